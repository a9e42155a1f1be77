"""``tensorhub bench transfer``: the data plane against the bare socket, in one run.

Measured here, each the median of ``--runs`` runs, every process on this machine:

(a) raw baseline: two processes, a blocking socket ``sendall`` -> ``recv_into`` a
    pre-faulted buffer of the same size, run just before each (b) while the same peers
    are up, so both see the same machine (idle peers alone slow it by several percent);
(b) TensorHub single-hop fetch over TCP, integrity on, into pre-faulted arrays, at the
    default settings (the chunk size the system chooses for the version, ``--chunk``
    to force one), and the same with 4 MiB chunks forced (a second publisher, ``pub4``,
    publishes the same model with ``chunk_size`` set): ``tcp_vs_raw`` and
    ``tcp_vs_raw_4mib_chunks``, each against the raw run just before it;
(c) the same over the same-host transport: the publisher's arrays are shared memory
    (``tensorhub.shared_empty``), so the reader maps them (``shm-memfd``);
(d) a chain publisher -> A -> B -> C, each fetching from the previous while it receives
    (informational: on one host it is CPU-bound; ``chain4_time_vs_single`` is measured
    NIC-bound in namespaces by ``tensorhub bench chain``);
(e) 10,000 tensors of 4 KiB;
(f) a numpy copy of the same bytes in the driver, the same-host ceiling: run just before
    each (c), like (a) before each (b);
(g) (b) without ``into=``, dropped after each: the first fetch lands in a new memory
    file, the next ones in the spare the one before left (no figure; ``no_into_s``);
(h) (e) by a fetcher labelled as another host (``f_far``), which checks every chunk
    with the manifest's cryptographic digest (blake3) as a reader on another machine
    does, not with the fast local one (no figure; ``far_small_s``);
(i) (b) while a thread of the fetcher's process runs Python without pause (the
    worker's ``spin`` command), as an engine's or a trainer's threads may: the peer's
    threads wait for the GIL (``PeerConfig.switch_interval``; no figure;
    ``busy_thread_s``); and while a thread of the holder's process does
    (``busy_holder_s``).

It also reports the publisher's RSS growth across ``publish`` and a fetcher's peak RSS.
``--only tcp`` measures (a) and (b) alone, to iterate on the TCP data plane.
``--keys on`` runs every peer with keys (``tensorhub keygen`` into a scratch directory).

The cost of security, ``--keys both``: two meshes (publisher and fetcher each) run side
by side, one keyless and one keyed, so both see the same machine; each of ``--runs``
rounds fetches over TCP from each, alternating which goes first, with a raw-socket run
(a) just before each fetch. ``security_cost_transfer`` is the keyed median over the
keyless one (bound 1.10). Only (a) and (b) are measured in this mode. What a keyed fetch
pays inside its timed span: CURVE encryption of the control messages it
sends and receives (manifest and plan requests), the manifest's publisher signature
check, and the keyed mesh's signed gossip running meanwhile (signing and checking on
the same cores). Not in it: ``publish`` (manifest signing), joining (the ZAP handshake),
loading keys, and the data connection's handshake after the first round (the fetcher
keeps its connections to the holder between fetches: :mod:`tensorhub.read.connections`).
The chunk digest is blake3 in both meshes (keys do not change it) and the
data bytes are not encrypted in either, so the difference is the keys alone.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from ..config import DEFAULT_CHUNK_SIZE, PeerConfig
from ..ops.demo import parse_size
from ..processes import free_ports
from ..security import write_keys
from ..testing.worker import WorkerClient
from .figures import figure, print_figures

RAW_SERVER = r"""
import socket, sys, numpy as np
size, runs = int(sys.argv[1]), int(sys.argv[2])
buf = np.ones(size, np.uint8)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
for _ in range(runs):
    conn, _ = srv.accept()
    conn.sendall(memoryview(buf))
    conn.close()
