"""Messages of the one-sided data plane (RDMA READ, CUDA IPC), and the check of a grant.

Theory of operation
-------------------
A reader that reads with a one-sided backend still talks to the holder over its data
connection (TCP; the same-host Unix socket for CUDA IPC), framed as every data-plane
message (:mod:`.dataplane`), for control only; the payload moves without the holder's
CPU: the reader's NIC (or GPU) reads the holder's registered memory itself.

1. ``OneSidedHello`` names the backend and carries the reader's endpoint (an RC queue
   pair's number, LID, GID and first PSN; a stand-in's link id).  The holder opens its
   end of the link and answers ``OneSidedWelcome`` with its own endpoint, or refuses
   with a non-OK ``Reply`` (backend not served here, and why).
2. ``OneSidedChunkRequest`` leases one chunk, exactly like a same-host chunk lease: the
   holder answers ``OneSidedGrant`` -- where the chunk's bytes lie (remote address,
   length, and the access key of the registered region each piece lies in: an RDMA
   ``rkey``, a CUDA IPC memory handle) -- or a non-OK ``Reply`` (no lease then).
3. The reader reads those ranges into its own registered memory, then sends
   ``OneSidedDone``; only then does the holder end the lease, so unpublish
   (``Store.wait_drained``) waits for every read in flight.

``OneSidedRunRequest`` leases consecutive chunks in one round trip: the holder answers
each chunk in order with a ``ChunkReply`` (its status; for an OK one, its
``OneSidedGrant`` frames follow), granting each as soon as it holds it verified, and
keeps every chunk of the run leased until the one ``OneSidedDone``; the reader reads
each chunk as its grant arrives.

Keys are valid while the version is published: the holder revokes a region's key once
no published version lies in it any more (after the drain), so a reader that kept a key
reads nothing -- its read completes with an error and the fetcher re-sources the chunk.

:func:`granted_ranges` checks a grant (every value from the wire) before any read is
posted; it is pure and fuzzed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Annotated

from ..bounds import U32, U63, U64, MaxLen, Range, Rank
from ..errors import RemoteProtocolError
from ..model import LayoutId, ModelName
from .dataplane import MAX_RUN_CHUNKS, ChunkIndex

MAX_ENDPOINT = 256
"""Bytes of a link endpoint (an RC queue pair's address is 26)."""
MAX_KEY = 128
"""Bytes of one access key (an rkey is 4; a CUDA IPC handle and its base 72)."""
MAX_KEYS = 2048
"""Distinct keys in one grant frame: 256 KiB of keys at most."""
GRANT_ROWS = 16384
"""Ranges per grant frame: 384 KiB of rows (with the keys, under ``MAX_FRAME``)."""
ROW = struct.Struct("<QQQ")
"""One granted range: remote address, length, index of its key in the frame's keys."""

BackendName = Annotated[str, MaxLen(32)]
Endpoint = Annotated[bytes, MaxLen(MAX_ENDPOINT)]


@dataclass(frozen=True, slots=True)
class OneSidedHello:
    """Open a link on ``backend``; ``endpoint`` is the reader's end of it."""

    req_id: U63
    backend: BackendName
    endpoint: Endpoint


@dataclass(frozen=True, slots=True)
class OneSidedWelcome:
    """The holder's end of the link the reader asked for."""

    req_id: U63
    endpoint: Endpoint


@dataclass(frozen=True, slots=True)
class OneSidedChunkRequest:
    """Lease chunk ``chunk`` and say where its bytes lie; answered by one or more
    :class:`OneSidedGrant` frames, or a non-OK ``Reply`` (no lease then)."""

    req_id: U63
    model: ModelName
    version: U63
    chunk: ChunkIndex
    shard: Rank = 0
    layout: LayoutId = b""


@dataclass(frozen=True, slots=True)
class OneSidedGrant:
    """Where a leased chunk lies: ``ranges`` are :data:`ROW` rows in chunk order,
    ``keys`` the ``key_size``-byte keys they index.  A chunk in too many pieces for one
    frame is granted in several, all but the last with ``more``; the lease holds until
    :class:`OneSidedDone` or the connection's end."""

    req_id: U63
    length: U64
    key_size: Annotated[int, Range(1, MAX_KEY)]
    keys: Annotated[bytes, MaxLen(MAX_KEY * MAX_KEYS)]
    ranges: bytes
    more: bool


@dataclass(frozen=True, slots=True)
class OneSidedDone:
    """The reader has read the chunk of request ``req_id``: the holder ends the lease."""

    req_id: U63


@dataclass(frozen=True, slots=True)
class OneSidedRunRequest:
    """Lease chunks ``first`` .. ``first + count - 1``: one ``ChunkReply`` each, in
    order, an OK one followed by its :class:`OneSidedGrant` frames; one
    :class:`OneSidedDone` ends every lease of the run."""

    req_id: U63
    model: ModelName
    version: U63
    first: U32
    count: Annotated[int, Range(1, MAX_RUN_CHUNKS)]
    shard: Rank = 0
    layout: LayoutId = b""


MESSAGES = (OneSidedHello, OneSidedWelcome, OneSidedChunkRequest, OneSidedGrant,
            OneSidedDone, OneSidedRunRequest)

RemoteRange = tuple[int, int, bytes]
"""``(address, length, key)`` of one granted piece of the holder's memory."""


def grant_frames(req_id: int, length: int, pieces: list[RemoteRange]
                 ) -> list[OneSidedGrant]:
    """The frames that grant ``pieces`` (a chunk of ``length`` bytes, keys of one
    size): a new frame after :data:`GRANT_ROWS` rows or :data:`MAX_KEYS` keys."""
    frames: list[OneSidedGrant] = []
    keys: dict[bytes, int] = {}
    rows: list[bytes] = []

    def flush(more: bool) -> None:
        size = len(next(iter(keys), b"\0"))
        frames.append(OneSidedGrant(req_id, length, size, b"".join(keys), b"".join(rows),
                                    more))
        keys.clear()
        rows.clear()

    for addr, n, key in pieces:
        if len(rows) == GRANT_ROWS or (key not in keys and len(keys) == MAX_KEYS):
            flush(True)
        rows.append(ROW.pack(addr, n, keys.setdefault(key, len(keys))))
    flush(False)
    return frames


def granted_ranges(msg: OneSidedGrant, want: int, got: int) -> list[RemoteRange]:
    """The ranges of one grant frame for a ``want``-byte chunk of which earlier frames
    granted ``got`` bytes, checked: every row whole, every key index in range, every
    range non-empty and inside the 64-bit address space, no more than ``want`` bytes in
    all; a last frame (not ``more``) completes the chunk exactly."""
    if msg.length != want:
        raise RemoteProtocolError(f"granted {msg.length} bytes for a {want}-byte chunk")
    if len(msg.ranges) % ROW.size or len(msg.keys) % msg.key_size:
        raise RemoteProtocolError("malformed grant: partial row or key")
    keys = [msg.keys[i:i + msg.key_size] for i in range(0, len(msg.keys), msg.key_size)]
    out: list[RemoteRange] = []
    for addr, n, index in ROW.iter_unpack(msg.ranges):
        if n == 0 or index >= len(keys) or addr + n > 1 << 64:
            raise RemoteProtocolError("malformed grant: empty range, unknown key or "
                                      "range past the address space")
        got += n
        if got > want:
            raise RemoteProtocolError(f"granted more than {want} bytes")
        out.append((addr, n, keys[index]))
    if msg.more and not out:
        raise RemoteProtocolError("malformed grant: an empty frame with more to come")
    if not msg.more and got != want:
        raise RemoteProtocolError(f"granted {got} of {want} bytes")
    return out
