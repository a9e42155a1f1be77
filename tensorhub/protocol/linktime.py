"""What one transfer measured of the links between DCs.

Theory of operation
-------------------
A fetch reads from several sources at once, some of them in other DCs.  What the WAN
model (:class:`~.wan.Wan`) wants of it is the rate of each DC pair ``a -> b``: every
byte that came from DC ``a`` over the time reads from DC ``a`` were going on, however
many sources of ``a`` shared the link meanwhile.  :class:`LinkTime` keeps, per source
DC, the bytes that landed and the seconds during which at least one chunk from that DC
was claimed and not yet landed (or given back): the union of the reads' busy times, so
two sources of one DC read side by side count once, at their summed rate.

Only chunks asked of a source that held the whole version count (the session's
``Stream.timed``): a source that is itself still receiving (a relay) keeps us waiting with
chunks claimed at its own pace, and timing that made links look several times slower
than they were, which inflated the plans' budgets (the trainer then fed two copies).  A
chunk's time still includes its digest check, which only makes the estimate lower than
the link, never higher.  Samples of
fewer than ``Wan``'s ``min_sample_bytes`` are dropped there.

Pure: every event carries its ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LocalProtocolError


@dataclass
class LinkTime:
    """Per source DC: bytes landed, and seconds with a chunk from it in flight."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    _open: dict[str, tuple[int, float]] = field(default_factory=dict)
    """DC -> (chunks in flight, since when some have been)."""

    def claimed(self, now: float, dc: str, chunks: int) -> None:
        """``chunks`` more chunks from DC ``dc`` are asked for."""
        if chunks <= 0:
            return
        n, since = self._open.get(dc, (0, now))
        self._open[dc] = (n + chunks, since)

    def ended(self, now: float, dc: str, chunks: int, nbytes: int = 0) -> None:
        """``chunks`` chunks from ``dc`` in flight landed (``nbytes`` in all) or were
        given back."""
        if chunks <= 0:
            return
        n, since = self._open.get(dc, (0, now))
        if chunks > n:
            raise LocalProtocolError(f"{chunks} chunks from DC {dc!r} ended, {n} in flight")
        if nbytes:
            self.bytes[dc] = self.bytes.get(dc, 0) + nbytes
        if n == chunks:
            del self._open[dc]
            self.seconds[dc] = self.seconds.get(dc, 0.0) + max(0.0, now - since)
        else:
            self._open[dc] = (n - chunks, since)

    def samples(self) -> list[tuple[str, int, float]]:
        """``(source DC, bytes, seconds)`` of every DC whose reads are over and moved
        bytes in measurable time."""
        return [(dc, n, self.seconds[dc]) for dc, n in sorted(self.bytes.items())
                if dc not in self._open and self.seconds.get(dc, 0.0) > 0]
