"""The conformance suite every data-plane transport passes.

A test module runs it by defining an ``open_holder`` fixture and importing the tests::

    from transport_conformance import *  # noqa: F403

``open_holder()`` is an async context manager that yields a :class:`Holder`: a live holder
serving ``holder.store`` over the transport under test, a ``connect()`` factory for
readers, ``kill()`` to make the holder die abruptly, and what its server counted.

The contract, for every transport:

* a read returns exactly the chunk's bytes, whatever the chunk's size, however many
  tensors it spans and however the destination is cut, for many reads in a row on one
  connection and for concurrent reads on several;
* refusals are :class:`NotServing` with the holder's status (``NOT_HELD``, ``NOT_YET``,
  ``BAD_REQUEST``) and leave the connection usable;
* a holder that dies mid-chunk makes the read fail with a transport error; bytes are
  never reported read unless they are exactly right;
* malformed, oversized or out-of-turn requests close that connection, are counted by
  the server's ``on_bad`` and do not disturb other connections;
* a stream (``stream_chunks``) reports each chunk it was given exactly once, in any
  order, with its exact bytes or its own failure: a chunk the holder lacks is refused
  (``NOT_YET``) and the stream goes on; a chunk whose check fails is that chunk's error
  and the chunks around it are good; a holder that dies mid-stream makes the stream
  fail, and no chunk is reported read unless it is exactly right; ``landed`` returning
  False ends it at once;
* a read in flight holds the holder's lease: unpublish (``Store.wait_drained``) waits for
  it (and for a same-host version lease until the reader's next request or the
  connection's end); a cancelled read ends the lease once the reader closes the
  connection (the fetcher does; a connection is used by one task at a time and closed
  after any failure).
"""

from __future__ import annotations

import os
import random
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
import trio.testing

from tensorhub.errors import RemoteProtocolError, TransportError
from tensorhub.manifest.manifest import Manifest
from tensorhub.model import TensorSpec, VersionKey
from tensorhub.protocol import codec
from tensorhub.protocol.dataplane import (
    BAD_REQUEST,
    MAX_FRAME,
    MAX_RUN_CHUNKS,
    NOT_HELD,
    NOT_YET,
    ChunkReply,
    ChunkRunRequest,
    Reply,
    ShmDone,
)
from tensorhub.protocol.messages import register_all
from tensorhub.protocol.sizing import StreamWindow
from tensorhub.read.store import LocalVersion, Store
from tensorhub.transport.base import Connection, NotServing, Verifier
from tensorhub.transport.server import TcpServer

register_all()
RUN_ID = {cls: i for i, cls in codec.registered().items()}[ChunkRunRequest]

SEED = int(os.environ.get("TENSORHUB_SEED") or random.randrange(2**32))
print(f"tests/transport_conformance.py: seed {SEED} (TENSORHUB_SEED={SEED} replays it)")

EMPTY: Callable[[int, type[np.uint8]], np.ndarray[Any, Any]] = np.empty
"""How :func:`publish` allocates the holder's arrays: the shared-memory holders of the
suite set ``tensorhub.shared_empty`` here."""

FAILED = (TransportError, RemoteProtocolError, OSError)
"""What a read from a dead or misbehaving holder may raise (the fetcher drops on each)."""


@dataclass
class Holder:
    store: Store
    connect: Callable[[], Awaitable[Connection]]
    kill: Callable[[], Awaitable[None]]
    address: str | None = None
    """``host:port`` of the wire server, or None for a transport without a wire."""
    sent: list[int] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)


OpenHolder = Callable[[], AbstractAsyncContextManager[Holder]]


@asynccontextmanager
async def running(server: TcpServer) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Serve ``server`` (bound) in a task until the block ends; yields ``kill()``, which
    stops it at once, as a holder that dies."""
    scope, stopped = trio.CancelScope(), trio.Event()

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await server.serve(task_status=task_status)
        stopped.set()

    async def kill() -> None:
        scope.cancel()
        await stopped.wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(run)
        yield kill
        scope.cancel()


@dataclass
class Published:
    local: LocalVersion
    data: np.ndarray[Any, Any]
    """The version's bytes, end to end: what every read is compared against."""

    def chunk(self, c: int) -> np.ndarray[Any, Any]:
        return self.data[slice(*self.local.manifest.chunk_range(c))]


