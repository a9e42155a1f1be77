"""``tensorhub bench cluster --topology-suite DIR``: TensorHub's fan-out on every topology
file of a folder, each against its own fluid bound, and the worst over the suite.

Theory of operation
-------------------
Each ``*.toml`` of ``DIR`` (sorted by name; format in ``docs/cluster.md``) is built as its
own emulated cluster (:func:`~tensorhub.testing.netns.open_topology`). Only TensorHub
fan-outs run there (no star, no baselines: a star would teach the peers the direct
links before the runs that are meant to find them). For each of ``--runs``:

(a) *declared*: a mesh whose peers are told the file's links (``--links`` to
    :mod:`tensorhub.testing.worker`, so ``PeerConfig.links``) fans out version 1;
(b) *learned*: a fresh mesh told nothing fans out versions 1, 2 and 3 one after the
    other (each dropped before the next): whatever the peers measure and gossip during
    one fan-out is what the planner knows in the next. Version 2 is the figure.

The declared links are written from the parsed file into the cluster's scratch folder,
named as the workers' ``dc`` labels are (``dc<index>``, :class:`~.cluster.Mesh`), one
``from``/``to`` table per capped direction at its rate when the fan-out starts
(``[defaults]`` included; a ``[[change]]`` is not declared: it is what a peer has to
notice).

A fan-out is timed as in :mod:`.cluster` (first start to last end, one clock). The
file's ``[[change]]`` tables are applied during every fan-out: a thread started just
before the fetches are sent changes the htb class at each ``at_s``
(:meth:`~tensorhub.testing.netns.Cluster.set_link_rate`); after the fan-out the rates are
put back. When each change really landed, relative to the first fetch's start, is kept.

Inter-DC bytes are the kernel counters of the router's legs (per DC: bytes into it);
``interdc_bytes_vs_min`` divides them by the least that must cross: one copy into each
DC that has a fetcher and no source (every DC but the trainer's).

Where the remote DCs' bytes came from is shown per fan-out from the fetch reports'
``bytes_by_source`` (the source's DC), and, when the reports carry a ``route`` (the DC
path a fetch was planned over), the routes as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import PeerConfig
from ..errors import TensorHubError
from ..links import load_links
from ..testing.clusterspec import ClusterSpec, LinkChange, fluid_bound_s, load_topology
from ..testing.netns import Cluster, ClusterUnavailable, open_topology
from .baselines import chunk_text
from .cluster import (
    FETCH_TIMEOUT_S,
    MODEL,
    SETUP_TIMEOUT_S,
    TRAINER,
    ClusterBenchError,
    Fanout,
    Mesh,
    mesh_keys,
    open_mesh,
)
from .figures import figure

FANOUT_BOUND = 1.3
"""``fanout_vs_fluid_bound_declared_v1`` and ``_learned_v2``'s bound (worst file)."""
INTERDC_BOUND = 1.1
"""``interdc_bytes_vs_min``'s bound (worst fan-out)."""
LEARNED_VERSIONS = (1, 2, 3)
"""Versions the learning mesh fans out in turn; :data:`FIGURE_VERSION` is the figure."""
FIGURE_VERSION = 2
BASE_PORT = 7800
"""Run ``r``'s declared mesh listens on ``BASE_PORT + 20 r``, its learning mesh 10 above."""


def dc_label(dc: int) -> str:
    """The ``dc`` label :class:`~.cluster.Mesh` gives the workers of DC ``dc``."""
    return f"dc{dc}"


def declared_links(spec: ClusterSpec) -> str:
    """The ``[[link]]`` tables that tell a peer ``spec``'s links as they are when a
    fan-out starts: one per capped direction, DCs named as the workers' labels."""
    out = []
    for (src, dst), link in sorted(spec.links.items()):
        if link.mbit is not None:
            out.append(f'[[link]]\nfrom = "{dc_label(src)}"\nto = "{dc_label(dst)}"\n'
                       f"mbit = {link.mbit!r}\nrtt_ms = {link.rtt_ms!r}\n")
    return "\n".join(out)


@dataclass
class Shot:
    """One fan-out of the suite and what it crossed."""

    kind: str
    """``declared v1`` or ``learned v<n>``."""
    fanout: Fanout
    into_bytes: dict[int, int]
    """Per DC, bytes into it over its router leg meanwhile."""
    changes_at_s: list[dict[str, Any]] = field(default_factory=list)
    """Each change applied: the DC pair, the rate, and when it landed (s after the first
    fetch started)."""


