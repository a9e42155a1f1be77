"""Device buffers: what TensorHub reads from torch, ``__cuda_array_interface__``, DLPack
and numpy (no CUDA needed), what it says without a GPU, and -- on a machine with one --
GPU tensors published and fetched through real peers (skipped here, with the reason)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch
import trio
from helpers import open_mesh
from test_staging import HostAsDevice

from tensorhub import LocalProtocolError
from tensorhub.device.buffers import is_device, layout_array, place_of
from tensorhub.device.copier import cuda_available
from tensorhub.device.landing import landing_places
from tensorhub.manifest.manifest import build_manifest
from tensorhub.model import VersionKey

NO_GPU = "needs cupy with a CUDA device (cupy.cuda.is_available() is False here)"


class DLPackOnGPU:
    """Says, through DLPack, that it lives on CUDA device 0."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        raise BufferError("not really on a GPU")


def test_host_tensors_are_read_in_place() -> None:
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    p = place_of(t, "t")
    assert (p.ptr, p.nbytes, p.dtype, p.shape) == (t.data_ptr(), 24, "bfloat16", (3, 4))
    assert not p.on_device and p.writable and not is_device(t)
    a = np.zeros((5, 2), np.int32)
    q = place_of(a, "a")
    assert (q.ptr, q.nbytes, q.dtype, q.on_device) == (a.ctypes.data, 40, "<i4", False)
    assert not is_device(a)
    with pytest.raises(LocalProtocolError, match="not contiguous"):
        place_of(t.t(), "t")


def test_cuda_array_interface_is_read_without_cuda() -> None:
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    dev = HostAsDevice(host)
    assert is_device(dev)
    p = place_of(dev, "d")
    assert (p.ptr, p.nbytes, p.dtype, p.shape) == (host.ctypes.data, 24, "<f4", (2, 3))
    assert p.on_device and p.writable and p.device == 0 and p.owner is dev
    strided = HostAsDevice(host)
    strided.__cuda_array_interface__["strides"] = (4, 8)
    with pytest.raises(LocalProtocolError, match="not C-contiguous"):
        place_of(strided, "s")
    ro = HostAsDevice(host)
    ro.__cuda_array_interface__["data"] = (host.ctypes.data, True)
    m = build_manifest(VersionKey("m", 1), [("ro", host)], 4096, "xxh3-128")
    with pytest.raises(LocalProtocolError, match="read-only"):
        landing_places(m, [place_of(ro, "ro")])
    with pytest.raises(LocalProtocolError, match=r"into\['ro'\] is int32"):
        landing_places(m, [place_of(HostAsDevice(host.view(np.int32)), "ro")])


def test_a_dlpack_gpu_exporter_needs_cupy_and_says_so(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    obj = DLPackOnGPU()
    assert is_device(obj)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ImportError
    with pytest.raises(LocalProtocolError, match="needs cupy"):
        place_of(obj, "x")


def test_layout_arrays_describe_device_tensors_in_one_element() -> None:
    p = place_of(HostAsDevice(np.zeros((1000, 1000), np.float32)), "w")
    arr = layout_array(p)
    assert arr.shape == (1000, 1000) and arr.nbytes == 4_000_000 and arr.strides == (0, 0)


@pytest.mark.skipif(cuda_available(), reason="checks the message shown without a GPU")
async def test_without_a_gpu_device_tensors_get_a_clear_error() -> None:
    async with open_mesh(2, transports=("tcp",)) as (pub, reader):
        with pytest.raises(LocalProtocolError, match="cupy with a working CUDA driver"):
            await pub.publish("m", 1, {"x": HostAsDevice(np.zeros(1024, np.float32))})
        assert pub.store.versions == {}
        await pub.publish("m", 1, {"x": np.ones(1024, np.float32)})
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        with pytest.raises(LocalProtocolError, match="cupy with a working CUDA driver"):
            await reader.fetch("m", 1, into={"x": HostAsDevice(np.zeros(1024, np.float32))})
        assert reader.store.versions == {}


# -- on a GPU ----------------------------------------------------------------------------

@pytest.mark.skipif(not cuda_available(), reason=NO_GPU)
async def test_cupy_arrays_publish_and_land_in_cupy_arrays_over_tcp() -> None:
    import cupy
    async with open_mesh(2, transports=("tcp",)) as (pub, reader):
        src = {"w": cupy.arange(3 << 18, dtype=cupy.float32).reshape(768, 1024),
               "b": cupy.arange(77, dtype=cupy.int64)}
        await pub.publish("m", 1, src)
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        dst = {k: cupy.zeros_like(v) for k, v in src.items()}
        got = await reader.fetch("m", 1, into=dst)
        assert got.report.verified and got.tensors["w"] is dst["w"]
        assert all(bool(cupy.array_equal(dst[k], v)) for k, v in src.items())


@pytest.mark.skipif(not cuda_available() or not torch.cuda.is_available(), reason=NO_GPU +
                    " and torch with CUDA")
async def test_torch_cuda_tensors_publish_and_land_in_torch_cuda_tensors() -> None:
    async with open_mesh(2, transports=("tcp",)) as (pub, reader):
        src = {"w": torch.randn(512, 1024, device="cuda").to(torch.bfloat16)}
        await pub.publish("m", 1, src)
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        dst = {"w": torch.zeros_like(src["w"])}
        await reader.fetch("m", 1, into=dst)
        assert torch.equal(dst["w"], src["w"])


@pytest.mark.skipif(not cuda_available(), reason=NO_GPU)
async def test_cupy_arrays_are_read_over_cuda_ipc_in_place() -> None:
    """Two peers of one host: the holder grants its GPU arrays themselves (its staging
    ring copies nothing for the reader); the reader copies them device to device into
    its GPU arrays and checks them there (device digests)."""
    import cupy
    async with open_mesh(2, transports=("cuda-ipc", "tcp"), labels=(("host", "gpu"),),
                         chunk_size=1 << 20, planning=False) as (pub, reader):
        src = {"w": cupy.arange(3 << 20, dtype=cupy.float32),
               "b": cupy.arange(1001, dtype=cupy.int16)}
        manifest = await pub.publish("m", 1, src)
        staged = pub.device_rings.serve_cache(0).ring.statistics().claims
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        dst = {k: cupy.zeros_like(v) for k, v in src.items()}
        got = await reader.fetch("m", 1, into=dst)
        assert got.report.verified and manifest.num_chunks > 4
        assert got.report.transport_by_source == {"p0": "cuda-ipc"}
        assert got.report.device_digest_chunks == manifest.num_chunks  # landed in place
        assert all(bool(cupy.array_equal(dst[k], v)) for k, v in src.items())
        assert pub.device_rings.serve_cache(0).ring.statistics().claims == staged
