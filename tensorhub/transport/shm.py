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

Version leases.  A reader's first request for a version on a connection is a
``ShmVersionRequest``.  A holder that holds the version complete and wholly in memory
files answers with the pieces of the whole byte space (``ShmVersionGrant``) and keeps the
whole version leased (``Store.hold``: unpublish waits for it) until the reader's
``ShmRelease`` or the connection's end; the reader then computes each chunk's pieces
itself and reads every further chunk without a message -- one copy-and-verify call in a
pool thread per chunk, the holder checked alive and connected after each.  A reader
releases when it reads another version or a manifest, when it closes (the fetcher closes
its connections when the fetch ends), and when the holder unpublishes: the holder then
says ``ShmRevoke`` (the copy in flight is still covered) and the reader's next read is
refused (``NOT_HELD``).  Any other holder (still receiving, plain arrays, the corrupt
hook armed) answers the request as a ``ShmChunkRequest``, and the connection asks chunk
by chunk from then on.

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
import queue
import select
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import outcome
import trio

from ..errors import LocalProtocolError, RemoteProtocolError, TransportError
from ..model import VersionKey
from ..protocol.dataplane import (
    BAD_REQUEST,
    NOT_HELD,
    OK,
    Reply,
    ShmChunkRequest,
    ShmDone,
    ShmFileGrant,
    ShmGrant,
    ShmHello,
    ShmRelease,
    ShmRevoke,
    ShmVersionGrant,
    ShmVersionRequest,
    ShmWelcome,
)
from .base import NotServing, Provider, Verifier
from .shmem import MappedFiles, Pieces, address_of, pieces_of
from .tcp import TcpConnection, _recv_frame, _send_frame

_T = TypeVar("_T")

Iovecs = npt.NDArray[np.uint64]
"""``(address, length)`` rows: the layout of Linux ``struct iovec`` on 64-bit hosts."""

IOV_MAX = 1024  # iovecs per process_vm_readv call, on each side
GRANT_IOVECS = 32768  # iovecs per ShmGrant frame: 512 KiB, well under MAX_FRAME
GRANT_PIECES = 16384  # pieces per ShmFileGrant frame: 512 KiB
RELEASE_CHUNKS = 131072  # chunk indices per ShmRelease frame: 512 KiB

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
                    req: ShmHello | ShmChunkRequest | ShmVersionRequest,
                    on_sent: Callable[[str, int], None]) -> None:
    """Answer one same-host request; a chunk stays leased until the reader's ShmDone, a
    version until its ShmRelease (or the connection's end)."""
    if isinstance(req, ShmHello):
        await _send_frame(sock, ShmWelcome(req.req_id, os.getpid(), _token, _token_at))
        return
    key = VersionKey(req.model, req.version, req.shard, req.layout)
    corrupt = False
    if isinstance(req, ShmVersionRequest):
        hold = getattr(provider, "hold", None)  # Store.hold: a lease on a whole version
        if hold is not None:
            with hold(key) as local:
                pieces = None if local is None else _whole_version(local)
                if pieces is not None:
                    corrupt = provider.corrupt_hook(peer)
                    if not corrupt:
                        await _lease_version(sock, peer, local, req.req_id, pieces, on_sent)
                        return
    await _serve_chunk(sock, peer, provider, key, req.req_id, req.chunk, on_sent, corrupt)


async def _serve_chunk(sock: trio.socket.SocketType, peer: str, provider: Provider,
                       key: VersionKey, req_id: int, chunk: int,
                       on_sent: Callable[[str, int], None], corrupt: bool) -> None:
    with ExitStack() as stack:
        try:
            await provider.wait_chunk(key, chunk)
            segments = stack.enter_context(provider.lease(key, chunk))
        except NotServing as ns:
            await _send_frame(sock, Reply(req_id, ns.status, 0, ns.detail))
            return
        if corrupt or provider.corrupt_hook(peer):
            segments = [_flipped_copy(segments)]
        files = pieces_of(segments)
        rows, grant, per_frame = ((iovecs_of(segments), ShmGrant, GRANT_IOVECS) if files is None
                                  else (files, ShmFileGrant, GRANT_PIECES))
        total = int(rows[:, -1].sum())
        for start in range(0, max(len(rows), 1), per_frame):
            part = rows[start:start + per_frame].astype("<u8").tobytes()
            await _send_frame(sock, grant(req_id, total, part, start + per_frame < len(rows)))
        try:
            done = await _recv_frame(sock)
        except TransportError:
            return  # the reader went away; its lease ends here
        if done != ShmDone(req_id):
            raise RemoteProtocolError(f"expected ShmDone({req_id}), got {done!r:.80}")
        on_sent(peer, total)


