"""The delta phase of a fetch: what a reader that holds an older version of the model can
make of it before the ordinary fetch runs (see :mod:`tensorhub.protocol.delta`).

:meth:`Deltas.run` runs after the plan is known and before the chunks are fetched
(:class:`~tensorhub.read.reader.Reader`).  With ``PeerConfig.delta`` on and a complete
older version of the same model (and shard) held here -- published, fetched or a
retained host copy -- it

1. copies every chunk whose digest is the same in both manifests from that base, and
   checks it against the new digest (nothing is sent);
2. asks for the other chunks as deltas: from each chunk's planned source when there is a
   plan (a remote DC's seed pulls deltas across, its DC's fan-out asks the seed), else
   from a holder of both versions (not on this host: a same-host copy beats any delta);
   only holders that advertise the base complete are asked;
3. applies each delta to its copy of the base in a worker thread and checks the result
   against the new digest before a byte of it is written to the destination.

Whatever did not land verified -- a holder without the base, a delta that fails its
digest (the holder is banned, as for bad full bytes), a broken connection -- stays
pending and the ordinary fetch brings it in full from another holder.  With
``delta="auto"`` a source is asked for deltas only where that is faster than full
chunks (:func:`~tensorhub.protocol.reading.delta_skip`: the holder's measured encode
rate and our apply rate against the link rate measured by the last fetch from it, or
before any the NIC labels), checked again after every chunk.  Which base, which
sources and whether a source pays are decided in :mod:`tensorhub.protocol.reading`.
Costs go to the fetch report (``delta_*``) and to ``statistics().delta``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from ..config import PeerConfig
from ..errors import RemoteProtocolError, TransportError
from ..manifest.digests import digest_of
from ..manifest.manifest import Manifest
from ..model import PeerInfo
from ..protocol.dataplane import OK, DeltaReply
from ..protocol.delta import (
    MAX_DELTA_OVERHEAD,
    RAW,
    DeltaTally,
    apply_chunk,
    delta_format,
    pick_sources,
    unchanged_chunks,
)
from ..protocol.reading import Plan, delta_base, delta_skip, delta_sources, link_estimate
from ..transport.deltas import delta_run
from .links import LinkMemory
from .ports import Ports
from .report import FetchReport
from .store import LocalVersion, Store

TOTALS = ("fetches_with_delta", "delta_bytes", "delta_chunk_bytes", "delta_chunks",
          "unchanged_chunks", "encode_seconds", "apply_seconds", "fallbacks")
"""The delta phase's totals (``statistics().delta``)."""


def add_to_report(report: FetchReport, tally: DeltaTally, seconds: float) -> None:
    """Put the delta phase (``seconds`` long) in the fetch's report."""
    report.delta = tally.to_dict()
    report.delta_bytes = tally.delta_bytes
    report.delta_chunks = tally.delta_chunks
    report.unchanged_chunks = tally.unchanged_chunks
    report.delta_encode_seconds = tally.encode_seconds
    report.delta_apply_seconds = tally.apply_seconds
    report.seconds += seconds
    if report.chunks == 0:  # all came as deltas or copies
        report.transfer_seconds = seconds
    else:
        report.transfer_seconds += seconds
        report.first_byte_seconds += seconds
    for name, why in tally.failed.items():
        if why.startswith("integrity"):
            report.integrity_failures[name] = report.integrity_failures.get(name, 0) + 1


def _sizes(m: Manifest) -> list[int]:
    return [stop - first for first, stop in map(m.chunk_range, range(m.num_chunks))]


def _scatter(dest: Sequence[Any], data: memoryview) -> None:
    at = 0
    for d in dest:
        view = memoryview(d).cast("B")
        view[:] = data[at:at + len(view)]
        at += len(view)


def _joined(segments: Sequence[memoryview]) -> memoryview:
    """A chunk's bytes as one buffer: its one segment as is (most chunks lie in one
    tensor), or a copy of its segments joined."""
    if len(segments) == 1:
        return memoryview(segments[0]).cast("B")
    return memoryview(b"".join(segments))


def _copy_unchanged(base: LocalVersion, local: LocalVersion, chunks: Sequence[int]
                    ) -> tuple[list[int], float]:
    """Copy ``chunks`` from the base where they check out; (those, CPU seconds)."""
    began = time.thread_time()
    m, done = local.manifest, []
    for c in chunks:
        data = _joined(base.segments(c))
        if digest_of(m.digest_algo, [data]) == m.chunk_digests[c]:
            _scatter(local.segments(c), data)
            done.append(c)
    return done, time.thread_time() - began


