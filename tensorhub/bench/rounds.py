"""``tensorhub bench rounds``: model-parallel groups switching versions while a trainer
publishes fast, on a loaded host -- how many rounds abort, and why.

Every peer is its own OS process on loopback (:mod:`tensorhub.bench.rounds_worker`):

* a **trainer**: four publisher ranks (a TP=4 group; the embedding and the qkv
  projections split along dim 0, the output projections along dim 1, norms replicated).
  Every ``--cadence`` seconds the driver tells all four to publish the next version and
  waits for all four (lockstep).  Each keeps its newest ``--keep`` versions and every
  version a group may still stage -- any newer than the oldest live version of the
  groups' leaders, which only ever move forward -- up to ``--max-held`` versions;
  older ones are unpublished in the background.  So a version vanishes under a staging
  group only when that group is ``--max-held`` versions behind (counted as forced).
* **consuming groups** (``--groups``, default one of 2 ranks and one of 3), each rank
  its own peer and process, with a layout that splits where the publishers do not, so
  every fetch reshards.  Every rank loops on ``group.fetch_latest()``; rank 0 (the
  leader) waits for a version newer than its live one before each round, until
  ``--rounds`` rounds have switched.  Every rank checks the bytes of every switch it
  sees against what the trainer published.
* ``--busy`` neighbour processes, each spinning on a core from the first publish to the
  end: a host as loaded as the acceptance tests'.

Figures: ``group_aborts`` (rounds that failed, at the leaders: aborted, timed out or
another error -- the texts of the first few are printed), ``group_rounds`` (switches of
the group that made the fewest), ``mixed_or_wrong_slices``; and two that say whether
the groups keep up: ``round_seconds_median`` and ``versions_behind_median`` (published
versions newer than the one a round switched to, when it switched).  A group keeps up
when it switches to one of the trainer's newest ``--keep`` versions: at most
``--keep - 1`` behind, in rounds of at most that many cadences.

The leaders report every round as it ends and every rank each mismatch as it finds it,
so a rank that stops answering loses none of the counts; it is named (``silent``).

Security: keys for every peer in a temporary directory (only the trainer's ranks may
publish), unless ``--insecure``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from ..ops.demo import parse_size
from ..processes import free_ports
from ..security import write_keys
from ..testing.chaos.mesh import MeshError, Proc
from .figures import figure, print_figures
from .rounds_worker import HIDDEN, MODEL, drop_old, model_bytes

PUBLISHERS = [f"t{r}" for r in range(4)]
REPLY_S = 30.0
"""How long a command's reply may take before the run fails (a loaded host is slow)."""
PROGRESS_S = 10.0
"""Seconds between progress lines."""


