"""Status queries: what an operator's view (``tensorhub status``) asks each member.

Theory of operation
-------------------
Gossip tells every member who is alive and which chunks of which versions each peer
holds, but not how many bytes those are, which transfers are running from whom, or
how fast.  ``tensorhub status`` joins the mesh as a member and sends each live member a
:class:`StatusQuery`; the member answers with a :class:`StatusReply` over the connection
the query came on (never a new one: the asker must have reached it), with the versions
it holds and their bytes, its fetches in flight (bytes received so far from each
source) and a few counters.  Rates are the asker's business: it queries again and
divides the difference by the time between replies.  A reply is matched to its query
by ``nonce``; a late or unknown one is dropped.  Replies are bounded like every message
(at most :data:`MAX_HELD` versions and :data:`MAX_LINKS` links, the rest left out and
counted in ``left_out``), and :func:`encode_reply` halves the lists until the reply
fits the frame size the peer is configured with, so a member with much state still
answers in one frame.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated

from ..bounds import U32, U63, MaxLen, PeerName, Rank
from ..errors import LocalProtocolError
from ..model import ModelName
from . import codec

MAX_HELD = 1024
MAX_LINKS = 1024
TransportName = Annotated[str, MaxLen(32)]


@dataclass(frozen=True, slots=True)
class HeldVersion:
    """One shard a member holds: its bytes, and how many of its chunks are verified."""

    model: ModelName
    version: U63
    shard: Rank
    nbytes: U63
    verified_chunks: U32
    num_chunks: U32


@dataclass(frozen=True, slots=True)
class LinkBytes:
    """Bytes a running fetch of ``model@version`` has received from ``source``."""

    model: ModelName
    version: U63
    source: PeerName
    transport: TransportName
    nbytes: U63
    total: U63
    """Bytes the whole fetch needs."""


@dataclass(frozen=True, slots=True)
class StatusQuery:
    nonce: U63


@dataclass(frozen=True, slots=True)
class StatusReply:
    nonce: U63
    name: PeerName
    held: Annotated[tuple[HeldVersion, ...], MaxLen(MAX_HELD)]
    links: Annotated[tuple[LinkBytes, ...], MaxLen(MAX_LINKS)]
    bytes_fetched: U63
    bytes_served: U63
    fetches: U63
    integrity_failures: U63
    suspicions: U63
    left_out: U32 = 0
    """Held versions and links over the bounds, not listed."""


MESSAGES = (StatusQuery, StatusReply)


def encode_reply(reply: StatusReply, max_bytes: int) -> bytes:
    """``reply`` encoded within ``max_bytes``: held versions and links are halved (the
    rest counted in ``left_out``) until it fits."""
    while True:
        try:
            return codec.encode(reply, max_bytes)
        except LocalProtocolError:
            if not reply.held and not reply.links:
                raise
            held, links = reply.held[:len(reply.held) // 2], reply.links[:len(reply.links) // 2]
            dropped = len(reply.held) - len(held) + len(reply.links) - len(links)
            reply = replace(reply, held=held, links=links,
                            left_out=min(reply.left_out + dropped, 2**32 - 1))
