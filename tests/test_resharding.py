"""Resharding plans over real publish manifests, checked against numpy slicing.

Pure: no network.  A publishing group of random size and sharding builds one manifest
per rank with :func:`build_manifest` from numpy slices of random full tensors; a fetcher
in another random sharding plans its slices with :func:`plan_reshard`.  The data plane
is simulated by copying *only* the chunks ``plan.chunks[s]`` lists (each checked against
its digest) into a buffer whose every other byte is wrong, and the slices assembled by
:func:`execute` from it must equal numpy's slicing of the full tensors byte for byte:
so the chunk list covers every byte the copy ops read.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from math import prod
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorhub.errors import ConsistencyError, LocalProtocolError
from tensorhub.manifest.digests import new_hasher
from tensorhub.manifest.manifest import Manifest, build_manifest
from tensorhub.model import VersionKey
from tensorhub.protocol.layout import execute
from tensorhub.protocol.resharding import ReshardPlan, plan_reshard
from tensorhub.protocol.sharding import Sharding

DTYPES = ["<f2", "<f4", "<f8", "|i1", "|u1", "<i2", "<i8", "<c8"]
Specs = dict[str, tuple[np.dtype[Any], tuple[int, ...]]]
Full = dict[str, np.ndarray[Any, Any]]

PROPERTY = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- strategies ---------------------------------------------------------------------


@st.composite
def tensor_specs(draw: st.DrawFn) -> Specs:
    """1-4 tensors of 1-3 dims (a dim may be 0) and assorted dtypes."""
    out: Specs = {}
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        out[f"w{i}"] = (np.dtype(draw(st.sampled_from(DTYPES))), shape)
    return out


@st.composite
def shardings(draw: st.DrawFn, specs: Specs) -> Sharding:
    """A random group sharding of ``specs``: per tensor a split dim or replicated, equal
    parts when they divide evenly (sometimes) or given parts (zero sizes allowed)."""
    size = draw(st.integers(1, 4))
    split: dict[str, int] = {}
    parts: dict[str, list[int]] = {}
    for name, (_, shape) in specs.items():
        dim = draw(st.none() | st.integers(0, len(shape) - 1))
        if dim is None:
            continue
        split[name] = dim
        n = shape[dim]
        if n % size or draw(st.booleans()):
            cuts = sorted(draw(st.lists(st.integers(0, n), min_size=size - 1,
                                        max_size=size - 1)))
            bounds = [0, *cuts, n]
            parts[name] = [b - a for a, b in itertools.pairwise(bounds)]
    return Sharding(draw(st.integers(0, size - 1)), size, split, parts)


# -- helpers ------------------------------------------------------------------------


def random_full(specs: Specs, seed: int) -> Full:
    """Full tensors of random bytes (compared as bytes: NaNs are fine)."""
    rng = np.random.default_rng(seed)
    out: Full = {}
    for name, (dtype, shape) in specs.items():
        raw = rng.integers(0, 256, size=prod(shape) * dtype.itemsize, dtype=np.uint8)
        out[name] = raw.view(dtype).reshape(shape)
    return out


def region(arr: np.ndarray[Any, Any], box: Sequence[tuple[int, int]]) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(arr[tuple(slice(a, b) for a, b in box)])


def as_bytes(arr: np.ndarray[Any, Any]) -> bytes:
    return np.ascontiguousarray(arr).tobytes()


def publish(spec: Sharding, full: Full, chunk_sizes: Sequence[int],
            orders: Sequence[Sequence[str]] | None = None, model: str = "m",
            version: int = 1) -> dict[int, tuple[Manifest, np.ndarray[Any, Any]]]:
    """What every rank of ``spec``'s group publishes: its manifest (round-tripped through
    the wire encoding, as a fetcher gets it) and its flat bytes."""
    out: dict[int, tuple[Manifest, np.ndarray[Any, Any]]] = {}
    for rank in range(spec.size):
        sp = spec.at(rank)
        names = list(orders[rank]) if orders is not None else list(full)
        arrays = [(n, region(full[n], sp.box(n, full[n].shape))) for n in names]
        placed = [sp.place(n, a.shape) for n, a in arrays]
        for (n, a), (gshape, start) in zip(arrays, placed, strict=True):
            if sp.dim_of(n) is None:
                assert (gshape, start) == ((), ())
            else:  # place() of the local slice says where box() put it
                assert gshape == full[n].shape
                assert tuple((s, s + k) for s, k in zip(start, a.shape, strict=True)) \
                    == sp.box(n, gshape)
        key = VersionKey(model, version, rank if spec.size > 1 else 0, spec.layout_id)
        m = build_manifest(key, arrays, chunk_sizes[rank], "blake3", spec.size, placed)
        assert Manifest.decode(m.encode(), m.manifest_id()) == m
        m = Manifest.decode(m.encode())
        flat = np.concatenate([a.reshape(-1).view(np.uint8) for _, a in arrays]) \
            if arrays else np.empty(0, np.uint8)
        assert flat.size == m.total_bytes
        out[rank] = (m, flat)
    return out


def digest(data: np.ndarray[Any, Any]) -> bytes:
    h = new_hasher("blake3")
    h.update(memoryview(data))
    out: bytes = h.digest()
    return out


def simulate_fetch(plan: ReshardPlan,
                   published: Mapping[int, tuple[Manifest, np.ndarray[Any, Any]]]
                   ) -> dict[str, np.ndarray[Any, Any]]:
    """The data plane: per source shard, a buffer whose every byte is wrong (the bitwise
    complement of the truth) except the chunks the plan lists, copied and verified; then
    run each tensor's copy ops from those buffers into fresh destinations."""
    bufs: dict[int, np.ndarray[Any, Any]] = {}
    for s, chunks in plan.chunks.items():
        m, flat = published[s]
        assert list(chunks) == sorted(set(chunks))
        assert all(0 <= c < m.num_chunks for c in chunks), (s, chunks, m.num_chunks)
        buf = ~flat
        for c in chunks:
            start, stop = m.chunk_range(c)
            buf[start:stop] = flat[start:stop]
            assert digest(buf[start:stop]) == m.chunk_digests[c]
        bufs[s] = buf
    out: dict[str, np.ndarray[Any, Any]] = {}
    for t in plan.tensors:
        sources = {}
        for s, buf in bufs.items():
            spec = next((w for w in published[s][0].tensors if w.name == t.name), None)
            if spec is not None:
                sources[s] = buf[spec.offset:spec.end]
        dest = np.full(t.shape, 0, dtype=np.dtype(t.dtype))
        dest.reshape(-1).view(np.uint8)[...] = 0x5A  # garbage, in case an op is missing
        execute(plan.plans[t.name], sources, dest)
        out[t.name] = dest
    return out


