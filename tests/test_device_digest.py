"""``dsum-128``, the digest computed where the bytes are (:mod:`tensorhub.device.digest`):
its definition on the host, its place in the manifest (built on the device at publish,
range-checked on decode), a fetch that lands chunks in place over CUDA IPC and checks
them there -- here over the stand-in with host memory posing as device memory -- and,
on a machine with a GPU, the kernel against the host reference."""

from __future__ import annotations

import itertools
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
from helpers import open_mesh
from hypothesis import given, settings
from hypothesis import strategies as st
from test_staging import HostAsDevice, host_rings

import tensorhub
from tensorhub import Manifest, RemoteProtocolError, VersionKey
from tensorhub.device.copier import cuda_available
from tensorhub.device.digest import host_dsum
from tensorhub.manifest.manifest import build_manifest

HOST = (("host", "h1"),)


def extents(buf: np.ndarray[Any, Any], cuts: list[int]) -> list[tuple[int, int]]:
    """``buf`` (uint8) as pieces cut at ``cuts``."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(buf))), len(buf)]
    base = int(buf.ctypes.data)
    return [(base + a, b - a) for a, b in itertools.pairwise(bounds)]


def reference(data: bytes) -> bytes:
    """The definition, one byte at a time, in Python integers."""
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)
    s1 = s2 = 0
    for i, b in enumerate(data):
        x = (b << 56) ^ (i + 1)
        s1 = (s1 + mix(x)) % 2**64
        s2 = (s2 + mix(x ^ 0x9E3779B97F4A7C15)) % 2**64
    return s1.to_bytes(8, "little") + s2.to_bytes(8, "little")


@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=5))
@settings(max_examples=200)
def test_host_dsum_is_the_definition_whatever_the_pieces(data: bytes, cuts: list[int]
                                                         ) -> None:
    buf = np.frombuffer(bytearray(data), np.uint8)
    assert host_dsum(extents(buf, cuts)) == reference(data)
    assert host_dsum(extents(buf, [])) == host_dsum(extents(buf, cuts))


@given(st.binary(min_size=2, max_size=2000), st.data())
@settings(max_examples=200)
def test_a_changed_or_swapped_byte_changes_the_digest(data: bytes, draw: st.DataObject
                                                      ) -> None:
    buf = np.frombuffer(bytearray(data), np.uint8)
    before = host_dsum(extents(buf, []))
    i = draw.draw(st.integers(0, len(data) - 1))
    changed = bytearray(data)
    changed[i] ^= draw.draw(st.integers(1, 255))
    assert host_dsum(extents(np.frombuffer(changed, np.uint8), [])) != before
    j = draw.draw(st.integers(0, len(data) - 1))
    swapped = bytearray(data)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    same = swapped == bytearray(data)
    assert (host_dsum(extents(np.frombuffer(swapped, np.uint8), [])) == before) == same


def test_large_chunks_are_hashed_in_blocks_with_the_same_result() -> None:
    buf = np.random.default_rng(1).integers(0, 256, (3 << 20) + 5, np.uint8)
    whole = host_dsum(extents(buf, []))
    assert whole == host_dsum(extents(buf, [1, 1 << 20, (2 << 20) + 3]))
    flipped = buf.copy()
    flipped[(2 << 20) + 1] ^= 1
    assert host_dsum(extents(flipped, [])) != whole


# -- in the manifest -----------------------------------------------------------------

def test_device_digests_are_one_per_chunk_and_travel_signed() -> None:
    data = np.random.default_rng(2).standard_normal(5000).astype(np.float32)
    m = build_manifest(VersionKey("m", 1), [("w", data)], 4096, "blake3",
                       on_device=lambda sk: [host_dsum([(int(data.ctypes.data) + a, b - a)])
                                             for a, b in map(sk.chunk_range,
                                                             range(sk.num_chunks))])
    raw = np.frombuffer(data.tobytes(), np.uint8)
    assert m.device_digests == tuple(reference(raw[i:i + 4096].tobytes())
                                     for i in range(0, raw.size, 4096))
    back = Manifest.decode(m.encode(), expected_id=m.manifest_id())
    assert back == m and back.device_digests == m.device_digests
    plain = build_manifest(VersionKey("m", 1), [("w", data)], 4096, "blake3")
    assert plain.device_digests == () and "device_digests" not in plain.to_wire()
    assert plain.manifest_id() != m.manifest_id()  # part of what is signed


@given(st.one_of(st.binary(max_size=80), st.integers(-2**63, 2**64 - 1), st.text(max_size=8),
                 st.none(), st.lists(st.binary(max_size=16), max_size=4)))
@settings(max_examples=300)
def test_any_device_digests_are_refused_or_one_per_chunk(value: object) -> None:
    m = build_manifest(VersionKey("m", 1), [("w", np.ones(2048, np.float32))], 4096,
                       "blake3")
    wire = m.to_wire()
    wire["device_digests"] = value
    try:
        back = Manifest.decode(msgpack.packb(wire, use_bin_type=True))
    except RemoteProtocolError as exc:
        assert "device digests" in str(exc)
        return
    assert len(back.device_digests) == back.num_chunks == 2
    assert all(len(d) == 16 for d in back.device_digests)


# -- a fetch that lands in place -------------------------------------------------------

async def test_a_version_changed_after_publish_fails_the_in_place_check() -> None:
    """The trainer writes its tensors after publishing: the reader lands the changed
    chunk in place, its device digest fails, and the fetch never counts it."""
    async with open_mesh(2, transports=("cuda-ipc-standin", "tcp"), labels=HOST,
                         chunk_size=1 << 16, planning=False, stall_timeout=1.0) as (pub, reader):
        for p in (pub, reader):
            host_rings(p)
        w = np.random.default_rng(4).standard_normal(1 << 16).astype(np.float32)
        manifest = await pub.publish("m", 1, {"w": HostAsDevice(w)})
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        w[60_000] += 1.0  # in the last of 4 chunks of 64 KiB
        dst = {"w": HostAsDevice(np.zeros_like(w))}
        with pytest.raises((tensorhub.IntegrityError, tensorhub.VersionUnavailable)) as info:
            await reader.fetch("m", 1, into=dst)
        print(info.value)
        assert "failed its device digest" in str(info.value)
        assert manifest.num_chunks == 4 and reader.store.get(manifest.key) is None
        assert reader.statistics().integrity_failures.get("p0", 0) >= 1


@pytest.mark.skipif(not cuda_available(), reason="needs cupy with a CUDA device")
def test_the_gpu_kernel_computes_the_host_reference() -> None:
    import cupy

    from tensorhub.device.digest import GpuDsum
    rng = np.random.default_rng(9)
    kernel = GpuDsum(0)
    for n, cuts in [(1, []), (1000, [3, 500]), ((4 << 20) + 7, [1, 1 << 20, (3 << 20) + 5])]:
        host = rng.integers(0, 256, n, np.uint8)
        dev = cupy.asarray(host)
        ptr = int(dev.data.ptr)
        pieces = [(ptr + a - int(host.ctypes.data), k) for a, k in extents(host, cuts)]
        assert kernel(pieces) == host_dsum(extents(host, cuts)), n
