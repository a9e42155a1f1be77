"""A fetch streams from its holders (:class:`tensorhub.peer.fetcher.Fetch` over the real
TCP data plane, in this process): runs of chunks asked ahead, each chunk counted when it
lands and passes its digest, a holder still receiving streamed as it lands, a stall
judged by progress, a holder that fails mid-stream replaced without losing a chunk."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from tensorhub.manifest import build_manifest
from tensorhub.model import PeerInfo, VersionKey
from tensorhub.peer.destination import allocate_flat
from tensorhub.peer.fetcher import Fetch, FetchReport
from tensorhub.peer.store import LocalVersion, Store
from tensorhub.protocol.refs import Holding
from tensorhub.protocol.sizing import StreamWindow
from tensorhub.transport.base import Connection
from tensorhub.transport.server import TcpServer
from tensorhub.transport.tcp import TcpConnection

KEY = VersionKey("m", 1)


@dataclass
class Holder:
    info: PeerInfo
    store: Store
    served: list[int]
    stop: trio.CancelScope


@asynccontextmanager
async def holders(count: int) -> AsyncIterator[list[Holder]]:
    """``count`` data servers, each with its own store, in this process."""
    async with trio.open_nursery() as nursery:
        out = []
        for i in range(count):
            store, served = Store(), list[int]()
            server = TcpServer(store, lambda _p, n, s=served: s.append(n), lambda _w: None)
            port = server.bind("127.0.0.1", 0)
            scope = trio.CancelScope()

            async def serve(server: TcpServer = server, scope: trio.CancelScope = scope,
                            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                            ) -> None:
                with scope:
                    await server.serve(task_status=task_status)

            await nursery.start(serve)
            out.append(Holder(PeerInfo(f"h{i}", "tcp://127.0.0.1:1", f"127.0.0.1:{port}"),
                              store, served, scope))
        yield out
        nursery.cancel_scope.cancel()


def version(seed: int, size: int, chunk: int) -> tuple[LocalVersion, np.ndarray[Any, Any]]:
    data = np.frombuffer(random.Random(seed).randbytes(size), dtype=np.uint8)
    manifest = build_manifest(KEY, [("w", data)], chunk, "blake3")
    return LocalVersion(manifest, [data], "h0", verified=True), data


def fetch(reader: LocalVersion, sources: list[Holder], **kw: Any) -> Fetch:
    def view(_key: VersionKey) -> list[tuple[PeerInfo, Holding]]:
        return [(h.info, local.holding()) for h in sources
                if (local := h.store.get(KEY)) is not None]

    async def connect(peer: PeerInfo) -> Connection:
        return await TcpConnection.connect(peer.data, peer.name, 5)

    return Fetch(me="reader", local=reader, view=view, connect=connect,
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
        report = await fetch(reader, [h0]).run()
    assert report.verified and same(reader, data)
    assert report.chunks == report.chunks_received == 24
    assert report.reads < report.chunks  # runs of several chunks at a time
    assert set(report.windows) == {"h0"} and "MiB" in report.windows["h0"]
    assert report.chunk_size.startswith("1 MiB chosen by the publisher: its PeerConfig")
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
        job.pace.floor = 0.2  # the run takes 2 s: a limit per run would stall
        wide = job.windows["h0"] = StreamWindow(65_536, 1 << 30)
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
            with trio.fail_after(30):
                while reader.num_verified < 8:
                    await trio.sleep(0)
            h1.stop.cancel()  # its connections end mid-run
    report = result[0]
    assert report.verified and same(reader, data)
    assert report.chunks == 64 and report.chunks_received == 64
    assert sum(report.bytes_by_source.values()) == 64 << 20