def check_plan(plan: ReshardPlan, fetcher: Sharding, full: Full,
               published: Mapping[int, tuple[Manifest, np.ndarray[Any, Any]]],
               order: Sequence[str]) -> None:
    # the fetcher's own specs: its slices end to end, in first-appearance order
    assert [t.name for t in plan.tensors] == list(order)
    offset = 0
    for t in plan.tensors:
        arr = full[t.name]
        box = fetcher.box(t.name, arr.shape)
        assert t.dtype == arr.dtype.str
        assert t.shape == tuple(b - a for a, b in box)
        assert t.offset == offset
        offset = t.end
        if fetcher.dim_of(t.name) is None:
            assert (t.global_shape, t.start) == ((), ())
        else:
            assert t.global_shape == arr.shape
            assert t.start == tuple(a for a, _ in box)
        assert plan.plans[t.name].want.ranges == box
    # a source shard is fetched from iff some copy op reads it, and each chunk listed
    # lies within the extent of a copy op on that shard
    used = {op.source for p in plan.plans.values() for op in p.ops}
    assert set(plan.chunks) == used
    for s, chunks in plan.chunks.items():
        m = published[s][0]
        extents = []
        for name, p in plan.plans.items():
            w = next(w for w in m.tensors if w.name == name) if any(
                op.source == s for op in p.ops) else None
            for op in p.ops:
                if op.source == s and w is not None:
                    high = op.src_offset + op.length + sum(
                        (n - 1) * st_ for n, st_ in zip(op.counts, op.src_strides, strict=True))
                    extents.append((w.offset + op.src_offset, w.offset + high))
        for c in chunks:
            start, stop = m.chunk_range(c)
            assert any(lo < stop and start < hi for lo, hi in extents), (s, c)
    got = simulate_fetch(plan, published)
    for t in plan.tensors:
        want = region(full[t.name], fetcher.box(t.name, full[t.name].shape))
        assert got[t.name].shape == want.shape
        assert as_bytes(got[t.name]) == as_bytes(want), t.name


