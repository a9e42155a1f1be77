"""The member table one peer holds, with the indexes membership needs.

Theory of operation
-------------------
Each entry is a frozen :class:`MemberState` plus the member's full wire record (what
a state exchange sends).  Statuses are ranked ``alive < suspect < dead < left``; an
entry's precedence key is ``incarnation * 4 + rank``, so whether an update wins is
one integer comparison.  Beside the table the view keeps the live members other than
ourselves in an array (O(1) random picks; O(1) removal by moving the last one into
the hole) and an order-free digest of its live part: the sum mod 2**64 of a hash of
each live ``(name, incarnation, rank)`` plus their count.  Peers compare digests to
decide whether a full state exchange is needed.  Tombstones (dead, left) remember when
they were made, so they can be reaped; the addresses of *failed* (dead, not departed)
members are kept apart, after their tombstone is gone, for reconnection attempts.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import lru_cache

from ..model import PeerInfo
from .swim_wire import Update

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
STATUSES = (ALIVE, SUSPECT, DEAD, LEFT)  # index = rank = an Update's ``kind``
RANK = {s: i for i, s in enumerate(STATUSES)}
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class MemberState:
    info: PeerInfo
    status: str
    incarnation: int


@lru_cache(maxsize=1 << 16)
def _entry_hash(name: str, incarnation: int, rank: int) -> int:
    key = f"{name}\x00{incarnation}\x00{rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class View:
    __slots__ = ("_count", "_failed_max", "_full", "_live_pos", "_sum", "dead_since", "failed",
                 "keys", "live", "me", "records", "states")

    def __init__(self, me: str, failed_max: int) -> None:
        self.me = me
        self.states: dict[str, MemberState] = {}
        self.records: dict[str, Update] = {}   # latest full record of every member
        self.keys: dict[str, int] = {}         # precedence keys of the others
        self.live: list[str] = []              # alive or suspect, ourselves excluded
        self._live_pos: dict[str, int] = {}
        self._sum = 0
        self._count = 0
        self._full: tuple[Update, ...] | None = None
        self.dead_since: dict[str, float] = {}
        self.failed: dict[str, tuple[str, float]] = {}  # name -> (control, failed at)
        self._failed_max = failed_max

    def set(self, name: str, state: MemberState, record: Update, now: float,
            ) -> MemberState | None:
        """Store ``state`` (``record.kind`` is its rank); return the previous one."""
        old = self.states.get(name)
        rank = record.kind
        if rank > 1:
            self.dead_since[name] = now
        else:
            self.dead_since.pop(name, None)
        self.failed.pop(name, None)
        if rank == 2 and name != self.me:
            self.failed[name] = (state.info.control, now)
            if len(self.failed) > self._failed_max:
                del self.failed[next(iter(self.failed))]
        self.states[name] = state
        self.records[name] = record
        self._full = None
        was_live = old is not None and RANK[old.status] <= 1
        if was_live:
            assert old is not None
            self._sum -= _entry_hash(name, old.incarnation, RANK[old.status])
            self._count -= 1
        if rank <= 1:
            self._sum += _entry_hash(name, state.incarnation, rank)
            self._count += 1
        self._sum &= _MASK
        if name == self.me:
            return old
        self.keys[name] = state.incarnation * 4 + rank
        if rank <= 1 and not was_live:
            self._live_pos[name] = len(self.live)
            self.live.append(name)
        elif rank > 1 and was_live:
            pos = self._live_pos.pop(name)
            last = self.live.pop()
            if last != name:
                self.live[pos] = last
                self._live_pos[last] = pos
        return old

    def reap(self, name: str, now: float, after: float) -> bool:
        """Forget ``name`` if it has been a tombstone for ``after`` seconds."""
        since = self.dead_since.get(name)
        if since is None or since + after > now or name == self.me:
            return False
        del self.states[name], self.records[name], self.keys[name], self.dead_since[name]
        self._full = None
        return True

    def is_live(self, name: str) -> bool:
        return name in self._live_pos

    def control(self, name: str) -> str:
        return self.states[name].info.control

    def digest(self) -> bytes:
        return self._sum.to_bytes(8, "little") + self._count.to_bytes(4, "little")

    def full_state(self) -> tuple[Update, ...]:
        if self._full is None:
            self._full = tuple(self.records.values())
        return self._full

    def pick(self, rng: random.Random, k: int, exclude: str | None) -> list[str]:
        """Up to ``k`` distinct random live members other than ``exclude``."""
        live = self.live
        n = len(live)
        if n <= 2 * k + 1:
            chosen = [x for x in live if x != exclude]
            rng.shuffle(chosen)
            return chosen[:k]
        rnd = rng.random
        out: list[str] = []
        while len(out) < k:
            x = live[int(rnd() * n)]
            if x != exclude and x not in out:
                out.append(x)
        return out
