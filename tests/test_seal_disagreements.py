"""Ranks of a publish that disagree never seal: a property test on a mesh of real peers.

Four publisher ranks ``t0..t3`` (TP=4: ``l1.qkv`` split along dim 0, ``l1.o`` along
dim 1, ``norm`` replicated) and two readers run in one trio loop on a background thread
(real ZeroMQ, real TCP), reused by every example: each example publishes a new version
in which one random rank deviates in one random way -- another dtype, another shape of
a split or of a replicated tensor, another split dim, other part sizes, a tensor
missing or one extra -- or nobody deviates.  Then, at every peer:

* a deviating version is never sealed (``latest`` never names it), ``unsealed()`` names
  the deviating rank, its peer and the tensor, and a fetch in the publishers' own layout
  and in another layout raises :class:`ConsistencyError` saying the same, having
  fetched no byte;
* a consistent version seals and reads back equal, in both layouts.

``pytest -s`` prints how many cases of each kind were explored.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
from helpers import wait_until
from hypothesis import example, given, seed, settings
from hypothesis import strategies as st
from test_stateful_mesh import MeshThread

import tensorhub
from tensorhub import ConsistencyError, Sharding, VersionKey

SEED = int(os.environ.get("TENSORHUB_SEED") or random.randrange(2**32))
print(f"tests/test_seal_disagreements.py: hypothesis seed {SEED} (TENSORHUB_SEED={SEED} "
      "replays it)")

Arrays = dict[str, np.ndarray[Any, Any]]
BASE = Sharding(0, 4, split={"l1.qkv": 0, "l1.o": 1})
RANKS = [f"t{r}" for r in range(4)]
KINDS = ("none", "dtype", "split shape", "replicated shape", "split dim", "parts",
         "missing", "extra")
WAIT = 20.0


def content(version: int) -> Arrays:
    rng = np.random.default_rng(version)
    return {"l1.qkv": rng.standard_normal((96, 40)).astype(np.float32),
            "l1.o": rng.integers(-99, 99, (16, 32)).astype(np.float16),
            "norm": rng.standard_normal(40).astype(np.float32)}


def cut(full: Arrays, spec: Sharding) -> Arrays:
    return {k: np.ascontiguousarray(a[tuple(slice(x, y) for x, y in spec.box(k, a.shape))])
            for k, a in full.items()}


def deviation(kind: str, rank: int, k: int, full: Arrays) -> tuple[Arrays, Sharding, str]:
    """What rank ``rank`` publishes when it deviates in ``kind`` (by ``k`` in 1..3), and
    the tensor the deviation is about (the account must name it)."""
    spec, tensor = BASE.at(rank), "l1.qkv"
    if kind == "split dim":
        spec = Sharding(rank, 4, split={"l1.qkv": 1, "l1.o": 1})
    elif kind == "parts":
        sizes = [24] * 4  # its own part smaller, its neighbour's larger: a gap
        sizes[rank], sizes[(rank + 1) % 4] = 24 - 2 * k, 24 + 2 * k
        spec = replace(BASE.at(rank), parts={"l1.qkv": sizes})
    local = cut(full, spec)
    if kind == "dtype":
        tensor = ("l1.qkv", "l1.o", "norm")[k - 1]
        local[tensor] = local[tensor].astype(np.float64)
    elif kind == "split shape":  # 24 x (40 + k) per rank: a [96, 40 + k] tensor
        local[tensor] = np.zeros((24, 40 + k), np.float32)
    elif kind == "replicated shape":
        tensor = "norm"
        local[tensor] = np.zeros(40 + k, np.float32)
    elif kind == "missing":
        tensor = ("norm", "l1.o", "l1.qkv")[k - 1]
        del local[tensor]
    elif kind == "extra":
        tensor = "x"
        local[tensor] = np.zeros(k, np.float32)
    return local, spec, tensor


@dataclass
class Net:
    mesh: MeshThread
    peers: list[tensorhub.Peer]
    version: int = 0
    explored: Counter[str] = field(default_factory=Counter)


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    mesh = MeshThread()
    try:
        async def start() -> list[tensorhub.Peer]:
            first = await mesh.start_peer("t0", ())
            seed_addr = (first.info.control.removeprefix("tcp://"),)
            peers = [first] + [await mesh.start_peer(n, seed_addr)
                               for n in [*RANKS[1:], "r0", "r1"]]
            await wait_until(lambda: all(len(p.control.live_names()) == 6 for p in peers), WAIT)
            return peers
        yield Net(mesh, mesh.call(start))
    finally:
        mesh.close()


async def one_example(net: Net, kind: str, rank: int, k: int) -> None:
    net.version += 1
    v, full = net.version, content(net.version)
    peers, (r0, r1) = net.peers, net.peers[4:]
    before = [await p.latest("m") for p in peers]
    tensor = ""
    for r, p in enumerate(peers[:4]):
        local, spec = cut(full, BASE.at(r)), BASE.at(r)
        if r == rank and kind != "none":
            local, spec, tensor = deviation(kind, r, k, full)
        await p.publish("m", v, local, layout=spec)
    if kind == "none":
        await wait_until(lambda: all(p.control.latest("m") == v for p in peers), WAIT)
        got = await r0.fetch("m", v, layout=BASE.at(rank))
        assert_equal(got.tensors, cut(full, BASE.at(rank)))
        assert_equal((await r1.fetch("m", v)).tensors, full)
        return
    await wait_until(lambda: all({c.origin for c in p.control.claims("m") if c.version == v}
                                 == set(RANKS) for p in peers), WAIT)
    must = [f"rank {rank} (peer t{rank})", f"tensor {tensor!r}"]

    def explained(p: tensorhub.Peer) -> bool:
        why = [w for w in p.unsealed("m") if w.startswith(f"version {v}: ")]
        return len(why) == 1 and all(m in why[0] for m in must)

    await wait_until(lambda: all(explained(p) for p in peers), WAIT)
    for p, was in zip(peers, before, strict=True):
        assert await p.latest("m") == was, f"{p.info.name} sealed a disagreeing version"
        assert v not in p.control.readable("m")
    fetched = r0.statistics().bytes_fetched, r1.statistics().bytes_fetched
    for reader, layout in ((r0, BASE.at(rank)), (r1, None)):
        with pytest.raises(ConsistencyError) as err:
            await reader.fetch("m", v, layout=layout)
        assert f"version {v}: holders disagree" in str(err.value)
        assert all(m in str(err.value) for m in must), str(err.value)
    with pytest.raises(ConsistencyError) as err:  # a staged flip of it says the same
        await tensorhub.Rollout(r1, "m").stage(v)
    assert all(m in str(err.value) for m in must), str(err.value)
    assert (r0.statistics().bytes_fetched, r1.statistics().bytes_fetched) == fetched


def assert_equal(got: Arrays, want: Arrays) -> None:
    assert set(got) == set(want)
    for k, a in want.items():
        assert got[k].dtype == a.dtype and got[k].shape == a.shape, k
        np.testing.assert_array_equal(got[k], a, err_msg=k)


def test_ranks_that_disagree_never_seal_and_are_named(net: Net) -> None:
    @seed(SEED)
    @settings(max_examples=36, deadline=None, database=None)
    @given(st.sampled_from(KINDS), st.integers(0, 3), st.integers(1, 3))
    @example("none", 0, 1)  # every kind at least once, whatever the draws
    @example("dtype", 2, 1)
    @example("split shape", 1, 1)
    @example("replicated shape", 3, 2)
    @example("split dim", 0, 1)
    @example("parts", 3, 3)
    @example("missing", 1, 2)
    @example("extra", 2, 1)
    def case(kind: str, rank: int, k: int) -> None:
        net.mesh.call(one_example, net, kind, rank, k, timeout=60)
        net.explored[kind] += 1

    case()
    print(f"\nexplored cases by kind: {dict(sorted(net.explored.items()))}")
    assert set(net.explored) == set(KINDS)


def test_a_manifest_with_other_specs_than_announced_is_refused(net: Net) -> None:
    """A rank that announces the others' schema id for a manifest of other specs (only
    a publisher's key can sign that): the version seals, but no fetch mixes it in."""
    async def lie() -> None:
        net.version += 1
        v, full = net.version, content(net.version)
        peers, (r0, r1) = net.peers, net.peers[4:]
        for r, p in enumerate(peers[:4]):
            local, spec, _ = deviation("dtype", r, 1, full) if r == 2 \
                else (cut(full, BASE.at(r)), BASE.at(r), "")
            await p.publish("m", v, local, layout=spec)
        liar, key = peers[2], VersionKey("m", v, 2, BASE.layout_id)
        held = liar.store.get(key)
        assert held is not None
        honest = peers[0].store.get(VersionKey("m", v, 0, BASE.layout_id))
        assert honest is not None
        # the liar's protocol announces a holding with another schema, and its shell
        # sends that out (fault injection: no public call announces a forged holding)
        liar._send(liar.control.put_holding(
            replace(held.holding(), schema=honest.manifest.schema_id())))
        await wait_until(lambda: all(p.control.latest("m") == v for p in peers), WAIT)
        fetched = r0.statistics().bytes_fetched, r1.statistics().bytes_fetched
        for reader, layout in ((r0, BASE.at(2)), (r1, None)):
            with pytest.raises(ConsistencyError, match=rf"m@{v}\[shard 2 .*other tensor "
                                                       "specs"):
                await reader.fetch("m", v, layout=layout)
            assert reader.store.get(VersionKey("m", v, 2 if layout else 0,
                                               layout.layout_id if layout else b"")) is None
        assert (r0.statistics().bytes_fetched, r1.statistics().bytes_fetched) == fetched
        # the honest ranks' shards are still read as sealed
        got = await r0.fetch("m", v, layout=BASE.at(1))
        assert_equal(got.tensors, cut(full, BASE.at(1)))

    net.mesh.call(lie, timeout=60)