def rng_for(test: str) -> random.Random:
    return random.Random(f"{SEED}:{test}")


def publish(store: Store, rng: random.Random, sizes: Sequence[int], chunk_size: int,
            model: str = "m", version: int = 1, verified: bool = True) -> Published:
    """Random tensors of ``sizes`` bytes (read-only arrays, as a publisher may hand us)."""
    data = np.frombuffer(rng.randbytes(sum(sizes)), dtype=np.uint8)
    arrays, specs, offset = [], [], 0
    for i, size in enumerate(sizes):
        dtype = np.dtype(np.float32 if size % 4 == 0 else np.uint8)
        arr = EMPTY(size, np.uint8)
        arr[:] = data[offset:offset + size]
        arr = arr.view(dtype)
        arr.flags.writeable = False
        arrays.append(arr)
        specs.append(TensorSpec(f"t{i}", dtype.str, arr.shape, offset))
        offset += size
    skeleton = Manifest(model, version, tuple(specs), chunk_size, "blake3", ())
    digests = (bytes(32),) * skeleton.num_chunks  # transports do not check digests
    manifest = Manifest(model, version, tuple(specs), chunk_size, "blake3", digests)
    local = LocalVersion(manifest, arrays, "holder", verified=verified)
    store.add(local)
    return Published(local, data)


def cut(buf: np.ndarray[Any, Any], rng: random.Random, pieces: int) -> list[memoryview]:
    """``buf`` as up to ``pieces`` destination segments cut at random places."""
    view = memoryview(buf)  # type: ignore[arg-type]
    points = sorted(rng.sample(range(1, len(buf)), min(pieces, len(buf)) - 1))
    return [view[a:b] for a, b in zip([0, *points], [*points, len(buf)], strict=True)]


async def read_into(conn: Connection, pub: Published, c: int,
                    dest: Sequence[memoryview]) -> None:
    n = await conn.read_chunk(pub.local.manifest.key, c, dest)
    assert n == len(pub.chunk(c))


async def landing(buf: np.ndarray[Any, Any], before: int) -> None:
    """Wait until the first byte of a read has landed in ``buf`` (it held ``before``)."""
    with trio.fail_after(10):
        while buf[0] == before:
            await trio.lowlevel.checkpoint()


# -- ordering -------------------------------------------------------------------------


async def test_sequential_reads_return_exact_bytes(open_holder: OpenHolder) -> None:
    rng = rng_for("sequential")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [rng.randrange(1, 200_000) for _ in range(40)],
                      chunk_size=65_536 + 13)
        conn = await holder.connect()
        assert await conn.read_manifest(pub.local.manifest.key) == pub.local.encoded_manifest
        order = list(range(pub.local.manifest.num_chunks)) * 2
        rng.shuffle(order)
        for c in order:
            buf = np.zeros(len(pub.chunk(c)), dtype=np.uint8)
            await read_into(conn, pub, c, cut(buf, rng, rng.randrange(1, 6)))
            assert np.array_equal(buf, pub.chunk(c)), f"chunk {c}"
        await conn.aclose()
        expected = sum(len(pub.chunk(c)) for c in order)
        with trio.fail_after(5):  # the holder counts once its send call returns
            while sum(holder.sent) < expected:
                await trio.sleep(0.001)
        assert sum(holder.sent) == expected


