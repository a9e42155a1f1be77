"""What a transfer plan is (see :mod:`.planner` for how one is made): the planner's
settings, a plan -- per fetcher, the chunk ranges it pulls and from whom -- and the
planner's statistics.  Plain values; the coordinator sends a fetcher its part."""

from __future__ import annotations

from dataclasses import dataclass

from ..bounds import U32, PeerName
from ..errors import ConfigError, LocalProtocolError

ChunkRanges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PlannerConfig:
    seeds_per_dc: int = 1
    """Fetchers per remote DC that pull across the inter-DC link, each a disjoint share
    of the stripes.  More seeds put more NICs on the WAN; WAN bytes stay 1x per DC."""
    max_stripes: int = 4
    """Most stripes tried.  More: shallower trees, but more sources per fetcher."""
    rebuild_max_peers: int = 4096
    """Most participants for which a join may rebuild the whole plan (see the module
    docstring); 0: never.  Above it joins only attach, and once the leaves' spare
    budget is spent the trees become chains (1,024 peers joining one at a time, limit
    128: 229x the fluid bound; limit 4096: 2.75x, as the plan made at once).  Cost on a
    loaded 2-core host: a fresh plan of 128 peers 0.1 s, of 1,024 peers 2 s; all of a
    1,024-peer fan-out's joins and tries 12 s, spread over its joins."""

    dc_trees: bool = False
    """Also try stripes cut along several DC trees (:meth:`~.planner.Planner._layouts`).
    Off by default: in the emulated cluster every fan-out whose plan took such a layout
    ran slower than the equal stripes did on the same topology (11.7 s against 8.2 s;
    15.2 and 15.3 s against 9.9-10.0 s), though the fluid model put the layouts 5-12%
    ahead."""

    def __post_init__(self) -> None:
        if not 1 <= self.seeds_per_dc <= 64:
            raise ConfigError("seeds_per_dc must be in [1, 64]")
        if not 1 <= self.max_stripes <= 64:
            raise ConfigError("max_stripes must be in [1, 64]")
        if not 0 <= self.rebuild_max_peers <= 1 << 20:
            raise ConfigError("rebuild_max_peers must be in [0, 2**20]")


@dataclass(frozen=True)
class SourceRange:
    """Pull chunks ``[first, stop)`` from ``peer``."""

    peer: PeerName
    first: U32
    stop: U32


@dataclass(frozen=True)
class Assignment:
    fetcher: str
    sources: tuple[SourceRange, ...]


@dataclass(frozen=True)
class Plan:
    """Who pulls which chunks from whom; estimate and lower bound in seconds."""

    model: str
    version: int
    epoch: int
    assignments: tuple[Assignment, ...]
    estimate_s: float
    bound_s: float

    def sources(self, fetcher: str) -> tuple[SourceRange, ...]:
        for a in self.assignments:
            if a.fetcher == fetcher:
                return a.sources
        raise LocalProtocolError(f"{fetcher!r} is not a fetcher in this plan")



MESSAGES = (Plan,)
"""Values a coordinator sends (checked frozen and codec-friendly by the tests)."""


@dataclass(frozen=True)
class PlannerStatistics:
    fetchers: int
    complete: int
    holders: int
    stripes: int
    budget_s: float
    epoch: int
    rebuilds: int = 0
    """Joins after which the plan was made afresh (see the module docstring)."""
    rebuild_tries: int = 0


def normalize_ranges(ranges: ChunkRanges, chunks: int) -> ChunkRanges:
    """``ranges`` sorted and merged; raises unless each lies within ``[0, chunks)``."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if not 0 <= lo < hi <= chunks:
            raise LocalProtocolError(f"chunk range [{lo}, {hi}) is not within [0, {chunks})")
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return tuple(out)
