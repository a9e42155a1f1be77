"""A chunk digest computed where the bytes are: on the GPU (a CUDA kernel through
cupy) or, for host memory, with numpy -- the same function either way.

``dsum-128`` of a chunk's bytes ``b[0..n)`` (its pieces laid end to end): with
``x_i = (b_i << 56) ^ (i + 1)`` and ``mix`` the splitmix64 finalizer (a bijection of
64-bit words), the two little-endian 64-bit sums ``sum(mix(x_i))`` and
``sum(mix(x_i ^ 0x9E3779B97F4A7C15))`` modulo 2**64.  Every byte's term depends on its
value and its place, so a changed, moved, missing or stale byte changes the sums
(two changes cancel with probability about 2**-64 per lane); the sums are cheap to
compute in parallel, so a GPU checks a chunk at memory speed.  It is **not**
cryptographic: a holder that wants to can forge it.  A reader uses it only as it uses
:data:`~tensorhub.manifest.digests.LOCAL_ALGO` -- against a holder on its own host that could
write its memory anyway (:attr:`~tensorhub.manifest.manifest.Manifest.device_digests`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_BLOCK = 1 << 20
"""Bytes hashed at once on the host (bounds the temporaries: 8 bytes per byte)."""

Extents = Sequence[tuple[int, int]]
"""A chunk as ``(address, nbytes)`` pieces, laid end to end."""


def _mix(z: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray[Any, Any] = z ^ (z >> np.uint64(31))
    return out


def host_dsum(pieces: Extents) -> bytes:
    """``dsum-128`` of pieces in host memory (numpy; the reference)."""
    s1 = s2 = np.uint64(0)
    pos = 0
    with np.errstate(over="ignore"):
        for addr, nbytes in pieces:
            if not nbytes:
                continue
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
            for at in range(0, nbytes, _BLOCK):
                b = raw[at:at + _BLOCK].astype(np.uint64)
                x = (b << np.uint64(56)) ^ np.arange(pos + at + 1, pos + at + 1 + len(b),
                                                     dtype=np.uint64)
                s1 += _mix(x).sum(dtype=np.uint64)
                s2 += _mix(x ^ _GOLDEN).sum(dtype=np.uint64)
            pos += nbytes
    return int(s1).to_bytes(8, "little") + int(s2).to_bytes(8, "little")


_KERNEL = r"""
__device__ __forceinline__ unsigned long long mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

extern "C" __global__ void dsum(const unsigned char* p, unsigned long long n,
                                unsigned long long pos, unsigned long long* out) {
    unsigned long long s1 = 0, s2 = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        unsigned long long x = ((unsigned long long)p[i] << 56) ^ (pos + i + 1);
        s1 += mix(x);
        s2 += mix(x ^ 0x9e3779b97f4a7c15ULL);
    }
    for (int off = 16; off > 0; off >>= 1) {
        s1 += __shfl_down_sync(0xffffffffu, s1, off);
        s2 += __shfl_down_sync(0xffffffffu, s2, off);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(out, s1);
        atomicAdd(out + 1, s2);
    }
}
"""
_THREADS = 256
_MAX_BLOCKS = 2048


class GpuDsum:
    """``dsum-128`` of pieces in the memory of GPU ``device`` (a cupy kernel, compiled
    on first use; each calling thread launches on a stream of its own)."""

    def __init__(self, device: int = 0) -> None:
        import cupy
        self._cupy = cupy
        self.device = device
        self._kernel: Any = None
        self._local = threading.local()
        self._lock = threading.Lock()

    def __call__(self, pieces: Extents) -> bytes:
        cp = self._cupy
        with cp.cuda.Device(self.device):
            if self._kernel is None:
                with self._lock:
                    if self._kernel is None:
                        self._kernel = cp.RawKernel(_KERNEL, "dsum")
            stream = getattr(self._local, "stream", None)
            if stream is None:
                stream = self._local.stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                out = cp.zeros(2, cp.uint64)
                pos = 0
                for addr, nbytes in pieces:
                    if nbytes:
                        blocks = min(_MAX_BLOCKS, -(-nbytes // (_THREADS * 16)))
                        self._kernel((blocks,), (_THREADS,),
                                     (np.uint64(addr), np.uint64(nbytes), np.uint64(pos),
                                      out))
                        pos += nbytes
                sums = out.get(stream=stream)
        return int(sums[0]).to_bytes(8, "little") + int(sums[1]).to_bytes(8, "little")


@functools.cache
def dsum_for(copier_name: str, device: int) -> Callable[[Extents], bytes]:
    """The ``dsum-128`` of memory a copier named ``copier_name`` reaches: the GPU
    kernel for ``"cuda"``, numpy for host memory (tests pose it as device memory)."""
    return GpuDsum(device) if copier_name == "cuda" else host_dsum
