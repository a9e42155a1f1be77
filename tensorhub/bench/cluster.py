"""``tensorhub bench cluster``: one version fanned out across an emulated cluster, next to
what users run today, in one run and the same namespaces.

Theory of operation
-------------------
:func:`~tensorhub.testing.netns.open_topology` builds one namespace per host of
``--topology FILE`` (any number of DCs, each host's NIC rate, each DC pair's rate and round
trip; :mod:`tensorhub.testing.clusterspec`), or of the shorthand ``--hosts``, ``--nic-mbit``,
``--dcs``, ``--wan-mbit``, ``--wan-rtt-ms`` (hosts split into DCs in contiguous blocks,
every DC pair alike). ``h0`` is the trainer, ``h1`` ... are rollouts. ``--grid`` runs the
whole benchmark once per setting (:mod:`tensorhub.bench.cluster_grid`); the command line
is :mod:`tensorhub.bench.cluster_cli`. :func:`open_mesh` starts one TensorHub peer per host
inside its namespace (:mod:`tensorhub.testing.worker`, TCP only, labels ``host``, ``dc``, ``rack``
and ``nic_bps``, the NIC cap, which the planner's fan-out limits follow),
driven by JSON lines; each worker's stderr goes to ``<scratch>/<name>.log`` and the tails
are printed if anything fails. Then, for each of ``--runs``:

(a) *star*: the trainer publishes a fresh version and every rollout fetches it with
    ``sources=["trainer"]`` at once: TensorHub with planning off;
(b) *TensorHub*: the same with no sources named: each fetcher asks the version's
    coordinator for a plan and follows it (``PeerConfig.planning``); with ``--no-plan``
    the fetchers choose holders themselves (not the publisher if another has the chunk,
    then the least loaded).

A fan-out's time is max(end) - min(start) of the rollouts' fetches, each a
``time.monotonic()`` read in the worker: one clock for every namespace. Every fetch is
digest-verified by the peer before it returns. With DCs, the bytes that crossed between
DCs come from the kernel counters of the router's legs (:meth:`Cluster.wan_bytes`).

Elastic: after the last TensorHub run, the last host's peer leaves and a fresh peer
(``joiner``) starts there, waits until it sees every other holder and fetches with the
same options; its time is compared with what that host took in the star run, where it
pulled from a trainer busy serving every rollout.

Security (``--keys``): ``on`` runs every peer with keys (``tensorhub keygen`` into a
scratch directory, removed at the end). ``both`` starts a second, keyed mesh in the same
namespaces (other ports) next to the keyless one, both up for the whole run; each run
adds a keyed TensorHub fan-out next to the keyless one, alternating which goes first,
and ``security_cost_cluster`` is the keyed median over the keyless one (bound 1.10). The
keyed fan-out pays the data handshake on every connection, CURVE on the control
messages (plans, holders), the manifest's signature check and the signed gossip running
meanwhile; the digest is blake3 in both and data bytes are not encrypted in either.

The peers are then ended and the baselines of :mod:`tensorhub.bench.baselines` (plain TCP
star, gloo broadcast, Ray) run in the same namespaces to the same rollouts. Every time is
printed next to its fluid lower bound; the figures of issue 6 follow, each with its bound
and whether it was met, and ``--json`` adds one JSON line at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TensorHubError
from ..security import write_keys
from ..testing.clusterspec import ClusterSpec, fluid_bound_s
from ..testing.netns import Cluster, Host, open_topology
from ..testing.worker import WorkerClient
from .baselines import BASELINES, BaselineError
from .figures import figure

MODEL = "bench"
TRAINER = "trainer"
JOINER = "joiner"
_PORT = 7700
KEYED_PORT = 7710
"""With ``--keys both``: the keyed mesh's port (its joiner's would be the next one)."""
_STALL_TIMEOUT_S = 60.0
"""Workers' stall limit per chunk read: a star fetch shares the trainer's NIC (or the WAN)
``window x rollouts`` ways, so one 8 MiB chunk can take ~10 s without anything stalling."""
SETUP_TIMEOUT_S = 120.0
FETCH_TIMEOUT_S = 900.0
_ROOT = str(Path(__file__).resolve().parents[2])
BASELINE_EXTRAS = {"gloo": "torch", "ray": "ray"}
FANOUT_BOUND = {False: 1.15, True: 1.25}
"""``fanout_vs_fluid_bound``'s bound: in one DC, and with several."""
INTERDC_BOUND = 1.05
"""``interdc_bytes_vs_size``'s bound: about one copy crosses into each remote DC."""
BASELINE_KEYS = {"star": "tcp_star", "gloo": "gloo", "ray": "ray"}
"""JSON keys of the baselines: ``star_s`` is TensorHub's star, the plain TCP one differs."""


