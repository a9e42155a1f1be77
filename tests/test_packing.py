"""Trees over the DC graph (:mod:`tensorhub.protocol.packing`): the cheapest
arborescence against brute force, packed trees against the cut bound, stripes cut in
proportion."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.protocol.packing import min_arborescence, pack_trees, stripe_trees, widest_trees

MBIT = 1e6 / 8


def brute_force(root: int, n: int, cost: dict[tuple[int, int], float]) -> float | None:
    """The cheapest arborescence's cost by trying every parent choice."""
    others = [v for v in range(n) if v != root]
    best = None
    for parents in itertools.product(range(n), repeat=len(others)):
        tree = dict(zip(others, parents, strict=True))
        if any(u == v or (u, v) not in cost for v, u in tree.items()):
            continue
        ok = True
        for v in others:  # every node reaches the root
            seen, at = set(), v
            while at != root and at not in seen:
                seen.add(at)
                at = tree[at]
            ok = ok and at == root
        if ok:
            c = sum(cost[u, v] for v, u in tree.items())
            best = c if best is None else min(best, c)
    return best


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 5).flatmap(lambda n: st.tuples(
    st.just(n), st.dictionaries(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))
                                .filter(lambda e: e[0] != e[1]),
                                st.integers(1, 50).map(float), max_size=n * (n - 1)))))
def test_the_cheapest_arborescence_is_as_cheap_as_brute_force(case: tuple[int, dict]) -> None:
    n, cost = case
    tree = min_arborescence(0, list(range(n)), cost)
    want = brute_force(0, n, cost)
    if want is None:
        assert tree is None
        return
    assert tree is not None and set(tree) == set(range(1, n))
    assert all((u, v) in cost for v, u in tree.items())
    assert sum(cost[u, v] for v, u in tree.items()) == pytest.approx(want)


def links(*pairs: tuple[str, str, float]) -> dict[tuple[str, str], float]:
    rate = {}
    for a, b, mbit in pairs:
        rate[a, b] = rate[b, a] = mbit * MBIT
    return rate


RELAY = links(("us", "eu", 250), ("eu", "me", 250), ("me", "ap", 250), ("us", "me", 40),
              ("us", "ap", 40), ("eu", "ap", 40))
"""topologies/04-relay-only.toml: the cut bound from us is 330 Mbit (into {ap}, and into
{eu, me, ap}); any one tree carries at most 250."""


def test_trees_together_come_near_the_cut_bound_and_fit_every_link() -> None:
    trees = pack_trees("us", ["us", "eu", "me", "ap"], RELAY)
    assert sum(trees.values()) >= 0.95 * 330 * MBIT  # one tree alone: 250
    assert len(trees) >= 3
    load: dict[tuple[str, str], float] = {}
    for tree, rate in trees.items():
        assert len(tree) == 3 and {b for _, b in tree} == {"eu", "me", "ap"}
        for e in tree:
            load[e] = load.get(e, 0.0) + rate
    assert all(x <= RELAY[e] * (1 + 1e-9) for e, x in load.items())


SPLIT = links(("us", "eu", 300), ("us", "as", 300), ("eu", "ap", 100), ("as", "ap", 100),
              ("us", "ap", 40), ("eu", "as", 40))
"""topologies/05-split-over-two-links.toml: the cut into {ap} is 240 Mbit."""


def test_the_widest_trees_take_the_plain_answer_where_each_dcs_links_suffice() -> None:
    trees = widest_trees("us", ["us", "eu", "as", "ap"], SPLIT, most=4)
    assert sum(trees.values()) == pytest.approx(240 * MBIT)
    assert sorted(round(r / MBIT) for r in trees.values()) == [40, 100, 100]
    assert all({("us", "eu"), ("us", "as")} <= t for t in trees)  # both direct, each time
    relay = widest_trees("us", ["us", "eu", "me", "ap"], RELAY, most=4)
    assert max(relay.values()) == pytest.approx(250 * MBIT)  # us -> eu -> me -> ap first
    assert sum(relay.values()) <= 330 * MBIT * (1 + 1e-9)
    assert widest_trees("us", ["us", "eu", "ap"], links(("us", "eu", 100)), most=4) == {}


def test_a_dc_nobody_links_to_gets_no_trees() -> None:
    rate = links(("us", "eu", 100))
    assert pack_trees("us", ["us", "eu", "ap"], rate) == {}
    assert pack_trees("us", ["us", "eu"], {**rate, ("us", "eu"): 0.0}) == {}


def test_one_link_is_one_tree_at_its_rate() -> None:
    trees = pack_trees("us", ["us", "eu"], links(("us", "eu", 100)))
    assert trees == {frozenset({("us", "eu")}): pytest.approx(100 * MBIT)}


@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=8), st.integers(1, 300),
       st.integers(1, 6))
def test_stripes_share_out_every_chunk_in_proportion(rates: list[float], chunks: int,
                                                      most: int) -> None:
    trees = {frozenset({("a", f"t{i}")}): r for i, r in enumerate(rates)}
    out = stripe_trees(trees, chunks, most)
    counts = [n for n, _ in out]
    assert sum(counts) == chunks and all(n >= 1 for n in counts)
    assert len(out) <= min(most, chunks, len(rates))
    kept = [trees[t] for _, t in out]
    assert kept == sorted(kept, reverse=True)  # the largest first
    total = sum(kept)
    for n, t in out:  # within a chunk of the exact share, but for the minimum of one
        assert n <= max(1, trees[t] / total * chunks + 1) + 1e-9
