"""A peer process of ``tensorhub bench rounds`` (``python -m tensorhub.bench.rounds_worker``),
driven by JSON lines: commands on stdin, events on stdout (:mod:`tensorhub.bench.rounds`).

* ``--role publisher --rank R``: rank R of the TP=4 publishing group (:data:`PUBLISH`).
  ``{"cmd": "publish", "version": v, "floor": f}`` publishes its slices of
  :func:`version_of` ``v`` and answers ``published``; then it unpublishes, in the
  background (an unpublish waits for reads in flight to drain), the versions below
  ``f`` (the oldest version a group may still stage: the driver's word) beyond its
  newest ``--keep``, and any beyond its newest ``--max-held`` (*forced*: a group may
  still want it; counted).
  ``{"cmd": "stats"}`` answers the unpublish errors and the slowest unpublish.
* ``--role consumer --group G --size N --rank K``: rank K of consuming group G of N
  ranks (:func:`consume_layout`: another split, so every fetch reshards).
  ``{"cmd": "run", "rounds", "round_timeout"}`` starts the rank's loop of
  ``group.fetch_latest()``; rank 0 (the leader) first waits for a version newer than its
  live one, reports each round (``round``: version, seconds, error) and stops after
  ``rounds`` switches (``done``); the other ranks loop until ``{"cmd": "stop"}``, which
  every rank answers with its counts (``stopped``).  Every rank checks the slices of
  each switch it sees against :func:`version_of` and reports a mismatch at once
  (``wrong``).  After a failed round a rank pauses :data:`BACKOFF` seconds, as an
  engine would: a round can fail without waiting (a rank not live), and a loop of
  ``fetch_latest`` calls that fail at once would spin (at any rank: one that believes
  the ranks below it dead leads its own rounds).

Content is cheap to make and to check on a loaded host: fixed random bits per tensor,
XORed (as 16-bit words) with a key that differs for every version, so a slice of another
version, or a chunk of one mixed into another, differs in every word.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import trio

from ..config import PeerConfig
from ..errors import TensorHubError
from ..peer.group import Group, GroupSwitchError, open_group
from ..peer.node import Peer, open_peer
from ..protocol.groups import GroupConfig
from ..protocol.sharding import Sharding
from ..security import load as load_keys
from ..testing.worker import answer_commands

MODEL = "rounds"
HIDDEN = 384
"""Divides into 2, 3, 4, 6, 8 and 12 equal parts: the group sizes a layout may have."""
PUBLISH = Sharding(0, 4, split={"embed": 0, "*.qkv": 0, "*.o": 1})
KEPT_TEXTS = 5
"""Abort and mismatch texts a rank reports (the first ones)."""
BACKOFF = 0.1
"""Seconds a rank waits after a failed round before the next."""
U16 = np.dtype(np.uint16)
Arrays = dict[str, np.ndarray[Any, Any]]


def consume_layout(rank: int, size: int) -> Sharding:
    """Rank ``rank`` of a consuming group of ``size``: split where the publishers do not."""
    return Sharding(rank, size, split={"embed": 1, "*.qkv": 1, "*.o": 0})


def model_specs(size: int) -> list[tuple[str, tuple[int, ...], str]]:
    """About ``size`` bytes: an embedding (1/8), then layers of a qkv (float32), an
    output projection (float16) and a replicated norm."""
    vocab = max(12, size // 8 // (HIDDEN * 2) // 12 * 12)
    specs: list[tuple[str, tuple[int, ...], str]] = [("embed", (vocab, HIDDEN), "<f2")]
    layer = 3 * HIDDEN * HIDDEN * 4 + HIDDEN * HIDDEN * 2 + HIDDEN * 4
    for i in range(max(1, (size - vocab * HIDDEN * 2) // layer)):
        specs += [(f"l{i}.qkv", (3 * HIDDEN, HIDDEN), "<f4"),
                  (f"l{i}.o", (HIDDEN, HIDDEN), "<f2"), (f"l{i}.norm", (HIDDEN,), "<f4")]
    return specs


def model_bytes(size: int) -> int:
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in model_specs(size))


def base_slices(size: int, layout: Sharding) -> dict[str, tuple[np.ndarray[Any, Any], str]]:
    """This layout's slice of every tensor's fixed bits, as 16-bit words, with its dtype."""
    rng = np.random.default_rng(20240613)
    out = {}
    for name, shape, dtype in model_specs(size):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize // 2
        full = rng.integers(0, 1 << 16, n, dtype=np.uint16).view(dtype).reshape(shape)
        box = layout.box(name, shape)
        part = np.ascontiguousarray(full[tuple(slice(a, b) for a, b in box)])
        out[name] = (part.view(U16), dtype)
    return out


def version_key(version: int) -> np.uint16:
    """A different 16-bit key for every version below 2**16 (odd multiplier: a bijection)."""
    return np.uint16((version * 40503 + 12345) & 0xFFFF)


def version_of(base: dict[str, tuple[np.ndarray[Any, Any], str]], version: int) -> Arrays:
    """Version ``version`` of the slices in ``base``: new arrays, each word XOR the key."""
    key = version_key(version)
    return {name: (words ^ key).view(dtype) for name, (words, dtype) in base.items()}


def mismatches(base: dict[str, tuple[np.ndarray[Any, Any], str]], version: int,
               got: Arrays) -> list[str]:
    """What in ``got`` is not version ``version`` of ``base`` (empty: all equal)."""
    if set(got) != set(base):
        return [f"tensors {sorted(set(got) ^ set(base))} differ"]
    key, wrong = version_key(version), []
    for name, (words, dtype) in base.items():
        a = got[name]
        want = words.view(dtype)
        if a.dtype != want.dtype or a.shape != want.shape:
            wrong.append(f"{name}: {a.dtype}{list(a.shape)}, not {want.dtype}{list(want.shape)}")
        elif not np.array_equal(np.ascontiguousarray(a).view(U16), words ^ key):
            wrong.append(f"{name}: other bytes than version {version}")
    return wrong


def drop_old(held: list[int], floor: int, keep: int, max_held: int) -> list[tuple[int, bool]]:
    """Take from ``held`` (ascending) the versions a publisher unpublishes now: below
    ``floor`` beyond the newest ``keep``, and any beyond the newest ``max_held`` (those
    *forced*: a group may still stage them).  Returns ``(version, forced)`` pairs."""
    out = []
    while len(held) > keep and (held[0] < floor or len(held) > max_held):
        out.append((held[0], held[0] >= floor))
        held.pop(0)
    return out


def emit(**obj: Any) -> None:
    print(json.dumps(obj), flush=True)


class Publisher:
    def __init__(self, peer: Peer, rank: int, size: int, keep: int, max_held: int,
                 nursery: trio.Nursery) -> None:
        self.peer, self.keep, self.max_held, self.nursery = peer, keep, max_held, nursery
        self.layout = PUBLISH.at(rank)
        self.base = base_slices(size, self.layout)
        self.held: list[int] = []
        self.unpublish_errors: list[str] = []
        self.slowest_unpublish = 0.0
        self.forced = 0

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "publish":
            v, t0 = cmd["version"], time.monotonic()
            await self.peer.publish(MODEL, v, version_of(self.base, v), layout=self.layout)
            self.held.append(v)
            for old, forced in drop_old(self.held, cmd["floor"], self.keep, self.max_held):
                self.forced += forced
                self.nursery.start_soon(self._unpublish, old)
            return {"event": "published", "version": v, "seconds": time.monotonic() - t0}
        if cmd["cmd"] == "stats":
            return {"event": "stats", "unpublish_errors": self.unpublish_errors[:KEPT_TEXTS],
                    "unpublish_error_count": len(self.unpublish_errors),
                    "slowest_unpublish_s": self.slowest_unpublish,
                    "forced_unpublishes": self.forced, "held": len(self.held)}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    async def _unpublish(self, version: int) -> None:
        t0 = time.monotonic()
        try:
            await self.peer.unpublish(MODEL, version, layout=self.layout)
        except TensorHubError as exc:
            self.unpublish_errors.append(f"version {version}: {type(exc).__name__}: {exc}")
        self.slowest_unpublish = max(self.slowest_unpublish, time.monotonic() - t0)


class Consumer:
    def __init__(self, peer: Peer, group: Group, size: int, nursery: trio.Nursery) -> None:
        self.peer, self.group, self.nursery = peer, group, nursery
        self.base = base_slices(size, consume_layout(group.rank, len(group.members)))
        self.scope = trio.CancelScope()
        self.ended = trio.Event()
        self.checked = 0
        self.wrong: list[str] = []
        self.failures: dict[str, int] = {"aborts": 0, "timeouts": 0, "errors": 0}
        self.texts: list[str] = []
        """The first failures' texts."""

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "run":
            self.nursery.start_soon(self._loop, cmd["rounds"], cmd["round_timeout"])
            return {"event": "running"}
        if cmd["cmd"] == "stop":
            self.scope.cancel()
            await self.ended.wait()
            st = self.group.statistics()
            return {"event": "stopped", "rank": self.group.rank, "switches": st.switches,
                    "group_aborts": st.aborts, "checked": self.checked,
                    "wrong": len(self.wrong), "wrong_texts": self.wrong[:KEPT_TEXTS],
                    **self.failures, "texts": self.texts[:KEPT_TEXTS],
                    "release_errors": list(st.release_errors[:KEPT_TEXTS])}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    async def _loop(self, rounds: int, round_timeout: float) -> None:
        leader = self.group.rank == 0
        with self.scope:
            while not leader or self.group.statistics().switches < rounds:
                if leader:  # a round for each new version, not a round a moment
                    live = self.group.live
                    newer_than = None if live is None else live.version
                    t0 = time.monotonic()
                    with trio.move_on_after(round_timeout) as waited:
                        await self.peer.wait_for_version(MODEL, newer_than)
                    if waited.cancelled_caught:
                        self._failed(leader, t0, TensorHubError(
                            f"no version newer than {newer_than} in {round_timeout:g} s"))
                        continue
                t0 = time.monotonic()
                try:
                    got = await self.group.fetch_latest(
                        timeout=round_timeout if leader else None)
                except (trio.TooSlowError, TensorHubError) as exc:
                    self._failed(leader, t0, exc)
                    await trio.sleep(BACKOFF)
                    continue
                at = time.monotonic()
                self.checked += 1
                for w in mismatches(self.base, got.version, got.tensors):
                    self.wrong.append(f"version {got.version}: {w}")
                    emit(event="wrong", text=self.wrong[-1])
                if leader:
                    emit(event="round", version=got.version, at=at, seconds=at - t0,
                         error="")
            emit(event="done")
        self.ended.set()

    def _failed(self, leader: bool, t0: float, exc: Exception) -> None:
        """Count (and at the leader report) a round that failed, by kind."""
        kind = "aborts" if isinstance(exc, GroupSwitchError) else \
            "timeouts" if isinstance(exc, trio.TooSlowError) else "errors"
        text = f"{type(exc).__name__}: {exc or 'no outcome in time'}"
        self.failures[kind] += 1
        if len(self.texts) < KEPT_TEXTS:
            self.texts.append(text)
        if leader:
            at = time.monotonic()
            emit(event="round", version=None, at=at, seconds=at - t0, error=text, kind=kind,
                 view=self.view())

    def view(self) -> str:
        """What this peer believes of the model: why a leader proposed what it did."""
        control, live = self.peer.control, self.group.live
        readable = control.readable(MODEL)
        unsealed = self.peer.unsealed(MODEL)
        return (f"live {None if live is None else live.version}, latest "
                f"{control.latest(MODEL)}, sealed now {readable[0] if readable else '-'}.."
                f"{readable[-1] if readable else '-'}, {len(unsealed)} unsealed"
                + (f" (first: {unsealed[0]})" if unsealed else ""))


