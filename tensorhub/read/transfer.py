"""One transfer of a manifest's chunks: the trio shell around
:class:`~tensorhub.protocol.transfer.TransferSession`.

The session decides (see :mod:`tensorhub.protocol.transfer`): which chunk next, from
which holder, how many chunks a run claims, what a failure or a stall means, when to
give up.  This shell does the I/O it asks for: a bounded number of workers
(``PeerConfig.fetch_window``), each streaming from the holder the session picked
(``Connection.stream_chunks``) with the window the session keeps for that source, under
a cancel scope whose deadline is the source's stall limit, renewed at each chunk.
Chunks land with ``recv_into`` straight in the destination arrays and are checked
against the manifest digest in a worker thread before they count; a verified chunk is
served to others at once (partial-prefix serving) and never fetched again.  A holder
whose bytes failed their digest is also banned by the peer (``on_bad_bytes``), so later
fetches skip it too.  Workers with nothing to do wait on a trio event, set when a chunk
goes back to pending, a stream ends or gossip changes the holder view.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import trio

from ..device.landing import Landing, PassingVerifier
from ..errors import (
    IntegrityError,
    RemoteProtocolError,
    TransportError,
    VersionUnavailable,
)
from ..manifest.digests import LOCAL_ALGO, digest_of
from ..model import PeerInfo, VersionKey
from ..protocol.dataplane import NOT_YET
from ..protocol.reading import BanCheck, View
from ..protocol.transfer import (
    FailureKind,
    Stream,
    TransferSession,
    TransferTally,
    chunk_size_note,
)
from ..transport.base import Connection, NotServing, Verifier
from .report import FetchReport
from .store import LocalVersion

HolderView = Callable[[VersionKey], View]
Connector = Callable[[PeerInfo], Awaitable[Connection]]
Releaser = Callable[[Connection], Awaitable[None]]
"""Takes a connection the fetch is done with (closes it, or keeps it for a later read)."""
BadBytes = Callable[[str, VersionKey, str], None]
"""Told ``(holder, version, reason)`` when a holder's chunk failed its digest."""
FAILURES = (NotServing, IntegrityError, RemoteProtocolError, TransportError, OSError)
"""What a read from a holder may raise that is the holder's or the link's doing."""


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


def failure_of(exc: Exception) -> tuple[FailureKind, str]:
    """The session's name for a failed read, and its text."""
    if isinstance(exc, NotServing):
        return ("not_yet" if exc.status == NOT_YET else "refused"), exc.detail
    if isinstance(exc, IntegrityError):
        return "integrity", str(exc)
    if isinstance(exc, RemoteProtocolError):
        return "remote_protocol", str(exc)
    if isinstance(exc, TransportError | OSError):
        return "transport", str(exc) or type(exc).__name__
    raise exc


