"""One fetch: pull every chunk of a version from holders, verify it, land it in place.

A bounded window of workers (``PeerConfig.fetch_window``) each take the lowest
unverified, unclaimed chunk and the best holder that has it: a holder other than the
original publisher first, then the one we are reading least from.  Chunks land with
``recv_into`` straight in the destination arrays and are checked against the manifest
digest in a worker thread before they count; a verified chunk is served to others at
once (partial-prefix serving) and never fetched again.  A holder that refuses or sends
bad bytes is dropped for this fetch and its chunk goes to another; one that sent bytes
failing their digest is also banned by the peer (``banned`` / ``on_bad_bytes``), so
later fetches skip it too.  A holder whose connection fails is retried after a backoff.

Stalls.  A read that takes longer than its source's limit (:class:`~tensorhub.protocol.
pace.Pace`: from the source's measured pace, never under a floor that holds on a loaded
host) is a stall.  The stalled source gets twice as long next time; its chunks go to
another holder that has them, and only when there is none is the same source asked
again at once: a slow but live sole source is never dropped.  What ends a fetch is a
real timeout: no chunk landed for ``stall_timeout``.  Then, or when no holder is left for
some chunk, the fetch raises :class:`VersionUnavailable` naming what is missing.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from ..errors import (
    IntegrityError,
    RemoteProtocolError,
    TransportError,
    VersionUnavailable,
)
from ..manifest import digest_of
from ..model import PeerInfo, VersionKey
from ..protocol.bans import Ban
from ..protocol.dataplane import NOT_YET
from ..protocol.pace import Pace
from ..protocol.refs import Holding
from ..transport.base import Connection, NotServing
from .store import LocalVersion

RELAY_DEPTH = 1
"""Requests in flight to one planned parent.  One: chunks arrive in order, one after the
other, and each level of a tree lags its parent by one chunk-time.  Measured in the
8-host emulated cluster (256 MiB, 4 MiB chunks): 1 gave 1.16x the fluid bound, 2 gave
1.28x (two chunks share our link, so every level lags by two)."""

HolderView = Callable[[VersionKey], list[tuple[PeerInfo, Holding]]]
Connector = Callable[[PeerInfo], Awaitable[Connection]]
Releaser = Callable[[Connection], Awaitable[None]]
"""Takes a connection the fetch is done with (closes it, or keeps it for a later read)."""
BanCheck = Callable[[str], Ban | None]
"""Holder name -> the peer's ban on it now (until when, and why), or None."""
BadBytes = Callable[[str, VersionKey, str], None]
RETRY_BASE = 0.1
"""Seconds before a source whose connection failed is tried again; doubles with each
failure in a row, up to ``stall_timeout``."""


class Stalled(TransportError):
    """A read took longer than its source's stall limit."""
"""Told ``(holder, version, reason)`` when a holder's chunk failed its digest."""


