"""Transfer planning: which fetcher pulls which chunks from whom.

Theory of operation
-------------------
The coordinator of a ``(model, version)`` keeps one :class:`Planner`: the *roots* (the
trainer or its shards, and fetchers that completed), the *fetchers* still pulling and
the :class:`Topology`.  Chunks are cut into K contiguous *stripes* (also at holders'
range boundaries) and each stripe travels along its own tree, so a fetcher's sources
partition the chunks; as in SplitStream a fetcher is interior in some trees and a leaf
in the others, so every uplink works while trees stay ~log_K(n) deep.  Parents may still
be receiving (chunk-level pipelining).

A plan aims to finish within ``T`` (first the fluid lower bound): a peer uploads at most
``uplink * T`` bytes, its fan-out limit, since children share the uplink; an original
holder spreads that evenly over stripes.  A tree that does not fit makes ``T`` grow 3%.
Trees grow by Prim's algorithm with a lexicographic cost: locality (host < rack < DC <
cross DC), links too slow for the stripe, a cross-DC parent whose DC has spent its
surplus on this stripe, parent depth (pipelining latency), a replica before an original
holder (spare the trainer), spare budget; fetchers that can forward join first.  In a DC
with no root of a stripe one *seed* pulls it across the WAN (stripes are shared out over
``seeds_per_dc`` seeds) and nobody else crosses, so every byte enters each DC once.
K = 1..max_stripes are tried and the plan the fluid model finishes first is kept.

*Stripes along DC trees.*  Equal stripes suit DCs on equal links.  Where a DC is behind
slow links, the version is better cut along several trees over the DCs at once, each
stripe as large as its tree's rate allows (:mod:`.packing`: a DC fed over another DC and
over its own slow links together, each carrying different bytes).  When every root is
in one DC and three DCs or more take part, and ``PlannerConfig.dc_trees`` is on (off by
default: measured slower so far), those layouts are tried beside the K equal stripes
(each stripe's routes fixed to its tree); one is kept only when the fluid model finishes
it :data:`LAYOUT_GAIN` times sooner than the best equal stripes.

Fluid model (``Plan.estimate_s``): shares are proportional to bytes, so an edge takes
max(parent load/uplink, size/downlink, pair bytes/link estimate, WAN bytes/WAN); a
fetcher's stream of a stripe starts one chunk after its parent's, and ends no sooner
than one chunk after the parent's ends.  That chunk moves at the stream's share of
what it crosses: each stream gets an equal share of the parent's uplink, of the
fetcher's downlink and of the DC link (TCP shares a link per connection, not per byte;
a small stripe relayed on a busy uplink is not held to its byte share).  Changes are
incremental: a joiner attaches to the best parent in each tree; a leaver's children
re-attach, each with its subtree, outside that subtree (no cycle can form); seeds are
replaced; nobody else moves.

*Rebuilds.*  Planned one joiner at a time, the plan depends on the order: the first
joiners take the roots' fan-out (a remote DC's seed that asked first takes the trainer's
one copy, and the budget must double for the trainer's own DC), and in one DC the trees
become chains (64 joiners: an estimate 1.97x the bound, 1.31x planned at once).  So a
join that leaves the plan suspect (the budget grew, or the estimate is over
:data:`REBUILD_OVER_BOUND` x the bound) tries a fresh plan of every participant (same
roots, same fetchers), kept if :data:`REBUILD_GAIN` x better.  Sound mid-transfer: a
fetcher skips the chunks it has verified whoever its new parent is, gives back what it
claimed elsewhere (``TransferSession.replan``), and asks a parent still receiving ahead
as it does any planned parent.  A fresh plan moves few: between equal choices an
earlier joiner attaches first, and at equal downlinks old seeds stay seeds (one may
have crossed the WAN, and finish before it asks again).  Cost (a fresh plan is about
O(n log n) per stripe and budget step, :mod:`.candidates`): after a join's try at n
fetchers the next waits for n/4 more joiners, so all cost a constant times one plan of
the final size; the joiners in
between get one try when a fetcher asks again (:meth:`Planner.reconsider`, once per
join's try); none above ``PlannerConfig.rebuild_max_peers`` participants.

*Links that fall.*  The rate of each DC link the plan crosses is noted when it is made.
Fetchers fold what they measured into the WAN model each time they ask again, so when
a link slows down mid-transfer the model follows it within a few asks; once it believes
a crossed link under :data:`LINK_FALL` of its noted rate, the next ask tries a fresh
plan, as a suspect join does (kept if :data:`REBUILD_GAIN` better), and notes the rates
again.  Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from itertools import accumulate, pairwise

from ..errors import LocalProtocolError, VersionUnavailable
from ..model import VersionKey
from .candidates import Candidates, EdgeKey, Group, worse_than
from .packing import Edge, pack_trees, stripe_trees, widest_trees
from .plans import Assignment, ChunkRanges, Plan, PlannerStatistics, normalize_ranges
from .plans import PlannerConfig as PlannerConfig
from .plans import SourceRange as SourceRange
from .topology import Locality, NodeInfo, Topology, cut_bound, locality

_STEP = 1.03
_MAX_STEPS = 400  # 1.03**400: far past any budget a star would need
_EPS = 1e-9
_Key = EdgeKey
REBUILD_OVER_BOUND = 1.25
"""A join that leaves the estimate over this many times the fluid bound tries a fresh
plan (as does one that made the budget grow)."""
REBUILD_GAIN = 1.05
"""A fresh plan replaces the incremental one only if its estimate is this much better:
moving fetchers has a cost (a stream ends, another starts)."""
WIDEN_OVER_BOUND = 1.15
"""A fresh plan whose estimate at the least budget that fits is over this many times the
bound also tries the budgets :data:`WIDEN` times larger: at the least budget every
uploader feeds about one child, trees become chains, and a chunk's delay per hop adds
up (deep relays across DCs make it worse)."""
WIDEN = (1.1, 1.25, 1.5)
REBUILD_SPACING = 4
"""After a try at n fetchers the next waits for n / this more joiners (at least one)."""
MAX_PACKED_DCS = 8
"""Past this many DCs in a plan, stripes are not cut along DC trees (:meth:`Planner.
_layouts`): the trees' search grows with the cube of the DCs (about 0.1 s at 8 DCs,
once per planner and set of link rates)."""
LAYOUT_GAIN = 1.15
"""Stripes along DC trees replace equal stripes only when the fluid model finishes them
this much sooner.  The model does not see what several uneven stripes cost a real
fan-out: in the emulated cluster, where it put layouts 5% (03-two-hop-beats-direct)
and 12% (04-relay-only) ahead of equal stripes, the fan-outs took 11.7 s against 8.2 s
and 15.2 s against 10.0 s."""
LINK_FALL = 0.75
"""A DC link the plan crosses that the WAN model now believes under this share of the
rate the plan was made with makes the next ask of a fetcher try a fresh plan
(:meth:`Planner.reconsider`).  The model follows a link down only after two transfer
samples in a row far under it (:mod:`.wan`), so any fall it believes is news."""
Layout = tuple[tuple[int, frozenset[Edge]], ...]
"""Stripes along DC trees: each stripe's chunk count and its tree's (from DC, to DC)
links, in chunk order."""


class Planner:
    """Plans one version's transfer; every change returns the new :class:`Plan`.

    ``holders`` maps each original holder to the chunk ranges it holds (``None``: all).
    Raises :class:`VersionUnavailable` if no holder has some chunks.
    """

    def __init__(self, key: VersionKey, size: int, chunks: int, topology: Topology,
                 holders: Mapping[str, ChunkRanges | None], fetchers: Iterable[str] = (),
                 *, config: PlannerConfig | None = None, epoch: int = 0) -> None:
        if size <= 0 or chunks <= 0:
            raise LocalProtocolError(f"{key}: size and chunk count must be > 0")
        self.key, self._size, self._chunks, self._topo = key, float(size), chunks, topology
        self._config, self._epoch = config or PlannerConfig(), epoch
        self._held = {h: normalize_ranges(r or ((0, chunks),), chunks) for h, r in holders.items()}
        self._rank = {v: i for i, v in enumerate(dict.fromkeys(fetchers))}  # join order
        self._fetchers, self._complete = set(self._rank), set[str]()
        if self._fetchers & self._held.keys():
            raise LocalProtocolError("a peer cannot be both an original holder and a fetcher")
        self._nodes = {n: self._node(n) for n in (*self._held, *self._fetchers)}
        self._cached: Plan | None = None
        self._rebuilds = self._rebuild_tries = 0
        self._next_rebuild, self._joined = 0, 0  # joins before a join's try; since a try
        self._catch_up = True  # whether reconsider() may try (again after a join's try)
        self._rebuilds_last = False  # whether the last try replaced the plan
        self._sticky: frozenset[str] = frozenset()  # seeds a rebuild keeps where it can
        self._packed: tuple[object, list[dict[frozenset[Edge], float]]] | None = None
        self._crossing: tuple[int, list[dict[str, str]], set[tuple[str, str]]] | None \
            = None
        self._planned_rates: dict[tuple[str, str], float] = {}
        """Each DC link the plan crosses: the rate it was planned with."""
        self.link_replans = 0
        """Fresh plans tried because a link the plan crossed fell (:data:`LINK_FALL`)."""
        self._fresh()

    # -- public -------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        if self._cached is not None and self._cached.epoch == self._epoch:
            return self._cached
        assignments = tuple(Assignment(v, self._sources(v)) for v in sorted(self._fetchers))
        self._cached = Plan(self.key.model, self.key.version, self._epoch,
                            assignments, self._estimate(), self._bound())
        return self._cached

    def sources(self, fetcher: str) -> tuple[SourceRange, ...]:
        """``fetcher``'s part of the plan (``plan.sources(fetcher)`` without making the
        whole plan: a fetcher that asks again costs O(stripes))."""
        if fetcher not in self._fetchers:
            raise LocalProtocolError(f"{fetcher!r} is not a fetcher in this plan")
        return self._sources(fetcher)

    def _sources(self, v: str) -> tuple[SourceRange, ...]:
        """One range per stripe, also where one parent serves several: the fetcher asks
        such a parent for its stripes in turn (``TransferSession``), so that each grows
        from the start for the children that read it from the fetcher."""
        return tuple(SourceRange(self._parent[j][v], lo, hi)
                     for j, (lo, hi) in enumerate(self._stripes))

    @property
    def epoch(self) -> int:
        """The plan's epoch: one more with every change."""
        return self._epoch

    @property
    def topology(self) -> Topology:
        return self._topo

    @property
    def fetchers(self) -> frozenset[str]:
        """Peers still pulling under this plan."""
        return frozenset(self._fetchers)

    @property
    def participants(self) -> frozenset[str]:
        """Every peer in the plan: original holders, fetchers and completed fetchers."""
        return frozenset(self._nodes)

    def add_fetcher(self, name: str) -> Plan:
        """A late joiner: attach it to the best parent in every tree, move nobody else;
        unless that leaves the plan clearly worse than a fresh one (see the module
        docstring), which then replaces it."""
        if name in self._nodes:
            raise LocalProtocolError(f"{name!r} already takes part in {self.key}")
        self._nodes[name] = self._node(name)
        self._fetchers.add(name)
        self._rank[name] = len(self._rank)
        self._load[name] = 0.0
        budget = self._budget_s
        self._attach([*self._refresh(), *((name, j) for j in range(len(self._sb)))])
        self._joined += 1
        n = len(self._fetchers)
        if n >= self._next_rebuild and self._rebuild(grew=self._budget_s > budget):
            self._next_rebuild = n + max(1, n // REBUILD_SPACING)
            self._catch_up = True
        self._epoch += 1
        return self.plan

    def reconsider(self) -> Plan:
        """A fetcher asks again: the joins that came since the last rebuild was tried
        (too soon after it to try one) get one try now, if the plan is suspect.  Once
        per join's try, so the tries stay within twice the joins' (see the module
        docstring); the coordinator calls it when a fetcher of the plan asks again.

        Also when a DC link the plan crosses is now believed under :data:`LINK_FALL` of
        the rate it was planned with (a link slowed down mid-transfer, and the fetchers'
        interim samples said so): a fresh plan is tried, and kept when clearly better,
        as for joins; the stripes still to come then take other paths.  The links'
        rates are taken as planned again either way, so one fall costs one try."""
        if self._catch_up and self._joined and self._rebuild(grew=False):
            self._catch_up = False
            if self._rebuilds_last:
                self._epoch += 1
        elif self._links_fell():
            self.link_replans += 1
            self._rebuild(grew=True)
            self._note_rates()
            if self._rebuilds_last:
                self._epoch += 1
        return self.plan

    def _crossed(self) -> set[tuple[str, str]]:
        """The (from DC, to DC) links some edge of the plan crosses (kept per epoch and
        build: every fetcher's ask looks, and the plan changes far less often)."""
        if self._crossing is None or self._crossing[0] != self._epoch \
                or self._crossing[1] is not self._parent:
            nodes = self._nodes
            crossed = {(nodes[p].dc, nodes[v].dc) for parent in self._parent
                       for v, p in parent.items() if nodes[p].dc != nodes[v].dc}
            self._crossing = (self._epoch, self._parent, crossed)
        return self._crossing[2]

    def _note_rates(self) -> None:
        self._planned_rates = {ab: self._topo.dc_link(*ab)[0] for ab in self._crossed()}

    def _links_fell(self) -> bool:
        """Whether a link the plan crosses is believed under :data:`LINK_FALL` of the
        rate it was planned with (links crossed since then are noted as they are)."""
        fell = False
        for ab in self._crossed():
            now = self._topo.dc_link(*ab)[0]
            was = self._planned_rates.setdefault(ab, now)
            fell |= now < LINK_FALL * was
        return fell

    def mark_complete(self, name: str) -> Plan:
        """``name`` holds every chunk verified: it stops pulling and becomes a root."""
        if name not in self._fetchers:
            raise LocalProtocolError(f"{name!r} is not fetching {self.key}")
        for j, roots in enumerate(self._roots):
            self._unlink(name, j)
            roots.add(name)
        self._fetchers.remove(name)
        self._complete.add(name)
        return self._apply(self._refresh())

    def remove_peer(self, name: str) -> Plan:
        """``name`` left: its children re-attach.  Unknown names change nothing.

        Raises :class:`VersionUnavailable`, changing nothing, if ``name`` held the last
        copy of some chunks.
        """
        if name not in self._nodes:
            return self.plan
        lost = [f"[{lo}, {hi})" for (lo, hi), r in zip(self._stripes, self._roots, strict=True)
                if r == {name}]
        if lost:
            raise VersionUnavailable(self.key.model, self.key.version,
                                     f"{name!r} held the last copy of chunks {', '.join(lost)}")
        orphans = []
        for j, roots in enumerate(self._roots):
            roots.discard(name)
            self._unlink(name, j)
            for v in [v for v, p in self._parent[j].items() if p == name]:
                self._unlink(v, j)
                orphans.append((v, j))
        self._fetchers.discard(name)
        self._complete.discard(name)
        self._held.pop(name, None)
        del self._load[name], self._nodes[name]
        return self._apply([*self._refresh(), *orphans])

    def fanout_limit(self, name: str) -> float:
        """How many full copies of the version ``name`` may upload under this plan."""
        if name not in self._nodes:
            raise LocalProtocolError(f"{name!r} takes no part in {self.key}")
        return self._nodes[name].up_bps * self._budget_s / self._size

    def statistics(self) -> PlannerStatistics:
        return PlannerStatistics(len(self._fetchers), len(self._complete), len(self._held),
                                 len(self._stripes), self._budget_s, self._epoch,
                                 self._rebuilds, self._rebuild_tries)

    def _node(self, name: str) -> NodeInfo:
        """``name`` as the planner sees it: without its rack when a rack is no faster
        than its DC (a non-blocking fabric), where preferring a rack would only make
        trees deeper (1,024 GPUs in racks of 128: depth 13 with racks, 8 without)."""
        node, c = self._topo.node(name), self._topo.config
        if node.rack and c.class_bps(Locality.SAME_DC) >= c.class_bps(Locality.SAME_RACK):
            return replace(node, rack="")
        return node

    # -- building -----------------------------------------------------------------

    _STATE = ("_stripes", "_sb", "_roots", "_held_bytes", "_parent", "_kids", "_load",
              "_seed", "_exports", "_budget_s", "_seed_stripes", "_surplus", "_route")
    """What a build makes (each a new object: a snapshot is a copy of the references)."""

    def _fresh(self) -> None:
        """Plan every participant from scratch: K = 1..max_stripes equal stripes, and
        stripes cut along the DC trees of :meth:`_layouts`, each at the least budget
        that fits; keep the one the fluid model finishes first."""
        seeds, tries = self._config.seeds_per_dc, []
        shapes: list[int | Layout] = [
            *sorted({max(i, seeds) for i in range(1, self._config.max_stripes + 1)}),
            *self._layouts()]
        for i, shape in enumerate(shapes):
            t = self._reset(shape)
            for _ in range(_MAX_STEPS):
                if self._build(shape, t):
                    break
                t *= _STEP
            else:
                raise LocalProtocolError(f"{self.key}: no plan fits any budget (planner bug)")
            tries.append((self._estimate(), i, t))
            if tries[-1][0] > WIDEN_OVER_BOUND * self._bound():
                for more in WIDEN:  # wider trees: shallower, so pipelining costs less
                    if self._build(shape, t * more):
                        tries.append((self._estimate(), i, t * more))
        equal = min((x for x in tries if isinstance(shapes[x[1]], int)), default=None)
        best = min(tries)
        if equal is not None and best[0] * LAYOUT_GAIN > equal[0]:
            best = equal  # a layout must win clearly (see LAYOUT_GAIN)
        _, i, t = best
        self._build(shapes[i], t)
        self._note_rates()

    def _layouts(self) -> list[Layout]:
        """Stripes along several DC trees at once (:mod:`.packing`), when
        ``PlannerConfig.dc_trees`` is on, every root is in one DC and holds every chunk,
        and two DCs or more fetch: a DC behind slow links
        then gets its bytes over several paths, each stripe sized to its path's rate.
        Empty otherwise (or past :data:`MAX_PACKED_DCS` DCs)."""
        if not self._config.dc_trees or any(r != ((0, self._chunks),)
                                            for r in self._held.values()):
            return []
        roots = set(self._held) | self._complete
        root_dcs = {self._nodes[r].dc for r in roots}
        dcs = sorted(root_dcs | {self._nodes[v].dc for v in self._fetchers})
        if len(root_dcs) != 1 or not 3 <= len(dcs) <= MAX_PACKED_DCS:
            return []
        (root,) = root_dcs
        rate = {(a, b): self._topo.dc_link(a, b)[0] for a in dcs for b in dcs if a != b}
        key = (root, tuple(dcs), tuple(sorted(rate.items())))
        most = self._config.max_stripes
        if self._packed is None or self._packed[0] != key:  # rebuilds ask again
            self._packed = (key, [pack_trees(root, dcs, rate),
                                  widest_trees(root, dcs, rate, most)])
        packed, widest = self._packed[1]
        out: list[Layout] = []
        for trees, k in ((packed, 2), (packed, most), (widest, most)):
            layout = tuple(stripe_trees(trees, self._chunks, k))
            if len(layout) > 1 and layout not in out:
                out.append(layout)
        return out

    def _rebuild(self, grew: bool) -> bool:
        """Try a fresh plan if this one is suspect (``grew``: the last join made the
        budget grow; or the estimate is over the bound), and keep it when clearly better
        (see the module docstring).  Returns whether it was tried."""
        self._rebuilds_last = False
        if len(self._nodes) > self._config.rebuild_max_peers:
            return False
        estimate = self._estimate()
        if not grew and estimate <= REBUILD_OVER_BOUND * self._bound():
            return False
        self._rebuild_tries += 1
        self._joined = 0
        before = {a: getattr(self, a) for a in self._STATE}
        self._sticky = frozenset(self._seed.values())
        self._fresh()
        self._sticky = frozenset()
        if self._estimate() * REBUILD_GAIN <= estimate:
            self._rebuilds += 1
            self._rebuilds_last = True
        else:
            for a, v in before.items():
                setattr(self, a, v)
        return True

    def _reset(self, shape: int | Layout) -> float:
        """Cut the stripes and forget all edges; returns the fluid bound.  ``shape``: K
        equal stripes, or a :data:`Layout` (a stripe per DC tree, its routes set)."""
        c = self._chunks
        if isinstance(shape, int):
            cuts = {0, c, *(round(i * c / shape) for i in range(1, shape))}
        else:
            cuts = {0, c, *accumulate(n for n, _ in shape)}
        cuts.update(x for ranges in self._held.values() for r in ranges for x in r)
        self._stripes = list(pairwise(sorted(cuts)))
        self._sb = [self._size * (hi - lo) / c for lo, hi in self._stripes]
        self._roots = [
            {h for h, rs in self._held.items() if any(a <= lo and hi <= b for a, b in rs)}
            | self._complete for lo, hi in self._stripes]
        missing = [f"[{lo}, {hi})" for (lo, hi), r in zip(self._stripes, self._roots,
                                                          strict=True) if not r]
        if missing:
            raise VersionUnavailable(self.key.model, self.key.version,
                                     f"no holder of chunks {', '.join(missing)}")
        self._held_bytes = {h: sum(b for b, r in zip(self._sb, self._roots, strict=True)
                                   if h in r) for h in self._held}
        self._parent: list[dict[str, str]] = [{} for _ in self._stripes]
        self._kids: list[dict[str, int]] = [{} for _ in self._stripes]
        self._load = dict.fromkeys(self._nodes, 0.0)
        self._seed: dict[tuple[str, int], str] = {}
        self._route: dict[tuple[str, int], str] = {}  # (DC, stripe) -> the DC feeding it
        if not isinstance(shape, int):
            self._route = {(b, j): a for j, (_, tree) in enumerate(shape) for a, b in tree}
        self._exports: dict[tuple[str, int], int] = {}  # cross-DC edges out of (DC, stripe)
        self._budget_s = self._bound()
        return self._budget_s

    def _build(self, shape: int | Layout, budget_s: float) -> bool:
        self._reset(shape)
        self._budget_s = budget_s
        self._refresh()
        return all(self._prim(j) for j in range(len(self._stripes)))

    def _prim(self, j: int) -> bool:
        """Grow stripe ``j``'s tree (lazy Prim over a heap).  ``open_``: the attached
        nodes that fit a child (a spare only shrinks while the tree grows, so one that no
        longer fits never will).  Most fetchers find their best parent through
        :class:`~.candidates.Candidates` (by host, rack, DC); the few it cannot describe
        (:meth:`_special`) keep a best parent of their own, found by a full scan."""
        sb, nodes = self._sb[j], self._nodes
        need = sb * (1 - _EPS)
        depth = dict.fromkeys(self._roots[j], 0)
        open_ = {p: 0 for p in depth if self._fits(p, j)}
        spare0 = {v: self._spare(v, j) for v in self._fetchers}
        special = self._special(j)
        slow = {loc: self._topo.config.class_bps(loc) * self._budget_s < sb
                for loc in Locality}

        def order(v: str) -> tuple[bool, float, int, str]:
            return spare0[v] < sb, -spare0[v], self._rank[v], v

        cands = Candidates(nodes, (v for v in self._fetchers if v not in special), order,
                           slow)

        def parent_key(p: str, spare: float) -> tuple[int, bool, float, str]:
            return depth[p], p in self._held, -spare, p

        for p in open_:
            cands.open_parent(p, parent_key(p, self._spare(p, j)))
        best = {v: self._best_parent(v, j, open_) for v in sorted(special)}
        heap: list[tuple[bool, tuple[Locality, bool, bool, int, bool], float, int, str, str,
                         _Key, Group | None]] = []

        def push(g: Group | None, found: tuple[tuple[bool, float, int, str], _Key, str, str]
                 | None) -> None:
            if found is not None:
                (flag, spare, rank, v), key, _, p = found
                heapq.heappush(heap, (flag, key[:5], spare, rank, v, p, key, g))

        def push_special(v: str) -> None:
            b = best[v]
            if b is not None:
                push(None, (order(v), b[0], v, b[1]))

        def push_groups(groups: list[Group]) -> None:
            for g in dict.fromkeys(groups):
                push(g, cands.candidate(g))

        push_groups(cands.tiers())
        for v in best:
            push_special(v)
        todo = set(self._fetchers)
        while todo:
            if not heap:
                return False  # nobody left has a parent that fits
            entry = heapq.heappop(heap)
            *_, v, p, key, g = entry
            if g is None:
                if best.get(v) != (key, p):
                    continue  # superseded, or attached
                if not self._fits(p, j) or self._key(p, v, j, depth[p]) != key:
                    best[v] = self._best_parent(v, j, open_)  # keys only worsen: lazy Prim
                    push_special(v)
                    continue
                del best[v]
            else:
                found = cands.candidate(g)
                if found is None or (found[2], found[3], found[1]) != (v, p, key):
                    push(g, found)  # the group's edge changed since (for the worse)
                    continue
            self._link(p, v, j)
            depth[v] = depth[p] + 1
            todo.discard(v)
            cands.attached(v)
            changed = [] if g is None else [g]
            if self._fits(p, j):
                cands.reprice(p, parent_key(p, self._spare(p, j)))
            else:
                open_.pop(p, None)
                changed += cands.close_parent(p)
            spare = self._spare(v, j)
            if spare >= need:  # v fits a child
                open_[v] = dv = depth[v]
                changed += cands.open_parent(v, parent_key(v, spare))
                for u, b in best.items():
                    if (b is None or not worse_than(nodes[v], nodes[u], dv, b[0])) \
                            and self._allowed(v, u, j):
                        k = self._key(v, u, j, dv, spare)
                        if b is None or k < b[0]:
                            best[u] = (k, v)
                            push_special(u)
            push_groups(changed)
        return True

    def _special(self, j: int) -> set[str]:
        """Fetchers whose best parent :class:`~.candidates.Candidates` cannot tell: the
        seeds of stripe ``j`` (they cross DCs), and those with a measured link in whose
        slowness differs from its locality class's."""
        out = {x for (_, k), x in self._seed.items() if k == j}
        nodes, sb, budget = self._nodes, self._sb[j], self._budget_s
        for src, dst, bps in self._topo.measured():
            if dst in self._fetchers and src in nodes:
                loc = locality(nodes[src], nodes[dst])
                if (bps * budget < sb) != (self._topo.config.class_bps(loc) * budget < sb):
                    out.add(dst)
        return out

    def _apply(self, todo: Iterable[tuple[str, int]]) -> Plan:
        """:meth:`_attach`, then publish the plan under a new epoch."""
        self._attach(todo)
        self._epoch += 1
        return self.plan

    def _attach(self, todo: Iterable[tuple[str, int]]) -> None:
        """Re-attach each ``(fetcher, stripe)``, seeds first so that their DC can follow
        (a seed fed through another DC after that DC's)."""
        def seeds_first(item: tuple[str, int]) -> tuple[bool, int, int, str]:
            v, j = item
            d = self._nodes[v].dc
            return self._seed.get((d, j)) != v, j, self._hops(d, j), v

        for v, j in sorted(set(todo), key=seeds_first):
            self._unlink(v, j)
            for _ in range(_MAX_STEPS):
                found = self._best_parent(v, j, self._depths(j, avoid=v))
                if found is not None:
                    self._link(found[1], v, j)
                    break
                self._budget_s = max(self._budget_s * _STEP, self._bound())
                self._refresh()
            else:
                raise LocalProtocolError(f"{self.key}: no source for {v!r} (planner bug)")

    def _refresh(self) -> list[tuple[str, int]]:
        """Give each remote (DC, stripe) one seed and recount surpluses.  Returns who
        must re-attach: new seeds, and old ones whose DC now holds their stripe."""
        dc = {v: n.dc for v, n in self._nodes.items()}
        root_dcs = [{dc[r] for r in roots} for roots in self._roots]
        new = []
        for (d, j), x in list(self._seed.items()):
            if x not in self._fetchers or d in root_dcs[j]:
                del self._seed[d, j]
                new += [(x, j)] if x in self._fetchers else []
        members: dict[str, list[str]] = {}
        for v in sorted(self._fetchers):
            members.setdefault(dc[v], []).append(v)
        self._plan_routes(root_dcs, members)
        for d, ms in sorted(members.items()):
            carried: dict[str, float] = {}  # bytes each seed of ``d`` pulls across
            for (dd, j), x in self._seed.items():
                if dd == d:
                    carried[x] = carried.get(x, 0.0) + self._sb[j]
            ranked = sorted((m for m in ms if m not in carried),
                            key=lambda m: (-self._nodes[m].down_bps, m not in self._sticky,
                                           self._rank[m], m))
            carried.update(dict.fromkeys(
                ranked[: min(self._config.seeds_per_dc, len(ms)) - len(carried)], 0.0))
            for j, rd in enumerate(root_dcs):
                if d not in rd and (d, j) not in self._seed:
                    x = self._seed[d, j] = min(carried, key=lambda s: (carried[s], s))
                    carried[x] += self._sb[j]
                    new.append((x, j))
        self._seed_stripes: dict[str, list[int]] = {}
        for (_, j), x in self._seed.items():
            self._seed_stripes.setdefault(x, []).append(j)
        # Surplus: a DC's budgets in whole stripes, less its fetchers' in-DC need.
        unit, self._surplus = max(self._sb), dict.fromkeys(dc.values(), 0.0)
        for n in self._nodes.values():
            self._surplus[n.dc] += unit * math.floor(n.up_bps * self._budget_s / unit + _EPS)
        for v in self._fetchers:
            self._surplus[dc[v]] -= self._size
        for d, j in self._seed:
            self._surplus[d] += self._sb[j]
        return new

    # -- routes between DCs -------------------------------------------------------

    def _plan_routes(self, root_dcs: list[set[str]], members: Mapping[str, list[str]]
                     ) -> None:
        """Give each (DC, stripe) that needs its stripe from outside the DC that feeds
        it: keep the routes that still stand, and add the others greedily, stripe by
        stripe, each time the (feeding DC, DC) pair that keeps the slowest link or DC
        uplink of the plan least loaded (ties: the less loaded edge, then the longer
        path: a stripe relayed on through the DCs that have it leaves the links out of
        its roots to the next stripes, which is what the cut bound asks of equal
        links).  So a
        DC behind a slow direct link is fed through another DC, and a DC whose links
        are each too slow alone gets its stripes over several (see the module
        docstring)."""
        need = {(d, j) for d in members for j, rd in enumerate(root_dcs) if d not in rd}
        route = {k: a for k, a in self._route.items() if k in need}
        while True:  # drop routes whose feeding DC no longer gets the stripe
            gone = [(d, j) for (d, j), a in route.items()
                    if a not in root_dcs[j] and (a, j) not in route]
            if not gone:
                break
            for k in gone:
                del route[k]
        self._route = route
        todo = sorted(need - route.keys(), key=lambda k: (k[1], k[0]))
        if not todo:
            return
        dcs = {n.dc for n in self._nodes.values()}
        upcap = dict.fromkeys(dcs, 0.0)
        for n in self._nodes.values():
            upcap[n.dc] += n.up_bps
        inside = dict.fromkeys(dcs, 0.0)  # bytes each DC's uplinks move inside it
        for d, ms in members.items():
            inside[d] = len(ms) * self._size - sum(
                b for b, rd in zip(self._sb, root_dcs, strict=True) if d not in rd)
        load: dict[tuple[str, str], float] = {}
        out = dict.fromkeys(dcs, 0.0)
        for (d, j), a in route.items():
            load[a, d] = load.get((a, d), 0.0) + self._sb[j]
            out[a] += self._sb[j]
        links = {(a, b): self._topo.dc_link(a, b) for a in dcs for b in dcs if a != b}

        def up_time(a: str, extra: float) -> float:
            return (max(inside[a], 0.0) + out[a] + extra) / upcap[a]

        worst = max([*(b / links[k][0] for k, b in load.items()),
                     *(up_time(a, 0.0) for a in dcs)], default=0.0)
        for j in sorted({j for _, j in todo}):
            hops = dict.fromkeys(root_dcs[j], 0)
            grow = True
            while grow:  # the DCs already routed for j, in chain order
                grow = False
                for (d, jj), a in route.items():
                    if jj == j and d not in hops and a in hops:
                        hops[d] = hops[a] + 1
                        grow = True
            pending = {d for d, jj in todo if jj == j}
            sb = self._sb[j]
            while pending:
                best: tuple[float, float, int, float, str, str] | None = None
                for d in sorted(pending):
                    for a, h in hops.items():
                        rate, rtt = links[a, d]
                        t_edge = (load.get((a, d), 0.0) + sb) / rate
                        t = max(t_edge, up_time(a, sb))
                        key = (max(worst, t), t, -h, t_edge + rtt, a, d)
                        if best is None or key < best:
                            best = key
                assert best is not None  # a root DC is always in hops
                cost, _, h, _, a, d = best
                route[d, j] = a
                hops[d] = 1 - h
                load[a, d] = load.get((a, d), 0.0) + sb
                out[a] += sb
                worst = max(worst, cost)
                pending.discard(d)

    def _hops(self, d: str, j: int) -> int:
        """DCs between DC ``d`` and a root of stripe ``j`` along the routes."""
        n = 0
        while (d, j) in self._route and n <= len(self._route):
            d, n = self._route[d, j], n + 1
        return n

    def route_of(self, fetcher: str) -> str:
        """Which DCs ``fetcher``'s DC gets its stripes through, and the links' rates and
        where they come from (declared, measured, default): one line for a fetch report
        or ``status``."""
        if fetcher not in self._nodes:
            raise LocalProtocolError(f"{fetcher!r} takes no part in {self.key}")
        d = self._nodes[fetcher].dc
        paths: dict[tuple[str, ...], list[tuple[int, int]]] = {}
        for j, (lo, hi) in enumerate(self._stripes):
            chain, at = [d], d
            while (at, j) in self._route and len(chain) <= len(self._route):
                at = self._route[at, j]
                chain.append(at)
            if len(chain) > 1:
                paths.setdefault(tuple(reversed(chain)), []).append((lo, hi))
        if not paths:
            return f"{d or 'this DC'}: every chunk from inside the DC"
        parts, used = [], set[tuple[str, str]]()
        for path, ranges in sorted(paths.items(), key=lambda kv: kv[1][0]):
            spans = ", ".join(f"[{lo}, {hi})" for lo, hi in normalize_ranges(
                tuple(ranges), self._chunks))
            parts.append(f"chunks {spans} via {' -> '.join(path)}")
            used.update(pairwise(path))
        rates = []
        for a, b in sorted(used):
            e = self._topo.wan.estimate(a, b)
            how = "default" if e is None else e.how
            rates.append(f"{a}->{b} {self._topo.dc_link(a, b)[0] * 8 / 1e6:.0f} Mbit {how}")
        return f"{d}: {'; '.join(parts)} ({', '.join(rates)})"

    # -- edges, budgets, costs ----------------------------------------------------

    def _link(self, p: str, v: str, j: int, sign: int = 1) -> None:
        self._kids[j][p] = self._kids[j].get(p, 0) + sign
        self._load[p] += sign * self._sb[j]
        if (d := self._nodes[p].dc) != self._nodes[v].dc:
            self._exports[d, j] = self._exports.get((d, j), 0) + sign
        if sign > 0:
            self._parent[j][v] = p

    def _unlink(self, v: str, j: int) -> None:
        if (p := self._parent[j].pop(v, None)) is not None:
            self._link(p, v, j, -1)

    def _spare(self, p: str, j: int) -> float:
        budget = self._nodes[p].up_bps * self._budget_s
        spare = budget - self._load[p]
        for k in self._seed_stripes.get(p, ()):  # keep room to pass each seed stripe on
            if k != j and not self._kids[k].get(p):
                spare -= self._sb[k]
        if p in self._held:  # an original holder serves each stripe its fair share
            share = budget * self._sb[j] / self._held_bytes[p]
            spare = min(spare, share - self._kids[j].get(p, 0) * self._sb[j])
        return spare

    def _fits(self, p: str, j: int) -> bool:
        return self._spare(p, j) >= self._sb[j] * (1 - _EPS)

    def _allowed(self, p: str, v: str, j: int) -> bool:
        """Only the seed of a (DC, stripe) crosses DCs, and it must, from the DC its
        route names."""
        dv, dp = self._nodes[v].dc, self._nodes[p].dc
        if self._seed.get((dv, j)) == v:
            return dp == self._route.get((dv, j), dp) and dp != dv
        return dp == dv

    def _key(self, p: str, v: str, j: int, depth: int, spare: float | None = None) -> _Key:
        """Edge cost.  A DC exports each stripe only its share of its surplus, so that
        later stripes can still leave it.  ``spare``: ``_spare(p, j)`` if known."""
        loc = locality(self._nodes[p], self._nodes[v])
        slow = self._topo.estimate(p, v, loc) * self._budget_s < self._sb[j]
        d = self._nodes[p].dc
        short = (loc is Locality.CROSS_DC and (self._exports.get((d, j), 0) + 1) * self._size
                 > self._surplus[d] * (1 + _EPS))
        return (loc, slow, short, depth, p in self._held,
                -(self._spare(p, j) if spare is None else spare), p)

    def _best_parent(self, v: str, j: int, depth: Mapping[str, int]
                     ) -> tuple[_Key, str] | None:
        best: tuple[_Key, str] | None = None
        nv, need = self._nodes[v], self._sb[j] * (1 - _EPS)
        for p, d in depth.items():
            if p == v or (best is not None and worse_than(self._nodes[p], nv, d, best[0])):
                continue
            spare = self._spare(p, j)
            if spare >= need and self._allowed(p, v, j):
                key = self._key(p, v, j, d, spare)
                if best is None or key < best[0]:
                    best = (key, p)
        return best

    def _children(self, j: int) -> dict[str, list[str]]:
        kids: dict[str, list[str]] = {}
        for v, p in self._parent[j].items():
            kids.setdefault(p, []).append(v)
        return kids

    def _depths(self, j: int, avoid: str) -> dict[str, int]:
        """Depth of every node that reaches a root of stripe ``j`` without ``avoid``."""
        kids, depth = self._children(j), dict.fromkeys(self._roots[j], 0)
        frontier = list(depth)
        while frontier:
            p = frontier.pop()
            for v in kids.get(p, ()):
                if v != avoid:
                    depth[v] = depth[p] + 1
                    frontier.append(v)
        return depth

    # -- the fluid model ----------------------------------------------------------

    def _estimate(self) -> float:
        nodes, pair, finish = self._nodes, dict[tuple[str, str], float](), 0.0
        wan: dict[tuple[str, str], float] = {}  # bytes over each DC pair's link
        for j, parent in enumerate(self._parent):
            for v, p in parent.items():
                pair[p, v] = pair.get((p, v), 0.0) + self._sb[j]
                if (dp := nodes[p].dc) != (dv := nodes[v].dc):
                    wan[dp, dv] = wan.get((dp, dv), 0.0) + self._sb[j]
        dc_link = {k: self._topo.dc_link(*k) for k in wan}
        outs, ins, over = dict[str, int](), dict[str, int](), dict[tuple[str, str], int]()
        for p, v in pair:  # streams: each gets an equal share of what it crosses
            outs[p], ins[v] = outs.get(p, 0) + 1, ins.get(v, 0) + 1
            if (dp := nodes[p].dc) != (dv := nodes[v].dc):
                over[dp, dv] = over.get((dp, dv), 0) + 1
        for j, (lo, hi) in enumerate(self._stripes):
            kids, chunk = self._children(j), self._sb[j] / (hi - lo)
            # (node, when its stream starts, when it ends, its first chunk's time)
            frontier = [(r, 0.0, 0.0, 0.0) for r in self._roots[j]]
            while frontier:
                p, start, end, lag = frontier.pop()
                start += lag
                for v in kids.get(p, ()):
                    loc = locality(nodes[p], nodes[v])
                    link = self._topo.estimate(p, v, loc)
                    edge = max(self._load[p] / nodes[p].up_bps, self._size / nodes[v].down_bps,
                               pair[p, v] / link)
                    share = min(nodes[p].up_bps / outs[p], nodes[v].down_bps / ins[v], link)
                    rtt = 0.0
                    if loc == Locality.CROSS_DC:
                        rate, rtt = dc_link[nodes[p].dc, nodes[v].dc]
                        edge = max(edge, wan[nodes[p].dc, nodes[v].dc] / rate)
                        share = min(share, rate / over[nodes[p].dc, nodes[v].dc])
                    # v ends no sooner than its own edge allows from its start, nor than
                    # one chunk (at v's share) after its parent's end
                    at = start + rtt
                    ends = max(at + edge, end + rtt + chunk / share)
                    finish = max(finish, ends)
                    frontier.append((v, at, ends, chunk / share))
        return finish

    def _bound(self) -> float:
        """The cut bound (:func:`~.topology.cut_bound`): roots of any stripe count as
        sources, so a DC holding part of the version is never cut from them (the
        bound only gets lower: still one no schedule beats)."""
        nodes = self._nodes
        if not self._fetchers:
            return 0.0
        return cut_bound(self._size,
                         [(nodes[r].dc, nodes[r].up_bps) for r in set().union(*self._roots)],
                         [(nodes[v].dc, nodes[v].up_bps, nodes[v].down_bps)
                          for v in self._fetchers],
                         lambda a, b: self._topo.dc_link(a, b)[0])