def first_appearance(orders: Sequence[Sequence[str]]) -> list[str]:
    seen: list[str] = []
    for names in orders:
        seen += [n for n in names if n not in seen]
    return seen


# -- properties ---------------------------------------------------------------------


@PROPERTY
@given(data=st.data())
def test_reshard_reads_only_listed_chunks_and_matches_numpy(data: st.DataObject) -> None:
    specs = data.draw(tensor_specs(), "tensors")
    pub = data.draw(shardings(specs), "publisher")
    fetcher = data.draw(shardings(specs), "fetcher")
    full = random_full(specs, data.draw(st.integers(0, 2**32 - 1), "seed"))
    chunk_sizes = data.draw(st.lists(st.integers(64, 4096), min_size=pub.size,
                                     max_size=pub.size), "chunk sizes")
    orders = [data.draw(st.permutations(list(specs)), f"order of rank {r}")
              for r in range(pub.size)]
    published = publish(pub, full, chunk_sizes, orders)
    manifests = {s: m for s, (m, _) in published.items()}
    plan = plan_reshard(fetcher, manifests)
    check_plan(plan, fetcher, full, published, first_appearance(orders))
    # the same plan again, and from the manifests given in another order
    again = plan_reshard(fetcher, dict(reversed(manifests.items())))
    assert again.tensors == plan.tensors
    assert again.chunks == plan.chunks
    assert again.plans == plan.plans


@PROPERTY
@given(data=st.data())
def test_every_rank_of_a_fetching_group_gets_its_slices(data: st.DataObject) -> None:
    """All ranks of one fetcher sharding, from one publish: each gets numpy's slice, and
    the slices of a split tensor tile it (their parts add up to the global dim)."""
    specs = data.draw(tensor_specs(), "tensors")
    pub = data.draw(shardings(specs), "publisher")
    fetcher = data.draw(shardings(specs), "fetcher")
    full = random_full(specs, data.draw(st.integers(0, 2**32 - 1), "seed"))
    chunk = data.draw(st.integers(64, 1024), "chunk size")
    published = publish(pub, full, [chunk] * pub.size)
    manifests = {s: m for s, (m, _) in published.items()}
    ids = set()
    for rank in range(fetcher.size):
        me = fetcher.at(rank)
        ids.add(me.layout_id)
        check_plan(plan_reshard(me, manifests), me, full, published, list(specs))
    assert ids == {fetcher.layout_id}
    assert (fetcher.layout_id == b"") == (fetcher.size == 1)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_same_layout_reads_split_tensors_from_its_own_rank_only(data: st.DataObject) -> None:
    specs = data.draw(tensor_specs(), "tensors")
    pub = data.draw(shardings(specs), "publisher")
    full = random_full(specs, data.draw(st.integers(0, 2**32 - 1), "seed"))
    published = publish(pub, full, [256] * pub.size)
    manifests = {s: m for s, (m, _) in published.items()}
    plan = plan_reshard(pub, manifests)
    check_plan(plan, pub, full, published, list(specs))
    for name, p in plan.plans.items():
        if pub.dim_of(name) is not None:
            assert {op.source for op in p.ops} <= {pub.rank}, name


