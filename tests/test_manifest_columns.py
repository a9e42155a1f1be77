"""A manifest whose tensor columns are byte for byte those of one decoded lately (the
next version of a model) reuses that one's specs without parsing the columns
(:mod:`tensorhub.manifest.columns`); anything odd takes the full parse."""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from unittest import mock

import blake3
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_manifest import manifests

from tensorhub import Manifest, RemoteProtocolError, VersionKey
from tensorhub.limits import ManifestLimits
from tensorhub.manifest import manifest as manifest_module
from tensorhub.manifest.manifest import build_manifest
from tensorhub.manifest.manifest import columns as columns

BOUNDS: dict[str, Any] = {"max_map_len": 16, "max_array_len": 1 << 18,
                          "max_str_len": 1 << 12, "max_bin_len": 1 << 26, "max_ext_len": 0}


@given(manifests())
@settings(max_examples=150)
def test_a_split_is_the_parse_less_the_columns_and_their_digest(m: Manifest) -> None:
    data = m.encode()
    parts = columns.split(data, **BOUNDS)
    assert parts is not None
    fields, digest = parts
    whole = msgpack.unpackb(data, raw=False)
    assert fields == {**whole, "tensors": None}
    assert digest == blake3.blake3(msgpack.packb(whole["tensors"], use_bin_type=True)).digest()


def many(version: int, seed: int, n: int = 300) -> Manifest:
    rng = np.random.default_rng(seed)
    arrays = [(f"layer{i}.w", rng.standard_normal(16).astype(np.float32)) for i in range(n)]
    return build_manifest(VersionKey("cols", version), arrays, 4096, "blake3")


def test_the_next_version_reuses_the_specs_of_the_last() -> None:
    first, second = many(1, 1), many(2, 2)
    assert first.chunk_digests != second.chunk_digests
    decoded = Manifest.decode(first.encode(), first.manifest_id())
    parts = columns.split(second.encode(), **BOUNDS)
    assert parts is not None and columns.known(parts[1]) is not None
    manifest_module._DECODED.clear()  # the parsed-columns cache cannot serve it: the bytes do
    again = Manifest.decode_known(second.encode(), second.manifest_id())
    assert again is not None
    assert again == second and again.tensors is decoded.tensors
    assert again.chunk_digests == second.chunk_digests


def test_other_columns_are_not_taken_for_known_ones() -> None:
    Manifest.decode(many(1, 1).encode())
    other = many(3, 1, n=299)
    parts = columns.split(other.encode(), **BOUNDS)
    assert parts is not None and columns.known(parts[1]) is None
    assert Manifest.decode_known(other.encode()) is None  # left to the full decode
    assert Manifest.decode(other.encode()) == other
    assert Manifest.decode_known(other.encode()) == other  # known from now on


def test_known_columns_still_meet_a_smaller_tensor_limit() -> None:
    m = many(1, 1)
    Manifest.decode(m.encode())  # remembered under the default limits
    with pytest.raises(RemoteProtocolError, match="over 100 tensors"):
        Manifest.decode(m.encode(), limits=replace(ManifestLimits(), max_tensors=100))


@pytest.mark.parametrize("bad", ["trailing byte", "two tensors fields", "a list",
                                 "no tensors", "cut short"])
def test_odd_input_is_left_to_the_full_parse(bad: str) -> None:
    m = many(1, 1)
    wire = m.to_wire()
    data = m.encode()
    odd = {
        "trailing byte": data + b"\x00",
        "two tensors fields": _with_duplicate_tensors(wire),
        "a list": msgpack.packb([wire], use_bin_type=True),
        "no tensors": msgpack.packb({k: v for k, v in wire.items() if k != "tensors"},
                                    use_bin_type=True),
        "cut short": data[:-3],
    }[bad]
    assert columns.split(odd, **BOUNDS) is None
    if bad == "two tensors fields":  # the full parse keeps the last, as it always did
        assert Manifest.decode(odd) == m
        return
    with pytest.raises(RemoteProtocolError):
        Manifest.decode(odd)


def _with_duplicate_tensors(wire: dict[str, Any]) -> bytes:
    """The map with ``tensors`` twice (msgpack writes what it is given)."""
    packer = msgpack.Packer(use_bin_type=True)
    out = packer.pack_map_header(len(wire) + 1)
    for k, v in [*wire.items(), ("tensors", wire["tensors"])]:
        out += packer.pack(k) + packer.pack(v)
    return out


@given(st.binary(max_size=300))
def test_any_bytes_split_or_not_without_raising(data: bytes) -> None:
    parts = columns.split(data, **BOUNDS)
    assert parts is None or isinstance(parts[0], dict)


@pytest.mark.parametrize("tensors", [
    b"\xdd\xff\xff\xff\xff",  # an array of 2**32 - 1 items, none there
    b"\xdf\xff\xff\xff\xff",  # a map of 2**32 - 1 pairs
    b"\xdb\xff\xff\xff\xff",  # a string of 4 GiB
    b"\xc6\x7f\xff\xff\xff",  # a bin of 2 GiB
])
def test_huge_declared_counts_in_the_columns_do_not_split(tensors: bytes) -> None:
    data = b"\x81\xa7tensors" + tensors
    assert columns.split(data, **BOUNDS) is None
    with pytest.raises(RemoteProtocolError):
        Manifest.decode(data)


FIELDS = ["model", "version", "chunk_size", "digest_algo", "chunk_digests", "shard",
          "local_digests", "device_digests", "extra"]
VALUES = st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from([0, 1, 2**63 - 1, 2**63]),
                   st.binary(max_size=64), st.text(max_size=8), st.none(), st.booleans(),
                   st.lists(st.integers(-1, 2**32), max_size=4))


@given(manifests(), st.sampled_from(FIELDS), VALUES)
@settings(max_examples=300)
def test_known_columns_beside_any_other_field_decode_as_the_full_parse_does(
        m: Manifest, name: str, value: object) -> None:
    """The columns are known (remembered by a first decode); every other field, given
    any value, is refused or accepted exactly as without that knowledge."""
    Manifest.decode(m.encode())
    wire = m.to_wire()
    wire[name] = value
    data = msgpack.packb(wire, use_bin_type=True)

    def outcome() -> object:
        try:
            return Manifest.decode(data)
        except RemoteProtocolError:
            return RemoteProtocolError

    parts = columns.split(data, **BOUNDS)
    assert parts is not None and columns.known(parts[1]) is not None
    known = outcome()
    with mock.patch.object(columns, "known", lambda _digest: None):
        assert outcome() == known
