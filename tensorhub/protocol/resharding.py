"""Resharding: what a fetcher in one layout needs from the shards of another.

Theory of operation
-------------------
A version published by ``world`` ranks is ``world`` manifests, one per publish shard;
each lists the slices that rank holds (local shape, global shape, start).  A fetcher
that declares its own :class:`~.sharding.Sharding` wants, per tensor, the region its
rank holds.  :func:`plan_reshard` reads the publish manifests and returns

* the fetcher's own tensor specs -- its slices laid end to end, in the order the
  tensors first appear in shards ``0..world-1`` -- so every fetcher of one layout and
  rank derives the same manifest, and so the same manifest id, from the same publish;
* per tensor, a :class:`~.layout.ShardPlan` whose copy ops name a source shard index;
* per source shard, the chunks that hold any byte those ops read (the extent of each
  op, rounded out to chunks).  The data plane fetches exactly those chunks, verifies
  each against its digest, and then runs the ops.

The publish manifests must agree on every tensor's dtype and global shape, and their
slices must cover what the fetcher wants; otherwise :class:`ConsistencyError` (ranks
disagree) or :class:`LocalProtocolError` (the layout asks for a tensor or region the
publish does not have) says what is wrong.  Nothing here performs I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..dtypes import display, storage_dtype
from ..errors import ConsistencyError, LocalProtocolError
from ..manifest.manifest import Manifest
from ..model import TensorSpec
from .layout import Shard, ShardPlan, plan_shard
from .sharding import Sharding


@dataclass(frozen=True)
class ReshardPlan:
    tensors: tuple[TensorSpec, ...]
    """The fetcher's slices, laid end to end (offsets in its own byte space)."""
    plans: dict[str, ShardPlan[int]]
    """How to assemble each of those slices; op sources are publish shard indices."""
    chunks: dict[int, tuple[int, ...]]
    """Per publish shard, the chunks the ops read from."""

    @property
    def fetch_bytes(self) -> int:
        return sum(len(c) for c in self.chunks.values())


def plan_reshard(spec: Sharding, shards: Mapping[int, Manifest]) -> ReshardPlan:
    """Plan rank ``spec.rank`` of ``spec``'s slices from publish manifests by shard."""
    order: list[str] = []
    info: dict[str, tuple[str, tuple[int, ...]]] = {}
    sources: dict[str, dict[int, Shard]] = {}
    where: dict[tuple[int, str], TensorSpec] = {}
    for s in sorted(shards):
        for t in shards[s].tensors:
            seen = info.get(t.name)
            if seen is None:
                info[t.name] = (t.dtype, t.full_shape)
                order.append(t.name)
            elif seen != (t.dtype, t.full_shape):
                raise ConsistencyError(
                    f"publish shards disagree on tensor {t.name!r}: "
                    f"{display(seen[0])}{list(seen[1])} vs {display(t.dtype)}"
                    f"{list(t.full_shape)} (shard {s})")
            sources.setdefault(t.name, {})[s] = Shard(t.name, t.box)
            where[(s, t.name)] = t
    tensors: list[TensorSpec] = []
    plans: dict[str, ShardPlan[int]] = {}
    needed: dict[int, set[int]] = {}
    offset = 0
    for name in order:
        dtype, gshape = info[name]
        want = spec.shard(name, gshape)
        itemsize = storage_dtype(dtype).itemsize
        plan = plan_shard(want, itemsize, sources[name])
        plans[name] = plan
        gs: tuple[int, ...] = ()
        start: tuple[int, ...] = ()
        if spec.dim_of(name) is None:
            pass
        else:
            gs, start = gshape, tuple(a for a, _ in want.ranges)
        spec_t = TensorSpec(name, dtype, want.shape, offset, gs, start)
        tensors.append(spec_t)
        offset += spec_t.nbytes
        for op in plan.ops:
            src = where[(op.source, name)]
            low, high = _extent(op.src_offset, op.src_strides, op.counts, op.length)
            m = shards[op.source]
            first = (src.offset + low) // m.chunk_size
            last = (src.offset + high - 1) // m.chunk_size
            needed.setdefault(op.source, set()).update(range(first, last + 1))
    return ReshardPlan(tuple(tensors), plans,
                       {s: tuple(sorted(c)) for s, c in sorted(needed.items())})


def _extent(offset: int, strides: tuple[int, ...], counts: tuple[int, ...],
            length: int) -> tuple[int, int]:
    """The byte range ``[low, high)`` a copy op touches in its source buffer."""
    reach = [(n - 1) * st for n, st in zip(counts, strides, strict=True)]
    low = offset + sum(r for r in reach if r < 0)
    high = offset + sum(r for r in reach if r > 0) + length
    if low < 0:
        raise LocalProtocolError(f"copy op reaches byte {low} before its source buffer")
    return low, high
