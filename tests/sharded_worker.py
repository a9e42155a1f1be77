"""A peer process for tests/test_sharded_processes.py, driven by JSON lines on stdin.

``--role publisher --rank R``: rank R of a TP=4 publishing group (split along dim 0);
``{"cmd": "publish", "version": v}`` publishes its slices of version v.
``--role consumer --group G --rank K``: rank K of the TP=2 consuming group G (a
different split, so every fetch reshards); ``{"cmd": "switch", "after": v}``
waits for a version newer than ``v``, runs ``group.fetch_latest`` and reports the
version and whether its slices equal numpy slicing of the full tensors.  Every process
answers ``{"cmd": "latest"}`` and ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import trio
from helpers import wait_until

import tensorhub
from tensorhub import PeerConfig, Sharding

PUBLISH = Sharding(0, 4, split={"*.qkv": 0, "*.o": 0})
CONSUME = Sharding(0, 2, split={"*.qkv": 1, "*.o": 1, "embed": 0})


def content(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + version)
    out: dict[str, np.ndarray] = {"embed": rng.standard_normal((64, 32)).astype(np.float16)}
    for layer in range(3):
        out[f"l{layer}.qkv"] = rng.standard_normal((96, 32)).astype(np.float32)
        out[f"l{layer}.o"] = rng.integers(-9, 9, (32, 48)).astype(np.int32)
        out[f"l{layer}.norm"] = rng.standard_normal(32).astype(np.float32)
    return out


def sliced(full: dict[str, np.ndarray], spec: Sharding) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(v[tuple(slice(a, b) for a, b in spec.box(k, v.shape))])
            for k, v in full.items()}


def emit(**obj: Any) -> None:
    print(json.dumps(obj), flush=True)


async def main(args: argparse.Namespace) -> None:
    config = PeerConfig.local(args.name, listen=args.listen, join=tuple(args.join),
                              data_listen=args.data_listen, chunk_size=4096,
                              stall_timeout=5.0)
    async with tensorhub.open_peer(config) as peer:
        await wait_until(lambda: len(peer.control.membership.live_members()) >= args.expect,
                         60, every=0.05, what=f"{args.expect} live members")
        if args.role == "publisher":
            await serve(peer, args, None)
        else:
            members = [f"g{args.group}r{k}" for k in range(2)]
            spec = CONSUME.at(args.rank)
            async with tensorhub.open_group(peer, f"g{args.group}", members, args.rank,
                                            model="m", layout=spec) as group:
                await serve(peer, args, group)


async def serve(peer: tensorhub.Peer, args: argparse.Namespace,
                group: tensorhub.Group | None) -> None:
    emit(event="ready", name=args.name)
    while True:
        line = await trio.to_thread.run_sync(sys.stdin.readline)
        if not line:
            return
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            return
        if cmd["cmd"] == "latest":
            emit(event="latest", version=await peer.latest("m"), unsealed=peer.unsealed("m"))
        elif cmd["cmd"] == "publish":
            v = cmd["version"]
            spec = PUBLISH.at(args.rank)
            await peer.publish("m", v, sliced(content(v), spec), layout=spec)
            emit(event="published", version=v)
        elif cmd["cmd"] == "switch":
            assert group is not None
            try:
                with trio.fail_after(30):  # what an engine does: wait for news, then switch
                    await peer.wait_for_version("m", newer_than=cmd.get("after"))
                got = await group.fetch_latest(timeout=60)
            except tensorhub.TensorHubError as exc:
                emit(event="switched", error=str(exc))
                continue
            want = sliced(content(got.version), CONSUME.at(args.rank))
            equal = set(got.tensors) == set(want) and all(
                np.array_equal(got.tensors[k], want[k]) for k in want)
            emit(event="switched", version=got.version, equal=equal,
                 sources=got.report.bytes_by_source, plan=got.report.plan)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--data-listen", default=None)
    parser.add_argument("--join", nargs="*", default=[])
    parser.add_argument("--role", choices=["publisher", "consumer"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--expect", type=int, required=True)
    trio.run(main, parser.parse_args())
