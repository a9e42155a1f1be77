"""Stall limits from a source's measured pace (tensorhub/protocol/pace.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorhub.errors import LocalProtocolError
from tensorhub.protocol.pace import MAX_STRIKES, STALL_FLOOR, Pace

MIB = 1 << 20


def test_an_unmeasured_source_gets_the_whole_stall_timeout() -> None:
    pace = Pace(ceiling=10.0)
    assert pace.limit("a", 4 * MIB) == 10.0
    assert pace.rate("a") is None


def test_a_fast_source_gets_the_floor_not_a_fraction_of_a_second() -> None:
    pace = Pace(ceiling=10.0)
    for _ in range(20):
        pace.completed("a", 4 * MIB, 0.004)  # 1 GB/s
    assert pace.limit("a", 4 * MIB) == STALL_FLOOR
    rate = pace.rate("a")
    assert rate is not None and 0.9e9 < rate < 1.2e9


def test_a_slow_source_gets_a_limit_that_fits_its_pace() -> None:
    pace = Pace(ceiling=60.0)
    for _ in range(20):
        pace.completed("slow", 4 * MIB, 2.0)
    limit = pace.limit("slow", 4 * MIB)
    assert 2.0 * 3 < limit < 60.0  # several expected read times, below the ceiling
    assert pace.limit("slow", 8 * MIB) > limit  # bigger reads get longer


def test_jitter_widens_the_limit() -> None:
    steady, jumpy = Pace(ceiling=1000.0, floor=0.0), Pace(ceiling=1000.0, floor=0.0)
    for k in range(40):
        steady.completed("s", MIB, 0.1)
        jumpy.completed("s", MIB, 0.02 if k % 2 else 0.18)  # same mean
    assert jumpy.limit("s", MIB) > steady.limit("s", MIB)


def test_each_stall_doubles_the_limit_and_reads_take_strikes_back() -> None:
    pace = Pace(ceiling=100.0, floor=0.5)
    pace.completed("a", MIB, 0.001)
    assert pace.limit("a", MIB) == 0.5
    pace.stalled("a")
    assert pace.limit("a", MIB) == 1.0
    pace.stalled("a")
    assert pace.limit("a", MIB) == 2.0 and pace.strikes("a") == 2
    pace.completed("a", MIB, 0.001)
    assert pace.strikes("a") == 1 and pace.limit("a", MIB) == 1.0
    assert pace.limit("other", MIB) == 100.0  # strikes are per source


def test_strikes_are_capped_and_the_ceiling_holds() -> None:
    pace = Pace(ceiling=3.0)
    pace.completed("a", MIB, 0.001)
    for _ in range(100):
        pace.stalled("a")
    assert pace.strikes("a") == MAX_STRIKES and pace.limit("a", MIB) == 3.0


def test_the_floor_never_exceeds_the_ceiling_and_a_bad_ceiling_is_refused() -> None:
    assert Pace(ceiling=0.5).limit("a", MIB) == 0.5
    p = Pace(ceiling=0.5)
    p.completed("a", MIB, 0.0)
    assert p.limit("a", MIB) == 0.5
    with pytest.raises(LocalProtocolError):
        Pace(ceiling=0.0)


@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.floats(0, 1e4),
                          st.booleans()), max_size=60),
       st.floats(0.01, 1e3), st.integers(0, 1 << 30))
def test_the_limit_stays_between_floor_and_ceiling(events: list[tuple[int, float, bool]],
                                                  ceiling: float, nbytes: int) -> None:
    pace = Pace(ceiling=ceiling)
    for size, seconds, stalled in events:
        if stalled:
            pace.stalled("a")
        else:
            pace.completed("a", size, seconds)
        assert min(STALL_FLOOR, ceiling) <= pace.limit("a", nbytes) <= ceiling
