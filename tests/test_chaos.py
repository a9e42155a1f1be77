"""The chaos bench: its invariant checker on crafted episodes, and a short real run."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tensorhub.bench.chaos_check import Episode, check, rogue_traces
from tensorhub.bench.chaos_episode import draw_faults, episode_rng
from tensorhub.bench.rogue import MARK, marks

FIGURES = {"peer_crashes", "unauth_reads", "unauth_messages_accepted",
           "forged_versions_accepted", "forged_chunks_accepted", "partial_activations",
           "verified_bytes_refetched", "fetch_failures", "flood_fetch_time_ratio",
           "chaos_seeds"}
NBYTES = 1000
MID = {1: "aa" * 16, 2: "bb" * 16}


def activation(version: int, *, ok: bool = True, sources: dict[str, int] | None = None,
               received: int = NBYTES, mid: str | None = None) -> dict[str, Any]:
    return {"peer": "r0", "version": version, "manifest_id": mid or MID.get(version, "cc"),
            "content_ok": ok, "nbytes": NBYTES,
            "report": {"bytes": received, "verified": True, "integrity_failures": {},
                       "bytes_by_source": sources or {"trainer": received}}}


def episode(**kw: Any) -> Episode:
    return Episode(seed=7, attack="forged_chunks", published=dict(MID), **kw)


def view(members: dict[str, list[Any]] | None = None, **kw: Any) -> dict[str, Any]:
    return {"members": members or {"trainer": ["alive", 0], "r0": ["alive", 0]},
            "stamps": {"trainer": [1 << 50, 3]}, "holdings": [], **kw}


def test_a_clean_episode_counts_nothing_but_its_activations() -> None:
    v = check(episode(activations=[activation(1), activation(2)],
                      views={"r0": view(), "trainer": view()}))
    assert v.counts["activations"] == 2
    assert sum(n for k, n in v.counts.items() if k != "activations") == 0
    assert v.problems == [] and not v.poisoned


def test_bytes_that_are_not_the_trainers_are_a_partial_activation() -> None:
    v = check(episode(activations=[activation(2, ok=False)]))
    assert v.counts["partial_activations"] == 1
    assert v.counts["forged_chunks_accepted"] == 0
    assert "not the trainer's" in v.problems[0]


def test_wrong_bytes_from_the_rogue_are_forged_chunks() -> None:
    v = check(episode(activations=[activation(1, ok=False,
                                              sources={"rogue7": 600, "trainer": 400})]))
    assert v.counts["forged_chunks_accepted"] == 1
    assert v.counts["partial_activations"] == 0


def test_a_version_the_trainer_never_published_or_published_otherwise_is_forged() -> None:
    v = check(episode(activations=[activation(999, sources={"rogue7": NBYTES}),
                                   activation(2, mid="dd" * 16)]))
    assert v.counts["forged_versions_accepted"] == 2
    # a trainer's refused publish: the version is not the trainer's, whatever it holds
    refused = Episode(seed=7, published={1: MID[1]}, activations=[activation(2)])
    assert check(refused).counts["forged_versions_accepted"] == 1


def test_verified_bytes_received_twice_are_counted() -> None:
    v = check(episode(activations=[activation(1, received=NBYTES + 300)]))
    assert v.counts["verified_bytes_refetched"] == 300


def test_only_version_unavailable_naming_what_is_missing_is_an_allowed_failure() -> None:
    errors = [{"peer": "r0", "version": 2, "kind": "VersionUnavailable",
               "error": "...", "detail": "no live holder for 3 of 33 chunks"},
              {"peer": "r1", "version": 2, "kind": "VersionUnavailable", "error": "...",
               "detail": ""},
              {"peer": "r2", "version": 2, "kind": "TransportError", "error": "reset",
               "detail": ""}]
    v = check(episode(fetch_errors=errors))
    assert v.counts["version_unavailable"] == 1
    assert v.counts["fetch_failures"] == 2


def test_a_fetch_that_never_ends_is_a_failure_unless_its_peer_was_killed() -> None:
    started = [{"peer": p, "version": 2} for p in ("r0", "r1", "r2")]
    v = check(episode(started=started, killed={"r2"}, activations=[activation(2)],
                      fetch_errors=[]))
    assert v.counts["fetch_failures"] == 1
    assert "r1's fetch of version 2 had not ended" in v.problems[0]


def test_a_peer_that_exits_unasked_is_a_crash() -> None:
    v = check(episode(killed={"r1"}, exited={"r2": "exit code 1: OverflowError"}))
    assert v.counts["peer_crashes"] == 1
    assert "r2 died" in v.problems[0]


def test_the_rogues_words_in_any_view_are_found() -> None:
    ours = marks(7)
    assert rogue_traces(7, {"r0": view()}) == []
    believed = {
        "r0": view({"trainer": ["alive", 0], "rogue7": ["suspect", 0]}),
        "r1": view({"trainer": ["left", ours[1]]}),
        "r2": view(forgotten={"trainer": [ours[3], 1]}),
        "trainer": view(holdings=[["r0", "chaos7", 999, "ee" * 16, "rogue7", True]]),
    }
    traces = rogue_traces(7, believed)
    assert [t.split()[0] for t in traces] == ["r0", "r1", "r2", "trainer"]
    # another episode's rogue is not this one's
    assert rogue_traces(8, {"r0": believed["r0"]}) == []
    v = check(episode(views=believed, rogue={"reads": ["member list from r0"]}))
    assert v.counts["unauth_messages_accepted"] == 1
    assert v.counts["unauth_reads"] == 1
    assert v.poisoned  # a planted stamp outlives the episode


def test_a_stamp_only_the_rogue_could_have_made_poisons_the_mesh() -> None:
    assert check(episode(views={"r0": view(stamps={"rogue3": [MARK + 5, 1]})})).poisoned \
        is False
    assert check(episode(views={"r0": view(stamps={"trainer": [MARK + 5, 1]})})).poisoned


@pytest.mark.slow
def test_a_short_real_run_reports_every_figure_and_the_faults_it_injected() -> None:
    base = next(s for s in range(1000) if any(
        (f.kind, f.role) == ("kill", "holder") for f in draw_faults(episode_rng(s), 0.6)))
    out = subprocess.run(
        [sys.executable, "-m", "simulations.chaos", "--seeds", "3", "--seed-base", str(base),
         "--attacks", "none", "--heavy", "off", "--flood-runs", "1", "--flood-timeout", "3",
         "--starved-seeds", "0",
         "--json"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    figures = {f["name"]: f for f in result["figures"]}
    assert set(figures) == FIGURES
    assert figures["chaos_seeds"]["value"] == 3
    first = next(line for line in lines if line.startswith(f"seed {base}:"))
    assert "kill holder r" in first, first
    assert result["baselines"]["faults"].get("kill holder", 0) >= 1
    # A process the harness killed is not a crash; faults alone never corrupt a version.
    for name in ("peer_crashes", "partial_activations", "forged_versions_accepted",
                 "forged_chunks_accepted", "verified_bytes_refetched"):
        assert figures[name]["value"] == 0, (name, out.stdout[-3000:])
    assert result["baselines"]["totals"]["activations"] > 0
    assert figures["flood_fetch_time_ratio"]["value"] > 0


def test_the_cli_refuses_an_unknown_attack_in_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "tensorhub.cli", "bench", "chaos",
                          "--attacks", "forged_chunks,teleport"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "teleport" in out.stderr, out.stderr
