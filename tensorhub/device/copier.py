"""The copies between staging-ring slots and tensors.

A :class:`Copier` allocates slot memory and copies ``n`` bytes between two addresses,
returning once the bytes are in place (the slot is then free to reuse).  Copies run in
worker threads, never on the event loop:

- :class:`HostCopier` -- host memory on both sides (a CPU tensor staged through the
  ring): ``memmove``, which releases the GIL; slots are page-aligned numpy buffers.
- :class:`CudaCopier` -- a GPU on one side: slots are page-locked (``cudaHostAlloc``
  through cupy's pinned allocator), each copy is a ``cudaMemcpyAsync`` on the calling
  thread's own non-blocking CUDA stream, waited for on that stream only, so copies from
  several threads overlap each other and the network.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Protocol

import numpy as np

from ..errors import LocalProtocolError

PAGE = 4096
_CUDA_MEMCPY_DEFAULT = 4
"""``cudaMemcpyDefault``: the direction follows from the addresses (unified addressing)."""


class Copier(Protocol):
    name: str
    blockwise: bool
    """Whether a chunk is best copied block by block as it is hashed (host memory:
    each block is copied from the cache) rather than whole once it passed."""

    def alloc(self, nbytes: int) -> tuple[np.ndarray[Any, Any], Any]:
        """``nbytes`` of slot memory as a uint8 array, and the object that owns it."""
        ...

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` to ``dst``; return once they are there."""
        ...

    def synchronize(self) -> None:
        """Return once work queued on the device (the caller's writes) is done."""
        ...


class HostCopier:
    name = "host"
    blockwise = True

    def alloc(self, nbytes: int) -> tuple[np.ndarray[Any, Any], Any]:
        raw = np.empty(nbytes + PAGE, np.uint8)
        skip = -int(raw.ctypes.data) % PAGE
        slot = raw[skip:skip + nbytes]
        slot[::PAGE] = 0  # pre-fault: memory touched first copies at a fraction of speed
        return slot, raw

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def synchronize(self) -> None:
        pass


class CudaCopier:
    name = "cuda"
    blockwise = False

    def __init__(self, device: int = 0) -> None:
        import cupy
        self._cupy = cupy
        self.device = device
        self._local = threading.local()

    def alloc(self, nbytes: int) -> tuple[np.ndarray[Any, Any], Any]:
        with self._cupy.cuda.Device(self.device):
            mem = self._cupy.cuda.alloc_pinned_memory(nbytes)
        slot = np.frombuffer(mem, np.uint8, nbytes)
        slot[::PAGE] = 0
        return slot, mem

    def _stream(self) -> Any:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            with self._cupy.cuda.Device(self.device):
                stream = self._local.stream = self._cupy.cuda.Stream(non_blocking=True)
        return stream

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        stream = self._stream()
        with self._cupy.cuda.Device(self.device):
            self._cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT,
                                                stream.ptr)
            stream.synchronize()

    def synchronize(self) -> None:
        with self._cupy.cuda.Device(self.device):
            self._cupy.cuda.Device().synchronize()


def cuda_available() -> bool:
    """Whether cupy is installed and sees a CUDA device (False without a driver)."""
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # cupy missing, or present without a driver or a library
        return False


def copier_for(on_device: bool, device: int = 0) -> Copier:
    """The copier for tensors on the host (``on_device`` False) or on GPU ``device``."""
    if not on_device:
        return HostCopier()
    if not cuda_available():
        raise LocalProtocolError("device tensors need cupy with a working CUDA driver "
                                 "(pip install cupy-cuda12x); cupy.cuda.is_available() "
                                 "is False here")
    return CudaCopier(device)
