"""The simulators' event queue (simulations/events.py): callbacks come out in (time,
insertion) order whatever was cancelled, and cancelled entries never outnumber the
live ones by much (the heap is rebuilt without them)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from simulations.events import COMPACT_AT, EventQueue


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 20), st.booleans()), max_size=3000))
def test_pops_in_time_then_insertion_order_skipping_cancelled(
        ops: list[tuple[int, bool]]) -> None:
    queue = EventQueue()
    fired: list[int] = []
    want: list[tuple[float, int]] = []
    entries = []
    for i, (when, cancel) in enumerate(ops):
        entries.append(queue.at(float(when), lambda t, i=i: fired.append(i)))
        want.append((float(when), i))
        if cancel:  # take back an earlier entry, picked by this one's time
            j = (when * 7919) % len(entries)
            if entries[j][2] is not None:
                queue.cancel(entries[j])
                want.remove((entries[j][0], j))
        assert queue.held <= max(2 * len(queue), COMPACT_AT + 1)
    assert len(queue) == len(want)
    while (nxt := queue.pop()) is not None:
        nxt[1](nxt[0])
    assert fired == [i for _, i in sorted(want)]


def test_cancelling_what_fired_or_was_cancelled_changes_nothing() -> None:
    queue = EventQueue()
    a, b = queue.at(1.0, lambda t: None), queue.at(2.0, lambda t: None)
    assert queue.pop() is not None
    queue.cancel(a)
    queue.cancel(b)
    queue.cancel(b)
    assert len(queue) == 0 and queue.pop() is None


def test_many_cancellations_compact_the_heap() -> None:
    queue = EventQueue()
    keep = [queue.at(float(i), lambda t: None) for i in range(10)]
    for i in range(100 * COMPACT_AT):
        queue.cancel(queue.at(1e6 + i, lambda t: None))
    assert queue.compactions > 0 and queue.held <= COMPACT_AT + len(keep)
    assert [queue.pop() is not None for _ in keep] == [True] * len(keep)
    assert queue.pop() is None
