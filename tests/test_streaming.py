"""A fetch streams from its holders (:class:`tensorhub.read.transfer.Transfer` over the real
TCP data plane, in this process): runs of chunks asked ahead, each chunk counted when it
lands and passes its digest, a holder still receiving streamed as it lands, a stall
judged by progress, a holder that fails mid-stream replaced without losing a chunk."""

from __future__ import annotations

import os
import random
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import trio
from helpers import wait_until

import tensorhub
from tensorhub import PeerConfig
from tensorhub.manifest.manifest import build_manifest
from tensorhub.model import PeerInfo, VersionKey
from tensorhub.protocol import codec
from tensorhub.protocol.dataplane import (
    BAD_REQUEST,
    MAX_RUN_CHUNKS,
    NOT_HELD,
    ChunkReply,
    ChunkRunRequest,
)
from tensorhub.protocol.messages import register_all
from tensorhub.protocol.refs import Holding
from tensorhub.protocol.sizing import StreamWindow, choose_chunk_size
from tensorhub.read.destination import allocate_flat
from tensorhub.read.report import FetchReport
from tensorhub.read.store import LocalVersion, Store
from tensorhub.read.transfer import Transfer
from tensorhub.testing.conformance import running
from tensorhub.transport.base import Connection
from tensorhub.transport.server import TcpServer
from tensorhub.transport.tcp import TcpConnection

register_all()
RUN_ID = {cls: i for i, cls in codec.registered().items()}[ChunkRunRequest]

KEY = VersionKey("m", 1)
SEED = int(os.environ.get("TENSORHUB_SEED") or random.randrange(2**32))
print(f"tests/test_streaming.py: seed {SEED} (TENSORHUB_SEED={SEED} replays it)")


@dataclass
class Holder:
    info: PeerInfo
    store: Store
    served: list[int]
    kill: Callable[[], Awaitable[None]]


@asynccontextmanager
async def holders(count: int) -> AsyncIterator[list[Holder]]:
    """``count`` data servers, each with its own store, in this process."""
    async with AsyncExitStack() as stack:
        out = []
        for i in range(count):
            store, served = Store(), list[int]()
            server = TcpServer(store, lambda _p, n, s=served: s.append(n),  # type: ignore[misc]
                               lambda _w: None)
            port = server.bind("127.0.0.1", 0)
            kill = await stack.enter_async_context(running(server))
            out.append(Holder(PeerInfo(f"h{i}", "tcp://127.0.0.1:1", f"127.0.0.1:{port}"),
                              store, served, kill))
        yield out


def version(seed: int, size: int, chunk: int) -> tuple[LocalVersion, np.ndarray[Any, Any]]:
    data = np.frombuffer(random.Random(seed).randbytes(size), dtype=np.uint8)
    manifest = build_manifest(KEY, [("w", data)], chunk, "blake3")
    return LocalVersion(manifest, [data], "h0", verified=True), data


def fetch(reader: LocalVersion, sources: list[Holder], **kw: Any) -> Transfer:
    def view(_key: VersionKey) -> list[tuple[PeerInfo, Holding]]:
        return [(h.info, local.holding()) for h in sources
                if (local := h.store.get(KEY)) is not None]

    async def connect(peer: PeerInfo) -> Connection:
        return await TcpConnection.connect(peer.data, peer.name, 5)

    return Transfer(me="reader", local=reader, view=view, connect=connect, release=kw.pop(
                     "release", None),
                 upstream=frozenset(kw.pop("upstream", ())), window=kw.pop("window", 2),
                 stall_timeout=kw.pop("stall_timeout", 10.0), on_progress=lambda: None,
                 banned=lambda _n: None, on_bad_bytes=lambda *_a: None, **kw)


def reader_of(local: LocalVersion) -> LocalVersion:
    arrays, flat = allocate_flat(local.manifest)
    return LocalVersion(local.manifest, arrays, "h0", verified=False, flat=flat)


def same(reader: LocalVersion, data: np.ndarray[Any, Any]) -> bool:
    assert reader.flat is not None
    return bytes(reader.flat) == data.tobytes()


async def test_a_fetch_streams_runs_and_reports_its_windows() -> None:
    async with holders(1) as (h0,):
        local, data = version(1, 24 << 20, 1 << 20)
        h0.store.add(local)
        reader = reader_of(local)
        kept: list[bool] = []

        async def release(conn: Connection) -> None:  # as the pool checks before keeping
            assert isinstance(conn, TcpConnection)
            kept.append(conn.reusable())
            await conn.aclose()

        report = await fetch(reader, [h0], release=release).run()
    assert report.verified and same(reader, data)
    assert kept and all(kept)  # streams end in step: the pool keeps their connections
    assert report.chunks == report.chunks_received == 24
    assert report.reads < report.chunks  # runs of several chunks at a time
    assert set(report.windows) == {"h0"} and "MiB" in report.windows["h0"]
    assert report.windows["h0"].endswith("; 1 stream at most")  # one link, in order
    assert report.chunk_size.startswith("1 MiB chosen by the publisher: its PeerConfig")
    # stage timings (issue 15): first verified chunk, last one, digest checks summed
    assert 0 < report.first_byte_seconds <= report.transfer_seconds <= report.seconds
    assert report.verify_seconds > 0 and report.to_dict()["verify_seconds"] > 0
    assert sum(h0.served) == 24 << 20


