"""A flow-level network for the transfer simulators (:mod:`simulations.transfer`,
:mod:`simulations.dataplane`).

Theory of operation
-------------------
Every host has an uplink and a downlink (bytes/s); every ordered pair of DCs may have a
WAN link.  A *flow* carries one chunk over one connection: it crosses its sender's
uplink, its receiver's downlink and, between DCs, the pair's WAN link; it may also have
a rate cap of its own (what one TCP connection keeps in flight over its round trip).

Sharing is **max-min fair**: the rates are those of progressive filling (raise every
flow's rate together; a link that fills freezes the flows on it; a flow that reaches its
cap freezes), so no link carries more than its rate and every flow has a *bottleneck*:
a full link on which no flow runs faster (or its own cap).  That allocation is unique,
and it is what the bottleneck condition recognises, which is what keeps an update
local: rates change only when a flow starts or ends, and the update refills only a set
``S`` of flows, holding every other flow at its rate (the links' capacity left over by
them is ``S``'s to share).  ``S`` starts with the new flow (a start) or empty (an end),
and grows until no flow outside it is wronged: a flow of ``S`` frozen on a link where an
outside flow runs faster brings that flow in (it must give way), and an outside flow
whose recorded bottleneck is no longer full, or now has a faster flow of ``S`` on it,
comes in too (it may speed up or must slow down).  At that fixed point every flow has a
bottleneck, so the rates are the max-min ones; the work is the ripple of flows whose
rates change, not the connected component of the network.

Completions go into the caller's :class:`~simulations.events.EventQueue`; a flow that
speeds up is armed anew (its earlier entry cancelled), one that slows down keeps its
entry, which re-arms when it fires.  Bytes are counted per link as they are carried (a
cancelled flow counts what it sent).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from .events import Entry, EventQueue

_DONE_SLACK = 1e-6
"""Bytes left that count as none (floating-point residue of rate x time)."""
_EPS = 1e-9
"""Relative slack of the bottleneck tests (rates are sums of floats)."""


class Link:
    """One direction of one NIC, or one WAN direction."""

    __slots__ = ("carried", "flows", "name", "rate", "used")

    def __init__(self, name: str, rate: float) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"link {name}: rate must be > 0, got {rate}")
        self.name = name
        self.rate = rate
        self.flows: dict[Flow, None] = {}
        """Flows on this link now, in the order they started."""
        self.used = 0.0
        """The sum of their rates."""
        self.carried = 0.0
        """Bytes carried so far."""


class Flow:
    """One chunk in flight on one connection."""

    __slots__ = ("bottleneck", "cap", "due", "ended", "entry", "left", "links", "nbytes",
                 "on_done", "rate", "since")

    def __init__(self, links: tuple[Link, ...], cap: float, nbytes: int,
                 on_done: Callable[[float], None]) -> None:
        self.links = links
        self.cap = cap
        self.nbytes = nbytes
        self.left = float(nbytes)
        self.rate = 0.0
        self.bottleneck: Link | None = None
        """The full link it is frozen on (None: its cap, or not yet running)."""
        self.since = 0.0
        self.entry: Entry | None = None
        """Its armed completion in the event queue."""
        self.due = math.inf
        """When that fires (it may be early: it then re-arms)."""
        self.ended = False
        self.on_done = on_done


class Network:
    """Links and the flows on them (see the module docstring)."""

    def __init__(self, queue: EventQueue) -> None:
        self.queue = queue
        self.links: dict[str, Link] = {}
        self.active = 0

    def link(self, name: str, rate: float) -> Link:
        """The link called ``name``, made with ``rate`` the first time it is asked for."""
        found = self.links.get(name)
        if found is None:
            found = self.links[name] = Link(name, rate)
        return found

    def start(self, now: float, links: tuple[Link, ...], nbytes: int,
              on_done: Callable[[float], None], cap: float = math.inf) -> Flow:
        """Start sending ``nbytes`` over ``links``; ``on_done(time)`` when the last byte
        has left the sender."""
        flow = Flow(links, cap, nbytes, on_done)
        flow.since = now
        for link in links:
            link.flows[flow] = None
        self.active += 1
        self._refill(now, {flow: None, **_held_on(links)}, ())
        return flow

    def cancel(self, now: float, flow: Flow) -> float:
        """Stop ``flow`` (its connection closed); returns the bytes it had sent."""
        if flow.ended:
            return float(flow.nbytes)
        self._settle(now, flow)
        self._remove(now, flow)
        return flow.nbytes - flow.left

    # -- max-min sharing ----------------------------------------------------------------

    def _refill(self, now: float, grow: dict[Flow, None], freed: Iterable[Link]) -> None:
        """Find the max-min rates by refilling a growing set of flows (see the module
        docstring); ``freed``: links a flow just left."""
        group: dict[Flow, None] = {}
        while True:
            group.update(grow)
            rate, frozen_on = _fill(group)
            grow = {}
            touched: dict[Link, float] = dict.fromkeys(freed, 0.0)
            for f in group:
                for link in f.links:
                    touched[link] = 0.0
            for link in touched:  # used once refilled, and the fastest of the group
                used, top = link.used, 0.0
                for f in link.flows:
                    if f in group:
                        r = rate[f]
                        used += r - f.rate
                        if r > top:
                            top = r
                touched[link] = used
                slack = _EPS * link.rate
                full = used >= link.rate - slack
                for g in link.flows:
                    if g in group:
                        continue
                    if g.bottleneck is link and (not full or top > g.rate + slack):
                        grow[g] = None  # it may speed up, or must give way
                    elif g.rate > top + slack and any(
                            frozen_on[f] is link for f in link.flows if f in group):
                        grow[g] = None  # it runs faster on a group flow's bottleneck
            if not grow:
                break
        for f in group:
            new = rate[f]
            f.bottleneck = frozen_on[f]
            if new != f.rate:
                self._settle(now, f)
                f.rate = new
                self._retime(now, f)
        for link, used in touched.items():
            link.used = used if link.flows else 0.0

    def _settle(self, now: float, flow: Flow) -> None:
        """Account for what ``flow`` sent since its last rate change."""
        sent = min(flow.left, flow.rate * (now - flow.since))
        if sent > 0:
            flow.left -= sent
            for link in flow.links:
                link.carried += sent
        flow.since = now

    def _retime(self, now: float, flow: Flow) -> None:
        """``flow``'s rate changed: arm its completion if it now comes sooner than the
        armed one (a later one is found when the armed one fires: it re-arms)."""
        if flow.rate > 0 and now + flow.left / flow.rate < flow.due:
            if flow.entry is not None:
                self.queue.cancel(flow.entry)
            self._arm(now, flow)

    def _arm(self, now: float, flow: Flow) -> None:
        def fire(at: float) -> None:
            flow.entry = None
            self._settle(at, flow)
            if flow.left > _DONE_SLACK and (flow.rate <= 0 or at + flow.left / flow.rate > at):
                # slowed since it was armed, or rounding (unless below the clock's
                # resolution); a stopped flow is armed again when it gets a rate
                flow.due = math.inf
                if flow.rate > 0:
                    self._arm(at, flow)
                return
            for link in flow.links:
                link.carried += flow.left
            flow.left = 0.0
            self._remove(at, flow)
            flow.on_done(at)

        flow.due = now + flow.left / flow.rate
        flow.entry = self.queue.at(flow.due, fire)

    def _remove(self, now: float, flow: Flow) -> None:
        """``flow`` ended: the flows it held back may speed up."""
        for link in flow.links:
            del link.flows[flow]
            link.used -= flow.rate
        if flow.entry is not None:
            self.queue.cancel(flow.entry)
            flow.entry = None
        flow.ended = True
        self.active -= 1
        self._refill(now, _held_on(flow.links), flow.links)


def _held_on(links: tuple[Link, ...]) -> dict[Flow, None]:
    """The flows frozen on ``links``: the first to change when a flow joins or leaves
    them (starting ``S`` with them saves rounds of growing it)."""
    return {f: None for link in links for f in link.flows if f.bottleneck is link}


def _fill(group: dict[Flow, None]) -> tuple[dict[Flow, float], dict[Flow, Link | None]]:
    """Progressive filling of ``group`` on what the other flows leave of each link:
    each flow's rate and the link it froze on (None: its cap).  Each round freezes the
    flows of the link with the least left per unfrozen flow (groups are small: a scan
    of their links costs less than a heap)."""
    left: dict[Link, float] = {}
    members: dict[Link, list[Flow]] = {}
    for f in group:
        for link in f.links:
            on = members.get(link)
            if on is None:
                members[link] = [f]
                left[link] = link.rate - link.used + f.rate
            else:
                on.append(f)
                left[link] += f.rate
    count = {link: len(on) for link, on in members.items()}
    capped = sorted((f for f in group if f.cap < math.inf), key=lambda f: f.cap)
    rate: dict[Flow, float] = {}
    frozen_on: dict[Flow, Link | None] = {}
    while len(rate) < len(group):
        share, at = math.inf, None
        for link, n in count.items():
            if n and left[link] < share * n:
                share, at = left[link] / n, link
        while capped and (capped[0] in rate or capped[0].cap <= share):
            f = capped.pop(0)
            if f not in rate:
                share, at = f.cap, None
                todo = [f]
                break
        else:
            assert at is not None
            todo = [f for f in members[at] if f not in rate]
        share = max(share, 0.0)
        for f in todo:
            rate[f], frozen_on[f] = share, at
            for link in f.links:
                left[link] -= share
                count[link] -= 1
    return rate, frozen_on
