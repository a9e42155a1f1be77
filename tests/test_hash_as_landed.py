"""A TCP reader hashes a chunk of many pieces (small tensors) itself as the pieces land,
when the chunk's digest is xxh3; other chunks are checked aside, as before
(:data:`tensorhub.transport.tcp.HASH_AS_LANDED_PIECES`)."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import blake3
import numpy as np
import pytest
import trio
import xxhash
from corrupting import CorruptingProvider
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.errors import IntegrityError
from tensorhub.protocol.sizing import StreamWindow
from tensorhub.read.store import Store
from tensorhub.testing.conformance import Published, cut, publish, running
from tensorhub.transport.server import TcpServer
from tensorhub.transport.sockio import recv_scattered
from tensorhub.transport.tcp import HASH_AS_LANDED_PIECES, TcpConnection


def send_in_bits(sock: socket.socket, payload: bytes, seed: int) -> None:
    """Send ``payload`` in writes of random sizes, so reads end mid-piece."""
    rng, at = random.Random(seed), 0
    while at < len(payload):
        step = rng.randrange(1, 20_000)
        sock.sendall(payload[at:at + step])
        at += step


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=800), st.integers(0, 1000))
def test_a_scattered_receive_hands_each_piece_to_the_hasher_in_order(
        sizes: list[int], seed: int) -> None:
    payload = np.random.default_rng(seed).integers(0, 256, sum(sizes), np.uint8).tobytes()
    dest = [np.zeros(n, np.uint8) for n in sizes]
    hasher = xxhash.xxh3_128()
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=send_in_bits, args=(a, payload, seed))
        sender.start()
        b.settimeout(30)
        seconds = recv_scattered(b, dest, hasher)
        sender.join()
    assert b"".join(d.tobytes() for d in dest) == payload
    assert hasher.digest() == xxhash.xxh3_128(payload).digest()
    assert seconds >= 0


class Check:
    """A digest check that says how it was run: on the bytes after they landed
    (``__call__``), or on the digest the reader computed as they landed."""

    def __init__(self, algo: str, expected: bytes) -> None:
        self.algo, self.expected = algo, expected
        self.aside = self.as_landed = 0

    def __call__(self, landed: Sequence[memoryview]) -> None:
        self.aside += 1
        h = xxhash.xxh3_128() if self.algo == "xxh3-128" else blake3.blake3()
        for piece in landed:
            h.update(piece)
        if h.digest() != self.expected:
            raise IntegrityError("failed its digest (aside)", source="holder")

    def check_digest(self, digest: bytes, seconds: float) -> None:
        assert seconds >= 0
        self.as_landed += 1
        if digest != self.expected:
            raise IntegrityError("failed its digest (as landed)", source="holder")


@asynccontextmanager
async def holder(corrupt: int = 0) -> AsyncIterator[tuple[Published, str]]:
    """A TCP holder of one version of 300 small tensors, in 64 KiB chunks."""
    store, rng = Store(), random.Random(7)
    pub = publish(store, rng, [rng.randrange(200, 1200) for _ in range(300)], 1 << 16)
    provider = CorruptingProvider(store, corrupt) if corrupt else store
    server = TcpServer(provider, lambda _peer, _n: None, lambda _why: None)
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    async with running(server):
        yield pub, address


async def stream_all(pub: Published, address: str, algo: str, pieces: int
                     ) -> tuple[dict[int, int | Exception], dict[int, Check],
                                dict[int, np.ndarray[Any, Any]]]:
    conn = await TcpConnection.connect(address, "holder", 5)
    rng = random.Random(pieces)
    chunks = list(range(pub.local.manifest.num_chunks))
    results: dict[int, int | Exception] = {}
    checks: dict[int, Check] = {}
    bufs: dict[int, np.ndarray[Any, Any]] = {}

    def take(_budget: int) -> list[tuple[int, Any, Any]]:
        run = chunks[:2]
        del chunks[:2]
        out = []
        for c in run:
            data = pub.chunk(c).tobytes()
            h = xxhash.xxh3_128(data) if algo == "xxh3-128" else blake3.blake3(data)
            checks[c] = Check(algo, h.digest())
            bufs[c] = np.zeros(len(data), np.uint8)
            out.append((c, cut(bufs[c], rng, pieces), checks[c]))
        return out

    def landed(c: int, result: int | Exception) -> bool:
        results[c] = result
        return True

    try:
        with trio.fail_after(20):
            await conn.stream_chunks(pub.local.manifest.key, take, landed,
                                     StreamWindow(1 << 16, 1 << 20))
    finally:
        await conn.aclose()
    return results, checks, bufs


async def test_chunks_of_many_pieces_are_hashed_as_they_land() -> None:
    async with holder() as (pub, address):
        results, checks, bufs = await stream_all(pub, address, "xxh3-128",
                                                 HASH_AS_LANDED_PIECES + 30)
    assert len(results) == pub.local.manifest.num_chunks > 2
    for c, result in results.items():
        assert result == len(pub.chunk(c)), (c, result)
        assert np.array_equal(bufs[c], pub.chunk(c))
        assert (checks[c].as_landed, checks[c].aside) == (1, 0)


async def test_a_corrupt_chunk_hashed_as_it_landed_fails_its_check() -> None:
    async with holder(corrupt=1) as (pub, address):
        results, checks, _ = await stream_all(pub, address, "xxh3-128",
                                              HASH_AS_LANDED_PIECES + 30)
    bad = [c for c, r in results.items() if isinstance(r, IntegrityError)]
    assert len(bad) == 1 and "as landed" in str(results[bad[0]])
    assert all(r == len(pub.chunk(c)) for c, r in results.items() if c not in bad)
    assert all(ch.aside == 0 for ch in checks.values())


@pytest.mark.parametrize(("algo", "pieces"), [("blake3", HASH_AS_LANDED_PIECES + 30),
                                              ("xxh3-128", HASH_AS_LANDED_PIECES)])
async def test_other_chunks_are_checked_aside(algo: str, pieces: int) -> None:
    """blake3 lets go of the GIL for each piece of 2 KiB or more, and a chunk of a few
    pieces is hashed faster in one pass: both are checked after they land."""
    async with holder() as (pub, address):
        results, checks, _ = await stream_all(pub, address, algo, pieces)
    assert all(r == len(pub.chunk(c)) for c, r in results.items())
    assert all((ch.as_landed, ch.aside) == (0, 1) for ch in checks.values())
