"""One table of limits: publish refuses at once what a reader would refuse, readers
refuse oversized manifests before they allocate, and every dtype either round-trips
exactly or is refused at publish."""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
from helpers import open_mesh
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tensorhub
from tensorhub import LocalProtocolError, Manifest, PeerConfig, RemoteProtocolError, VersionKey
from tensorhub.limits import MAX_DTYPES, MAX_NDIM, MAX_TENSOR_NAME, ManifestLimits
from tensorhub.manifest.manifest import build_manifest
from tensorhub.read.destination import allocate_flat

KEY = VersionKey("m", 1)


@pytest.mark.parametrize(("tensors", "reason"), [
    ({"": np.zeros(3)}, "1 to 1000 characters"),
    ({"x" * (MAX_TENSOR_NAME + 1): np.zeros(3)}, "1 to 1000 characters"),
    ({"a\nb": np.zeros(3)}, "control characters"),
    ({"a\ud800": np.zeros(3)}, "surrogates"),
    ({"deep": np.zeros((1,) * (MAX_NDIM + 1))}, "17 dimensions"),
    ({f"t{i}": np.zeros(1, f"S{i + 1}") for i in range(MAX_DTYPES + 1)}, "257 distinct dtypes"),
    ({"rec": np.zeros(2, [("a", "<f4"), ("b", "<i8")])}, "structured"),
    ({"sub": np.zeros(2, "(3,)<f4")[:, 0]}, None),  # a plain float32 view: allowed
])
async def test_publish_refuses_at_once_what_readers_refuse(tensors: dict[str, Any],
                                                           reason: str | None) -> None:
    async with tensorhub.open_peer(PeerConfig.local("pub")) as pub:
        if reason is None:
            await pub.publish("m", 1, {k: np.ascontiguousarray(v) for k, v in tensors.items()})
            return
        with pytest.raises(LocalProtocolError, match=reason):
            await pub.publish("m", 1, tensors)
        assert pub.store.versions == {}
        assert pub.control.latest("m") is None


async def test_the_bounds_publish_accepts_a_reader_fetches() -> None:
    """At the bounds (256 dtypes, 1,000-character names, 16 dims) a version publishes
    and another peer fetches it: both sides use the same table."""
    w = {f"{i:04d}" + "n" * (MAX_TENSOR_NAME - 4): np.full(2, i, f"S{i + 1}")
         for i in range(MAX_DTYPES - 1)}
    w["deep"] = np.arange(2, dtype=np.float32).reshape((2,) + (1,) * (MAX_NDIM - 1))
    async with open_mesh(2) as (pub, reader):
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        got = await reader.fetch("m", 1)
    assert got.report.verified
    for k, v in w.items():
        assert got.tensors[k].dtype == v.dtype and got.tensors[k].shape == v.shape
        assert got.tensors[k].tobytes() == v.tobytes()


def test_publish_checks_counts_against_the_configured_caps() -> None:
    arrays = [(f"t{i}", np.zeros(1, np.float32)) for i in range(11)]
    small = ManifestLimits(max_tensors=10)
    with pytest.raises(LocalProtocolError, match="11 tensors"):
        build_manifest(KEY, arrays, 4096, "blake3", limits=small)
    with pytest.raises(LocalProtocolError, match="chunks"):
        build_manifest(KEY, [("big", np.zeros(5 * 4096, np.uint8))], 4096, "blake3",
                       limits=ManifestLimits(max_chunks=4))
    with pytest.raises(LocalProtocolError, match="encodes to"):
        build_manifest(KEY, [("n" * 900 + str(i), np.zeros(1)) for i in range(10)], 4096,
                       "blake3", limits=ManifestLimits(max_manifest_bytes=4096))
    m = build_manifest(KEY, arrays, 4096, "blake3")
    with pytest.raises(RemoteProtocolError):  # the reader's side of the same cap
        Manifest.decode(m.encode(), limits=small)


def test_config_validates_the_caps() -> None:
    assert PeerConfig.local("x").manifest_limits == ManifestLimits()
    for bad in ({"max_tensors": 0}, {"max_chunks": 1 << 30}, {"max_manifest_bytes": 1 << 30},
                {"ban_seconds": 0}):
        with pytest.raises(tensorhub.ConfigError):
            PeerConfig.local("x", **bad)


def test_config_refuses_labels_given_as_a_dict() -> None:
    """A dict iterates as its keys, and a 2-character key ("dc") looked like a pair: the
    peer then could not send its join and never became a member (found running the
    docs by hand).  Labels are a tuple of pairs; anything else is refused at once."""
    assert PeerConfig.local("x", labels=(("dc", "eu"),)).labels == (("dc", "eu"),)
    for bad in ({"dc": "eu"}, [("dc", "eu")], ("dc",), (("dc", "eu", "x"),)):
        with pytest.raises(tensorhub.ConfigError, match="labels must be"):
            PeerConfig.local("x", labels=bad)  # type: ignore[arg-type]


def test_a_manifest_declaring_millions_of_tensors_is_refused_before_allocating() -> None:
    """The issue's 4-million-tensor manifest: the parser refuses the array header."""
    m = build_manifest(KEY, [("a", np.zeros(4, np.float32))], 4096, "blake3")
    wire = m.to_wire()
    n = 4_000_000
    wire["tensors"]["names"] = [str(i) for i in range(n)]
    wire["tensors"]["dtype"] = bytes(2 * n)
    wire["tensors"]["ndim"] = bytes(n)
    data = msgpack.packb(wire, use_bin_type=True)
    del wire
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match=r"max_array_len|over the limit"):
            Manifest.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # the 4M names list alone would be ~300 MB


DTYPES = st.one_of(
    hnp.scalar_dtypes(),
    hnp.byte_string_dtypes(endianness="?"),
    hnp.unicode_string_dtypes(endianness="?"),
    hnp.datetime64_dtypes(endianness="?"),
    hnp.timedelta64_dtypes(endianness="?"),
    hnp.integer_dtypes(endianness="?"),
    hnp.floating_dtypes(endianness="?"),
    hnp.complex_number_dtypes(endianness="?"),
    hnp.array_dtypes(allow_subarrays=True),
    hnp.nested_dtypes(),
    st.integers(0, 64).map(lambda n: np.dtype(f"V{n}")),
)


@given(DTYPES, st.integers(0, 4))
@settings(max_examples=400, deadline=None)
def test_every_dtype_round_trips_exactly_or_is_refused(dt: np.dtype[Any], n: int) -> None:
    arr = np.frombuffer(np.random.default_rng(n).bytes(n * dt.itemsize), dt) \
        if dt.itemsize else np.zeros(n, dt)
    try:
        m = build_manifest(KEY, [("x", arr), ("y", np.ones(3, np.float32))], 4096, "blake3")
    except LocalProtocolError as exc:
        assert "'x'" in str(exc)
        # refused: only what the wire cannot carry as it is
        assert dt.fields is not None or dt.subdtype is not None or dt.itemsize == 0 \
            or np.dtype(dt.str) != dt
        return
    back = Manifest.decode(m.encode(), expected_id=m.manifest_id())
    got = np.dtype(back.tensors[0].dtype)
    assert got == dt and got.str == dt.str and got.byteorder == dt.byteorder
    arrays, _ = allocate_flat(back)
    assert arrays[0].dtype == dt and arrays[0].shape == arr.shape
    arrays[0].reshape(-1).view(np.uint8)[:] = arr.reshape(-1).view(np.uint8)
    assert arrays[0].tobytes() == arr.tobytes()
