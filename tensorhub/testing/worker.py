"""A peer process driven by JSON lines, for benchmarks and multi-process tests.

``python -m tensorhub.testing.worker --name A --listen HOST:PORT [--join ...]`` starts a
peer, prints ``{"event": "ready", ...}`` and then executes one JSON command per stdin
line, answering each with one JSON line on stdout:

* ``{"cmd": "publish", "model", "version", "shape": "model"|"large"|"small", "size",
  "shared": bool}`` allocates (``shared``: with :func:`tensorhub.shared_empty`), fills and
  pre-faults arrays, publishes them, and reports the RSS before and after ``publish``
  (ROS: publishing must not copy).
* ``{"cmd": "prepare", "model", "shape", "size"}`` allocates pre-faulted ``into`` buffers
  (with ``"like": MODEL``, reuses that model's instead: for fetches taking turns).
* ``{"cmd": "fetch", "model", "version", "sources": [...] | null, "into": bool}`` fetches
  and reports the fetch report, monotonic start / end times, the CPU seconds this
  process spent meanwhile (every thread) and the peak RSS.
* ``{"cmd": "publish_step", "model", "version", "size", "base": int | null,
  "fraction", "seed"}`` publishes bf16 weights (:mod:`.rlstep`): fresh ones without
  ``base``, else an RL-like step of the version ``base`` it published (kept until it is
  unpublished).
* ``{"cmd": "wait_holders", "model", "version", "count", "timeout"}`` waits until
  ``count`` other live peers hold the version completely and names them.
* ``{"cmd": "unpublish", "model", "version"}``, ``{"cmd": "quit"}``.
* ``{"cmd": "stats"}``: bytes served, members, the peer's security and digest lines, its
  membership timers, stall timeout and the interpreter's switch interval.
* ``{"cmd": "spin", "on": bool}`` starts (or stops) a thread of this process that runs
  Python without pause, as an engine's or a trainer's own threads may: the peer's
  threads then wait for the GIL (``PeerConfig.switch_interval``).
* The staged flip, through one :class:`~tensorhub.Rollout` per model:
  ``{"cmd": "stage", "model", "version"}`` (into the buffers the last release freed, if
  any), ``{"cmd": "commit", "model"}`` (reports ``switch_seconds``, the reads of the
  previous version in flight here just before and just after the switch, and whether
  its release was done when ``commit`` returned), ``{"cmd": "wait_released", "model"}``
  (``drain_seconds`` and the release error, if any).
* ``{"cmd": "read_loop", "model", "version", "sources"}`` fetches that version into the
  prepared buffers again and again in the background (dropping each copy); when it is
  refused, it moves on to the newest version in this peer's view.
  ``{"cmd": "read_status"}`` reports the reads by version and the errors.

Times are ``time.monotonic()``, one clock for every process on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio

from ..config import PeerConfig, parse_labels
from ..errors import TensorHubError
from ..links import load_links
from ..model import VersionKey
from ..ops.demo import checksum, fill, model_specs
from ..peer.node import Peer, open_peer
from ..peer.rollout import Committed, Rollout, Staged
from ..security import load as load_keys
from ..transport.samehost.memory_files import shared_empty
from .netns import read_line
from .rlstep import bf16_weights, rl_step


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    cur = peak = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return cur, peak


def specs_for(shape: str, size: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Tensor (name, shape, dtype) lists: a transformer, one big tensor, or 4 KiB ones."""
    if shape == "model":
        return [(n, s, "<f2") for n, s in model_specs(size)]
    if shape == "large":
        return [("weights", (size // 2,), "<f2")]
    if shape == "small":
        return [(f"t{i}", (1024,), "<f4") for i in range(max(1, size // 4096))]
    raise ValueError(f"unknown shape {shape!r}")


def allocate(specs: list[tuple[str, tuple[int, ...], str]], shared: bool = False
             ) -> dict[str, np.ndarray[Any, Any]]:
    """Pre-faulted arrays; ``shared``: views of one :func:`shared_empty` buffer (one
    memory file for the whole model: a reader maps it once per connection)."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in specs]
    flat = shared_empty(sum(sizes), np.uint8) if shared else None
    out, at = {}, 0
    for (name, shape, dtype), size in zip(specs, sizes, strict=True):
        if flat is None:
            arr = np.empty(shape, dtype=np.dtype(dtype))
        else:
            arr = flat[at:at + size].view(np.dtype(dtype)).reshape(shape)
            at += size
        arr.reshape(-1).view(np.uint8)[::4096] = 1  # pre-fault every page
        out[name] = arr
    return out


class WorkerError(TensorHubError):
    """A worker reported an error, answered out of turn, went silent or exited."""


class WorkerClient:
    """The driver's side: one JSON command per line in, one JSON reply per line out."""

    def __init__(self, name: str, process: subprocess.Popen[str],
                 timeout_s: float = 300.0) -> None:
        self.name = name
        self.process = process
        self.timeout_s = timeout_s
        """How long a reply may take unless a call says otherwise."""

    def send(self, **cmd: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()

    def expect(self, event: str, timeout_s: float | None = None) -> dict[str, Any]:
        """The next reply, which must be ``event``."""
        try:
            reply: dict[str, Any] = json.loads(
                read_line(self.process, timeout_s or self.timeout_s))
        except (TimeoutError, EOFError, json.JSONDecodeError) as error:
            raise WorkerError(f"{self.name}: {error}") from error
        if reply.get("event") != event:
            raise WorkerError(f"{self.name}: {reply.get('error', reply)} (expected {event!r})")
        return reply

    def call(self, event: str, timeout_s: float | None = None, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.expect(event, timeout_s)

    def close(self) -> None:
        """Ask the worker to leave the mesh; kill it if it does not within 10 s."""
        if self.process.poll() is None:
            try:
                self.send(cmd="quit")
                self.process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


class Worker:
    def __init__(self, peer: Peer, nursery: trio.Nursery | None = None) -> None:
        self.peer = peer
        self.nursery = nursery
        self.buffers: dict[str, dict[str, np.ndarray[Any, Any]]] = {}
        self.rollouts: dict[str, Rollout] = {}
        self.staged: dict[str, Staged] = {}
        self.committed: dict[str, Committed] = {}
        self.spare: dict[str, dict[str, np.ndarray[Any, Any]]] = {}
        self.reads: dict[int, int] = {}
        self.read_errors: list[str] = []
        self.spinning: threading.Event | None = None

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        kind = cmd["cmd"]
        if kind in ("stage", "commit", "wait_released"):
            return await self.flip(kind, cmd["model"], cmd.get("version"))
        if kind == "read_loop":
            assert self.nursery is not None
            self.nursery.start_soon(self.read_loop, cmd["model"], cmd["version"],
                                    cmd.get("sources"))
            return {"event": "reading"}
        if kind == "spin":
            return self.spin(bool(cmd["on"]))
        if kind == "read_status":
            return {"event": "read_status", "reads": {str(v): n for v, n in self.reads.items()},
                    "errors": len(self.read_errors), "last_errors": self.read_errors[-3:]}
        if kind == "publish":
            arrays = allocate(specs_for(cmd["shape"], cmd["size"]), cmd.get("shared", False))
            fill(arrays, cmd["version"])
            before = rss_mib()[0]
            t0 = time.monotonic()
            await self.peer.publish(cmd["model"], cmd["version"], arrays)
            t1 = time.monotonic()
            self.buffers[f"pub:{cmd['model']}@{cmd['version']}"] = arrays
            return {"event": "published", "rss_before_mib": before,
                    "rss_after_mib": rss_mib()[0], "seconds": t1 - t0,
                    "checksum": checksum(arrays)}
        if kind == "publish_step":
            return await self.publish_step(cmd)
        if kind == "prepare":
            like = cmd.get("like")
            self.buffers[f"into:{cmd['model']}"] = self.buffers[f"into:{like}"] if like \
                else allocate(specs_for(cmd["shape"], cmd["size"]))
            return {"event": "prepared", "rss_mib": rss_mib()[0]}
        if kind == "fetch":
            into = self.buffers.get(f"into:{cmd['model']}") if cmd.get("into") else None
            cpu0, t0 = time.process_time(), time.monotonic()
            got = await self.peer.fetch(cmd["model"], cmd["version"], into=into,
                                        sources=cmd.get("sources"))
            t1, cpu1 = time.monotonic(), time.process_time()
            out = {"event": "fetched", "start": t0, "end": t1, "seconds": t1 - t0,
                   "cpu_s": cpu1 - cpu0,
                   "report": got.report.to_dict(), "peak_rss_mib": rss_mib()[1]}
            if cmd.get("checksum"):
                out["checksum"] = checksum(got.tensors)
            return out
        if kind == "wait_holders":
            return {"event": "holders", "holders": await self.wait_holders(
                VersionKey(cmd["model"], cmd["version"]), cmd["count"], cmd["timeout"])}
        if kind == "unpublish":
            await self.peer.unpublish(cmd["model"], cmd["version"])
            self.buffers.pop(f"pub:{cmd['model']}@{cmd['version']}", None)
            return {"event": "unpublished"}
        if kind == "stats":
            st = self.peer.statistics()
            return {"event": "stats", "bytes_served": st.bytes_served,
                    "bytes_by_transport": st.bytes_by_transport, "members": st.members,
                    "security": st.security, "digest": st.digest,
                    "tcp_local_digests": st.tcp_local_digests,
                    "gossip_interval": self.peer.config.gossip_interval,
                    "probe_interval": self.peer.config.probe_interval,
                    "stall_timeout": self.peer.config.stall_timeout,
                    "switch_interval": st.switch_interval, "wan": st.wan}
        raise ValueError(f"unknown command {kind!r}")

    def spin(self, on: bool) -> dict[str, Any]:
        """The ``spin`` command (see the module docstring)."""
        if on and self.spinning is None:
            stop = self.spinning = threading.Event()

            def run() -> None:
                n = 0
                while not stop.is_set():
                    n += 1

            threading.Thread(target=run, name="bench spinner", daemon=True).start()
        elif not on and self.spinning is not None:
            self.spinning.set()
            self.spinning = None
        return {"event": "spinning", "on": self.spinning is not None}

    async def publish_step(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The ``publish_step`` command (see the module docstring)."""
        model, base = cmd["model"], cmd.get("base")
        arrays = bf16_weights(cmd["size"], cmd["seed"]) if base is None else \
            rl_step(self.buffers[f"pub:{model}@{base}"], cmd["fraction"], cmd["seed"])
        t0 = time.monotonic()
        await self.peer.publish(model, cmd["version"], arrays)
        self.buffers[f"pub:{model}@{cmd['version']}"] = arrays
        return {"event": "published", "seconds": time.monotonic() - t0,
                "checksum": checksum(arrays)}

    async def flip(self, kind: str, model: str, version: int | None) -> dict[str, Any]:
        """The staged flip's commands (see the module docstring)."""
        if kind == "stage":
            rollout = self.rollouts.setdefault(model, Rollout(self.peer, model))
            into = self.spare.pop(model, None)
            t0 = time.monotonic()
            self.staged[model] = await rollout.stage(version or "latest", into=into)
            return {"event": "staged", "seconds": time.monotonic() - t0,
                    "into": into is not None}
        if kind == "commit":
            staged = self.staged.pop(model)
            live = staged.rollout.live
            old = None if live is None else self.peer.store.get(VersionKey(model, live.version))
            before = 0 if old is None else old.inflight
            t0 = time.monotonic()
            done = await staged.commit()
            t1 = time.monotonic()
            self.committed[model] = done
            return {"event": "committed", "version": done.version, "previous": done.previous,
                    "switch_seconds": done.switch_seconds, "call_seconds": t1 - t0,
                    "inflight_before": before, "inflight_after": 0 if old is None
                    else old.inflight, "release_done": done.release_done}
        done = self.committed.pop(model)
        freed = await done.wait_released()
        if freed is not None:
            self.spare[model] = freed
        error = done.release_error
        return {"event": "released", "drain_seconds": done.drain_seconds,
                "error": None if error is None else f"{type(error).__name__}: {error}"}

    async def read_loop(self, model: str, version: int, sources: list[str] | None) -> None:
        into = self.buffers[f"into:{model}"]
        while True:
            try:
                await self.peer.fetch(model, version, into=into, sources=sources)
                self.reads[version] = self.reads.get(version, 0) + 1
                await self.peer.unpublish(model, version)
            except TensorHubError as exc:
                self.read_errors = [*self.read_errors[-99:], f"v{version}: {exc}"]
                latest = self.peer.control.latest(model)
                if latest is not None and latest > version:
                    version = latest
                else:
                    with trio.move_on_after(1):
                        await self.peer.wait_changed()

    async def wait_holders(self, key: VersionKey, count: int, timeout: float) -> list[str]:
        """Names of the other live peers holding ``key`` completely, once there are
        ``count``; ``TimeoutError`` after ``timeout`` seconds."""
        names: list[str] = []
        with trio.move_on_after(timeout):
            while True:
                names = sorted(p.name for p, h in self.peer.control.holders(key)
                               if h.complete and p.name != self.peer.info.name)
                if len(names) >= count:
                    return names
                await trio.sleep(0.02)
        raise TimeoutError(f"{len(names)} of {count} holders of {key} after {timeout} s")


MEMBERSHIP_TIMERS = ("gossip_interval", "probe_interval", "probe_timeout", "suspicion_mult",
                     "push_pull_interval", "dead_reap_after")
"""What ``--timers default`` takes from ``PeerConfig``'s defaults; the rest (stall,
connect and lease timeouts) stays the local preset's."""


async def main(args: argparse.Namespace) -> None:
    overrides: dict[str, Any] = {} if args.stall_timeout is None \
        else {"stall_timeout": args.stall_timeout}
    if args.switch_interval != "default":
        overrides["switch_interval"] = None if args.switch_interval == "none" \
            else float(args.switch_interval)
    if args.timers == "default":  # the membership timers of PeerConfig's defaults
        defaults = PeerConfig(args.name)
        overrides.update({f: getattr(defaults, f) for f in MEMBERSHIP_TIMERS})
    cfg = PeerConfig.local(args.name, listen=args.listen,
                           join=tuple(s for s in args.join.split(",") if s),
                           chunk_size=args.chunk or None,
                           transports=tuple(args.transports.split(",")),
                           labels=(("host", args.host), *parse_labels(args.label)),
                           planning=args.planning == "on", delta=args.delta,
                           security=load_keys(args.keys, args.name) if args.keys else None,
                           links=load_links(args.links) if args.links else (),
                           **({} if args.wan_probe_bytes is None
                              else {"wan_probe_bytes": args.wan_probe_bytes}),
                           allow_insecure=True,  # without --keys: emulated hosts on a
                           **overrides)          # private bridge, or loopback
    async with open_peer(cfg) as peer:
        while len(peer.control.membership.live_members()) < args.expect:
            await trio.sleep(0.02)
        print(json.dumps({"event": "ready", "name": args.name}), flush=True)
        async with trio.open_nursery() as nursery:  # background reads
            await answer_commands(Worker(peer, nursery).handle, Exception)
            nursery.cancel_scope.cancel()


async def answer_commands(handle: Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]],
                          errors: type[Exception]) -> None:
    """Answer one JSON command per stdin line with ``handle``'s reply (none if it returns
    None) until ``{"cmd": "quit"}`` or the end of input.  A command that raises
    ``errors`` is answered ``{"event": "error", "cmd", "version", "error"}``: reported to
    the driver, which decides."""
    stdin = trio.wrap_file(sys.stdin)
    while line := (await stdin.readline()).strip():
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            return
        try:
            reply = await handle(cmd)
        except errors as exc:
            reply = {"event": "error", "cmd": cmd["cmd"], "version": cmd.get("version"),
                     "error": f"{type(exc).__name__}: {exc}"}
        if reply is not None:
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m tensorhub.testing.worker")
    p.add_argument("--name", required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--join", default="")
    p.add_argument("--expect", type=int, default=1)
    p.add_argument("--chunk", type=int, default=0,
                   help="chunk size of what this worker publishes (0: automatic)")
    p.add_argument("--transports", default="shm,tcp")
    p.add_argument("--host", default="localhost")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="topology label besides host (dc, rack, ...); repeatable")
    p.add_argument("--planning", choices=("on", "off"), default="on",
                   help="ask the coordinator for a plan (off: fetchers pick holders)")
    p.add_argument("--delta", choices=("off", "auto", "always"), default="off",
                   help="chunk deltas against an older version held here (PeerConfig.delta;"
                        " off here: benchmarks measure full transfers unless told)")
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="run with the keys of --name in DIR (tensorhub keygen)")
    p.add_argument("--wan-probe-bytes", type=int, default=None, metavar="N",
                   help="PeerConfig.wan_probe_bytes (link probes between DCs; 0: off)")
    p.add_argument("--links", default=None, metavar="FILE",
                   help="declared links between DCs: the [[link]] tables of FILE "
                        "(PeerConfig.links; tensorhub.links)")
    p.add_argument("--timers", choices=("local", "default"), default="local",
                   help="membership timers: local (PeerConfig.local's: gossip every 0.1 s, "
                        "for benches that kill peers) or default (PeerConfig's: every 1 s); "
                        "the other timeouts are the local preset's either way")
    p.add_argument("--stall-timeout", type=float, default=None,
                   help="seconds without progress before a source counts as stalled "
                        "(default: the local preset's)")
    p.add_argument("--switch-interval", default="default", metavar="SECONDS|none|default",
                   help="PeerConfig.switch_interval (none: leave Python's 5 ms)")
    trio.run(main, p.parse_args())
