"""Plain data shared by every layer: peers, versions, tensor specs, host arrays.

Nothing here performs I/O.  A *version* of a model is a flat byte space: its tensors
are laid end to end in manifest order (each starting at ``TensorSpec.offset``); how that
space is chunked and checked is the manifest's business (:mod:`tensorhub.manifest.manifest`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import methodcaller
from typing import Annotated, Any

import msgpack
import numpy as np

from .bounds import ControlEndpoint, DataEndpoint, Labels, MaxLen, PeerName
from .dtypes import storage_dtype
from .errors import LocalProtocolError
from .limits import MAX_LAYOUT_ID, MAX_MODEL_NAME
from .torch import host_view, is_tensor

ModelName = Annotated[str, MaxLen(MAX_MODEL_NAME)]
LayoutId = Annotated[bytes, MaxLen(MAX_LAYOUT_ID)]
SCHEMA_ID_BYTES = 16
SchemaId = Annotated[bytes, MaxLen(SCHEMA_ID_BYTES)]
_TAG_SCHEMA = b"tensorhub/schema/1\0"


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int:
    return storage_dtype(dtype).itemsize



def check_model_name(model: str) -> str:
    if not isinstance(model, str) or not model or len(model) > MAX_MODEL_NAME:
        raise LocalProtocolError(f"model name must be a non-empty str of <= {MAX_MODEL_NAME} chars")
    return model


def check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**63:
        raise LocalProtocolError(f"version must be an int in [0, 2**63), got {version!r}")
    return version


@dataclass(frozen=True)
class PeerInfo:
    """Who a peer is and where to reach it.

    ``control`` is the ZeroMQ endpoint of its ROUTER socket (``tcp://host:port``),
    ``data`` the ``host:port`` of its data-plane server; ``labels`` are topology labels
    such as ``dc``, ``rack``, ``host``.
    """

    name: PeerName
    control: ControlEndpoint
    data: DataEndpoint
    labels: Labels = ()

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None


@dataclass(frozen=True, order=True)
class VersionKey:
    """What one manifest describes: ``shard`` of ``model@version`` in layout ``layout``.

    A version published by one process is the single shard 0 of the trivial layout
    (``layout == b""``: every tensor whole), so ``VersionKey(model, version)`` names it.
    A multi-rank publish has one key per rank, and a consumer that fetched its own
    slices in another layout holds them under that layout's id and its rank."""

    model: str
    version: int
    shard: int = 0
    layout: bytes = b""

    @property
    def whole(self) -> bool:
        return self.shard == 0 and not self.layout

    def __str__(self) -> str:
        if self.whole:
            return f"{self.model}@{self.version}"
        return f"{self.model}@{self.version}[shard {self.shard} of layout {self.layout.hex()[:8]}]"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a version: its name, dtype (numpy ``dtype.str``, or an extended
    name such as ``"bfloat16"``: see :mod:`tensorhub.dtypes`), shape, place.

    In a shard, ``shape`` is the local slice's shape; ``global_shape`` and ``start``
    (both empty for a whole tensor) give the full tensor's shape and where the slice
    begins in it, so the slice is ``[start[d], start[d] + shape[d])`` along each dim."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    global_shape: tuple[int, ...] = ()
    start: tuple[int, ...] = ()
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        count = _itemsize(self.dtype)
        for d in self.shape:
            count *= d
        object.__setattr__(self, "nbytes", count)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (``shape`` itself when this is not a slice)."""
        return self.global_shape or self.shape

    @property
    def box(self) -> tuple[tuple[int, int], ...]:
        """The slice as ``(start, stop)`` per dim of the whole tensor."""
        start = self.start or (0,) * len(self.shape)
        return tuple((a, a + n) for a, n in zip(start, self.shape, strict=True))


def schema_id(tensors: Iterable[TensorSpec]) -> bytes:
    """The *schema id* of a shard's tensors: a digest of the sorted ``(name, dtype,
    full shape)`` of each.  Every rank of one consistent publish lists every tensor (a
    split one by its own part, with the whole tensor's shape), so all of them have the
    same schema id; another dtype, another whole shape, a missing or an extra tensor at
    one rank changes it.  Where a rank's slice lies is not part of it (see the layout
    id, :attr:`tensorhub.protocol.sharding.Sharding.layout_id`)."""
    rows = sorted((t.name, t.dtype, list(t.full_shape)) for t in tensors)
    packed: bytes = msgpack.packb(rows, use_bin_type=True)
    return hashlib.sha256(_TAG_SCHEMA + packed).digest()[:SCHEMA_ID_BYTES]


_AS_BYTES = methodcaller("cast", "B")


def byte_views(arrays: Sequence[np.ndarray[Any, Any]]) -> list[memoryview]:
    """:func:`byte_view` of each array, made by C-level calls when the buffer formats
    allow (every plain numeric dtype); anything else goes the general way."""
    try:
        return list(map(_AS_BYTES, map(memoryview, arrays)))  # type: ignore[arg-type]
    except (TypeError, ValueError, NotImplementedError):
        return [byte_view(a) for a in arrays]


def as_host_array(obj: Any, name: str) -> np.ndarray[Any, Any]:
    """View anything exposing ``__dlpack__`` or the buffer protocol as a numpy array;
    a CPU torch tensor as its bytes, whatever its dtype (:mod:`tensorhub.torch`).

    No copy is made: publishing keeps a *reference* to the caller's memory.
    """
    if isinstance(obj, np.ndarray):
        arr = obj
    elif is_tensor(obj):
        arr = host_view(obj, name)
    elif hasattr(obj, "__dlpack__"):
        try:
            arr = np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise LocalProtocolError(
                f"tensor {name!r}: cannot view as host memory via DLPack ({exc}); "
                "move it to the host first"
            ) from None
    else:
        try:
            arr = np.asarray(memoryview(obj))
        except TypeError:
            raise LocalProtocolError(
                f"tensor {name!r}: {type(obj).__name__} exposes neither __dlpack__ "
                "nor the buffer protocol"
            ) from None
    if not arr.flags.c_contiguous:
        raise LocalProtocolError(
            f"tensor {name!r} is not C-contiguous; TensorHub serves it in place and "
            "will not copy it (pass np.ascontiguousarray(x))"
        )
    if arr.dtype.hasobject:
        raise LocalProtocolError(f"tensor {name!r} has an object dtype")
    return arr


def byte_view(arr: np.ndarray[Any, Any]) -> memoryview:
    """A flat, writable-if-possible byte view of a C-contiguous array (no copy)."""
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
