"""``tensorhub bench cluster --topology-suite``: the checked-in topologies (they parse, fit
the box and bound what their comments say), the harness's pieces without root (declared
links, link changes on a stand-in cluster, option checks), and one real run of the suite
on a tiny three-DC file at 16 MiB (root needed; skips with the reason otherwise). No
wall-clock time is asserted."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import leftovers
from helpers import wait_until_sync

from tensorhub.bench.cluster_suite import changing, declared_links
from tensorhub.links import LinkSpec, parse_links
from tensorhub.testing.clusterspec import (
    ClusterSpec,
    fluid_bound_s,
    load_topology,
    parse_topology,
    uniform,
)

ROOT = Path(__file__).resolve().parents[1]
SUITE = sorted((ROOT / "topologies").glob("*.toml"))
MB = 1e6 / 8  # bytes/s in one Mbit/s
S = 256 * 2**20
FIGURES = {"fanout_vs_fluid_bound_declared_v1", "fanout_vs_fluid_bound_learned_v2",
           "fanout_vs_fluid_bound_learned_v1", "interdc_bytes_vs_min"}


def _spec(name: str) -> ClusterSpec:
    (path,) = [p for p in SUITE if p.stem.endswith(name)]
    return load_topology(path)


# -- the checked-in suite ----------------------------------------------------------------


def test_the_suite_has_its_files_and_each_fits_the_box() -> None:
    assert len(SUITE) >= 7
    kinds = {"asymmetric": 0, "change": 0, "uniform": 0}
    for path in SUITE:
        spec = load_topology(path)
        text = path.read_text()
        assert text.startswith("# ") and "Tests:" in text, f"{path.name}: say what it tests"
        assert len(spec.hosts) <= 12, path.name  # one Python peer per host, two cores
        assert all(nic <= 400 for _, nic in spec.hosts), path.name
        if spec == uniform(8, 400, 2, 100, 20):
            kinds["uniform"] += 1
            continue
        assert 3 <= len(spec.dcs) <= 5, path.name
        for (a, b), link in spec.links.items():
            assert link.mbit is not None and 40 <= link.mbit <= 300, (path.name, a, b)
            assert 40 <= link.rtt_ms <= 150, (path.name, a, b)
        for change in spec.changes:
            assert 40 <= change.mbit <= 300, path.name
        kinds["asymmetric"] += any(not spec.symmetric(a, b) for a, b in spec.links)
        kinds["change"] += bool(spec.changes)
    assert all(kinds.values()), kinds
    assert any(len({nic for _, nic in load_topology(p).hosts}) > 1 for p in SUITE)


@pytest.mark.parametrize(("name", "mbit"), [
    ("uniform-2dc", 100),          # the one link
    ("asymmetric", 60 + 200),      # into ap: us -> ap, eu -> ap (not ap's fast uplinks)
    ("two-hop-beats-direct", 40 + 300),  # into ap: the direct link and eu -> ap
    ("relay-only", 40 + 40 + 250),  # into ap: from us, eu and me
    ("split-over-two-links", 100 + 100 + 40),  # into ap: eu -> ap, as -> ap, us -> ap
    ("slow-source-uplinks", 3 * 80),  # out of us into {eu, ap, sa}
    ("heterogeneous-5dc", 40 + 60 + 40 + 40),  # into sa
])
def test_each_file_is_bound_by_the_cut_its_comment_names(name: str, mbit: float) -> None:
    assert fluid_bound_s(_spec(name), S) == pytest.approx(S / (mbit * MB))


def test_the_degrading_link_bounds_by_its_cut_before_and_after_the_change() -> None:
    spec = _spec("degrading-link")
    assert [(c.at_s, c.src, c.dst, c.mbit) for c in spec.changes] == [(1.5, 0, 1, 40.0)]
    # Out of us into {eu, as}: 150 + 60 Mbit for 1.5 s, then 40 + 60.
    before, after = 210 * MB, 100 * MB
    assert spec.cut_steps([1, 2]) == [(0.0, before), (1.5, after)]
    expected = 1.5 + (S - 1.5 * before) / after
    assert fluid_bound_s(spec, S) == pytest.approx(expected)
    assert fluid_bound_s(spec, 16 * 2**20) == pytest.approx(16 * 2**20 / before)  # done first


# -- the harness's pieces ------------------------------------------------------------------


def test_declared_links_tell_the_workers_every_capped_direction() -> None:
    spec = parse_topology("""
        [defaults]
        wan_mbit = 150
        wan_rtt_ms = 100
        [[dc]]
        name = "us"
        hosts = [400]
        [[dc]]
        name = "eu"
        hosts = [400]
        [[dc]]
        name = "ap"
        hosts = [400]
        [[link]]
        from = "us"
        to = "eu"
        mbit = 300
        rtt_ms = 80
        [[link]]
        from = "eu"
        to = "us"
        mbit = 60
        rtt_ms = 80
        [[link]]
        between = ["eu", "ap"]
        rtt_ms = 40
        [[change]]
        at_s = 1
        from = "us"
        to = "eu"
        mbit = 40
    """)
    declared = parse_links(tomllib.loads(declared_links(spec))["link"])
    assert set(declared) == {
        LinkSpec("dc0", "dc1", 300 * MB, 0.08), LinkSpec("dc1", "dc0", 60 * MB, 0.08),
        LinkSpec("dc0", "dc2", 150 * MB, 0.1), LinkSpec("dc2", "dc0", 150 * MB, 0.1),
    }  # eu-ap is uncapped: not declared; the change is not declared either


class _Stand:
    """What :func:`changing` uses of a cluster: its spec and set_link_rate."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.calls: list[tuple[int, int, float]] = []
        self.lock = threading.Lock()

    def set_link_rate(self, src: int, dst: int, mbit: float) -> None:
        with self.lock:
            self.calls.append((src, dst, mbit))


