"""The streaming copy: exact bytes for any length, alignment and cut; its machine code is
its listing; switched off it copies the same."""

from __future__ import annotations

import itertools
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from machine_code import assembled, needs_assembler, printed_switched_off

from tensorhub.transport.samehost import streaming_copy
from tensorhub.transport.samehost.streaming_copy import (
    BLOCK,
    CHECKED_BLOCK,
    MIN_BYTES,
    checked_then_copied,
    stream_copy_all,
)

NATIVE = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def test_the_routine_is_used_where_it_can_be() -> None:
    status = streaming_copy.status()
    if NATIVE and os.environ.get("TENSORHUB_STREAM_COPY", "1") != "0":
        assert status == "non-temporal (SSE2)"
    else:
        assert status.startswith(("off", "not available", "not loaded", "executable"))


def lengths() -> st.SearchStrategy[tuple[int, int]]:
    """(whole blocks, bytes after them): short copies, and copies long enough for the
    routine whose last partial block is empty, one byte, a line or almost a block."""
    tails = st.one_of(st.integers(0, 130), st.sampled_from([BLOCK - 64, BLOCK - 1]))
    return st.one_of(st.tuples(st.just(0), st.integers(0, 3 * BLOCK)),
                     st.tuples(st.integers(MIN_BYTES // BLOCK, MIN_BYTES // BLOCK + 3), tails))


@settings(max_examples=200, deadline=None)
@given(size=lengths(), head=st.integers(0, 63), src_at=st.integers(0, 127),
       data=st.data())
def test_copies_exact_bytes_whatever_the_alignment_and_cuts(
        size: tuple[int, int], head: int, src_at: int, data: st.DataObject) -> None:
    """``head``: bytes before the destination's first 64-byte boundary (copied with
    memmove when the routine takes the rest)."""
    blocks, tail = size
    length = head + blocks * BLOCK + tail
    dst_room = np.zeros(length + 256, np.uint8)
    dst_at = ((-dst_room.ctypes.data) % 64 + 64 - head) % 64 + 64
    assert (-(dst_room.ctypes.data + dst_at)) % 64 == head
    src_room = np.random.default_rng(length + src_at).integers(0, 256, length + 256,
                                                                dtype=np.uint8)
    src, dst = src_room[src_at:src_at + length], dst_room[dst_at:dst_at + length]
    cuts = sorted(data.draw(st.lists(st.integers(0, length), max_size=4)))
    bounds = list(zip([0, *cuts], [*cuts, length], strict=True))
    order = data.draw(st.permutations(bounds))  # neighbours merge only when in order
    stream_copy_all([(dst[a:b], src[a:b]) for a, b in order])
    assert np.array_equal(dst, src)
    assert not dst_room[:dst_at].any() and not dst_room[dst_at + length:].any()


def aligned_room(length: int, head: int) -> tuple[np.ndarray[Any, Any], int]:
    """Zeros with room around ``length`` bytes that start ``head`` bytes before a 64-byte
    boundary: (the room, where they start in it)."""
    room = np.zeros(length + 256, np.uint8)
    at = ((-room.ctypes.data) % 64 + 64 - head) % 64 + 64
    return room, at


@settings(max_examples=60, deadline=None)
@given(head=st.integers(0, 63),
       length=st.one_of(st.integers(1, 3 * BLOCK),
                        st.integers(MIN_BYTES, 2 * CHECKED_BLOCK + 3 * BLOCK)),
       cuts=st.lists(st.integers(0, 1 << 30), max_size=3))
def test_checked_then_copied_hands_out_each_source_block_before_copying_it(
        head: int, length: int, cuts: list[int]) -> None:
    """The blocks handed out are the source's bytes, in order, at most CHECKED_BLOCK
    each, read-only, and not yet in the destination when handed out; once all were
    asked for, the destination is the source and nothing around it was written."""
    room, at = aligned_room(length, head)
    src = np.random.default_rng(length * 64 + head).integers(1, 256, length, dtype=np.uint8)
    dst = room[at:at + length]
    bounds = sorted({c % (length + 1) for c in cuts} | {0, length})
    seen = 0
    for block in checked_then_copied([(dst[a:b], src[a:b]) for a, b in
                                      itertools.pairwise(bounds)]):
        assert block.readonly and 0 < block.nbytes <= CHECKED_BLOCK
        got = np.frombuffer(block, np.uint8)
        assert np.array_equal(got, src[seen:seen + len(got)])
        assert not dst[seen:seen + len(got)].any()  # the copy comes after the check
        seen += len(got)
    assert seen == length
    assert np.array_equal(dst, src)
    assert not room[:at].any() and not room[at + length:].any()


def test_checked_then_copied_stopped_early_copies_only_what_was_checked() -> None:
    length = 3 * CHECKED_BLOCK + 100
    src = np.random.default_rng(7).integers(1, 256, length, dtype=np.uint8)
    dst = np.zeros(length, np.uint8)
    blocks = checked_then_copied([(dst, src)])
    first = next(blocks).nbytes
    second = next(blocks).nbytes  # asking for it copied the first
    del blocks  # a failed check stops here
    assert np.array_equal(dst[:first], src[:first])
    assert not dst[first:].any() and first + second < length


def test_checked_then_copied_refuses_bad_pairs_before_handing_out_anything() -> None:
    dst = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="11 bytes into 10"):
        checked_then_copied([(dst, np.ones(11, np.uint8))])
    ro = np.zeros(10, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        checked_then_copied([(ro, np.ones(10, np.uint8))])


@pytest.mark.parametrize("head", [0, 1, 48, 63])
@pytest.mark.parametrize("tail", [0, 1, 63, 64, 65, BLOCK - 1])
def test_every_head_and_tail_around_the_routines_blocks(head: int, tail: int) -> None:
    length = head + (MIN_BYTES // BLOCK) * BLOCK + tail
    dst_room = np.zeros(length + 256, np.uint8)
    dst_at = ((-dst_room.ctypes.data) % 64 + 64 - head) % 64 + 64
    src = np.random.default_rng(head * 100_003 + tail).integers(0, 256, length,
                                                                 dtype=np.uint8)
    stream_copy_all([(dst_room[dst_at:dst_at + length], src)])
    assert np.array_equal(dst_room[dst_at:dst_at + length], src)
    assert not dst_room[:dst_at].any() and not dst_room[dst_at + length:].any()


def test_a_large_copy_into_an_array_of_another_dtype_view() -> None:
    src = np.random.default_rng(1).standard_normal((3, 1 << 17)).astype(np.float32)
    dst = np.empty_like(src)
    stream_copy_all([(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))])
    assert np.array_equal(dst, src)


@pytest.mark.parametrize(("dst", "src", "error"), [
    (np.zeros(10, np.uint8), np.zeros(11, np.uint8), "11 bytes into 10"),
    (np.zeros(20, np.uint8)[::2], np.zeros(10, np.uint8), "contiguous"),
    (np.zeros(10, np.uint8), np.zeros(20, np.uint8)[::2], "contiguous"),
])
def test_refuses_mismatched_or_strided_arrays(dst: Any, src: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        stream_copy_all([(dst, src)])
    assert not dst.any()


def test_refuses_a_read_only_destination() -> None:
    dst = np.zeros(10, np.uint8)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        stream_copy_all([(dst, np.ones(10, np.uint8))])


@needs_assembler
def test_the_machine_code_is_the_listing_assembled(tmp_path: Path) -> None:
    assert assembled(streaming_copy.assembly(), tmp_path) == streaming_copy.CODE


def test_switched_off_it_copies_with_memmove() -> None:
    script = ("import numpy as np\n"
              "from tensorhub.transport.samehost import streaming_copy as s\n"
              "src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)\n"
              "dst = np.zeros_like(src)\n"
              "s.stream_copy_all([(dst[3:], src[3:])])\n"
              "print(s.status(), bool((dst[3:] == src[3:]).all()), int(dst[:3].sum()))\n")
    assert printed_switched_off("TENSORHUB_STREAM_COPY", script) == [
        "off", "(TENSORHUB_STREAM_COPY=0)", "True", "0"]
