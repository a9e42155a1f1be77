"""The staging ring: its slots and tickets, a fetch landing through it (flow control,
digests checked in the slot, cancellation), and device-memory versions published and
fetched through it, here with host memory posing as device memory (a host copier)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
import trio
from corrupting import corrupt_served
from helpers import complete_holders, open_mesh, wait_until
from slow_serving import slow_served

import tensorhub
from tensorhub import IntegrityError, LocalProtocolError, StagingRing, ThroughRing
from tensorhub.device.copier import HostCopier
from tensorhub.device.landing import Landing
from tensorhub.device.staging import DeviceRings
from tensorhub.manifest.digests import digest_of
from tensorhub.manifest.manifest import build_manifest
from tensorhub.model import VersionKey

KIB = 1024


class HostAsDevice:
    """Host memory that says it is device memory (``__cuda_array_interface__``)."""

    def __init__(self, arr: np.ndarray[Any, Any]) -> None:
        self.arr = arr
        self.__cuda_array_interface__ = {
            "data": (arr.ctypes.data, False), "shape": arr.shape,
            "typestr": arr.dtype.str, "strides": None, "version": 3}


def state(seed: int, mib: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * (1 << 20)) // 4
    return {"a": torch.randn(n // 2, generator=g), "b": torch.randn(n // 4, 2, generator=g),
            "c": torch.randint(0, 1 << 30, (3,), generator=g, dtype=torch.int64),
            "d": torch.randn(5, 7, generator=g).to(torch.bfloat16)}


async def published(pub: tensorhub.Peer, reader: tensorhub.Peer, model: str, version: int,
                    tensors: dict[str, Any]) -> None:
    await pub.publish(model, version, tensors)
    with trio.fail_after(10):
        await reader.wait_for_version(model, version - 1 if version > 1 else None)


# -- the ring -----------------------------------------------------------------------

def test_ring_hands_out_each_slot_once_and_refuses_stale_claims() -> None:
    ring = StagingRing(slots=3, slot_bytes=4 * KIB)
    claims = [ring.acquire_nowait() for _ in range(3)]
    assert all(c is not None for c in claims) and ring.acquire_nowait() is None
    assert len({c.slot for c in claims if c}) == 3
    a, b, c = claims
    assert a is not None and b is not None and c is not None
    ring.release(a)
    again = ring.acquire_nowait()
    assert again is not None and again.slot == a.slot and again.ticket == a.ticket + 1
    assert not ring.begin(a), "a released claim must not reach its slot's new chunk"
    ring.release(a)  # stale: a no-op, the slot stays with ``again``
    assert ring.statistics().in_use == 3
    # abandoning a slot a worker is using leaves it to the worker's release
    assert ring.begin(b)
    ring.abandon(b)
    assert ring.statistics().in_use == 3
    ring.release(b)
    ring.abandon(c)  # nothing uses it: free at once
    s = ring.statistics()
    assert (s.in_use, s.most_in_use, s.claims, s.abandoned) == (1, 3, 4, 1)


async def test_ring_acquire_waits_for_a_slot_released_by_a_worker_thread() -> None:
    ring = StagingRing(slots=1, slot_bytes=4 * KIB)
    first = await ring.acquire()
    got: list[int] = []

    async def second() -> None:
        got.append((await ring.acquire()).slot)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.sleep(0.05)
        assert got == [] and ring.statistics().waits == 1
        threading.Thread(target=ring.release, args=(first,)).start()
    assert got == [first.slot]


def test_ring_slots_are_page_aligned_and_bounded() -> None:
    ring = StagingRing(slots=2, slot_bytes=8 * KIB, copier=HostCopier())
    claim = ring.acquire_nowait()
    assert claim is not None and claim.ptr % 4096 == 0 and len(claim.view) == 8 * KIB
    with pytest.raises(LocalProtocolError, match="do not fit"):
        ring.fit(16 * KIB)
    with pytest.raises(LocalProtocolError, match="slots must be"):
        StagingRing(slots=0)


# -- a landing, driven directly ------------------------------------------------------

def landing_of(slots: int, copier: Any = None
               ) -> tuple[Landing, dict[str, np.ndarray[Any, Any]], Any]:
    src = {"x": np.arange(10_000, dtype=np.float32), "y": np.arange(3_000, dtype=np.int64)}
    m = build_manifest(VersionKey("m", 1), list(src.items()), 4 * KIB, "xxh3-128")
    dst = {k: np.zeros_like(v) for k, v in src.items()}
    from tensorhub.device.buffers import place_of
    ring = StagingRing(slots=slots, slot_bytes=4 * KIB, copier=copier or HostCopier())
    return Landing(m, [place_of(dst[k], k) for k in m.table.names], ring), dst, src


class WholeChunkCopier(HostCopier):
    """Copies like a GPU copier does: the whole chunk, once it passed."""

    blockwise = False


@pytest.mark.parametrize("copier", [HostCopier(), WholeChunkCopier()],
                         ids=["block-by-block", "whole-chunk"])
def test_landing_checks_each_chunk_in_its_slot_and_places_only_what_passed(
        copier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # blocks of 1 KiB: a 4 KiB chunk is hashed and copied in four, one of them
    # across the end of tensor x
    monkeypatch.setattr(tensorhub.manifest.digests, "HASHED_BLOCK", KIB)
    landing, dst, src = landing_of(slots=4, copier=copier)
    m = landing.manifest
    flat = np.concatenate([src["x"].view(np.uint8), src["y"].view(np.uint8)])
    placed = np.concatenate  # what the tensors hold, as one byte string

    def verifier(c: int) -> Any:
        def verify(views: Any, each: Any = None) -> None:
            if digest_of("xxh3-128", views, each=each) != m.chunk_digests[c]:
                raise IntegrityError(f"chunk {c} bad", source="test")
        return verify

    assert landing.streams(8) == 1 and landing.window_cap(1) == 4 * m.chunk_size
    seam = src["x"].nbytes // m.chunk_size  # the chunk that spans both tensors
    for c in range(m.num_chunks):
        (slot,), check = landing.take(c, verifier(c))
        start, stop = m.chunk_range(c)
        slot[:] = flat[start:stop].tobytes()
        if c in (2, seam):
            slot[-1] ^= 0xFF  # bad bytes in the slot: refused
            with pytest.raises(IntegrityError):
                check([slot])
            landing.abandon(c)
            got = placed([dst["x"].view(np.uint8), dst["y"].view(np.uint8)])[start:stop]
            if not copier.blockwise:  # nothing of it placed
                assert not got.any()
            assert landing.ring.statistics().in_use == 0
            (slot,), check = landing.take(c, verifier(c))  # fetched again, over it
            slot[:] = flat[start:stop].tobytes()
        check([slot])
        landing.abandon(c)  # reported: a no-op, its check released the slot
        assert landing.ring.statistics().in_use == 0
    np.testing.assert_array_equal(dst["x"], src["x"])
    np.testing.assert_array_equal(dst["y"], src["y"])


def test_digest_of_hands_on_every_byte_once_in_order() -> None:
    block = tensorhub.manifest.digests.HASHED_BLOCK
    data = np.random.default_rng(3).integers(0, 255, 3 * block + 77, np.uint8)
    parts = [memoryview(data[:1000]), memoryview(data[1000:])]
    seen = bytearray()
    offsets: list[int] = []

    def each(offset: int, block: memoryview) -> None:
        offsets.append(offset)
        assert offset == len(seen)
        seen.extend(block)

    for algo in ("blake3", "sha256", "xxh3-128"):
        seen.clear()
        offsets.clear()
        assert digest_of(algo, parts, each=each) == digest_of(algo, [data.tobytes()])
        assert bytes(seen) == data.tobytes()
        assert offsets == [0, 1000, 1000 + block, 1000 + 2 * block]


def accept(views: Any, each: Any = None) -> None:
    """A check every chunk passes (it hashes, and hands each block on)."""
    digest_of("xxh3-128", views, each=each)


def test_landing_budget_follows_free_slots_and_spills_only_when_none_is_free() -> None:
    landing, dst, _ = landing_of(slots=4)
    chunk = landing.manifest.chunk_size
    assert landing.budget(1) == 4 * chunk
    for c in range(3):
        landing.take(c, accept)
    assert landing.budget(1) == chunk
    landing.take(3, accept)
    assert landing.ring.free_slots() == 0 and landing.overflows == 0
    (spill,), check = landing.take(4, accept)  # a stream's successor, early
    assert landing.overflows == 1 and len(spill) == chunk
    spill[:] = b"\x07" * chunk
    check([spill])  # placed like a slot's bytes
    assert (dst["x"].view(np.uint8)[4 * chunk:5 * chunk] == 7).all()
    landing.close()
    assert landing.ring.statistics().in_use == 0


# -- fetches through the ring, real peers over TCP --------------------------------------

async def test_a_torch_state_dict_lands_through_the_ring_over_tcp() -> None:
    async with open_mesh(2, transports=("tcp",)) as (pub, reader):
        src = state(1, mib=3)
        await published(pub, reader, "m", 1, src)
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        ptrs = {k: v.data_ptr() for k, v in dst.items()}
        ring = StagingRing(slots=4, slot_bytes=1 << 20)
        got = await reader.fetch("m", 1, into=ThroughRing(dst, ring))
        assert got.report.verified and got.report.transport_by_source == {"p0": "tcp"}
        for k, v in dst.items():
            assert v.data_ptr() == ptrs[k] and torch.equal(v, src[k]), k
        s = ring.statistics()
        assert s.most_in_use <= 4 and s.in_use == 0 and s.claims >= 3
        # the fetched copy is served from the tensors themselves
        assert reader.store.get(VersionKey("m", 1)).source is None  # type: ignore[union-attr]


async def test_bad_bytes_in_a_slot_are_refused_and_fetched_from_another_holder() -> None:
    async with open_mesh(3, planning=False, transports=("tcp",)) as (pub, liar, reader):
        src = state(2, mib=2)
        await published(pub, liar, "m", 1, src)
        await liar.fetch("m", 1)
        key = VersionKey("m", 1)
        await wait_until(lambda: len(complete_holders(reader, key)) >= 2,
                         what="the reader seeing the liar as a complete holder")
        corrupt_served(liar, 1 << 30)
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        ring = StagingRing(slots=4, slot_bytes=1 << 20)
        got = await reader.fetch("m", 1, into=ThroughRing(dst, ring))
        assert got.report.integrity_failures.get("p1", 0) >= 1
        assert all(torch.equal(dst[k], v) for k, v in src.items())
        assert ring.statistics().in_use == 0


async def test_bad_bytes_from_the_only_holder_end_in_a_clear_error() -> None:
    async with open_mesh(2, transports=("tcp",), stall_timeout=1.0) as (pub, reader):
        src = state(3)
        await published(pub, reader, "m", 1, src)
        corrupt_served(pub, 1 << 30)
        ring = StagingRing(slots=4, slot_bytes=1 << 20)
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        with pytest.raises(tensorhub.VersionUnavailable):
            await reader.fetch("m", 1, into=ThroughRing(dst, ring))
        assert ring.statistics().in_use == 0 and reader.store.versions == {}


async def test_a_cancelled_fetch_gives_every_slot_back() -> None:
    async with open_mesh(2, transports=("tcp",)) as (pub, reader):
        src = state(4, mib=4)
        await published(pub, reader, "m", 1, src)
        slow = slow_served(pub, 0.05)
        ring = StagingRing(slots=4, slot_bytes=1 << 20)
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        with trio.move_on_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader.fetch, "m", 1, ThroughRing(dst, ring))
                await wait_until(lambda: slow.served >= 2, what="two chunks served")
                assert ring.statistics().in_use > 0
                nursery.cancel_scope.cancel()
        s = ring.statistics()
        assert s.in_use == 0 and s.abandoned >= 1
        assert reader.store.versions == {}


async def test_a_mismatched_staged_into_is_refused_before_any_byte_moves() -> None:
    async with open_mesh(2, transports=("tcp",)) as (pub, reader):
        src = state(5)
        await published(pub, reader, "m", 1, src)
        ring = StagingRing(slots=4, slot_bytes=1 << 20)
        wrong = {k: torch.zeros_like(v) for k, v in src.items()}
        wrong["d"] = torch.zeros(5, 7, dtype=torch.float16)
        with pytest.raises(LocalProtocolError, match=r"into\['d'\] is float16"):
            await reader.fetch("m", 1, into=ThroughRing(wrong, ring))
        small = StagingRing(slots=4, slot_bytes=64 * KIB)
        with pytest.raises(LocalProtocolError, match="do not fit"):
            await reader.fetch("m", 1, into=ThroughRing(src, small))
        assert ring.statistics().claims == 0 and pub.statistics().bytes_served == 0


# -- device versions, with host memory posing as device memory ------------------------

def host_rings(peer: tensorhub.Peer) -> None:
    """The peer's rings (publish's and its reader's) copy host memory."""
    rings = DeviceRings(lambda device: HostCopier(), slots=8, slot_bytes=1 << 20)
    peer.device_rings = peer.reader.rings = rings


