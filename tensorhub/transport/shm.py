"""Same-host data plane: one copy, straight from the holder's arrays into the reader's.

A reader on the holder's host uses the ordinary TCP data connection
(:mod:`tensorhub.transport.tcp`) for control only.  For each chunk it sends a
``ShmChunkRequest``; the holder leases the chunk and says where its bytes lie.  If they
lie in shared memory files (arrays from :func:`tensorhub.transport.shmem.shared_empty`,
and every fetched version) the grant names the files (``ShmFileGrant``) and the reader
maps their pages read-only and copies them with an ordinary memory copy (transport name
``shm-memfd``); otherwise it names addresses (``ShmGrant``) and the reader copies with
Linux cross-memory attach, ``process_vm_readv`` (transport name ``shm``), about half as
fast.  The copy and the digest check run in one worker-thread call, while the bytes are
still in cache; then the reader sends ``ShmDone`` and the holder ends the lease.  No
payload byte touches a socket and nothing is staged.

Three checks make this safe.  At connect the holder sends its pid and a random token that
lies in its memory (``ShmWelcome``); reading the token back proves that the reader shares
the holder's host and pid namespace and is allowed to read its memory (the kernel's
ptrace rules: same user, ``kernel.yama.ptrace_scope`` 0, no seccomp filter).  The holder
keeps the lease until ``ShmDone`` or until the connection ends, so unpublish's drain
covers every copy in flight.  And after each copy the reader checks, through a pidfd and
the socket, that the holder is still alive and still connected: a holder that died or let
go of the lease during a copy makes the read fail instead of returning bytes that may have
changed under it.  A memory file is used only if it is the very file granted (its inode
matches: descriptor numbers get reused), sealed against shrinking (so a mapping cannot
fault past its end) and long enough for the piece granted.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from ..errors import LocalProtocolError, RemoteProtocolError, TransportError
from ..model import VersionKey
from ..protocol.dataplane import (
    OK,
    Reply,
    ShmChunkRequest,
    ShmDone,
    ShmFileGrant,
    ShmGrant,
    ShmHello,
    ShmWelcome,
)
from .base import NotServing, Provider, Verifier
from .shmem import MappedFiles, Pieces, address_of, pieces_of
from .tcp import TcpConnection, _recv_frame, _send_frame

Iovecs = npt.NDArray[np.uint64]
"""``(address, length)`` rows: the layout of Linux ``struct iovec`` on 64-bit hosts."""

IOV_MAX = 1024  # iovecs per process_vm_readv call, on each side
GRANT_IOVECS = 32768  # iovecs per ShmGrant frame: 512 KiB, well under MAX_FRAME
GRANT_PIECES = 16384  # pieces per ShmFileGrant frame: 512 KiB

_libc = ctypes.CDLL(None, use_errno=True)
_vm_readv: Any = getattr(_libc, "process_vm_readv", None)
if _vm_readv is not None:
    _vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                          ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _vm_readv.restype = ctypes.c_ssize_t

_WHY = {
    errno.EPERM: "not permitted: another user, or kernel.yama.ptrace_scope or a seccomp "
                 "filter forbids process_vm_readv",
    errno.ESRCH: "no such process: the holder is gone",
    errno.EFAULT: "an address is not mapped: the holder granted memory it does not have",
    errno.ENOSYS: "this kernel has no process_vm_readv",
}


def iovecs_of(views: Sequence[memoryview]) -> Iovecs:
    """The ``(address, length)`` of each non-empty view, neighbours in memory merged."""
    iov = np.array([(address_of(v), v.nbytes) for v in views if v.nbytes],
                   dtype=np.uint64).reshape(-1, 2)
    if len(iov) > 1:
        starts = np.flatnonzero(np.r_[True, iov[1:, 0] != iov[:-1, 0] + iov[:-1, 1]])
        iov = np.column_stack((iov[starts, 0], np.add.reduceat(iov[:, 1], starts)))
    return iov


class _Cursor:
    """A position in a list of iovecs, handed to the kernel IOV_MAX at a time."""

    def __init__(self, iov: Iovecs) -> None:
        self.iov = iov
        self.row = 0
        self.skip = 0  # bytes of ``iov[row]`` already consumed

    def batch(self) -> Iovecs:
        out = self.iov[self.row:self.row + IOV_MAX].copy()
        out[0, 0] += self.skip
        out[0, 1] -= self.skip
        return out

    def advance(self, n: int) -> None:
        lengths = self.iov[self.row:self.row + IOV_MAX, 1].astype(np.int64)
        ends = np.cumsum(lengths) - self.skip
        done = int(np.searchsorted(ends, n, side="right"))
        if done:
            self.row += done
            self.skip = n - int(ends[done - 1])
        else:
            self.skip += n


def _readv_all(pid: int, local: Iovecs, remote: Iovecs) -> None:
    """Copy ``remote`` (memory of process ``pid``) into ``local``; same total length."""
    if _vm_readv is None:
        raise TransportError("this platform has no process_vm_readv")
    left = int(local[:, 1].sum())
    mine, theirs = _Cursor(local), _Cursor(remote)
    while left:
        lb, rb = mine.batch(), theirs.batch()
        n = _vm_readv(pid, lb.ctypes.data, len(lb), rb.ctypes.data, len(rb), 0)
        if n <= 0:
            err = ctypes.get_errno() if n < 0 else errno.EFAULT
            why = _WHY.get(err) or os.strerror(err)
            raise TransportError(f"reading holder pid {pid}: {errno.errorcode.get(err)}: {why}")
        mine.advance(n)
        theirs.advance(n)
        left -= n


def shm_available() -> tuple[bool, str]:
    """Whether this host lets peers read each other's memory, and why (not)."""
    if _vm_readv is None:
        return False, "this platform has no process_vm_readv (Linux only)"
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        scope = 0
    if scope:
        return False, (f"kernel.yama.ptrace_scope={scope} forbids reading another process's "
                       "memory; set it to 0 to move chunks through shared memory")
    src, dst = bytearray(b"tensorhub"), bytearray(9)
    try:
        _readv_all(os.getpid(), iovecs_of([memoryview(dst)]), iovecs_of([memoryview(src)]))
        os.close(os.pidfd_open(os.getpid()))  # how a reader watches its holder
    except TransportError as exc:
        return False, str(exc)
    except OSError as exc:
        return False, f"pidfd_open: {exc.strerror} (needs Linux 5.3)"
    return True, "process_vm_readv works: one copy, no socket on the payload path"


