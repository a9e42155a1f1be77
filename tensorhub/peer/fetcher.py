"""One fetch: pull every chunk of a version from holders, verify it, land it in place.

A bounded number of workers (``PeerConfig.fetch_window``) each take the lowest
unverified, unclaimed chunk and the best holder that has it: a holder other than the
original publisher first, then the one we are reading least from.  The worker then
*streams* from that holder (``Connection.stream_chunks``): it claims runs of the
pending chunks that holder is the source for (consecutive ones the holder has; planned
chunks stay with their planned source) and keeps a window of them requested ahead, sized
from the bandwidth-delay product measured on that source
(:class:`~tensorhub.protocol.sizing.StreamWindow`), until the holder is the source of
nothing pending.  Chunks land with ``recv_into`` straight in the destination arrays and
are checked against the manifest digest in a worker thread before they count; a
verified chunk is served to others at once (partial-prefix serving) and never fetched
again.  A holder that refuses or sends
bad bytes is dropped for this fetch and its chunk goes to another; one that sent bytes
failing their digest is also banned by the peer (``banned`` / ``on_bad_bytes``), so
later fetches skip it too.  A holder whose connection fails is retried after a backoff.

Stalls.  A stream that lands no chunk for longer than its source's limit per chunk
(:class:`~tensorhub.protocol.pace.Pace`: from the source's measured pace, never under a
floor that holds on a loaded host) is a stall; the limit applies to progress, chunk by
chunk, not to a whole run.  The stalled source gets twice as long next time; its chunks go to
another holder that has them, and only when there is none is the same source asked
again at once: a slow but live sole source is never dropped.  What ends a fetch is a
real timeout: no chunk landed for ``stall_timeout``.  Then, or when no holder is left for
some chunk, the fetch raises :class:`VersionUnavailable` naming what is missing.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

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
from ..protocol.sizing import StreamWindow, choose_chunk_size, size_text
from ..transport.base import Connection, NotServing, Verifier
from .fetch_report import Fetched as Fetched
from .fetch_report import FetchReport as FetchReport
from .store import LocalVersion

RELAY_DEPTH = 1
"""Streams to one planned parent (or named parent still receiving).  One: chunks arrive
in order, one after the other, and each level of a tree lags its parent by one
chunk-time; the stream's window keeps the parent's next chunks asked for, and the parent
sends each as it lands.  Measured in the 8-host emulated cluster (256 MiB, 4 MiB chunks,
one request at a time): 1 gave 1.16x the fluid bound, 2 gave 1.28x (two chunks share
our link, so every level lags by two)."""

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
                 only: Sequence[int] | None = None, release: Releaser | None = None,
                 window_cap: int = 256 << 20, socket_window: int = 0) -> None:
        """``only``, when given, limits the fetch to those chunks (a resharding fetch
        needs just the chunks that overlap its slices); ``release`` takes each
        connection a worker is done with (default: close it); ``window_cap`` bounds
        the bytes one stream keeps requested ahead; ``socket_window`` what one TCP
        connection can keep in flight (0: unknown, one stream per source)."""
        self.socket_window = socket_window
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
        self.window_cap = window_cap
        self.windows: dict[str, StreamWindow] = {}
        """Each source's stream window, from what its streams measured."""
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
        """Streams open per source."""
        self.dropped: dict[str, str] = {}
        self.lacks: dict[str, set[int]] = {}
        self.tried: set[int] = set()
        self.report = FetchReport(self.key.model, self.key.version)
        size = self.manifest.chunk_size
        auto, _ = choose_chunk_size(self.manifest.total_bytes)
        self.report.chunk_size = f"{size_text(size)} chosen by the publisher: " + (
            f"automatic for {size_text(self.manifest.total_bytes)}" if size == auto else
            f"its PeerConfig.chunk_size (automatic would be {size_text(auto)})")
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

    def _source_for(self, chunk: int, holders: list[tuple[PeerInfo, Holding]],
                    streaming: str | None = None) -> PeerInfo | None:
        """The best source of ``chunk`` now, or None; ``streaming`` names the source of
        the stream asking (its own stream does not count in its load, and it wins ties)."""
        def load(name: str) -> int:
            return self.load.get(name, 0) - (name == streaming)

        planned = self.planned.get(chunk)
        if planned is not None and self._usable(planned.name) \
                and chunk not in self.lacks.get(planned.name, ()):
            # A planned parent gets one stream, so chunks arrive in order one after the
            # other: more would share our link between several chunks and delay our own
            # children (and theirs) by that many chunk-times.
            return planned if load(planned.name) < RELAY_DEPTH else None
        best: tuple[tuple[int, int, bool, str], PeerInfo] | None = None
        copy_busy = False  # a holder other than the publisher has it, at its streams
        for peer, holding in holders:
            if chunk in self.lacks.get(peer.name, ()) or not (
                    holding.has(chunk) or peer.name in self.upstream):
                continue
            publisher = holding.publisher == peer.name
            if load(peer.name) >= self._streams(peer.name, holding):
                copy_busy |= not publisher
                continue  # chunks in order from each source (sizing: streams per source)
            rank = (int(publisher), load(peer.name), peer.name != streaming, peer.name)
            if best is None or rank < best[0]:
                best = (rank, peer)
        if best is not None and best[0][0] and copy_busy:
            return None  # the publisher only for what no copy can serve (ROS)
        return None if best is None else best[1]

    def _streams(self, name: str, holding: Holding) -> int:
        """Streams to keep to ``name``: one, so its chunks land in order (a source
        still receiving: always one); more only on a link one cannot fill."""
        window = self.windows.get(name)
        if window is None or not holding.complete:
            return 1
        return window.streams(self.socket_window, self.window)

    def _holders(self) -> list[tuple[PeerInfo, Holding]]:
        return [(p, h) for p, h in self.view(self.key) if self._usable(p.name)]

    def _pick(self) -> tuple[int, PeerInfo] | None:
        holders = self._holders()
        for chunk in self.pending:
            peer = self._source_for(chunk, holders)
            if peer is not None:
                return chunk, peer
        return None

    def _take(self, peer: PeerInfo, budget: int) -> list[int]:
        """Claim the next run for a stream from ``peer``: the lowest pending chunk it is
        the source of, and the pending chunks right after it that it has too (planned
        chunks stay with their planned source), about ``budget`` bytes and no more than
        leaves work for every worker."""
        name = peer.name
        if not self._usable(name):
            return []
        holders = self._holders()
        holding = next((h for p, h in holders if p.name == name), None)
        at = next((i for i, c in enumerate(self.pending)
                   if (found := self._source_for(c, holders, name)) is not None
                   and found.name == name), None)
        if at is None:
            return []
        chunk = self.pending[at]
        share = max(1, -(-len(self.pending) // self.window))
        out, size = [chunk], self._size(chunk)
        for nxt in self.pending[at + 1:at + share]:
            planned = self.planned.get(nxt)
            mine = planned.name == name if planned is not None else (
                name in self.upstream or (holding is not None and holding.has(nxt)))
            if nxt != out[-1] + 1 or not mine or nxt in self.lacks.get(name, ()) \
                    or size + self._size(nxt) > budget:
                break
            out.append(nxt)
            size += self._size(nxt)
        for c in out:
            self.pending.remove(c)
            self.claimed[c] = name
        self.report.reads += 1
        return out

    def _size(self, chunk: int) -> int:
        first, stop = self.manifest.chunk_range(chunk)
        return stop - first

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
        self.report.windows = {name: w.why() for name, w in self.windows.items()}
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
                if not await self._stream(conns, chunk, peer):
                    await trio.lowlevel.checkpoint()  # claimed meanwhile by another worker
        finally:
            for conn in conns.values():
                await self.release(conn)

    async def _let_go(self, conns: dict[str, Connection]) -> None:
        """End this worker's idle connections to sources the fetch is not using now
        (dropped, benched, banned): a same-host one may hold a lease on a version its
        holder is unpublishing, whose drain would otherwise wait for this fetch to end."""
        for name in [n for n in conns if not self._usable(n)]:
            await self.release(conns.pop(name))

    async def _stream(self, conns: dict[str, Connection], chunk: int, peer: PeerInfo
                      ) -> int:
        """Stream from ``peer`` (picked as the source of ``chunk``) for as long as it is
        the source of pending chunks; returns how many it claimed.  Chunks not landed go
        back to pending."""
        name = peer.name
        taken: dict[int, None] = {}  # claimed by this stream, not reported yet
        claimed = 0
        window = self.windows.get(name)
        if window is None:
            window = self.windows[name] = StreamWindow(self.manifest.chunk_size,
                                                       self.window_cap)
        stop = False  # the source failed: close the connection
        self.load[name] = self.load.get(name, 0) + 1
        try:
            conn = conns.get(name)
            if conn is None:
                conn = conns[name] = await self.connect(peer)
            ready = conn

            def take(budget: int) -> list[tuple[int, Any, Verifier | None]]:
                nonlocal claimed
                run = self._take(peer, budget)
                claimed += len(run)
                taken.update(dict.fromkeys(run))
                out: list[tuple[int, Any, Verifier | None]] = []
                for c in run:
                    dest = self.local.buffers(c) if ready.lands_arrays else \
                        self.local.segments(c)
                    out.append((c, dest, self._verifier(c, name)))
                return out

            last = [trio.current_time()]
            scope = trio.CancelScope(deadline=last[0] + self.pace.limit(
                name, self.manifest.chunk_size))

            def landed(c: int, result: int | Exception) -> bool:
                nonlocal stop
                del taken[c]
                del self.claimed[c]
                now = trio.current_time()
                scope.deadline = now + self.pace.limit(name, self.manifest.chunk_size)
                if isinstance(result, Exception):
                    self.pending.append(c)
                    self.pending.sort()
                    stop = self._failed(name, c, result)
                    self._notify()  # a chunk to fetch again
                else:  # no news for waiting workers: nothing new to fetch
                    self.pace.completed(name, result, now - last[0])
                    self._landed(c, result, name, ready)
                    self.failures.pop(name, None)
                    self.on_progress()
                last[0] = now
                return not stop

            with scope:
                await conn.stream_chunks(self.key, take, landed, window)
            if scope.cancelled_caught:
                limit = self.pace.limit(name, self.manifest.chunk_size)
                raise Stalled(f"stalled: no chunk of {sorted(taken)[:4]} in {limit:.2f}s")
        except (NotServing, IntegrityError, RemoteProtocolError, TransportError, OSError) as exc:
            stop = self._failed(name, min(taken, default=chunk), exc)
        finally:
            self.load[name] -= 1
            for c in taken:
                del self.claimed[c]
                self.pending.append(c)
            self.pending.sort()
            self._notify()  # a slot or a source is free again
        if stop:
            conn = conns.pop(name, None)
            if conn is not None:
                await conn.aclose()
        return claimed

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

    def _failed(self, name: str, chunk: int, exc: Exception) -> bool:
        """What a failed read of ``chunk`` from ``name`` means for the source; True when
        the stream from it must end (its connection closed)."""
        if isinstance(exc, NotServing):
            if exc.status == NOT_YET:
                self.lacks.setdefault(name, set()).add(chunk)
                return False
            self._drop(name, f"refused: {exc.detail}", math.inf)
        elif isinstance(exc, IntegrityError):
            self.report.chunks_received += 1  # received in full, then refused
            self.report.integrity_failures[name] = self.report.integrity_failures.get(name, 0) + 1
            self.on_bad_bytes(name, self.key, str(exc))
            self._drop(name, str(exc), math.inf)
        elif isinstance(exc, RemoteProtocolError):
            self._drop(name, str(exc), math.inf)
        elif isinstance(exc, Stalled):
            self._stalled(name, chunk, str(exc))
        elif isinstance(exc, TransportError | OSError):
            # Maybe a passing fault: retry this source after a backoff (membership
            # removes it from the view meanwhile if it died).
            n = self.failures[name] = self.failures.get(name, 0) + 1
            self._drop(name, str(exc) or type(exc).__name__,
                       min(self.stall_timeout, RETRY_BASE * 2 ** min(n - 1, 16)))
        else:
            raise exc
        return True

    def _stalled(self, name: str, chunk: int, why: str) -> None:
        """A stream from ``name`` landed nothing within its limit (see the module
        docstring).  Its connection is out of step (cancelled mid-run) and is closed."""
        self.pace.stalled(name)
        now = trio.current_time()
        if now - self.last_progress >= self.stall_timeout:  # a real timeout
            self._drop(name, why, self.stall_timeout)
        elif self._others_have(name, chunk):
            self._drop(name, why, self.pace.limit(name, self.manifest.chunk_size))
        else:
            # The only source: ask it again, with twice the time, on a new connection.
            self.report.stall_retries[name] = self.report.stall_retries.get(name, 0) + 1

    def _others_have(self, name: str, chunk: int) -> bool:
        """Whether a usable holder other than ``name`` could serve ``chunk``."""
        planned = self.planned.get(chunk)
        if planned is not None and planned.name != name and self._usable(planned.name):
            return True
        return any(p.name != name and self._usable(p.name)
                   and (h.has(chunk) or p.name in self.upstream)
                   for p, h in self.view(self.key))

    def _drop(self, name: str, reason: str, bench_for: float) -> None:
        self.dropped[name] = reason
        self.benched[name] = max(self.benched.get(name, 0.0), trio.current_time() + bench_for)
        self.tried.update(c for c, src in self.claimed.items() if src == name)


async def _close(conn: Connection) -> None:
    await conn.aclose()
