"""The WAN model (declared, measured, heard) and the planner's routes between DCs: a
remote DC fed through a better DC, a DC's copy split over two links, the cut bound, and
the route a fetcher's DC took, in words."""

from __future__ import annotations

import math

import pytest

import tensorhub.protocol.planner as planner_mod
from tensorhub.errors import ConfigError, RemoteProtocolError
from tensorhub.links import LinkSpec, parse_links
from tensorhub.model import VersionKey
from tensorhub.protocol.planner import Planner, PlannerConfig
from tensorhub.protocol.topology import NodeInfo, Topology, TopologyConfig, cut_bound
from tensorhub.protocol.wan import MAX_LINK_REPORTS, SLOW_SHARE, SLOW_STREAK, LinkReport, Wan

MBIT = 1e6 / 8
KEY = VersionKey("llm", 1)
SIZE = 256 << 20


def mesh(hosts: dict[str, int], links: dict[tuple[str, str], float], nic_mbit: float = 400
         ) -> tuple[Topology, list[str]]:
    """``hosts[dc]`` peers per DC (the trainer first, in the first DC); every link given
    both ways at ``links[(a, b)]`` Mbit."""
    declared = [LinkSpec(x, y, mbit * MBIT, 0.05) for (a, b), mbit in links.items()
                for x, y in ((a, b), (b, a))]
    nodes = []
    for dc, n in hosts.items():
        for i in range(n):
            name = "trainer" if not nodes else f"{dc}-{i}"
            nodes.append(NodeInfo(name, dc, "", name, nic_mbit * MBIT, nic_mbit * MBIT))
    topo = Topology(TopologyConfig(), tuple(nodes), wan=Wan(declared))
    return topo, [n.name for n in nodes[1:]]


def wan_bytes(planner: Planner, topo: Topology) -> dict[tuple[str, str], float]:
    """Bytes the plan moves over each DC pair's link."""
    out: dict[tuple[str, str], float] = {}
    plan = planner.plan
    chunk = SIZE / 64
    for a in plan.assignments:
        for s in a.sources:
            pair = (topo.node(s.peer).dc, topo.node(a.fetcher).dc)
            if pair[0] != pair[1]:
                out[pair] = out.get(pair, 0.0) + (s.stop - s.first) * chunk
    return out


def test_a_dc_behind_a_slow_direct_link_is_fed_through_the_fast_one() -> None:
    topo, fetchers = mesh({"us": 3, "eu": 3, "ap": 3},
                          {("us", "eu"): 300, ("eu", "ap"): 300, ("us", "ap"): 20})
    planner = Planner(KEY, SIZE, 64, topo, {"trainer": None}, fetchers)
    moved = wan_bytes(planner, topo)
    # One copy into each remote DC, and most of ap's through eu.
    assert sum(moved.values()) == pytest.approx(2 * SIZE)
    assert moved.get(("eu", "ap"), 0.0) > moved.get(("us", "ap"), 0.0)
    assert moved.get(("us", "ap"), 0.0) <= SIZE / 4
    assert "us -> eu -> ap" in planner.route_of("ap-0")
    assert "declared" in planner.route_of("ap-0")
    assert "from inside the DC" in planner.route_of("us-1")
    # And the plan's own estimate of it stays near the cut bound.
    assert planner.plan.estimate_s <= 1.3 * planner.plan.bound_s


def test_without_that_knowledge_the_plan_goes_direct() -> None:
    topo, fetchers = mesh({"us": 3, "eu": 3, "ap": 3}, {})
    planner = Planner(KEY, SIZE, 64, topo, {"trainer": None}, fetchers)
    assert "default" in planner.route_of("ap-0")
    assert sum(wan_bytes(planner, topo).values()) == pytest.approx(2 * SIZE)