async def test_concurrent_reads_on_several_connections(open_holder: OpenHolder) -> None:
    rng = rng_for("concurrent")
    async with open_holder() as holder:
        pubs = [publish(holder.store, rng, [rng.randrange(1, 300_000) for _ in range(12)],
                        chunk_size=100_000, version=v) for v in (1, 2)]
        bad: list[str] = []

        async def reader(seed: int) -> None:
            mine = random.Random(seed)
            conn = await holder.connect()
            jobs = [(p, c) for p in pubs for c in range(p.local.manifest.num_chunks)]
            mine.shuffle(jobs)
            for pub, c in jobs:
                buf = np.zeros(len(pub.chunk(c)), dtype=np.uint8)
                await read_into(conn, pub, c, cut(buf, mine, 3))
                if not np.array_equal(buf, pub.chunk(c)):
                    bad.append(f"reader {seed}: {pub.local.manifest.key} chunk {c}")
            await conn.aclose()

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(reader, rng.randrange(2**32) + i)
        assert not bad


async def test_batched_reads_return_each_chunks_bytes(open_holder: OpenHolder) -> None:
    """``read_chunks``: one entry per chunk read, in order, each chunk's exact bytes; a
    chunk whose check fails is that entry (the chunks before it are good)."""
    rng = rng_for("batched")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [rng.randrange(1, 900_000) for _ in range(10)],
                      chunk_size=300_000 + rng.randrange(1000))
        key, count = pub.local.manifest.key, pub.local.manifest.num_chunks
        conn = await holder.connect()
        first = np.zeros(len(pub.chunk(0)), dtype=np.uint8)
        await read_into(conn, pub, 0, cut(first, rng, 2))  # a same-host reader's lease
        checked: list[int] = []

        def check(c: int) -> Callable[[Sequence[memoryview]], None]:
            def verify(landed: Sequence[memoryview]) -> None:
                assert b"".join(landed) == pub.chunk(c).tobytes()
                checked.append(c)
            return verify

        at = 1
        while at < count:
            chunks = list(range(at, min(count, at + rng.randrange(2, 6))))
            bufs = [np.zeros(len(pub.chunk(c)), dtype=np.uint8) for c in chunks]
            got = await conn.read_chunks(key, chunks, [cut(b, rng, 3) for b in bufs],
                                         [check(c) for c in chunks])
            assert got == [len(pub.chunk(c)) for c in chunks]
            for c, buf in zip(chunks, bufs, strict=True):
                assert np.array_equal(buf, pub.chunk(c)), f"chunk {c}"
            at = chunks[-1] + 1
        # each chunk checked once; a transport may check a batch's chunks in parallel
        # threads (shm-memfd splits one batch over its copy threads), so in any order
        assert sorted(checked) == list(range(1, count)), checked

        class Bad(Exception):
            pass

        def refuse(_landed: Sequence[memoryview]) -> None:
            raise Bad("refused by the check")

        chunks = [1, 2, 3]
        bufs = [np.zeros(len(pub.chunk(c)), dtype=np.uint8) for c in chunks]
        got = await conn.read_chunks(key, chunks, [[memoryview(b)] for b in bufs],  # type: ignore[arg-type]
                                     [None, refuse, None])
        assert got[0] == len(pub.chunk(1)) and np.array_equal(bufs[0], pub.chunk(1))
        assert isinstance(got[1], Bad) and len(got) in (2, 3)
        if len(got) == 3:  # a transport that read on: that chunk is good too
            assert got[2] == len(pub.chunk(3)) and np.array_equal(bufs[2], pub.chunk(3))
        await conn.aclose()


# -- partial reads --------------------------------------------------------------------


async def test_chunks_spanning_many_small_tensors(open_holder: OpenHolder) -> None:
    rng = rng_for("small")
    async with open_holder() as holder:
        tiny = [rng.randrange(1, 50) for _ in range(40)]
        small = [rng.randrange(1, 300) for _ in range(3000)]
        pubs = [
            publish(holder.store, rng, tiny, chunk_size=7, version=1),
            publish(holder.store, rng, small, chunk_size=4096, version=2),
            publish(holder.store, rng, small, chunk_size=1 << 20, version=3),  # one chunk
            publish(holder.store, rng, [24 << 20], chunk_size=16 << 20, version=4),
        ]
        conn = await holder.connect()
        for pub in pubs:
            m = pub.local.manifest
            for c in range(m.num_chunks):
                start, stop = m.chunk_range(c)
                flat = np.zeros(stop - start, dtype=np.uint8)
                await read_into(conn, pub, c, [memoryview(flat)])  # type: ignore[arg-type]
                # ...and cut like a fetch into separate tensors: one piece per tensor
                per_tensor = np.zeros_like(flat)
                view = memoryview(per_tensor)  # type: ignore[arg-type]
                pieces = [view[s.start + m.tensors[s.index].offset - start:
                               s.stop + m.tensors[s.index].offset - start]
                          for s in m.segments(start, stop)]
                await read_into(conn, pub, c, pieces)
                assert np.array_equal(flat, pub.chunk(c)), f"{m.key} chunk {c}"
                assert np.array_equal(per_tensor, pub.chunk(c)), f"{m.key} chunk {c}"
        await conn.aclose()


