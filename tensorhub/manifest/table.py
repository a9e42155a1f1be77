"""Columns of a tuple of tensor specs, computed once and shared by every manifest built
on that same tuple (see :class:`TensorTable`).  Nothing here performs I/O."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import storage_dtype
from ..model import TensorSpec, schema_id

CACHE_LOCK = threading.Lock()
"""Guards the caches of decoded and tabled specs: manifests are built and decoded in
worker threads too."""


class TensorTable:
    """What a fetch or a holder needs to know about a tuple of tensor specs, as columns
    computed once (lazily) and shared by every manifest built on that same tuple.

    Decoding caches the tuple by its wire columns (see :func:`_tensors_from_wire`), so
    each version of a model whose layout does not change shares one table: finding a
    chunk's tensors, checking ``into=`` arrays or naming the result costs no per-tensor
    Python work after the first time.  Positions in :attr:`nonempty` order are what the
    chunk spans use: empty tensors have no bytes and appear in no chunk."""

    def __init__(self, tensors: Sequence[TensorSpec]) -> None:
        self.tensors = tensors
        self._names: list[str] | None = None
        self._index: dict[str, int] | None = None
        self._nonempty: list[int] | None = None
        self._starts: np.ndarray[Any, Any] | None = None
        self._ends: np.ndarray[Any, Any] | None = None
        self._expected: tuple[list[tuple[int, ...]], list[np.dtype[Any]]] | None = None
        self._sizes: list[int] | None = None
        self._plain = False
        self._spans: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        self._exports: bool | None = None
        self._schema: bytes | None = None

    @property
    def names(self) -> list[str]:
        if self._names is None:
            self._names = [t.name for t in self.tensors]
        return self._names

    def index(self) -> dict[str, int]:
        """Tensor name -> position in the manifest."""
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        return self._index

    def _columns(self) -> None:
        n = len(self.tensors)
        offsets = np.fromiter((t.offset for t in self.tensors), np.int64, n)
        sizes = np.array(self.sizes(), np.int64)
        keep = np.flatnonzero(sizes)
        self._nonempty = keep.tolist()
        self._starts = offsets[keep]
        self._ends = self._starts + sizes[keep]

    @property
    def nonempty(self) -> list[int]:
        """Positions of the tensors that have bytes, in manifest (and offset) order."""
        if self._nonempty is None:
            self._columns()
        assert self._nonempty is not None
        return self._nonempty

    @property
    def schema_id(self) -> bytes:
        """:func:`~tensorhub.model.schema_id` of these specs."""
        if self._schema is None:
            self._schema = schema_id(self.tensors)
        return self._schema

    def exports_buffers(self) -> bool:
        """Whether arrays of every dtype here export their memory as a buffer (numbers
        and bools do; datetimes, for one, do not)."""
        if self._exports is None:
            self._exports = all(storage_dtype(d).kind in "biufc" for d in {t.dtype for t in
                                                                      self.tensors})
        return self._exports

    def expected(self) -> tuple[list[tuple[int, ...]], list[np.dtype[Any]]]:
        """Every tensor's shape and numpy dtype, in manifest order."""
        if self._expected is None:
            dtypes: dict[str, np.dtype[Any]] = {}
            out = []
            for t in self.tensors:
                dt = dtypes.get(t.dtype)
                if dt is None:
                    dt = dtypes[t.dtype] = storage_dtype(t.dtype)
                out.append(dt)
            self._expected = ([t.shape for t in self.tensors], out)
            self._plain = not any(d.hasobject or d.metadata for d in dtypes.values())
        return self._expected

    def plain_dtypes(self) -> bool:
        """Whether no dtype here holds Python objects or carries metadata."""
        self.expected()
        return self._plain

    def sizes(self) -> list[int]:
        """Every tensor's bytes, in manifest order."""
        if self._sizes is None:
            self._sizes = [t.nbytes for t in self.tensors]
        return self._sizes

    def spans(self, chunk_size: int, total: int) -> tuple[list[int], list[int]]:
        """Per chunk, ``lo`` and ``hi``: the chunk overlaps exactly the tensors at
        positions ``nonempty[lo:hi]`` (one ``searchsorted`` for all chunks)."""
        got = self._spans.get((chunk_size, total))
        if got is None:
            if self._nonempty is None:
                self._columns()
            assert self._starts is not None and self._ends is not None
            bounds = np.arange(0, total, chunk_size, dtype=np.int64)
            lo = np.searchsorted(self._ends, bounds, "right")
            hi = np.searchsorted(self._starts, np.minimum(bounds + chunk_size, total), "left")
            got = self._spans[(chunk_size, total)] = (lo.tolist(), hi.tolist())
        return got

    def first_ending_after(self, offset: int) -> int:
        """Position in :attr:`nonempty` of the first tensor that ends after ``offset``."""
        if self._ends is None:
            self._columns()
        assert self._ends is not None
        return int(np.searchsorted(self._ends, offset, "right"))

    def piece_bounds(self, lo: int, hi: int) -> tuple[int, int]:
        """Where the first of ``nonempty[lo:hi]`` starts and the last ends (bytes)."""
        assert self._starts is not None and self._ends is not None
        return int(self._starts[lo]), int(self._ends[hi - 1])


_TABLES: OrderedDict[int, tuple[Sequence[TensorSpec], TensorTable]] = OrderedDict()
_TABLES_KEPT = 32


def table_of(tensors: Sequence[TensorSpec]) -> TensorTable:
    """The shared :class:`TensorTable` of this very tuple of specs (by identity: the cache
    keeps the tuple alive, so its id cannot be reused while it is cached)."""
    with CACHE_LOCK:  # manifests are also built in worker threads (publish)
        hit = _TABLES.get(id(tensors))
        if hit is not None and hit[0] is tensors:
            _TABLES.move_to_end(id(tensors))
            return hit[1]
        table = TensorTable(tensors)
        _TABLES[id(tensors)] = (tensors, table)
        if len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
        return table


SpecRow = tuple[str, str, tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]
"""A tensor spec's fields: name, dtype, shape, offset, global shape, start."""
_BUILT: OrderedDict[tuple[str, int, bytes], tuple[list[SpecRow], tuple[TensorSpec, ...]]] = \
    OrderedDict()
_BUILT_KEPT = 16


def built_specs(place: tuple[str, int, bytes], rows: list[SpecRow]) -> tuple[TensorSpec, ...]:
    """The specs of ``rows``, for a manifest built here of ``place`` (model, shard,
    layout): the very tuple the last build of that place made when its rows were the
    same.  A publisher's next version of a model lists the same tensors, so its
    manifest shares the specs, and their :class:`TensorTable`, with the last one's, as
    a decoded manifest does (:func:`~tensorhub.manifest.manifest._tensors_from_wire`).

    Before, every publish made a spec object per tensor, and the table cache kept the
    last 32 tuples alive: a publisher of 10,000 tensors held 320,000 objects that the
    garbage collector walked in every full collection, which then took 25-45 ms, with
    the event loop and every serving thread stopped."""
    with CACHE_LOCK:
        hit = _BUILT.get(place)
        if hit is not None and hit[0] == rows:
            _BUILT.move_to_end(place)
            return hit[1]
    specs = tuple(TensorSpec(*row) for row in rows)
    with CACHE_LOCK:
        _BUILT[place] = (rows, specs)
        _BUILT.move_to_end(place)
        if len(_BUILT) > _BUILT_KEPT:
            _BUILT.popitem(last=False)
    return specs
