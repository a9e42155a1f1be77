"""``tensorhub bench chaos`` (also ``python -m simulations.chaos``): faults and a rogue
peer against a real mesh of processes, with the invariants checked after every seed.

The mesh is a trainer and ``--rollouts`` rollout peers, each its own OS process on
loopback (:mod:`tensorhub.bench.chaos_worker`), plus the rogue
(:mod:`tensorhub.bench.rogue`), which has no key and speaks the wire format raw.  Each
**seed** is one short episode on the running mesh, on a model of its own
(``chaos<seed>``): the trainer publishes ``--versions`` versions ``--interval`` seconds
apart, every rollout follows ``latest`` and checks every byte it activates against the
trainer's content, and meanwhile, at moments drawn from the seed,

* up to two faults: ``kill -9`` or ``SIGSTOP`` (then ``SIGCONT``) of a holder, of the
  version's coordinator or of the trainer;
* one attack of the rogue, in turn from :data:`~tensorhub.bench.rogue.LIGHT`; the heavy
  ones (a 4-million-tensor manifest, 1,000 half-sent data frames) every 50th seed.

After the episode stopped peers are resumed, the peers' views are read, the invariants
checked (:mod:`tensorhub.bench.chaos_check`), killed peers restarted, and the mesh
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
import dataclasses
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..demo import parse_size
from ..model import VersionKey
from ..protocol.ring import coordinator
from .chaos_check import COUNTS, Episode, Verdict, check
from .chaos_mesh import TRAINER, Mesh, MeshError
from .chaos_worker import security_supported
from .figures import figure, print_figures
from .rogue import HEAVY, LIGHT

SETTLE_GRACE = 8.0
"""Seconds past the episode's end a fetch may still take: a source that stalls is given
up after ``stall_timeout`` (3 s), and the chunks are then fetched again elsewhere."""
CLAIM_FIRST = frozenset({"forged_chunks"})
"""Attacks whose episode starts the rollouts only after the rogue made its claim (a
bad holder of the real version is tested only if readers can meet it)."""


def attack_for(seed: int, kinds: tuple[str, ...], heavy: bool) -> str | None:
    """The attack of episode ``seed``: the light ``kinds`` in turn, a heavy one every
    50th seed (with ``heavy``); None without attacks."""
    if heavy and seed % 50 == 49:
        return HEAVY[(seed // 50) % len(HEAVY)]
    light = [k for k in LIGHT if k in kinds]
    return light[seed % len(light)] if light else None


@dataclass(frozen=True)
class Fault:
    at: float
    """Seconds into the episode."""
    kind: str
    """``kill`` (SIGKILL) or ``stop`` (SIGSTOP, SIGCONT ``pause`` seconds later)."""
    role: str
    """Whose process: a ``holder`` (a rollout), the version's ``coordinator``, the
    ``trainer``; the process itself is picked when the fault strikes."""
    pause: float


def episode_rng(seed: int) -> random.Random:
    return random.Random(f"chaos-{seed}")


def draw_faults(rng: random.Random, span: float) -> list[Fault]:
    """Up to two faults at moments within ``span`` (+0.3) seconds."""
    return [Fault(rng.uniform(0.05, span + 0.3), rng.choice(("kill", "stop")),
                  rng.choice(("holder", "coordinator", "trainer")), rng.uniform(0.2, 1.5))
            for _ in range(rng.choice((0, 1, 1, 2)))]


class Runner:
    def __init__(self, mesh: Mesh, args: argparse.Namespace) -> None:
        self.mesh = mesh
        self.args = args
        self.totals = dict.fromkeys(COUNTS, 0)
        self.problems: list[str] = []
        self.by_attack: dict[str, int] = {}
        self.faults: dict[str, int] = {}
        self.silent = 0
        self.seconds: list[float] = []
        self.flood_errors: list[str] = []
        self.recent: dict[str, Episode] = {}
        """The last episodes by model, for events that arrive after their episode."""
        self.kinds: tuple[str, ...] = LIGHT if args.attacks == "all" else tuple(
            k for k in args.attacks.split(",") if k and k != "none")

    # -- one seed ---------------------------------------------------------------------------

    def episode(self, seed: int) -> Episode:
        args, mesh = self.args, self.mesh
        rng = episode_rng(seed)
        model = f"chaos{seed}"
        ep = Episode(seed, attack_for(seed, self.kinds, args.heavy == "on"))
        rollouts = [n for n in mesh.names if n != TRAINER]
        def follow() -> None:
            for r in rollouts:
                mesh.procs[r].send(cmd="follow", model=model, seed=seed)
            for r in rollouts:
                mesh.reply(r, "following", 0.0 if mesh.procs[r].stopped else 10.0)

        t0 = time.monotonic()
        timeline: list[tuple[float, str, Callable[[], None]]] = []
        for i in range(args.versions):
            timeline.append((i * args.interval, "publish", self._publisher(ep, model, i + 1)))
        span = max(args.interval * (args.versions - 1), 0.5)
        for fault in draw_faults(rng, span):
            timeline += self._fault(ep, rng, model, fault)
        if ep.attack in CLAIM_FIRST:  # readers start once the rogue holds the version
            attack_at, follow_at = 0.05, 0.5
        else:
            attack_at, follow_at = rng.uniform(0.1, span), -1.0
        timeline.append((follow_at, "follow", follow))
        timeline.append((attack_at, "attack", lambda: self._attack(ep, rng, model)))
        timeline.sort(key=lambda t: t[0])
        for at, _what, action in timeline:
            mesh.poll(t0 + at)
            action()
        for p in mesh.procs.values():  # every stopped peer resumes
            if p.stopped:
                p.signal(signal.SIGCONT)
        self._settle(ep, rollouts, t0 + span + args.settle)
        self._published(ep)
        if ep.attack is not None and mesh.rogue is not None:
            ep.rogue = mesh.reply("rogue", "attacked", 30.0) or {}
            mesh.rogue.send(cmd="end")
            mesh.reply("rogue", "ended", 10.0)
        ep.views, silent = mesh.views([model], 20.0)
        self.silent += len(silent)
        self._file_async(ep)
        for name, proc in mesh.procs.items():
            if name not in ep.killed and proc.p.poll() is not None:
                ep.exited[name] = f"exit code {proc.p.returncode}: {proc.stderr_tail()}"
        self._published(ep)
        if mesh.alive(TRAINER) and mesh.procs[TRAINER].send(cmd="drop", model=model):
            mesh.reply(TRAINER, "dropped", 10.0)
        return ep

    def _publisher(self, ep: Episode, model: str, version: int) -> Callable[[], None]:
        def publish() -> None:
            if self.mesh.procs[TRAINER].send(cmd="publish", model=model, version=version,
                                             seed=ep.seed):
                ep.published[version] = None
        return publish

    def _published(self, ep: Episode) -> None:
        """File the trainer's answers: a manifest id, or a refusal (then the version
        is not the trainer's: whatever a rollout activates under it is forged)."""
        self.mesh.poll(time.monotonic())
        box = self.mesh.inbox.get(TRAINER)
        for ev in list(box or ()):
            if ev.get("event") == "published":
                ep.published[ev["version"]] = ev["manifest_id"]
            elif ev.get("event") == "error" and ev.get("cmd") == "publish":
                ep.published.pop(ev["version"], None)
                ep.faults.append(f"trainer refused version {ev['version']}: {ev['error']}")
            else:
                continue
            assert box is not None
            box.remove(ev)

    def _fault(self, ep: Episode, rng: random.Random, model: str, fault: Fault
               ) -> list[tuple[float, str, Callable[[], None]]]:
        at, kind, role, pause = fault.at, fault.kind, fault.role, fault.pause

        def target() -> str | None:
            live = [n for n in self.mesh.names if n not in ep.killed
                    and self.mesh.alive(n) and not self.mesh.procs[n].stopped]
            if role == "trainer":
                return TRAINER if TRAINER in live else None
            if role == "coordinator":
                v = max(ep.published, default=1)
                return coordinator(VersionKey(model, v), live) if live else None
            holders = [n for n in live if n != TRAINER]
            return rng.choice(holders) if holders else None

        def strike() -> None:
            name = target()
            if name is None:
                return
            label = f"{kind} {role} {name}"
            ep.faults.append(label)
            self.faults[f"{kind} {role}"] = self.faults.get(f"{kind} {role}", 0) + 1
            if kind == "kill":
                ep.killed.add(name)
                self.mesh.procs[name].signal(signal.SIGKILL)
            else:
                self.mesh.procs[name].signal(signal.SIGSTOP)
                resume.append(name)

        resume: list[str] = []

        def wake() -> None:
            for name in resume:
                self.mesh.procs[name].signal(signal.SIGCONT)

        return [(at, "fault", strike)] + ([(at + pause, "resume", wake)] if kind == "stop"
                                          else [])

    def _attack(self, ep: Episode, rng: random.Random, model: str) -> None:
        mesh = self.mesh
        peers = mesh.peers()
        if mesh.rogue is None or not peers or ep.attack is None:
            return
        self._published(ep)
        version = max(ep.published, default=1)
        if ep.published.get(version) is None and mesh.alive(TRAINER):  # answer due
            got = mesh.reply(TRAINER, "published", 0.0 if mesh.procs[TRAINER].stopped else 2.0)
            if got is not None and got.get("event") == "published":
                ep.published[got["version"]] = got["manifest_id"]
        victims = [p["name"] for p in peers if not mesh.procs[p["name"]].stopped]
        trainer = mesh.procs[TRAINER].info
        mesh.rogue.send(cmd="attack", kind=ep.attack, seed=ep.seed, peers=peers,
                        victim=rng.choice(victims or [peers[0]["name"]]), model=model,
                        version=version, trainer=TRAINER, trainer_data=trainer["data"],
                        manifest_id=ep.published.get(version) or "00" * 16,
                        connections=self.args.half_frames,
                        watch=max(0.5, self.args.interval * self.args.versions))
        self.by_attack[ep.attack] = self.by_attack.get(ep.attack, 0) + 1

    def _settle(self, ep: Episode, rollouts: list[str], until: float) -> None:
        """Wait until ``until``, then until every running rollout has ended a fetch of
        the last version and no fetch it began is still running -- at most
        ``SETTLE_GRACE`` seconds more (past that, a running fetch counts as a failure)."""
        last = max(ep.published, default=0)
        model = f"chaos{ep.seed}"
        deadline = max(until, time.monotonic()) + SETTLE_GRACE
        while time.monotonic() < deadline:
            self.mesh.poll(min(deadline, time.monotonic() + 0.1))
            if time.monotonic() < until:
                continue
            running: dict[str, int] = {}
            done = set()
            for n, ev in self.mesh.async_events:
                if ev.get("model") != model:
                    continue
                running[n] = running.get(n, 0) + (1 if ev["event"] == "fetch_started" else -1)
                if ev["event"] != "fetch_started" and ev.get("version", 0) >= last:
                    done.add(n)
            if all((r in done and running.get(r, 0) <= 0) or r in ep.killed
                   or not self.mesh.alive(r) for r in rollouts):
                return

    # -- after a seed -----------------------------------------------------------------------

    def _file_async(self, ep: Episode) -> None:
        """File the rollouts' fetch events with this episode; one of an earlier
        episode's model (a rollout that was stopped then, and resumed) is checked as a
        late part of that episode."""
        late: dict[str, Episode] = {}
        for name, ev in self.mesh.take_async():
            model = ev.get("model", "")
            if model == f"chaos{ep.seed}":
                into = ep
            elif model in self.recent:
                old = self.recent[model]
                into = late.setdefault(model, Episode(old.seed, None, published=old.published,
                                                       killed=old.killed))
            else:
                continue
            {"fetch_started": into.started, "activated": into.activations,
             "fetch_error": into.fetch_errors}[ev["event"]].append({**ev, "peer": name})
        for part in late.values():
            # Fetches that started then were counted when that episode was checked.
            part.started = []
            self._count(check(part))
        self.recent[f"chaos{ep.seed}"] = ep
        if len(self.recent) > 4:
            del self.recent[next(iter(self.recent))]

    def _count(self, verdict: Verdict) -> None:
        for k, n in verdict.counts.items():
            self.totals[k] += n
        self.problems += verdict.problems
        for line in verdict.problems:
            print(f"  ! {line}", flush=True)

    def record(self, ep: Episode) -> None:
        for name in self.mesh.dead():  # died after the views were read
            if name not in ep.killed and name not in ep.exited:
                ep.exited[name] = (f"exit code {self.mesh.procs[name].p.returncode}: "
                                   f"{self.mesh.procs[name].stderr_tail()}")
        if self.args.log:
            with open(self.args.log, "a") as f:
                f.write(json.dumps(dataclasses.asdict(ep), default=sorted) + "\n")
        verdict = check(ep)
        self._count(verdict)
        restart = sorted(ep.killed | set(ep.exited))
        if verdict.poisoned:
            print(f"  seed {ep.seed}: the mesh keeps the rogue's state; restarting it",
                  flush=True)
            self.mesh.restart_all()
        elif restart:
            self.mesh.restart(restart)
        for _ in range(2):
            if self.mesh.wait_healthy(self.args.heal):
                return
            # A peer that dies now, while the mesh heals, died of this episode too.
            for name in self.mesh.dead():
                self.totals["peer_crashes"] += 1
                line = (f"seed {ep.seed}: {name} died while the mesh healed: "
                        f"{self.mesh.procs[name].stderr_tail()}")
                self.problems.append(line)
                print(f"  ! {line}", flush=True)
            print(f"  seed {ep.seed}: the mesh did not heal ({self.mesh.unhealthy[:300]}); "
                  "restarting it", flush=True)
            self.mesh.restart_all()
        if not self.mesh.wait_healthy(self.args.heal):
            raise MeshError("a freshly started mesh did not converge")

    # -- the flood ---------------------------------------------------------------------------

    def flood_phase(self) -> tuple[list[float], list[float]]:
        """Fetches of one version from the trainer, first on a quiet mesh, then while
        the rogue floods the trainer's control and data ports.  (Quiet ones first: a
        flood's after-effects must not be measured as "quiet".)"""
        mesh, args = self.mesh, self.args
        trainer = mesh.procs[TRAINER]
        trainer.send(cmd="publish", model="flood", version=1, seed=0)
        if mesh.reply(TRAINER, "published", 30.0) is None:
            raise MeshError("the trainer did not publish the flood model")
        quiet = [self._timed_fetch("quiet") for _ in range(args.flood_runs)]
        if mesh.rogue is None:
            return quiet, []
        mesh.rogue.send(cmd="flood", control=trainer.info["control"],
                        data=trainer.info["data"], on=True)
        mesh.reply("rogue", "flood", 10.0)
        time.sleep(0.3)  # the flood is under way before the first fetch starts
        flooded = [self._timed_fetch("flooded") for _ in range(args.flood_runs)]
        mesh.rogue.send(cmd="flood", control="", data="", on=False)
        mesh.reply("rogue", "flood", 30.0)
        if trainer.send(cmd="drop", model="flood"):
            mesh.reply(TRAINER, "dropped", 30.0)
        if not mesh.wait_healthy(args.heal):
            print("  the mesh did not heal after the flood; restarting it", flush=True)
            mesh.restart_all()
        return quiet, flooded

    def _timed_fetch(self, label: str) -> float:
        """Seconds r0 takes to fetch the flood model from the trainer; a fetch that
        fails counts as ``--flood-timeout`` (the error is kept)."""
        self.mesh.procs["r0"].send(cmd="fetch_once", model="flood", version=1,
                                   sources=[TRAINER], timeout=self.args.flood_timeout)
        got = self.mesh.reply("r0", "fetched_once", self.args.flood_timeout + 10)
        if got is not None and got.get("event") == "fetched_once" and not got.get("error"):
            return float(got["seconds"])
        self.flood_errors.append(f"{label} fetch: {got.get('error') if got else 'no answer'}")
        print(f"  ! {self.flood_errors[-1]}", flush=True)
        return float(self.args.flood_timeout)


