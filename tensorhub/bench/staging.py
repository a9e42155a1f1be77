"""``tensorhub bench staging``: a fetch through the staging ring against a plain fetch.

Two peers in this process (one trio loop, TCP over loopback, integrity on): the
publisher publishes ``--size`` bytes once, as ``--tensors`` float32 tensors, and the
reader fetches that same version ``--runs`` times each way, the ways alternating (and
which goes first alternating too, so both see the same machine):

(a) *plain*: into pre-faulted numpy arrays, each chunk landing in its place;
(b) *staged*: into pre-faulted torch CPU tensors through a
    :class:`~tensorhub.StagingRing` of ``--slots`` slots (``ThroughRing``): each chunk
    lands in a slot and is checked there, each 1 MiB block copied to its place with
    ``memmove`` right after it was hashed -- the path a GPU destination takes, where
    ``cudaMemcpyAsync`` copies the whole chunk once it passed.

A run is timed from the ``fetch`` call until it returned; the reader then unpublishes
its copy.  The figure ``staged_vs_plain_time`` is the staged median over the plain
median (bound 1.15).  Both ways' times, and the ring's statistics, are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import trio

from ..config import PeerConfig
from ..device.landing import ThroughRing
from ..device.ring import StagingRing
from ..ops.demo import parse_size
from ..peer.node import Peer, open_peer
from ..protocol.sizing import choose_chunk_size
from .figures import figure, print_figures

MODEL = "bench-staging"


async def _fetch(reader: Peer, into: Any) -> float:
    start = time.perf_counter()
    got = await reader.fetch(MODEL, 1, into=into)
    took = time.perf_counter() - start
    assert got.report.verified
    await reader.unpublish(MODEL, 1)
    return took


async def measure(size: int, tensors: int, runs: int, chunk: int | None, slots: int
                  ) -> dict[str, Any]:
    import torch

    per = size // tensors // 4
    gen = np.random.default_rng(0)
    src = {f"layer.{i}.weight": gen.standard_normal(per, np.float32) for i in range(tensors)}
    plain = {k: np.ones_like(v) for k, v in src.items()}
    staged = {k: torch.ones(per, dtype=torch.float32) for k in src}
    chunk_size = chunk or choose_chunk_size(sum(v.nbytes for v in src.values()))[0]
    ring = StagingRing(slots, chunk_size)
    await ring.ready()
    cfg: dict[str, Any] = {"chunk_size": chunk, "transports": ("tcp",), "retain_latest": 0,
                           "delta": "off"}
    times: dict[str, list[float]] = {"plain": [], "staged": []}
    async with open_peer(PeerConfig.local("bench-pub", **cfg)) as pub:
        seed = pub.info.control.removeprefix("tcp://")
        async with open_peer(PeerConfig.local("bench-reader", join=(seed,), **cfg)) as rd:
            await pub.publish(MODEL, 1, src)
            with trio.fail_after(30):
                await rd.wait_for_version(MODEL, None)
            for run in range(runs):
                order = ("plain", "staged") if run % 2 == 0 else ("staged", "plain")
                for way in order:
                    into = plain if way == "plain" else ThroughRing(staged, ring)
                    times[way].append(await _fetch(rd, into))
    equal = all(np.array_equal(plain[k], v) and np.array_equal(staged[k].numpy(), v)
                for k, v in src.items())
    s = ring.statistics()
    return {"times": times, "equal": equal, "chunk": chunk_size,
            "total_bytes": sum(v.nbytes for v in src.values()),
            "ring": {"slots": s.slots, "slot_bytes": s.slot_bytes, "most_in_use": s.most_in_use,
                     "claims": s.claims, "abandoned": s.abandoned, "waits": s.waits}}


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="1GiB", help="bytes of the version (default 1GiB)")
    p.add_argument("--tensors", type=int, default=16, help="tensors (default 16)")
    p.add_argument("--runs", type=int, default=5, help="runs per way (median; default 5)")
    p.add_argument("--chunk", default=None,
                   help="chunk size (default: automatic for the size, as users get)")
    p.add_argument("--slots", type=int, default=8, help="staging ring slots (default 8)")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")


def run_cli(args: argparse.Namespace) -> int:
    size = parse_size(args.size)
    chunk = parse_size(args.chunk) if args.chunk else None
    r = trio.run(measure, size, args.tensors, args.runs, chunk, args.slots)
    med = statistics.median
    ring = r["ring"]
    print(f"staging benchmark: {r['total_bytes'] / 2**20:.0f} MiB as {args.tensors} "
          f"tensors, chunk {r['chunk'] / 2**20:g} MiB, ring {ring['slots']} x "
          f"{ring['slot_bytes'] / 2**20:g} MiB (at most {ring['most_in_use']} in use), "
          f"{args.runs} runs per way, TCP loopback, one process; landed equal: {r['equal']}")
    print(f"{'way':<34} {'fetch s':>8} {'GB/s':>6}")
    for way, label in (("plain", "plain, into numpy"),
                       ("staged", "staging ring, into torch CPU")):
        t = med(r["times"][way])
        print(f"{label:<34} {t:>8.3f} {r['total_bytes'] / t / 1e9:>6.2f}")
    figures = [figure("staged_vs_plain_time", med(r["times"]["staged"]) /
                      med(r["times"]["plain"]), "x", 1.15, "lower")]
    print()
    print_figures(figures)
    if args.json:
        print(json.dumps({"figures": figures,
                          "measured": {"times_s": r["times"], "landed_equal": r["equal"],
                                       "ring": ring},
                          "settings": {"size": size, "tensors": args.tensors,
                                       "runs": args.runs, "chunk": r["chunk"],
                                       "slots": args.slots}}))
    return 0 if r["equal"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tensorhub bench staging", description=__doc__)
    add_options(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
