"""One-sided transport, reader side: the reader's NIC (or GPU) reads the holder's
registered memory itself (RDMA READ, a CUDA IPC copy); the data connection carries
control only.  See :mod:`tensorhub.protocol.onesided` for the protocol, :mod:`.holder`
for the holder side.

A connection opens a link at connect (``OneSidedHello``: the queue pairs of RDMA are
set up through it), then reads each chunk as: request a lease, check the grant, read
the granted ranges into the destination (registered once per destination buffer,
:mod:`.registry`), verify, check that the holder is still connected (a holder that cut
us off let go of the lease, so bytes read across that are never used), and end the
lease (``OneSidedDone``).  The reads and the verification run in one worker-thread
call.  A stream asks for runs of consecutive chunks (up to ``batch_bytes``) in one
request, reads each chunk as its grant arrives and ends the run's leases at once.
"""

from __future__ import annotations

import select
from collections.abc import Callable, Sequence

import trio

from ...errors import LocalProtocolError, RemoteProtocolError, TransportError
from ...model import VersionKey
from ...protocol.dataplane import MAX_RUN_CHUNKS, OK, WRONG_TRANSPORT, ChunkReply, Reply
from ...protocol.onesided import (
    OneSidedChunkRequest,
    OneSidedDone,
    OneSidedGrant,
    OneSidedHello,
    OneSidedRunRequest,
    OneSidedWelcome,
    RemoteRange,
    granted_ranges,
)
from ...protocol.sizing import StreamWindow
from .. import copy_threads
from ..base import Landed, NotServing, Take, Verifier, read_each, stream_each
from ..frames import recv_frame, send_frame
from ..handshake import DataAuth
from ..local import credentials, local_name, same_user
from ..sockio import tune
from ..tcp import TcpConnection, dial, greeted
from .backend import Backend, Link, Region, pair_up, read_ranges
from .registry import Registrations

READ_TIMEOUT = 120.0
"""Seconds a posted read may take to complete: a safety net (the fetcher's stall
timeout notices a slow source first)."""

_HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR


def _land(link: Link, reads: list[tuple[Region, int, int, bytes, int]], depth: int,
          dest: Sequence[memoryview], verify: Verifier | None) -> Exception | None:
    """Read, then verify: one worker-thread call.  Returns (does not raise) what
    ``verify`` raised, so the lease still ends in step."""
    read_ranges(link, reads, depth, READ_TIMEOUT)
    try:
        if verify is not None:
            verify(dest)
    except Exception as exc:
        return exc
    return None


