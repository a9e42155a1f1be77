"""Plain data shared by every layer: peers, versions, tensor specs, manifests.

Nothing here performs I/O.  A *version* of a model is a flat byte space: its tensors
are laid end to end in manifest order (each starting at ``TensorSpec.offset``), and
the space is cut into chunks of ``Manifest.chunk_size`` bytes.  A chunk may span
several small tensors, so many small tensors travel together.  Every chunk has a
digest in the manifest, and the manifest itself has a digest (its *id*) that the
reference table carries, so a fetcher can check a manifest it got from any holder.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack
import numpy as np

from .errors import LocalProtocolError, RemoteProtocolError

DIGEST_ALGOS = ("blake3", "sha256")
MAX_MODEL_NAME = 200
MAX_TENSOR_NAME = 1000
MAX_NDIM = 16
MAX_LAYOUT_ID = 32


def new_hasher(algo: str) -> Any:
    """A fresh incremental hasher (``update`` / ``digest``) for ``algo``."""
    if algo == "blake3":
        return blake3.blake3()
    if algo == "sha256":
        return hashlib.sha256()
    raise LocalProtocolError(f"unknown digest algorithm {algo!r}; use one of {DIGEST_ALGOS}")


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

    name: str
    control: str
    data: str
    labels: tuple[tuple[str, str], ...] = ()

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
    """One tensor of a version: its name, dtype (numpy ``dtype.str``), shape, place.

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
        count = 1
        for d in self.shape:
            count *= d
        object.__setattr__(self, "nbytes", count * np.dtype(self.dtype).itemsize)

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


@dataclass(frozen=True)
class Segment:
    """Part of a chunk that lies in one tensor: ``[start, stop)`` bytes of tensor ``index``."""

    index: int
    start: int
    stop: int


@dataclass(frozen=True)
class Manifest:
    """Tensor specs, chunking and per-chunk digests of one published version."""

    model: str
    version: int
    tensors: tuple[TensorSpec, ...]
    chunk_size: int
    digest_algo: str
    chunk_digests: tuple[bytes, ...]
    shard: int = 0
    world: int = 1
    layout: bytes = b""
    """Which shard of which layout this manifest describes (see :class:`VersionKey`)."""
    _ends: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ends", [t.end for t in self.tensors])

    @property
    def key(self) -> VersionKey:
        return VersionKey(self.model, self.version, self.shard, self.layout)

    @property
    def total_bytes(self) -> int:
        if not self.tensors:
            return 0
        last = self.tensors[-1]
        return last.offset + last.nbytes

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_size) if self.total_bytes else 0

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_size
        return start, min(start + self.chunk_size, self.total_bytes)

    def segments(self, start: int, stop: int) -> list[Segment]:
        """The tensor pieces that make up bytes ``[start, stop)`` of the version."""
        out: list[Segment] = []
        for i in range(bisect.bisect_right(self._ends, start), len(self.tensors)):
            t = self.tensors[i]
            if t.offset >= stop:
                break
            s, e = max(start, t.offset), min(stop, t.end)
            if e > s:
                out.append(Segment(i, s - t.offset, e - t.offset))
        return out

    # -- wire form -------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset]
                        + ([list(t.global_shape), list(t.start)] if t.global_shape else [])
                        for t in self.tensors],
            "chunk_size": self.chunk_size,
            "digest_algo": self.digest_algo,
            "chunk_digests": list(self.chunk_digests),
            "shard": [self.shard, self.world, self.layout],
        }

    def encode(self) -> bytes:
        """The wire form (computed once: a manifest is immutable)."""
        cached: bytes | None = self.__dict__.get("_encoded")
        if cached is None:
            cached = msgpack.packb(self.to_wire(), use_bin_type=True)
            object.__setattr__(self, "_encoded", cached)
        return cached

    def manifest_id(self) -> bytes:
        """A digest of the encoded manifest: what the reference table carries."""
        cached: bytes | None = self.__dict__.get("_id")
        if cached is None:
            cached = manifest_id_of(self.encode())
            object.__setattr__(self, "_id", cached)
        return cached

    @classmethod
    def from_wire(cls, obj: Any) -> Manifest:
        """Validate and build a manifest received from a peer."""
        try:
            return _manifest_from_wire(obj)
        except RemoteProtocolError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
            raise RemoteProtocolError(f"malformed manifest: {exc}") from None

    @classmethod
    def decode(cls, data: bytes, expected_id: bytes | None = None) -> Manifest:
        """Parse a manifest from the wire.  With ``expected_id`` the bytes are checked
        against it first: a manifest whose encoding does not hash to the id the
        reference table carries is refused before it is parsed."""
        if expected_id is not None and manifest_id_of(data) != expected_id:
            raise RemoteProtocolError("manifest does not match its id")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises a zoo of types on bad input
            raise RemoteProtocolError(f"malformed manifest encoding: {exc}") from None
        manifest = cls.from_wire(obj)
        if expected_id is not None:  # these exact bytes are its canonical encoding
            object.__setattr__(manifest, "_encoded", bytes(data))
            object.__setattr__(manifest, "_id", expected_id)
        return manifest