async def test_device_tensors_publish_and_fetch_through_rings_and_are_served_on() -> None:
    async with open_mesh(3, planning=False, transports=("tcp",)) as (pub, mid, end):
        for p in (pub, mid, end):
            host_rings(p)
        src = {"w": np.random.default_rng(6).standard_normal((700, 1000), np.float32),
               "b": np.arange(333, dtype=np.int64)}
        shown = {k: HostAsDevice(v) for k, v in src.items()}
        manifest = await pub.publish("m", 1, shown)
        held = pub.store.get(manifest.key)
        assert held is not None and held.source is not None
        assert held.arrays[0] is shown["w"]  # a reference, not a copy
        with trio.fail_after(10):
            await mid.wait_for_version("m", None)
        dst = {k: HostAsDevice(np.zeros_like(v)) for k, v in src.items()}
        got = await mid.fetch("m", 1, into=dst)
        assert got.report.verified and got.tensors["w"] is dst["w"]
        assert all(np.array_equal(dst[k].arr, v) for k, v in src.items())
        served = pub.device_rings.serve_cache(0).ring.statistics()
        assert served.claims >= manifest.num_chunks and served.most_in_use <= served.slots
        # the fetched device copy serves others, through mid's own ring
        key = VersionKey("m", 1)
        await wait_until(lambda: len(complete_holders(end, key)) >= 2,
                         what="the end seeing the middle as a complete holder")
        again = await end.fetch("m", 1, sources=["p1"])
        assert again.report.bytes_by_source == {"p1": manifest.total_bytes}
        assert all(np.array_equal(again.tensors[k], v) for k, v in src.items())
        # unpublished: its staged slots go back
        await pub.unpublish("m", 1)
        assert pub.device_rings.serve_cache(0).ring.statistics().in_use == 0