def _keys(mode: str, names: list[str], where: Path) -> tuple[str, str]:
    """The keygen directory for the mesh ("" for none) and what was decided, and why."""
    if mode == "off":
        return "", "off (--security off)"
    if not security_supported():
        if mode == "on":
            raise MeshError("--security on: this tree's PeerConfig has no 'security' field")
        return "", "off (this tree's PeerConfig takes no cluster key set yet)"
    import importlib

    security = importlib.import_module("tensorhub.security")
    security.write_keys(where, names, publishers={"*": [TRAINER]})
    return str(where), "on (cluster key set; the rogue has no member key)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tensorhub-chaos-") as tmp:
        names = [TRAINER, *(f"r{i}" for i in range(args.rollouts))]
        keys, security_note = _keys(args.security, names, Path(tmp) / "keys")
        print(f"chaos: {len(names)} peers, model {size / 2**20:g} MiB in "
              f"{chunk / 2**10:g} KiB chunks, seeds {args.seed_base}.."
              f"{args.seed_base + args.seeds - 1}, security {security_note}", flush=True)
        mesh = Mesh(args.rollouts, size, chunk, Path(tmp), keys, args.huge_tensors)
        runner = Runner(mesh, args)
        try:
            mesh.start(mesh.names)
            if not mesh.wait_healthy(args.heal):
                raise MeshError("the mesh did not converge at start")
            quiet, flooded = runner.flood_phase() if args.flood_runs else ([], [])
            print(f"flood phase: fetch {statistics.median(quiet or [0]):.3f} s quiet, "
                  f"{statistics.median(flooded or [0]):.3f} s flooded", flush=True)
            for seed in range(args.seed_base, args.seed_base + args.seeds):
                t = time.monotonic()
                ep = runner.episode(seed)
                runner.record(ep)
                runner.seconds.append(time.monotonic() - t)
                print(f"seed {seed}: {ep.attack or '-'}; faults: "
                      f"{', '.join(ep.faults) or 'none'}; {len(ep.activations)} activations, "
                      f"{len(ep.fetch_errors)} fetch errors ({runner.seconds[-1]:.1f} s)",
                      flush=True)
        finally:
            mesh.close()
    return {"totals": runner.totals, "problems": runner.problems, "quiet": quiet,
            "flooded": flooded, "by_attack": runner.by_attack, "faults": runner.faults,
            "silent": runner.silent, "mesh_restarts": mesh.restarts,
            "flood_errors": runner.flood_errors,
            "episode_s": runner.seconds, "seconds": time.monotonic() - started,
            "security": security_note, "size": size, "chunk": chunk}


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
    p.add_argument("--heal", type=float, default=15.0,
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
    p.add_argument("--log", default="", help="append every episode's record (JSON lines)")
    p.add_argument("--security", choices=("auto", "on", "off"), default="auto",
                   help="run the mesh with a cluster key set (auto: if this tree can)")


def run_cli(args: argparse.Namespace) -> int:
    if args.rollouts < 1 or args.seeds < 0 or args.versions < 1:
        raise MeshError("need --rollouts >= 1, --seeds >= 0, --versions >= 1")
    unknown = set(args.attacks.split(",")) - {*LIGHT, "all", "none", ""}
    if unknown:
        raise MeshError(f"unknown attacks {sorted(unknown)}; choose from {', '.join(LIGHT)}")
    r = run(args)
    figures = figures_of(r, args.seeds)
    t = r["totals"]
    print()
    print(f"{args.seeds} seeds in {r['seconds']:.0f} s; security {r['security']}")
    print(f"attacks: {', '.join(f'{k} {n}' for k, n in sorted(r['by_attack'].items()))}")
    print(f"faults: {', '.join(f'{k} {n}' for k, n in sorted(r['faults'].items()))}")
    print(f"activations {t['activations']}, VersionUnavailable {t['version_unavailable']}, "
          f"integrity failures detected {t['integrity_failures_detected']}, peers silent "
          f"at a check {r['silent']}, mesh restarts {r['mesh_restarts']}")
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
                          "peers_silent": r["silent"], "mesh_restarts": r["mesh_restarts"],
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