_WHOLE: weakref.WeakKeyDictionary[Any, Pieces | None] = weakref.WeakKeyDictionary()
"""Per held version (a ``LocalVersion``): where its whole byte space lies in memory
files, or None when some of it lies in plain memory."""


def _whole_version(local: Any) -> Pieces | None:
    """The ``(fd, inode, offset, length)`` pieces of a complete version's byte space, in
    order; None unless all of it lies in this process's memory files."""
    if local in _WHOLE:
        return _WHOLE[local]
    manifest = local.manifest
    if manifest.total_bytes == 0:
        pieces = None
    elif local.flat is not None:
        pieces = pieces_of([local.flat[:manifest.total_bytes]])
    else:
        segments = [s for c in range(manifest.num_chunks) for s in local.segments(c)]
        pieces = pieces_of(segments)
    if pieces is not None and int(pieces[:, 3].sum()) != manifest.total_bytes:
        pieces = None  # pragma: no cover - segments always cover the byte space
    _WHOLE[local] = pieces
    return pieces


async def _lease_version(sock: trio.socket.SocketType, peer: str, local: Any, req_id: int,
                         pieces: Pieces, on_sent: Callable[[str, int], None]) -> None:
    """Grant the whole version and keep it leased (we run inside ``Store.hold``) until
    the reader's ShmRelease or the connection's end.  If the version is unpublished
    meanwhile, tell the reader (ShmRevoke): it releases once its copy in flight is done."""
    manifest = local.manifest
    total = manifest.total_bytes
    for start in range(0, len(pieces), GRANT_PIECES):
        part = pieces[start:start + GRANT_PIECES].astype("<u8").tobytes()
        await _send_frame(sock, ShmVersionGrant(req_id, total, manifest.chunk_size, part,
                                                start + GRANT_PIECES < len(pieces)))

    async def revoke_when_hidden() -> None:
        while not local.hidden:
            await local.progress.wait()
        # Shielded: never leave half a frame on the socket.  A reader that went away
        # ends the lease by the connection's end.
        with trio.CancelScope(shield=True), suppress(TransportError, OSError):
            await _send_frame(sock, ShmRevoke(req_id))

    copied: list[npt.NDArray[np.uint32]] = []
    got: Any = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(revoke_when_hidden)
        try:
            while True:
                got = await _recv_frame(sock)
                if not isinstance(got, ShmRelease) or got.req_id != req_id \
                        or len(got.chunks) % 4:
                    break
                copied.append(np.frombuffer(got.chunks, dtype="<u4"))
                if not got.more:
                    break
        except (TransportError, OSError):
            return  # the reader went away; the lease ends here
        finally:
            nursery.cancel_scope.cancel()
    if not isinstance(got, ShmRelease) or got.req_id != req_id or got.more \
            or len(got.chunks) % 4:
        raise RemoteProtocolError(f"expected ShmRelease({req_id}), got {got!r:.80}")
    chunks = np.concatenate(copied) if copied else np.zeros(0, np.uint32)
    if len(chunks) and int(chunks.max()) >= manifest.num_chunks:
        raise RemoteProtocolError(f"{peer} released chunks {manifest.num_chunks} and up "
                                  f"of a {manifest.num_chunks}-chunk version")
    last = manifest.num_chunks - 1
    tail = total - last * manifest.chunk_size
    for c in chunks.tolist():
        on_sent(peer, manifest.chunk_size if c != last else tail)
    await _send_frame(sock, Reply(req_id, OK, 0))


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
    """Copy from the holder's memory files, then verify: one worker-thread call.
    (Hashing each 256 KiB block right after copying it costs less CPU, but measured
    slower here: two threads hashing small blocks contend for the GIL.)"""
    files.copy(pieces, dest)
    return _verified(dest, verify)