class Transfer:
    """The state of one transfer; :meth:`run` drives it to completion or failure."""

    def __init__(self, *, me: str, local: LocalVersion, view: HolderView, connect: Connector,
                 upstream: frozenset[str], window: int, stall_timeout: float,
                 on_progress: Callable[[], None], banned: BanCheck, on_bad_bytes: BadBytes,
                 plan: Sequence[tuple[PeerInfo, int, int]] = (),
                 only: Sequence[int] | None = None, release: Releaser | None = None,
                 window_cap: int = 256 << 20, socket_window: int = 0,
                 host: str | None = None, rates: Mapping[str, float] | None = None,
                 cores: int = 0, dc: str | None = None) -> None:
        """``only``, when given, limits the fetch to those chunks (a resharding fetch
        needs just the chunks that overlap its slices); ``release`` takes each
        connection a worker is done with (default: close it); ``window_cap`` bounds
        the bytes one stream keeps requested ahead; ``socket_window`` is what one TCP
        connection keeps in flight, ``host`` this peer's host label, ``rates`` what
        earlier fetches measured per source and ``cores`` the cores this process may
        run on (see :class:`TransferSession`)."""
        self.local = local
        self.manifest = local.manifest
        self.key = key = local.manifest.key
        self.connect = connect
        self.release: Releaser = release or _close
        self.on_bad_bytes = on_bad_bytes
        self.on_progress = on_progress
        self.session = TransferSession(
            now=trio.current_time(), me=me, manifest=self.manifest,
            holders=lambda: view(key), banned=lambda _now, name: banned(name),
            wanted=range(self.manifest.num_chunks) if only is None else only,
            verified=local.verified, window=window, stall_timeout=stall_timeout,
            upstream=upstream, plan=plan, window_cap=window_cap,
            socket_window=socket_window, host=host, rates=rates, cores=cores, dc=dc)
        self._report = FetchReport(key.model, key.version,
                                   chunk_size=chunk_size_note(self.manifest))
        self._verify_times: list[float] = []
        """Seconds each digest check took (appended from worker threads)."""
        self.changed = trio.Event()
        self._streams: dict[int, tuple[Stream, trio.CancelScope]] = {}
        """Open streams (by id) and their cancel scopes, for :meth:`replan`."""
        self._abandoned: set[int] = set()
        """Streams ended by a newer plan (not stalled)."""

    @property
    def report(self) -> FetchReport:
        """The report so far (progress displays read it while the fetch runs)."""
        tally = self.session.tally
        for f in fields(TransferTally):
            if hasattr(self._report, f.name):  # not the landing times
                setattr(self._report, f.name, getattr(tally, f.name))
        return self._report

    def streaming_from(self) -> tuple[str, ...]:
        """The source of each stream open now."""
        return tuple(stream.source.name for stream, _ in self._streams.values())

    def poke(self) -> None:
        """Gossip changed the holder view: wake workers waiting for a source."""
        self.session.view_changed()
        self._notify()

    def replan(self, plan: Sequence[tuple[PeerInfo, int, int]]) -> tuple[int, int]:
        """The coordinator's newer plan: pending chunks take its sources, and streams
        with chunks it sources elsewhere end now (see :meth:`TransferSession.replan`);
        waiting workers look again.  Returns how many pending chunks changed source,
        and how many streams it ends."""
        moved, ended = self.session.replan(trio.current_time(), plan), 0
        for key, (stream, scope) in self._streams.items():
            if stream.source.name in self.session.abandon and key not in self._abandoned:
                stream.stop = True  # its connection closes: what it asked is not sent
                self._abandoned.add(key)
                scope.cancel()
                ended += 1
        self._notify()
        return moved, ended

    def _notify(self) -> None:
        """Wake every waiting worker.  Only the notifier replaces the event, so a waiter
        can never be left on an event nobody will set."""
        self.changed.set()
        self.changed = trio.Event()

    async def run(self) -> FetchReport:
        start = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(self.session.window):
                    nursery.start_soon(self._worker)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        report, tally = self.report, self.session.tally
        report.seconds = trio.current_time() - start
        report.verified = self.session.done
        if tally.first_landed is not None and tally.last_landed is not None:
            report.first_byte_seconds = max(0.0, tally.first_landed - start)
            report.transfer_seconds = max(0.0, tally.last_landed - start)
        report.verify_seconds = sum(self._verify_times)
        most = self.session.most_streams
        report.windows = {name: f"{w.why()}; {_streams(most.get(name, 0))}"
                          for name, w in self.session.windows.items()}
        return report

    async def _worker(self) -> None:
        conns: dict[str, Connection] = {}
        session = self.session
        try:
            while not session.done:
                await self._let_go(conns)
                job = session.pick(trio.current_time())
                if job is None:
                    if not session.pending:
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
        now = trio.current_time()
        for name in [n for n in conns if not self.session.usable(now, n)]:
            await self.release(conns.pop(name))

    async def _stream(self, conns: dict[str, Connection], chunk: int, peer: PeerInfo
                      ) -> int:
        """Stream from ``peer`` (picked as the source of ``chunk``) for as long as the
        session gives it runs; returns how many chunks it claimed."""
        session, name = self.session, peer.name
        stream = session.open_stream(trio.current_time(), chunk, peer)
        failure: tuple[FailureKind, str] | None = None
        scope = trio.CancelScope()  # its deadline is set once connected
        self._streams[id(stream)] = (stream, scope)
        try:
            conn = conns.get(name)
            if conn is None:
                conn = conns[name] = await self.connect(peer)
            ready = conn

            landing = self.local.landing
            # this holder could write our memory anyway: the manifest's fast digests
            local = ready.holder_shares_memory and bool(self.manifest.local_digests)
            # ... and, copying into our device memory, chunks land and are checked there
            in_place = landing is not None and landing.on_device and ready.lands_device \
                and ready.holder_shares_memory and bool(self.manifest.device_digests)

            def take(budget: int) -> list[tuple[int, Any, Verifier | None]]:
                if landing is not None and not in_place:  # no more than the ring holds
                    budget = min(budget, landing.budget(session.window))
                run = session.next_run(trio.current_time(), stream, budget)
                if landing is not None and in_place:
                    return [(c, landing.in_place(c), self._in_place_check(c, name, landing))
                            for c in run]
                if landing is not None:
                    return [(c, *landing.take(c, self._verifier(c, name, local)))
                            for c in run]
                return [(c, self.local.buffers(c) if ready.lands_arrays else
                         self.local.segments(c), self._verifier(c, name, local)) for c in run]

            scope.deadline = trio.current_time() + session.stall_limit(name)

            def landed(c: int, result: int | Exception) -> bool:
                now = trio.current_time()
                if landing is not None:
                    landing.abandon(c)  # a no-op once its check released the slot
                if isinstance(result, Exception):
                    kind, detail = failure_of(result)
                    stop = session.failed(now, stream, c, kind, detail)
                    if kind == "integrity":
                        self.on_bad_bytes(name, self.key, detail)
                    self._notify()  # a chunk to fetch again
                else:  # no news for waiting workers: nothing new to fetch
                    self.local.mark_verified(c)
                    if in_place:
                        self._report.device_digest_chunks += 1
                    else:
                        self._report.local_digest_chunks += local
                    session.landed(now, stream, c, result)
                    self._report.transport_by_source[name] = ready.transport
                    self.on_progress()
                    stop = False
                scope.deadline = now + session.stall_limit(name)
                return not stop

            with scope:
                await conn.stream_chunks(self.key, take, landed, session.windows[name])
            if scope.cancelled_caught and id(stream) not in self._abandoned:
                failure = "stalled", ""
        except FAILURES as exc:
            failure = failure_of(exc)
            if failure[0] == "integrity":
                self.on_bad_bytes(name, self.key, failure[1])
        finally:
            if self.local.landing is not None:  # chunks not reported: slots back
                for c in stream.taken:
                    self.local.landing.abandon(c)
            del self._streams[id(stream)]
            self._abandoned.discard(id(stream))
            stop = session.stream_ended(trio.current_time(), stream, *(failure or (None,)))
            self._notify()  # a slot or a source is free again
        if stop:
            conn = conns.pop(name, None)
            if conn is not None:
                await conn.aclose()
        return stream.claimed

    async def _wait_for_source(self) -> None:
        """No usable holder has a pending chunk.  Wait for news: a holder that is still
        receiving, a benched holder coming back, or gossip about a new one.  With nothing
        in flight and no progress for ``stall_timeout``, give up and say what is missing."""
        now = trio.current_time()
        if self.session.expired(now):
            raise VersionUnavailable(self.key.model, self.key.version,
                                     self.session.missing_text())
        changed = self.changed
        with trio.move_on_at(self.session.wake_at(now)):
            await changed.wait()

    def _verifier(self, chunk: int, source: str, local: bool = False) -> PassingVerifier:
        """The check of ``chunk`` read from ``source``: against the manifest's local
        digest where ``local`` (it has them, and the holder could write this process's
        memory anyway: see ``Connection.holder_shares_memory``), and then one a copying
        transport may run on the holder's bytes as it copies them
        (:class:`~tensorhub.transport.base.SourceVerifier`)."""
        m = self.manifest
        if local:
            return LocalDigestCheck(self, chunk, source, LOCAL_ALGO, m.local_digests[chunk])
        return DigestCheck(self, chunk, source, m.digest_algo, m.chunk_digests[chunk])

    def _in_place_check(self, chunk: int, source: str, landing: Landing) -> Verifier:
        """The check of ``chunk`` landed in place in device memory: its ``dsum-128``,
        computed on the device, against the manifest's."""
        expected = self.manifest.device_digests[chunk]

        def verify(landed: Sequence[Any]) -> None:
            began = time.perf_counter()
            ok = landing.dsum(landed) == expected
            self._verify_times.append(time.perf_counter() - began)
            if not ok:
                raise IntegrityError(f"chunk {chunk} of {self.key} failed its device digest",
                                     source=source)

        return verify


