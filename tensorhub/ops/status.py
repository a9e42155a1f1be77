"""``tensorhub status``: gather a mesh's state as one member sees it, and draw it.

:func:`gather` joins what gossip says (members, incarnations, who holds which chunks,
the links between DCs its members measured: :func:`wan_rows`) with what each member
answers to a status query (bytes held, fetches in flight with
the bytes from each source); :class:`Rates` turns two gathers into per-link rates; and
:func:`render` draws a report with rich (the ``ops`` extra, imported when drawing).
A member's *staleness* for a model is how many sealed versions are newer than the
newest one it holds complete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ..peer.node import Peer

MB = 1e6


async def gather(peer: Peer, timeout: float) -> dict[str, Any]:
    """The mesh as ``peer`` sees it, plus the members' answers within ``timeout``."""
    replies = await peer.status_desk.ask_all(timeout)
    me = peer.info.name
    members: dict[str, dict[str, Any]] = {}
    health: dict[str, int] = {}
    for name, state in peer.control.membership.members().items():
        if name == me:
            continue
        health[state.status] = health.get(state.status, 0) + 1
        r = replies.get(name)
        members[name] = {"state": state.status, "incarnation": state.incarnation,
                         "labels": dict(state.info.labels), "control": state.info.control,
                         "data": state.info.data, "answered": r is not None}
        if r is not None:
            members[name].update(fetched=r.bytes_fetched, served=r.bytes_served,
                                 fetches=r.fetches, suspicions=r.suspicions,
                                 integrity_failures=r.integrity_failures)
    nbytes = {(h.model, h.version, h.shard): h.nbytes
              for r in replies.values() for h in r.held}
    versions: dict[str, dict[str, Any]] = {}
    newest: dict[tuple[str, str], int] = {}
    for entry in peer.control.refs.origins():
        for h in entry.holdings:
            v = versions.setdefault(str(h.key), {"holders": {}, "bytes": None})
            size = nbytes.get((h.model, h.version, h.shard))
            v["bytes"] = size if size is not None else v["bytes"]
            v["holders"][entry.origin] = {
                "chunks": f"{h.count()}/{h.num_chunks}", "complete": h.complete,
                "publisher": h.publisher}
            if h.complete:
                key = (entry.origin, h.model)
                newest[key] = max(newest.get(key, -1), h.version)
    staleness = []
    for (name, model), held in sorted(newest.items()):
        sealed = peer.control.readable(model)
        staleness.append({"member": name, "model": model, "holds": held,
                          "latest": peer.control.latest(model),
                          "behind": sum(1 for v in sealed if v > held)})
    links = [{"dest": r.name, "source": link.source, "model": link.model,
              "version": link.version, "transport": link.transport, "bytes": link.nbytes,
              "total": link.total}
             for r in replies.values() for link in r.links]
    return {"members": members, "health": health, "versions": versions, "links": links,
            "staleness": staleness, "wan": peer.control.wan.table(),
            "time": trio.current_time()}


class Rates:
    """Per-link rates from successive reports: bytes since the last one over the time."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str, str, int], tuple[float, int]] = {}

    def add(self, report: dict[str, Any]) -> None:
        """Set ``rate`` (bytes/s, None the first time a link is seen) on each link."""
        now, seen = report["time"], {}
        for link in report["links"]:
            key = (link["dest"], link["source"], link["model"], link["version"])
            before = self._last.get(key)
            link["rate"] = None if before is None or now <= before[0] else \
                (link["bytes"] - before[1]) / (now - before[0])
            seen[key] = (now, link["bytes"])
        self._last = seen


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


WAN_COLUMNS = ("from", "to", "Mbit", "rtt ms", "how", "reporters")


def wan_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """The WAN table of a report: one row per known DC link (:data:`WAN_COLUMNS`)."""
    return [(w["from"], w["to"], f"{w['mbit']:g}", f"{w['rtt_ms']:g}", w["how"],
             str(w["reporters"]) if w["how"] == "measured" else "-")
            for w in report.get("wan", ())]


def render(report: dict[str, Any]) -> Any:
    """The report as a rich renderable (members, versions, transfers, staleness, WAN)."""
    from rich.console import Group
    from rich.table import Table

    health = report["health"]
    members = Table(title="members  " + "  ".join(
        f"{state} {health.get(state, 0)}" for state in ("alive", "suspect", "dead", "left")),
        title_justify="left")
    for col in ("member", "state", "incarnation", "fetched", "served", "suspicions",
                "labels"):
        members.add_column(col)
    for name, m in sorted(report["members"].items()):
        members.add_row(name, m["state"], str(m["incarnation"]), _size(m.get("fetched")),
                        _size(m.get("served")), str(m.get("suspicions", "?")),
                        ",".join(f"{k}={v}" for k, v in m["labels"].items()))
    versions = Table(title="versions", title_justify="left")
    for col in ("version", "bytes", "holders (chunks verified)"):
        versions.add_column(col)
    for key, v in sorted(report["versions"].items()):
        versions.add_row(key, _size(v["bytes"]), ", ".join(
            f"{n} ({h['chunks']})" for n, h in sorted(v["holders"].items())))
    links = Table(title="transfers in flight", title_justify="left")
    for col in ("to", "from", "version", "transport", "received", "rate"):
        links.add_column(col)
    for link in report["links"]:
        rate = link.get("rate")
        links.add_row(link["dest"], link["source"], f"{link['model']}@{link['version']}",
                      link["transport"], f"{_size(link['bytes'])} / {_size(link['total'])}",
                      "-" if rate is None else f"{rate / MB:.1f} MB/s")
    # "behind": sealed versions newer than the newest one held complete (a short title:
    # rich wraps a title at the table's width)
    stale = Table(title="staleness (sealed versions behind)", title_justify="left")
    for col in ("member", "model", "holds", "latest", "behind"):
        stale.add_column(col)
    for s in report["staleness"]:
        stale.add_row(s["member"], s["model"], str(s["holds"]), str(s["latest"]),
                      str(s["behind"]))
    wan = Table(title="links between DCs", title_justify="left")
    for col in WAN_COLUMNS:
        wan.add_column(col)
    for row in wan_rows(report):
        wan.add_row(*row)
    return Group(members, versions, links, stale, wan)


async def watch(peer: Peer, interval: float, count: int | None, timeout: float) -> None:
    """Redraw the mesh every ``interval`` seconds (``count`` times, or until
    interrupted) on the terminal, in place; on a pipe each drawing is printed."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    rates = Rates()
    drawn = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while count is None or drawn < count:
            report = await gather(peer, timeout)
            rates.add(report)
            live.update(render(report), refresh=True)
            drawn += 1
            if count is None or drawn < count:
                await trio.sleep(interval)
    console.line()
