"""A fetch into tensors through a staging ring.

Each chunk the fetch asks for is given a ring slot to land in (instead of its place in
the tensors); the slot is digest-checked in the worker thread that checks any chunk, and
only a chunk that passed is copied to its place (``cudaMemcpyAsync`` into GPU memory,
or ``memmove`` into host tensors) before the slot is released.  The fetch keeps no more
chunks in flight than the ring has slots: :meth:`Landing.streams` and
:meth:`Landing.window_cap` size its streams and windows from the ring, and
:meth:`Landing.budget` caps each claim of chunks by the free slots, so
:meth:`Landing.take` finds a free slot (see there for the one exception).  A chunk
its stream gives up (the source failed, stalled, refused it, or the fetch was
cancelled) is :meth:`~Landing.abandon`-ed: its slot is free again at once, or, if a
worker is copying it, when that copy ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import LocalProtocolError, TransportError
from ..manifest import Manifest
from ..protocol.sizing import MIN_CHUNKS
from ..transport.base import Verifier
from .buffers import Place
from .ring import Claim, StagingRing


class Landing:
    """Where the chunks of one fetch land: ring slots, then ``places`` (manifest order)."""

    def __init__(self, manifest: Manifest, places: Sequence[Place], ring: StagingRing
                 ) -> None:
        ring.fit(manifest.chunk_size)
        self.manifest = manifest
        self.places = list(places)
        self.ring = ring
        self._claims: dict[int, Claim] = {}
        self.overflows = 0

    def streams(self, most: int) -> int:
        """Streams the fetch may run: each keeps at least ``MIN_CHUNKS`` chunks in
        flight, so at most ``slots // MIN_CHUNKS`` (and at least one)."""
        return max(1, min(most, self.ring.slots // MIN_CHUNKS))

    def window_cap(self, streams: int) -> int:
        """Bytes one of ``streams`` streams may keep in flight: its share of the slots."""
        return max(MIN_CHUNKS, self.ring.slots // streams) * self.manifest.chunk_size

    def budget(self, streams: int) -> int:
        """Most bytes one claim of chunks may take: a stream's share, and no more
        than the free slots hold."""
        free = self.ring.free_slots() * self.manifest.chunk_size
        return max(self.manifest.chunk_size, min(self.window_cap(streams), free))

    def take(self, chunk: int, verify: Verifier) -> tuple[list[memoryview], Verifier]:
        """A slot for ``chunk``: where it lands, and the check to run once it has
        landed (``verify``, then the copy to its place, then the slot's release).

        With every slot in use -- only for a moment after a stream ended with chunks
        still being checked, whose slots its successor cannot have yet -- the chunk
        lands in a buffer of its own instead (counted in ``overflows``)."""
        start, stop = self.manifest.chunk_range(chunk)
        claim = self.ring.acquire_nowait()
        if claim is None:
            self.overflows += 1
            spill = np.empty(stop - start, np.uint8)

            def check_spill(landed: Sequence[memoryview]) -> None:
                verify(landed)
                self._place(start, stop, int(spill.ctypes.data))
            return [memoryview(spill)], check_spill  # type: ignore[arg-type]
        self._claims[chunk] = claim
        ring = self.ring

        def check_then_place(landed: Sequence[memoryview]) -> None:
            if not ring.begin(claim):
                raise TransportError(f"chunk {chunk} was given up before its check")
            try:
                verify(landed)
                self._place(start, stop, claim.ptr)
            finally:
                ring.release(claim)

        return [claim.view[:stop - start]], check_then_place

    def _place(self, start: int, stop: int, src: int) -> None:
        """Copy bytes ``[start, stop)`` of the version from ``src`` to their tensors."""
        copy = self.ring.copier.copy
        at = src
        for seg in self.manifest.segments(start, stop):
            n = seg.stop - seg.start
            copy(self.places[seg.index].ptr + seg.start, at, n)
            at += n

    def abandon(self, chunk: int) -> None:
        """``chunk`` was reported, or will not be: give its slot back unless its check
        did (see the module doc)."""
        claim = self._claims.pop(chunk, None)
        if claim is not None:
            self.ring.abandon(claim)

    def close(self) -> None:
        """The fetch ended: give back every slot still claimed."""
        for chunk in list(self._claims):
            self.abandon(chunk)


def landing_places(manifest: Manifest, places: Sequence[Place]) -> list[Place]:
    """``places`` checked against the manifest's specs (dtype, shape, writable)."""
    from ..dtypes import display
    for t, p in zip(manifest.tensors, places, strict=True):
        if p.dtype != t.dtype or p.shape != t.shape:
            raise LocalProtocolError(
                f"into[{t.name!r}] is {display(p.dtype)}{list(p.shape)}, {manifest.key} "
                f"has {display(t.dtype)}{list(t.shape)}")
        if not p.writable:
            raise LocalProtocolError(f"into[{t.name!r}] is read-only")
    return list(places)


class ThroughRing:
    """``fetch(into=ThroughRing(tensors, ring))``: land the fetch in ``tensors`` (a
    mapping of name -> tensor, or an ``nn.Module``) through ``ring``'s slots, each
    chunk checked there, then copied to its place.  Device tensors go this way without
    asking (through a ring of the peer's); host tensors only when asked, e.g. to measure
    the staging path on a host without a GPU."""

    def __init__(self, tensors: Any, ring: StagingRing) -> None:
        self.tensors = tensors
        self.ring = ring
