"""A fetch into tensors through a staging ring.

Each chunk the fetch asks for is given a ring slot to land in (instead of its place in
the tensors); the slot is digest-checked in the worker thread that checks any chunk,
and copied to its place (``cudaMemcpyAsync`` into GPU memory, or ``memmove`` into host
tensors) block by block as it is hashed, each block while it is still in the cache,
before the slot is released.  A chunk that fails its digest is fetched again over the
bytes it left in its place; the fetch never counts, serves or returns a chunk that did
not pass.  The fetch keeps no more
chunks in flight than the ring has slots: :meth:`Landing.streams` and
:meth:`Landing.window_cap` size its streams and windows from the ring, and
:meth:`Landing.budget` caps each claim of chunks by the free slots, so
:meth:`Landing.take` finds a free slot (see there for the one exception).  A chunk
its stream gives up (the source failed, stalled, refused it, or the fetch was
cancelled) is :meth:`~Landing.abandon`-ed: its slot is free again at once, or, if a
worker is copying it, when that copy ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import trio

from ..errors import LocalProtocolError, TransportError
from ..manifest.manifest import Manifest
from ..protocol.sizing import MIN_CHUNKS
from ..transport.base import Verifier
from .buffers import DeviceBytes, DeviceChunks, Place
from .digest import dsum_for
from .ring import Claim, StagingRing


class PassingVerifier(Protocol):
    """A chunk's check that can hand each block on as it hashes it (see
    :func:`~tensorhub.manifest.digests.digest_of`); raises if the chunk fails."""

    def __call__(self, landed: Sequence[memoryview],
                 each: Callable[[int, memoryview], None] | None = None) -> None: ...


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
        self.on_device = bool(self.places) and all(p.on_device for p in self.places)
        """Whether every tensor is in device memory (then a transport that copies into
        device memory may land chunks in place: :meth:`in_place`)."""
        self._in_place: DeviceChunks | None = None
        self._checking = 0
        """Checks running now (in a transport's threads): each writes to the tensors."""
        self._lock = threading.Lock()

    async def settled(self) -> None:
        """Return once no check of this fetch's chunks is running: a transport's thread
        may still be checking (and placing) one after its stream was cancelled, and the
        caller gets its tensors back only after that."""
        while self._checking:
            await trio.sleep(0.001)

    def _checks(self, step: int) -> None:
        with self._lock:
            self._checking += step

    def in_place(self, chunk: int) -> list[DeviceBytes]:
        """``chunk``'s places themselves (no slot), for a transport that copies into
        device memory; the chunk is then checked where it landed, on the device
        (:func:`~tensorhub.device.digest.dsum_for`)."""
        if self._in_place is None:
            self._in_place = DeviceChunks(self.manifest, self.places)
        return self._in_place.pieces(chunk)

    def dsum(self, landed: Sequence[Any]) -> bytes:
        """The ``dsum-128`` of a chunk landed in place."""
        device = self.places[0].device if self.places else 0
        return dsum_for(self.ring.copier.name, device)([(d.ptr, d.nbytes) for d in landed])

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

    def take(self, chunk: int, verify: PassingVerifier) -> tuple[list[memoryview], Verifier]:
        """A slot for ``chunk``: where it lands, and the check to run once it has
        landed (``verify``, copying each block to its place as it is hashed, then the
        slot's release).

        With every slot in use -- only for a moment after a stream ended with chunks
        still being checked, whose slots its successor cannot have yet -- the chunk
        lands in a buffer of its own instead (counted in ``overflows``)."""
        start, stop = self.manifest.chunk_range(chunk)
        claim = self.ring.acquire_nowait()
        if claim is None:
            self.overflows += 1
            spill = np.empty(stop - start, np.uint8)

            def check_spill(landed: Sequence[memoryview]) -> None:
                self._checks(1)
                try:
                    self._check_and_place(verify, landed, start, int(spill.ctypes.data))
                finally:
                    self._checks(-1)
            return [memoryview(spill)], check_spill  # type: ignore[arg-type]
        self._claims[chunk] = claim
        ring = self.ring

        def check_then_place(landed: Sequence[memoryview]) -> None:
            self._checks(1)
            try:
                if not ring.begin(claim):
                    raise TransportError(f"chunk {chunk} was given up before its check")
                try:
                    self._check_and_place(verify, landed, start, claim.ptr)
                finally:
                    ring.release(claim)
            finally:
                self._checks(-1)

        return [claim.view[:stop - start]], check_then_place

    def _check_and_place(self, verify: PassingVerifier, landed: Sequence[memoryview],
                         start: int, src: int) -> None:
        """Check the chunk that begins at byte ``start`` of the version, landed at
        ``src``, and copy it to its tensors: block by block as it is hashed where the
        copier copies host memory, the whole chunk once it passed where a GPU copies
        it (a DMA reads memory, not the cache, and each copy waits for its stream)."""
        if not self.ring.copier.blockwise:
            verify(landed)
            self._place(start, src, sum(map(len, landed)))
            return
        verify(landed, lambda offset, block: self._place(start + offset, src + offset,
                                                         len(block)))

    def _place(self, start: int, src: int, n: int) -> None:
        """Copy ``n`` bytes of the version from ``start`` on, at ``src``, to their
        tensors."""
        copy = self.ring.copier.copy
        for seg in self.manifest.segments(start, start + n):
            size = seg.stop - seg.start
            copy(self.places[seg.index].ptr + seg.start, src, size)
            src += size

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
    chunk checked there and copied to its place.  Device tensors go this way without
    asking (through a ring of the peer's); host tensors only when asked, e.g. to measure
    the staging path on a host without a GPU."""

    def __init__(self, tensors: Any, ring: StagingRing) -> None:
        self.tensors = tensors
        self.ring = ring
