"""What this peer holds: references to arrays, never copies.

A :class:`LocalVersion` points at the caller's own arrays (after ``publish``) or at the
arrays a fetch filled.  It knows which chunks are verified, serves leases on their
memory, and implements the unpublish contract: :meth:`Store.hide` stops new leases at
once, :meth:`Store.wait_drained` returns when the last in-flight lease has ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ..manifest.manifest import Manifest, chunk_buffers, chunk_pieces
from ..model import VersionKey, byte_views
from ..protocol.dataplane import BAD_REQUEST, NOT_HELD, NOT_YET
from ..protocol.refs import Holding, bitmap_of
from ..transport.base import NotServing

if TYPE_CHECKING:
    from ..device.landing import Landing
    from ..device.serving import DeviceSource


class LocalVersion:
    def __init__(self, manifest: Manifest, arrays: Sequence[np.ndarray[Any, Any]],
                 publisher: str, verified: bool, flat: memoryview | None = None,
                 derived: bool = False) -> None:
        """``flat``, when given, is one buffer laid out exactly like the version's byte
        space that holds every tensor at its manifest offset: chunks are then one
        contiguous range each, whatever the number of tensors in them."""
        self.manifest = manifest
        self.arrays = list(arrays)
        self._nonempty: list[np.ndarray[Any, Any]] | None = None
        self.flat = flat
        self._segments: dict[int, list[memoryview]] = {}
        self.publisher = publisher
        self.derived = derived
        """Slices assembled in a consumer's own layout (see :attr:`Holding.derived`)."""
        self.announced: tuple[int, bytes] = (0, b"")
        """The publisher's generation and signature of this publish (secure mode; see
        :attr:`Holding.publisher_sig`), carried by every copy."""
        n = manifest.num_chunks
        self.verified = bytearray(b"\x01" * n if verified else n)
        self.num_verified = n if verified else 0
        self.hidden = False
        self.receiving = not verified
        """True while a fetch is filling this version (readers may wait for chunks)."""
        self.progress = trio.Event()
        """Set (and replaced) whenever a chunk is verified or the fetch ends."""
        self.inflight = 0
        self.drained = trio.Event()
        self.drained.set()
        self.encoded_manifest = manifest.encode()
        self.landing: Landing | None = None
        """While a fetch lands this version through a staging ring: the ring's slots
        (:mod:`tensorhub.device.landing`); chunks then never land in ``arrays``."""
        self.source: DeviceSource | None = None
        """When ``arrays`` are in device memory: what serves verified chunks, through
        a staging ring (:mod:`tensorhub.device.serving`); ``segments`` is then unused."""

    def host_copy(self) -> list[np.ndarray[Any, Any]]:
        """The whole version in new host arrays (retention's offload)."""
        if self.source is not None:
            return self.source.host_copy()
        return [np.array(a, copy=True) for a in self.arrays]

    @property
    def complete(self) -> bool:
        return self.num_verified == self.manifest.num_chunks

    def _nonempty_arrays(self) -> list[np.ndarray[Any, Any]]:
        if self._nonempty is None:
            nonempty = self.manifest.table.nonempty
            self._nonempty = self.arrays if len(nonempty) == len(self.arrays) \
                else [self.arrays[i] for i in nonempty]
        return self._nonempty

    def segments(self, chunk: int) -> list[memoryview]:
        """The memory of one chunk: one byte view per tensor piece, or one view of
        ``flat``.  Made when a chunk is first asked for and kept once it is verified,
        for serving it."""
        if self.flat is not None:
            start, stop = self.manifest.chunk_range(chunk)
            return [self.flat[start:stop]]
        cached = self._segments.get(chunk)
        if cached is None:
            lo, hi, head, tail = self.manifest.chunk_tensors(chunk)
            cached = chunk_pieces(byte_views(self._nonempty_arrays()[lo:hi]), head, tail)
            if self.verified[chunk]:
                self._segments[chunk] = cached
        return cached

    def buffers(self, chunk: int) -> list[Any]:
        """The memory of one chunk as the arrays themselves wherever a tensor lies
        whole in it (byte views only for the pieces of tensors cut by its bounds), for a
        transport that lands in any buffer (``Connection.lands_arrays``).

        A fetch of 10,000 small tensors then makes no object per tensor: 10,000 views
        made per fetch survive long enough to be promoted, and pushed the garbage
        collector into a full collection (8-16 ms here) in every third fetch.  Arrays
        whose dtype cannot export a buffer get :meth:`segments`."""
        if self.flat is not None or not self.manifest.table.exports_buffers():
            return self.segments(chunk)
        lo, hi, head, tail = self.manifest.chunk_tensors(chunk)
        return chunk_buffers(self._nonempty_arrays()[lo:hi], head, tail)

    def mark_verified(self, chunk: int) -> None:
        if not self.verified[chunk]:
            self.verified[chunk] = 1
            self.num_verified += 1
            self._signal()

    def end_receiving(self) -> None:
        self.receiving = False
        self._signal()

    def _signal(self) -> None:
        self.progress.set()
        self.progress = trio.Event()

    def holding(self) -> Holding:
        m = self.manifest
        chunks = (i for i, v in enumerate(self.verified) if v)
        bitmap = b"" if self.complete else bitmap_of(chunks, m.num_chunks)
        if not self.complete and not bitmap:  # nothing verified yet: an all-zero map
            bitmap = bytes((m.num_chunks + 7) // 8)
        return Holding(m.model, m.version, m.manifest_id(), self.publisher, m.num_chunks, bitmap,
                       m.shard, m.world, m.layout, self.derived, *self.announced,
                       m.schema_id(), m.total_bytes)


class Store:
    """This peer's holdings, keyed by version; the data plane's :class:`Provider`."""

    def __init__(self, chunk_wait: float = 5.0) -> None:
        self.versions: dict[VersionKey, LocalVersion] = {}
        self.chunk_wait = chunk_wait
        """Longest a reader's request waits for a chunk we are still receiving."""
        self.expected: dict[VersionKey, trio.Event] = {}
        """Versions a fetch here is about to add (see :meth:`expecting`)."""
        self.on_dropped: list[Callable[[LocalVersion], None]] = []
        """Called with each version (or a swapped-out memory of one) once it is no longer
        served and its reads have drained: one-sided backends revoke its keys."""

    def add(self, local: LocalVersion) -> None:
        self.versions[local.manifest.key] = local
        arrived = self.expected.pop(local.manifest.key, None)
        if arrived is not None:
            arrived.set()

    @contextmanager
    def expecting(self, key: VersionKey) -> Iterator[None]:
        """A fetch of ``key`` has asked for its plan before its manifest is in: until
        it adds the version (or gives up), a reader the plan sent here is told "not
        yet" and waits as for a chunk still on its way, instead of "not held"."""
        event = self.expected.setdefault(key, trio.Event())
        try:
            yield
        finally:
            if self.expected.get(key) is event:
                del self.expected[key]
            event.set()

    def get(self, key: VersionKey) -> LocalVersion | None:
        return self.versions.get(key)

    # -- Provider ---------------------------------------------------------------

    def manifest_bytes(self, key: VersionKey) -> bytes:
        local = self.versions.get(key)
        if local is None or local.hidden:
            raise NotServing(NOT_HELD, f"{key} is not held here")
        return local.encoded_manifest

    async def wait_chunk(self, key: VersionKey, chunk: int, stage: bool = True) -> None:
        """Return once ``chunk`` can be leased (or it never will, or ``chunk_wait``
        passed): the version is in, the chunk verified, and -- unless not ``stage`` --
        a device version's chunk copied to its staging ring."""
        with trio.move_on_after(self.chunk_wait):
            arriving = self.expected.get(key)
            if arriving is not None and key not in self.versions:
                await arriving.wait()
            local = self.versions.get(key)
            if local is None or not 0 <= chunk < local.manifest.num_chunks:
                return
            while local.receiving and not local.hidden and not local.verified[chunk]:
                await local.progress.wait()
            if stage and local.source is not None and local.verified[chunk] \
                    and not local.hidden:
                await local.source.stage(chunk)

    def _leasable(self, key: VersionKey, chunk: int) -> LocalVersion:
        """The version ``chunk`` of which a reader may lease, or why not."""
        local = self.versions.get(key)
        if local is None and key in self.expected:
            raise NotServing(NOT_YET, f"{key} is being fetched here: manifest not in yet")
        if local is None or local.hidden:
            raise NotServing(NOT_HELD, f"{key} is not held here")
        if not 0 <= chunk < local.manifest.num_chunks:
            raise NotServing(BAD_REQUEST, f"{key} has no chunk {chunk}")
        if not local.verified[chunk]:
            raise NotServing(NOT_YET, f"chunk {chunk} of {key} is not verified here yet")
        return local

    @contextmanager
    def _leased(self, key: VersionKey, chunk: int,
                host: Callable[[LocalVersion, int], Sequence[Any]]
                ) -> Iterator[tuple[LocalVersion, Sequence[Any]]]:
        """The chunk's memory pinned: ``host(local, chunk)`` of a version in host
        memory, a staged copy of one in device memory."""
        local = self._leasable(key, chunk)
        with self._pinned(local):
            if local.source is None:
                yield local, host(local, chunk)
            else:
                with local.source.lease(chunk) as staged:
                    yield local, staged

    @contextmanager
    def lease(self, key: VersionKey, chunk: int) -> Iterator[Sequence[memoryview]]:
        with self._leased(key, chunk, LocalVersion.segments) as (_, segments):
            yield segments

    @contextmanager
    def lease_pieces(self, key: VersionKey, chunk: int
                     ) -> Iterator[tuple[Sequence[Any], int]]:
        """As :meth:`lease`, the chunk's memory as any C-contiguous buffers, sized by
        ``nbytes`` (:meth:`LocalVersion.buffers`: the arrays themselves wherever a
        tensor lies whole in the chunk), for a sender that takes any buffer (a vectored
        socket write), and the chunk's size (no pass over its pieces to add them up).
        Serving a version of 10,000 small tensors then keeps no view per tensor: 20,000
        such objects a version made every full collection of the garbage collector
        longer, and the serving peer stalled 20-40 ms in some."""
        with self._leased(key, chunk, LocalVersion.buffers) as (local, pieces):
            start, stop = local.manifest.chunk_range(chunk)
            yield pieces, stop - start

    @contextmanager
    def lease_device(self, key: VersionKey, chunk: int) -> Iterator[Sequence[Any] | None]:
        """As :meth:`lease`, for a backend that reads device memory in place: a device
        version's chunk as pieces of its tensors (nothing staged), or None for a
        version in host memory (lease it the usual way)."""
        local = self._leasable(key, chunk)
        if local.source is None:
            yield None
            return
        with self._pinned(local):
            yield local.source.device_pieces(chunk)

    @contextmanager
    def hold(self, key: VersionKey) -> Iterator[LocalVersion | None]:
        """Pin a complete version we hold while this peer reads it itself (a
        resharding fetch using its own shards): unpublish waits for it like for a
        reader.  Yields None when it is not held complete."""
        local = self.versions.get(key)
        if local is None or local.hidden or not local.complete or local.source is not None:
            yield None  # device memory: no host view of the whole version to hand out
            return
        with self._pinned(local):
            yield local

    @contextmanager
    def _pinned(self, local: LocalVersion) -> Iterator[None]:
        if local.inflight == 0:
            local.drained = trio.Event()
        local.inflight += 1
        try:
            yield
        finally:
            local.inflight -= 1
            if local.inflight == 0:
                local.drained.set()

    # -- unpublish ----------------------------------------------------------------

    def hide(self, key: VersionKey) -> LocalVersion | None:
        local = self.versions.get(key)
        if local is not None:
            local.hidden = True
            local.end_receiving()  # readers waiting for a chunk get NOT_HELD now
        return local

    async def swap(self, new: LocalVersion) -> None:
        """Serve ``new`` (same version, other memory) from now on; return when reads of
        the old memory have drained."""
        old = self.versions.get(new.manifest.key)
        self.versions[new.manifest.key] = new
        if old is not None:
            old.hidden = True
            old.end_receiving()
            await old.drained.wait()
            self._dropped(old)

    async def wait_drained(self, key: VersionKey) -> None:
        local = self.versions.get(key)
        if local is None:
            return
        await local.drained.wait()
        if self.versions.get(key) is local:
            del self.versions[key]
            self._dropped(local)
        elif local.source is not None:
            local.source.close()

    def _dropped(self, local: LocalVersion) -> None:
        if local.source is not None:
            local.source.close()
        for hook in self.on_dropped:
            hook(local)
