"""The data-plane simulator's per-pair WAN (issue 41): each ordered DC pair its own link
in the flow network, the coordinator's planner told of them, the multi-DC table of
``python -m simulations.paper --only wan``; small fabrics, virtual time only."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from simulations.dataplane import multidc as m
from simulations.dataplane import workloads as w
from simulations.dataplane.fabric import GBIT, Fabric, FabricSpec
from simulations.dataplane.fanouts import FabricCoordinator, Fanout, new_fabric, run, setup_of
from simulations.paper.__main__ import main
from tensorhub.config import PeerConfig

SLOW, FAST = 10 * GBIT, 100 * GBIT
CHUNK = 256 << 20
SMALL = replace(w.Options(), size=8e9, rollout_hosts=4, chunks=4)


def _two_dcs(**wan: tuple[float, float]) -> tuple[Fabric, str, str]:
    """One GPU in ``a``, one in ``b``; ``wan`` keyed ``"a_b"`` for ``a -> b``."""
    spec = FabricSpec(gpus_per_host=1,
                      wan={tuple(k.split("_")): v for k, v in wan.items()})  # type: ignore[misc]
    fabric = new_fabric(spec)
    return fabric, fabric.add_hosts("a", 1, "x")[0][0], fabric.add_hosts("b", 1, "y")[0][0]


def _pull(fabric: Fabric, src: str, dst: str, chunks: int = 8) -> float:
    """``dst`` pulls ``chunks`` chunks from ``src``: when it is done (virtual time)."""
    fan = Fanout("v", (src,), (dst,), chunks * CHUNK, CHUNK, plan=False,
                 upstream={dst: frozenset({src})})
    res = run([fan], fabric, until=1e4)
    assert not res.fanouts["v"].failed
    return res.fanouts["v"].done[dst]


def test_each_direction_of_a_pair_runs_at_its_own_rate() -> None:
    fabric, x, y = _two_dcs(a_b=(SLOW, 0.02), b_a=(FAST, 0.02))
    size = 8 * CHUNK
    there = _pull(fabric, x, y)
    assert there >= size / SLOW
    assert fabric.net.links["wan:a>b"].rate == SLOW
    assert fabric.net.links["wan:a>b"].carried == pytest.approx(size)
    fabric, x, y = _two_dcs(a_b=(SLOW, 0.02), b_a=(FAST, 0.02))
    back = _pull(fabric, y, x)
    assert size / FAST <= back < size / SLOW
    assert fabric.net.links["wan:b>a"].rate == FAST


def test_a_coarse_chunk_slower_than_a_peers_stall_timeout_still_lands() -> None:
    """A chunk here is four of a peer's largest: over a link where it takes twice the
    peer's ``stall_timeout`` (but each of a peer's chunks half of it) it lands, instead
    of being given up and asked for again for ever."""
    stall = PeerConfig("sim").stall_timeout
    rate = CHUNK / (2 * stall)
    fabric, x, y = _two_dcs(a_b=(rate, 0.02))
    assert 2 * CHUNK / rate <= _pull(fabric, x, y, chunks=2) < 3 * CHUNK / rate


def test_a_pair_not_listed_takes_the_default_rate_and_the_round_trip_is_the_pairs() -> None:
    fabric, x, y = _two_dcs(a_b=(SLOW, 0.05))
    spec = fabric.spec
    assert spec.wan_link("a", "b") == (SLOW, 0.05)
    assert spec.wan_link("b", "a") == (spec.wan_bps, 0.05)  # one round trip per pair
    assert spec.wan_link("a", "c") == (spec.wan_bps, spec.wan_rtt_s)
    assert fabric.rtt(x, y) == fabric.rtt(y, x) == 0.05
    names = {link.name: link.rate for link in fabric.links(y, x)}
    assert names["wan:b>a"] == spec.wan_bps


@pytest.mark.parametrize("wan", [{("a", "b"): (SLOW, 0.02), ("b", "a"): (SLOW, 0.03)},
                                 {("a", "b"): (0.0, 0.02)}, {("a", "a"): (SLOW, 0.0)},
                                 {("a", "b"): (SLOW, -1.0)}])
def test_a_bad_wan_map_is_refused(wan: dict[tuple[str, str], tuple[float, float]]) -> None:
    with pytest.raises(ValueError, match="wan link"):
        FabricSpec(wan=wan)


@pytest.mark.parametrize("known", [True, False])
def test_the_planner_plans_with_the_declared_links(known: bool) -> None:
    fabric, x, y = _two_dcs(a_b=(SLOW, 0.04), b_a=(FAST, 0.04))
    fan = Fanout("v", (x,), (y,), 8 * CHUNK, CHUNK, wan_known=known)
    coordinator = FabricCoordinator(setup_of(fan, fabric, 0), 8, fabric, fan)
    topology = coordinator._new([y]).topology
    if known:
        assert topology.dc_link("a", "b") == (SLOW, 0.04)
        assert topology.dc_link("b", "a") == (FAST, 0.04)
        estimate = topology.wan.estimate("a", "b")
        assert estimate is not None and estimate.how == "declared"
    else:
        assert topology.wan.pairs() == []
        assert topology.dc_link("a", "b") == (fabric.spec.wan_bps, 0.0)


def test_spread_deals_hosts_over_the_dcs() -> None:
    assert m.spread(128) == (32, 32, 32, 32)
    assert m.spread(6) == (2, 2, 1, 1)
    assert sum(m.spread(7)) == 7


def test_every_shape_is_at_least_its_cut_bound_and_crosses_each_link_it_needs() -> None:
    """The bound is a bound: no simulated run beats it; every remote DC gets the model
    at least once; the closed forms are the direct links' times."""
    for shape in m.SHAPES:
        r = m.measure(SMALL, shape, blind=False)
        print(shape.name, r.makespan_s, r.bound_s, r.bytes_vs_min)
        assert r.makespan_s >= r.bound_s
        assert r.bytes_vs_min >= 1 - 1e-6
        assert set(r.per_dc_s) == set(m.DCS) and max(r.per_dc_s.values()) == r.makespan_s
        direct = max(SMALL.size / (shape.links[m.HOME, dc][0] * GBIT) for dc in m.DCS[1:])
        assert r.direct_feed_s == pytest.approx(direct)
        assert r.pull_s >= r.direct_feed_s


