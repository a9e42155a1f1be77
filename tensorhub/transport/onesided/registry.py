"""Registered memory, by buffer: registered once, reused across versions, keys revoked
on unpublish.

Registering memory is what costs with RDMA (the kernel pins the pages and the NIC
learns their translation: tens of microseconds per megabyte), so it is done once per
*buffer* -- the allocation a chunk's bytes lie in, found by following views back to the
object that owns the memory -- and kept while that object lives (a finalizer
deregisters it when the object is freed, so an address reused by a new allocation is
never read through an old registration).  A trainer that unpublishes version ``v`` and
publishes ``v+1`` in the same arrays registers nothing new.

Keys are per version, not per buffer: a region's key is granted when a chunk lying in
it is first leased and revoked once no published version lies in it any more
(:meth:`Registrations.dropped`, called by the store after the drain), so a reader
holding a key from before cannot read the buffer after its version was unpublished --
its read fails with an access error and the chunk is re-sourced.  A granted key a
backend can renew is a new one each time (the stand-ins, RDMA with re-registration).

Objects that cannot be weakly referenced (``bytes``, ``bytearray``) are registered for
one use and deregistered after it (:meth:`Registrations.local_pieces` says which).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ...protocol.onesided import RemoteRange
from ..samehost.memory_files import address_of
from .backend import Backend, Region


@dataclass(frozen=True)
class RegistrationStats:
    registered: int
    """Buffers registered (each once while it lives)."""
    reused: int
    """Leases (or reads) served from a buffer registered before."""
    granted: int
    revoked: int
    """Keys granted, and revoked (unpublish)."""
    deregistered: int
    transient: int
    """Registrations for one use only (memory that cannot be weakly referenced)."""
    live: int


def owner_of(piece: Any) -> Any:
    """The object that owns ``piece``'s memory: a view's exporter, followed through
    array bases."""
    obj: Any = piece.obj if isinstance(piece, memoryview) else piece
    while getattr(obj, "base", None) is not None and not isinstance(obj, memoryview):
        obj = obj.base
    return obj


def whole(owner: Any) -> Any:
    """An owner's whole allocation, as a backend registers it: a byte view, or the
    device array itself."""
    if isinstance(owner, np.ndarray):
        return memoryview(owner.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    if hasattr(owner, "__cuda_array_interface__"):
        return owner
    return memoryview(owner).cast("B")


def extent(memory: Any) -> tuple[int, int]:
    """``(address, length)`` of what a backend is asked to register: a byte view, a
    host array, or a device array (``__cuda_array_interface__``)."""
    if isinstance(memory, memoryview):
        return (address_of(memory) if memory.nbytes else 0), memory.nbytes
    if isinstance(memory, np.ndarray):
        return int(memory.__array_interface__["data"][0]), memory.nbytes
    return int(memory.__cuda_array_interface__["data"][0]), int(memory.nbytes)




class Registrations:
    """A backend's registered buffers (see the module docstring)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._regions: dict[int, tuple[Region, weakref.ref[Any]]] = {}
        """id(owner) -> (region, weak reference to the owner)."""
        self._users: dict[int, set[object]] = {}
        """id(owner) -> the published versions granted in it."""
        self._by_user: dict[object, set[int]] = {}
        self._counts = dict.fromkeys(("registered", "reused", "granted", "revoked",
                                      "deregistered", "transient"), 0)

    def statistics(self) -> RegistrationStats:
        return RegistrationStats(**self._counts, live=len(self._regions))

    def _region(self, piece: Any, transient: list[Region]) -> Region:
        owner = owner_of(piece)
        entry = self._regions.get(id(owner))
        if entry is not None and entry[1]() is owner:
            self._counts["reused"] += 1
            return entry[0]
        region = self.backend.register(whole(owner))  # which must not keep it alive
        try:
            ref = weakref.ref(owner, partial(self._forget, id(owner)))
        except TypeError:
            transient.append(region)
            self._counts["transient"] += 1
            return region
        self._regions[id(owner)] = (region, ref)
        self._counts["registered"] += 1
        return region

    def _forget(self, oid: int, _ref: object = None) -> None:
        """The owner was freed: deregister its memory (its key dies with it)."""
        entry = self._regions.pop(oid, None)
        users = self._users.pop(oid, set())
        for user in users:
            self._by_user.get(user, set()).discard(oid)
        if entry is not None:
            self.backend.deregister(entry[0])
            self._counts["deregistered"] += 1

    def remote_ranges(self, segments: Sequence[Any], user: Hashable) -> list[RemoteRange]:
        """Where a leased chunk's ``segments`` lie, with keys, for a reader: their
        buffers registered (once) and granted (while ``user``, the version, is
        published)."""
        out: list[RemoteRange] = []
        transient: list[Region] = []
        for piece in segments:
            n = piece.nbytes
            if not n:
                continue
            region = self._region(piece, transient)
            if transient:  # a holder never serves a buffer it cannot keep registered
                self.release(transient)
                raise TypeError(f"{type(owner_of(piece)).__name__} memory cannot be "
                                "served one-sided (it cannot be weakly referenced)")
            oid = id(owner_of(piece))
            if not region.key:
                self.backend.grant(region)
                region.grants += 1
                self._counts["granted"] += 1
            self._users.setdefault(oid, set()).add(user)
            self._by_user.setdefault(user, set()).add(oid)
            out.append((extent(piece)[0], n, region.key))
        return out

    def dropped(self, user: Hashable) -> None:
        """``user`` (a version) is no longer published here: revoke the key of every
        buffer no other published version lies in."""
        for oid in self._by_user.pop(user, set()):
            users = self._users.get(oid)
            if users is None:
                continue
            users.discard(user)
            entry = self._regions.get(oid)
            if not users and entry is not None and entry[0].key:
                self.backend.revoke(entry[0])
                self._counts["revoked"] += 1

    def local_pieces(self, dest: Sequence[Any]) -> tuple[list[tuple[Region, int, int]],
                                                          list[Region]]:
        """A reader's destination as ``(region, address, length)`` pieces, and the
        regions registered for this use only (:meth:`release` them after it)."""
        out: list[tuple[Region, int, int]] = []
        transient: list[Region] = []
        for piece in dest:
            if piece.nbytes:
                out.append((self._region(piece, transient), extent(piece)[0], piece.nbytes))
        return out, transient

    def release(self, transient: list[Region]) -> None:
        for region in transient:
            self.backend.deregister(region)
        transient.clear()

    def close(self) -> None:
        """Deregister everything (the backend is going away)."""
        for oid in list(self._regions):
            self._forget(oid)
