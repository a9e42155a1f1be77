"""``tensorhub bench rtt``: one TensorHub fetch against one plain TCP stream of the same
bytes on the same capped, delayed path, at several added round trips.

Theory of operation
-------------------
For each round trip ``r`` of ``--rtts`` an emulated cluster of two hosts in two DCs is
built (:func:`~tensorhub.testing.netns.open_topology`): ``h0`` (the holder) and ``h1``
(the reader), each NIC capped at ``--mbit``, the DC pair's link too, and ``r`` added by
the inter-DC relay (half each way; :mod:`tensorhub.testing.relay`, since this kernel has no
netem). A TensorHub peer runs on each host (:func:`~tensorhub.bench.cluster.open_mesh`,
TCP, the default chunk size, keyless unless ``--keys on``), and a plain TCP server
holding ``--size`` random bytes runs on ``h0``.

One untimed fetch of a small version warms the peers' connections (a reader in a mesh
fetches version after version over connections it already has). Then ``--runs`` times,
alternating which goes first:

* the **stream**: a fresh process on ``h1`` connects to the server, starts its clock,
  sends one byte (the request) and reads ``--size`` bytes into a pre-faulted buffer;
  the clock stops at the last byte; the SHA-256 of the bytes is checked afterwards;
* the **fetch**: ``h0`` publishes a fresh version of ``--size`` bytes (one tensor) and
  ``h1`` fetches it with the default options (no sources named: it finds the holder, or
  asks for a plan) into pre-faulted arrays, every chunk digest-verified; the worker's
  clock spans the whole ``Peer.fetch`` call (manifest, plan, every chunk).

Both cross the same caps and the same relay. The relay terminates TCP on each side and
buffers what is in flight, so the stream never waits on a congestion window across the
long round trip: it is the best a single stream can do on that path, paying the round
trip once. A fetch that waits a round trip per request pays it once per chunk (or per
window); that is what ``fetch_vs_tcp_stream_worst`` (min over ``r`` of stream time /
fetch time, bound >= 0.9) exposes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from typing import Any

from ..errors import TensorHubError
from ..testing.clusterspec import ClusterSpec, DCLink, DCSpec
from ..testing.netns import Cluster, open_topology, read_line
from .baselines import chunk_text, parse_chunk, parse_size
from .cluster import MODEL, TRAINER, Mesh, mesh_keys, open_mesh
from .figures import figure, print_figures

BOUND = 0.9
STREAM_PORT = 29600
_TIMEOUT_S = 600.0
_WARM_SIZE = 1 << 20

STREAM_SERVER = r"""
import hashlib, os, socket, sys
size, conns, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
payload = memoryview(os.urandom(size))
listener = socket.create_server(("0.0.0.0", port), backlog=4)
print("ready", hashlib.sha256(payload).hexdigest(), flush=True)
for _ in range(conns):
    conn, _ = listener.accept()
    with conn:
        if conn.recv(1):
            conn.sendall(payload)
"""
STREAM_CLIENT = r"""
import hashlib, json, socket, sys, time
ip, size, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buffer = bytearray(b"\1") * size
view = memoryview(buffer)
got = 0
with socket.create_connection((ip, port), timeout=600) as conn:
    start = time.monotonic()
    conn.sendall(b"g")
    while got < size and (n := conn.recv_into(view[got:])):
        got += n
    end = time.monotonic()
print(json.dumps({"seconds": end - start, "bytes": got,
                  "digest": hashlib.sha256(view[:got]).hexdigest()}), flush=True)