def manifest_id_of(encoded: bytes) -> bytes:
    return hashlib.sha256(encoded).digest()[:16]


def _manifest_from_wire(obj: Any) -> Manifest:
    def bad(what: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"malformed manifest: {what}")

    if not isinstance(obj, dict) or set(obj) != {
        "model", "version", "tensors", "chunk_size", "digest_algo", "chunk_digests", "shard"
    }:
        raise bad("wrong fields")
    sh = obj["shard"]
    if not (isinstance(sh, list) and len(sh) == 3 and _is_count(sh[0]) and _is_count(sh[1])
            and sh[0] < sh[1] and isinstance(sh[2], bytes) and len(sh[2]) <= MAX_LAYOUT_ID
            and (sh[1] == 1 or sh[2])):
        raise bad("shard")
    shard, world, layout = sh
    model, version = obj["model"], obj["version"]
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_NAME:
        raise bad("model")
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**63:
        raise bad("version")
    chunk_size = obj["chunk_size"]
    if not isinstance(chunk_size, int) or not 0 < chunk_size <= 1 << 31:
        raise bad("chunk_size")
    algo = obj["digest_algo"]
    if algo not in DIGEST_ALGOS:
        raise bad("digest_algo")
    tensors: list[TensorSpec] = []
    offset = 0
    names: set[str] = set()
    dtypes: dict[str, np.dtype[Any]] = {}
    raw_tensors = obj["tensors"]
    if not isinstance(raw_tensors, list):
        raise bad("tensors")
    for item in raw_tensors:
        if not isinstance(item, list) or len(item) not in (4, 6):
            raise bad("tensor entry")
        name, dtype, shape, toff = item[:4]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TENSOR_NAME or name in names:
            raise bad("tensor name")
        names.add(name)
        if not isinstance(dtype, str) or len(dtype) > 16:
            raise bad("dtype")
        dt = dtypes.get(dtype)
        if dt is None:
            try:
                dt = dtypes[dtype] = np.dtype(dtype)
            except TypeError:
                raise bad(f"dtype {dtype!r}") from None
            if dt.hasobject or dt.itemsize == 0:
                raise bad(f"dtype {dtype!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40
                       for d in shape)
        ):
            raise bad("shape")
        if toff != offset:
            raise bad("tensor offsets are not contiguous")
        gshape: tuple[int, ...] = ()
        start: tuple[int, ...] = ()
        if len(item) == 6:
            gs, st = item[4], item[5]
            if not (isinstance(gs, list) and isinstance(st, list)
                    and len(gs) == len(st) == len(shape)
                    and all(_is_count(x) and x < 2**40 for x in (*gs, *st))
                    and all(a + n <= g for a, n, g in zip(st, shape, gs, strict=True))):
                raise bad(f"slice of tensor {name!r}")
            gshape, start = tuple(gs), tuple(st)
        spec = TensorSpec(name, dt.str, tuple(shape), toff, gshape, start)
        if spec.nbytes >= 2**50:
            raise bad("tensor too large")
        offset += spec.nbytes
        tensors.append(spec)
    digests = obj["chunk_digests"]
    expected = -(-offset // chunk_size) if offset else 0
    if not isinstance(digests, list) or len(digests) != expected:
        raise bad("chunk digest count")
    if not all(isinstance(d, bytes) and 16 <= len(d) <= 64 for d in digests):
        raise bad("chunk digest")
    return Manifest(model, version, tuple(tensors), chunk_size, algo, tuple(digests),
                    shard, world, layout)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31


def as_host_array(obj: Any, name: str) -> np.ndarray[Any, Any]:
    """View anything exposing ``__dlpack__`` or the buffer protocol as a numpy array.

    No copy is made: publishing keeps a *reference* to the caller's memory.
    """
    if isinstance(obj, np.ndarray):
        arr = obj
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
