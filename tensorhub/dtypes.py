"""Element types the wire carries beyond numpy's: ``bfloat16`` and the fp8 formats.

A manifest names each tensor's dtype by a string: numpy's ``dtype.str`` (``"<f4"``) for
the types numpy has, or one of :data:`EXTENDED`'s names for those it lacks.  The data
plane moves bytes and digests cover bytes, so an extended tensor travels as raw bits:
on the host it is a numpy array of an unsigned integer of the same width (its *storage
dtype*), tagged with the real type's name in the dtype's metadata.  The tag follows the
array through views and reshapes, so :func:`dtype_name` (and publishing) recovers the
type, and :func:`tensorhub.torch.as_torch` views the bits as the torch dtype.

Nothing here performs I/O or imports torch.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

EXTENDED: dict[str, str] = {
    "bfloat16": "<u2",
    "float8_e4m3fn": "|u1",
    "float8_e5m2": "|u1",
}
"""Extended dtype name -> the numpy dtype of its raw bits (same width, native order)."""

TAG = "tensorhub.dtype"
"""The key of the extended name in a storage dtype's ``metadata``."""


@functools.lru_cache(maxsize=256)
def storage_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a tensor of manifest dtype ``name`` lands in: ``np.dtype(name)``,
    or for an extended name its raw-bits dtype tagged with the name."""
    raw = EXTENDED.get(name)
    if raw is None:
        return np.dtype(name)
    return np.dtype(raw, metadata={TAG: name})


def dtype_name(dtype: np.dtype[Any]) -> str | None:
    """The extended name a storage dtype is tagged with, or None for a plain dtype."""
    meta = dtype.metadata
    if not meta:
        return None
    name = meta.get(TAG)
    return name if isinstance(name, str) and name in EXTENDED else None


def tagged(arr: np.ndarray[Any, Any], name: str) -> np.ndarray[Any, Any]:
    """``arr`` (raw bits of the right width) viewed as extended dtype ``name`` (no copy)."""
    return arr.view(storage_dtype(name))


def display(name: str) -> str:
    """A manifest dtype as people read it: ``"float32"``, ``"bfloat16"``."""
    return name if name in EXTENDED else np.dtype(name).name
