"""``tensorhub bench delta``: RL-like steps sent as chunk deltas across an emulated
cluster (the harness of ``tensorhub bench cluster``, :mod:`.cluster`), next to the same
fan-out in full.

Theory of operation
-------------------
The trainer (``h0``) publishes bf16 weights (:mod:`.rlstep`) as version 1; every rollout
fetches it into fresh buffers while holding nothing of the model: full chunks (the
*full* round).  Then, for each ``--steps`` fraction ``p``, the trainer publishes the next
version, an RL-like step of the last with a seeded fraction ``p`` of the values changed
a little, and every rollout fetches it while holding the last one (the *delta* round):
with ``--delta auto`` (the default) each asks the plan's sources for deltas where
encoding beats the link, a remote DC's seed pulls them across and its DC asks the seed.
After each round everyone drops the older version.  Each fetch is digest-verified by the
peer, chunk by chunk, after the delta is applied; each rollout's copy is also checksummed
against the trainer's (``digest_equal``).  Bytes between DCs are the router's kernel
counters, as in ``bench cluster``.

A second cluster (``--one-dc-mbit``, default 400; 0 skips it) runs the full round and
the 1% step inside one DC: ``delta_vs_full_time_1dc`` is the delta round's time over
the full round's (a delta must not slow a fast link).

Figures (``--json``: the last line is JSON with them): ``interdc_bytes_vs_size_delta_1pct``
(<= 0.1), ``remote_dc_time_vs_full_1pct`` (<= 0.25: the remote DC's rollouts, delta round
over full round), ``digest_equal`` (= 1), ``delta_vs_full_time_1dc`` (<= 1.0), and for the
other fractions ``interdc_bytes_vs_size_delta_Npct`` (< 1: less than a copy).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from ..testing.clusterspec import ClusterSpec, uniform
from ..testing.netns import Cluster, open_topology
from .baselines import chunk_text, parse_chunk, parse_size
from .cluster import FETCH_TIMEOUT_S, MODEL, SETUP_TIMEOUT_S, ClusterBenchError, open_mesh
from .figures import figure, print_figures

_SEED = 1000


def _round(mesh: Any, version: int, base: int | None, fraction: float, size: int,
           cluster: Cluster) -> dict[str, Any]:
    """The trainer publishes ``version`` (a step of ``base``), every rollout fetches it
    into fresh buffers; the fetches, the trainer's checksum and the bytes between DCs."""
    published = mesh.trainer.call("published", FETCH_TIMEOUT_S, cmd="publish_step",
                                  model=MODEL, version=version, size=size, base=base,
                                  fraction=fraction, seed=_SEED + version)
    for w in mesh.rollouts:
        w.call("holders", cmd="wait_holders", model=MODEL, version=version, count=1,
               timeout=SETUP_TIMEOUT_S)
    wan0 = cluster.wan_bytes() if cluster.dcs > 1 else 0
    for w in mesh.rollouts:
        w.send(cmd="fetch", model=MODEL, version=version, into=False, checksum=True)
    fetches = {w.name: w.expect("fetched", FETCH_TIMEOUT_S) for w in mesh.rollouts}
    wan = cluster.wan_bytes() - wan0 if cluster.dcs > 1 else 0
    start = min(f["start"] for f in fetches.values())
    return {"fetches": fetches, "wan_bytes": wan, "start": start,
            "equal": all(f["checksum"] == published["checksum"] for f in fetches.values())}


def _done_s(r: dict[str, Any], names: Sequence[str]) -> float:
    return float(max(r["fetches"][n]["end"] for n in names) - r["start"])


def _drop(mesh: Any, version: int) -> None:
    for w in [*mesh.rollouts, mesh.trainer]:
        w.call("unpublished", cmd="unpublish", model=MODEL, version=version)


def run_steps(spec: ClusterSpec, size: int, chunk: int, steps: Sequence[float], mode: str
              ) -> dict[str, Any]:
    """The full round, then one delta round per fraction, on the cluster ``spec``."""
    with open_topology(spec) as cluster, \
            open_mesh(cluster, chunk, True, extra=("--delta", mode)) as mesh:
        home = cluster.hosts[0].dc
        remote = [w.name for w in mesh.rollouts if w.host.dc != home]
        names = remote or [w.name for w in mesh.rollouts]
        full = _round(mesh, 1, None, 0.0, size, cluster)
        out: dict[str, Any] = {"full": _summary(full, names, size), "steps": {}}
        equal = full["equal"]
        for i, fraction in enumerate(steps):
            r = _round(mesh, i + 2, i + 1, fraction, size, cluster)
            _drop(mesh, i + 1)
            equal &= r["equal"]
            out["steps"][f"{fraction:g}"] = _summary(r, names, size)
        out["equal"] = equal
        out["remote"] = remote
        return out


