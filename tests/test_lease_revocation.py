"""A reader that holds a holder's memory and stops answering loses its lease.

``unpublish`` (``Store.hide`` + ``Store.wait_drained``) must return within about
``lease_timeout`` whatever a reader does, and a reader whose lease was revoked must
never return bytes copied after it (see the revocation notes in
:mod:`tensorhub.transport.samehost.reader`).
"""

from __future__ import annotations

import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from tensorhub.errors import TransportError
from tensorhub.model import VersionKey
from tensorhub.protocol.dataplane import ChunkRequest, ShmChunkRequest, ShmGrant, ShmRevoke
from tensorhub.read.store import Store
from tensorhub.testing.conformance import Published, publish, running
from tensorhub.transport import server as server_module
from tensorhub.transport.admission import ServerLimits
from tensorhub.transport.base import NotServing
from tensorhub.transport.frames import recv_frame, send_frame
from tensorhub.transport.local import local_name
from tensorhub.transport.samehost import reader as shm_reader
from tensorhub.transport.samehost.reader import ShmConnection, shm_available
from tensorhub.transport.server import TcpServer

SHM, WHY_NOT = shm_available()
needs_shm = pytest.mark.skipif(not SHM, reason=WHY_NOT)
SEED = random.randrange(2**32)
print(f"tests/test_lease_revocation.py: seed {SEED}")
LEASE = 0.3


@dataclass
class Holder:
    store: Store
    server: TcpServer
    address: str
    kill: Callable[[], Awaitable[None]]
    """Stops the server at once, as a holder that dies; returns once it stopped."""

    async def unpublish(self, key: VersionKey) -> None:
        self.store.hide(key)
        with trio.fail_after(30):  # about LEASE; never forever
            await self.store.wait_drained(key)


@asynccontextmanager
async def holder() -> AsyncIterator[Holder]:
    store = Store()
    server = TcpServer(store, lambda peer, n: None, lambda what: None,
                       ServerLimits(lease_timeout=LEASE))
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    async with running(server) as kill:
        yield Holder(store, server, address, kill)


async def read(conn: Any, pub: Published, c: int) -> None:
    buf = np.zeros(len(pub.chunk(c)), dtype=np.uint8)
    await conn.read_chunk(pub.local.manifest.key, c, [memoryview(buf)])
    assert np.array_equal(buf, pub.chunk(c))


async def leased_reader(h: Holder) -> tuple[Published, ShmConnection]:
    """A reader that has read chunk 0 of a new version under a version lease."""
    pub = publish(h.store, random.Random(SEED), [200_000], 65_536)
    conn = await ShmConnection.connect(h.address, "holder", 5)
    await read(conn, pub, 0)
    assert conn.version_leases == 1 and pub.local.inflight == 1
    return pub, conn


def before_the_copy(monkeypatch: pytest.MonkeyPatch,
                    action: Callable[[], Awaitable[object]]) -> None:
    """Run ``action`` on the event loop once the reader's next copy has been handed to
    its worker thread; the copy starts when it returns."""
    token = trio.lowlevel.current_trio_token()
    land = shm_reader._land_batch

    def land_later(files: Any, jobs: Any) -> Any:
        trio.from_thread.run(action, trio_token=token)
        return land(files, jobs)

    monkeypatch.setattr(shm_reader, "_land_batch", land_later)


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_a_hung_version_lease_is_revoked_and_unpublish_returns() -> None:
    async with holder() as h:
        pub, conn = await leased_reader(h)
        await h.unpublish(pub.local.manifest.key)  # the reader never answers the revoke
        assert h.server.statistics().leases_revoked == 1
        assert h.store.get(pub.local.manifest.key) is None
        with pytest.raises(TransportError, match="ended the connection"):
            await read(conn, pub, 1)
        await conn.aclose()


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_a_copy_that_outlives_its_lease_is_never_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder revokes while a copy is running (and may then overwrite the memory):
    the copy completes from the reader's own mapping, and the read fails."""
    async with holder() as h:
        pub, conn = await leased_reader(h)
        key = pub.local.manifest.key

        async def unpublish_and_reuse() -> None:
            await h.unpublish(key)  # the reader does not answer: it is copying
            for array in pub.local.arrays:  # the holder reuses its memory at once
                array.flags.writeable = True
                array[...] = 0

        before_the_copy(monkeypatch, unpublish_and_reuse)
        buf = np.full(len(pub.chunk(1)), 7, dtype=np.uint8)
        with pytest.raises(TransportError, match="during the copy"):
            await conn.read_chunk(key, 1, [memoryview(buf)])
        assert h.server.statistics().leases_revoked == 1
        await conn.aclose()


