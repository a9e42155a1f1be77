"""The data plane serves members only: the handshake that opens every connection.

Members' reads over both sockets are the conformance suite's ``tcp+keys`` and
``shm+keys`` holders (tests/test_transports.py); here, everyone else is turned away
before any request is read.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio

from tensorhub.errors import TransportError
from tensorhub.protocol.dataplane import (
    NONCE_BYTES,
    UNAUTHORIZED,
    AuthHello,
    AuthProof,
    ManifestRequest,
    Reply,
)
from tensorhub.read.store import Store
from tensorhub.security import Identity, Keyring
from tensorhub.testing.conformance import Published, publish, running
from tensorhub.transport.frames import recv_frame, send_frame
from tensorhub.transport.handshake import DataAuth, transcript
from tensorhub.transport.samehost.reader import ShmConnection, shm_available
from tensorhub.transport.server import TcpServer
from tensorhub.transport.tcp import TcpConnection

SHM, WHY_NOT = shm_available()
IDS = {name: Identity.generate() for name in ("holder", "reader", "other", "outsider")}


def keyring() -> Keyring:
    return Keyring({n: [IDS[n].public] for n in ("holder", "reader", "other")})


@asynccontextmanager
async def holder(ring: Keyring, name: str = "holder"
                 ) -> AsyncIterator[tuple[TcpServer, str, Published, list[int]]]:
    store, sent = Store(), list[int]()
    pub = publish(store, random.Random(7), [100_000], 65_536)
    server = TcpServer(store, lambda _peer, n: sent.append(n), lambda what: None,
                       auth=DataAuth(name, IDS[name], ring))
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    async with running(server):
        yield server, address, pub, sent


async def read_chunk(conn: TcpConnection, pub: Published) -> None:
    buf = np.zeros(len(pub.chunk(0)), dtype=np.uint8)
    await conn.read_chunk(pub.local.manifest.key, 0, [memoryview(buf)])
    assert np.array_equal(buf, pub.chunk(0))


CONNECTIONS = [TcpConnection, ShmConnection]


@pytest.mark.parametrize("connection", CONNECTIONS, ids=["tcp", "shm"])
@pytest.mark.parametrize("who", ["outsider", "impostor"])
async def test_a_non_member_gets_nothing(connection: type[TcpConnection], who: str) -> None:
    """An unknown name, or a member's name with another key, is refused before any
    request; a member on the same server is served."""
    if connection is ShmConnection and not SHM:
        pytest.skip(WHY_NOT)
    ring = keyring()
    async with holder(ring) as (server, address, pub, _sent):
        auth = DataAuth("outsider", IDS["outsider"], ring) if who == "outsider" \
            else DataAuth("reader", IDS["outsider"], ring)
        with pytest.raises(TransportError, match=r"refused us: .*not a member"):
            await connection.connect(address, "holder", 5, auth)
        assert server.statistics().refused_auth == 1
        assert server.statistics().auth.startswith("members")
        conn = await connection.connect(address, "holder", 5, DataAuth("reader", IDS["reader"],
                                                                         ring))
        await read_chunk(conn, pub)
        await conn.aclose()
        assert server.statistics().refused_auth == 1


async def test_a_client_without_the_handshake_gets_no_manifest() -> None:
    async with holder(keyring()) as (server, address, pub, sent):
        host, _, port = address.rpartition(":")
        with trio.socket.socket() as sock:
            await sock.connect((host, int(port)))
            key = pub.local.manifest.key
            await send_frame(sock, ManifestRequest(5, key.model, key.version))
            reply = await recv_frame(sock)
            assert reply == Reply(5, UNAUTHORIZED, 0, reply.detail)
            with trio.fail_after(5):
                assert await sock.recv(1 << 16) == b""  # and nothing more
        assert server.statistics().refused_auth == 1 and sent == []


async def test_a_replayed_proof_does_not_verify() -> None:
    """A reader's proof binds the holder's fresh nonce: recorded, it opens nothing."""
    ring = keyring()
    async with holder(ring) as (server, address, _pub, _sent):
        host, _, port = address.rpartition(":")
        mine = bytes(NONCE_BYTES)
        proofs = []
        for _ in range(2):
            with trio.socket.socket() as sock:
                await sock.connect((host, int(port)))
                await send_frame(sock, AuthHello("reader", mine))
                challenge = await recv_frame(sock)
                assert isinstance(challenge, AuthHello) and challenge.name == ""
                if not proofs:  # the first time, the real reader signs
                    proofs.append(IDS["reader"].sign(transcript(
                        b"reader", mine, challenge.nonce, "reader", "holder")))
                    await send_frame(sock, AuthProof(proofs[0]))
                    assert isinstance(await recv_frame(sock), AuthProof)
                else:  # the second time, an eavesdropper replays it
                    await send_frame(sock, AuthProof(proofs[0]))
                    answer = await recv_frame(sock)
                    assert isinstance(answer, Reply) and answer.status == UNAUTHORIZED
        assert server.statistics().refused_auth == 1


async def test_the_reader_checks_whom_it_reached() -> None:
    """A member ("other") that answers at an address the reader believes is another
    member's ("holder") cannot sign as that member: the reader refuses it."""
    ring = keyring()
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    async def pose_as_holder() -> None:
        sock, _ = await listener.accept()
        with sock:
            hello = await recv_frame(sock)
            mine = bytes(range(NONCE_BYTES))
            await send_frame(sock, AuthHello("", mine))
            await recv_frame(sock)  # the reader's proof, taken as good
            await send_frame(sock, AuthProof(IDS["other"].sign(transcript(
                b"holder", hello.nonce, mine, "holder", "reader"))))
            await sock.recv(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pose_as_holder)
        with listener, pytest.raises(TransportError, match="did not prove it is holder"):
            await TcpConnection.connect(f"127.0.0.1:{listener.getsockname()[1]}", "holder",
                                        5, DataAuth("reader", IDS["reader"], ring))


async def test_a_removed_key_opens_no_new_connection_and_ends_no_transfer() -> None:
    """Rotation: the keyring is replaced while a reader is connected; its connection
    keeps serving, a new one with the removed key is refused, the new key is let in."""
    ring = keyring()
    async with holder(ring) as (_server, address, pub, _sent):
        old = DataAuth("reader", IDS["reader"], ring)
        conn = await TcpConnection.connect(address, "holder", 5, old)
        new = Identity.generate()
        ring.replace({**ring.members(), "reader": [new.public]})
        await read_chunk(conn, pub)
        await conn.aclose()
        with pytest.raises(TransportError, match="refused"):
            await TcpConnection.connect(address, "holder", 5, old)
        conn = await TcpConnection.connect(address, "holder", 5,
                                           DataAuth("reader", new, ring))
        await read_chunk(conn, pub)
        await conn.aclose()


async def test_without_keys_the_server_says_it_is_insecure() -> None:
    server = TcpServer(Store(), lambda _peer, n: None, lambda what: None)
    assert server.statistics().auth.startswith("insecure")
