"""The staged flip: fetch the next version while the live one keeps serving, then
switch to it in one step.

Theory of operation
-------------------
Staging.  A version a peer has fetched stays held, verified and served to other peers
until it is unpublished.  So fetching ``v+1`` while ``v`` is live *is* staging: ``v``'s
buffers keep serving the engine and the mesh while ``v+1`` lands in other buffers.
:meth:`Rollout.stage` does that fetch (waiting first, up to ``stall_timeout``, for
``v+1`` to be sealed in this peer's view, which may lag the view that named it) and
returns a :class:`Staged`; :meth:`Staged.commit` makes it live in one step -- the
engine's pause is that swap, not the transfer -- and then *releases* ``v``: it
unpublishes it with the rollout's layout, which hides it from new readers at once and
returns when reads in flight have drained (retention may keep a host copy).  The
released buffers are then free: pass them as ``into=`` to the next :meth:`Rollout.stage`
to double-buffer.  A release that fails (say :class:`~tensorhub.errors.RetentionError`)
does not undo the switch; :class:`Committed` reports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from ..errors import LocalProtocolError, TensorHubError, VersionUnavailable
from ..model import check_model_name
from ..protocol.sharding import Sharding
from .fetcher import Fetched
from .node import Peer

Tensors = dict[str, np.ndarray[Any, Any]]


@dataclass(frozen=True)
class Committed:
    """What :meth:`Staged.commit` did."""

    version: int
    tensors: Tensors
    """The new live tensors."""
    previous: int | None
    """The version that was live before, if another one was."""
    released: Tensors | None
    """The previous live tensors, unpublished and drained: free to overwrite (pass them as
    ``into=`` to the next stage).  None when there were none or the release failed."""
    release_error: TensorHubError | None
    """Why releasing the previous version failed; the switch stands regardless."""
    switch_seconds: float
    """How long :meth:`Staged.commit` blocked the caller: the swap plus draining the
    previous version's in-flight reads -- never a transfer."""


class Staged:
    """A version fetched, verified and held (and served to other peers) next to the live
    one, not yet seen by the engine.  Make it live with :meth:`commit`, or :meth:`discard`
    it; each at most once."""

    def __init__(self, rollout: Rollout, fetched: Fetched, *, trivial: bool = False) -> None:
        self.rollout = rollout
        self.fetched = fetched
        self._trivial = trivial  # the version was live already: nothing was fetched
        self._state = "staged"

    @property
    def version(self) -> int:
        """The staged version."""
        return self.fetched.version

    def _settle(self, state: str) -> None:
        if self._state != "staged":
            raise LocalProtocolError(f"version {self.version} was already {self._state}")
        self._state = state

    async def commit(self) -> Committed:
        """Make this version live in one step and return it; then release the version
        that was live (see :class:`Committed`)."""
        started = trio.current_time()
        previous = self.rollout._switch(self)
        released, error = None, None
        if previous is not None:
            error = await self.rollout._release(previous)
            released = None if error is not None else previous.tensors
        else:
            await trio.lowlevel.checkpoint()
        return Committed(self.version, self.fetched.tensors,
                         None if previous is None else previous.version, released, error,
                         trio.current_time() - started)

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
        await self._wait_sealed(resolved)
        return Staged(self, await self.peer.fetch(self.model, resolved, into,
                                                  layout=self.layout))

    async def _wait_sealed(self, version: int) -> None:
        """Another peer's view may have named ``version`` before ours has sealed it."""
        with trio.move_on_after(self.peer.config.stall_timeout):
            while True:
                try:
                    self.peer.control.seal(self.model, version)
                    return
                except VersionUnavailable:
                    await self.peer.wait_changed()

    def _switch(self, staged: Staged) -> Fetched | None:
        """Make ``staged`` live; the version to release, if any.  Never blocks."""
        if staged.rollout is not self:
            raise LocalProtocolError("that version was staged by another rollout")
        staged._settle("committed")
        previous, self.live = self.live, staged.fetched
        if staged._trivial or previous is None or previous.version == staged.version:
            return None
        return previous

    async def _release(self, previous: Fetched) -> TensorHubError | None:
        try:
            await self.peer.unpublish(self.model, previous.version, layout=self.layout)
        except TensorHubError as exc:
            return exc
        return None
