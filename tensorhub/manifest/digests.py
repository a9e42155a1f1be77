"""Chunk digests: the algorithms a manifest may name and how a chunk's bytes are hashed.

Nothing here performs I/O.  A manifest (:mod:`tensorhub.manifest.manifest`) carries one digest
per chunk in its algorithm, and, for readers on the holder's own host, one in
:data:`LOCAL_ALGO`; every chunk a reader lands is checked against one of them with
:func:`digest_of` before it counts.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import blake3
import xxhash

from ..errors import LocalProtocolError

DIGEST_ALGOS = ("blake3", "sha256", "xxh3-128")
"""Per-chunk digests a manifest may name.  ``blake3`` (the default) and ``sha256`` are
cryptographic: no holder can make other bytes that pass.  ``xxh3-128`` catches
corruption (bit flips, truncation, a buggy or stale holder) at memory speed but can be
forged in milliseconds: only for a trusted fleet, where every holder is honest."""

DIGEST_SIZES = {"blake3": 32, "sha256": 32, "xxh3-128": 16}
"""Bytes of one chunk digest, per algorithm."""

TRUSTED_ONLY = frozenset({"xxh3-128"})
"""Digests that only hold where every holder is trusted (see :data:`DIGEST_ALGOS`)."""

LOCAL_ALGO = "xxh3-128"
"""The digest of :attr:`Manifest.local_digests`: what a reader checks a chunk against
when its holder is a process that can already write the reader's memory."""

HASHED_AS_LANDED = frozenset({"xxh3-128"})
"""Digests a TCP reader computes itself as a chunk of many pieces lands (while each
piece is in the cache), instead of a pool thread reading the chunk again: xxh3 keeps
the GIL for inputs under about 100 KiB, so a reader thread hashing piece by piece
never waits to take it back.  blake3 and sha256 let go of it for every input of 2 KiB
or more (see :func:`digest_of`)."""

THREADED_HASH_BYTES = 1 << 20
"""Chunks at least this large are hashed by blake3 with several threads when a manifest
is built.  Measured here (2 cores, 1 GiB in 4 MiB chunks): one thread 6.1 GB/s, all
cores 11.4 GB/s (xxh3-128: 16 GB/s).  A fetch verifies with one thread per chunk: its
window already keeps several chunks in flight at once."""


def new_hasher(algo: str, threads: bool = False) -> Any:
    """A fresh incremental hasher (``update`` / ``digest``) for ``algo``; with
    ``threads``, blake3 spreads a large ``update`` over every core."""
    if algo == "xxh3-128":
        return xxhash.xxh3_128()
    if algo == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
    if algo == "sha256":
        return hashlib.sha256()
    raise LocalProtocolError(f"unknown digest algorithm {algo!r}; use one of {DIGEST_ALGOS}")


HASHED_BLOCK = 1 << 20
"""Bytes hashed at a time by :func:`digest_of` when it hands each block on: small
enough to be in the cache still when the block is copied on, large enough that the
thread's GIL handovers between blocks cost nothing (256 KiB blocks measured slower
than hashing and copying a 16 MiB chunk in two passes, next to a receiving thread)."""


def digest_of(algo: str, segments: Iterable[Any], threads: bool = False,
              each: Callable[[int, memoryview], None] | None = None) -> bytes:
    """The digest of the segments' bytes, in order.  A segment may be an array itself
    (see :meth:`LocalVersion.buffers`): xxh3 and sha256 hash any contiguous buffer,
    blake3 only byte-format ones, so it gets a byte view of each array.  ``segments`` is
    read once, in order, each segment hashed before the next is asked for (a copy may
    hand them out as it goes: :class:`~tensorhub.transport.base.SourceVerifier`).

    With ``each``, the bytes are hashed :data:`HASHED_BLOCK` at a time and each block
    is handed to ``each(offset, block)`` just after it was hashed (while it is in the
    cache): one pass over memory for a check and a copy.

    blake3 and sha256 let go of the GIL for every input of 2 KiB or more, and take it
    back after: beside a thread of the same process running Python, each take waits
    for that thread's switch interval.  So their segments under
    :data:`COALESCE_BELOW` are hashed together, copied into a scratch buffer of this
    thread's (one update per :data:`HASHED_BLOCK`, not one per tensor): measured, 4 MiB
    in 1,024 pieces, 1.05 ms instead of 1.32 idle and 23 ms instead of 630 beside a
    spinning thread."""
    h = new_hasher(algo, threads)
    if each is None and algo == "xxh3-128":
        # One C-level pass over the pieces: no view or loop step of ours per piece (a
        # chunk of 1,000 small tensors: 0.2 ms against 0.4 ms here).  xxhash keeps the
        # GIL for small inputs.
        deque(map(h.update, segments), maxlen=0)
    elif each is None:
        _update_coalesced(h, segments)
    else:
        at = 0
        for s in segments:
            view = (s if isinstance(s, memoryview) else memoryview(s)).cast("B")
            for lo in range(0, len(view), HASHED_BLOCK):
                block = view[lo:lo + HASHED_BLOCK]
                h.update(block)
                each(at + lo, block)
            at += len(view)
    out: bytes = h.digest()
    return out


COALESCE_BELOW = 256 << 10
"""Segments shorter than this are hashed together (see :func:`digest_of`)."""

_scratch = threading.local()


def _update_coalesced(h: Any, segments: Iterable[Any]) -> None:
    """``h.update`` with each segment in order, those under :data:`COALESCE_BELOW`
    gathered first into this thread's scratch buffer of :data:`HASHED_BLOCK` bytes."""
    buf: memoryview | None = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(bytearray(HASHED_BLOCK))
    held = 0
    for s in segments:
        view = (s if isinstance(s, memoryview) else memoryview(s)).cast("B")
        n = len(view)
        if n >= COALESCE_BELOW:
            if held:
                h.update(buf[:held])
                held = 0
            h.update(view)
            continue
        if held + n > HASHED_BLOCK:
            h.update(buf[:held])
            held = 0
        buf[held:held + n] = view
        held += n
    if held:
        h.update(buf[:held])