"""


def raw_socket_seconds(size: int, runs: int) -> list[float]:
    server = subprocess.Popen([sys.executable, "-c", RAW_SERVER, str(size), str(runs)],
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    buf = np.empty(size, np.uint8)
    buf[::4096] = 0
    view = memoryview(buf)  # type: ignore[arg-type]
    out = []
    try:
        for _ in range(runs):
            t0 = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as s:
                got = 0
                while got < size:
                    n = s.recv_into(view[got:], size - got)
                    if n == 0:
                        raise RuntimeError("raw server closed early")
                    got += n
            out.append(time.perf_counter() - t0)
    finally:
        server.wait(30)
    return out


def numpy_copier(size: int) -> Callable[[], float]:
    """A timed numpy copy of ``size`` bytes between two pre-faulted arrays: the seconds."""
    src = np.ones(size, np.uint8)
    dst = np.empty(size, np.uint8)
    dst[::4096] = 0

    def once() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    return once


_DEFAULTS = PeerConfig("bench")
_TIMERS = (f"default (PeerConfig's: gossip every {_DEFAULTS.gossip_interval:g} s, probes "
           f"every {_DEFAULTS.probe_interval:g} s)")
"""What the JSON settings say of the workers' membership timers (``--timers default``)."""


FORCED_CHUNK = DEFAULT_CHUNK_SIZE  # what pub4 publishes with (4 MiB)


def run(size: int, chunk: int, runs: int, only_tcp: bool = False, keys: bool = False,
        switching: str = "default") -> dict[str, Any]:
    """``chunk`` 0: the chunk size the system chooses."""
    names = ["pub", "pub4", "f_tcp"] if only_tcp else \
        ["pub", "pub4", "f_tcp", "f_shm", "a", "b", "c", "f_far"]
    with tempfile.TemporaryDirectory(prefix="tensorhub-keys-") as key_dir:
        if keys:
            write_keys(key_dir, names, {"*": ["pub", "pub4"]})
        return _run(names, size, chunk, runs, only_tcp, key_dir if keys else None,
                    switching)


@contextmanager
def _mesh(names: list[str], chunk: int, key_dir: str | None, switching: str = "default"
          ) -> Iterator[dict[str, WorkerClient]]:
    """One worker per name on loopback (``names[0]`` the seed), ready; ended on the way out.
    The workers run the default membership timers, as deployed peers do: no peer fails
    here, and the local preset's (gossip every 0.1 s, probes every 0.2 s) cost each of
    seven idle workers about 3% of a core on a 2-core host, taken from the fetch
    measured beside them."""
    ports = free_ports(len(names))
    seed = f"127.0.0.1:{ports[0]}"
    transports = {"f_shm": "shm,tcp"}
    hosts = {"f_far": "far"}  # checks chunks as a reader on another machine
    procs: dict[str, WorkerClient] = {}
    try:
        for i, name in enumerate(names):
            argv = [sys.executable, "-m", "tensorhub.testing.worker", "--name", name,
                    "--listen", f"127.0.0.1:{ports[i]}", "--expect", str(len(names)),
                    "--chunk", str(FORCED_CHUNK if name == "pub4" else chunk),
                    "--transports", transports.get(name, "tcp"), "--timers", "default",
                    "--host", hosts.get(name, "localhost"), "--switch-interval", switching]
            argv += ["--join", seed] if i else []
            argv += ["--keys", key_dir] if key_dir else []
            procs[name] = WorkerClient(name, subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1))
        for p in procs.values():
            p.expect("ready", 60)
        yield procs
    finally:
        for p in procs.values():
            p.close()


def _fetch_once(proc: WorkerClient, model: str, source: str = "pub", into: bool = True
                ) -> dict[str, Any]:
    """One timed fetch of ``model@1`` from ``source`` into prepared arrays (``into``; else
    into arrays the fetch allocates), then dropped."""
    got = proc.call("fetched", cmd="fetch", model=model, version=1, sources=[source],
                    into=into)
    proc.call("unpublished", cmd="unpublish", model=model, version=1)
    return got


def run_both(size: int, chunk: int, runs: int, switching: str = "default") -> dict[str, Any]:
    """(a) and (b) over a keyless and a keyed mesh, both up for the whole run, fetches
    interleaved (round ``i`` starts with the keyless mesh when ``i`` is even)."""
    names = ["pub", "f_tcp"]
    fetched: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    raw: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="tensorhub-keys-") as key_dir, ExitStack() as stack:
        write_keys(key_dir, names, {"*": ["pub"]})
        meshes = {"off": stack.enter_context(_mesh(names, chunk, None, switching)),
                  "on": stack.enter_context(_mesh(names, chunk, key_dir, switching))}
        for procs in meshes.values():
            procs["pub"].call("published", cmd="publish", model="big", version=1,
                              shape="model", size=size, shared=True)
            procs["f_tcp"].call("prepared", cmd="prepare", model="big", shape="model",
                                size=size)
        security = {mode: {k: v for k, v in procs["f_tcp"].call("stats", cmd="stats").items()
                           if k in ("security", "digest")} for mode, procs in meshes.items()}
        for i in range(runs):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                raw[mode].append(raw_socket_seconds(size, 1)[0])
                fetched[mode].append(_fetch_once(meshes[mode]["f_tcp"], "big"))
    return {"raw": raw["off"] + raw["on"], "raw_keyless": raw["off"], "raw_keyed": raw["on"],
            "tcp": fetched["off"], "tcp_keyed": fetched["on"], "security": security,
            "fetcher_peak_rss_mib": max(r["peak_rss_mib"] for r in fetched["off"])}


