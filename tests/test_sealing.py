"""Multi-rank publish over real in-process peers (real ZeroMQ, real TCP): sealing,
``latest``, resharding fetches, integrity during resharding, and retention of shards.

Each peer runs in its own task, so a test can close one (it leaves the mesh) while the
others keep running.  Waits are bounded by generous ``trio.fail_after``; nothing here
asserts how long anything took.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import numpy as np
import pytest
import trio
from corrupting import corrupt_served
from helpers import complete_holders, wait_until

import tensorhub
from tensorhub import (
    ConsistencyError,
    LocalProtocolError,
    PeerConfig,
    RetentionError,
    Sharding,
    VersionKey,
    VersionUnavailable,
)
from tensorhub.manifest.manifest import build_manifest
from tensorhub.protocol.resharding import plan_reshard

CHUNK = 4096  # the smallest chunk size a peer allows: many chunks per shard
WAIT = 10.0


class Mesh:
    """Peers ``p0, p1, ...`` each running in its own task of one nursery."""

    def __init__(self, nursery: trio.Nursery, cfg: dict[str, Any]) -> None:
        self.nursery = nursery
        self.cfg = cfg
        self.peers: list[tensorhub.Peer] = []
        self._stop: dict[str, trio.Event] = {}
        self._done: dict[str, trio.Event] = {}

    async def add(self, **cfg: Any) -> tensorhub.Peer:
        name = f"p{len(self.peers)}"
        join = (self.peers[0].info.control.removeprefix("tcp://"),) if self.peers else ()
        config = PeerConfig.local(name, join=join, chunk_size=CHUNK, **{**self.cfg, **cfg})
        stop, done = trio.Event(), trio.Event()
        self._stop[name], self._done[name] = stop, done

        async def run(task_status: trio.TaskStatus[tensorhub.Peer]) -> None:
            try:
                async with tensorhub.open_peer(config) as peer:
                    task_status.started(peer)
                    await stop.wait()
            finally:
                done.set()

        peer: tensorhub.Peer = await self.nursery.start(run)
        self.peers.append(peer)
        return peer

    @property
    def open(self) -> list[tensorhub.Peer]:
        return [p for p in self.peers if not self._stop[p.info.name].is_set()]

    async def settle(self) -> None:
        """Wait until every open peer sees every open peer live."""
        names = {p.info.name for p in self.open}
        await wait_until(lambda: all(names <= set(p.control.live_names()) for p in self.open),
                         WAIT, what="every open peer seeing every open peer live")

    async def close(self, peer: tensorhub.Peer) -> None:
        """Exit ``peer``'s ``open_peer`` block (it leaves the mesh); wait until the
        other peers no longer count it live."""
        name = peer.info.name
        self._stop[name].set()
        with trio.fail_after(WAIT):
            await self._done[name].wait()
        await wait_until(lambda: all(name not in p.control.live_names() for p in self.open),
                         WAIT, what=f"no open peer counting {name} live")


@asynccontextmanager
async def mesh(n: int, **cfg: Any) -> AsyncIterator[Mesh]:
    async with trio.open_nursery() as nursery:
        m = Mesh(nursery, cfg)
        try:
            for _ in range(n):
                await m.add()
            await m.settle()
            yield m
        finally:
            for p in reversed(m.peers):
                m._stop[p.info.name].set()


def tensors(seed: int) -> dict[str, np.ndarray[Any, Any]]:
    """A small model: several chunks per shard, mixed dtypes, one replicated tensor."""
    rng = np.random.default_rng(seed)
    return {
        "qkv": rng.standard_normal((128, 96)).astype(np.float32),
        "o": rng.standard_normal((96, 128)).astype(np.float16),
        "emb": rng.integers(-2**40, 2**40, size=(64, 32), dtype=np.int64),
        "norm": rng.standard_normal(96).astype(np.float32),
    }


def region(arr: np.ndarray[Any, Any], box: tuple[tuple[int, int], ...]) -> np.ndarray[Any, Any]:
    """A copy (the caller's own memory, never a view of ``arr``)."""
    return np.array(arr[tuple(slice(a, b) for a, b in box)], order="C", copy=True)


def slices(full: dict[str, np.ndarray[Any, Any]], spec: Sharding
           ) -> dict[str, np.ndarray[Any, Any]]:
    """What rank ``spec.rank`` of ``spec`` holds, as numpy slicing says."""
    return {k: region(v, spec.box(k, v.shape)) for k, v in full.items()}


def assert_same(got: dict[str, np.ndarray[Any, Any]], want: dict[str, np.ndarray[Any, Any]]
                ) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v, err_msg=k)


