"""The checked copy: copy a chunk out of a holder's memory and compute its xxh3-128 in
the same pass, one read of every byte.

A same-host reader checks each chunk against the manifest's local digest (xxh3-128,
:data:`tensorhub.manifest.digests.LOCAL_ALGO`) as it copies it.  Done as two steps, a check
that reads a block and a copy that reads it again from the cache, the two steps never
overlap: the check's reads wait on memory while nothing is written, then the copy
writes while nothing is read.  Measured on a 2-core VM (Xeon, KVM), one thread, 1 GiB
from a memory file in 16 MiB chunks: numpy's copy alone 88 ms, xxh3 alone 89 ms, check
then copy 170-180 ms, this routine 116 ms (byte-misaligned destinations, which it
writes with ordinary stores: 169 ms).

The routine (listing: :func:`assembly`) runs XXH3's long-input loop with AVX2 over
whole 64-byte stripes and writes each stripe to the destination as it goes, with
non-temporal stores where the destination is 16-byte aligned.  XXH3 is specified by
its reference implementation (https://github.com/Cyan4973/xxHash, ``doc/xxhash_spec.md``):

- eight 64-bit lanes start from fixed primes; each stripe's eight words ``w`` are mixed
  with eight words ``s`` of the secret: lane ``i`` gains ``lo32(w ^ s) * hi32(w ^ s)``,
  and lane ``i ^ 1`` gains ``w`` itself;
- the secret window moves 8 bytes per stripe; after 16 stripes (a block) every lane is
  scrambled (``x ^= x >> 47; x ^= secret[128:192]; x *= PRIME32_1``) and the window
  starts over;
- the input's last 64 bytes are mixed once more with the secret at byte 121, and the
  lanes are folded into two 64-bit halves (:func:`_finish`).

Python keeps the stripe count, joins stripes cut between two runs of the copy (a chunk
may come from several memory files and land in several arrays), and folds the lanes.
Every result is the library's: the routine checks itself against :mod:`xxhash` on first
use and is not used where it cannot be loaded (not x86-64 Linux, no AVX2, executable
pages refused, ``TENSORHUB_CHECKED_COPY=0``); the reader then checks and copies in two
steps (:func:`.streaming_copy.checked_then_copied`).  :func:`status` says which.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from .streaming_copy import OnFirstUse, executable, native

ALGO = "xxh3-128"
"""The digest the routine computes."""

STRIPE = 64
"""Bytes of one stripe."""

SHORTEST = 241
"""Inputs up to 240 bytes take XXH3's short paths: hashed by :mod:`xxhash`."""

PREFETCH_AHEAD = 2048
"""Bytes ahead of the stripe being read that the routine prefetches: memory files are
mapped with 4 KiB pages, where hardware prefetchers stop at every page boundary.  512
and 1024 measured 5-10 % slower here, 4096 and 8192 no faster."""

SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
"""XXH3's default 192-byte secret."""

LAST_KEY = 121
"""Where in the secret the last stripe's key starts."""

_M = (1 << 64) - 1
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P64_4, _P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
_START = np.array([_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1],
                  np.uint64)
_WORD = [int.from_bytes(SECRET[i:i + 8], "little") for i in range(len(SECRET) - 7)]

# The secret where the routine reads it, padded: the last stripe's call passes a window
# 121 bytes in, whose scramble keys (never used) would lie past the end.
_secret = np.zeros(len(SECRET) + 192, np.uint8)
_secret[:len(SECRET)] = np.frombuffer(SECRET, np.uint8)
_SECRET_AT = _secret.ctypes.data


