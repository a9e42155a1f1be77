"""The staging ring: a fixed set of host slots that chunks pass through.

Device memory cannot be handed to a socket, so a chunk bound for (or served from) a GPU
passes through host memory: one *slot* of this ring (pinned on a GPU, so the copy is a
DMA that overlaps everything else).  The ring never holds more than ``slots x
slot_bytes``: a fetch sizes its in-flight window from it, so never a whole-model host
copy, whatever the model's size.

Each slot goes ``FREE -> TAKEN`` (:meth:`acquire_nowait` / :meth:`acquire`: a chunk will
land in it, or be copied into it), ``TAKEN -> BUSY`` (:meth:`begin`: a worker thread
checks or copies it), and back to ``FREE`` (:meth:`release`).  Every acquire bumps the
slot's ticket; a :class:`Claim` carries its ticket, so a claim given up with
:meth:`abandon` (a stream that ended or was cancelled with the chunk unreported) frees
its slot at once when nothing uses it, and a late worker holding the stale claim finds
:meth:`begin` refusing it.  A slot being copied (``BUSY``) is never freed from under the
copy: its abandon is a no-op and the copy's own :meth:`release` frees it.

Slot memory is allocated and pre-faulted on first use, or ahead of it, off the event
loop, by :meth:`StagingRing.ready`.  Thread-safe: claims are taken on
the event loop and released from worker threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from ..errors import LocalProtocolError
from ..protocol.sizing import size_text
from .copier import Copier, HostCopier

FREE, TAKEN, BUSY = 0, 1, 2


@dataclass(frozen=True)
class Claim:
    """One slot, taken: its index, ticket, address and memory."""

    slot: int
    ticket: int
    ptr: int
    view: memoryview


@dataclass(frozen=True)
class RingStats:
    slots: int
    slot_bytes: int
    copier: str
    in_use: int
    most_in_use: int
    claims: int
    waits: int
    """Acquires that found no free slot and waited."""
    abandoned: int


class StagingRing:
    """``slots`` host buffers of ``slot_bytes`` each, copied through by ``copier``
    (default: host memory both sides; :func:`~tensorhub.device.copier.copier_for`
    gives a GPU's).  One ring serves one fetch at a time, or one peer's serving."""

    def __init__(self, slots: int = 8, slot_bytes: int = 64 << 20,
                 copier: Copier | None = None) -> None:
        if not 1 <= slots <= 4096:
            raise LocalProtocolError(f"slots must be in [1, 4096], got {slots}")
        if not 4096 <= slot_bytes <= 1 << 30:
            raise LocalProtocolError(f"slot_bytes must be in [4 KiB, 1 GiB], got {slot_bytes}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.copier: Copier = copier or HostCopier()
        self._mem: tuple[np.ndarray[Any, Any], Any] | None = None
        self._state = [FREE] * slots
        self._ticket = [0] * slots
        self._free = deque(range(slots))
        self._lock = threading.Lock()
        self._alloc_lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._freed: trio.Event | None = None
        self._most = self._claims = self._waits = self._abandoned = 0

    def fit(self, chunk_size: int) -> None:
        """Raise a clear error if chunks of ``chunk_size`` do not fit a slot."""
        if chunk_size > self.slot_bytes:
            raise LocalProtocolError(
                f"chunks of {size_text(chunk_size)} do not fit the staging ring's "
                f"{size_text(self.slot_bytes)} slots: make the slots larger, or publish "
                "with a smaller PeerConfig.chunk_size")

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def _memory(self) -> np.ndarray[Any, Any]:
        with self._alloc_lock:
            if self._mem is None:
                self._mem = self.copier.alloc(self.nbytes)
            return self._mem[0]

    async def ready(self) -> None:
        """Allocate (and pre-fault) the slots in a worker thread, if not done yet:
        hundreds of MiB take a second or more to fault in, too long for the event loop."""
        if self._mem is None:
            await trio.to_thread.run_sync(self._memory)

    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def acquire_nowait(self) -> Claim | None:
        """A free slot, taken; None when every slot is in use."""
        mem = self._memory()
        with self._lock:
            if not self._free:
                return None
            slot = self._free.popleft()
            self._state[slot] = TAKEN
            self._ticket[slot] += 1
            ticket = self._ticket[slot]
            self._claims += 1
            self._most = max(self._most, self.slots - len(self._free))
        at = slot * self.slot_bytes
        view = mem[at:at + self.slot_bytes]
        return Claim(slot, ticket, int(view.ctypes.data), memoryview(view))  # type: ignore[arg-type]

    async def acquire(self) -> Claim:
        """A free slot, taken; waits (on the event loop) until one is released."""
        while True:
            claim = self.acquire_nowait()
            if claim is not None:
                return claim
            with self._lock:
                if self._free:
                    continue
                self._waits += 1
                if self._freed is None:
                    self._token = trio.lowlevel.current_trio_token()
                    self._freed = trio.Event()
                freed = self._freed
            await freed.wait()

    def begin(self, claim: Claim) -> bool:
        """Mark ``claim``'s slot in use by a worker; False if the claim was given up
        (its slot may hold another chunk now: do not touch it)."""
        with self._lock:
            if self._ticket[claim.slot] != claim.ticket or self._state[claim.slot] != TAKEN:
                return False
            self._state[claim.slot] = BUSY
            return True

    def release(self, claim: Claim) -> None:
        """The slot of ``claim`` is free again (a no-op for a stale claim)."""
        self._free_slot(claim, (TAKEN, BUSY))

    def abandon(self, claim: Claim) -> None:
        """Give ``claim`` up: its slot is free at once unless a worker is using it
        (that worker's :meth:`release` frees it)."""
        if self._free_slot(claim, (TAKEN,)):
            with self._lock:
                self._abandoned += 1

    def _free_slot(self, claim: Claim, states: tuple[int, ...]) -> bool:
        with self._lock:
            slot = claim.slot
            if self._ticket[slot] != claim.ticket or self._state[slot] not in states:
                return False
            self._state[slot] = FREE
            self._free.append(slot)
            freed, token, self._freed = self._freed, self._token, None
        if freed is not None and token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(freed.set)
        return True

    def statistics(self) -> RingStats:
        with self._lock:
            return RingStats(self.slots, self.slot_bytes, self.copier.name,
                             self.slots - len(self._free), self._most, self._claims,
                             self._waits, self._abandoned)