async def test_a_holder_still_receiving_is_streamed_in_order_without_stalls() -> None:
    """The holder gets a chunk every 50 ms (a parent in a relay tree); the reader, which
    names it as its source, asks ahead and gets each chunk as it lands, however long the
    whole run takes: the stall limit applies to progress, chunk by chunk."""
    async with holders(1) as (h0,):
        full, data = version(2, 40 * 65_536, 65_536)
        parent = LocalVersion(full.manifest, [data.copy()], "h0", verified=False)
        h0.store.add(parent)
        reader = reader_of(full)
        job = fetch(reader, [h0], upstream={"h0"}, window=1, stall_timeout=1.0)
        job.session.pace.floor = 0.2  # the run takes 2 s: a limit per run would stall
        wide = job.session.windows["h0"] = StreamWindow(65_536, 1 << 30)
        wide.rtt(1.0)  # as if over a long fast link: the whole version in one run
        wide.delivered(1 << 20, 1e-3)
        result: list[FetchReport] = []

        async def run() -> None:
            result.append(await job.run())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            for c in range(full.manifest.num_chunks):
                await trio.sleep(0.05)
                parent.mark_verified(c)
            parent.end_receiving()
    report = result[0]
    assert report.verified and same(reader, data)
    assert report.stall_retries == {} and report.dropped_sources == {}
    assert report.chunks_received == report.chunks == 40
    assert report.reads == 1


async def test_a_holder_that_dies_mid_stream_is_replaced_and_no_chunk_is_lost() -> None:
    async with holders(2) as (h0, h1):
        local, data = version(3, 64 << 20, 1 << 20)
        for h in (h0, h1):
            h.store.add(LocalVersion(local.manifest, [data], "h0", verified=True))
        reader = reader_of(local)
        job = fetch(reader, [h0, h1], window=2)
        result: list[FetchReport] = []

        async def run() -> None:
            result.append(await job.run())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await wait_until(lambda: reader.num_verified >= 8, 30, every=0,
                             what="8 chunks verified")
            await h1.kill()  # its connections end mid-run
    report = result[0]
    assert report.verified and same(reader, data)
    assert report.chunks == 64 and report.chunks_received == 64
    assert sum(report.bytes_by_source.values()) == 64 << 20


async def test_hostile_runs_get_an_answer_per_chunk_or_a_closed_connection() -> None:
    """Run requests with any first chunk, count and names: a request within bounds is
    answered with one ChunkReply per chunk, in order (refusals included); one out of
    bounds closes that connection and is counted; the holder serves on throughout."""
    rng = random.Random(SEED)
    bad: list[str] = []
    store = Store()
    local, data = version(4, 10 * 4096, 4096)
    store.add(local)
    server = TcpServer(store, lambda _p, _n: None, bad.append)
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"

    async def counted(before: int) -> None:
        await wait_until(lambda: len(bad) > before, 5, every=0.001,
                         what="the request out of bounds counted")

    async with running(server):
        for i in range(60):
            first = rng.choice([0, 3, 9, 10, 2**31, 2**32 - 1, 2**32, -1, rng.randrange(20)])
            count = rng.choice([0, 1, 2, 7, MAX_RUN_CHUNKS, MAX_RUN_CHUNKS + 1, -3, 2**40])
            model = rng.choice(["m", "other", "", "x" * 300, 7])
            wire = [RUN_ID, i, model, 1, first, count, 0, b""]
            valid = 0 <= first < 2**32 and 1 <= count <= MAX_RUN_CHUNKS \
                and isinstance(model, str) and len(model) <= 200 \
                and first + count - 1 < 2**32
            before = len(bad)
            stream = await trio.open_tcp_stream("127.0.0.1", int(address.rpartition(":")[2]))
            async with stream:
                body = msgpack.packb(wire, use_bin_type=True)
                await stream.send_all(struct.pack(">I", len(body)) + body)
                got = await replies(stream, count if valid else 0)
            if valid:
                assert [r.chunk for r, _ in got] == list(range(first, first + count))
                for r, payload in got:
                    if model == "m" and r.chunk < 10:
                        assert r.status == 0 and payload == data[r.chunk * 4096:][:4096].tobytes()
                    else:
                        assert r.status in (NOT_HELD, BAD_REQUEST) and payload == b"", r
            else:
                await counted(before)
                assert not got
        reader = reader_of(local)
        conn = await TcpConnection.connect(address, "h0", 5)
        await conn.read_chunk(KEY, 3, reader.segments(3))
        assert bytes(reader.segments(3)[0]) == data[3 * 4096:4 * 4096].tobytes()
        await conn.aclose()


