"""Layouts and resharding plans, checked against numpy slicing of the full tensor."""

from __future__ import annotations

import itertools
import os
import random
import time
from math import prod
from typing import Any

import numpy as np
import pytest
from hypothesis import given, note, seed, settings
from hypothesis import strategies as st

from tensorhub.errors import LocalProtocolError
from tensorhub.protocol.layout import (
    CopyOp,
    Layout,
    Shard,
    ShardPlan,
    TensorLayout,
    column_parallel,
    execute,
    plan_rank,
    plan_shard,
    replicated,
    row_parallel,
    split,
)

SEED = int(os.environ.get("TENSORHUB_SEED") or random.randrange(2**32))
print(f"tests/test_layout.py: hypothesis seed {SEED} (TENSORHUB_SEED={SEED} replays it)")

DTYPES = {1: np.uint8, 2: np.float16, 4: np.float32, 8: np.int64}
BF16 = 2


def index(shard: Shard) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in shard.ranges)


def random_tensor(shape: tuple[int, ...], itemsize: int, rng_seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(rng_seed)
    raw = rng.integers(0, 256, size=prod(shape) * itemsize, dtype=np.uint8)
    return raw.view(DTYPES[itemsize]).reshape(shape)


def buffers_for(
    sources: dict[Any, Shard], tensors: dict[str, np.ndarray[Any, Any]]
) -> dict[Any, np.ndarray[Any, Any]]:
    """Each source shard stored alone, C-contiguous, as its holder keeps it."""
    return {k: np.ascontiguousarray(tensors[s.tensor][index(s)]) for k, s in sources.items()}


def run_and_check(
    plan: ShardPlan[Any],
    sources: dict[Any, Shard],
    buffers: dict[Any, np.ndarray[Any, Any]],
    full: np.ndarray[Any, Any],
) -> None:
    """Executing ``plan`` gives numpy's slice; every destination byte is written once."""
    dest = np.zeros(plan.nbytes, np.uint8)
    execute(plan, buffers, dest)
    expected = np.ascontiguousarray(full[index(plan.want)]).reshape(-1).view(np.uint8)
    assert dest.tobytes() == expected.tobytes()
    written = np.zeros(plan.nbytes, np.int64)
    for op in plan.ops:
        source = sources[op.source]
        assert source.tensor == plan.want.tensor
        runs = list(op.runs())
        assert sum(n for *_, n in runs) == op.nbytes
        for (s, d, n), (s2, d2, _) in itertools.pairwise(runs):
            assert not (s + n == s2 and d + n == d2), f"unmerged runs in {op}"
        for s, d, n in runs:
            assert s >= 0 and s + n <= source.size * plan.itemsize
            written[d : d + n] += 1
    assert (written == 1).all()


def is_whole_copy(plan: ShardPlan[Any]) -> bool:
    [op] = plan.ops
    return (op.src_offset, op.dst_offset, op.length, op.counts) == (0, 0, plan.nbytes, ())


# -- property test -------------------------------------------------------------------


@st.composite
def tensor_layouts(
    draw: st.DrawFn, name: str, shape: tuple[int, ...], itemsize: int
) -> TensorLayout:
    """Replicated, or split along any dim into equal or given parts; sometimes with
    ranks holding nothing or sharing a part."""
    kind = draw(st.sampled_from(["replicated", "equal", "equal", "given", "given"]))
    if kind == "replicated":
        layout = replicated(name, shape, itemsize, draw(st.integers(1, 3)))
    else:
        dim = draw(st.integers(0, len(shape) - 1))
        n = shape[dim]
        if kind == "equal":
            divisors = [k for k in range(2, n + 1) if n % k == 0] or [1]
            parts: int | list[int] = draw(st.sampled_from(divisors))
        else:
            cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
            parts = [b - a for a, b in itertools.pairwise([0, *cuts, n])]
        layout = split(name, shape, itemsize, dim, parts)
    if draw(st.integers(0, 3)) == 0:
        nparts = max(len(layout.parts), 1)
        placement = draw(st.lists(st.integers(-1, nparts - 1), min_size=1, max_size=nparts + 2))
        layout = TensorLayout(name, shape, itemsize, layout.dim, layout.parts, tuple(placement))
    return layout


@st.composite
def boxes(draw: st.DrawFn, name: str, shape: tuple[int, ...]) -> Shard:
    ranges = []
    for n in shape:
        start = draw(st.integers(0, n - 1))
        ranges.append((start, draw(st.integers(start + 1, n))))
    return Shard(name, tuple(ranges))


@seed(SEED)
@settings(max_examples=1000, deadline=None)
@given(data=st.data())
def test_plan_matches_numpy_slicing(data: st.DataObject) -> None:
    note(f"hypothesis seed {SEED}")
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4), "shape"))
    itemsize = data.draw(st.sampled_from(sorted(DTYPES)), "itemsize")
    full = random_tensor(shape, itemsize, data.draw(st.integers(0, 2**32 - 1)))
    publishers = data.draw(st.lists(tensor_layouts("w", shape, itemsize), min_size=1, max_size=2))
    sources: dict[Any, Shard] = {
        (g, r): s for g, lay in enumerate(publishers) for r in range(len(lay.placement))
        if (s := lay.shard(r)) is not None
    }
    for i, box in enumerate(data.draw(st.lists(boxes("w", shape), max_size=3), "box sources")):
        sources[("box", i)] = box  # any rectangle, e.g. held by a peer part way through
    buffers = buffers_for(sources, {"w": full})
    sources["decoy"] = Shard.whole("other", shape)  # another tensor: must be ignored
    covered = np.zeros(shape, bool)
    for s in sources.values():
        if s.tensor == "w":
            covered[index(s)] = True
    fetcher = data.draw(tensor_layouts("w", shape, itemsize), "fetcher")
    wants = [s for r in range(len(fetcher.placement)) if (s := fetcher.shard(r)) is not None]
    wants.append(data.draw(boxes("w", shape), "box"))
    keys = [k for k, s in sources.items() if s.tensor == "w"]
    prefer = data.draw(st.permutations(keys), "prefer")[: data.draw(st.integers(0, len(keys)))]
    for want in wants:
        if not covered[index(want)].all():
            for order in ([], prefer):
                with pytest.raises(LocalProtocolError, match="do not cover"):
                    plan_shard(want, itemsize, sources, order)
            continue
        plan = plan_shard(want, itemsize, sources)
        run_and_check(plan, sources, buffers, full)
        if want.size and want in sources.values():
            assert is_whole_copy(plan)
        preferred = plan_shard(want, itemsize, sources, prefer)
        run_and_check(preferred, sources, buffers, full)
        first = next((k for k in prefer if _overlap(sources[k], want)), None)
        if first is not None:  # the best preferred source serves all it can
            served = sum(op.nbytes for op in preferred.ops if op.source == first)
            assert served == _overlap(sources[first], want) * itemsize


