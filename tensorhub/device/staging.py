"""A peer's device buffers: its staging rings, and what publish and fetch do with
device tensors or with tensors passed :class:`~tensorhub.device.landing.ThroughRing`
(see :mod:`tensorhub.device`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import trio

from ..errors import LocalProtocolError
from ..manifest.manifest import Manifest
from ..torch import destination
from .buffers import Place, is_device, layout_array, place_of
from .copier import Copier, copier_for
from .landing import Landing, ThroughRing, landing_places
from .ring import StagingRing
from .serving import DeviceSource, ServeCache, dsum_digests, staged_digests

Digests = Callable[[Manifest], list[bytes]]
GPU_COPIER: Callable[[int], Copier] = partial(copier_for, True)

SLOTS = 8
"""Slots of a ring the peer makes itself: 8 keep two streams of four chunks in flight."""
SLOT_BYTES = 64 << 20
"""Bytes of a slot the peer makes itself: the largest automatic chunk size."""


class DeviceRings:
    """One serving cache per GPU, and landing rings for fetches into device tensors
    (one per fetch at a time, kept for the next: pinned memory is slow to allocate)."""

    def __init__(self, copier: Callable[[int], Copier] = GPU_COPIER, slots: int = SLOTS,
                 slot_bytes: int = SLOT_BYTES) -> None:
        """``copier(device)``: the copier for GPU ``device`` (tests hand device-like
        host memory a host copier); each ring has ``slots`` of ``slot_bytes``."""
        self._copier = copier
        self._size = slots, slot_bytes
        self._caches: dict[int, ServeCache] = {}
        self._idle: dict[int, list[StagingRing]] = {}

    def serve_cache(self, device: int) -> ServeCache:
        cache = self._caches.get(device)
        if cache is None:
            ring = StagingRing(*self._size, self._copier(device))
            cache = self._caches[device] = ServeCache(ring)
        return cache

    @contextmanager
    def landing_ring(self, device: int) -> Iterator[StagingRing]:
        idle = self._idle.setdefault(device, [])
        ring = idle.pop() if idle else StagingRing(*self._size, self._copier(device))
        try:
            yield ring
        finally:
            idle.append(ring)


def on_device(values: Collection[Any]) -> bool:
    """Whether any of ``values`` is in device memory (plain numpy arrays: at C speed)."""
    if set(map(type, values)) <= {np.ndarray}:
        return False
    return any(map(is_device, values))


def one_device(places: list[Place]) -> int:
    devices = {p.device for p in places if p.on_device}
    if len(devices) > 1:
        raise LocalProtocolError(f"tensors on several GPUs {sorted(devices)}: publish or "
                                 "fetch the tensors of each GPU as a version (or shard) of "
                                 "its own")
    return devices.pop() if devices else -1


@dataclass
class DevicePublish:
    """What publish makes of device tensors: host arrays that only describe them (for
    the manifest), the digest pass, and the source that serves them."""

    layout: list[tuple[str, np.ndarray[Any, Any]]]
    places: list[Place]
    cache: ServeCache

    async def manifest(self, build: Callable[..., Manifest], chunk_size: int
                       ) -> Manifest:
        """``build(digests=, on_device=)`` in a worker thread: the digests hashed on
        host copies of the chunks made in one slot of the serving ring, the device
        digests computed on the device."""
        ring = self.cache.ring
        ring.fit(chunk_size)
        await ring.ready()
        claim = await ring.acquire()
        try:
            return await trio.to_thread.run_sync(partial(
                build, digests=staged_digests(self.places, ring, claim),
                on_device=dsum_digests(self.places, ring.copier)))
        finally:
            ring.release(claim)  # a no-op once the digests released it

    def source(self, manifest: Manifest) -> DeviceSource:
        return DeviceSource(manifest, self.places, self.cache)


def device_publish(rings: DeviceRings, tensors: Mapping[str, Any]) -> DevicePublish | None:
    """None unless some tensor is in device memory; then all must be, on one GPU."""
    if not on_device(tensors.values()):
        return None
    places = [place_of(t, str(name)) for name, t in tensors.items()]
    host = [str(n) for (n, _), p in zip(tensors.items(), places, strict=True)
            if not p.on_device]
    if host:
        raise LocalProtocolError(f"tensors {host[:3]} are in host memory, the others on a "
                                 "GPU: publish each kind as a version of its own")
    device = one_device(places)
    return DevicePublish([(str(n), layout_array(p)) for n, p in zip(tensors, places,
                                                                     strict=True)],
                         places, rings.serve_cache(device))


@dataclass
class StagedFetch:
    """A fetch through a ring: where chunks land, what the caller gets, what serves the
    version once (and while) it is held here."""

    landing: Landing
    arrays: list[Any]
    source: DeviceSource | None
    _done: list[Any] = field(default_factory=list)

    def close(self) -> None:
        self.landing.close()
        for exit_ in self._done:
            exit_()


def staged_fetch(rings: DeviceRings, manifest: Manifest, into: Any) -> StagedFetch | None:
    """A :class:`StagedFetch` when ``into`` is a :class:`ThroughRing` or holds device
    tensors; None for a plain fetch."""
    ring = into.ring if isinstance(into, ThroughRing) else None
    tensors = destination(into.tensors if isinstance(into, ThroughRing) else into)
    if ring is None and not on_device(tensors.values()):
        return None
    names = manifest.table.names
    if set(tensors.keys()) != set(names):
        missing = sorted(set(names) - set(tensors.keys()))
        extra = sorted(set(tensors.keys()) - set(names))
        raise LocalProtocolError(
            f"into= does not match {manifest.key}: missing {missing[:5]}, unknown {extra[:5]}")
    places = landing_places(manifest, [place_of(tensors[n], n) for n in names])
    device = one_device(places)
    done = []
    if ring is None:
        lease = rings.landing_ring(device)
        ring = lease.__enter__()
        done.append(lambda: lease.__exit__(None, None, None))
    elif ring.copier.name == "host" and device >= 0:
        raise LocalProtocolError("into= has GPU tensors but its ring copies host memory: "
                                 "make it with copier=copier_for(True, device)")
    source = DeviceSource(manifest, places, rings.serve_cache(device)) if device >= 0 \
        else None
    arrays = [p.owner for p in places]
    return StagedFetch(Landing(manifest, places, ring), arrays, source, done)
