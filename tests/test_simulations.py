"""The control-plane scenarios at N=64: the invariants hold (virtual time, not wall time).

The full-size figures come from ``python -m simulations.control_plane``; these tests
run the same scenario functions small, with few seeds.
"""

from __future__ import annotations

import pytest

from simulations import membership_scenarios as scenarios
from simulations.report import C_ROUNDS, Context, Figure


@pytest.fixture(scope="module")
def ctx() -> Context:
    c = Context(nodes=64, seeds=2, hour=3600.0, hour_seeds=1, partition_nodes=64,
                partition_seeds=1, partition_durations=(10.0, 120.0, 1800.0),
                log=lambda line: None)
    print(f"simulation seeds {c.seed_list(c.seeds)}")
    return c


def _by_name(figures: list[Figure]) -> dict[str, Figure]:
    for f in figures:
        print(f.name, f.value, f.bound, f.detail)
    return {f.name: f for f in figures}


def test_every_crash_is_detected_by_every_peer_within_the_bound(ctx: Context) -> None:
    figures = _by_name(scenarios.crash_detection(ctx))
    assert figures["detect_max_over_bound"].within()  # <= 1; inf if any peer never saw it
    assert "false deaths 0" in figures["detect_p99_s"].detail


def test_slow_lossy_peers_are_never_declared_dead(ctx: Context) -> None:
    assert _by_name(scenarios.false_positives(ctx))["false_deaths"].value == 0


def test_a_join_reaches_everyone_within_c_log_n_rounds(ctx: Context) -> None:
    figure = _by_name(scenarios.convergence(ctx))["converge_rounds_c"]
    assert figure.bound == C_ROUNDS and figure.within()


def test_views_converge_after_partitions_heal(ctx: Context) -> None:
    assert _by_name(scenarios.partitions(ctx))["partition_heal_over_bound"].within()


def test_a_restarted_peer_rejoins_within_one_push_pull_interval(ctx: Context) -> None:
    assert _by_name(scenarios.restart(ctx))["restart_rejoin_over_bound"].within()


def test_same_seed_same_trace_hash(ctx: Context) -> None:
    def traces(seeds: int) -> list[str]:
        c = Context(nodes=64, seeds=seeds, log=lambda line: None)
        scenarios.crash_detection(c)
        return c.traces

    first, again, more = traces(2), traces(2), traces(3)
    print("trace hashes", first)
    assert first == again
    assert more[:2] == first and more[2] not in first


def test_coordinator_handover_and_split_views(ctx: Context) -> None:
    from simulations.coordinator_scenarios import coordinator

    figures = _by_name(coordinator(ctx))
    assert figures["coord_moved_extra"].value == 0
    assert figures["dual_epoch_plans"].value == 0
    assert "0 not on the final epoch" in figures["dual_epoch_plans"].detail