class Driver:
    """The processes and their events: replies filed by peer, rounds by group."""

    def __init__(self, args: argparse.Namespace, logdir: Path, keys: str) -> None:
        self.args = args
        self.groups = {f"g{g}": [f"g{g}r{k}" for k in range(n)]
                       for g, n in enumerate(args.group_sizes)}
        self.names = [*PUBLISHERS, *(n for ranks in self.groups.values() for n in ranks)]
        self.logdir, self.keys = logdir, keys
        self.events: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
        self.inbox: dict[str, deque[dict[str, Any]]] = {n: deque() for n in self.names}
        self.rounds: dict[str, list[dict[str, Any]]] = {g: [] for g in self.groups}
        self.done: set[str] = set()
        self.wrong: dict[str, list[str]] = {g: [] for g in self.groups}
        self.procs: dict[str, Proc] = {}
        self.busy: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        a = self.args
        ports = dict(zip(self.names, free_ports(len(self.names)), strict=True))
        seed = f"127.0.0.1:{ports[PUBLISHERS[0]]}"
        for name in self.names:
            argv = [sys.executable, "-m", "tensorhub.bench.rounds_worker", "--name", name,
                    "--listen", f"127.0.0.1:{ports[name]}", "--expect", str(len(self.names)),
                    "--size", str(a.size_bytes), "--chunk", str(a.chunk_bytes),
                    "--keep", str(a.keep), "--max-held", str(a.max_held),
                    "--round-timeout", str(a.round_timeout)]
            if name in PUBLISHERS:
                argv += ["--role", "publisher", "--rank", name[1:]]
            else:
                g, _, k = name[1:].partition("r")
                argv += ["--role", "consumer", "--group", g, "--rank", k, "--group-size",
                         str(len(self.groups[f"g{g}"]))]
            if name != PUBLISHERS[0]:
                argv += ["--join", seed]
            if self.keys:
                argv += ["--keys", self.keys]
            self.procs[name] = Proc(name, argv, self.logdir, self.events)
        for name in self.names:
            self.reply(name, "ready", 180.0)

    def start_busy(self) -> None:
        self.busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                     for _ in range(self.args.busy)]

    def poll(self, until: float) -> None:
        """File the events that arrive before monotonic time ``until``."""
        while True:
            left = until - time.monotonic()
            try:
                name, ev = self.events.get(timeout=left) if left > 0 \
                    else self.events.get_nowait()
            except queue.Empty:
                return
            group = name.partition("r")[0]
            if ev.get("event") == "round":
                self.rounds[group].append(ev)
            elif ev.get("event") == "done":
                self.done.add(group)
            elif ev.get("event") == "wrong":
                self.wrong[group].append(f"{name}: {ev['text']}")
            else:
                self.inbox[name].append(ev)

    def reply(self, name: str, event: str, timeout: float = REPLY_S) -> dict[str, Any]:
        """The next reply of ``name``, which must be ``event``; MeshError otherwise."""
        deadline = time.monotonic() + timeout
        box, proc = self.inbox[name], self.procs[name]
        while not box:
            if time.monotonic() >= deadline or proc.p.poll() is not None:
                self.poll(time.monotonic())
                if box:
                    break
                why = "exited" if proc.p.poll() is not None else f"silent for {timeout:.1f} s"
                raise MeshError(f"{name} {why} waiting for {event!r}: {proc.stderr_tail()}")
            self.poll(min(deadline, time.monotonic() + 0.05))
        ev = box.popleft()
        if ev.get("event") != event:
            raise MeshError(f"{name} answered {ev} (expected {event!r})")
        return ev

    def floor(self) -> int:
        """The oldest version a group may still stage: above every leader's live one."""
        live = [max((ev["version"] for ev in self.rounds[g] if not ev["error"]), default=0)
                for g in self.groups]
        return min(live) + 1

    def cpu_seconds(self) -> float:
        """CPU seconds the peer processes have used so far (user + system)."""
        total = 0
        for proc in self.procs.values():
            try:
                fields = Path(f"/proc/{proc.p.pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:  # ended, or not Linux
                continue
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def progress(self, elapsed: float, versions: int, cpu: float) -> str:
        parts = []
        for g, evs in self.rounds.items():
            failed = sum(1 for ev in evs if ev["error"])
            parts.append(f"{g} {len(evs) - failed} switched, {failed} failed")
        return (f"{elapsed:5.1f} s: {versions} versions published; {'; '.join(parts)}; "
                f"peers' CPU {cpu:.2f} s/s")

    def stop(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Stop every consuming rank: the counts of those that answer, and those silent."""
        for name in self.names[len(PUBLISHERS):]:
            self.procs[name].send(cmd="stop")
        stopped, silent = {}, []
        deadline = time.monotonic() + REPLY_S
        for name in self.names[len(PUBLISHERS):]:
            try:
                stopped[name] = self.reply(name, "stopped",
                                           max(0.1, deadline - time.monotonic()))
            except MeshError as exc:
                print(f"  {exc}", flush=True)
                silent.append(name)
        return stopped, silent

    def close(self) -> None:
        for p in self.busy:
            p.kill()
            p.wait()
        for proc in self.procs.values():
            proc.end()


def publish_loop(d: Driver) -> dict[str, Any]:
    """Publish a version every ``--cadence`` seconds until every group is done or
    ``--deadline`` passes; when each version was complete at every rank, and how long
    its publish took."""
    a = d.args
    published: list[float] = []  # published[v - 1]: when v was complete at every rank
    held: list[int] = []  # what every rank holds, by the workers' rule
    forced: set[int] = set()
    seconds: list[float] = []
    late = 0
    start = next_at = shown = time.monotonic()
    cpu_at = cpu0 = d.cpu_seconds()
    while len(d.done) < len(d.groups) and time.monotonic() < start + a.deadline:
        v = len(published) + 1
        t0 = time.monotonic()
        floor = d.floor()
        for name in PUBLISHERS:
            d.procs[name].send(cmd="publish", version=v, floor=floor)
        held.append(v)
        forced.update(old for old, f in drop_old(held, floor, a.keep, a.max_held) if f)
        replies = [d.reply(name, "published") for name in PUBLISHERS]
        published.append(time.monotonic())
        seconds.append(max(r["seconds"] for r in replies))
        if v == 1:
            for ranks in d.groups.values():
                for name in ranks:
                    d.procs[name].send(cmd="run", rounds=a.rounds,
                                       round_timeout=a.round_timeout)
            for ranks in d.groups.values():
                for name in ranks:
                    d.reply(name, "running")
        next_at += a.cadence
        if published[-1] - t0 > a.cadence or time.monotonic() > next_at:
            late += 1
            next_at = time.monotonic()
        d.poll(next_at)
        if time.monotonic() >= shown + PROGRESS_S:
            now, cpu = time.monotonic(), d.cpu_seconds()
            print(d.progress(now - start, v, (cpu - cpu_at) / (now - shown)), flush=True)
            shown, cpu_at = now, cpu
    return {"published_at": published, "publish_s": seconds, "late": late, "forced": forced,
            "seconds": time.monotonic() - start, "peer_cpu_s": d.cpu_seconds() - cpu0}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tensorhub-rounds-") as tmp:
        keys = ""
        if not args.insecure:
            keys = str(Path(tmp) / "keys")
            names = [*PUBLISHERS, *(f"g{g}r{k}" for g, n in enumerate(args.group_sizes)
                                    for k in range(n))]
            write_keys(keys, names, {MODEL: PUBLISHERS})
        d = Driver(args, Path(tmp), keys)
        print(f"rounds: 4 publisher ranks, groups of "
              f"{' and '.join(map(str, args.group_sizes))} ranks, model "
              f"{model_bytes(args.size_bytes) / 2**20:.1f} MiB in "
              f"{args.chunk_bytes / 2**10:g} KiB chunks, a version every {args.cadence:g} s, "
              f"{args.busy} busy neighbour(s), "
              f"{'insecure (--insecure)' if args.insecure else 'keys'}", flush=True)
        try:
            d.start()
            d.start_busy()
            pub = publish_loop(d)
            stopped, silent = d.stop()
            pstats = {}
            for name in PUBLISHERS:
                d.procs[name].send(cmd="stats")
                try:
                    pstats[name] = d.reply(name, "stats")
                except MeshError as exc:
                    print(f"  {exc}", flush=True)
        finally:
            d.close()
    return {"groups": d.groups, "rounds": d.rounds, "wrong": d.wrong, "stopped": stopped,
            "silent": silent, "publish": pub, "publishers": pstats}


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """Per group, from the leader's round events: switches, failures by kind, those of a
    version the trainer had already dropped, the texts of the first five and the last
    three (with the leader's view then), seconds and lag of each round; mismatches from
    every rank's events; and what each rank that answered ``stop`` counted."""
    published = r["publish"]["published_at"]
    out = {}
    for g, ranks in r["groups"].items():
        events = r["rounds"][g]
        ok = [ev for ev in events if not ev["error"]]
        failed = [ev for ev in events if ev["error"]]
        shown = failed[:5] + failed[5:][-3:]  # the first failures and the last
        dropped = [ev for ev in failed
                   if (m := re.search(r"could not stage version (\d+)", ev["error"]))
                   and int(m[1]) in r["publish"]["forced"]]
        stopped = {n: r["stopped"][n] for n in ranks if n in r["stopped"]}
        out[g] = {"ranks": len(ranks), "switches": len(ok),
                  **{k: sum(1 for ev in failed if ev["kind"] == k)
                     for k in ("aborts", "timeouts", "errors")},
                  "failed": len(failed), "on_dropped_versions": len(dropped),
                  "texts": [ev["error"] for ev in shown],
                  "views": [ev["view"] for ev in shown],
                  "causes": dict(Counter(re.sub(r"\d+(\.\d+)?", "N", ev["error"])
                                         for ev in failed).most_common(5)),
                  "wrong": len(r["wrong"][g]), "wrong_texts": r["wrong"][g][:5],
                  "silent": [n for n in ranks if n not in stopped],
                  "checked": {n: s["checked"] for n, s in stopped.items()},
                  "group_stats": {n: {"switches": s["switches"], "aborts": s["group_aborts"]}
                                  for n, s in stopped.items()},
                  "release_errors": [t for s in stopped.values() for t in s["release_errors"]],
                  "round_s": [ev["seconds"] for ev in ok],
                  "versions_behind": [bisect.bisect_right(published, ev["at"]) - ev["version"]
                                      for ev in ok],
                  "publish_to_switch_s": [ev["at"] - published[ev["version"] - 1]
                                          for ev in ok]}
    return out


def figures_of(args: argparse.Namespace, groups: dict[str, Any]) -> list[dict[str, Any]]:
    round_s = [s for g in groups.values() for s in g["round_s"]]
    behind = [b for g in groups.values() for b in g["versions_behind"]]
    nan = float("nan")
    return [
        figure("group_aborts", sum(g["failed"] for g in groups.values()), "rounds", 0,
               "lower"),
        figure("group_rounds", min(g["switches"] for g in groups.values()), "rounds",
               args.rounds, "higher"),
        figure("mixed_or_wrong_slices", sum(g["wrong"] for g in groups.values()), "count",
               0, "lower"),
        figure("round_seconds_median", statistics.median(round_s) if round_s else nan, "s",
               round((args.keep - 1) * args.cadence, 3), "lower"),
        figure("versions_behind_median", statistics.median(behind) if behind else nan,
               "versions", args.keep - 1, "lower"),
    ]


def _quantiles(xs: list[float]) -> str:
    if not xs:
        return "-"
    s = sorted(xs)
    return f"{statistics.median(s):.3f} / {s[int(0.9 * (len(s) - 1))]:.3f} / {s[-1]:.3f}"


def run_cli(args: argparse.Namespace) -> int:
    args.size_bytes, args.chunk_bytes = parse_size(args.size), parse_size(args.chunk)
    args.group_sizes = [int(n) for n in args.groups.split(",") if n]
    if not args.group_sizes or any(n < 1 or HIDDEN % n for n in args.group_sizes):
        raise MeshError(f"--groups: sizes that divide {HIDDEN}, comma-separated")
    if args.rounds < 1 or not 2 <= args.keep <= args.max_held or args.busy < 0 \
            or not args.cadence > 0:
        raise MeshError("need --rounds >= 1, 2 <= --keep <= --max-held, --busy >= 0, "
                        "--cadence > 0")
    r = run(args)
    groups = summarize(r)
    pub = r["publish"]
    figures = figures_of(args, groups)
    print()
    ps = r["publishers"].values()
    print(f"{len(pub['published_at'])} versions published in {pub['seconds']:.1f} s "
          f"(publish s median/max {statistics.median(pub['publish_s']):.3f}/"
          f"{max(pub['publish_s']):.3f}, {pub['late']} past their tick); unpublishes: "
          f"{sum(p['unpublish_error_count'] for p in ps)} failed, "
          f"{sum(p['forced_unpublishes'] for p in ps)} forced (a group --max-held behind), "
          f"slowest {max((p['slowest_unpublish_s'] for p in ps), default=0):.2f} s; "
          f"peers used {pub['peer_cpu_s'] / pub['seconds']:.2f} CPU s/s")
    print(f"{'group':<6} {'ranks':>5} {'switched':>8} {'aborted':>7} {'timeout':>7} "
          f"{'error':>5} {'wrong':>5}  round s (med/p90/max)    behind (med/max)")
    for g, s in groups.items():
        behind = s["versions_behind"]
        print(f"{g:<6} {s['ranks']:>5} {s['switches']:>8} {s['aborts']:>7} "
              f"{s['timeouts']:>7} {s['errors']:>5} {s['wrong']:>5}  "
              f"{_quantiles(s['round_s']):<24} "
              f"{statistics.median(behind) if behind else '-'}/{max(behind, default='-')}")
    for g, s in groups.items():
        if s["on_dropped_versions"]:
            print(f"  {g}: {s['on_dropped_versions']} of its {s['failed']} failed rounds "
                  f"staged a version the trainer had dropped (over --max-held "
                  f"{args.max_held} versions behind)")
        if s["silent"]:
            print(f"  {g}: ranks that did not answer stop: {', '.join(s['silent'])}")
        for text, view in zip(s["texts"], s["views"], strict=True):
            print(f"  {g}: {text}")
            print(f"  {g}:   the leader's view then: {view}")
        for text in [*s["wrong_texts"], *s["release_errors"]]:
            print(f"  {g}: {text}")
        for cause, n in s["causes"].items():
            print(f"  {g}: {n} x {cause}")
    for name, p in r["publishers"].items():
        for text in p["unpublish_errors"]:
            print(f"  {name} unpublish: {text}")
    print()
    print_figures(figures)
    if args.json:
        print(json.dumps({
            "figures": [{**f, "value": None} if f["value"] != f["value"] else f
                        for f in figures],  # not measured (NaN): null
            "measured": {"groups": groups, "publish_s": pub["publish_s"],
                         "versions_published": len(pub["published_at"]),
                         "publishes_late": pub["late"], "seconds": pub["seconds"],
                         "peer_cpu_s": pub["peer_cpu_s"],
                         "versions_dropped_while_stageable": len(pub["forced"]),
                         "publishers": r["publishers"]},
            "settings": {"rounds": args.rounds, "cadence": args.cadence,
                         "groups": args.group_sizes, "busy": args.busy,
                         "size": model_bytes(args.size_bytes), "chunk": args.chunk_bytes,
                         "keep": args.keep, "max_held": args.max_held,
                         "round_timeout": args.round_timeout,
                         "deadline": args.deadline, "security": not args.insecure},
        }))
    return 0


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=100,
                   help="switched rounds each group makes (default 100)")
    p.add_argument("--cadence", type=float, default=0.3,
                   help="seconds between published versions (default 0.3)")
    p.add_argument("--groups", default="2,3",
                   help="consuming groups' sizes, comma-separated (default 2,3)")
    p.add_argument("--busy", type=int, default=1,
                   help="neighbour processes spinning on a core (default 1)")
    p.add_argument("--size", default="8MiB", help="model size (default 8MiB)")
    p.add_argument("--chunk", default="256KiB", help="chunk size (default 256KiB)")
    p.add_argument("--keep", type=int, default=4,
                   help="versions each publisher rank keeps at least (default 4)")
    p.add_argument("--max-held", type=int, default=16,
                   help="versions it holds at most, even for a group behind (default 16)")
    p.add_argument("--round-timeout", type=float, default=30.0,
                   help="seconds a round may take (GroupConfig.timeout; default 30)")
    p.add_argument("--deadline", type=float, default=300.0,
                   help="seconds of publishing after which the run stops (default 300)")
    p.add_argument("--insecure", action="store_true", help="run the mesh without keys")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tensorhub.bench.rounds",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    add_options(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
