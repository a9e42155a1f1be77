"""``tensorhub bench chaos`` (also ``python -m simulations.chaos``): faults and a rogue
peer against a real mesh of processes, with the invariants checked after every seed.

The mesh is a trainer and ``--rollouts`` rollout peers, each its own OS process on
loopback (:mod:`tensorhub.testing.chaos.worker`), plus the rogue
(:mod:`tensorhub.testing.chaos.rogue`), which has no key and speaks the wire format raw.  Each
**seed** is one short episode on the running mesh, on a model of its own
(``chaos<seed>``): the trainer publishes ``--versions`` versions ``--interval`` seconds
apart, every rollout follows ``latest`` and checks every byte it activates against the
trainer's content, and meanwhile, at moments drawn from the seed,

* up to two faults: ``kill -9`` or ``SIGSTOP`` (then ``SIGCONT``) of a holder, of the
  version's coordinator or of the trainer;
* one attack of the rogue, in turn from :data:`~tensorhub.testing.chaos.rogue.LIGHT`; the heavy
  ones (a 4-million-tensor manifest, 1,000 half-sent data frames) every 50th seed.

The **insider** family (``--insider-seeds``, with keys only) runs more seeds on the same
mesh, each with one attack of :data:`~tensorhub.testing.chaos.insider.INSIDER_ATTACKS` by a
second rogue process that holds the valid member key ``insider`` (no publisher rights):
its words pass CURVE and the signature checks, so only the rules can refuse them.

The **starved-links** family (``--starved-seeds``, root and ``ip netns`` only, else
skipped with the reason) runs more seeds the same way with every peer and the rogue on an
emulated host of its own, NICs capped by ``tc`` (:mod:`tensorhub.testing.netns`).

After the episode stopped peers are resumed, the peers' views are read, the invariants
checked (:mod:`tensorhub.testing.chaos.check`), killed peers restarted, and the mesh
restarted whole if it kept state it cannot outlive.  Before the seeds, the flood phase
times a rollout's fetch from the trainer with and without the rogue flooding the
trainer's control and data ports, alternately (``flood_fetch_time_ratio``).

Security: ``--security auto`` runs the mesh with a cluster key set (and the rogue
without a member key) when this tree's ``PeerConfig`` takes one, else without, and says
so; ``on`` requires it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..ops.demo import parse_size
from ..testing import netns
from ..testing.chaos.check import ACCEPTED
from ..testing.chaos.episode import Runner
from ..testing.chaos.insider import INSIDER
from ..testing.chaos.mesh import TRAINER, Host, Mesh, MeshError
from ..testing.chaos.rogue import LIGHT
from ..testing.chaos.worker import security_supported
from .figures import figure, print_figures


def _keys(mode: str, names: list[str], where: Path) -> tuple[str, str]:
    """The keygen directory for the mesh ("" for none) and what was decided, and why
    (with keys: ``names`` and the insider's member key; only the trainer publishes)."""
    if mode == "off":
        return "", "off (--security off)"
    if not security_supported():
        if mode == "on":
            raise MeshError("--security on: this tree's PeerConfig has no 'security' field")
        return "", "off (this tree's PeerConfig takes no cluster key set yet)"
    import importlib

    security = importlib.import_module("tensorhub.security")
    security.write_keys(where, [*names, INSIDER], publishers={"*": [TRAINER]})
    return str(where), ("on (cluster key set; the rogue has no member key, the insider "
                        "has one and publishes nothing)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tensorhub-chaos-") as tmp:
        names = [TRAINER, *(f"r{i}" for i in range(args.rollouts))]
        keys, security_note = _keys(args.security, names, Path(tmp) / "keys")
        print(f"chaos: {len(names)} peers, model {size / 2**20:g} MiB in "
              f"{chunk / 2**10:g} KiB chunks, seeds {args.seed_base}.."
              f"{args.seed_base + args.seeds - 1}, security {security_note}", flush=True)
        insider_seeds = args.insider_seeds if keys else 0
        if args.insider_seeds and not keys:
            print("insider: skipped (no keys: nobody holds a member key)", flush=True)
        mesh = Mesh(args.rollouts, size, chunk, Path(tmp), keys, args.huge_tensors,
                    insider=insider_seeds > 0)
        runner = Runner(mesh, args, heavy=args.heavy == "on")
        try:
            mesh.start(mesh.names)
            if not mesh.wait_healthy(args.heal):
                raise MeshError("the mesh did not converge at start")
            quiet, flooded = runner.flood_phase() if args.flood_runs else ([], [])
            print(f"flood phase: fetch {statistics.median(quiet or [0]):.3f} s quiet, "
                  f"{statistics.median(flooded or [0]):.3f} s flooded", flush=True)
            for seed in range(args.seed_base, args.seed_base + args.seeds):
                runner.seed(seed)
            first = args.seed_base + args.seeds
            for seed in range(first, first + insider_seeds):
                runner.seed(seed, " (insider)", insider=True)
            runner.hung(wait=True)
        finally:
            mesh.close()
        starved = run_starved(args, runner, size, chunk, keys, Path(tmp),
                              args.seed_base + args.seeds + insider_seeds)
    return {"totals": runner.totals, "problems": runner.problems, "quiet": quiet,
            "flooded": flooded, "by_attack": runner.by_attack, "faults": runner.faults,
            "silent": runner.silent, "mesh_restarts": mesh.restarts + runner.restarts,
            "starved": starved, "slow_unpublishes": runner.slow_unpublishes,
            "heal_failures": runner.heal_failures, "missed_wakeups": runner.missed_wakeups,
            "flood_errors": runner.flood_errors,
            "episode_s": runner.seconds, "seconds": time.monotonic() - started,
            "security": security_note, "size": size, "chunk": chunk,
            "insider_seeds": insider_seeds, "by_family": runner.by_family}


def run_starved(args: argparse.Namespace, runner: Runner, size: int, chunk: int,
                keys: str, tmp: Path, first: int) -> dict[str, Any]:
    """The starved-links family: ``--starved-seeds`` more episodes with every peer (and
    the rogue) on an emulated host of its own, NICs capped at ``--starved-mbit`` with
    ``tc`` (needs root and ``ip netns``; skipped, saying why, where unavailable).  Its
    counts join ``runner``'s."""
    note: dict[str, Any] = {"seeds": 0, "mbit": args.starved_mbit}
    if args.starved_seeds <= 0:
        return {**note, "skipped": "--starved-seeds 0"}
    try:
        netns.check_support()
    except netns.ClusterUnavailable as exc:
        print(f"starved links: skipped ({exc})", flush=True)
        return {**note, "skipped": str(exc)}
    names = [TRAINER, *(f"r{i}" for i in range(args.rollouts)), "rogue"]
    print(f"starved links: {len(names)} emulated hosts at {args.starved_mbit:g} Mbit, "
          f"seeds {first}..{first + args.starved_seeds - 1}", flush=True)
    with netns.open_cluster(len(names), args.starved_mbit) as cluster:
        hosts = {n: Host(h.ip, h.name, ("ip", "netns", "exec", h.namespace))
                 for n, h in zip(names, cluster.hosts, strict=True)}
        mesh = Mesh(args.rollouts, size, chunk, tmp, keys, args.huge_tensors, hosts)
        sub = Runner(mesh, args, heavy=False)
        try:
            mesh.start(mesh.names)
            if not mesh.wait_healthy(args.heal):
                raise MeshError(f"the starved mesh did not converge: {mesh.unhealthy}")
            for seed in range(first, first + args.starved_seeds):
                sub.seed(seed, " (starved)")
            sub.hung(wait=True)
        finally:
            mesh.close()
    runner.absorb(sub)
    return {**note, "seeds": args.starved_seeds}


def figures_of(r: dict[str, Any], seeds: int) -> list[dict[str, Any]]:
    t = r["totals"]
    ratio = (statistics.median(r["flooded"]) / statistics.median(r["quiet"])
             if r["quiet"] and r["flooded"] else float("nan"))
    return [
        figure("peer_crashes", t["peer_crashes"], "count", 0, "lower"),
        figure("unauth_reads", t["unauth_reads"], "count", 0, "lower"),
        figure("unauth_messages_accepted", t["unauth_messages_accepted"], "episodes", 0,
               "lower"),
        figure("forged_versions_accepted", t["forged_versions_accepted"], "count", 0,
               "lower"),
        figure("forged_chunks_accepted", t["forged_chunks_accepted"], "count", 0, "lower"),
        figure("partial_activations", t["partial_activations"], "count", 0, "lower"),
        figure("verified_bytes_refetched", t["verified_bytes_refetched"], "bytes", 0,
               "lower"),
        figure("fetch_failures", t["fetch_failures"], "count", 0, "lower"),
        figure("flood_fetch_time_ratio", ratio, "ratio", 2, "lower"),
        figure("chaos_seeds", seeds, "seeds", 200, "higher"),
    ]


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=200, help="episodes (default 200)")
    p.add_argument("--seed-base", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")
    p.add_argument("--rollouts", type=int, default=3, help="rollout peers (default 3)")
    p.add_argument("--size", default="2MiB", help="model size (default 2MiB)")
    p.add_argument("--chunk", default="64KiB", help="chunk size (default 64KiB)")
    p.add_argument("--versions", type=int, default=2, help="versions per seed (default 2)")
    p.add_argument("--interval", type=float, default=0.6,
                   help="seconds between versions (default 0.6)")
    p.add_argument("--settle", type=float, default=0.8,
                   help="seconds after the last version before checking (default 0.8)")
    p.add_argument("--heal", type=float, default=10.0,
                   help="seconds the mesh may take to see every peer alive again")
    p.add_argument("--flood-runs", type=int, default=5,
                   help="fetches with and without the flood (default 5 each)")
    p.add_argument("--attacks", default="all",
                   help=f"light attacks to take turns, comma-separated, or all / none "
                        f"(default all: {', '.join(LIGHT)})")
    p.add_argument("--flood-timeout", type=float, default=30.0,
                   help="seconds a flood-phase fetch may take; a failed one counts as this")
    p.add_argument("--heavy", choices=("on", "off"), default="on",
                   help="the heavy attacks every 50th seed (default on)")
    p.add_argument("--huge-tensors", type=int, default=4_000_000,
                   help="tensors the rogue's huge manifest declares (default 4,000,000)")
    p.add_argument("--half-frames", type=int, default=1000,
                   help="half-sent data frames the rogue keeps open (default 1000)")
    p.add_argument("--insider-seeds", type=int, default=40,
                   help="more seeds, each an attack by a member key without publisher "
                        "rights (with keys only; default 40, 0: off)")
    p.add_argument("--starved-seeds", type=int, default=10,
                   help="more seeds with every peer on its own emulated host behind a "
                        "tc-capped NIC (root and ip netns; default 10, 0: off)")
    p.add_argument("--starved-mbit", type=float, default=50.0,
                   help="NIC cap of the starved-links family (default 50 Mbit)")
    p.add_argument("--log", default="", help="append every episode's record (JSON lines)")
    p.add_argument("--security", choices=("auto", "on", "off"), default="auto",
                   help="run the mesh with a cluster key set (auto: if this tree can)")


def run_cli(args: argparse.Namespace) -> int:
    if args.rollouts < 1 or args.seeds < 0 or args.versions < 1 or args.insider_seeds < 0:
        raise MeshError("need --rollouts >= 1, --seeds >= 0, --versions >= 1, "
                        "--insider-seeds >= 0")
    unknown = set(args.attacks.split(",")) - {*LIGHT, "all", "none", ""}
    if unknown:
        raise MeshError(f"unknown attacks {sorted(unknown)}; choose from {', '.join(LIGHT)}")
    r = run(args)
    seeds = args.seeds + r["insider_seeds"] + r["starved"]["seeds"]
    figures = figures_of(r, seeds)
    t = r["totals"]
    print()
    print(f"{seeds} seeds ({r['insider_seeds']} insider, {r['starved']['seeds']} on starved "
          f"links{': ' + r['starved']['skipped'] if 'skipped' in r['starved'] else ''}) in "
          f"{r['seconds']:.0f} s; security {r['security']}")
    for fam, c in sorted(r["by_family"].items()):
        print(f"family {fam}: {c['seeds']} seeds, "
              + ", ".join(f"{k} {c[k]}" for k in ACCEPTED))
    print(f"insider: fetches that caught or banned it {t['insider_bans']}, integrity "
          "failures detected (all families) "
          f"{t['integrity_failures_detected']}")
    print(f"attacks: {', '.join(f'{k} {n}' for k, n in sorted(r['by_attack'].items()))}")
    print(f"faults: {', '.join(f'{k} {n}' for k, n in sorted(r['faults'].items()))}")
    print(f"activations {t['activations']}, VersionUnavailable {t['version_unavailable']}, "
          f"integrity failures detected {t['integrity_failures_detected']}, peers silent "
          f"at a check {r['silent']}, mesh restarts {r['mesh_restarts']} (after "
          f"{len(r['heal_failures'])} episodes the mesh did not heal), unpublishes over 2 s "
          f"{len(r['slow_unpublishes'])}, rollouts left waiting with a newer version sealed "
          f"{len(r['missed_wakeups'])}")
    if r["problems"]:
        print(f"{len(r['problems'])} problems (first 20):")
        for line in r["problems"][:20]:
            print(f"  {line}")
    print()
    print_figures(figures)
    if args.json:
        print(json.dumps({
            "figures": [{**f, "value": None} if f["value"] != f["value"] else f
                        for f in figures],  # not measured (NaN): null
            "baselines": {"flood_quiet_s": r["quiet"], "flood_flooded_s": r["flooded"],
                          "flood_errors": r["flood_errors"],
                          "totals": t, "attacks": r["by_attack"], "faults": r["faults"],
                          "by_family": r["by_family"], "insider_seeds": r["insider_seeds"],
                          "peers_silent": r["silent"], "mesh_restarts": r["mesh_restarts"],
                          "starved_links": r["starved"],
                          "slow_unpublishes": r["slow_unpublishes"],
                          "heal_failures": r["heal_failures"],
                          "missed_wakeups": r["missed_wakeups"],
                          "episode_s_median": statistics.median(r["episode_s"] or [0]),
                          "problems": r["problems"][:200]},
            "settings": {k: v for k, v in vars(args).items() if k not in ("func",)}
            | {"size": r["size"], "chunk": r["chunk"], "security": r["security"],
               "seconds": round(r["seconds"], 1)},
        }))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.chaos",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    add_options(p)
    with contextlib.suppress(KeyboardInterrupt):
        return run_cli(p.parse_args(argv))
    return 130


if __name__ == "__main__":
    sys.exit(main())
