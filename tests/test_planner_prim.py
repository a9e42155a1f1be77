"""The planner's Prim, which finds parents by host, rack and DC
(:mod:`tensorhub.protocol.candidates`), against the full scan it replaced: the same
plans, edge for edge, on random topologies (with measured links) and on a large one.

Every randomized test prints its seed; rerun one with ``TENSORHUB_TEST_SEED=<seed>``.
"""

from __future__ import annotations

import heapq
import random

from hypothesis import given, seed
from hypothesis import strategies as st
from test_planner import KEY, PROPERTY, SEED, Scenario, scenarios

from tensorhub.protocol import planner as planner_mod
from tensorhub.protocol.candidates import worse_than
from tensorhub.protocol.planner import Planner, PlannerConfig
from tensorhub.protocol.topology import NodeInfo, Topology, TopologyConfig


class FullScan(Planner):
    """The reference: every attach offers the new parent to every fetcher."""

    def _prim(self, j: int) -> bool:
        depth = dict.fromkeys(self._roots[j], 0)
        open_ = {p: 0 for p in depth if self._fits(p, j)}
        spare0 = {v: self._spare(v, j) for v in self._fetchers}
        best = {v: self._best_parent(v, j, open_) for v in self._fetchers}
        heap: list[tuple[object, ...]] = []

        def push(v: str) -> None:
            b = best[v]
            if b is not None:
                heapq.heappush(heap, (spare0[v] < self._sb[j], b[0][:5], -spare0[v],
                                      self._rank[v], v, b[1], b[0]))

        for v in best:
            push(v)
        while best:
            if not heap:
                return False
            *_, v, p, key = heapq.heappop(heap)
            assert isinstance(v, str) and isinstance(p, str)
            if best.get(v) != (key, p):
                continue
            if not self._fits(p, j) or self._key(p, v, j, depth[p]) != key:
                if not self._fits(p, j):
                    open_.pop(p, None)
                best[v] = self._best_parent(v, j, open_)
                push(v)
                continue
            self._link(p, v, j)
            depth[v] = depth[p] + 1
            del best[v]
            if not self._fits(p, j):
                open_.pop(p, None)
            spare = self._spare(v, j)
            if spare >= self._sb[j] * (1 - 1e-9):
                open_[v] = dv = depth[v]
                for u, b in best.items():
                    if (b is None or not worse_than(self._nodes[v], self._nodes[u], dv, b[0])) \
                            and self._allowed(v, u, j):
                        k = self._key(v, u, j, dv, spare)
                        if b is None or k < b[0]:
                            best[u] = (k, v)
                            push(u)
        return True


def same(a: Planner, b: Planner) -> None:
    pa, pb = a.plan, b.plan
    assert pa.assignments == pb.assignments
    assert (pa.estimate_s, pa.bound_s) == (pb.estimate_s, pb.bound_s)
    assert a.statistics() == b.statistics()


@seed(SEED)
@PROPERTY
@given(scenarios(), st.randoms(use_true_random=False), st.floats(0.01, 3.0))
def test_same_plans_as_the_full_scan(sc: Scenario, rng: random.Random, speed: float
                                     ) -> None:
    """Including measured links, some too slow for a stripe (those fetchers take the
    full scan), and joins and removals after the first plan."""
    print(f"seed={SEED}")
    names = [*sc.holders, *sc.fetchers]
    for _ in range(rng.randrange(0, 3 * len(names))):
        src, dst = rng.choice(names), rng.choice(sc.fetchers)
        if src != dst:
            nbytes = 1 << 30
            rate = sc.topo.link_bps(src, dst) * speed * rng.uniform(0.5, 1.5)
            sc.topo.observe(src, dst, nbytes, nbytes / rate)
    args = (KEY, sc.size, sc.chunks, sc.topo, sc.holders, sc.fetchers)
    ours, ref = Planner(*args, config=sc.config), FullScan(*args, config=sc.config)
    same(ours, ref)
    if len(sc.fetchers) > 2:
        for pl in (ours, ref):
            pl.remove_peer(sc.fetchers[0])
            pl.mark_complete(sc.fetchers[1])
        same(ours, ref)


