"""The API calls in flight on one peer, so that closing the peer ends them cleanly.

Each public call that can block runs under :meth:`Operations.guard`: its own cancel
scope, kept in a set.  Closing the peer cancels those scopes and waits (a bounded time)
for the calls to unwind -- a fetch hides and drops its partial version, waits for reads
of it to drain, closes its connections -- *before* the peer's own tasks stop, so every
call ends while the peer can still clean up after it.  A call ended that way raises
:class:`PeerClosed`; a call cancelled by its own caller's scope gets ``trio.Cancelled``
as trio's rules say.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import trio

from ..errors import PeerClosed

P = ParamSpec("P")
T = TypeVar("T")


class Operations:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False
        self._scopes: set[trio.CancelScope] = set()
        self._idle = trio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._scopes)

    def _error(self) -> PeerClosed:
        return PeerClosed(f"peer {self.name} was closed")

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run one call; raises :class:`PeerClosed` if the peer closes under it."""
        if self.closed:
            raise self._error()
        scope = trio.CancelScope()
        self._scopes.add(scope)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        try:
            with scope:
                yield
        except Exception as exc:
            if scope.cancel_called:  # whatever the cancellation became on its way out
                raise self._error() from exc
            raise
        finally:
            self._scopes.discard(scope)
            if not self._scopes:
                self._idle.set()
        if scope.cancelled_caught:
            raise self._error()

    async def close(self, patience: float) -> None:
        """Refuse new calls, cancel those in flight and wait up to ``patience`` seconds
        for them to end."""
        self.closed = True
        for scope in self._scopes:
            scope.cancel()
        with trio.move_on_after(patience):
            await self._idle.wait()


class _HasOperations(Protocol):
    operations: Operations


S = TypeVar("S", bound=_HasOperations)


def operation(method: Callable[Concatenate[S, P], Coroutine[Any, Any, T]]
              ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """Decorate an ``async`` method of a peer as an operation (see :class:`Operations`)."""
    @functools.wraps(method)
    async def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        with self.operations.guard():
            return await method(self, *args, **kwargs)
    return run

