"""Many fan-outs at once on one fabric, each run by the transfer simulator's engine
(:class:`simulations.transfer_engine.Sim`: every reader a real
:class:`~tensorhub.protocol.transfer.TransferSession`, every plan the real
:class:`~tensorhub.protocol.planner.Planner` asked as the coordinator asks it).

Theory of operation
-------------------
A :class:`Fanout` is one version (or one shard of one, as a sharded fetch moves it):
its original holders, its readers and when each joins.  Every fan-out gets its own
``Sim`` (its own coordinator, sessions, holder view), but all share one clock, one heap
of events and one :class:`~simulations.flows.Network` on one
:class:`~simulations.dataplane.fabric.Fabric`: a GPU that reads four shards at once
shares its NIC between them, and shards that cross the same leaf uplink share it.
Ties in the queue are broken by insertion order, and the readers' start jitter comes
from the seed, so one seed gives one run.  The coordinator plans with the topology a
peer gossips (DC, leaf as rack, host labels; NIC rates) unless ``topology_aware`` is
off (every peer then looks alike), with the fabric's speeds per locality class (a
leaf's switch at NIC rate, the spine at NIC rate over the oversubscription), and with
each DC pair's link as an operator declares it (a :class:`~tensorhub.protocol.wan.Wan`
of the fabric's ``wan`` links) unless ``wan_known`` is off.  Chunks
here are coarse (hundreds of MB, so that a 140 GB model is tens of chunks); a reader's
in-flight limit is scaled with them (``max_inflight_bytes`` = ``fetch_window`` x
``MIN_CHUNKS`` chunks), so it keeps as many streams and chunks in flight as a peer does
with its own chunk size, and so is its ``stall_timeout`` (a limit per chunk: one chunk
here is as many of a peer's largest, ``MAX_AUTO_CHUNK``, as it holds), or a chunk that
needs longer than it over a thin link would be given up and asked for again for ever.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from tensorhub.config import PeerConfig
from tensorhub.protocol.planner import Planner, PlannerConfig
from tensorhub.protocol.sizing import MAX_AUTO_CHUNK, MIN_CHUNKS
from tensorhub.protocol.topology import NodeInfo, Topology, TopologyConfig
from tensorhub.protocol.wan import Wan

from ..events import EventQueue
from ..flows import Link, Network
from ..transfer_coord import SimCoordinator
from ..transfer_engine import Sim
from ..transfer_setup import KEY, Host, Setup
from .fabric import Fabric, FabricSpec


@dataclass(frozen=True)
class Fanout:
    """One version (or shard) moving from ``holders`` to ``readers``."""

    name: str
    holders: tuple[str, ...]
    """Hold every chunk at time 0; the first is the publisher."""
    readers: tuple[str, ...]
    size: int
    chunk_size: int
    joins: dict[str, float] = field(default_factory=dict)
    """Reader -> when it starts (unlisted: at 0), plus the start jitter."""
    plan: bool = True
    incremental: bool = False
    """Readers register with the coordinator as they start (as peers do)."""
    upstream: dict[str, frozenset[str]] = field(default_factory=dict)
    seeds_per_dc: int = 1
    topology_aware: bool = True
    wan_known: bool = True
    """The coordinator is told each DC pair's link (off: it knows none, and plans every
    pair at the fabric's ``wan_bps``, as before per-pair links)."""
    rebuild: bool = True


class Clock(EventQueue):
    """The shared virtual clock and queue of every fan-out of one run."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0


class FabricCoordinator(SimCoordinator):
    """The coordinator with the fabric's labels, several holders and the planner's
    configuration."""

    def __init__(self, setup: Setup, chunks: int, fabric: Fabric, fan: Fanout) -> None:
        super().__init__(setup, chunks)
        self.fabric, self.fan = fabric, fan

    def _topology(self) -> Topology:
        spec, fan = self.fabric.spec, self.fan
        nodes = [self.fabric.node(n) for n in (*fan.holders, *fan.readers)]
        if not fan.topology_aware:
            nodes = [NodeInfo(n.name, "", "", n.name, n.up_bps, n.down_bps) for n in nodes]
        return Topology(TopologyConfig(
            same_host_bps=spec.nvlink_bps, same_rack_bps=spec.nic_bps,
            same_dc_bps=spec.nic_bps / spec.oversubscription, cross_dc_bps=spec.wan_bps,
            wan_bps=spec.wan_bps), tuple(nodes),
            wan=Wan(spec.declared() if fan.wan_known else ()))

    def _new(self, fetchers: list[str]) -> Planner:
        s, fan = self.setup, self.fan
        config = PlannerConfig(seeds_per_dc=fan.seeds_per_dc)
        if not fan.rebuild:
            config = replace(config, rebuild_max_peers=0)
        return Planner(KEY, s.size, self.chunks, self._topology(),
                       dict.fromkeys(fan.holders), fetchers, config=config)


class FanoutSim(Sim):
    """One fan-out's engine on the shared clock, network and fabric."""

    def __init__(self, setup: Setup, fan: Fanout, fabric: Fabric, clock: Clock) -> None:
        self.fan, self.fabric, self.clock = fan, fabric, clock
        super().__init__(setup)
        self.net = fabric.net
        for h in fan.holders[1:]:
            self.have[h][:] = b"\1" * self.m.num_chunks
            self.advertised[h] = bytearray(b"\1" * self.m.num_chunks)

    @property  # type: ignore[override]
    def now(self) -> float:
        return self.clock.now

    @now.setter
    def now(self, value: float) -> None:
        pass  # the shared clock moves

    def new_coordinator(self) -> SimCoordinator:
        return FabricCoordinator(self.setup, self.m.num_chunks, self.fabric, self.fan)

    def at(self, when: float, fn: Callable[[float], None]) -> None:
        self.clock.at(when, fn)

    def rtt(self, a: str, b: str) -> float:
        return self.fabric.rtt(a, b)

    def links(self, src: str, dst: str) -> tuple[Link, ...]:
        return self.fabric.links(src, dst)