def _apply(base: LocalVersion, local: LocalVersion, chunk: int, payload: bytes
           ) -> tuple[str, float]:
    """Apply, check, then write chunk ``chunk``: ("" or why it failed, CPU seconds).
    A failure is the holder's (``integrity: ...``) unless our own copy of the base chunk
    no longer matches its digest (``local: ...``)."""
    began = time.thread_time()
    m, bm = local.manifest, base.manifest
    old = _joined(base.segments(chunk))
    try:
        data = apply_chunk(old, payload).data
        why = "" if digest_of(m.digest_algo, [data]) == m.chunk_digests[chunk] else \
            f"integrity: chunk {chunk} of {m.key} made from a delta failed its digest"
    except RemoteProtocolError as exc:
        why = f"integrity: {exc}"
    if why and digest_of(bm.digest_algo, [memoryview(old)]) != bm.chunk_digests[chunk]:
        why = f"local: our copy of chunk {chunk} of {bm.key} no longer matches its digest"
    if not why:
        _scatter(local.segments(chunk), data)
    return why, time.thread_time() - began


class Deltas:
    """The delta phase of this peer's fetches, and its totals (see the module text)."""

    def __init__(self, me: PeerInfo, config: PeerConfig, store: Store, links: LinkMemory,
                 ports: Ports) -> None:
        self.me, self.config, self.store, self.links, self.ports = \
            me, config, store, links, ports
        self.totals: dict[str, float] = dict.fromkeys(TOTALS, 0.0)

    async def run(self, local: LocalVersion, plan: Plan, allowed: frozenset[str] | None,
                  progress: Callable[[], None]) -> tuple[DeltaTally, float]:
        """The delta phase of the fetch filling ``local``: its tally and how long it
        took."""
        tally, started = DeltaTally(), trio.current_time()
        mode, key, m = self.config.delta, local.manifest.key, local.manifest
        if mode == "off":
            tally.note = "off (PeerConfig.delta)"
            return tally, 0.0
        if local.landing is not None:
            tally.note = "off: the version lands through a staging ring"
            return tally, 0.0
        base_key = delta_base((k for k, v in self.store.versions.items()
                               if v.complete and not v.hidden), key)
        if base_key is None:
            tally.note = "no older version of this model held here"
            return tally, 0.0
        with self.store.hold(base_key) as base:
            if base is None:
                tally.note = f"{base_key} is no longer held complete"
                return tally, 0.0
            tally.base = base_key.version
            bm = base.manifest
            sizes, base_sizes = _sizes(m), _sizes(bm)
            same = unchanged_chunks(bm.chunk_digests, m.chunk_digests, base_sizes, sizes) \
                if bm.digest_algo == m.digest_algo else [False] * m.num_chunks
            todo = [c for c in range(m.num_chunks) if not local.verified[c]]
            copied, cpu = await trio.to_thread.run_sync(
                _copy_unchanged, base, local, [c for c in todo if same[c]])
            for c in copied:
                local.mark_verified(c)
            tally.unchanged_chunks, tally.apply_seconds = len(copied), cpu
            if copied:
                progress()
            changed = [c for c in todo if not local.verified[c]
                       and c < bm.num_chunks and base_sizes[c] == sizes[c]]
            cands = delta_sources(self.me, self.ports.holders(base_key),
                                  self.ports.holders(key), plan, self.ports.banned, allowed)
            planned = {c: p.name for p, first, stop in plan for c in range(first, stop)}
            by_source = pick_sources(changed, planned, [p.name for p in cands], bool(plan))
            infos = {p.name: p for p in cands}
            notes = []
            async with trio.open_nursery() as nursery:
                for name, chunks in by_source.items():
                    if not self._pays(infos[name], tally):
                        continue
                    notes.append(f"{len(chunks)} chunks from {name}")
                    nursery.start_soon(self._from_source, base, local, infos[name], chunks,
                                       tally, progress)
            left = len(changed) - tally.delta_chunks
            tally.note = (f"against v{base_key.version}: {len(copied)} unchanged, "
                          + (", ".join(notes) or "no delta source")
                          + (f"; {left} chunks in full" if left else ""))
        seconds = trio.current_time() - started
        totals = self.totals
        totals["fetches_with_delta"] += 1
        totals["delta_bytes"] += tally.delta_bytes
        totals["delta_chunk_bytes"] += tally.chunk_bytes
        totals["delta_chunks"] += tally.delta_chunks
        totals["unchanged_chunks"] += tally.unchanged_chunks
        totals["encode_seconds"] += tally.encode_seconds
        totals["apply_seconds"] += tally.apply_seconds
        totals["fallbacks"] += len(tally.failed)
        return tally, seconds

    def link_bps(self, source: PeerInfo) -> float:
        """Bytes/s from ``source`` as the delta choice sees it."""
        return link_estimate(self.links.rates.get(source.name), self.me, source,
                             self.config.nic_bps)

    def _pays(self, source: PeerInfo, tally: DeltaTally) -> bool:
        """Whether ``source`` is to be asked for deltas now; if not, why goes to
        ``tally.skipped``."""
        name = source.name
        why = delta_skip(self.config.delta, self.link_bps(source), name in self.links.rates,
                         self.links.encode.get(name), self.links.apply_bps)
        if why is not None:
            tally.skipped[name] = why
        return why is None

    async def _from_source(self, base: LocalVersion, local: LocalVersion,
                           source: PeerInfo, chunks: list[int], tally: DeltaTally,
                           progress: Callable[[], None]) -> None:
        """Deltas of ``chunks`` from ``source``, applied as they come (one chunk applied
        while the next arrives); the first failure ends the stream."""
        name, key, m = source.name, local.manifest.key, local.manifest
        send, receive = trio.open_memory_channel[tuple[int, DeltaReply, bytes]](2)

        def limit(c: int) -> int:
            first, stop = m.chunk_range(c)
            return stop - first + MAX_DELTA_OVERHEAD

        async def handle(chunk: int, reply: DeltaReply, payload: bytes) -> bool:
            if reply.status != OK:  # it lacks a version, or the chunk in time: all in full
                tally.failed[name] = f"status {reply.status}: {reply.detail}"
                nursery.cancel_scope.cancel()
                return False
            await send.send((chunk, reply, payload))
            return True

        async def applier() -> None:
            async with receive:
                async for chunk, reply, payload in receive:
                    why, cpu = await trio.to_thread.run_sync(_apply, base, local, chunk,
                                                             payload)
                    tally.apply_seconds += cpu
                    if why.startswith("local"):  # that chunk in full; the holder is fine
                        tally.failed.setdefault(name, why)
                        continue
                    if why:
                        tally.failed[name] = why
                        self.ports.ban(name, key, why)
                        nursery.cancel_scope.cancel()
                        return
                    size = sum(map(len, local.segments(chunk)))
                    local.mark_verified(chunk)
                    progress()
                    nursery.cancel_scope.deadline = trio.current_time() + stall
                    kind = delta_format(payload)
                    tally.formats[kind] = tally.formats.get(kind, 0) + 1
                    tally.raw_chunks += payload[0] == RAW
                    tally.delta_chunks += 1
                    tally.delta_bytes += len(payload)
                    tally.bytes_by_source[name] = \
                        tally.bytes_by_source.get(name, 0) + len(payload)
                    tally.chunk_bytes += size
                    encode = reply.encode_us / 1e6
                    tally.encode_seconds += encode
                    self.links.encoded(name, size, encode)
                    self.links.applied(size, cpu)
                    if not self._pays(source, tally):
                        nursery.cancel_scope.cancel()
                        return

        async def receiver() -> None:
            async with send:
                try:
                    await delta_run(source.data, name, self.config.connect_timeout,
                                    self.ports.data_auth(), key, base.manifest.key.version,
                                    chunks, limit, handle)
                except RemoteProtocolError as exc:
                    tally.failed[name] = f"remote_protocol: {exc}"
                    nursery.cancel_scope.cancel()
                except (TransportError, OSError) as exc:
                    tally.failed[name] = f"transport: {exc}"

        # A holder still receiving answers each chunk when it lands: no chunk for
        # ``stall_timeout`` (the wait a holder allows itself) ends the stream as stalled.
        stall = self.config.stall_timeout + self.config.connect_timeout
        async with trio.open_nursery() as nursery:
            nursery.cancel_scope.deadline = trio.current_time() + stall
            nursery.start_soon(applier)
            nursery.start_soon(receiver)
        if nursery.cancel_scope.cancelled_caught and name not in tally.failed \
                and name not in tally.skipped:
            tally.failed[name] = f"stalled: no chunk for {stall:.1f} s"
