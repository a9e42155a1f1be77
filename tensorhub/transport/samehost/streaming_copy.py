"""Streaming memory copies: copy large buffers with non-temporal stores.

A same-host reader copies gigabytes from the holder's memory files into its own arrays,
and nothing reads the destination again soon except the digest check.  An ordinary copy
(``memcpy`` below glibc's non-temporal threshold, which is about three quarters of the
last-level cache and so hundreds of MiB on hosts with a large one) first reads every
destination line into the cache and later writes it back: a third more memory traffic
than a streaming copy, whose stores bypass the cache.  Measured on a 2-core host with a
480 MiB L3, 1 GiB in 4 MiB pieces: 0.152 s with ``numpy.copyto``, 0.084 s streaming; with
two threads 0.090 s and 0.053 s; copy plus an xxh3 digest of each piece, two threads,
0.135 s and 0.095 s.

Neither numpy nor the standard library has such a copy, so on Linux x86-64 this module
puts a small SSE2 routine (every x86-64 CPU has SSE2; listing: :func:`assembly`) into an
executable page of its own and calls it through ``ctypes``, which releases the GIL for
the call.  It copies 16 KiB blocks four pages at a time (four read streams keep more
memory reads in flight) to a 64-byte aligned destination; :func:`stream_copy_all` copies
the unaligned head and the tail with ``memmove``.  The routine checks itself on first use
and is not used where it cannot be loaded (another platform, a kernel or security policy
that refuses executable anonymous pages) or where ``TENSORHUB_STREAM_COPY=0``:
:func:`stream_copy_all` then copies with ``memmove``.  :func:`status` says which.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

BLOCK = 16384
"""The routine copies whole blocks of four 4 KiB pages."""

MIN_BYTES = 256 << 10
"""Smaller copies use ``numpy.copyto``: they fit in the cache, where cached stores win."""

CODE = bytes.fromhex(
    "b9400000000f188e004000000f188e005000000f188e006000000f188e00700000f30f6f06f30f6f4e10"
    "f30f6f5620f30f6f5e30f30f6fa600100000f30f6fae10100000f30f6fb620100000f30f6fbe30100000"
    "f3440f6f8600200000f3440f6f8e10200000f3440f6f9620200000f3440f6f9e30200000f3440f6fa600"
    "300000f3440f6fae10300000f3440f6fb620300000f3440f6fbe30300000660fe707660fe74f10660fe7"
    "5720660fe75f30660fe7a700100000660fe7af10100000660fe7b720100000660fe7bf3010000066440f"
    "e7870020000066440fe78f1020000066440fe7972020000066440fe79f3020000066440fe7a700300000"
    "66440fe7af1030000066440fe7b72030000066440fe7bf303000004883c6404883c740ffc90f85defeff"
    "ff4881c6003000004881c7003000004881ea004000000f85befeffff0faef8c3")
""":func:`assembly`, assembled (``as`` then ``objcopy -O binary -j .text``)."""


def assembly() -> str:
    """The routine's source (GNU as, Intel syntax): ``ntcopy(dst, src, n)`` with ``dst``
    16-byte aligned and ``n`` a positive multiple of :data:`BLOCK`.  Each inner pass
    prefetches four blocks ahead, loads 64 bytes from each of four consecutive pages into
    xmm0..xmm15 and stores them with ``movntdq``; ``sfence`` orders the stores before
    the return."""
    lines = [".intel_syntax noprefix", ".text", ".globl ntcopy", "ntcopy:", "2:",
             "    mov ecx, 64", "1:"]
    lines += [f"    prefetcht0 [rsi+{p * 4096 + 4 * 4096}]" for p in range(4)]
    lines += [f"    movdqu xmm{4 * p + k}, [rsi+{p * 4096 + 16 * k}]"
              for p in range(4) for k in range(4)]
    lines += [f"    movntdq [rdi+{p * 4096 + 16 * k}], xmm{4 * p + k}"
              for p in range(4) for k in range(4)]
    lines += ["    add rsi, 64", "    add rdi, 64", "    dec ecx", "    jnz 1b",
              "    add rsi, 12288", "    add rdi, 12288", "    sub rdx, 16384", "    jnz 2b",
              "    sfence", "    ret"]
    return "\n".join(lines) + "\n"


_Routine = Callable[[int, int, int], None]
_lock = threading.Lock()
_loaded: tuple[_Routine | None, str] | None = None


def _load() -> tuple[_Routine | None, str]:
    """The routine, or None and why not."""
    if os.environ.get("TENSORHUB_STREAM_COPY", "1") == "0":
        return None, "off (TENSORHUB_STREAM_COPY=0)"
    if not (sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")):
        return None, f"not available on {sys.platform} {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    page.write(CODE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    # Writable, then executable: never both (W^X).  The page is never unmapped.
    if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        err = ctypes.get_errno()
        return None, f"executable page refused: {os.strerror(err)}"
    _pages.append(page)
    routine: _Routine = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_size_t)(address)
    # Check: a block and a half of random bytes, source and destination misaligned.
    src = np.random.default_rng().integers(0, 256, 3 * BLOCK + 64, dtype=np.uint8)
    dst = np.zeros(3 * BLOCK + 128, np.uint8)
    at = (-dst.ctypes.data) % 64
    routine(dst.ctypes.data + at, src.ctypes.data + 3, 2 * BLOCK)
    if not (np.array_equal(dst[at:at + 2 * BLOCK], src[3:3 + 2 * BLOCK])
            and not dst[:at].any() and not dst[at + 2 * BLOCK:].any()):
        return None, "self-check failed"
    return routine, "non-temporal (SSE2)"


_pages: list[mmap.mmap] = []  # the routine's page, kept mapped for the process's life


def _routine() -> _Routine | None:
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                try:
                    _loaded = _load()
                except (OSError, ValueError, AttributeError) as exc:
                    _loaded = None, f"not loaded: {exc}"
    return _loaded[0]


def status() -> str:
    """How :func:`stream_copy_all` copies in this process, and why (for statistics)."""
    _routine()
    assert _loaded is not None
    return _loaded[1]


def stream_copy_all(pairs: Sequence[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]
                    ) -> None:
    """``dst[:] = src`` for each pair of contiguous uint8 arrays of one length.  Pairs
    that continue the previous one in memory on both sides are copied as one run; a run
    of at least :data:`MIN_BYTES` is copied with non-temporal stores for its 64-byte
    aligned whole blocks where the routine is available, everything else with
    ``memmove``.  The GIL is released during each copy."""
    runs: list[list[int]] = []  # [destination address, source address, length]
    for dst, src in pairs:
        n = len(dst)
        if len(src) != n:
            raise ValueError(f"stream_copy_all: {len(src)} bytes into {n}")
        if not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.flags.writeable):
            raise ValueError("stream_copy_all needs contiguous arrays and a writable destination")
        if not n:
            continue
        d, s = dst.ctypes.data, src.ctypes.data
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1][2] += n
        else:
            runs.append([d, s, n])
    for d, s, n in runs:
        routine = _routine() if n >= MIN_BYTES else None
        if routine is None:
            ctypes.memmove(d, s, n)
            continue
        head = (-d) % 64
        body = (n - head) // BLOCK * BLOCK
        if head:
            ctypes.memmove(d, s, head)
        if body:
            routine(d + head, s + head, body)
        if head + body < n:
            ctypes.memmove(d + head + body, s + head + body, n - head - body)