@contextmanager
def changing(cluster: Cluster, changes: Sequence[LinkChange]
             ) -> Iterator[list[tuple[LinkChange, float]]]:
    """Apply ``changes`` at their ``at_s`` from now on (a thread), yield the list of
    ``(change, monotonic time it was applied)``, and on the way out stop and put every
    changed link back to the rate it was built with."""
    applied: list[tuple[LinkChange, float]] = []
    if not changes:
        yield applied
        return
    stop = threading.Event()
    failed: list[BaseException] = []
    t0 = time.monotonic()

    def run() -> None:
        try:
            for change in sorted(changes, key=lambda c: c.at_s):
                if stop.wait(max(0.0, t0 + change.at_s - time.monotonic())):
                    return
                cluster.set_link_rate(change.src, change.dst, change.mbit)
                applied.append((change, time.monotonic()))
        except BaseException as error:  # reported by the driver below
            failed.append(error)

    thread = threading.Thread(target=run, name="link changes", daemon=True)
    thread.start()
    try:
        yield applied
    finally:
        stop.set()
        thread.join()
        for src, dst in sorted({(c.src, c.dst) for c, _ in applied}):
            mbit = cluster.spec.link(src, dst).mbit
            assert mbit is not None  # a change needs a capped link (ClusterSpec checks)
            cluster.set_link_rate(src, dst, mbit)
    if failed:
        raise ClusterBenchError(f"changing a link failed: {failed[0]}") from failed[0]


SETTLE_TIMEOUT_S = 90.0
"""Most seconds a fresh mesh is given for its link probes before its first fan-out."""


def settle(mesh: Mesh, dcs: int) -> float:
    """Wait until every peer knows a measured estimate of every ordered DC pair (the
    probes at join are done and gossiped), at most :data:`SETTLE_TIMEOUT_S`; returns the
    seconds waited.  Probes belong to joining, not to the version: their bytes must
    not count as the fan-out's, nor their load slow it."""
    t0 = time.monotonic()
    want = dcs * (dcs - 1)
    while time.monotonic() - t0 < SETTLE_TIMEOUT_S:
        known = [sum(1 for link in w.call("stats", cmd="stats")["wan"].get("links", [])
                     if link.get("how") == "measured")
                 for w in mesh.workers.values()]
        if min(known) >= want:
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def fanout(mesh: Mesh, version: int, size: int, kind: str) -> Shot:
    """The trainer publishes ``version``; every rollout fetches it at once with no
    sources named (as :meth:`~.cluster.Mesh.fanout`), while the file's changes are applied;
    then everyone drops it."""
    cluster = mesh.cluster
    published = mesh.trainer.call("published", cmd="publish", model=MODEL, version=version,
                                  shape="large", size=size)
    for worker in mesh.rollouts:
        worker.prepare(size)
        worker.call("holders", cmd="wait_holders", model=MODEL, version=version, count=1,
                    timeout=SETUP_TIMEOUT_S)
    before = cluster.wan_counters()
    with changing(cluster, cluster.spec.changes) as applied:
        for worker in mesh.rollouts:
            worker.send(cmd="fetch", model=MODEL, version=version, into=True, sources=None)
        fetches = {w.name: w.expect("fetched", FETCH_TIMEOUT_S) for w in mesh.rollouts}
    after = cluster.wan_counters()
    into = {dc: (after[dc] - before[dc]).tx_bytes for dc in after}
    for worker in [*mesh.rollouts, mesh.trainer]:
        worker.call("unpublished", cmd="unpublish", model=MODEL, version=version)
    shot = Shot(kind, Fanout(fetches, published, sum(into.values())), into)
    start = min(f["start"] for f in fetches.values())
    names = [dc.name for dc in cluster.spec.dcs]
    shot.changes_at_s = [{"from": names[c.src], "to": names[c.dst], "mbit": c.mbit,
                          "at_s": c.at_s, "applied_s": round(t - start, 3)}
                         for c, t in applied]
    return shot


@dataclass
class FileResult:
    """Everything one topology file's runs measured."""

    path: str
    spec: ClusterSpec
    bound_s: float
    shots: list[Shot] = field(default_factory=list)
    error: str | None = None
    settle_s: list[float] = field(default_factory=list)
    """Seconds each mesh waited for its link probes before its first fan-out."""

    def seconds(self, kind: str) -> list[float]:
        return [s.fanout.seconds for s in self.shots if s.kind == kind]

    def median_ratio(self, kind: str) -> float | None:
        times = self.seconds(kind)
        return statistics.median(times) / self.bound_s if times else None


