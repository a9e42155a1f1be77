"""Same-host reads hold no descriptor once the connection that made them is closed,
however many of the holder's memory files they mapped, and whether they finished or were
cancelled; a holder's memory files are closed once its arrays are gone, and a cancelled
fetch's once the fetch is.

Counted in ``/proc/self/fd``: holder and reader run in this process (a reader may map its
own memory files), so every descriptor either side keeps shows up here.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio
import trio.testing
from helpers import open_mesh, wait_until

from tensorhub.read.store import Store
from tensorhub.testing.conformance import publish, running
from tensorhub.transport.samehost import memory_files
from tensorhub.transport.samehost.reader import ShmConnection, shm_available
from tensorhub.transport.server import TcpServer

SHM, WHY_NOT = shm_available()
pytestmark = [pytest.mark.skipif(not (SHM and hasattr(os, "memfd_create")), reason=WHY_NOT),
              pytest.mark.usefixtures("shared_arrays")]
SEED = random.randrange(2**32)
print(f"tests/test_shm_descriptors.py: seed {SEED}")
FILES = 600
"""Holder arrays, each its own memory file: more than a reader may keep descriptors for."""


def descriptors() -> tuple[int, int]:
    """(descriptors of this process, those of them that are memory files)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return len(names), sum(name.startswith("/memfd:") for name in names)


@asynccontextmanager
async def serving() -> AsyncIterator[tuple[Store, str]]:
    store = Store()
    server = TcpServer(store, lambda peer, n: None, lambda what: None)
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    async with running(server):
        yield store, address


@pytest.fixture
def no_cycle_collection() -> Iterator[None]:
    """What is released here is released by reference counting alone: when its owner
    goes, not whenever the cyclic collector happens to run."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()



async def cancel_after(scope: trio.CancelScope, checkpoints: int) -> None:
    """Cancel ``scope`` after ``checkpoints`` trio checkpoints: a cancellation at every
    point of the operation under test, one point per run."""
    for _ in range(checkpoints):
        await trio.lowlevel.checkpoint()
    scope.cancel()

async def test_reads_from_many_memory_files_keep_no_descriptor_after_close(
        no_cycle_collection: None) -> None:
    before, cached = descriptors(), memory_files.sweep_mappings()  # other tests' files
    async with serving() as (store, address):
        rng = random.Random(SEED)
        pub = publish(store, rng, [rng.randrange(1, 5000) for _ in range(FILES)],
                      chunk_size=256 << 10)
        held = descriptors()
        assert held[1] >= before[1] + FILES  # the holder's files (the check sees them)
        m = pub.local.manifest
        conn = await ShmConnection.connect(address, "holder", 5)
        for c in range(m.num_chunks):
            buf = np.zeros(len(pub.chunk(c)), dtype=np.uint8)
            assert await conn.read_chunk(m.key, c, [memoryview(buf)]) == len(buf)  # type: ignore[arg-type]
            assert np.array_equal(buf, pub.chunk(c))
        assert conn.transport == "shm-memfd"
        await conn.aclose()
        # The holder keeps its files open, so the reader keeps them mapped (cached)...
        assert memory_files.cached_mappings() >= cached + FILES
        await trio.testing.wait_all_tasks_blocked()  # the holder has ended its side too
        # ...but not one descriptor for them, nor for the connection.
        assert descriptors() == held
    del store, pub, conn
    # The server stopped and its store is gone, so are the arrays and their files; the
    # reader unmaps them.
    assert memory_files.sweep_mappings() == cached
    assert descriptors() == before


async def test_cancelled_reads_keep_no_descriptor_after_close() -> None:
    """Reads cancelled at every point of their exchange, one connection each."""
    async with serving() as (store, address):
        rng = random.Random(SEED + 1)
        pub = publish(store, rng, [rng.randrange(1, 200_000) for _ in range(200)],
                      chunk_size=4 << 20)
        m = pub.local.manifest
        held = descriptors()
        buf = np.zeros(len(pub.chunk(0)), dtype=np.uint8)
        cancelled = 0
        for steps in range(1000):
            conn = await ShmConnection.connect(address, "holder", 5)
            done = False
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_after, scope, steps)
                    await conn.read_chunk(m.key, 0, [memoryview(buf)])  # type: ignore[arg-type]
                    done = True
            await conn.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert descriptors() == held, f"cancelled after {steps} checkpoints"
            if done:  # the read now completes before the cancellation comes
                break
            cancelled += 1
        assert done and cancelled > 0


async def test_a_cancelled_fetch_leaves_neither_its_version_nor_its_memory(
        no_cycle_collection: None) -> None:
    """Cancelled at every point of a fetch, planning included: the version is dropped, its
    fetch-allocated memory file closed once the connection's reader thread is out (by
    reference counting alone), and the next fetch starts afresh."""
    async with open_mesh(2, chunk_size=64 << 10) as (publisher, reader):
        rng = np.random.default_rng(SEED)
        weights = {f"t{i}": rng.standard_normal(20_000).astype(np.float32) for i in range(4)}
        await publisher.publish("m", 1, weights)
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        gc.collect()
        memory_files.drop_spare()  # another test's
        before = descriptors()
        cancelled = 0
        for steps in range(5000):
            got = None
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_after, scope, steps)
                    got = await reader.fetch("m", 1)
                    nursery.cancel_scope.cancel()
            if got is not None:
                break
            cancelled += 1
            assert not reader.store.versions, f"cancelled after {steps} checkpoints"
            # once the connection's reader thread is out; the dropped buffer's file may
            # stay as the spare, for the next fetch
            await wait_until(lambda: descriptors()[1] - bool(memory_files.spare_bytes())
                             == before[1], every=0.001, what="the fetch's memory file closed")
        assert got is not None and cancelled > 0
        for name, array in weights.items():
            np.testing.assert_array_equal(got.tensors[name], array)