@PROPERTY
@given(data=st.data())
def test_lost_shard_is_an_error_exactly_when_the_fetcher_needs_it(data: st.DataObject) -> None:
    specs = data.draw(tensor_specs(), "tensors")
    pub = data.draw(shardings(specs), "publisher")
    fetcher = data.draw(shardings(specs), "fetcher")
    full = random_full(specs, data.draw(st.integers(0, 2**32 - 1), "seed"))
    published = publish(pub, full, [128] * pub.size)
    lost = data.draw(st.integers(0, pub.size - 1), "lost shard")
    left = {s: p for s, p in published.items() if s != lost}
    uncovered = []
    for name, arr in full.items():
        have = np.zeros(arr.shape, bool)
        for s in left:
            have[tuple(slice(a, b) for a, b in pub.at(s).box(name, arr.shape))] = True
        if not region(have, fetcher.box(name, arr.shape)).all():
            uncovered.append(name)
    manifests = {s: m for s, (m, _) in left.items()}
    if not left:  # no shard left names any tensor: nothing to plan
        assert plan_reshard(fetcher, manifests) == ReshardPlan((), {}, {})
    elif uncovered:
        with pytest.raises(LocalProtocolError, match=rf"of tensor '{uncovered[0]}' do not cover"
                                                     r" \d+ of the \d+ elements .*: missing "):
            plan_reshard(fetcher, manifests)
    else:
        check_plan(plan_reshard(fetcher, manifests), fetcher, full, left, list(full))
        assert lost not in plan_reshard(fetcher, manifests).chunks


def test_plan_is_deterministic_across_calls_and_manifest_copies() -> None:
    full = random_full({"a": (np.dtype("<f4"), (8, 6)), "b": (np.dtype("<i8"), (5,)),
                        "c": (np.dtype("<f2"), (4, 4, 3))}, 7)
    pub = Sharding(0, 4, split={"a": 0, "c": 2}, parts={"c": [1, 0, 2, 0]})
    fetcher = Sharding(1, 2, split={"a": 1, "b": 0}, parts={"b": [2, 3]})
    first = publish(pub, full, [64, 100, 128, 4096])
    second = publish(pub, full, [64, 100, 128, 4096])
    plans = [plan_reshard(fetcher, {s: m for s, (m, _) in pubd.items()})
             for pubd in (first, second, first)]
    assert plans[0].tensors == plans[1].tensors == plans[2].tensors
    assert plans[0].chunks == plans[1].chunks == plans[2].chunks
    # the manifest a fetcher derives from its slices is the same every time, so every
    # fetcher of this layout and rank announces the same manifest id
    key = VersionKey("m", 1, fetcher.rank, fetcher.layout_id)
    ids = set()
    for plan in plans:
        got = simulate_fetch(plan, first)
        m = build_manifest(key, [(t.name, got[t.name]) for t in plan.tensors], 256, "blake3",
                           fetcher.size, [(t.global_shape, t.start) for t in plan.tensors])
        ids.add(m.manifest_id())
    assert len(ids) == 1
    check_plan(plans[0], fetcher, full, first, ["a", "b", "c"])


# -- errors ---------------------------------------------------------------------------


def _two_rank_manifests(a0: np.ndarray[Any, Any], a1: np.ndarray[Any, Any],
                        b0: np.ndarray[Any, Any], b1: np.ndarray[Any, Any]
                        ) -> dict[int, Manifest]:
    spec = Sharding(0, 2, split={"a": 0})
    out = {}
    for r, (a, b) in enumerate([(a0, b0), (a1, b1)]):
        arrays = [("a", a), ("b", b)]
        placed = [((a.shape[0] * 2, *a.shape[1:]), (r * a.shape[0], 0)), ((), ())]
        out[r] = build_manifest(VersionKey("m", 1, r, spec.layout_id), arrays, 64, "blake3",
                                2, placed)
    return out


