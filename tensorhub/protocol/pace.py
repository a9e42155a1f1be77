"""How long a read from one source may take before the source counts as stalled.

Theory of operation
-------------------
A fetch reads chunks from holders; a holder that stops sending must be noticed so its
chunks go elsewhere, but a holder that is merely slow -- its host loaded, its link
shared, its process descheduled for a moment on a busy two-core machine -- must not be
mistaken for a dead one.  Declaring a live sole source stalled fails a fetch that would
have finished.

:class:`Pace` keeps, per source, what its reads have cost, the way TCP keeps a
retransmission timeout: a smoothed time per byte and its mean deviation, updated from
every completed read (Jacobson's estimator, gains 1/8 and 1/4).  The limit for a read of
``n`` bytes is ``MARGIN x n x (smoothed + 4 x deviation)``, never below ``floor`` (what
scheduling noise alone can cost on a loaded host) and never above ``ceiling`` (the
peer's ``stall_timeout``: past it, no progress is a real timeout).  Before a source has
completed a read its limit is the ceiling.

Each stall doubles that source's limit (a *strike*; backoff, up to the ceiling) and each
completed read takes one strike back, so a source that stalled because the host was busy
gets more time on the next try instead of stalling again.  Nothing here reads a clock or
performs I/O: callers pass durations in.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LocalProtocolError

STALL_FLOOR = 1.0
"""Seconds a read may always take before it counts as stalled.  On a two-core host with
a busy neighbour, a process waits for the CPU for hundreds of milliseconds at a time
(the rollout groups' stateful tests run like that); a floor below that -- it was 0.25 s
-- declared live holders stalled and failed fetches that would have finished."""

MARGIN = 4.0
"""Headroom over the estimate: a read may take this many times its expected duration."""

MAX_STRIKES = 6


@dataclass
class _Source:
    per_byte: float
    deviation: float


class Pace:
    """Per-source read-time estimates and the stall limits derived from them."""

    def __init__(self, *, ceiling: float, floor: float = STALL_FLOOR) -> None:
        if not ceiling > 0:
            raise LocalProtocolError(f"ceiling must be > 0, got {ceiling!r}")
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self._sources: dict[str, _Source] = {}
        self._strikes: dict[str, int] = {}

    def limit(self, source: str, nbytes: int) -> float:
        """Seconds a read of ``nbytes`` from ``source`` may take before it is stalled."""
        s = self._sources.get(source)
        if s is None:
            return self.ceiling
        expected = MARGIN * nbytes * (s.per_byte + 4 * s.deviation)
        backoff = 2.0 ** self._strikes.get(source, 0)
        return min(self.ceiling, max(self.floor, expected) * backoff)

    def rate(self, source: str) -> float | None:
        """The source's smoothed rate in bytes/s (None before its first read)."""
        s = self._sources.get(source)
        return None if s is None or s.per_byte <= 0 else 1.0 / s.per_byte

    def completed(self, source: str, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` from ``source`` took ``seconds``."""
        if nbytes <= 0:
            return
        sample = max(seconds, 0.0) / nbytes
        s = self._sources.get(source)
        if s is None:
            self._sources[source] = _Source(sample, sample / 2)
        else:
            s.deviation += (abs(s.per_byte - sample) - s.deviation) / 4
            s.per_byte += (sample - s.per_byte) / 8
        strikes = self._strikes.get(source, 0)
        if strikes:
            self._strikes[source] = strikes - 1

    def stalled(self, source: str) -> None:
        """A read from ``source`` hit its limit: give the next one twice as long."""
        self._strikes[source] = min(MAX_STRIKES, self._strikes.get(source, 0) + 1)

    def strikes(self, source: str) -> int:
        return self._strikes.get(source, 0)
