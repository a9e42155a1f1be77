"""Layouts and resharding plans: which slice of a tensor each rank holds, and how to
assemble the slice one rank wants from the slices other ranks hold.

Theory of operation
-------------------
A *shard* is a hyper-rectangle of one tensor: a half-open index range per dimension.
A holder stores each shard alone in its own C-contiguous buffer, so the local array
has the rectangle's shape, and global element ``(i0, i1, ...)`` sits at byte
``sum((i_k - start_k) * stride_k)`` of that buffer (byte strides of the local shape).

A *layout* says, for each tensor of a model and each rank of a group, which shard the
rank holds: the whole tensor (replicated) or one part of a split along one dimension,
in equal or given part sizes.  Tensor-parallel engines use two cases of the split on
``[out, in]`` weights: column-parallel layers split dim 0, row-parallel ones dim 1.
``placement`` maps ranks to parts, so a rank may hold no part (another pipeline stage)
and several ranks may hold the same part (data-parallel replicas).

A *plan* assembles one wanted shard from source shards, each source named by a key the
caller chooses.  Sources that intersect the wanted shard are ranked -- the caller's
preference order first, then the largest overlap, then the smallest source (an exact
match beats a replicated superset), then the caller's order -- and each in turn claims
what it intersects of the still-uncovered region.  That region is kept as disjoint
boxes (box difference), so every wanted element is copied exactly once; anything left
at the end is reported as missing.

Each claimed box becomes one :class:`CopyOp`: a run of ``length`` contiguous bytes
repeated over nested ``counts`` with a byte stride per level in the source and in the
destination buffer.  Dimensions the box spans fully in both buffers fold into the run,
and levels that line up merge, so a plan never has more runs than the buffers force: a
dim-0 split moves whole buffers, a dim-1 split one run per row.  ``CopyOp.runs()``
lists the runs as explicit ``(src_start, dst_start, length)`` byte ranges for a data
plane that wants ranges; :func:`execute` is the reference executor on numpy buffers.
Nothing here performs I/O or reads a clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any, Generic, TypeVar

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..errors import LocalProtocolError

K = TypeVar("K", bound=Hashable)
Box = tuple[tuple[int, int], ...]
Buffer = np.ndarray[Any, Any] | memoryview | bytes | bytearray

REPLICATED = -1
"""``TensorLayout.dim`` of a tensor that every holder keeps whole."""

_MAX_LISTED = 8  # missing regions named in a coverage error


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Shard:
    """A hyper-rectangle of tensor ``tensor``: ``(start, stop)`` per dimension."""

    tensor: str
    ranges: Box

    def __post_init__(self) -> None:
        if not all(
            isinstance(r, tuple) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1])
            and 0 <= r[0] <= r[1]
            for r in self.ranges
        ):
            raise LocalProtocolError(
                f"shard of {self.tensor!r}: ranges must be (start, stop) int pairs with "
                f"0 <= start <= stop, got {self.ranges!r}"
            )

    @classmethod
    def whole(cls, tensor: str, shape: Sequence[int]) -> Shard:
        """The shard covering all of a tensor of global ``shape``."""
        return cls(tensor, tuple((0, n) for n in shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.ranges)

    @property
    def size(self) -> int:
        """Number of elements."""
        return prod(self.shape)

    def __str__(self) -> str:
        return f"{self.tensor}[{', '.join(f'{a}:{b}' for a, b in self.ranges)}]"


@dataclass(frozen=True)
class TensorLayout:
    """How one tensor of global ``shape`` is placed over the ranks of a group.

    ``dim`` is the split dimension (or :data:`REPLICATED`), ``parts`` the part sizes
    along it (empty when replicated), and ``placement[rank]`` the index of the part
    that rank holds, -1 for none (a replicated tensor has the one part 0).
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    dim: int
    parts: tuple[int, ...]
    placement: tuple[int, ...]

    def __post_init__(self) -> None:
        problem = ""
        if not all(_is_int(n) and n >= 0 for n in self.shape):
            problem = f"shape {self.shape!r} must be non-negative ints"
        elif not _is_int(self.itemsize) or self.itemsize <= 0:
            problem = f"itemsize {self.itemsize!r} must be a positive int"
        elif self.dim == REPLICATED:
            if self.parts:
                problem = "a replicated tensor has no parts"
        elif not _is_int(self.dim) or not 0 <= self.dim < len(self.shape):
            problem = f"split dim {self.dim!r} is not a dim of shape {self.shape}"
        elif not all(_is_int(p) and p >= 0 for p in self.parts):
            problem = f"part sizes {self.parts!r} must be non-negative ints"
        elif sum(self.parts) != self.shape[self.dim]:
            problem = f"part sizes {self.parts} do not add up to dim {self.dim} of {self.shape}"
        nparts = 1 if self.dim == REPLICATED else len(self.parts)
        if not problem and not all(_is_int(p) and -1 <= p < nparts for p in self.placement):
            problem = f"placement {self.placement!r} must name parts 0..{nparts - 1} or -1"
        if problem:
            raise LocalProtocolError(f"layout of tensor {self.name!r}: {problem}")

    def shard(self, rank: int) -> Shard | None:
        """The shard ``rank`` holds, or None if it holds none of this tensor."""
        if not 0 <= rank < len(self.placement):
            raise LocalProtocolError(f"rank {rank} is not in a group of {len(self.placement)}")
        part = self.placement[rank]
        if part < 0:
            return None
        whole = Shard.whole(self.name, self.shape)
        if self.dim == REPLICATED:
            return whole
        start = sum(self.parts[:part])
        ranges = list(whole.ranges)
        ranges[self.dim] = (start, start + self.parts[part])
        return Shard(self.name, tuple(ranges))