class OneSidedConnection(TcpConnection):
    """A reader's connection that reads with a one-sided :class:`~.backend.Backend`."""

    lands_arrays = False
    holder_shares_memory = False
    """Set for a same-host backend: the kernel's credentials of the holder's end of
    the same-host socket show its user (see ``Connection.holder_shares_memory``)."""
    batch_bytes = 64 << 20
    """Bytes of consecutive chunks a stream hands one :meth:`read_chunks`: one round
    trip leases them all."""

    def __init__(self, sock: trio.socket.SocketType, peer: str, backend: Backend,
                 registrations: Registrations,
                 on_refused: Callable[[str], None] | None = None) -> None:
        super().__init__(sock, peer)
        self.transport = backend.name
        self.lands_device = backend.device_memory
        self._backend = backend
        self._reg = registrations
        self._on_refused = on_refused
        self._link: Link | None = None
        self._poll: select.poll | None = None

    @classmethod
    async def open(cls, address: str, peer: str, timeout: float,
                   registrations: Registrations, auth: DataAuth | None = None,
                   on_refused: Callable[[str], None] | None = None) -> OneSidedConnection:
        """Connect to the data server of ``peer`` at ``address`` (its same-host socket
        for a same-host backend), authenticate as over TCP, and open a link with
        ``registrations.backend``; fails with a :class:`TransportError` naming the
        reason when the holder does not serve it.  ``on_refused(why)`` is called when
        the holder later says a chunk cannot be read this way (the read then fails
        with a :class:`TransportError`: read it over another transport)."""
        backend = registrations.backend
        if backend.same_host:
            sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
            where: object = local_name(address)
        else:
            sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
            tune(sock)
            host, _, port = address.rpartition(":")
            where = (host, int(port))
        await dial(sock, where, peer, timeout, auth,
                   f"cannot connect to {peer} at {address} for {backend.name}")
        conn = cls(sock, peer, backend, registrations, on_refused)
        if backend.same_host:
            conn.holder_shares_memory = same_user(credentials(sock)[1])
        return await greeted(conn, conn._hello, timeout,
                             f"{peer} did not open a {backend.name} link")

    async def _hello(self) -> None:
        req_id = next(self._ids)
        dialing = self._backend.dial()
        try:
            await send_frame(self._sock, OneSidedHello(req_id, self._backend.name,
                                                       dialing.endpoint))
            msg = await recv_frame(self._sock)
            if isinstance(msg, Reply) and msg.req_id == req_id and msg.status != OK:
                raise TransportError(f"{self.peer} does not serve {self._backend.name}: "
                                     f"{msg.detail}")
            if not isinstance(msg, OneSidedWelcome) or msg.req_id != req_id:
                raise RemoteProtocolError(f"{self.peer} answered the link setup out of turn")
            self._link = dialing.connect(msg.endpoint)
        finally:
            if self._link is None:
                dialing.close()

    async def _grant(self, req_id: int, want: int) -> list[RemoteRange]:
        ranges: list[RemoteRange] = []
        while True:
            msg = await recv_frame(self._sock)
            if isinstance(msg, Reply) and msg.req_id == req_id and msg.status != OK:
                raise self._refusal(msg.status, msg.detail)
            if not isinstance(msg, OneSidedGrant) or msg.req_id != req_id:
                raise RemoteProtocolError(f"{self.peer} answered out of turn")
            try:
                ranges += granted_ranges(msg, want, sum(n for _, n, _ in ranges))
            except RemoteProtocolError as exc:
                raise RemoteProtocolError(f"{self.peer}: {exc}") from None
            if not msg.more:
                return ranges

    def _check_holder(self, in_run: bool = False) -> None:
        """Fail unless the holder is still connected -- and silent, unless ``in_run``
        (where grants of the next chunks may be waiting) -- after every read."""
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self._sock.fileno(), select.POLLIN | select.POLLRDHUP)
        for _fd, events in self._poll.poll(0):
            if events & _HUNG_UP:
                raise TransportError(f"{self.peer} ended the connection during the read")
            if not in_run:
                raise TransportError(f"{self.peer} spoke out of turn during the read")

    async def _read_granted(self, link: Link, req_id: int, dest: Sequence[memoryview],
                            verify: Verifier | None) -> Exception | None:
        """Take the grant of request ``req_id`` for ``dest``, read it, verify: what
        ``verify`` raised, if anything."""
        ranges = await self._grant(req_id, sum(d.nbytes for d in dest))
        local, transient = self._reg.local_pieces(dest)
        try:
            bad: Exception | None = await copy_threads.pool.run(
                _land, link, pair_up(local, ranges), self._backend.depth, dest, verify)
            return bad
        finally:
            self._reg.release(transient)

    def _link_for(self, key: VersionKey, dests: Sequence[Sequence[memoryview]]) -> Link:
        if self._sock.fileno() < 0 or self._link is None:
            raise TransportError(f"connection to {self.peer} is closed")
        if any(d.readonly for dest in dests for d in dest):
            raise LocalProtocolError(f"a destination of {key} is read-only")
        return self._link

    async def read_chunk(self, key: VersionKey, chunk: int, dest: Sequence[memoryview],
                         verify: Verifier | None = None) -> int:
        link = self._link_for(key, [dest])
        req_id = next(self._ids)
        try:
            await send_frame(self._sock, OneSidedChunkRequest(
                req_id, key.model, key.version, chunk, key.shard, key.layout))
            bad = await self._read_granted(link, req_id, dest, verify)
            self._check_holder()
            await send_frame(self._sock, OneSidedDone(req_id))
        except NotServing:
            raise  # in step: a whole reply was read, nothing is leased
        except BaseException:
            self._close()  # out of step; closing ends the holder's lease and our link
            raise
        if bad is not None:
            raise bad
        return sum(d.nbytes for d in dest)

    async def read_chunks(self, key: VersionKey, chunks: Sequence[int],
                          dests: Sequence[Sequence[memoryview]],
                          verifies: Sequence[Verifier | None]) -> list[int | Exception]:
        """Consecutive chunks leased in one round trip (``OneSidedRunRequest``), each
        read as its grant arrives; any other list, one read after another."""
        first = chunks[0] if chunks else -1
        if not 2 <= len(chunks) <= MAX_RUN_CHUNKS or first < 0 \
                or list(chunks) != list(range(first, first + len(chunks))):
            return await read_each(self, key, chunks, dests, verifies)
        link = self._link_for(key, dests)
        req_id = next(self._ids)
        out: list[int | Exception] = []
        try:
            await send_frame(self._sock, OneSidedRunRequest(
                req_id, key.model, key.version, first, len(chunks), key.shard, key.layout))
            granted = False
            for chunk, dest, verify in zip(chunks, dests, verifies, strict=True):
                want = sum(d.nbytes for d in dest)
                head = await recv_frame(self._sock)
                if not isinstance(head, ChunkReply) or head.req_id != req_id \
                        or head.chunk != chunk or (head.status == OK and head.length != want):
                    raise RemoteProtocolError(f"{self.peer} answered a run out of turn")
                if head.status == OK:
                    granted = True
                    bad = await self._read_granted(link, req_id, dest, verify)
                    self._check_holder(in_run=True)
                    out.append(want if bad is None else bad)
                else:
                    out.append(self._refusal(head.status, head.detail))
            if granted:
                self._check_holder()
                await send_frame(self._sock, OneSidedDone(req_id))
        except BaseException as exc:
            self._close()
            if not out or not isinstance(exc, Exception):
                raise
            out.append(exc)  # the chunks before it were read, under the lease
        return out

    def _refusal(self, status: int, detail: str) -> Exception:
        """What a non-OK answer means to the reader; a chunk the holder cannot serve
        over this backend also tells ``on_refused``."""
        if status != WRONG_TRANSPORT:
            return NotServing(status, detail or f"status {status}")
        why = f"{self.peer} {detail}"
        if self._on_refused is not None:
            self._on_refused(why)
        return TransportError(why)

    async def stream_chunks(self, key: VersionKey, take: Take, landed: Landed,
                            window: StreamWindow) -> None:
        """Runs of up to ``batch_bytes``, one after another: the payload does not cross
        the data connection, so only the leases' round trips are to be shared."""
        await stream_each(self, key, take, landed)

    def _close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
        self._poll = None
        self._sock.close()

    def close(self) -> None:
        self._close()

    async def aclose(self) -> None:
        self._close()
