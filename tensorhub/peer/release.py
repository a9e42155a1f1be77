"""Unpublishing a version in the background: the second half of the staged flip.

Theory of operation
-------------------
A consumer that switched to a new version no longer needs the one it served before, but
readers may still be copying it.  :meth:`Release.start` (synchronous) does what can be
done at once and leaves only the wait to a task:

* a version retention lets go of (not retained, or not a complete shard of the
  publisher's layout) is *withdrawn* right there -- new reads are refused and the mesh is
  told we dropped it -- and the task only waits for the reads already in flight to drain;
* a retained version is unpublished whole by the task: retention may first ask the other
  holders whether they keep it, or copy it to host memory, and it goes on being served
  meanwhile (see :meth:`Peer.unpublish`).

The task runs in the peer's nursery (:meth:`Peer.start_background`), as a peer operation:
it outlives the task that started it, and closing the peer ends it with
:class:`~tensorhub.errors.PeerClosed`.  It never raises: its outcome is recorded
(:attr:`Release.error`, :attr:`Release.seconds`) and :attr:`Release.finished` is set, so
a waiter never waits forever and nothing reaches the peer's nursery.  Once it finished
without an error, nobody reads the released buffers any more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ..errors import LocalProtocolError, PeerClosed, TensorHubError
from ..protocol.sharding import WHOLE, Sharding

if TYPE_CHECKING:
    from .node import Peer

Tensors = dict[str, np.ndarray[Any, Any]]


class Release:
    """The release of ``version`` of ``model`` held with ``layout`` in ``tensors``."""

    def __init__(self, peer: Peer, model: str, version: int, layout: Sharding | None,
                 tensors: Tensors) -> None:
        self.peer = peer
        self.key = (layout or WHOLE).key(model, version)
        self.layout = layout
        self.tensors = tensors
        self.withdrawn = False
        """New readers were refused from the start (see the module docstring)."""
        self.error: Exception | None = None
        """Why the release failed (the buffers are then not free); None if it did not."""
        self.seconds: float | None = None
        """From :meth:`start` until it finished; None until then."""
        self.finished = trio.Event()
        self._started = trio.current_time()
        self._retained = False

    @property
    def version(self) -> int:
        return self.key.version

    def start(self) -> None:
        """Withdraw the version now if retention allows, and start the task; never blocks
        or raises (a failure is recorded)."""
        local = self.peer.store.get(self.key)
        if local is None or local.hidden:
            self._finish(LocalProtocolError(f"{self.key} is not held here"))
            return
        self._retained = self.peer.retention.may_offload(self.key, local)
        try:
            self.peer.start_background(self._run)
        except PeerClosed as exc:
            self._finish(exc)
            return
        if not self._retained:
            self.peer.withdraw(self.key)
            self.withdrawn = True

    def busy(self) -> bool:
        """Whether readers may still read the released buffers: it has not finished, or
        it failed and this peer still holds the version."""
        return not self.finished.is_set() or (
            self.error is not None and self.peer.store.get(self.key) is not None)

    async def wait(self) -> Tensors | None:
        """Wait until the release finished; the released tensors, now free to overwrite,
        or None if it failed (see :attr:`error`)."""
        await self.finished.wait()
        return self.tensors if self.error is None else None

    async def _run(self) -> None:
        peer, key = self.peer, self.key
        error: Exception | None = PeerClosed(f"peer {peer.info.name} was closed")
        try:  # the error stays PeerClosed if the peer's nursery cancels us
            with peer.operations.guard():
                if self._retained:
                    await peer.unpublish(key.model, key.version, layout=self.layout)
                else:
                    await peer.store.wait_drained(key)
                    peer.retention.offloaded.discard(key)
            error = None
        except TensorHubError as exc:
            error = exc
        except Exception as exc:  # a bug: counted and recorded, the peer goes on
            peer.internal_error(f"releasing {key}: {type(exc).__name__}: {exc}", exc)
            error = exc
        finally:
            self._finish(error)

    def _finish(self, error: Exception | None) -> None:
        self.error = error
        self.seconds = trio.current_time() - self._started
        self.finished.set()
