"""Peer processes spoken to in lines, and loopback ports for them: what the demo, the
benchmarks and the tests use to run real peer processes on one machine."""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import threading
import time
from typing import IO, Any


class LineProcess:
    """A worker process spoken to in lines: commands on stdin, JSON events on stdout.

    A thread reads stdout into a queue, so :meth:`expect` keeps its timeout even when
    the worker prints nothing (hung at start, say) instead of blocking in ``readline``.
    """

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, bufsize=1)
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._pump, name=f"stdout of {name}", daemon=True).start()

    def _pump(self) -> None:
        stdout: IO[str] = self.p.stdout  # type: ignore[assignment]
        for line in stdout:
            self._lines.put(line)
        self._lines.put("")  # end of output

    def send(self, line: str) -> None:
        stdin: IO[str] = self.p.stdin  # type: ignore[assignment]
        stdin.write(line + "\n")
        stdin.flush()

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no {event!r} within {timeout}s") from None
            if not line:
                self._lines.put("")  # stays ended for the next caller
                raise RuntimeError(f"{self.name} exited (code {self.p.poll()})")
            try:
                obj: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                continue
            if obj.get("event") == event:
                return obj


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` (loopback by default) right now (for
    peers about to start)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind((host, 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