# -- holder side: TcpServer hands ShmHello / ShmChunkRequest here ----------------------

_token = b""
_token_at = 0


def _new_token() -> None:
    global _token, _token_at
    _token = os.urandom(16)
    _token_at = address_of(memoryview(_token))


_new_token()
os.register_at_fork(after_in_child=_new_token)


def _flipped_copy(segments: Sequence[memoryview]) -> memoryview:
    """Test hook (``Provider.corrupt_hook``): a private copy with one byte flipped."""
    buf = bytearray(b"".join(segments))
    if buf:
        buf[0] ^= 0xFF
    return memoryview(buf)


async def serve_shm(sock: trio.socket.SocketType, peer: str, provider: Provider,
                    req: ShmHello | ShmChunkRequest,
                    on_sent: Callable[[str, int], None]) -> None:
    """Answer one same-host request; a chunk stays leased until the reader's ShmDone."""
    if isinstance(req, ShmHello):
        await _send_frame(sock, ShmWelcome(req.req_id, os.getpid(), _token, _token_at))
        return
    key = VersionKey(req.model, req.version, req.shard, req.layout)
    with ExitStack() as stack:
        try:
            await provider.wait_chunk(key, req.chunk)
            segments = stack.enter_context(provider.lease(key, req.chunk))
        except NotServing as ns:
            await _send_frame(sock, Reply(req.req_id, ns.status, 0, ns.detail))
            return
        if provider.corrupt_hook(peer):
            segments = [_flipped_copy(segments)]
        files = pieces_of(segments)
        rows, grant, per_frame = ((iovecs_of(segments), ShmGrant, GRANT_IOVECS) if files is None
                                  else (files, ShmFileGrant, GRANT_PIECES))
        total = int(rows[:, -1].sum())
        for start in range(0, max(len(rows), 1), per_frame):
            part = rows[start:start + per_frame].astype("<u8").tobytes()
            await _send_frame(sock, grant(req.req_id, total, part, start + per_frame < len(rows)))
        try:
            done = await _recv_frame(sock)
        except TransportError:
            return  # the reader went away; its lease ends here
        if done != ShmDone(req.req_id):
            raise RemoteProtocolError(f"expected ShmDone({req.req_id}), got {done!r:.80}")
        on_sent(peer, total)