def _run(names: list[str], size: int, chunk: int, runs: int, only_tcp: bool,
         key_dir: str | None, switching: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with _mesh(names, chunk, key_dir, switching) as procs:
        pub = procs["pub"]
        published = pub.call("published", cmd="publish", model="big", version=1,
                             shape="model", size=size, shared=True)
        procs["pub4"].call("published", cmd="publish", model="big4", version=1,
                           shape="model", size=size, shared=True)
        results["publisher_rss_growth_mib"] = (published["rss_after_mib"]
                                               - published["rss_before_mib"])

        def single(proc: WorkerClient, model: str,
                   baseline: Callable[[], float] | None = None, seen: list[float] | None = None
                   ) -> list[dict[str, Any]]:
            """``runs`` fetches; ``baseline()`` runs just before each, into ``seen``."""
            out = []
            for _ in range(runs):
                if baseline is not None and seen is not None:
                    seen.append(baseline())
                out.append(_fetch_once(proc, model))
            return out

        for name in names[2:]:
            procs[name].call("prepared", cmd="prepare", model="big", shape="model", size=size)
        procs["f_tcp"].call("prepared", cmd="prepare", model="big4", like="big")
        raw: list[float] = []
        raw4: list[float] = []
        tcp: list[dict[str, Any]] = []
        tcp4: list[dict[str, Any]] = []
        for _ in range(runs):  # interleaved, each right after its own raw run
            raw.append(raw_socket_seconds(size, 1)[0])
            tcp.append(_fetch_once(procs["f_tcp"], "big"))
            raw4.append(raw_socket_seconds(size, 1)[0])
            tcp4.append(_fetch_once(procs["f_tcp"], "big4", "pub4"))
        results.update(raw=raw, tcp=tcp, raw4=raw4, tcp4=tcp4,
                       fetcher_peak_rss_mib=max(r["peak_rss_mib"] for r in tcp))
        if only_tcp:
            return results
        # Without into=: the first lands in a new memory file, the rest in the spare.
        results["no_into"] = [_fetch_once(procs["f_tcp"], "big", into=False)
                              for _ in range(runs)]
        copies: list[float] = []
        shm = single(procs["f_shm"], "big", numpy_copier(size), copies)
        chain = []
        for _ in range(runs):
            for name, src in (("a", "pub"), ("b", "a"), ("c", "b")):
                procs[name].send(cmd="fetch", model="big", version=1, sources=[src], into=True)
            legs = [procs[n].expect("fetched") for n in ("a", "b", "c")]
            chain.append(max(x["end"] for x in legs) - min(x["start"] for x in legs))
            for n in ("c", "b", "a"):
                procs[n].call("unpublished", cmd="unpublish", model="big", version=1)
        pub.call("published", cmd="publish", model="small", version=1, shape="small",
                 size=10_000 * 4096)
        procs["f_tcp"].call("prepared", cmd="prepare", model="small", shape="small",
                            size=10_000 * 4096)
        small = single(procs["f_tcp"], "small")
        procs["f_far"].call("prepared", cmd="prepare", model="small", shape="small",
                            size=10_000 * 4096)
        far_small = single(procs["f_far"], "small")
        busy: dict[str, list[dict[str, Any]]] = {}
        for spinner in ("f_tcp", "pub"):
            procs[spinner].call("spinning", cmd="spin", on=True)
            try:
                busy[spinner] = single(procs["f_tcp"], "big")
            finally:
                procs[spinner].call("spinning", cmd="spin", on=False)
        switching = procs["f_tcp"].call("stats", cmd="stats")["switch_interval"]
    results.update(shm=shm, copy=copies, chain=chain, small=small, far_small=far_small,
                   busy_thread=busy["f_tcp"], busy_holder=busy["pub"],
                   switch_interval=switching)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tensorhub bench transfer", description=__doc__)
    add_options(p)
    return run_cli(p.parse_args(argv))


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="1GiB", help="bytes per transfer (default 1GiB)")
    p.add_argument("--chunk", default="auto",
                   help="chunk size of pub's version (default auto: the system chooses "
                        "from the version's size; pub4 always publishes 4 MiB chunks)")
    p.add_argument("--runs", type=int, default=5, help="runs per measurement (median)")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")
    p.add_argument("--only", choices=("all", "tcp"), default="all",
                   help="tcp: just (a) and (b), for iterating on the TCP data plane")
    p.add_argument("--switch-interval", default="default", metavar="SECONDS|none|default",
                   help="every worker's PeerConfig.switch_interval (none: Python's 5 ms, "
                        "as before peers set it; see (i))")
    p.add_argument("--keys", choices=("on", "off", "both"), default="off",
                   help="on: every peer runs with keys; both: a keyless and a keyed mesh "
                        "in the same run, fetches interleaved, (a) and (b) only: the cost "
                        "of security")


