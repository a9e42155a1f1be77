"""Messages of the data plane: a reader asks a holder for a manifest or a chunk.

Theory of operation
-------------------
Each frame is a 4-byte big-endian length followed by a codec-encoded message.  A
``Reply`` (or ``ChunkReply``) with ``status == OK`` and ``length > 0`` is followed by
exactly ``length`` raw payload bytes, which the reader lands straight in its destination
buffer; nothing else on the connection is unframed.  Status codes say why a holder would
not serve, so a reader can tell "try another holder" (``NOT_HELD``, ``NOT_YET``) from
"you asked nonsense" (``BAD_REQUEST``).

A reader may send its next request before the last is answered: the holder answers
requests in the order they came, one after the other.  A ``ChunkRunRequest`` asks for
``count`` consecutive chunks at once; the holder answers it with one ``ChunkReply`` per
chunk, in order, each with its own status (a chunk it lacks is ``NOT_YET`` and the run
goes on), streaming each chunk as soon as it holds it verified.  So a reader keeps a
window of requests ahead of what has landed and no chunk waits for a round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..bounds import U8, U32, U63, U64, MaxLen, PeerName, Range, Rank, Signature, Text
from ..model import LayoutId, ModelName

OK = 0
NOT_HELD = 1
"""The holder does not (or no longer) serve this version: unpublished or never held."""
NOT_YET = 2
"""The holder is still fetching this chunk itself."""
BAD_REQUEST = 3
"""The request names a chunk outside the manifest or is otherwise invalid."""
UNAUTHORIZED = 4
"""The reader did not prove a member identity (see :class:`AuthHello`): nothing is served."""
WRONG_TRANSPORT = 5
"""The chunk's memory cannot be served over this connection's one-sided backend (host
memory over CUDA IPC): the reader asks over its next transport."""

ChunkIndex = Annotated[int, Range(-(2**31), 2**32 - 1)]
"""A chunk index as asked: a negative one still decodes, and is answered BAD_REQUEST."""

FRAME_HEADER = 4
MAX_FRAME = 1 << 20  # requests and reply headers are small; manifests travel as payload


@dataclass(frozen=True, slots=True)
class ManifestRequest:
    req_id: U63
    model: ModelName
    version: U63
    shard: Rank = 0
    layout: LayoutId = b""


@dataclass(frozen=True, slots=True)
class ChunkRequest:
    req_id: U63
    model: ModelName
    version: U63
    chunk: ChunkIndex
    shard: Rank = 0
    layout: LayoutId = b""


@dataclass(frozen=True, slots=True)
class Reply:
    req_id: U63
    status: U8
    length: U64
    detail: Text = ""


@dataclass(frozen=True, slots=True)
class ShmHello:
    """Same-host handshake: "show me where you are"; answered by :class:`ShmWelcome`."""

    req_id: U63


@dataclass(frozen=True, slots=True)
class ShmWelcome:
    """The holder's process id, and a random ``token`` that lies at address ``token_at``
    of its memory: a reader that reads those bytes back shares the holder's host and pid
    namespace and may read its memory."""

    req_id: U63
    pid: U32
    token: Annotated[bytes, MaxLen(64)]
    token_at: U64


@dataclass(frozen=True, slots=True)
class ShmChunkRequest:
    """Lease chunk ``chunk`` and say where its bytes lie; answered by one or more
    :class:`ShmGrant` frames, or by a non-OK :class:`Reply` (no lease then)."""

    req_id: U63
    model: ModelName
    version: U63
    chunk: ChunkIndex
    shard: Rank = 0
    layout: LayoutId = b""


@dataclass(frozen=True, slots=True)
class ShmGrant:
    """Where a leased chunk lies in the holder's memory: ``iovecs`` are little-endian
    uint64 ``(address, length)`` pairs, in chunk order.  A chunk in too many pieces for one
    frame is granted in several frames, all but the last with ``more``.  The lease holds
    until the reader sends :class:`ShmDone` or the connection ends."""

    req_id: U63
    length: U64
    iovecs: bytes
    more: bool


@dataclass(frozen=True, slots=True)
class ShmDone:
    """The reader has copied the chunk of request ``req_id``: the holder ends the lease."""

    req_id: U63


@dataclass(frozen=True, slots=True)
class ShmFileGrant:
    """Like :class:`ShmGrant`, for a chunk that lies wholly in the holder's memory files
    (:mod:`tensorhub.transport.samehost.memory_files`): ``pieces`` are little-endian uint64
    ``(fd, inode, offset, length)`` quadruples, in chunk order.  The reader opens
    ``/proc/<pid>/fd/<fd>``, checks the inode and maps the pages instead of copying
    through the kernel.  Same lease, same :class:`ShmDone`."""

    req_id: U63
    length: U64
    pieces: bytes
    more: bool


MESSAGES = (ManifestRequest, ChunkRequest, Reply,
            # same-host transport (tensorhub/transport/samehost/):
            ShmHello, ShmWelcome, ShmChunkRequest, ShmGrant, ShmDone, ShmFileGrant)


# -- same-host version leases (second id block: the first, 1..9, is full) --------------


@dataclass(frozen=True, slots=True)
class ShmVersionRequest:
    """A same-host reader's first request for a version on a connection: "lease me the
    whole version if you can, else just chunk ``chunk``".  A holder that holds the
    version complete and wholly in memory files answers :class:`ShmVersionGrant` and
    keeps the whole version leased for this connection until :class:`ShmRelease` or the
    connection's end; any other holder answers exactly as for a
    :class:`ShmChunkRequest` of ``chunk`` (a chunk grant, then :class:`ShmDone`, or a
    non-OK :class:`Reply`)."""

    req_id: U63
    model: ModelName
    version: U63
    chunk: ChunkIndex
    shard: Rank = 0
    layout: LayoutId = b""


@dataclass(frozen=True, slots=True)
class ShmVersionGrant:
    """Where the whole leased version lies: ``pieces`` are little-endian uint64
    ``(fd, inode, offset, length)`` quadruples covering its ``length`` bytes in order,
    cut into chunks of ``chunk_size``; several frames, all but the last with ``more``,
    when they do not fit in one.  The reader copies any chunk without asking again."""

    req_id: U63
    length: U64
    chunk_size: U32
    pieces: bytes
    more: bool


@dataclass(frozen=True, slots=True)
class ShmRelease:
    """The reader lets go of the version lease of request ``req_id``; ``chunks`` are the
    little-endian uint32 indices of the chunks it copied under it (for the holder's
    counts), continued in further frames while ``more``.  Answered by ``Reply(req_id,
    OK, 0)`` once the lease has ended."""

    req_id: U63
    chunks: bytes
    more: bool


@dataclass(frozen=True, slots=True)
class ShmRevoke:
    """The holder unpublished the leased version: the reader finishes the copy in flight
    (still leased), then sends :class:`ShmRelease`; further reads are refused."""

    req_id: U63


MESSAGES_2 = (ShmVersionRequest, ShmVersionGrant, ShmRelease, ShmRevoke)


# -- authentication (third id block): the handshake that opens every data connection ----
#
# When the holder has keys, every data connection (TCP or same-host) opens with a mutual
# challenge-response before any request:
#
#   reader -> holder   AuthHello(reader's name, reader's nonce)
#   holder -> reader   AuthHello("", holder's nonce)
#   reader -> holder   AuthProof(reader's signature)
#   holder -> reader   AuthProof(holder's signature), or Reply(0, UNAUTHORIZED) and close
#
# Each signs (a domain tag, its role, both nonces, its own name, the other's name) with
# its Ed25519 identity; each checks the other's signature under the keys the keyring
# lists for the name it expects.  The holder answers nothing -- not even its own proof --
# before the reader's proof checks out.  Fresh nonces on both sides make a recorded
# handshake useless on another connection.  (The bytes that follow are not encrypted:
# integrity comes from the publisher's chunk digests; this keeps outsiders out.)

NONCE_BYTES = 32


@dataclass(frozen=True, slots=True)
class AuthHello:
    """Who the sender is (empty from the holder: it says so only once the reader is
    known) and its fresh random ``nonce`` (:data:`NONCE_BYTES`)."""

    name: PeerName
    nonce: Annotated[bytes, MaxLen(NONCE_BYTES)]


@dataclass(frozen=True, slots=True)
class AuthProof:
    """The sender's Ed25519 signature over the handshake (see
    :func:`tensorhub.transport.handshake.transcript`)."""

    signature: Signature


MESSAGES_3 = (AuthHello, AuthProof)


# -- streamed runs (fourth id block) ----------------------------------------------------

MAX_RUN_CHUNKS = 1024
"""Chunks one :class:`ChunkRunRequest` may ask for.  A reader keeps its window in
several runs when it needs more; the holder charges each chunk of a run against the
connection's request rate, so a run buys nothing a flood of single requests would not."""


