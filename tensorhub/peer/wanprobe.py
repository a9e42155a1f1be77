"""The peer's link probes: the trio task around :class:`~tensorhub.protocol.probing.
ProbeSchedule`.

Every gossip round the task asks the schedule which links into this peer's DC to probe
now (none unless this peer is its DC's prober and some link nobody measured has a live
member at its other end), probes them one after the other through the read path
(:meth:`~tensorhub.read.reader.Reader.probe`), and folds each result into the WAN model
(:meth:`~tensorhub.protocol.wan.Wan.observe`, with the round trip); the control plane
then puts it in this peer's reference entry at its next tick.  What each probe found, or
why it failed, is kept for ``statistics().wan``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from ..config import PeerConfig
from ..errors import RemoteProtocolError, TransportError
from ..model import PeerInfo
from ..protocol.control import ControlPlane
from ..protocol.probing import PROBE_STREAMS, ProbeSample, ProbeSchedule

Probe = Callable[[PeerInfo, int], Awaitable[ProbeSample]]
"""Reads ``nbytes`` a stream from a peer and times it."""


AGAIN_UNDER = 0.7
"""A probe that reads a declared link under this share of its declared rate is taken
once more, and the faster of the two counts: a probe shares the link with whatever else
crosses it then (a 300 Mbit link once read 129 beside the other DCs' probes), and a
declaration the operator made deserves a second look before it is overruled."""


class LinkProbes:
    """This peer's probes of the links into its DC (see the module docstring)."""

    def __init__(self, me: PeerInfo, config: PeerConfig, control: ControlPlane,
                 probe: Probe, now: float) -> None:
        self.config, self.control, self._probe = config, control, probe
        self.schedule = ProbeSchedule(me, now, config.wan_probe_after,
                                      config.wan_probe_every)
        self.notes: dict[str, str] = {}
        """``"src->dst"`` -> what the last probe of that link found, or why it failed."""

    def describe(self) -> str:
        """Whether this peer probes, and why not."""
        if self.config.wan_probe_bytes == 0:
            return "off (PeerConfig.wan_probe_bytes = 0)"
        if not self.schedule.dc:
            return "off: this peer has no dc label"
        return (f"{PROBE_STREAMS} x {self.config.wan_probe_bytes} bytes per link nobody "
                f"measured, by the smallest-named live member of each DC, at most every "
                f"{self.config.wan_probe_every:g} s")

    async def run(self) -> None:
        """Look every gossip round until cancelled (returns at once when probes are off
        or this peer has no DC)."""
        if self.config.wan_probe_bytes == 0 or not self.schedule.dc:
            return
        while True:
            due = self.schedule.due(trio.current_time(),
                                    self.control.membership.live_members(), self.control.wan)
            for dc, target in due:
                await self.probe_link(dc, target)
            await trio.sleep(self.config.gossip_interval)  # a schedule, not a wait

    async def probe_link(self, dc: str, target: PeerInfo) -> None:
        """Probe the link from DC ``dc`` by reading from ``target``; note the outcome."""
        link, here = f"{dc}->{self.schedule.dc}", self.schedule.dc
        declared = self.control.wan.estimate(dc, here)
        try:
            s = await self._probe(target, self.config.wan_probe_bytes)
            if declared is not None and declared.how == "declared" and \
                    s.bps < AGAIN_UNDER * declared.bps:
                again = await self._probe(target, self.config.wan_probe_bytes)
                s = max(s, again, key=lambda x: x.bps)
        except (TransportError, RemoteProtocolError) as exc:
            self.notes[link] = f"from {target.name}: failed: {exc}"
            return
        counted = s.tail_seconds > 0 and self.control.wan.observe(
            dc, here, s.tail_bytes, s.tail_seconds, rtt_s=s.rtt_s, probe=True)
        rate = s.bps * 8 / 1e6
        self.notes[link] = (f"from {target.name}: {s.nbytes} bytes, {rate:.1f} Mbit over "
                            f"the second half, round trip {s.rtt_s * 1e3:.2f} ms"
                            + ("" if counted else " (too little timed: not counted)"))