# -- statuses -------------------------------------------------------------------------


async def test_not_held_not_yet_and_bad_chunk(open_holder: OpenHolder) -> None:
    rng = rng_for("statuses")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [5000, 7000], chunk_size=4096, verified=False)
        pub.local.mark_verified(1)
        pub.local.end_receiving()  # a holder that will not get chunk 0: NOT_YET at once
        key = pub.local.manifest.key
        conn = await holder.connect()

        async def refused(status: int, read: Callable[[], Awaitable[object]]) -> None:
            with pytest.raises(NotServing) as info:
                await read()
            assert info.value.status == status, info.value.detail
            buf = np.zeros(len(pub.chunk(1)), dtype=np.uint8)  # and the connection still works
            await read_into(conn, pub, 1, [memoryview(buf)])  # type: ignore[arg-type]
            assert np.array_equal(buf, pub.chunk(1))

        dest = [memoryview(bytearray(4096))]
        other = VersionKey("m", 99)
        await refused(NOT_HELD, lambda: conn.read_manifest(other))
        await refused(NOT_HELD, lambda: conn.read_chunk(other, 0, dest))
        await refused(NOT_YET, lambda: conn.read_chunk(key, 0, dest))
        await refused(BAD_REQUEST, lambda: conn.read_chunk(key, pub.local.manifest.num_chunks,
                                                           dest))
        await refused(BAD_REQUEST, lambda: conn.read_chunk(key, -1, dest))
        holder.store.hide(key)
        with pytest.raises(NotServing) as info:
            await conn.read_chunk(key, 1, dest)
        assert info.value.status == NOT_HELD
        await conn.aclose()


async def test_a_chunk_still_arriving_is_served_once_verified(open_holder: OpenHolder) -> None:
    """Pipelining: a holder that is still receiving answers when it has the chunk, or
    NOT_YET when its fetch ends without it."""
    rng = rng_for("arriving")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [5000, 7000], chunk_size=4096, verified=False)
        conn, other = await holder.connect(), await holder.connect()
        buf = np.zeros(4096, dtype=np.uint8)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_into, conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
            await trio.testing.wait_all_tasks_blocked()
            assert not buf.any()
            pub.local.mark_verified(0)
        assert np.array_equal(buf, pub.chunk(0))

        async def end_receiving() -> None:
            await trio.testing.wait_all_tasks_blocked()
            pub.local.end_receiving()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(end_receiving)
            with pytest.raises(NotServing) as info:
                await read_into(other, pub, 1, [memoryview(buf)])  # type: ignore[arg-type]
        assert info.value.status == NOT_YET
        await conn.aclose()
        await other.aclose()


# -- streams --------------------------------------------------------------------------


@dataclass
class Streamed:
    """What a stream reported: each chunk's bytes (or error), in the order reported."""

    bufs: dict[int, np.ndarray[Any, Any]] = field(default_factory=dict)
    results: dict[int, int | Exception] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)


