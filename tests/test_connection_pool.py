"""Data connections kept between reads: one handshake serves a manifest, its chunks and
the next fetch from the same holder; a keyring change, an identity switch or a holder
that closed the connection means a new one."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import trio
from helpers import Keys, open_mesh, wait_until
from test_data_auth import IDS, SHM, WHY_NOT, holder, keyring, read_chunk
from test_trust_mesh import weights

from tensorhub.errors import TransportError
from tensorhub.model import PeerInfo
from tensorhub.read.connections import ConnectionPool
from tensorhub.read.store import Store
from tensorhub.security import Identity
from tensorhub.testing.conformance import publish
from tensorhub.transport.admission import ServerLimits
from tensorhub.transport.base import Connection
from tensorhub.transport.handshake import DataAuth
from tensorhub.transport.samehost.reader import ShmConnection
from tensorhub.transport.server import TcpServer
from tensorhub.transport.tcp import TcpConnection


def _accepted(peer: object) -> int:
    return peer.statistics().data_server.connections_accepted  # type: ignore[attr-defined, no-any-return]



def opener(auth: DataAuth) -> Callable[[PeerInfo], Awaitable[Connection]]:
    """Open authenticated TCP connections to a holder, as a peer's pool does."""
    async def open_connection(peer: PeerInfo) -> Connection:
        return await TcpConnection.connect(peer.data, peer.name, 5, auth)
    return open_connection

async def test_a_keyed_reader_proves_itself_once_for_many_fetches() -> None:
    keys = Keys(["p0", "p1"], {"m": ["p0"]})
    async with open_mesh(2, keys=keys, fetch_window=1) as (p0, p1):
        for version in (1, 2, 3):
            await p0.publish("m", version, weights(version))
            await wait_until(lambda v=version: p1.control.latest("m") == v, 20)
            got = await p1.fetch("m", version, sources=["p0"])
            assert got.report.verified
            np.testing.assert_array_equal(got.tensors["w"], weights(version)["w"])
        # manifest and chunks of three versions over one connection: one handshake
        assert _accepted(p0) == 1
        assert p0.statistics().data_server.refused_auth == 0


async def test_a_keyring_change_or_a_new_identity_means_new_connections() -> None:
    keys = Keys(["p0", "p1"], {"m": ["p0"]})
    async with open_mesh(2, keys=keys, fetch_window=1) as (p0, p1):
        await p0.publish("m", 1, weights(1))
        await p0.publish("m", 2, weights(2))
        await p0.publish("m", 3, weights(3))
        await wait_until(lambda: p1.control.latest("m") == 3, 20)
        await p1.fetch("m", 1, sources=["p0"])
        assert _accepted(p0) == 1
        ring = {n: [i.public] for n, i in keys.ids.items()}
        new = Identity.generate()
        for p in (p0, p1):  # a rotation's first step: p1's new key is added
            p.update_keyring({**ring, "p1": [keys.ids["p1"].public, new.public]})
        got = await p1.fetch("m", 2, sources=["p0"])
        assert got.report.verified and _accepted(p0) == 2  # handshake under the new ring
        p1.rotate_identity(new)
        for p in (p0, p1):  # the old key is gone: only the new one may read
            p.update_keyring({**ring, "p1": [new.public]})
        got = await p1.fetch("m", 3, sources=["p0"])
        assert got.report.verified and _accepted(p0) == 3
        assert p0.statistics().data_server.refused_auth == 0


async def test_a_connection_the_holder_closed_is_not_reused() -> None:
    """The holder ends idle connections after its ``data_idle_timeout``: the next fetch
    opens a new one and does not count the holder as failed."""
    keys = Keys(["p0", "p1"], {"m": ["p0"]})
    async with open_mesh(2, keys=keys, fetch_window=1,
                         data_idle_timeout=0.2) as (p0, p1):
        await p0.publish("m", 1, weights(1))
        await p0.publish("m", 2, weights(2))
        await wait_until(lambda: p1.control.latest("m") == 2, 20)
        await p1.fetch("m", 1, sources=["p0"])
        await wait_until(lambda: p0.statistics().data_server.connections_open == 0, 20)
        got = await p1.fetch("m", 2, sources=["p0"])
        assert got.report.verified and got.report.dropped_sources == {}
        assert _accepted(p0) == 2


