"""Lossless chunk deltas: a chunk of version ``v`` said as what changed against the same
chunk of a base version ``v - k`` that the reader already holds.

Theory of operation
-------------------
A holder of both versions encodes each asked chunk (:func:`encode_chunk`); the reader
applies the delta to its own copy of the base chunk (:func:`apply_chunk`) and checks the
result against ``v``'s manifest digest before it counts, exactly as for a chunk received
in full: a delta never weakens the integrity guarantee, and any failure leaves the chunk
to the ordinary fetch.  A chunk whose digest is the same in both manifests is not asked
for at all: the reader copies it from its base.

*Formats* (the payload's first byte).  The XOR of the two chunks is zero wherever a
value did not change.  ``SPARSE``: the positions of the 16-bit words that differ (as
gaps, 32 bits each) and their XOR, both split into byte planes, then zstd level 1.
``XOR``: the XOR itself, zstd level 1 (dense changes, or an odd chunk length).
``RAW``: the new chunk as is (a delta that would not be smaller).  Measured on 4 MiB
chunks of bf16 values (``std 0.02``, a seeded fraction changed by a relative 1%; bytes
of delta per chunk byte, encode MB/s on one core of the development host):

=================  =============  =============  ==============
                   1% changed     2%             10%
=================  =============  =============  ==============
sparse planes+zstd 0.0072, 1146   0.0115, 1050   0.044, 695
sparse+zstd1       0.0089, 2995   0.0158, 2145   0.066, 613
XOR+zstd1          0.0120, 1794   0.0215, 1546   0.084, 597
XOR+zstd3          0.0122, 1567   0.0216, 1340   0.084, 530
XOR+zstd6          0.0118,  320   0.0210,  235   0.080, 134
XOR+lz4            0.0244, 3139   0.0441, 2281   0.164, 1058
XOR+lz4hc9         0.0142,   39   0.0234,   26   0.087,    8
positions+values   0.0235, 4203   0.0468, 3176   0.233, 1095
=================  =============  =============  ==============

Sparse byte planes with zstd level 1 is smallest at every fraction and fast enough for
any link it pays on (see :func:`delta_pays`); lz4 is twice the size.  Decoding is
hostile-input safe: every length and count is range-checked, a zstd frame must declare
exactly the size it should decompress to (no bomb gets further than its header), and
positions must be strictly increasing and inside the chunk.

*When it pays* (:func:`delta_pays`).  Encoding (holder), sending and applying (reader)
run as a pipeline, so a delta stream moves ``min(encode, link / ratio, apply)`` chunk
bytes a second against ``link`` for full chunks: a delta pays where encoding and
applying are faster than the link, by :data:`MARGIN`.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from ..errors import LocalProtocolError, RemoteProtocolError

SPARSE = 1
XOR = 2
RAW = 3
FORMATS = {SPARSE: "sparse", XOR: "xor", RAW: "raw"}

ZSTD_LEVEL = 1
"""Level 3 and 6 were no smaller on RL-like steps and 1.2-5x slower (module table)."""
DENSE = 3
"""XOR format when over one word in this many changed: sparse positions then cost more
than the XOR's zeros."""
MARGIN = 1.25
"""A delta pays only where encoding and applying beat the link by this factor."""
DEFAULT_ENCODE_BPS = 400e6
"""Chunk bytes a holder encodes per second until it has said (under half the rate
measured at 1-2% changed, module table: a guess that errs towards full chunks)."""
MAX_DELTA_OVERHEAD = 64
"""Bytes a delta payload may exceed its chunk by (a RAW payload is the chunk plus one)."""

_WIDE_SCAN = 8
"""See :func:`_changed_words` (at 10% of values changed a third of the 64-bit words
are, and expanding them costs more than scanning 16-bit words)."""
_COUNT = struct.Struct("<I")
_WORD = 2
_XOR_HEAD = bytes((XOR,))


