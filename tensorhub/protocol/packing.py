"""Trees over the DC graph: how one version can flow from its DC to every other DC over
several paths at once.

Theory of operation
-------------------
A version broadcast from one DC to the others is, at the DC level, a set of spanning
trees rooted at the source DC (*arborescences*), each carrying its own share of the
bytes along its own links; one link may serve several trees.  By Edmonds' branching
theorem the best rate such trees can reach together is the least, over the DCs, of the
max-flow from the source into that DC, which is the cut bound of
:func:`~.topology.cut_bound` on the links alone.  One tree is rarely enough: a DC whose
direct link is slow is best fed over another DC, and a DC whose every link is slow is
best fed over several links at once, each carrying different bytes.

:func:`pack_trees` finds such trees and their rates by the multiplicative-weights method
of Garg and Könemann: each round takes the cheapest arborescence under the links'
current lengths (Chu-Liu/Edmonds, :func:`min_arborescence`), adds its bottleneck rate,
and lengthens each of its links by its share of that rate, so a busy link grows dear
and later rounds go around it; at the end the rates are scaled to fit every link.  A
fixed number of rounds on a graph of a few DCs costs well under a millisecond per
round.  The method spreads the rate over many trees; :func:`widest_trees` is the
greedy alternative that takes few (the widest tree, then the widest in what is left).
:func:`stripe_trees` then keeps the few trees that carry most and cuts the version's
chunks among them in proportion to their rates.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence

Edge = tuple[str, str]

ROUNDS = 300
"""Rounds of :func:`pack_trees`."""

EPSILON = 0.1
"""How much a round lengthens a link it filled (the method's step)."""


def min_arborescence(root: Hashable, nodes: Sequence[Hashable],
                     cost: Mapping[tuple[Hashable, Hashable], float]
                     ) -> dict[Hashable, Hashable] | None:
    """The cheapest spanning arborescence of ``nodes`` rooted at ``root`` over the edges
    of ``cost`` (Chu-Liu/Edmonds): each node but the root mapped to its parent.  None
    if some node cannot be reached.  Ties go to the smaller parent, so the answer does
    not depend on the mapping's order."""
    cheapest: dict[Hashable, tuple[float, str, Hashable]] = {}
    for (u, v), c in cost.items():
        if u != v and v != root and ((c, repr(u)) < cheapest[v][:2] if v in cheapest
                                     else True):
            cheapest[v] = (c, repr(u), u)
    if any(v != root and v not in cheapest for v in nodes):
        return None
    best = {v: cheapest[v][2] for v in nodes if v != root}
    cycle = _cycle(best)
    if not cycle:
        return best
    inside = set(cycle)
    merged: Hashable = ("@cycle", len(nodes), tuple(sorted(map(repr, cycle))))
    reduced: dict[tuple[Hashable, Hashable], float] = {}
    origin: dict[tuple[Hashable, Hashable], tuple[Hashable, Hashable]] = {}
    for (u, v), c in sorted(cost.items(), key=lambda kv: repr(kv[0])):
        if u in inside and v in inside:
            continue
        key: tuple[Hashable, Hashable]
        if v in inside:
            key, c = (u, merged), c - cost[best[v], v]
        elif u in inside:
            key = (merged, v)
        else:
            key = (u, v)
        if key not in reduced or c < reduced[key]:
            reduced[key], origin[key] = c, (u, v)
    sub = min_arborescence(root, [n for n in nodes if n not in inside] + [merged], reduced)
    if sub is None:
        return None
    parent: dict[Hashable, Hashable] = {}
    for v, u in sub.items():
        ou, ov = origin[u, v]
        parent[ov] = ou
    for v in cycle:
        parent.setdefault(v, best[v])
    return parent


def _cycle(parent: Mapping[Hashable, Hashable]) -> list[Hashable]:
    """A cycle of the parent map, if there is one."""
    done: set[Hashable] = set()
    for start in parent:
        path: dict[Hashable, int] = {}
        v: Hashable = start
        while v in parent and v not in done and v not in path:
            path[v] = len(path)
            v = parent[v]
        if v in path:
            order = list(path)
            return order[path[v]:]
        done.update(path)
    return []


def pack_trees(root: str, dcs: Sequence[str], rate: Mapping[Edge, float],
               rounds: int = ROUNDS) -> dict[frozenset[Edge], float]:
    """Arborescences rooted at DC ``root`` spanning ``dcs`` (root included), each with the
    bytes a second it carries, together within every link's ``rate`` (bytes a second;
    links missing or at 0 are not used).  Empty if some DC cannot be reached."""
    cap = {e: r for e, r in rate.items() if r > 0 and e[0] in dcs and e[1] in dcs
           and e[0] != e[1]}
    length: dict[tuple[Hashable, Hashable], float] = {e: 1.0 / r for e, r in cap.items()}
    flows: dict[frozenset[Edge], float] = {}
    for _ in range(max(1, rounds)):
        tree = min_arborescence(root, list(dcs), length)
        if tree is None:
            return {}
        edges = frozenset((str(u), str(v)) for v, u in tree.items())
        if not edges:
            return {}
        bottleneck = min(cap[e] for e in edges)
        flows[edges] = flows.get(edges, 0.0) + bottleneck
        for e in edges:
            length[e] *= 1.0 + EPSILON * bottleneck / cap[e]
    load: dict[Edge, float] = {}
    for edges, f in flows.items():
        for e in edges:
            load[e] = load.get(e, 0.0) + f
    scale = min(cap[e] / x for e, x in load.items())
    return {t: f * scale for t, f in flows.items()}


def widest_trees(root: str, dcs: Sequence[str], rate: Mapping[Edge, float], most: int
                 ) -> dict[frozenset[Edge], float]:
    """Up to ``most`` arborescences, greedily: each the one whose narrowest link is widest
    in what the links have left (Prim's algorithm, taking the widest link out of the
    tree each step), at that narrowest link's rate.  Fewer trees than
    :func:`pack_trees` and sometimes less in all (on 04-relay-only, 290 Mbit of 330),
    but where each DC's own links are wide enough it finds the plain answer (on
    05-split-over-two-links, 240 of 240 in three trees)."""
    left = {e: r for e, r in rate.items() if r > 0 and e[0] in dcs and e[1] in dcs
            and e[0] != e[1]}
    out: dict[frozenset[Edge], float] = {}
    first = 0.0
    for _ in range(max(0, most)):
        tree: set[Edge] = set()
        reached, narrowest = {root}, math.inf
        while len(reached) < len(set(dcs)):
            step = max(((r, e) for e, r in left.items()
                        if e[0] in reached and e[1] not in reached and r > 0),
                       default=None)  # ties: the larger (from, to) names, any fixed rule
            if step is None:
                return out
            r, e = step
            tree.add(e)
            reached.add(e[1])
            narrowest = min(narrowest, r)
        if not tree or narrowest <= first * 0.01:
            break
        first = first or narrowest
        edges = frozenset(tree)
        out[edges] = out.get(edges, 0.0) + narrowest
        for e in edges:
            left[e] -= narrowest
    return out


def stripe_trees(trees: Mapping[frozenset[Edge], float], chunks: int, most: int
                 ) -> list[tuple[int, frozenset[Edge]]]:
    """At most ``most`` of ``trees`` (the ones carrying most), each with its number of
    chunks (at least one; all together ``chunks``), in proportion to their rates (each
    chunk left over goes to the tree furthest below its share); in the trees' order of
    rate, largest first."""
    ranked = sorted(trees.items(), key=lambda kv: (-kv[1], sorted(kv[0])))
    ranked = ranked[: max(1, min(most, chunks))]
    total = sum(f for _, f in ranked)
    if not ranked or total <= 0:
        return []
    exact = [f / total * chunks for _, f in ranked]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > chunks:  # the minimum of one pushed it over: take from the largest
        counts[counts.index(max(counts))] -= 1
    while sum(counts) < chunks:  # the rest to the tree furthest below its share
        counts[max(range(len(counts)), key=lambda i: (exact[i] - counts[i], -i))] += 1
    return [(n, t) for n, (t, _) in zip(counts, ranked, strict=True) if n > 0]
