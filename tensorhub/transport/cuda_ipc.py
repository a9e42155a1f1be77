"""CUDA IPC with cupy: the real backend of the ``cuda-ipc`` transport.

Two processes on one host (one GPU or two with peer access): the holder exports a CUDA
IPC memory handle of each device buffer it serves (``cudaIpcGetMemHandle``), the reader
opens it once (``cudaIpcOpenMemHandle``, kept open while the connection lives) and copies
with ``cudaMemcpyAsync`` on its own stream to wherever the fetch lands the chunk (a fetch
into GPU tensors lands each chunk in a pinned slot of its staging ring, to check its
digest on the host, then copies it to its place); no byte crosses a socket.  cupy is imported only
when a peer names ``cuda-ipc`` in ``PeerConfig.transports`` (``pip install
cupy-cuda12x``); the transport is usable only where ``cupy.cuda.is_available()``.

Against :class:`~tensorhub.transport.onesided.backend.Backend`: a region's key is its
memory handle and the allocation's base address (the handle names the whole
allocation; the reader adds the offset); ``revoke`` stops granting the handle.  CUDA
cannot take back a handle a reader has opened, so for CUDA IPC the lease, the drain and
the reader's check of the connection after each copy (as for shared memory) are what
keep a reader from using bytes of an unpublished version -- not the key.

Only device memory is served: a version held in device memory is granted as its tensors
themselves (not the host copies its staging ring makes for other transports); a holder
whose chunk lies in host memory refuses the grant (the reader then uses ``shm``).
Tested on every run through its stand-in; ``docs/transports.md`` says what ran on a GPU.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import struct
from contextlib import suppress
from typing import Any

from ..errors import TransportError
from .onesided.backend import Link, Region
from .onesided.registry import extent

_ENDPOINT = struct.Struct("<II")  # pid, device
_BASE = struct.Struct("<Q")
_HANDLE = 64
_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)


def probe() -> tuple[Any, str]:
    """``(factory, what was found)``, or ``(None, why not)``."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        return None, "cupy not installed (pip install cupy-cuda12x)"
    try:
        if not cupy.cuda.is_available():
            return None, "cupy: no CUDA driver or device"
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"cupy: {exc}"
    return (lambda: CudaIpcBackend(cupy)), f"CUDA: {count} device(s)"


class CudaIpcBackend:
    """See the module docstring."""

    name = "cuda-ipc"
    same_host = True
    depth = 8
    device_memory = True

    def __init__(self, cupy: Any) -> None:
        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self.device = int(cupy.cuda.Device().id)

    def register(self, memory: Any) -> Region:
        addr, length = extent(memory)
        return Region(addr, length, "host" if isinstance(memory, memoryview) else "device")

    def deregister(self, region: Region) -> None:
        region.key = b""

    def grant(self, region: Region) -> None:
        if region.handle != "device":
            raise TransportError("CUDA IPC exports device memory only; host memory is "
                                 "served by shm")
        base = self._base(region.addr)
        region.key = bytes(self._rt.ipcGetMemHandle(base)) + _BASE.pack(base)

    def _base(self, addr: int) -> int:
        """The start of the allocation ``addr`` lies in (an IPC handle names that: a
        tensor of a caching allocator lies inside a larger allocation)."""
        try:
            driver = importlib.import_module("cupy.cuda.driver")
            return int(driver.memGetAddressRange(addr)[0])
        except (AttributeError, ImportError):  # a cupy without it: ask the driver
            return _address_range_base(addr)

    def revoke(self, region: Region) -> None:
        region.key = b""

    def dial(self) -> _Dialing:
        return _Dialing(self)

    def accept(self, endpoint: bytes) -> tuple[Link, bytes]:
        if len(endpoint) != _ENDPOINT.size:
            raise ValueError("malformed CUDA IPC endpoint")
        return _HolderEnd(), _ENDPOINT.pack(os.getpid(), self.device)


def _address_range_base(addr: int) -> int:
    """``cuMemGetAddressRange``'s base of ``addr``, through the driver library."""
    lib = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                         ctypes.c_uint64(addr))
    if status != 0:
        raise TransportError(f"cuda-ipc: cuMemGetAddressRange failed ({status}) for "
                             f"{addr:#x}")
    return int(base.value)


class _HolderEnd:
    """The holder's end posts nothing: the reader's GPU reads."""

    def post_read(self, wr_id: int, local: Region, local_addr: int, remote_addr: int,
                  key: bytes, length: int) -> None:
        raise TransportError("a holder's end posts no reads")

    def poll(self, timeout: float) -> list[tuple[int, str | None]]:
        return []

    def close(self) -> None:
        pass


class _Dialing:
    def __init__(self, backend: CudaIpcBackend) -> None:
        self.backend = backend
        self.endpoint = _ENDPOINT.pack(os.getpid(), backend.device)

    def connect(self, holder_endpoint: bytes) -> Link:
        if len(holder_endpoint) != _ENDPOINT.size:
            raise TransportError("malformed CUDA IPC endpoint from the holder")
        pid, _device = _ENDPOINT.unpack(holder_endpoint)
        return _CopyLink(self.backend, same_process=pid == os.getpid())

    def close(self) -> None:
        pass


class _CopyLink:
    """Copies on one stream; a poll waits for all of them.  A holder in this very
    process (CUDA refuses to open a handle where it was made) is read at its own
    addresses."""

    def __init__(self, backend: CudaIpcBackend, same_process: bool) -> None:
        self.backend = backend
        self.same_process = same_process
        self.stream = backend._cp.cuda.Stream(non_blocking=True)
        self._opened: dict[bytes, int] = {}
        self._posted: list[int] = []
        self._failed: dict[int, str] = {}

    def _open(self, key: bytes) -> int:
        ptr = self._opened.get(key)
        if ptr is None and self.same_process:
            return int(_BASE.unpack(key[_HANDLE:])[0])
        if ptr is None:
            ptr = int(self.backend._rt.ipcOpenMemHandle(key[:_HANDLE]))
            self._opened[key] = ptr
        return ptr

    def post_read(self, wr_id: int, local: Region, local_addr: int, remote_addr: int,
                  key: bytes, length: int) -> None:
        if len(key) != _HANDLE + _BASE.size:
            raise TransportError("cuda-ipc: a granted key is not a memory handle")
        (base,) = _BASE.unpack(key[_HANDLE:])
        try:
            src = self._open(key) + remote_addr - base
            self.backend._rt.memcpyAsync(local_addr, src, length, _DEFAULT, self.stream.ptr)
        except Exception as exc:
            self._failed[wr_id] = f"cuda-ipc: {exc}"
        self._posted.append(wr_id)

    def poll(self, timeout: float) -> list[tuple[int, str | None]]:
        try:
            self.stream.synchronize()
            error = None
        except Exception as exc:
            error = f"cuda-ipc: {exc}"
        done, self._posted = self._posted, []
        out = [(w, self._failed.pop(w, error)) for w in done]
        return out

    def close(self) -> None:
        for ptr in self._opened.values():
            with suppress(Exception):  # the context may be gone at exit
                self.backend._rt.ipcCloseMemHandle(ptr)
        self._opened.clear()