def encode_chunk(base: Any, new: Any) -> bytes:
    """The delta that turns chunk ``base`` into chunk ``new`` (byte buffers of equal
    length; raises :class:`LocalProtocolError` if not)."""
    old_b = np.frombuffer(base, np.uint8)
    new_b = np.frombuffer(new, np.uint8)
    if old_b.size != new_b.size:
        raise LocalProtocolError(f"chunks of {old_b.size} and {new_b.size} bytes")
    n = new_b.size
    if n % _WORD:
        out = _XOR_HEAD + _compress(np.bitwise_xor(old_b, new_b))
    else:
        x, pos, values = _changed_words(old_b, new_b)
        if len(pos) * DENSE > x.size:
            out = _XOR_HEAD + _compress(x)
        else:
            gaps = np.diff(pos, prepend=0).astype("<u4")
            body = (gaps.view(np.uint8).reshape(-1, 4).T.tobytes()
                    + values.astype("<u2").view(np.uint8).reshape(-1, 2).T.tobytes())
            out = bytes((SPARSE,)) + _COUNT.pack(len(pos)) + _compress(body)
    if len(out) > n:
        return bytes((RAW,)) + new_b.tobytes()
    return out


def _changed_words(old_b: np.ndarray[Any, Any], new_b: np.ndarray[Any, Any]
                   ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The XOR of two chunks as 16-bit words, the positions of those not zero, and
    their values.  Sparse changes are found among 64-bit words first (a quarter of the
    elements to scan: 1% of values changed, a 4 MiB chunk, 2.7 ms instead of 4.7);
    over one 64-bit word in :data:`_WIDE_SCAN` changed, among the 16-bit words."""
    if old_b.size % 8:
        x = np.bitwise_xor(old_b.view(np.uint16), new_b.view(np.uint16))
        pos = np.flatnonzero(x)
        return x, pos, x[pos]
    x64 = np.bitwise_xor(old_b.view(np.uint64), new_b.view(np.uint64))
    x = x64.view(np.uint16)
    wide = np.flatnonzero(x64)
    if len(wide) * _WIDE_SCAN > x64.size:
        pos = np.flatnonzero(x)
        return x, pos, x[pos]
    lanes = x64[wide].view(np.uint16).reshape(-1, 4)  # memory order, as x's words
    changed = lanes != 0
    pos = (wide[:, None] * 4 + np.arange(4))[changed]
    return x, pos, lanes[changed]


def _compress(data: Any) -> bytes:
    out: bytes = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(memoryview(data).cast("B"))
    return out


def _decompress(frame: memoryview, size: int) -> bytes:
    """Exactly ``size`` bytes from one zstd frame, or :class:`RemoteProtocolError`."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"delta: bad zstd frame header ({exc})") from None
    if declared != size:
        raise RemoteProtocolError(f"delta: zstd frame declares {declared} bytes, "
                                  f"expected {size}")
    try:
        out: bytes = zstandard.ZstdDecompressor().decompress(
            frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"delta: bad zstd frame ({exc})") from None
    if len(out) != size:
        raise RemoteProtocolError(f"delta: {len(out)} bytes decompressed, expected {size}")
    return out


def apply_chunk(base: Any, delta: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The chunk that ``delta`` (from the wire: any content) makes of ``base``: a new
    array of ``len(base)`` bytes.  Raises :class:`RemoteProtocolError` for a malformed
    delta; never allocates more than a few times the chunk."""
    old = np.frombuffer(base, np.uint8)
    n = old.size
    d = memoryview(delta).cast("B")
    if len(d) < 1 or len(d) > n + MAX_DELTA_OVERHEAD:
        raise RemoteProtocolError(f"delta of {len(d)} bytes for a {n}-byte chunk")
    kind = d[0]
    if kind == RAW:
        if len(d) != n + 1:
            raise RemoteProtocolError(f"raw delta of {len(d) - 1} bytes, chunk is {n}")
        return np.frombuffer(d[1:], np.uint8).copy()
    if kind == XOR:
        x = np.frombuffer(_decompress(d[1:], n), np.uint8)
        return np.bitwise_xor(old, x)
    if kind != SPARSE:
        raise RemoteProtocolError(f"unknown delta format {kind}")
    if n % _WORD or len(d) < 1 + _COUNT.size:
        raise RemoteProtocolError(f"sparse delta for a {n}-byte chunk")
    (count,) = _COUNT.unpack_from(d, 1)
    words = n // _WORD
    if count > words:
        raise RemoteProtocolError(f"sparse delta of {count} words for {words}")
    body = np.frombuffer(_decompress(d[1 + _COUNT.size:], 6 * count), np.uint8)
    gaps = body[:4 * count].reshape(4, count).T.copy().view("<u4").reshape(count)
    values = body[4 * count:].reshape(2, count).T.copy().view("<u2").reshape(count)
    if count and np.any(gaps[1:] == 0):
        raise RemoteProtocolError("sparse delta: positions not strictly increasing")
    pos = np.cumsum(gaps, dtype=np.uint64)
    if count and pos[-1] >= words:
        raise RemoteProtocolError(f"sparse delta: position {int(pos[-1])} past {words}")
    out = old.copy()
    view = out.view(np.uint16)
    view[pos.astype(np.intp)] ^= values
    return out


def delta_format(delta: bytes) -> str:
    """The name of a delta's format (for reports)."""
    return FORMATS.get(delta[0], "?") if delta else "?"


def delta_pays(link_bps: float, encode_bps: float, apply_bps: float | None) -> bool:
    """Whether a delta stream beats full chunks on a link of ``link_bps``: encoding and
    applying (None: not measured yet, taken as fast as encoding) must each outrun the
    link by :data:`MARGIN` (see the module docstring)."""
    slowest = min(encode_bps, apply_bps if apply_bps is not None else encode_bps)
    return slowest > link_bps * MARGIN


def unchanged_chunks(base_digests: Sequence[bytes], new_digests: Sequence[bytes],
                     base_ranges: Sequence[int], new_ranges: Sequence[int]) -> list[bool]:
    """Per chunk of the new version: whether it is the same as the base's (same digest,
    same length; digests of one algorithm)."""
    return [i < len(base_digests) and base_digests[i] == d and base_ranges[i] == new_ranges[i]
            for i, d in enumerate(new_digests)]


def pick_sources(chunks: Sequence[int], planned: Mapping[int, str],
                 candidates: Sequence[str], have_plan: bool) -> dict[str, list[int]]:
    """Which holder encodes each chunk: ``candidates`` hold both versions, best first.
    With a plan, a chunk's planned source only (a delta never takes another path than
    the plan's: a chunk whose planned source lacks the base comes in full, along the
    plan); without one, the first candidate."""
    ok = set(candidates)
    out: dict[str, list[int]] = {}
    for c in chunks:
        src = planned.get(c) if have_plan else (candidates[0] if candidates else None)
        if src is not None and src in ok:
            out.setdefault(src, []).append(c)
    return out


@dataclass
class DeltaTally:
    """What the delta part of a fetch did (the fetch report's ``delta`` entry)."""

    base: int | None = None
    """The version the deltas were applied to, or None (no delta tried)."""
    note: str = ""
    """Why no delta, or which sources and formats."""
    delta_bytes: int = 0
    """Delta payload bytes received (each verified after applying, or not counted)."""
    delta_chunks: int = 0
    raw_chunks: int = 0
    """Chunks the holder sent whole in the delta stream (a delta would not be smaller)."""
    chunk_bytes: int = 0
    """Bytes of the chunks that came as deltas (what they would have cost in full)."""
    unchanged_chunks: int = 0
    """Chunks copied from the base, not sent (same digest in both manifests)."""
    encode_seconds: float = 0.0
    """CPU seconds the holders spent encoding (as they said)."""
    apply_seconds: float = 0.0
    """CPU seconds spent here applying deltas and copying unchanged chunks."""
    failed: dict[str, str] = field(default_factory=dict)
    """Sources whose deltas failed (digest mismatch, no base, link), and why: their
    chunks came in full."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Sources not asked for deltas because full chunks were faster, and why."""
    formats: dict[str, int] = field(default_factory=dict)
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    """Delta bytes per holder."""

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base, "note": self.note, "delta_bytes": self.delta_bytes,
                "delta_chunks": self.delta_chunks, "raw_chunks": self.raw_chunks,
                "chunk_bytes": self.chunk_bytes, "unchanged_chunks": self.unchanged_chunks,
                "encode_seconds": self.encode_seconds, "apply_seconds": self.apply_seconds,
                "failed": dict(self.failed), "skipped": dict(self.skipped),
                "formats": dict(self.formats), "bytes_by_source": dict(self.bytes_by_source)}
