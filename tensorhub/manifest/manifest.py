"""Manifests: the tensor specs, chunking and per-chunk digests of one version, and
their wire form.

Nothing here performs I/O.  A version's byte space (see :mod:`tensorhub.model`) is cut
into chunks of ``Manifest.chunk_size`` bytes.  A chunk may span several small tensors,
so many small tensors travel together.  Every chunk has a digest in the manifest, and
the manifest itself has a digest (its *id*) that the reference table carries, so a
fetcher can check a manifest it got from any holder.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import numpy as np

from ..dtypes import EXTENDED, storage_dtype
from ..errors import LocalProtocolError, RemoteProtocolError
from ..limits import (
    BAD_NAME_CHARS,
    DEFAULT_LIMITS,
    MAX_CHUNK_SIZE,
    MAX_DIM,
    MAX_DTYPE_STR,
    MAX_DTYPES,
    MAX_LAYOUT_ID,
    MAX_MODEL_NAME,
    MAX_NDIM,
    MAX_TENSOR_BYTES,
    MAX_TENSOR_NAME,
    ManifestLimits,
    check_counts,
    check_dtype,
    check_shape,
    check_tensor_name,
)
from ..model import TensorSpec, VersionKey, byte_views
from . import columns as columns
from .digests import (
    DIGEST_ALGOS,
    DIGEST_SIZES,
    LOCAL_ALGO,
    THREADED_HASH_BYTES,
    TRUSTED_ONLY,
    digest_of,
    new_hasher,
)
from .table import CACHE_LOCK, SpecRow, TensorTable, built_specs, table_of


@dataclass(slots=True)
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
    local_digests: tuple[bytes, ...] = ()
    """Per-chunk :data:`LOCAL_ALGO` digests next to cryptographic ``chunk_digests``
    (empty where there are none).  A reader checks against them instead only where the
    holder is a process of its own host and user whose memory it was shown to read
    (``Connection.holder_shares_memory``): such a process can write the reader's memory
    too, so a cryptographic digest guards against nothing it could not do anyway, while
    these still catch every corruption (a stale mapping, a buffer changed while leased)
    at memory speed.  Under the publisher's signature like every other field."""
    device_digests: tuple[bytes, ...] = ()
    """Per-chunk ``dsum-128`` digests (:mod:`tensorhub.device.digest`) of a version
    published from device memory, computed on the device (empty otherwise).  Checked,
    like ``local_digests`` and only where those would be, by a reader that lands chunks
    straight in its own device memory (CUDA IPC), on its device.  Under the publisher's
    signature like every other field."""
    table: TensorTable = field(init=False, repr=False, compare=False)
    """Derived columns, shared with every manifest of the same tensor tuple."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "table", table_of(self.tensors))

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
        nonempty = self.table.nonempty
        for p in range(self.table.first_ending_after(start), len(nonempty)):
            t = self.tensors[nonempty[p]]
            if t.offset >= stop:
                break
            s, e = max(start, t.offset), min(stop, t.end)
            if e > s:
                out.append(Segment(nonempty[p], s - t.offset, e - t.offset))
        return out

    def chunk_tensors(self, chunk: int) -> tuple[int, int, int, int]:
        """Chunk ``chunk`` as ``(lo, hi, head, tail)``: the bytes of the tensors at
        positions ``table.nonempty[lo:hi]``, less ``head`` bytes at the start of the
        first and ``tail`` at the end of the last (see :func:`chunk_pieces`)."""
        start, stop = self.chunk_range(chunk)
        los, his = self.table.spans(self.chunk_size, self.total_bytes)
        lo, hi = los[chunk], his[chunk]
        if lo >= hi:
            return lo, hi, 0, 0
        first, last = self.table.piece_bounds(lo, hi)
        return lo, hi, start - first, last - stop

    # -- wire form -------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """Columns, not one record per tensor: a model of 10,000 small tensors decodes
        in a few milliseconds (see :func:`_tensors_from_wire`)."""
        ts = self.tensors
        dtypes = sorted({t.dtype for t in ts})
        index = {d: i for i, d in enumerate(dtypes)}
        sliced = [t for t in ts if t.global_shape]
        return {
            "model": self.model,
            "version": self.version,
            "tensors": {
                "names": [t.name for t in ts],
                "dtypes": dtypes,
                "dtype": np.array([index[t.dtype] for t in ts], "<u2").tobytes(),
                "ndim": np.array([len(t.shape) for t in ts], "u1").tobytes(),
                "dims": np.array([d for t in ts for d in t.shape], "<i8").tobytes(),
                "sliced": np.array([bool(t.global_shape) for t in ts], "u1").tobytes()
                if sliced else b"",
                "global": np.array([d for t in sliced for d in t.global_shape],
                                   "<i8").tobytes(),
                "start": np.array([d for t in sliced for d in t.start], "<i8").tobytes(),
            },
            "chunk_size": self.chunk_size,
            "digest_algo": self.digest_algo,
            "chunk_digests": b"".join(self.chunk_digests),
            "shard": [self.shard, self.world, self.layout],
        } | ({"local_digests": b"".join(self.local_digests)} if self.local_digests else {}) \
          | ({"device_digests": b"".join(self.device_digests)} if self.device_digests else {})

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

    def schema_id(self) -> bytes:
        """The rank-independent digest of the tensor specs (see
        :func:`~tensorhub.model.schema_id`): what a publish announces for sealing."""
        return self.table.schema_id

    @classmethod
    def from_wire(cls, obj: Any, limits: ManifestLimits = DEFAULT_LIMITS) -> Manifest:
        """Validate and build a manifest received from a peer."""
        return _checked_from_wire(obj, limits, None)

    @classmethod
    def decode(cls, data: bytes, expected_id: bytes | None = None,
               limits: ManifestLimits = DEFAULT_LIMITS) -> Manifest:
        """Parse a manifest from the wire.  With ``expected_id`` the bytes are checked
        against it first: a manifest whose encoding does not hash to the id the
        reference table carries is refused before it is parsed.

        ``limits`` cap what is allocated: longer input, or an array longer than
        ``max_tensors`` (the tensor names are the only long array; chunk digests travel
        as one byte string), is refused by the parser before it builds anything.  A
        manifest near the caps takes a worker thread half a second to decode: call this
        off the event loop (:meth:`Peer.fetch` does, for all but small ones and those
        :meth:`decode_known` takes)."""
        manifest = cls._decode(data, expected_id, limits, False)
        assert manifest is not None
        return manifest

    @classmethod
    def decode_known(cls, data: bytes, expected_id: bytes | None = None,
                     limits: ManifestLimits = DEFAULT_LIMITS) -> Manifest | None:
        """:meth:`decode`, when the manifest's tensor columns are equal to ones decoded
        lately (the next version of a model: specs reused, nothing of them to check);
        None when they are not, without checking them.  The costly part of a decode is
        building and checking 10,000 specs (about 17 ms), against under a millisecond
        for a manifest of known columns: an event loop can afford this one and leaves
        the other to a thread."""
        return cls._decode(data, expected_id, limits, True)

    @classmethod
    def _decode(cls, data: bytes, expected_id: bytes | None, limits: ManifestLimits,
                known_only: bool) -> Manifest | None:
        if len(data) > limits.max_manifest_bytes:
            raise RemoteProtocolError(f"manifest of {len(data)} bytes is over the limit "
                                      f"of {limits.max_manifest_bytes}")
        if expected_id is not None and manifest_id_of(data) != expected_id:
            raise RemoteProtocolError("manifest does not match its id")
        bounds = {"max_map_len": 16, "max_array_len": max(limits.max_tensors, MAX_DTYPES),
                  "max_str_len": 4 * MAX_TENSOR_NAME,
                  "max_bin_len": limits.max_manifest_bytes, "max_ext_len": 0}
        parts = columns.split(data, **bounds)
        specs = columns.known(parts[1]) if parts is not None else None
        if parts is not None and specs is not None:  # the columns' very bytes seen lately
            if len(specs[0]) > limits.max_tensors:
                raise RemoteProtocolError(
                    f"malformed manifest: over {limits.max_tensors} tensors")
            manifest = _checked_from_wire(parts[0], limits, specs)
        elif known_only and parts is not None:
            return None  # new columns: parsed once, by the full decode
        else:
            try:
                obj = msgpack.unpackb(data, raw=False, strict_map_key=True, **bounds)
            except Exception as exc:  # msgpack raises a zoo of types on bad input
                raise RemoteProtocolError(f"malformed manifest encoding: {exc}") from None
            known = None
            if known_only:
                known = _cached_tensors(
                    obj.get("tensors") if isinstance(obj, dict) else None, limits)[1]
                if known is None:
                    return None
            manifest = _checked_from_wire(obj, limits, known)
            if parts is not None:
                columns.remember(parts[1], (manifest.tensors, manifest.total_bytes))
        if expected_id is not None:  # these exact bytes are its canonical encoding
            object.__setattr__(manifest, "_encoded", bytes(data))
            object.__setattr__(manifest, "_id", expected_id)
        return manifest


def chunk_pieces(views: list[Any], head: int, tail: int) -> list[Any]:
    """Trim the whole-tensor byte ``views`` of a chunk (see :meth:`Manifest.chunk_tensors`)
    to the chunk's own bytes, in place."""
    if views and head > 0:
        views[0] = views[0][head:]
    if views and tail > 0:
        views[-1] = views[-1][:len(views[-1]) - tail]
    return views