async def stream(conn: Connection, pub: Published, chunks: Sequence[int],
                 rng: random.Random, verify: Callable[[int], Verifier | None] = lambda c: None,
                 on_landed: Callable[[int, int | Exception], bool] = lambda c, r: True,
                 ) -> Streamed:
    """Stream ``chunks`` (handed out in runs of random sizes) into fresh buffers cut at
    random, checking each chunk's bytes before ``verify(c)`` runs."""
    out = Streamed()
    todo = list(chunks)

    def checked(c: int) -> Verifier:
        extra = verify(c)

        def check(landed: Sequence[memoryview]) -> None:
            assert b"".join(bytes(d) for d in landed) == pub.chunk(c).tobytes(), c
            if extra is not None:
                extra(landed)
        return check

    def take(budget: int) -> list[tuple[int, Any, Verifier | None]]:
        assert budget > 0
        run = todo[:rng.randrange(1, 5)]
        del todo[:len(run)]
        for c in run:
            out.bufs[c] = np.zeros(len(pub.chunk(c)), dtype=np.uint8)
        return [(c, cut(out.bufs[c], rng, rng.randrange(1, 4)), checked(c)) for c in run]

    def landed(c: int, result: int | Exception) -> bool:
        assert c not in out.results, f"chunk {c} reported twice"
        out.results[c] = result
        out.order.append(c)
        return on_landed(c, result)

    window = StreamWindow(pub.local.manifest.chunk_size, 1 << 30)
    await conn.stream_chunks(pub.local.manifest.key, take, landed, window)
    return out


def assert_good(pub: Published, got: Streamed, chunks: Sequence[int]) -> None:
    for c in chunks:
        assert got.results[c] == len(pub.chunk(c)), f"chunk {c}: {got.results[c]!r}"
        assert np.array_equal(got.bufs[c], pub.chunk(c)), f"chunk {c}"


async def test_a_stream_refuses_a_missing_chunk_and_goes_on(open_holder: OpenHolder) -> None:
    """A holder that lacks a chunk in the middle of a run answers it NOT_YET; the chunks
    before and after it arrive, exactly."""
    rng = rng_for("stream-missing")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [rng.randrange(1, 300_000) for _ in range(8)],
                      chunk_size=100_000 + rng.randrange(1000), verified=False)
        count = pub.local.manifest.num_chunks
        gap = count // 2
        for c in range(count):
            if c != gap:
                pub.local.mark_verified(c)
        pub.local.end_receiving()  # it will not get the gap: NOT_YET at once
        conn = await holder.connect()
        got = await stream(conn, pub, range(count), rng)
        assert sorted(got.results) == list(range(count))
        refused = got.results[gap]
        assert isinstance(refused, NotServing) and refused.status == NOT_YET, refused
        assert_good(pub, got, [c for c in range(count) if c != gap])
        await read_into(conn, pub, 0, [memoryview(got.bufs[0])])  # type: ignore[arg-type]
        await conn.aclose()


async def test_a_stream_from_a_holder_still_receiving_gets_chunks_as_they_land(
        open_holder: OpenHolder) -> None:
    """Partial-prefix serving: a stream asks ahead of what the holder has; the holder
    sends each chunk once it is verified there, and the stream waits for it."""
    rng = rng_for("stream-arriving")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [rng.randrange(1, 200_000) for _ in range(6)],
                      chunk_size=65_536 + rng.randrange(1000), verified=False)
        count = pub.local.manifest.num_chunks
        conn = await holder.connect()
        got: list[Streamed] = []

        async def read() -> None:
            got.append(await stream(conn, pub, range(count), rng))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            for c in range(count):  # lands one by one while the stream waits
                await trio.testing.wait_all_tasks_blocked()
                assert not got
                pub.local.mark_verified(c)
        assert sorted(got[0].results) == list(range(count))
        assert_good(pub, got[0], range(count))
        await conn.aclose()