async def publish_group(peers: list[tensorhub.Peer], version: int,
                        full: dict[str, np.ndarray[Any, Any]], spec: Sharding
                        ) -> list[dict[str, np.ndarray[Any, Any]]]:
    """Rank ``r`` of ``spec`` publishes its slices from ``peers[r]``; returns the slices
    (the caller's arrays the peers now reference)."""
    out = []
    for r, p in enumerate(peers):
        local = slices(full, spec.at(r))
        await p.publish("m", version, local, layout=spec.at(r))
        out.append(local)
    return out


def key_of(version: int, spec: Sharding) -> VersionKey:
    return VersionKey("m", version, spec.rank if spec.size > 1 else 0, spec.layout_id)


def claimants(peer: tensorhub.Peer, version: int) -> set[str]:
    """Peers whose claims on ``m@version`` ``peer`` sees."""
    return {c.origin for c in peer.control.claims("m") if c.version == version}


async def never_returns(aw: Callable[[], Any], seconds: float = 0.5) -> None:
    with trio.move_on_after(seconds) as scope:
        await aw()
    assert scope.cancelled_caught, "returned, but must not have"


@contextmanager
def unaware_of_other_holders(peer: tensorhub.Peer) -> Iterator[None]:
    """``peer`` does not yet see other holders' announcements (they are still in
    flight): what two ranks publishing the same shard at the same instant each see."""
    real = peer.control.holders
    peer.control.holders = lambda key: [(p, h) for p, h in real(key)  # type: ignore[method-assign]
                                        if p.name == peer.info.name]
    try:
        yield
    finally:
        del peer.control.holders  # type: ignore[method-assign]


TP4 = Sharding(0, 4, split={"qkv": 0, "o": 0})
"""The publishing group: column-parallel split of qkv and o, emb and norm replicated."""


# -- (a) sealing waits for every rank -------------------------------------------------------


async def test_version_is_invisible_until_every_rank_has_published() -> None:
    async with mesh(6) as m:
        pubs, readers = m.peers[:4], m.peers[4:]
        full = tensors(1)
        for r in range(3):
            await pubs[r].publish("m", 1, slices(full, TP4.at(r)), layout=TP4.at(r))
        missing = ["version 1: shards [3] of 4 have no complete holder"]
        await wait_until(lambda: all(p.unsealed("m") == missing for p in m.peers))
        for p in m.peers:
            assert await p.latest("m") is None
            assert p.control.readable("m") == []
            with pytest.raises(VersionUnavailable, match=r"version 1 .*shards \[3\] of 4"):
                await p.fetch("m", 1)
            with pytest.raises(VersionUnavailable, match="no sealed version"):
                await p.fetch("m")
            with pytest.raises(VersionUnavailable, match=r"shards \[3\] of 4"):
                p.control.seal("m", 1)
        await never_returns(lambda: readers[0].wait_for_version("m"))
        assert readers[0].statistics().bytes_fetched == 0

        woke: dict[str, int] = {}

        async def waiter(p: tensorhub.Peer) -> None:
            woke[p.info.name] = await p.wait_for_version("m")

        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                for p in m.peers:
                    nursery.start_soon(waiter, p)
                await trio.sleep(0.1)
                assert woke == {}
                await pubs[3].publish("m", 1, slices(full, TP4.at(3)), layout=TP4.at(3))
        assert woke == {p.info.name: 1 for p in m.peers}
        for p in m.peers:
            assert await p.latest("m") == 1
            assert p.unsealed("m") == []
            assert p.control.seal("m", 1).world == 4
        whole = await readers[0].fetch("m", 1)
        assert_same(whole.tensors, full)
        assert whole.report.plan.startswith("resharded from 4 shards")
        # the publish layout itself: one shard, read whole from the rank that holds it
        rank2 = await readers[1].fetch("m", "latest", layout=TP4.at(2))
        assert_same(rank2.tensors, slices(full, TP4.at(2)))
        assert set(rank2.report.bytes_by_source) == {"p2"}


