"""Who a control message may come from: the rule that keeps replies where they belong.

Theory of operation
-------------------
Every peer's ZeroMQ routing id is its control endpoint, and the shell knows the routing
id of the connection each frame arrived on.  Messages that carry a ``sender`` address
are answered at that address, so the address must *be* the connection: a message whose
``sender`` differs from its routing id is refused, and a reply then goes back over the
connection it came on and nowhere else (the shell never opens a connection for a
reply).  Messages that name their sender as a member (a group envelope, a keep query,
a ban notice) are answered (if at all) by name through our own membership view, so the
member must be reached at that connection.  A coordinator request forwarded by another
member keeps its asker's address but is answered at the address our view has for the
asker's name.

Pure: the caller passes the members it knows.
"""

from __future__ import annotations

from collections.abc import Mapping

from . import control, coordination, membership
from .bans import BanNotice
from .coordination import CoordRequest
from .groups import GroupEnvelope
from .opstatus import StatusQuery, StatusReply
from .retention import KeepAnswer, KeepQuery
from .view import MemberState

CONTROL = (*membership.MESSAGES, *control.MESSAGES, *coordination.MESSAGES)
"""What the control plane handles; each but CoordReply names its sender's address."""


def misaddressed(msg: object, routing_id: str, members: Mapping[str, MemberState]) -> str:
    """Why ``msg`` may not be taken from the connection ``routing_id`` ('' if it may)."""
    if isinstance(msg, GroupEnvelope | KeepQuery | BanNotice):
        name = msg.asker if isinstance(msg, KeepQuery) else msg.sender
        member = members.get(name)
        if member is None or member.info.control != routing_id:
            return f"speaks for {name[:100]!r}, not a member at that address"
        return ""
    if isinstance(msg, KeepAnswer | StatusReply):
        return ""  # matched against the address we asked (peer/retention.py, opstatus.py)
    if isinstance(msg, StatusQuery):
        return ""  # answered over the connection it came on, and nowhere else
    if not isinstance(msg, CONTROL):
        return "not a control-plane message"
    if isinstance(msg, CoordRequest) and msg.hops:
        return ""  # forwarded: answered at the asker's address in our own view
    claimed = getattr(msg, "sender", routing_id)
    return "" if claimed == routing_id else f"claims to come from {claimed[:100]!r}"


def claimed_name(msg: object) -> str | None:
    """The member name a control message says it comes from (None: it names none), to
    hold against the member its connection authenticated as (secure mode).  A forwarded
    coordinator request names its asker, whose signature speaks for it, not the
    forwarder that passes it on: None."""
    if isinstance(msg, membership.MESSAGES):
        return msg.sender_name
    if isinstance(msg, CoordRequest):
        return msg.name if msg.hops == 0 else None
    if isinstance(msg, control.RefsDigest | control.RefsDelta):
        return msg.name
    if isinstance(msg, GroupEnvelope):
        return msg.sender
    if isinstance(msg, KeepQuery):
        return msg.asker
    return None
