"""Data plane over TCP (trio sockets), payload landed with ``recv_into``.

The holder's server (:mod:`.server`) answers a connection's requests in order (see
:mod:`tensorhub.protocol.dataplane` for the framing).  Chunk payload is sent from the
holder's own array memory and received straight into the reader's destination arrays:
no ``bytes`` object is ever made of payload.

A reader sends each request from the event loop; one thread per connection, already
waiting in ``recv``, takes the reply, lands and verifies the payload and wakes the task.
A chunk thus costs the reader one wake-up of the event loop and no hand-off to a thread.
A fetch streams (:meth:`TcpConnection.stream_chunks`): it keeps a window of runs of
chunks requested ahead, sized from the measured bandwidth-delay product
(:class:`~tensorhub.protocol.sizing.StreamWindow`), so no chunk waits for a round trip,
and the reader thread lands chunk k+1 while a pool thread checks chunk k.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import trio

from ..errors import RemoteProtocolError, TransportError
from ..limits import MAX_MANIFEST_BYTES
from ..manifest.digests import HASHED_AS_LANDED, new_hasher
from ..model import VersionKey
from ..protocol.dataplane import (
    MAX_RUN_CHUNKS,
    OK,
    ChunkReply,
    ChunkRequest,
    ChunkRunRequest,
    ManifestRequest,
    Reply,
)
from ..protocol.sizing import StreamWindow
from . import copy_threads
from .base import Landed, NotServing, Take, Verifier, read_each, takes_digest
from .frames import (
    recv_exact,
    recv_exact_blocking,
    recv_frame,
    recv_frame_blocking,
    send_frame,
)
from .handshake import DataAuth, prove_to_holder
from .sockio import NBYTES, bytes_of, recv_scattered, running_ends, tune

# -- the payload path: plain sockets in threads (:mod:`.sockio`) --------------------------
#
# The reader's standing thread, over a worker-thread call per chunk: ~8% on
# ``tensorhub bench transfer --only tcp``.

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends a reset
_THREAD_TIMEOUT = 120.0  # a safety net; stalls are detected by the caller's deadline
_MAX_MANIFEST = MAX_MANIFEST_BYTES  # the limits table's bound
_C = TypeVar("_C", bound="TcpConnection")


def _dup(sock: trio.socket.SocketType) -> socket.socket:
    plain = socket.socket(fileno=os.dup(sock.fileno()))
    plain.settimeout(_THREAD_TIMEOUT)
    return plain


@dataclass(eq=False)
class _Exchange:
    """One request in flight: what the reader thread does with an OK reply's payload
    (``land``, run in that thread), and what came of it."""

    req_id: int
    land: Callable[[socket.socket, Reply], Any]
    done: trio.Event = field(default_factory=trio.Event)
    reply: Reply | None = None
    value: Any = None
    error: BaseException | None = None


class TcpConnection:
    """A reader's connection to one holder's data-plane server.

    Requests go out from the event loop, several at a time when streaming; replies are
    read by one thread per connection that is already waiting in ``recv`` when a reply
    lands, so a chunk costs no thread hand-off on the way in: the thread copies the
    payload and either verifies it and wakes the waiting task (:meth:`read_chunk`) or,
    for a streamed run, hands the check to a pool thread and reads on
    (:meth:`stream_chunks`).  The thread ends when the connection is closed.
    """

    transport = "tcp"
    lands_arrays = True
    """:meth:`read_chunk` takes any C-contiguous buffers as ``dest`` (numpy arrays
    included, sized by ``nbytes``), not only byte views (see ``Connection``)."""
    lands_device = False
    holder_shares_memory = False
    """True once :func:`~tensorhub.transport.samehost.loopback.prove_holder_shares_memory`
    showed the holder to be a process of this host and user whose memory this one reads
    (see ``Connection``)."""
    batch_bytes = 0

    def __init__(self, sock: trio.socket.SocketType, peer: str) -> None:
        self._sock = sock
        self.peer = peer
        self._ids = itertools.count(1)
        self._plain: socket.socket | None = None  # the reader thread's; made on first read
        self._queue: deque[_Exchange | _Run] = deque()
        """Requests sent and not wholly answered, oldest first (the event loop appends,
        the reader thread takes)."""
        self._ended: BaseException | None = None  # why the reader thread stopped
        self._last_end: float | None = None  # when the reader thread last landed a chunk
        self.min_rtt: float | None = None
        """The least time from a request sent with none in flight to its reply."""

    @property
    def sock(self) -> trio.socket.SocketType:
        """The connection's socket (to look up its ends; reads go through the methods)."""
        return self._sock

    @classmethod
    async def connect(cls, address: str, peer: str, timeout: float,
                      auth: DataAuth | None = None) -> TcpConnection:
        """Connect to ``peer``'s data server at ``address``; with ``auth``, each side
        proves its identity to the other first (:mod:`.handshake`)."""
        host, _, port = address.rpartition(":")
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        tune(sock)
        await dial(sock, (host, int(port)), peer, timeout, auth,
                    f"cannot connect to {peer} at {address}")
        return cls(sock, peer)

    async def read_manifest(self, key: VersionKey) -> bytes:
        req = ManifestRequest(next(self._ids), key.model, key.version, key.shard, key.layout)
        if self._plain is not None:  # the reader thread owns the replies now
            data: bytes = await self._exchange(req, self._land_manifest)
            return data
        # Before any chunk (and always on a shared-memory connection): on the event loop.
        sent = time.perf_counter()
        await send_frame(self._sock, req)
        reply = await recv_frame(self._sock)
        self._rtt(time.perf_counter() - sent)
        if not isinstance(reply, Reply) or reply.req_id != req.req_id:
            raise RemoteProtocolError(f"{self.peer} answered out of turn")
        if reply.status != OK:
            raise NotServing(reply.status, reply.detail or f"status {reply.status}")
        _check_manifest_length(self.peer, reply)
        buf = bytearray(reply.length)
        await recv_exact(self._sock, memoryview(buf))
        return bytes(buf)

    async def read_chunk(self, key: VersionKey, chunk: int, dest: Sequence[memoryview],
                         verify: Verifier | None = None) -> int:
        req = ChunkRequest(next(self._ids), key.model, key.version, chunk, key.shard,
                           key.layout)
        n: int = await self._exchange(
            req, lambda sock, reply: self._land_chunk(sock, reply, chunk, dest, verify))
        return n

    async def read_chunks(self, key: VersionKey, chunks: Sequence[int],
                          dests: Sequence[Sequence[memoryview]],
                          verifies: Sequence[Verifier | None]) -> list[int | Exception]:
        return await read_each(self, key, chunks, dests, verifies)

    def _start_reader(self) -> None:
        if self._plain is None:
            self._plain = _dup(self._sock)
            trio.lowlevel.start_thread_soon(
                partial(self._read_replies, self._plain, trio.lowlevel.current_trio_token()),
                lambda _: None, name=f"tensorhub tcp reader ({self.peer})")

    def _enqueue(self, item: _Exchange | _Run) -> None:
        self._queue.append(item)
        # Published before this check, while the reader thread records why it stopped
        # before it fails what is queued: one of the two sees the other.
        if self._ended is not None:
            raise TransportError(f"connection to {self.peer} is closed: {self._ended}")

    async def _exchange(self, req: ManifestRequest | ChunkRequest,
                        land: Callable[[socket.socket, Reply], Any]) -> Any:
        """Send ``req`` and wait for the reader thread to land its reply with ``land``."""
        self._start_reader()
        ex = _Exchange(req.req_id, land)
        try:
            self._enqueue(ex)
            await send_frame(self._sock, req)
            await ex.done.wait()
        except BaseException:
            # Cancelled or failed mid-exchange: the stream is out of step.  Shutting it
            # down wakes the reader thread and ends the holder's lease at once.
            self._shutdown()
            raise
        if ex.error is not None:
            self._shutdown()
            raise ex.error
        assert ex.reply is not None
        if ex.reply.status != OK:  # a clean refusal: the connection stays usable
            raise NotServing(ex.reply.status, ex.reply.detail or f"status {ex.reply.status}")
        return ex.value

    # -- streamed runs -------------------------------------------------------------------

    async def stream_chunks(self, key: VersionKey, take: Take, landed: Landed,
                            window: StreamWindow) -> None:
        """See :meth:`Connection.stream_chunks`: runs of chunks asked for with
        ``ChunkRunRequest``, a new run when the window says (``StreamWindow.ask``:
        half of it free, or a chunk free and less than the bandwidth-delay product
        and a chunk in flight), so the holder never waits for a request."""
        self._start_reader()
        stream = _Stream(trio.lowlevel.current_trio_token())
        if self.min_rtt is not None:
            window.rtt(self.min_rtt)
        # Chunks asked for and not reported.  Each counts as a whole chunk in flight
        # (the last, shorter one too): no pass over a chunk's pieces to add them up.
        asked: set[int] = set()
        try:
            while True:
                budget = window.ask(len(asked) * window.chunk_bytes)
                if budget > 0 or not asked:
                    run = take(budget)
                    if not run and not asked:
                        return
                    asked.update(chunk for chunk, _, _ in run)
                    await self._send_runs(key, run, stream)
                await stream.wait()
                while stream.items:
                    item = stream.items.popleft()
                    if isinstance(item, BaseException):  # the connection failed
                        raise _failure(self.peer, item) from None
                    chunk, result, rtt, sample = item
                    asked.discard(chunk)
                    if rtt is not None:
                        self._rtt(rtt)
                        window.rtt(rtt)
                    if sample is not None and window.backlogged(sample[2]):
                        window.delivered(sample[0], sample[1])
                    if not landed(chunk, result):
                        if asked:
                            self._shutdown()  # chunks in flight: out of step
                        return
        except BaseException:
            self._shutdown()
            raise

    async def _send_runs(self, key: VersionKey, run: Sequence[tuple[int, Sequence[Any],
                                                                     Verifier | None]],
                         stream: _Stream) -> None:
        """Ask for ``run`` in requests of consecutive chunks."""
        at = 0
        while at < len(run):
            stop = at + 1
            while stop < len(run) and stop - at < MAX_RUN_CHUNKS \
                    and run[stop][0] == run[stop - 1][0] + 1:
                stop += 1
            part = run[at:stop]
            req = ChunkRunRequest(next(self._ids), key.model, key.version, part[0][0],
                                  len(part), key.shard, key.layout)
            self._enqueue(_Run(req.req_id, part[0][0], [d for _, d, _ in part],
                               [v for _, _, v in part], stream, time.perf_counter(),
                               not self._queue))
            await send_frame(self._sock, req)
            at = stop

    def _rtt(self, seconds: float) -> None:
        if self.min_rtt is None or seconds < self.min_rtt:
            self.min_rtt = seconds

    # -- the reader thread ---------------------------------------------------------------

    def _read_replies(self, sock: socket.socket, token: trio.lowlevel.TrioToken) -> None:
        """Wait, idle, for each reply and land it as the request it answers says; stop
        on the first error (the connection is then out of step) or when it is closed."""
        head: _Exchange | _Run | None = None
        try:
            while True:
                # Waiting, idle perhaps, in a pooled connection: hold nothing of the last
                # request (its run's checks keep a fetch and its memory alive).
                head = ex = None
                reply = recv_frame_blocking(sock, partial(self._on_idle, token))
                now = time.perf_counter()
                if not self._queue:
                    raise RemoteProtocolError(f"{self.peer} sent a frame nobody asked for")
                head = self._queue[0]
                if isinstance(head, _Run):
                    self._land_run(sock, head, reply, now)
                    continue
                ex = head
                self._queue.popleft()
                try:
                    if not isinstance(reply, Reply) or reply.req_id != ex.req_id:
                        raise RemoteProtocolError(f"{self.peer} answered out of turn")
                    ex.reply = reply
                    if reply.status == OK:
                        ex.value = ex.land(sock, reply)
                except BaseException as exc:
                    ex.error = exc
                    raise
                finally:
                    _wake(token, ex)
        except BaseException as exc:
            # Kept without its traceback: the frames it would keep (this thread's, with
            # the run being landed) hold a fetch's buffers until the cyclic collector.
            self._ended = exc.with_traceback(None)
            while self._queue:  # some may have been sent after this thread's last look
                item = self._queue.popleft()
                if isinstance(item, _Run):
                    item.stream.post(exc)
                elif item.error is None:
                    item.error = exc
                    _wake(token, item)
            # This frame lives on in the traceback of self._ended: not the last
            # request's buffers (a cancelled fetch's memory would wait for the collector).
            item = head = ex = None  # type: ignore[assignment]
        finally:
            sock.close()

    def _land_run(self, sock: socket.socket, run: _Run, reply: Any, now: float) -> None:
        """Land the next chunk of ``run``; its check runs in a pool thread meanwhile
        (:data:`VERIFY_ASIDE`), and the result goes to the run's stream."""
        i, chunk = run.at, run.first + run.at
        if not isinstance(reply, ChunkReply) or reply.req_id != run.req_id \
                or reply.chunk != chunk:
            raise RemoteProtocolError(f"{self.peer} answered out of turn")
        rtt = now - run.sent_at if i == 0 and run.alone else None
        sample: tuple[int, float, float] | None = None
        result: int | Exception
        dest, verify = run.dests[i], run.verifies[i]
        if reply.status != OK:
            self._last_end = None  # the holder may have waited: no rate sample next
            result = NotServing(reply.status, reply.detail or f"status {reply.status}")
            verify = None
        else:
            hasher = _hasher_for(verify, dest)
            nbytes, hashed = self._land_payload(sock, reply.length, chunk, dest, hasher)
            result = nbytes
            if hasher is not None and takes_digest(verify):
                try:
                    verify.check_digest(hasher.digest(), hashed)
                except Exception as exc:
                    result = exc
                verify = None
            end = time.perf_counter()
            if rtt is not None:  # from its header on, the holder was sending it
                sample = (nbytes, end - now, math.inf)
            elif self._last_end is not None:  # the window judges it (``backlogged``)
                sample = (nbytes, end - self._last_end, self._last_end - run.sent_at)
            self._last_end = end
        run.at += 1
        if run.at == len(run.dests):
            self._queue.popleft()
        if verify is not None and VERIFY_ASIDE:
            copy_threads.pool.submit(partial(_check_then_post, run.stream, chunk, dest, verify,
                                         result, rtt, sample))
            return
        if verify is not None:
            result = _checked(dest, verify, result)
        run.stream.post((chunk, result, rtt, sample))

    def _on_idle(self, token: trio.lowlevel.TrioToken) -> None:
        """No reply for ``_THREAD_TIMEOUT``: a stall if one was asked for (a safety net:
        the caller's deadline comes first); else wait on, unless the run that owns this
        connection has ended (``run_sync_soon`` then raises)."""
        if self._queue:
            raise TransportError(f"{self.peer} sent no reply for {_THREAD_TIMEOUT:.0f}s")
        token.run_sync_soon(_nothing)

    def _land_manifest(self, sock: socket.socket, reply: Reply) -> bytes:
        _check_manifest_length(self.peer, reply)
        buf = bytearray(reply.length)
        recv_exact_blocking(sock, memoryview(buf))
        return bytes(buf)

    def _land_payload(self, sock: socket.socket, length: int, chunk: int,
                      dest: Sequence[Any], hasher: Any = None) -> tuple[int, float]:
        """Land a chunk's payload in ``dest``: its bytes, and the seconds ``hasher``
        (given the pieces as they landed; see :func:`_hasher_for`) took."""
        if len(dest) > 2:  # always, with a hasher (:data:`HASH_AS_LANDED_PIECES`)
            ends = running_ends(dest)
            self._check_length(length, chunk, ends[-1])
            return length, recv_scattered(sock, dest, hasher, ends)
        self._check_length(length, chunk, sum(map(NBYTES, dest)))
        for d in dest:
            recv_exact_blocking(sock, bytes_of(d))
        return length, 0.0

    def _check_length(self, length: int, chunk: int, want: int) -> None:
        if length != want:
            raise RemoteProtocolError(
                f"{self.peer} sent {length} bytes for chunk {chunk}, expected {want}")

    def _land_chunk(self, sock: socket.socket, reply: Reply, chunk: int,
                    dest: Sequence[memoryview], verify: Verifier | None) -> int:
        want, _ = self._land_payload(sock, reply.length, chunk, dest)
        if verify is not None:
            verify(dest)  # while the bytes are still in cache
        return want

    # -- closing -------------------------------------------------------------------------

    def _shutdown(self, abort: bool = True) -> None:
        """End the connection now; the reader thread wakes, stops and closes its socket.
        ``abort``: with a reset, so a holder still sending to us stops at once and ends
        its lease (after a plain close, a holder facing our closed receive window would
        wait out its lease timeout)."""
        if abort and self._sock.fileno() >= 0:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        if self._plain is not None:
            with contextlib.suppress(OSError):
                self._plain.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def close(self) -> None:
        """:meth:`aclose` without a checkpoint (for a pool of idle connections)."""
        self._shutdown(abort=bool(self._queue) or self._ended is not None)

    async def aclose(self) -> None:
        self._shutdown(abort=bool(self._queue) or self._ended is not None)

    def reusable(self) -> bool:
        """True iff this connection is in step and open: nothing in flight, no reply
        pending or stray byte waiting, not closed by either side.  A kept idle
        connection is checked with this before each reuse (see
        :mod:`tensorhub.read.connections`)."""
        if self._ended is not None or self._queue or self._sock.fileno() < 0:
            return False
        probe = socket.socket(fileno=self._sock.fileno())
        try:
            probe.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True  # open, and nothing unasked-for has arrived
        except OSError:
            return False
        finally:
            probe.detach()
        return False  # closed by the holder (b""), or a byte nobody asked for


