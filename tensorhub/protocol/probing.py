"""Link probes: who measures which link between DCs that nobody has measured yet.

Theory of operation
-------------------
Reads measure the links they use (:mod:`.linktime`), but a planner deciding the first
transfer into a new DC has only what operators declared, or nothing.  So each DC sends
one cheap probe over each link into it that nobody has measured: its *prober*, the live
member of the DC with the smallest name (every member of the DC agrees on it from
membership alone, without a message), reads :data:`PROBE_STREAMS` x
``PeerConfig.wan_probe_bytes`` of zeros from the smallest-named live member of the
other DC and times it (:mod:`tensorhub.read.probe`); the result is one more sample of
that link (:meth:`~.wan.Wan.observe`), which then travels in the prober's reference
entry like any measurement.

:class:`ProbeSchedule` is the prober's policy.  Nothing is probed until
``wan_probe_after`` seconds after joining, so the DCs' probers are agreed on; after that
every look (:meth:`ProbeSchedule.due`: the shell looks again every gossip round, so a
DC that appears in membership is probed within a round) names, per other DC with a live
member, the peer to read from, when the link from that DC into ours is not measured
(declared is not measured) and was not probed in the last ``wan_probe_every`` seconds,
successfully or not.  A probe is at most a few tens of MiB per link and per
``wan_probe_every``, and none runs on a link anyone measured.

Why the rate is timed on the second half only: a fresh TCP connection starts slowly
(slow start doubles its window every round trip), so its first bytes measure the round
trip more than the link.  With 4 streams of 8 MiB, a 300 Mbit link at 150 ms reaches its
rate after some 7 MB, before the timed half begins.

Pure: the caller passes ``now``, the live members and the WAN model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from ..model import PeerInfo
from .wan import Wan

COMMON_SHARE = 0.25
"""The least time all of a probe's tails must have run at once, as a share of the
longest tail, for that common window alone to give the rate (:func:`combine`)."""

PROBE_STREAMS = 4
"""Parallel connections of one probe: four slow starts side by side reach a long link's
rate in fewer round trips than one."""


@dataclass(frozen=True)
class ProbeSample:
    """What one probe measured: ``tail_bytes`` (those after the first half of each
    stream) in ``tail_seconds`` (at the rate :func:`combine` found), and the least round
    trip of its streams."""

    nbytes: int
    tail_bytes: int
    tail_seconds: float
    rtt_s: float

    @property
    def bps(self) -> float:
        """The rate it found, bytes a second (0: nothing was timed)."""
        return self.tail_bytes / self.tail_seconds if self.tail_seconds > 0 else 0.0


def combine(streams: Iterable[tuple[int, int, float, float, float]],
            marks: Sequence[Sequence[tuple[float, int]]] | None = None) -> ProbeSample:
    """One probe of several streams, each ``(bytes, tail bytes, tail start, end, round
    trip)``.  With ``marks`` (per stream, ``(time, bytes of its tail so far)`` from its
    tail's start to its end), where every tail ran at once for at least
    :data:`COMMON_SHARE` of the longest tail: the bytes all streams got in that common
    window over its length, the link's rate while they all shared it.  Else, where all
    the tails overlapped, the sum of the tails' rates (each tail's bytes over its own
    time: a tail that ran partly alone counts its lone speed, so this reads high: a 60
    Mbit link read 82); else the tails over the time from the first tail's start to the
    last end."""
    got = list(streams)
    if not got:
        return ProbeSample(0, 0, 0.0, 0.0)
    nbytes, tail = sum(n for n, _, _, _, _ in got), sum(t for _, t, _, _, _ in got)
    rtt = min(r for _, _, _, _, r in got)
    start = min(s for _, _, s, _, _ in got)
    end = max(e for _, _, _, e, _ in got)
    if marks is not None and len(marks) == len(got) and all(marks):
        lo = max(s for _, _, s, _, _ in got)
        hi = min(e for _, _, _, e, _ in got)
        longest = max(e - s for _, _, s, e, _ in got)
        if hi > lo and hi - lo >= COMMON_SHARE * longest:
            common = sum(_at(m, hi) - _at(m, lo) for m in marks)
            if common > 0:
                return ProbeSample(nbytes, tail, tail * (hi - lo) / common, rtt)
    if max(s for _, _, s, _, _ in got) < min(e for _, _, _, e, _ in got) \
            and all(e > s for _, _, s, e, _ in got):
        # Every tail ran at once for a while: the link carried the sum of their rates
        # then.  (From the first tail's start to the last end, the streams still in
        # their heads shared the link uncounted: that read 300 Mbit links as 175.)
        rate = sum(t / (e - s) for _, t, s, e, _ in got)
        return ProbeSample(nbytes, tail, tail / rate if rate > 0 else 0.0, rtt)
    return ProbeSample(nbytes, tail, max(0.0, end - start), rtt)


def _at(marks: Sequence[tuple[float, int]], t: float) -> float:
    """Bytes a stream had at time ``t``, between its marks (linearly)."""
    if t <= marks[0][0]:
        return float(marks[0][1])
    for (t0, b0), (t1, b1) in pairwise(marks):
        if t0 <= t <= t1:
            return b0 + (b1 - b0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
    return float(marks[-1][1])


def prober(members: Iterable[PeerInfo], dc: str) -> PeerInfo | None:
    """The smallest-named of ``members`` in DC ``dc`` (None: none is)."""
    return min((m for m in members if m.label("dc") == dc), key=lambda m: m.name,
               default=None)


def rotation(dcs: Iterable[str], mine: str) -> list[str]:
    """The other DCs in the order DC ``mine`` probes them: the DCs sorted, starting
    after ``mine`` and wrapping around.  Every prober agrees on the sorted list, so
    while they probe in step, at the i-th probe each DC reads from the DC i places
    after it and is read by the one i places before: a prober serves one probe while
    it reads one.  (All in the same order, every prober read the first DC at once:
    each prober's uplink carried two or three probes, its own probe's acknowledgements
    queued behind them, and a 250 Mbit link read as 128.)"""
    ordered = sorted(set(dcs) - {""} | {mine})
    at = ordered.index(mine)
    return ordered[at + 1:] + ordered[:at]


class ProbeSchedule:
    """Which links one peer probes, and when (see the module docstring)."""

    def __init__(self, me: PeerInfo, joined: float, after: float, every: float) -> None:
        self.me = me
        self.dc = me.label("dc") or ""
        self.start = joined + after
        self.every = every
        self._last: dict[str, float] = {}
        """Source DC -> when we last probed the link from it."""

    def due(self, now: float, live: Iterable[PeerInfo], wan: Wan) -> list[tuple[str, PeerInfo]]:
        """``(source DC, peer to read from)`` of each link to probe now: none unless we
        are our DC's prober; each is noted as probed now (call it when about to probe)."""
        if not self.dc or now < self.start:
            return []
        members = [*live, self.me]
        mine = prober(members, self.dc)
        if mine is None or mine.name != self.me.name:
            return []
        out = []
        for dc in rotation({m.label("dc") or "" for m in members}, self.dc):
            known = wan.estimate(dc, self.dc)
            last = self._last.get(dc)
            if (known is not None and known.how == "measured") or (
                    last is not None and now < last + self.every):
                continue
            target = prober(members, dc)
            if target is not None:
                self._last[dc] = now
                out.append((dc, target))
        return out