# -- (b) a rank that leaves mid-publish ---------------------------------------------------


async def test_rank_leaving_before_the_last_rank_publishes_leaves_version_unsealed() -> None:
    async with mesh(5) as m:
        pubs, mirror, reader = m.peers[:3], m.peers[3], m.peers[4]
        tp3 = Sharding(0, 3, split={"qkv": 0, "o": 1},
                       parts={"qkv": [48, 32, 48], "o": [64, 0, 64]})
        v1, v2 = tensors(1), tensors(2)
        await publish_group(pubs, 1, v1, tp3)
        for p in (mirror, reader):
            with trio.fail_after(WAIT):
                assert await p.wait_for_version("m") == 1
        # an exact copy of shard 1 of version 1 keeps that version readable
        copy = await mirror.fetch("m", 1, layout=tp3.at(1))
        assert_same(copy.tensors, slices(v1, tp3.at(1)))
        await wait_until(lambda: complete_holders(reader, key_of(1, tp3.at(1))) == {"p1", "p3"})

        await pubs[0].publish("m", 2, slices(v2, tp3.at(0)), layout=tp3.at(0))
        await pubs[1].publish("m", 2, slices(v2, tp3.at(1)), layout=tp3.at(1))
        await m.close(pubs[1])
        await pubs[2].publish("m", 2, slices(v2, tp3.at(2)), layout=tp3.at(2))

        reason = ["version 2: shards [1] of 3 have no complete holder"]
        live = [pubs[0], pubs[2], mirror, reader]
        await wait_until(lambda: all(p.unsealed("m") == reason for p in live))
        for p in live:
            assert await p.latest("m") == 1
            assert p.control.readable("m") == [1]
            with pytest.raises(VersionUnavailable, match=r"version 2 .*shards \[1\] of 3"):
                await p.fetch("m", 2)
        await never_returns(lambda: reader.wait_for_version("m", 1))
        got = await reader.fetch("m")
        assert got.version == 1
        assert_same(got.tensors, v1)
        assert "p1" not in got.report.bytes_by_source


# -- (c) ranks that disagree ----------------------------------------------------------------