def run_cli(args: argparse.Namespace) -> int:
    size, runs = parse_size(args.size), args.runs
    chunk = 0 if args.chunk == "auto" else parse_size(args.chunk)
    both = args.keys == "both"
    only_tcp = args.only == "tcp" or both
    switching = args.switch_interval
    if switching not in ("default", "none"):
        float(switching)  # a bad value fails here, not in every worker
    r = run_both(size, chunk, runs, switching) if both else \
        run(size, chunk, runs, only_tcp, args.keys == "on", switching)
    copy_s: list[float] = r.get("copy", [])
    med = statistics.median
    raw_s = r["raw"]
    model_bytes = r["tcp"][0]["report"]["bytes"]
    raw_rate = size / med(raw_s)
    tcp_s = med([x["seconds"] for x in r["tcp"]])
    tcp_rate = model_bytes / tcp_s
    rows = [
        ("(a) raw socket sendall -> recv_into", med(raw_s), raw_rate),
        ("(b) TensorHub fetch, TCP, integrity on" + (", keyless" if both else ""), tcp_s,
         tcp_rate),
    ]
    figures = [figure("tcp_vs_raw", tcp_rate / raw_rate, "ratio", 0.9, "higher")]
    measured: dict[str, Any] = {"tcp_s": [x["seconds"] for x in r["tcp"]],
                                "model_bytes": model_bytes,
                                "chunk_size": r["tcp"][0]["report"]["chunk_size"],
                                "windows": r["tcp"][-1]["report"]["windows"]}
    if "tcp4" in r:
        raw4_rate = size / med(r["raw4"])
        tcp4_s = med([x["seconds"] for x in r["tcp4"]])
        rows += [("(a) raw socket, before each 4 MiB fetch", med(r["raw4"]), raw4_rate),
                 ("(b) TensorHub fetch, TCP, 4 MiB chunks forced", tcp4_s,
                  model_bytes / tcp4_s)]
        figures.append(figure("tcp_vs_raw_4mib_chunks", model_bytes / tcp4_s / raw4_rate,
                              "ratio", 0.85, "higher"))
        measured.update(tcp4_s=[x["seconds"] for x in r["tcp4"]], raw4_s=r["raw4"],
                        windows_4mib=r["tcp4"][-1]["report"]["windows"])
    baselines: dict[str, Any] = {"raw_socket_s": raw_s, "numpy_copy_s": copy_s}
    if both:
        keyed_s = med([x["seconds"] for x in r["tcp_keyed"]])
        rows.append(("(b) TensorHub fetch, TCP, integrity on, keyed", keyed_s,
                     model_bytes / keyed_s))
        figures.append(figure("security_cost_transfer", keyed_s / tcp_s, "ratio", 1.10,
                              "lower"))
        pairs = [k["seconds"] / x["seconds"] for k, x in zip(r["tcp_keyed"], r["tcp"],
                                                             strict=True)]
        measured.update(keyed_tcp_s=[x["seconds"] for x in r["tcp_keyed"]],
                        keyed_over_keyless_by_round=pairs,
                        cpu_s=[x["cpu_s"] for x in r["tcp"]],
                        keyed_cpu_s=[x["cpu_s"] for x in r["tcp_keyed"]],
                        raw_before_keyless_s=r["raw_keyless"],
                        raw_before_keyed_s=r["raw_keyed"], fetchers=r["security"])
        baselines.update(keyless_tcp_median_s=tcp_s, keyed_tcp_median_s=keyed_s,
                         raw_socket_median_s=med(raw_s))
    if not only_tcp:
        small_bytes = r["small"][0]["report"]["bytes"]
        copy_rate = size / med(copy_s)
        shm_s = med([x["seconds"] for x in r["shm"]])
        chain_s = med(r["chain"])
        small_s = med([x["seconds"] for x in r["small"]])
        no_into_s = [x["seconds"] for x in r["no_into"]]
        far_small_s = med([x["seconds"] for x in r["far_small"]])
        busy_thread_s = med([x["seconds"] for x in r["busy_thread"]])
        busy_holder_s = med([x["seconds"] for x in r["busy_holder"]])
        shm_rate = model_bytes / shm_s
        small_rate = small_bytes / small_s
        shm_transports = {t for x in r["shm"]
                          for t in x["report"]["transport_by_source"].values()}
        rows = [
            ("(f) numpy copy", med(copy_s), copy_rate),
            *rows,
            (f"(c) TensorHub fetch, same host ({'/'.join(sorted(shm_transports))})", shm_s,
             shm_rate),
            ("(g) TensorHub fetch, TCP, without into=", med(no_into_s),
             model_bytes / med(no_into_s)),
            ("(d) chain pub -> A -> B -> C (TCP)", chain_s, model_bytes / chain_s),
            ("(e) 10,000 x 4 KiB tensors, TCP", small_s, small_rate),
            ("(h) (e), checked as from another host (blake3)", far_small_s,
             small_bytes / far_small_s),
            ("(i) (b), a thread of the fetcher running Python", busy_thread_s,
             model_bytes / busy_thread_s),
            ("(i) (b), a thread of the holder running Python", busy_holder_s,
             model_bytes / busy_holder_s),
        ]
        figures += [
            figure("shm_vs_memcpy", shm_rate / copy_rate, "ratio", 0.6, "higher"),
            figure("small_vs_large", small_rate / tcp_rate, "ratio", 0.5, "higher"),
            figure("publisher_rss_growth_mib", r["publisher_rss_growth_mib"], "MiB", 64,
                   "lower"),
            figure("fetcher_rss_over_size_mib",
                   r["fetcher_peak_rss_mib"] - model_bytes / 2**20, "MiB", 128, "lower"),
        ]
        measured.update(shm_s=[x["seconds"] for x in r["shm"]],
                        shm_transports=sorted(shm_transports), chain_s=r["chain"],
                        chain_same_host_vs_single=chain_s / tcp_s,  # figure: bench chain
                        small_s=[x["seconds"] for x in r["small"]], small_bytes=small_bytes,
                        no_into_s=no_into_s,
                        far_small_s=[x["seconds"] for x in r["far_small"]],
                        far_small_local_digest_chunks=[
                            x["report"]["local_digest_chunks"] for x in r["far_small"]],
                        busy_thread_s=[x["seconds"] for x in r["busy_thread"]],
                        busy_holder_s=[x["seconds"] for x in r["busy_holder"]],
                        fetcher_switch_interval=r["switch_interval"],
                        publisher_rss_growth_mib=r["publisher_rss_growth_mib"],
                        fetcher_peak_rss_mib=r["fetcher_peak_rss_mib"])
    print(f"transfer benchmark: {size / 2**20:.0f} MiB, chunk "
          f"{f'{chunk / 2**20:g} MiB' if chunk else 'auto'} "
          f"({measured['chunk_size']}), median of {runs} runs, keys {args.keys}")
    print(f"{'path':<52} {'seconds':>8} {'GB/s':>7}")
    for label, secs, rate in rows:
        print(f"{label:<52} {secs:>8.3f} {rate / 1e9:>7.2f}")
    if both:
        pairs = measured["keyed_over_keyless_by_round"]
        print(f"keyed / keyless by round (each pair back to back): "
              f"{', '.join(f'{x:.3f}' for x in pairs)}; median {med(pairs):.3f}")
        print(f"fetcher CPU seconds a fetch (every thread), median: keyless "
              f"{med(measured['cpu_s']):.3f}, keyed {med(measured['keyed_cpu_s']):.3f}")
    print()
    print_figures(figures)
    if args.json:
        print(json.dumps({
            "figures": figures,
            "baselines": baselines,
            "measured": measured,
            "settings": {"size": size, "chunk": chunk or "auto", "runs": runs,
                         "only": "tcp" if only_tcp else "all", "keys": args.keys,
                         "switch_interval": switching,
                         "membership_timers": _TIMERS},
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
