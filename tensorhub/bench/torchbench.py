"""``tensorhub bench torch``: publish and fetch a bf16 torch ``state_dict`` against the
same bytes as numpy arrays.

Two peers in this process (one trio loop, TCP over loopback, integrity on) move
``--size`` bytes as ``--tensors`` tensors, ``--runs`` times per kind, the kinds
alternating (which goes first alternates too, so both see the same machine): a
``state_dict`` of ``bfloat16`` torch tensors, and the very same memory as plain numpy
``uint16`` arrays.  A run is ``publish`` (the manifest: every chunk's digest) plus a ``fetch`` into
pre-faulted destinations of the same kind (torch tensors; numpy arrays), timed from the
call to publish until the fetch returned; then both sides unpublish.  The figure
``torch_bf16_vs_numpy`` is the torch median over the numpy median (bound 1.10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import trio

from ..config import DEFAULT_CHUNK_SIZE, PeerConfig
from ..ops.demo import parse_size
from ..peer.node import Peer, open_peer
from .figures import figure, print_figures

MODEL = "bench-torch"


def _shapes(size: int, tensors: int) -> list[tuple[int, int]]:
    per = size // tensors // 2  # bf16 elements per tensor
    cols = 4096 if per >= 4096 else per
    return [(per // cols, cols)] * tensors


async def _one(pub: Peer, reader: Peer, version: int, state: Mapping[str, Any],
               into: Mapping[str, Any]) -> tuple[float, float]:
    start = time.perf_counter()
    await pub.publish(MODEL, version, state)
    published = time.perf_counter()
    with trio.fail_after(60):
        await reader.wait_for_version(MODEL, version - 1)
    got = await reader.fetch(MODEL, version, into=into)
    done = time.perf_counter()
    assert got.report.verified
    await reader.unpublish(MODEL, version)
    await pub.unpublish(MODEL, version)
    return published - start, done - published


async def measure(size: int, tensors: int, runs: int, chunk: int) -> dict[str, Any]:
    import torch

    shapes = _shapes(size, tensors)
    gen = torch.Generator().manual_seed(0)
    state = {f"layer.{i}.weight": torch.randn(s, generator=gen).to(torch.bfloat16)
             for i, s in enumerate(shapes)}
    arrays = {k: v.view(torch.int16).numpy().view(np.uint16) for k, v in state.items()}
    into_t = {k: torch.ones_like(v) for k, v in state.items()}
    into_n = {k: np.ones_like(v) for k, v in arrays.items()}
    cfg = {"chunk_size": chunk, "transports": ("tcp",), "retain_latest": 0}
    times: dict[str, list[tuple[float, float]]] = {"torch": [], "numpy": []}
    async with open_peer(PeerConfig.local("bench-pub", **cfg)) as pub:
        seed = pub.info.control.removeprefix("tcp://")
        async with open_peer(PeerConfig.local("bench-reader", join=(seed,), **cfg)) as rd:
            with trio.fail_after(10):
                while len(rd.control.membership.live_members()) < 2:
                    await rd.wait_changed()
            version = 0
            for run in range(runs):
                order = ("torch", "numpy") if run % 2 == 0 else ("numpy", "torch")
                for kind in order:
                    version += 1
                    src, dst = (state, into_t) if kind == "torch" else (arrays, into_n)
                    times[kind].append(await _one(pub, rd, version, src, dst))
    ok = all(torch.equal(into_t[k].view(torch.int16).reshape(-1),
                         torch.from_numpy(into_n[k].view(np.int16)).reshape(-1))
             for k in state)
    return {"times": times, "equal": ok, "total_bytes": sum(a.nbytes for a in arrays.values())}


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="1GiB", help="bytes per version (default 1GiB)")
    p.add_argument("--tensors", type=int, default=64, help="tensors (default 64)")
    p.add_argument("--runs", type=int, default=5, help="runs per kind (median; default 5)")
    p.add_argument("--chunk", default=str(DEFAULT_CHUNK_SIZE),
                   help=f"chunk size (default {DEFAULT_CHUNK_SIZE >> 20}MiB)")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")


def run_cli(args: argparse.Namespace) -> int:
    size, chunk = parse_size(args.size), parse_size(args.chunk)
    r = trio.run(measure, size, args.tensors, args.runs, chunk)
    med = statistics.median
    total = {k: [p + f for p, f in v] for k, v in r["times"].items()}
    print(f"torch benchmark: {r['total_bytes'] / 2**20:.0f} MiB as {args.tensors} tensors, "
          f"chunk {chunk / 2**20:g} MiB, {args.runs} runs per kind, TCP loopback, one "
          f"process; landed equal: {r['equal']}")
    print(f"{'kind':<13} {'publish s':>10} {'fetch s':>9} {'total s':>9} {'GB/s':>6}")
    for kind, label in (("torch", "torch bf16"), ("numpy", "numpy uint16")):
        pub = med(p for p, _ in r["times"][kind])
        fetch = med(f for _, f in r["times"][kind])
        print(f"{label:<13} {pub:>10.3f} {fetch:>9.3f} {med(total[kind]):>9.3f} "
              f"{r['total_bytes'] / med(total[kind]) / 1e9:>6.2f}")
    figures = [figure("torch_bf16_vs_numpy", med(total["torch"]) / med(total["numpy"]), "x",
                      1.10, "lower")]
    print()
    print_figures(figures)
    if args.json:
        print(json.dumps({"figures": figures,
                          "measured": {"times_s": r["times"], "landed_equal": r["equal"]},
                          "settings": {"size": size, "tensors": args.tensors,
                                       "runs": args.runs, "chunk": chunk}}))
    return 0 if r["equal"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tensorhub bench torch", description=__doc__)
    add_options(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