@dataclass
class FetchReport:
    """What one fetch did: where its bytes came from and how long it took."""

    model: str
    version: int
    seconds: float = 0.0
    bytes: int = 0
    chunks: int = 0
    chunks_received: int = 0
    """Chunk payloads received in full (verified or not): equals ``chunks`` when no
    chunk had to be received twice."""
    reads: int = 0
    """Reads that landed chunks: one per chunk, except from a same-host holder that
    leased the whole version, read several neighbouring chunks at a time."""
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    transport_by_source: dict[str, str] = field(default_factory=dict)
    integrity_failures: dict[str, int] = field(default_factory=dict)
    dropped_sources: dict[str, str] = field(default_factory=dict)
    banned_sources: dict[str, str] = field(default_factory=dict)
    """Holders this fetch did not read from because the peer bans them (a chunk of
    theirs failed its digest, in this fetch or an earlier one), and why."""
    resourced_chunks: int = 0
    stall_retries: dict[str, int] = field(default_factory=dict)
    """Reads that stalled at a source no other holder could replace, and were asked of it
    again (with more time) rather than failing the fetch."""
    planned_bytes: int = 0
    """Bytes that came from the source the coordinator's plan named."""
    plan: str = ""
    """The plan followed: coordinator and epoch, or why there was none."""
    verified: bool = False
    cast: dict[str, str] = field(default_factory=dict)
    """Tensors cast after verification (``fetch(cast=...)``): name -> ``from->to``."""
    cast_seconds: float = 0.0
    served_arrays: bool = False
    """True when the fetch found the version already held here complete and returned
    the very arrays this peer serves it from (the caller's published arrays, or those of
    an earlier fetch), not a copy: writing to them changes what readers get.  Unpublish
    first, or fetch with ``into=``, to get arrays of one's own."""

    def add(self, other: FetchReport) -> None:
        """Count ``other`` (a part of the same fetch) in this report."""
        self.bytes += other.bytes
        self.chunks += other.chunks
        self.chunks_received += other.chunks_received
        self.reads += other.reads
        self.resourced_chunks += other.resourced_chunks
        for name, n in other.bytes_by_source.items():
            self.bytes_by_source[name] = self.bytes_by_source.get(name, 0) + n
        for name, n in other.integrity_failures.items():
            self.integrity_failures[name] = self.integrity_failures.get(name, 0) + n
        for name, n in other.stall_retries.items():
            self.stall_retries[name] = self.stall_retries.get(name, 0) + n
        self.transport_by_source.update(other.transport_by_source)
        self.dropped_sources.update(other.dropped_sources)
        self.banned_sources.update(other.banned_sources)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "version": self.version, "seconds": self.seconds,
            "bytes": self.bytes, "chunks": self.chunks, "mb_per_s": self.mb_per_s,
            "chunks_received": self.chunks_received, "reads": self.reads,
            "bytes_by_source": dict(self.bytes_by_source),
            "transport_by_source": dict(self.transport_by_source),
            "integrity_failures": dict(self.integrity_failures),
            "dropped_sources": dict(self.dropped_sources),
            "banned_sources": dict(self.banned_sources),
            "resourced_chunks": self.resourced_chunks, "verified": self.verified,
            "stall_retries": dict(self.stall_retries),
            "served_arrays": self.served_arrays,
            "cast": dict(self.cast), "cast_seconds": self.cast_seconds,
            "planned_bytes": self.planned_bytes, "plan": self.plan,
        }


@dataclass(frozen=True)
class Fetched:
    """The result of :meth:`Peer.fetch`: the version, its tensors and what it took."""

    version: int
    tensors: dict[str, np.ndarray[Any, Any]]
    report: FetchReport



