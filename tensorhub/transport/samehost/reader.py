"""Same-host data plane: one copy, straight from the holder's arrays into the reader's.

A reader on the holder's host talks to it over a Unix socket (:mod:`..local`: the
kernel tells the holder who connected), with the framing of the TCP data connection
(:mod:`tensorhub.transport.tcp`), for control only.  For each chunk it sends a
``ShmChunkRequest``; the holder leases the chunk and says where its bytes lie.  If they
lie in shared memory files (arrays from :func:`.memory_files.shared_empty`,
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
refused (``NOT_HELD``).  Any other holder (still receiving, plain arrays, a provider
that leases no whole version) answers the request as a ``ShmChunkRequest``, and the
connection asks chunk by chunk from then on.

Four checks make this safe.  The holder answers only its own user (or root), as the
kernel reports the socket's other end (``SO_PEERCRED``); the reader checks the same of
the holder.  At connect the holder sends its pid and a random token that
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

A reader that stops answering loses its lease (revocation, in :mod:`.holder`); the
check after each copy makes sure it never uses a copy that outlived its lease.

This module is the reader side.  The holder side is :mod:`.holder`; the kernel copy
:mod:`.process_vm`, the memory files :mod:`.memory_files`, the copy threads
:mod:`..copy_threads`.
"""

from __future__ import annotations

