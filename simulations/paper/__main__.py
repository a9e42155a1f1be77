"""The paper's figures at cluster scale, from the data-plane simulator
(:mod:`simulations.dataplane`): every table, a PNG per figure into ``docs/results/``.

    python -m simulations.paper --json
    python -m simulations.paper --rollout-hosts 4 --kraken-hosts 32 --no-plots  # quick
    python -m simulations.paper --only wan --no-plots --json  # the multi-DC WAN (opt-in)

Prints each table, then each figure next to its bound; with ``--json`` one JSON object
as the last line: ``{"figures": [...], "tables": {...}, "raw": {...}, "settings": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tensorhub.bench.figures import figure, print_figures
from tensorhub.protocol.sizing import MAX_AUTO_CHUNK, choose_chunk_size

from ..dataplane import multidc as m
from ..dataplane import workloads as w
from ..dataplane.validate import compare

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


PARTS = ("standalone", "ablations", "elastic", "crossdc", "kraken", "validation", "wan")
DEFAULT_PARTS = PARTS[:-1]
"""``wan`` is asked for by name: ten 1,024-GPU runs, some 8 minutes here (2 cores)."""

STANDALONE_CHUNK = MAX_AUTO_CHUNK
"""The standalone figures' chunk size: 64 MiB (66 chunks per 4.4 GB slice), what a
publisher gets with ``PeerConfig.chunk_size`` set so.  The automatic choice in a mesh
of 1,056 GPUs is 8 MiB (522 chunks: 64 for each of its 10 levels), about eight times the
chunks and so the events of a run, past the 120 s this run is to take here."""


UNLABELLED_HOSTS = 32
"""Rollout hosts of the cross-DC run without DC labels (256 GPUs), beside ours at the
same size.  Without labels the planner sends thousands of flows across the WAN at once;
the flow model then recomputes every one of their rates at each start and end, and at
64 hosts the virtual clock moved 16 ms in 100 s here (docs/simulations.md, Not done)."""


def run(o: w.Options, kraken_hosts: int, kraken_chunks: int, standalone_chunks: int = 0,
        only: frozenset[str] = frozenset(DEFAULT_PARTS)
        ) -> tuple[list[dict[str, Any]], dict[str, list[tuple[str, float, str]]],
                   dict[str, Any]]:
    """Every part in ``only``: its figures, tables and raw numbers.  The standalone
    figures at ``standalone_chunks`` per slice (0: :data:`STANDALONE_CHUNK`), the rest at
    ``o.chunks``."""
    figs: list[dict[str, Any]] = []
    tables: dict[str, list[tuple[str, float, str]]] = {}
    raw: dict[str, Any] = {}
    gpus = o.rollout_hosts * o.roll_tp
    began = time.perf_counter()

    def say(what: str) -> None:
        print(f"[{time.perf_counter() - began:7.1f} s] {what}", file=sys.stderr, flush=True)

    if "standalone" in only:
        so = replace(o, chunks=standalone_chunks or -(-o.slice_bytes // STANDALONE_CHUNK))
        say(f"standalone, {so.chunks} chunks per slice ...")
        ours = w.standalone(so)
        stalls = w.broadcast_stalls(so, gpus)
        mine = ours.stall(so)
        best_bcast = min(stalls["ring"], stalls["tree"])
        tables["standalone"] = [
            (f"TensorHub (planned pull of each slice, {so.chunks} chunks)", mine, "GPU-s"),
            (f"... with a staged flip (overlap {so.overlap_s:g} s)",
             ours.stall(so, so.overlap_s), "GPU-s"),
            *((f"baseline {k}", v, "GPU-s") for k, v in stalls.items()),
            ("makespan", ours.makespan, "s"),
            ("simulated readers (GPU x slice)", ours.readers, ""),
            ("wall time of this run", ours.wall_s, "s")]
        figs.append(figure("standalone_stall_vs_broadcast", best_bcast / mine, "x", 6.7,
                           "higher"))
        eta = w.logdepth_bound(so, so.rollout_hosts) / ours.makespan
        figs.append(figure("eta_vs_logdepth_bound", eta, "ratio", 0.85, "higher"))
        figs.append(figure("standalone_wall_s", ours.wall_s, "s", 120, "lower"))

    if "ablations" in only:
        say(f"ablations, {o.chunks} chunks per slice ...")
        base = w.standalone(o)
        ablations = [("no pipelining (one chunk per slice)", w.standalone(o, chunks=1)),
                     ("no topology awareness", w.standalone(o, topology_aware=False))]
        killed, victim = w.resourcing(o, base)
        tables["ablations (standalone)"] = [
            (f"all on ({o.chunks} chunks per slice)", base.makespan, "s"),
            *((what, x.makespan, "s") for what, x in ablations),
            (f"relay {victim} killed mid-transfer, re-sourced", killed.makespan, "s"),
            ("staged flip: stall over the plain pull",
             base.stall(o, o.overlap_s) / base.stall(o), "x")]
        live = sum(1 for t in killed.instance_s if t != float("inf")) / len(killed.instance_s)
        figs.append(figure("resourcing_instances_done", live, "share", 1.0, "higher"))

    if "elastic" in only:
        say("elastic ...")
        (mine_e, there_e), (star_e, star_there) = w.elastic(o), w.elastic(o, star=True)
        tables["elastic"] = [("TensorHub, joiners' update (join to switch), mean",
                              w.mean(mine_e.instance_s), "s"),
                             ("star from the trainer, joiners' update, mean",
                              w.mean(star_e.instance_s), "s"),
                             ("TensorHub, instances there at the publish, mean",
                              w.mean(there_e.instance_s), "s"),
                             ("star, instances there at the publish, mean",
                              w.mean(star_there.instance_s), "s"),
                             ("readers per trainer GPU (star)", o.rollout_hosts, "")]
        figs.append(figure("elastic_speedup_vs_star", w.mean(star_e.instance_s)
                           / w.mean(mine_e.instance_s), "x", 4.8, "higher"))

    if "crossdc" in only:
        say("cross-DC ...")
        dc_ours, dc_seeds = w.crossdc(o), w.crossdc(o, seeds_per_dc=4)
        small = replace(o, rollout_hosts=min(o.rollout_hosts, UNLABELLED_HOSTS))
        gpus_small = small.rollout_hosts * small.roll_tp
        say(f"cross-DC without DC labels, {gpus_small} GPUs ...")
        dc_unaware = w.crossdc(small, topology_aware=False)
        dc_small = dc_ours if small == o else w.crossdc(small)
        naive = w.crossdc_naive_stalls(o)
        wan = {k: sum(v for n, v in x.result.carried.items() if n.startswith("wan:")) / o.size
               for k, x in (("ours", dc_ours), (f"no DC labels, {gpus_small} GPUs", dc_unaware),
                            ("four seeds", dc_seeds))}
        tables["cross-DC"] = [("TensorHub, one seed per DC", dc_ours.stall(o), "GPU-s"),
                              ("TensorHub, four seeds per DC", dc_seeds.stall(o), "GPU-s"),
                              (f"TensorHub, one seed per DC, {gpus_small} GPUs",
                               dc_small.stall(small), "GPU-s"),
                              (f"TensorHub without DC labels, {gpus_small} GPUs",
                               dc_unaware.stall(small), "GPU-s"),
                              *((f"baseline: {k}", v, "GPU-s") for k, v in naive.items()),
                              *((f"WAN bytes / model, {k}", v, "x") for k, v in wan.items())]
        pulls = naive["every GPU pulls (remote ones over the WAN)"]
        figs.append(figure("crossdc_stall_vs_naive", pulls / dc_ours.stall(o), "x", 19,
                           "higher"))
        figs.append(figure("crossdc_stall_vs_wan_broadcast",
                           naive["stop-and-broadcast across the WAN"] / dc_ours.stall(o), "x",
                           1.0, "higher"))

    if "kraken" in only:
        say("kraken ...")
        chunk = choose_chunk_size(w.KRAKEN_BLOB, peers=kraken_hosts + 1)[0]
        n_chunks = kraken_chunks or -(-w.KRAKEN_BLOB // chunk)
        kr = w.kraken(kraken_hosts, kraken_chunks or None, o.seed)
        p50, p99 = w.percentile(kr.instance_s, 0.5), w.percentile(kr.instance_s, 0.99)
        fine_hosts = min(kraken_hosts, 256)
        say(f"kraken, {fine_hosts} hosts at 32 and 128 chunks ...")
        fine = {c: w.percentile(w.kraken(fine_hosts, c, o.seed).instance_s, 0.5)
                for c in (32, 128)}
        tables["kraken"] = [
            (f"p50, {kraken_hosts} hosts, {n_chunks} chunks", p50, "s"),
            (f"p99, {kraken_hosts} hosts, {n_chunks} chunks", p99, "s"),
            ("bound (3 GB / 300 MB/s)", 10.0, "s"),
            *((f"p50, {fine_hosts} hosts, {c} chunks", v, "s") for c, v in fine.items()),
            *((f"relay lag at {kraken_hosts} hosts, {c} chunks (closed form)",
               w.kraken_lag_s(kraken_hosts, c), "s") for c in (n_chunks, 750)),
            ("wall time of the run", kr.wall_s, "s")]
        figs.append(figure("kraken_p50_s", p50, "s", 10.5, "lower"))
        figs.append(figure("kraken_p99_s", p99, "s", 18, "lower"))

    if "validation" in only:
        rows = compare()
        tables["validation (netns)"] = [(f"{r['name']}: measured / simulated / error",
                                         r["measured_s"], f"{r['simulated_s']:.3f} s, "
                                         f"{r['error']:.3f}") for r in rows]
        figs.append(figure("sim_vs_netns_error", max(r["error"] for r in rows), "ratio", 0.15,
                           "lower"))

    if "wan" in only:
        runs = []
        for shape in m.SHAPES:
            say(f"multi-DC WAN, {shape.name} ({shape.what}) ...")
            runs.append(m.measure(o, shape))
        tables["multi-DC WAN"] = [row for r in runs for row in wan_rows(r)]
        figs.append(figure("sim_wan_fanout_vs_cut_bound_worst",
                           max(r.vs_bound for r in runs), "ratio", 1.3, "lower"))
        figs.append(figure("sim_wan_interdc_bytes_vs_min_worst",
                           max(r.bytes_vs_min for r in runs), "ratio", 1.1, "lower"))
        figs.append(figure("sim_wan_fanout_vs_blind_planner_worst",
                           max(r.makespan_s / (r.blind_s or r.makespan_s) for r in runs),
                           "ratio", 1.0, "lower"))
        figs.append(figure("sim_wan_fanout_vs_direct_feed_worst",
                           max(r.makespan_s / r.direct_feed_s for r in runs), "ratio", 1.0,
                           "lower"))
        raw["wan"] = [r.raw() for r in runs]
    return figs, tables, raw


def wan_rows(r: m.Run) -> list[tuple[str, float, str]]:
    """One shape's rows of the multi-DC table."""
    n = r.shape.name
    return [(f"{n}: simulated fan-out", r.makespan_s, "s"),
            (f"{n}: cut bound", r.bound_s, "s"),
            (f"{n}: simulated / cut bound", r.vs_bound, "x"),
            (f"{n}: inter-DC bytes / (remote DCs x model)", r.bytes_vs_min, "x"),
            *([(f"{n}: planner blind to the links (simulated)", r.blind_s, "s")]
              if r.blind_s is not None else []),
            (f"{n}: each DC fed over its direct link", r.direct_feed_s, "s"),
            (f"{n}: every GPU pulls from the trainer", r.pull_s, "s")]


