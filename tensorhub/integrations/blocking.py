"""Blocking facade for trainer and inference-engine code that does not run trio.

``BlockingPeer`` runs a peer's trio loop in a background thread and offers the same
methods as :class:`~tensorhub.peer.node.Peer`, with the same arguments, as plain
blocking calls.  Closing it (from any thread) while a call is in flight ends that call
with :class:`PeerClosed`: never ``trio.Cancelled``, which means nothing to a thread that
does not run trio.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import trio

from ..config import PeerConfig
from ..errors import PeerClosed
from ..manifest.manifest import Manifest
from ..peer.node import Peer, open_peer
from ..peer.stats import PeerStats
from ..protocol.sharding import Sharding
from ..read.cast import CastSpec
from ..read.report import Fetched
from ..torch import Into

T = TypeVar("T")


class BlockingPeer:
    """A peer for synchronous code.  Use as a context manager or call :meth:`close`."""

    def __init__(self, config: PeerConfig, *, start_timeout: float = 30.0) -> None:
        self._config = config
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._peer: Peer | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=f"tensorhub-{config.name}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise TimeoutError(f"peer {config.name} did not start in {start_timeout}s")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # handed to the caller's thread
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        async with open_peer(self._config) as peer:
            self._peer = peer
            self._stop = trio.Event()
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._token is None or not self._thread.is_alive():
            raise PeerClosed(f"peer {self._config.name} is closed")
        try:
            return trio.from_thread.run(functools.partial(fn, *args, **kwargs),
                                        trio_token=self._token)
        except trio.RunFinishedError:
            raise PeerClosed(f"peer {self._config.name} is closed") from None
        except BaseException as exc:
            # The peer ends its calls with PeerClosed when it closes; should a call be
            # caught by the loop's own shutdown instead, say the same thing.
            if _only_cancelled(exc):
                raise PeerClosed(f"peer {self._config.name} was closed") from None
            raise

    @property
    def peer(self) -> Peer:
        if self._peer is None:
            raise PeerClosed("peer is not running")
        return self._peer

    def publish(self, model: str, version: int, tensors: Mapping[str, Any], *,
                layout: Sharding | None = None) -> Manifest:
        result: Manifest = self._call(self.peer.publish, model, version, tensors,
                                      layout=layout)
        return result

    def fetch(self, model: str, version: int | str = "latest",
              into: Into | None = None, *, sources: Sequence[str] | None = None,
              layout: Sharding | None = None, cast: CastSpec | None = None) -> Fetched:
        result: Fetched = self._call(self.peer.fetch, model, version, into=into,
                                     sources=sources, layout=layout, cast=cast)
        return result

    def unsealed(self, model: str) -> list[str]:
        result: list[str] = self._call(self._sync, self.peer.unsealed, model)
        return result

    def latest(self, model: str) -> int | None:
        result: int | None = self._call(self.peer.latest, model)
        return result

    def wait_for_version(self, model: str, newer_than: int | None = None) -> int:
        result: int = self._call(self.peer.wait_for_version, model, newer_than)
        return result

    def unpublish(self, model: str, version: int, *, layout: Sharding | None = None) -> None:
        self._call(self.peer.unpublish, model, version, layout=layout)

    def pin(self, model: str, version: int) -> None:
        self._call(self._sync, self.peer.pin, model, version)

    def unpin(self, model: str, version: int) -> None:
        self._call(self._sync, self.peer.unpin, model, version)

    async def _sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def statistics(self) -> PeerStats:
        result: PeerStats = self._call(self._sync_stats)
        return result

    async def _sync_stats(self) -> PeerStats:
        return self.peer.statistics()

    def close(self) -> None:
        """Leave the mesh and stop the background thread.  Calls in flight in other
        threads raise :class:`PeerClosed`."""
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            stop = self._stop
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(stop.set, trio_token=self._token)
        self._thread.join()
        self._token = None
        if self._error is not None and not isinstance(self._error, PeerClosed):
            raise self._error

    def __enter__(self) -> BlockingPeer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _only_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is ``trio.Cancelled`` or a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)
