"""A holder with a slow uplink, for tests: a :class:`Provider` wrapper that hands out one
chunk per fixed time however many readers ask, so that a fetch on loopback lasts long
enough for something to happen in the middle of it (a source leaving, a newer plan).

A chunk asked before its turn is answered "not yet" (``NOT_YET``), as a chunk still
arriving is; the server then waits in ``wait_chunk``, which books that chunk the next
turn.  The bytes are the holder's own; only their pace changes.  Serve over TCP only: a
same-host reader's version lease would bypass the pace.  :func:`slow_served` arms it on
a running in-process peer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import trio

from tensorhub.model import VersionKey
from tensorhub.peer.node import Peer
from tensorhub.protocol.dataplane import NOT_YET
from tensorhub.transport.base import NotServing, Provider


class SlowProvider:
    """``inner``, at one chunk per ``delay`` seconds."""

    def __init__(self, inner: Provider, delay: float) -> None:
        self.inner = inner
        self.delay = delay
        self.served = 0
        """Chunks handed out so far (a test may watch it)."""
        self._next = 0.0  # when the uplink is free for the next chunk
        self._booked: set[tuple[VersionKey, int]] = set()

    def manifest_bytes(self, key: VersionKey) -> bytes:
        return self.inner.manifest_bytes(key)

    async def wait_chunk(self, key: VersionKey, chunk: int) -> None:
        await self.inner.wait_chunk(key, chunk)
        if (key, chunk) in self._booked:
            return
        turn = max(self._next, trio.current_time())
        self._next = turn + self.delay
        self._booked.add((key, chunk))
        await trio.sleep_until(turn)

    @contextmanager
    def lease(self, key: VersionKey, chunk: int) -> Iterator[Sequence[memoryview]]:
        if (key, chunk) in self._booked:
            self._booked.discard((key, chunk))
        else:
            now = trio.current_time()
            if now < self._next:
                raise NotServing(NOT_YET, f"chunk {chunk} of {key} waits for the uplink")
            self._next = now + self.delay
        with self.inner.lease(key, chunk) as segments:
            self.served += 1
            yield segments

    @contextmanager
    def hold(self, key: VersionKey) -> Iterator[Any]:
        """No whole-version lease."""
        yield None


def slow_served(peer: Peer, delay: float) -> SlowProvider:
    """Make ``peer``'s data server hand out one chunk per ``delay`` seconds."""
    # Fault injection reaches into the peer, once, here: no public call swaps what its
    # data server serves from (nor should one).
    server = peer._server
    slow = SlowProvider(server.provider, delay)
    server.provider = slow
    return slow
