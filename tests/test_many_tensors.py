"""Models of many small tensors: the per-tensor fast paths (shared tensor tables, bulk
``into=`` checks, chunks landed in the arrays themselves) keep every contract."""

from __future__ import annotations

import collections
import gc
import itertools
import socket
import threading
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
from helpers import open_mesh
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub import LocalProtocolError, Manifest, RemoteProtocolError, VersionKey
from tensorhub.manifest import manifest as manifest_module
from tensorhub.manifest.manifest import build_manifest, chunk_pieces
from tensorhub.model import byte_view
from tensorhub.read.store import LocalVersion
from tensorhub.transport.sockio import recv_scattered, send_segments


def small_model(version: int, n: int = 10_000) -> dict[str, np.ndarray[Any, Any]]:
    """``n`` tensors of mixed small sizes and dtypes (some empty, some 0-d), so chunk
    bounds fall inside tensors as well as between them."""
    rng = np.random.default_rng(version)
    out: dict[str, np.ndarray[Any, Any]] = {}
    for i in range(n):
        kind = i % 7
        if kind == 0:
            arr = rng.standard_normal(1024).astype(np.float32)
        elif kind == 1:
            arr = rng.integers(0, 255, 777, dtype=np.uint8)
        elif kind == 2:
            arr = rng.standard_normal((3, 5)).astype(np.float16)
        elif kind == 3:
            arr = np.zeros((0, 4), np.float32)
        elif kind == 4:
            arr = np.array(rng.integers(-9, 9), np.int64)
        elif kind == 5:
            arr = rng.standard_normal(333).astype(">f4")  # not native: byte views
        else:
            arr = rng.integers(0, 2, 61).astype(np.bool_)
        out[f"layer.{i}.{kind}"] = arr
    return out


