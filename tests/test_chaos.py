"""The chaos bench: its invariant checker on crafted episodes, and a short real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tensorhub.testing.chaos.check import Episode, check, family, insider_traces, rogue_traces
from tensorhub.testing.chaos.episode import draw_faults, episode_rng
from tensorhub.testing.chaos.rogue import MARK, marks

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


def insider_episode(attack: str = "insider_announce", **kw: Any) -> Episode:
    return Episode(seed=7, attack=attack, published=dict(MID),
                   addresses={"trainer": "tcp://h:1", "r0": "tcp://h:2"}, **kw)


def test_the_insiders_refusable_words_in_any_view_are_found() -> None:
    def at(addresses: dict[str, str], **kw: Any) -> dict[str, Any]:
        return view(addresses=addresses, latest={"chaos7": 2}, **kw)

    real = {"trainer": "tcp://h:1", "r0": "tcp://h:2", "insider": "tcp://h:9"}
    # its own signed entry (holding what it "published") and its membership are its own
    own = at(real, holdings=[["insider", "chaos7", 999, "ee" * 16, "insider", True]])
    assert insider_traces(insider_episode(views={"r0": own})) == []
    believed = {
        "r0": at(real, holdings=[["r0", "chaos7", 999, "ee" * 16, "insider", True]]),
        "r1": {**at(real), "latest": {"chaos7": 999}},
        "r2": at({**real, "insider": "tcp://h:2"}),
        "trainer": at({**real, "r0": "tcp://h:9"}),
    }
    traces = insider_traces(insider_episode(views=believed))
    assert traces == ["r0 lists r0 holding version 999 by insider",
                      "r1 takes version 999 as latest",
                      "r2 lists insider at r0's address",
                      "trainer lists r0 at tcp://h:9"]
    v = check(insider_episode(views=believed, rogue={"reads": ["manifest of chaos7@1"]}))
    assert v.counts["unauth_messages_accepted"] == 1
    assert v.counts["unauth_reads"] == 0  # a member may read
    # a marked incarnation (a "left" at a huge incarnation) is found as the rogue's is
    left = {"r1": view({"trainer": ["left", marks(7)[1]]})}
    assert check(insider_episode("insider_false_left", views=left)).counts[
        "unauth_messages_accepted"] == 1


def test_the_insiders_bytes_are_forged_chunks_and_its_bans_are_counted() -> None:
    bad = activation(1, ok=False, sources={"insider": 600, "trainer": 400})
    caught = activation(2, sources={"trainer": NBYTES})
    caught["report"]["integrity_failures"] = {"insider": 3}
    banned = activation(1, sources={"r1": NBYTES})
    banned["report"]["banned_sources"] = {"insider": "chunk 3 failed its digest"}
    v = check(insider_episode("insider_forged_chunks", activations=[bad, caught, banned]))
    assert v.counts["forged_chunks_accepted"] == 1
    assert v.counts["insider_bans"] == 2
    assert v.counts["integrity_failures_detected"] == 3
    assert [family(a) for a in (None, "forged_chunks", "insider_announce")] == [
        "none", "keyless", "insider"]


@pytest.mark.slow
def test_an_insider_gets_in_and_none_of_its_words_is_accepted(tmp_path: Path) -> None:
    """Seeds 47..49: the insider's announce, impersonate and forged-chunks attacks
    (seed 49 has no fault: rollout r0 reads from it and the trainer)."""
    log = tmp_path / "episodes.jsonl"
    out = subprocess.run(
        [sys.executable, "-m", "simulations.chaos", "--seeds", "0", "--seed-base", "47",
         "--insider-seeds", "3", "--heavy", "off", "--flood-runs", "0",
         "--starved-seeds", "0", "--security", "on", "--log", str(log), "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    figures = {f["name"]: f["value"] for f in result["figures"]}
    for name in ("peer_crashes", "unauth_messages_accepted", "forged_versions_accepted",
                 "forged_chunks_accepted", "partial_activations"):
        assert figures[name] == 0, (name, out.stdout[-3000:])
    assert figures["chaos_seeds"] == 3
    assert result["baselines"]["by_family"]["insider"]["seeds"] == 3
    episodes = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["attack"] for e in episodes] == ["insider_announce", "insider_impersonate",
                                               "insider_forged_chunks"]
    for e in episodes:
        # In at the transport level: peers answered it over CURVE, counted no refused
        # handshake, and listed it as a member; their rules refused the rest.
        assert e["rogue"]["received"] > 0, e["rogue"]
        for peer, v in e["views"].items():
            assert "insider" in v["members"], peer
            assert v["refused"].get("handshake", 0) == 0
            assert v["refused"].get("not a member", 0) == 0
    forged = episodes[-1]
    assert forged["rogue"]["admitted"] > 0 and forged["rogue"]["chunks_served"] > 0
    r0 = [a for a in forged["activations"] if a["peer"] == "r0"]
    assert r0 and all(a["content_ok"] for a in r0)
    assert sum(sum(a["report"]["integrity_failures"].values()) for a in r0) > 0
    assert result["baselines"]["totals"]["insider_bans"] >= 1


@pytest.mark.slow
def test_a_short_real_run_reports_every_figure_and_the_faults_it_injected() -> None:
    base = next(s for s in range(1000) if any(
        (f.kind, f.role) == ("kill", "holder") for f in draw_faults(episode_rng(s), 0.6)))
    out = subprocess.run(
        [sys.executable, "-m", "simulations.chaos", "--seeds", "3", "--seed-base", str(base),
         "--attacks", "none", "--heavy", "off", "--flood-runs", "1", "--flood-timeout", "3",
         "--starved-seeds", "0", "--insider-seeds", "0",
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