def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error that ended a group of tasks, for callers that expect one exception
    (``except VersionUnavailable``): trio wraps whatever a nursery's tasks raise in a
    group.  The first leaf that is not a cancellation; the group itself if all are."""
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = list(exc.exceptions)
        elif not isinstance(exc, trio.Cancelled):
            return exc
    return group


class Fetch:
    """The state of one fetch; :meth:`run` drives it to completion or failure."""

    def __init__(self, *, me: str, local: LocalVersion, view: HolderView, connect: Connector,
                 upstream: frozenset[str], window: int, stall_timeout: float,
                 on_progress: Callable[[], None], banned: BanCheck, on_bad_bytes: BadBytes,
                 plan: Sequence[tuple[PeerInfo, int, int]] = (),
                 only: Sequence[int] | None = None, release: Releaser | None = None
                 ) -> None:
        """``only``, when given, limits the fetch to those chunks (a resharding fetch
        needs just the chunks that overlap its slices); ``release`` takes each
        connection a worker is done with (default: close it)."""
        self.me = me
        self.local = local
        self.manifest = local.manifest
        self.key = local.manifest.key
        self.view = view
        self.upstream = upstream
        """Named sources: asked for any chunk even before they advertise it."""
        self.planned: dict[int, PeerInfo] = {
            c: peer for peer, first, stop in plan for c in range(first, stop)}
        """The coordinator's plan: the source of each chunk while it stays usable; a
        planned source is asked even before it advertises the chunk (it pipelines)."""
        self.connect = connect
        self.release: Releaser = release or _close
        self.window = window
        self.stall_timeout = stall_timeout
        self.banned = banned
        self.on_bad_bytes = on_bad_bytes
        self.benched: dict[str, float] = {}
        """Sources not to use until the given time (``inf``: not for this fetch)."""
        self.last_progress = trio.current_time()
        self.pace = Pace(ceiling=stall_timeout)
        """Each source's measured pace, for stall limits that fit each link and load."""
        self.failures: dict[str, int] = {}
        """Connection failures in a row per source (the retry backoff)."""
        self.on_progress = on_progress
        wanted = range(self.manifest.num_chunks) if only is None else sorted(set(only))
        self.pending = [c for c in wanted if not local.verified[c]]
        self.wanted = len(wanted)
        self.claimed: dict[int, str] = {}
        self.load: dict[str, int] = {}
        self.dropped: dict[str, str] = {}
        self.lacks: dict[str, set[int]] = {}
        self.tried: set[int] = set()
        self.report = FetchReport(self.key.model, self.key.version)
        self.changed = trio.Event()

    def poke(self) -> None:
        """Gossip changed the holder view: wake workers waiting for a source."""
        self.lacks.clear()
        self._notify()

    def _notify(self) -> None:
        """Wake every waiting worker.  Only the notifier replaces the event, so a waiter
        can never be left on an event nobody will set."""
        self.changed.set()
        self.changed = trio.Event()

    def _usable(self, name: str) -> bool:
        if name == self.me or self.benched.get(name, 0.0) > trio.current_time():
            return False
        ban = self.banned(name)
        if ban is not None:  # benched too: a waiting worker wakes when the ban ends
            self.report.banned_sources[name] = ban.reason
            self.benched[name] = ban.until
            return False
        return True

    def _pick(self) -> tuple[int, PeerInfo] | None:
        holders = [(p, h) for p, h in self.view(self.key) if self._usable(p.name)]
        for chunk in self.pending:
            planned = self.planned.get(chunk)
            if planned is not None and self._usable(planned.name) \
                    and chunk not in self.lacks.get(planned.name, ()):
                if self.load.get(planned.name, 0) < RELAY_DEPTH:
                    return chunk, planned
                # A planned parent gets few requests at a time, so chunks arrive in order
                # one after the other: more would share our link between several chunks
                # and delay our own children (and theirs) by that many chunk-times.
                continue
            best: tuple[tuple[int, int, str], PeerInfo] | None = None
            for peer, holding in holders:
                if chunk in self.lacks.get(peer.name, ()) or not (
                        holding.has(chunk) or peer.name in self.upstream):
                    continue
                if peer.name in self.upstream and not holding.complete \
                        and self.load.get(peer.name, 0) >= RELAY_DEPTH:
                    continue  # a named parent still receiving: chunks in order, as planned
                rank = (int(holding.publisher == peer.name), self.load.get(peer.name, 0),
                        peer.name)
                if best is None or rank < best[0]:
                    best = (rank, peer)
            if best is not None:
                return chunk, best[1]
        return None

    def _missing(self) -> str:
        names = sorted({
            self.manifest.tensors[s.index].name
            for c in self.pending
            for s in self.manifest.segments(*self.manifest.chunk_range(c))
        })
        dropped = "; ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items()))
        banned = "; ".join(f"{k}: {v}" for k, v in sorted(self.report.banned_sources.items())
                           if k not in self.dropped)
        return (f"no live holder for {len(self.pending)} of {self.wanted} chunks "
                f"(tensors {names[:8]}{' ...' if len(names) > 8 else ''})"
                + (f"; dropped sources: {dropped}" if dropped else "")
                + (f"; banned sources: {banned}" if banned else ""))

    async def run(self) -> FetchReport:
        start = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(self.window):
                    nursery.start_soon(self._worker)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        self.report.seconds = trio.current_time() - start
        self.report.verified = not self.pending and not self.claimed
        self.report.dropped_sources = dict(self.dropped)
        return self.report

    async def _worker(self) -> None:
        conns: dict[str, Connection] = {}
        try:
            while self.pending or self.claimed:
                await self._let_go(conns)
                job = self._pick()
                if job is None:
                    if not self.pending:
                        return  # the rest is claimed by other workers
                    await self._wait_for_source()
                    continue
                chunk, peer = job
                chunks = self._batch(chunk, peer, conns.get(peer.name))
                for c in chunks:
                    self.pending.remove(c)
                    self.claimed[c] = peer.name
                self.load[peer.name] = self.load.get(peer.name, 0) + 1
                landed: set[int] = set()
                try:
                    landed = await self._read(conns, chunks, peer)
                finally:
                    self.load[peer.name] -= 1
                    for c in chunks:
                        del self.claimed[c]
                        if c not in landed:
                            self.pending.append(c)
                    self.pending.sort()
                    self._notify()  # a slot or a source is free again
        finally:
            for conn in conns.values():
                await self.release(conn)

    async def _let_go(self, conns: dict[str, Connection]) -> None:
        """End this worker's idle connections to sources the fetch is not using now
        (dropped, benched, banned): a same-host one may hold a lease on a version its
        holder is unpublishing, whose drain would otherwise wait for this fetch to end."""
        for name in [n for n in conns if not self._usable(n)]:
            await self.release(conns.pop(name))

    def _batch(self, chunk: int, peer: PeerInfo, conn: Connection | None) -> list[int]:
        """``chunk`` and the pending chunks right after it that ``peer`` holds, as many
        as ``conn`` takes in one read but no more than leaves work for every worker
        (planned chunks stay with their planned source)."""
        count = 0 if conn is None else min(conn.batch_bytes // self.manifest.chunk_size,
                                           -(-len(self.pending) // self.window))
        if count < 2:
            return [chunk]
        holding = next((h for p, h in self.view(self.key) if p.name == peer.name), None)
        out = [chunk]
        at = self.pending.index(chunk)
        for nxt in self.pending[at + 1:at + count]:
            planned = self.planned.get(nxt)
            if nxt != out[-1] + 1 or holding is None or not holding.has(nxt) \
                    or (planned is not None and planned.name != peer.name):
                break
            out.append(nxt)
        return out

    async def _wait_for_source(self) -> None:
        """No usable holder has a pending chunk.  Wait for news: a holder that is still
        receiving, a benched holder coming back, or gossip about a new one.  With nothing
        in flight and no progress for ``stall_timeout``, give up and say what is missing."""
        now = trio.current_time()
        if not self.claimed and now - self.last_progress > self.stall_timeout:
            raise VersionUnavailable(self.key.model, self.key.version, self._missing())
        wake = now + self.stall_timeout
        for until in self.benched.values():
            if now < until < wake:
                wake = until
        changed = self.changed
        with trio.move_on_at(wake):
            await changed.wait()

    async def _read(self, conns: dict[str, Connection], chunks: list[int], peer: PeerInfo
                    ) -> set[int]:
        """Read ``chunks`` from ``peer``; returns those that landed verified."""
        name = peer.name
        try:
            conn = conns.get(name)
            if conn is None:
                conn = conns[name] = await self.connect(peer)
            dests = [self.local.buffers(c) if conn.lands_arrays else self.local.segments(c)
                     for c in chunks]
            size = sum(stop - first for first, stop in map(self.manifest.chunk_range, chunks))
            limit = self.pace.limit(name, size)
            started = trio.current_time()
            verifies = [self._verifier(c, name) for c in chunks]
            with trio.move_on_after(limit) as scope:
                results = await conn.read_chunks(self.key, chunks, dests, verifies)
            if scope.cancelled_caught:
                raise Stalled(f"stalled: chunks {chunks} took over {limit:.2f}s")
        except (NotServing, IntegrityError, RemoteProtocolError, TransportError, OSError) as exc:
            await self._failed(conns, name, chunks[0], exc)
            return set()
        landed: set[int] = set()
        for chunk, result in zip(chunks, results, strict=False):  # results may stop early
            if isinstance(result, Exception):
                await self._failed(conns, name, chunk, result)
                break
            landed.add(chunk)
            self._landed(chunk, result, name, conn)
        if landed:
            self.report.reads += 1
            self.failures.pop(name, None)
            self.pace.completed(name, sum(stop - first for first, stop in
                                          map(self.manifest.chunk_range, landed)),
                                trio.current_time() - started)
            self.on_progress()
        return landed

    def _verifier(self, chunk: int, source: str) -> Callable[[Sequence[memoryview]], None]:
        algo, expected = self.manifest.digest_algo, self.manifest.chunk_digests[chunk]

        def verify(landed: Sequence[memoryview]) -> None:
            if digest_of(algo, landed) != expected:
                raise IntegrityError(f"chunk {chunk} of {self.key} failed its digest",
                                     source=source)

        return verify

    def _landed(self, chunk: int, n: int, name: str, conn: Connection) -> None:
        """Count a chunk that arrived from ``name`` and passed its check."""
        self.report.chunks_received += 1
        if chunk in self.tried:
            self.report.resourced_chunks += 1
        self.local.mark_verified(chunk)
        self.last_progress = trio.current_time()
        self.report.bytes += n
        self.report.chunks += 1
        self.report.bytes_by_source[name] = self.report.bytes_by_source.get(name, 0) + n
        if self.planned.get(chunk) is not None and self.planned[chunk].name == name:
            self.report.planned_bytes += n
        self.report.transport_by_source[name] = conn.transport

    async def _failed(self, conns: dict[str, Connection], name: str, chunk: int,
                      exc: Exception) -> None:
        """What a failed read of ``chunk`` from ``name`` means for the source."""
        if isinstance(exc, NotServing):
            if exc.status == NOT_YET:
                self.lacks.setdefault(name, set()).add(chunk)
            else:
                await self._drop(conns, name, f"refused: {exc.detail}", math.inf)
        elif isinstance(exc, IntegrityError):
            self.report.chunks_received += 1  # received in full, then refused
            self.report.integrity_failures[name] = self.report.integrity_failures.get(name, 0) + 1
            self.on_bad_bytes(name, self.key, str(exc))
            await self._drop(conns, name, str(exc), math.inf)
        elif isinstance(exc, RemoteProtocolError):
            await self._drop(conns, name, str(exc), math.inf)
        elif isinstance(exc, Stalled):
            await self._stalled(conns, name, chunk, str(exc))
        elif isinstance(exc, TransportError | OSError):
            # Maybe a passing fault: retry this source after a backoff (membership
            # removes it from the view meanwhile if it died).
            n = self.failures[name] = self.failures.get(name, 0) + 1
            await self._drop(conns, name, str(exc) or type(exc).__name__,
                             min(self.stall_timeout, RETRY_BASE * 2 ** min(n - 1, 16)))
        else:
            raise exc

    async def _stalled(self, conns: dict[str, Connection], name: str, chunk: int,
                       why: str) -> None:
        """A read from ``name`` hit its limit (see the module docstring)."""
        self.pace.stalled(name)
        now = trio.current_time()
        if now - self.last_progress >= self.stall_timeout:  # a real timeout
            await self._drop(conns, name, why, self.stall_timeout)
        elif self._others_have(name, chunk):
            await self._drop(conns, name, why, self.pace.limit(name, self.manifest.chunk_size))
        else:
            # The only source: ask it again, with twice the time.  The connection is
            # out of step (the read was cancelled mid-exchange): open a new one.
            self.report.stall_retries[name] = self.report.stall_retries.get(name, 0) + 1
            conn = conns.pop(name, None)
            if conn is not None:
                await conn.aclose()

    def _others_have(self, name: str, chunk: int) -> bool:
        """Whether a usable holder other than ``name`` could serve ``chunk``."""
        planned = self.planned.get(chunk)
        if planned is not None and planned.name != name and self._usable(planned.name):
            return True
        return any(p.name != name and self._usable(p.name)
                   and (h.has(chunk) or p.name in self.upstream)
                   for p, h in self.view(self.key))

    async def _drop(self, conns: dict[str, Connection], name: str, reason: str,
                    bench_for: float) -> None:
        self.dropped[name] = reason
        self.benched[name] = max(self.benched.get(name, 0.0), trio.current_time() + bench_for)
        self.tried.update(c for c, src in self.claimed.items() if src == name)
        conn = conns.pop(name, None)
        if conn is not None:
            await conn.aclose()


async def _close(conn: Connection) -> None:
    await conn.aclose()
