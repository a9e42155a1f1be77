"""Topology: where peers sit and how fast bytes move between them.

Theory of operation
-------------------
Every peer is a :class:`NodeInfo`: its ``dc`` / ``rack`` / ``host`` labels and its NIC
upload and download bandwidth (bytes/s).  Two peers are related by a
:class:`Locality` class -- same host, same rack, same DC, or cross DC -- which the
planner prefers in that order.

A *link estimate* is the throughput of ``src -> dst``.  Until something was measured it
is the default of the pair's locality class (:class:`TopologyConfig`); each completed
transfer of at least ``min_sample_bytes`` then updates it as an exponentially weighted
moving average, because small transfers measure latency, not bandwidth.  Only the
receiver measures (``observe(src, dst=self, ...)``), so the estimates *into* a peer are
that peer's own data: it gossips them as one :class:`LinkDigest` with a sequence number,
and a merge keeps, per origin, the digest with the highest sequence number.  Merging is
thus commutative, associative and idempotent.

Between DCs each ordered pair ``a -> b`` has its own link (:class:`~.wan.Wan`: declared,
measured, gossiped); :meth:`Topology.dc_link` is its rate and round trip, the
``wan_bps`` default where nothing is known.  A cross-DC pair of peers nobody measured is
estimated at its DCs' link rate.

:func:`cut_bound` is the time no schedule can beat: every byte must leave the sources,
reach the slowest fetcher, fit in the sum of all uplinks, and enter every set of DCs
without a source over the links into it (the cuts); :func:`fluid_bound` is its one-link
special case and :func:`star_time` what everyone pulling from the sources would take.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from ..errors import ConfigError, LocalProtocolError, RemoteProtocolError
from ..model import PeerInfo
from .wan import Wan

MAX_DIGEST_LINKS = 4096


class Locality(IntEnum):
    """How close two peers are; a lower value is preferred."""

    SAME_HOST = 0
    SAME_RACK = 1
    SAME_DC = 2
    CROSS_DC = 3


@dataclass(frozen=True)
class NodeInfo:
    """A peer's place in the topology and its NIC bandwidth in bytes/s."""

    name: str
    dc: str
    rack: str
    host: str
    up_bps: float
    down_bps: float

    def __post_init__(self) -> None:
        if not self.name:
            raise LocalProtocolError("a node needs a name")
        for bps in (self.up_bps, self.down_bps):
            if not (math.isfinite(bps) and bps > 0):
                raise LocalProtocolError(f"node {self.name!r}: NIC bandwidth must be > 0")

    @classmethod
    def from_peer(cls, peer: PeerInfo, nic_bps: float) -> NodeInfo:
        """Read labels ``dc``, ``rack``, ``host`` and ``nic_bps`` (default ``nic_bps``).

        A peer without a ``host`` label is its own host; without ``rack``, it shares a
        rack with nobody.
        """
        label = peer.label("nic_bps")
        try:
            bps = float(label) if label is not None else nic_bps
        except ValueError:
            raise LocalProtocolError(f"peer {peer.name!r}: bad nic_bps {label!r}") from None
        return cls(peer.name, peer.label("dc") or "", peer.label("rack") or "",
                   peer.label("host") or peer.name, bps, bps)


@dataclass(frozen=True)
class LinkDigest:
    """The throughput estimates ``origin`` measured into itself, for gossip."""

    origin: str
    seq: int
    sources: tuple[str, ...]
    bps: tuple[float, ...]


MESSAGES = (NodeInfo, LinkDigest)


def locality(a: NodeInfo, b: NodeInfo) -> Locality:
    if a.dc != b.dc:
        return Locality.CROSS_DC
    if a.host == b.host:
        return Locality.SAME_HOST
    if a.rack and a.rack == b.rack:
        return Locality.SAME_RACK
    return Locality.SAME_DC


