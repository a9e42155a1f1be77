"""A peer process of the chaos bench (``python -m tensorhub.testing.chaos.worker``).

It runs one real peer and speaks JSON lines with the driver (:mod:`tensorhub.bench.chaos`):
commands on stdin, events on stdout, one object per line.

* ``--role trainer``: ``{"cmd": "publish", "model", "version", "seed"}`` publishes
  :func:`content` of ``(seed, version)`` from shared memory and answers ``published``
  with the manifest id; ``{"cmd": "drop", "model"}`` unpublishes every version of it.
* ``--role rollout``: ``{"cmd": "follow", "model", "seed"}`` starts a loop that waits for
  each newer ``latest`` of the model, fetches it into its own buffers and compares every
  byte with :func:`content`; each fetch ends in an ``activated`` event (version, manifest
  id, ``content_ok``, the fetch report) or a ``fetch_error`` (the error's class and
  text).  The previous model's versions are unpublished first.  With ``"sources"``
  the loop reads only from those peers (no plan).  ``{"cmd": "fetch_once",
  "model", "version", "sources"}`` times one fetch (the flood measurement).
* Unpublishing runs in the background (it waits for readers to drain); one that takes
  over two seconds is reported as ``slow_unpublish``.
* Every role: ``{"cmd": "view", "models": [...]}`` answers ``view``: this peer's
  membership (status and incarnation of each member), reference-table stamps and
  holdings, ``latest`` of the models, counters; ``{"cmd": "quit"}`` leaves the mesh.

Being slow to answer ``view`` is how the driver sees a stalled event loop; exiting is how
it sees a crash (the peer's own errors end the process, as they would a real one).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import time
from typing import Any

import numpy as np
import trio

from ...config import PeerConfig
from ...errors import TensorHubError, VersionUnavailable
from ...model import VersionKey
from ...peer.node import Peer, open_peer
from ...transport.samehost.memory_files import shared_empty
from ..worker import answer_commands

TENSOR_BYTES = 256 << 10
SLOW_UNPUBLISH = 2.0


def model_specs(size: int) -> list[tuple[str, tuple[int, ...], str]]:
    """``size`` bytes of 256 KiB float32 tensors, plus a 100-element float16 bias that
    puts every later chunk boundary off the tensor boundaries."""
    n = max(1, size // TENSOR_BYTES)
    return [("bias", (100,), "<f2"),
            *((f"layers.{i}.w", (TENSOR_BYTES // 1024, 256), "<f4") for i in range(n))]


def model_bytes(size: int) -> int:
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in model_specs(size))


def content(seed: int, version: int, nbytes: int) -> np.ndarray[Any, Any]:
    """The bytes the trainer publishes as ``version`` in episode ``seed``."""
    return np.random.default_rng([seed, version]).integers(0, 256, nbytes, dtype=np.uint8)


def allocate(size: int) -> tuple[np.ndarray[Any, Any], dict[str, np.ndarray[Any, Any]]]:
    """One shared-memory buffer (same-host readers map it) and the tensors as its views."""
    specs = model_specs(size)
    flat = shared_empty(model_bytes(size), np.uint8)
    flat[::4096] = 0  # pre-fault
    out, at = {}, 0
    for name, shape, dtype in specs:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out[name] = flat[at:at + n].view(np.dtype(dtype)).reshape(shape)
        at += n
    return flat, out


def emit(**obj: Any) -> None:
    print(json.dumps(obj), flush=True)


def view(peer: Peer, models: list[str]) -> dict[str, Any]:
    """What this peer believes: the driver looks here for the rogue's words."""
    known = peer.control.membership.members()
    members = {n: [m.status, m.incarnation] for n, m in known.items()}
    addresses = {n: m.info.control for n, m in known.items()}
    stamps, holdings = {}, []
    for entry in peer.control.refs.origins():
        stamps[entry.origin] = [entry.stamp.generation, entry.stamp.seq]
        holdings += [[entry.origin, h.model, h.version, h.manifest_id.hex(), h.publisher,
                      h.complete] for h in entry.holdings]
    # Origins forgotten (dead or left) and the stamp a new entry of theirs must beat: a
    # stamp planted here outlives the entry it came with.
    forgotten = {o: [s.generation, s.seq]
                 for o, s in getattr(peer.control.refs, "_forgotten", {}).items()}
    st = peer.statistics()
    return {"event": "view", "members": members, "addresses": addresses,
            "refused": dict(getattr(st, "refused", {})),
            "stamps": stamps, "holdings": holdings,
            "forgotten": forgotten,
            "latest": {m: peer.control.latest(m) for m in models},
            "malformed_dropped": st.malformed_dropped, "gossip_dropped": st.gossip_dropped,
            "integrity_failures": st.integrity_failures, "rss_mib": _rss_mib()}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Role:
    def __init__(self, peer: Peer, size: int, nursery: trio.Nursery) -> None:
        self.peer = peer
        self.size = size
        self.nbytes = model_bytes(size)
        self.nursery = nursery
        self.published: dict[tuple[str, int], np.ndarray[Any, Any]] = {}
        self.followed = ""
        self.waiting: trio.CancelScope | None = None
        self.waiting_for: list[Any] | None = None
        """``[model, newer than]`` while the loop waits for a version (in ``view``)."""
        """The followed model's wait for its next version (cancelled to follow another)."""
        self.held: list[tuple[str, int]] = []

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        kind = cmd["cmd"]
        if kind == "view":
            return {**view(self.peer, cmd.get("models", [])), "waiting": self.waiting_for}
        if kind == "publish":
            flat, arrays = allocate(self.size)
            flat[:] = content(cmd["seed"], cmd["version"], self.nbytes)
            manifest = await self.peer.publish(cmd["model"], cmd["version"], arrays)
            self.published[(cmd["model"], cmd["version"])] = flat
            return {"event": "published", "model": cmd["model"], "version": cmd["version"],
                    "manifest_id": manifest.manifest_id().hex()}
        if kind == "drop":
            for key in [k for k in self.published if k[0] == cmd["model"]]:
                del self.published[key]
                self.nursery.start_soon(self._unpublish, *key)
            return {"event": "dropped", "model": cmd["model"]}
        if kind == "follow":
            # The previous model's loop stops waiting; a fetch it has begun runs to its
            # end and reports (a fetch is never cut short by the harness).
            self.followed = cmd["model"]
            if self.waiting is not None:
                self.waiting.cancel()
            self._drop_held()
            self.nursery.start_soon(self._follow, cmd["model"], cmd["seed"],
                                    cmd.get("sources"))
            return {"event": "following", "model": cmd["model"]}
        if kind == "fetch_once":
            t0 = time.monotonic()
            try:
                with trio.fail_after(cmd["timeout"]):
                    await self.peer.fetch(cmd["model"], cmd["version"],
                                          sources=cmd["sources"])
            except (TensorHubError, trio.TooSlowError) as exc:
                return {"event": "fetched_once", "seconds": time.monotonic() - t0,
                        "error": f"{type(exc).__name__}: {exc}"}
            seconds = time.monotonic() - t0
            await self._unpublish(cmd["model"], cmd["version"])
            return {"event": "fetched_once", "seconds": seconds, "error": None}
        raise ValueError(f"unknown command {kind!r}")

    def _drop_held(self, keep: int = 0) -> None:
        while len(self.held) > keep:
            self.nursery.start_soon(self._unpublish, *self.held.pop(0))

    async def _unpublish(self, model: str, version: int) -> None:
        """Unpublish in the background (it waits for readers to drain); one that takes
        over SLOW_UNPUBLISH seconds is reported."""
        local = self.peer.store.get(VersionKey(model, version))
        if local is None or local.hidden:
            return
        t0 = time.monotonic()
        await self.peer.unpublish(model, version)
        if time.monotonic() - t0 > SLOW_UNPUBLISH:
            emit(event="slow_unpublish", model=model, version=version,
                 seconds=time.monotonic() - t0)

    async def _follow(self, model: str, seed: int, sources: list[str] | None) -> None:
        """Fetch each newer version of ``model`` while it is the one followed."""
        last: int | None = None
        while self.followed == model:
            with trio.CancelScope() as self.waiting:
                self.waiting_for = [model, last]
                last = await self.peer.wait_for_version(model, last)
            self.waiting_for = None
            if self.followed != model or last is None:
                return
            await self._fetch_one(model, seed, last, sources)

    async def _fetch_one(self, model: str, seed: int, version: int,
                         sources: list[str] | None = None) -> None:
        self._drop_held(keep=1)  # the last version stays held: a source for others
        flat, arrays = allocate(self.size)
        t0 = time.monotonic()
        emit(event="fetch_started", model=model, version=version)
        try:
            got = await self.peer.fetch(model, version, into=arrays, sources=sources)
        except VersionUnavailable as exc:
            emit(event="fetch_error", model=model, version=version,
                 kind="VersionUnavailable", error=str(exc), detail=exc.detail)
            return
        except TensorHubError as exc:
            emit(event="fetch_error", model=model, version=version,
                 kind=type(exc).__name__, error=str(exc), detail="")
            return
        self.held.append((model, version))
        local = self.peer.store.get(VersionKey(model, version))
        mid = local.manifest.manifest_id().hex() if local is not None else ""
        ok = bool(np.array_equal(flat, content(seed, version, self.nbytes)))
        emit(event="activated", model=model, version=version, manifest_id=mid,
             content_ok=ok, seconds=time.monotonic() - t0, nbytes=self.nbytes,
             report=got.report.to_dict())


