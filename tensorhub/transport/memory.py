"""In-memory transport: reader and holder in one process, no sockets; for protocol tests.

It keeps the semantics of the real transports and passes the same conformance suite:
refusals arrive as :class:`NotServing`, a chunk is copied under the holder's lease, and the
copy moves a piece at a time with a checkpoint between pieces, so a read can be cancelled
(releasing the lease) or see its holder go away part way through (a
:class:`TransportError`, never a partial chunk reported as read).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import trio

from ..errors import RemoteProtocolError, TransportError
from ..model import VersionKey
from ..protocol.sizing import StreamWindow
from .base import Landed, Provider, Take, Verifier, read_each, stream_each

PIECE = 1 << 20
"""Bytes copied between checkpoints."""


class MemoryServer:
    """A holder's side: serves ``provider`` to :class:`MemoryConnection` objects.

    ``on_sent(reader, nbytes)`` counts, as for :class:`~tensorhub.transport.server.TcpServer`.
    """

    def __init__(self, provider: Provider, on_sent: Callable[[str, int], None]) -> None:
        self.provider = provider
        self.on_sent = on_sent
        self.closed = False
        self._readers = itertools.count(1)

    async def connect(self, peer: str) -> MemoryConnection:
        """A new connection to this holder, which the reader calls ``peer``."""
        await trio.lowlevel.checkpoint()
        if self.closed:
            raise TransportError(f"cannot connect to {peer}: it is not serving")
        return MemoryConnection(self, peer, f"memory-{next(self._readers)}")

    def close(self) -> None:
        """The holder goes away: reads in flight and all later ones fail."""
        self.closed = True


class MemoryConnection:
    """A reader's connection to a :class:`MemoryServer`."""

    transport = "memory"
    lands_arrays = False
    lands_device = False
    holder_shares_memory = False
    batch_bytes = 0

    def __init__(self, server: MemoryServer, peer: str, reader: str) -> None:
        self.peer = peer
        self._server = server
        self._reader = reader
        self._open = True

    def _check(self) -> None:
        if not self._open:
            raise TransportError(f"connection to {self.peer} is closed")
        if self._server.closed:
            raise TransportError(f"{self.peer} went away")

    async def read_manifest(self, key: VersionKey) -> bytes:
        await trio.lowlevel.checkpoint()
        self._check()
        return self._server.provider.manifest_bytes(key)

    async def read_chunk(self, key: VersionKey, chunk: int, dest: Sequence[memoryview],
                         verify: Verifier | None = None) -> int:
        await trio.lowlevel.checkpoint()
        self._check()
        provider = self._server.provider
        await provider.wait_chunk(key, chunk)
        self._check()
        with provider.lease(key, chunk) as segments:
            src = [s.cast("B") for s in segments if s.nbytes]
            out = [d.cast("B") for d in dest if d.nbytes]
            want = sum(len(d) for d in out)
            if sum(len(s) for s in src) != want:
                raise RemoteProtocolError(f"{self.peer} has {sum(map(len, src))} bytes in "
                                          f"chunk {chunk}, expected {want}")
            await self._copy(src, out)
        self._server.on_sent(self._reader, want)
        if verify is not None:
            verify(dest)
        return want

    async def read_chunks(self, key: VersionKey, chunks: Sequence[int],
                          dests: Sequence[Sequence[memoryview]],
                          verifies: Sequence[Verifier | None]) -> list[int | Exception]:
        return await read_each(self, key, chunks, dests, verifies)

    async def stream_chunks(self, key: VersionKey, take: Take, landed: Landed,
                            window: StreamWindow) -> None:
        await stream_each(self, key, take, landed)

    async def _copy(self, src: list[memoryview], dest: list[memoryview]) -> None:
        """Copy ``src`` into ``dest`` (two cuts of the same bytes), a piece at a time."""
        si = so = di = do = moved = 0
        while si < len(src):
            s, d = src[si], dest[di]
            n = min(len(s) - so, len(d) - do, PIECE - moved)
            d[do:do + n] = s[so:so + n]
            so, do, moved = so + n, do + n, moved + n
            if so == len(s):
                si, so = si + 1, 0
            if do == len(d):
                di, do = di + 1, 0
            if moved == PIECE:
                moved = 0
                await trio.lowlevel.checkpoint()
                self._check()

    async def aclose(self) -> None:
        self._open = False