import bisect
import itertools
import os
import select
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from ...errors import LocalProtocolError, RemoteProtocolError, TransportError
from ...model import VersionKey
from ...protocol.dataplane import (
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
from ...protocol.sizing import StreamWindow
from .. import copy_threads
from ..base import (
    Landed,
    NotServing,
    Take,
    Verifier,
    checks_source,
    read_each,
    stream_each,
    takes_digest,
)
from ..frames import recv_frame, send_frame
from ..handshake import DataAuth
from ..local import credentials, local_name, same_user
from ..tcp import TcpConnection, dial, greeted
from . import checked_copy
from .memory_files import MappedFiles, Pieces
from .process_vm import Iovecs, iovecs_of, readv_all, shm_available

__all__ = ["ShmConnection", "shm_available"]

_HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR
RELEASE_CHUNKS = 131072  # chunk indices per ShmRelease frame: 512 KiB


def _land_iovecs(pid: int, local: Iovecs, remote: Iovecs, dest: Sequence[memoryview],
                 verify: Verifier | None) -> Exception | None:
    """Copy with ``process_vm_readv``, then verify: one worker-thread call.  Returns
    (does not raise) what ``verify`` raised, so the lease still ends in step."""
    readv_all(pid, local, remote)
    return _verified(dest, verify)


def _verified(dest: Sequence[memoryview], verify: Verifier | None) -> Exception | None:
    try:
        if verify is not None:
            verify(dest)
    except Exception as exc:  # raised by the reader once ShmDone is sent
        return exc
    return None


def _land_batch(files: MappedFiles, jobs: Sequence[tuple[Pieces, Sequence[memoryview],
                                                         Verifier | None]]
                ) -> list[Exception | None]:
    """Copy chunks from the holder's memory files and verify each: one worker-thread
    call.  A chunk whose check may read the holder's bytes
    (:class:`~tensorhub.transport.base.SourceVerifier`) is checked as it is copied: by
    the copy itself where the check is an xxh3-128 digest
    (:mod:`.checked_copy`: one read of each byte), else block by block, each block from
    the cache between the check's read and the copy's
    (:meth:`MappedFiles.checked_then_copied`).  Its bytes cross memory twice, as in a
    plain copy, not three times.  The other chunks are copied first (neighbouring
    pieces as one run), then checked where they landed: measured faster than checking
    each one right after its copy, whose streaming stores may still be in flight.
    Returns what each check raised, if anything."""
    bad: list[Exception | None] = [None] * len(jobs)
    later = []
    one_pass = checked_copy.available()
    for i, (pieces, dest, verify) in enumerate(jobs):
        if not checks_source(verify):
            later.append(i)
            continue
        if one_pass and takes_digest(verify) and verify.algo == checked_copy.ALGO:
            began = time.perf_counter()
            digest = files.copy_digest(pieces, dest)  # raises as files.copy
            check: Callable[[], None] = partial(
                verify.check_digest, digest, time.perf_counter() - began)
        else:
            check = partial(verify.check_source,
                            files.checked_then_copied(pieces, dest))  # raises as files.copy
        try:
            check()
        except Exception as exc:  # raised by the reader once ShmDone is sent
            bad[i] = exc
    files.copy([(jobs[i][0], jobs[i][1]) for i in later])
    for i in later:
        bad[i] = _verified(jobs[i][1], jobs[i][2])
    return bad


class ShmConnection(TcpConnection):
    """A reader's same-host connection: a Unix socket for control; payload copied from the
    holder's memory files or with ``process_vm_readv``.

    Manifests travel over the same socket, framed as over TCP.  :meth:`connect` fails with a
    :class:`TransportError` naming the reason when the holder's memory cannot be read.
    """

    transport = "shm"
    """``shm-memfd`` once the last chunk came from the holder's memory files, ``shm`` when
    it came through ``process_vm_readv``."""
    lands_arrays = False
    lands_device = False  # chunks are copied into byte views
    holder_shares_memory = False
    """True once the handshake showed the holder is this user's (or root's) process
    whose memory this one reads: it could write this process's memory too."""
    batch_bytes = 64 << 20
    """Under a version lease, bytes per worker-thread call.  Measured (1 GiB in 4 MiB
    chunks, 2 cores): 0.165 s a fetch with one chunk per call, 0.129 with 4, 0.124 with
    8, 0.117 with 16 (64 MiB)."""

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

    @property
    def holder_pid(self) -> int:
        """The holder's process id, as its handshake showed (0 before it)."""
        return self._pid

    @classmethod
    async def connect(cls, address: str, peer: str, timeout: float,
                      auth: DataAuth | None = None) -> ShmConnection:
        """Connect to the same-host socket of the holder whose data address is
        ``address`` (see :mod:`..local`), authenticate as over TCP, and check that we can
        read its memory."""
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await dial(sock, local_name(address), peer, timeout, auth,
                    f"no same-host connection to {peer} (on another host or in another "
                    "network namespace?)")
        conn = cls(sock, peer)
        return await greeted(conn, conn._hello, timeout,
                             f"{peer} did not answer the shared-memory handshake")

    async def _hello(self) -> None:
        req_id = next(self._ids)
        await send_frame(self._sock, ShmHello(req_id))
        welcome = await recv_frame(self._sock)
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
        pid, uid, _ = credentials(self._sock)
        if not same_user(uid) or pid != welcome.pid:
            raise TransportError(f"{elsewhere}: the kernel says pid {pid} of user {uid} "
                                 "holds the socket")
        self._pid = self._files.pid = welcome.pid
        echo = bytearray(len(welcome.token))
        token_at = np.array([[welcome.token_at, len(echo)]], dtype=np.uint64)
        try:
            readv_all(self._pid, iovecs_of([memoryview(echo)]), token_at)
        except TransportError as exc:
            raise TransportError(f"{elsewhere}: {exc}") from None
        if echo != welcome.token:
            raise TransportError(f"{elsewhere}: pid {self._pid} here is another process; "
                                 "the holder runs on another host or in another pid namespace")
        self._check_holder()
        self.holder_shares_memory = uid in (os.geteuid(), 0)

    def _holder_state(self) -> tuple[bool, bool]:
        """(the holder exited or ended the connection, its socket has something to say).
        A connection the holder ended is a lease it let go of (revoked, or closed)."""
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self._pidfd, select.POLLIN)
            self._poll.register(self._sock.fileno(), select.POLLIN | select.POLLRDHUP)
        ready = dict(self._poll.poll(0))
        ended = ready.get(self._sock.fileno(), 0) & _HUNG_UP
        return self._pidfd in ready or bool(ended), self._sock.fileno() in ready

    def _check_holder(self) -> None:
        """Fail unless the holder is alive and the connection open (after every copy)."""
        dead, spoke = self._holder_state()
        if dead:
            raise TransportError(f"{self.peer} (pid {self._pid}) exited or ended the "
                                 "connection during the copy")
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
                msg = await recv_frame(self._sock)
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
            msg = await recv_frame(self._sock)
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
                return await self._read_leased_one(self._lease, chunk, dest, verify)
            req_id = next(self._ids)
            if key in self._unleased:
                await send_frame(self._sock, ShmChunkRequest(
                    req_id, key.model, key.version, chunk, key.shard, key.layout))
                files, rows = await self._grant(req_id, want)
            else:
                self._unleased.add(key)  # ask for a version lease once per connection
                await send_frame(self._sock, ShmVersionRequest(
                    req_id, key.model, key.version, chunk, key.shard, key.layout))
                first = await recv_frame(self._sock)
                if isinstance(first, ShmVersionGrant) and first.req_id == req_id:
                    self._lease = await self._version_grant(req_id, key, first)
                    self._unleased.discard(key)
                    self.version_leases += 1
                    return await self._read_leased_one(self._lease, chunk, dest, verify)
                files, rows = await self._grant(req_id, want, first)
            self.chunk_grants += 1
            if files:
                self.transport = "shm-memfd"
                (bad,) = await copy_threads.pool.run(_land_batch, self._files,
                                                 [(rows, dest, verify)])
            else:
                self.transport = "shm"
                bad = await copy_threads.pool.run(_land_iovecs, self._pid, iovecs_of(dest),
                                                  rows, dest, verify)
            self._check_holder()
            await send_frame(self._sock, ShmDone(req_id))
            if bad is not None:
                raise bad
        except NotServing:
            raise  # in step: a whole reply was read, and nothing is leased per chunk
        except BaseException:
            self._close()  # out of step mid-exchange; closing ends the holder's lease
            raise
        return want

    async def read_chunks(self, key: VersionKey, chunks: Sequence[int],
                          dests: Sequence[Sequence[memoryview]],
                          verifies: Sequence[Verifier | None]) -> list[int | Exception]:
        """Under a version lease of ``key``, every chunk in one worker-thread call (the
        holder is checked once, after it); otherwise one read after another.  Without
        a lease yet, the first read asks for one, and under it the rest go in one call."""
        lease = self._lease
        if (lease is None or lease.key != key) and key not in self._unleased \
                and len(chunks) > 1:
            first = await self.read_chunk(key, chunks[0], dests[0], verifies[0])
            try:
                rest = await self.read_chunks(key, chunks[1:], dests[1:], verifies[1:])
            except Exception as exc:  # the first chunk's bytes stand
                rest = [exc]
            return [first, *rest]
        if lease is None or lease.key != key or len(chunks) < 2 or self._sock.fileno() < 0:
            return await read_each(self, key, chunks, dests, verifies)
        for chunk, dest in zip(chunks, dests, strict=True):
            if any(d.readonly for d in dest):
                raise LocalProtocolError(f"destination of chunk {chunk} of {key} is read-only")
        try:
            bad = await self._read_leased(lease, chunks, dests, verifies)
        except NotServing:
            raise
        except BaseException:
            self._close()
            raise
        return [sum(d.nbytes for d in dest) if b is None else b
                for dest, b in zip(dests, bad, strict=True)]

    async def stream_chunks(self, key: VersionKey, take: Take, landed: Landed,
                            window: StreamWindow) -> None:
        """Reads one after another (``batch_bytes`` at a time under a version lease):
        the bytes move in shared memory, not through the socket, so there is nothing to
        keep in flight."""
        await stream_each(self, key, take, landed)

    async def _read_leased_one(self, lease: _VersionLease, chunk: int,
                               dest: Sequence[memoryview], verify: Verifier | None) -> int:
        (bad,) = await self._read_leased(lease, [chunk], [dest], [verify])
        if bad is not None:
            raise bad
        return sum(d.nbytes for d in dest)

    async def _read_leased(self, lease: _VersionLease, chunks: Sequence[int],
                           dests: Sequence[Sequence[memoryview]],
                           verifies: Sequence[Verifier | None]) -> list[Exception | None]:
        """Serve reads from the version lease: no message, one worker-thread call for
        all of them.  Returns what each chunk's check raised, if anything; the lease is
        released if any check failed."""
        dead, spoke = self._holder_state()
        if dead:
            raise TransportError(f"{self.peer} (pid {self._pid}) exited or ended the "
                                 "connection")
        if spoke:
            await self._heard(lease)  # an unpublish (or a hang-up) since the last read
        if lease.revoked:
            await self._release()
            raise NotServing(NOT_HELD, f"{lease.key} was unpublished by {self.peer}")
        jobs = []
        for chunk, dest, verify in zip(chunks, dests, verifies, strict=True):
            if not 0 <= chunk < lease.num_chunks:
                raise NotServing(BAD_REQUEST, f"{lease.key} has no chunk {chunk}")
            start = chunk * lease.chunk_size
            stop = min(start + lease.chunk_size, lease.length)
            want = sum(d.nbytes for d in dest)
            if want != stop - start:
                raise RemoteProtocolError(f"{self.peer} leased a version whose chunk {chunk} "
                                          f"has {stop - start} bytes, not {want}")
            jobs.append((lease.pieces_of(start, stop), dest, verify))
        self.transport = "shm-memfd"
        bad = [b for part in await copy_threads.pool.run_each(
            _land_batch, [(self._files, p) for p in self._split(jobs)]) for b in part]
        dead, spoke = self._holder_state()
        if dead:
            raise TransportError(f"{self.peer} (pid {self._pid}) exited or ended the "
                                 "connection during the copy")
        if spoke:
            await self._heard(lease)  # a revoke still covers these copies: they were leased
        lease.copied.extend(chunks)
        if any(b is not None for b in bad):
            await self._release()  # in step, so the holder counts the copies; then fail
        return bad

    def _split(self, jobs: list[tuple[Pieces, Sequence[memoryview], Verifier | None]]
               ) -> list[list[tuple[Pieces, Sequence[memoryview], Verifier | None]]]:
        """A batch as consecutive parts of about equal bytes, one per copy thread, so
        every thread has work queued while the event loop hands out the next batch; one
        part until every file the batch reads is mapped (a mapping is made by one
        thread at a time).  Plain Python on small lists: it runs on the event loop's
        thread, once per batch, where numpy's per-call cost showed."""
        parts = min(copy_threads.pool.threads, len(jobs))
        mapped = self._files.mapped
        rows = [pieces.tolist() for pieces, _, _ in jobs]
        if parts < 2 or any((fd, inode) not in mapped for r in rows for fd, inode, _, _ in r):
            return [jobs]
        sizes = list(itertools.accumulate(sum(n for _, _, _, n in r) for r in rows))
        cuts = {bisect.bisect_right(sizes, sizes[-1] * k / parts) for k in range(1, parts)}
        bounds = [0, *sorted(c for c in cuts if 0 < c < len(jobs)), len(jobs)]
        return [jobs[a:b] for a, b in itertools.pairwise(bounds)]

    async def _heard(self, lease: _VersionLease) -> None:
        """The holder spoke while we hold its version lease: only a revoke is in turn."""
        msg = await recv_frame(self._sock)  # raises TransportError on a hang-up
        if msg != ShmRevoke(lease.req_id) or lease.revoked:
            raise RemoteProtocolError(f"{self.peer} spoke out of turn during a version lease")
        lease.revoked = True

    async def _release(self) -> None:
        """End the version lease: tell the holder what we copied, wait for its answer."""
        lease, self._lease = self._lease, None
        assert lease is not None
        await self._send_release(lease)
        while True:
            msg = await recv_frame(self._sock)
            if msg == Reply(lease.req_id, OK, 0):
                return
            if msg != ShmRevoke(lease.req_id) or lease.revoked:
                raise RemoteProtocolError(f"{self.peer} answered a release out of turn")
            lease.revoked = True

    async def _send_release(self, lease: _VersionLease) -> None:
        chunks = np.array(lease.copied, dtype="<u4")
        for at in range(0, max(len(chunks), 1), RELEASE_CHUNKS):
            await send_frame(self._sock, ShmRelease(
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
            copy_threads.pool.submit(self._files.close)
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
        self._starts = [0, *itertools.accumulate(pieces[:, 3].tolist())]
        """Where each piece starts in the version (and the version's end): a plain list,
        looked up with :mod:`bisect` for every chunk read on the event loop's thread,
        where a few numpy calls per chunk cost more than the lookup."""
        self.copied: list[int] = []
        self.revoked = False

    def pieces_of(self, start: int, stop: int) -> Pieces:
        """The pieces of bytes ``[start, stop)`` of the version."""
        starts = self._starts
        lo = bisect.bisect_right(starts, start) - 1
        hi = bisect.bisect_left(starts, stop)
        rows = []
        for i, (fd, inode, offset, _) in enumerate(self.pieces[lo:hi].tolist(), lo):
            begin, end = max(starts[i], start), min(starts[i + 1], stop)
            rows.append((fd, inode, offset + begin - starts[i], end - begin))
        return np.array(rows, dtype=np.uint64).reshape(-1, 4)