async def dial(sock: trio.socket.SocketType, where: Any, peer: str, timeout: float,
                auth: DataAuth | None, failed: str) -> None:
    """Connect ``sock`` to ``where`` and, with ``auth``, run the handshake with ``peer``,
    all within ``timeout``; the socket is closed if anything fails."""
    try:
        with trio.fail_after(timeout):
            await sock.connect(where)
            if auth is not None:
                await prove_to_holder(sock, auth, peer)
    except BaseException as exc:
        sock.close()
        if isinstance(exc, OSError | trio.TooSlowError):
            raise TransportError(f"{failed}: {str(exc) or 'timed out'}") from None
        raise


async def greeted(conn: _C, hello: Callable[[], Awaitable[None]], timeout: float,
                  what: str) -> _C:
    """``conn`` once ``hello()`` (its handshake after :func:`dial`) finished within
    ``timeout``; otherwise ``conn`` is closed and the failure raised (a timeout as a
    :class:`TransportError` saying ``what`` did not happen)."""
    try:
        with trio.fail_after(timeout):
            await hello()
    except trio.TooSlowError:
        await conn.aclose()
        raise TransportError(f"{what} within {timeout}s") from None
    except BaseException:
        await conn.aclose()
        raise
    return conn


def _check_manifest_length(peer: str, reply: Reply) -> None:
    if reply.length > _MAX_MANIFEST:
        raise RemoteProtocolError(f"{peer} sent a {reply.length}-byte manifest")