@dataclass(frozen=True, slots=True)
class ChunkRunRequest:
    """Stream chunks ``first`` .. ``first + count - 1`` of a version back to back: one
    :class:`ChunkReply` each, in order, sent as soon as the holder has the chunk."""

    req_id: U63
    model: ModelName
    version: U63
    first: U32
    count: Annotated[int, Range(1, MAX_RUN_CHUNKS)]
    shard: Rank = 0
    layout: LayoutId = b""


@dataclass(frozen=True, slots=True)
class ChunkReply:
    """The answer for chunk ``chunk`` of run ``req_id``: like :class:`Reply`, followed by
    ``length`` payload bytes when ``status == OK``."""

    req_id: U63
    chunk: U32
    status: U8
    length: U64
    detail: Text = ""


MESSAGES_4 = (ChunkRunRequest, ChunkReply)


# -- chunk deltas (fifth id block; see :mod:`tensorhub.protocol.delta`) ------------------


@dataclass(frozen=True, slots=True)
class DeltaRunRequest:
    """Stream chunks ``first`` .. ``first + count - 1`` of ``version`` as deltas against
    the same chunks of ``base``, which the reader holds: one :class:`DeltaReply` each,
    in order, as soon as the holder has the chunk.  A holder without ``base`` answers
    each chunk ``NOT_HELD`` (the reader then fetches them in full)."""

    req_id: U63
    model: ModelName
    version: U63
    base: U63
    first: U32
    count: Annotated[int, Range(1, MAX_RUN_CHUNKS)]
    shard: Rank = 0
    layout: LayoutId = b""


@dataclass(frozen=True, slots=True)
class DeltaReply:
    """The answer for chunk ``chunk`` of delta run ``req_id``: followed by ``length``
    bytes of delta payload (:func:`tensorhub.protocol.delta.apply_chunk`) when
    ``status == OK``; ``encode_us`` is the holder's CPU time encoding it."""

    req_id: U63
    chunk: U32
    status: U8
    length: U64
    encode_us: U32 = 0
    detail: Text = ""


MESSAGES_5 = (DeltaRunRequest, DeltaReply)


# -- link probes (sixth id block; see :mod:`tensorhub.protocol.probing`) -----------------


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """Send ``nbytes`` bytes of zeros, to time the link: answered by a :class:`Reply`
    whose ``length`` is what the holder sends (at most its ``PeerConfig.wan_probe_bytes``;
    0 with ``nbytes`` 0, a round trip alone), followed by that many zero bytes.  A
    holder with probes off answers ``BAD_REQUEST``."""

    req_id: U63
    nbytes: U64


MESSAGES_6 = (ProbeRequest,)