async def test_a_stream_reports_a_failed_check_in_the_middle(open_holder: OpenHolder) -> None:
    """Bytes failing their check in the middle of a stream are that chunk's error only;
    a ``landed`` that says stop ends the stream there."""
    rng = rng_for("stream-bad")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [rng.randrange(1, 400_000) for _ in range(10)],
                      chunk_size=200_000 + rng.randrange(1000))
        count = pub.local.manifest.num_chunks
        bad = rng.randrange(1, count - 1)

        class BadDigest(Exception):
            pass

        def verify(c: int) -> Verifier | None:
            def refuse(_landed: Sequence[memoryview]) -> None:
                raise BadDigest(f"chunk {c}")
            return refuse if c == bad else None

        conn = await holder.connect()
        got = await stream(conn, pub, range(count), rng, verify)
        assert isinstance(got.results[bad], BadDigest)
        assert_good(pub, got, [c for c in range(count) if c != bad])
        await conn.aclose()

        conn = await holder.connect()
        got = await stream(conn, pub, range(count), rng, verify,
                           lambda c, r: not isinstance(r, BadDigest))
        assert isinstance(got.results[bad], BadDigest)
        assert got.order[-1] == bad  # nothing reported after the stop
        assert_good(pub, got, [c for c in got.results if c != bad])
        await conn.aclose()


async def test_a_stream_cut_by_the_holder_fails_and_lands_nothing_wrong(
        open_holder: OpenHolder) -> None:
    """The holder dies once the first chunk has landed: the stream fails (or, with
    everything already on its way, ends), and every chunk it reported is exact."""
    rng = rng_for("stream-cut")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [48 << 20], chunk_size=4 << 20)
        count = pub.local.manifest.num_chunks
        conn = await holder.connect()
        first = trio.Event()

        def on_landed(_c: int, _r: int | Exception) -> bool:
            first.set()
            return True

        outcome: list[BaseException | Streamed] = []

        async def run() -> None:
            try:
                outcome.append(await stream(conn, pub, range(count), rng,
                                            on_landed=on_landed))
            except FAILED as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            with trio.fail_after(10):
                await first.wait()
            await holder.kill()
        if isinstance(outcome[0], Streamed):
            for c, r in outcome[0].results.items():
                if isinstance(r, int):
                    assert np.array_equal(outcome[0].bufs[c], pub.chunk(c)), c
        with pytest.raises(FAILED):
            await stream(conn, pub, range(count), rng)
        await conn.aclose()


# -- peer death -----------------------------------------------------------------------


async def test_holder_death_mid_chunk(open_holder: OpenHolder) -> None:
    rng = rng_for("death")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [64 << 20], chunk_size=64 << 20)
        conn = await holder.connect()
        buf = np.full(len(pub.chunk(0)), pub.data[0] ^ 0xFF, dtype=np.uint8)
        outcome: list[BaseException | None] = []

        async def read() -> None:
            try:
                await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
                outcome.append(None)
            except FAILED as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await landing(buf, pub.data[0] ^ 0xFF)
            await holder.kill()
        # Bytes are reported read only when they are all exactly right.
        assert outcome[0] is not None or np.array_equal(buf, pub.chunk(0))
        with pytest.raises(FAILED):  # the dead holder serves no more
            await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
        await conn.aclose()
        with pytest.raises(FAILED):
            await (await holder.connect()).read_chunk(pub.local.manifest.key, 0,
                                                      [memoryview(buf)])  # type: ignore[arg-type]


# -- bad input ------------------------------------------------------------------------


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


BAD_REQUESTS = {
    "not msgpack": _frame(b"\xc1\xc1\xc1"),
    "unknown type id": _frame(msgpack.packb([999, 1])),
    "wrong arity": _frame(msgpack.packb([2, 1, "m"])),
    "wrong field type": _frame(msgpack.packb([2, 1, "m", "one", 0])),
    "absurd length": struct.pack(">I", 0xFFFF_FFF0) + b"x" * 64,
    "oversized frame": struct.pack(">I", MAX_FRAME + 1) + b"x" * 64,
    "a reply as request": _frame(codec.encode(Reply(1, 0, 0))),
    "a chunk reply as request": _frame(codec.encode(ChunkReply(1, 0, 0, 0))),
    "a run of no chunks": _frame(msgpack.packb([RUN_ID, 1, "m", 1, 0, 0, 0, b""])),
    "a run over the cap": _frame(msgpack.packb([RUN_ID, 1, "m", 1, 0, MAX_RUN_CHUNKS + 1, 0,
                                                b""])),
    "a run past the last index": _frame(codec.encode(ChunkRunRequest(1, "m", 1, 2**32 - 1,
                                                                     2))),
    "done out of turn": _frame(codec.encode(ShmDone(1))),
}