def test_the_planner_takes_the_detour_it_is_told_of() -> None:
    """dc0>dc3 direct is 8x slower than through dc1: told the links, the plan sends
    (almost) nothing over it and beats feeding dc3 directly."""
    detour = next(s for s in m.SHAPES if s.name == "detour")
    r = m.measure(SMALL, detour, blind=False)
    assert r.carried.get("wan:dc0>dc3", 0.0) <= 0.1 * SMALL.size
    assert r.makespan_s < r.direct_feed_s


def test_the_cut_bound_is_the_model_over_a_dc_that_only_a_thin_cut_reaches() -> None:
    """transit: dc3 takes in 420 Gb/s in all, far below the rest of the fabric."""
    transit = next(s for s in m.SHAPES if s.name == "transit")
    o = replace(SMALL, rollout_hosts=128)
    bound = m.cut_bound_s(o, m.spec_of(o, transit), m.spread(128))
    assert bound == pytest.approx(o.size / (420 * GBIT))


def test_the_wan_part_prints_its_table_and_figures(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--only", "wan", "--rollout-hosts", "4", "--chunks", "4", "--no-plots", "--json"])
    out = capsys.readouterr().out
    data = json.loads(out.strip().splitlines()[-1])
    names = {f["name"] for f in data["figures"]}
    assert {"sim_wan_fanout_vs_cut_bound_worst", "sim_wan_interdc_bytes_vs_min_worst",
            "sim_wan_fanout_vs_blind_planner_worst",
            "sim_wan_fanout_vs_direct_feed_worst"} == names
    assert all({"name", "value", "unit", "bound", "better"} <= f.keys()
               for f in data["figures"])
    raw = data["raw"]["wan"]
    assert [r["shape"] for r in raw] == [s.name for s in m.SHAPES]
    for r in raw:
        assert len(r["links"]) == 12 and r["rollout_hosts_per_dc"] == dict(
            zip(m.DCS, (1, 1, 1, 1), strict=True))
        assert r["makespan_s"] >= r["cut_bound_s"] > 0 and r["blind_planner_s"] > 0
    rows = data["tables"]["multi-DC WAN"]
    assert len(rows) == 7 * len(m.SHAPES)
    assert "split: simulated / cut bound" in out
