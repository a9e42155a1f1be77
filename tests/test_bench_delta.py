"""``tensorhub bench delta`` without a cluster: its RL-like steps change the fraction
they say, and its figures hold their bounds as the issue states them."""

from __future__ import annotations

import numpy as np
import pytest

from tensorhub.bench.delta import figures_of
from tensorhub.testing.rlstep import bf16_weights, rl_step


@pytest.mark.parametrize("fraction", [0.01, 0.02, 0.10])
def test_a_step_changes_about_its_fraction_by_small_amounts(fraction: float) -> None:
    w = bf16_weights(4 << 20, seed=1)
    new = rl_step(w, fraction, seed=2)
    old, changed = w["weights"], new["weights"]
    assert np.array_equal(old, bf16_weights(4 << 20, seed=1)["weights"])  # seeded
    share = np.mean(old != changed)
    assert 0.5 * fraction < share <= fraction  # some round to themselves, some repeat
    as_f32 = [(a.astype(np.uint32) << 16).view(np.float32) for a in (old, changed)]
    moved = as_f32[0] != as_f32[1]
    rel = np.abs(as_f32[1][moved] / as_f32[0][moved] - 1)
    assert np.median(rel) < 0.02  # small amounts


def summary(seconds: float, wan: float) -> dict[str, float]:
    return {"seconds": seconds, "watched_s": seconds, "wan_vs_size": wan}


def test_figures_follow_the_issues_bounds() -> None:
    two = {"full": summary(20.0, 1.0), "equal": True,
           "steps": {"0.01": summary(2.0, 0.01), "0.1": summary(6.0, 0.05)}}
    one = {"full": summary(6.0, 0.0), "equal": True, "steps": {"0.01": summary(1.0, 0.0)}}
    figs = {f["name"]: f for f in figures_of(two, one, [0.01, 0.1])}
    assert figs["interdc_bytes_vs_size_delta_1pct"]["bound"] == 0.1
    assert figs["remote_dc_time_vs_full_1pct"]["value"] == 0.1
    assert figs["delta_vs_full_time_1dc"]["ok"] and figs["digest_equal"]["ok"]
    assert figs["interdc_bytes_vs_size_delta_10pct"]["ok"]
    two["equal"] = False
    slow = figures_of(two, {**one, "steps": {"0.01": summary(7.0, 0.0)}}, [0.01])
    assert [f["name"] for f in slow if not f["ok"]] == ["digest_equal",
                                                          "delta_vs_full_time_1dc"]