async def test_ranks_disagreeing_on_a_shard_never_seal() -> None:
    async with mesh(4) as m:
        a, b, c, reader = m.peers
        tp2 = Sharding(0, 2, split={"qkv": 0, "o": 0})
        full = tensors(1)
        other = {k: v.copy() for k, v in full.items()}
        other["qkv"][3, 5] += 1  # in rank 0's slice
        await a.publish("m", 1, slices(full, tp2.at(0)), layout=tp2.at(0))
        await wait_until(lambda: complete_holders(b, key_of(1, tp2.at(0))) == {"p0"})
        # a rank that already sees the other announcement refuses to publish
        with pytest.raises(ConsistencyError, match="already published by p0 with different"):
            await b.publish("m", 1, slices(other, tp2.at(0)), layout=tp2.at(0))
        assert b.store.get(key_of(1, tp2.at(0))) is None
        # ... but one that publishes before the announcement reached it does not know
        with unaware_of_other_holders(b):
            await b.publish("m", 1, slices(other, tp2.at(0)), layout=tp2.at(0))
        # (the last rank publishes once every peer has both claims: a peer that sees
        # the version sealed before the conflicting claim arrives keeps it as latest)
        await wait_until(lambda: all(claimants(p, 1) == {"p0", "p1"} for p in m.peers))
        await c.publish("m", 1, slices(full, tp2.at(1)), layout=tp2.at(1))

        def disagree(p: tensorhub.Peer) -> bool:
            why = p.unsealed("m")
            return len(why) == 1 and "disagree on the manifest of shard 0" in why[0] \
                and "from p0" in why[0] and "from p1" in why[0]

        await wait_until(lambda: all(disagree(p) for p in m.peers))
        for p in m.peers:
            assert await p.latest("m") is None
            with pytest.raises(ConsistencyError, match=r"disagree on the manifest of shard 0"):
                p.control.seal("m", 1)
        with pytest.raises(ConsistencyError, match=r"version 1: holders disagree"):
            await reader.fetch("m", 1)
        await never_returns(lambda: reader.wait_for_version("m"))
        assert reader.statistics().bytes_fetched == 0

        # ranks of one version that declare different shardings, or group sizes
        await a.publish("m", 2, slices(full, tp2.at(0)), layout=tp2.at(0))
        by_dim1 = Sharding(1, 2, split={"qkv": 1, "o": 0})
        await c.publish("m", 2, slices(full, by_dim1), layout=by_dim1)
        tp3 = Sharding(0, 3, split={"qkv": 0}, parts={"qkv": [43, 43, 42]})
        await a.publish("m", 3, slices(full, tp3), layout=tp3)
        await c.publish("m", 3, slices(full, tp2.at(1)), layout=tp2.at(1))
        await wait_until(lambda: claimants(reader, 2) == claimants(reader, 3) == {"p0", "p2"})
        why = reader.unsealed("m")
        assert len(why) == 3
        assert why[1].startswith("version 2: holders disagree on the layout id: ")
        assert why[2].startswith("version 3: holders disagree on the world: 3 from p0; "
                                 "2 from p2; holders disagree on the layout id")
        # ... and on which tensors, once the reader has compared the ranks' manifests
        await wait_until(lambda: "; tensor 'qkv': the ranks' slices do not tile its [128, 96] "
                                 "(overlapping): rank 0 (peer p0) [0:64, 0:96], rank 1 (peer p2) "
                                 "[0:128, 48:96]" in reader.unsealed("m")[1])

        # a rank that publishes a tensor with another dtype: never sealed, rank and
        # tensor named
        odd = slices(full, tp2.at(1))
        odd["o"] = odd["o"].astype(np.float32)
        await a.publish("m", 4, slices(full, tp2.at(0)), layout=tp2.at(0))
        await c.publish("m", 4, odd, layout=tp2.at(1))
        await wait_until(lambda: claimants(reader, 4) == {"p0", "p2"})
        with pytest.raises(ConsistencyError, match=(
                r"version 4: holders disagree on the tensor specs: \w+ \(rank 0\) from p0; "
                r"\w+ \(rank 1\) from p2; tensor 'o': rank 0 \(peer p0\) has float16 "
                r"\[96, 128\], rank 1 \(peer p2\) has float32 \[96, 128\]$")):
            await reader.fetch("m", 4)
        assert reader.statistics().bytes_fetched == 0

        # the wrong copy goes away: version 1 seals
        await b.unpublish("m", 1, layout=tp2.at(0))
        with trio.fail_after(WAIT):
            assert await reader.wait_for_version("m") == 1
        got = await reader.fetch("m", 1)
        assert_same(got.tensors, full)
        assert set(got.report.bytes_by_source) <= {"p0", "p2"}

        # a conflicting claim that arrives after the seal: latest stays, fetches refuse
        with trio.fail_after(WAIT):
            assert await c.wait_for_version("m") == 1
        with unaware_of_other_holders(b):
            await b.publish("m", 1, slices(other, tp2.at(0)), layout=tp2.at(0))
        await wait_until(lambda: claimants(c, 1) == {"p0", "p1", "p2"})
        assert await c.latest("m") == 1
        with pytest.raises(ConsistencyError, match=r"version 1: holders disagree on the "
                                                   r"manifest of shard 0: .* from p0; .* from p1"):
            await c.fetch("m", 1)
        # the reader that already holds its copy keeps reading it
        held = await reader.fetch("m", 1)
        assert held.report.bytes == 0
        assert_same(held.tensors, full)


# -- (d) resharding fetch -----------------------------------------------------------------