def same_bytes(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("algo", ["xxh3-128", "blake3", "sha256"])
async def test_ten_thousand_tensors_fetched_into_arrays_served_onward_and_refetched(
        algo: str) -> None:
    async with open_mesh(3, planning=False, digest_algo=algo) as (pub, a, b):
        w1 = small_model(1)
        await pub.publish("m", 1, w1)
        with trio.fail_after(10):
            await a.wait_for_version("m", None)
        into = {k: np.zeros_like(v) for k, v in w1.items()}
        got = await a.fetch("m", 1, into=into, sources=["p0"])
        assert got.report.verified and got.report.bytes == sum(v.nbytes for v in w1.values())
        assert all(got.tensors[k] is into[k] for k in w1)
        assert all(same_bytes(into[k], v) for k, v in w1.items())
        # a serves what it fetched into the caller's arrays: b reads it from a only
        got_b = await b.fetch("m", 1, sources=["p1"])
        assert set(got_b.report.bytes_by_source) == {"p1"}
        assert all(same_bytes(got_b.tensors[k], v) for k, v in w1.items())
        # the next version has the same tensors and other bytes: the decoded tensor
        # table is shared, the bytes are the new version's
        w2 = small_model(2)
        await pub.publish("m", 2, w2)
        with trio.fail_after(10):
            await a.wait_for_version("m", 1)
        await a.unpublish("m", 1)
        got2 = await a.fetch("m", 2, into=into, sources=["p0"])
        assert got2.report.verified
        assert all(same_bytes(into[k], v) for k, v in w2.items())
        held_a, held_b = a.store.get(VersionKey("m", 2)), b.store.get(VersionKey("m", 1))
        assert held_a is not None and held_b is not None
        assert held_a.manifest.tensors is held_b.manifest.tensors
        assert a.statistics().bytes_fetched == got.report.bytes + got2.report.bytes
        assert a.statistics().bytes_served == got_b.report.bytes


async def test_serving_many_tensors_over_tcp_keeps_no_view_per_tensor() -> None:
    """A holder serves a chunk over TCP from the arrays themselves: serving a version of
    3,000 tensors leaves no byte view per tensor behind (each is an object the garbage
    collector walks in every full collection while the version is held), and the
    reader gets every byte."""
    async with open_mesh(2, planning=False, transports=("tcp",)) as (pub, a):
        w = {f"t{i}": np.full(1000 + i % 7, i, np.float32) for i in range(3000)}
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await a.wait_for_version("m", None)
        into = {k: np.zeros_like(v) for k, v in w.items()}

        def views() -> int:
            gc.collect()
            return sum(type(o) is memoryview for o in gc.get_objects())

        before = views()
        got = await a.fetch("m", 1, into=into, sources=["p0"])
        assert got.report.verified and got.report.chunks > 4
        assert set(got.report.transport_by_source.values()) == {"tcp"}
        assert all(np.array_equal(into[k], v) for k, v in w.items())
        assert views() - before < 100  # a few per chunk at most, not 3,000


async def test_without_a_descriptor_to_spare_a_holder_sends_the_arrays_from_its_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server out of descriptors sends from the event loop, piece by piece: the
    arrays of every dtype go out as their bytes."""
    from tensorhub.transport import server as server_module
    monkeypatch.setattr(server_module._ServerConn, "plain", lambda self: None)
    async with open_mesh(2, planning=False, transports=("tcp",), chunk_size=1 << 16) as (pub, a):
        w = small_model(6, 600)
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await a.wait_for_version("m", None)
        with trio.fail_after(30):
            got = await a.fetch("m", 1, sources=["p0"])
        assert got.report.verified and got.report.chunks > 4
        assert all(same_bytes(got.tensors[k], v) for k, v in w.items())


@pytest.mark.parametrize("chunk_size", [4096, 65536, 1 << 20])
async def test_a_lease_of_pieces_is_the_chunk_and_its_size(chunk_size: int) -> None:
    """What the TCP server sends of each chunk: the pieces' bytes are the chunk's
    bytes, and the size it is given with them is theirs (cut tensors included)."""
    async with open_mesh(1, chunk_size=chunk_size) as (pub,):
        w = small_model(5, 700)
        await pub.publish("m", 1, w)
        key = VersionKey("m", 1)
        held = pub.store.get(key)
        assert held is not None
        flat = b"".join(v.tobytes() for v in w.values())
        for c in range(held.manifest.num_chunks):
            start, stop = held.manifest.chunk_range(c)
            with pub.store.lease_pieces(key, c) as (pieces, size):
                assert size == stop - start == sum(p.nbytes for p in pieces)
                assert b"".join(bytes(memoryview(p).cast("B")) for p in pieces) \
                    == flat[start:stop]


def _bad_into(w: dict[str, np.ndarray[Any, Any]], name: str, how: str
              ) -> dict[str, Any]:
    into: dict[str, Any] = {k: np.zeros_like(v) for k, v in w.items()}
    arr = into[name]
    if how == "shape":
        into[name] = np.zeros(arr.size + 1, arr.dtype)
    elif how == "dtype":
        into[name] = np.zeros(arr.shape, np.float64)
    elif how == "read-only":
        arr.flags.writeable = False
    elif how == "not contiguous":
        into[name] = np.zeros((arr.size, 2), arr.dtype)[:, 0].reshape(arr.shape) \
            if arr.ndim == 1 else np.zeros(arr.shape[::-1], arr.dtype).T
    elif how == "missing":
        del into[name]
    elif how == "unknown":
        into["no.such.tensor"] = np.zeros(3)
    elif how == "renamed":  # as many keys as tensors, one of them unknown
        into["no.such.tensor"] = into.pop(name)
    return into


@pytest.mark.parametrize("how", ["shape", "dtype", "read-only", "not contiguous", "missing",
                                 "unknown", "renamed"])
async def test_a_bad_into_array_among_ten_thousand_is_named_before_any_byte_moves(
        how: str) -> None:
    async with open_mesh(2) as (pub, r):
        w = small_model(1)
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        name = list(w)[-4]  # float32[1024], near the end: all before it pass the checks
        into = _bad_into(w, name, how)
        match = "no.such.tensor" if how in ("unknown", "renamed") else name.replace(".", r"\.")
        with pytest.raises(LocalProtocolError, match=match):
            await r.fetch("m", 1, into=into)
        assert r.statistics().bytes_fetched == 0
        assert pub.statistics().bytes_served == 0
        assert r.store.get(VersionKey("m", 1)) is None
        good = {k: np.zeros_like(v) for k, v in w.items()}
        got = await r.fetch("m", 1, into=good)
        assert all(same_bytes(good[k], v) for k, v in w.items())
        assert got.report.verified


@pytest.mark.parametrize("kind", ["dict", "defaultdict", "OrderedDict"])
def test_into_mappings_with_other_keys_are_refused_and_left_as_they_were(kind: str) -> None:
    """Keys are compared before any value is looked up in a mapping that is not a
    plain dict: a ``defaultdict`` is not given the key it lacks."""
    from tensorhub.read.destination import prepare_destination
    w = small_model(4, 40)
    m = build_manifest(VersionKey("m", 1), list(w.items()), 4096, "xxh3-128")
    make = {"dict": dict, "OrderedDict": collections.OrderedDict,
            "defaultdict": lambda items: collections.defaultdict(lambda: np.zeros(1), items)}
    into = make[kind]((k, np.zeros_like(v)) for k, v in w.items())
    lost = list(w)[7]
    into["stranger"] = into.pop(lost)
    keys = list(into)
    with pytest.raises(LocalProtocolError, match=f"missing \\['{lost}'\\], unknown "
                                                 "\\['stranger'\\]"):
        prepare_destination(m, into)
    assert list(into) == keys
    into[lost] = into.pop("stranger")
    assert len(prepare_destination(m, into)) == len(w)


def test_into_arrays_of_other_kinds_are_viewed_and_checked_one_by_one() -> None:
    from tensorhub.read.destination import prepare_destination
    w = small_model(3, 50)
    m = build_manifest(VersionKey("m", 1), list(w.items()), 4096, "blake3")
    into: dict[str, Any] = {k: np.zeros_like(v) for k, v in w.items()}
    first = next(iter(w))
    into[first] = bytearray(w[first].nbytes)  # the buffer protocol, not an ndarray
    with pytest.raises(LocalProtocolError, match=first.replace(".", r"\.")):
        prepare_destination(m, into)  # a bytearray is uint8 of another shape
    into[first] = np.zeros_like(w[first]).view(type("Sub", (np.ndarray,), {}))
    arrays = prepare_destination(m, into)
    assert arrays[0].shape == w[first].shape and len(arrays) == len(w)



def test_into_arrays_unaligned_or_read_only_or_not_contiguous_are_checked_one_by_one(
        ) -> None:
    """The fast check passes only aligned, writeable, C-contiguous plain arrays; any
    other goes the per-tensor way, which takes an unaligned one as it is (no copy: the
    fetch lands in the caller's memory) and refuses the other two by name."""
    from tensorhub.read.destination import prepare_destination
    w = small_model(3, 50)
    m = build_manifest(VersionKey("m", 1), list(w.items()), 4096, "blake3")
    first = next(iter(w))
    raw = np.zeros(w[first].nbytes + 1, np.uint8)
    unaligned = raw[1:].view(w[first].dtype).reshape(w[first].shape)
    assert not unaligned.flags.aligned and unaligned.flags.c_contiguous
    into: dict[str, Any] = {k: np.zeros_like(v) for k, v in w.items()} | {first: unaligned}
    arrays = prepare_destination(m, into)
    assert arrays[0] is unaligned and all(a is into[k] for k, a in zip(w, arrays, strict=True))
    frozen = np.zeros_like(w[first])
    frozen.flags.writeable = False
    with pytest.raises(LocalProtocolError, match="read-only"):
        prepare_destination(m, into | {first: frozen})
    strided = np.zeros(2 * w[first].size, w[first].dtype)[::2].reshape(w[first].shape)
    with pytest.raises(LocalProtocolError, match="not C-contiguous"):
        prepare_destination(m, into | {first: strided})

@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[tuple[str, np.ndarray[Any, Any]]], int]:
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=40))
    dtypes = draw(st.lists(st.sampled_from(["|u1", "<f2", ">f4", "<i8"]),
                           min_size=len(sizes), max_size=len(sizes)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = [(f"t{i}", np.frombuffer(rng.bytes(n * np.dtype(d).itemsize), d).copy())
              for i, (n, d) in enumerate(zip(sizes, dtypes, strict=True))]
    return arrays, draw(st.integers(1, 64))


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_chunk_pieces_match_a_naive_cut_of_the_byte_space(
        case: tuple[list[tuple[str, np.ndarray[Any, Any]]], int]) -> None:
    arrays, chunk_size = case
    data = b"".join(a.tobytes() for _, a in arrays)
    m = build_manifest(VersionKey("m", 1), arrays, chunk_size, "blake3")
    held = LocalVersion(m, [a for _, a in arrays], "p", verified=True)
    fresh = LocalVersion(m, [np.zeros_like(a) for _, a in arrays], "p", verified=False)
    for c in range(m.num_chunks):
        start, stop = m.chunk_range(c)
        naive = [(s.index, s.start, s.stop) for s in m.segments(start, stop)]
        expect = [(i, a, b) for i, (_, arr) in enumerate(arrays)
                  for a, b in [(max(start, m.tensors[i].offset) - m.tensors[i].offset,
                                min(stop, m.tensors[i].end) - m.tensors[i].offset)]
                  if b > a]
        assert naive == expect
        views = [byte_view(a) for _, a in arrays]
        lo, hi, head, tail = m.chunk_tensors(c)
        pieces = chunk_pieces([views[i] for i in m.table.nonempty[lo:hi]], head, tail)
        assert b"".join(bytes(p) for p in pieces) == data[start:stop]
        assert all(len(p) for p in pieces)
        assert b"".join(bytes(p) for p in held.segments(c)) == data[start:stop]
        assert b"".join(bytes(memoryview(p).cast("B")) for p in held.buffers(c)) \
            == data[start:stop]
        # landing: writing the chunk's bytes through buffers() fills exactly it
        off = 0
        for p in fresh.buffers(c):
            view = memoryview(p).cast("B")
            view[:] = data[start + off:start + off + len(view)]
            off += len(view)
        assert off == stop - start
    assert b"".join(a.tobytes() for a in fresh.arrays) == data


def test_equal_tensor_columns_decode_to_one_shared_tuple_and_others_are_still_checked(
        ) -> None:
    arrays = [(f"w.{i}", np.full(16, i, np.float32)) for i in range(1000)]
    m1 = build_manifest(VersionKey("m", 1), arrays, 4096, "xxh3-128")
    m2 = build_manifest(VersionKey("m", 2), [(n, a + 1) for n, a in arrays], 4096, "xxh3-128")
    d1 = Manifest.decode(m1.encode(), expected_id=m1.manifest_id())
    d2 = Manifest.decode(m2.encode(), expected_id=m2.manifest_id())
    assert d1 == m1 and d2 == m2 and d1.chunk_digests != d2.chunk_digests
    assert d1.tensors is d2.tensors and d1.table is d2.table
    # columns that differ in one name are decoded (and validated) on their own
    wire = m1.to_wire()
    wire["tensors"]["names"][5] = "w.4"  # a duplicate name
    with pytest.raises(RemoteProtocolError, match="duplicate"):
        Manifest.decode(msgpack.packb(wire, use_bin_type=True))
    wire["tensors"]["names"][5] = "other"
    d3 = Manifest.decode(msgpack.packb(wire, use_bin_type=True))
    assert d3.tensors[5].name == "other" and d3.tensors is not d1.tensors
    # unhashable junk where a name belongs is refused, not a crash
    wire["tensors"]["names"][5] = ["junk"]
    with pytest.raises(RemoteProtocolError):
        Manifest.decode(msgpack.packb(wire, use_bin_type=True))


def test_only_a_manifest_of_columns_decoded_lately_is_decoded_known() -> None:
    """``decode_known`` (what a fetch decodes on its event loop) takes a manifest only
    when its tensor columns are in the cache; any other is left to ``decode``, and a
    known one is checked like any other (its id, its digests)."""
    arrays = [(f"k.{i}", np.full(8, i, np.float32)) for i in range(300)]
    m1 = build_manifest(VersionKey("k", 1), arrays, 4096, "xxh3-128")
    m2 = build_manifest(VersionKey("k", 2), [(n, a + 1) for n, a in arrays], 4096,
                        "xxh3-128")
    manifest_module._DECODED.clear()
    assert Manifest.decode_known(m1.encode(), m1.manifest_id()) is None
    d1 = Manifest.decode(m1.encode(), m1.manifest_id())
    d2 = Manifest.decode_known(m2.encode(), m2.manifest_id())
    assert d2 == m2 and d2.tensors is d1.tensors and d2.manifest_id() == m2.manifest_id()
    with pytest.raises(RemoteProtocolError, match="does not match its id"):
        Manifest.decode_known(m2.encode(), m1.manifest_id())
    wire = m2.to_wire()
    wire["chunk_digests"] = wire["chunk_digests"][:-1]
    with pytest.raises(RemoteProtocolError, match="chunk digests"):
        Manifest.decode_known(msgpack.packb(wire, use_bin_type=True))
    with pytest.raises(RemoteProtocolError, match="malformed manifest encoding"):
        Manifest.decode_known(b"\x93junk")
    assert Manifest.decode_known(msgpack.packb([1, 2])) is None  # left to decode, which
    with pytest.raises(RemoteProtocolError, match="wrong fields"):  # says what is wrong
        Manifest.decode(msgpack.packb([1, 2]))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=1200), st.booleans())
