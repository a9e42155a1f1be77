"""The processes of the chaos bench: peer workers and the rogue, driven in JSON lines.

Every process's stdout is read by a thread into one queue of ``(name, event)``; the
driver takes what it waits for and files the rest (rollout activations arrive at any
time).  stderr goes to a file per process, so a crash can be explained.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ...errors import TensorHubError
from ...processes import free_ports

TRAINER = "trainer"
ASYNC_EVENTS = ("fetch_started", "activated", "fetch_error", "slow_unpublish")
"""What rollouts report on their own, at any time (everything else answers a command)."""


@dataclass(frozen=True)
class Host:
    """Where a process runs: its address, its ``host`` label, and the command prefix
    that starts a process there (``ip netns exec NS`` for an emulated host)."""

    ip: str
    label: str
    prefix: tuple[str, ...] = ()


LOOPBACK = Host("127.0.0.1", "localhost")


class MeshError(TensorHubError):
    """A process of the chaos mesh did not start or answer in time."""


class Proc:
    def __init__(self, name: str, argv: list[str], logdir: Path,
                 events: queue.SimpleQueue[tuple[str, dict[str, Any]]]) -> None:
        self.name = name
        self.log = logdir / f"{name}.{time.monotonic_ns()}.err"
        with open(self.log, "w") as err:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=err, text=True, bufsize=1,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.stopped = False
        self.info: dict[str, Any] = {}
        threading.Thread(target=self._pump, args=(events,), daemon=True).start()

    def _pump(self, events: queue.SimpleQueue[tuple[str, dict[str, Any]]]) -> None:
        stdout: IO[str] = self.p.stdout  # type: ignore[assignment]
        for line in stdout:
            try:
                events.put((self.name, json.loads(line)))
            except json.JSONDecodeError:
                continue

    def send(self, **cmd: Any) -> bool:
        if self.p.poll() is not None:
            return False
        try:
            stdin: IO[str] = self.p.stdin  # type: ignore[assignment]
            stdin.write(json.dumps(cmd) + "\n")
            stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def signal(self, signum: int) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signum)
        self.stopped = signum == signal.SIGSTOP

    def stderr_tail(self, lines: int = 6) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def end(self) -> None:
        if self.p.poll() is None:
            if self.stopped:
                os.kill(self.p.pid, signal.SIGCONT)
            self.send(cmd="quit")
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


class Mesh:
    """A trainer, ``rollouts`` rollout peers and the rogue, on loopback."""

    def __init__(self, rollouts: int, size: int, chunk: int, logdir: Path,
                 keys: str, huge_tensors: int, hosts: dict[str, Host] | None = None,
                 insider: bool = False) -> None:
        """``hosts``: where each peer (and ``rogue``) runs, by name; default: all on
        this host's loopback.  ``insider``: also start the rogue that holds member key
        ``insider`` of ``keys`` (:mod:`tensorhub.testing.chaos.insider`)."""
        self.names = [TRAINER, *(f"r{i}" for i in range(rollouts))]
        self.hosts = hosts or {}
        self.size, self.chunk, self.keys = size, chunk, keys
        self.huge_tensors = huge_tensors
        self.logdir = logdir
        self.events: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
        self.inbox: dict[str, deque[dict[str, Any]]] = {}
        self.async_events: list[tuple[str, dict[str, Any]]] = []
        self.procs: dict[str, Proc] = {}
        self.ports = dict(zip(self.names, free_ports(len(self.names)), strict=True))
        self.rogue: Proc | None = None
        self.insider: Proc | None = None
        self.with_insider = insider and bool(keys)
        self.restarts = 0
        self.unhealthy = ""
        """Why the last :meth:`wait_healthy` found the mesh unhealthy."""

    # -- events ----------------------------------------------------------------------------

    def poll(self, until: float) -> None:
        """File events arriving before monotonic time ``until``."""
        while True:
            left = until - time.monotonic()
            try:
                name, ev = self.events.get(timeout=max(0.0, left)) if left > 0 \
                    else self.events.get_nowait()
            except queue.Empty:
                return
            if ev.get("event") in ASYNC_EVENTS:
                self.async_events.append((name, ev))
            else:
                self.inbox.setdefault(name, deque()).append(ev)

    def reply(self, name: str, event: str, timeout: float) -> dict[str, Any] | None:
        """The next ``event`` (or ``error``) from ``name``; None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            box = self.inbox.setdefault(name, deque())
            while box:
                ev = box.popleft()
                if ev.get("event") in (event, "error"):
                    return ev
            proc = self.rogue if name == "rogue" else self.insider if name == "insider" \
                else self.procs.get(name)
            if time.monotonic() >= deadline or proc is None or proc.p.poll() is not None:
                self.poll(time.monotonic())
                box = self.inbox[name]
                return next((e for e in box if e.get("event") in (event, "error")), None)
            self.poll(min(deadline, time.monotonic() + 0.05))

    def take_async(self) -> list[tuple[str, dict[str, Any]]]:
        self.poll(time.monotonic())
        out, self.async_events = self.async_events, []
        return out

    # -- processes -------------------------------------------------------------------------

    def control(self, name: str) -> str:
        return f"{self._host(name).ip}:{self.ports[name]}"

    def _host(self, name: str) -> Host:
        return self.hosts.get(name, LOOPBACK)

    def start(self, names: list[str], timeout: float = 60.0) -> None:
        for name in names:
            join = [a for n in self.names if n != name for a in ("--join", self.control(n))]
            host = self._host(name)
            argv = [*host.prefix, sys.executable, "-m", "tensorhub.testing.chaos.worker",
                    "--name", name, "--role", "trainer" if name == TRAINER else "rollout",
                    "--listen", self.control(name), "--size", str(self.size),
                    "--chunk", str(self.chunk), "--host", host.label, *join]
            if self.keys:
                argv += ["--keys", self.keys]
            self.inbox.pop(name, None)
            self.procs[name] = Proc(name, argv, self.logdir, self.events)
        for name in names:
            ready = self.reply(name, "ready", timeout)
            if ready is None or ready.get("event") != "ready":
                raise MeshError(f"{name} did not start: {self.procs[name].stderr_tail()}")
            self.procs[name].info = ready
        if self.rogue is None or self.rogue.p.poll() is not None:
            host = self._host("rogue")
            self.rogue = Proc("rogue", [*host.prefix, sys.executable, "-m",
                                        "tensorhub.testing.chaos.rogue", "--size", str(self.size),
                                        "--chunk", str(self.chunk), "--ip", host.ip,
                                        "--huge-tensors", str(self.huge_tensors)],
                              self.logdir, self.events)
            if self.reply("rogue", "ready", timeout) is None:
                raise MeshError(f"the rogue did not start: {self.rogue.stderr_tail()}")
        if self.with_insider and (self.insider is None or self.insider.p.poll() is not None):
            self.insider = Proc("insider", [sys.executable, "-m", "tensorhub.testing.chaos.rogue",
                                            "--size", str(self.size), "--chunk",
                                            str(self.chunk), "--huge-tensors", "1",
                                            "--insider-keys", self.keys], self.logdir,
                                self.events)
            if self.reply("insider", "ready", timeout) is None:
                raise MeshError(f"the insider did not start: {self.insider.stderr_tail()}")

    def alive(self, name: str) -> bool:
        return self.procs[name].p.poll() is None

    def peers(self) -> list[dict[str, Any]]:
        """Names and addresses of the running peers, for the rogue."""
        return [{"name": n, "control": p.info["control"], "data": p.info["data"]}
                for n, p in self.procs.items() if p.p.poll() is None and p.info]

    def views(self, models: list[str], timeout: float) -> tuple[dict[str, Any], list[str]]:
        """Every running peer's view; and the peers that did not answer in time."""
        asked = [n for n in self.names if self.procs[n].send(cmd="view", models=models)]
        views, silent = {}, []
        deadline = time.monotonic() + timeout
        for n in asked:
            v = self.reply(n, "view", max(0.1, deadline - time.monotonic()))
            if v is None:
                silent.append(n)
            else:
                views[n] = v
        return views, silent

    def wait_healthy(self, timeout: float) -> bool:
        """True once every peer sees every peer alive and no rogue member live; False
        after ``timeout`` or as soon as a peer process ends (see :meth:`dead`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.dead():
                return False
            views, silent = self.views([], 5.0)
            wrong = [f"{p} sees {n} {st}" for p, v in sorted(views.items())
                     for n, (st, _) in sorted(v["members"].items())
                     if (n in self.names and st != "alive")
                     or (n.startswith("rogue") and st in ("alive", "suspect"))]
            wrong += [f"{p} sees no {n}" for p, v in sorted(views.items())
                      for n in self.names if n not in v["members"]]
            self.unhealthy = "; ".join([*(f"{n} is silent" for n in silent), *wrong])
            if not silent and len(views) == len(self.names) and not wrong:
                return True
            time.sleep(0.2)
        return False

    def dead(self) -> list[str]:
        return [n for n in self.names if not self.alive(n)]

    def restart(self, names: list[str]) -> None:
        for n in names:
            self.procs[n].end()
        self.start(names)

    def restart_all(self) -> None:
        """A fresh mesh on fresh ports (the old one kept state it cannot outlive)."""
        self.restarts += 1
        for p in self.procs.values():
            p.signal(signal.SIGKILL)
            p.p.wait()
        self.ports = dict(zip(self.names, free_ports(len(self.names)), strict=True))
        self.start(self.names)

    def close(self) -> None:
        for p in [*self.procs.values(), *(r for r in (self.rogue, self.insider) if r)]:
            p.end()