async def test_resharding_fetch_and_readers_of_the_same_layout() -> None:
    async with mesh(7, planning=False) as m:
        pubs, (c0, c1, c2) = m.peers[:4], m.peers[4:]
        full = tensors(3)
        await publish_group(pubs, 1, full, TP4)
        with trio.fail_after(WAIT):
            await c0.wait_for_version("m")
        # TP=2 consumer: qkv row-split (dim 1, reads part of every row of all 4 shards),
        # o column-split (dim 0, reads whole shards), emb split unequally from a
        # replicated source, norm replicated
        tp2 = Sharding(1, 2, split={"qkv": 1, "o": 0, "emb": 0}, parts={"emb": [40, 24]})
        got = await c0.fetch("m", 1, layout=tp2)
        want = slices(full, tp2)
        assert_same(got.tensors, want)
        assert got.version == 1 and got.report.verified
        assert got.report.plan.startswith("resharded from 4 shards of layout")
        assert set(got.report.bytes_by_source) <= {p.info.name for p in pubs}
        assert sum(got.report.bytes_by_source.values()) == got.report.bytes
        assert got.report.integrity_failures == {}
        # fetching it again is served from what we hold
        again = await c0.fetch("m", 1, layout=tp2)
        assert_same(again.tensors, want)
        # a second consumer of the same layout and rank reads the whole slices from c0
        key = key_of(1, tp2)
        await wait_until(lambda: complete_holders(c1, key) == {"p4"}
                         and claimants(c1, 1) == {p.info.name for p in pubs})
        # (c0's derived holding serves readers of its layout but claims no publish shard)
        got1 = await c1.fetch("m", 1, layout=tp2)
        assert_same(got1.tensors, want)
        assert got1.report.bytes_by_source == {"p4": sum(v.nbytes for v in want.values())}
        # the same through ``sources``
        await wait_until(lambda: complete_holders(c2, key) == {"p4", "p5"})
        got2 = await c2.fetch("m", 1, layout=tp2, sources=["p4"])
        assert_same(got2.tensors, want)
        assert set(got2.report.bytes_by_source) == {"p4"}

        # the other rank of the consumer group has no holder of its slices: it reshards,
        # into the caller's arrays
        into = {k: np.zeros_like(v) for k, v in slices(full, tp2.at(0)).items()}
        got0 = await c2.fetch("m", 1, into, layout=tp2.at(0))
        assert all(got0.tensors[k] is into[k] for k in into)
        assert_same(into, slices(full, tp2.at(0)))
        assert set(got0.report.bytes_by_source) <= {p.info.name for p in pubs}

        # a layout aligned with the publish reads only the shards it overlaps, and
        # exactly the chunks the plan lists
        aligned = Sharding(1, 2, split={"qkv": 0, "o": 0})
        got_a = await c2.fetch("m", 1, layout=aligned)
        assert_same(got_a.tensors, slices(full, aligned))
        plan = plan_reshard(aligned, {s: build_manifest(
            key_of(1, TP4.at(s)), list(slices(full, TP4.at(s)).items()), CHUNK, "blake3", 4,
            [TP4.at(s).place(k, v.shape) for k, v in slices(full, TP4.at(s)).items()])
            for s in range(4)})
        assert set(plan.chunks) == {0, 2, 3}  # replicated tensors from shard 0
        assert set(got_a.report.bytes_by_source) == {"p0", "p2", "p3"}
        assert got_a.report.chunks == sum(len(c) for c in plan.chunks.values())
        # and the whole model, assembled from the publish shards
        whole = await c1.fetch("m", 1)
        assert_same(whole.tensors, full)


async def test_fetch_from_a_named_source_of_the_same_layout_waits_for_it() -> None:
    async with mesh(6, planning=False) as m:
        pubs, (c0, c1) = m.peers[:4], m.peers[4:]
        full = tensors(3)
        await publish_group(pubs, 1, full, TP4)
        for p in (c0, c1):
            with trio.fail_after(WAIT):
                await p.wait_for_version("m")
        tp2 = Sharding(1, 2, split={"qkv": 1, "o": 0})
        await c0.fetch("m", 1, layout=tp2)
        # c1 is told to read from c0 before gossip has told it that c0 holds the slices
        got = await c1.fetch("m", 1, layout=tp2, sources=["p4"])
        assert_same(got.tensors, slices(full, tp2))
        assert set(got.report.bytes_by_source) == {"p4"}


