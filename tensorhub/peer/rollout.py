"""The staged flip: fetch the next version while the live one keeps serving, then
switch to it in one step.

Theory of operation
-------------------
Staging.  A version a peer has fetched stays held, verified and served to other peers
until it is unpublished.  So fetching ``v+1`` while ``v`` is live *is* staging: ``v``'s
buffers keep serving the engine and the mesh while ``v+1`` lands in other buffers.
:meth:`Rollout.stage` does that fetch (waiting first, up to ``stall_timeout``, for
``v+1`` to be sealed in this peer's view, which may lag the view that named it) and
returns a :class:`Staged`.

The flip.  :meth:`Staged.commit` makes it live in one step and returns at once: the
engine's pause is that swap (``Committed.switch_seconds``), never a transfer and never a
wait for readers.  The previous version is *released* after, in the background
(:mod:`.release`): unless retention must keep it readable it is hidden from new readers
at the swap itself; then reads of it still in flight drain and it is unpublished with
the rollout's layout (retention may keep a host copy).  :class:`Committed` says when
that finished: :attr:`~Committed.release_done`, :attr:`~Committed.drain_seconds`, and
:meth:`Committed.wait_released`, which returns the previous buffers once nobody reads
them any more.  Pass them as ``into=`` to the next :meth:`Rollout.stage` to
double-buffer; a stage into buffers whose release is still draining first waits for it
(and refuses buffers whose release failed, or the live version's own), so bytes a reader
is copying are never overwritten.  A release that fails (say
:class:`~tensorhub.errors.RetentionError`, or :class:`~tensorhub.errors.PeerClosed` when
the peer closes first) does not undo the switch; :attr:`Committed.release_error` says why.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import trio

from ..errors import LocalProtocolError, PeerClosed, VersionUnavailable
from ..model import as_host_array, check_model_name
from ..protocol.sharding import Sharding
from ..read.report import Fetched
from .node import Peer
from .release import Release, Tensors


@dataclass(frozen=True)
class Committed:
    """What :meth:`Staged.commit` did, and how the release of the previous version goes."""

    version: int
    tensors: Tensors
    """The new live tensors."""
    previous: int | None
    """The version that was live before, if another one was."""
    switch_seconds: float
    """How long the switch took: the swap alone, never a transfer or a wait for readers
    (:meth:`Staged.commit` yields to trio once, before it)."""
    _release: Release | None = field(repr=False)

    @property
    def release_done(self) -> bool:
        """The previous version's release finished (or failed); True when there was
        none to release."""
        return self._release is None or self._release.finished.is_set()

    @property
    def release_error(self) -> Exception | None:
        """Why releasing the previous version failed (the switch stands regardless);
        None while it runs and when it succeeded."""
        return None if self._release is None else self._release.error

    @property
    def drain_seconds(self) -> float | None:
        """From the swap until the release finished (readers drained, unpublished);
        None while it runs and when there was none."""
        return None if self._release is None else self._release.seconds

    async def wait_released(self) -> Tensors | None:
        """Wait until the previous version is released; its tensors, which nobody reads
        any more (free for the next ``into=``), or None when there was none or the
        release failed (see :attr:`release_error`).  Closing the peer ends the wait."""
        if self._release is None:
            await trio.lowlevel.checkpoint()
            return None
        return await self._release.wait()


class Staged:
    """A version fetched, verified and held (and served to other peers) next to the live
    one, not yet seen by the engine.  Make it live with :meth:`commit`, or :meth:`discard`
    it; each at most once."""

    def __init__(self, rollout: Rollout, fetched: Fetched, *, trivial: bool = False) -> None:
        self.rollout = rollout
        self.fetched = fetched
        self._trivial = trivial  # the version was live already: nothing was fetched
        self._state = "staged"
        self.switch_seconds = 0.0
        """How long making it live took (set by the commit)."""

    @property
    def version(self) -> int:
        """The staged version."""
        return self.fetched.version

    def _settle(self, state: str) -> None:
        if self._state != "staged":
            raise LocalProtocolError(f"version {self.version} was already {self._state}")
        self._state = state

    async def commit(self) -> Committed:
        """Make this version live in one step and return; the version that was live is
        released in the background (see :class:`Committed`).  Cancelled, it has not
        switched; once it switched it returns without waiting for anything."""
        await trio.lowlevel.checkpoint()  # cancelled here, nothing has changed
        release = self.rollout.switch_nowait(self)  # from here on, no await: never lost
        return Committed(self.version, self.fetched.tensors,
                         None if release is None else release.version,
                         self.switch_seconds, release)

    async def discard(self) -> bool:
        """Unpublish the staged version (returns once its in-flight reads have drained);
        True if its buffers are now free.  A version that is live is left alone."""
        self._settle("discarded")
        live = self.rollout.live
        if self._trivial or (live is not None and live.version == self.version):
            await trio.lowlevel.checkpoint()
            return False
        await self.rollout.peer.unpublish(self.rollout.model, self.version,
                                          layout=self.rollout.layout)
        return True


class Rollout:
    """The live version of one model at one consumer (an engine, or one rank of one, with
    that rank's ``layout``), and the staged flip to the next: :meth:`stage`, then
    :meth:`Staged.commit`."""

    def __init__(self, peer: Peer, model: str, *, layout: Sharding | None = None) -> None:
        self.peer = peer
        self.model = check_model_name(model)
        self.layout = layout
        self.live: Fetched | None = None
        """The live version and its tensors; None before the first commit."""
        self._releases: list[Release] = []
        """Releases of previous live versions whose buffers may still be read."""

    async def stage(self, version: int | str = "latest", *,
                    into: Mapping[str, Any] | None = None) -> Staged:
        """Fetch ``version`` (an int, or ``"latest"`` in this peer's view) with the
        rollout's layout into ``into`` (or new arrays) while the live version keeps
        serving.  The live version itself stages at once, fetching nothing."""
        if version == "latest":
            resolved = self.peer.control.latest(self.model)
            if resolved is None:
                raise VersionUnavailable(self.model, "latest", "no sealed version is known")
        elif isinstance(version, int):
            resolved = version
        else:
            raise LocalProtocolError(f"version must be an int or 'latest', got {version!r}")
        if self.live is not None and self.live.version == resolved:
            await trio.lowlevel.checkpoint()
            return Staged(self, self.live, trivial=True)
        if into is not None:
            await self._wait_free(into)
        await self.peer.wait_sealed(self.model, resolved)
        return Staged(self, await self.peer.fetch(self.model, resolved, into,
                                                  layout=self.layout))

    async def _wait_free(self, into: Mapping[str, Any]) -> None:
        """Memory readers may still be copying is not staged into: wait for a release
        of ``into``'s buffers to finish; refuse buffers still published."""
        spans = _spans(into.items())
        if self.live is not None and _overlap(spans, _spans(self.live.tensors.items())):
            raise LocalProtocolError(f"into= overlaps the buffers of the live version "
                                     f"{self.live.version}")
        for release in self._releases:
            if release.busy() and _overlap(spans, _spans(release.tensors.items())):
                await release.finished.wait()
                if isinstance(release.error, PeerClosed):
                    raise PeerClosed(str(release.error))
                if release.busy():
                    raise LocalProtocolError(
                        f"into= overlaps the buffers of version {release.version}, whose "
                        f"release failed ({release.error}): they may still be read")

    def switch_nowait(self, staged: Staged) -> Release | None:
        """Make ``staged`` live and start releasing the version that was live, if any
        (see :mod:`.release`); never blocks.  :meth:`Staged.commit` is the API; a
        group's shell, which switches inside its dispatcher, calls this.  The time it
        takes is the switch: counted in the peer's statistics and the staged fetch's
        report, unless the version was live already."""
        started = trio.current_time()
        if staged.rollout is not self:
            raise LocalProtocolError("that version was staged by another rollout")
        staged._settle("committed")
        previous, self.live = self.live, staged.fetched
        release = None
        if not (staged._trivial or previous is None or previous.version == staged.version):
            release = Release(self.peer, self.model, previous.version, self.layout,
                              previous.tensors)
            release.start()
            self._releases = [r for r in self._releases if r.busy()]
            self._releases.append(release)
        staged.switch_seconds = trio.current_time() - started
        if not staged._trivial:
            self.peer.switches.add(staged.fetched.report, staged.switch_seconds)
        return release


def _spans(tensors: Iterable[tuple[str, Any]]) -> list[tuple[int, int]]:
    """The address ranges of ``tensors``' memory, sorted."""
    out = []
    for name, t in tensors:
        arr = as_host_array(t, name)
        if arr.nbytes:
            start = arr.__array_interface__["data"][0]
            out.append((start, start + arr.nbytes))
    return sorted(out)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    """Whether a range of ``a`` overlaps a range of ``b`` (both sorted)."""
    if not a or not b:
        return False
    starts = [s for s, _ in b]
    reach = list(accumulate((e for _, e in b), max))  # the furthest end among b[:i+1]
    for start, end in a:
        i = bisect_left(starts, end)  # b[:i] begin before this range ends
        if i and reach[i - 1] > start:
            return True
    return False