def replicated(name: str, shape: Sequence[int], itemsize: int, ranks: int) -> TensorLayout:
    """Every one of ``ranks`` ranks holds the whole tensor."""
    return TensorLayout(name, tuple(shape), itemsize, REPLICATED, (), (0,) * ranks)


def split(
    name: str,
    shape: Sequence[int],
    itemsize: int,
    dim: int,
    parts: int | Sequence[int],
    placement: Sequence[int] | None = None,
) -> TensorLayout:
    """Split along ``dim`` into ``parts`` equal parts, or parts of the given sizes.

    By default rank ``i`` holds part ``i``; ``placement`` overrides that (see
    :class:`TensorLayout`).
    """
    shape = tuple(shape)
    if isinstance(parts, int):
        if parts <= 0 or not 0 <= dim < len(shape) or shape[dim] % parts:
            raise LocalProtocolError(
                f"cannot split dim {dim} of tensor {name!r} {shape} into {parts} equal "
                "parts; pass the part sizes instead"
            )
        sizes = (shape[dim] // parts,) * parts
    else:
        sizes = tuple(parts)
    place = tuple(range(len(sizes))) if placement is None else tuple(placement)
    return TensorLayout(name, shape, itemsize, dim, sizes, place)


def column_parallel(name: str, shape: Sequence[int], itemsize: int, tp: int) -> TensorLayout:
    """A column-parallel linear's ``[out, in]`` weight (or ``[out]`` bias): split dim 0."""
    return split(name, shape, itemsize, 0, tp)


def row_parallel(name: str, shape: Sequence[int], itemsize: int, tp: int) -> TensorLayout:
    """A row-parallel linear's ``[out, in]`` weight: split dim 1."""
    return split(name, shape, itemsize, 1, tp)


@dataclass(frozen=True)
class Layout:
    """Where every tensor of a model lives over the ``size`` ranks of one group."""

    size: int
    tensors: tuple[TensorLayout, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise LocalProtocolError("layout names a tensor twice")
        for t in self.tensors:
            if len(t.placement) != self.size:
                raise LocalProtocolError(
                    f"layout of tensor {t.name!r} places {len(t.placement)} ranks, "
                    f"the group has {self.size}"
                )

    def shards(self, rank: int) -> tuple[Shard, ...]:
        """The shards ``rank`` holds, in tensor order."""
        return tuple(s for t in self.tensors if (s := t.shard(rank)) is not None)

    def holdings(self) -> dict[tuple[int, str], Shard]:
        """Every ``(rank, tensor name) -> shard`` of the group: ready as plan sources."""
        return {(r, s.tensor): s for r in range(self.size) for s in self.shards(r)}


@dataclass(frozen=True)
class CopyOp(Generic[K]):
    """Bytes to copy from the buffer of source shard ``source`` into the destination.

    ``prod(counts)`` runs of ``length`` bytes; run ``(j0, j1, ...)`` starts at byte
    ``src_offset + sum(j_k * src_strides[k])`` of the source buffer and at byte
    ``dst_offset + sum(j_k * dst_strides[k])`` of the destination buffer.
    """

    source: K
    src_offset: int
    dst_offset: int
    length: int
    counts: tuple[int, ...] = ()
    src_strides: tuple[int, ...] = ()
    dst_strides: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.length * prod(self.counts)

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """The contiguous runs as ``(src_start, dst_start, length)``, destination order."""
        for idx in itertools.product(*map(range, self.counts)):
            yield (
                self.src_offset + sum(j * s for j, s in zip(idx, self.src_strides, strict=True)),
                self.dst_offset + sum(j * s for j, s in zip(idx, self.dst_strides, strict=True)),
                self.length,
            )


@dataclass(frozen=True)
class ShardPlan(Generic[K]):
    """How to assemble shard ``want`` (stored C-contiguous) from source shards."""

    want: Shard
    itemsize: int
    ops: tuple[CopyOp[K], ...]

    @property
    def nbytes(self) -> int:
        """Size of the destination buffer."""
        return self.want.size * self.itemsize


def plan_shard(
    want: Shard, itemsize: int, sources: Mapping[K, Shard], prefer: Sequence[K] = ()
) -> ShardPlan[K]:
    """Plan ``want`` from ``sources`` (shards of other tensors are ignored).

    ``prefer`` lists source keys to use first, best first.  Raises
    :class:`LocalProtocolError` naming the regions no source covers.
    """
    candidates = [(k, s) for k, s in sources.items() if s.tensor == want.tensor]
    return _plan(want, itemsize, candidates, {k: i for i, k in enumerate(prefer)})


def plan_rank(
    layout: Layout, rank: int, sources: Mapping[K, Shard], prefer: Sequence[K] = ()
) -> dict[str, ShardPlan[K]]:
    """Plans for every shard that ``rank`` of the fetching ``layout`` holds, by tensor."""
    by_tensor: dict[str, list[tuple[K, Shard]]] = {}
    for key, shard in sources.items():
        by_tensor.setdefault(shard.tensor, []).append((key, shard))
    order = {k: i for i, k in enumerate(prefer)}
    plans: dict[str, ShardPlan[K]] = {}
    for t in layout.tensors:
        want = t.shard(rank)
        if want is not None:
            plans[t.name] = _plan(want, t.itemsize, by_tensor.get(t.name, []), order)
    return plans


def _plan(
    want: Shard, itemsize: int, candidates: list[tuple[K, Shard]], order: Mapping[K, int]
) -> ShardPlan[K]:
    if not _is_int(itemsize) or itemsize <= 0:
        raise LocalProtocolError(f"itemsize {itemsize!r} must be a positive int")
    ranked: list[tuple[int, int, int, int, K, Shard]] = []
    for pos, (key, src) in enumerate(candidates):
        if len(src.ranges) != len(want.ranges):
            raise LocalProtocolError(
                f"source {key!r} holds {src}, which has {len(src.ranges)} dims; "
                f"the wanted {want} has {len(want.ranges)}"
            )
        overlap = _intersect(want.ranges, src.ranges)
        if overlap is not None:
            ranked.append(
                (order.get(key, len(order)), -_volume(overlap), src.size, pos, key, src)
            )
    ranked.sort(key=lambda r: r[:4])
    uncovered = [want.ranges] if want.size else []
    ops: list[CopyOp[K]] = []
    for *_, key, src in ranked:
        left: list[Box] = []
        for box in uncovered:
            part = _intersect(box, src.ranges)
            if part is None:
                left.append(box)
            else:
                ops.append(_copy_op(key, src.ranges, want.ranges, part, itemsize))
                left.extend(_subtract(box, part))
        uncovered = left
        if not uncovered:
            break
    if uncovered:
        listed = ", ".join(str(Shard(want.tensor, b)) for b in uncovered[:_MAX_LISTED])
        more = f" and {len(uncovered) - _MAX_LISTED} more" if len(uncovered) > _MAX_LISTED else ""
        raise LocalProtocolError(
            f"the {len(candidates)} source shard(s) of tensor {want.tensor!r} do not cover "
            f"{sum(map(_volume, uncovered))} of the {want.size} elements of {want}: "
            f"missing {listed}{more}"
        )
    ops.sort(key=lambda op: op.dst_offset)
    return ShardPlan(want, itemsize, tuple(ops))


def _volume(box: Box) -> int:
    return prod(stop - start for start, stop in box)


def _intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, None if it holds no element."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        start, stop = max(a0, b0), min(a1, b1)
        if start >= stop:
            return None
        out.append((start, stop))
    return tuple(out)


def _subtract(box: Box, hole: Box) -> list[Box]:
    """Disjoint boxes covering ``box`` minus ``hole`` (which lies inside ``box``).

    Slabs are cut along the outer dimensions first: those are contiguous in memory.
    """
    out: list[Box] = []
    rest = list(box)
    for d, ((b0, b1), (h0, h1)) in enumerate(zip(box, hole, strict=True)):
        if b0 < h0:
            out.append((*rest[:d], (b0, h0), *rest[d + 1 :]))
        if h1 < b1:
            out.append((*rest[:d], (h1, b1), *rest[d + 1 :]))
        rest[d] = (h0, h1)
    return out


def _byte_strides(box: Box, itemsize: int) -> list[int]:
    """Byte strides of a C-contiguous array of the box's shape."""
    strides: list[int] = []
    step = itemsize
    for start, stop in reversed(box):
        strides.append(step)
        step *= stop - start
    return strides[::-1]


def _copy_op(key: K, src: Box, dst: Box, box: Box, itemsize: int) -> CopyOp[K]:
    """The op moving ``box`` from a source buffer holding ``src`` into one holding ``dst``."""
    src_strides, dst_strides = _byte_strides(src, itemsize), _byte_strides(dst, itemsize)
    src_offset = sum((b[0] - s[0]) * k for b, s, k in zip(box, src, src_strides, strict=True))
    dst_offset = sum((b[0] - d[0]) * k for b, d, k in zip(box, dst, dst_strides, strict=True))
    levels = [
        (stop - start, s, d)
        for (start, stop), s, d in zip(box, src_strides, dst_strides, strict=True)
        if stop - start > 1
    ]
    length = itemsize
    while levels and levels[-1][1] == length == levels[-1][2]:  # contiguous in both
        length *= levels.pop()[0]
    merged: list[tuple[int, int, int]] = []
    for count, s, d in levels:
        if merged and merged[-1][1] == count * s and merged[-1][2] == count * d:
            merged[-1] = (merged[-1][0] * count, s, d)
        else:
            merged.append((count, s, d))
    return CopyOp(key, src_offset, dst_offset, length, *map(tuple, zip(*merged, strict=True)))


def execute(plan: ShardPlan[K], sources: Mapping[K, Buffer], dest: np.ndarray[Any, Any]) -> None:
    """Run ``plan``: copy from each source's shard buffer into ``dest`` (C-contiguous)."""
    dst = _bytes_of(dest, "destination")
    if not dst.flags.writeable:
        raise LocalProtocolError("destination buffer is read-only")
    if dst.size != plan.nbytes:
        raise LocalProtocolError(
            f"destination holds {dst.size} bytes; {plan.want} needs {plan.nbytes}"
        )
    for op in plan.ops:
        if op.source not in sources:
            raise LocalProtocolError(f"no buffer for source {op.source!r} of {plan.want}")
        src = _bytes_of(sources[op.source], f"source {op.source!r}")
        shape = (*op.counts, op.length)
        _check_extent(op.src_offset, op.src_strides, shape, src.size, f"source {op.source!r}")
        _check_extent(op.dst_offset, op.dst_strides, shape, dst.size, "destination")
        src_view = as_strided(src[op.src_offset :], shape, (*op.src_strides, 1), writeable=False)
        as_strided(dst[op.dst_offset :], shape, (*op.dst_strides, 1))[...] = src_view


def _bytes_of(buf: Buffer, what: str) -> np.ndarray[Any, Any]:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise LocalProtocolError(f"{what} buffer is not C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _check_extent(
    offset: int, strides: tuple[int, ...], shape: tuple[int, ...], size: int, what: str
) -> None:
    """Refuse an op that would touch bytes outside a buffer (``as_strided`` would not)."""
    reach = [(n - 1) * s for n, s in zip(shape, (*strides, 1), strict=True)]
    low = offset + sum(r for r in reach if r < 0)
    high = offset + sum(r for r in reach if r > 0) + 1
    if low < 0 or high > size:
        raise LocalProtocolError(
            f"copy op reaches bytes [{low}, {high}) outside the {size}-byte {what} buffer"
        )
