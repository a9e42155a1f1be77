"""A holder that sends bad bytes, for tests: a :class:`Provider` wrapper that hands out
the next N chunks it leases with their first byte flipped.

The flip is made in a private copy, never in the holder's memory, so the holder keeps
good bytes and only what readers receive is wrong; a reader must catch it with the
chunk's digest.  While flips are pending the wrapper leases no whole version
(``hold`` yields None), so a same-host reader asks chunk by chunk and gets them.

:func:`corrupt_served` arms it on a running in-process peer;
``tests/corrupting_worker.py`` runs a demo worker process whose server serves through it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tensorhub.model import VersionKey
from tensorhub.peer.node import Peer
from tensorhub.transport.base import Provider


class CorruptingProvider:
    """``inner``, except that the next ``chunks`` chunk leases carry one flipped byte."""

    def __init__(self, inner: Provider, chunks: int = 0) -> None:
        self.inner = inner
        self.remaining = chunks
        """Chunks still to be handed out corrupt (a test may set it)."""

    def manifest_bytes(self, key: VersionKey) -> bytes:
        return self.inner.manifest_bytes(key)

    async def wait_chunk(self, key: VersionKey, chunk: int) -> None:
        await self.inner.wait_chunk(key, chunk)

    @contextmanager
    def lease(self, key: VersionKey, chunk: int) -> Iterator[Sequence[memoryview]]:
        with self.inner.lease(key, chunk) as segments:
            if self.remaining <= 0 or not any(len(s) for s in segments):
                yield segments
                return
            self.remaining -= 1
            copy = bytearray(b"".join(segments))
            copy[0] ^= 0xFF
            yield [memoryview(copy)]

    @contextmanager
    def hold(self, key: VersionKey) -> Iterator[Any]:
        """The inner provider's version lease, unless flips are pending: then none."""
        hold = getattr(self.inner, "hold", None)
        if self.remaining > 0 or hold is None:
            yield None
            return
        with hold(key) as local:
            yield local


def corrupt_served(peer: Peer, chunks: int) -> CorruptingProvider:
    """Make ``peer``'s data server hand out its next ``chunks`` chunks corrupt (0: none
    from now on); returns the wrapper it serves through."""
    # Fault injection reaches into the peer, once, here: no public call swaps what its
    # data server serves from (nor should one).
    server = peer._server
    if not isinstance(server.provider, CorruptingProvider):
        server.provider = CorruptingProvider(server.provider)
    server.provider.remaining = chunks
    return server.provider
