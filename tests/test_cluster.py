"""``tensorhub bench cluster`` pieces in a small emulated cluster (needs root; skips with the
reason otherwise): TensorHub peers in network namespaces fan one version out, bytes are
verified, sources and inter-DC bytes are read back, and nothing is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import leftovers

from tensorhub import cli
from tensorhub.bench.cluster import TRAINER, open_mesh
from tensorhub.testing.netns import open_cluster

MIB = 1 << 20
SIZE = 32 * MIB


@pytest.mark.netns
def test_rollouts_get_verified_bytes_also_from_each_other(cluster_support: None) -> None:
    with open_cluster(4, nic_mbit=400) as cluster, open_mesh(cluster) as mesh:
        fan = mesh.fanout(1, SIZE, checksum=True)
        pids = [w.process.pid for w in mesh.workers.values()]
    for name, fetched in fan.fetches.items():
        assert fetched["report"]["verified"], name
        assert fetched["report"]["bytes"] == SIZE, name
        assert fetched["checksum"] == fan.published["checksum"], name
    assert leftovers(cluster.prefix) == []
    assert not any(_alive(pid) for pid in pids)
    sources = fan.sources()
    print("bytes by source:", sources)
    assert any(n for by in sources.values() for src, n in by.items() if src != TRAINER), (
        f"every rollout read only from the trainer: {sources}")


@pytest.mark.netns
def test_two_dcs_move_about_one_copy_between_them(wan_support: None) -> None:
    with (
        open_cluster(4, nic_mbit=400, dcs=2, wan_mbit=100, wan_delay_ms=20) as cluster,
        open_mesh(cluster) as mesh,
    ):
        assert [h.dc for h in cluster.hosts] == [0, 0, 1, 1]
        fan = mesh.fanout(1, SIZE)
    assert all(f["report"]["verified"] for f in fan.fetches.values())
    assert fan.wan_bytes is not None
    print(f"inter-DC bytes: {fan.wan_bytes / SIZE:.3f} x size; sources: {fan.sources()}")
    assert fan.wan_bytes >= SIZE  # the remote DC got its copy across the link
    assert leftovers(cluster.prefix) == []
    # One copy crosses (plus TCP/IP headers, ~0.5% at MTU 9000); a star would send two.
    assert fan.wan_bytes <= 1.1 * SIZE


@pytest.mark.netns
def test_a_failure_prints_peer_logs_and_leaves_nothing(
        cluster_support: None, capfd: pytest.CaptureFixture[str]) -> None:
    with (
        pytest.raises(RuntimeError, match="boom"),
        open_cluster(2, nic_mbit=400) as cluster,
        open_mesh(cluster) as mesh,
    ):
        pids = [w.process.pid for w in mesh.workers.values()]
        raise RuntimeError("boom")
    err = capfd.readouterr().err
    assert "--- trainer on h0: last lines of" in err and "--- h1 on h1" in err
    assert leftovers(cluster.prefix) == []
    assert not any(_alive(pid) for pid in pids)


def test_refuses_clearly_without_root(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["bench", "cluster", "--hosts", "3", "--baselines", ""]) == 2
    assert "need root" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