class _CopyPool:
    """Worker threads for the same-host copies, one per usable core (at most 8), fed
    from one queue.  Unlike ``trio.to_thread`` a thread that finishes a copy takes the
    next queued one at once, without waiting for the event loop to hand it over: with
    a few reads in flight the cores never idle between chunks (on a 2-core host that
    hand-over took longer than the copy)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._threads = 0
        self._lock = threading.Lock()
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cores = os.cpu_count() or 2
        self._limit = max(1, min(8, cores))

    def _work(self) -> None:
        while True:
            self._jobs.get()()

    def _start(self) -> None:
        with self._lock:
            if self._threads < self._limit:
                self._threads += 1
                threading.Thread(target=self._work, name="tensorhub-shm-copy",
                                 daemon=True).start()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` in a pool thread, not waiting for it (it must not raise)."""
        self._start()
        self._jobs.put(fn)

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in a pool thread; waits for it even when cancelled (the copy
        writes into memory the caller owns and reads memory the holder leased)."""
        self._start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[outcome.Outcome[_T]] = []

        def job() -> None:
            result.append(outcome.capture(fn, *args))
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        self._jobs.put(job)
        with trio.CancelScope(shield=True):
            await done.wait()
        return result[0].unwrap()


_pool = _CopyPool()


def _new_pool() -> None:
    global _pool
    _pool = _CopyPool()  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_new_pool)


class ShmConnection(TcpConnection):
    """A reader's same-host connection: TCP for control, ``process_vm_readv`` for payload.

    Manifests travel over TCP as usual.  :meth:`connect` fails with a
    :class:`TransportError` naming the reason when the holder's memory cannot be read.
    """

    transport = "shm"
    """``shm-memfd`` once the last chunk came from the holder's memory files, ``shm`` when
    it came through ``process_vm_readv``."""
    lands_arrays = False  # chunks are copied into byte views

    def __init__(self, sock: trio.socket.SocketType, peer: str) -> None:
        super().__init__(sock, peer)
        self._pid = 0
        self._pidfd = -1
        self._files = MappedFiles(peer)
        self._poll: Any = None  # select.poll over the pidfd and the socket, made once
        self._lease: _VersionLease | None = None
        self._unleased: set[VersionKey] = set()
        self.version_leases = 0
        """Versions the holder leased whole to this connection (statistics, tests)."""
        self.chunk_grants = 0
        """Chunks granted one by one on this connection (statistics, tests)."""

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

    def _holder_state(self) -> tuple[bool, bool]:
        """(the holder exited, its socket has something to say or hung up)."""
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self._pidfd, select.POLLIN)
            self._poll.register(self._sock.fileno(), select.POLLIN | select.POLLRDHUP)
        ready = dict(self._poll.poll(0))
        return self._pidfd in ready, self._sock.fileno() in ready

    def _check_holder(self) -> None:
        """Fail unless the holder is alive and the connection open (after every copy)."""
        dead, spoke = self._holder_state()
        if dead:
            raise TransportError(f"{self.peer} (pid {self._pid}) exited during the copy")
        if spoke:
            raise TransportError(f"{self.peer} closed the connection (or spoke out of turn) "
                                 "during the copy")

    def _check_rows(self, raw: bytes, width: int, want: int) -> npt.NDArray[np.uint64]:
        """A grant's rows, checked: ``width`` uint64 columns, the last a length."""
        if len(raw) % (8 * width):
            raise RemoteProtocolError(f"{self.peer} sent a malformed grant")
        rows = np.frombuffer(raw, dtype="<u8").reshape(-1, width)
        lengths = rows[:, -1]
        if not (lengths > 0).all() or int(lengths.max(initial=0)) > want \
                or (width == 4 and not ((rows[:, 0] < 1 << 31).all()
                                        and (rows[:, 2] < 1 << 62).all())):
            raise RemoteProtocolError(f"{self.peer} sent a malformed grant")
        return rows.astype(np.uint64)

    async def _grant(self, req_id: int, want: int, msg: Any = None
                     ) -> tuple[bool, npt.NDArray[np.uint64]]:
        """Whether request ``req_id`` was granted memory files, and the holder's pieces
        (``(fd, inode, offset, length)``) or iovecs, checked to add up to ``want``.
        ``msg``: the first answer, when the caller has read it already."""
        parts: list[npt.NDArray[np.uint64]] = []
        got = 0
        kind: type | None = None
        while True:
            if msg is None:
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
            rows = self._check_rows(raw, width, want)
            if msg.more and not len(rows):
                raise RemoteProtocolError(f"{self.peer} sent a malformed grant")
            got += int(rows[:, -1].sum())
            if got > want:
                raise RemoteProtocolError(f"{self.peer} granted more than {want} bytes")
            parts.append(rows)
            more, msg = msg.more, None
            if not more:
                break
        if got != want:
            raise RemoteProtocolError(f"{self.peer} granted {got} of {want} bytes")
        return kind is ShmFileGrant, np.concatenate(parts)

    async def _version_grant(self, req_id: int, key: VersionKey, msg: ShmVersionGrant
                             ) -> _VersionLease:
        """The rest of a version grant whose first frame is ``msg``, checked."""
        length, chunk_size = msg.length, msg.chunk_size
        if not (0 < length < 1 << 62 and 0 < chunk_size < 1 << 62):
            raise RemoteProtocolError(f"{self.peer} sent a malformed version grant")
        parts: list[npt.NDArray[np.uint64]] = []
        got = 0
        while True:
            rows = self._check_rows(msg.pieces, 4, length)
            if msg.more and not len(rows):
                raise RemoteProtocolError(f"{self.peer} sent a malformed version grant")
            got += int(rows[:, 3].sum())
            if got > length:
                raise RemoteProtocolError(f"{self.peer} granted more than {length} bytes")
            parts.append(rows)
            if not msg.more:
                break
            msg = await _recv_frame(self._sock)
            if not isinstance(msg, ShmVersionGrant) or msg.req_id != req_id \
                    or (msg.length, msg.chunk_size) != (length, chunk_size):
                raise RemoteProtocolError(f"{self.peer} answered out of turn")
        if got != length:
            raise RemoteProtocolError(f"{self.peer} granted {got} of {length} bytes")
        return _VersionLease(key, req_id, length, chunk_size, np.concatenate(parts))

    async def read_chunk(self, key: VersionKey, chunk: int, dest: Sequence[memoryview],
                         verify: Verifier | None = None) -> int:
        if self._sock.fileno() < 0:
            raise TransportError(f"connection to {self.peer} is closed")
        if any(d.readonly for d in dest):
            raise LocalProtocolError(f"destination of chunk {chunk} of {key} is read-only")
        want = sum(d.nbytes for d in dest)
        try:
            if self._lease is not None and self._lease.key != key:
                await self._release()
            if self._lease is not None:
                return await self._read_leased(self._lease, chunk, dest, want, verify)
            req_id = next(self._ids)
            if key in self._unleased:
                await _send_frame(self._sock, ShmChunkRequest(
                    req_id, key.model, key.version, chunk, key.shard, key.layout))
                files, rows = await self._grant(req_id, want)
            else:
                self._unleased.add(key)  # ask for a version lease once per connection
                await _send_frame(self._sock, ShmVersionRequest(
                    req_id, key.model, key.version, chunk, key.shard, key.layout))
                first = await _recv_frame(self._sock)
                if isinstance(first, ShmVersionGrant) and first.req_id == req_id:
                    self._lease = await self._version_grant(req_id, key, first)
                    self._unleased.discard(key)
                    self.version_leases += 1
                    return await self._read_leased(self._lease, chunk, dest, want, verify)
                files, rows = await self._grant(req_id, want, first)
            self.chunk_grants += 1
            if files:
                self.transport = "shm-memfd"
                bad = await _pool.run(_land_files, self._files, rows, dest, verify)
            else:
                self.transport = "shm"
                bad = await _pool.run(_land_iovecs, self._pid, iovecs_of(dest), rows, dest,
                                      verify)
            self._check_holder()
            await _send_frame(self._sock, ShmDone(req_id))
            if bad is not None:
                raise bad
        except NotServing:
            raise  # in step: a whole reply was read, and nothing is leased per chunk
        except BaseException:
            self._close()  # out of step mid-exchange; closing ends the holder's lease
            raise
        return want

    async def _read_leased(self, lease: _VersionLease, chunk: int, dest: Sequence[memoryview],
                           want: int, verify: Verifier | None) -> int:
        """Serve a read from the version lease: no message, one worker-thread call."""
        dead, spoke = self._holder_state()
        if dead:
            raise TransportError(f"{self.peer} (pid {self._pid}) exited")
        if spoke:
            await self._heard(lease)  # an unpublish (or a hang-up) since the last read
        if lease.revoked:
            await self._release()
            raise NotServing(NOT_HELD, f"{lease.key} was unpublished by {self.peer}")
        if not 0 <= chunk < lease.num_chunks:
            raise NotServing(BAD_REQUEST, f"{lease.key} has no chunk {chunk}")
        start = chunk * lease.chunk_size
        stop = min(start + lease.chunk_size, lease.length)
        if want != stop - start:
            raise RemoteProtocolError(f"{self.peer} leased a version whose chunk {chunk} "
                                      f"has {stop - start} bytes, not {want}")
        self.transport = "shm-memfd"
        bad = await _pool.run(_land_files, self._files, lease.pieces_of(start, stop), dest,
                              verify)
        dead, spoke = self._holder_state()
        if dead:
            raise TransportError(f"{self.peer} (pid {self._pid}) exited during the copy")
        if spoke:
            await self._heard(lease)  # a revoke still covers this copy: it was leased
        lease.copied.append(chunk)
        if bad is not None:
            await self._release()  # in step, so the holder counts the copy; then fail
            raise bad
        return want

    async def _heard(self, lease: _VersionLease) -> None:
        """The holder spoke while we hold its version lease: only a revoke is in turn."""
        msg = await _recv_frame(self._sock)  # raises TransportError on a hang-up
        if msg != ShmRevoke(lease.req_id) or lease.revoked:
            raise RemoteProtocolError(f"{self.peer} spoke out of turn during a version lease")
        lease.revoked = True

    async def _release(self) -> None:
        """End the version lease: tell the holder what we copied, wait for its answer."""
        lease, self._lease = self._lease, None
        assert lease is not None
        await self._send_release(lease)
        while True:
            msg = await _recv_frame(self._sock)
            if msg == Reply(lease.req_id, OK, 0):
                return
            if msg != ShmRevoke(lease.req_id) or lease.revoked:
                raise RemoteProtocolError(f"{self.peer} answered a release out of turn")
            lease.revoked = True

    async def _send_release(self, lease: _VersionLease) -> None:
        chunks = np.array(lease.copied, dtype="<u4")
        for at in range(0, max(len(chunks), 1), RELEASE_CHUNKS):
            await _send_frame(self._sock, ShmRelease(
                lease.req_id, chunks[at:at + RELEASE_CHUNKS].tobytes(),
                at + RELEASE_CHUNKS < len(chunks)))

    async def read_manifest(self, key: VersionKey) -> bytes:
        if self._lease is not None:
            try:
                await self._release()
            except BaseException:
                self._close()
                raise
        return await super().read_manifest(key)

    def _close(self) -> None:
        self._lease = None
        self._poll = None
        self._sock.close()
        # Unmapping a mapping of a whole version costs milliseconds: not on the event
        # loop, which may be running the last copies of the fetch (FIFO: after them).
        if self._files.mapped:
            _pool.submit(self._files.close)
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    async def aclose(self) -> None:
        """Close; a version lease is released first (so the holder counts what we
        copied) unless we are being cancelled -- then the connection's end releases it."""
        lease = self._lease
        try:
            if lease is not None and self._sock.fileno() >= 0 \
                    and trio.current_effective_deadline() > trio.current_time():
                with trio.move_on_after(1):
                    await self._send_release(lease)
        except (TransportError, OSError):
            pass
        finally:
            self._close()


class _VersionLease:
    """A version the holder leased to this connection: where all of it lies."""

    def __init__(self, key: VersionKey, req_id: int, length: int, chunk_size: int,
                 pieces: Pieces) -> None:
        self.key = key
        self.req_id = req_id
        self.length = length
        self.chunk_size = chunk_size
        self.num_chunks = -(-length // chunk_size)
        self.pieces = pieces
        self.starts = np.concatenate((np.zeros(1, np.uint64),
                                      np.cumsum(pieces[:, 3], dtype=np.uint64)))
        self.copied: list[int] = []
        self.revoked = False

    def pieces_of(self, start: int, stop: int) -> Pieces:
        """The pieces of bytes ``[start, stop)`` of the version."""
        lo = int(np.searchsorted(self.starts, start, side="right")) - 1
        hi = int(np.searchsorted(self.starts, stop, side="left"))
        rows = self.pieces[lo:hi].copy()
        first = self.starts[lo:hi]
        last = first + rows[:, 3]
        begin = np.maximum(first, np.uint64(start))
        end = np.minimum(last, np.uint64(stop))
        rows[:, 2] += begin - first
        rows[:, 3] = end - begin
        return rows