def remote_dcs(spec: ClusterSpec) -> list[int]:
    """DCs with a fetcher and no source: every DC but the trainer's (``h0``'s)."""
    return [d for d in range(len(spec.dcs)) if d != spec.hosts[0][0]]


def interdc_ratio(shot: Shot, spec: ClusterSpec, size: int) -> float:
    """Bytes that crossed between DCs over the least that must: one copy per remote DC."""
    return (shot.fanout.wan_bytes or 0) / (len(remote_dcs(spec)) * size)


def source_dcs(shot: Shot, cluster_hosts: Sequence[tuple[int, float]],
               spec: ClusterSpec) -> dict[str, dict[str, float]]:
    """Per remote DC (by name), the share of its rollouts' bytes that came from each DC."""
    names = [dc.name for dc in spec.dcs]

    def dc_of(source: str) -> str:
        if source == TRAINER:
            return names[cluster_hosts[0][0]]
        if source.startswith("h") and source[1:].isdigit() and int(source[1:]) < len(
                cluster_hosts):
            return names[cluster_hosts[int(source[1:])][0]]
        return "?"

    out: dict[str, dict[str, float]] = {}
    for dc in remote_dcs(spec):
        got: dict[str, int] = {}
        for name, fetch in shot.fanout.fetches.items():
            if cluster_hosts[int(name[1:])][0] != dc:
                continue
            for source, n in fetch["report"]["bytes_by_source"].items():
                got[dc_of(source)] = got.get(dc_of(source), 0) + n
        total = sum(got.values()) or 1
        out[names[dc]] = {k: v / total for k, v in sorted(got.items(), key=lambda kv: -kv[1])}
    return out


def routes(shot: Shot, spec: ClusterSpec) -> dict[str, list[str]] | None:
    """Per remote DC, the distinct ``route`` values of its rollouts' fetch reports; None
    when the reports have no such field."""
    found = [f["report"].get("route") for f in shot.fanout.fetches.values()]
    if all(r is None for r in found):
        return None
    out: dict[str, list[str]] = {}
    for dc in remote_dcs(spec):
        seen = {str(f["report"].get("route")) for n, f in shot.fanout.fetches.items()
                if spec.hosts[int(n[1:])][0] == dc}
        out[spec.dcs[dc].name] = sorted(seen)
    return out


def path_text(shot: Shot, spec: ClusterSpec) -> str:
    """The table's last column: where each remote DC's bytes came from, by the source's
    DC (``ap<-eu 75% us 25%``)."""
    parts = []
    for dc, shares in source_dcs(shot, spec.hosts, spec).items():
        parts.append(f"{dc}<-" + " ".join(f"{src} {share:.0%}"
                                          for src, share in shares.items() if share >= 0.005))
    return "; ".join(parts)


def route_lines(shot: Shot, spec: ClusterSpec) -> list[str]:
    """Per remote DC, its rollouts' distinct routes (none if the reports have none)."""
    found = routes(shot, spec)
    if found is None:
        return []
    return [f"{dc}: " + " | ".join(r or "(no route)" for r in rs) for dc, rs in found.items()]


def run_file(args: argparse.Namespace, path: Path, spec: ClusterSpec) -> FileResult:
    """Build ``path``'s cluster and run ``--runs`` x (declared v1; learned v1, v2, v3)."""
    size, chunk = args.size, args.chunk
    result = FileResult(str(path), spec, fluid_bound_s(spec, size))
    with open_topology(spec) as cluster, \
            tempfile.TemporaryDirectory(prefix="tensorhub-keys-") as key_dir:
        keys = mesh_keys(cluster, key_dir) if args.keys == "on" else None
        links_file = cluster.scratch_dir / "declared-links.toml"
        links_file.write_text(declared_links(spec))
        load_links(links_file)  # what the workers will read: fail here, not in eleven peers
        for run in range(args.runs):
            port = BASE_PORT + 20 * run
            with open_mesh(cluster, chunk, args.plan, port, keys,
                           extra=["--links", str(links_file), *PEERS]) as mesh:
                result.settle_s.append(settle(mesh, len(spec.dcs)))
                result.shots.append(fanout(mesh, 1, size, "declared v1"))
                _say(result, result.shots[-1], size)
            with open_mesh(cluster, chunk, args.plan, port + 10, keys, extra=PEERS) as mesh:
                result.settle_s.append(settle(mesh, len(spec.dcs)))
                for version in LEARNED_VERSIONS:
                    result.shots.append(fanout(mesh, version, size, f"learned v{version}"))
                    _say(result, result.shots[-1], size)
    return result