@dataclass(frozen=True)
class TopologyConfig:
    """Link defaults in bytes/s per locality class, and how estimates learn."""

    same_host_bps: float = 100e9
    """Shared memory / NVLink inside one host; far above any NIC."""
    same_rack_bps: float = 50e9
    """One switch hop: a 400 Gb/s NIC's line rate."""
    same_dc_bps: float = 25e9
    """Across the spine; 2:1 oversubscription is common."""
    cross_dc_bps: float = 25e9
    """One flow across the inter-DC link (200 Gb/s cross-site)."""
    wan_bps: float = 25e9
    """A DC pair's link where nothing was declared or measured (each pair its own)."""
    ewma_alpha: float = 0.3
    """Weight of a new sample. Higher follows change faster, but is noisier."""
    min_sample_bytes: int = 1 << 20
    """Smaller transfers measure latency, not bandwidth, and are ignored."""

    def __post_init__(self) -> None:
        for name in ("same_host_bps", "same_rack_bps", "same_dc_bps", "cross_dc_bps",
                     "wan_bps"):
            value = getattr(self, name)
            if not value > 0 or math.isnan(value):
                raise ConfigError(f"{name} must be > 0")
        if not 0 < self.ewma_alpha <= 1:
            raise ConfigError("ewma_alpha must be in (0, 1]")
        if self.min_sample_bytes < 0:
            raise ConfigError("min_sample_bytes must be >= 0")

    def class_bps(self, locality: Locality) -> float:
        return (self.same_host_bps, self.same_rack_bps, self.same_dc_bps,
                self.cross_dc_bps)[locality]


class Topology:
    """Known nodes plus per-link throughput estimates (mutable, one per peer)."""

    def __init__(self, config: TopologyConfig | None = None,
                 nodes: tuple[NodeInfo, ...] = (), wan: Wan | None = None) -> None:
        self.config = config or TopologyConfig()
        self.wan = wan if wan is not None else Wan()
        """The DC pairs' links (shared: the coordinator passes its peer's)."""
        self._nodes: dict[str, NodeInfo] = {n.name: n for n in nodes}
        self._est: dict[tuple[str, str], float] = {}
        self._seq: dict[str, int] = {}

    def add(self, node: NodeInfo) -> None:
        """Add a node, or replace what was known about it."""
        self._nodes[node.name] = node

    def remove(self, name: str) -> None:
        """Forget a node (its link estimates stay: it may come back)."""
        self._nodes.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def node(self, name: str) -> NodeInfo:
        try:
            return self._nodes[name]
        except KeyError:
            raise LocalProtocolError(f"peer {name!r} is not in the topology") from None

    def locality(self, a: str, b: str) -> Locality:
        return locality(self.node(a), self.node(b))

    def link_bps(self, src: str, dst: str) -> float:
        """Estimated throughput of ``src -> dst`` (not capped by the NICs)."""
        return self.estimate(src, dst, self.locality(src, dst))

    def estimate(self, src: str, dst: str, where: Locality) -> float:
        """``link_bps`` for a pair whose locality is known (the nodes may be gone): as
        measured, else (across DCs) the DCs' link, else the class default."""
        est = self._est.get((src, dst))
        if est is not None:
            return est
        if where is Locality.CROSS_DC and src in self._nodes and dst in self._nodes:
            rate = self.wan.rate(self._nodes[src].dc, self._nodes[dst].dc)
            if rate is not None:
                return rate
        return self.config.class_bps(where)

    def dc_link(self, src: str, dst: str) -> tuple[float, float]:
        """The ``src -> dst`` DC link's rate (bytes/s) and round trip (s): as the WAN
        model believes, else ``wan_bps`` and 0."""
        e = self.wan.estimate(src, dst)
        return (self.config.wan_bps, 0.0) if e is None else (e.bps, e.rtt_s)

    def measured(self) -> list[tuple[str, str, float]]:
        """Every measured estimate, as ``(src, dst, bytes/s)``."""
        return [(s, d, bps) for (s, d), bps in self._est.items()]

    def observe(self, src: str, dst: str, nbytes: int, seconds: float) -> None:
        """Fold one completed transfer into the ``src -> dst`` estimate (call on ``dst``)."""
        if nbytes < 0 or not seconds > 0 or not math.isfinite(seconds):
            raise LocalProtocolError(f"bad transfer sample: {nbytes} bytes in {seconds} s")
        if nbytes < self.config.min_sample_bytes or nbytes == 0:
            return
        rate = nbytes / seconds
        old = self._est.get((src, dst))
        alpha = self.config.ewma_alpha
        self._est[src, dst] = rate if old is None else alpha * rate + (1 - alpha) * old
        self._seq[dst] = self._seq.get(dst, 0) + 1

    def digest(self, origin: str) -> LinkDigest:
        """What ``origin`` knows about links into itself, for gossip."""
        links = sorted((s, bps) for (s, d), bps in self._est.items() if d == origin)
        links = links[-MAX_DIGEST_LINKS:]
        return LinkDigest(origin, self._seq.get(origin, 0),
                          tuple(s for s, _ in links), tuple(b for _, b in links))

    def merge(self, digest: LinkDigest) -> bool:
        """Adopt ``digest`` if it is newer than what we have from its origin."""
        if (len(digest.sources) != len(digest.bps) or len(digest.sources) > MAX_DIGEST_LINKS
                or not all(math.isfinite(b) and b > 0 for b in digest.bps)):
            raise RemoteProtocolError(f"malformed link digest from {digest.origin!r}")
        if digest.seq <= self._seq.get(digest.origin, 0):
            return False
        for key in [k for k in self._est if k[1] == digest.origin]:
            del self._est[key]
        for src, bps in zip(digest.sources, digest.bps, strict=True):
            self._est[src, digest.origin] = bps
        self._seq[digest.origin] = digest.seq
        return True