def _overlap(a: Shard, b: Shard) -> int:
    pairs = zip(a.ranges, b.ranges, strict=True)
    return prod(max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in pairs)


# -- tensor-parallel resharding ------------------------------------------------------


def test_tp8_to_tp4_column_parallel_moves_whole_shards() -> None:
    shape = (8192, 8192)
    trainer = Layout(8, (column_parallel("w", shape, BF16, 8),))
    engine = Layout(4, (column_parallel("w", shape, BF16, 4),))
    sources = trainer.holdings()
    for rank in range(4):
        plan = plan_rank(engine, rank, sources)["w"]
        half = 1024 * 8192 * BF16
        assert plan.ops == (
            CopyOp((2 * rank, "w"), 0, 0, half),
            CopyOp((2 * rank + 1, "w"), 0, half, half),
        )


def test_tp8_to_tp4_row_parallel_moves_one_range_per_row() -> None:
    shape = (8192, 8192)
    trainer = Layout(8, (row_parallel("w", shape, BF16, 8),))
    engine = Layout(4, (row_parallel("w", shape, BF16, 4),))
    plan = plan_rank(engine, 1, trainer.holdings())["w"]
    row = 1024 * BF16  # bytes of one source row
    assert plan.ops == (
        CopyOp((2, "w"), 0, 0, row, (8192,), (row,), (2 * row,)),
        CopyOp((3, "w"), 0, row, row, (8192,), (row,), (2 * row,)),
    )
    assert list(plan.ops[1].runs())[:2] == [(0, row, row), (row, 3 * row, row)]


