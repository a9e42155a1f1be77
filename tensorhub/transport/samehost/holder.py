"""Same-host transport, holder side: answering ``ShmHello``, ``ShmChunkRequest`` and
``ShmVersionRequest`` (handed over by :class:`~tensorhub.transport.server.TcpServer`
from its same-host socket only); see :mod:`.reader` for the protocol and the reader side.

Revocation.  A reader that does not end a chunk lease (``ShmDone``) within the holder's
``lease_timeout``, or a version lease within it of a ``ShmRevoke``, is cut off: the holder
shuts the connection down, and only then lets go of the memory, so ``unpublish`` returns
within about ``lease_timeout`` even when a reader hangs.  The holder may then overwrite
or free that memory while a copy is still running; that copy is harmless and never
used.  With ``process_vm_readv`` the kernel reads the holder's pages on the reader's
behalf, so a freed page makes the call fail (``EFAULT``) instead of faulting the reader;
with a mapped memory file the reader copies from its own mapping, which the holder's
letting go does not unmap (the file is sealed against shrinking), so the pages stay
readable.  Either way the bytes may have changed, and the reader's check after every copy
sees the connection ended (``POLLRDHUP``) -- the holder ended it before letting go, the
copy ended after the memory changed, so the check comes after the end -- and fails the
read; a ``ShmRevoke`` alone, the connection still up, means the copy was covered.  A
reader therefore never returns bytes from memory it no longer leases; it reports a
transport error and the fetcher takes the chunk from another holder.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from ...errors import RemoteProtocolError, TransportError
from ...model import VersionKey
from ...protocol.dataplane import (
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
from ..base import NotServing, Provider
from ..frames import recv_frame, send_frame
from .memory_files import Pieces, address_of, pieces_of
from .process_vm import iovecs_of

GRANT_IOVECS = 32768  # iovecs per ShmGrant frame: 512 KiB, well under MAX_FRAME
GRANT_PIECES = 16384  # pieces per ShmFileGrant frame: 512 KiB

_token = b""
_token_at = 0


def _new_token() -> None:
    global _token, _token_at
    _token = os.urandom(16)
    _token_at = address_of(memoryview(_token))


_new_token()
os.register_at_fork(after_in_child=_new_token)


@dataclass(frozen=True)
class LeaseTerms:
    """How a same-host reader's lease ends, from the holder's side."""

    timeout: float
    """Seconds a reader may take to end a chunk lease (ShmDone), or a revoked version
    lease (ShmRelease), before the holder revokes it by closing the connection."""
    on_sent: Callable[[str, int], None]
    on_revoked: Callable[[str], None]
    """Called with the reader's name each time a lease is revoked for lack of an answer."""


async def serve_shm(sock: trio.socket.SocketType, peer: str, provider: Provider,
                    req: ShmHello | ShmChunkRequest | ShmVersionRequest,
                    terms: LeaseTerms) -> None:
    """Answer one same-host request; a chunk stays leased until the reader's ShmDone, a
    version until its ShmRelease (or the connection's end, or revocation)."""
    if isinstance(req, ShmHello):
        await send_frame(sock, ShmWelcome(req.req_id, os.getpid(), _token, _token_at))
        return
    key = VersionKey(req.model, req.version, req.shard, req.layout)
    if isinstance(req, ShmVersionRequest):
        hold = getattr(provider, "hold", None)  # Store.hold: a lease on a whole version
        if hold is not None:
            with hold(key) as local:
                pieces = None if local is None else _whole_version(local)
                if pieces is not None:
                    await _lease_version(sock, peer, local, req.req_id, pieces, terms)
                    return
    await _serve_chunk(sock, peer, provider, key, req.req_id, req.chunk, terms)


def _revoke(sock: trio.socket.SocketType) -> None:
    """End a reader's lease by ending its connection -- before the lease's memory is
    let go (the caller's context exits after this): a reader checks the connection
    after every copy, so a copy that overlaps the end of the lease is never used.
    ``shutdown``, not ``close``: the connection's thread-side twin shares the socket."""
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


async def _serve_chunk(sock: trio.socket.SocketType, peer: str, provider: Provider,
                       key: VersionKey, req_id: int, chunk: int, terms: LeaseTerms) -> None:
    with ExitStack() as stack:
        try:
            await provider.wait_chunk(key, chunk)
            segments = stack.enter_context(provider.lease(key, chunk))
        except NotServing as ns:
            await send_frame(sock, Reply(req_id, ns.status, 0, ns.detail))
            return
        files = pieces_of(segments)
        rows, grant, per_frame = ((iovecs_of(segments), ShmGrant, GRANT_IOVECS) if files is None
                                  else (files, ShmFileGrant, GRANT_PIECES))
        total = int(rows[:, -1].sum())
        done: Any = None
        with trio.move_on_after(terms.timeout) as waited:
            for start in range(0, max(len(rows), 1), per_frame):
                part = rows[start:start + per_frame].astype("<u8").tobytes()
                await send_frame(sock, grant(req_id, total, part, start + per_frame < len(rows)))
            try:
                done = await recv_frame(sock)
            except TransportError:
                return  # the reader went away; its lease ends here
        if waited.cancelled_caught:
            with trio.move_on_after(0.1), suppress(TransportError, OSError):
                await send_frame(sock, ShmRevoke(req_id))
            _revoke(sock)
            terms.on_revoked(peer)
            raise TransportError(f"{peer} held chunk {chunk} of {key} for over "
                                 f"{terms.timeout}s; lease revoked")
        if done != ShmDone(req_id):
            raise RemoteProtocolError(f"expected ShmDone({req_id}), got {done!r:.80}")
        terms.on_sent(peer, total)


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
                         pieces: Pieces, terms: LeaseTerms) -> None:
    """Grant the whole version and keep it leased (we run inside ``Store.hold``) until
    the reader's ShmRelease or the connection's end.  If the version is unpublished
    meanwhile, tell the reader (ShmRevoke): it releases once its copy in flight is done,
    or, silent for ``terms.timeout``, loses the lease with its connection."""
    manifest = local.manifest
    total = manifest.total_bytes
    for start in range(0, len(pieces), GRANT_PIECES):
        part = pieces[start:start + GRANT_PIECES].astype("<u8").tobytes()
        await send_frame(sock, ShmVersionGrant(req_id, total, manifest.chunk_size, part,
                                                start + GRANT_PIECES < len(pieces)))

    async def revoke_when_hidden() -> None:
        while not local.hidden:
            await local.progress.wait()
        # Shielded: never leave half a frame on the socket.  A reader that went away
        # ends the lease by the connection's end.
        with trio.CancelScope(shield=True), suppress(TransportError, OSError):
            with trio.move_on_after(terms.timeout):
                await send_frame(sock, ShmRevoke(req_id))
        await trio.sleep(terms.timeout)
        _revoke(sock)  # the release waited on below fails: the hold ends
        terms.on_revoked(peer)

    copied: list[npt.NDArray[np.uint32]] = []
    got: Any = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(revoke_when_hidden)
        try:
            while True:
                got = await recv_frame(sock)
                if not isinstance(got, ShmRelease) or got.req_id != req_id \
                        or len(got.chunks) % 4:
                    break
                copied.append(np.frombuffer(got.chunks, dtype="<u4"))
                if not got.more:
                    break
        except (TransportError, OSError):
            return  # the reader went away; the lease ends here
        except RemoteProtocolError as exc:
            got = exc  # raised below as what it is, not from the nursery (as a group)
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
        terms.on_sent(peer, manifest.chunk_size if c != last else tail)
    await send_frame(sock, Reply(req_id, OK, 0))
