"""The coordinator of a simulated fan-out: the real :class:`~tensorhub.protocol.planner.
Planner`, asked as :mod:`tensorhub.protocol.coordination` asks it.

Either the plan is made once with every reader as a fetcher (:meth:`SimCoordinator.
sources`), or each reader registers when it starts and asks again while it runs
(:meth:`SimCoordinator.ask`): a first ask plans it in (``add_fetcher``, which may make
the plan afresh), a later one gets the current plan after ``reconsider``, as
``Coordination._plan_for`` does.  The engine (:mod:`simulations.transfer_engine`) puts
the round trips around each ask and applies a newer plan with
``TransferSession.replan``.
"""

from __future__ import annotations

from tensorhub.protocol.planner import Planner, PlannerConfig, SourceRange
from tensorhub.protocol.topology import NodeInfo, Topology, TopologyConfig

from .transfer_setup import KEY, Setup


class SimCoordinator:
    def __init__(self, setup: Setup, chunks: int) -> None:
        self.setup, self.chunks = setup, chunks
        self.planner: Planner | None = None
        self.asks = 0
        """Asks answered (first ones and re-asks)."""

    def _topology(self) -> Topology:
        s = self.setup
        wan = min((rate for rate, _ in s.wan.values()), default=25e9)
        return Topology(TopologyConfig(wan_bps=wan, cross_dc_bps=wan), tuple(
            NodeInfo(h.name, h.dc, "", h.name, h.up, h.down) for h in s.hosts
            if h.name == s.publisher or h.name in s.readers))

    def _new(self, fetchers: list[str]) -> Planner:
        s = self.setup
        config = PlannerConfig() if s.rebuild else PlannerConfig(rebuild_max_peers=0)
        return Planner(KEY, s.size, self.chunks, self._topology(), {s.publisher: None},
                       fetchers, config=config)

    def sources(self, reader: str) -> tuple[SourceRange, ...]:
        """``reader``'s part of the plan made once with every planned reader."""
        if self.planner is None:
            self.planner = self._new([r for r in self.setup.readers
                                      if r not in self.setup.upstream])
        return self.planner.sources(reader)

    def ask(self, reader: str) -> tuple[tuple[SourceRange, ...], int]:
        """``reader`` asks (to register, or again): its sources and the plan's epoch."""
        self.asks += 1
        if self.planner is None:
            self.planner = self._new([reader])
        elif reader not in self.planner.participants:
            self.planner.add_fetcher(reader)
        else:
            self.planner.reconsider()
        return self.planner.sources(reader), self.planner.epoch

    @property
    def bound_s(self) -> float | None:
        return None if self.planner is None else self.planner.plan.bound_s