def test_same_plan_at_scale_in_two_dcs() -> None:
    """600 peers in racks of 40 (hosts of 1 to 8), two DCs, the holders in one (so
    seeds cross): the index keeps every tie the full scan breaks."""
    print(f"seed={SEED}")
    rng = random.Random(SEED)
    topo = Topology(TopologyConfig(wan_bps=10e9))
    holders: dict[str, tuple[tuple[int, int], ...] | None] = {}
    fetchers = []
    for i in range(602):
        dc = f"dc{i % 2}"
        rack = f"r{(i // 2) // 40}"
        host = f"{dc}{rack}h{(i // 2) // rng.choice([1, 4, 8])}"
        bps = rng.choice([25e9, 50e9, 50e9])
        topo.add(NodeInfo(f"n{i:03d}", dc, rack, host, bps, bps))
        if i in (0, 2):
            holders[f"n{i:03d}"] = None
        else:
            fetchers.append(f"n{i:03d}")
    config = PlannerConfig(seeds_per_dc=2, max_stripes=3)
    args = (KEY, 64 << 30, 256, topo, holders, fetchers)
    same(Planner(*args, config=config), FullScan(*args, config=config))


def test_joins_past_128_peers_end_near_the_plan_made_at_once() -> None:
    """320 fetchers join one at a time: rebuilds keep the plan within what the rebuild
    rule allows of the plan made at once (with rebuilds only up to 128 peers the trees
    became chains: 1,024 joiners, 229x the fluid bound; here, 320 joiners, 1.7x the plan
    made at once, where each level of a chain costs a chunk at its link's share)."""
    topo = Topology(TopologyConfig())
    topo.add(NodeInfo("trainer", "dc0", "r0", "ht", 50e9, 50e9))
    names = [f"f{i:03d}" for i in range(320)]
    for i, name in enumerate(names):
        topo.add(NodeInfo(name, "dc0", f"r{i % 8}", f"h{i}", 50e9, 50e9))
    holders: dict[str, tuple[tuple[int, int], ...] | None] = {"trainer": None}
    fresh = Planner(KEY, 4 << 30, 16, topo, holders, names).plan
    ratios: dict[int, float] = {}
    for limit in (128, PlannerConfig().rebuild_max_peers):
        pl = Planner(KEY, 4 << 30, 16, topo, holders, names[:1],
                     config=PlannerConfig(rebuild_max_peers=limit))
        for name in names[1:]:
            pl.add_fetcher(name)
        ratios[limit] = pl.reconsider().estimate_s / fresh.estimate_s
    print(f"estimate / the plan made at once, by rebuild limit: {ratios}")
    assert ratios[PlannerConfig().rebuild_max_peers] <= planner_mod.REBUILD_GAIN
    assert ratios[128] > 1.5


def test_racks_count_only_where_the_spine_is_slower() -> None:
    """A rack no faster than its DC buys nothing but depth: the plan is the one made
    without rack labels.  With a slower spine racks are kept."""
    def plan(config: TopologyConfig, racks: bool) -> tuple[object, float]:
        topo = Topology(config)
        topo.add(NodeInfo("trainer", "dc0", "r0", "ht", 50e9, 50e9))
        names = [f"f{i:03d}" for i in range(256)]
        for i, name in enumerate(names):
            topo.add(NodeInfo(name, "dc0", f"r{i // 16}" if racks else "", f"h{i}",
                              50e9, 50e9))
        p = Planner(KEY, 4 << 30, 16, topo, {"trainer": None}, names).plan
        return p.assignments, p.estimate_s

    flat = TopologyConfig(same_rack_bps=50e9, same_dc_bps=50e9)
    assert plan(flat, racks=True) == plan(flat, racks=False)
    spine = TopologyConfig(same_rack_bps=50e9, same_dc_bps=40e9)
    assert plan(spine, racks=True)[0] != plan(spine, racks=False)[0]
