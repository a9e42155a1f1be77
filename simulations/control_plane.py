"""Run the control-plane scenarios and print every figure next to its bound.

    python -m simulations.control_plane --nodes 1000 --seeds 20 --json

prints a table, then (with ``--json``) one JSON object as the last line of stdout:
``{"figures": [{"name", "value", "unit", "bound", "better"}, ...], "settings": {...}}``.
Timers are ``PeerConfig.datacenter()``'s; the link is a LAN (0.5 ms + up to 0.5 ms).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from .report import SCENARIOS, Context, Figure, print_table

# Modules whose @scenario functions run, in this order (append new ones).
SCENARIO_MODULES = ("simulations.membership_scenarios", "simulations.coordinator_scenarios")


def main(argv: list[str] | None = None) -> int:
    for module in SCENARIO_MODULES:
        importlib.import_module(module)
    parser = argparse.ArgumentParser(prog="python -m simulations.control_plane",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000, help="peers in most scenarios")
    parser.add_argument("--seeds", type=int, default=20, help="seeds per scenario")
    parser.add_argument("--hour", type=float, default=3600.0,
                        help="virtual seconds of the slow-peer run")
    parser.add_argument("--hour-seeds", type=int, default=1, help="seeds of the slow-peer run")
    parser.add_argument("--partition-nodes", type=int, default=256)
    parser.add_argument("--partition-seeds", type=int, default=3)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                        help="run only these (repeatable); default: all")
    parser.add_argument("--quick", action="store_true",
                        help="small and short: 64 peers, 2 seeds, 10 virtual minutes")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    ctx = Context(nodes=args.nodes, seeds=args.seeds, hour=args.hour,
                  hour_seeds=args.hour_seeds, partition_nodes=args.partition_nodes,
                  partition_seeds=args.partition_seeds)
    if args.quick:
        ctx = Context(nodes=64, seeds=2, hour=600.0, hour_seeds=1, partition_nodes=64,
                      partition_seeds=1, partition_durations=(10.0, 120.0, 300.0))
    ctx.log = lambda line: print(line, file=sys.stderr, flush=True)
    figures: list[Figure] = []
    started = time.perf_counter()
    for name in args.scenario or list(SCENARIOS):
        t = time.perf_counter()
        ctx.log(f"scenario {name} ...")
        figures += SCENARIOS[name](ctx)
        ctx.log(f"  {name}: {time.perf_counter() - t:.1f} s wall")
    figures.append(Figure("trace_hash", ctx.combined_trace(), "sha256", None, None,
                          f"over {len(ctx.traces)} runs' delivered-message traces"))
    print_table(figures)
    settings = {
        "nodes": ctx.nodes, "seeds": ctx.seeds, "hour_s": ctx.hour,
        "hour_seeds": ctx.hour_seeds, "partition_nodes": ctx.partition_nodes,
        "partition_seeds": ctx.partition_seeds,
        "partition_durations_s": list(ctx.partition_durations),
        "timers": "PeerConfig.datacenter()",
        "probe_interval_s": ctx.config.probe_interval,
        "probe_timeout_s": ctx.config.probe_timeout,
        "gossip_interval_s": ctx.config.gossip_interval,
        "push_pull_interval_s": ctx.config.push_pull_interval,
        "link": {"delay_s": ctx.link.delay, "jitter_s": ctx.link.jitter},
        "scenarios": args.scenario or list(SCENARIOS),
        "wall_s_total": round(time.perf_counter() - started, 1),
    }
    if args.json:
        print(json.dumps({"figures": [f.as_json() for f in figures], "settings": settings}))
    return 0 if all(f.within() for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