TWO_DCS = """
    [[dc]]
    name = "a"
    hosts = [400, 400]
    [[dc]]
    name = "b"
    hosts = [400]
    [[link]]
    between = ["a", "b"]
    mbit = 100
    rtt_ms = 50
"""


def test_changes_are_applied_in_time_order_and_undone_afterwards() -> None:
    spec = parse_topology(TWO_DCS + """
        [[change]]
        at_s = 0.02
        from = "b"
        to = "a"
        mbit = 60
        [[change]]
        at_s = 0
        from = "a"
        to = "b"
        mbit = 40
    """)
    stand = _Stand(spec)
    with changing(stand, spec.changes) as applied:  # type: ignore[arg-type]
        wait_until_sync(lambda: len(applied) == 2, what="both changes applied")
    assert [(c.src, c.dst, c.mbit) for c, _ in applied] == [(0, 1, 40.0), (1, 0, 60.0)]
    assert stand.calls == [(0, 1, 40.0), (1, 0, 60.0), (0, 1, 100.0), (1, 0, 100.0)]


def test_changes_not_reached_are_neither_applied_nor_undone() -> None:
    spec = parse_topology(TWO_DCS + "[[change]]\nat_s = 3600\nfrom = 'a'\nto = 'b'\nmbit = 40\n")
    stand = _Stand(spec)
    with changing(stand, spec.changes) as applied:  # type: ignore[arg-type]
        pass
    assert applied == [] and stand.calls == []