class ClusterBenchError(TensorHubError):
    """A worker failed or answered with an error; the message names it."""


class _Worker(WorkerClient):
    """One bench worker peer inside a host's namespace, spoken to in JSON lines."""

    def __init__(self, cluster: Cluster, host: Host, name: str, port: int, join: str,
                 expect: int, chunk: int, plan: bool, keys: str | None = None,
                 extra: Sequence[str] = ()) -> None:
        self.name = name
        self.host = host
        self.control = f"{host.ip}:{port}"
        self.log = cluster.scratch_dir / f"{name}.log"
        self.prepared = 0
        argv = [sys.executable, "-m", "tensorhub.testing.worker", "--name", name,
                "--listen", self.control, "--join", join, "--expect", str(expect),
                "--chunk", str(chunk), "--transports", "tcp", "--host", host.name,
                "--label", f"dc=dc{host.dc}", "--label", f"rack=dc{host.dc}-r0",
                "--label", f"nic_bps={host.nic_mbit * 1e6 / 8:g}",
                "--planning", "on" if plan else "off",
                "--stall-timeout", str(_STALL_TIMEOUT_S)]  # fmt: skip
        argv += ["--keys", keys] if keys else []
        argv += ["--wan-probe-bytes", "0"]  # the suite turns them on (cluster_suite.PROBES)
        argv += extra
        path = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
        with self.log.open("w") as log:
            process: subprocess.Popen[str] = cluster.run(
                host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, env={**os.environ, "PYTHONPATH": path},
            )  # fmt: skip
        super().__init__(name, process, SETUP_TIMEOUT_S)

    def prepare(self, size: int) -> None:
        """Pre-faulted ``into`` buffers of ``size`` bytes (a rollout's fixed weights)."""
        if self.prepared != size:
            self.call("prepared", cmd="prepare", model=MODEL, shape="large", size=size)
            self.prepared = size

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as error:
            return f"(no log: {error})"


@dataclass(frozen=True)
class Fanout:
    """One version fanned out to every rollout of a :class:`Mesh`."""

    fetches: dict[str, dict[str, Any]]
    """Per rollout, its worker's ``fetched`` reply (start, end, seconds, report, ...)."""
    published: dict[str, Any]
    """The trainer's ``published`` reply (its checksum, RSS)."""
    wan_bytes: int | None
    """Bytes that crossed between DCs meanwhile (kernel counters); None with one DC."""

    @property
    def seconds(self) -> float:
        """From the first rollout's start to the last one's end."""
        return self.completion_s(self.fetches)

    def completion_s(self, names: Sequence[str] | dict[str, Any]) -> float:
        """From the first rollout's start to the last of ``names``' end."""
        start = min(f["start"] for f in self.fetches.values())
        return float(max(self.fetches[n]["end"] for n in names) - start)

    def sources(self) -> dict[str, dict[str, int]]:
        """Per rollout, bytes received per source."""
        return {n: f["report"]["bytes_by_source"] for n, f in self.fetches.items()}

    def plans(self) -> dict[str, str]:
        """Per rollout, the plan it followed (coordinator and epoch) or why none."""
        return {n: f["report"].get("plan", "") for n, f in self.fetches.items()}


