"""Where a fetch lands: new arrays laid out like the version's byte space, or the
caller's ``into=`` arrays, checked before any byte moves."""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from operator import attrgetter, eq, is_
from typing import Any

import numpy as np

from ..dtypes import display, dtype_name, storage_dtype
from ..errors import LocalProtocolError
from ..manifest.manifest import Manifest
from ..manifest.table import TensorTable
from ..model import as_host_array
from ..torch import check_into, is_tensor
from ..transport.samehost.memory_files import fetch_buffer


def allocate_flat(manifest: Manifest) -> tuple[list[np.ndarray[Any, Any]], memoryview | None]:
    """New arrays for a fetch: views into one buffer laid out like the version's byte
    space, so every chunk lands with one ``recv_into`` however many tensors it spans.
    The buffer is shared memory (``fetch_buffer``), so same-host peers that fetch from us
    later map it instead of copying through the kernel; the memory of the last such
    buffer let go is reused.  Falls back to separate plain arrays if some tensor's offset
    does not suit its dtype."""
    if any(t.offset % storage_dtype(t.dtype).alignment for t in manifest.tensors):
        return [np.empty(t.shape, dtype=storage_dtype(t.dtype)) for t in manifest.tensors], None
    flat = fetch_buffer(manifest.total_bytes)
    arrays = [flat[t.offset:t.end].view(storage_dtype(t.dtype)).reshape(t.shape)
              for t in manifest.tensors]
    return arrays, memoryview(flat)  # type: ignore[arg-type]


_SHAPE = attrgetter("shape")
_DTYPE = attrgetter("dtype")
_CARRAY = attrgetter("flags.carray")
_NBYTES = attrgetter("nbytes")


def prepare_destination(manifest: Manifest, into: Any) -> list[np.ndarray[Any, Any]]:
    """The caller's ``into`` arrays in manifest order, checked before any byte moves.

    Plain numpy arrays of the right shape and dtype pass a handful of C-level passes
    over all of them (10,000 tensors: about 2.5 ms here, against 5-9 ms one by one);
    anything else, or any mismatch, goes through the per-tensor check, which names what
    is wrong."""
    if not hasattr(into, "keys"):
        raise LocalProtocolError("into= must be a mapping of tensor name -> array, or an "
                                 "nn.Module")
    table = manifest.table
    names = table.names
    given = _lookup(into, table)
    if given is None:
        wanted = set(names)
        extra = sorted(set(into.keys()) - wanted)
        missing = sorted(wanted - set(into.keys()))
        raise LocalProtocolError(
            f"into= does not match {manifest.key}: missing {missing[:5]}, unknown {extra[:5]}")
    _, dtypes = table.expected()
    if _plain_match(table, given):
        return disjoint(names, given, table.sizes())  # sizes follow from shapes and dtypes
    out = []
    for t, obj, dt in zip(manifest.tensors, given, dtypes, strict=True):
        if is_tensor(obj):
            check_into(t.name, obj, t.dtype, t.shape)
        arr = as_host_array(obj, t.name)
        if arr.shape != t.shape or arr.dtype != dt or dtype_name(arr.dtype) != dtype_name(dt):
            raise LocalProtocolError(
                f"into[{t.name!r}] is {display(dtype_name(arr.dtype) or arr.dtype.str)}"
                f"{list(arr.shape)}, {manifest.key} has {display(t.dtype)}{list(t.shape)}")
        if not arr.flags.writeable:
            raise LocalProtocolError(f"into[{t.name!r}] is read-only")
        out.append(arr)
    return disjoint(names, out)


def _lookup(into: Any, table: TensorTable) -> list[Any] | None:
    """``into``'s values in manifest order, or None unless its keys are exactly the
    tensors' names.  A plain dict with as many keys as there are (unique) names, each of
    them found, has no other key: no set of 10,000 keys to compare (0.2 ms).  Any other
    mapping's keys are compared first, as a ``defaultdict`` makes up a key it lacks."""
    names = table.names
    if len(into.keys()) != len(names) or (
            type(into) is not dict and not into.keys() >= table.index().keys()):
        return None
    try:
        return list(map(into.__getitem__, names))
    except KeyError:
        return None


