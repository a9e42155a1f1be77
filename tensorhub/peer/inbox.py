"""A fair inbound queue: one bounded queue per sender, served round-robin.

Theory of operation
-------------------
Control frames wait here between the socket's owner task and the dispatcher.  One FIFO
queue would let a single flooding sender fill it, so the frames of everyone else would
wait behind the flood or be dropped.  Here each sender (ZeroMQ routing id) has its own
queue of at most ``per_sender`` frames, and :meth:`FairInbox.pop` takes one frame from
each sender with frames waiting in turn: a flood delays another sender's next frame by
at most one frame of each flooder, however fast it sends.

All queues together hold at most ``capacity`` frames.  When that is reached, a frame
from a sender holding less than its fair share (``capacity`` over the senders waiting)
pushes out the oldest frame of the longest queue; any other frame is dropped.  So many
flooders together cannot lock out a sender that is quiet, and a sender that stops
sending gives its room back as soon as its queue is served.

Fair turns bound the *delay* a flood causes others, not the CPU it costs: every frame
admitted is decoded and handled.  So each sender also has a token bucket: ``rate``
frames a second, bursts of up to ``per_sender``; a frame beyond it is dropped before it
costs more than its read.  Buckets are kept for the ``MAX_TRACKED`` most recent senders
(a forgotten one starts full again).  Every drop is counted.  Time is passed in.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")

MAX_TRACKED = 4096


class FairInbox(Generic[T]):
    """Frames (any ``T``) by sender, served round-robin; see the module docstring."""

    def __init__(self, capacity: int, per_sender: int, rate: float = float("inf")) -> None:
        if not 1 <= per_sender <= capacity or not rate > 0:
            raise ValueError("need 1 <= per_sender <= capacity and rate > 0")
        self.capacity = capacity
        self.per_sender = per_sender
        self.rate = rate
        self._queues: OrderedDict[bytes, deque[T]] = OrderedDict()
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        """Per sender: (tokens, when last filled), least recently heard first."""
        self._total = 0
        self.dropped = 0
        self.over_rate = 0
        """Of ``dropped``: frames beyond their sender's rate."""

    def __len__(self) -> int:
        return self._total

    @property
    def senders(self) -> int:
        """Senders with frames waiting."""
        return len(self._queues)

    def put(self, sender: bytes, frame: T, now: float = 0.0) -> bool:
        """Queue ``frame`` from ``sender``, arrived at ``now`` (perhaps pushing out
        another sender's oldest frame); False if ``frame`` was dropped instead."""
        if not self._take_token(sender, now):
            self.dropped += 1
            self.over_rate += 1
            return False
        queue = self._queues.get(sender)
        held = 0 if queue is None else len(queue)
        if held >= self.per_sender or (self._total >= self.capacity and (
                held * (len(self._queues) + 1) >= self.capacity or not self._push_out())):
            self.dropped += 1
            return False
        if queue is None:
            queue = self._queues[sender] = deque()
        queue.append(frame)
        self._total += 1
        return True

    def pop(self) -> tuple[bytes, T] | None:
        """The next frame in round-robin order of senders, or None if all are empty."""
        if not self._queues:
            return None
        sender, queue = next(iter(self._queues.items()))
        frame = queue.popleft()
        self._total -= 1
        if queue:
            self._queues.move_to_end(sender)
        else:
            del self._queues[sender]
        return sender, frame

    def _take_token(self, sender: bytes, now: float) -> bool:
        if self.rate == float("inf"):
            return True
        tokens, last = self._buckets.pop(sender, (float(self.per_sender), now))
        tokens = min(float(self.per_sender), tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        self._buckets[sender] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > MAX_TRACKED:
            self._buckets.popitem(last=False)
        return ok

    def _push_out(self) -> bool:
        longest = max(self._queues.values(), key=len)
        if len(longest) < 2:
            return False  # every sender holds one frame: nobody has more than its share
        longest.popleft()
        self._total -= 1
        self.dropped += 1
        return True