# -- (e) integrity during a resharding fetch ---------------------------------------------


async def test_corrupt_chunk_during_resharding_fetch_is_caught_and_refetched() -> None:
    async with mesh(4, planning=False) as m:
        p0, p1, mirror, reader = m.peers
        tp2 = Sharding(0, 2, split={"qkv": 0, "o": 1})
        full = tensors(4)
        await publish_group([p0, p1], 1, full, tp2)
        for p in (mirror, reader):
            with trio.fail_after(WAIT):
                await p.wait_for_version("m")
        copy = await mirror.fetch("m", 1, layout=tp2.at(0))  # an exact copy of shard 0
        assert copy.report.bytes_by_source == {"p0": copy.report.bytes}
        await wait_until(lambda: complete_holders(reader, key_of(1, tp2.at(0))) == {"p0", "p2"})
        assert mirror.statistics().chunks_served == 0
        served = corrupt_served(mirror, 1)
        got = await reader.fetch("m", 1)  # reshards: shard 0 from p0 or p2, shard 1 from p1
        assert_same(got.tensors, full)
        assert served.remaining == 0  # the mirror did serve a (corrupt) chunk
        assert got.report.integrity_failures == {"p2": 1}
        assert "p2" in got.report.dropped_sources
        assert got.report.verified
        assert reader.statistics().integrity_failures == {"p2": 1}


# -- (f) retention of shards --------------------------------------------------------------


async def test_last_holders_of_shards_keep_host_copies_on_unpublish() -> None:
    async with mesh(3) as m:
        p0, p1, reader = m.peers
        tp2 = Sharding(0, 2, split={"qkv": 0, "o": 1})
        full = tensors(5)
        mine = await publish_group([p0, p1], 1, full, tp2)
        for p in m.peers:  # (retention is decided on each unpublisher's own view)
            with trio.fail_after(WAIT):
                assert await p.wait_for_version("m") == 1
        await p0.unpublish("m", 1, layout=tp2.at(0))
        await p1.unpublish("m", 1, layout=tp2.at(1))
        for arrays in mine:  # the callers may now reuse their memory
            for a in arrays.values():
                a[...] = 0
        for r, p in enumerate((p0, p1)):
            held = p.store.get(key_of(1, tp2.at(r)))
            assert held is not None and not held.hidden
            assert not any(np.shares_memory(a, b) for a in held.arrays for b in mine[r].values())
        assert reader.control.readable("m") == [1]
        got = await reader.fetch("m", 1)
        assert_same(got.tensors, full)
        assert set(got.report.bytes_by_source) == {"p0", "p1"}
        # a newer version seals: the host copies of version 1 are released
        await publish_group([p0, p1], 2, tensors(6), tp2)
        await wait_until(lambda: p0.store.get(key_of(1, tp2.at(0))) is None
                         and p1.store.get(key_of(1, tp2.at(1))) is None)
        await wait_until(lambda: reader.control.readable("m") == [2])
        assert await reader.latest("m") == 2


async def test_unpublish_of_last_shard_copy_without_offload_is_refused() -> None:
    async with mesh(4, retention_offload=False) as m:
        p0, p1, mirror, reader = m.peers
        tp2 = Sharding(0, 2, split={"qkv": 0, "o": 1})
        full = tensors(7)
        mine = await publish_group([p0, p1], 1, full, tp2)
        for p in (p0, p1, reader):
            with trio.fail_after(WAIT):
                await p.wait_for_version("m")
        k0, k1 = key_of(1, tp2.at(0)), key_of(1, tp2.at(1))
        for r, (p, k) in enumerate(((p0, k0), (p1, k1))):
            before = p.store.get(k)
            with pytest.raises(RetentionError, match="retention_offload"):
                await p.unpublish("m", 1, layout=tp2.at(r))
            held = p.store.get(k)
            assert held is before and held is not None and not held.hidden
            assert all(a is b for a, b in zip(held.arrays, mine[r].values(), strict=True))
        with pytest.raises(LocalProtocolError, match="not held here"):
            await reader.unpublish("m", 1, layout=tp2.at(0))
        await trio.sleep(0.3)  # nothing was withdrawn: every view still has both ranks
        assert complete_holders(reader, k0) == {"p0"} and complete_holders(reader, k1) == {"p1"}
        got = await reader.fetch("m", 1)
        assert_same(got.tensors, full)
        # with another exact copy of shard 0 around, p0 may drop its own
        with trio.fail_after(WAIT):
            await mirror.wait_for_version("m")
        await mirror.fetch("m", 1, layout=tp2.at(0))
        await wait_until(lambda: complete_holders(p0, k0) == {"p0", "p2"})
        await p0.unpublish("m", 1, layout=tp2.at(0))
        assert p0.store.get(k0) is None
        await wait_until(lambda: complete_holders(reader, k0) == {"p2"})
        assert reader.control.readable("m") == [1]


