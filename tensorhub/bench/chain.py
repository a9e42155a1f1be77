"""``tensorhub bench chain``: a relay chain publisher -> r1 -> r2 -> r3 -> r4 against one
hop, in an emulated cluster where every NIC is capped, so the answer is physics.

Theory of operation
-------------------
:func:`~tensorhub.testing.netns.open_cluster` builds ``--depth + 1`` hosts in one DC, every
NIC capped at ``--mbit`` both ways. A TensorHub peer runs on each
(:func:`~tensorhub.bench.cluster.open_mesh`, TCP): the publisher on ``h0``, relays ``h1``
... ``h<depth>``. ``--runs`` times, alternating which goes first:

* **single hop**: ``h0`` publishes a fresh version of ``--size`` bytes (one tensor) and
  ``h1`` alone fetches it with ``sources=["trainer"]``;
* **chain**: ``h0`` publishes another fresh version; at once, ``h1`` fetches it from the
  publisher and each ``h<k>`` from ``h<k-1>`` only (``sources=[...]``), while that one is
  still receiving: a holder serves each chunk as soon as it has verified it. The chain's
  time runs from the first fetch's start to the last one's end (``time.monotonic()``
  in every worker: one clock).

Every fetch lands in pre-faulted arrays and every chunk is verified. The physics: each
hop is a separate NIC pair at the same rate, so bytes flow through all hops at once and a
chain of depth ``D`` can finish in one link time ``S/R`` plus, per extra hop, the time a
relay holds a chunk before forwarding it: a chunk time ``C/R`` (it verifies a chunk
whole before serving it) plus a round trip. So the floor printed next to the figure is
``1 + (D - 1) * C / S`` times the single hop (``C / S``: one over the chunk count the
fetches report); ``chain4_time_vs_single`` (chain / single,
medians) should be within 1.3, which at 4 MiB chunks needs ``S`` >= 64 MiB
(1 + 3/16 = 1.19) and is comfortable at the default 256 MiB (1.05).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from contextlib import ExitStack
from typing import Any

from ..errors import TensorHubError
from ..testing.netns import open_cluster
from .baselines import chunk_text, parse_chunk, parse_size
from .cluster import MODEL, TRAINER, Mesh, mesh_keys, open_mesh
from .figures import figure, print_figures

BOUND = 1.3
_TIMEOUT_S = 900.0


class ChainBenchError(TensorHubError):
    """A fetch failed or was not whole and verified; the message says which."""


def _checked(name: str, fetched: dict[str, Any], size: int) -> dict[str, Any]:
    report = fetched["report"]
    if not report["verified"] or report["bytes"] != size:
        raise ChainBenchError(f"{name}: the fetch was not whole and verified: {report}")
    return fetched


def _publish(mesh: Mesh, version: int, size: int) -> None:
    mesh.trainer.call("published", cmd="publish", model=MODEL, version=version,
                      shape="large", size=size)


def _drop(mesh: Mesh, names: list[str], version: int) -> None:
    for name in [*names, TRAINER]:
        mesh.workers[name].call("unpublished", cmd="unpublish", model=MODEL, version=version)


def single_hop(mesh: Mesh, version: int, size: int) -> dict[str, Any]:
    """``h1`` fetches a fresh version from the publisher alone."""
    _publish(mesh, version, size)
    first = mesh.workers["h1"]
    first.call("holders", cmd="wait_holders", model=MODEL, version=version, count=1,
               timeout=_TIMEOUT_S)
    fetched = first.call("fetched", _TIMEOUT_S, cmd="fetch", model=MODEL, version=version,
                         into=True, sources=[TRAINER])
    _drop(mesh, ["h1"], version)
    return _checked("h1", fetched, size)


def chain(mesh: Mesh, version: int, size: int, depth: int) -> dict[str, Any]:
    """Every relay fetches a fresh version from its predecessor only, all at once."""
    _publish(mesh, version, size)
    names = [f"h{k}" for k in range(1, depth + 1)]
    for name in names:  # as for the single hop: every relay knows the version first
        mesh.workers[name].call("holders", cmd="wait_holders", model=MODEL,
                                version=version, count=1, timeout=_TIMEOUT_S)
    for name, source in zip(names, [TRAINER, *names], strict=False):
        mesh.workers[name].send(cmd="fetch", model=MODEL, version=version, into=True,
                                sources=[source])
    legs = {n: _checked(n, mesh.workers[n].expect("fetched", _TIMEOUT_S), size)
            for n in names}
    _drop(mesh, names, version)
    start = min(x["start"] for x in legs.values())
    return {"seconds": max(x["end"] for x in legs.values()) - start,
            "chunks": max(x["report"]["chunks"] for x in legs.values()),
            "done_s": {n: x["end"] - start for n, x in legs.items()},
            "bytes_by_source": {n: x["report"]["bytes_by_source"] for n, x in legs.items()}}


def measure(args: argparse.Namespace) -> tuple[list[float], list[dict[str, Any]], int]:
    """(single-hop seconds, chain results, mtu) over ``--runs`` runs."""
    singles: list[float] = []
    chains: list[dict[str, Any]] = []
    with (open_cluster(args.depth + 1, args.mbit) as cluster,
          tempfile.TemporaryDirectory(prefix="tensorhub-keys-") as key_dir,
          ExitStack() as stack):
        keys = mesh_keys(cluster, key_dir) if args.keys == "on" else None
        mesh = stack.enter_context(open_mesh(cluster, args.chunk, plan=True, keys=keys))
        for worker in mesh.rollouts:
            worker.prepare(args.size)
        version = 0
        for run in range(args.runs):
            order = ("single", "chain") if run % 2 == 0 else ("chain", "single")
            for what in order:
                version += 1
                if what == "single":
                    singles.append(float(single_hop(mesh, version, args.size)["seconds"]))
                else:
                    chains.append(chain(mesh, version, args.size, args.depth))
            done = ", ".join(f"{n} {t:.2f}" for n, t in chains[-1]["done_s"].items())
            print(f"  run {run + 1}: single hop {singles[-1]:.3f} s, chain "
                  f"{chains[-1]['seconds']:.3f} s (done at: {done})", flush=True)
        mtu = cluster.mtu
    return singles, chains, mtu


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--depth", type=int, default=4,
                   help="relays in the chain after the publisher (default 4)")
    p.add_argument("--mbit", type=float, default=400.0,
                   help="every host's NIC cap, Mbit/s each way (default 400)")
    p.add_argument("--size", type=parse_size, default=parse_size("256MiB"),
                   help="bytes per version (default 256MiB)")
    p.add_argument("--chunk", type=parse_chunk, default="auto",
                   help="the peers' chunk size (default auto: the system chooses from the "
                        "version's size; e.g. 4MiB forces one)")
    p.add_argument("--runs", type=int, default=3,
                   help="single hops and chains each (medians; default 3)")
    p.add_argument("--keys", choices=("off", "on"), default="off",
                   help="on: every peer runs with keys")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")


def run_cli(args: argparse.Namespace) -> int:
    if args.depth < 1 or args.runs < 1 or not args.mbit > 0 or args.size < 1:
        raise ChainBenchError("need --depth >= 1, --runs >= 1, --mbit > 0 and --size > 0")
    size, chunk, depth = args.size, args.chunk, args.depth
    link_s = size / (args.mbit * 1e6 / 8)
    print(f"chain benchmark: publisher -> {depth} relays, one DC, {args.mbit:g} Mbit NICs, "
          f"{size / 2**20:g} MiB, {chunk_text(chunk, size)}, median of {args.runs} "
          f"run(s), keys {args.keys}", flush=True)
    singles, chains, mtu = measure(args)
    single_s = statistics.median(singles)
    chain_s = statistics.median(c["seconds"] for c in chains)
    chunks = max(c["chunks"] for c in chains)  # as the fetches report it (any chunk size)
    floor = 1 + (depth - 1) / max(1, chunks)
    print(f"\n{'what':<44} {'seconds':>8} {'x link time':>12}")
    for what, seconds in ((f"link time (size / {args.mbit:g} Mbit)", link_s),
                          ("single hop, publisher -> h1", single_s),
                          (f"chain of {depth}, publisher -> h1 -> ... -> h{depth}", chain_s),
                          (f"chunk-pipeline floor: link + {depth - 1} chunk times",
                           floor * link_s)):
        print(f"{what:<44} {seconds:>8.3f} {seconds / link_s:>12.3f}")
    figures = [figure(f"chain{depth}_time_vs_single", chain_s / single_s, "ratio", BOUND,
                      "lower")]
    print(f"\nchain / single floor with {chunks} chunks: {floor:.3f}\n")
    print_figures(figures)
    if args.json:
        print(json.dumps({
            "figures": figures,
            "baselines": {"single_hop_s": singles, "link_time_s": link_s,
                          "floor_ratio": floor, "chunks": chunks},
            "measured": {"chain_s": [c["seconds"] for c in chains],
                         "chain_done_s": [c["done_s"] for c in chains],
                         "chain_bytes_by_source": [c["bytes_by_source"] for c in chains]},
            "settings": {"depth": depth, "mbit": args.mbit, "size_bytes": size,
                         "chunk_bytes": chunk or "auto", "runs": args.runs, "keys": args.keys,
                         "mtu": mtu},
        }))
    return 0