def _say(result: FileResult, shot: Shot, size: int) -> None:
    print(f"  {shot.kind}: {shot.fanout.seconds:.2f} s ({shot.fanout.seconds / result.bound_s:.2f}"
          f" x bound, {interdc_ratio(shot, result.spec, size):.2f} x min inter-DC bytes)",
          flush=True)


PROBES = ("--wan-probe-bytes", str(PeerConfig.wan_probe_bytes))
"""The suite's peers probe the links between DCs at join, as peers do by default (the
plain ``bench cluster`` turns probes off: its 2-DC figures predate them)."""

PEERS = (*PROBES, "--timers", "default")
"""How the suite's peers run: probes on, and ``PeerConfig``'s own membership timers (a
probe timeout of 0.5 s, gossip every second), as a deployment across DCs would.  The
workers' local preset (a 0.1 s probe timeout, gossip ten times a second) is for one
machine: across round trips of 40-150 ms every direct probe between DCs timed out, so
peers were suspected and coordinators moved mid-fetch, and holdings gossip took most
of the CPU (05-split-over-two-links: 29 s with 1.66x the inter-DC bytes; workers used
2.7 CPU-seconds each in a 19 s fan-out, 1.0 with these timers)."""

KINDS = ("declared v1", *(f"learned v{v}" for v in LEARNED_VERSIONS))


def suite_figures(results: Sequence[FileResult], size: int) -> list[dict[str, Any]]:
    """The suite's figures: per fan-out kind the worst file's median over its bound, and
    the worst inter-DC ratio over every fan-out."""
    done = [r for r in results if r.error is None and r.shots]
    if not done:
        raise ClusterBenchError("no topology file of the suite ran to the end")

    def worst(kind: str) -> float:
        return max(r.median_ratio(kind) or 0.0 for r in done)

    interdc = max(interdc_ratio(s, r.spec, size) for r in done for s in r.shots)
    return [
        figure("fanout_vs_fluid_bound_declared_v1", worst("declared v1"), "ratio",
               FANOUT_BOUND, "lower"),
        figure(f"fanout_vs_fluid_bound_learned_v{FIGURE_VERSION}",
               worst(f"learned v{FIGURE_VERSION}"), "ratio", FANOUT_BOUND, "lower"),
        figure("fanout_vs_fluid_bound_learned_v1", worst("learned v1"), "ratio",
               FANOUT_BOUND, "lower"),
        figure("interdc_bytes_vs_min", interdc, "ratio", INTERDC_BOUND, "lower"),
    ]


def print_table(results: Sequence[FileResult], size: int) -> None:
    print(f"\n{'file':<28} {'fan-out':<12} {'seconds':>8} {'bound':>7} {'x bound':>8} "
          f"{'interdc':>8}  where the remote DCs' bytes came from (by the source's DC)")
    for r in results:
        name = Path(r.path).stem
        if r.error is not None:
            print(f"{name:<28} FAILED: {r.error}")
            continue
        for kind in KINDS:
            shots = [s for s in r.shots if s.kind == kind]
            if not shots:
                continue
            times = [s.fanout.seconds for s in shots]
            med = statistics.median(times)
            crossed = max(interdc_ratio(s, r.spec, size) for s in shots)
            middle = min(shots, key=lambda s: abs(s.fanout.seconds - med))
            print(f"{name:<28} {kind:<12} {med:>8.2f} {r.bound_s:>7.2f} {med / r.bound_s:>8.2f} "
                  f"{crossed:>8.2f}  {path_text(middle, r.spec)}")
            for line in route_lines(middle, r.spec):
                print(f"{'':<30}route {line}")
            name = ""
        if any(routes(s, r.spec) is not None for s in r.shots):
            print(f"{'':<30}(routes name DCs by the peers' labels: "
                  + ", ".join(f"{dc_label(d)} = {dc.name}" for d, dc in enumerate(r.spec.dcs))
                  + ")")
    print("\nseconds: median over runs; bound: the file's fluid bound (changes included); "
          "interdc: the worst run's inter-DC bytes / (remote DCs x size).\n"
          f"learned v1 is reported, not judged: a fresh mesh knows no links yet; it is "
          f"shown against the v{FIGURE_VERSION} bound ({FANOUT_BOUND}).\n")


