"""What a tensor is in memory: :class:`Place`, from torch, cupy, DLPack or numpy.

A :class:`Place` is an address, a size, a dtype (the manifest's name) and a shape, on the
host or on a GPU, plus the object that owns the memory (kept alive with it).  GPU memory
is read from a CUDA torch tensor (``data_ptr``), from ``__cuda_array_interface__``
(cupy, numba, ...) or from a DLPack capsule on a CUDA device (through cupy); host
memory from what :func:`tensorhub.model.as_host_array` takes.  Nothing here copies or
calls CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import LocalProtocolError
from ..model import as_host_array
from ..torch import dtype_of, is_tensor

if TYPE_CHECKING:
    from ..manifest.manifest import Manifest

_DLPACK_CUDA = (2, 13)
"""DLPack device types of CUDA memory: kDLCUDA, kDLCUDAManaged."""


@dataclass(frozen=True)
class Place:
    """One tensor's memory: ``nbytes`` at ``ptr``, C-contiguous."""

    ptr: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    on_device: bool
    writable: bool
    device: int
    """The CUDA device index (0 for host memory)."""
    owner: Any
    """The object owning the memory (the caller's tensor, or a view of it)."""


def is_device(obj: Any) -> bool:
    """Whether ``obj`` lives in GPU memory (a CUDA torch tensor, an object with
    ``__cuda_array_interface__``, or a DLPack exporter on a CUDA device)."""
    if is_tensor(obj):
        return bool(obj.device.type == "cuda")
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    device = getattr(obj, "__dlpack_device__", None)
    if device is None or isinstance(obj, np.ndarray):
        return False
    try:
        return int(device()[0]) in _DLPACK_CUDA
    except (TypeError, ValueError, IndexError):
        return False


def place_of(obj: Any, name: str) -> Place:
    """The memory of ``obj`` (see the module doc); a clear error for memory TensorHub
    cannot use in place (strided, read-only, an unknown dtype)."""
    if is_tensor(obj):
        return _torch_place(obj, name)
    if hasattr(obj, "__cuda_array_interface__"):
        return _cai_place(obj, obj.__cuda_array_interface__, name)
    if is_device(obj):  # DLPack on a GPU: cupy reads it
        try:
            import cupy
        except ImportError:
            raise LocalProtocolError(
                f"tensor {name!r} is DLPack device memory; reading it needs cupy "
                "(pip install cupy-cuda12x)") from None
        arr = cupy.from_dlpack(obj)
        return _cai_place(arr, arr.__cuda_array_interface__, name)
    host = as_host_array(obj, name)
    return Place(int(host.ctypes.data), host.nbytes, _host_dtype(host), host.shape, False,
                 bool(host.flags.writeable), 0, host)


def _host_dtype(arr: np.ndarray[Any, Any]) -> str:
    from ..dtypes import dtype_name
    return dtype_name(arr.dtype) or arr.dtype.str


def _torch_place(t: Any, name: str) -> Place:
    if not t.is_contiguous():
        raise LocalProtocolError(f"tensor {name!r} is not contiguous; TensorHub uses it in "
                                 "place and will not copy it (pass t.contiguous())")
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    return Place(int(t.data_ptr()), nbytes, dtype_of(t), tuple(t.shape),
                 t.device.type == "cuda", True, t.device.index or 0, t)


def _cai_place(obj: Any, iface: Any, name: str) -> Place:
    """``__cuda_array_interface__`` (version 2 or 3): data, shape, typestr, strides."""
    try:
        ptr, readonly = iface["data"]
        shape = tuple(int(s) for s in iface["shape"])
        dtype = np.dtype(iface["typestr"])
        strides = iface.get("strides")
    except (KeyError, TypeError, ValueError) as exc:
        raise LocalProtocolError(f"tensor {name!r}: bad __cuda_array_interface__ ({exc})") \
            from None
    if strides is not None:
        want, step = [], dtype.itemsize
        for dim in reversed(shape):
            want.append(step)
            step *= dim
        if tuple(strides) != tuple(reversed(want)) and int(np.prod(shape)) > 1:
            raise LocalProtocolError(f"tensor {name!r} is not C-contiguous; TensorHub uses "
                                     "it in place (pass cupy.ascontiguousarray(x))")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return Place(int(ptr or 0), nbytes, dtype.str, shape, True, not readonly, _device_id(obj), obj)


def _device_id(obj: Any) -> int:
    """The CUDA device of an array with ``__cuda_array_interface__`` (cupy says it)."""
    device = getattr(obj, "device", None)
    return int(getattr(device, "id", 0) or 0)


def layout_array(place: Place) -> np.ndarray[Any, Any]:
    """A host array with ``place``'s dtype, shape and ``nbytes`` that owns one element
    (a broadcast view), for building a manifest of memory the host cannot read."""
    from ..dtypes import storage_dtype
    return np.broadcast_to(np.zeros((), storage_dtype(place.dtype)), place.shape)


class DeviceBytes:
    """``nbytes`` of device memory at ``ptr`` as a flat byte array
    (``__cuda_array_interface__``), for a one-sided backend that reads device memory in
    place (CUDA IPC).  ``base``: the :class:`DeviceBytes` of the whole tensor a piece
    lies in (None for a whole one), which a backend registers once."""

    __slots__ = ("__weakref__", "base", "device", "nbytes", "owner", "ptr")
    readonly = False

    def __init__(self, ptr: int, nbytes: int, device: int, owner: Any,
                 base: DeviceBytes | None = None) -> None:
        self.ptr, self.nbytes, self.device, self.owner, self.base = (
            ptr, nbytes, device, owner, base)

    @classmethod
    def of(cls, place: Place) -> DeviceBytes:
        return cls(place.ptr, place.nbytes, place.device, place.owner)

    def piece(self, start: int, stop: int) -> DeviceBytes:
        """Bytes ``[start, stop)`` of this tensor."""
        if not 0 <= start <= stop <= self.nbytes:
            raise ValueError(f"bytes {start}..{stop} outside a tensor of {self.nbytes}")
        return DeviceBytes(self.ptr + start, stop - start, self.device, self.owner, self)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"data": (self.ptr, False), "shape": (self.nbytes,), "typestr": "|u1",
                "strides": None, "version": 3}


class DeviceChunks:
    """The chunks of a version as pieces of its tensors in device memory, for a backend
    that reads or writes them in place (each tensor's :class:`DeviceBytes` is made once,
    so the backend registers it once)."""

    def __init__(self, manifest: Manifest, places: Sequence[Place]) -> None:
        self.manifest = manifest
        self.wholes = [DeviceBytes.of(p) for p in places]

    def pieces(self, chunk: int) -> list[DeviceBytes]:
        start, stop = self.manifest.chunk_range(chunk)
        return [self.wholes[seg.index].piece(seg.start, seg.stop)
                for seg in self.manifest.segments(start, stop) if seg.stop > seg.start]