async def test_host_and_device_tensors_do_not_mix_in_one_version() -> None:
    async with tensorhub.open_peer(tensorhub.PeerConfig.local("solo")) as peer:
        host_rings(peer)
        with pytest.raises(LocalProtocolError, match="host memory, the others on a GPU"):
            await peer.publish("m", 1, {"a": HostAsDevice(np.zeros(4)), "b": np.zeros(4)})
        assert peer.store.versions == {}


# -- the serving cache, driven directly -------------------------------------------------

def source_of(cache: Any, seed: int) -> tuple[Any, np.ndarray[Any, Any]]:
    from tensorhub.device.buffers import place_of
    from tensorhub.device.serving import DeviceSource
    arr = np.random.default_rng(seed).integers(0, 255, 3 * 4096, np.uint8)
    m = build_manifest(VersionKey(f"m{seed}", 1), [("x", arr)], 4096, "xxh3-128")
    return DeviceSource(m, [place_of(arr, "x")], cache), arr


async def test_serving_cache_stages_ahead_evicts_the_oldest_and_frees_on_close() -> None:
    from tensorhub.device.serving import ServeCache
    cache = ServeCache(StagingRing(slots=2, slot_bytes=4096))
    a, arr_a = source_of(cache, 1)
    b, arr_b = source_of(cache, 2)
    from tensorhub.transport.base import NotServing
    with pytest.raises(NotServing), a.lease(0):  # not staged yet
        pass
    await a.stage(0)  # chunk 0, and chunk 1 ahead into the other slot
    await wait_until(lambda: len(cache.staged) >= 2, 5, what="chunk 1 staged ahead")
    with a.lease(0) as views:
        assert bytes(views[0]) == arr_a[:4096].tobytes()
        await b.stage(2)  # both slots staged: the oldest unleased one (a's chunk 1) goes
        with b.lease(2) as got:
            assert bytes(got[0]) == arr_b[8192:].tobytes()
        a.close()  # a's chunk 0 is being read: its slot waits for the lease to end
        assert cache.ring.statistics().in_use == 2
    b.close()
    assert cache.ring.statistics().in_use == 0 and not cache.staged


class FailingCopier(HostCopier):
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        raise OSError("copy failed")


async def test_a_failed_copy_from_the_gpu_answers_not_held() -> None:
    from tensorhub.device.serving import ServeCache
    from tensorhub.transport.base import NotServing
    cache = ServeCache(StagingRing(slots=2, slot_bytes=4096, copier=FailingCopier()))
    a, _ = source_of(cache, 3)
    with pytest.raises(NotServing, match="copy from the GPU failed"):
        await a.stage(2)
    assert cache.ring.statistics().in_use == 0