def test_a_scattered_receive_fills_every_piece_in_order(sizes: list[int],
                                                        ends_given: bool) -> None:
    """``recv_scattered`` lands a payload across any number of pieces, empty ones
    among them, more than one vectored read's worth too, arrays of wider items among
    them (a read that stops inside one goes on from the byte), with the pieces' running
    ends given or not; a hasher is handed every piece that has bytes, in order."""
    payload = np.random.default_rng(len(sizes)).integers(0, 256, sum(sizes), np.uint8)
    dest: list[Any] = [np.zeros(n // 4, np.float32) if i % 2 and n % 4 == 0
                       else np.zeros(n, np.uint8) for i, n in enumerate(sizes)]
    handed: list[int] = []

    class Hasher:
        def update(self, piece: Any) -> None:
            handed.append(piece.nbytes)

    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=a.sendall, args=(payload.tobytes(),))
        sender.start()
        b.settimeout(30)
        recv_scattered(b, dest, Hasher(),
                       list(itertools.accumulate(sizes)) if ends_given else None)
        sender.join()
    assert b"".join(d.tobytes() for d in dest) == payload.tobytes()
    assert [n for n in handed if n] == [n for n in sizes if n]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=2, max_size=1200), st.integers(0, 99))
def test_a_gathered_send_writes_every_segment_in_order(sizes: list[int], seed: int) -> None:
    """``send_segments`` sends any number of segments, empty ones among them, through a
    small send buffer: writes that stop mid-segment go on from there.  Segments may be
    arrays of any item size (a holder sends a version's arrays themselves): a write
    that stops inside one goes on from the byte, not the item, where it stopped."""
    payload = np.random.default_rng(seed).integers(0, 256, sum(sizes), np.uint8).tobytes()
    view, cuts = memoryview(payload), list(itertools.accumulate(sizes))
    segments: list[Any] = [view[a:b] for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
    for i, seg in enumerate(segments):  # every other one as an array of wider items
        width = (8, 4, 2)[i % 3]
        if i % 2 and len(seg) % width == 0:
            segments[i] = np.frombuffer(seg, dtype=np.dtype(f"<u{width}"))
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        got = bytearray()

        def read() -> None:
            while len(got) < len(payload):
                got.extend(b.recv(1 << 16))

        reader = threading.Thread(target=read)
        reader.start()
        a.settimeout(30)
        send_segments(a, segments)
        reader.join(30)
    assert bytes(got) == payload