def fluid_bound(size: float, source_up: float, d_min: float, uplinks: Sequence[float], *,
                wan_bytes: float = 0.0, wan_bps: float = math.inf) -> float:
    """No schedule beats this: max{S/u_s, S/d_min, n*S/(u_s + sum u_i), WAN bytes/WAN}."""
    if not uplinks:
        return 0.0
    return max(size / source_up, size / d_min,
               len(uplinks) * size / (source_up + sum(uplinks)), wan_bytes / wan_bps)


MAX_CUT_DCS = 12
"""Above this many DCs without a source, :func:`cut_bound` tries each alone and all
together instead of every subset (2^12 subsets is some 50 ms)."""


def cut_bound(size: float, sources: Sequence[tuple[str, float]],
              fetchers: Sequence[tuple[str, float, float]],
              link_bps: Callable[[str, str], float]) -> float:
    """No schedule moves ``size`` bytes from ``sources`` (``(dc, up)``, each holding all
    of them) to every fetcher (``(dc, up, down)``) faster than this:

        max{ S/sum u_src,  S/min d_i,  N*S/(sum u_src + sum u_i),
             max over sets A of DCs without a source:
                 S/c(A),  |fetchers(A)|*S/(sum_{i in A} u_i + c(A)) }

    with ``c(A)`` the sum of the rates ``link_bps(b, a)`` of the links into ``A`` from
    the other DCs taking part (``a`` in ``A``, ``b`` not).  Each term is a cut: the sources
    must upload one copy; the slowest fetcher must download one; all N copies must be
    uploaded by someone; ``A`` must receive at least one copy over its links, and its
    fetchers' copies come from inside ``A`` or over them."""
    if not fetchers or not sources:
        return 0.0
    up_src = sum(u for _, u in sources)
    terms = [size / up_src, size / min(d for _, _, d in fetchers),
             len(fetchers) * size / (up_src + sum(u for _, u, _ in fetchers))]
    src_dcs = {dc for dc, _ in sources}
    dcs = sorted(src_dcs | {dc for dc, _, _ in fetchers})
    others = [d for d in dcs if d not in src_dcs]
    if len(others) <= MAX_CUT_DCS:
        groups: Iterable[tuple[str, ...]] = (
            g for k in range(1, len(others) + 1) for g in itertools.combinations(others, k))
    else:
        groups = [*((d,) for d in others), tuple(others)]
    for group in groups:
        inside = set(group)
        cut = sum(link_bps(b, a) for a in inside for b in dcs if b not in inside)
        members = [u for dc, u, _ in fetchers if dc in inside]
        if members:
            terms += [size / cut, len(members) * size / (sum(members) + cut)]
    return max(terms)


def star_time(size: float, source_up: float, downlinks: Sequence[float], *,
              wan_bytes: float = 0.0, wan_bps: float = math.inf) -> float:
    """Every fetcher pulls the whole version from the source(s) at once."""
    if not downlinks:
        return 0.0
    return max(len(downlinks) * size / source_up, size / min(downlinks), wan_bytes / wan_bps)
