"""What a peer reports about itself (:meth:`tensorhub.peer.node.Peer.statistics`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..transport.admission import ServerStats

INSECURE = "insecure: no keys; any local process can join, read and publish"


@dataclass(frozen=True)
class PeerStats:
    name: str
    control: str
    data: str
    members: dict[str, str]
    holdings: dict[str, str]
    bytes_served: int
    chunks_served: int
    bytes_fetched: int
    bytes_fetched_by_source: dict[str, int]
    bytes_by_transport: dict[str, int]
    fetches: int
    integrity_failures: dict[str, int]
    malformed_dropped: int
    gossip_dropped: int
    control_received: int
    control_sent: int
    internal_errors: int
    """Exceptions our own code raised on remote input (bugs: always expected to be 0)."""
    internal_error_texts: tuple[str, ...]
    """The last few of them."""
    shm: str
    """Whether the same-host transport is usable here, and if not why."""
    shm_fallbacks: dict[str, str]
    """Same-host peers read over TCP instead, and why."""
    security: str = INSECURE
    """``"keys: ..."`` (members, key rotation state) or why this peer is insecure."""
    refused: dict[str, int] = field(default_factory=dict)
    """What security refused, by kind: control connections (``handshake``: not a
    member, or no CURVE), messages whose sender name is not the authenticated member's,
    and claims whose signature did not verify."""
    digest: str = ""
    """The chunk digest this peer publishes with, and whether it holds against lying
    holders (``xxh3-128``: trusted fleet only)."""
    bans: dict[str, str] = field(default_factory=dict)
    """Holders this peer does not read from now (their bytes failed a digest): the
    reason and the seconds left."""
    ban_notices: dict[str, int] = field(default_factory=dict)
    """Ban notices other peers sent, per reporter: hints, counted, never obeyed."""
    reports: tuple[dict[str, Any], ...] = field(default=())
    data_server: ServerStats | None = None
    """What the data server admitted, refused and revoked (and whether it authenticates)."""
