"""SWIM probe bookkeeping: whom to probe next, what the current probe waits for, and
the indirect probes this peer relays for others.

Theory of operation
-------------------
Targets come from a shuffled round-robin list of the live members; a newcomer is
inserted at a random place in the rest of the current cycle, so each member is probed
once per cycle and the order is unpredictable.  A probe waits for a direct ack until
``ack_deadline``, then for an ack through helpers (or their nacks) until ``end``.  A
relayed probe is remembered under a fresh sequence number until its ack arrives (and is
forwarded) or its nack deadline passes; all relays share one timeout, so their
deadlines are a FIFO.
"""

from __future__ import annotations

import random
from collections import deque

from .view import View


class Probe:
    __slots__ = ("ack_deadline", "end", "indirect", "nacks", "nacks_expected", "seq", "target")

    def __init__(self, target: str, seq: int, ack_deadline: float, end: float) -> None:
        self.target = target
        self.seq = seq
        self.ack_deadline = ack_deadline
        self.end = end
        self.indirect = False  # helpers have been asked
        self.nacks_expected = 0
        self.nacks = 0

    def deadline(self) -> float:
        return self.end if self.indirect else self.ack_deadline


class Prober:
    __slots__ = ("_index", "_order", "_relay_due", "_rng", "current", "relays", "seq")

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._order: list[str] = []
        self._index = 0
        self.current: Probe | None = None
        self.seq = 0
        self.relays: dict[int, tuple[str, int]] = {}  # our seq -> (requester, its seq)
        self._relay_due: deque[tuple[float, int]] = deque()

    def insert(self, name: str) -> None:
        """A member became live: probe it within the current cycle."""
        rest = len(self._order) - self._index
        self._order.insert(self._index + int(self._rng.random() * (rest + 1)), name)

    def next_target(self, view: View) -> str | None:
        for _ in range(2):
            while self._index < len(self._order):
                name = self._order[self._index]
                self._index += 1
                if view.is_live(name):
                    return name
            self._order[:] = view.live
            self._rng.shuffle(self._order)
            self._index = 0
        return None

    def begin(self, target: str, ack_deadline: float, end: float) -> Probe:
        self.seq += 1
        self.current = Probe(target, self.seq, ack_deadline, end)
        return self.current

    def acked(self, seq: int) -> bool:
        """True when ``seq`` answers the current probe, which is then over."""
        if self.current is not None and self.current.seq == seq:
            self.current = None
            return True
        return False

    def nacked(self, seq: int) -> None:
        if self.current is not None and self.current.seq == seq:
            self.current.nacks += 1

    def relay(self, requester: str, their_seq: int, nack_at: float) -> int:
        self.seq += 1
        self.relays[self.seq] = (requester, their_seq)
        self._relay_due.append((nack_at, self.seq))
        return self.seq

    def relay_deadline(self) -> float:
        return self._relay_due[0][0] if self._relay_due else float("inf")

    def overdue_relays(self, now: float) -> list[tuple[str, int]]:
        """Relays whose target never answered: (requester, its seq) to nack."""
        out = []
        while self._relay_due and self._relay_due[0][0] <= now:
            relay = self.relays.pop(self._relay_due.popleft()[1], None)
            if relay is not None:
                out.append(relay)
        return out
