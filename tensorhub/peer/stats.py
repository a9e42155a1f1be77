"""What a peer reports about itself (:meth:`tensorhub.peer.node.Peer.statistics`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ..manifest.digests import TRUSTED_ONLY
from ..transport.admission import ServerStats
from .delta_fetch import book
from .switching import describe

if TYPE_CHECKING:
    from .fetch_report import FetchReport
    from .node import Peer

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
    transports: dict[str, str] = field(default_factory=dict)
    """Each transport of ``PeerConfig.transports``, in order of preference: available
    here and what was found, or why not (:mod:`tensorhub.peer.dialing`)."""
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
    """Chunk deltas (:mod:`tensorhub.peer.delta_fetch`), as a reader: fetches that had a
    delta phase, delta payload bytes received and the bytes of the chunks they made
    (what they would have cost in full: compare ``bytes_fetched``, the bytes received
    in full), delta chunks, chunks copied unchanged from a base, CPU seconds the holders
    spent encoding them and we spent applying them, sources that fell back to full
    chunks; as a holder (``served_*``): chunks encoded, sent whole, their bytes, delta
    bytes sent and CPU seconds encoding."""
    switch_interval: str = ""
    """The interpreter's thread switch interval while this peer runs, and why
    (``PeerConfig.switch_interval``, :mod:`tensorhub.peer.switching`)."""
    chunking: str = ""
    """How this peer cuts what it publishes into chunks (automatic, or
    ``PeerConfig.chunk_size``), and what its last publish chose and why.  Each fetch
    report says the chunk size and the stream windows of that fetch."""


def _security_text(peer: Peer) -> str:
    trust = peer.control.trust
    if trust is None:
        return INSECURE
    return (f"keys: {len(trust.keyring.members())} members, keyring generation "
            f"{trust.keyring.generation}; control socket CURVE with a member allow-list")


def _refused(peer: Peer) -> dict[str, int]:
    trust = peer.control.trust
    out = dict(trust.refused) if trust is not None else {}
    if peer._zap is not None and peer._monitor is not None:
        out["handshake"] = peer._monitor.failed  # no CURVE, wrong cluster key, ...
        out["not a member"] = peer._zap.refused  # ... or a key not in the keyring
    if peer._sender_mismatch:
        out["sender name"] = peer._sender_mismatch
    return out



def _shm(peer: Peer) -> str:
    ok, why = peer.dialer.found.get("shm", (False, "not enabled"))
    return "available" if ok else f"unavailable: {why}"


def _delta(peer: Peer) -> dict[str, float]:
    served = peer._server.delta
    return {**book(peer).totals, "served_chunks": served.chunks,
            "served_raw_chunks": served.raw_chunks, "served_chunk_bytes": served.chunk_bytes,
            "served_delta_bytes": served.delta_bytes,
            "served_encode_seconds": served.encode_seconds}


def peer_statistics(peer: Peer) -> PeerStats:
    """The snapshot :meth:`Peer.statistics` returns."""
    rs = peer._router.statistics()
    return PeerStats(
        name=peer.info.name, control=peer.info.control, data=peer.info.data,
        members={n: m.status for n, m in peer.control.membership.members().items()},
        holdings={str(k): ("complete" if v.complete else
                           f"{v.num_verified}/{v.manifest.num_chunks} chunks")
                  for k, v in peer.store.versions.items() if not v.hidden},
        bytes_served=peer._served, chunks_served=peer._chunks_served,
        bytes_fetched=peer._fetched, bytes_fetched_by_source=dict(peer._by_source),
        bytes_by_transport=dict(peer._by_transport), fetches=peer._nfetches,
        integrity_failures=dict(peer._integrity), malformed_dropped=peer._malformed,
        gossip_dropped=rs.dropped_inbound + rs.dropped_outbound,
        control_received=rs.received, control_sent=rs.sent,
        internal_errors=peer._internal_errors,
        internal_error_texts=tuple(peer._internal_texts),
        shm=_shm(peer),
        shm_fallbacks={h: r["shm"] for h, r in peer.dialer.refusals.items() if "shm" in r},
        transports=peer.dialer.describe(), transport_chosen=dict(peer.dialer.chosen),
        transport_refusals={h: dict(r) for h, r in peer.dialer.refusals.items() if r},
        tcp_local_digests=dict(peer.dialer.local_digests),
        registrations={name: asdict(st) for name, st in
                       peer.dialer.host.statistics().items()},
        security=_security_text(peer), refused=_refused(peer),
        digest=peer.config.digest_algo + (
            " (trusted fleet only: a holder can forge chunks that pass)"
            if peer.config.digest_algo in TRUSTED_ONLY else " (cryptographic)"),
        bans={n: f"{why} ({left:.0f} s left)"
              for n, (left, why) in peer.bans.active(trio.current_time()).items()},
        ban_notices=dict(peer.bans.notices),
        reports=tuple(peer._reports), data_server=peer._server.statistics(),
        switches=peer._switches, switch_seconds=peer._switch_seconds,
        casts=peer._casts, cast_seconds=peer._cast_seconds, delta=_delta(peer),
        switch_interval=describe(peer.config.switch_interval),
        chunking=("automatic (about 64 chunks a version and per level of the relay tree "
                  "the mesh allows, 4 to 64 MiB)"
                  if peer.config.chunk_size is None else
                  f"{peer.config.chunk_size} bytes (PeerConfig.chunk_size)")
        + f"; last publish: {peer.chunking}",
    )


def count_integrity(peer: Peer, report: FetchReport) -> None:
    """Count who sent bad bytes in ``report`` (a failed fetch still tells)."""
    for src, n in report.integrity_failures.items():
        peer._integrity[src] = peer._integrity.get(src, 0) + n


def account(peer: Peer, report: FetchReport) -> None:
    """Count a finished fetch in the peer's statistics."""
    peer._nfetches += 1
    peer._fetched += report.bytes
    for src, n in report.bytes_by_source.items():
        peer._by_source[src] = peer._by_source.get(src, 0) + n
        tr = report.transport_by_source.get(src, "?")
        peer._by_transport[tr] = peer._by_transport.get(tr, 0) + n
        why = peer.dialer.refusals_of(src)
        if why:
            report.transport_refusals[src] = why
    count_integrity(peer, report)
    peer._reports = [*peer._reports[-63:], report.to_dict()]


def account_switch(peer: Peer, report: FetchReport, seconds: float) -> None:
    """Count a rollout's swap to the version ``report`` fetched, which took ``seconds``."""
    report.switch_seconds = seconds
    peer._switches += 1
    peer._switch_seconds += seconds


def account_cast(peer: Peer, report: FetchReport) -> None:
    """Count a fetch's cast, done after its report was accounted (:func:`account`)."""
    if report.cast:
        peer._casts += 1
        peer._cast_seconds += report.cast_seconds