def plot(tables: dict[str, list[tuple[str, float, str]]], out: Path) -> list[str]:
    """One bar chart per table (its rows with a unit of seconds or GPU-seconds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for name, rows in tables.items():
        bars = [(what, v) for what, v, unit in rows if unit in ("s", "GPU-s")]
        if not bars:
            continue
        fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(bars)))
        ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1])
        ax.set_title(f"{name}  ({rows[0][2]})")
        ax.set_xscale("log")
        fig.tight_layout()
        path = out / f"{name.split(' ')[0].replace('-', '')}.png"
        fig.savefig(path, dpi=90, bbox_inches="tight")  # long row labels
        plt.close(fig)
        made.append(str(path.name))
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.paper",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rollout-hosts", type=int, default=128,
                        help="rollout hosts of 8 GPUs (default 128: 1,024 GPUs)")
    parser.add_argument("--chunks", type=int, default=16,
                        help="chunks per slice, but for the standalone figures")
    parser.add_argument("--standalone-chunks", type=int, default=0,
                        help="chunks per slice of the standalone figures (default 0: "
                        "64 MiB chunks, 66)")
    parser.add_argument("--oversubscription", type=float, default=1.0)
    parser.add_argument("--kraken-hosts", type=int, default=2600)
    parser.add_argument("--kraken-chunks", type=int, default=0,
                        help="chunks of the 3 GB blob (default 0: the origin's own "
                        "choice in a mesh of --kraken-hosts + 1 peers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated parts to run (of {','.join(PARTS)}; "
                        f"default all but wan)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args(argv)
    if a.rollout_hosts < 2 or a.chunks < 1 or a.kraken_hosts < 2 or a.kraken_chunks < 0 \
            or a.standalone_chunks < 0:
        parser.error("need --rollout-hosts >= 2, --chunks >= 1, --kraken-hosts >= 2, "
                     "--kraken-chunks >= 0, --standalone-chunks >= 0")
    o = replace(w.Options(), rollout_hosts=a.rollout_hosts, chunks=a.chunks,
                oversubscription=a.oversubscription, seed=a.seed)
    print(f"seed {a.seed}")
    started = time.perf_counter()
    only = frozenset(a.only.split(","))
    if not only or not only <= set(PARTS):
        parser.error(f"--only takes parts of {','.join(PARTS)}")
    figs, tables, raw = run(o, a.kraken_hosts, a.kraken_chunks, a.standalone_chunks, only)
    for name, rows in tables.items():
        print(f"\n{name}")
        for what, value, unit in rows:
            print(f"  {what:<52} {value:>12.4g} {unit}")
    plots = [] if a.no_plots else plot(tables, RESULTS)
    print()
    print_figures(figs)
    settings = {**asdict(o), "kraken_hosts": a.kraken_hosts, "kraken_chunks": a.kraken_chunks,
                "standalone_chunks": a.standalone_chunks,
                "wall_s": round(time.perf_counter() - started, 1), "plots": plots}
    out = {"figures": figs, "tables": {k: [list(r) for r in v] for k, v in tables.items()},
           "raw": raw, "settings": settings}
    if not a.no_plots:
        (RESULTS / "paper.json").write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
