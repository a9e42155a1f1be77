"""The checked copy: the library's xxh3-128 and exact bytes for any length, cuts and
alignment; its machine code is its listing; switched off it gives the same."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from machine_code import assembled, needs_assembler, printed_switched_off

from tensorhub.transport.samehost import checked_copy
from tensorhub.transport.samehost.checked_copy import SHORTEST, STRIPE, copy_digest
from tensorhub.transport.samehost.streaming_copy import native


def _avx2() -> bool:
    flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("flags")] if Path("/proc/cpuinfo").exists() else []
    return bool(flags) and "avx2" in flags[0].split()


ROUTINE = native() is None and _avx2() and os.environ.get("TENSORHUB_CHECKED_COPY") != "0"


def test_the_routine_is_used_where_it_can_be() -> None:
    status = checked_copy.status()
    if ROUTINE:
        assert status == "one pass (AVX2)"
        assert checked_copy.available()
    else:
        assert status.startswith(("off", "not available", "not loaded", "executable"))
        assert not checked_copy.available()


def _copy(src: np.ndarray, src_cuts: list[int], dst_cuts: list[int], shift: int
          ) -> tuple[bytes, np.ndarray, np.ndarray]:
    """``copy_digest`` of ``src`` split into pieces at ``src_cuts`` (each piece in its
    own array, as memory files are) into a destination cut at ``dst_cuts`` (each part
    in its own array, ``shift`` bytes past a 64-byte boundary, between zeroed margins)."""
    assert checked_copy.available() == ROUTINE  # the routine itself, where it runs
    n = len(src)
    s_bounds = [0, *sorted(set(c for c in src_cuts if 0 < c < n)), n]
    d_bounds = [0, *sorted(set(c for c in dst_cuts if 0 < c < n)), n]
    s_parts = [src[lo:hi].copy() for lo, hi in itertools.pairwise(s_bounds)]
    rooms, d_parts = [], []
    for lo, hi in itertools.pairwise(d_bounds):
        room = np.zeros(hi - lo + 192, np.uint8)
        at = (-room.ctypes.data) % 64 + 64 + shift
        rooms.append((room, at, hi - lo))
        d_parts.append(room[at:at + hi - lo])
    runs = []
    for lo, hi in itertools.pairwise(sorted(set(s_bounds) | set(d_bounds))):
        si, di = s_bounds.index(max(b for b in s_bounds if b <= lo)), \
            d_bounds.index(max(b for b in d_bounds if b <= lo))
        s = s_parts[si].ctypes.data + lo - s_bounds[si]
        d = d_parts[di].ctypes.data + lo - d_bounds[di]
        runs.append([d, s, hi - lo])
    digest = copy_digest(runs, n)
    got = np.concatenate(d_parts) if d_parts else np.zeros(0, np.uint8)
    margins = np.concatenate([np.concatenate([r[:at], r[at + m:]]) for r, at, m in rooms])
    return digest, got, margins


def lengths() -> st.SearchStrategy[int]:
    """Around XXH3's block (16 stripes) and short-input boundaries, and longer."""
    edges = [SHORTEST - 1, SHORTEST, 16 * STRIPE, 16 * STRIPE + 1, 17 * STRIPE,
             32 * STRIPE - 1, 32 * STRIPE, 32 * STRIPE + 64, 1 << 16]
    return st.one_of(st.sampled_from(edges), st.integers(1, 5000),
                     st.integers(5000, 300_000))


@settings(max_examples=300, deadline=None)
@given(n=lengths(), shift=st.sampled_from([0, 16, 32, 48, 1, 7, 63]), data=st.data())
def test_the_digest_is_xxh3_128_and_the_copy_exact_for_any_cuts(
        n: int, shift: int, data: st.DataObject) -> None:
    cut = st.lists(st.integers(1, n), max_size=6)
    src_cuts, dst_cuts = data.draw(cut), data.draw(cut)
    src = np.random.default_rng(n * 7 + shift).integers(0, 256, n, dtype=np.uint8)
    digest, got, margins = _copy(src, src_cuts, dst_cuts, shift)
    assert digest == xxhash.xxh3_128(src.data).digest()
    assert np.array_equal(got, src)
    assert not margins.any()


@pytest.mark.parametrize("n", [SHORTEST, 1024, 1025, 1088, 4 << 20, (4 << 20) + 33])
def test_one_run_of_many_blocks(n: int) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    digest, got, margins = _copy(src, [], [], 0)
    assert digest == xxhash.xxh3_128(src.data).digest()
    assert np.array_equal(got, src) and not margins.any()


def test_a_changed_byte_anywhere_changes_the_digest() -> None:
    n = 3 * 1024 + 100
    src = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    want = xxhash.xxh3_128(src.data).digest()
    for at in (0, 63, 64, 1023, 1024, n - 65, n - 64, n - 1):
        bad = src.copy()
        bad[at] ^= 1
        digest, got, _ = _copy(bad, [n // 2], [n // 3], 16)
        assert digest != want, at
        assert np.array_equal(got, bad)


def test_an_empty_copy_is_the_empty_digest() -> None:
    assert copy_digest([], 0) == xxhash.xxh3_128(b"").digest()


@needs_assembler
def test_the_machine_code_is_the_listing_assembled(tmp_path: Path) -> None:
    assert assembled(checked_copy.assembly(), tmp_path) == checked_copy.CODE


def test_switched_off_it_hashes_with_xxhash_and_copies_with_memmove() -> None:
    script = ("import numpy as np, xxhash\n"
              "from tensorhub.transport.samehost import checked_copy as c\n"
              "src = np.arange(1 << 18, dtype=np.uint32).view(np.uint8)\n"
              "dst = np.zeros_like(src)\n"
              "d = c.copy_digest([[dst.ctypes.data, src.ctypes.data, len(src)]], len(src))\n"
              "print(c.status(), d == xxhash.xxh3_128(src.data).digest(),\n"
              "      bool((dst == src).all()))\n")
    assert printed_switched_off("TENSORHUB_CHECKED_COPY", script) == [
        "off", "(TENSORHUB_CHECKED_COPY=0)", "True", "True"]
