"""``tensorhub bench flip``: the staged flip's pause while readers read the old version.

Processes on this machine, each a peer (:mod:`.worker`), over loopback:

* ``pub`` publishes version ``v+1`` of one ``--size`` tensor before each flip and
  unpublishes ``v-1`` after it;
* ``roll`` holds the live version in a :class:`~tensorhub.Rollout`: it stages ``v+1``
  (into the buffers the previous release freed, from the second flip on), commits, then
  waits for the release of ``v``;
* ``--readers`` reader processes fetch the live version from ``roll`` (and only from it)
  in a loop, each into its own buffers, dropping every copy: reads of ``v`` are in
  flight at ``roll`` whenever it commits.  A reader refused ``v`` moves on to ``v+1``;
  each flip waits until every reader has read the live version at least once.

``switch_seconds`` (``Committed.switch_seconds``, ``roll``'s trio clock) is the swap; the
wall time of ``roll``'s ``await staged.commit()`` adds the one scheduling point before it
(other tasks of that peer may run there, and the machine's load shows).  Their medians
are the figures, bound 0.05 s each: neither may depend on readers.  ``drain_seconds``,
from the swap until the reads of ``v`` in flight drained and ``v`` was unpublished,
passes in the background; its median is reported against the holder's
``lease_timeout``, the longest a reader can hold it.  Also reported: the reads of ``v``
in flight at ``roll`` (chunk leases) when ``commit`` was called and right after it
returned -- the evidence that readers were pinned on it -- and whether the release was
done when ``commit`` returned.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..config import DEFAULT_CHUNK_SIZE, PeerConfig
from ..ops.demo import parse_size
from ..processes import free_ports
from ..testing.worker import WorkerClient, WorkerError
from .figures import figure, print_figures

MODEL = "big"
READER_STALL = 0.5  # a reader refused the old version moves on within about this


@contextmanager
def _processes(readers: int, chunk: int, transport: str
               ) -> Iterator[tuple[WorkerClient, WorkerClient, list[WorkerClient]]]:
    names = ["pub", "roll", *(f"reader{i}" for i in range(readers))]
    ports = free_ports(len(names))
    seed = f"127.0.0.1:{ports[0]}"
    procs: dict[str, WorkerClient] = {}
    try:
        for i, name in enumerate(names):
            argv = [sys.executable, "-m", "tensorhub.testing.worker", "--name", name,
                    "--listen", f"127.0.0.1:{ports[i]}", "--expect", str(len(names)),
                    "--chunk", str(chunk)]
            argv += ["--join", seed] if i else []
            if name.startswith("reader"):
                argv += ["--transports", transport, "--stall-timeout", str(READER_STALL)]
            procs[name] = WorkerClient(name, subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1),
                timeout_s=60)
        for p in procs.values():
            p.expect("ready", 60)
        yield procs["pub"], procs["roll"], [procs[n] for n in names[2:]]
    finally:
        for p in procs.values():
            p.close()


def _wait_reading(readers: list[WorkerClient], version: int, timeout_s: float = 30) -> None:
    """Until every reader has read ``version`` at least once."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = [r.call("read_status", cmd="read_status") for r in readers]
        if all(s["reads"].get(str(version), 0) > 0 for s in status):
            return
        if time.monotonic() > deadline:
            raise WorkerError(f"readers did not read version {version} within {timeout_s}s: "
                              f"{[s['last_errors'] for s in status]}")
        time.sleep(0.05)


