"""Held versions whose tensors are in device memory, served through a staging ring.

A reader's request for a chunk finds it *staged* (copied to a ring slot) or not.  Not
staged: the lease is answered "not yet" and the server waits in :meth:`DeviceSource.stage`,
which copies the chunk to a slot in a worker thread (``cudaMemcpyAsync`` on that thread's
stream) and starts copying the chunks after it into free slots without waiting
(read-ahead), so the next requests find them staged and the copies overlap the sends.
A staged chunk stays in its slot while it is leased and after, as a cache, until a slot
is needed: the least recently staged chunk no reader leases gives its slot up, whatever
version it belongs to (one :class:`ServeCache` per GPU, shared by the versions on it).
The host never holds more of them than the ring.

The manifest's digests are computed the same way (:func:`staged_digests`): chunk by
chunk through one slot, hashed on the host copy; its ``dsum-128`` device digests
(:func:`dsum_digests`) on the device, in place.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import trio

from ..manifest.digests import THREADED_HASH_BYTES, digest_of
from ..manifest.manifest import Manifest
from ..protocol.dataplane import NOT_HELD, NOT_YET
from ..transport import copy_threads
from ..transport.base import NotServing
from .buffers import DeviceBytes, DeviceChunks, Place
from .copier import Copier
from .digest import dsum_for
from .ring import Claim, StagingRing

READ_AHEAD = 4
"""Chunks after a requested one copied to free slots without waiting."""

Staged = tuple[int, int]
"""(id of a :class:`DeviceSource`, chunk)."""


class ServeCache:
    """The staged chunks of the device versions one ring serves."""

    def __init__(self, ring: StagingRing) -> None:
        self.ring = ring
        self.staged: OrderedDict[Staged, Claim] = OrderedDict()
        self.leases: dict[Staged, int] = {}
        self.copying: dict[Staged, trio.Event] = {}
        self.errors: dict[Staged, BaseException] = {}
        """Copies that failed, until the reader waiting for them is told."""
        self.changed = trio.Event()
        """Set (and replaced) when a lease ends or a copy is done: a slot may be free."""

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def take_slot(self) -> Claim | None:
        """A free slot, or the slot of the least recently staged unleased chunk."""
        claim = self.ring.acquire_nowait()
        if claim is not None:
            return claim
        for old, held in self.staged.items():
            if old not in self.leases:
                del self.staged[old]
                self.ring.release(held)
                return self.ring.acquire_nowait()
        return None

    def drop(self, owner: int) -> None:
        """Give back the slots of ``owner``'s staged chunks that no reader leases."""
        for k in [k for k in self.staged if k[0] == owner and k not in self.leases]:
            self.ring.release(self.staged.pop(k))
        self.notify()


def gather(manifest: Manifest, places: Sequence[Place], copier: Copier, start: int,
           stop: int, dst: int) -> None:
    """Copy bytes ``[start, stop)`` of the version from their tensors to ``dst``."""
    at = dst
    for seg in manifest.segments(start, stop):
        n = seg.stop - seg.start
        copier.copy(at, places[seg.index].ptr + seg.start, n)
        at += n


