"""The command line of ``tensorhub bench cluster``: options, the cluster they describe,
the printed table and the ``--json`` line (the benchmark itself: :mod:`.cluster`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from typing import Any

from ..testing.clusterspec import ClusterSpec, load_topology, uniform
from .baselines import BASELINES, chunk_text, parse_chunk, parse_size
from .cluster import BASELINE_EXTRAS, BASELINE_KEYS, ClusterBenchError, Measured, measure, report
from .cluster_grid import run_grid
from .cluster_suite import run_suite
from .figures import print_figures


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """The cluster of ``--topology`` or of the shorthand flags (their defaults: 8 hosts,
    400 Mbit, 1 DC; 100 Mbit and a 20 ms round trip between DCs)."""
    shorthand = {"--hosts": args.hosts, "--nic-mbit": args.nic_mbit, "--dcs": args.dcs,
                 "--wan-mbit": args.wan_mbit, "--wan-rtt-ms": args.wan_rtt_ms}
    if args.topology is not None:
        given = [flag for flag, value in shorthand.items() if value is not None]
        if given:
            raise ClusterBenchError(f"--topology describes the whole cluster; drop "
                                    f"{', '.join(given)} (or edit the file)")
        spec = load_topology(args.topology)
        if spec.changes:
            raise ClusterBenchError(f"{args.topology} has [[change]] tables: only "
                                    "--topology-suite applies them (put it in a folder)")
        return spec
    hosts = 8 if args.hosts is None else args.hosts
    dcs = 1 if args.dcs is None else args.dcs
    if hosts < 2 * dcs:
        raise ClusterBenchError("need two hosts per DC with --dcs (or use --topology)")
    return uniform(hosts, 400.0 if args.nic_mbit is None else args.nic_mbit, dcs,
                   100.0 if args.wan_mbit is None else args.wan_mbit,
                   20.0 if args.wan_rtt_ms is None else args.wan_rtt_ms)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="the cluster as a TOML file: DCs, each host's NIC rate, each DC "
                        "pair's rate and round trip (docs/cluster.md); replaces the next "
                        "five flags")
    p.add_argument("--topology-suite", default=None, metavar="DIR",
                   help="run TensorHub's fan-out on every *.toml topology file of DIR "
                        "(declared links, then learned ones; no baselines) and report each "
                        "file and the worst (docs/cluster.md)")
    p.add_argument("--hosts", type=int, default=None,
                   help="emulated hosts: h0 is the trainer, the others rollouts (default 8)")
    p.add_argument("--nic-mbit", type=float, default=None,
                   help="each host's NIC, both ways (default 400)")
    p.add_argument("--dcs", type=int, default=None,
                   help="datacenters: hosts split in contiguous blocks; h0 in the first "
                        "(default 1)")
    p.add_argument("--wan-mbit", type=float, default=None,
                   help="each DC pair's link, each way (with --dcs > 1; default 100)")
    p.add_argument("--wan-rtt-ms", "--wan-delay-ms", dest="wan_rtt_ms", type=float,
                   default=None,
                   help="round trip each DC pair's link adds, half each way (with --dcs > 1; "
                        "default 20). --wan-delay-ms is the old name, same meaning: it was "
                        "always the round trip")
    p.add_argument("--size", type=parse_size, default=parse_size("256MiB"),
                   help="bytes per version (default 256MiB)")
    p.add_argument("--chunk", type=parse_chunk, default="auto",
                   help="the peers' chunk size (default auto: the system chooses from the "
                        "version's size; e.g. 4MiB forces one)")
    p.add_argument("--runs", type=int, default=1,
                   help="star and TensorHub fan-outs each (median); baselines run once")
    p.add_argument("--baselines", default=None,
                   help="comma-separated subset of star (plain TCP), gloo, ray; '' for none "
                        "(default star,gloo,ray; with --grid none)")
    p.add_argument("--plan", action=argparse.BooleanOptionalAction, default=True,
                   help="TensorHub fetchers follow the coordinator's plan (default); "
                        "--no-plan: they choose holders themselves")
    p.add_argument("--keys", choices=("off", "on", "both"), default="off",
                   help="on: every peer runs with keys; both: a keyed mesh next to the "
                        "keyless one, a keyed fan-out after or before each TensorHub one "
                        "(the cost of security)")
    p.add_argument("--grid", nargs="+", default=None, metavar="KEY=V1,V2",
                   help="run once per combination of settings and report the worst "
                        "figures; keys: wan-mbit, wan-rtt-ms, nic-mbit (e.g. --grid "
                        "wan-mbit=100,400 wan-rtt-ms=20,40,80)")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")


def check(args: argparse.Namespace) -> tuple[ClusterSpec, list[str]]:
    """The cluster and the chosen baselines; ``ClusterBenchError`` for options that
    cannot run here."""
    spec = cluster_spec(args)
    default = "" if args.grid else "star,gloo,ray"
    text = default if args.baselines is None else args.baselines
    chosen = [b.strip() for b in text.split(",") if b.strip()]
    for name in chosen:
        if name not in BASELINES:
            raise ClusterBenchError(f"unknown baseline {name!r}; choose from "
                                    f"{', '.join(BASELINES)}")
        if name in BASELINE_EXTRAS and importlib.util.find_spec(BASELINE_EXTRAS[name]) is None:
            raise ClusterBenchError(f"baseline {name} needs {BASELINE_EXTRAS[name]}: pip install "
                                    f"'tensorhub[bench]' (or --baselines without {name})")
    if len(spec.hosts) < 3 or args.runs < 1:
        raise ClusterBenchError("need at least 3 hosts and --runs >= 1")
    return spec, chosen


def check_suite(args: argparse.Namespace) -> None:
    """``ClusterBenchError`` for options ``--topology-suite`` does not take."""
    given = [flag for flag, value in (
        ("--topology", args.topology), ("--hosts", args.hosts), ("--nic-mbit", args.nic_mbit),
        ("--dcs", args.dcs), ("--wan-mbit", args.wan_mbit), ("--wan-rtt-ms", args.wan_rtt_ms),
        ("--grid", args.grid), ("--baselines", args.baselines)) if value not in (None, "")]
    if args.keys == "both":
        given.append("--keys both")
    if given:
        raise ClusterBenchError(f"--topology-suite runs the folder's files, TensorHub only; "
                                f"drop {', '.join(given)}")
    if args.runs < 1:
        raise ClusterBenchError("need --runs >= 1")


def run_cli(args: argparse.Namespace) -> int:
    if args.topology_suite is not None:
        check_suite(args)
        return run_suite(args)
    spec, chosen = check(args)
    if args.grid:
        return run_grid(args, spec, chosen)
    size, chunk = args.size, args.chunk
    print(f"cluster benchmark: trainer + {len(spec.hosts) - 1} rollouts; {spec.describe()}; "
          f"{size / 2**20:g} MiB, {chunk_text(chunk, size)}, "
          f"median of {args.runs} run(s), keys {args.keys}", flush=True)
    m, bound, mtu = measure(args, spec, size, chunk, chosen)
    rows, figures = report(m, bound, size, spec, args.plan)
    print(f"\nfluid lower bound: {bound:.2f} s")
    print(f"{'what':<40} {'seconds':>8} {'bound':>7} {'x bound':>8}  notes")
    for what, seconds, its_bound, note in rows:
        print(f"{what:<40} {seconds:>8.2f} {its_bound:>7.2f} {seconds / its_bound:>8.2f}  "
              f"{note}")
    print()
    print_figures(figures)
    if args.json:
        print(json.dumps(result_json(args, spec, m, bound, figures, chosen, mtu)))
    return 0


def result_json(args: argparse.Namespace, spec: ClusterSpec, m: Measured, bound: float,
                figures: list[dict[str, Any]], chosen: list[str], mtu: int
                ) -> dict[str, Any]:
    """The ``--json`` line of one run: figures, baselines, measured, settings."""
    uniform_nic = len({nic for _, nic in spec.hosts}) == 1
    link = spec.link(0, 1) if len(spec.dcs) > 1 else None
    return {
        "figures": figures,
        "baselines": {"fluid_bound_s": bound,
                      "star_s": statistics.median(f.seconds for f in m.star),
                      **{f"{BASELINE_KEYS[k]}_s": v for k, v in m.baselines.items()},
                      **{f"{BASELINE_KEYS[k]}_wan_bytes": v
                         for k, v in m.baseline_wan_bytes.items()},
                      **({"keyless_fanout_median_s": statistics.median(
                              f.seconds for f in m.tensorhub),
                          "keyed_fanout_median_s": statistics.median(
                              f.seconds for f in m.keyed)} if m.keyed else {})},
        "measured": {
            "tensorhub_s": [f.seconds for f in m.tensorhub],
            "keyed_tensorhub_s": [f.seconds for f in m.keyed],
            "star_s": [f.seconds for f in m.star],
            "tensorhub_wan_bytes": [f.wan_bytes for f in m.tensorhub],
            "star_wan_bytes": [f.wan_bytes for f in m.star],
            "remote_rollouts": m.remote,
            "tensorhub_remote_s": [f.completion_s(m.remote) for f in m.tensorhub]
            if m.remote else [],
            "star_remote_s": [f.completion_s(m.remote) for f in m.star] if m.remote else [],
            "tensorhub_done_s": [{n: f.completion_s([n]) for n in f.fetches}
                                 for f in m.tensorhub],
            "bytes_by_source": [f.sources() for f in m.tensorhub],
            "plans": [f.plans() for f in m.tensorhub],
            "joiner_host": m.joiner_host, "joiner_s": m.joiner["seconds"],
            "joiner_bytes_by_source": m.joiner["report"]["bytes_by_source"],
            "joiner_wan_bytes": m.joiner_wan_bytes,
            "busy_trainer_s": [f.fetches[m.joiner_host]["seconds"] for f in m.star],
        },
        "settings": {"hosts": len(spec.hosts), "rollouts": len(spec.hosts) - 1,
                     "nic_mbit": spec.hosts[0][1] if uniform_nic else None,
                     "size_bytes": args.size, "chunk_bytes": args.chunk or "auto",
                     "dcs": len(spec.dcs),
                     "wan_mbit": link.mbit if link else None,
                     "wan_rtt_ms": link.rtt_ms if link else None,
                     "topology_file": args.topology, "topology": spec.to_dict(),
                     "runs": args.runs, "plan": args.plan, "baselines": chosen,
                     "keys": args.keys, "mtu": mtu},
    }
