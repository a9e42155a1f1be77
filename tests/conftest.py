"""Fixtures shared by the test modules: peer processes and emulated clusters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import tensorhub.testing.conformance as transport_conformance
from tensorhub import shared_empty
from tensorhub.processes import LineProcess
from tensorhub.testing import netns
from tensorhub.testing.netns import ClusterUnavailable, open_cluster

# Peers spawned by tests run with the interpreter that runs the tests.
os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def procs() -> Iterator[list[LineProcess]]:
    """Worker processes a test starts; killed (and resumed first, if stopped) at the end."""
    started: list[LineProcess] = []
    yield started
    for p in started:
        if p.p.poll() is None:
            os.kill(p.p.pid, signal.SIGCONT)
            p.p.kill()
        p.p.wait(5)


@pytest.fixture
def shared_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The conformance suite's holders publish arrays in memory files
    (``tensorhub.shared_empty``), which a same-host reader maps: version leases."""
    monkeypatch.setattr(transport_conformance, "EMPTY", shared_empty)


@pytest.fixture
def busy_neighbour() -> Iterator[subprocess.Popen[bytes]]:
    """A process spinning on a core for the whole test, so the two-core host is loaded
    the way acceptance runs load it (group rounds must not abort because of it)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield spinner
    finally:
        spinner.kill()
        spinner.wait(5)


@pytest.fixture(scope="session")
def cluster_support() -> None:
    try:
        with open_cluster(1, 100):
            pass
    except ClusterUnavailable as error:
        pytest.skip(f"cannot build an emulated cluster here: {error}")


@pytest.fixture(scope="session")
def wan_support(cluster_support: None) -> None:
    try:
        netns.check_support(dcs=2)
    except ClusterUnavailable as error:
        pytest.skip(f"cannot build a multi-DC cluster here: {error}")


def leftovers(prefix: str) -> list[str]:
    """Namespaces and scratch dirs of the cluster with this prefix."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]
    return names + [p.name for p in Path(tempfile.gettempdir()).glob(f"{prefix}*")]