class DigestCheck:
    """The check of one chunk against its digest in the manifest, of the bytes that
    landed, timed into the fetch's ``verify_seconds``: a
    :class:`~tensorhub.device.landing.PassingVerifier`."""

    def __init__(self, fetch: Transfer, chunk: int, source: str, algo: str, expected: bytes
                 ) -> None:
        self.fetch, self.chunk, self.source = fetch, chunk, source
        self.algo, self.expected = algo, expected

    def __call__(self, landed: Sequence[memoryview],
                 each: Callable[[int, memoryview], None] | None = None) -> None:
        self._check(landed, each)

    def check_digest(self, digest: bytes, seconds: float) -> None:
        """The check, of the digest a reader computed as the bytes landed
        (:class:`~tensorhub.transport.base.DigestVerifier`)."""
        self.fetch._verify_times.append(seconds)
        if digest != self.expected:
            raise IntegrityError(f"chunk {self.chunk} of {self.fetch.key} failed its digest",
                                 source=self.source)

    def _check(self, segments: Iterable[Any],
               each: Callable[[int, memoryview], None] | None) -> None:
        began = time.perf_counter()
        digest = digest_of(self.algo, segments, each=each)
        self.check_digest(digest, time.perf_counter() - began)


class LocalDigestCheck(DigestCheck):
    """:class:`DigestCheck` against the manifest's local digest, which may also be run
    on the holder's bytes as a copy hands them over: a
    :class:`~tensorhub.transport.base.SourceVerifier`."""

    def check_source(self, blocks: Iterable[memoryview]) -> None:
        """The check of the chunk's bytes as a copy hands them over (the time it takes
        counts the copy too)."""
        self._check(blocks, None)


def _streams(n: int) -> str:
    return f"{n} stream{'s' * (n != 1)} at most"


async def _close(conn: Connection) -> None:
    await conn.aclose()