def test_vocab_embedding_split_dim1_and_transposed_split() -> None:
    shape = (32000, 4096)
    trainer = Layout(8, (split("emb", shape, BF16, 1, 8),))
    by_cols = plan_rank(Layout(4, (split("emb", shape, BF16, 1, 4),)), 3, trainer.holdings())
    assert [(op.counts, op.length) for op in by_cols["emb"].ops] == [((32000,), 1024)] * 2
    rows = Layout(8, (split("emb", shape, BF16, 0, 8),))
    by_rows = plan_rank(Layout(4, (split("emb", shape, BF16, 1, 4),)), 0, rows.holdings())
    ops = by_rows["emb"].ops
    assert [op.source for op in ops] == [(r, "emb") for r in range(8)]
    assert all(op.counts == (4000,) and op.length == 1024 * BF16 for op in ops)


def _tp_pp_model(
    layers: int, hidden: int, vocab: int, tp: int, pp: int
) -> tuple[Layout, Layout]:
    """A trainer layout TP=tp x PP=pp (rank = stage * tp + tp_rank) and a TP=4 engine's."""
    trainer: list[TensorLayout] = []
    engine: list[TensorLayout] = []
    per_stage = layers // pp
    for layer in range(layers):
        stage = layer // per_stage
        mine = tuple(range(tp))
        before, after = (-1,) * (stage * tp), (-1,) * ((pp - stage - 1) * tp)
        for name, shape, dim in (
            (f"l{layer}.qkv", (3 * hidden, hidden), 0),
            (f"l{layer}.o", (hidden, hidden), 1),
            (f"l{layer}.up", (4 * hidden, hidden), 0),
            (f"l{layer}.down", (hidden, 4 * hidden), 1),
        ):
            trainer.append(split(name, shape, BF16, dim, tp, before + mine + after))
            engine.append(split(name, shape, BF16, dim, 4))
        norm = f"l{layer}.norm"
        trainer.append(TensorLayout(norm, (hidden,), BF16, -1, (), before + (0,) * tp + after))
        engine.append(replicated(norm, (hidden,), BF16, 4))
    trainer.append(split("emb", (vocab, hidden), BF16, 0, tp, mine + (-1,) * ((pp - 1) * tp)))
    engine.append(split("emb", (vocab, hidden), BF16, 0, 4))
    return Layout(tp * pp, tuple(trainer)), Layout(4, tuple(engine))


def test_tp8_pp2_to_tp4_bytes_match() -> None:
    trainer, engine = _tp_pp_model(layers=4, hidden=32, vocab=80, tp=8, pp=2)
    tensors = {
        t.name: random_tensor(t.shape, BF16, SEED + i) for i, t in enumerate(trainer.tensors)
    }
    sources = trainer.holdings()
    buffers = buffers_for(sources, tensors)
    for rank in range(4):
        plans = plan_rank(engine, rank, sources)
        assert set(plans) == {t.name for t in engine.tensors}
        for name, plan in plans.items():
            run_and_check(plan, sources, buffers, tensors[name])


def test_realistic_model_plans_in_milliseconds() -> None:
    trainer, engine = _tp_pp_model(layers=32, hidden=8192, vocab=32000, tp=8, pp=2)
    sources = trainer.holdings()
    start = time.perf_counter()
    plans = [plan_rank(engine, rank, sources) for rank in range(4)]
    elapsed = time.perf_counter() - start
    count = sum(len(p) for p in plans)
    print(f"planned {count} shards in {elapsed * 1e3:.1f} ms")
    assert elapsed < 2.0  # ~tens of ms here; generous for a loaded 2-core machine
    ops = [op for p in plans for plan in p.values() for op in plan.ops]
    assert max(len(op.counts) for op in ops) <= 1
    assert max(prod(op.counts) for op in ops) == 8192  # one run per row of a dim-1 split


