"""The holder's data server: serves a :class:`Provider` to readers over TCP, and to
same-host readers over a Unix socket (:mod:`.local`), the only one where same-host
requests are answered.

One task per connection answers its requests one at a time, in order (see
:mod:`tensorhub.protocol.dataplane` for the framing; a reader may queue several); chunk
payload leaves from the holder's own array memory in vectored writes from a worker
thread.  A streamed run (``ChunkRunRequest``) is answered chunk after chunk: every chunk
verified here already goes out in one write with its neighbours, and a chunk still
arriving is waited for (``Provider.wait_chunk``) and sent as soon as it lands.  Every reader is
bounded by :class:`~.admission.ServerLimits`: connections in total and per address, the
time a frame may take and a connection may idle, the request rate; accept() under
descriptor pressure backs off instead of failing the peer.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from functools import partial
from typing import Any

import outcome
import trio

from ..errors import RemoteProtocolError, TransportError
from ..model import VersionKey
from ..protocol.dataplane import (
    BAD_REQUEST,
    FRAME_HEADER,
    NOT_YET,
    OK,
    ChunkReply,
    ChunkRequest,
    ChunkRunRequest,
    DeltaRunRequest,
    ManifestRequest,
    ProbeRequest,
    Reply,
    ShmChunkRequest,
    ShmHello,
    ShmVersionRequest,
)
from ..protocol.onesided import OneSidedChunkRequest, OneSidedHello, OneSidedRunRequest
from .admission import (
    ACCEPT_BACKOFF_MAX,
    ACCEPT_PRESSURE,
    ACCEPT_TRANSIENT,
    Admission,
    RequestRate,
    ServerLimits,
    ServerStats,
)
from .base import NotServing, Provider
from .deltas import DeltaServed, serve_delta
from .frames import encode_frame, recv_rest_of_frame, send_all, send_frame
from .handshake import DataAuth, check_reader
from .local import credentials, local_name, same_user
from .onesided.holder import LinkSlot, OneSidedHost, serve_onesided
from .samehost.holder import LeaseTerms, serve_shm
from .sockio import NBYTES, bytes_of, send_segments, tune

_BACKLOG = 128

RUN_WRITE_BYTES = 64 << 20
"""Bytes of a streamed run sent in one worker-thread write at most (leased together)."""

_LAST_CHUNK = 2**32 - 1  # the largest chunk index a ChunkReply can name

PROBE_PIECE = 1 << 20
_ZEROS = memoryview(bytes(PROBE_PIECE))
"""What a link probe is answered with, one piece after the other (shared: read only)."""


class TcpServer:
    """Serves a :class:`Provider` to readers.  ``on_sent(peer_addr, nbytes)`` counts
    what was served, ``on_bad(what)`` each connection closed for bad input."""

    def __init__(self, provider: Provider, on_sent: Callable[[str, int], None],
                 on_bad: Callable[[str], None], limits: ServerLimits | None = None,
                 auth: DataAuth | None = None, onesided: OneSidedHost | None = None
                 ) -> None:
        self.provider = provider
        self.onesided = onesided or OneSidedHost(())
        """The one-sided backends served (RDMA READ, CUDA IPC; :mod:`.onesided`)."""
        self.auth = auth
        """Set: every connection must prove a member identity first (:mod:`.handshake`)."""
        self.on_sent = on_sent
        self.on_bad = on_bad
        self.limits = limits or ServerLimits()
        self.port = 0
        self._admission = Admission(self.limits)
        self.delta = DeltaServed()
        """What delta runs (:mod:`.deltas`) cost and sent."""
        # Not a method of ours: a server in a reference cycle would keep its provider's
        # arrays, and their memory files, until the cyclic collector ran.
        self._terms = LeaseTerms(self.limits.lease_timeout, on_sent, self._admission.revoked)
        self._idle: dict[_ServerConn, tuple[float, trio.CancelScope]] = {}
        """TCP connections waiting for their next request, longest waiting first: a
        reader keeps its connection between reads, and one of these is closed to make
        room for a new connection rather than refusing it (:meth:`_make_room`)."""
        self._listener: trio.socket.SocketType | None = None
        self._local: trio.socket.SocketType | None = None
        """The same-host socket (:mod:`.local`): the only one answering Shm* requests."""

    def bind(self, host: str, port: int) -> int:
        """Bind the listening socket now, so a used port fails before anything starts."""
        plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        plain.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            plain.bind((host, port))
        except OSError as exc:
            plain.close()
            if exc.errno == errno.EADDRINUSE:
                raise TransportError(f"data address {host}:{port} is already in use") from None
            raise TransportError(f"cannot listen on {host}:{port}: {exc}") from None
        plain.listen(_BACKLOG)
        self._listener = trio.socket.from_stdlib_socket(plain)
        self.port = plain.getsockname()[1]
        local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            local.bind(local_name(f"{host}:{self.port}"))
        except OSError as exc:
            local.close()
            self._listener.close()
            raise TransportError(f"cannot listen for same-host readers of {host}:"
                                 f"{self.port}: {exc}") from None
        local.listen(_BACKLOG)
        self._local = trio.socket.from_stdlib_socket(local)
        return self.port

    def statistics(self) -> ServerStats:
        auth = "insecure: any client may read" if self.auth is None else \
            f"members: {len(self.auth.keyring.members())} in the keyring"
        return self._admission.statistics(auth)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        listener, local = self._listener, self._local
        if listener is None or local is None:
            raise RuntimeError("TcpServer.serve() before bind()")
        async with trio.open_nursery() as nursery:
            with listener, local:
                nursery.start_soon(self._accept_forever, local, nursery, True)
                task_status.started()
                await self._accept_forever(listener, nursery, False)

    async def _accept_forever(self, listener: trio.socket.SocketType,
                              nursery: trio.Nursery, local: bool) -> None:
        """Accept until cancelled.  Out of descriptors (or kernel memory), back off --
        the pending connection waits in the backlog -- and keep serving the open ones;
        over a cap, or (same-host socket) from another user, close the new connection at
        once (counted)."""
        backoff = 0.0
        admission = self._admission
        while True:
            try:
                sock, addr = await listener.accept()
            except OSError as exc:
                if exc.errno in ACCEPT_PRESSURE:
                    backoff = min(max(2 * backoff, 0.005), ACCEPT_BACKOFF_MAX)
                    admission.accept_failed(exc, backoff)
                    await trio.sleep(backoff)
                    continue
                if exc.errno in ACCEPT_TRANSIENT:
                    continue
                raise
            backoff = 0.0
            admission.accepted()
            if local:
                try:
                    pid, uid, _ = credentials(sock)
                except OSError:
                    sock.close()  # gone already
                    continue
                if not same_user(uid):
                    admission.counts["refused_credentials"] += 1
                    sock.close()
                    continue
                address, peer = f"uid {uid}", f"local pid {pid}"
            else:
                address, peer = str(addr[0]), f"{addr[0]}:{addr[1]}"
            if admission.crowded(address):
                self._make_room(address)
            if not admission.admit(address):
                sock.close()
                continue
            nursery.start_soon(self._serve_conn, sock, address, peer, local)

    def _make_room(self, address: str) -> None:
        """Close the connection that has waited longest for a request -- from
        ``address`` if that address is at its cap -- if it has waited at least
        ``evict_idle_after``, and free its slot now."""
        adm = self._admission
        per_address = adm.open_by_address[address] >= self.limits.max_connections_per_address
        victim = next((c for c in self._idle if not per_address or c.address == address),
                      None)
        if victim is None:
            return
        since, scope = self._idle[victim]
        if trio.current_time() - since < self.limits.evict_idle_after:
            return
        del self._idle[victim]
        scope.cancel()
        victim.evicted = True
        adm.release(victim.address)
        adm.counts["idle_evicted"] += 1

    async def _serve_conn(self, sock: trio.socket.SocketType, address: str,
                          peer: str, local: bool) -> None:
        conn = _ServerConn(self, sock, address, peer, local)
        try:
            with sock:
                await conn.serve()
        finally:
            conn.close()
            if not conn.evicted:  # an evicted one's slot was freed already
                self._admission.release(address)


class _ServerConn:
    """One reader's connection, as its server task sees it."""

    def __init__(self, server: TcpServer, sock: trio.socket.SocketType, address: str,
                 peer: str, local: bool) -> None:
        self.server = server
        self.sock = sock
        self.address = address
        self.evicted = False
        self.peer = peer
        self.local = local
        """A same-host connection (Unix socket, the same user): Shm* requests allowed."""
        self.counts = server._admission.counts
        self.limits = server.limits
        self._plain: socket.socket | None = None
        self.slot = LinkSlot()
        """The one-sided link this reader opened, if any (closed with the connection)."""

    def close(self) -> None:
        self.slot.close()
        if self._plain is not None:
            self._plain.close()

    def plain(self) -> socket.socket | None:
        """The thread-side twin of the connection (same socket, duplicated descriptor),
        or None when the process is out of descriptors.  Its timeout bounds one send: a
        reader that stops taking a chunk for ``lease_timeout`` loses the connection and
        the holder its lease."""
        if self._plain is None:
            try:
                fd = socket.dup(self.sock.fileno())
            except OSError as exc:
                if exc.errno in ACCEPT_PRESSURE:
                    return None
                raise
            self._plain = socket.socket(fileno=fd)
            self._plain.settimeout(self.limits.lease_timeout)
        return self._plain

    async def serve(self) -> None:
        rate = RequestRate(self.limits.requests_per_second, trio.current_time())
        try:
            if not self.local:
                tune(self.sock)
            if self.server.auth is not None and not await self.authenticate(self.server.auth):
                return
            while True:
                req = await self.next_request()
                if req is None:
                    return
                wait = rate.delay(trio.current_time(), self.cost(req))
                if wait:
                    self.counts["throttled"] += 1
                    await trio.sleep(wait)
                await self.answer(req)
        except (TransportError, OSError):
            return  # the reader went away or reset the connection; nothing to clean up
        except Exception as exc:  # RemoteProtocolError, or a bug some request met
            # One reader's bad input ends its connection, never the server (nor the peer
            # whose nursery runs it): counted and reported, with the type when it is not
            # a protocol error.  No input is known to raise anything else; one did until
            # a version lease reported protocol errors as an exception group.
            self.counts["bad_frames"] += 1
            what = str(exc) if isinstance(exc, RemoteProtocolError) else \
                f"{type(exc).__name__} answering a request: {exc}"
            self.server.on_bad(f"{self.peer}: {what}")

    def cost(self, req: Any) -> int:
        """Tokens of the request rate ``req`` takes: a run one per chunk, a link probe
        one per :data:`PROBE_PIECE` it is answered with, anything else one."""
        if isinstance(req, ChunkRunRequest | DeltaRunRequest | OneSidedRunRequest):
            return int(req.count)
        if isinstance(req, ProbeRequest):
            return 1 + min(req.nbytes, self.limits.probe_bytes) // PROBE_PIECE
        return 1

    async def authenticate(self, auth: DataAuth) -> bool:
        """The reader proves a member identity (within ``frame_timeout``) before any
        request is read; a refusal or a stall ends the connection (counted)."""
        with trio.move_on_after(self.limits.frame_timeout):
            try:
                self.peer = f"{await check_reader(self.sock, auth)} at {self.peer}"
            except TransportError:
                self.counts["refused_auth"] += 1
                return False
            return True
        self.counts["refused_auth"] += 1
        return False

    async def next_request(self) -> Any:
        """The next request, or None when the reader closed the connection, left it
        idle for ``idle_timeout`` or took over ``frame_timeout`` to send a frame."""
        head = bytearray(FRAME_HEADER)
        got = -1
        with trio.move_on_after(self.limits.idle_timeout) as idle:
            # Between requests a TCP connection holds nothing but its slot, so it may be
            # closed for a new one; a same-host one may hold a version lease: never.
            if not self.local:
                self.server._idle[self] = (trio.current_time(), idle)
            try:
                got = await self.sock.recv_into(head, FRAME_HEADER)
            finally:
                self.server._idle.pop(self, None)
        if self.evicted:
            return None
        if got <= 0:
            self.counts["idle_closed"] += got < 0
            return None
        with trio.move_on_after(self.limits.frame_timeout):
            return await recv_rest_of_frame(self.sock, head, got)
        self.counts["frame_timeouts"] += 1
        return None

    async def answer(self, req: Any) -> None:
        provider, sock = self.server.provider, self.sock
        if isinstance(req, ManifestRequest):
            try:
                key = VersionKey(req.model, req.version, req.shard, req.layout)
                data = provider.manifest_bytes(key)
            except NotServing as ns:
                await send_frame(sock, Reply(req.req_id, ns.status, 0, ns.detail))
                return
            await send_frame(sock, Reply(req.req_id, OK, len(data)))
            await send_all(sock, memoryview(data))
        elif isinstance(req, ProbeRequest):
            await self.send_probe(req)
        elif isinstance(req, ChunkRequest):
            await self.send_chunk(req)
        elif isinstance(req, ChunkRunRequest):
            await self.send_run(req)
        elif isinstance(req, DeltaRunRequest):
            await serve_delta(self.send_views, partial(self.server.on_sent, self.peer),
                              provider, req, self.server.delta)
        elif isinstance(req, ShmHello | ShmChunkRequest | ShmVersionRequest):
            if not self.local:  # a remote client never gets a lease on our memory
                self.counts["shm_over_tcp"] += 1
                await send_frame(sock, Reply(req.req_id, BAD_REQUEST, 0, "same-host "
                                             "requests are answered on the local socket only"))
                return
            await serve_shm(sock, self.peer, provider, req, self.server._terms)
        elif isinstance(req, OneSidedHello | OneSidedChunkRequest | OneSidedRunRequest):
            await serve_onesided(sock, self.peer, provider, self.server.onesided, self.slot,
                                 req, self.local, self.server._terms)
        else:
            await send_frame(sock, Reply(0, BAD_REQUEST, 0, f"unexpected {type(req).__name__}"))
            raise RemoteProtocolError(f"unexpected message {type(req).__name__}")

    async def send_probe(self, req: ProbeRequest) -> None:
        """Answer a link probe: ``req.nbytes`` zeros, at most ``limits.probe_bytes``
        (one request at a time on a connection, like every other; charged to its request
        rate a piece of :data:`PROBE_PIECE` at a time)."""
        cap = self.limits.probe_bytes
        if cap == 0:
            await send_frame(self.sock, Reply(req.req_id, BAD_REQUEST, 0,
                                              "link probes are off here"))
            return
        n = min(req.nbytes, cap)
        if n == 0:  # a round trip alone: answered at once, from the event loop
            await send_frame(self.sock, Reply(req.req_id, OK, 0))
            return
        whole, rest = divmod(n, PROBE_PIECE)
        await self.send_views([memoryview(encode_frame(Reply(req.req_id, OK, n))),
                               *([_ZEROS] * whole), _ZEROS[:rest]])
        self.counts["probes"] += 1
        self.counts["probe_bytes"] += n

    async def send_chunk(self, req: ChunkRequest) -> None:
        provider = self.server.provider
        key = VersionKey(req.model, req.version, req.shard, req.layout)
        try:
            await provider.wait_chunk(key, req.chunk)
            lease = _pieces(provider, key, req.chunk)
            segments, total = lease.__enter__()
        except NotServing as ns:
            await send_frame(self.sock, Reply(req.req_id, ns.status, 0, ns.detail))
            return
        try:
            await self.send_views([memoryview(encode_frame(Reply(req.req_id, OK, total))),
                                   *segments])
            self.server.on_sent(self.peer, total)
        finally:
            lease.__exit__(None, None, None)

    async def send_run(self, req: ChunkRunRequest) -> None:
        """Stream the run's chunks, each with its own :class:`ChunkReply`: those held
        verified now are leased together and sent in one write (up to
        :data:`RUN_WRITE_BYTES`); before a chunk still arriving, what is ready goes out
        and the chunk is waited for.  A wait that ends without the chunk answers it
        ``NOT_YET``, and the rest of the run is answered as it stands, without waiting."""
        last = req.first + req.count - 1
        if last > _LAST_CHUNK:
            raise RemoteProtocolError(f"run of chunks {req.first}..{last} passes the last "
                                      f"chunk index {_LAST_CHUNK}")
        provider = self.server.provider
        key = VersionKey(req.model, req.version, req.shard, req.layout)
        waited_out = False
        with ExitStack() as leases:
            views: list[Any] = []
            served: list[int] = []  # payload bytes of the chunks in ``views``

            async def flush() -> None:
                if views:
                    await self.send_views(views)
                    for n in served:
                        self.server.on_sent(self.peer, n)
                    views.clear()
                    served.clear()
                leases.close()  # ends every lease of what was just sent

            for chunk in range(req.first, last + 1):
                try:
                    try:
                        segments, total = leases.enter_context(_pieces(provider, key, chunk))
                    except NotServing as ns:
                        if ns.status != NOT_YET or waited_out:
                            raise
                        await flush()
                        await provider.wait_chunk(key, chunk)
                        try:
                            segments, total = leases.enter_context(
                                _pieces(provider, key, chunk))
                        except NotServing as again:
                            waited_out = again.status == NOT_YET
                            raise
                except NotServing as ns:
                    views.append(memoryview(encode_frame(
                        ChunkReply(req.req_id, chunk, ns.status, 0, ns.detail))))
                    continue
                views += [memoryview(encode_frame(ChunkReply(req.req_id, chunk, OK, total))),
                          *segments]
                served.append(total)
                if sum(served) >= RUN_WRITE_BYTES:
                    await flush()
            await flush()

    async def send_views(self, views: list[Any]) -> None:
        """Send ``views`` (headers and leased payload: any C-contiguous buffers) in one
        vectored write from a worker thread; a reader that takes none of it for
        ``lease_timeout`` loses the connection."""
        twin = self.plain()
        try:
            if twin is None:  # out of descriptors: slower, from the event loop
                with trio.fail_after(self.limits.lease_timeout):
                    for view in views:
                        await send_all(self.sock, bytes_of(view))
            else:
                await _send_from_thread(twin, views)
        except (TimeoutError, trio.TooSlowError):
            self.counts["leases_revoked"] += 1
            raise TransportError(f"{self.peer} took no chunk for "
                                 f"{self.limits.lease_timeout}s") from None


