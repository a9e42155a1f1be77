"""``tensorhub bench cluster --grid KEY=V1,V2 ...``: the cluster benchmark once per
combination of settings, and the worst figures over all of them.

Each combination builds its own cluster (the ``--topology`` file or the shorthand flags,
with the grid's keys applied: ``wan-mbit`` and ``wan-rtt-ms`` set every DC pair's link,
``nic-mbit`` every host's NIC) and runs the whole of :func:`~.cluster.measure`, so every
row is a complete, independent run. The figures are the worst over the grid:
``fanout_vs_fluid_bound_worst`` (bound 1.15 in one DC, 1.25 across DCs) and, with DCs,
``interdc_bytes_vs_size_worst`` (bound 1.05). Baselines are off unless ``--baselines``
names some.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from typing import Any

from ..testing.clusterspec import ClusterSpec
from .baselines import chunk_text
from .cluster import FANOUT_BOUND, INTERDC_BOUND, ClusterBenchError, measure, report
from .figures import figure, print_figures

GRID_KEYS = ("wan-mbit", "wan-rtt-ms", "nic-mbit")


def parse_grid(items: Sequence[str]) -> list[dict[str, float]]:
    """``["wan-mbit=100,400", "wan-rtt-ms=20,40"]`` -> every combination, in order."""
    axes: dict[str, list[float]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or key not in GRID_KEYS:
            raise ClusterBenchError(f"--grid expects KEY=V1,V2 with KEY one of "
                                    f"{', '.join(GRID_KEYS)}; got {item!r}")
        if key in axes:
            raise ClusterBenchError(f"--grid names {key} twice")
        try:
            numbers = [float(v) for v in values.split(",")]
        except ValueError:
            raise ClusterBenchError(f"--grid {key}: not numbers: {values!r}") from None
        if not numbers or any(not n >= 0 for n in numbers) or (
                key != "wan-rtt-ms" and any(n == 0 for n in numbers)):
            raise ClusterBenchError(f"--grid {key}: rates must be > 0, round trips >= 0")
        axes[key] = numbers
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def apply(spec: ClusterSpec, setting: dict[str, float]) -> ClusterSpec:
    """``spec`` with one grid setting applied."""
    if "nic-mbit" in setting:
        spec = spec.with_nics(setting["nic-mbit"])
    return spec.with_links(setting.get("wan-mbit"), setting.get("wan-rtt-ms"))


def label(setting: dict[str, float]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in setting.items())


def run_grid(args: argparse.Namespace, spec: ClusterSpec, chosen: list[str]) -> int:
    """Run the grid of ``args.grid`` over ``spec`` (the options' cluster) with the
    ``chosen`` baselines (both as :func:`~.cluster_cli.check` found them)."""
    settings = parse_grid(args.grid)
    if len(spec.dcs) == 1 and any(k.startswith("wan-") for s in settings for k in s):
        raise ClusterBenchError("--grid wan-* needs more than one DC")
    size, chunk = args.size, args.chunk
    print(f"cluster grid: {len(settings)} setting(s) of {spec.describe()}; "
          f"{size / 2**20:g} MiB, {chunk_text(chunk, size)}, median of {args.runs} run(s) "
          f"each", flush=True)
    rows: list[dict[str, Any]] = []
    for i, setting in enumerate(settings):
        print(f"\n[{i + 1}/{len(settings)}] {label(setting)}", flush=True)
        this = apply(spec, setting)
        m, bound, _ = measure(args, this, size, chunk, chosen)
        _, figures = report(m, bound, size, this, args.plan)
        values = {f["name"]: f["value"] for f in figures}
        rows.append({"setting": setting, "fluid_bound_s": bound,
                     "tensorhub_s": [f.seconds for f in m.tensorhub],
                     "tensorhub_wan_bytes": [f.wan_bytes for f in m.tensorhub],
                     "figures": figures,
                     "fanout_vs_fluid_bound": values["fanout_vs_fluid_bound"],
                     "interdc_bytes_vs_size": values.get("interdc_bytes_vs_size")})
    several = len(spec.dcs) > 1
    print(f"\n{'setting':<36} {'bound s':>8} {'x bound':>8} {'interdc':>8}")
    for row in rows:
        interdc = row["interdc_bytes_vs_size"]
        print(f"{label(row['setting']):<36} {row['fluid_bound_s']:>8.2f} "
              f"{row['fanout_vs_fluid_bound']:>8.3f} "
              f"{'-' if interdc is None else f'{interdc:.3f}':>8}")
    worst = max(rows, key=lambda r: r["fanout_vs_fluid_bound"])
    out = [figure("fanout_vs_fluid_bound_worst", worst["fanout_vs_fluid_bound"], "ratio",
                  FANOUT_BOUND[several], "lower")]
    if several:
        crossed = max(rows, key=lambda r: r["interdc_bytes_vs_size"])
        out.append(figure("interdc_bytes_vs_size_worst", crossed["interdc_bytes_vs_size"],
                          "ratio", INTERDC_BOUND, "lower"))
    print()
    print_figures(out)
    if args.json:
        print(json.dumps({
            "figures": out,
            "measured": {"grid": rows, "worst_fanout_setting": worst["setting"]},
            "settings": {"grid": args.grid, "topology_file": args.topology,
                         "topology": spec.to_dict(), "size_bytes": size,
                         "chunk_bytes": chunk or "auto", "runs": args.runs, "plan": args.plan,
                         "keys": args.keys, "baselines": chosen},
        }))
    return 0