def assembly() -> str:
    """The routine's source (GNU as, Intel syntax):
    ``k = xxh3_copy(lanes, dst, src, stripes, secret, k)`` copies ``stripes`` 64-byte
    stripes from ``src`` to ``dst`` and mixes each into the eight ``lanes`` (uint64,
    updated in place) with the secret window at ``secret + 8 * k``, scrambling after the
    16th; returns the window's next ``k``.  ``stripes`` is at least one."""
    def stores(streaming: bool) -> list[str]:
        if not streaming:
            return ["    vmovdqu [rsi], ymm5", "    vmovdqu [rsi+32], ymm6"]
        return ["    vmovntdq [rsi], xmm5", "    vextracti128 xmm7, ymm5, 1",
                "    vmovntdq [rsi+16], xmm7", "    vmovntdq [rsi+32], xmm6",
                "    vextracti128 xmm7, ymm6, 1", "    vmovntdq [rsi+48], xmm7"]

    def mix(data: int, lane: int, at: int) -> list[str]:
        return [f"    vpxor ymm7, ymm{data}, [r8+r9*8+{at}]",
                "    vpsrlq ymm8, ymm7, 32",
                "    vpmuludq ymm7, ymm7, ymm8",
                f"    vpshufd ymm{data}, ymm{data}, 0x4e",
                f"    vpaddq ymm{lane}, ymm{lane}, ymm{data}",
                f"    vpaddq ymm{lane}, ymm{lane}, ymm7"]

    def scramble(lane: int, key: int) -> list[str]:
        return [f"    vpsrlq ymm7, ymm{lane}, 47",
                f"    vpxor ymm{lane}, ymm{lane}, ymm7",
                f"    vpxor ymm{lane}, ymm{lane}, ymm{key}",
                f"    vpsrlq ymm7, ymm{lane}, 32",
                f"    vpmuludq ymm{lane}, ymm{lane}, ymm2",
                "    vpmuludq ymm7, ymm7, ymm2",
                "    vpsllq ymm7, ymm7, 32",
                f"    vpaddq ymm{lane}, ymm{lane}, ymm7"]

    def loop(label: int, streaming: bool) -> list[str]:
        return [f"{label}:", f"    prefetcht0 [rdx+{PREFETCH_AHEAD}]",
                "    vmovdqu ymm5, [rdx]", "    vmovdqu ymm6, [rdx+32]",
                *stores(streaming), *mix(5, 0, 0), *mix(6, 1, 32),
                "    add rdx, 64", "    add rsi, 64", "    inc r9", "    cmp r9, 16",
                f"    jne {label + 1}f", *scramble(0, 3), *scramble(1, 4),
                "    xor r9d, r9d", f"{label + 1}:", "    dec rcx", f"    jnz {label}b"]

    lines = [".intel_syntax noprefix", ".text", ".globl xxh3_copy", "xxh3_copy:",
             "    vmovdqu ymm0, [rdi]", "    vmovdqu ymm1, [rdi+32]",
             f"    mov eax, {_P32_1:#x}", "    vmovd xmm2, eax",
             "    vpbroadcastd ymm2, xmm2",
             "    vmovdqu ymm3, [r8+128]", "    vmovdqu ymm4, [r8+160]",
             "    test sil, 15", "    jnz 3f"]
    lines += [*loop(1, True), "    jmp 9f", *loop(3, False)]
    lines += ["9:", "    sfence", "    vmovdqu [rdi], ymm0", "    vmovdqu [rdi+32], ymm1",
              "    mov rax, r9", "    vzeroupper", "    ret"]
    return "\n".join(lines) + "\n"


CODE = bytes.fromhex(
    "c5fe6f07c5fe6f4f20b8b179379ec5f96ed0c4e27d58d2c4c17e6f9880000000c4c17e6fa0a00000"
    "0040f6c60f0f85d20000000f188a00080000c5fe6f2ac5fe6f7220c5f9e72ec4e37d39ef01c5f9e7"
    "7e10c5f9e77620c4e37d39f701c5f9e77e30c48155ef3cc8c5bd73d720c4c145f4f8c5fd70ed4ec5"
    "fdd4c5c5fdd4c7c4814def7cc820c5bd73d720c4c145f4f8c5fd70f64ec5f5d4cec5f5d4cf4883c2"
    "404883c64049ffc14983f9107549c5c573d02fc5fdefc7c5fdefc3c5c573d020c5fdf4c2c5c5f4fa"
    "c5c573f720c5fdd4c7c5c573d12fc5f5efcfc5f5efccc5c573d120c5f5f4cac5c5f4fac5c573f720"
    "c5f5d4cf4531c948ffc90f8533ffffffe9b70000000f188a00080000c5fe6f2ac5fe6f7220c5fe7f"
    "2ec5fe7f7620c48155ef3cc8c5bd73d720c4c145f4f8c5fd70ed4ec5fdd4c5c5fdd4c7c4814def7c"
    "c820c5bd73d720c4c145f4f8c5fd70f64ec5f5d4cec5f5d4cf4883c2404883c64049ffc14983f910"
    "7549c5c573d02fc5fdefc7c5fdefc3c5c573d020c5fdf4c2c5c5f4fac5c573f720c5fdd4c7c5c573"
    "d12fc5f5efcfc5f5efccc5c573d120c5f5f4cac5c5f4fac5c573f720c5f5d4cf4531c948ffc90f85"
    "49ffffff0faef8c5fe7f07c5fe7f4f204c89c8c5f877c3")
""":func:`assembly`, assembled (``as`` then ``objcopy -O binary -j .text``)."""

_Routine = Callable[[int, int, int, int, int, int], int]


def _avx2() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx2" in line.split()
    except OSError:
        pass
    return False


def _load() -> tuple[_Routine | None, str]:
    """The routine, or None and why not."""
    if os.environ.get("TENSORHUB_CHECKED_COPY", "1") == "0":
        return None, "off (TENSORHUB_CHECKED_COPY=0)"
    why = native()
    if why is not None:
        return None, why
    if not _avx2():
        return None, "not available: the CPU has no AVX2"
    try:
        address = executable(CODE)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    routine: _Routine = ctypes.CFUNCTYPE(
        ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.c_void_p, ctypes.c_uint64)(address)
    if not _self_check(routine):
        return None, "self-check failed"
    return routine, "one pass (AVX2)"


