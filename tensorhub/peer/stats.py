"""What a peer reports about itself (:meth:`tensorhub.peer.node.Peer.statistics`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import PeerConfig
from ..manifest.digests import TRUSTED_ONLY
from ..read.report import FetchReport
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
    """Transfers finished here (a fetch that joined another's transfer is not one)."""
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
    transports: dict[str, str] = field(default_factory=dict)
    """Each transport of ``PeerConfig.transports``, in order of preference: available
    here and what was found, or why not (:mod:`tensorhub.read.dialing`)."""
    transport_chosen: dict[str, str] = field(default_factory=dict)
    """Per holder read from: the transport of the last connection to it."""
    transport_refusals: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per holder: each transport preferred over the chosen one and skipped, and why."""
    tcp_local_digests: dict[str, str] = field(default_factory=dict)
    """Per holder on this host read over TCP: whether its last connection checks chunks
    against the manifest's fast local digests (the holder shown to share memory with
    this process), and why or why not (:mod:`tensorhub.transport.samehost.loopback`)."""
    registrations: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per one-sided transport served: buffers registered, reused, keys granted and
    revoked (:mod:`tensorhub.transport.onesided.registry`)."""
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
    switches: int = 0
    """Versions rollouts (and group ranks) made live here."""
    switch_seconds: float = 0.0
    """Seconds those swaps took, summed (each one: ``Committed.switch_seconds``)."""
    casts: int = 0
    """Fetches that cast a tensor on the way (``fetch(cast=...)``)."""
    cast_seconds: float = 0.0
    """Seconds those casts took, summed (each one: ``FetchReport.cast_seconds``)."""
    delta: dict[str, float] = field(default_factory=dict)
    """Chunk deltas (:mod:`tensorhub.read.deltas`), as a reader: fetches that had a
    delta phase, delta payload bytes received and the bytes of the chunks they made
    (what they would have cost in full: compare ``bytes_fetched``, the bytes received
    in full), delta chunks, chunks copied unchanged from a base, CPU seconds the holders
    spent encoding them and we spent applying them, sources that fell back to full
    chunks; as a holder (``served_*``): chunks encoded, sent whole, their bytes, delta
    bytes sent and CPU seconds encoding."""
    switch_interval: str = ""
    """The interpreter's thread switch interval while this peer runs, and why
    (``PeerConfig.switch_interval``, :mod:`tensorhub.peer.switching`)."""
    fetches_joined: int = 0
    """Fetch calls that found the same version already moving here and waited for that
    transfer instead of moving its bytes again (single flight; ``FetchReport.joined``)."""
    fetches_in_flight: int = 0
    """Versions moving into this peer now (one transfer each, however many callers)."""
    control_waiting: int = 0
    """Control frames received and not handled yet (the fair inbound queue)."""
    control_dropped: int = 0
    """Of ``gossip_dropped``, the control frames read and dropped unhandled: of several
    parts, or beyond their sender's share or rate (:mod:`tensorhub.peer.inbox`)."""
    chunking: str = ""
    """How this peer cuts what it publishes into chunks (automatic, or
    ``PeerConfig.chunk_size``), and what its last publish chose and why.  Each fetch
    report says the chunk size and the stream windows of that fetch."""
    wan: dict[str, Any] = field(default_factory=dict)
    """The links between DCs as this peer knows them (:mod:`tensorhub.protocol.wan`):
    ``links``, one row per DC pair (from, to, Mbit, rtt_ms, how: declared or measured,
    reporters: the origins whose measurements it is the median of); ``probes``: whether
    this peer probes links and how; ``probed``: what its probes found, per link;
    ``implausible_entries``: reference entries refused for link reports out of range."""


def digest_text(algo: str) -> str:
    return algo + (" (trusted fleet only: a holder can forge chunks that pass)"
                   if algo in TRUSTED_ONLY else " (cryptographic)")


def chunking_text(config: PeerConfig, last: str) -> str:
    return ("automatic (about 64 chunks a version and per level of the relay tree the "
            "mesh allows, 4 to 64 MiB)" if config.chunk_size is None else
            f"{config.chunk_size} bytes (PeerConfig.chunk_size)") + f"; last publish: {last}"


@dataclass
class Switches:
    """Versions rollouts (and group ranks) made live at one peer, and how long the swaps
    took (``PeerStats.switches``, ``switch_seconds``)."""

    count: int = 0
    seconds: float = 0.0

    def add(self, report: FetchReport, seconds: float) -> None:
        """A rollout swapped to the version ``report`` fetched, in ``seconds``."""
        report.switch_seconds = seconds
        self.count += 1
        self.seconds += seconds
