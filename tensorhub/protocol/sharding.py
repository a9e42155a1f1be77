"""Sharding: how the ranks of one group split a model's tensors, as a user states it.

Theory of operation
-------------------
A :class:`Sharding` is what one process says about itself: "I am rank ``rank`` of a
group of ``size``, tensors matching these name patterns are split along this dimension
(into equal parts, or parts of these sizes), every other tensor is replicated".  It is
the user-facing form of :mod:`.layout`: resolved against a tensor's global shape it
gives the :class:`~.layout.Shard` a rank holds; resolved against the *local* slice a
publishing rank passes it gives the global shape and where the slice starts.

Rank ``k`` holds part ``k`` of every split tensor -- the tensor-parallel convention:
column-parallel weights split dim 0, row-parallel ones dim 1.  Patterns are
:func:`fnmatch.fnmatchcase` patterns; the first that matches a name wins.

Every rank of one group passes the same ``size``, ``split`` and ``parts``; only ``rank``
differs.  :attr:`Sharding.layout_id` digests exactly those three, so two groups with the
same sharding share an id (and read whole slices from each other), and the trivial
sharding (``size == 1``: every tensor whole) has the empty id, the layout of a version
published by a single process.  Nothing here performs I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import msgpack

from ..errors import LocalProtocolError
from ..model import VersionKey
from .layout import Box, Shard

LAYOUT_ID_BYTES = 12


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Sharding:
    """Rank ``rank`` of a group of ``size`` that splits tensors as ``split`` says.

    ``split`` maps name patterns to the dimension they are split along; ``parts`` maps
    name patterns to explicit part sizes (one per rank) for tensors that do not split
    evenly.  Mappings are accepted and kept as tuples, in their order (the first
    pattern that matches a name decides).
    """

    rank: int = 0
    size: int = 1
    split: tuple[tuple[str, int], ...] | Mapping[str, int] = ()
    parts: tuple[tuple[str, tuple[int, ...]], ...] | Mapping[str, Sequence[int]] = ()

    def __post_init__(self) -> None:
        split = self.split.items() if isinstance(self.split, Mapping) else self.split
        parts = self.parts.items() if isinstance(self.parts, Mapping) else self.parts
        try:
            split_t = tuple((str(p), d) for p, d in split)
            parts_t = tuple((str(p), tuple(sizes)) for p, sizes in parts)
        except (TypeError, ValueError):
            raise LocalProtocolError(
                "split must map name patterns to dims, parts name patterns to part sizes"
            ) from None
        object.__setattr__(self, "split", split_t)
        object.__setattr__(self, "parts", parts_t)
        if not _is_int(self.size) or self.size < 1:
            raise LocalProtocolError(f"group size must be an int >= 1, got {self.size!r}")
        if not _is_int(self.rank) or not 0 <= self.rank < self.size:
            raise LocalProtocolError(f"rank {self.rank!r} is not in a group of {self.size}")
        for pattern, dim in split_t:
            if not _is_int(dim) or dim < 0:
                raise LocalProtocolError(f"split dim of {pattern!r} must be an int >= 0")
        for pattern, sizes in parts_t:
            if len(sizes) != self.size or not all(_is_int(n) and n >= 0 for n in sizes):
                raise LocalProtocolError(
                    f"parts of {pattern!r} must be {self.size} sizes >= 0, got {list(sizes)}")

    # -- identity -------------------------------------------------------------------

    @property
    def layout_id(self) -> bytes:
        """Digest of the group's sharding (not of the rank); empty for ``size == 1``."""
        if self.size == 1:
            return b""
        data = msgpack.packb([self.size, [list(s) for s in self._split],
                              [[p, list(n)] for p, n in self._parts]], use_bin_type=True)
        return hashlib.sha256(b"tensorhub-layout\0" + data).digest()[:LAYOUT_ID_BYTES]

    def key(self, model: str, version: int) -> VersionKey:
        """The key ``model@version`` is held under with this sharding: this rank's shard
        of the group's layout (shard 0 and the empty layout id when whole)."""
        return VersionKey(model, version, self.rank if self.size > 1 else 0, self.layout_id)

    def at(self, rank: int) -> Sharding:
        """The same sharding seen by another rank of the group."""
        return Sharding(rank, self.size, self._split, self._parts)

    @property
    def _split(self) -> tuple[tuple[str, int], ...]:
        return self.split  # type: ignore[return-value]

    @property
    def _parts(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return self.parts  # type: ignore[return-value]

    # -- resolution ------------------------------------------------------------------

    def dim_of(self, name: str) -> int | None:
        """The dimension ``name`` is split along, None if replicated."""
        if self.size == 1:
            return None
        for pattern, dim in self._split:
            if fnmatchcase(name, pattern):
                return dim
        return None

    def part_sizes(self, name: str, length: int) -> tuple[int, ...]:
        """Part sizes of tensor ``name`` whose split dimension has ``length`` elements."""
        for pattern, sizes in self._parts:
            if fnmatchcase(name, pattern):
                if sum(sizes) != length:
                    raise LocalProtocolError(
                        f"parts {list(sizes)} of tensor {name!r} add up to {sum(sizes)}, "
                        f"its split dim has {length}")
                return sizes
        if length % self.size:
            raise LocalProtocolError(
                f"tensor {name!r}: {length} elements do not split into {self.size} equal "
                f"parts; give its part sizes in Sharding.parts")
        return (length // self.size,) * self.size

    def box(self, name: str, global_shape: Sequence[int]) -> Box:
        """The region of tensor ``name`` (of ``global_shape``) this rank holds."""
        shape = tuple(global_shape)
        dim = self.dim_of(name)
        box = [(0, n) for n in shape]
        if dim is not None:
            if dim >= len(shape):
                raise LocalProtocolError(
                    f"tensor {name!r} of shape {list(shape)} has no dim {dim} to split")
            sizes = self.part_sizes(name, shape[dim])
            start = sum(sizes[: self.rank])
            box[dim] = (start, start + sizes[self.rank])
        return tuple(box)

    def shard(self, name: str, global_shape: Sequence[int]) -> Shard:
        return Shard(name, self.box(name, global_shape))

    def place(self, name: str, local_shape: Sequence[int]
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """For a publishing rank: the global shape of tensor ``name`` and where this
        rank's slice of ``local_shape`` starts in it (both empty when replicated)."""
        local = tuple(local_shape)
        dim = self.dim_of(name)
        if dim is None:
            return (), ()
        if dim >= len(local):
            raise LocalProtocolError(
                f"tensor {name!r} of shape {list(local)} has no dim {dim} to split")
        sizes: tuple[int, ...] | None = None
        for pattern, given in self._parts:
            if fnmatchcase(name, pattern):
                sizes = given
                break
        if sizes is None:
            sizes = (local[dim],) * self.size
        if sizes[self.rank] != local[dim]:
            raise LocalProtocolError(
                f"tensor {name!r}: rank {self.rank} passes {local[dim]} elements along dim "
                f"{dim}, the sharding gives it {sizes[self.rank]}")
        global_shape = list(local)
        global_shape[dim] = sum(sizes)
        start = [0] * len(local)
        start[dim] = sum(sizes[: self.rank])
        return tuple(global_shape), tuple(start)

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "size": self.size, "split": dict(self._split),
                "parts": {p: list(n) for p, n in self._parts}}


WHOLE = Sharding()
"""The trivial sharding: one process holds every tensor whole."""
