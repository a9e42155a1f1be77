"""``tensorhub keygen`` and ``--keys`` as an operator runs them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from tensorhub.processes import free_ports

CLI = [sys.executable, "-m", "tensorhub.cli"]


def _peer(port: int, name: str, keys: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([*CLI, "peer", "--name", name, "--listen", f"127.0.0.1:{port}",
                          "--preset", "local", "--keys", str(keys)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    ready = json.loads(p.stdout.readline())
    assert ready["event"] == "ready" and ready["security"].startswith("keys:"), ready
    return p


def _status(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "status", "--preset", "local", "--join",
                           f"127.0.0.1:{port}", "--settle", "1", "--json", *extra],
                          capture_output=True, text=True, timeout=60)


def test_keygen_then_only_key_holders_see_the_mesh(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    out = subprocess.run([*CLI, "keygen", str(keys), "--peer", "alpha", "--peer", "ops",
                          "--publisher", "m=alpha"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert {Path(line).name for line in out.stdout.split()} == {
        "cluster.json", "alpha.key", "ops.key"}
    assert json.loads((keys / "cluster.json").read_text())["publishers"] == {"m": ["alpha"]}
    (port,) = free_ports(1)
    p = _peer(port, "alpha", keys)
    try:
        ok = _status(port, "--keys", str(keys), "--name", "ops")
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout.splitlines()[-1])["members"]["alpha"]["state"] == "alive"
        # without keys: the handshake fails, so alpha is never seen
        shut = _status(port)
        assert shut.returncode == 0, shut.stderr
        assert json.loads(shut.stdout.splitlines()[-1])["members"] == {}
        # a name without a key in DIR is a clear error, not a traceback
        bad = _status(port, "--keys", str(keys), "--name", "nobody")
        assert bad.returncode == 2 and "nobody" in bad.stderr and "Traceback" not in bad.stderr
        # SIGHUP re-reads the keyring (here: a new member added by keygen)
        subprocess.run([*CLI, "keygen", str(keys), "--peer", "late"], check=True, timeout=30)
        p.send_signal(signal.SIGHUP)
        assert p.stdout is not None
        assert json.loads(p.stdout.readline())["members"] == ["alpha", "late", "ops"]
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=5)
        p.stdout.close()  # type: ignore[union-attr]
        p.stderr.close()  # type: ignore[union-attr]


def test_insecure_wide_listen_is_refused_unless_asked_by_name() -> None:
    out = subprocess.run([*CLI, "peer", "--name", "x", "--listen", "0.0.0.0:0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "tensorhub keygen" in out.stderr
    assert "Traceback" not in out.stderr
