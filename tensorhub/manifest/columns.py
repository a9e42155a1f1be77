"""Tensor columns a manifest shares with one decoded lately, found by their bytes.

The next version of a model lists the same tensors; only its digests change.  Its
manifest's tensor columns are then the very bytes of the last one's (the encoding is
canonical), and parsing them again costs most of a decode: 10,000 names made into
strings, then hashed and compared as a cache key (about 0.5 ms of 0.7 here).
:func:`split` reads a manifest's top-level map with the columns left unparsed, as their
byte span, and :func:`known` finds the specs of columns with the same blake3 digest,
which the decode that first parsed and checked them left with :func:`remember`.

Nothing here decides whether a manifest is well formed: input that does not split
cleanly is left to the full parse, which says what is wrong.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import blake3
import msgpack

from ..model import TensorSpec
from .table import CACHE_LOCK

Specs = tuple[tuple[TensorSpec, ...], int]
"""Tensor specs laid end to end, and the bytes they span."""

KEPT = 16
"""Columns remembered (by digest), as many as :mod:`tensorhub.manifest.manifest` keeps parsed."""

_BY_DIGEST: OrderedDict[bytes, Specs] = OrderedDict()

SPLIT_MAX = 4 << 20
"""Largest manifest :func:`split` reads (about 200,000 tensors): its unpacker copies the
bytes it is fed, and a larger manifest's full parse costs far more than that anyway."""

_MAPS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
"""First bytes of a msgpack map (fixmap, map 16, map 32)."""


def split(data: bytes, **limits: Any) -> tuple[dict[str, Any], bytes] | None:
    """The top-level fields of a manifest, its ``tensors`` value left out (None in their
    place), and the blake3 digest of that value's bytes; None where ``data`` is not a
    map with one well-formed ``tensors`` field that this reads to its last byte
    (``limits``: the ``msgpack`` limits of the full parse)."""
    if not data or len(data) > SPLIT_MAX or data[0] not in _MAPS:
        return None
    unpacker = msgpack.Unpacker(max_buffer_size=len(data), raw=False, strict_map_key=True,
                                **limits)
    unpacker.feed(data)
    fields: dict[str, Any] = {}
    span: tuple[int, int] | None = None
    try:
        for _ in range(unpacker.read_map_header()):
            name = unpacker.unpack()
            if name == "tensors" and span is None:
                start = unpacker.tell()
                unpacker.skip()
                span = start, unpacker.tell()
                fields[name] = None
            elif name in fields or not isinstance(name, str):
                return None  # duplicate or odd keys: the full parse decides
            else:
                fields[name] = unpacker.unpack()
    except Exception:  # msgpack raises a zoo of types on bad input
        return None
    if span is None or unpacker.tell() != len(data):
        return None
    return fields, blake3.blake3(memoryview(data)[span[0]:span[1]]).digest()


def known(digest: bytes) -> Specs | None:
    """The specs of columns with this digest, if a decode here remembered them."""
    with CACHE_LOCK:
        hit = _BY_DIGEST.get(digest)
        if hit is not None:
            _BY_DIGEST.move_to_end(digest)
    return hit


def remember(digest: bytes, specs: Specs) -> None:
    """Columns with this digest were parsed and checked into ``specs``."""
    with CACHE_LOCK:
        _BY_DIGEST[digest] = specs
        _BY_DIGEST.move_to_end(digest)
        while len(_BY_DIGEST) > KEPT:
            _BY_DIGEST.popitem(last=False)
