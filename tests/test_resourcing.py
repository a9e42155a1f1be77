"""Faults mid-fetch: a holder killed, stopped, or sending bad bytes is replaced."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from helpers import complete_holders, wait_until

import tensorhub
from tensorhub import PeerConfig, VersionKey
from tensorhub.ops.demo import checksum
from tensorhub.processes import LineProcess, free_ports

SIZE = 48 << 20
CHUNK = 1 << 20
CORRUPTING_WORKER = Path(__file__).with_name("corrupting_worker.py")


def worker(name: str, role: str, port: int, seed: str, expect: int = 3,
           corrupt: int = 0) -> LineProcess:
    """A demo worker; with ``corrupt``, one whose first ``corrupt`` chunks served are
    corrupt (tests/corrupting_worker.py)."""
    start = ([sys.executable, str(CORRUPTING_WORKER), str(corrupt)] if corrupt
             else [sys.executable, "-m", "tensorhub.ops.demo", "worker"])
    argv = [*start, "--name", name, "--role", role,
            "--listen", f"127.0.0.1:{port}", "--size", str(SIZE), "--expect", str(expect),
            "--chunk", str(CHUNK), "--transports", "tcp"]
    return LineProcess(name, argv + (["--join", seed] if seed else []))


@asynccontextmanager
async def two_holders_and_reader(procs: list[LineProcess], corrupt: int = 0,
                                 planning: bool = True) -> AsyncIterator[
        tuple[tensorhub.Peer, dict[str, LineProcess], str]]:
    """A publisher and a holder (whose first ``corrupt`` chunks served are corrupt)
    processes, by name, and a reader in this process that sees both hold version 1
    (without ``planning`` it reads from the holder first: a copy before the publisher)."""
    ports = free_ports(3)
    seed = f"127.0.0.1:{ports[0]}"
    procs += [worker("pub", "trainer", ports[0], ""),
              worker("holder", "rollout", ports[1], seed, corrupt=corrupt)]
    cfg = PeerConfig.local("reader", listen=f"127.0.0.1:{ports[2]}", join=(seed,),
                           fetch_window=1, transports=("tcp",), stall_timeout=5.0,
                           planning=planning)
    async with tensorhub.open_peer(cfg) as reader:
        for p in procs:
            await trio.to_thread.run_sync(p.expect, "ready", 60)
        procs[0].send("publish 1")
        published = await trio.to_thread.run_sync(procs[0].expect, "published", 60)
        procs[1].send("fetch 1")
        await trio.to_thread.run_sync(procs[1].expect, "fetched", 60)
        await wait_until(lambda: len(complete_holders(reader, VersionKey("demo-llm", 1))) >= 2,
                         what="the reader seeing both hold version 1")
        yield reader, {p.name: p for p in procs}, published["checksum"]


async def fetch_and_act_midway(reader: tensorhub.Peer, act: Callable[[str], object]
                               ) -> tuple[tensorhub.Fetched, str]:
    """Fetch version 1; once 8 chunks are in, call ``act`` with the source the fetch is
    reading from (its one stream's; which holder the plan picks is not the test's to
    fix).  The result, and that source."""
    key = VersionKey("demo-llm", 1)
    result: list[tensorhub.Fetched] = []

    async def run() -> None:
        result.append(await reader.fetch("demo-llm", 1))

    async with trio.open_nursery() as n:
        n.start_soon(run)
        sources: list[str] = []

        def midway() -> bool:  # (between two streams, a replan's, there are none)
            local = reader.store.get(key)
            if local is None or local.num_verified < 8:
                return False
            sources[:] = [s for job in reader.reader.progress() for s in job.streaming_from]
            return len(sources) == 1

        await wait_until(midway, 30, every=0, what="8 chunks in, from one stream")
        act(sources[0])  # the one stream's source (fetch_window=1), mid-read
    return result[0], sources[0]


async def test_sigkill_holder_mid_fetch_completes_from_the_other(procs: list[LineProcess]) -> None:
    async with two_holders_and_reader(procs) as (reader, by_name, expected):
        got, src = await fetch_and_act_midway(
            reader, lambda name: os.kill(by_name[name].p.pid, signal.SIGKILL))
    other = ({"pub", "holder"} - {src}).pop()
    r = got.report
    assert r.verified and checksum(got.tensors) == expected
    assert r.bytes_by_source[src] >= 8 * CHUNK and r.bytes_by_source[other] > 0
    n_chunks = -(-r.bytes // CHUNK)
    assert r.chunks == n_chunks
    assert r.chunks_received == n_chunks  # no chunk was received twice
    assert src in r.dropped_sources


async def test_sigstop_holder_mid_fetch_completes_from_the_other(procs: list[LineProcess]) -> None:
    async with two_holders_and_reader(procs) as (reader, by_name, expected):
        got, src = await fetch_and_act_midway(
            reader, lambda name: os.kill(by_name[name].p.pid, signal.SIGSTOP))
    other = ({"pub", "holder"} - {src}).pop()
    r = got.report
    assert r.verified and checksum(got.tensors) == expected
    assert "stalled" in r.dropped_sources.get(src, ""), r.to_dict()
    assert r.bytes_by_source[other] > 0
    assert r.chunks_received == r.chunks


async def test_corrupt_chunk_is_detected_attributed_and_refetched(procs: list[LineProcess]) -> None:
    # No plan: which holder a coordinator's plan names is not this test's to fix, and
    # the corrupting one must be read from.
    async with two_holders_and_reader(procs, corrupt=1, planning=False) as (
            reader, _, expected):
        got = await reader.fetch("demo-llm", 1)
    r = got.report
    assert r.verified and checksum(got.tensors) == expected
    assert r.integrity_failures == {"holder": 1}
    assert "digest" in r.dropped_sources["holder"]
    assert reader.statistics().integrity_failures == {"holder": 1}
    assert r.chunks_received == r.chunks + 1  # the bad one, received once more elsewhere


async def test_a_sole_holder_paused_past_its_stall_limit_is_asked_again(
        procs: list[LineProcess]) -> None:
    """The only holder stops for longer than a read's stall limit, then goes on: the
    fetch asks it again with more time instead of dropping it and failing."""
    ports = free_ports(2)
    procs.append(worker("pub", "trainer", ports[0], "", expect=2))
    cfg = PeerConfig.local("reader", listen=f"127.0.0.1:{ports[1]}",
                           join=(f"127.0.0.1:{ports[0]}",), fetch_window=1,
                           transports=("tcp",), stall_timeout=12.0)
    async with tensorhub.open_peer(cfg) as reader:
        await trio.to_thread.run_sync(procs[0].expect, "ready", 60)
        procs[0].send("publish 1")
        published = await trio.to_thread.run_sync(procs[0].expect, "published", 60)
        with trio.fail_after(10):
            while reader.control.latest("demo-llm") != 1:
                await reader.wait_changed()
        pid = procs[0].p.pid

        async def pause() -> None:
            os.kill(pid, signal.SIGSTOP)
            try:
                await trio.sleep(2.5)  # the fault: longer than the 1 s floor of a limit
            finally:
                os.kill(pid, signal.SIGCONT)

        got, _ = await fetch_and_act_midway(
            reader, lambda _: trio.lowlevel.spawn_system_task(pause))
    r = got.report
    assert r.verified and checksum(got.tensors) == published["checksum"]
    assert r.stall_retries.get("pub", 0) >= 1, r.to_dict()
    assert r.bytes_by_source == {"pub": r.bytes}