async def test_unpublish_right_after_the_last_rank_publishes_keeps_the_shard() -> None:
    async with mesh(3) as m:
        p0, p1, reader = m.peers
        tp2 = Sharding(0, 2, split={"qkv": 0, "o": 1})
        full = tensors(10)
        await p0.publish("m", 1, slices(full, tp2.at(0)), layout=tp2.at(0))
        await wait_until(lambda: claimants(reader, 1) == {"p0"})
        await p1.publish("m", 1, slices(full, tp2.at(1)), layout=tp2.at(1))
        # no checkpoint since p1 announced: p0 cannot have merged p1's claim yet
        await p0.unpublish("m", 1, layout=tp2.at(0))
        with trio.fail_after(5):
            assert await reader.wait_for_version("m") == 1
        got = await reader.fetch("m", 1)
        assert_same(got.tensors, full)


# -- (g) latest is monotonic --------------------------------------------------------------


async def test_latest_never_goes_backwards_when_the_newest_version_loses_holders() -> None:
    async with mesh(4) as m:
        p0, p1, p2, reader = m.peers
        v1, v2 = tensors(8), tensors(9)
        await p0.publish("m", 1, v1)  # a single process publishes version 1 whole
        tp2 = Sharding(0, 2, split={"qkv": 0, "o": 1})
        await publish_group([p1, p2], 2, v2, tp2)
        # ``latest`` is what a peer has *observed* sealed: each of these looks while
        # version 2 is sealed (a peer that did not look then never reports it)
        for p in (p0, p1, reader):
            with trio.fail_after(WAIT):
                # one read of latest per step: two could straddle the seal, and waiting
                # for a version newer than 2 would never end
                while (seen := await p.latest("m")) != 2:
                    await p.wait_for_version("m", seen)
        await m.close(p2)
        await wait_until(lambda: reader.control.readable("m") == [1])
        for p in (p0, p1, reader):
            assert await p.latest("m") == 2
            assert p.unsealed("m") == []  # version 2 is not newer than latest
            with pytest.raises(VersionUnavailable, match=r"version 2 .*shards \[1\] of 2"):
                await p.fetch("m")
        with trio.fail_after(WAIT):
            assert await reader.wait_for_version("m") == 2
        await never_returns(lambda: reader.wait_for_version("m", 2))
        got = await reader.fetch("m", 1)
        assert_same(got.tensors, v1)
        tp3 = Sharding(2, 3, split={"o": 1}, parts={"o": [0, 100, 28]})
        part = await reader.fetch("m", 1, layout=tp3)  # resharded from a whole publish
        assert_same(part.tensors, slices(v1, tp3))
        assert part.report.plan.startswith("resharded from 1 shards of layout whole")
        # a peer that joins now never saw version 2 sealed: its history starts at 1
        late = await m.add()
        await m.settle()
        await wait_until(lambda: late.control.readable("m") == [1])
        assert await late.latest("m") == 1
        assert late.unsealed("m") == ["version 2: shards [1] of 2 have no complete holder"]
        # version 3 seals: latest moves on everywhere
        await p1.publish("m", 3, v2)
        for p in (reader, late):
            with trio.fail_after(WAIT):
                assert await p.wait_for_version("m", 2) == 3