def config_for(args: argparse.Namespace) -> PeerConfig:
    extra: dict[str, Any] = {}
    if args.keys:
        security = importlib.import_module("tensorhub.security")
        extra["security"] = security.load(args.keys, args.name)
    elif not args.listen.startswith("127.") and "allow_insecure" in _fields():
        extra["allow_insecure"] = True  # an emulated host, by the driver's choice
    return PeerConfig.local(args.name, listen=args.listen, join=tuple(args.join),
                            chunk_size=args.chunk, retain_latest=0,
                            labels=(("host", args.host), ("role", args.role)), **extra)


def _fields() -> set[str]:
    return {f.name for f in dataclasses.fields(PeerConfig)}


def security_supported() -> bool:
    """Whether this tree's peers take a cluster key set (``PeerConfig.security``)."""
    return "security" in _fields()


async def main(args: argparse.Namespace) -> None:
    async with open_peer(config_for(args)) as peer, trio.open_nursery() as nursery:
        emit(event="ready", name=args.name, control=peer.info.control, data=peer.info.data)
        await answer_commands(Role(peer, args.size, nursery).handle, TensorHubError)
        nursery.cancel_scope.cancel()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tensorhub.testing.chaos.worker")
    p.add_argument("--name", required=True)
    p.add_argument("--role", choices=("trainer", "rollout"), required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--join", action="append", default=[])
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--chunk", type=int, required=True)
    p.add_argument("--host", default="localhost", help="the host label (same host: shm)")
    p.add_argument("--keys", default="", help="a `tensorhub keygen` directory (security on)")
    return p.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse())
