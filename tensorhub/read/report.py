"""What a fetch reports (:class:`FetchReport`) and returns (:class:`Fetched`)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class FetchReport:
    """What one fetch did: where its bytes came from and how long it took."""

    model: str
    version: int
    seconds: float = 0.0
    bytes: int = 0
    chunks: int = 0
    chunks_received: int = 0
    """Chunk payloads received in full (verified or not): equals ``chunks`` when no
    chunk had to be received twice."""
    reads: int = 0
    """Requests for chunks: a streamed run (TCP) or a batch under a same-host version
    lease asks for several neighbouring chunks at once."""
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    transport_by_source: dict[str, str] = field(default_factory=dict)
    transport_refusals: dict[str, str] = field(default_factory=dict)
    """Per source: the transports preferred over the one used and skipped, and why
    (``PeerConfig.transports``; :mod:`tensorhub.read.dialing`)."""
    local_digest_chunks: int = 0
    """Chunks checked against the manifest's fast local digests (xxh3-128) instead of
    its cryptographic ones: read from a same-host holder that could write this process's
    memory anyway (``Connection.holder_shares_memory``)."""
    device_digest_chunks: int = 0
    """Chunks that such a holder's transport (CUDA IPC) copied straight into the
    destination's device memory, checked there against the manifest's device digests
    (``dsum-128``) instead of through the staging ring."""
    integrity_failures: dict[str, int] = field(default_factory=dict)
    dropped_sources: dict[str, str] = field(default_factory=dict)
    banned_sources: dict[str, str] = field(default_factory=dict)
    """Holders this fetch did not read from because the peer bans them (a chunk of
    theirs failed its digest, in this fetch or an earlier one), and why."""
    resourced_chunks: int = 0
    stall_retries: dict[str, int] = field(default_factory=dict)
    """Reads that stalled at a source no other holder could replace, and were asked of it
    again (with more time) rather than failing the fetch."""
    planned_bytes: int = 0
    """Bytes that came from the source the coordinator's plan named."""
    plan: str = ""
    """The plan followed: coordinator and epoch, or why there was none."""
    route: str = ""
    """Which DC path the bytes into this peer's DC took, and why: the links' rates and
    whether each was declared, measured or a default (the coordinator's
    ``Planner.route_of``); empty when no plan was followed."""
    plan_seconds: float | None = None
    """From asking the version's coordinator for a plan until its answer (or the
    failure to get one); None when no plan was asked (planning off, a named source, a
    shard, a resharding fetch)."""
    switch_seconds: float | None = None
    """Set when a rollout makes this fetch's version live: the swap
    (:attr:`Committed.switch_seconds <tensorhub.peer.rollout.Committed.switch_seconds>`);
    None until then, and in the peer's report history, which keeps each report as it
    was when its fetch ended (switches are counted in ``statistics()`` instead)."""
    chunk_size: str = ""
    """The version's chunk size, as its publisher chose it, and whether that is the
    automatic choice for its size (:func:`~tensorhub.protocol.sizing.choose_chunk_size`)."""
    windows: dict[str, str] = field(default_factory=dict)
    """Per source: the window kept in flight on each stream from it, and why (rate x
    round trip measured on that source, the floor or the cap), and the most streams
    open to it at once."""
    first_byte_seconds: float = 0.0
    """From the start of the fetch to its first verified chunk."""
    transfer_seconds: float = 0.0
    """From the start of the fetch to its last chunk landed (verified)."""
    verify_seconds: float = 0.0
    """Time spent checking chunk digests, summed over chunks (checks run in worker
    threads, several at once, so this can exceed ``seconds``).  A same-host chunk
    checked block by block as it is copied (``shm-memfd`` with local digests) counts
    its copy here too."""
    verified: bool = False
    cast: dict[str, str] = field(default_factory=dict)
    """Tensors cast after verification (``fetch(cast=...)``): name -> ``from->to``."""
    cast_seconds: float = 0.0
    delta_bytes: int = 0
    """Bytes received as chunk deltas (``bytes`` counts those received in full); see
    ``delta`` for the rest of the delta phase."""
    delta_chunks: int = 0
    """Chunks made from a delta (applied to an older version held here, verified)."""
    unchanged_chunks: int = 0
    """Chunks copied from that older version (same digest): not sent at all."""
    delta_encode_seconds: float = 0.0
    """CPU seconds the holders spent encoding this fetch's deltas (as they said)."""
    delta_apply_seconds: float = 0.0
    """CPU seconds spent here applying deltas and copying unchanged chunks."""
    delta: dict[str, Any] = field(default_factory=dict)
    """The delta phase (``PeerConfig.delta``): the base version, a note (sources, or
    why none), formats, sources that fell back to full chunks and why, sources skipped
    because full chunks were faster; empty with deltas off."""
    joined: bool = False
    """True when another fetch of the same version was already moving it here: this one
    waited for that transfer (single flight) instead of moving the bytes again, and
    this report is a copy of that fetch's, with the result read as held here
    (``served_arrays``, or copied into ``into=``: ``copy_seconds``)."""
    copy_seconds: float = 0.0
    """Seconds spent copying the version, held here complete, into the caller's
    ``into=`` arrays (a version fetched again, or a fetch that joined another)."""
    served_arrays: bool = False
    """True when the fetch found the version already held here complete and returned
    the very arrays this peer serves it from (the caller's published arrays, or those of
    an earlier fetch), not a copy: writing to them changes what readers get.  Unpublish
    first, or fetch with ``into=``, to get arrays of one's own."""

    def copy(self) -> FetchReport:
        """A copy whose dicts are its own."""
        return copy.deepcopy(self)

    def add(self, other: FetchReport) -> None:
        """Count ``other`` (a part of the same fetch) in this report."""
        self.bytes += other.bytes
        self.chunks += other.chunks
        self.chunks_received += other.chunks_received
        self.reads += other.reads
        self.resourced_chunks += other.resourced_chunks
        for name, n in other.bytes_by_source.items():
            self.bytes_by_source[name] = self.bytes_by_source.get(name, 0) + n
        for name, n in other.integrity_failures.items():
            self.integrity_failures[name] = self.integrity_failures.get(name, 0) + n
        for name, n in other.stall_retries.items():
            self.stall_retries[name] = self.stall_retries.get(name, 0) + n
        self.transport_by_source.update(other.transport_by_source)
        self.transport_refusals.update(other.transport_refusals)
        self.windows.update(other.windows)
        self.dropped_sources.update(other.dropped_sources)
        self.banned_sources.update(other.banned_sources)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "version": self.version, "seconds": self.seconds,
            "bytes": self.bytes, "chunks": self.chunks, "mb_per_s": self.mb_per_s,
            "chunks_received": self.chunks_received, "reads": self.reads,
            "bytes_by_source": dict(self.bytes_by_source),
            "transport_by_source": dict(self.transport_by_source),
            "transport_refusals": dict(self.transport_refusals),
            "integrity_failures": dict(self.integrity_failures),
            "dropped_sources": dict(self.dropped_sources),
            "banned_sources": dict(self.banned_sources),
            "resourced_chunks": self.resourced_chunks, "verified": self.verified,
            "stall_retries": dict(self.stall_retries),
            "served_arrays": self.served_arrays, "joined": self.joined,
            "copy_seconds": self.copy_seconds,
            "cast": dict(self.cast), "cast_seconds": self.cast_seconds,
            "planned_bytes": self.planned_bytes, "plan": self.plan, "route": self.route,
            "plan_seconds": self.plan_seconds, "switch_seconds": self.switch_seconds,
            "chunk_size": self.chunk_size, "windows": dict(self.windows),
            "first_byte_seconds": self.first_byte_seconds,
            "transfer_seconds": self.transfer_seconds, "verify_seconds": self.verify_seconds,
            "local_digest_chunks": self.local_digest_chunks,
            "delta_bytes": self.delta_bytes, "delta_chunks": self.delta_chunks,
            "unchanged_chunks": self.unchanged_chunks,
            "delta_encode_seconds": self.delta_encode_seconds,
            "delta_apply_seconds": self.delta_apply_seconds, "delta": dict(self.delta),
        }


@dataclass(frozen=True)
class Fetched:
    """The result of :meth:`Peer.fetch`: the version, its tensors and what it took."""

    version: int
    tensors: dict[str, np.ndarray[Any, Any]]
    report: FetchReport
