"""Coordinator scenarios of issue 3: handover, load balance and split views.

They drive :mod:`tensorhub.protocol.ring` -- the election, epochs and trackers the peer
uses -- unchanged, with one seeded ``random.Random`` per seed:

* ``coord_moved_extra``: over every one of 10,000 versions, removing a random peer moves
  exactly the versions it coordinated and adding one moves versions only to it (0);
* ``coord_max_over_mean``: N peers, 10,000 versions of one model, the busiest
  coordinator's load over the mean, worst over all seeds (<= 2);
* ``dual_epoch_plans``: views that differ in d = 1, 3, 10 peers, plans delivered in random
  order; fetchers that ran plans of two epochs for one version, summed over seeds (0).
"""

from __future__ import annotations

import random
import statistics

from tensorhub.protocol.ring import coord_max_over_mean, coord_moved_extra, split_view_trial

from .report import Context, Figure, scenario

VERSIONS = 10_000
VIEW_DIFFS = (1, 3, 10)


@scenario("coordinator")
def coordinator(ctx: Context) -> list[Figure]:
    n = ctx.nodes
    moved, ratios, dual, naive, unconverged = 0, [], 0, 0, 0
    for seed in ctx.seed_list(ctx.seeds):
        moved += coord_moved_extra(n, VERSIONS, random.Random(f"moved/{seed}"))
        ratios.append(coord_max_over_mean(n, VERSIONS, random.Random(f"load/{seed}")))
        for d in VIEW_DIFFS:
            trial = split_view_trial(random.Random(f"split/{seed}/{d}"), n, min(n, 256), d)
            dual += trial.dual_epoch_fetchers
            naive += trial.naive_dual_fetchers
            unconverged += trial.unconverged
    seeds = len(ctx.seed_list(ctx.seeds))
    return [
        Figure("coord_moved_extra", moved, "versions", 0, "lower",
               f"N={n}, {VERSIONS} versions, one leave and one join per seed, {seeds} seeds"),
        Figure("coord_max_over_mean", max(ratios), "ratio", 2.0, "lower",
               f"N={n}, {VERSIONS} versions; worst of {seeds} seeds, median "
               f"{statistics.median(ratios):.2f}"),
        Figure("dual_epoch_plans", dual, "fetchers", 0, "lower",
               f"views differing by d={'/'.join(map(str, VIEW_DIFFS))} peers, {seeds} seeds; "
               f"{naive} fetchers were sent plans of 2+ epochs; {unconverged} not on the "
               f"final epoch after views agreed"),
    ]
