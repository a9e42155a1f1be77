"""The fan-out across a real WAN (issue 41): rollout GPUs spread over four DCs whose
every ordered pair has a link of its own, on five shapes of WAN.

Theory of operation
-------------------
The model, its slices and the hosts are :mod:`.workloads`' (140 GB, TP 8 x PP 4 on the
trainer, 8 GPUs and 400 Gb/s NICs per host); the trainer sits in ``dc0`` and the rollout
hosts are dealt evenly over ``dc0..dc3``.  The DCs are joined by links of 10-800 Gb/s, a
fraction of what a DC's NICs move (32 hosts x 8 x 400 Gb/s), so the WAN is what limits
every remote DC.  Each :class:`Shape` is a map ``(src DC, dst DC) -> (Gb/s, ms)`` that
becomes the fabric's per-pair links (:attr:`~.fabric.FabricSpec.wan`) and what the
coordinator is told of them (declared ``[[link]]`` tables).

What a run is held against:

* :func:`cut_bound_s`: :func:`tensorhub.protocol.topology.cut_bound` with the fabric's
  rates.  A rollout GPU needs one TP shard (``size / roll_tp``), not the model, so the
  bound is taken for one TP rank's problem -- the trainer's GPUs at ``1/roll_tp`` of
  their NIC (together they upload rank ``r``'s shard at the rate all of them upload the
  model), one GPU per rollout host, each DC link at ``1/roll_tp`` of its rate (the
  ``roll_tp`` ranks share it).  Each of its terms is a cut of the whole problem: a set of
  DCs must take in the whole model over its links, and every shard its hosts need comes
  over those links or from an upload inside it.  Taking every GPU as wanting the whole
  model would be eight times too high on the GPU terms, and no bound.
* the least inter-DC bytes: every remote DC with rollouts takes in the model once.
* baselines: the same planner told nothing of the links (it plans every pair at the
  fabric's default rate, as it did before per-pair links; simulated), and two closed
  forms: each remote DC fed once over its direct link from ``dc0``, and every rollout
  GPU pulling its shard from the trainer (:func:`.baselines.wan_star_s` per DC).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tensorhub.protocol.topology import cut_bound

from . import baselines as b
from .fabric import GBIT, FabricSpec
from .workloads import Options, cluster, simulate, slices

DCS = ("dc0", "dc1", "dc2", "dc3")
HOME = DCS[0]
"""Where the trainer is."""

HORIZON = 4.0
"""A run is stopped at this many times what every GPU pulling its shard takes (the worst
schedule that sends no byte twice over one link)."""

Links = Mapping[tuple[str, str], tuple[float, float]]
"""``(src DC, dst DC) -> (Gb/s, round trip ms)``."""


@dataclass(frozen=True)
class Shape:
    name: str
    what: str
    links: Links


def _pair(a: str, b: str, there: float, back: float, rtt_ms: float) -> Links:
    return {(a, b): (there, rtt_ms), (b, a): (back, rtt_ms)}


def _mesh(*pairs: Links) -> Links:
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for p in pairs:
        out.update(p)
    assert set(out) == {(a, c) for a in DCS for c in DCS if a != c}, "every pair given"
    return out


SHAPES = (
    Shape("uniform", "every pair alike: 400 Gb/s each way, 30 ms",
          _mesh(*(_pair(a, c, 400, 400, 30) for i, a in enumerate(DCS) for c in DCS[i + 1:]))),
    Shape("asymmetric", "every pair a different rate each way (100-800 Gb/s)",
          _mesh(_pair("dc0", "dc1", 800, 100, 20), _pair("dc0", "dc2", 400, 200, 40),
                _pair("dc0", "dc3", 100, 400, 60), _pair("dc1", "dc2", 200, 600, 30),
                _pair("dc1", "dc3", 600, 100, 50), _pair("dc2", "dc3", 300, 100, 40))),
    Shape("detour", "dc0>dc3 direct at 50 Gb/s, 8x slower than dc0>dc1>dc3 (400 each)",
          _mesh(_pair("dc0", "dc1", 400, 400, 20), _pair("dc1", "dc3", 400, 400, 20),
                _pair("dc0", "dc3", 50, 50, 80), _pair("dc0", "dc2", 200, 200, 30),
                _pair("dc1", "dc2", 100, 100, 30), _pair("dc2", "dc3", 100, 100, 30))),
    Shape("transit", "dc3 useful only through dc2 (400 Gb/s; 10 from dc0 and dc1)",
          _mesh(_pair("dc0", "dc1", 400, 400, 20), _pair("dc0", "dc2", 400, 400, 20),
                _pair("dc1", "dc2", 200, 200, 30), _pair("dc2", "dc3", 400, 400, 20),
                _pair("dc0", "dc3", 10, 10, 150), _pair("dc1", "dc3", 10, 10, 150))),
    Shape("split", "dc3 best fed over dc1>dc3 and dc2>dc3 (200 Gb/s each; 50 direct)",
          _mesh(_pair("dc0", "dc1", 400, 100, 20), _pair("dc0", "dc2", 400, 100, 20),
                _pair("dc1", "dc3", 200, 100, 30), _pair("dc2", "dc3", 200, 100, 30),
                _pair("dc0", "dc3", 50, 50, 60), _pair("dc1", "dc2", 100, 100, 20))),
)


def spec_of(o: Options, shape: Shape) -> FabricSpec:
    """``o``'s fabric with ``shape``'s links."""
    return replace(o.spec(), wan={k: (gbit * GBIT, ms / 1e3)
                                  for k, (gbit, ms) in shape.links.items()})


def spread(hosts: int, dcs: int = len(DCS)) -> tuple[int, ...]:
    """``hosts`` dealt over ``dcs`` DCs, the first ones one more where it does not divide."""
    return tuple(hosts // dcs + (i < hosts % dcs) for i in range(dcs))


def cut_bound_s(o: Options, spec: FabricSpec, hosts: tuple[int, ...]) -> float:
    """The cut bound of one TP rank's problem (see the module docstring)."""
    trainer = [(HOME, spec.nic_bps / o.roll_tp)] * (o.train_tp * o.train_pp)
    fetchers = [(DCS[i], spec.nic_bps, spec.nic_bps) for i, n in enumerate(hosts)
                for _ in range(n)]
    return cut_bound(o.size / o.roll_tp, trainer, fetchers,
                     lambda a, c: spec.wan_link(a, c)[0] / o.roll_tp)


