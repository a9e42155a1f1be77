"""SWIM's wire messages and outputs (see :mod:`tensorhub.protocol.membership`).

An :class:`Update` is one claim about one member; pings, acks, nacks and gossip carry
updates piggybacked; a :class:`PushPull` carries a view digest or full state.  The state
machine that sends and merges them is :class:`~tensorhub.protocol.membership.Membership`;
it returns :class:`Outbound` messages and :class:`MemberEvent` records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..bounds import MAX_PEERS, U63, ControlEndpoint, MaxLen, PeerName, Range, Signature
from ..model import PeerInfo
from .codec import fields_bytes

KIND_ALIVE, KIND_SUSPECT, KIND_DEAD, KIND_LEFT = range(4)  # an Update's kind: the rank of STATUSES
_TAG = b"tensorhub/member-claim/1\0"
PIGGYBACK_PROBE = 8        # updates riding on a ping or ack
PIGGYBACK_GOSSIP = 256     # updates in one gossip message (TCP: no datagram limit)


# -- wire messages ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Update:
    """One claim about one member.  ``kind`` indexes STATUSES; ``origin`` is who made
    it (the accuser of a suspicion or death, the member itself otherwise); ``info`` is
    carried by alive claims and by full-state records; ``sig`` is the origin's
    signature (empty without security; see :meth:`signed_bytes`)."""

    kind: Annotated[int, Range(0, KIND_LEFT)]
    name: PeerName
    incarnation: U63
    origin: PeerName
    info: PeerInfo | None
    sig: Signature = b""

    def __post_init__(self) -> None:
        if not 0 <= self.kind <= KIND_LEFT or self.incarnation < 0:
            raise ValueError("update kind or incarnation out of range")
        if (self.info is None and self.kind == KIND_ALIVE) or (
            self.info is not None and self.info.name != self.name
        ):
            raise ValueError("update info missing or about another member")

    def signed_bytes(self) -> bytes:
        """What ``sig`` covers: the claim, with ``info`` only where it is the claim's
        own (alive), so records may carry a member's info beside any claim."""
        info = self.info if self.kind == KIND_ALIVE else None
        return fields_bytes(_TAG, self.kind, self.name, self.incarnation, self.origin, info)

    def with_info(self, info: PeerInfo | None) -> Update:
        """This claim carrying ``info`` (its signature stays valid: see
        :meth:`signed_bytes`)."""
        return Update(self.kind, self.name, self.incarnation, self.origin, info, self.sig)


ProbeUpdates = Annotated[tuple[Update, ...], MaxLen(PIGGYBACK_PROBE + 1)]
"""What rides on a probe: the piggybacked news, plus the receiver's own record."""


@dataclass(frozen=True, slots=True)
class Ping:
    sender: ControlEndpoint
    sender_name: PeerName
    seq: U63
    target: PeerName  # the name we expect to answer (an address may have been reused)
    updates: ProbeUpdates


@dataclass(frozen=True, slots=True)
class IndirectPing:
    """Ask the receiver to ping member ``target`` for us.  ``target_control`` is only
    informative: the receiver pings the address *its* view has for ``target``."""

    sender: ControlEndpoint
    sender_name: PeerName
    seq: U63
    target: PeerName
    target_control: ControlEndpoint
    updates: ProbeUpdates


@dataclass(frozen=True, slots=True)
class Ack:
    sender: ControlEndpoint
    sender_name: PeerName
    seq: U63
    updates: ProbeUpdates


@dataclass(frozen=True, slots=True)
class Nack:
    sender: ControlEndpoint
    sender_name: PeerName
    seq: U63


@dataclass(frozen=True, slots=True)
class Gossip:
    sender: ControlEndpoint
    sender_name: PeerName
    updates: Annotated[tuple[Update, ...], MaxLen(PIGGYBACK_GOSSIP)]


@dataclass(frozen=True, slots=True)
class PushPull:
    """A view digest, optionally with full state (``members``: one record per member)."""

    sender: ControlEndpoint
    sender_name: PeerName
    digest: Annotated[bytes, MaxLen(64)]
    members: Annotated[tuple[Update, ...], MaxLen(MAX_PEERS)]
    want_reply: bool


MESSAGES = (Ping, IndirectPing, Ack, Nack, Gossip, PushPull)  # append only
Message = Ping | IndirectPing | Ack | Nack | Gossip | PushPull


# -- outputs -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Outbound:
    dest: str     # control address
    msg: object   # a wire message (membership's, or another protocol's riding along)
    reply: bool = False
    """``dest`` is the sender of a message we answer: the shell sends it back over the
    connection that message came on and never connects to ``dest`` (an address taken
    from a message is never contacted)."""


@dataclass(frozen=True, slots=True)
class MemberEvent:
    kind: str  # joined, alive, suspect, dead, left
    name: str
    incarnation: int
