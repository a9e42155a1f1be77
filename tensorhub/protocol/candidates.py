"""Where the planner's Prim finds each fetcher's best parent without scanning them all.

Theory of operation
-------------------
The planner grows each stripe's tree by Prim's algorithm (:meth:`Planner._prim`): the
next edge is the unattached fetcher whose best parent costs least, attached to that
parent.  An edge's cost begins with the pair's locality (same host < same rack < same
DC < cross DC) and whether the link is too slow for the stripe; inside a DC, with no
measured link, both depend only on the locality class.  So a fetcher's best parent in
its own DC is the best open parent of its *host*, if there is one; otherwise of its
*rack*; otherwise of its *DC* (which may have none now): the fetcher's *tier*.  Between
parents of one group the rest of the cost orders them (depth, original holder, spare
budget, name), which is a heap per group; between the fetchers of one group, which
share their best parent, the planner's order of fetchers is a heap per group too.  A
fetcher moves between tiers only when its host or rack group gains its first open
parent or loses its last.  The planner asks :meth:`Candidates.candidate` for a group's
next edge and keeps a heap of groups; each heap entry is checked against the group's
current candidate when it is popped (a cost only grows while a tree grows, so a stale
entry is never too late).

Fetchers this cannot describe (a seed, which must cross DCs, or one with a measured link
whose slowness differs from its class's) are left to the planner's full scan.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from .topology import Locality, NodeInfo, locality

Group = tuple[str, str, str]
"""``("h", dc, host)``, ``("r", dc, rack)`` or ``("d", dc, "")``."""
Order = tuple[bool, float, int, str]
"""A fetcher's place among fetchers with the same best parent."""
EdgeKey = tuple[Locality, bool, bool, int, bool, float, str]
"""The planner's cost of an edge (``Planner._key``)."""
ParentKey = tuple[int, bool, float, str]
"""(depth, original holder, -spare, name): a parent's place within its group."""
_TIER = {"h": Locality.SAME_HOST, "r": Locality.SAME_RACK, "d": Locality.SAME_DC}


def groups_of(n: NodeInfo) -> tuple[Group, ...]:
    """The host, rack (when labelled) and DC groups of ``n``, nearest first."""
    return (("h", n.dc, n.host), *((("r", n.dc, n.rack),) if n.rack else ()),
            ("d", n.dc, ""))


class Candidates:
    """Open parents and unattached fetchers of one stripe, by group (see above).

    ``order(v)`` is a fetcher's :data:`Order`; ``slow[loc]`` whether the class default
    link of ``loc`` is too slow for the stripe."""

    def __init__(self, nodes: dict[str, NodeInfo], fetchers: Iterable[str],
                 order: Callable[[str], Order], slow: dict[Locality, bool]) -> None:
        self._nodes, self._order, self._slow = nodes, order, slow
        self._parents: dict[Group, list[tuple[ParentKey, int]]] = {}
        self._open: dict[Group, int] = {}  # open parents per group
        self._version: dict[str, int] = {}  # a parent's current heap entry
        self._fetchers: dict[Group, list[tuple[Order, str]]] = {}
        self._members: dict[Group, list[str]] = {}
        self._tier: dict[str, Group] = {}
        for v in fetchers:
            *near, dc = groups_of(nodes[v])
            for g in near:
                self._members.setdefault(g, []).append(v)
            self._tier[v] = dc
            self._fetchers.setdefault(dc, []).append((order(v), v))
        for fs in self._fetchers.values():
            heapq.heapify(fs)

    def attached(self, v: str) -> None:
        """``v`` has its parent: it is no longer a fetcher here."""
        self._tier.pop(v, None)

    def open_parent(self, p: str, key: ParentKey) -> list[Group]:
        """``p`` may take children, at ``key``; returns the groups whose candidate may
        have improved."""
        self._version[p] = version = self._version.get(p, -1) + 1
        changed = []
        for g in groups_of(self._nodes[p]):
            heapq.heappush(self._parents.setdefault(g, []), (key, version))
            self._open[g] = self._open.get(g, 0) + 1
            changed.append(g)
            if self._open[g] == 1 and g[0] != "d":
                changed += self._retier(self._members.get(g, ()))
        return changed

    def reprice(self, p: str, key: ParentKey) -> None:
        """``p``'s spare shrank (it took a child) and it still fits one more."""
        self._version[p] = version = self._version[p] + 1
        for g in groups_of(self._nodes[p]):
            heapq.heappush(self._parents[g], (key, version))

    def close_parent(self, p: str) -> list[Group]:
        """``p`` fits no more children; returns the groups that gained fetchers."""
        self._version[p] += 1
        changed = []
        for g in groups_of(self._nodes[p]):
            self._open[g] -= 1
            if self._open[g] == 0 and g[0] != "d":
                changed += self._retier(self._members.get(g, ()))
        return changed

    def _retier(self, fetchers: Iterable[str]) -> list[Group]:
        """Put each unattached fetcher of ``fetchers`` in its tier; returns the groups
        that gained one."""
        changed = []
        for v in fetchers:
            if v not in self._tier:
                continue
            *near, dc = groups_of(self._nodes[v])
            tier = next((g for g in near if self._open.get(g)), dc)
            if tier != self._tier[v]:
                self._tier[v] = tier
                heapq.heappush(self._fetchers.setdefault(tier, []), (self._order(v), v))
                changed.append(tier)
        return changed

    def tiers(self) -> list[Group]:
        """Every group that holds a fetcher now."""
        return sorted(set(self._tier.values()))

    def candidate(self, g: Group) -> tuple[Order, EdgeKey, str, str] | None:
        """Group ``g``'s next edge: (the fetcher's order with its parent's cost prefix
        spliced in, the parent's full cost, fetcher, parent); None if it has none."""
        fs, ps = self._fetchers.get(g), self._parents.get(g)
        while fs and self._tier.get(fs[0][1]) != g:
            heapq.heappop(fs)
        while ps and self._version.get(ps[0][0][3]) != ps[0][1]:
            heapq.heappop(ps)
        if not fs or not ps or not self._open.get(g):
            return None
        order, v = fs[0]
        (depth, held, neg_spare, p), _ = ps[0]
        loc = _TIER[g[0]]
        key = (loc, self._slow[loc], False, depth, held, neg_spare, p)
        return order, key, v, p


def worse_than(p: NodeInfo, v: NodeInfo, depth: int, key: EdgeKey) -> bool:
    """Whether any edge ``p -> v`` from depth ``depth`` costs more than ``key``, told
    from the locality and depth alone (the cheap prefix of the planner's edge key)."""
    loc = locality(p, v)
    return loc > key[0] or (loc == key[0] and depth > key[3] and not key[1] and not key[2])