def _summary(r: dict[str, Any], names: Sequence[str], size: int) -> dict[str, Any]:
    reports = {n: f["report"] for n, f in r["fetches"].items()}
    return {"seconds": _done_s(r, list(r["fetches"])), "watched_s": _done_s(r, names),
            "wan_bytes": r["wan_bytes"], "wan_vs_size": r["wan_bytes"] / size,
            "equal": r["equal"],
            "full_bytes": {n: rep["bytes"] for n, rep in reports.items()},
            "delta_bytes": {n: rep.get("delta_bytes", 0) for n, rep in reports.items()},
            "encode_s": {n: rep.get("delta_encode_seconds", 0.0) for n, rep in reports.items()},
            "apply_s": {n: rep.get("delta_apply_seconds", 0.0) for n, rep in reports.items()},
            "notes": {n: rep.get("delta", {}).get("note", "") for n, rep in reports.items()},
            "plans": {n: rep.get("plan", "") for n, rep in reports.items()}}


def figures_of(two: dict[str, Any], one: dict[str, Any] | None,
               steps: Sequence[float]) -> list[dict[str, Any]]:
    figs = []
    for fraction in steps:
        pct = f"{fraction * 100:g}pct"
        s = two["steps"][f"{fraction:g}"]
        bound = 0.1 if pct == "1pct" else 1.0
        figs.append(figure(f"interdc_bytes_vs_size_delta_{pct}", s["wan_vs_size"], "x",
                           bound, "lower"))
        if pct == "1pct":
            figs.append(figure("remote_dc_time_vs_full_1pct",
                               s["watched_s"] / two["full"]["watched_s"], "x", 0.25, "lower"))
    equal = two["equal"] and (one is None or one["equal"])
    figs.append(figure("digest_equal", float(equal), "", 1.0, "higher"))
    if one is not None and one["steps"]:
        first = next(iter(one["steps"].values()))
        figs.append(figure("delta_vs_full_time_1dc", first["seconds"] / one["full"]["seconds"],
                           "x", 1.0, "lower"))
    return figs


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=4,
                   help="emulated hosts, h0 the trainer (default 4: 2 per DC)")
    p.add_argument("--nic-mbit", type=float, default=400.0, help="each host's NIC (400)")
    p.add_argument("--dcs", type=int, default=2, help="datacenters (default 2)")
    p.add_argument("--wan-mbit", type=float, default=100.0, help="each DC pair (100)")
    p.add_argument("--wan-rtt-ms", type=float, default=20.0, help="round trip (20)")
    p.add_argument("--size", type=parse_size, default=parse_size("256MiB"),
                   help="bytes per version (default 256MiB)")
    p.add_argument("--chunk", type=parse_chunk, default="auto",
                   help="chunk size (default auto)")
    p.add_argument("--steps", "--delta-step", dest="steps", default="0.01,0.02,0.10",
                   help="fractions of values each step changes (default 0.01,0.02,0.10)")
    p.add_argument("--delta", choices=("auto", "always"), default="auto",
                   help="the peers' PeerConfig.delta (default auto)")
    p.add_argument("--one-dc-mbit", type=float, default=400.0,
                   help="NIC of the one-DC run (full vs 1%% delta); 0 skips it")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")


def run_cli(args: argparse.Namespace) -> int:
    try:
        steps = [float(s) for s in args.steps.split(",") if s.strip()]
    except ValueError:
        raise ClusterBenchError(f"--steps: fractions like 0.01,0.02, got {args.steps!r}") from None
    if not steps or not all(0 < s < 1 for s in steps):
        raise ClusterBenchError("--steps: fractions in (0, 1)")
    spec = uniform(args.hosts, args.nic_mbit, args.dcs, args.wan_mbit, args.wan_rtt_ms)
    print(f"delta benchmark: {spec.describe()}; {args.size / 2**20:g} MiB bf16, "
          f"{chunk_text(args.chunk, args.size)}, steps {steps}, delta {args.delta}",
          flush=True)
    two = run_steps(spec, args.size, args.chunk, steps, args.delta)
    one = None
    if args.one_dc_mbit > 0:
        one = run_steps(uniform(max(3, args.hosts), args.one_dc_mbit), args.size,
                        args.chunk, steps[:1], args.delta)
    for what, run in (("2 DCs", two), ("1 DC", one)):
        if run is None:
            continue
        print(f"\n{what}: full round {run['full']['seconds']:.2f} s "
              f"(watched rollouts {run['full']['watched_s']:.2f} s), "
              f"{run['full']['wan_vs_size']:.2f} x size between DCs")
        for frac, s in run["steps"].items():
            print(f"  step {frac}: {s['seconds']:.2f} s (watched {s['watched_s']:.2f} s), "
                  f"{s['wan_vs_size']:.3f} x size between DCs, delta bytes "
                  f"{sum(s['delta_bytes'].values())}, full bytes {sum(s['full_bytes'].values())}")
            for n, note in s["notes"].items():
                print(f"    {n}: {note}")
    figs = figures_of(two, one, steps)
    print()
    print_figures(figs)
    if args.json:
        print(json.dumps({"figures": figs, "measured": {"dcs": two, "one_dc": one},
                          "settings": {"hosts": args.hosts, "nic_mbit": args.nic_mbit,
                                       "dcs": args.dcs, "wan_mbit": args.wan_mbit,
                                       "wan_rtt_ms": args.wan_rtt_ms, "size": args.size,
                                       "chunk": args.chunk or "auto", "steps": steps,
                                       "delta": args.delta,
                                       "one_dc_mbit": args.one_dc_mbit}}))
    return 0
