"""Topology files (tensorhub.testing.clusterspec): parsing, clear errors, the shorthand,
and the fluid bound on heterogeneous NICs and several DCs. Pure: no root needed."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorhub.errors import ConfigError
from tensorhub.protocol.topology import fluid_bound
from tensorhub.testing.clusterspec import (
    ClusterSpec,
    DCLink,
    DCSpec,
    LinkChange,
    TopologyFileError,
    fluid_bound_s,
    load_topology,
    pair_class,
    parse_topology,
    relay_buffer,
    relay_routes,
    send_time_s,
    uniform,
)

MB = 1e6 / 8  # bytes/s in one Mbit/s
S = 64 * 2**20

EXAMPLE = """
[defaults]
wan_mbit = 400
wan_rtt_ms = 40

[[dc]]
name = "us"
hosts = [1000, 100, 400]

[[dc]]
name = "eu"
hosts = 2
nic_mbit = 400

[[dc]]
name = "ap"
hosts = [100]

[[link]]
between = ["eu", "us"]
mbit = 100
rtt_ms = 80

[[link]]
between = ["ap", "eu"]
rtt_ms = 10
"""


def test_a_file_gives_dcs_hosts_and_every_pair_a_link() -> None:
    spec = parse_topology(EXAMPLE)
    assert [dc.name for dc in spec.dcs] == ["us", "eu", "ap"]
    assert spec.hosts == [(0, 1000.0), (0, 100.0), (0, 400.0), (1, 400.0), (1, 400.0),
                          (2, 100.0)]
    assert spec.link(1, 0) == spec.link(0, 1) == DCLink(100.0, 80.0)
    assert spec.link(1, 2) == DCLink(None, 10.0)  # listed without mbit: no cap
    assert spec.link(0, 2) == DCLink(400.0, 40.0)  # from [defaults]
    assert "us: 1 x 1000 + 1 x 100 + 1 x 400 Mbit" in spec.describe()
    assert spec.to_dict()["links"][0] == {"between": ["us", "eu"], "mbit": 100.0,
                                          "rtt_ms": 80.0}


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(EXAMPLE)
    assert load_topology(path) == parse_topology(EXAMPLE)
    with pytest.raises(TopologyFileError, match=r"missing\.toml"):
        load_topology(tmp_path / "missing.toml")
    path.write_text("[[dc]]\nname = 'a'\n")
    with pytest.raises(TopologyFileError, match=r"cluster\.toml: .*hosts must be"):
        load_topology(path)


@pytest.mark.parametrize(("text", "message"), [
    ("[[dc]\n", "not valid TOML"),
    ("", "no \\[\\[dc\\]\\] tables"),
    ("colour = 1\n[[dc]]\nname='a'\nhosts=[1]\n", "unknown key\\(s\\) colour"),
    ("[[dc]]\nhosts = [100]\n", "needs a name"),
    ("[[dc]]\nname = 'a'\nhosts = 3\n", "hosts = 3 needs nic_mbit"),
    ("[[dc]]\nname = 'a'\nhosts = 0\nnic_mbit = 1\n", "need 1 to 250 hosts, got 0"),
    ("[[dc]]\nname = 'a'\nhosts = [100, -5]\n", "NIC rates > 0.*got \\[-5\\]"),
    ("[[dc]]\nname = 'a'\nhosts = [100, true]\n", "NIC rates > 0"),
    ("[[dc]]\nname = 'a'\nhosts = [100]\nnic_mbit = 100\n", "nic_mbit only with a host count"),
    ("[[dc]]\nname='a'\nhosts=[1]\n[[dc]]\nname='a'\nhosts=[1]\n", "'a' is used twice"),
    ("[[dc]]\nname='a'\nhosts=[1]\n[[dc]]\nname='b'\nhosts=[1]\n",
     "no \\[\\[link\\]\\] for a-b"),
    ("[[dc]]\nname='a'\nhosts=[1]\n[[link]]\nbetween=['a','x']\n", "no DC named 'x'"),
    ("[[dc]]\nname='a'\nhosts=[1]\n[[link]]\nbetween=['a','a']\n", "two different DCs"),
    ("[[dc]]\nname='a'\nhosts=[1]\n[[dc]]\nname='b'\nhosts=[1]\n"
     "[[link]]\nbetween=['a','b']\n[[link]]\nbetween=['b','a']\n", "a second link"),
    ("[[dc]]\nname='a'\nhosts=[1]\n[[dc]]\nname='b'\nhosts=[1]\n"
     "[[link]]\nbetween=['a','b']\nmbit=0\nrtt_ms=-1\n", "mbit must be.*rtt_ms must be"),
    ("[[dc]]\nname='a'\nhosts=[1]\n[[link]]\nbetween='a'\n", "between must be two DC names"),
    ("dc = 3\n", "dc must be an array of tables"),
])
def test_bad_files_say_what_and_where(text: str, message: str) -> None:
    with pytest.raises(TopologyFileError, match=message) as raised:
        parse_topology(text, "my.toml")
    assert str(raised.value).startswith("my.toml: ")


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(TopologyFileError) as raised:
        parse_topology("[[dc]]\nname='a'\nhosts=3\nrack=1\n")
    assert "unknown key(s) rack" in str(raised.value)
    assert "needs nic_mbit" in str(raised.value)


def test_the_shorthand_is_the_same_structure_as_a_file() -> None:
    spec = uniform(8, 400, dcs=2, wan_mbit=100, wan_rtt_ms=20)
    assert spec == parse_topology("""
        [[dc]]
        name = "dc0"
        hosts = 4
        nic_mbit = 400
        [[dc]]
        name = "dc1"
        hosts = 4
        nic_mbit = 400
        [[link]]
        between = ["dc0", "dc1"]
        mbit = 100
        rtt_ms = 20
    """)
    assert [dc for dc, _ in uniform(5, 100, dcs=2).hosts] == [0, 0, 0, 1, 1]
    with pytest.raises(ConfigError):
        ClusterSpec((DCSpec("a", (1.0,)), DCSpec("b", (1.0,))), {})


def test_bound_on_heterogeneous_nics_is_the_slowest_receiver_or_the_source() -> None:
    one_dc = parse_topology("[[dc]]\nname='a'\nhosts=[400, 1000, 100, 1000]\n")
    assert fluid_bound_s(one_dc, S) == pytest.approx(S / (100 * MB))  # the 100 Mbit host
    fast = parse_topology("[[dc]]\nname='a'\nhosts=[100, 1000, 1000]\n")
    assert fluid_bound_s(fast, S) == pytest.approx(S / (100 * MB))  # the source's upload


def test_bound_takes_the_tightest_cut_over_sets_of_dcs() -> None:
    # DC 0 holds the source. Into {1}: 0-1 + 1-2 = 500; into {2}: 500; into {1, 2}: only
    # 0-1 + 0-2 = 200 Mbit: that set of DCs must get one copy through 200 Mbit.
    spec = parse_topology("""
        [[dc]]
        name = "src"
        hosts = [1000]
        [[dc]]
        name = "b"
        hosts = [1000, 1000]
        [[dc]]
        name = "c"
        hosts = [1000]
        [[link]]
        between = ["src", "b"]
        mbit = 100
        [[link]]
        between = ["src", "c"]
        mbit = 100
        [[link]]
        between = ["b", "c"]
        mbit = 400
    """)
    assert fluid_bound_s(spec, S) == pytest.approx(S / (200 * MB))
    uncapped = ClusterSpec(spec.dcs, {k: DCLink(None, 0) for k in spec.links})
    assert uncapped.link(0, 1).bytes_per_s == math.inf
    assert fluid_bound_s(uncapped, S) == pytest.approx(S / (1000 * MB))


@given(hosts=st.integers(3, 12), nic=st.sampled_from([100.0, 400.0, 1000.0]),
       wan=st.sampled_from([50.0, 100.0, 400.0, 2000.0]), dcs=st.integers(1, 2))
def test_bound_matches_the_uniform_formula_on_uniform_clusters(
        hosts: int, nic: float, wan: float, dcs: int) -> None:
    spec = uniform(hosts, nic, dcs, wan, 20)
    old = fluid_bound(S, nic * MB, nic * MB, [nic * MB] * (hosts - 1),
                      wan_bytes=S if dcs > 1 else 0.0, wan_bps=wan * MB)
    assert fluid_bound_s(spec, S) == pytest.approx(old)


@given(nics=st.lists(st.sampled_from([100.0, 400.0, 1000.0]), min_size=2, max_size=8))
def test_bound_is_never_below_any_single_cut(nics: list[float]) -> None:
    spec = ClusterSpec((DCSpec("a", tuple(nics)),), {})
    bound = fluid_bound_s(spec, S)
    assert bound >= S / (nics[0] * MB) - 1e-9  # the source uploads a copy
    assert bound >= max(S / (n * MB) for n in nics[1:]) - 1e-9  # each receiver downloads one
    assert bound >= (len(nics) - 1) * S / (sum(nics) * MB) - 1e-9  # N copies uploaded


def test_relay_routes_give_each_direction_its_delay_and_class() -> None:
    spec = parse_topology(EXAMPLE)  # us-eu 100 Mbit / 80 ms, eu-ap uncapped / 10 ms
    routes = {(r["src"], r["dst"]): r for r in relay_routes(spec, "10.77")}
    assert len(routes) == 6  # every ordered pair of 3 DCs
    us_eu = routes[("10.77.0.0/24", "10.77.1.0/24")]
    assert us_eu["one_way_ms"] == 40
    # Bytes sent back to the client in "us" come from "eu" (class 1:0x101), and bytes
    # into "eu" from "us" (class 1:0x100).
    assert us_eu["to_src_priority"] == 0x10000 | pair_class(1) == 0x10101
    assert us_eu["to_dst_priority"] == 0x10000 | pair_class(0) == 0x10100
    eu_ap = routes[("10.77.1.0/24", "10.77.2.0/24")]
    assert (eu_ap["one_way_ms"], eu_ap["to_src_priority"], eu_ap["to_dst_priority"]) == (
        5, 0, 0)  # uncapped: the default class
    # The fastest, longest pair: us-ap at 400 Mbit / 40 ms -> 2 x 50 MB/s x 20 ms.
    assert relay_buffer(spec) == 2_000_000


def test_the_example_in_the_docs_parses() -> None:
    docs = Path(__file__).resolve().parents[1] / "docs" / "cluster.md"
    match = re.search(r"```toml\n(.*?)```", docs.read_text(), re.S)
    assert match, "the topology example is missing from docs/cluster.md"
    spec = parse_topology(match.group(1), "docs/cluster.md")
    assert [len(dc.nics_mbit) for dc in spec.dcs] == [4, 4, 2]
    assert spec.link(0, 2) == DCLink(400.0, 40.0)  # us-ap from [defaults]
    assert fluid_bound_s(spec, S) == pytest.approx(S / (100 * MB))  # the 100 Mbit hosts


# -- one-way links and changes during a fan-out ----------------------------------------

TWO = "[[dc]]\nname = 'a'\nhosts = [400]\n[[dc]]\nname = 'b'\nhosts = [400, 400]\n"


def test_one_way_links_give_each_direction_its_rate() -> None:
    spec = parse_topology(TWO + """
        [[link]]
        from = "a"
        to = "b"
        mbit = 100
        rtt_ms = 40
        [[link]]
        from = "b"
        to = "a"
        mbit = 40
        rtt_ms = 40
    """)
    assert spec.link(0, 1) == DCLink(100.0, 40.0)
    assert spec.link(1, 0) == DCLink(40.0, 40.0)
    assert not spec.symmetric(0, 1)
    assert "a->b: 100 Mbit, b->a: 40 Mbit, 40 ms rtt" in spec.describe()
    assert spec.to_dict()["links"] == [
        {"from": "a", "to": "b", "mbit": 100.0, "rtt_ms": 40.0},
        {"from": "b", "to": "a", "mbit": 40.0, "rtt_ms": 40.0}]
    # The cut into {b} is the link a -> b: S / 100 Mbit, not the 40 Mbit back.
    assert fluid_bound_s(spec, S) == pytest.approx(S / (100 * MB))
    swapped = ClusterSpec(spec.dcs, {(0, 1): spec.link(1, 0), (1, 0): spec.link(0, 1)})
    assert fluid_bound_s(swapped, S) == pytest.approx(S / (40 * MB))


def test_a_one_way_link_may_take_its_way_back_from_defaults() -> None:
    spec = parse_topology(TWO + """
        [defaults]
        wan_mbit = 300
        wan_rtt_ms = 60
        [[link]]
        from = "a"
        to = "b"
        mbit = 50
        rtt_ms = 60
    """)
    assert (spec.link(0, 1), spec.link(1, 0)) == (DCLink(50.0, 60.0), DCLink(300.0, 60.0))


def test_a_symmetric_mapping_is_completed_both_ways() -> None:
    spec = ClusterSpec((DCSpec("a", (1.0,)), DCSpec("b", (1.0,))), {(0, 1): DCLink(5.0, 2.0)})
    assert spec.links == {(0, 1): DCLink(5.0, 2.0), (1, 0): DCLink(5.0, 2.0)}
    assert spec.symmetric(0, 1)
    with pytest.raises(ConfigError, match="the same both ways"):
        ClusterSpec(spec.dcs, {(0, 1): DCLink(5.0, 2.0), (1, 0): DCLink(5.0, 3.0)})


def test_bound_cuts_into_a_set_of_dcs_use_the_links_into_it() -> None:
    # Into {b}: s->b + c->b = 100 + 40; into {c}: s->c + b->c = 50 + 200; into {b, c}:
    # s->b + s->c = 150. The tightest is {b} at 140 Mbit (the links out of b, 300 + 200,
    # and out of c, 300 + 40, do not count).
    spec = parse_topology("""
        [[dc]]
        name = "s"
        hosts = [400]
        [[dc]]
        name = "b"
        hosts = [400]
        [[dc]]
        name = "c"
        hosts = [400]
        [[link]]
        from = "s"
        to = "b"
        mbit = 100
        [[link]]
        from = "b"
        to = "s"
        mbit = 300
        [[link]]
        from = "s"
        to = "c"
        mbit = 50
        [[link]]
        from = "c"
        to = "s"
        mbit = 300
        [[link]]
        from = "b"
        to = "c"
        mbit = 200
        [[link]]
        from = "c"
        to = "b"
        mbit = 40
    """)
    assert spec.cut_steps([1]) == [(0.0, 140 * MB)]
    assert spec.cut_steps([1, 2]) == [(0.0, 150 * MB)]
    assert fluid_bound_s(spec, S) == pytest.approx(S / (140 * MB))


def test_send_time_follows_the_rate_steps() -> None:
    assert send_time_s(10.0, [(0.0, 5.0)]) == 2.0
    # 12.5 MB/s for 2 s carries 25 MB; the other 25 MB at 5 MB/s take 5 s more.
    assert send_time_s(50e6, [(0.0, 12.5e6), (2.0, 5e6)]) == pytest.approx(7.0)
    assert send_time_s(20e6, [(0.0, 12.5e6), (2.0, 5e6)]) == pytest.approx(1.6)  # done before
    assert send_time_s(50e6, [(0.0, 5e6), (1.0, 37.5e6)]) == pytest.approx(2.2)
    assert send_time_s(50e6, [(0.0, 5e6), (1.0, math.inf)]) == 1.0
    assert send_time_s(1.0, [(0.0, math.inf)]) == 0.0
    assert send_time_s(50e6, [(0.0, 12.5e6), (2.0, 12.5e6 * 4)]) == pytest.approx(2.5)


def test_a_change_during_the_fan_out_moves_the_bound() -> None:
    text = TWO + """
        [[link]]
        between = ["a", "b"]
        mbit = 100
        rtt_ms = 40
        [[change]]
        at_s = 2.0
        from = "a"
        to = "b"
        mbit = 40
    """
    spec = parse_topology(text)
    assert spec.changes == (LinkChange(2.0, 0, 1, 40.0),)
    assert spec.rate_steps(0, 1) == [(0.0, 100 * MB), (2.0, 40 * MB)]
    assert spec.rate_steps(1, 0) == [(0.0, 100 * MB)]
    assert not spec.symmetric(0, 1)
    assert "at 2 s a->b: 40 Mbit" in spec.describe()
    assert spec.to_dict()["changes"] == [{"at_s": 2.0, "from": "a", "to": "b", "mbit": 40.0}]
    # 12.5 MB/s for 2 s, then 5 MB/s: 50 MB arrive at 7 s; 20 MB before the change.
    assert fluid_bound_s(spec, 50e6) == pytest.approx(7.0)
    assert fluid_bound_s(spec, 20e6) == pytest.approx(1.6)
    faster = parse_topology(text.replace("mbit = 40", "mbit = 300").replace(
        "mbit = 100", "mbit = 40").replace("at_s = 2.0", "at_s = 1.0"))
    assert fluid_bound_s(faster, 50e6) == pytest.approx(2.2)  # 5 MB in 1 s, 45 at 37.5


def test_a_change_on_one_of_two_links_into_a_dc_changes_that_cut_only() -> None:
    spec = parse_topology("""
        [defaults]
        wan_mbit = 300
        wan_rtt_ms = 50
        [[dc]]
        name = "s"
        hosts = [400]
        [[dc]]
        name = "t"
        hosts = [400]
        [[dc]]
        name = "r"
        hosts = [400]
        [[link]]
        from = "s"
        to = "r"
        mbit = 100
        rtt_ms = 50
        [[link]]
        from = "t"
        to = "r"
        mbit = 100
        rtt_ms = 50
        [[change]]
        at_s = 1
        between = ["t", "r"]
        mbit = 20
    """)
    assert len(spec.changes) == 2  # both ways
    assert spec.cut_steps([2]) == [(0.0, 200 * MB), (1.0, 120 * MB)]
    # Into {r}: 25 MB in the first second, then 15 MB/s: 100 MB at 6 s. Into {t}: 600
    # Mbit (1.33 s); into {t, r}: 400 Mbit (2 s); the source's NIC: 2 s.
    assert fluid_bound_s(spec, 100e6) == pytest.approx(6.0)
    assert relay_buffer(spec) == int(2 * 300 * MB * 0.025)


def test_relay_routes_cap_each_direction_on_its_own() -> None:
    spec = parse_topology(TWO + """
        [[link]]
        from = "a"
        to = "b"
        mbit = 100
        rtt_ms = 20
        [[link]]
        from = "b"
        to = "a"
        rtt_ms = 20
    """)
    routes = {(r["src"], r["dst"]): r for r in relay_routes(spec, "10.77")}
    a_to_b = routes[("10.77.0.0/24", "10.77.1.0/24")]
    assert a_to_b["one_way_ms"] == 10
    assert a_to_b["to_dst_priority"] == 0x10000 | pair_class(0)  # a -> b: capped
    assert a_to_b["to_src_priority"] == 0  # b -> a: uncapped
    b_to_a = routes[("10.77.1.0/24", "10.77.0.0/24")]
    assert (b_to_a["to_dst_priority"], b_to_a["to_src_priority"]) == (0, 0x10000 | pair_class(0))


@pytest.mark.parametrize(("text", "message"), [
    ("[[link]]\nfrom='a'\nto='b'\nmbit=100\nrtt_ms=10\n",
     "no \\[\\[link\\]\\] for b->a .*needs one back"),
    ("[[link]]\nfrom='a'\nto='b'\nmbit=100\nrtt_ms=10\n"
     "[[link]]\nfrom='b'\nto='a'\nmbit=40\nrtt_ms=20\n",
     "\\[\\[link\\]\\] #1 and \\[\\[link\\]\\] #2: the round trip between 'a' and 'b' must "
     "be the same both ways, got rtt_ms = 10 a->b and 20 b->a"),
    ("[defaults]\nwan_mbit=300\nwan_rtt_ms=60\n[[link]]\nfrom='a'\nto='b'\nmbit=100\n",
     "\\[\\[link\\]\\] #1 and \\[defaults\\]: the round trip"),
    ("[[link]]\nbetween=['a','b']\nfrom='a'\nmbit=1\n", "either between = \\[a, b\\] or from"),
    ("[[link]]\nfrom='a'\nmbit=1\n", "needs between = \\[a, b\\] \\(both ways\\), or from"),
    ("[[link]]\nfrom='a'\nto=3\nmbit=1\n", "from and to must be DC names"),
    ("[[link]]\nfrom='a'\nto='x'\nmbit=1\n", "no DC named 'x'"),
    ("[[link]]\nbetween=['a','b']\n[[link]]\nfrom='b'\nto='a'\n",
     "#2: a second link from 'b' to 'a' \\(the first is \\[\\[link\\]\\] #1\\)"),
    ("[[link]]\nbetween=['a','b']\nrtt_ms=5\n[[change]]\nat_s=1\nfrom='a'\nto='b'\nmbit=5\n",
     "\\[\\[change\\]\\] #1: the link a->b has no cap"),
    ("[[link]]\nbetween=['a','b']\nmbit=9\n[[change]]\nat_s=-1\nfrom='a'\nto='b'\nmbit=5\n",
     "\\[\\[change\\]\\] #1: at_s must be a number >= 0"),
    ("[[link]]\nbetween=['a','b']\nmbit=9\n[[change]]\nfrom='a'\nto='b'\nmbit=5\n",
     "at_s must be a number"),
    ("[[link]]\nbetween=['a','b']\nmbit=9\n[[change]]\nat_s=1\nfrom='a'\nto='b'\n",
     "\\[\\[change\\]\\] #1: mbit must be a number > 0"),
    ("[[link]]\nbetween=['a','b']\nmbit=9\n[[change]]\nat_s=1\nfrom='a'\nto='z'\nmbit=1\n",
     "\\[\\[change\\]\\] #1: no DC named 'z'"),
    ("[[link]]\nbetween=['a','b']\nmbit=9\n[[change]]\nat_s=1\nbetween=['a','b']\nmbit=1\n"
     "[[change]]\nat_s=1\nfrom='b'\nto='a'\nmbit=2\n",
     "\\[\\[change\\]\\] #2: a second change of b->a at 1 s"),
    ("[[link]]\nbetween=['a','b']\nmbit=9\n[[change]]\nat_s=1\nfrom='a'\nto='b'\nmbit=1\n"
     "rtt_ms=3\n", "\\[\\[change\\]\\] #1: unknown key\\(s\\) rtt_ms"),
])
def test_bad_one_way_links_and_changes_say_what_and_where(text: str, message: str) -> None:
    with pytest.raises(TopologyFileError, match=message) as raised:
        parse_topology(TWO + text, "my.toml")
    assert str(raised.value).startswith("my.toml: ")
    with pytest.raises(TopologyFileError, match="change must be an array of tables"):
        parse_topology("change = 3\n" + TWO + "[[link]]\nbetween=['a','b']\n")
