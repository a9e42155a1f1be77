"""One seed of the chaos bench: its faults, its attack, the wait, the checks, the repair.

:class:`Runner` drives episodes on a :class:`~tensorhub.testing.chaos.mesh.Mesh` and sums
what :func:`~tensorhub.testing.chaos.check.check` finds; it also runs the flood phase.
See :mod:`tensorhub.bench.chaos` for what an episode is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...model import VersionKey
from ...protocol.ring import coordinator
from .check import ACCEPTED, COUNTS, Episode, Verdict, check, family
from .insider import INSIDER, INSIDER_ATTACKS
from .mesh import TRAINER, Mesh, MeshError
from .rogue import HEAVY, LIGHT

SETTLE_GRACE = 3.0
"""Seconds past the episode's end the check waits for the last version's fetches: a
source that stalls is given up after ``stall_timeout`` (3 s)."""
HANG_S = 30.0
"""A fetch still running this long after its episode ended is counted as hung (a
failure); until then it is followed across the next episodes."""
CLAIM_FIRST = frozenset({"forged_chunks", "insider_forged_chunks"})
PINNED = {"insider_forged_chunks": (TRAINER, INSIDER)}
"""Attacks in whose episode rollout ``r0`` reads only from these sources: the
coordinator's plan did not send readers to the insider in trial runs, and a reader
that names its sources is how a forged holder surely meets one."""
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
    def __init__(self, mesh: Mesh, args: argparse.Namespace, heavy: bool) -> None:
        self.mesh = mesh
        self.args = args
        self.heavy = heavy
        self.totals = dict.fromkeys(COUNTS, 0)
        self.by_family: dict[str, dict[str, int]] = {}
        """Seeds and acceptance counts per family of attacks (keyless, insider, none)."""
        self.problems: list[str] = []
        self.by_attack: dict[str, int] = {}
        self.faults: dict[str, int] = {}
        self.silent = 0
        self.seconds: list[float] = []
        self.flood_errors: list[str] = []
        self.restarts = 0
        """Mesh restarts of absorbed runners."""
        self.slow_unpublishes: list[str] = []
        self.heal_failures: list[str] = []
        self.missed_wakeups: list[str] = []
        """Episodes after which the mesh did not see every peer alive in ``--heal`` s."""
        self.pending: dict[tuple[str, str, int], tuple[float, int]] = {}
        """Fetches that had not ended when their episode was checked: (peer, model,
        version) -> (when they count as hung, seed)."""
        self.recent: dict[str, Episode] = {}
        """The last episodes by model, for events that arrive after their episode."""
        self.kinds: tuple[str, ...] = LIGHT if args.attacks == "all" else tuple(
            k for k in args.attacks.split(",") if k and k != "none")

    # -- one seed ---------------------------------------------------------------------------

    def episode(self, seed: int, insider: bool = False) -> Episode:
        args, mesh = self.args, self.mesh
        rng = episode_rng(seed)
        model = f"chaos{seed}"
        ep = Episode(seed, INSIDER_ATTACKS[seed % len(INSIDER_ATTACKS)] if insider
                     else attack_for(seed, self.kinds, self.heavy))
        attacker = mesh.insider if insider else mesh.rogue
        who = "insider" if insider else "rogue"
        rollouts = [n for n in mesh.names if n != TRAINER]
        def follow() -> None:
            for r in rollouts:
                pinned = PINNED.get(ep.attack or "") if r == "r0" else None
                mesh.procs[r].send(cmd="follow", model=model, seed=seed,
                                   **({"sources": list(pinned)} if pinned else {}))
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
        if ep.attack is not None and attacker is not None:
            ep.rogue = mesh.reply(who, "attacked", 30.0) or {}
            attacker.send(cmd="end")
            mesh.reply(who, "ended", 10.0)
        ep.views, silent = mesh.views([model], 20.0)
        self._missed_wakeups(ep, model)
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
        attacker = mesh.insider if ep.attack in INSIDER_ATTACKS else mesh.rogue
        if attacker is None or not peers or ep.attack is None:
            return
        ep.addresses = {p["name"]: p["control"] for p in peers}
        self._published(ep)
        version = max(ep.published, default=1)
        if ep.published.get(version) is None and mesh.alive(TRAINER):  # answer due
            got = mesh.reply(TRAINER, "published", 0.0 if mesh.procs[TRAINER].stopped else 2.0)
            if got is not None and got.get("event") == "published":
                ep.published[got["version"]] = got["manifest_id"]
        victims = [p["name"] for p in peers if not mesh.procs[p["name"]].stopped]
        trainer = mesh.procs[TRAINER].info
        attacker.send(cmd="attack", kind=ep.attack, seed=ep.seed, peers=peers,
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

    def _missed_wakeups(self, ep: Episode, model: str) -> None:
        """Rollouts still waiting for a version newer than one they know is sealed:
        ``wait_for_version`` missed its wake-up (not an invariant, a liveness note)."""
        for name, v in ep.views.items():
            waiting, latest = v.get("waiting"), v["latest"].get(model)
            if waiting is not None and waiting[0] == model and latest is not None and (
                    waiting[1] is None or latest > waiting[1]):
                self.missed_wakeups.append(f"seed {ep.seed}: {name} waits for a version "
                                           f"newer than {waiting[1]}; latest is {latest}")
                print(f"  ~ {self.missed_wakeups[-1]}", flush=True)

    def _file_async(self, ep: Episode) -> None:
        """File the rollouts' fetch events with this episode; one of an earlier
        episode's model (a rollout that was stopped then, and resumed) is checked as a
        late part of that episode."""
        late: dict[str, Episode] = {}
        for name, ev in self.mesh.take_async():
            model = ev.get("model", "")
            if ev["event"] == "slow_unpublish":
                self.slow_unpublishes.append(f"{name} {model}@{ev['version']} "
                                             f"{ev['seconds']:.1f} s")
                print(f"  ~ unpublish took {self.slow_unpublishes[-1]}", flush=True)
                continue
            if model == f"chaos{ep.seed}" and ep.seed >= 0:
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
            for e in (*part.activations, *part.fetch_errors):
                self.pending.pop((e["peer"], e["model"], e["version"]), None)
            part.started = []  # a late start is followed like this episode's own
            self._count(check(part))
        # Fetches still running are followed until they end or HANG_S has passed.
        ended = [(e["peer"], e["version"]) for e in (*ep.activations, *ep.fetch_errors)]
        for st in list(ep.started):
            key = (st["peer"], st["version"])
            if key in ended:
                ended.remove(key)
            else:
                ep.started.remove(st)
                self.pending[(st["peer"], st["model"], st["version"])] = (
                    time.monotonic() + HANG_S, ep.seed)
        self.recent[f"chaos{ep.seed}"] = ep
        if len(self.recent) > 64:
            del self.recent[next(iter(self.recent))]

    def hung(self, wait: bool = False) -> None:
        """Count the followed fetches that have run HANG_S seconds without ending;
        with ``wait``, first wait (up to HANG_S) for the others to end."""
        while wait and self.pending and time.monotonic() < max(
                d for d, _ in self.pending.values()):
            self.mesh.poll(time.monotonic() + 0.2)
            self._file_async(Episode(-1))
        now = time.monotonic()
        for (peer, model, version), (deadline, seed) in list(self.pending.items()):
            if now >= deadline:
                del self.pending[(peer, model, version)]
                self.totals["fetch_failures"] += 1
                line = (f"seed {seed}: {peer}'s fetch of version {version} had not ended "
                        f"{HANG_S:g} s after the episode")
                self.problems.append(line)
                print(f"  ! {line}", flush=True)

    def forget_fetches_of(self, names: list[str]) -> None:
        """A restarted peer's fetches end with it: not a hang."""
        for key in [k for k in self.pending if k[0] in names]:
            del self.pending[key]

    def seed(self, seed: int, label: str = "", insider: bool = False) -> None:
        """Run, check and print episode ``seed`` (``insider``: one of the insider's
        attacks); repair the mesh for the next."""
        t = time.monotonic()
        ep = self.episode(seed, insider)
        self.record(ep)
        self.seconds.append(time.monotonic() - t)
        print(f"seed {seed}{label}: {ep.attack or '-'}; faults: "
              f"{', '.join(ep.faults) or 'none'}; {len(ep.activations)} activations, "
              f"{len(ep.fetch_errors)} fetch errors ({self.seconds[-1]:.1f} s)", flush=True)

    def absorb(self, other: Runner) -> None:
        """Add another runner's counts (another family of seeds) to ours."""
        for k, n in other.totals.items():
            self.totals[k] += n
        self.problems += other.problems
        for mine, theirs in ((self.by_attack, other.by_attack), (self.faults, other.faults)):
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n
        self.silent += other.silent
        self.slow_unpublishes += other.slow_unpublishes
        self.heal_failures += other.heal_failures
        self.missed_wakeups += other.missed_wakeups
        self.seconds += other.seconds
        self.restarts += other.mesh.restarts
        for fam, counts in other.by_family.items():
            mine = self.by_family.setdefault(fam, dict.fromkeys(("seeds", *ACCEPTED), 0))
            for k, n in counts.items():
                mine[k] += n

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
        fam = self.by_family.setdefault(family(ep.attack), dict.fromkeys(("seeds", *ACCEPTED), 0))
        fam["seeds"] += 1
        for k in ACCEPTED:
            fam[k] += verdict.counts[k]
        self.hung()
        restart = sorted(ep.killed | set(ep.exited))
        self.forget_fetches_of(restart)
        if verdict.poisoned:
            print(f"  seed {ep.seed}: the mesh keeps the rogue's state; restarting it",
                  flush=True)
            self.forget_fetches_of(self.mesh.names)
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
            self.heal_failures.append(f"seed {ep.seed}: {self.mesh.unhealthy}")
            print(f"  seed {ep.seed}: the mesh did not heal ({self.mesh.unhealthy[:300]}); "
                  "restarting it", flush=True)
            self.forget_fetches_of(self.mesh.names)
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
