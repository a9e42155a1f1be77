"""The ``tensorhub`` command as a user runs it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorhub.processes import free_ports

CLI = [sys.executable, "-m", "tensorhub.cli"]


def test_demo_json_reports_every_version_verified() -> None:
    keydirs = set(Path(tempfile.gettempdir()).glob("tensorhub-demo-keys-*"))
    out = subprocess.run([*CLI, "demo", "--json", "--size", "24MiB", "--rollouts", "3",
                          "--versions", "2"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["all_verified"] is True
    assert summary["security"] == "keys"  # the default demo is a closed mesh
    assert set(Path(tempfile.gettempdir()).glob("tensorhub-demo-keys-*")) == keydirs  # removed
    assert [v["version"] for v in summary["versions"]] == [1, 2]
    for v in summary["versions"]:
        assert len(v["rollouts"]) == 3
        for r in v["rollouts"]:
            assert r["verified"] is True
            assert sum(r["bytes_by_source"].values()) == r["bytes"] > 0


def test_demo_insecure_says_so() -> None:
    out = subprocess.run([*CLI, "demo", "--json", "--insecure", "--size", "8MiB",
                          "--rollouts", "1", "--versions", "1"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["all_verified"] is True and summary["security"] == "insecure"
    assert "insecure: no keys" in out.stderr  # each peer warns in its log


def _start_peer(port: int, name: str = "solo") -> subprocess.Popen[str]:
    p = subprocess.Popen([*CLI, "peer", "--name", name, "--listen", f"127.0.0.1:{port}",
                          "--preset", "local"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert json.loads(line)["event"] == "ready", line
    return p


def test_peer_exits_zero_soon_after_sigterm() -> None:
    (port,) = free_ports(1)
    p = _start_peer(port)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=5) == 0
    assert time.monotonic() - t0 < 2.0
    p.stdout.close()  # type: ignore[union-attr]
    p.stderr.close()  # type: ignore[union-attr]


def test_second_peer_on_a_used_port_exits_2_with_one_line() -> None:
    (port,) = free_ports(1)
    first = _start_peer(port, "first")
    try:
        out = subprocess.run([*CLI, "peer", "--name", "second", "--listen",
                              f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "already in use" in lines[0], out.stderr
        assert "Traceback" not in out.stderr
    finally:
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=5) == 0
        first.stdout.close()  # type: ignore[union-attr]
        first.stderr.close()  # type: ignore[union-attr]


def test_bad_options_exit_2_without_traceback() -> None:
    out = subprocess.run([*CLI, "peer", "--name", "x", "--listen", "nonsense"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "HOST:PORT" in out.stderr


def test_status_lists_members_and_versions() -> None:
    ports = free_ports(1)
    p = _start_peer(ports[0], "alpha")
    try:
        out = subprocess.run([*CLI, "status", "--preset", "local", "--join",
                              f"127.0.0.1:{ports[0]}", "--settle", "1", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["members"]["alpha"]["state"] == "alive"
        assert report["versions"] == {}
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=5)
        p.stdout.close()  # type: ignore[union-attr]
        p.stderr.close()  # type: ignore[union-attr]


def test_links_file_declares_the_wan_and_status_shows_it(tmp_path: Path) -> None:
    links = tmp_path / "links.toml"
    links.write_text('[[link]]\nbetween = ["east", "west"]\nmbit = 300\nrtt_ms = 150\n')
    ports = free_ports(1)
    p = _start_peer(ports[0], "alpha")
    try:
        out = subprocess.run([*CLI, "status", "--preset", "local", "--join",
                              f"127.0.0.1:{ports[0]}", "--settle", "0.5", "--json",
                              "--links", str(links)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert {"from": "east", "to": "west", "mbit": 300.0, "rtt_ms": 150.0,
                "how": "declared", "reporters": 0} in report["wan"]
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=5)
        p.stdout.close()  # type: ignore[union-attr]
        p.stderr.close()  # type: ignore[union-attr]
    bad = subprocess.run([*CLI, "peer", "--name", "x", "--links", str(tmp_path / "no.toml")],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "links file" in bad.stderr


def test_port_helper_gives_bindable_ports() -> None:
    (port,) = free_ports(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_bench_flip_json_reports_each_flip_and_its_release() -> None:
    out = subprocess.run([*CLI, "bench", "flip", "--json", "--size", "8MiB", "--flips", "2",
                          "--readers", "2"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert [f["name"] for f in summary["figures"]] == [
        "flip_switch_s", "flip_commit_call_s", "flip_drain_s"]
    rounds = summary["measured"]["rounds"]
    assert [r["version"] for r in rounds] == [2, 3]
    for r in rounds:  # commit returned before the release ran; the release then ended
        assert r["release_done"] is False and r["drain_seconds"] > 0
    assert rounds[1]["staged_into_released"] is True  # double buffering
    assert all(reads.get("3", 0) > 0 for reads in summary["measured"]["reads_by_reader"])