# -- sources, preference, identical layouts ------------------------------------------


def test_identical_layout_pulls_whole_shard_even_with_replica_present() -> None:
    shape = (6, 10)
    sources = {"replica": Shard.whole("w", shape), "same": Shard("w", ((0, 6), (5, 10)))}
    plan = plan_shard(Shard("w", ((0, 6), (5, 10))), 4, sources)
    assert plan.ops[0].source == "same" and is_whole_copy(plan)


def test_preference_order_chooses_among_replicas() -> None:
    sources = {h: Shard.whole("w", (4, 4)) for h in ("a", "b", "c")}
    want = Shard("w", ((1, 3), (0, 4)))
    assert [op.source for op in plan_shard(want, 2, sources).ops] == ["a"]
    assert [op.source for op in plan_shard(want, 2, sources, ["c", "a"]).ops] == ["c"]


def test_uncovered_region_is_named() -> None:
    sources = {0: Shard("w", ((0, 4), (0, 6))), 1: Shard("w", ((6, 8), (0, 6)))}
    with pytest.raises(LocalProtocolError, match=r"12 of the 48 elements .* missing w\[4:6, 0:6\]"):
        plan_shard(Shard.whole("w", (8, 6)), 2, sources)
    with pytest.raises(LocalProtocolError, match=r"the 0 source shard\(s\) of tensor 'v'"):
        plan_shard(Shard.whole("v", (2,)), 2, sources)


def test_scalar_and_empty_tensors() -> None:
    scalar = Shard.whole("s", ())
    plan = plan_shard(scalar, 8, {"p": scalar})
    assert plan.ops == (CopyOp("p", 0, 0, 8),)
    dest = np.zeros(1, np.float64)
    execute(plan, {"p": np.array(2.5)}, dest)
    assert dest[0] == 2.5
    empty = Shard.whole("e", (0, 3))
    assert plan_shard(empty, 4, {}).ops == ()


# -- bad input -------------------------------------------------------------------------


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(LocalProtocolError, match="equal parts"):
        split("w", (10, 4), 2, 0, 3)
    with pytest.raises(LocalProtocolError, match="do not add up"):
        split("w", (10, 4), 2, 0, [3, 3])
    with pytest.raises(LocalProtocolError, match="placement"):
        split("w", (10, 4), 2, 0, 2, placement=[0, 2])
    with pytest.raises(LocalProtocolError, match="not a dim"):
        TensorLayout("w", (4,), 2, 1, (4,), (0,))
    with pytest.raises(LocalProtocolError, match="places 4 ranks, the group has 2"):
        Layout(2, (column_parallel("w", (8, 8), 2, 4),))
    with pytest.raises(LocalProtocolError, match="rank 5"):
        column_parallel("w", (8, 8), 2, 4).shard(5)
    with pytest.raises(LocalProtocolError, match="start <= stop"):
        Shard("w", ((3, 1),))


def test_mismatched_dims_and_bad_buffers_are_refused() -> None:
    want = Shard.whole("w", (4, 4))
    with pytest.raises(LocalProtocolError, match="has 1 dims"):
        plan_shard(want, 1, {0: Shard("w", ((0, 16),))})
    plan = plan_shard(want, 1, {0: Shard.whole("w", (4, 4)), 1: Shard.whole("w", (4, 4))})
    good = np.arange(16, dtype=np.uint8)
    with pytest.raises(LocalProtocolError, match="needs 16"):
        execute(plan, {0: good}, np.zeros(15, np.uint8))
    with pytest.raises(LocalProtocolError, match="no buffer for source 0"):
        execute(plan, {1: good}, np.zeros(16, np.uint8))
    with pytest.raises(LocalProtocolError, match="outside the 8-byte source 0"):
        execute(plan, {0: good[:8]}, np.zeros(16, np.uint8))
    with pytest.raises(LocalProtocolError, match="not C-contiguous"):
        execute(plan, {0: good}, np.zeros((4, 8), np.uint8)[:, ::2])
    dest = np.zeros(16, np.uint8)
    execute(plan, {0: memoryview(good.tobytes())}, dest)
    assert (dest == good).all()
