"""``tensorhub demo``: a real mesh of processes on loopback moving real weights.

The driver spawns one trainer and N rollout processes (``python -m tensorhub.ops.demo
worker ...``), each a full peer.  Workers talk to the driver in JSON lines: the driver
writes commands to a worker's stdin, the worker reports events on its stdout.  For each
version the trainer publishes a synthetic model of realistic tensor shapes; every
rollout waits for it, fetches it and reports where its bytes came from and a blake3 of
what it received, which the driver compares with the trainer's.  Both trainer and
rollouts double-buffer: version ``v`` lives in buffer set ``v % 2``, and the version
that held that set before is unpublished (and drained) first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import blake3
import numpy as np
import trio

from .. import security
from ..config import DEFAULT_CHUNK_SIZE, PeerConfig
from ..model import VersionKey
from ..processes import LineProcess, free_ports
from ..transport.samehost.memory_files import shared_empty

MODEL = "demo-llm"


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def model_specs(size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and fp16 shapes of a small transformer of about ``size`` bytes."""
    hidden = 1024 if size >= 128 << 20 else 256
    ffn, vocab = hidden * 11 // 4, min(32000, max(1000, size // 16 // hidden))
    specs: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, hidden))]
    layer = [("attn.qkv.weight", (3 * hidden, hidden)), ("attn.o.weight", (hidden, hidden)),
             ("mlp.gate.weight", (ffn, hidden)), ("mlp.up.weight", (ffn, hidden)),
             ("mlp.down.weight", (hidden, ffn)), ("ln1.weight", (hidden,)),
             ("ln2.weight", (hidden,))]
    per_layer = sum(int(np.prod(s)) * 2 for _, s in layer)
    used = 2 * vocab * hidden * 2 + hidden * 2
    for i in range(max(1, (size - used) // per_layer)):
        specs += [(f"layers.{i}.{n}", s) for n, s in layer]
    specs += [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return specs


def allocate(specs: list[tuple[str, tuple[int, ...]]]) -> dict[str, np.ndarray[Any, Any]]:
    """One buffer slot: the tensors as views of one :func:`shared_empty` array, so that
    peers on this host copy straight from it (``shm-memfd``), as docs/operations.md
    recommends for real trainers."""
    sizes = [int(np.prod(shape)) for _, shape in specs]
    flat = shared_empty(sum(sizes), np.float16)
    flat.view(np.uint8)[::4096] = 0  # pre-fault every page
    out, at = {}, 0
    for (name, shape), size in zip(specs, sizes, strict=True):
        out[name] = flat[at:at + size].reshape(shape)
        at += size
    return out


def fill(arrays: dict[str, np.ndarray[Any, Any]], version: int) -> None:
    block = np.random.default_rng(version).integers(0, 256, 1 << 20, dtype=np.uint8)
    for i, arr in enumerate(arrays.values()):
        flat = arr.reshape(-1).view(np.uint8)
        start = (i * 4099) % len(block)
        for off in range(0, len(flat), len(block)):
            n = min(len(block), len(flat) - off)
            head = min(n, len(block) - start)
            flat[off:off + head] = block[start:start + head]
            flat[off + head:off + n] = block[:n - head]


def checksum(arrays: dict[str, np.ndarray[Any, Any]]) -> str:
    h = blake3.blake3()
    for arr in arrays.values():
        h.update(memoryview(arr.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
    out: str = h.hexdigest()
    return out


def holders_of(peer: Any, key: VersionKey) -> list[str]:
    return [p.name for p, _ in peer.control.holders(key)]


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def _worker(args: argparse.Namespace) -> None:
    from ..peer.node import open_peer

    join = tuple(s for s in args.join.split(",") if s)
    config = PeerConfig.local(args.name, listen=args.listen, join=join,
                              chunk_size=args.chunk, transports=tuple(args.transports.split(",")),
                              labels=(("host", "localhost"), ("role", args.role)),
                              security=security.load(args.keys, args.name) if args.keys else None)
    specs = model_specs(args.size)
    buffers = [allocate(specs), allocate(specs)]
    held: list[int | None] = [None, None]
    async with open_peer(config) as peer:
        while len(peer.control.membership.live_members()) < args.expect:
            await trio.sleep(0.05)
        _emit({"event": "ready", "name": args.name})
        stdin = trio.wrap_file(sys.stdin)
        last: int | None = None
        while True:
            line = (await stdin.readline()).strip()
            if not line or line == "quit":
                break
            cmd, *rest = line.split()
            if cmd == "stats":
                st = peer.statistics()
                _emit({"event": "stats", "bytes_served": st.bytes_served,
                       "bytes_fetched_by_source": st.bytes_fetched_by_source,
                       "members": st.members, "holders": {
                           str(h.key): sorted({*holders_of(peer, h.key)})
                           for e in peer.control.refs.origins() for h in e.holdings}})
                continue
            version = int(rest[0])
            slot = buffers[version % 2]
            if held[version % 2] is not None:
                await peer.unpublish(MODEL, held[version % 2])  # type: ignore[arg-type]
                held[version % 2] = None
            if cmd == "publish":
                fill(slot, version)
                t0 = time.perf_counter()
                await peer.publish(MODEL, version, slot)
                _emit({"event": "published", "version": version, "checksum": checksum(slot),
                       "seconds": time.perf_counter() - t0})
            elif cmd == "fetch":
                got = await peer.wait_for_version(MODEL, last)
                min_holders = int(rest[1]) if len(rest) > 1 else 0
                key = VersionKey(MODEL, got)
                while sum(h.complete for _, h in peer.control.holders(key)) < min_holders:
                    await trio.sleep(0.02)
                fetched = await peer.fetch(MODEL, got, into=slot)
                last = got
                _emit({"event": "fetched", "version": got, "checksum": checksum(slot),
                       "report": fetched.report.to_dict()})
            held[version % 2] = version


def run_demo(args: argparse.Namespace) -> int:
    """A closed mesh (fresh keys in a temporary directory: only these processes may join,
    and only the trainer may publish) unless ``--insecure``."""
    n = args.rollouts
    with tempfile.TemporaryDirectory(prefix="tensorhub-demo-keys-") as keys:
        if not args.insecure:
            names = ["trainer", *(f"rollout-{i}" for i in range(n))]
            security.write_keys(keys, names, {MODEL: ["trainer"]})
        return _run_mesh(args, "" if args.insecure else keys)


def _run_mesh(args: argparse.Namespace, keys: str) -> int:
    size = parse_size(args.size)
    n = args.rollouts
    ports = free_ports(n + 1)
    seed = f"127.0.0.1:{ports[0]}"
    base = [sys.executable, "-m", "tensorhub.ops.demo", "worker", "--size", str(size),
            "--expect", str(n + 1), *(["--keys", keys] if keys else [])]
    if not args.json:
        print("closed mesh: keys made for this run (members: trainer, rollouts; publisher: "
              "trainer)" if keys else "insecure mesh (--insecure): no keys")
    procs = [LineProcess("trainer", [*base, "--name", "trainer", "--role", "trainer",
                               "--listen", seed])]
    procs += [LineProcess(f"rollout-{i}", [*base, "--name", f"rollout-{i}", "--role", "rollout",
                                     "--listen", f"127.0.0.1:{ports[i + 1]}", "--join", seed])
              for i in range(n)]
    trainer, rollouts = procs[0], procs[1:]
    summary: dict[str, Any] = {"model": MODEL, "size_bytes": size, "rollouts": n,
                               "versions": [], "all_verified": False,
                               "security": "keys" if keys else "insecure"}
    try:
        for p in procs:
            p.expect("ready", 60)
        all_ok = True
        for v in range(1, args.versions + 1):
            trainer.send(f"publish {v}")
            pub = trainer.expect("published", 120)
            for r in rollouts:
                r.send(f"fetch {v}")
            rows = []
            for r in rollouts:
                ev = r.expect("fetched", 300)
                rep = ev["report"]
                ok = bool(rep["verified"]) and ev["checksum"] == pub["checksum"] \
                    and ev["version"] == v
                all_ok &= ok
                rows.append({"rollout": r.name, "seconds": rep["seconds"],
                             "mb_per_s": rep["mb_per_s"], "bytes": rep["bytes"],
                             "bytes_by_source": rep["bytes_by_source"],
                             "transport_by_source": rep["transport_by_source"],
                             "verified": ok})
            summary["versions"].append({"version": v, "publish_seconds": pub["seconds"],
                                        "rollouts": rows})
            if not args.json or args.table:
                _print_version(v, rows)
        summary["all_verified"] = all_ok
    finally:
        for p in procs:
            if p.p.poll() is None:
                with contextlib.suppress(BrokenPipeError, OSError):
                    p.send("quit")
        for p in procs:
            try:
                p.p.wait(10)
            except subprocess.TimeoutExpired:
                p.p.kill()
    if args.json:
        print(json.dumps(summary))
    else:
        print("all verified" if summary["all_verified"] else "VERIFICATION FAILED")
    return 0 if summary["all_verified"] else 1


def _print_version(v: int, rows: list[dict[str, Any]]) -> None:
    print(f"version {v}  ({rows[0]['bytes'] / (1 << 20):.1f} MiB)")
    print(f"  {'rollout':<11} {'seconds':>8} {'MB/s':>8}  {'verified':<8} served by")
    for r in rows:
        src = ", ".join(f"{k} {b / (1 << 20):.1f} MiB over {r['transport_by_source'].get(k, '?')}"
                        for k, b in sorted(r["bytes_by_source"].items()))
        print(f"  {r['rollout']:<11} {r['seconds']:>8.3f} {r['mb_per_s']:>8.0f}  "
              f"{'yes' if r['verified'] else 'NO':<8} {src}")
    print(flush=True)


def add_demo_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rollouts", type=int, default=4, help="rollout processes (default 4)")
    p.add_argument("--size", default="256MiB", help="model size (default 256MiB)")
    p.add_argument("--versions", type=int, default=3, help="versions to publish (default 3)")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--table", action="store_true", help="with --json, print the tables too")
    p.add_argument("--insecure", action="store_true",
                   help="run without keys (default: fresh keys for this run, a closed mesh)")


def _worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="tensorhub.ops.demo worker")
    p.add_argument("--name", required=True)
    p.add_argument("--role", choices=("trainer", "rollout"), required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--join", default="")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--expect", type=int, required=True)
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_SIZE)
    p.add_argument("--transports", default="shm,tcp")
    p.add_argument("--keys", default="", help="a `tensorhub keygen` directory")
    trio.run(_worker, p.parse_args(argv))


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        _worker_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m tensorhub.ops.demo worker ...  (use `tensorhub demo`)")
