"""A bounded queue of gossip updates, retransmitted a limited number of times.

Theory of operation
-------------------
Each update is about one subject (a member name); a newer update about the same
subject replaces the older one, so the queue holds at most one entry per subject.
Every outgoing protocol message asks for a few updates to piggyback; the queue hands
out the *least-sent* ones first (newest first among equals) and counts one
transmission for each.  An update sent ``limit`` times is retired; the caller computes
``limit`` as ``retransmit_mult * ceil(log10(N + 1))`` so that, with high probability,
every peer has heard it.  Entries are kept in buckets by transmission count, so
taking ``k`` updates costs O(k + limit) whatever the queue length.

The queue is bounded: past ``bound`` entries the most-sent, oldest one is dropped and
counted (gossip drops and counts; push-pull repairs whatever is lost).
"""

from __future__ import annotations

from itertools import islice
from typing import Generic, TypeVar

T = TypeVar("T")


class BroadcastQueue(Generic[T]):
    __slots__ = ("_bound", "_buckets", "_where", "dropped")

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._buckets: list[dict[str, T]] = [{}]  # index = transmissions so far
        self._where: dict[str, int] = {}
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._where)

    def put(self, subject: str, item: T) -> None:
        """Queue ``item``, replacing any older update about ``subject``."""
        sent = self._where.pop(subject, None)
        if sent is not None:
            del self._buckets[sent][subject]
        self._buckets[0][subject] = item
        self._where[subject] = 0
        if len(self._where) > self._bound:
            self._drop_one()

    def take(self, count: int, limit: int) -> tuple[T, ...]:
        """Up to ``count`` updates, least-sent first; each counts one transmission."""
        if not self._where:
            return ()
        buckets = self._buckets
        if len(self._where) <= count:  # everything goes: shift every bucket up by one
            out = tuple(item for bucket in buckets[:limit] for item in reversed(bucket.values()))
            buckets.insert(0, {})
            for subject in self._where:
                self._where[subject] += 1
            self._retire_beyond(limit)
            return out
        picked: list[tuple[int, dict[str, T]]] = []
        need = count
        for sent in range(min(limit, len(buckets))):
            bucket = buckets[sent]
            if not bucket:
                continue
            if len(bucket) <= need:
                buckets[sent] = {}
                group = bucket
            else:
                newest = list(islice(reversed(bucket), need))
                group = {s: bucket.pop(s) for s in reversed(newest)}  # keep age order
            picked.append((sent, group))
            need -= len(group)
            if not need:
                break
        # Move what was taken up one bucket, after picking, so nothing is taken twice.
        for sent, group in picked:
            if sent + 1 < limit:
                if sent + 1 == len(buckets):
                    buckets.append({})
                buckets[sent + 1].update(group)
                self._where.update(dict.fromkeys(group, sent + 1))
            else:
                for subject in group:
                    del self._where[subject]
        self._retire_beyond(limit)
        return tuple(item for _, group in picked for item in reversed(group.values()))

    def _retire_beyond(self, limit: int) -> None:
        """Forget entries sent ``limit`` times or more (the limit shrinks with N)."""
        while len(self._buckets) > max(1, limit):
            for subject in self._buckets.pop():
                del self._where[subject]

    def _drop_one(self) -> None:
        for bucket in reversed(self._buckets):
            if bucket:
                subject = next(iter(bucket))
                del bucket[subject]
                del self._where[subject]
                self.dropped += 1
                return