def _plain_match(table: TensorTable, given: list[Any]) -> bool:
    """Whether ``given`` are plain numpy arrays of ``table``'s shapes and dtypes, each
    C-contiguous, aligned and writeable, in passes at C speed.

    Each pass streams (``all(map(...))``): the 10,000 shape tuples and flag objects it
    makes die one by one instead of piling up for the garbage collector.  A numpy dtype
    of a builtin type is one object however it was made: ``is`` first.
    ``flags.carray`` is C-contiguous, aligned and writeable in one look-up (an unaligned
    array takes the slow path, which accepts it)."""
    shapes, dtypes = table.expected()
    return (set(map(type, given)) <= {np.ndarray} and all(map(eq, map(_SHAPE, given), shapes))
            and (all(map(is_, map(_DTYPE, given), dtypes))
                 or all(map(eq, map(_DTYPE, given), dtypes)))
            and all(map(_CARRAY, given)) and table.plain_dtypes())


def _address(arr: np.ndarray[Any, Any]) -> int:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(arr))  # type: ignore[arg-type]
    except (TypeError, ValueError):  # dtypes that export no buffer (datetimes)
        return int(arr.__array_interface__["data"][0])


class _Checked:
    """The arrays last found disjoint, by identity and size: valid until one of them is
    garbage collected (an id can be reused only after its object is gone)."""

    def __init__(self, ids: list[int], sizes: list[int]) -> None:
        self.ids, self.sizes, self.valid = ids, sizes, True
        self.refs: list[weakref.ref[Any]] = []

    def dead(self, _ref: weakref.ref[Any]) -> None:
        self.valid = False


_last: _Checked | None = None
"""The last destination found disjoint.  A training loop fetches every step into the
same arrays; finding their addresses costs about 1.2 us an array (12 ms for 10,000),
so the same arrays, of the same sizes, all alive since, are not checked again.  (An
array's memory moves only through ``ndarray.resize``, which refuses while the ``into``
mapping holds the array.)"""


def disjoint(names: Sequence[str], arrays: list[np.ndarray[Any, Any]],
             sizes: list[int] | None = None) -> list[np.ndarray[Any, Any]]:
    """``arrays``, if no two share a byte (each is C-contiguous); else the fetch would
    land two tensors in the same memory, and its digests fail, blaming the holder.
    ``sizes``: their bytes, where the caller knows them already."""
    global _last
    ids = list(map(id, arrays))
    nbytes = list(map(_NBYTES, arrays)) if sizes is None else sizes
    last = _last
    if last is not None and last.valid and last.ids == ids and last.sizes == nbytes:
        return arrays
    _check_disjoint(names, arrays, np.array(nbytes, np.int64))
    checked = _Checked(ids, nbytes)
    dead = checked.dead  # one callback for all: not a bound method object per array
    try:
        checked.refs = [weakref.ref(a, dead) for a in arrays]
    except TypeError:  # not every array-like takes a weak reference: not remembered
        return arrays
    _last = checked
    return arrays


def _check_disjoint(names: Sequence[str], arrays: list[np.ndarray[Any, Any]],
                    sizes: np.ndarray[Any, Any]) -> None:
    keep = np.flatnonzero(sizes)
    if len(keep) < 2:
        return
    starts = np.fromiter((_address(arrays[i]) for i in keep.tolist()), np.uint64, len(keep))
    order = np.argsort(starts, kind="stable")
    ends = starts[order] + sizes[keep][order].astype(np.uint64)
    clash = np.flatnonzero(ends[:-1] > starts[order][1:])
    if len(clash):
        a, b = keep[order[clash[0]]], keep[order[clash[0] + 1]]
        raise LocalProtocolError(
            f"into[{names[a]!r}] and into[{names[b]!r}] "
            "share memory (the same array twice, or overlapping views of one buffer); "
            "every tensor needs memory of its own")
