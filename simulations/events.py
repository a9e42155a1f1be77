"""The queue of timed callbacks behind the transfer simulators' virtual clock
(:mod:`simulations.transfer_engine`, :mod:`simulations.dataplane.fanouts`, and the
completions the flow-level network of :mod:`simulations.flows` arms).

Theory of operation
-------------------
A binary heap of ``[time, seq, callback]`` entries.  Ties on time are broken by
``seq``, the order of insertion, so one run's events always come out in one order.
:meth:`EventQueue.at` returns the entry, and :meth:`EventQueue.cancel` takes it back:
the network re-arms a flow's completion each time the flow speeds up, and in a large
fan-out that is most rate changes, so left in place, entries that will never fire would
outnumber the live ones many times over (the 1,024-GPU cross-DC run without DC labels
held gigabytes of them).  A cancelled entry loses its callback and is skipped when it
reaches the top; once cancelled entries are the majority (and more than
:data:`COMPACT_AT`), the heap is rebuilt without them, in linear time paid for by the
cancellations that made it due.  That changes no order: ``(time, seq)`` orders every
entry.  A popped entry loses its callback too, so cancelling an entry that already
fired is a no-op.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Entry = list[Any]
"""``[time, seq, callback]``; the callback is None once cancelled or popped."""

COMPACT_AT = 1024
"""Cancelled entries a heap may hold whatever its size (a rebuild of a small heap
saves nothing)."""


class EventQueue:
    """Timed callbacks, popped in ``(time, insertion)`` order (see the module doc)."""

    def __init__(self) -> None:
        self._heap: list[Entry] = []
        self._seq = 0
        self._cancelled = 0
        self.compactions = 0
        """Rebuilds so far (for tests and reports)."""

    def __len__(self) -> int:
        """Entries still to fire."""
        return len(self._heap) - self._cancelled

    @property
    def held(self) -> int:
        """Entries in the heap, cancelled ones included."""
        return len(self._heap)

    def at(self, when: float, fn: Callable[[float], None]) -> Entry:
        """Call ``fn(when)`` at ``when``; returns the entry (for :meth:`cancel`)."""
        self._seq += 1
        entry = [when, self._seq, fn]
        heapq.heappush(self._heap, entry)
        return entry

    def cancel(self, entry: Entry) -> None:
        """``entry`` will not fire (a no-op if it fired or was cancelled)."""
        if entry[2] is None:
            return
        entry[2] = None
        self._cancelled += 1
        if self._cancelled > COMPACT_AT and 2 * self._cancelled > len(self._heap):
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)
            self._cancelled = 0
            self.compactions += 1

    def pop(self) -> tuple[float, Callable[[float], None]] | None:
        """The next entry's time and callback, taken off the queue (None: empty)."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            fn = entry[2]
            if fn is not None:
                entry[2] = None
                return entry[0], fn
            self._cancelled -= 1
        return None
