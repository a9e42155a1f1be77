"""Streaming memory copies: copy large buffers with non-temporal stores.

A same-host reader copies gigabytes from the holder's memory files into its own arrays,
and nothing reads the destination again soon except the digest check.  An ordinary copy
(``memcpy`` below glibc's non-temporal threshold, which is about three quarters of the
last-level cache and so hundreds of MiB on hosts with a large one) first reads every
destination line into the cache and later writes it back: a third more memory traffic
than a streaming copy, whose stores bypass the cache.

The routine reads the source in one sequential stream, 64 bytes at a time, with a
software prefetch a few lines ahead (hardware prefetchers stop at page boundaries; a
prefetch is a hint and never faults), and writes each line with ``movntdq``.  One
sequential stream is the pattern every prefetcher and TLB handles best, whatever the
source's page size.  An earlier routine interleaved four pages at a time (as glibc does
for its largest copies); it was quick from huge-page memory but slow from memory files,
which most kernels map with 4 KiB pages: measured on a 2-core VM (KVM, 32 MiB L3),
1 GiB in 64 MiB calls, one thread / two threads, in seconds:

============================  ==============  =============
source                        four pages      one stream
============================  ==============  =============
memory file (4 KiB pages)     0.53 / 0.48     0.07 / 0.04
numpy array (huge pages)      0.077 / 0.055   0.06 / 0.035
============================  ==============  =============

(glibc's ``memcpy`` of 1 GiB at once, from the memory file: 0.23; of 64 MiB at a time:
0.11.)

Neither numpy nor the standard library has such a copy, so on Linux x86-64 this module
puts a small SSE2 routine (every x86-64 CPU has SSE2; listing: :func:`assembly`) into an
executable page of its own and calls it through ``ctypes``, which releases the GIL for
the call.  It copies whole 64-byte lines to a 64-byte aligned destination;
:func:`stream_copy_all` copies the unaligned head and the tail with ``memmove``.  The
routine checks itself on first use and is not used where it cannot be loaded (another
platform, a kernel or security policy that refuses executable anonymous pages) or where
``TENSORHUB_STREAM_COPY=0``: :func:`stream_copy_all` then copies with ``memmove``.
:func:`status` says which.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

BLOCK = 64
"""The routine copies whole 64-byte lines."""

MIN_BYTES = 256 << 10
"""Smaller copies use ``numpy.copyto``: they fit in the cache, where cached stores win."""

PREFETCH_AHEAD = 512
"""Bytes ahead of the line being copied that the routine prefetches: eight lines, enough
to cover the memory latency at one line per iteration, short enough to stay in L1."""

CODE = bytes.fromhex(
    "0f188e00020000f30f6f06f30f6f4e10f30f6f5620f30f6f5e30660fe707660fe74f10660fe75720"
    "660fe75f304883c6404883c7404883ea4075c50faef8c3")
""":func:`assembly`, assembled (``as`` then ``objcopy -O binary -j .text``)."""


def assembly() -> str:
    """The routine's source (GNU as, Intel syntax): ``ntcopy(dst, src, n)`` with ``dst``
    16-byte aligned and ``n`` a positive multiple of :data:`BLOCK`.  Each pass prefetches
    the line :data:`PREFETCH_AHEAD` bytes ahead, loads 64 bytes into xmm0..xmm3 and
    stores them with ``movntdq``; ``sfence`` orders the stores before the return."""
    lines = [".intel_syntax noprefix", ".text", ".globl ntcopy", "ntcopy:", "1:",
             f"    prefetcht0 [rsi+{PREFETCH_AHEAD}]"]
    lines += [f"    movdqu xmm{k}, [rsi+{16 * k}]" for k in range(4)]
    lines += [f"    movntdq [rdi+{16 * k}], xmm{k}" for k in range(4)]
    lines += ["    add rsi, 64", "    add rdi, 64", "    sub rdx, 64", "    jnz 1b",
              "    sfence", "    ret"]
    return "\n".join(lines) + "\n"


_Routine = Callable[[int, int, int], None]
_pages: list[mmap.mmap] = []  # the routines' pages, kept mapped for the process's life
_R = TypeVar("_R")


class OnFirstUse(Generic[_R]):
    """A routine loaded on first use, once per process: ``load()`` returns it, or None,
    and in either case a line saying how this process runs and why."""

    def __init__(self, load: Callable[[], tuple[_R | None, str]]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._loaded: tuple[_R | None, str] | None = None

    def _get(self) -> tuple[_R | None, str]:
        if self._loaded is None:
            with self._lock:
                if self._loaded is None:
                    try:
                        self._loaded = self._load()
                    except (OSError, ValueError, AttributeError) as exc:
                        self._loaded = None, f"not loaded: {exc}"
        return self._loaded

    def routine(self) -> _R | None:
        """The routine, or None where it is not used."""
        return self._get()[0]

    def status(self) -> str:
        """How this process runs, and why."""
        return self._get()[1]


def executable(code: bytes) -> int:
    """The address of ``code`` copied into pages of their own, made executable (and no
    longer writable: never both, W^X).  The pages stay mapped for the process's life.
    Raises ``OSError`` where the kernel or a security policy refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = -(-len(code) // mmap.PAGESIZE) * mmap.PAGESIZE
    pages = mmap.mmap(-1, size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    pages.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(pages))
    if libc.mprotect(address, size, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"executable page refused: {os.strerror(err)}")
    _pages.append(pages)
    return address


def native() -> str | None:
    """Why this process cannot run the x86-64 routines, or None where it can."""
    if not (sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")):
        return f"not available on {sys.platform} {platform.machine()}"
    return None


def _load() -> tuple[_Routine | None, str]:
    """The routine, or None and why not."""
    if os.environ.get("TENSORHUB_STREAM_COPY", "1") == "0":
        return None, "off (TENSORHUB_STREAM_COPY=0)"
    why = native()
    if why is not None:
        return None, why
    try:
        address = executable(CODE)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    routine: _Routine = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_size_t)(address)
    # Check: 130 lines (across page boundaries) from a misaligned source; nothing
    # written before or after them.
    n = 130 * BLOCK
    src = np.random.default_rng().integers(0, 256, n + 64, dtype=np.uint8)
    dst = np.zeros(n + 128, np.uint8)
    at = (-dst.ctypes.data) % 64
    routine(dst.ctypes.data + at, src.ctypes.data + 3, n)
    if not (np.array_equal(dst[at:at + n], src[3:3 + n])
            and not dst[:at].any() and not dst[at + n:].any()):
        return None, "self-check failed"
    return routine, "non-temporal (SSE2)"


_native = OnFirstUse(_load)
_routine = _native.routine


def status() -> str:
    """How :func:`stream_copy_all` copies in this process, and why (for statistics)."""
    return _native.status()


_Pairs = Sequence[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]


def runs_of(pairs: _Pairs) -> list[list[int]]:
    """``[destination address, source address, length]`` of the pairs' bytes: pairs that
    continue the previous one in memory on both sides are joined into one run."""
    runs: list[list[int]] = []
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
    return runs


def _copy_run(d: int, s: int, n: int, stream: bool) -> None:
    """``n`` bytes from ``s`` to ``d``: where ``stream`` and the routine is available,
    with non-temporal stores for the 64-byte aligned whole blocks; everything else with
    ``memmove``."""
    routine = _routine() if stream else None
    if routine is None:
        ctypes.memmove(d, s, n)
        return
    head = (-d) % 64
    body = (n - head) // BLOCK * BLOCK
    if head:
        ctypes.memmove(d, s, head)
    if body:
        routine(d + head, s + head, body)
    if head + body < n:
        ctypes.memmove(d + head + body, s + head + body, n - head - body)


def stream_copy_all(pairs: _Pairs) -> None:
    """``dst[:] = src`` for each pair of contiguous uint8 arrays of one length.  Pairs
    that continue the previous one in memory on both sides are copied as one run; a run
    of at least :data:`MIN_BYTES` is copied with non-temporal stores for its 64-byte
    aligned whole blocks where the routine is available, everything else with
    ``memmove``.  The GIL is released during each copy."""
    for d, s, n in runs_of(pairs):
        _copy_run(d, s, n, n >= MIN_BYTES)


CHECKED_BLOCK = 1024 << 10
"""Bytes :func:`checked_then_copied` hands out at a time: a block read by the check stays
in the core's own cache (L2: 512 KiB on AMD Zen cores, 1-2 MiB on recent Intel server
cores) until it is copied on."""


def checked_then_copied(pairs: _Pairs) -> Iterator[memoryview]:
    """``dst[:] = src`` for each pair, as :func:`stream_copy_all`, while a check reads the
    source bytes: hands out a read-only view of the next block of ``src`` (at most
    :data:`CHECKED_BLOCK` bytes, in order) and copies that block once the next one is
    asked for, from the cache where the check's reads left it.  Each byte crosses memory
    twice, read once and written once (as in a plain copy), where checking ``dst`` after
    the copy reads it a third time.

    What is checked is the source as it was just before it was copied: for a source
    that only a process trusted as much as this one can change (see
    :class:`~tensorhub.transport.base.SourceVerifier`).  A caller that stops asking early
    leaves the rest of ``dst`` as it was.  Raises ``ValueError`` (at once, not once
    iterated) as :func:`stream_copy_all` does."""
    return _checked_then_copied(runs_of(pairs))


def _checked_then_copied(runs: list[list[int]]) -> Iterator[memoryview]:
    for d, s, n in runs:
        # The destination's unaligned head on its own, so each block after it starts
        # 64-byte aligned and is copied with streaming stores whole.
        stream = n >= MIN_BYTES
        head = (-d) % 64 if stream else 0
        cuts = [0, head] if head else [0]
        cuts += range(cuts[-1] + CHECKED_BLOCK, n, CHECKED_BLOCK)
        cuts.append(n)
        for lo, hi in itertools.pairwise(cuts):
            yield memoryview((ctypes.c_uint8 * (hi - lo)).from_address(s + lo)).toreadonly()
            _copy_run(d + lo, s + lo, hi - lo, stream)