async def connect_raw(address: str, rcvbuf: int = 0) -> trio.socket.SocketType:
    host, _, port = address.rpartition(":")
    sock = trio.socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host, int(port)))
    return sock


@needs_shm
async def test_a_chunk_lease_without_shm_done_is_revoked() -> None:
    async with holder() as h:
        pub = publish(h.store, random.Random(SEED), [100_000], 65_536)  # plain arrays
        key = pub.local.manifest.key
        with trio.socket.socket(trio.socket.AF_UNIX) as sock:
            await sock.connect(local_name(h.address))
            await send_frame(sock, ShmChunkRequest(1, key.model, key.version, 0))
            grant = await recv_frame(sock)
            assert isinstance(grant, ShmGrant) and grant.req_id == 1
            await trio.testing.wait_all_tasks_blocked()
            assert pub.local.inflight == 1
            await h.unpublish(key)  # no ShmDone ever comes
            assert await recv_frame(sock) == ShmRevoke(1)
            assert await sock.recv(1) == b""
        assert h.server.statistics().leases_revoked == 1


async def test_a_tcp_reader_that_stops_taking_a_chunk_loses_it() -> None:
    async with holder() as h:
        pub = publish(h.store, random.Random(SEED), [48 << 20], 48 << 20)
        key = pub.local.manifest.key
        with await connect_raw(h.address, rcvbuf=4096) as sock:
            await send_frame(sock, ChunkRequest(1, key.model, key.version, 0))
            await sock.recv(1)  # the reply has started; the reader takes no more
            await h.unpublish(key)
        assert h.server.statistics().leases_revoked == 1


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_a_revoke_answered_in_time_covers_the_copy_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpublish during a copy, the reader answers within the lease timeout: its copy
    counts, the next read is refused cleanly (NOT_HELD), nothing is revoked."""
    async with holder() as h:
        pub, conn = await leased_reader(h)
        key = pub.local.manifest.key

        async def hide() -> None:
            h.store.hide(key)
            await trio.testing.wait_all_tasks_blocked()  # the revoke is on its way

        before_the_copy(monkeypatch, hide)
        await read(conn, pub, 1)
        with pytest.raises(NotServing):
            await read(conn, pub, 2)
        with trio.fail_after(30):
            await h.store.wait_drained(key)
        assert h.server.statistics().leases_revoked == 0
        await conn.aclose()


async def test_a_send_cut_short_by_shutdown_ends_before_its_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder stops while a chunk send to a stalled reader is in its worker thread:
    the send is cut short, and the lease ends only after the thread has let go of the
    memory (never while it may still read it)."""
    events: list[str] = []
    send = server_module.send_segments

    def recorded_send(*args: Any) -> None:
        try:
            send(*args)
        finally:
            events.append("send ended")

    monkeypatch.setattr(server_module, "send_segments", recorded_send)
    async with holder() as h:
        pub = publish(h.store, random.Random(SEED), [48 << 20], 48 << 20)
        key = pub.local.manifest.key
        lease = h.store.lease_pieces  # the lease a TCP send holds

        @contextmanager
        def recorded_lease(*args: Any) -> Iterator[Any]:
            with lease(*args) as segments:
                yield segments
            events.append("lease ended")

        monkeypatch.setattr(h.store, "lease_pieces", recorded_lease)
        with await connect_raw(h.address, rcvbuf=4096) as sock:
            await send_frame(sock, ChunkRequest(1, key.model, key.version, 0))
            await sock.recv(1)  # the send has started; the reader takes no more
            with trio.fail_after(10):  # cut short: well before lease_timeout's socket limit
                await h.kill()
    assert events == ["send ended", "lease ended"]
