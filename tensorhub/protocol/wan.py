"""The WAN: one link per ordered pair of datacenters, declared, measured and gossiped.

Theory of operation
-------------------
Real cross-region fleets are not two equal DCs behind one link: each ordered DC pair
``a -> b`` has its own rate and round trip, often asymmetric, and a direct link may be
slower than a path through a third DC.  :class:`Wan` is one peer's picture of them.

Three kinds of knowledge, best last:

* *unknown*: :meth:`Wan.rate` says ``None`` and the topology falls back to its class
  default (:class:`~.topology.TopologyConfig`);
* *declared* by the operator (``PeerConfig.links``, :mod:`tensorhub.links`): a starting
  point;
* *measured*: a receiver in DC ``b`` folds each transfer it completed from DC ``a`` (at
  least ``min_sample_bytes``, so latency does not pass for bandwidth) into its estimate
  of ``a -> b`` (:meth:`Wan.observe`).  A transfer's rate is what the link carried *at
  least* (a busy sender or a short read shows less than the link can), so a faster
  sample is believed at once, as a bottleneck-bandwidth filter does.  A slower one shows
  the transfer's own limits (a sender sharing its uplink, a receiver its downlink, both
  their CPUs) as often as the link's: one above :data:`SLOW_SHARE` of the estimate
  changes nothing, and one under it counts only when :data:`SLOW_STREAK` in a row were;
  from then on each moves the estimate ``ewma_alpha`` of the way down: a link that
  degrades is followed within a few transfers, to within ``1 / SLOW_SHARE`` of its
  rate.  (Taking every slower sample halfway, 300 Mbit links probed right at 303-317
  were believed at 182-227 after two fan-outs, and the planner routed around them; with
  three slower ones in a row and no share, the third fan-out did.)  A peer's first
  sample of a link is weighed the same way against what it hears or was declared, and
  makes a report of its own only when it is news: otherwise a short tail read after a
  relay completed (300 Mbit read as 60) became a second report, the median of two is
  their mean, and the next version was planned at 180.  A probe at join
  (:mod:`.probing`) reads the link and nothing else: its sample replaces the estimate.
  A peer's own measurements (:meth:`Wan.reports`, at most :data:`MAX_LINK_REPORTS`)
  travel in its reference-table entry, so they reach every peer by the same anti-entropy
  that carries holdings; :meth:`Wan.hear` keeps, per origin, the reports of its newest
  entry.  A pair measured by anyone is estimated as the median of the measurements (ours
  and each origin's), which a single slow or lying reporter cannot move far; otherwise
  the declaration stands.  (The lower middle of two was tried, so that a fall one reader
  saw would be believed at once: in the emulated suite a single low report then held
  300 Mbit links at 170 for the next version, and learned plans routed around them.)

  Samples of a transfer still running (``interim``, :mod:`.linktime`) are taken only
  as news of a link slowing down: one that is not under our estimate, or comes before
  any other, changes nothing (a window's bytes are off by the chunks on the wire at its
  ends).

Everything that comes from the wire is range-checked in :meth:`Wan.hear`; origins and
reports are bounded (:data:`MAX_ORIGINS`, :data:`MAX_LINK_REPORTS`), so gossip cannot
grow a peer's memory without bound.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

from ..bounds import MAX_LABEL_VALUE, MaxLen
from ..errors import LocalProtocolError, RemoteProtocolError
from ..links import MAX_LINK_BPS, MAX_LINK_RTT_S, LinkSpec

MAX_LINK_REPORTS = 64
"""Measured links one origin gossips (the most recently measured first)."""
MAX_ORIGINS = 1 << 16
"""Origins whose reports are kept (one per member)."""

DCName = Annotated[str, MaxLen(MAX_LABEL_VALUE)]
How = Literal["measured", "declared", "default"]


@dataclass(frozen=True, slots=True)
class LinkReport:
    """``src -> dst`` measured at ``bps`` bytes/s with a ``rtt_s`` round trip (0: not
    measured)."""

    src: DCName
    dst: DCName
    bps: float
    rtt_s: float = 0.0


MESSAGES = (LinkReport,)


def check_report(r: LinkReport) -> None:
    """Raise :class:`RemoteProtocolError` unless ``r`` is a plausible link report."""
    if (not r.src or not r.dst or r.src == r.dst or not isinstance(r.bps, float)
            or not math.isfinite(r.bps) or not 0 < r.bps <= MAX_LINK_BPS
            or not isinstance(r.rtt_s, float) or not math.isfinite(r.rtt_s)
            or not 0 <= r.rtt_s <= MAX_LINK_RTT_S):
        raise RemoteProtocolError(f"implausible link report {r!r}")


@dataclass(frozen=True)
class LinkEstimate:
    """What a peer believes of ``src -> dst`` now, and why."""

    bps: float
    rtt_s: float
    how: How
    reporters: int = 0
    """Origins whose measurements the estimate is the median of."""


SLOW_SHARE = 0.6
"""A transfer's sample under our estimate but above this share of it changes nothing
(see the module docstring)."""

SLOW_STREAK = 2
"""Transfer samples in a row under :data:`SLOW_SHARE` of our estimate before it follows
them down (see the module docstring)."""


class Wan:
    """One peer's estimates of every DC pair's link (mutable).

    ``changes`` counts changes of our own measurements, so the shell knows when to put
    them in its reference-table entry again.
    """

    def __init__(self, declared: Iterable[LinkSpec] = (), *, ewma_alpha: float = 0.5,
                 min_sample_bytes: int = 1 << 20) -> None:
        self._declared = {(d.src, d.dst): (float(d.bps), float(d.rtt_s)) for d in declared}
        self._alpha, self._min_bytes = ewma_alpha, min_sample_bytes
        self._mine: dict[tuple[str, str], tuple[float, float]] = {}
        self._slower: dict[tuple[str, str], int] = {}
        """Transfer samples in a row slower than our estimate, per pair."""
        self._heard: dict[str, dict[tuple[str, str], tuple[float, float]]] = {}
        self._known: dict[tuple[str, str], LinkEstimate | None] = {}
        """:meth:`estimate` per pair, until the next change (a planner asks per edge,
        and each answer is a median over every reporting origin)."""
        self.changes = 0

    # -- our own measurements -------------------------------------------------------

    def observe(self, src: str, dst: str, nbytes: int, seconds: float,
                rtt_s: float | None = None, *, probe: bool = False,
                interim: bool = False) -> bool:
        """Fold one transfer ``src -> dst`` (DC names) into our estimate; returns whether
        it counted (big enough, across DCs).  ``probe``: a link probe's sample, taken as
        the link's rate up or down (it read the link and nothing else).  ``interim``:
        part of a transfer still running (:meth:`~.linktime.LinkTime.interim`), news
        only of a link slowing down: not faster than our estimate, nor the first."""
        if nbytes < 0 or not (math.isfinite(seconds) and seconds > 0):
            raise LocalProtocolError(f"bad link sample: {nbytes} bytes in {seconds} s")
        if src == dst or not src or not dst or nbytes < max(1, self._min_bytes):
            return False
        rate = min(nbytes / seconds, MAX_LINK_BPS)
        old = self._mine.get((src, dst))
        base = old  # what the sample is weighed against: ours, else what we hear
        if old is None and not probe and (known := self.estimate(src, dst)) is not None:
            base = (known.bps, known.rtt_s)
        if interim and (base is None or rate >= base[0]):
            return False
        self._mine.pop((src, dst), None)  # re-inserted last: the most recent
        if base is None or probe:
            bps, rtt = rate, 0.0 if old is None else old[1]
        elif rate >= base[0]:  # a link carried at least this: believe it at once
            bps, rtt = rate, base[1]
        elif rate >= SLOW_SHARE * base[0]:  # the transfer's own limits: nothing learned
            bps, rtt = base
        elif (streak := self._slower.get((src, dst), 0) + 1) < SLOW_STREAK:
            self._slower[src, dst] = streak  # far slower, but once may be a busy sender
            bps, rtt = base
        else:  # slower time after time: the link degraded; follow by halves
            bps = self._alpha * rate + (1 - self._alpha) * base[0]
            rtt = base[1]
        if base is None or probe or rate >= base[0]:
            self._slower.pop((src, dst), None)
        if old is None and base is not None and not probe and (bps, rtt) == base:
            return True  # nothing learned: our first report waits for news
        if rtt_s is not None and math.isfinite(rtt_s) and 0 <= rtt_s <= MAX_LINK_RTT_S:
            rtt = rtt_s if rtt == 0 else self._alpha * rtt_s + (1 - self._alpha) * rtt
        if old == (bps, rtt):
            self._mine[src, dst] = old
            return True
        self._mine[src, dst] = (bps, rtt)
        self._known.clear()
        while len(self._mine) > MAX_LINK_REPORTS:
            gone = next(iter(self._mine))
            del self._mine[gone]
            self._slower.pop(gone, None)
        self.changes += 1
        return True

    def reports(self) -> tuple[LinkReport, ...]:
        """Our own measurements, for our reference-table entry (most recent last)."""
        return tuple(LinkReport(s, d, bps, rtt) for (s, d), (bps, rtt) in self._mine.items())

    # -- others' --------------------------------------------------------------------

    def hear(self, origin: str, reports: Iterable[LinkReport]) -> bool:
        """Adopt the reports of ``origin``'s newest entry (replacing its older ones).
        Raises :class:`RemoteProtocolError`, keeping what it had, on a malformed one."""
        got = list(reports)
        if len(got) > MAX_LINK_REPORTS:
            raise RemoteProtocolError(f"{origin!r} reports {len(got)} links "
                                      f"(at most {MAX_LINK_REPORTS})")
        for r in got:
            check_report(r)
        new = {(r.src, r.dst): (r.bps, r.rtt_s) for r in got}
        if self._heard.get(origin, {}) == new:
            return False
        self._known.clear()
        if not new:
            self._heard.pop(origin, None)
        elif origin in self._heard or len(self._heard) < MAX_ORIGINS:
            self._heard[origin] = new
        else:
            return False
        return True

    def forget(self, origin: str) -> None:
        """``origin`` left the mesh: its reports no longer count."""
        if self._heard.pop(origin, None) is not None:
            self._known.clear()

    # -- what we believe --------------------------------------------------------------

    def estimate(self, src: str, dst: str) -> LinkEstimate | None:
        """``src -> dst`` as we believe it now; None if nobody declared or measured it."""
        if (src, dst) not in self._known:
            if len(self._known) >= MAX_LINK_REPORTS * MAX_LINK_REPORTS:
                self._known.clear()  # asked of more pairs than any mesh has: start over
            self._known[src, dst] = self._estimate(src, dst)
        return self._known[src, dst]

    def _estimate(self, src: str, dst: str) -> LinkEstimate | None:
        measured = [m[src, dst] for m in (self._mine, *self._heard.values())
                    if (src, dst) in m]
        declared = self._declared.get((src, dst))
        if measured:
            rtts = [r for _, r in measured if r > 0]
            rtt = statistics.median(rtts) if rtts else (declared[1] if declared else 0.0)
            return LinkEstimate(statistics.median(b for b, _ in measured), rtt, "measured",
                                len(measured))
        if declared is not None:
            return LinkEstimate(declared[0], declared[1], "declared")
        return None

    def rate(self, src: str, dst: str) -> float | None:
        e = self.estimate(src, dst)
        return None if e is None else e.bps

    def pairs(self) -> list[tuple[str, str]]:
        """Every DC pair something is known of."""
        known = set(self._declared) | set(self._mine)
        for m in self._heard.values():
            known |= m.keys()
        return sorted(known)

    def table(self) -> list[dict[str, object]]:
        """Every known link as plain data (``status``, metrics)."""
        out: list[dict[str, object]] = []
        for s, d in self.pairs():
            e = self.estimate(s, d)
            if e is not None:
                out.append({"from": s, "to": d, "mbit": round(e.bps * 8 / 1e6, 3),
                            "rtt_ms": round(e.rtt_s * 1e3, 3), "how": e.how,
                            "reporters": e.reporters})
        return out
