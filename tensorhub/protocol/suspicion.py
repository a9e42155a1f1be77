"""Lifeguard's local-health mechanisms, as plain arithmetic on times passed in.

Theory of operation
-------------------
*Suspicion timeout* (Lifeguard "LHA-Suspicion").  When a member is first suspected its
timer starts at ``max_timeout``.  Every further, independent accuser (a suspicion of the
same incarnation from a peer not counted yet) is a confirmation; after ``n`` of the
``k`` expected ones the timeout is

    max(min, max - (max - min) * log(n + 1) / log(k + 1))

measured from the moment the suspicion started, so a member many peers failed to reach
is declared dead after ``min_timeout`` while a lone, possibly slow accuser must wait
``max_timeout``.  ``min_timeout`` grows with log10 of the cluster size (memberlist's
rule), because a bigger cluster needs more gossip rounds to tell the suspect.

*Local health* (Lifeguard "LHA-Probe").  A score in ``[0, limit)`` rises when our own
probes fail without the expected nacks (our network or our process is the likely
culprit) and when we must refute a suspicion of ourselves, and falls with every
successful probe.  Probe intervals and timeouts, and the suspicion timeouts of the
suspicions we start, are multiplied by ``score + 1``: a peer that is itself slow probes
less often and waits longer before it accuses others or declares them dead.
"""

from __future__ import annotations

import math

from ..config import PeerConfig


def suspicion_bounds(mult: float, max_mult: float, members: int, interval: float,
                     ) -> tuple[float, float]:
    """``(min, max)`` suspicion timeouts for a cluster of ``members`` peers."""
    low = mult * max(1.0, math.log10(max(1, members))) * interval
    return low, low * max_mult


class Suspicion:
    """One member under suspicion at one incarnation, with its confirmations."""

    __slots__ = ("accusers", "expected", "incarnation", "max_timeout", "min_timeout", "start")

    def __init__(self, start: float, incarnation: int, accuser: str, expected: int,
                 min_timeout: float, max_timeout: float) -> None:
        self.start = start
        self.incarnation = incarnation
        self.expected = expected
        self.min_timeout = min_timeout
        self.max_timeout = max_timeout
        # The first accuser started the timer; it does not count as a confirmation.
        self.accusers: dict[str, None] = {accuser: None}

    @classmethod
    def for_cluster(cls, start: float, incarnation: int, accuser: str, members: int,
                    config: PeerConfig, health: Health) -> Suspicion:
        """Timeouts for a cluster of ``members``, stretched by our own ill health.  As
        memberlist does, expect ``suspicion_mult - 2`` confirmations (none in a cluster
        too small to give them): the nominal timeout is hit two probe intervals early."""
        low, high = suspicion_bounds(config.suspicion_mult, config.suspicion_max_mult,
                                     members, config.probe_interval)
        expected = int(config.suspicion_mult) - 2
        return cls(start, incarnation, accuser, 0 if members - 2 < expected else expected,
                   health.scale(low), health.scale(high))

    @property
    def confirmations(self) -> int:
        return len(self.accusers) - 1

    def confirm(self, accuser: str) -> bool:
        """Count ``accuser``; True when it is new and still shortens the timeout."""
        if self.confirmations >= self.expected or accuser in self.accusers:
            return False
        self.accusers[accuser] = None
        return True

    def deadline(self) -> float:
        if self.expected < 1:
            return self.start + self.min_timeout
        frac = math.log(self.confirmations + 1) / math.log(self.expected + 1)
        timeout = self.max_timeout - frac * (self.max_timeout - self.min_timeout)
        return self.start + max(self.min_timeout, timeout)


class Health:
    """Lifeguard's local health score: 0 is healthy, ``limit - 1`` is the worst."""

    __slots__ = ("limit", "score")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.score = 0

    def apply(self, delta: int) -> None:
        self.score = min(self.limit - 1, max(0, self.score + delta))

    def scale(self, timeout: float) -> float:
        return timeout * (self.score + 1)
