"""Prometheus metrics of one peer (``tensorhub peer --metrics-port PORT``).

The HTTP server is prometheus-client's own (a thread); each scrape reads the peer's
state inside its trio loop (``trio.from_thread.run_sync``), so a scrape sees one
consistent snapshot and the peer's state is only ever touched by its own thread.
prometheus-client is imported here only: it is the ``ops`` extra.

Fetch stage timings come from the reports of finished fetches: the whole fetch
(``stage="fetch"``) and every ``*_seconds`` figure a report carries (``plan`` only for
fetches that asked for a plan), summed per stage with a count, so a rate of sum over
count gives the mean.  ``stage="switch"`` is the rollouts' swaps and ``stage="cast"``
the casts of ``fetch(cast=...)``, which both happen after their fetch's report was
taken: counted from ``statistics().switches`` and ``statistics().casts``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from ..errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from ..peer.node import Peer

INSTALL = "needs the ops extra: pip install 'tensorhub[ops]' (rich, prometheus-client)"


def require(module: str) -> Any:
    """Import ``module`` of the ``ops`` extra, or say how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{module} is not installed: this command {INSTALL}") from None


class StageTimes:
    """Seconds per fetch stage summed over finished fetches (reports are kept by the
    peer for the last 64 fetches only: each scrape adds those it has not seen)."""

    def __init__(self) -> None:
        self.seen = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def update(self, fetches: int, reports: tuple[dict[str, Any], ...],
               switches: tuple[int, float] = (0, 0.0),
               casts: tuple[int, float] = (0, 0.0)) -> None:
        """Add the reports not seen yet; ``switches`` and ``casts``: the swaps and the
        casts so far and their seconds (totals, not increments)."""
        new = min(fetches - self.seen, len(reports))
        self.seen = fetches
        for report in reports[len(reports) - new:] if new > 0 else ():
            stages = {"fetch": report.get("seconds", 0.0)}
            stages.update({k[:-len("_seconds")]: v for k, v in report.items()
                           if k.endswith("_seconds") and isinstance(v, int | float)})
            stages.pop("cast", None)  # taken after the report: counted from casts
            for stage, seconds in stages.items():
                self.sums[stage] = self.sums.get(stage, 0.0) + float(seconds)
                self.counts[stage] = self.counts.get(stage, 0) + 1
        if switches[0]:
            self.counts["switch"], self.sums["switch"] = switches
        if casts[0]:
            self.counts["cast"], self.sums["cast"] = casts


def families(peer: Peer, stages: StageTimes) -> list[Any]:
    """The metric families of ``peer`` now (call in the peer's trio thread)."""
    core = require("prometheus_client.core")
    counter, gauge = core.CounterMetricFamily, core.GaugeMetricFamily
    st = peer.statistics()
    ms = peer.control.membership.statistics()
    stages.update(st.fetches, st.reports, (st.switches, st.switch_seconds),
                  (st.casts, st.cast_seconds))

    def labelled(kind: Any, name: str, doc: str, label: str,
                 values: dict[str, int] | dict[str, float]) -> Any:
        fam = kind(name, doc, labels=[label])
        for key, value in sorted(values.items()):
            fam.add_metric([key], value)
        return fam

    by_state: dict[str, int] = {}
    for state in st.members.values():
        by_state[state] = by_state.get(state, 0) + 1
    held = [v for v in peer.store.versions.values() if not v.hidden]
    stage_sum = labelled(counter, "tensorhub_fetch_stage_seconds",
                         "Seconds spent per fetch stage, over finished fetches", "stage",
                         stages.sums)
    stage_count = labelled(counter, "tensorhub_fetch_stage",
                           "Finished fetches that timed each stage", "stage",
                           stages.counts)
    return [
        labelled(counter, "tensorhub_fetched_bytes_by_transport",
                 "Bytes fetched, by transport", "transport", st.bytes_by_transport),
        labelled(counter, "tensorhub_fetched_bytes_by_source",
                 "Bytes fetched, by source peer", "source", st.bytes_fetched_by_source),
        counter("tensorhub_served_bytes", "Bytes served to readers", value=st.bytes_served),
        counter("tensorhub_fetches", "Fetches finished", value=st.fetches),
        stage_sum, stage_count,
        labelled(counter, "tensorhub_integrity_failures",
                 "Chunks that failed their digest, by source", "source",
                 st.integrity_failures),
        counter("tensorhub_suspicions", "Members this peer suspected", value=ms.suspicions),
        counter("tensorhub_gossip_dropped", "Control messages dropped (queues full)",
                value=st.gossip_dropped),
        counter("tensorhub_malformed_dropped", "Malformed control messages dropped",
                value=st.malformed_dropped),
        labelled(gauge, "tensorhub_gossip_queue_depth", "Messages waiting, by queue",
                 "queue", {"broadcast": ms.broadcast_queue, "inbound": st.control_waiting}),
        labelled(gauge, "tensorhub_members", "Members in this peer's view, by state",
                 "state", by_state),
        gauge("tensorhub_versions_held", "Versions (shards) held here", value=len(held)),
        gauge("tensorhub_held_bytes", "Bytes of the versions held here",
              value=sum(v.manifest.total_bytes for v in held)),
        gauge("tensorhub_fetches_in_flight", "Fetches running", value=st.fetches_in_flight),
    ]


def _collector(peer: Peer, token: trio.lowlevel.TrioToken) -> Collector:
    stages = StageTimes()

    class PeerCollector:
        def collect(self) -> Iterator[Any]:
            try:
                yield from trio.from_thread.run_sync(families, peer, stages,
                                                     trio_token=token)
            except trio.RunFinishedError:  # the peer is gone: nothing to report
                return

    return PeerCollector()


@asynccontextmanager
async def serve_metrics(peer: Peer, port: int, host: str = "127.0.0.1"
                        ) -> AsyncIterator[int]:
    """Serve ``peer``'s metrics at ``http://host:port/metrics`` while the block runs;
    yields the port (``port`` 0: one the system picked).  The server is stopped from a
    worker thread: a scrape in progress waits for this loop, which must keep running."""
    client = require("prometheus_client")
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(_collector(peer, trio.lowlevel.current_trio_token()))
    try:
        server, thread = client.start_http_server(port, host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: cannot listen on {host}: {exc}") from None
    try:
        yield int(server.server_address[1])
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)
        server.server_close()
        thread.join()
