"""The one table of bounds on what a version may contain, shared by both sides.

A publisher checks what it is asked to publish against these bounds (and raises
:class:`LocalProtocolError` at once, saying which bound), and a reader checks a manifest
it received against the same bounds (and raises :class:`RemoteProtocolError`).  So a
version that publishes is a version every reader accepts, and a reader refuses anything
else cheaply, before it allocates for it.

Fixed bounds are properties of the wire form (a dtype index is two bytes, an ndim one);
the counts a reader is willing to pay memory and time for are :class:`ManifestLimits`,
set per peer through :class:`~tensorhub.config.PeerConfig`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import EXTENDED, dtype_name
from .errors import ConfigError, LocalProtocolError

MAX_MODEL_NAME = 200
"""Characters in a model name."""

MAX_TENSOR_NAME = 1000
"""Characters in a tensor name (at least one; see :data:`BAD_NAME_CHARS`)."""

BAD_NAME_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
"""Characters a tensor name may not contain: control characters (they garble logs and
the CLI's tables) and lone surrogates (no UTF-8 form, so no wire form)."""

MAX_NDIM = 16
"""Dimensions of one tensor (numpy allows 32 or 64; models use at most 5 or 6)."""

MAX_DIM = (1 << 40) - 1
"""Elements along one dimension (and the extent of a sliced tensor's global shape)."""

MAX_TENSOR_BYTES = (1 << 50) - 1
"""Bytes of one tensor: 1 PiB, so that sums of them stay exact in a float64."""

MAX_DTYPES = 256
"""Distinct dtypes in one manifest."""

MAX_DTYPE_STR = 16
"""Characters of a dtype's ``dtype.str`` (``'<M8[ns]'`` is 7)."""

MAX_LAYOUT_ID = 32
"""Bytes of a sharding layout id."""

MAX_CHUNK_SIZE = 1 << 31
"""Bytes of one chunk (a reader buffers and verifies a chunk as a unit)."""

MAX_MANIFEST_BYTES = 64 << 20
"""Encoded bytes of one manifest: what the data plane accepts as a manifest reply.
262,144 tensors with 30-character names encode to about 12 MiB."""


@dataclass(frozen=True)
class ManifestLimits:
    """What a reader is willing to decode: counts checked before anything is allocated
    for them (``msgpack`` refuses longer arrays while it parses).

    ``max_tensors``: 1<<18 (262,144).  The largest open checkpoints list under 140,000
    tensors (a 384-expert MoE of 60 layers, three weights and a scale per expert), so
    this leaves about twice that.  Measured here (2 shared cores), decoding a manifest
    at the cap takes 0.5 s of a worker thread and about 0.2 GiB; at 1<<20 it took 2.9 s
    and about 0.8 GiB, and the 4 million tensors of the issue about 3 GiB: what a lying
    peer could make every reader pay.  ``max_chunks``: 1<<22, 16 TiB in 4 MiB chunks."""

    max_tensors: int = 1 << 18
    max_chunks: int = 1 << 22
    max_manifest_bytes: int = MAX_MANIFEST_BYTES

    def __post_init__(self) -> None:
        if not 1 <= self.max_tensors <= 1 << 24:
            raise ConfigError("max_tensors must be in [1, 2**24]")
        if not 1 <= self.max_chunks <= 1 << 28:
            raise ConfigError("max_chunks must be in [1, 2**28]")
        if not 4096 <= self.max_manifest_bytes <= MAX_MANIFEST_BYTES:
            raise ConfigError(f"max_manifest_bytes must be in [4096, {MAX_MANIFEST_BYTES}]")


DEFAULT_LIMITS = ManifestLimits()


def check_tensor_name(name: Any) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TENSOR_NAME:
        raise LocalProtocolError(f"tensor name {repr(name)[:40]} must be a str of 1 to "
                                 f"{MAX_TENSOR_NAME} characters")
    bad = BAD_NAME_CHARS.search(name)
    if bad is not None:
        raise LocalProtocolError(
            f"tensor name {name[:40]!r} contains {bad.group()!r}: control characters "
            "and lone surrogates are not allowed")
    return name


def check_dtype(name: str, dtype: np.dtype[Any]) -> str:
    """``dtype.str``, if the wire form carries ``dtype`` exactly (a reader gets the very
    same dtype back, byte order included); else :class:`LocalProtocolError`."""
    code = dtype.str
    why = ""
    extended = dtype_name(dtype)
    if extended is not None and np.dtype(code) == np.dtype(EXTENDED[extended]):
        return extended
    if dtype.hasobject:
        why = "holds Python objects"
    elif dtype.fields is not None or dtype.subdtype is not None:
        why = "is structured (fields or a sub-array); the wire carries only dtype.str, " \
              "which loses the structure: publish each field as its own tensor, or a " \
              "plain byte view (arr.view(np.uint8))"
    elif dtype.metadata:
        why = "carries metadata, which the wire does not"
    elif dtype.itemsize == 0:
        why = "has no bytes per element"
    elif len(code) > MAX_DTYPE_STR:
        why = f"has a dtype.str longer than {MAX_DTYPE_STR} characters"
    elif np.dtype(code) != dtype:
        why = f"does not round-trip through its dtype.str {code!r}"
    if why:
        raise LocalProtocolError(f"tensor {name!r}: dtype {dtype!r} {why}")
    return code


def check_shape(name: str, shape: Sequence[int], itemsize: int) -> None:
    if len(shape) > MAX_NDIM:
        raise LocalProtocolError(
            f"tensor {name!r} has {len(shape)} dimensions; at most {MAX_NDIM} are allowed")
    if any(not 0 <= d <= MAX_DIM for d in shape):
        raise LocalProtocolError(f"tensor {name!r}: dimensions must be in [0, {MAX_DIM}]")
    if float(np.prod(shape, dtype=np.float64)) * itemsize > MAX_TENSOR_BYTES:
        raise LocalProtocolError(f"tensor {name!r} is over {MAX_TENSOR_BYTES} bytes")


def check_counts(tensors: int, dtypes: int, chunks: int, limits: ManifestLimits) -> None:
    """What a publisher checks before hashing anything: the counts a reader caps."""
    if tensors > limits.max_tensors:
        raise LocalProtocolError(
            f"{tensors} tensors in one version; readers accept at most {limits.max_tensors} "
            "(PeerConfig.max_tensors)")
    if dtypes > MAX_DTYPES:
        raise LocalProtocolError(
            f"{dtypes} distinct dtypes in one version; at most {MAX_DTYPES} are allowed")
    if chunks > limits.max_chunks:
        raise LocalProtocolError(
            f"{chunks} chunks in one version; readers accept at most {limits.max_chunks} "
            "(PeerConfig.max_chunks; or raise chunk_size)")
