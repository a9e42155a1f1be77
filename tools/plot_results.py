"""Draw the benchmark plots of docs/benchmarks.md from docs/results/benchmarks.json.

    .venv/bin/python tools/plot_results.py [--data docs/results/benchmarks.json] [--out docs/results]

Writes ``rtt.png`` (one fetch against one plain TCP stream across added round trips,
``tensorhub bench rtt``) and ``fanout.png`` (fan-out time over the fluid lower bound, one
DC and each cell of the 2-DC grid, ``tensorhub bench cluster``). The figures in the JSON
file are copied from the benchmark notebook (docs/benchmarks-history.md); this script
only draws them. matplotlib is a tool-only dependency (``pip install matplotlib``), not
one of TensorHub's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "results" / "benchmarks.json"
OUT = ROOT / "docs" / "results"


def plot_rtt(rtt: dict, path: Path) -> None:
    """Left: stream/fetch per added round trip, run by run, with the bound; right: the
    seconds of the last run that printed the full table."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    runs = [r for r in rtt["runs"] if "rtt_ms" in r and "stream_over_fetch" in r]
    markers = iter("osD^vP*X")
    for run in runs:
        dashed = run["mbit"] != 400
        tree = run["commit"] or f"recorded {run['recorded_in']}"
        left.plot(run["rtt_ms"], run["stream_over_fetch"], linestyle="--" if dashed else "-",
                  marker=next(markers), linewidth=2.4 if run["label"].endswith("latest") else 1.2,
                  label=f"{run['date']} {run['label']} ({tree})")
    left.axhline(rtt["bound"], color="red", linestyle=":", linewidth=1.5,
                 label=f"bound: {rtt['figure']} >= {rtt['bound']}")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xscale("log")
    left.set_xticks([1, 10, 40, 100], labels=["1", "10", "40", "100"])
    left.set_xlabel("added round trip (ms)")
    left.set_ylabel("stream time / fetch time (1.0 = as fast as one TCP stream)")
    left.set_title("tensorhub bench rtt: fetch against one TCP stream (64 MiB)")
    left.set_ylim(0.4, 1.05)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=7.5, loc="lower left")

    full = [r for r in rtt["runs"] if "fetch_data_phase_s" in r and r["mbit"] == 400][-1]
    x = full["rtt_ms"]
    right.plot(x, full["fetch_s"], marker="o", label="fetch (whole)")
    right.plot(x, full["fetch_data_phase_s"], marker="s", label="fetch, data phase (chunks only)")
    right.plot(x, full["stream_s"], marker="^", label="plain TCP stream")
    right.plot(x, full["line_rate_s"], color="black", linestyle=":", label="line rate (size / 400 Mbit)")
    right.set_xscale("log")
    right.set_xticks([1, 10, 40, 100], labels=["1", "10", "40", "100"])
    right.set_xlabel("added round trip (ms)")
    right.set_ylabel("seconds for 64 MiB")
    right.set_title(f"the last full table (400 Mbit): {full['date']}, {full['condition']}, "
                    f"recorded {full['recorded_in']}", fontsize=10)
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


STYLE = {"idle": {"marker": "o", "face": "black"}, "paused": {"marker": "o", "face": "black"},
         "busy": {"marker": "o", "face": "none"}, "loaded": {"marker": "o", "face": "none"},
         "not stated": {"marker": "s", "face": "lightgrey"}}


def plot_fanout(fanout: dict, path: Path) -> None:
    """Bars: the latest idle run per setting; dots: every earlier run of the same command
    in the notebook (busy ones hollow); red: each group's bound."""
    one, grid = fanout["one_dc"], fanout["two_dc_grid"]
    keys = list(next(r for r in grid["runs"] if r.get("latest"))["cells"])
    labels = ["1 DC\n8 hosts"] + [f"2 DCs\nWAN {k.split('/')[0]} Mbit\n{k.split('/')[1]} ms" for k in keys]
    latest_one = next(r for r in one["runs"] if r.get("latest"))
    latest_grid = next(r for r in grid["runs"] if r.get("latest"))
    heights = [latest_one["fanout_vs_fluid_bound"]] + [latest_grid["cells"][k] for k in keys]
    fig, ax = plt.subplots(figsize=(11, 6))
    xs = range(len(labels))
    bars = ax.bar(xs, heights, color="#4c72b0", width=0.6,
                  label=f"latest, idle ({latest_grid['date']}, {latest_grid['commit']})")
    for bar, h in zip(bars, heights):
        ax.text(bar.get_x() + bar.get_width() / 2, h + 0.005, f"{h:.3f}", ha="center", va="bottom",
                fontsize=9)

    top = 1.35  # a loaded run's 1.81 would squash the rest: drawn at the top, labelled

    def dots(x: float, runs: list[tuple[float, str]]) -> None:
        for i, (v, load) in enumerate(runs):
            style = STYLE[load]
            at = min(v, top - 0.01)
            ax.plot(x + 0.36 + 0.04 * (i % 4), at, "^" if v > at else style["marker"],
                    markersize=5, markerfacecolor=style["face"], markeredgecolor="black")
            if v > at:
                ax.text(x + 0.4, at - 0.03, f"{v:g}", fontsize=8, ha="center")

    dots(0, [(r["fanout_vs_fluid_bound"], r["load"]) for r in one["runs"] if not r.get("latest")])
    for i, k in enumerate(keys, start=1):
        dots(i, [(r["cells"][k], r["load"]) for r in grid["runs"]
                 if not r.get("latest") and k in r["cells"]])
    for load, text in (("idle", "earlier runs, idle or paused"), ("busy", "earlier runs, busy or loaded"),
                       ("not stated", "earlier runs, load not stated")):
        style = STYLE[load]
        ax.plot([], [], style["marker"], markerfacecolor=style["face"], markeredgecolor="black",
                markersize=5, label=text)

    ax.hlines(one["bound"], -0.4, 0.6, colors="red", linestyles="--", linewidth=1.8)
    ax.text(-0.38, one["bound"] + 0.01, f"bound {one['bound']}", color="red", fontsize=9)
    ax.hlines(grid["bound"], 0.6, len(labels) - 0.4, colors="red", linestyles="--", linewidth=1.8,
              label="bound: fanout_vs_fluid_bound <= 1.15 (1 DC), worst cell <= 1.25 (2 DCs)")
    ax.text(0.65, grid["bound"] + 0.01, f"bound {grid['bound']}", color="red", fontsize=9)
    ax.axhline(1.0, color="grey", linewidth=1, label="1.0 = the fluid lower bound")
    ax.set_xticks(list(xs), labels=labels, fontsize=9)
    ax.set_ylabel("fan-out time / fluid lower bound")
    ax.set_ylim(0.95, top)
    ax.set_title("tensorhub bench cluster: trainer + 7 rollouts, 400 Mbit NICs, 256 MiB")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    data = json.loads(args.data.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    plot_rtt(data["rtt"], args.out / "rtt.png")
    plot_fanout(data["fanout"], args.out / "fanout.png")
    for name in ("rtt.png", "fanout.png"):
        print(args.out / name)


if __name__ == "__main__":
    main()