def run(size: int, chunk: int, flips: int, readers: int, transport: str) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    with _processes(readers, chunk, transport) as (pub, roll, reading):
        pub.call("published", cmd="publish", model=MODEL, version=1, shape="large",
                 size=size, shared=True)
        roll.call("staged", cmd="stage", model=MODEL, version=1)
        roll.call("committed", cmd="commit", model=MODEL)
        for r in reading:
            r.call("prepared", cmd="prepare", model=MODEL, shape="large", size=size)
            r.call("reading", cmd="read_loop", model=MODEL, version=1, sources=["roll"])
        _wait_reading(reading, 1)
        for v in range(2, flips + 2):
            pub.call("published", cmd="publish", model=MODEL, version=v, shape="large",
                     size=size, shared=True)
            staged = roll.call("staged", cmd="stage", model=MODEL, version=v)
            committed = roll.call("committed", cmd="commit", model=MODEL)
            released = roll.call("released", cmd="wait_released", model=MODEL)
            if released["error"]:
                raise WorkerError(f"releasing version {v - 1}: {released['error']}")
            pub.call("unpublished", cmd="unpublish", model=MODEL, version=v - 1)
            _wait_reading(reading, v)
            rounds.append({"version": v, "stage_s": staged["seconds"],
                           "staged_into_released": staged["into"], **{
                               k: committed[k] for k in (
                                   "switch_seconds", "call_seconds", "inflight_before",
                                   "inflight_after", "release_done")},
                           "drain_seconds": released["drain_seconds"]})
        status = [r.call("read_status", cmd="read_status") for r in reading]
    return {"rounds": rounds, "reads": [s["reads"] for s in status],
            "read_errors": [s["errors"] for s in status]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tensorhub bench flip", description=__doc__)
    add_options(p)
    return run_cli(p.parse_args(argv))


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="64MiB", help="bytes per version (default 64MiB)")
    p.add_argument("--chunk", default=str(DEFAULT_CHUNK_SIZE),
                   help=f"chunk size (default {DEFAULT_CHUNK_SIZE >> 20}MiB)")
    p.add_argument("--flips", type=int, default=5, help="flips measured (median)")
    p.add_argument("--readers", type=int, default=4, help="reader processes (default 4)")
    p.add_argument("--transport", choices=("tcp", "shm"), default="tcp",
                   help="how the readers read from the rollout's peer (default tcp)")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")


def run_cli(args: argparse.Namespace) -> int:
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    transport = "shm,tcp" if args.transport == "shm" else "tcp"
    r = run(size, chunk, args.flips, args.readers, transport)
    med = statistics.median
    rounds = r["rounds"]
    switch = [x["switch_seconds"] for x in rounds]
    drain = [x["drain_seconds"] for x in rounds]
    lease = PeerConfig.local("bench").lease_timeout
    call = [x["call_seconds"] for x in rounds]
    figures = [figure("flip_switch_s", med(switch), "s", 0.05, "lower"),
               figure("flip_commit_call_s", med(call), "s", 0.05, "lower"),
               figure("flip_drain_s", med(drain), "s", lease, "lower")]
    print(f"flip benchmark: {size / 2**20:.0f} MiB, chunk {chunk / 2**20:g} MiB, "
          f"{args.readers} reader processes ({args.transport}), {args.flips} flips")
    print(f"{'flip':<9} {'switch ms':>10} {'commit ms':>10} {'reads in flight':>16} "
          f"{'done at return':>15} {'drain ms':>9}")
    for x in rounds:
        label = f"v{x['version'] - 1}->v{x['version']}"
        inflight = f"{x['inflight_before']} -> {x['inflight_after']}"
        print(f"{label:<9} {x['switch_seconds'] * 1e3:>10.3f} {x['call_seconds'] * 1e3:>10.3f} "
              f"{inflight:>16} {'yes' if x['release_done'] else 'no':>15} "
              f"{x['drain_seconds'] * 1e3:>9.1f}")
    print()
    print_figures(figures)
    if args.json:
        print(json.dumps({
            "figures": figures,
            "measured": {"switch_s": switch, "drain_s": drain,
                         "commit_call_s": call,
                         "rounds": rounds, "reads_by_reader": r["reads"],
                         "read_errors_by_reader": r["read_errors"]},
            "settings": {"size": size, "chunk": chunk, "flips": args.flips,
                         "readers": args.readers, "transport": args.transport,
                         "lease_timeout": lease},
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