def chunk_buffers(arrays: list[Any], head: int, tail: int) -> list[Any]:
    """As :func:`chunk_pieces`, for the whole-tensor arrays themselves: byte views only
    of the tensors cut by the chunk's bounds, so a chunk of many small tensors makes no
    object per tensor (each a view the garbage collector would walk while it lives)."""
    if arrays and head:
        arrays[0] = byte_views(arrays[:1])[0]
    if arrays and tail:
        arrays[-1] = byte_views(arrays[-1:])[0]
    return chunk_pieces(arrays, head, tail)


def manifest_id_of(encoded: bytes) -> bytes:
    return hashlib.sha256(encoded).digest()[:16]


def _checked_from_wire(obj: Any, limits: ManifestLimits, known: _Specs | None) -> Manifest:
    """:func:`_manifest_from_wire`, any error in it a :class:`RemoteProtocolError`."""
    try:
        return _manifest_from_wire(obj, limits, known)
    except RemoteProtocolError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
        raise RemoteProtocolError(f"malformed manifest: {exc}") from None


def _manifest_from_wire(obj: Any, limits: ManifestLimits, known: _Specs | None
                        ) -> Manifest:
    """``known``: the specs of ``obj``'s tensor columns, found in the cache already."""
    def bad(what: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"malformed manifest: {what}")

    if not isinstance(obj, dict) or set(obj) - _OPTIONAL != _FIELDS:
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
    if not isinstance(chunk_size, int) or not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise bad("chunk_size")
    algo = obj["digest_algo"]
    if algo not in DIGEST_ALGOS:
        raise bad("digest_algo")
    tensors, offset = known if known is not None else _tensors_from_wire(obj["tensors"],
                                                                         limits)
    blob = obj["chunk_digests"]
    expected = -(-offset // chunk_size) if offset else 0
    size = DIGEST_SIZES[algo]
    if type(blob) is not bytes or len(blob) != expected * size or expected > limits.max_chunks:
        raise bad("chunk digests")
    digests = tuple(blob[i:i + size] for i in range(0, len(blob), size))
    local = obj.get("local_digests", b"")
    size = DIGEST_SIZES[LOCAL_ALGO]
    if "local_digests" in obj and (type(local) is not bytes or algo in TRUSTED_ONLY
                                   or not 0 < len(local) == expected * size):
        raise bad("local digests")  # present only when it has every chunk's, canonical
    on_device = obj.get("device_digests", b"")
    if "device_digests" in obj and (type(on_device) is not bytes
                                    or not 0 < len(on_device) == expected * DSUM_SIZE):
        raise bad("device digests")
    return Manifest(model, version, tensors, chunk_size, algo, digests, shard, world, layout,
                    tuple(local[i:i + size] for i in range(0, len(local), size)),
                    tuple(on_device[i:i + DSUM_SIZE]
                          for i in range(0, len(on_device), DSUM_SIZE)))


_FIELDS = {"model", "version", "tensors", "chunk_size", "digest_algo", "chunk_digests",
           "shard"}
_OPTIONAL = {"local_digests", "device_digests"}
DSUM_SIZE = 16
"""Bytes of one of :attr:`Manifest.device_digests` (``dsum-128``)."""


_TENSOR_COLUMNS = {"names", "dtypes", "dtype", "ndim", "dims", "sliced", "global", "start"}
_Specs = tuple[tuple[TensorSpec, ...], int]
"""Tensor specs laid end to end, and the bytes they span."""
_DECODED: OrderedDict[tuple[Any, ...], _Specs] = OrderedDict()
_DECODED_KEPT = 16
"""Tensor columns decoded lately, by their exact wire content: the next version of a
model has the same tensors (only its digests change), so its manifest reuses the specs
(and their :class:`TensorTable`) instead of validating and building them again."""


def _tensors_from_wire(cols: Any, limits: ManifestLimits) -> _Specs:
    """The specs (laid end to end) of validated tensor columns; the same tuple again for
    columns equal to ones decoded lately (and so validated already)."""
    key, hit = _cached_tensors(cols, limits)
    if hit is not None:
        return hit
    tensors, offset = _build_tensors(cols, limits)
    got = (tuple(tensors), offset)
    if key is not None:
        with CACHE_LOCK:
            _DECODED[key] = got
            if len(_DECODED) > _DECODED_KEPT:
                _DECODED.popitem(last=False)
    return got


def _cached_tensors(cols: Any, limits: ManifestLimits
                    ) -> tuple[tuple[Any, ...] | None, _Specs | None]:
    """The columns' cache key (None if they are not even shaped right) and their specs
    if they were decoded lately (None otherwise); columns of more than ``max_tensors``
    names are refused first, whatever another peer of this process decoded."""
    key = _columns_key(cols)
    if key is None:
        return None, None
    if len(key[0]) > limits.max_tensors:
        raise RemoteProtocolError(f"malformed manifest: over {limits.max_tensors} tensors")
    with CACHE_LOCK:
        hit = _DECODED.get(key)
        if hit is not None:
            _DECODED.move_to_end(key)
    return key, hit


def _columns_key(cols: Any) -> tuple[Any, ...] | None:
    """The columns as one hashable value, or None if they are not even shaped right
    (they then go to validation, which says what is wrong)."""
    if not isinstance(cols, dict) or set(cols) != _TENSOR_COLUMNS \
            or not isinstance(cols["names"], list) or not isinstance(cols["dtypes"], list):
        return None
    key = (tuple(cols["names"]), tuple(cols["dtypes"]), cols["dtype"], cols["ndim"],
           cols["dims"], cols["sliced"], cols["global"], cols["start"])
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _build_tensors(cols: Any, limits: ManifestLimits) -> tuple[list[TensorSpec], int]:
    """Validate the tensor columns and build the specs (laid end to end)."""
    def bad(what: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"malformed manifest: {what}")

    if not isinstance(cols, dict) or set(cols) != _TENSOR_COLUMNS:
        raise bad("tensor columns")
    names, dtypes = cols["names"], cols["dtypes"]
    if not isinstance(names, list) or len(names) > limits.max_tensors \
            or not all(type(n) is str and 0 < len(n) <= MAX_TENSOR_NAME for n in names) \
            or BAD_NAME_CHARS.search("".join(names)):
        raise bad("tensor names")
    n = len(names)
    if len(set(names)) != n:
        raise bad("duplicate tensor name")
    if not isinstance(dtypes, list) or len(dtypes) > MAX_DTYPES:
        raise bad("dtypes")
    itemsizes = []
    for d in dtypes:
        if type(d) is not str or len(d) > MAX_DTYPE_STR:
            raise bad("dtype")
        try:
            dt = storage_dtype(d)
        except TypeError:
            raise bad(f"dtype {d!r}") from None
        if dt.hasobject or dt.itemsize == 0 or dt.fields is not None \
                or (dt.str != d and d not in EXTENDED):
            raise bad(f"dtype {d!r}")
        itemsizes.append(dt.itemsize)
    for key in ("dtype", "ndim", "dims", "sliced", "global", "start"):
        if not isinstance(cols[key], bytes):
            raise bad(key)
    if len(cols["dtype"]) != 2 * n or len(cols["ndim"]) != n:
        raise bad("column lengths")
    dtype_idx = np.frombuffer(cols["dtype"], "<u2")
    ndim = np.frombuffer(cols["ndim"], "u1").astype(np.int64)
    if n and (int(dtype_idx.max()) >= len(dtypes) or int(ndim.max()) > MAX_NDIM):
        raise bad("dtype index or ndim")
    ends = np.cumsum(ndim)
    total_dims = int(ends[-1]) if n else 0
    if len(cols["dims"]) != 8 * total_dims:
        raise bad("dims length")
    dims = np.frombuffer(cols["dims"], "<i8")
    if total_dims and (int(dims.min()) < 0 or int(dims.max()) > MAX_DIM):
        raise bad("shape")
    # bytes per tensor: product of its dims (in floats first, to refuse overflow)
    padded = np.append(dims, 1).astype(np.float64)
    starts = ends - ndim
    counts_f = np.where(ndim > 0, np.multiply.reduceat(padded, starts), 1.0) if n \
        else np.zeros(0)
    sizes_f = counts_f * np.array(itemsizes, np.float64)[dtype_idx] if n else counts_f
    if n and float(sizes_f.max()) > MAX_TENSOR_BYTES:
        raise bad("tensor too large")
    dim_list = dims.tolist()
    shapes = [tuple(dim_list[a:b]) for a, b in zip(starts.tolist(), ends.tolist(),
                                                     strict=True)]
    sliced_col = cols["sliced"]
    sliced = np.frombuffer(sliced_col, "u1") if sliced_col else np.zeros(n, "u1")
    if len(sliced) != n or (n and int(sliced.max()) > 1):
        raise bad("sliced")
    n_sliced_dims = int(ndim[sliced == 1].sum()) if n else 0
    if len(cols["global"]) != 8 * n_sliced_dims or len(cols["start"]) != 8 * n_sliced_dims:
        raise bad("slice columns")
    gdims = np.frombuffer(cols["global"], "<i8").tolist()
    gstart = np.frombuffer(cols["start"], "<i8").tolist()
    dtype_strs = [dtypes[i] for i in dtype_idx.tolist()]
    sizes = [int(x) for x in sizes_f.tolist()]
    out: list[TensorSpec] = []
    offset = 0
    g = 0
    new = object.__new__
    for i, name in enumerate(names):
        shape = shapes[i]
        gshape: tuple[int, ...] = ()
        start: tuple[int, ...] = ()
        if sliced[i]:
            k = len(shape)
            gshape, start = tuple(gdims[g:g + k]), tuple(gstart[g:g + k])
            g += k
            if not all(a >= 0 and a + m <= gs <= MAX_DIM
                       for a, m, gs in zip(start, shape, gshape, strict=True)):
                raise bad(f"slice of tensor {name!r}")
        spec = new(TensorSpec)  # validated above: skip the dataclass __init__
        spec.__dict__.update(name=name, dtype=dtype_strs[i], shape=shape, offset=offset,
                             global_shape=gshape, start=start, nbytes=sizes[i])
        out.append(spec)
        offset += sizes[i]
    return out, offset


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31




def build_manifest(key: VersionKey, arrays: Sequence[tuple[str, np.ndarray[Any, Any]]],
                   chunk_size: int, algo: str, world: int = 1,
                   placed: Sequence[tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
                   limits: ManifestLimits = DEFAULT_LIMITS,
                   digests: Callable[[Manifest], list[bytes]] | None = None,
                   on_device: Callable[[Manifest], list[bytes]] | None = None) -> Manifest:
    """Specs, chunking and digests of arrays laid end to end (runs in a worker thread).
    ``placed`` gives, per array, its global shape and start when it is a slice.
    ``digests``, when given, computes the chunk digests from the manifest without them
    (memory the host cannot read: the arrays then only describe the tensors), and
    ``on_device`` the :attr:`Manifest.device_digests`.

    Anything a reader would refuse (see :mod:`tensorhub.limits`) raises
    :class:`LocalProtocolError` naming the tensor and the bound, before any hashing."""
    rows: list[SpecRow] = []
    offset = 0
    codes: dict[np.dtype[Any], str] = {}
    for i, (name, arr) in enumerate(arrays):
        check_tensor_name(name)
        code = codes.get(arr.dtype)
        if code is None or arr.dtype.metadata:  # equal dtypes may differ in their tags
            code = check_dtype(name, arr.dtype)
            if not arr.dtype.metadata:
                codes[arr.dtype] = code
        check_shape(name, arr.shape, arr.dtype.itemsize)
        gshape, start = placed[i] if placed is not None else ((), ())
        if gshape:
            check_shape(name, gshape, 1)
        rows.append((name, code, tuple(arr.shape), offset, gshape, start))
        offset += arr.nbytes
    check_counts(len(rows), len(set(codes.values())), -(-offset // chunk_size), limits)
    tensors = built_specs((key.model, key.shard, key.layout), rows)
    skeleton = Manifest(key.model, key.version, tensors, chunk_size, algo, ())
    _check_size(key, len(skeleton.encode()) + skeleton.num_chunks * 34, limits)
    local: list[bytes] = []
    if digests is not None:
        found = digests(skeleton)
    else:
        nonempty: list[Any] = [arrays[i][1] for i in skeleton.table.nonempty]
        whole = skeleton.table.exports_buffers()
        if not whole:
            nonempty = byte_views(nonempty)
        threads = chunk_size >= THREADED_HASH_BYTES
        found = []
        for c in range(skeleton.num_chunks):
            lo, hi, head, tail = skeleton.chunk_tensors(c)
            pieces = (chunk_buffers if whole else chunk_pieces)(nonempty[lo:hi], head, tail)
            if algo in TRUSTED_ONLY:
                found.append(digest_of(algo, pieces, threads))
                continue
            fast = new_hasher(LOCAL_ALGO)  # fed each block while it is in the cache
            found.append(digest_of(algo, pieces, threads, _feeder(fast)))
            local.append(fast.digest())
    device = on_device(skeleton) if on_device is not None else []
    manifest = Manifest(key.model, key.version, tensors, chunk_size, algo, tuple(found),
                        key.shard, world, key.layout, tuple(local), tuple(device))
    if (local or device) and len(manifest.encode()) > limits.max_manifest_bytes:
        manifest = replace(manifest, local_digests=(), device_digests=())  # optional
    _check_size(key, len(manifest.encode()), limits)
    return manifest


def _feeder(hasher: Any) -> Callable[[int, memoryview], None]:
    def feed(_at: int, block: memoryview) -> None:
        hasher.update(block)
    return feed


def _check_size(key: VersionKey, size: int, limits: ManifestLimits) -> None:
    if size > limits.max_manifest_bytes:
        raise LocalProtocolError(
            f"the manifest of {key} encodes to {size} bytes; readers accept at most "
            f"{limits.max_manifest_bytes} (fewer tensors or shorter names)")