def test_publish_shards_disagreeing_on_dtype_are_a_consistency_error() -> None:
    a = np.zeros((2, 3), np.float32)
    b = np.zeros(4, np.int64)
    manifests = _two_rank_manifests(a, a.astype(np.float16), b, b)
    with pytest.raises(ConsistencyError, match=r"disagree on tensor 'a'.*float16.*shard 1"):
        plan_reshard(Sharding(), manifests)


def test_publish_shards_disagreeing_on_global_shape_are_a_consistency_error() -> None:
    a = np.zeros((2, 3), np.float32)
    manifests = _two_rank_manifests(a, a, np.zeros(4, np.int64), np.zeros(5, np.int64))
    with pytest.raises(ConsistencyError, match=r"disagree on tensor 'b'.*\[4\].*\[5\]"):
        plan_reshard(Sharding(0, 2, split={"a": 1}, parts={"a": [1, 2]}), manifests)
    # a split tensor whose ranks claim different global shapes
    spec = Sharding(0, 2, split={"a": 0})
    m0 = build_manifest(VersionKey("m", 1, 0, spec.layout_id), [("a", a)], 64, "blake3", 2,
                        [((4, 3), (0, 0))])
    m1 = build_manifest(VersionKey("m", 1, 1, spec.layout_id), [("a", a)], 64, "blake3", 2,
                        [((5, 3), (2, 0))])
    with pytest.raises(ConsistencyError, match=r"'a'.*\[4, 3\].*\[5, 3\]"):
        plan_reshard(Sharding(), {0: m0, 1: m1})


def test_a_region_no_shard_covers_is_named() -> None:
    full = random_full({"a": (np.dtype("<f4"), (6, 3)), "r": (np.dtype("|u1"), (5,))}, 1)
    pub = Sharding(0, 3, split={"a": 0})
    published = publish(pub, full, [64] * 3)
    manifests = {s: m for s, (m, _) in published.items() if s != 1}  # shard 1 is gone
    with pytest.raises(LocalProtocolError, match=r"do not cover 6 of the 18 elements.*"
                                                 r"missing a\[2:4, 0:3\]"):
        plan_reshard(Sharding(), manifests)
    with pytest.raises(LocalProtocolError, match=r"missing a\[3:4, 0:3\]"):
        plan_reshard(Sharding(1, 2, split={"a": 0}), manifests)
    # a fetcher whose slices avoid the lost shard still plans (and reads none of it)
    plan = plan_reshard(Sharding(0, 3, split={"a": 0}), manifests)
    assert 1 not in plan.chunks
    check_plan(plan, Sharding(0, 3, split={"a": 0}), full, published, ["a", "r"])
    # no shard at all
    assert plan_reshard(Sharding(), {}).tensors == ()