@dataclass
class FanoutResult:
    done: dict[str, float]
    failed: dict[str, str]
    bytes_by_source: dict[str, dict[str, int]]
    resourced: int
    bound_s: float | None


@dataclass
class RunResult:
    fanouts: dict[str, FanoutResult]
    end: float
    events: int
    trace: str
    carried: dict[str, float]
    """Bytes each link carried (``wan:...``, ``leaf-up:...``, ``up:...``)."""


def setup_of(fan: Fanout, fabric: Fabric, seed: int) -> Setup:
    nic, peer = fabric.spec.nic_bps, PeerConfig("sim")
    hosts = tuple(Host(n, fabric.places[n].dc, nic, nic) for n in (*fan.holders, *fan.readers))
    return Setup(hosts, fan.holders[0], fan.readers, fan.size, fan.chunk_size, plan=fan.plan,
                 incremental_plan=fan.incremental, upstream=fan.upstream,
                 rtt=fabric.spec.rtt_s, rebuild=fan.rebuild, seed=seed,
                 gossip_delay=0.001, detect_delay=0.2, start_jitter=0.001,
                 config=peer.replace(max_inflight_bytes=max(
                     512 << 20, peer.fetch_window * MIN_CHUNKS * fan.chunk_size),
                     stall_timeout=peer.stall_timeout * max(1.0, fan.chunk_size
                                                            / MAX_AUTO_CHUNK)))


def run(fans: list[Fanout], fabric: Fabric, *, seed: int = 0,
        kills: tuple[tuple[float, str], ...] = (), until: float = math.inf) -> RunResult:
    """Run every fan-out at once on ``fabric`` until each reader is done or failed, or
    the clock passes ``until`` (a reader not done then counts as failed)."""
    clock = Clock()
    fabric.net.queue = clock
    sims = [FanoutSim(setup_of(f, fabric, seed), f, fabric, clock) for f in fans]
    rng = random.Random(seed)
    for sim in sims:
        for name in sim.fan.readers:
            when = sim.fan.joins.get(name, 0.0) + rng.random() * sim.setup.start_jitter
            clock.at(when, partial(sim._start, sim.readers[name]))
    for when, gpu in kills:
        for sim in sims:
            if gpu in sim.hosts:
                clock.at(when, partial(sim.kill, gpu))
    events = 0
    while (nxt := clock.pop()) is not None and nxt[0] <= until:
        when, fn = nxt
        clock.now = when
        events += 1
        fn(when)
        if events % 256 == 0 and all(len(s.done) + len(s.failed) == len(s.readers)
                                     for s in sims):
            break
    trace = hashlib.sha256()
    out = {}
    for sim in sims:
        for name in sim.readers:
            if name not in sim.done and name not in sim.failed:
                sim.failed[name] = f"unfinished at t={clock.now}"
        trace.update(sim.trace.digest())
        out[sim.fan.name] = FanoutResult(
            dict(sim.done), dict(sim.failed),
            {r.name: dict(r.session.tally.bytes_by_source) for r in sim.readers.values()},
            sum(r.session.tally.resourced_chunks for r in sim.readers.values()),
            sim.coordinator.bound_s)
    end = max((t for f in out.values() for t in f.done.values()), default=math.inf)
    carried = {name: link.carried for name, link in fabric.net.links.items()}
    return RunResult(out, end, events, trace.hexdigest(), carried)


def new_fabric(spec: FabricSpec) -> Fabric:
    """A fabric on a fresh network (:func:`run` gives it the run's clock)."""
    return Fabric(spec, Network(EventQueue()))