def _self_check(routine: _Routine) -> bool:
    """Digests and copies of inputs cut in several places, to aligned and misaligned
    destinations, against :mod:`xxhash` and the source."""
    rng = np.random.default_rng()
    for length, cuts, shift in ((241, [], 0), (1024, [1], 16), (1025, [64, 600], 3),
                                (70_001, [4097, 4100, 65_536], 0)):
        src = rng.integers(0, 256, length, dtype=np.uint8)
        room = np.zeros(length + 128, np.uint8)
        at = (-room.ctypes.data) % 64 + shift
        dst = room[at:at + length]
        bounds = [0, *cuts, length]
        runs = [[dst.ctypes.data + lo, src.ctypes.data + lo, hi - lo]
                for lo, hi in itertools.pairwise(bounds)]
        if (_digest(routine, runs, length) != xxhash.xxh3_128(src.data).digest()
                or not np.array_equal(dst, src) or room[:at].any()
                or room[at + length:].any()):
            return False
    return True


_native = OnFirstUse(_load)
_routine = _native.routine


def available() -> bool:
    """Whether :func:`copy_digest` runs the routine in this process."""
    return _routine() is not None


def status() -> str:
    """How :func:`copy_digest` works in this process, and why (for statistics)."""
    return _native.status()


class _Scratch(threading.local):
    """Per thread: the eight lanes, and a stripe cut between two runs, joined."""

    def __init__(self) -> None:
        self.lanes = np.zeros(8, np.uint64)
        self.room = np.zeros(3 * STRIPE, np.uint8)
        at = (-self.room.ctypes.data) % STRIPE
        self.joined = self.room.ctypes.data + at
        self.spill = self.joined + STRIPE  # where a joined stripe is "copied" to


_scratch = _Scratch()


def copy_digest(runs: Sequence[Sequence[int]], length: int) -> bytes:
    """Copy each ``(destination address, source address, bytes)`` run, in order, and
    return the xxh3-128 digest of the source bytes as read by that copy (``length``:
    the runs' total).  Where the routine is not available, or for inputs under
    :data:`SHORTEST` bytes, copies with ``memmove`` and hashes the source with
    :mod:`xxhash`.  The GIL is released during each call of the routine."""
    routine = _routine()
    if routine is None or length < SHORTEST:
        h = xxhash.xxh3_128()
        for d, s, n in runs:
            h.update(memoryview((ctypes.c_uint8 * n).from_address(s)))
            ctypes.memmove(d, s, n)
        return h.digest()
    return _digest(routine, runs, length)


def _digest(routine: _Routine, runs: Sequence[Sequence[int]], length: int) -> bytes:
    scratch = _scratch
    lanes = scratch.lanes
    lanes[:] = _START
    at = lanes.ctypes.data
    stripes = (length - 1) // STRIPE  # the last stripe is mixed apart, with LAST_KEY
    done = k = held = 0
    for d, s, n in runs:
        off = 0
        if held:  # a stripe cut by the previous run: join its rest, mix it
            off = min(STRIPE - held, n)
            ctypes.memmove(scratch.joined + held, s, off)
            ctypes.memmove(d, s, off)
            held += off
            if held == STRIPE:
                k = routine(at, scratch.spill, scratch.joined, 1, _SECRET_AT, k)
                done, held = done + 1, 0
        whole = min((n - off) // STRIPE, stripes - done)
        if whole > 0:
            k = routine(at, d + off, s + off, whole, _SECRET_AT, k)
            done += whole
            off += whole * STRIPE
        if off < n:
            ctypes.memmove(d + off, s + off, n - off)
            if done < stripes:  # the start of a stripe this run cuts
                held = n - off
                ctypes.memmove(scratch.joined, s + off, held)
    _, s, n = runs[-1]
    if n >= STRIPE:  # the input's last 64 bytes, in its last run
        last = s + n - STRIPE
    else:  # they span runs: gather them
        last, want = scratch.joined, STRIPE
        for _, s, n in reversed(runs):
            take = min(n, want)
            want -= take
            ctypes.memmove(last + want, s + n - take, take)
            if not want:
                break
    routine(at, scratch.spill, last, 1, _SECRET_AT + LAST_KEY, 0)
    return _finish(lanes.tolist(), length)


def _fold(lanes: list[int], key: int, start: int) -> int:
    """XXH3's merge of the eight lanes into 64 bits, with the secret from byte ``key``."""
    h = start
    for i in range(4):
        p = (lanes[2 * i] ^ _WORD[key + 16 * i]) * (lanes[2 * i + 1] ^ _WORD[key + 16 * i + 8])
        h = (h + ((p & _M) ^ (p >> 64))) & _M
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & _M
    return h ^ (h >> 32)


def _finish(lanes: list[int], length: int) -> bytes:
    """The 128-bit digest, high half first (xxhash's ``digest()``)."""
    low = _fold(lanes, 11, (length * _P64_1) & _M)
    high = _fold(lanes, len(SECRET) - 64 - 11, ~(length * _P64_2) & _M)
    return high.to_bytes(8, "big") + low.to_bytes(8, "big")