def _nothing() -> None:
    pass


def _wake(token: trio.lowlevel.TrioToken, ex: _Exchange) -> None:
    with contextlib.suppress(trio.RunFinishedError):  # nobody is left to wait
        token.run_sync_soon(ex.done.set)


VERIFY_ASIDE = True
"""Check a streamed chunk in a pool thread while the reader thread lands the next one
(else in the reader thread, which then reads nothing meanwhile)."""

HASH_AS_LANDED_PIECES = 16
"""A chunk that lands in more pieces than this (small tensors) is hashed by the reader
thread as its pieces land, when its digest allows (:data:`~tensorhub.manifest.digests.
HASHED_AS_LANDED`), instead of in a pool thread after it landed.  The pieces are then
hashed while in the cache, and the hashing, which keeps the GIL, takes less of it.
Measured here, 10,000 tensors of 4 KiB from a holder on this host: a fetch 1.1-2.3 ms
faster (of 26-29).  A chunk of a few large pieces is hashed aside as before: its
hashing lets go of the GIL, and the reader lands the next chunk meanwhile."""


def _hasher_for(verify: Verifier | None, dest: Sequence[Any]) -> Any:
    """A hasher for ``dest``'s bytes as they land, or None (checked aside, or not)."""
    if len(dest) > HASH_AS_LANDED_PIECES and takes_digest(verify) \
            and verify.algo in HASHED_AS_LANDED:
        return new_hasher(verify.algo)
    return None


