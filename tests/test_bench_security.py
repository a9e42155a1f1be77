"""The cost of security in the benchmarks: ``--keys both`` measures a keyless and a keyed
mesh in the same run and prints ``security_cost_*`` next to both medians."""

from __future__ import annotations

import json
import tempfile

import pytest
from conftest import leftovers

from tensorhub import PeerConfig, cli
from tensorhub.bench import transfer
from tensorhub.bench.cluster import KEYED_PORT, mesh_keys, open_mesh
from tensorhub.testing.netns import open_cluster

MIB = 1 << 20


def _last_json(out: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return doc


def _figure(doc: dict[str, object], name: str) -> dict[str, object]:
    figures = doc["figures"]
    assert isinstance(figures, list)
    found = [f for f in figures if f["name"] == name]
    assert len(found) == 1, figures
    return dict(found[0])


def test_transfer_keys_both_measures_both_meshes_in_one_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert transfer.main(["--size", "8MiB", "--runs", "2", "--keys", "both", "--json"]) == 0
    out = capsys.readouterr().out
    assert "integrity on, keyless" in out and "integrity on, keyed" in out
    doc = _last_json(out)
    cost = _figure(doc, "security_cost_transfer")
    assert (cost["bound"], cost["better"], cost["unit"]) == (1.10, "lower", "ratio")
    measured, baselines = doc["measured"], doc["baselines"]
    assert isinstance(measured, dict) and isinstance(baselines, dict)
    assert len(measured["tcp_s"]) == len(measured["keyed_tcp_s"]) == 2
    assert len(measured["keyed_over_keyless_by_round"]) == 2
    assert len(baselines["raw_socket_s"]) == 4  # one before each fetch, both meshes
    ratio = baselines["keyed_tcp_median_s"] / baselines["keyless_tcp_median_s"]
    assert cost["value"] == pytest.approx(ratio, abs=1e-3)
    fetchers = measured["fetchers"]
    assert fetchers["off"]["security"].startswith("insecure"), fetchers
    assert fetchers["on"]["security"].startswith("keys"), fetchers
    assert fetchers["off"]["digest"] == fetchers["on"]["digest"], fetchers
    settings = doc["settings"]
    assert isinstance(settings, dict)
    assert settings["membership_timers"].startswith("default"), settings
    assert {k: v for k, v in settings.items() if k != "membership_timers"} == {
        "size": 8 * MIB, "chunk": "auto", "runs": 2, "only": "tcp", "keys": "both",
        "switch_interval": "default"}


@pytest.mark.netns
def test_a_keyed_mesh_beside_a_keyless_one_in_the_same_namespaces(
        cluster_support: None) -> None:
    with (open_cluster(3, nic_mbit=400) as cluster,
          tempfile.TemporaryDirectory() as key_dir):
        keys = mesh_keys(cluster, key_dir)
        with (open_mesh(cluster) as keyless,
              open_mesh(cluster, port=KEYED_PORT, keys=keys) as keyed):
            fans = [keyless.fanout(1, 8 * MIB, checksum=True),
                    keyed.fanout(1, 8 * MIB, checksum=True)]
            stats = [{w.name: w.call("stats", cmd="stats") for w in m.workers.values()}
                     for m in (keyless, keyed)]
    for fan in fans:
        for name, fetched in fan.fetches.items():
            assert fetched["report"]["verified"], name
            assert fetched["checksum"] == fan.published["checksum"], name
    assert all(st["security"].startswith("insecure") for st in stats[0].values()), stats
    assert all(st["security"].startswith("keys") for st in stats[1].values()), stats
    assert all(st["digest"].startswith("blake3") for m in stats for st in m.values()), stats
    assert leftovers(cluster.prefix) == []


@pytest.mark.netns
def test_cluster_keys_both_prints_the_cost(cluster_support: None,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "cluster", "--hosts", "3", "--size", "8MiB", "--baselines", "",
                     "--keys", "both", "--runs", "2", "--json"]) == 0
    doc = _last_json(capsys.readouterr().out)
    cost = _figure(doc, "security_cost_cluster")
    assert (cost["bound"], cost["better"]) == (1.10, "lower")
    measured, baselines = doc["measured"], doc["baselines"]
    assert isinstance(measured, dict) and isinstance(baselines, dict)
    assert len(measured["keyed_tensorhub_s"]) == len(measured["tensorhub_s"]) == 2
    ratio = baselines["keyed_fanout_median_s"] / baselines["keyless_fanout_median_s"]
    assert cost["value"] == pytest.approx(ratio, abs=1e-3)


def test_transfer_bench_workers_run_the_default_membership_timers() -> None:
    """The workers beside a measured fetch gossip and probe at the deployed rate, not
    the local preset's ten times faster one (which other benches keep: they kill peers)."""
    with transfer._mesh(["pub", "f_tcp"], 0, None) as procs:
        for proc in procs.values():
            stats = proc.call("stats", cmd="stats")
            assert (stats["gossip_interval"], stats["probe_interval"]) == (
                PeerConfig("x").gossip_interval, PeerConfig("x").probe_interval)
            assert stats["gossip_interval"] != PeerConfig.local("x").gossip_interval
            assert stats["stall_timeout"] == PeerConfig.local("x").stall_timeout  # the rest