@asynccontextmanager
async def raw_connection(address: str) -> AsyncIterator[trio.SocketStream]:
    host, _, port = address.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        yield stream


async def hung_up(raw: trio.SocketStream) -> None:
    """Wait for the server to close (after a BAD_REQUEST reply at most)."""
    with trio.fail_after(5):
        try:
            while await raw.receive_some(1 << 16):
                pass
        except trio.BrokenResourceError:
            pass  # it closed with our bytes unread: a reset


async def test_malformed_requests_are_dropped_and_counted(open_holder: OpenHolder) -> None:
    rng = rng_for("malformed")
    async with open_holder() as holder:
        if holder.address is None:
            pytest.skip("this transport has no wire to send malformed bytes on")
        pub = publish(holder.store, rng, [10_000], chunk_size=4096)
        keeper = await holder.connect()  # a well-behaved reader throughout
        for name, data in BAD_REQUESTS.items():
            before = len(holder.bad)
            async with raw_connection(holder.address) as raw:
                await raw.send_all(data)
                await hung_up(raw)
            await trio.testing.wait_all_tasks_blocked()
            assert len(holder.bad) == before + 1, f"{name}: {holder.bad[before:]}"
            buf = np.zeros(len(pub.chunk(1)), dtype=np.uint8)
            await read_into(keeper, pub, 1, [memoryview(buf)])  # type: ignore[arg-type]
            assert np.array_equal(buf, pub.chunk(1)), name
        async with raw_connection(holder.address) as raw:  # leaving mid-frame is no fault
            await raw.send_all(_frame(b"\x95\x02")[:5])
        await trio.testing.wait_all_tasks_blocked()
        assert len(holder.bad) == len(BAD_REQUESTS)
        await keeper.aclose()


# -- leases: unpublish drain and cancellation ---------------------------------------------


async def test_unpublish_waits_for_a_read_in_flight(open_holder: OpenHolder) -> None:
    rng = rng_for("drain")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [64 << 20], chunk_size=64 << 20)
        key = pub.local.manifest.key
        conn = await holder.connect()
        buf = np.full(len(pub.chunk(0)), pub.data[0] ^ 0xFF, dtype=np.uint8)
        read_done, drained = trio.Event(), trio.Event()

        async def read() -> None:
            await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
            read_done.set()

        async def unpublish() -> None:
            await holder.store.wait_drained(key)
            drained.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await landing(buf, pub.data[0] ^ 0xFF)
            holder.store.hide(key)
            nursery.start_soon(unpublish)
            await trio.lowlevel.checkpoint()
            assert pub.local.inflight == 1 and not drained.is_set()
            with trio.fail_after(10):
                await read_done.wait()
            # The reader's next request is refused; a same-host reader that holds the
            # whole version leased (shm-memfd) lets go of it there at the latest.
            with pytest.raises(NotServing) as info:
                await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
            assert info.value.status == NOT_HELD
            with trio.fail_after(10):
                await drained.wait()
        assert np.array_equal(buf, pub.chunk(0))
        assert holder.store.get(key) is None
        await conn.aclose()


async def test_cancelled_read_releases_the_lease(open_holder: OpenHolder) -> None:
    rng = rng_for("cancel")
    async with open_holder() as holder:
        pub = publish(holder.store, rng, [64 << 20], chunk_size=64 << 20)
        conn = await holder.connect()
        buf = np.full(len(pub.chunk(0)), pub.data[0] ^ 0xFF, dtype=np.uint8)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_into, conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
            await landing(buf, pub.data[0] ^ 0xFF)
            nursery.cancel_scope.cancel()
        await conn.aclose()
        with trio.fail_after(10):
            await pub.local.drained.wait()
        assert pub.local.inflight == 0
        again = await holder.connect()  # and the holder serves on
        buf[:] = 0
        await read_into(again, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
        assert np.array_equal(buf, pub.chunk(0))
        await again.aclose()