async def replies(stream: trio.SocketStream, count: int) -> list[tuple[ChunkReply, bytes]]:
    """``count`` chunk replies and their payloads, then nothing (or the end) within 0.2 s
    of quiet; stops early at the end of the connection."""
    buf = bytearray()
    out: list[tuple[ChunkReply, bytes]] = []

    async def need(n: int) -> bool:
        while len(buf) < n:
            with trio.move_on_after(5 if len(out) < count else 0.2):
                more = await stream.receive_some(1 << 16)
                if not more:
                    return False
                buf.extend(more)
                continue
            return False
        return True

    while await need(4):
        size = struct.unpack(">I", buf[:4])[0]
        if not await need(4 + size):
            break
        reply = codec.decode(bytes(buf[4:4 + size]))
        del buf[:4 + size]
        assert isinstance(reply, ChunkReply)
        length = reply.length if reply.status == 0 else 0
        if not await need(length):
            break
        out.append((reply, bytes(buf[:length])))
        del buf[:length]
    return out


async def test_a_peer_chooses_the_chunk_size_and_says_so() -> None:
    """Without ``chunk_size`` a publisher cuts a version by its size and says so in
    ``statistics().chunking``; a fetch report names the chunk size and each source's
    window; ``chunk_size`` set overrides the choice."""
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(tensorhub.open_peer(PeerConfig.local("pub")))
        seed = pub.info.control.removeprefix("tcp://")
        fixed = await stack.enter_async_context(tensorhub.open_peer(
            PeerConfig.local("fixed", join=(seed,), chunk_size=1 << 20)))
        reader = await stack.enter_async_context(tensorhub.open_peer(
            PeerConfig.local("reader", join=(seed,), transports=("tcp",))))
        assert pub.statistics().chunking.startswith("automatic")
        weights = {"w": np.arange(6 << 20, dtype=np.uint8)}
        manifest = await pub.publish("m", 1, weights)
        assert manifest.chunk_size == choose_chunk_size(6 << 20)[0] == 4 << 20
        assert "automatic for 6 MiB" in pub.statistics().chunking
        assert (await fixed.publish("n", 1, weights)).chunk_size == 1 << 20
        assert fixed.statistics().chunking.startswith("1048576 bytes (PeerConfig")
        for model, source in (("m", "pub"), ("n", "fixed")):
            with trio.fail_after(10):
                while await reader.latest(model) != 1:
                    await reader.wait_changed()
            got = await reader.fetch(model, 1)
            assert np.array_equal(got.tensors["w"], weights["w"])
            assert set(got.report.windows) == {source}, got.report.windows
        assert "automatic would be 4 MiB" in got.report.chunk_size


async def delayed_relay(listener: trio.SocketListener, port: int, one_way: float) -> None:
    """Forward connections to ``port``, every byte ``one_way`` seconds late each way
    (there is no netem here: a round trip added in user space)."""
    async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        send, recv = trio.open_memory_channel[tuple[float, bytes]](1 << 16)

        async def read() -> None:
            async with send:
                while data := await src.receive_some(1 << 16):
                    await send.send((trio.current_time() + one_way, data))

        async def write() -> None:
            async with recv:
                async for at, data in recv:
                    await trio.sleep_until(at)
                    await dst.send_all(data)
            await dst.send_eof()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(write)

    async def handle(client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", port)
        async with client, upstream, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, upstream)
            nursery.start_soon(pump, upstream, client)

    await trio.serve_listeners(handle, [listener])


async def test_a_long_round_trip_costs_requests_per_window_not_per_chunk() -> None:
    """Over a 100 ms round trip a stream measures the link and asks for as much as its
    bandwidth-delay product at once: a few requests for 64 chunks, where one request
    per chunk would pay 64 round trips."""
    async with holders(1) as (h0,), trio.open_nursery() as nursery:
        local, data = version(5, 64 * 262_144, 262_144)
        h0.store.add(local)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(delayed_relay, listeners[0], int(h0.info.data.rpartition(":")[2]),
                           0.05)
        relayed = listeners[0].socket.getsockname()[1]
        h0.info = PeerInfo("h0", "tcp://127.0.0.1:1", f"127.0.0.1:{relayed}")
        reader = reader_of(local)
        report = await fetch(reader, [h0], window=1).run()
        nursery.cancel_scope.cancel()
    assert report.verified and same(reader, data)
    assert report.reads <= 8, report.reads
    window = report.windows["h0"]
    assert "x the BDP" in window or "the cap" in window, window
