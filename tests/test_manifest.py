"""The manifest's wire form: round trips, and every malformed input is refused cleanly."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub import Manifest, RemoteProtocolError, VersionKey
from tensorhub.manifest.manifest import build_manifest

DTYPES = ["<f4", "<f2", "|i1", "<i8", "|b1", "<u2"]
NAME_CHARS = st.characters(blacklist_categories=("Cc", "Cs"))  # see limits.BAD_NAME_CHARS


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    n = draw(st.integers(0, 12))
    arrays = []
    placed = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        arr = np.zeros(shape, np.dtype(draw(st.sampled_from(DTYPES))))
        arrays.append((f"t{i}.{draw(st.text(NAME_CHARS, max_size=5))}", arr))
        if shape and draw(st.booleans()):
            start = tuple(draw(st.integers(0, 3)) for _ in shape)
            placed.append((tuple(a + d + draw(st.integers(0, 2))
                                 for a, d in zip(start, shape, strict=True)), start))
        else:
            placed.append(((), ()))
    world = draw(st.integers(1, 4))
    key = VersionKey("m", draw(st.integers(0, 2**62)), draw(st.integers(0, world - 1)),
                     b"" if world == 1 else b"L" * 12)
    if not arrays:
        arrays, placed = [("only", np.zeros(3, np.float32))], [((), ())]
    return build_manifest(key, arrays, 4096, "blake3", world, placed)


@given(manifests())
@settings(max_examples=200)
def test_round_trip_is_exact(m: Manifest) -> None:
    back = Manifest.decode(m.encode(), expected_id=m.manifest_id())
    assert back == m
    assert [t.nbytes for t in back.tensors] == [t.nbytes for t in m.tensors]
    assert [t.offset for t in back.tensors] == [t.offset for t in m.tensors]
    assert back.key == m.key and back.encode() == m.encode()


@given(manifests(), st.data())
@settings(max_examples=300)
def test_mutated_columns_are_refused_or_decode_consistently(m: Manifest,
                                                            data: st.DataObject) -> None:
    wire = m.to_wire()
    cols = wire["tensors"]
    key = data.draw(st.sampled_from(sorted(cols)))
    value = cols[key]
    if isinstance(value, bytes):
        cols[key] = data.draw(st.one_of(st.binary(max_size=64), st.just(value[:-1]),
                                        st.just(value + b"\x07")))
    else:
        cols[key] = data.draw(st.one_of(st.just(value[:-1]), st.just([*value, value[-1:]]),
                                        st.just([*value, 3]), st.just(None)))
    raw = msgpack.packb(wire, use_bin_type=True)
    try:
        back = Manifest.decode(raw)
    except RemoteProtocolError:
        return
    # whatever decoded is self-consistent: contiguous, digests match the size
    end = 0
    for t in back.tensors:
        assert t.offset == end and t.nbytes >= 0
        end += t.nbytes
    assert len(back.chunk_digests) == back.num_chunks


@given(manifests(), st.data())
@settings(max_examples=200)
def test_decode_known_agrees_with_decode_on_mutated_manifests(m: Manifest,
                                                              data: st.DataObject) -> None:
    """What a fetch decodes on its event loop (``decode_known``): for a manifest whose
    columns were decoded before, with any field of it mutated, the same manifest as
    ``decode`` or the same refusal; None only for columns it has not seen."""
    Manifest.decode(m.encode())  # its columns are known now
    wire = m.to_wire()
    field = data.draw(st.sampled_from(sorted(wire)))
    wire[field] = data.draw(st.one_of(st.none(), st.integers(-2**63, 2**64 - 1),
                                      st.binary(max_size=40), st.just(wire[field])))
    raw = msgpack.packb(wire, use_bin_type=True)
    try:
        want: Manifest | None = Manifest.decode(raw)
    except RemoteProtocolError:
        want = None
    try:
        got = Manifest.decode_known(raw)
    except RemoteProtocolError:
        assert want is None
        return
    if got is None:
        assert field == "tensors"  # only other columns are left to decode
    else:
        assert got == want


@given(st.binary(max_size=300))
def test_decode_known_refuses_random_bytes_or_leaves_them_to_decode(blob: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        assert Manifest.decode_known(blob) is None
    with pytest.raises(RemoteProtocolError):
        Manifest.decode(blob)


@given(st.binary(max_size=300))
def test_random_bytes_are_refused(blob: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        Manifest.decode(blob)


def test_wrong_id_is_refused_before_parsing() -> None:
    m = build_manifest(VersionKey("m", 1), [("w", np.ones(10, np.float32))], 4096, "blake3")
    with pytest.raises(RemoteProtocolError, match="id"):
        Manifest.decode(m.encode(), expected_id=b"\0" * 16)


def test_huge_claimed_sizes_are_refused() -> None:
    m = build_manifest(VersionKey("m", 1), [("w", np.ones(10, np.float32))], 4096, "blake3")
    wire = m.to_wire()
    wire["tensors"]["ndim"] = bytes([4])
    wire["tensors"]["dims"] = np.array([2**39] * 4, "<i8").tobytes()
    with pytest.raises(RemoteProtocolError, match="too large"):
        Manifest.decode(msgpack.packb(wire, use_bin_type=True))


def test_ten_thousand_tensors_round_trip() -> None:
    arrays = [(f"layer.{i}.w", np.full(1024, i, np.float32)) for i in range(10_000)]
    m = build_manifest(VersionKey("m", 1), arrays, 4 << 20, "blake3")
    back = Manifest.decode(m.encode(), expected_id=m.manifest_id())
    assert back.tensors[-1].offset == 9_999 * 4096 and back.total_bytes == 10_000 * 4096


def test_local_digests_are_xxh3_of_each_chunk_next_to_cryptographic_ones() -> None:
    from tensorhub.manifest.digests import LOCAL_ALGO, digest_of
    data = np.random.default_rng(5).standard_normal(5000).astype(np.float32)
    m = build_manifest(VersionKey("m", 1), [("w", data)], 4096, "blake3")
    raw = data.tobytes()
    chunks = [raw[i:i + 4096] for i in range(0, len(raw), 4096)]
    assert m.local_digests == tuple(digest_of(LOCAL_ALGO, [c]) for c in chunks)
    assert m.chunk_digests == tuple(digest_of("blake3", [c]) for c in chunks)
    back = Manifest.decode(m.encode(), expected_id=m.manifest_id())
    assert back.local_digests == m.local_digests and back == m
    # a manifest whose digests are fast already carries no second list
    fast = build_manifest(VersionKey("m", 1), [("w", data)], 4096, "xxh3-128")
    assert fast.local_digests == () and "local_digests" not in fast.to_wire()


_PIECE_DTYPES = (np.uint8, np.float32, np.int64, np.float16)


@given(st.lists(st.tuples(st.sampled_from(range(len(_PIECE_DTYPES))),
                          st.integers(0, 300), st.booleans()), max_size=40),
       st.sampled_from(["blake3", "sha256", "xxh3-128"]))
@settings(max_examples=60, deadline=None)
def test_digest_of_pieces_is_the_digest_of_their_bytes_in_order(
        spec: list[tuple[int, int, bool]], algo: str) -> None:
    """Arrays of any dtype, byte views and empty pieces, as a chunk of many small tensors
    hands them over, hash to what their bytes laid end to end hash to."""
    from tensorhub.manifest.digests import digest_of, new_hasher
    rng = np.random.default_rng(len(spec))
    pieces: list[Any] = []
    for kind, n, as_view in spec:
        arr = rng.integers(0, 255, n * 8, dtype=np.uint8).view(_PIECE_DTYPES[kind])
        pieces.append(memoryview(arr).cast("B") if as_view else arr)
    whole = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    h = new_hasher(algo)
    h.update(whole)
    assert digest_of(algo, pieces) == h.digest()
    # one changed byte anywhere changes it
    if whole:
        at = len(whole) // 2
        flipped = bytearray(whole)
        flipped[at] ^= 1
        assert digest_of(algo, [memoryview(flipped)]) != h.digest()


@pytest.mark.parametrize("bad", [b"", b"\0" * 16, b"\0" * 48, "text", 7])
def test_malformed_local_digests_are_refused(bad: object) -> None:
    m = build_manifest(VersionKey("m", 1), [("w", np.ones(2048, np.float32))], 4096,
                       "blake3")
    assert len(m.local_digests) == 2
    wire = m.to_wire()
    wire["local_digests"] = bad  # empty, too short, too long, not bytes
    with pytest.raises(RemoteProtocolError, match="local digests"):
        Manifest.decode(msgpack.packb(wire, use_bin_type=True))
    fast = build_manifest(VersionKey("m", 1), [("w", np.ones(2048, np.float32))], 4096,
                          "xxh3-128").to_wire()
    fast["local_digests"] = wire["chunk_digests"][:32]  # beside fast digests: refused
    with pytest.raises(RemoteProtocolError, match="local digests"):
        Manifest.decode(msgpack.packb(fast, use_bin_type=True))


@given(manifests(), st.one_of(st.binary(max_size=200), st.integers(-2**63, 2**64 - 1),
                              st.text(max_size=8), st.none(), st.lists(st.binary(max_size=16),
                                                                       max_size=4)))
@settings(max_examples=300)
def test_any_local_digests_are_refused_or_one_per_chunk(m: Manifest, value: object) -> None:
    wire = m.to_wire()
    wire["local_digests"] = value
    try:
        back = Manifest.decode(msgpack.packb(wire, use_bin_type=True))
    except RemoteProtocolError:
        return
    assert len(back.local_digests) == back.num_chunks > 0
    assert all(len(d) == 16 for d in back.local_digests)