def direct_feed_s(o: Options, spec: FabricSpec, hosts: tuple[int, ...]) -> float:
    """Each remote DC takes the model once over its direct link from ``dc0`` and passes
    it on inside at NIC rate, pipelined (a lower bound of that schedule)."""
    feeds = [o.size / spec.wan_link(HOME, DCS[i])[0] for i, n in enumerate(hosts)
             if n and DCS[i] != HOME]
    return max([o.size / o.roll_tp / spec.nic_bps, *feeds])


def pull_s(o: Options, spec: FabricSpec, hosts: tuple[int, ...]) -> float:
    """Every rollout GPU pulls its shard from the trainer (remote ones over their DC's
    direct link from ``dc0``)."""
    each, gpus = o.size / o.roll_tp, [n * o.roll_tp for n in hosts]
    trainer_up = o.train_tp * o.train_pp * spec.nic_bps
    remote = [b.wan_star_s(g, each, spec.wan_link(HOME, DCS[i])[0], spec.nic_bps)
              for i, g in enumerate(gpus) if g and DCS[i] != HOME]
    return max([b.star_s(sum(gpus), each, trainer_up, spec.nic_bps), *remote])


@dataclass(frozen=True)
class Run:
    """One shape's fan-out and what it is held against (seconds, bytes)."""

    shape: Shape
    hosts: tuple[int, ...]
    makespan_s: float
    bound_s: float
    interdc_bytes: float
    min_interdc_bytes: float
    blind_s: float | None
    direct_feed_s: float
    pull_s: float
    per_dc_s: dict[str, float]
    """When each DC's last instance switched."""
    carried: dict[str, float]
    """Bytes over each DC link."""
    wall_s: float

    @property
    def vs_bound(self) -> float:
        return self.makespan_s / self.bound_s

    @property
    def bytes_vs_min(self) -> float:
        return self.interdc_bytes / self.min_interdc_bytes

    def raw(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {"shape": self.shape.name, "what": self.shape.what,
                "links": [{"from": a, "to": c, "gbit": g, "rtt_ms": ms}
                          for (a, c), (g, ms) in sorted(self.shape.links.items())],
                "rollout_hosts_per_dc": dict(zip(DCS, self.hosts, strict=True)),
                "makespan_s": self.makespan_s, "cut_bound_s": self.bound_s,
                "vs_cut_bound": self.vs_bound, "interdc_bytes": self.interdc_bytes,
                "min_interdc_bytes": self.min_interdc_bytes,
                "interdc_bytes_vs_min": self.bytes_vs_min, "blind_planner_s": self.blind_s,
                "direct_feed_s": self.direct_feed_s, "pull_s": self.pull_s,
                "per_dc_s": self.per_dc_s, "interdc_bytes_per_link": self.carried,
                "wall_s": self.wall_s}


def fanout(o: Options, shape: Shape, *, wan_known: bool = True) -> tuple[float, dict[str, float],
                                                                         dict[str, float]]:
    """Simulate ``shape``: the makespan, each DC's, and the bytes over each DC link.  A
    run still going at :data:`HORIZON` times :func:`pull_s` is stopped (its makespan
    infinite)."""
    hosts, spec = spread(o.rollout_hosts), spec_of(o, shape)
    fabric, trainer, rollouts = cluster(o, hosts, spec)
    out = simulate(o, fabric, slices(o, trainer, rollouts, wan_known=wan_known), rollouts,
                   until=HORIZON * pull_s(o, spec, hosts))
    per_dc: dict[str, float] = {}
    for gpus, t in zip(rollouts, out.instance_s, strict=True):
        dc = fabric.places[gpus[0]].dc
        per_dc[dc] = max(per_dc.get(dc, 0.0), t)
    carried = {n: v for n, v in sorted(out.result.carried.items()) if n.startswith("wan:")}
    return out.makespan, per_dc, carried


def measure(o: Options, shape: Shape, *, blind: bool = True) -> Run:
    """``shape`` with the coordinator told its links, next to its bound and baselines
    (with ``blind``, also simulated with a coordinator told nothing of them)."""
    began = time.perf_counter()
    hosts, spec = spread(o.rollout_hosts), spec_of(o, shape)
    makespan, per_dc, carried = fanout(o, shape)
    blind_s = fanout(o, shape, wan_known=False)[0] if blind else None
    remote = sum(1 for i, n in enumerate(hosts) if n and DCS[i] != HOME)
    return Run(shape, hosts, makespan, cut_bound_s(o, spec, hosts), sum(carried.values()),
               remote * o.size, blind_s, direct_feed_s(o, spec, hosts),
               pull_s(o, spec, hosts), per_dc, carried, time.perf_counter() - began)