_Item = tuple[int, "int | Exception", "float | None", "tuple[int, float, float] | None"]


@dataclass(eq=False)
class _Run:
    """A ``ChunkRunRequest`` in flight: where each chunk lands, how it is checked, and
    the stream its results go to."""

    req_id: int
    first: int
    dests: list[Sequence[Any]]
    verifies: list[Verifier | None]
    stream: _Stream
    sent_at: float
    alone: bool
    """Nothing else was in flight when it was sent: its first reply times a round trip."""
    at: int = 0


class _Stream:
    """Where the reader thread (and the pool threads checking chunks) put a stream's
    results -- ``(chunk, bytes or error, rtt sample, rate sample)``, or the exception
    that ended the connection -- for the task in :meth:`TcpConnection.stream_chunks`.  A
    rate sample is the chunk's bytes, the seconds since the previous landing, and how
    long before that landing the chunk was asked for."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self.items: deque[_Item | BaseException] = deque()
        self._arrived = trio.Event()

    def post(self, item: _Item | BaseException) -> None:
        """Any thread: queue ``item`` and wake the stream's task."""
        self.items.append(item)
        with contextlib.suppress(trio.RunFinishedError):  # nobody is left to wait
            self._token.run_sync_soon(self._wake)

    def _wake(self) -> None:
        self._arrived.set()

    async def wait(self) -> None:
        """Until at least one item is queued."""
        while not self.items:
            await self._arrived.wait()
            self._arrived = trio.Event()


def _failure(peer: str, exc: BaseException) -> Exception:
    """A new error saying why the connection to ``peer`` failed, of the kind the fetcher
    acts on (the reader thread's own is kept by the connection: raising it here would
    tie this task's frames, and the fetch's buffers, to it)."""
    if isinstance(exc, RemoteProtocolError):
        return RemoteProtocolError(str(exc))
    return TransportError(f"connection to {peer} failed: {exc or type(exc).__name__}")


def _checked(dest: Sequence[Any], verify: Verifier, n: int | Exception) -> int | Exception:
    try:
        verify(dest)
    except Exception as exc:
        return exc
    return n


def _check_then_post(stream: _Stream, chunk: int, dest: Sequence[Any], verify: Verifier,
                     n: int | Exception, rtt: float | None,
                     sample: tuple[int, float, float] | None) -> None:
    stream.post((chunk, _checked(dest, verify, n), rtt, sample))