def test_fetcher_sharding_that_does_not_fit_the_publish_is_a_clear_error() -> None:
    full = random_full({"a": (np.dtype("<f4"), (6, 3))}, 2)
    manifests = {s: m for s, (m, _) in publish(Sharding(0, 2, split={"a": 0}), full,
                                               [64, 64]).items()}
    with pytest.raises(LocalProtocolError, match=r"'a'.*3 elements do not split into 2 equal"):
        plan_reshard(Sharding(0, 2, split={"a": 1}), manifests)
    with pytest.raises(LocalProtocolError, match=r"parts \[1, 1\] of tensor 'a' add up to 2"):
        plan_reshard(Sharding(0, 2, split={"a": 1}, parts={"a": [1, 1]}), manifests)
    with pytest.raises(LocalProtocolError, match=r"'a' of shape \[6, 3\] has no dim 2"):
        plan_reshard(Sharding(0, 2, split={"a": 2}), manifests)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rank": 2, "size": 2}, r"rank 2 is not in a group of 2"),
    ({"rank": -1, "size": 2}, r"rank -1 is not in a group of 2"),
    ({"rank": True, "size": 2}, r"rank True is not in a group"),
    ({"rank": 0, "size": 0}, r"group size must be an int >= 1, got 0"),
    ({"rank": 0, "size": 2.0}, r"group size must be an int >= 1"),
    ({"rank": 0, "size": 2, "split": {"a": -1}}, r"split dim of 'a' must be an int >= 0"),
    ({"rank": 0, "size": 2, "split": {"a": "0"}}, r"split dim of 'a' must be an int >= 0"),
    ({"rank": 0, "size": 2, "parts": {"a": [1, 2, 3]}}, r"parts of 'a' must be 2 sizes >= 0"),
    ({"rank": 0, "size": 2, "parts": {"a": [3, -1]}}, r"parts of 'a' must be 2 sizes >= 0"),
    ({"rank": 0, "size": 2, "split": [("a",)]}, r"split must map name patterns to dims"),
    ({"rank": 0, "size": 2, "parts": {"a": 3}}, r"parts name patterns to part sizes"),
])
def test_sharding_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        Sharding(**kwargs)


def test_sharding_resolution_errors_and_identity() -> None:
    s = Sharding(1, 3, split={"w*": 0, "b": 1}, parts={"w.odd": [1, 0, 4]})
    with pytest.raises(LocalProtocolError, match=r"'w.even': 7 elements do not split into 3"):
        s.box("w.even", (7, 2))
    with pytest.raises(LocalProtocolError, match=r"parts \[1, 0, 4\] of tensor 'w.odd' add up "
                                                 r"to 5, its split dim has 6"):
        s.box("w.odd", (6, 2))
    with pytest.raises(LocalProtocolError, match=r"'b' of shape \[4\] has no dim 1"):
        s.box("b", (4,))
    with pytest.raises(LocalProtocolError, match=r"'b' of shape \[4\] has no dim 1"):
        s.place("b", (4,))
    with pytest.raises(LocalProtocolError, match=r"rank 1 passes 2 elements along dim 0, "
                                                 r"the sharding gives it 0"):
        s.place("w.odd", (2, 2))
    assert s.box("w.odd", (5, 2)) == ((1, 1), (0, 2))  # a zero-size part
    assert s.place("w.odd", (0, 2)) == ((5, 2), (1, 0))
    assert s.box("w.even", (9, 2)) == ((3, 6), (0, 2))
    assert s.place("w.even", (3, 2)) == ((9, 2), (3, 0))
    assert s.box("other", (5,)) == ((0, 5),)  # replicated
    assert s.place("other", (5,)) == ((), ())
    assert s.dim_of("w.x") == 0 and s.dim_of("b") == 1 and s.dim_of("c") is None
    # identity: the group's sharding, not the rank
    assert s.at(0).layout_id == s.at(2).layout_id == s.layout_id
    assert len(s.layout_id) == 12
    assert Sharding(0, 3, split={"w*": 0, "b": 1}).layout_id != s.layout_id
    assert Sharding(0, 3, split={"w*": 1, "b": 1}, parts={"w.odd": [1, 0, 4]}).layout_id \
        != s.layout_id
    assert Sharding(0, 2, split={"w*": 0, "b": 1}, parts={}).layout_id \
        != Sharding(0, 4, split={"w*": 0, "b": 1}).layout_id
    assert Sharding().layout_id == b"" == Sharding(0, 1, split={"a": 0}).layout_id
    assert Sharding(0, 1, split={"a": 0}).dim_of("a") is None
    with pytest.raises(LocalProtocolError, match="rank 3 is not in a group of 3"):
        s.at(3)