class Mesh:
    """A TensorHub peer on every host of a cluster; made by :func:`open_mesh`."""

    def __init__(self, cluster: Cluster, chunk: int, plan: bool, port: int = _PORT,
                 keys: str | None = None, extra: Sequence[str] = ()) -> None:
        self.cluster = cluster
        self.chunk = chunk
        self.plan = plan
        self.port = port
        self.keys = keys
        """A directory of keys (:func:`~tensorhub.security.write_keys`) or None: keyless."""
        self.extra = tuple(extra)
        """More worker options (``--delta auto``)."""
        self.workers: dict[str, _Worker] = {}
        self.seed = f"{cluster.hosts[0].ip}:{port}"

    @property
    def trainer(self) -> _Worker:
        return self.workers[TRAINER]

    @property
    def rollouts(self) -> list[_Worker]:
        return [w for name, w in self.workers.items() if name != TRAINER]

    def _start(self, hosts: Sequence[tuple[Host, str, int]], expect: int) -> None:
        started = []
        for host, name, port in hosts:
            self.workers[name] = worker = _Worker(self.cluster, host, name, port, self.seed,
                                                  expect, self.chunk, self.plan, self.keys,
                                                  self.extra)
            started.append(worker)
        for worker in started:
            worker.expect("ready", SETUP_TIMEOUT_S)

    def fanout(self, version: int, size: int, *, sources: Sequence[str] | None = None,
               keep: bool = False, checksum: bool = False) -> Fanout:
        """The trainer publishes ``version`` (``size`` bytes); every rollout fetches it at
        once into its buffers. Unless ``keep``, everyone drops the version afterwards."""
        published = self.trainer.call("published", cmd="publish", model=MODEL,
                                      version=version, shape="large", size=size)
        for worker in self.rollouts:
            worker.prepare(size)
            worker.call("holders", cmd="wait_holders", model=MODEL, version=version, count=1,
                        timeout=SETUP_TIMEOUT_S)
        wan_before = self.cluster.wan_bytes() if self.cluster.dcs > 1 else None
        for worker in self.rollouts:
            worker.send(cmd="fetch", model=MODEL, version=version, into=True,
                        sources=None if sources is None else list(sources),
                        checksum=checksum)
        fetches = {w.name: w.expect("fetched", FETCH_TIMEOUT_S) for w in self.rollouts}
        wan = None if wan_before is None else self.cluster.wan_bytes() - wan_before
        if not keep:
            for worker in [*self.rollouts, self.trainer]:
                worker.call("unpublished", cmd="unpublish", model=MODEL, version=version)
        return Fanout(fetches, published, wan)

    def join_late(self, host: Host, version: int, size: int
                  ) -> tuple[dict[str, Any], int | None]:
        """The peer on ``host`` leaves; a fresh one (:data:`JOINER`) starts there, waits
        until it sees every other holder of ``version`` and fetches it. Returns its
        ``fetched`` reply and the bytes that crossed between DCs meanwhile."""
        self.workers.pop(host.name).close()
        holders = len(self.workers)
        # Not the leaving peer's port: it may linger.
        self._start([(host, JOINER, self.port + 1)], expect=holders + 1)
        joiner = self.workers[JOINER]
        joiner.prepare(size)
        joiner.call("holders", cmd="wait_holders", model=MODEL, version=version,
                    count=holders, timeout=SETUP_TIMEOUT_S)
        wan_before = self.cluster.wan_bytes() if self.cluster.dcs > 1 else None
        fetched = joiner.call("fetched", FETCH_TIMEOUT_S, cmd="fetch", model=MODEL,
                              version=version, into=True, sources=None)
        return fetched, None if wan_before is None else self.cluster.wan_bytes() - wan_before


@contextmanager
def open_mesh(cluster: Cluster, chunk: int = 8 << 20, plan: bool = True, port: int = _PORT,
              keys: str | None = None, extra: Sequence[str] = ()) -> Iterator[Mesh]:
    """Start a TensorHub peer on every host (``trainer`` on ``h0``, rollouts named after
    their hosts; ``plan``: they follow the coordinator's plans; ``keys``: a directory made
    by :func:`mesh_keys`), yield the :class:`Mesh`, and end the peers on the way out. If
    the block fails, the tail of every peer's log is printed to stderr first."""
    mesh = Mesh(cluster, chunk, plan, port, keys, extra)
    try:
        mesh._start([(h, TRAINER if i == 0 else h.name, port)
                     for i, h in enumerate(cluster.hosts)], expect=len(cluster.hosts))
        yield mesh
    except BaseException:
        for worker in mesh.workers.values():
            print(f"--- {worker.name} on {worker.host.name}: last lines of {worker.log}",
                  file=sys.stderr)
            print(worker.tail(), file=sys.stderr)
        raise
    finally:
        for worker in mesh.workers.values():
            worker.close()


