"""The delta phase of a fetch: what a reader that holds an older version of the model can
make of it before the ordinary fetch runs (see :mod:`tensorhub.protocol.delta`).

:func:`fetch_deltas` runs after the plan is known and before the chunks are fetched
(:mod:`.fetching`).  With ``PeerConfig.delta`` on and a complete older version of the
same model (and shard) held here -- published, fetched or a retained host copy -- it

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
chunks (:func:`~tensorhub.protocol.delta.delta_pays`: the holder's measured encode rate
and our apply rate against the link rate measured by the last fetch from it, or before
any the NIC labels), checked again after every chunk.  Costs go to the fetch report
(``delta_*``) and to ``statistics().delta``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ..errors import LocalProtocolError, RemoteProtocolError, TransportError
from ..manifest.digests import digest_of
from ..manifest.manifest import Manifest
from ..model import PeerInfo, VersionKey
from ..protocol.dataplane import OK, DeltaReply
from ..protocol.delta import (
    DEFAULT_ENCODE_BPS,
    MAX_DELTA_OVERHEAD,
    RAW,
    DeltaTally,
    apply_chunk,
    delta_format,
    delta_pays,
    pick_sources,
    unchanged_chunks,
)
from ..protocol.topology import NodeInfo
from ..transport.deltas import delta_run
from .fetch_report import FetchReport
from .store import LocalVersion

if TYPE_CHECKING:
    from .fetcher import Fetch
    from .node import Peer

Plan = Sequence[tuple[PeerInfo, int, int]]


@dataclass
class DeltaBook:
    """A peer's memory for delta decisions, and its totals for ``statistics().delta``."""

    links: dict[str, float] = field(default_factory=dict)
    """Bytes/s measured on full streams from each source (the last fetch from it)."""
    encode: dict[str, float] = field(default_factory=dict)
    """Chunk bytes/s each source encoded, as it said (the last delta chunk)."""
    apply_bps: float | None = None
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("fetches_with_delta", "delta_bytes", "delta_chunk_bytes", "delta_chunks",
         "unchanged_chunks", "encode_seconds", "apply_seconds", "fallbacks"), 0.0))


_books: weakref.WeakKeyDictionary[Peer, DeltaBook] = weakref.WeakKeyDictionary()


def book(peer: Peer) -> DeltaBook:
    found = _books.get(peer)
    if found is None:
        found = _books[peer] = DeltaBook()
    return found


def known_rates(peer: Peer) -> Mapping[str, float]:
    """The link rates (bytes a second) earlier fetches measured per source: the
    delta choice weighs them, and a new fetch's windows start from them."""
    return book(peer).links


def remember_links(peer: Peer, job: Fetch) -> None:
    """Keep the link rates a finished fetch measured per source."""
    links = book(peer).links
    for name, window in job.session.windows.items():
        rate = window.rate
        if rate is not None and rate > 0:
            links[name] = rate


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


def _base_of(peer: Peer, key: VersionKey) -> VersionKey | None:
    """The newest complete older version of ``key``'s model (same shard) held here."""
    older = [k for k, v in peer.store.versions.items()
             if k.model == key.model and k.shard == key.shard and k.layout == key.layout
             and k.version < key.version and v.complete and not v.hidden]
    return max(older, key=lambda k: k.version, default=None)


def _candidates(peer: Peer, key: VersionKey, base: VersionKey,
                allowed: frozenset[str] | None, plan: Plan) -> list[PeerInfo]:
    """Holders of the base, complete, that hold (or, planned, will hold) ``key``; not
    us, not banned, not on this host; best first (same DC, not the publisher)."""
    holding_new = {p.name: h for p, h in peer.control.holders(key)}
    planned = {p.name for p, _, _ in plan}
    host, dc = peer.info.label("host"), peer.info.label("dc")
    found = [p for p, h in peer.control.holders(base)
             if h.complete and (p.name in holding_new or p.name in planned)
             and p.name != peer.info.name and peer.banned(p.name) is None
             and (allowed is None or p.name in allowed)
             and (host is None or p.label("host") != host)]
    return sorted(found, key=lambda p: (
        p.label("dc") != dc, (h := holding_new.get(p.name)) is not None
        and h.publisher == p.name, p.name))


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


