"""Chunk deltas, sans-IO: every delta round-trips; any input from the wire either
applies to a chunk of the right size or is refused as the remote's fault (never a
crash, never an allocation past a few chunks); the rules that pick sources and decide
whether a delta pays."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.errors import LocalProtocolError, RemoteProtocolError
from tensorhub.protocol import codec
from tensorhub.protocol.dataplane import DeltaReply, DeltaRunRequest
from tensorhub.protocol.delta import (
    MAX_DELTA_OVERHEAD,
    RAW,
    SPARSE,
    XOR,
    apply_chunk,
    delta_format,
    delta_pays,
    encode_chunk,
    pick_sources,
    unchanged_chunks,
)
from tensorhub.protocol.messages import register_all

register_all()


def bf16_step(n_words: int, fraction: float, seed: int) -> tuple[bytes, bytes]:
    """bf16 weights and an RL-like step of them: ``fraction`` of values changed a little."""
    rng = np.random.default_rng(seed)
    f = (rng.standard_normal(n_words) * 0.02).astype(np.float32)
    base = (f.view(np.uint32) >> 16).astype(np.uint16)
    new = base.copy()
    idx = rng.choice(n_words, int(n_words * fraction), replace=False)
    v = (new[idx].astype(np.uint32) << 16).view(np.float32)
    v = v * (1 + 0.01 * rng.standard_normal(idx.size)).astype(np.float32)
    new[idx] = ((v.view(np.uint32) + 0x8000) >> 16).astype(np.uint16)
    return base.tobytes(), new.tobytes()


@pytest.mark.parametrize("fraction,most", [(0.0, 0.001), (0.01, 0.012), (0.02, 0.02),
                                           (0.10, 0.06)])
def test_an_rl_step_round_trips_and_is_small(fraction: float, most: float) -> None:
    base, new = bf16_step(1 << 20, fraction, 1)
    delta = encode_chunk(base, new)
    assert apply_chunk(base, delta).tobytes() == new
    assert delta_format(delta) == "sparse" and len(delta) <= most * len(new) + 32


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=4096), flips=st.lists(st.tuples(st.integers(0, 4095),
                                                              st.integers(1, 255))),
       dense=st.booleans())
def test_any_change_round_trips(data: bytes, flips: list[tuple[int, int]],
                                dense: bool) -> None:
    new = bytearray(data)
    if dense and new:
        new = bytearray(b ^ 0x5A for b in new)
    for at, x in flips:
        if at < len(new):
            new[at] ^= x
    delta = encode_chunk(data, bytes(new))
    assert delta[0] in (SPARSE, XOR, RAW) and len(delta) <= len(data) + 1
    assert apply_chunk(data, delta).tobytes() == bytes(new)


def test_chunks_of_different_lengths_are_the_callers_mistake() -> None:
    with pytest.raises(LocalProtocolError):
        encode_chunk(b"ab", b"abc")


@settings(max_examples=500, deadline=None)
@given(delta=st.binary(max_size=300), n=st.integers(0, 256))
def test_any_bytes_apply_or_are_refused(delta: bytes, n: int) -> None:
    base = bytes(range(256))[:n]
    try:
        out = apply_chunk(base, delta)
    except RemoteProtocolError:
        return
    assert out.size == n


@settings(max_examples=300, deadline=None)
@given(at=st.integers(0, 10_000), x=st.integers(1, 255), cut=st.integers(0, 10_000))
def test_a_mutated_or_cut_delta_applies_or_is_refused(at: int, x: int, cut: int) -> None:
    base, new = bf16_step(2048, 0.05, 2)
    delta = bytearray(encode_chunk(base, new))
    delta[at % len(delta)] ^= x
    for bad in (bytes(delta), bytes(delta[:cut % len(delta)])):
        try:
            out = apply_chunk(base, bad)
        except RemoteProtocolError:
            continue
        assert out.size == len(base)


def zframe(data: bytes, **kw: object) -> bytes:
    return zstandard.ZstdCompressor(**kw).compress(data)  # type: ignore[arg-type]


def lying_frame() -> bytes:
    """A zstd frame of 8 KiB whose header says 4 KiB (its 2-byte size field patched)."""
    frame = zframe(bytes(8192))
    assert frame[4] == 0x60 and frame[5:7] == (8192 - 256).to_bytes(2, "little")
    return frame[:5] + (4096 - 256).to_bytes(2, "little") + frame[7:]


HOSTILE = {
    "empty": b"",
    "unknown format": b"\x09" + b"\0" * 8,
    "declares more than the chunk": bytes((XOR,)) + zframe(bytes(1 << 20)),
    "declares the chunk, holds twice": bytes((XOR,)) + lying_frame(),
    "no declared size": bytes((XOR,)) + zframe(bytes(4096), write_content_size=False),
    "trailing frame": bytes((XOR,)) + zframe(bytes(4096)) + zframe(bytes(16)),
    "raw too short": bytes((RAW,)) + bytes(4095),
    "sparse count past the chunk": bytes((SPARSE,)) + struct.pack("<I", 2049)
    + zframe(bytes(6 * 2049)),
    "sparse repeated position": bytes((SPARSE,)) + struct.pack("<I", 2) + zframe(
        np.array([3, 0], "<u4").view(np.uint8).reshape(-1, 4).T.tobytes() + bytes(4)),
    "sparse position past the end": bytes((SPARSE,)) + struct.pack("<I", 1) + zframe(
        np.array([2048], "<u4").view(np.uint8).reshape(-1, 4).T.tobytes() + b"\1\1"),
    "sparse gaps overflow 32 bits": bytes((SPARSE,)) + struct.pack("<I", 2) + zframe(
        np.array([2**32 - 1, 2**32 - 1], "<u4").view(np.uint8).reshape(-1, 4).T.tobytes()
        + bytes(4)),
    "oversized": bytes((RAW,)) + bytes(4096 + MAX_DELTA_OVERHEAD),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_deltas_are_the_remotes_fault(name: str) -> None:
    with pytest.raises(RemoteProtocolError):
        apply_chunk(bytes(4096), HOSTILE[name])


def test_a_zstd_bomb_is_refused_by_its_header() -> None:
    # A frame that declares 64 MiB (it would decompress to it) for a 4 KiB chunk.
    bomb = bytes((XOR,)) + zframe(bytes(64 << 20), level=19)
    assert len(bomb) < 4096 + MAX_DELTA_OVERHEAD
    with pytest.raises(RemoteProtocolError, match="declares"):
        apply_chunk(bytes(4096), bomb)


def test_unchanged_chunks_are_those_with_equal_digests_and_lengths() -> None:
    assert unchanged_chunks([b"a", b"b", b"c"], [b"a", b"x", b"c", b"d"],
                           [4, 4, 2], [4, 4, 3, 1]) == [True, False, False, False]


def test_with_a_plan_deltas_come_only_from_each_chunks_planned_source() -> None:
    planned = {0: "seed", 1: "seed", 2: "nobase", 3: "seed"}
    assert pick_sources([0, 1, 2, 3], planned, ["other", "seed"], True) == {
        "seed": [0, 1, 3]}
    assert pick_sources([0, 2], {}, ["other", "seed"], False) == {"other": [0, 2]}
    assert pick_sources([0], {}, [], False) == {}


def test_a_delta_pays_only_where_encoding_and_applying_outrun_the_link() -> None:
    assert delta_pays(12.5e6, 1e9, None)  # applying not measured yet: as encoding
    assert not delta_pays(1.25e9, 1e9, None)  # 10 Gbit
    assert delta_pays(12.5e6, 1e9, 2e9)  # 100 Mbit
    assert delta_pays(50e6, 1e9, 2e9)  # 400 Mbit
    assert not delta_pays(3e9, 1e9, 2e9)  # loopback
    assert not delta_pays(50e6, 1e9, 55e6)  # applying here is the bottleneck


def test_delta_messages_round_trip_with_their_own_ids() -> None:
    ids = {cls: i for i, cls in codec.registered().items()}
    assert ids[DeltaRunRequest] == 130 and ids[DeltaReply] == 131
    for msg in (DeltaRunRequest(1, "m", 2, 1, 0, 64), DeltaReply(1, 5, 0, 100, 7)):
        assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.05, 0.2, 1.0])
def test_changed_words_are_found_alike_by_either_scan(fraction: float) -> None:
    from tensorhub.protocol.delta import _changed_words
    base, new = bf16_step(1 << 16, fraction, 7)
    old_b, new_b = np.frombuffer(base, np.uint8), np.frombuffer(new, np.uint8)
    x = np.bitwise_xor(old_b.view(np.uint16), new_b.view(np.uint16))
    want = np.flatnonzero(x)
    for cut in (0, 2):  # a length of whole 64-bit words (wide scan), and one without
        got_x, pos, values = _changed_words(old_b[cut:], new_b[cut:])
        shifted = want[want >= cut // 2] - cut // 2
        assert np.array_equal(pos, shifted) and np.array_equal(values, got_x[pos])
        assert np.array_equal(got_x, x[cut // 2:])