def mesh_keys(cluster: Cluster, directory: str) -> str:
    """Keys for every peer :func:`open_mesh` and :meth:`Mesh.join_late` start on
    ``cluster`` (the trainer publishes), written into ``directory``; returns it."""
    names = [TRAINER, *(h.name for h in cluster.hosts[1:]), JOINER]
    write_keys(directory, names, {MODEL: [TRAINER]})
    return directory


# -- the benchmark ------------------------------------------------------------------------


def bound_s(cluster: Cluster, size: int) -> float:
    """The fluid lower bound of a fan-out from ``h0`` to every other host of ``cluster``
    (:func:`~tensorhub.testing.clusterspec.fluid_bound_s`)."""
    return fluid_bound_s(cluster.spec, size)


@dataclass(frozen=True)
class Measured:
    """Everything one benchmark run measured, in seconds and bytes."""

    star: list[Fanout]
    tensorhub: list[Fanout]
    joiner: dict[str, Any]
    joiner_wan_bytes: int | None
    joiner_host: str
    remote: list[str]
    """Rollouts outside the trainer's DC."""
    baselines: dict[str, float]
    baseline_wan_bytes: dict[str, int]
    keyed: list[Fanout]
    """With ``--keys both``: the keyed mesh's TensorHub fan-outs, else empty."""


def measure(args: argparse.Namespace, spec: ClusterSpec, size: int, chunk: int,
            baselines: Sequence[str]) -> tuple[Measured, float, int]:
    """Build the cluster, run every measurement, remove it all; (results, bound, mtu)."""
    with (open_topology(spec) as cluster,
          tempfile.TemporaryDirectory(prefix="tensorhub-keys-") as key_dir):
        bound = bound_s(cluster, size)
        keys = mesh_keys(cluster, key_dir) if args.keys != "off" else None
        star: list[Fanout] = []
        tensorhub: list[Fanout] = []
        keyed: list[Fanout] = []
        with (open_mesh(cluster, chunk, args.plan,
                        keys=keys if args.keys == "on" else None) as mesh,
              ExitStack() as extra):
            other = (extra.enter_context(open_mesh(cluster, chunk, args.plan, KEYED_PORT,
                                                   keys))
                     if args.keys == "both" else None)
            for run in range(args.runs):
                star.append(mesh.fanout(2 * run + 1, size, sources=[TRAINER]))
                _say("star", star[-1], bound, size)
                last = run == args.runs - 1
                if other is not None and run % 2 == 1:
                    keyed.append(other.fanout(2 * run + 2, size))
                    _say("keyed TensorHub", keyed[-1], bound, size)
                tensorhub.append(mesh.fanout(2 * run + 2, size, keep=last))
                _say("TensorHub", tensorhub[-1], bound, size)
                if other is not None and run % 2 == 0:
                    keyed.append(other.fanout(2 * run + 2, size))
                    _say("keyed TensorHub", keyed[-1], bound, size)
            extra.close()  # the keyed mesh ends: the joiner meets one mesh, as without it
            joiner_host = cluster.hosts[-1]
            joiner, joiner_wan = mesh.join_late(joiner_host, 2 * args.runs, size)
        seconds: dict[str, float] = {}
        wan_bytes: dict[str, int] = {}
        for name in baselines:
            wan_before = cluster.wan_bytes() if cluster.dcs > 1 else 0
            try:
                seconds[name] = BASELINES[name](cluster, size)
            except BaselineError as error:
                raise ClusterBenchError(f"baseline {name}: {error}") from error
            if cluster.dcs > 1:
                wan_bytes[name] = cluster.wan_bytes() - wan_before
            print(f"  measured {name} baseline: {seconds[name]:.2f} s", flush=True)
        remote = [h.name for h in cluster.hosts[1:] if h.dc != cluster.hosts[0].dc]
        return (Measured(star, tensorhub, joiner, joiner_wan, joiner_host.name, remote,
                         seconds, wan_bytes, keyed), bound, cluster.mtu)


def _planned(fans: list[Fanout]) -> str:
    """The share of fetched bytes that came from the source the plan named."""
    reports = [x["report"] for f in fans for x in f.fetches.values()]
    planned = sum(r.get("planned_bytes", 0) for r in reports) / sum(r["bytes"] for r in reports)
    return f"{planned:.0%} of bytes from planned sources"


