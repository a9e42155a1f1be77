"""A flow-level network for the transfer simulator (:mod:`simulations.transfer`).

Theory of operation
-------------------
Every host has an uplink and a downlink (bytes/s); every ordered pair of DCs may have a
WAN link.  A *flow* carries one chunk over one connection: it crosses its sender's
uplink, its receiver's downlink and, between DCs, the pair's WAN link; it may also have
a rate cap of its own (what one TCP connection keeps in flight over its round trip).

Sharing is **equal share per link**: a flow runs at the least, over the links it
crosses, of the link's rate divided by the number of flows on that link now (and at
most its own cap).  No link ever carries more than its rate, so a simulation cannot beat
physics; unlike max-min fairness, the share a flow cannot use (it is held back on
another link) is not handed to the others on this one, so the model errs on the slow
side when flows with different bottlenecks share a link.  Rates change only when a flow
starts or ends, and only for the flows that share a link with it: a start slows only
those above the link's new share, an end may speed up only those held to its old share,
so an event costs a comparison per flow on the links it touches, and a recomputation
and a new completion only for the flows whose rate changes.

Completions go into the caller's event queue through ``schedule(time, callback)``; a
flow that speeds up is armed anew (the entry made stale is recognised by the flow's
version and ignored), one that slows down keeps its entry, which re-arms when it fires.
Bytes are counted per link as they are carried (a cancelled flow counts what it sent).
"""

from __future__ import annotations

import math
from collections.abc import Callable

Schedule = Callable[[float, Callable[[float], None]], None]
"""``schedule(time, callback)``: call ``callback(time)`` then."""

_DONE_SLACK = 1e-6
"""Bytes left that count as none (floating-point residue of rate x time)."""


class Link:
    """One direction of one NIC, or one WAN direction."""

    __slots__ = ("carried", "flows", "name", "rate")

    def __init__(self, name: str, rate: float) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"link {name}: rate must be > 0, got {rate}")
        self.name = name
        self.rate = rate
        self.flows: dict[Flow, None] = {}
        """Flows on this link now, in the order they started."""
        self.carried = 0.0
        """Bytes carried so far."""


class Flow:
    """One chunk in flight on one connection."""

    __slots__ = ("cap", "due", "left", "links", "nbytes", "on_done", "rate", "since",
                 "version")

    def __init__(self, links: tuple[Link, ...], cap: float, nbytes: int,
                 on_done: Callable[[float], None]) -> None:
        self.links = links
        self.cap = cap
        self.nbytes = nbytes
        self.left = float(nbytes)
        self.rate = 0.0
        self.since = 0.0
        self.version = 0
        self.due = math.inf
        """When its armed completion fires (it may be early: it then re-arms)."""
        self.on_done = on_done


class Network:
    """Links and the flows on them (see the module docstring)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
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
        self._reshare(now, flow)
        return flow

    def cancel(self, now: float, flow: Flow) -> float:
        """Stop ``flow`` (its connection closed); returns the bytes it had sent."""
        if flow.version < 0:
            return float(flow.nbytes)
        self._settle(now, flow)
        self._remove(now, flow)
        return flow.nbytes - flow.left

    # -- sharing ------------------------------------------------------------------------

    def _rate(self, flow: Flow) -> float:
        rate = flow.cap
        for link in flow.links:
            share = link.rate / len(link.flows)
            if share < rate:
                rate = share
        return rate

    def _settle(self, now: float, flow: Flow) -> None:
        """Account for what ``flow`` sent since its last rate change."""
        sent = min(flow.left, flow.rate * (now - flow.since))
        if sent > 0:
            flow.left -= sent
            for link in flow.links:
                link.carried += sent
        flow.since = now

    def _reshare(self, now: float, changed: Flow) -> None:
        """``changed`` started: a flow sharing a link with it whose rate was above that
        link's new share now runs at the share (every other constraint of it is as
        before); ``changed`` gets its rate and its completion."""
        for link in changed.links:
            share = link.rate / len(link.flows)
            for flow in link.flows:
                if flow is not changed and flow.rate > share:
                    self._settle(now, flow)
                    flow.rate = share
                    self._retime(now, flow)
        changed.since = now
        changed.rate = self._rate(changed)
        self._retime(now, changed)

    def _retime(self, now: float, flow: Flow) -> None:
        """``flow``'s rate changed: arm its completion if it now comes sooner than the
        armed one (a later one is found when the armed one fires: it re-arms)."""
        if now + flow.left / flow.rate < flow.due:
            flow.version += 1
            self._arm(now, flow)

    def _arm(self, now: float, flow: Flow) -> None:
        version = flow.version

        def fire(at: float) -> None:
            if flow.version != version:
                return  # rescheduled since
            self._settle(at, flow)
            if flow.left > _DONE_SLACK and at + flow.left / flow.rate > at:  # slowed
                # since it was armed, or rounding (unless below the clock's resolution)
                flow.version += 1
                self._arm(at, flow)
                return
            for link in flow.links:
                link.carried += flow.left
            flow.left = 0.0
            self._remove(at, flow)
            flow.on_done(at)

        flow.due = now + flow.left / flow.rate
        self.schedule(flow.due, fire)

    def _remove(self, now: float, flow: Flow) -> None:
        """``flow`` ended: only a flow held to a link's old share may speed up."""
        shares = [link.rate / len(link.flows) for link in flow.links]
        for link in flow.links:
            del link.flows[flow]
        flow.version = -1
        self.active -= 1
        for link, share in zip(flow.links, shares, strict=True):
            for other in link.flows:
                if other.rate >= share:
                    rate = self._rate(other)
                    if rate != other.rate:
                        self._settle(now, other)
                        other.rate = rate
                        self._retime(now, other)
