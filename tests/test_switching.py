"""``PeerConfig.switch_interval``: the interpreter's switch interval is shortened while
peers run, where the process has Python's default, and put back after."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from helpers import open_mesh

from tensorhub import PeerConfig
from tensorhub.errors import ConfigError
from tensorhub.peer.switching import PYTHON_DEFAULT, describe, switch_interval


@pytest.fixture(autouse=True)
def python_default() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(PYTHON_DEFAULT)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


async def test_peers_shorten_the_default_interval_while_they_run() -> None:
    async with open_mesh(2) as peers:
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        for p in peers:
            note = p.statistics().switch_interval
            assert note.startswith("0.5 ms") and "PeerConfig.switch_interval" in note
    assert sys.getswitchinterval() == pytest.approx(PYTHON_DEFAULT)


def test_the_default_comes_back_when_the_last_user_ends() -> None:
    with switch_interval(0.001):
        with switch_interval(0.0002):  # the first one's interval stays
            assert sys.getswitchinterval() == pytest.approx(0.001)
        assert sys.getswitchinterval() == pytest.approx(0.001)
    assert sys.getswitchinterval() == pytest.approx(PYTHON_DEFAULT)


def test_an_interval_the_process_chose_is_left_alone() -> None:
    sys.setswitchinterval(0.002)
    with switch_interval(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.002)
        assert describe(0.0005) == "2 ms: set by this process, left as it is"
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_longer_interval_than_pythons_is_never_set() -> None:
    with switch_interval(0.01):
        assert sys.getswitchinterval() == pytest.approx(PYTHON_DEFAULT)
        assert describe(0.01) == "5 ms: Python's default, left as it is"
    assert sys.getswitchinterval() == pytest.approx(PYTHON_DEFAULT)


def test_a_change_made_while_peers_run_is_not_undone() -> None:
    with switch_interval(0.0005):
        assert describe(0.0005).startswith("0.5 ms: set by PeerConfig")
        sys.setswitchinterval(0.003)
        assert describe(0.0005) == "3 ms: set by this process, left as it is"
    assert sys.getswitchinterval() == pytest.approx(0.003)


def test_none_leaves_the_interval_alone() -> None:
    with switch_interval(None):
        assert sys.getswitchinterval() == pytest.approx(PYTHON_DEFAULT)
        note = describe(None)
        assert "left as it is" in note and "None" in note
    assert sys.getswitchinterval() == pytest.approx(PYTHON_DEFAULT)


@pytest.mark.parametrize("bad", [0.0, -1.0, 1.0, 1e-7])
def test_out_of_range_intervals_are_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="switch_interval"):
        PeerConfig("p", switch_interval=bad)