def test_a_dc_whose_links_are_each_too_slow_gets_its_copy_over_two() -> None:
    topo, fetchers = mesh({"us": 2, "eu": 2, "as": 2, "ap": 2},
                          {("us", "eu"): 300, ("us", "as"): 300, ("eu", "ap"): 100,
                           ("as", "ap"): 100, ("us", "ap"): 10, ("eu", "as"): 10})
    planner = Planner(KEY, SIZE, 64, topo, {"trainer": None}, fetchers)
    moved = wan_bytes(planner, topo)
    into_ap = {src: b for (src, dst), b in moved.items() if dst == "ap"}
    assert sum(into_ap.values()) == pytest.approx(SIZE)
    assert into_ap.get("eu", 0.0) > 0 and into_ap.get("as", 0.0) > 0  # both links used
    assert sum(moved.values()) == pytest.approx(3 * SIZE)  # still one copy per DC


def test_a_dc_behind_slow_links_gets_its_copy_along_several_dc_trees() -> None:
    """04-relay-only at 1 GiB (256 chunks) on 1 Gbit NICs: ap's cut is 40 + 40 + 250
    Mbit; equal stripes take it all over the one 250 Mbit path, a layout also sends
    different bytes over its two 40 Mbit links."""
    topo, fetchers = mesh({"us": 3, "eu": 2, "me": 2, "ap": 2},
                          {("us", "eu"): 250, ("eu", "me"): 250, ("me", "ap"): 250,
                           ("us", "me"): 40, ("us", "ap"): 40, ("eu", "ap"): 40}, 1000)
    size, chunks = 1 << 30, 256
    config = PlannerConfig(dc_trees=True)
    planner = Planner(KEY, size, chunks, topo, {"trainer": None}, fetchers, config=config)
    plan = planner.plan
    lengths = {hi - lo for lo, hi in planner._stripes}
    assert len(lengths) > 1  # cut by the trees' rates, not evenly
    route = planner.route_of("ap-0")
    assert "via us -> ap" in route and "via us -> eu -> me -> ap" in route, route
    assert plan.estimate_s <= 1.15 * plan.bound_s
    into_ap = 0
    for a in plan.assignments:  # still one copy into each DC
        for src in a.sources:
            if topo.node(src.peer).dc != "ap" and topo.node(a.fetcher).dc == "ap":
                into_ap += src.stop - src.first
    assert into_ap == chunks
    old_gain = planner_mod.LAYOUT_GAIN
    try:
        planner_mod.LAYOUT_GAIN = math.inf  # equal stripes only
        gated = Planner(KEY, size, chunks, topo, {"trainer": None}, fetchers,
                        config=config).plan
    finally:
        planner_mod.LAYOUT_GAIN = old_gain
    assert gated.estimate_s >= plan.estimate_s * planner_mod.LAYOUT_GAIN
    default = Planner(KEY, size, chunks, topo, {"trainer": None}, fetchers)
    assert {hi - lo for lo, hi in default._stripes} == {chunks // default.statistics().stripes}
    assert gated.estimate_s == pytest.approx(default.plan.estimate_s)  # off by default


def test_the_cut_bound_by_hand() -> None:
    links = {("s", "a"): 10.0, ("s", "b"): 2.0, ("a", "b"): 6.0, ("b", "a"): 1.0}
    rate = lambda x, y: links.get((x, y), 0.0) or 1e-9  # noqa: E731
    # One fetcher in each of a and b, fast NICs: the cuts into {b} (2 + 6) and into
    # {a, b} (10 + 2) and into {a} (10 + 1): b's is the least, 8 bytes/s.
    bound = cut_bound(80.0, [("s", 1e6)], [("a", 1e6, 1e6), ("b", 1e6, 1e6)], rate)
    assert bound == pytest.approx(10.0)
    # A slow NIC at b's fetcher dominates.
    assert cut_bound(80.0, [("s", 1e6)], [("a", 1e6, 1e6), ("b", 1e6, 4.0)], rate) == 20.0
    assert cut_bound(80.0, [], [("a", 1.0, 1.0)], rate) == 0.0


def test_measured_beats_declared_and_the_median_of_reporters_counts() -> None:
    wan = Wan([LinkSpec("a", "b", 100.0, 0.1)], min_sample_bytes=10)
    assert wan.estimate("a", "b").how == "declared"  # type: ignore[union-attr]
    assert wan.rate("b", "a") is None
    assert wan.observe("a", "b", 1000, 2.0)  # 500 B/s
    e = wan.estimate("a", "b")
    assert e is not None and e.how == "measured" and e.bps == 500.0 and e.rtt_s == 0.1
    assert wan.hear("x", [LinkReport("a", "b", 900.0, 0.2)])
    assert wan.hear("y", [LinkReport("a", "b", 50.0, 0.0)])
    assert wan.rate("a", "b") == 500.0  # median of 500, 900 and 50
    assert not wan.hear("y", [LinkReport("a", "b", 50.0, 0.0)])  # nothing new
    wan.forget("x")
    assert wan.rate("a", "b") == pytest.approx(275.0)
    assert [r.bps for r in wan.reports()] == [500.0]


def test_a_faster_sample_is_believed_a_slower_one_by_halves_once_it_persists() -> None:
    wan = Wan(min_sample_bytes=1)
    wan.observe("a", "b", 100, 1.0)
    wan.observe("a", "b", 400, 1.0)
    assert wan.rate("a", "b") == 400.0
    changes = wan.changes
    for _ in range(5):  # a little slower, time after time: the transfers' own limits
        wan.observe("a", "b", int(SLOW_SHARE * 400) + 1, 1.0)
    assert wan.rate("a", "b") == 400.0 and wan.changes == changes
    for _ in range(SLOW_STREAK - 1):  # far slower, but not yet in a row
        wan.observe("a", "b", 100, 1.0)
    assert wan.rate("a", "b") == 400.0 and wan.changes == changes
    wan.observe("a", "b", 400, 1.0)  # a fast one in between: the streak starts over
    for _ in range(SLOW_STREAK - 1):
        wan.observe("a", "b", 100, 1.0)
    assert wan.rate("a", "b") == 400.0
    wan.observe("a", "b", 100, 1.0)  # slower time after time: the link degraded
    assert wan.rate("a", "b") == 250.0
    for _ in range(8):  # follows by halves while the samples are under the share
        wan.observe("a", "b", 100, 1.0)
    assert 100.0 < wan.rate("a", "b") <= 100.0 / SLOW_SHARE
    wan.observe("a", "b", 30, 1.0, probe=True)  # a probe reads the link alone
    assert wan.rate("a", "b") == 30.0
    assert not wan.observe("a", "a", 100, 1.0)  # inside one DC: not a link


def test_interim_samples_only_bring_news_of_a_link_slowing_down() -> None:
    wan = Wan(min_sample_bytes=1)
    assert not wan.observe("a", "b", 900, 1.0, interim=True)  # nothing known yet
    assert wan.rate("a", "b") is None
    wan.observe("a", "b", 400, 1.0)
    assert not wan.observe("a", "b", 900, 1.0, interim=True)  # faster: not believed
    assert wan.rate("a", "b") == 400.0
    for _ in range(SLOW_STREAK):  # far slower, time after time: followed down
        assert wan.observe("a", "b", 100, 1.0, interim=True)
    assert wan.rate("a", "b") == 250.0


def test_a_first_sample_is_weighed_against_what_we_hear_and_reports_only_news() -> None:
    """A short tail read after a relay completed must not become a report of its own:
    the median of two reports is their mean."""
    wan = Wan(min_sample_bytes=1)
    wan.hear("prober", [LinkReport("a", "b", 300.0, 0.08)])
    assert wan.observe("a", "b", 200, 1.0)  # slower, but within the share: no news
    assert wan.reports() == () and wan.rate("a", "b") == 300.0
    wan.observe("a", "b", 60, 1.0)  # far slower, once
    assert wan.reports() == () and wan.rate("a", "b") == 300.0
    wan.observe("a", "b", 60, 1.0)  # twice in a row: halfway from what we heard
    assert [r.bps for r in wan.reports()] == [180.0]
    assert wan.rate("a", "b") == 240.0 and wan.estimate("a", "b").rtt_s == 0.08  # type: ignore[union-attr]
    other = Wan([LinkSpec("a", "b", 100.0, 0.1)], min_sample_bytes=1)
    assert other.observe("a", "b", 400, 1.0)  # faster than declared: believed
    assert other.rate("a", "b") == 400.0


def test_reports_from_the_wire_are_checked_and_bounded() -> None:
    wan = Wan()
    for bad in (LinkReport("a", "a", 1.0), LinkReport("a", "b", math.nan),
                LinkReport("a", "b", -1.0), LinkReport("a", "b", 1e20),
                LinkReport("a", "b", 1.0, 99.0), LinkReport("", "b", 1.0)):
        with pytest.raises(RemoteProtocolError):
            wan.hear("x", [bad])
    many = [LinkReport("a", f"d{i}", 1.0) for i in range(MAX_LINK_REPORTS + 1)]
    with pytest.raises(RemoteProtocolError):
        wan.hear("x", many)
    assert wan.pairs() == []
    for i in range(MAX_LINK_REPORTS + 5):  # our own: the most recent kept
        wan.observe("a", f"d{i}", 1 << 21, 1.0)
    assert len(wan.reports()) == MAX_LINK_REPORTS
    assert wan.reports()[-1].dst == f"d{MAX_LINK_REPORTS + 4}"


def test_link_tables_parse_both_shapes_and_refuse_mistakes() -> None:
    got = parse_links([{"between": ["a", "b"], "mbit": 8, "rtt_ms": 20},
                       {"from": "a", "to": "c", "mbit": 16}, {"between": ["b", "c"]}])
    assert got == (LinkSpec("a", "b", 1e6, 0.02), LinkSpec("b", "a", 1e6, 0.02),
                   LinkSpec("a", "c", 2e6, 0.0))
    for bad, says in (([{"between": ["a"], "mbit": 1}], "two DC names"),
                      ([{"from": "a", "mbit": 1}], "needs between"),
                      ([{"between": ["a", "a"], "mbit": 1}], "two different DCs"),
                      ([{"between": ["a", "b"], "mbit": -1}], "rate must be"),
                      ([{"between": ["a", "b"], "mbit": 1, "speed": 2}], "unknown key"),
                      ([{"between": ["a", "b"], "mbit": 1},
                        {"from": "a", "to": "b", "mbit": 2}], "declared twice"),
                      ({"between": ["a", "b"]}, "array of tables")):
        with pytest.raises(ConfigError, match=says):
            parse_links(bad)


def test_a_link_that_falls_mid_transfer_moves_the_remaining_stripes() -> None:
    """The plan crosses us -> eu at 150 Mbit; the fetchers' interim samples then make
    the WAN model believe 40: the next ask tries a fresh plan, which moves stripes off
    that link (to us -> as -> eu), under a new epoch; one fall costs one try."""
    topo, fetchers = mesh({"us": 3, "eu": 3, "as": 2},
                          {("us", "eu"): 150, ("us", "as"): 60, ("as", "eu"): 200})
    planner = Planner(KEY, SIZE, 64, topo, {"trainer": None}, fetchers)
    before, epoch = wan_bytes(planner, topo), planner.epoch
    assert before[("us", "eu")] > before.get(("us", "as"), 0.0)
    planner.reconsider()
    assert planner.epoch == epoch and planner.link_replans == 0  # nothing fell
    wan = topo.wan
    wan.observe("us", "eu", int(140 * MBIT), 1.0, probe=True)  # a little slower: no news
    planner.reconsider()
    assert planner.epoch == epoch and planner.link_replans == 0
    wan.observe("us", "eu", int(40 * MBIT), 1.0, probe=True)
    planner.reconsider()
    assert planner.link_replans == 1 and planner.epoch == epoch + 1
    after = wan_bytes(planner, topo)
    assert after[("us", "eu")] < before[("us", "eu")]
    assert after[("us", "as")] > before.get(("us", "as"), 0.0)
    assert sum(after.values()) == pytest.approx(2 * SIZE)  # still one copy into each DC
    assert "40 Mbit" in planner.route_of("eu-0")
    planner.reconsider()  # the same rates: no second try
    assert planner.link_replans == 1 and planner.epoch == epoch + 1
