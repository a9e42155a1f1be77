"""safetensors files as TensorHub versions: served from a read-only mmap, written back.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(per tensor: ``dtype``, ``shape``, ``data_offsets`` ``[begin, end)`` relative to the
data section; optionally ``__metadata__``, a str -> str map), then the data section.
:func:`map_safetensors` parses the header itself and returns numpy views into a
read-only mmap of the file: publishing them copies nothing, and the page cache is the
only copy in memory.  :func:`write_safetensors` streams fetched arrays to a file that
``safetensors.safe_open`` reads back equal (written to a temporary name, then renamed).

Dtypes numpy has no type for (``BF16``, ``F8_E4M3``, ``F8_E5M2``) are viewed as their
raw bits tagged with the real type (:mod:`tensorhub.dtypes`): the manifest names the
real type, readers get it back, and a file written from them says it again.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import dtype_name, storage_dtype
from ..errors import LocalProtocolError

DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
          "I16": "<i2", "I8": "|i1", "U64": "<u8", "U32": "<u4", "U16": "<u2",
          "U8": "|u1", "BOOL": "|b1", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2"}
"""safetensors dtype names and the manifest dtypes they are: a little-endian numpy
``dtype.str`` (as on disk), or an extended name of :mod:`tensorhub.dtypes`."""
_CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20
"""The header size safetensors itself refuses beyond (100 MB)."""


@dataclass
class MappedFile:
    """A safetensors file mapped read-only: ``tensors`` are views into ``mm``.

    :meth:`close` drops the views and unmaps; call it only once nothing serves them
    (unpublish first)."""

    path: Path
    tensors: dict[str, np.ndarray[Any, Any]]
    metadata: dict[str, str]
    mm: mmap.mmap | None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tensors.values())

    def close(self) -> None:
        self.tensors = {}
        if self.mm is not None:
            # BufferError: a view is still held elsewhere; unmapped when it goes.
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None


def _bad(path: Path, why: str) -> LocalProtocolError:
    return LocalProtocolError(f"{path}: not a valid safetensors file: {why}")


def _dtype(path: Path, name: str, code: object) -> np.dtype[Any]:
    if not isinstance(code, str) or code not in DTYPES:
        raise _bad(path, f"tensor {name!r} has unknown dtype {code!r}")
    return storage_dtype(DTYPES[code])


def parse_header(path: Path, head: bytes | mmap.mmap, size: int
                 ) -> tuple[int, dict[str, tuple[np.dtype[Any], tuple[int, ...], int]],
                            dict[str, str]]:
    """``(data start, {name: (dtype, shape, offset in file)}, metadata)`` of a file of
    ``size`` bytes whose first bytes are ``head`` (at least the whole header)."""
    if size < 8:
        raise _bad(path, "shorter than its 8-byte header length")
    n = int.from_bytes(head[:8], "little")
    if n > MAX_HEADER or 8 + n > size:
        raise _bad(path, f"header length {n} does not fit the file ({size} bytes)")
    try:
        header = json.loads(bytes(head[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _bad(path, f"header is not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad(path, "__metadata__ is not a map of strings")
    start = 8 + n
    out: dict[str, tuple[np.dtype[Any], tuple[int, ...], int]] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _bad(path, f"entry {name!r} is not an object")
        dtype = _dtype(path, name, info.get("dtype"))
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(
                type(d) is int and d >= 0 for d in shape):
            raise _bad(path, f"tensor {name!r} has shape {shape!r}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(
                type(o) is int for o in offsets):
            raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}")
        begin, end = offsets
        count = math.prod(shape)  # exact: no int64 wrap-around to match a small span
        if not 0 <= begin <= end or start + end > size or end - begin != count * dtype.itemsize:
            raise _bad(path, f"tensor {name!r}: data_offsets {offsets} do not hold "
                             f"{shape} x {dtype.itemsize} bytes within the file")
        out[name] = (dtype, tuple(shape), start + begin)
    return start, out, meta


def map_safetensors(path: str | os.PathLike[str]) -> MappedFile:
    """Map ``path`` read-only and view each tensor in place (no copy)."""
    p = Path(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise _bad(p, "empty file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        _, specs, meta = parse_header(p, mm, size)
        tensors = {name: np.frombuffer(mm, dtype, int(np.prod(shape, dtype=np.int64)),
                                       offset).reshape(shape)
                   for name, (dtype, shape, offset) in specs.items()}
    except BaseException:
        mm.close()
        raise
    if not tensors:
        mm.close()
        raise LocalProtocolError(f"{p}: holds no tensors, nothing to publish")
    return MappedFile(p, tensors, meta, mm)


def header_for(tensors: Mapping[str, np.ndarray[Any, Any]],
               metadata: Mapping[str, str] | None = None) -> bytes:
    """The length-prefixed header of a file holding ``tensors`` back to back in order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, arr in tensors.items():
        code = _CODES.get(dtype_name(arr.dtype) or arr.dtype.str)
        if code is None:
            raise LocalProtocolError(f"tensor {name!r}: dtype {arr.dtype} has no "
                                     "safetensors name (little-endian numeric types, "
                                     "bfloat16 and fp8 only)")
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(path: str | os.PathLike[str],
                      tensors: Mapping[str, np.ndarray[Any, Any]],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` to ``path`` (streamed from the arrays, no copy of them);
    returns the file's size.  Readers never see a partial file: it is written to a
    temporary name next to ``path`` and renamed."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.part")
    head = header_for(tensors, metadata)
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for arr in tensors.values():
                f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(head) + sum(a.nbytes for a in tensors.values())