async def test_only_a_connection_in_step_is_kept() -> None:
    """Kept: an idle connection after a read.  Closed instead: one the holder closed,
    one with a byte nobody asked for, one past ``max_idle``."""
    ring = keyring()
    auth = DataAuth("reader", IDS["reader"], ring)
    async with holder(ring) as (server, address, pub, _sent):
        info = PeerInfo("holder", "tcp://127.0.0.1:1", address, ())

        pool = ConnectionPool(opener(auth), lambda: ring.generation, max_idle=60)
        first = await pool.connect(info)
        await read_chunk(first, pub)  # type: ignore[arg-type]
        await pool.release(first)
        again = await pool.connect(info)
        assert again is first and (pool.opened, pool.reused) == (1, 1)
        await read_chunk(again, pub)  # type: ignore[arg-type]
        assert server.statistics().connections_accepted == 1

        await pool.release(again)
        server_side = server.statistics()
        assert server_side.connections_open == 1
        pool.max_idle = 0.05
        await trio.sleep(0.1)  # the time that makes it stale, not a synchronisation
        fresh = await pool.connect(info)
        assert fresh is not first and pool.opened == 2
        await read_chunk(fresh, pub)  # type: ignore[arg-type]
        await pool.release(fresh)
        pool.close()
        assert not fresh.reusable()  # type: ignore[attr-defined]


async def test_reusable_sees_a_closed_or_out_of_step_stream() -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(2)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    with listener:
        conn = await TcpConnection.connect(address, "holder", 5)
        served, _ = await listener.accept()
        assert conn.reusable()
        await served.send(b"x")  # a byte nobody asked for
        await wait_until(lambda: not conn.reusable(), timeout=5, every=0.001)
        await conn.aclose()
        served.close()

        conn = await TcpConnection.connect(address, "holder", 5)
        served, _ = await listener.accept()
        assert conn.reusable()
        served.close()  # the holder went away
        await wait_until(lambda: not conn.reusable(), timeout=5, every=0.001)
        await conn.aclose()
        assert not conn.reusable()


async def test_a_fetch_with_many_workers_keeps_at_most_per_holder() -> None:
    ring = keyring()
    auth = DataAuth("reader", IDS["reader"], ring)
    async with holder(ring) as (server, address, _pub, _sent):
        info = PeerInfo("holder", "tcp://127.0.0.1:1", address, ())

        pool = ConnectionPool(opener(auth), lambda: ring.generation, per_holder=2)
        conns = [await pool.connect(info) for _ in range(4)]
        random.Random(1).shuffle(conns)
        for c in conns:
            await pool.release(c)
        assert sum(c.reusable() for c in conns) == 2  # type: ignore[attr-defined]
        await wait_until(lambda: server.statistics().connections_open == 2, 20)
        pool.close()
        await wait_until(lambda: server.statistics().connections_open == 0, 20)


async def test_a_same_host_connection_is_never_kept() -> None:
    """It may hold a version lease that the holder's unpublish waits for."""
    if not SHM:
        pytest.skip(WHY_NOT)
    ring = keyring()
    auth = DataAuth("reader", IDS["reader"], ring)
    async with holder(ring) as (server, address, pub, _sent):
        info = PeerInfo("holder", "tcp://127.0.0.1:1", address, ())

        async def open_connection(peer: PeerInfo) -> Connection:
            return await ShmConnection.connect(peer.data, peer.name, 5, auth)

        pool = ConnectionPool(open_connection, lambda: ring.generation)
        first = await pool.connect(info)
        await read_chunk(first, pub)  # type: ignore[arg-type]
        await pool.release(first)
        await wait_until(lambda: server.statistics().connections_open == 0, 20)
        second = await pool.connect(info)
        assert second is not first and (pool.opened, pool.reused) == (2, 0)
        await pool.release(second)
        pool.close()


async def test_an_idle_connection_makes_room_for_a_new_one() -> None:
    """At its per-address cap, the holder closes the connection that has waited longest
    for a request (if long enough) instead of refusing a new one."""
    store = Store()
    pub = publish(store, random.Random(7), [100_000], 65_536)
    server = TcpServer(store, lambda _peer, n: None, lambda what: None,
                       ServerLimits(max_connections=8, max_connections_per_address=2,
                                    evict_idle_after=0.05))
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        oldest = await TcpConnection.connect(address, "holder", 5)
        await read_chunk(oldest, pub)
        newer = await TcpConnection.connect(address, "holder", 5)
        await read_chunk(newer, pub)
        # refused (closed at once): both are idle for less than evict_idle_after
        with pytest.raises((TransportError, ConnectionResetError)):
            refused = await TcpConnection.connect(address, "holder", 5)
            await read_chunk(refused, pub)
        await trio.sleep(0.1)  # time passing, not a synchronisation
        third = await TcpConnection.connect(address, "holder", 5)
        await read_chunk(third, pub)  # served: the oldest idle one made room
        await wait_until(lambda: not oldest.reusable(), timeout=5, every=0.001)
        assert newer.reusable()
        await read_chunk(newer, pub)
        stats = server.statistics()
        assert (stats.idle_evicted, stats.refused_over_address) == (1, 1)
        assert stats.connections_open == 2
        for conn in (oldest, newer, third):
            await conn.aclose()
        nursery.cancel_scope.cancel()
