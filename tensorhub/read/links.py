"""What this peer's reads measured of its links, kept for the next reads.

A transfer measures each source's rate as its streams run (the session's stream
windows); the last measurement per source is kept here.  A new fetch's stream windows
start from it, and the delta phase weighs it against encoding and applying (with, per
source, the encode rate the holder last reported and our own apply rate, smoothed).
Owned by the :class:`~tensorhub.read.reader.Reader`; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..protocol.sizing import StreamWindow

RATE_GAIN = 0.3
"""Weight of a new encode or apply rate sample (one chunk's CPU time is noisy)."""


def smooth(old: float | None, sample: float) -> float:
    return sample if old is None else old + (sample - old) * RATE_GAIN


@dataclass
class LinkMemory:
    """Per source: the link rate and the encode rate last measured; our apply rate."""

    rates: dict[str, float] = field(default_factory=dict)
    """Bytes/s measured on full streams from each source (the last fetch from it)."""
    encode: dict[str, float] = field(default_factory=dict)
    """Chunk bytes/s each source encoded deltas at, as it said (smoothed)."""
    apply_bps: float | None = None
    """Chunk bytes/s this peer applied deltas at (smoothed)."""

    def remember(self, windows: Iterable[tuple[str, StreamWindow]]) -> None:
        """Keep the rates a finished transfer measured per source."""
        for name, window in windows:
            rate = window.rate
            if rate is not None and rate > 0:
                self.rates[name] = rate

    def encoded(self, source: str, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self.encode[source] = smooth(self.encode.get(source), nbytes / seconds)

    def applied(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self.apply_bps = smooth(self.apply_bps, nbytes / seconds)