# -- reader side --------------------------------------------------------------------


def _land_iovecs(pid: int, local: Iovecs, remote: Iovecs, dest: Sequence[memoryview],
                 verify: Verifier | None) -> Exception | None:
    """Copy with ``process_vm_readv``, then verify: one worker-thread call.  Returns
    (does not raise) what ``verify`` raised, so the lease still ends in step."""
    _readv_all(pid, local, remote)
    return _verified(dest, verify)


def _verified(dest: Sequence[memoryview], verify: Verifier | None) -> Exception | None:
    try:
        if verify is not None:
            verify(dest)
    except Exception as exc:  # raised by the reader once ShmDone is sent
        return exc
    return None


def _land_files(files: MappedFiles, pieces: Pieces, dest: Sequence[memoryview],
                verify: Verifier | None) -> Exception | None:
    """Copy from the holder's memory files, then verify: one worker-thread call."""
    files.copy(pieces, dest)
    return _verified(dest, verify)


class ShmConnection(TcpConnection):
    """A reader's same-host connection: TCP for control, ``process_vm_readv`` for payload.

    Manifests travel over TCP as usual.  :meth:`connect` fails with a
    :class:`TransportError` naming the reason when the holder's memory cannot be read.
    """

    transport = "shm"
    """``shm-memfd`` once the last chunk came from the holder's memory files, ``shm`` when
    it came through ``process_vm_readv``."""

    def __init__(self, sock: trio.socket.SocketType, peer: str) -> None:
        super().__init__(sock, peer)
        self._pid = 0
        self._pidfd = -1
        self._files = MappedFiles(peer)

    @classmethod
    async def connect(cls, address: str, peer: str, timeout: float) -> ShmConnection:
        conn = await super().connect(address, peer, timeout)
        assert isinstance(conn, ShmConnection)
        try:
            with trio.fail_after(timeout):
                await conn._hello()
        except trio.TooSlowError:
            await conn.aclose()
            raise TransportError(f"{peer} did not answer the shared-memory handshake "
                                 f"within {timeout}s") from None
        except BaseException:
            await conn.aclose()
            raise
        return conn

    async def _hello(self) -> None:
        req_id = next(self._ids)
        await _send_frame(self._sock, ShmHello(req_id))
        welcome = await _recv_frame(self._sock)
        if isinstance(welcome, Reply):
            raise TransportError(f"{self.peer} does not serve shared memory: {welcome.detail}")
        if not isinstance(welcome, ShmWelcome) or welcome.req_id != req_id:
            raise RemoteProtocolError(f"{self.peer} answered the handshake out of turn")
        if not (0 < welcome.pid < 1 << 31 and 0 <= welcome.token_at < 1 << 64
                and 8 <= len(welcome.token) <= 64):
            raise RemoteProtocolError(f"{self.peer} sent a malformed ShmWelcome")
        elsewhere = (f"{self.peer} (pid {welcome.pid} by its own account) is not a process "
                     "whose memory this one can read")
        try:
            self._pidfd = os.pidfd_open(welcome.pid)
        except OSError as exc:
            raise TransportError(f"{elsewhere}: {exc.strerror}; it runs on another host "
                                 "or in another pid namespace") from None
        self._pid = self._files.pid = welcome.pid
        echo = bytearray(len(welcome.token))
        token_at = np.array([[welcome.token_at, len(echo)]], dtype=np.uint64)
        try:
            _readv_all(self._pid, iovecs_of([memoryview(echo)]), token_at)
        except TransportError as exc:
            raise TransportError(f"{elsewhere}: {exc}") from None
        if echo != welcome.token:
            raise TransportError(f"{elsewhere}: pid {self._pid} here is another process; "
                                 "the holder runs on another host or in another pid namespace")
        self._check_holder()

    def _check_holder(self) -> None:
        """Fail unless the holder is alive and the connection open (after every copy)."""
        poll = select.poll()
        poll.register(self._pidfd, select.POLLIN)
        poll.register(self._sock.fileno(), select.POLLIN | select.POLLRDHUP)
        ready = dict(poll.poll(0))
        if self._pidfd in ready:
            raise TransportError(f"{self.peer} (pid {self._pid}) exited during the copy")
        if ready:
            raise TransportError(f"{self.peer} closed the connection (or spoke out of turn) "
                                 "during the copy")

    async def _grant(self, req_id: int, want: int) -> tuple[bool, npt.NDArray[np.uint64]]:
        """Whether request ``req_id`` was granted memory files, and the holder's pieces
        (``(fd, inode, offset, length)``) or iovecs, checked to add up to ``want``."""
        parts: list[npt.NDArray[np.uint64]] = []
        got = 0
        kind: type | None = None
        while True:
            msg = await _recv_frame(self._sock)
            if isinstance(msg, Reply) and msg.req_id == req_id and msg.status != OK:
                raise NotServing(msg.status, msg.detail or f"status {msg.status}")
            if not isinstance(msg, ShmGrant | ShmFileGrant) or msg.req_id != req_id \
                    or kind not in (None, type(msg)):
                raise RemoteProtocolError(f"{self.peer} answered out of turn")
            kind = type(msg)
            if msg.length != want:
                raise RemoteProtocolError(
                    f"{self.peer} granted {msg.length} bytes for a {want}-byte chunk")
            raw, width = (msg.iovecs, 2) if isinstance(msg, ShmGrant) else (msg.pieces, 4)
            if len(raw) % (8 * width):
                raise RemoteProtocolError(f"{self.peer} sent a malformed grant")
            rows = np.frombuffer(raw, dtype="<u8").reshape(-1, width)
            lengths = rows[:, -1]
            if not (lengths > 0).all() or (msg.more and not len(rows)) \
                    or int(lengths.max(initial=0)) > want \
                    or (width == 4 and not ((rows[:, 0] < 1 << 31).all()
                                            and (rows[:, 2] < 1 << 62).all())):
                raise RemoteProtocolError(f"{self.peer} sent a malformed grant")
            got += int(lengths.sum())
            if got > want:
                raise RemoteProtocolError(f"{self.peer} granted more than {want} bytes")
            parts.append(rows.astype(np.uint64))
            if not msg.more:
                break
        if got != want:
            raise RemoteProtocolError(f"{self.peer} granted {got} of {want} bytes")
        return kind is ShmFileGrant, np.concatenate(parts)

    async def read_chunk(self, key: VersionKey, chunk: int, dest: Sequence[memoryview],
                         verify: Verifier | None = None) -> int:
        if self._sock.fileno() < 0:
            raise TransportError(f"connection to {self.peer} is closed")
        if any(d.readonly for d in dest):
            raise LocalProtocolError(f"destination of chunk {chunk} of {key} is read-only")
        want = sum(d.nbytes for d in dest)
        req_id = next(self._ids)
        try:
            await _send_frame(self._sock, ShmChunkRequest(
                req_id, key.model, key.version, chunk, key.shard, key.layout))
            files, rows = await self._grant(req_id, want)
            if files:
                self.transport = "shm-memfd"
                bad = await trio.to_thread.run_sync(_land_files, self._files, rows, dest,
                                                    verify)
            else:
                self.transport = "shm"
                bad = await trio.to_thread.run_sync(_land_iovecs, self._pid, iovecs_of(dest),
                                                    rows, dest, verify)
            self._check_holder()
            await _send_frame(self._sock, ShmDone(req_id))
            if bad is not None:
                raise bad
        except NotServing:
            raise  # a whole reply was read: in step, and nothing is leased
        except BaseException:
            self._close()  # out of step mid-exchange; closing ends the holder's lease
            raise
        return want

    def _close(self) -> None:
        self._sock.close()
        self._files.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    async def aclose(self) -> None:
        self._close()