class DeviceSource:
    """Serves ``places`` (manifest order) through ``cache``."""

    def __init__(self, manifest: Manifest, places: Sequence[Place], cache: ServeCache
                 ) -> None:
        cache.ring.fit(manifest.chunk_size)
        self.manifest = manifest
        self.places = list(places)
        self.cache = cache
        self.closed = False
        self._in_place: DeviceChunks | None = None

    def device_pieces(self, chunk: int) -> list[DeviceBytes]:
        """``chunk``'s bytes in the tensors themselves, one piece per tensor it spans
        (for a backend that reads device memory in place; nothing is staged)."""
        if self._in_place is None:
            self._in_place = DeviceChunks(self.manifest, self.places)
        return self._in_place.pieces(chunk)

    @contextmanager
    def lease(self, chunk: int) -> Iterator[list[memoryview]]:
        """The staged copy of ``chunk``, kept while leased; "not yet" if not staged."""
        k, cache = (id(self), chunk), self.cache
        claim = cache.staged.get(k)
        if claim is None:
            raise NotServing(NOT_YET, f"chunk {chunk} is being copied from the GPU")
        start, stop = self.manifest.chunk_range(chunk)
        cache.leases[k] = cache.leases.get(k, 0) + 1
        try:
            yield [claim.view[:stop - start]]
        finally:
            cache.leases[k] -= 1
            if not cache.leases[k]:
                del cache.leases[k]
                if self.closed:  # the last read of a version no longer served
                    cache.ring.release(cache.staged.pop(k))
                cache.notify()

    async def stage(self, chunk: int) -> None:
        """Return once ``chunk`` is staged; start copying the next few meanwhile."""
        cache, me = self.cache, id(self)
        await cache.ring.ready()
        for ahead in range(chunk + 1, min(chunk + 1 + READ_AHEAD, self.manifest.num_chunks)):
            if (me, ahead) not in cache.staged and (me, ahead) not in cache.copying:
                claim = cache.ring.acquire_nowait()
                if claim is None:
                    break
                self._start(ahead, claim)
        k = (me, chunk)
        while k not in cache.staged:
            copying = cache.copying.get(k)
            if copying is not None:
                await copying.wait()
                failed = cache.errors.pop(k, None)
                if failed is not None:
                    raise NotServing(NOT_HELD, f"chunk {chunk}: the copy from the GPU "
                                     f"failed ({failed})")
                continue
            claim = cache.take_slot()
            if claim is None:
                await cache.changed.wait()
                continue
            self._start(chunk, claim)

    def _start(self, chunk: int, claim: Claim) -> None:
        k, cache = (id(self), chunk), self.cache
        done = cache.copying[k] = trio.Event()
        token = trio.lowlevel.current_trio_token()
        start, stop = self.manifest.chunk_range(chunk)

        def copy() -> None:
            error: BaseException | None = None
            try:
                cache.ring.begin(claim)
                gather(self.manifest, self.places, cache.ring.copier, start, stop, claim.ptr)
            except BaseException as exc:  # reported on the loop; the slot goes back
                error = exc
            try:
                token.run_sync_soon(self._copied, k, claim, done, error)
            except trio.RunFinishedError:
                cache.ring.release(claim)

        copy_threads.pool.submit(copy)

    def _copied(self, k: Staged, claim: Claim, done: trio.Event,
                error: BaseException | None) -> None:
        cache = self.cache
        del cache.copying[k]
        if error is None and not self.closed:
            cache.staged[k] = claim
        else:
            cache.ring.release(claim)
            if error is not None:
                cache.errors[k] = error
        done.set()
        cache.notify()

    def close(self) -> None:
        """No longer served: staged chunks give their slots back (those being read,
        when their last lease ends)."""
        self.closed = True
        self.cache.drop(id(self))
        for k in [k for k in self.cache.errors if k[0] == id(self)]:
            del self.cache.errors[k]

    def host_copy(self) -> list[np.ndarray[Any, Any]]:
        """The whole version in new host arrays (retention: the last copy of a version
        that must stay readable moves to host memory before its GPU buffers go)."""
        from ..dtypes import storage_dtype
        out = []
        for t, p in zip(self.manifest.tensors, self.places, strict=True):
            arr = np.empty(t.shape, storage_dtype(t.dtype))
            if arr.nbytes:
                self.cache.ring.copier.copy(int(arr.ctypes.data), p.ptr, arr.nbytes)
            out.append(arr)
        return out


def dsum_digests(places: Sequence[Place], copier: Copier
                 ) -> Callable[[Manifest], list[bytes]]:
    """For ``build_manifest(on_device=...)``: each chunk's ``dsum-128``, computed where
    the tensors are (run in a worker thread)."""
    device = places[0].device if places else 0
    dsum = dsum_for(copier.name, device)

    def digests(skeleton: Manifest) -> list[bytes]:
        copier.synchronize()  # the caller's writes to its tensors are done
        chunks = DeviceChunks(skeleton, places)
        return [dsum([(p.ptr, p.nbytes) for p in chunks.pieces(c)])
                for c in range(skeleton.num_chunks)]
    return digests


def staged_digests(places: Sequence[Place], ring: StagingRing, claim: Claim
                   ) -> Callable[[Manifest], list[bytes]]:
    """For ``build_manifest(digests=...)``: each chunk's digest, hashed on its host copy
    in ``claim``'s slot (run in a worker thread; the slot is released at the end)."""
    def digests(skeleton: Manifest) -> list[bytes]:
        ring.begin(claim)
        try:
            out = []
            for c in range(skeleton.num_chunks):
                start, stop = skeleton.chunk_range(c)
                gather(skeleton, places, ring.copier, start, stop, claim.ptr)
                out.append(digest_of(skeleton.digest_algo, [claim.view[:stop - start]],
                                     skeleton.chunk_size >= THREADED_HASH_BYTES))
            return out
        finally:
            ring.release(claim)
    return digests
