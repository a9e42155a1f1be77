"""The paper's workloads, our ablations and the baselines, on the simulated fabric.

Theory of operation
-------------------
A model of ``size`` bytes is trained with TP x PP (``train_tp`` x ``train_pp`` GPUs on
``train_pp`` hosts) and served by rollout instances of ``roll_tp`` GPUs, one per host.
Rollout GPU of TP rank ``r`` needs its slice of every stage; the slice of stage ``s`` is
held by trainer GPU ``(s, r * train_tp // roll_tp)``.  Each (stage, rank) slice is one
fan-out (:class:`~simulations.dataplane.fanouts.Fanout`) of ``size / (roll_tp x
train_pp)`` bytes to the rank-``r`` GPUs of every instance, all at once on one fabric:
a rollout GPU reads ``train_pp`` slices through one NIC.

*Stall* is GPU time a rollout spends not generating because of the update.  An
instance switches when its last GPU has its last slice, then copies the staged slice
into its live weights (``flip``, at HBM speed); stop-and-broadcast stops every rollout
GPU for the broadcast (:mod:`.baselines`).  With a *staged flip* rollouts keep
generating on the old version for ``overlap_s`` after the publish, so only what is
left after that stalls.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from tensorhub.protocol.sizing import choose_chunk_size

from . import baselines as b
from .fabric import Fabric, FabricSpec
from .fanouts import Fanout, RunResult, new_fabric, run

KRAKEN_BLOB = 3_000_000_000


@dataclass(frozen=True)
class Options:
    size: float = 140e9
    """A 70B-parameter model in bf16."""
    train_tp: int = 8
    train_pp: int = 4
    roll_tp: int = 8
    rollout_hosts: int = 128
    chunks: int = 16
    """Chunks per slice (a parameter: coarse chunks keep 1,024 GPUs fast)."""
    flip_bps: float = 2e12
    overlap_s: float = 0.5
    oversubscription: float = 1.0
    wave_s: float = 0.2
    waves: int = 4
    store_bps: float = 100e9
    seed: int = 0

    @property
    def slice_bytes(self) -> int:
        return int(self.size / (self.roll_tp * self.train_pp))

    def spec(self) -> FabricSpec:
        return FabricSpec(gpus_per_host=self.roll_tp, oversubscription=self.oversubscription)


@dataclass
class Outcome:
    """One simulated run of a workload: per instance, when it switched (from its join)."""

    instance_s: list[float]
    result: RunResult
    wall_s: float
    readers: int

    @property
    def makespan(self) -> float:
        return max(self.instance_s)

    def stall(self, o: Options, overlap_s: float = 0.0) -> float:
        """GPU-seconds of stall over every rollout GPU."""
        flip = o.size / o.roll_tp / o.flip_bps
        return sum(o.roll_tp * (max(0.0, t - overlap_s) + flip) for t in self.instance_s)


def cluster(o: Options, dcs: tuple[int, ...], spec: FabricSpec | None = None
            ) -> tuple[Fabric, list[list[str]], list[list[str]]]:
    """Trainer hosts in the first DC, then ``dcs[i]`` rollout hosts in ``dc{i}``, on
    ``spec`` (default ``o.spec()``)."""
    fabric = new_fabric(spec or o.spec())
    trainer = fabric.add_hosts("dc0", o.train_pp, "t")
    rollouts = [g for i, n in enumerate(dcs) for g in fabric.add_hosts(f"dc{i}", n, "r")]
    return fabric, trainer, rollouts


def slices(o: Options, trainer: list[list[str]], readers: list[list[str]],
           holders: list[list[str]] = (), joins: dict[int, float] | None = None,
           chunks: int | None = None, **kw: Any) -> list[Fanout]:
    """One fan-out per (stage, rollout rank), read by ``readers`` (hosts), held by the
    trainer GPU that owns it and by the ``holders`` hosts' GPU of that rank."""
    size, c = o.slice_bytes, chunks or o.chunks
    fans = []
    for s in range(o.train_pp):
        for r in range(o.roll_tp):
            owner = trainer[s][r * o.train_tp // o.roll_tp]
            when = {} if joins is None else {readers[i][r]: t for i, t in joins.items()}
            fans.append(Fanout(f"s{s}r{r}", (owner, *(h[r] for h in holders)),
                               tuple(h[r] for h in readers), size, -(-size // c),
                               joins=when, **kw))
    return fans


def simulate(o: Options, fabric: Fabric, fans: list[Fanout], hosts: list[list[str]],
             joins: dict[int, float] | None = None,
             kills: tuple[tuple[float, str], ...] = (), until: float = math.inf) -> Outcome:
    started = time.perf_counter()
    res = run(fans, fabric, seed=o.seed, kills=kills, until=until)
    wall = time.perf_counter() - started
    done = {g: t for f in res.fanouts.values() for g, t in f.done.items()}
    late: dict[str, float] = {}
    for f in res.fanouts.values():
        for g, t in f.done.items():
            late[g] = max(late.get(g, 0.0), t)
    dead = {g for _, g in kills}
    out = []
    for i, gpus in enumerate(hosts):
        live = [g for g in gpus if g not in dead]
        if all(g in done for g in live):
            out.append(max(late[g] for g in live) - (joins or {}).get(i, 0.0))
        else:
            out.append(math.inf)
    return Outcome(out, res, wall, sum(len(f.readers) for f in fans))


# -- the workloads ------------------------------------------------------------------------

def standalone(o: Options, **kw: Any) -> Outcome:
    fabric, trainer, rollouts = cluster(o, (o.rollout_hosts,))
    return simulate(o, fabric, slices(o, trainer, rollouts, **kw), rollouts)


def broadcast_stalls(o: Options, gpus: int) -> dict[str, float]:
    """GPU-seconds every baseline stalls ``gpus`` rollout GPUs."""
    spec = o.spec()
    gather = b.gather_s(o.size, o.train_pp, spec.nvlink_bps)
    each = o.size / o.roll_tp
    return {
        "ring": gpus * (gather + b.ring_broadcast_s(o.size, gpus, spec.nic_bps, o.train_pp)),
        "tree": gpus * (gather + b.tree_broadcast_s(o.size, gpus, spec.nic_bps, o.train_pp)),
        "checkpoint_engine": gpus * (gather + b.checkpoint_engine_s(
            o.size, gpus, spec.nic_bps, o.train_pp)),
        "star": gpus * b.star_s(gpus, each, o.train_tp * o.train_pp * spec.nic_bps,
                                spec.nic_bps),
        "storage": gpus * b.storage_s(o.size, gpus, each, o.store_bps, spec.nic_bps),
    }


def logdepth_bound(o: Options, readers_per_slice: int) -> float:
    """Pipelined broadcast of C chunks to n readers through one NIC each: C - 1 +
    ceil(log2(n + 1)) chunk-times (the single-port optimum), for the slices a GPU
    reads at once sharing its NIC."""
    shard = o.size / o.roll_tp
    return shard / o.spec().nic_bps * (1 + (math.ceil(math.log2(readers_per_slice + 1)) - 1)
                                       / o.chunks)


def elastic(o: Options, *, star: bool = False) -> tuple[Outcome, Outcome]:
    """Spot instances join during an update: half the rollout hosts start pulling the
    version at its publish, the other half join in ``waves`` ``wave_s`` apart while it
    moves.  Ours: every instance registers with the coordinator as it starts (as peers
    do) and pulls along the plan.  Star: every instance pulls each slice from the
    trainer GPU that owns it.  Returns (the joiners, the instances there at the
    publish), each timed from its own start."""
    fabric, trainer, rollouts = cluster(o, (o.rollout_hosts,))
    half = o.rollout_hosts // 2
    joiners = rollouts[half:]
    joins = {half + i: (1 + i * o.waves // len(joiners)) * o.wave_s
             for i in range(len(joiners))}
    if star:
        fans = [replace(f, upstream=dict.fromkeys(f.readers, frozenset(f.holders)))
                for f in slices(o, trainer, rollouts, joins=joins, plan=False)]
    else:
        fans = slices(o, trainer, rollouts, joins=joins, incremental=True)
    out = simulate(o, fabric, fans, rollouts, joins)
    return (Outcome(out.instance_s[half:], out.result, out.wall_s, out.readers),
            Outcome(out.instance_s[:half], out.result, out.wall_s, out.readers))


def crossdc(o: Options, **kw: Any) -> Outcome:
    """Half the rollout hosts in a remote DC behind the WAN link."""
    half = o.rollout_hosts // 2
    fabric, trainer, rollouts = cluster(o, (half, o.rollout_hosts - half))
    return simulate(o, fabric, slices(o, trainer, rollouts, **kw), rollouts)


def crossdc_naive_stalls(o: Options) -> dict[str, float]:
    """GPU-seconds the naive cross-DC baselines stall every rollout GPU (half of them
    remote): each GPU pulls its shard from the trainer (the remote ones all over the
    WAN link), or one stop-and-broadcast spans both DCs."""
    spec, gpus = o.spec(), o.rollout_hosts * o.roll_tp
    remote = (o.rollout_hosts - o.rollout_hosts // 2) * o.roll_tp
    local, each = gpus - remote, o.size / o.roll_tp
    trainer_up = o.train_tp * o.train_pp * spec.nic_bps
    bcast = b.gather_s(o.size, o.train_pp, spec.nvlink_bps) + b.wan_broadcast_s(
        o.size, gpus, spec.nic_bps, spec.wan_bps, o.train_pp, spec.wan_rtt_s)
    return {"every GPU pulls (remote ones over the WAN)":
            local * b.star_s(local, each, trainer_up, spec.nic_bps)
            + remote * b.wan_star_s(remote, each, spec.wan_bps, spec.nic_bps),
            "stop-and-broadcast across the WAN": gpus * bcast}


def resourcing(o: Options, base: Outcome) -> tuple[Outcome, str]:
    """``standalone`` with the GPU that relayed the most killed at 30% of its makespan."""
    relayed: dict[str, int] = {}
    for f in base.result.fanouts.values():
        for by in f.bytes_by_source.values():
            for src, n in by.items():
                if src.startswith("r"):
                    relayed[src] = relayed.get(src, 0) + n
    victim = max(sorted(relayed), key=lambda g: relayed[g])
    fabric, trainer, rollouts = cluster(o, (o.rollout_hosts,))
    return simulate(o, fabric, slices(o, trainer, rollouts), rollouts,
                    kills=((0.3 * base.makespan, victim),)), victim


def kraken(hosts: int, chunks: int | None = None, seed: int = 0) -> Outcome:
    """Uber Kraken's published test: a 3 GB blob to ``hosts`` hosts, each NIC capped at
    300 MB/s both ways; one origin; one plan with every agent (they all ask at once).
    ``chunks``: None, the chunk size the origin chooses for 3 GB in a mesh of ``hosts +
    1`` peers (2,601 peers: 4 MiB, 716 chunks)."""
    spec = FabricSpec(gpus_per_host=1, hosts_per_leaf=40, nic_bps=300e6, rtt_s=2e-4)
    fabric = new_fabric(spec)
    origin = fabric.add_hosts("dc0", 1, "o")[0][0]
    agents = [h[0] for h in fabric.add_hosts("dc0", hosts, "a")]
    size = KRAKEN_BLOB
    chunk = choose_chunk_size(size, peers=hosts + 1)[0] if chunks is None else \
        -(-size // chunks)
    fan = Fanout("blob", (origin,), tuple(agents), size, chunk)
    o = Options(seed=seed)
    return simulate(o, fabric, [fan], [[a] for a in agents])


def kraken_lag_s(hosts: int, chunks: int, nic_bps: float = 300e6) -> float:
    """What per-chunk store-and-forward adds over ``KRAKEN_BLOB / nic_bps`` along a
    binary tree of ``hosts`` (two stripes; a parent sends each chunk to two children):
    one chunk-time at half the NIC per level."""
    return math.log2(hosts + 1) * 2 * KRAKEN_BLOB / chunks / nic_bps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def mean(values: list[float]) -> float:
    return statistics.fmean(values)