async def fetch_deltas(peer: Peer, local: LocalVersion, plan: Plan,
                       allowed: frozenset[str] | None, progress: Callable[[], None]
                       ) -> tuple[DeltaTally, float]:
    """The delta phase (see the module docstring): its tally and how long it took."""
    tally, started = DeltaTally(), trio.current_time()
    mode, key, m = peer.config.delta, local.manifest.key, local.manifest
    if mode == "off":
        tally.note = "off (PeerConfig.delta)"
        return tally, 0.0
    if local.landing is not None:
        tally.note = "off: the version lands through a staging ring"
        return tally, 0.0
    base_key = _base_of(peer, key)
    if base_key is None:
        tally.note = "no older version of this model held here"
        return tally, 0.0
    with peer.store.hold(base_key) as base:
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
        cands = _candidates(peer, key, base_key, allowed, plan)
        planned = {c: p.name for p, first, stop in plan for c in range(first, stop)}
        by_source = pick_sources(changed, planned, [p.name for p in cands], bool(plan))
        infos = {p.name: p for p in cands}
        notes = []
        async with trio.open_nursery() as nursery:
            for name, chunks in by_source.items():
                if not _pays(peer, mode, infos[name], tally):
                    continue
                notes.append(f"{len(chunks)} chunks from {name}")
                nursery.start_soon(_from_source, peer, base, local, infos[name], chunks,
                                   tally, progress)
        left = len(changed) - tally.delta_chunks
        tally.note = (f"against v{base_key.version}: {len(copied)} unchanged, "
                      + (", ".join(notes) or "no delta source")
                      + (f"; {left} chunks in full" if left else ""))
    seconds = trio.current_time() - started
    totals = book(peer).totals
    totals["fetches_with_delta"] += 1
    totals["delta_bytes"] += tally.delta_bytes
    totals["delta_chunk_bytes"] += tally.chunk_bytes
    totals["delta_chunks"] += tally.delta_chunks
    totals["unchanged_chunks"] += tally.unchanged_chunks
    totals["encode_seconds"] += tally.encode_seconds
    totals["apply_seconds"] += tally.apply_seconds
    totals["fallbacks"] += len(tally.failed)
    return tally, seconds


RATE_GAIN = 0.3
"""Weight of a new encode or apply rate sample (one chunk's CPU time is noisy)."""


def _smooth(old: float | None, sample: float) -> float:
    return sample if old is None else old + (sample - old) * RATE_GAIN


def _link_bps(peer: Peer, source: PeerInfo) -> float:
    """Bytes/s from ``source`` as measured by the last fetch from it, else as the two
    NIC labels say (``nic_bps``, or ``PeerConfig.nic_bps``): the planner's numbers."""
    measured = book(peer).links.get(source.name)
    if measured is not None:
        return measured
    try:
        ours, theirs = (NodeInfo.from_peer(p, peer.config.nic_bps)
                        for p in (peer.info, source))
    except LocalProtocolError:  # a malformed label: as if unlabelled
        return peer.config.nic_bps
    return min(ours.down_bps, theirs.up_bps)


def _pays(peer: Peer, mode: str, source: PeerInfo, tally: DeltaTally) -> bool:
    """Whether ``source`` is to be asked for deltas now (``auto``: by the rates)."""
    if mode == "always":
        return True
    b, name = book(peer), source.name
    link, encode = _link_bps(peer, source), b.encode.get(name, DEFAULT_ENCODE_BPS)
    if delta_pays(link, encode, b.apply_bps):
        return True
    apply = "?" if b.apply_bps is None else f"{b.apply_bps / 1e6:.0f}"
    how = "measured" if name in b.links else "from the NIC labels"
    tally.skipped[name] = (f"link {link / 1e6:.0f} MB/s ({how}) is faster than "
                           f"encoding {encode / 1e6:.0f} / applying {apply} MB/s")
    return False


async def _from_source(peer: Peer, base: LocalVersion, local: LocalVersion,
                       source: PeerInfo, chunks: list[int], tally: DeltaTally,
                       progress: Callable[[], None]) -> None:
    """Deltas of ``chunks`` from ``source``, applied as they come (one chunk applied
    while the next arrives); the first failure ends the stream."""
    name, key, m = source.name, local.manifest.key, local.manifest
    b = book(peer)
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
                why, cpu = await trio.to_thread.run_sync(_apply, base, local, chunk, payload)
                tally.apply_seconds += cpu
                if why.startswith("local"):  # that chunk in full; the holder is fine
                    tally.failed.setdefault(name, why)
                    continue
                if why:
                    tally.failed[name] = why
                    peer.ban(name, key, why)
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
                tally.bytes_by_source[name] = tally.bytes_by_source.get(name, 0) + len(payload)
                tally.chunk_bytes += size
                encode = reply.encode_us / 1e6
                tally.encode_seconds += encode
                if encode > 0:
                    b.encode[name] = _smooth(b.encode.get(name), size / encode)
                if cpu > 0:
                    b.apply_bps = _smooth(b.apply_bps, size / cpu)
                if not _pays(peer, peer.config.delta, source, tally):
                    nursery.cancel_scope.cancel()
                    return

    async def receiver() -> None:
        async with send:
            try:
                await delta_run(source.data, name, peer.config.connect_timeout,
                                peer.data_plane().data_auth, key, base.manifest.key.version,
                                chunks, limit, handle)
            except RemoteProtocolError as exc:
                tally.failed[name] = f"remote_protocol: {exc}"
                nursery.cancel_scope.cancel()
            except (TransportError, OSError) as exc:
                tally.failed[name] = f"transport: {exc}"

    # A holder still receiving answers each chunk when it lands: no chunk for
    # ``stall_timeout`` (the wait a holder allows itself) ends the stream as stalled.
    stall = peer.config.stall_timeout + peer.config.connect_timeout
    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.deadline = trio.current_time() + stall
        nursery.start_soon(applier)
        nursery.start_soon(receiver)
    if nursery.cancel_scope.cancelled_caught and name not in tally.failed \
            and name not in tally.skipped:
        tally.failed[name] = f"stalled: no chunk for {stall:.1f} s"