async def main(args: argparse.Namespace) -> None:
    config = PeerConfig.local(args.name, listen=args.listen, join=tuple(args.join),
                              chunk_size=args.chunk,
                              security=load_keys(args.keys, args.name) if args.keys else None)
    async with open_peer(config) as peer, trio.open_nursery() as nursery:
        with trio.fail_after(args.start_timeout):
            while len(peer.control.membership.live_members()) < args.expect:
                await trio.sleep(0.05)
        if args.role == "publisher":
            emit(event="ready", name=args.name)
            await answer_commands(Publisher(peer, args.rank, args.size, args.keep,
                                            args.max_held, nursery).handle, TensorHubError)
        else:
            members = [f"g{args.group}r{k}" for k in range(args.group_size)]
            async with open_group(peer, f"g{args.group}", members, args.rank, model=MODEL,
                                  layout=consume_layout(args.rank, args.group_size),
                                  config=GroupConfig(timeout=args.round_timeout)) as group:
                emit(event="ready", name=args.name)
                await answer_commands(Consumer(peer, group, args.size, nursery).handle,
                                      TensorHubError)
        nursery.cancel_scope.cancel()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tensorhub.bench.rounds_worker")
    p.add_argument("--name", required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--join", action="append", default=[])
    p.add_argument("--role", choices=("publisher", "consumer"), required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--size", type=int, required=True, help="model bytes")
    p.add_argument("--chunk", type=int, required=True)
    p.add_argument("--keep", type=int, default=4, help="versions a publisher keeps")
    p.add_argument("--max-held", type=int, default=16, help="versions it holds at most")
    p.add_argument("--round-timeout", type=float, default=30.0)
    p.add_argument("--expect", type=int, required=True, help="peers live before ready")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--keys", default="", help="a `tensorhub keygen` directory")
    return p.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse())
