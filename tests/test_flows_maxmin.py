"""Max-min fair sharing of the flow-level network (simulations/flows.py): rates against
hand-computed allocations, and, for random start/end sequences, the bottleneck
condition that characterises max-min (no link over its rate; every flow at its cap or
on a full link where no flow runs faster) and agreement with progressive filling of
the whole network from scratch."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulations.events import COMPACT_AT, EventQueue
from simulations.flows import Flow, Link, Network


def _net() -> tuple[Network, EventQueue]:
    queue = EventQueue()
    return Network(queue), queue


def _start(net: Network, links: tuple[Link, ...], cap: float = math.inf) -> Flow:
    return net.start(0.0, links, 10**9, lambda t: None, cap)


def test_a_flow_held_back_elsewhere_leaves_its_share_to_the_others() -> None:
    net, _ = _net()
    up = net.link("up:a", 100.0)
    slow, fast = net.link("down:b", 30.0), net.link("down:c", 1000.0)
    f1 = _start(net, (up, slow))
    f2 = _start(net, (up, fast))
    assert f1.rate == 30.0 and f2.rate == 70.0  # equal share per link would give f2 50


def test_the_classic_parking_lot() -> None:
    """Three links of 10 in a row; one long flow over all, one short flow on each:
    every flow 5.  Make the middle link 4: the long flow and the middle one get 2,
    the outer short flows 8."""
    for middle, want in ((10.0, (5.0, 5.0, 5.0, 5.0)), (4.0, (2.0, 8.0, 2.0, 8.0))):
        net, _ = _net()
        a, b, c = net.link("a", 10.0), net.link("b", middle), net.link("c", 10.0)
        long_ = _start(net, (a, b, c))
        shorts = [_start(net, (x,)) for x in (a, b, c)]
        assert (long_.rate, *(f.rate for f in shorts)) == pytest.approx(want)


def test_a_cap_frees_capacity_and_an_end_hands_it_back() -> None:
    net, _ = _net()
    up = net.link("up:a", 90.0)
    downs = [net.link(f"down:{i}", 1000.0) for i in range(3)]
    capped = _start(net, (up, downs[0]), cap=10.0)
    f1, f2 = _start(net, (up, downs[1])), _start(net, (up, downs[2]))
    assert (capped.rate, f1.rate, f2.rate) == pytest.approx((10.0, 40.0, 40.0))
    net.cancel(0.0, capped)
    assert (f1.rate, f2.rate) == pytest.approx((45.0, 45.0))


def test_an_end_ripples_through_a_chain_of_links() -> None:
    """f0 on L1 (10) with f1; f1 also on L2 (10) with f2; f2 also on L3 (4).  Max-min:
    f2 = 4 (L3), f1 = 5, f0 = 5.  End f0: f1 = 6 on L2 (f2 still 4), not 10."""
    net, _ = _net()
    l1, l2, l3 = net.link("l1", 10.0), net.link("l2", 10.0), net.link("l3", 4.0)
    f0, f1, f2 = _start(net, (l1,)), _start(net, (l1, l2)), _start(net, (l2, l3))
    assert (f0.rate, f1.rate, f2.rate) == pytest.approx((5.0, 5.0, 4.0))
    net.cancel(0.0, f0)
    assert (f1.rate, f2.rate) == pytest.approx((6.0, 4.0))
    assert l2.used == pytest.approx(10.0)


def test_bytes_and_completion_follow_the_rates() -> None:
    net, queue = _net()
    up = net.link("up:a", 100.0)
    slow, fast = net.link("down:b", 30.0), net.link("down:c", 1000.0)
    net.start(0.0, (up, slow), 300, lambda t: None)
    f2 = net.start(0.0, (up, fast), 700, lambda t: None)
    assert len(queue) == 2
    nxt = queue.pop()
    assert nxt is not None and nxt[0] == pytest.approx(10.0)  # both end together
    assert net.cancel(5.0, f2) == pytest.approx(350.0)


def _reference(flows: list[Flow]) -> list[float]:
    """Progressive filling of every flow from scratch, in small steps of the water
    level: every unfrozen flow rises together until a link fills or it reaches its
    cap (exact, solved per step)."""
    rate = {f: 0.0 for f in flows}
    frozen: set[Flow] = set()
    while len(frozen) < len(flows):
        links = {link for f in flows if f not in frozen for link in f.links}
        step = min([(link.rate - sum(rate[g] for g in link.flows))
                    / sum(1 for g in link.flows if g not in frozen) for link in links]
                   + [f.cap - rate[f] for f in flows if f not in frozen])
        for f in flows:
            if f not in frozen:
                rate[f] += step
        for f in flows:
            if f in frozen:
                continue
            if rate[f] >= f.cap * (1 - 1e-9) or any(
                    sum(rate[g] for g in link.flows) >= link.rate * (1 - 1e-9)
                    for link in f.links):
                frozen.add(f)
    return [rate[f] for f in flows]


_actions = st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 5), min_size=1,
                                                      max_size=3, unique=True),
                              st.sampled_from([math.inf, math.inf, 7.0, 25.0]),
                              st.integers(0, 99)), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(rates=st.lists(st.sampled_from([10.0, 30.0, 40.0, 100.0]), min_size=6,
                      max_size=6), actions=_actions)
def test_rates_are_max_min_after_every_start_and_end(
        rates: list[float], actions: list[tuple[bool, list[int], float, int]]) -> None:
    net, _ = _net()
    links = [net.link(f"l{i}", r) for i, r in enumerate(rates)]
    flows: list[Flow] = []
    for start, on, cap, pick in actions:
        if start or not flows:
            flows.append(_start(net, tuple(links[i] for i in on), cap))
        else:
            net.cancel(0.0, flows.pop(pick % len(flows)))
        for link in links:
            used = sum(f.rate for f in link.flows)
            assert used <= link.rate * (1 + 1e-9)
            assert link.used == pytest.approx(used, rel=1e-9, abs=1e-9)
        for f in flows:
            assert f.rate > 0
            assert f.rate >= f.cap * (1 - 1e-9) or any(
                sum(g.rate for g in link.flows) >= link.rate * (1 - 1e-9)
                and f.rate >= max(g.rate for g in link.flows) * (1 - 1e-9)
                for link in f.links), "a flow without a bottleneck"
        assert [f.rate for f in flows] == pytest.approx(_reference(flows), rel=1e-6)


def test_re_arming_keeps_the_queue_bounded_and_the_times_exact() -> None:
    """n flows of 1..n units on one link, all from t=0: each end speeds up every flow
    left, which re-arms it (about n^2 / 2 re-arms).  The queue never holds more
    cancelled entries than there are flows (or :data:`COMPACT_AT`), and the ends are
    processor sharing's: the k-th smallest ends ``(s_k - s_{k-1}) x (n - k + 1) / rate``
    after the one before it."""
    n, unit, rate = 400, 1000, 100.0
    net, queue = _net()
    link = net.link("up:a", rate)
    ended: dict[int, float] = {}
    for i in range(n):
        net.start(0.0, (link,), (i + 1) * unit, lambda t, i=i: ended.setdefault(i, t))
    assert queue.held == len(queue) == n
    while (nxt := queue.pop()) is not None:
        nxt[1](nxt[0])
        assert queue.held - len(queue) <= max(n, COMPACT_AT)
    assert queue.compactions > 0
    t, want = 0.0, {}
    for k in range(n):
        t += unit * (n - k) / rate
        want[k] = t
    assert ended == pytest.approx(want, rel=1e-9)
