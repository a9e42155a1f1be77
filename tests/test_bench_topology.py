"""The emulated-cluster commands end to end, through the CLI in a subprocess, at tiny sizes:
``bench cluster --topology`` (3 hosts, 2 DCs, mixed NICs), its ``--grid``, ``bench rtt``
and ``bench chain``. Each JSON line is checked for its figures and for agreeing with its
own raw numbers; bounds and wall-clock times are not asserted. Needs root (skips with the
reason otherwise); every run must leave no namespace behind."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import leftovers

from tensorhub.testing.clusterspec import fluid_bound_s, load_topology

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
TOPOLOGY = """
[[dc]]
name = "near"
hosts = [400, 100]

[[dc]]
name = "far"
hosts = [200]

[[link]]
between = ["near", "far"]
mbit = 200
rtt_ms = 10
"""


def _bench(*argv: str) -> dict[str, Any]:
    """Run ``tensorhub bench ARGV --json``; its last line, once nothing is left behind."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "tensorhub.cli", "bench", *argv,
                                "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=ROOT)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    assert leftovers(f"thc{process.pid}-") == []
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    for f in result["figures"]:
        ok = f["value"] >= f["bound"] if f["better"] == "higher" else f["value"] <= f["bound"]
        assert f["ok"] == ok, f
    return result


def _figures(result: dict[str, Any]) -> dict[str, float]:
    return {f["name"]: f["value"] for f in result["figures"]}


@pytest.fixture
def topology(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TOPOLOGY)
    return path


@pytest.mark.netns
def test_cluster_runs_a_topology_file(wan_support: None, topology: Path) -> None:
    size = 8 * MIB
    result = _bench("cluster", "--topology", str(topology), "--size", "8MiB",
                    "--baselines", "")
    figures = _figures(result)
    assert {"fanout_vs_fluid_bound", "interdc_bytes_vs_size", "fanout_vs_star",
            "joiner_speedup_vs_trainer"} <= set(figures)
    settings, measured = result["settings"], result["measured"]
    assert settings["topology"]["dcs"] == [{"name": "near", "hosts_mbit": [400, 100]},
                                           {"name": "far", "hosts_mbit": [200]}]
    assert settings["hosts"] == 3 and settings["dcs"] == 2 and settings["nic_mbit"] is None
    bound = fluid_bound_s(load_topology(topology), size)
    assert bound == pytest.approx(size / (100e6 / 8))  # the 100 Mbit host downloads a copy
    assert result["baselines"]["fluid_bound_s"] == pytest.approx(bound)
    assert figures["fanout_vs_fluid_bound"] == pytest.approx(
        statistics.median(measured["tensorhub_s"]) / bound, abs=1e-3)
    assert measured["remote_rollouts"] == ["h2"]
    crossed = statistics.median(measured["tensorhub_wan_bytes"])
    assert crossed >= size  # the far DC got its copy across the link
    assert figures["interdc_bytes_vs_size"] == pytest.approx(crossed / size, abs=1e-3)


@pytest.mark.netns
def test_cluster_grid_reports_the_worst_setting(wan_support: None, topology: Path) -> None:
    result = _bench("cluster", "--topology", str(topology), "--size", "4MiB",
                    "--grid", "wan-mbit=100,200", "wan-rtt-ms=5")
    rows = result["measured"]["grid"]
    assert [r["setting"] for r in rows] == [{"wan-mbit": 100, "wan-rtt-ms": 5},
                                            {"wan-mbit": 200, "wan-rtt-ms": 5}]
    figures = _figures(result)
    assert figures["fanout_vs_fluid_bound_worst"] == pytest.approx(
        max(r["fanout_vs_fluid_bound"] for r in rows))
    assert figures["interdc_bytes_vs_size_worst"] == pytest.approx(
        max(r["interdc_bytes_vs_size"] for r in rows))
    # 100 Mbit is below the slowest NIC: the link is the cut at 100 and not above it.
    assert rows[0]["fluid_bound_s"] == pytest.approx(4 * MIB / (100e6 / 8))
    assert result["figures"][0]["bound"] == 1.25


@pytest.mark.netns
def test_rtt_compares_a_fetch_with_a_stream_per_round_trip(wan_support: None) -> None:
    result = _bench("rtt", "--rtts", "1,20", "--size", "4MiB", "--runs", "1",
                    "--mbit", "100")
    rows = result["measured"]["per_rtt"]
    assert [r["rtt_ms"] for r in rows] == [1, 20]
    for row in rows:
        assert len(row["stream_s"]) == len(row["fetch_s"]) == 1
        assert row["stream_over_fetch"] == pytest.approx(row["stream_s"][0] / row["fetch_s"][0])
        (report,) = row["fetch_reports"]
        assert report["verified"] and report["bytes"] == 4 * MIB
        assert report["bytes_by_source"] == {"trainer": 4 * MIB}
    assert _figures(result)["fetch_vs_tcp_stream_worst"] == pytest.approx(
        min(r["stream_over_fetch"] for r in rows), abs=1e-4)
    assert result["baselines"]["tcp_stream_s"] == {"1": rows[0]["stream_s"],
                                                   "20": rows[1]["stream_s"]}


@pytest.mark.netns
def test_chain_relays_through_every_hop(cluster_support: None) -> None:
    result = _bench("chain", "--depth", "2", "--size", "8MiB", "--runs", "1", "--mbit", "100")
    figures = _figures(result)
    measured = result["measured"]
    (single,) = result["baselines"]["single_hop_s"]
    (chain,) = measured["chain_s"]
    assert figures["chain2_time_vs_single"] == pytest.approx(chain / single, abs=1e-4)
    assert measured["chain_bytes_by_source"] == [{"h1": {"trainer": 8 * MIB},
                                                  "h2": {"h1": 8 * MIB}}]
    done = measured["chain_done_s"][0]
    assert max(done.values()) == pytest.approx(chain)
    chunks = result["baselines"]["chunks"]  # 2 at 4 MiB chunks
    assert chunks >= 1
    assert result["baselines"]["floor_ratio"] == pytest.approx(1 + 1 / chunks)


def test_cluster_refuses_a_bad_topology_and_mixed_flags(topology: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from tensorhub import cli

    bad = tmp_path / "bad.toml"
    bad.write_text("[[dc]]\nname = 'x'\nhosts = 2\n")
    assert cli.main(["bench", "cluster", "--topology", str(bad)]) == 2
    assert "bad.toml: [[dc]] #1 ('x'): hosts = 2 needs nic_mbit" in capsys.readouterr().err
    assert cli.main(["bench", "cluster", "--topology", str(topology), "--hosts", "4"]) == 2
    assert "drop --hosts" in capsys.readouterr().err
    assert cli.main(["bench", "cluster", "--grid", "wan-mbit=100"]) == 2
    assert "needs more than one DC" in capsys.readouterr().err
    assert cli.main(["bench", "cluster", "--dcs", "2", "--grid", "colour=1"]) == 2
    assert "KEY one of wan-mbit" in capsys.readouterr().err