"""


class RttBenchError(TensorHubError):
    """A stream or a fetch failed, or delivered wrong bytes; the message says which."""


def two_dc_spec(mbit: float, rtt_ms: float) -> ClusterSpec:
    """Holder ``h0`` in DC ``holder``, reader ``h1`` in DC ``reader``: NICs and the link
    all at ``mbit``; the link adds ``rtt_ms``."""
    return ClusterSpec((DCSpec("holder", (mbit,)), DCSpec("reader", (mbit,))),
                       {(0, 1): DCLink(mbit, rtt_ms)})


def stream_once(cluster: Cluster, digest: str, size: int) -> float:
    """One plain TCP stream of ``size`` bytes from the server on ``h0`` to ``h1``."""
    holder, reader = cluster.hosts
    client = cluster.run(reader, [sys.executable, "-c", STREAM_CLIENT, holder.ip, str(size),
                                  str(STREAM_PORT)], stdout=subprocess.PIPE, text=True)
    try:
        result = json.loads(read_line(client, _TIMEOUT_S))
    except (TimeoutError, EOFError, json.JSONDecodeError) as error:
        raise RttBenchError(f"the stream client failed: {error}") from error
    client.wait(30)
    if result["bytes"] != size or result["digest"] != digest:
        raise RttBenchError(f"the stream delivered wrong bytes: {result}")
    return float(result["seconds"])


def fetch_once(mesh: Mesh, version: int, size: int) -> dict[str, Any]:
    """The holder publishes ``version``; the reader fetches it (default options)."""
    fan = mesh.fanout(version, size)
    (fetched,) = fan.fetches.values()
    report = fetched["report"]
    if not report["verified"] or report["bytes"] != size:
        raise RttBenchError(f"the fetch was not whole and verified: {report}")
    return fetched


def measure_rtt(rtt_ms: float, args: argparse.Namespace) -> dict[str, Any]:
    """Every run at one round trip: stream and fetch seconds, the fetch reports."""
    size, runs = args.size, args.runs
    streams: list[float] = []
    fetches: list[dict[str, Any]] = []
    with (open_topology(two_dc_spec(args.mbit, rtt_ms)) as cluster,
          tempfile.TemporaryDirectory(prefix="tensorhub-keys-") as key_dir,
          ExitStack() as stack):
        keys = mesh_keys(cluster, key_dir) if args.keys == "on" else None
        mesh = stack.enter_context(open_mesh(cluster, args.chunk, plan=True, keys=keys))
        server = cluster.run(cluster.hosts[0], [sys.executable, "-c", STREAM_SERVER,
                                                str(size), str(runs), str(STREAM_PORT)],
                             stdout=subprocess.PIPE, text=True)
        word, _, digest = read_line(server, _TIMEOUT_S).partition(" ")
        if word != "ready":
            raise RttBenchError(f"the stream server said {word!r}")
        fetch_once(mesh, 1, _WARM_SIZE)  # connections up, as in a running mesh
        for run in range(runs):
            order = ("stream", "fetch") if run % 2 == 0 else ("fetch", "stream")
            for what in order:
                if what == "stream":
                    streams.append(stream_once(cluster, digest, size))
                else:
                    fetches.append(fetch_once(mesh, run + 2, size))
            print(f"  rtt {rtt_ms:g} ms, run {run + 1}: stream {streams[-1]:.3f} s, "
                  f"fetch {fetches[-1]['seconds']:.3f} s", flush=True)
        server.wait(30)
    return {"rtt_ms": rtt_ms, "stream_s": streams,
            "fetch_s": [f["seconds"] for f in fetches],
            "fetch_cpu_s": [f["cpu_s"] for f in fetches],
            "fetch_reports": [f["report"] for f in fetches]}


def summarize(rows: list[dict[str, Any]], size: int, mbit: float
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per round trip the medians and their ratio; the worst ratio as the figure."""
    line_s = size / (mbit * 1e6 / 8)
    for row in rows:
        row["stream_median_s"] = statistics.median(row["stream_s"])
        row["fetch_median_s"] = statistics.median(row["fetch_s"])
        row["fetch_data_median_s"] = statistics.median(r["seconds"]
                                                       for r in row["fetch_reports"])
        row["stream_over_fetch"] = row["stream_median_s"] / row["fetch_median_s"]
        row["line_rate_s"] = line_s
    worst = min(r["stream_over_fetch"] for r in rows)
    return rows, figure("fetch_vs_tcp_stream_worst", worst, "ratio", BOUND, "higher")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rtts", default="1,10,40,100",
                   help="added round trips in ms, comma-separated (default 1,10,40,100)")
    p.add_argument("--mbit", type=float, default=400.0,
                   help="NIC and link cap, Mbit/s each way (default 400)")
    p.add_argument("--size", type=parse_size, default=parse_size("64MiB"),
                   help="bytes per transfer (default 64MiB)")
    p.add_argument("--chunk", type=parse_chunk, default="auto",
                   help="the peers' chunk size (default auto: the system chooses from the "
                        "version's size; e.g. 4MiB forces one)")
    p.add_argument("--runs", type=int, default=3,
                   help="streams and fetches per round trip (medians; default 3)")
    p.add_argument("--keys", choices=("off", "on"), default="off",
                   help="on: both peers run with keys")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")


def run_cli(args: argparse.Namespace) -> int:
    try:
        rtts = [float(x) for x in args.rtts.split(",") if x.strip()]
    except ValueError:
        raise RttBenchError(f"--rtts: not numbers: {args.rtts!r}") from None
    if not rtts or any(not r >= 0 for r in rtts) or args.runs < 1 or not args.mbit > 0:
        raise RttBenchError("need round trips >= 0, --runs >= 1 and --mbit > 0")
    if args.size <= _WARM_SIZE:
        raise RttBenchError(f"--size must be above {_WARM_SIZE} bytes (the warm-up's)")
    size = args.size
    print(f"rtt benchmark: one holder -> one reader across two DCs, {args.mbit:g} Mbit "
          f"NICs and link, {size / 2**20:g} MiB, {chunk_text(args.chunk, size)}, "
          f"median of {args.runs} run(s), keys {args.keys}", flush=True)
    rows, worst = summarize([measure_rtt(r, args) for r in rtts], size, args.mbit)
    print(f"\n{'rtt ms':>7} {'stream s':>9} {'fetch s':>8} {'stream/fetch':>13} "
          f"{'line rate s':>12} {'fetch data phase s':>19}")
    for row in rows:
        print(f"{row['rtt_ms']:>7g} {row['stream_median_s']:>9.3f} "
              f"{row['fetch_median_s']:>8.3f} {row['stream_over_fetch']:>13.3f} "
              f"{row['line_rate_s']:>12.3f} {row['fetch_data_median_s']:>19.3f}")
    print()
    print_figures([worst])
    if args.json:
        print(json.dumps({
            "figures": [worst],
            "baselines": {"tcp_stream_s": {f"{r['rtt_ms']:g}": r["stream_s"] for r in rows}},
            "measured": {"per_rtt": rows},
            "settings": {"rtts_ms": rtts, "mbit": args.mbit, "size_bytes": size,
                         "chunk_bytes": args.chunk or "auto", "runs": args.runs, "keys": args.keys,
                         "holder": TRAINER, "model": MODEL},
        }))
    return 0