def test_the_suite_refuses_options_it_does_not_take(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    from tensorhub import cli

    assert cli.main(["bench", "cluster", "--topology-suite", str(ROOT / "topologies"),
                     "--hosts", "4", "--baselines", "star"]) == 2
    assert "drop --hosts, --baselines" in capsys.readouterr().err
    assert cli.main(["bench", "cluster", "--topology-suite", str(tmp_path)]) == 2
    assert "no *.toml files" in capsys.readouterr().err
    (tmp_path / "bad.toml").write_text("[[dc]]\nname = 'x'\nhosts = 2\n")
    assert cli.main(["bench", "cluster", "--topology-suite", str(tmp_path)]) == 2
    assert "bad.toml: [[dc]] #1 ('x'): hosts = 2 needs nic_mbit" in capsys.readouterr().err
    changed = ROOT / "topologies" / next(p.name for p in SUITE if "degrading" in p.name)
    assert cli.main(["bench", "cluster", "--topology", str(changed)]) == 2
    assert "only --topology-suite applies them" in capsys.readouterr().err


# -- one real run ---------------------------------------------------------------------------

TINY = """
# Three DCs: a -> b fast, b -> a slow; c best reached through b; a -> c slows down.
[[dc]]
name = "a"
hosts = [200, 200]
[[dc]]
name = "b"
hosts = [200]
[[dc]]
name = "c"
hosts = [200]
[[link]]
from = "a"
to = "b"
mbit = 100
rtt_ms = 20
[[link]]
from = "b"
to = "a"
mbit = 40
rtt_ms = 20
[[link]]
between = ["a", "c"]
mbit = 40
rtt_ms = 40
[[link]]
between = ["b", "c"]
mbit = 100
rtt_ms = 30
[[change]]
at_s = 0.3
from = "a"
to = "c"
mbit = 20
"""


@pytest.mark.netns
def test_the_suite_runs_a_tiny_three_dc_file(wan_support: None, tmp_path: Path) -> None:
    size = 16 * 2**20
    (tmp_path / "tiny.toml").write_text(TINY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "tensorhub.cli", "bench", "cluster",
                                "--topology-suite", str(tmp_path), "--size", "16MiB", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, cwd=ROOT)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    assert leftovers(f"thc{process.pid}-") == []
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    figures = {f["name"]: f for f in result["figures"]}
    assert set(figures) == FIGURES
    for f in figures.values():
        ok = f["value"] >= f["bound"] if f["better"] == "higher" else f["value"] <= f["bound"]
        assert f["ok"] == ok and f["value"] > 0, f
    assert figures["interdc_bytes_vs_min"]["bound"] == 1.1
    assert figures["fanout_vs_fluid_bound_learned_v2"]["bound"] == 1.3
    (one,) = result["measured"]["files"]
    assert one["error"] is None and result["measured"]["failed"] == []
    bound = fluid_bound_s(parse_topology(TINY), size)
    assert one["fluid_bound_s"] == pytest.approx(bound)
    for kind in ("declared_v1", "learned_v1", "learned_v2", "learned_v3"):
        shots = one[kind]
        (seconds,) = shots["seconds"]
        assert shots["vs_fluid_bound"] == pytest.approx(seconds / bound)
        assert seconds >= bound * 0.95  # nothing beats the fluid bound (the change lands late)
        (crossed,) = shots["wan_bytes"]
        (into,) = shots["into_dc_bytes"]
        assert into["b"] >= size and into["c"] >= size  # each remote DC got its copy
        assert crossed == sum(into.values())
        assert shots["interdc_bytes_vs_min"] == [pytest.approx(crossed / (2 * size))]
        (by_source,) = shots["bytes_by_source"]
        assert sorted(by_source) == ["h1", "h2", "h3"]
        assert all(sum(got.values()) == size for got in by_source.values())
        (sources,) = shots["source_dcs"]
        assert set(sources) == {"b", "c"}
        for change in shots["changes"][0]:  # applied if the fan-out lasted past 0.3 s
            assert (change["from"], change["to"], change["mbit"]) == ("a", "c", 20.0)
    worst = max(r for k in ("declared_v1", "learned_v1", "learned_v2", "learned_v3")
                for r in one[k]["interdc_bytes_vs_min"])
    assert figures["interdc_bytes_vs_min"]["value"] == pytest.approx(worst, abs=1e-3)
    assert figures["fanout_vs_fluid_bound_declared_v1"]["value"] == pytest.approx(
        statistics.median(one["declared_v1"]["seconds"]) / bound, abs=1e-3)
    assert result["settings"]["size_bytes"] == size


def test_the_report_takes_the_worst_file_and_leaves_out_a_failed_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The table, figures and JSON from made-up fan-outs (no cluster is built)."""
    from tensorhub import cli
    from tensorhub.bench import cluster_suite
    from tensorhub.bench.cluster import Fanout
    from tensorhub.testing.worker import WorkerError

    size = 2**20
    (tmp_path / "a.toml").write_text(TWO_DCS)
    (tmp_path / "b.toml").write_text(TWO_DCS.replace("rtt_ms = 50", "rtt_ms = 60"))
    (tmp_path / "c.toml").write_text(TWO_DCS)
    seconds = {"a": 2.0, "b": 3.0}

    def run_file(args: Any, path: Path, spec: ClusterSpec) -> cluster_suite.FileResult:
        if path.stem == "c":
            raise WorkerError("h1: gone")
        result = cluster_suite.FileResult(str(path), spec, fluid_bound_s(spec, size))
        for kind in cluster_suite.KINDS:
            crossed = size * (1.5 if (path.stem, kind) == ("b", "learned v3") else 1.0)
            fetch = {"start": 10.0, "end": 10.0 + seconds[path.stem],
                     "report": {"bytes_by_source": {"trainer": size}, "route": "dc0 -> dc1"}}
            local = {**fetch, "end": 11.0, "report": {"bytes_by_source": {"trainer": size}}}
            result.shots.append(cluster_suite.Shot(
                kind, Fanout({"h1": local, "h2": fetch}, {}, int(crossed)),
                {0: 0, 1: int(crossed)}))
        return result

    monkeypatch.setattr(cluster_suite, "run_file", run_file)
    assert cli.main(["bench", "cluster", "--topology-suite", str(tmp_path), "--size", "1MiB",
                     "--json"]) == 1
    out = capsys.readouterr().out
    bound = fluid_bound_s(parse_topology(TWO_DCS), size)  # 1 MiB over 100 Mbit
    assert bound == pytest.approx(size / (100 * MB))
    assert "c                            FAILED: h1: gone" in out
    assert "b<-a 100%\n" in out and "route b: dc0 -> dc1\n" in out
    result = json.loads(out.strip().splitlines()[-1])
    figures = {f["name"]: f["value"] for f in result["figures"]}
    assert figures == {
        "fanout_vs_fluid_bound_declared_v1": pytest.approx(3.0 / bound, abs=1e-4),
        "fanout_vs_fluid_bound_learned_v2": pytest.approx(3.0 / bound, abs=1e-4),
        "fanout_vs_fluid_bound_learned_v1": pytest.approx(3.0 / bound, abs=1e-4),
        "interdc_bytes_vs_min": 1.5,
    }
    assert result["measured"]["failed"] == [str(tmp_path / "c.toml")]
    files = result["measured"]["files"]
    assert [f["error"] for f in files] == [None, None, "h1: gone"]
    assert files[1]["learned_v3"]["interdc_bytes_vs_min"] == [1.5]
    assert files[0]["declared_v1"]["source_dcs"] == [{"b": {"a": 1.0}}]
    assert files[0]["learned_v2"]["routes"] == [{"b": ["dc0 -> dc1"]}]
