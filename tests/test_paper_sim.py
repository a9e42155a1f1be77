"""The data-plane simulator at small scale (simulations/dataplane, simulations/paper):
closed-form answers, determinism per seed, every workload and figure; virtual time
only."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from simulations.dataplane import workloads as w
from simulations.dataplane.fabric import FabricSpec
from simulations.dataplane.fanouts import Fanout, new_fabric, run
from simulations.events import EventQueue
from simulations.flows import Network
from simulations.paper.__main__ import main
from tensorhub.model import VersionKey
from tensorhub.protocol.planner import Planner
from tensorhub.protocol.topology import NodeInfo, Topology

NIC = FabricSpec().nic_bps
SMALL = replace(w.Options(), size=8e9, rollout_hosts=4, chunks=8)


def test_one_flow_on_one_link_takes_bytes_over_rate() -> None:
    net = Network(EventQueue())
    link = net.link("up:a", 100.0)
    flow = net.start(0.0, (link,), 250, lambda t: None)
    nxt = net.queue.pop()
    assert flow.rate == 100.0 and nxt is not None and nxt[0] == pytest.approx(2.5)


def _fabric_fan(readers: int, chunks: int, **kw: object) -> tuple[object, Fanout]:
    fabric = new_fabric(FabricSpec(gpus_per_host=1))
    src = fabric.add_hosts("dc0", 1, "t")[0][0]
    dst = tuple(h[0] for h in fabric.add_hosts("dc0", readers, "r"))
    size = chunks * (512 << 20)  # chunk-times far above the start jitter and round trips
    return fabric, Fanout("x", (src,), dst, size, 512 << 20, **kw)  # type: ignore[arg-type]


def test_a_star_from_one_source_takes_n_copies_over_its_uplink() -> None:
    fabric, fan = _fabric_fan(6, 8, plan=False)
    fan = replace(fan, upstream=dict.fromkeys(fan.readers, frozenset(fan.holders)))
    res = run([fan], fabric)  # type: ignore[arg-type]
    star = len(fan.readers) * fan.size / NIC
    assert star <= res.end <= 1.05 * star


def test_a_pipelined_chain_lags_one_chunk_time_a_level() -> None:
    depth, chunks = 4, 16
    fabric, fan = _fabric_fan(depth, chunks, plan=False)
    names = (fan.holders[0], *fan.readers)
    fan = replace(fan, upstream={names[i]: frozenset({names[i - 1]})
                                 for i in range(1, depth + 1)})
    res = run([fan], fabric)  # type: ignore[arg-type]
    link = fan.size / NIC
    floor = link * (1 + (depth - 1) / chunks)
    assert floor <= res.end <= 1.02 * floor


def test_the_same_seed_gives_the_same_run() -> None:
    seed = random.randrange(1000)
    print("seed", seed)
    o = replace(SMALL, seed=seed)
    a, b = w.standalone(o), w.standalone(o)
    assert a.result.trace == b.result.trace and a.instance_s == b.instance_s
    other = w.standalone(replace(o, seed=seed + 1))
    assert other.result.trace != a.result.trace


def test_the_standalone_pull_beats_the_fluid_floor_never_and_broadcast_by_far() -> None:
    out = w.standalone(SMALL)
    shard_time = SMALL.size / SMALL.roll_tp / NIC
    assert all(t >= shard_time for t in out.instance_s)
    stalls = w.broadcast_stalls(SMALL, 32)
    assert min(stalls["ring"], stalls["tree"]) > 3 * out.stall(SMALL)  # full tensors
    assert w.logdepth_bound(SMALL, 4) <= out.makespan


def test_each_workload_and_ablation_runs() -> None:
    for out in (w.standalone(SMALL, chunks=1), w.standalone(SMALL, topology_aware=False),
                *w.elastic(SMALL), *w.elastic(SMALL, star=True), w.crossdc(SMALL),
                w.crossdc(SMALL, seeds_per_dc=2), w.kraken(8, 8)):
        assert out.instance_s and all(t < float("inf") for t in out.instance_s)
    base = w.standalone(SMALL)
    killed, victim = w.resourcing(SMALL, base)
    assert victim.startswith("r") and all(t < float("inf") for t in killed.instance_s)


def test_elastic_joiners_come_during_the_update_and_the_star_shares_trainer_nics() -> None:
    shard = SMALL.size / SMALL.roll_tp / NIC
    o = replace(SMALL, rollout_hosts=8, wave_s=shard / 4)
    (joiners, there), (star, _) = w.elastic(o), w.elastic(o, star=True)
    assert len(joiners.instance_s) == len(there.instance_s) == 4
    assert max(there.instance_s) > o.wave_s  # the first joiners come during the update
    # star: each trainer GPU sends its slice (a quarter shard) to all 8 instances
    assert star.result.end >= 8 * shard / 4
    assert all(t >= shard for t in (*joiners.instance_s, *star.instance_s))


def test_naive_cross_dc_baselines_are_their_closed_forms() -> None:
    o = replace(SMALL, rollout_hosts=8)
    spec = o.spec()
    each, remote = o.size / o.roll_tp, 4 * o.roll_tp
    naive = w.crossdc_naive_stalls(o)
    pulls = naive["every GPU pulls (remote ones over the WAN)"]
    assert pulls >= remote * remote * each / spec.wan_bps  # the WAN carries every shard
    bcast = naive["stop-and-broadcast across the WAN"]
    assert bcast >= 2 * remote * o.size / spec.wan_bps  # every GPU waits for the WAN


def test_cross_dc_with_the_plan_crosses_the_wan_once() -> None:
    out = w.crossdc(SMALL)
    wan = sum(v for n, v in out.result.carried.items() if n.startswith("wan:"))
    assert wan / SMALL.size == pytest.approx(1.0, abs=0.05)


def test_the_command_prints_every_figure_and_one_json_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    main(["--rollout-hosts", "2", "--chunks", "4", "--kraken-hosts", "8",
          "--kraken-chunks", "8", "--no-plots", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = {f["name"] for f in out["figures"]}
    assert {"standalone_stall_vs_broadcast", "elastic_speedup_vs_star",
            "crossdc_stall_vs_naive", "eta_vs_logdepth_bound", "kraken_p50_s",
            "kraken_p99_s", "sim_vs_netns_error"} <= names
    assert all({"name", "value", "unit", "bound", "better"} <= f.keys()
               for f in out["figures"])


@pytest.mark.parametrize("seed", range(5))
def test_the_planners_pruned_scans_pick_what_a_full_scan_picks(seed: int) -> None:
    """The cheap locality/depth prefix only skips parents whose key is worse."""
    rng = random.Random(seed)
    nodes = tuple(NodeInfo(f"n{i}", rng.choice("ab"), f"r{rng.randrange(3)}",
                           f"h{rng.randrange(6)}", rng.choice([1e9, 4e9]), 4e9)
                  for i in range(40))
    p = Planner(VersionKey("m", 1), 64 << 20, 16, Topology(nodes=nodes), {"n0": None},
                [n.name for n in nodes[1:]])
    for j in range(len(p._stripes)):
        for v in [n.name for n in nodes[1:]]:
            depth = p._depths(j, avoid=v)
            full = min(((p._key(q, v, j, d), q) for q, d in depth.items()
                        if q != v and p._fits(q, j) and p._allowed(q, v, j)), default=None)
            assert p._best_parent(v, j, depth) == full


def test_only_runs_the_parts_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--rollout-hosts", "2", "--chunks", "4", "--no-plots", "--json",
          "--only", "elastic,validation"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {f["name"] for f in out["figures"]} == {"elastic_speedup_vs_star",
                                                   "sim_vs_netns_error"}
    with pytest.raises(SystemExit):
        main(["--only", "nothing"])