def _say(what: str, fan: Fanout, bound: float, size: int) -> None:
    crossed = "" if fan.wan_bytes is None else f", {fan.wan_bytes / size:.2f} x size crossed"
    print(f"  measured {what} fan-out: {fan.seconds:.2f} s ({fan.seconds / bound:.2f} x "
          f"bound{crossed})", flush=True)


def report(m: Measured, bound: float, size: int, spec: ClusterSpec, plan: bool
           ) -> tuple[list[tuple[str, float, float, str]], list[dict[str, Any]]]:
    """Rows (what, seconds, its bound, note) and the figures of issue 6 (and 14: the
    fan-out's bound is 1.15 in one DC, 1.25 across DCs)."""
    med = statistics.median
    star_s = med(f.seconds for f in m.star)
    th_s = med(f.seconds for f in m.tensorhub)
    joiner_nic = spec.hosts[int(m.joiner_host.removeprefix("h"))][1]
    one_fetch = size / (min(joiner_nic, spec.hosts[0][1]) * 1e6 / 8)
    busy_s = med(f.fetches[m.joiner_host]["seconds"] for f in m.star)
    joiner_s = float(m.joiner["seconds"])

    def crossed(fans: list[Fanout]) -> str:
        wan = [f.wan_bytes for f in fans if f.wan_bytes is not None]
        return f"{med(wan) / size:.2f} x size crossed DCs" if wan else ""

    non_trainer = sum(n for f in m.tensorhub for s in f.sources().values()
                      for src, n in s.items() if src != TRAINER)
    rows = [
        ("TensorHub fan-out" + ("" if plan else ", --no-plan"), th_s, bound,
         "; ".join(filter(None, [crossed(m.tensorhub), _planned(m.tensorhub),
                                 f"{non_trainer / len(m.tensorhub) / size:.2f} x size "
                                 "from non-trainer sources"]))),
        ("TensorHub star, sources=[trainer]", star_s, bound, crossed(m.star)),
    ]
    for name, seconds in m.baselines.items():
        wan = m.baseline_wan_bytes.get(name)
        rows.append((f"baseline {BASELINE_KEYS[name].replace('_', ' ')}", seconds, bound,
                     "" if wan is None else f"{wan / size:.2f} x size crossed DCs"))
    figures = [
        figure("fanout_vs_fluid_bound", th_s / bound, "ratio",
               FANOUT_BOUND[len(spec.dcs) > 1], "lower"),
        figure("fanout_vs_star", th_s / star_s, "ratio", 0.35, "lower"),
    ]
    for name, label in (("gloo", "fanout_vs_gloo"), ("ray", "fanout_vs_ray")):
        if name in m.baselines:
            figures.append(figure(label, th_s / m.baselines[name], "ratio", 0.5, "lower"))
    if m.remote:
        th_remote = med(f.completion_s(m.remote) for f in m.tensorhub)
        star_remote = med(f.completion_s(m.remote) for f in m.star)
        rows += [("TensorHub, remote DC done", th_remote, bound, ""),
                 ("TensorHub star, remote DC done", star_remote, bound, "")]
        crossed_bytes = med(f.wan_bytes or 0 for f in m.tensorhub)
        figures += [
            figure("interdc_bytes_vs_size", crossed_bytes / size, "ratio", INTERDC_BOUND,
                   "lower"),
            figure("remote_dc_speedup_vs_star", star_remote / th_remote, "ratio", 3, "higher"),
        ]
    sources = ", ".join(f"{k} {v / size:.2f}" for k, v in
                        sorted(m.joiner["report"]["bytes_by_source"].items()))
    joined = f"x size from: {sources}"
    if m.joiner_wan_bytes is not None:
        joined += f"; {m.joiner_wan_bytes / size:.2f} x size crossed DCs"
    rows += [(f"joiner on {m.joiner_host}, after the fan-out", joiner_s, one_fetch, joined),
             (f"{m.joiner_host} in the star run (busy trainer)", busy_s, one_fetch, "")]
    figures.append(figure("joiner_speedup_vs_trainer", busy_s / joiner_s, "ratio", 3,
                          "higher"))
    if m.keyed:
        keyed_s = med(f.seconds for f in m.keyed)
        rows.insert(1, ("TensorHub fan-out, keyed", keyed_s, bound, crossed(m.keyed)))
        figures.append(figure("security_cost_cluster", keyed_s / th_s, "ratio", 1.10, "lower"))
    return rows, figures
