"""Scenario registry, run settings and the figures a scenario reports.

A scenario is a function ``(Context) -> list[Figure]`` registered under a name with
``@scenario``; ``control_plane`` runs the registered ones in order and prints each
figure next to its bound.  To add figures (the coordinator's, the reference table's),
write a module with more ``@scenario`` functions and list it in
``control_plane.SCENARIO_MODULES``.  Every run's trace hash goes through
:meth:`Context.record`, and the ``trace_hash`` figure hashes them all in order.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensorhub.config import PeerConfig

from .engine import LinkModel, Simulation

C_ROUNDS = 2.0   # c in "c * log2(N) gossip rounds": the dissemination bound
M_PROBES = 2.0   # m in "m * T_probe": until someone probes the dead peer and gives up


@dataclass(frozen=True)
class Figure:
    name: str
    value: float | str
    unit: str
    bound: float | None
    better: str | None  # "higher", "lower", or None (no ordering, e.g. a hash)
    detail: str = ""

    def within(self) -> bool:
        if self.bound is None or isinstance(self.value, str):
            return True
        return self.value <= self.bound if self.better == "lower" else self.value >= self.bound

    def as_json(self) -> dict[str, Any]:
        value = self.value
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        return {"name": self.name, "value": value, "unit": self.unit, "bound": self.bound,
                "better": self.better}


Scenario = Callable[["Context"], list[Figure]]
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} registered twice")
        SCENARIOS[name] = fn
        return fn

    return register


@dataclass
class Context:
    """What every scenario shares: sizes, seeds, timers, link, warm clusters, traces."""

    nodes: int = 1000
    seeds: int = 20
    hour: float = 3600.0           # virtual length of the slow-peer run
    hour_seeds: int = 1
    partition_nodes: int = 256
    partition_seeds: int = 3
    partition_durations: tuple[float, ...] = (10.0, 120.0, 1800.0)
    config: PeerConfig = field(default_factory=lambda: PeerConfig.datacenter("sim"))
    link: LinkModel = field(default_factory=LinkModel)
    log: Callable[[str], None] = print
    traces: list[str] = field(default_factory=list)
    _warm: dict[int, bytes] = field(default_factory=dict)

    def seed_list(self, count: int) -> list[int]:
        return list(range(1, count + 1))

    def warm(self, n: int) -> bytes:
        """A snapshot of ``n`` peers that have run until their gossip went quiet."""
        if n not in self._warm:
            started = time.perf_counter()
            sim = Simulation(0, self.config, self.link)
            sim.bootstrap(n)
            while not quiet(sim):
                sim.run_until(sim.now + 5.0)
            self._warm[n] = sim.snapshot()
            self.log(f"  (warm cluster of {n} peers: quiet at t={sim.now:.0f} s virtual, "
                     f"{time.perf_counter() - started:.1f} s wall)")
        return self._warm[n]

    def sim(self, n: int, seed: int) -> Simulation:
        return Simulation.restore(self.warm(n), seed)

    def record(self, sim: Simulation) -> str:
        digest = sim.trace_hash()
        self.traces.append(digest)
        return digest

    def combined_trace(self) -> str:
        h = hashlib.sha256()
        for digest in self.traces:
            h.update(bytes.fromhex(digest))
        return h.hexdigest()


def quiet(sim: Simulation) -> bool:
    """No peer has gossip left to send."""
    return all(node.statistics().broadcast_queue == 0 for node in sim.nodes if node)


def one_view(sim: Simulation) -> bool:
    """Every live peer holds the same view: exactly the live peers, all alive."""
    live = sim.live()
    digests = {sim.nodes[i].digest() for i in live}  # type: ignore[union-attr]
    if len(digests) != 1:
        return False
    stats = sim.nodes[live[0]].statistics()  # type: ignore[union-attr]
    return stats.suspect == 0 and stats.alive == len(live)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); inf for an empty list."""
    if not values:
        return math.inf
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run_checked(sim: Simulation, end: float, step: float, done: Callable[[], bool]) -> bool:
    """Run to ``end``, checking ``done()`` every ``step`` virtual seconds."""
    finished = False

    def check() -> None:
        nonlocal finished
        finished = done()
        if not finished and sim.now + step <= end:
            sim.at(sim.now + step, check)

    sim.at(sim.now, check)
    sim.run_until(end, stop=lambda: finished)
    return finished


def print_table(figures: list[Figure], out: Callable[[str], None] = print) -> None:
    out(f"{'figure':<32} {'value':>14} {'bound':>12}  {'ok':<3} detail")
    for f in figures:
        value = f.value if isinstance(f.value, str) else f"{f.value:.3g} {f.unit}".strip()
        bound = "" if f.bound is None else f"{'<=' if f.better == 'lower' else '>='} {f.bound:g}"
        ok = "" if f.bound is None else ("yes" if f.within() else "NO")
        out(f"{f.name:<32} {value:>14} {bound:>12}  {ok:<3} {f.detail}")
