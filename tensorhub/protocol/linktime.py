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

*Interim samples.*  A link can slow down while a transfer runs; the plan can move the
remaining stripes only once the WAN model believes it.  :meth:`LinkTime.interim` gives
what moved since the last interim sample (time in flight counted up to ``now``), each
time the read path asks the coordinator again (``PlanFollow``'s schedule: seconds
apart), but only once reads have been in flight for :data:`INTERIM_SECONDS` and
:data:`INTERIM_CHUNKS` chunks landed since the last one.  A window's bytes are off by
the chunks on the wire at its two ends; over a short window that is most of them (an
interim sample of 0.4 s read a 60 Mbit link as 231, which the WAN model believed, as it
believes any faster sample), and a stream's start (slow start, the first requests)
would pass for a slow link.  So the WAN model takes interim samples only as news of a
link slowing down (``Wan.observe(interim=True)``), and :meth:`LinkTime.samples`, at the
end, is the whole transfer's, not what came after the last interim sample: such a tail
is a window like any other (tails of a few chunks read 80 Mbit links as 178).

Pure: every event carries its ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LocalProtocolError

INTERIM_SECONDS = 2.0
"""Seconds in flight an interim sample covers at least (see the module docstring)."""
INTERIM_CHUNKS = 4
"""Chunks landed that an interim sample covers at least: one chunk more or less on the
wire then moves it by a quarter at most."""


@dataclass
class LinkTime:
    """Per source DC: bytes landed, and seconds with a chunk from it in flight."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    _open: dict[str, tuple[int, float]] = field(default_factory=dict)
    """DC -> (chunks in flight, since when some have been)."""
    landed: dict[str, int] = field(default_factory=dict)
    """Chunks landed per DC."""
    _marks: dict[str, tuple[int, float, int]] = field(default_factory=dict)
    """DC -> (bytes, seconds, chunks landed) already given out by :meth:`interim`."""

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
            self.landed[dc] = self.landed.get(dc, 0) + chunks
        if n == chunks:
            del self._open[dc]
            self.seconds[dc] = self.seconds.get(dc, 0.0) + max(0.0, now - since)
        else:
            self._open[dc] = (n - chunks, since)

    def samples(self) -> list[tuple[str, int, float]]:
        """``(source DC, bytes, seconds)`` of every DC whose reads are over and moved
        bytes in measurable time: the whole transfer's, interim samples or not."""
        return [(dc, n, self.seconds[dc]) for dc, n in sorted(self.bytes.items())
                if dc not in self._open and self.seconds.get(dc, 0.0) > 0]

    def interim(self, now: float) -> list[tuple[str, int, float]]:
        """``(source DC, bytes, seconds)`` landed since the last interim sample, the
        time in flight counted up to ``now`` (reads still going on included); a DC
        whose reads were in flight less than :data:`INTERIM_SECONDS`, or landed fewer than
        :data:`INTERIM_CHUNKS`, since then waits."""
        out = []
        for dc in sorted(self.bytes.keys() | self._open.keys()):
            busy = self.seconds.get(dc, 0.0)
            if dc in self._open:
                busy += max(0.0, now - self._open[dc][1])
            n, landed = self.bytes.get(dc, 0), self.landed.get(dc, 0)
            b0, s0, l0 = self._marks.get(dc, (0, 0.0, 0))
            if landed - l0 >= INTERIM_CHUNKS and busy - s0 >= INTERIM_SECONDS:
                out.append((dc, n - b0, busy - s0))
                self._marks[dc] = (n, busy, landed)  # else it waits for more
        return out