def print_suite_figures(figures: Sequence[dict[str, Any]]) -> None:
    """The figures as :func:`~.figures.print_figures` prints them, with room for the
    names."""
    width = max(len(f["name"]) for f in figures)
    print(f"{'figure':<{width}} {'value':>8} {'bound':>7}  ok")
    for f in figures:
        sign = ">=" if f["better"] == "higher" else "<="
        print(f"{f['name']:<{width}} {f['value']:>8.3f} {sign}{f['bound']:>5}  "
              f"{'yes' if f['ok'] else 'NO'}")


def file_json(r: FileResult, size: int) -> dict[str, Any]:
    """One file's raw numbers for the ``--json`` line."""
    out: dict[str, Any] = {"file": r.path, "topology": r.spec.to_dict(),
                           "fluid_bound_s": r.bound_s, "error": r.error,
                           "probe_settle_s": r.settle_s}
    for kind in KINDS:
        shots = [s for s in r.shots if s.kind == kind]
        key = kind.replace(" ", "_")
        out[key] = {
            "seconds": [s.fanout.seconds for s in shots],
            "vs_fluid_bound": r.median_ratio(kind),
            "wan_bytes": [s.fanout.wan_bytes for s in shots],
            "into_dc_bytes": [{r.spec.dcs[d].name: n for d, n in s.into_bytes.items()}
                              for s in shots],
            "interdc_bytes_vs_min": [interdc_ratio(s, r.spec, size) for s in shots],
            "done_s": [{n: s.fanout.completion_s([n]) for n in s.fanout.fetches}
                       for s in shots],
            "source_dcs": [source_dcs(s, r.spec.hosts, r.spec) for s in shots],
            "routes": [routes(s, r.spec) for s in shots],
            "bytes_by_source": [s.fanout.sources() for s in shots],
            "plans": [s.fanout.plans() for s in shots],
            "changes": [s.changes_at_s for s in shots],
        }
    return out


def run_suite(args: argparse.Namespace) -> int:
    """``--topology-suite DIR``: every ``*.toml`` of DIR, sorted; the table, the figures and
    with ``--json`` one JSON line last."""
    folder = Path(args.topology_suite)
    files = sorted(folder.glob("*.toml"))
    if not files:
        raise ClusterBenchError(f"--topology-suite {folder}: no *.toml files there")
    specs = [(path, load_topology(path)) for path in files]  # every file checked first
    for path, spec in specs:
        if len(spec.dcs) < 2 or len(spec.hosts) < 3:
            raise ClusterBenchError(f"{path}: the suite needs at least 2 DCs and 3 hosts")
    size, chunk = args.size, args.chunk
    print(f"topology suite: {len(files)} file(s) in {folder}; {size / 2**20:g} MiB, "
          f"{chunk_text(chunk, size)}, median of {args.runs} run(s) per fan-out; declared "
          f"v1, then learned v{', v'.join(map(str, LEARNED_VERSIONS))}", flush=True)
    results: list[FileResult] = []
    for i, (path, spec) in enumerate(specs):
        print(f"\n[{i + 1}/{len(specs)}] {path.name}: {spec.describe()}; fluid bound "
              f"{fluid_bound_s(spec, size):.2f} s", flush=True)
        try:
            results.append(run_file(args, path, spec))
        except ClusterUnavailable:
            raise
        except TensorHubError as error:  # a worker failed, a tc command, a link change
            print(f"  FAILED: {error}", flush=True)
            results.append(FileResult(str(path), spec, fluid_bound_s(spec, size),
                                      error=str(error)))
    print_table(results, size)
    figures = suite_figures(results, size)
    print_suite_figures(figures)
    failed = [r.path for r in results if r.error is not None]
    if failed:
        print(f"\nnot run to the end (figures leave them out): {', '.join(failed)}")
    if args.json:
        print(json.dumps({
            "figures": figures,
            "measured": {"files": [file_json(r, size) for r in results], "failed": failed},
            "settings": {"topology_suite": str(folder), "files": [str(p) for p in files],
                         "size_bytes": size, "chunk_bytes": chunk or "auto",
                         "runs": args.runs, "plan": args.plan, "keys": args.keys,
                         "learned_versions": list(LEARNED_VERSIONS),
                         "figure_version": FIGURE_VERSION},
        }))
    return 1 if failed else 0
