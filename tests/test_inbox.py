"""FairInbox against a naive reference: per-sender FIFO, round-robin service, bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.peer.inbox import FairInbox

SENDERS = [b"flood", b"a", b"b", b"c"]
OPS = st.lists(st.one_of(st.sampled_from(SENDERS), st.none()), max_size=400)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(1, 16), st.integers(1, 64))
def test_bounded_fifo_per_sender_and_round_robin(ops: list[bytes | None], per: int,
                                                 extra: int) -> None:
    box = FairInbox(per + extra, per)
    queued: dict[bytes, list[int]] = {s: [] for s in SENDERS}
    turns_since: dict[bytes, int] = {}  # pops of others since a sender's last pop
    n = 0
    for op in ops:
        if op is not None:  # a frame arrives
            n += 1
            before = {s: list(q) for s, q in queued.items()}
            if box.put(op, n.to_bytes(4, "big")):
                queued[op].append(n)
            # a push-out removes the oldest frame of the longest queue
            for s in SENDERS:
                if s != op and len(queued[s]) and box_missing(box, s, queued[s]):
                    queued[s].pop(0)
            assert all(len(q) <= len(before[s]) + (s == op) for s, q in queued.items())
        else:
            item = box.pop()
            waiting = [s for s in SENDERS if queued[s]]
            if item is None:
                assert not waiting
                continue
            sender, frame = item
            assert int.from_bytes(frame, "big") == queued[sender].pop(0)  # FIFO per sender
            # round robin: no sender with frames waits more than one pop of each other
            for s in waiting:
                turns_since[s] = turns_since.get(s, 0) + 1
            turns_since[sender] = 0
            assert all(turns_since.get(s, 0) <= len(SENDERS) for s in waiting)
        assert len(box) == sum(map(len, queued.values())) <= box.capacity
        assert all(len(q) <= per for q in queued.values())


def box_missing(box: FairInbox, sender: bytes, frames: list[int]) -> bool:
    """Whether the oldest frame the reference holds for ``sender`` left the box."""
    queue = box._queues.get(sender)
    return queue is None or int.from_bytes(queue[0], "big") != frames[0]


def test_a_flooder_delays_a_quiet_sender_by_one_frame_at_most() -> None:
    box = FairInbox(1024, 128)
    for i in range(10_000):
        box.put(b"flood", i.to_bytes(4, "big"))
    assert len(box) == 128 and box.dropped == 10_000 - 128
    box.put(b"good", b"hello")
    assert [box.pop()[0] for _ in range(2)].count(b"good") == 1  # type: ignore[index]


def test_many_flooders_cannot_lock_out_a_new_sender() -> None:
    box = FairInbox(64, 16)
    for f in range(8):
        for i in range(100):
            box.put(b"flood%d" % f, bytes([i]))
    assert len(box) == 64
    assert box.put(b"good", b"hello")  # pushes out a flooder's oldest frame
    assert len(box) == 64
    popped = [box.pop() for _ in range(9)]
    assert (b"good", b"hello") in popped


def test_a_sender_beyond_its_rate_is_dropped_before_it_costs_more() -> None:
    box = FairInbox(1024, 16, rate=100.0)
    admitted = 0
    for i in range(10_000):  # 1 s at 10,000 frames a second, each served at once
        admitted += box.put(b"flood", b"x", now=i / 10_000)
        box.pop()
    assert 100 <= admitted <= 16 + 100 + 1  # the burst, then 100 a second
    assert box.over_rate == box.dropped == 10_000 - admitted
    assert box.put(b"quiet", b"hello", now=1.0)  # another sender has its own bucket
    assert box.put(b"flood", b"x", now=2.0)  # and the flooder's refills with time