def _pieces(provider: Provider, key: VersionKey, chunk: int
            ) -> AbstractContextManager[tuple[Sequence[Any], int]]:
    """A lease of the chunk's memory, and its size, as whatever buffers the provider can
    hand out without a view per tensor (``lease_pieces``, where it has one), else as
    views."""
    lease = getattr(provider, "lease_pieces", None)
    return lease(key, chunk) if lease is not None else _sized(provider.lease(key, chunk))


@contextmanager
def _sized(lease: AbstractContextManager[Sequence[Any]]) -> Iterator[tuple[Sequence[Any], int]]:
    with lease as segments:
        yield segments, sum(map(NBYTES, segments))


async def _send_from_thread(twin: socket.socket, views: list[Any]) -> None:
    """Send ``views`` on ``twin`` in a worker thread and wait for it, even when cancelled:
    the thread reads leased memory, so the lease must outlive it.  A cancelled send is
    cut short by shutting the connection down (the thread's send then fails at once)."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    result: list[outcome.Outcome[None]] = []

    def deliver(out: outcome.Outcome[None]) -> None:
        result.append(out)
        with suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    trio.lowlevel.start_thread_soon(partial(send_segments, twin, views), deliver,
                                    name="tensorhub chunk send")
    try:
        await done.wait()
    except trio.Cancelled:
        with suppress(OSError):
            twin.shutdown(socket.SHUT_RDWR)
        with trio.CancelScope(shield=True):
            await done.wait()
        raise
    result[0].unwrap()
