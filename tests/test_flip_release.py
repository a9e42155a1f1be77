"""The staged flip never waits for readers.

``commit()`` swaps and returns while reads of the previous version are still in flight;
that version is hidden from new readers at the swap, drains in the background, and
``Committed`` says when it is released.  Real peers, real readers: same-host readers
holding a version lease (``ShmConnection``), and TCP readers that asked for a chunk and
stopped taking it, so the holder's send, and its lease, stay in flight until the test
closes them.  ``lease_timeout`` is long, so only the readers end their reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from helpers import open_mesh
from test_group_shell import sealed
from test_lease_revocation import connect_raw

import tensorhub
from tensorhub import LocalProtocolError, PeerClosed, PeerConfig, Rollout, VersionKey
from tensorhub.protocol.dataplane import ChunkRequest
from tensorhub.transport.base import NotServing
from tensorhub.transport.frames import send_frame
from tensorhub.transport.samehost.reader import ShmConnection, shm_available
from tensorhub.transport.tcp import TcpConnection

SHM, WHY_NOT = shm_available()
CHUNK = 16 << 20  # far more than loopback buffers hold: a stalled TCP send stays stalled
CONFIG: dict[str, Any] = {"chunk_size": CHUNK, "lease_timeout": 120.0, "planning": False}
READERS = 4
V1 = VersionKey("m", 1)


def weights(version: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(version)
    return {"w": rng.standard_normal(2 * CHUNK // 4).astype(np.float32),  # two chunks
            "b": rng.standard_normal(10).astype(np.float32)}


@asynccontextmanager
async def pinned_readers(holder: tensorhub.Peer, transport: str
                         ) -> AsyncIterator[list[Any]]:
    """``READERS`` readers, each with a read of ``m@1`` in flight at ``holder`` until the
    block ends (the readers then go away, ending their reads)."""
    local = holder.store.get(V1)
    assert local is not None
    async with AsyncExitStack() as stack:
        readers: list[Any] = []
        for _ in range(READERS):
            if transport == "shm":  # a version lease, kept until released or closed
                conn = await ShmConnection.connect(holder.info.data, "p1", 5)
                stack.push_async_callback(conn.aclose)
                buf = np.empty(CHUNK, np.uint8)
                await conn.read_chunk(V1, 0, [memoryview(buf)])
                readers.append(conn)
            else:  # a chunk asked for and never taken: the holder's send is stuck
                sock = await connect_raw(holder.info.data, rcvbuf=4096)
                stack.callback(sock.close)
                await send_frame(sock, ChunkRequest(1, "m", 1, 0))
                await sock.recv(1)  # the reply has started
                readers.append(sock)
        assert local.inflight == READERS
        yield readers


@pytest.mark.parametrize("transport", [
    pytest.param("shm", marks=pytest.mark.skipif(not SHM, reason=WHY_NOT)), "tcp"])
async def test_commit_returns_while_readers_of_the_old_version_read(transport: str) -> None:
    async with open_mesh(3, **CONFIG) as (pub, roll, other):
        t1, t2, t3 = weights(1), weights(2), weights(3)
        await pub.publish("m", 1, t1)
        await sealed([roll], 1)
        r = Rollout(roll, "m")
        first = await (await r.stage()).commit()
        old = roll.store.get(V1)
        assert old is not None
        await pub.publish("m", 2, t2)
        await sealed([roll], 2)
        staged = await r.stage(2)
        third: list[Any] = []

        async def stage_into_v1_buffers() -> None:
            third.append(await r.stage(3, into=first.tensors))

        async with trio.open_nursery() as nursery, pinned_readers(roll, transport):
            with trio.fail_after(30):  # a commit that waited for the readers would hang
                done = await staged.commit()
            # the switch is done while every read of v1 is still in flight
            assert r.live is not None and r.live.version == 2 and done.previous == 1
            assert old.inflight == READERS and not done.release_done
            assert done.drain_seconds is None and done.release_error is None
            # new readers are refused v1 here, and the mesh is told we dropped it
            assert old.hidden
            conn = await TcpConnection.connect(roll.info.data, "p1", 5)
            with pytest.raises(NotServing, match="not held"):
                await conn.read_chunk(V1, 0, [memoryview(np.empty(CHUNK, np.uint8))])
            await conn.aclose()
            with trio.fail_after(10):
                while "p1" in {p.name for p, _ in other.control.holders(V1)}:
                    await other.wait_changed()
            # a stage into v1's buffers waits for the drain: they are not touched
            await pub.publish("m", 3, t3)
            await sealed([roll], 3)
            nursery.start_soon(stage_into_v1_buffers)
            await trio.testing.wait_all_tasks_blocked()
            assert done._release is not None  # the stage waits for the release to end
            assert done._release.finished.statistics().tasks_waiting == 1
            assert not third and roll.store.get(VersionKey("m", 3)) is None
            np.testing.assert_array_equal(first.tensors["w"], t1["w"])
            assert old.inflight == READERS and not done.release_done
        # the readers have gone (their reads ended): v1 drained and was released
        released = await done.wait_released()
        assert done.release_done and done.release_error is None
        assert done.drain_seconds is not None and done.drain_seconds > 0
        assert released is not None and released["w"] is first.tensors["w"]
        assert roll.store.get(V1) is None
        # and the stage, which waited for that, landed v3 in v1's buffers
        assert third[0].fetched.tensors["w"] is first.tensors["w"]
        np.testing.assert_array_equal(first.tensors["w"], t3["w"])


async def test_closing_the_peer_ends_a_pending_release_with_peer_closed() -> None:
    async with open_mesh(2, **CONFIG) as (pub, _other), AsyncExitStack() as outlive_roll:
        await pub.publish("m", 1, weights(1))
        seed = pub.info.control.removeprefix("tcp://")
        waited: list[Any] = []
        async with trio.open_nursery() as nursery:
            async with tensorhub.open_peer(PeerConfig.local("p2", join=(seed,),
                                                            **CONFIG)) as roll:
                await sealed([roll], 1)
                r = Rollout(roll, "m")
                await (await r.stage()).commit()
                await pub.publish("m", 2, weights(2))
                await sealed([roll], 2)
                staged = await r.stage(2)
                await outlive_roll.enter_async_context(pinned_readers(roll, "tcp"))
                done = await staged.commit()

                async def wait_released() -> None:
                    waited.append(await done.wait_released())

                nursery.start_soon(wait_released)
                await trio.testing.wait_all_tasks_blocked()
                assert not done.release_done and not waited
            # the peer closed with the readers still reading: the release ended, the
            # waiter was answered, and nothing reached the peer
            assert done.release_done and isinstance(done.release_error, PeerClosed)
            assert roll.statistics().internal_errors == 0
        assert waited == [None]
        assert await done.wait_released() is None


async def test_a_retained_previous_version_is_kept_in_host_memory_then_released() -> None:
    """Pinned at the rollout, which becomes its last holder: the release copies it to
    host memory first (retention), keeps serving that, and frees the live buffers."""
    async with open_mesh(3, **CONFIG) as (pub, roll, other):
        t1 = weights(1)
        await pub.publish("m", 1, t1)
        await sealed([roll], 1)
        r = Rollout(roll, "m")
        first = await (await r.stage()).commit()
        roll.pin("m", 1)
        await pub.publish("m", 2, weights(2))
        await sealed([roll], 2)
        await pub.unpublish("m", 1)  # no longer retained at pub: roll holds the last copy
        done = await (await r.stage(2)).commit()
        released = await done.wait_released()
        assert done.release_error is None and released is not None
        assert released["w"] is first.tensors["w"]
        kept = roll.store.get(V1)
        assert kept is not None and not kept.hidden and V1 in roll.retention.offloaded
        assert not np.shares_memory(kept.arrays[kept.manifest.table.names.index("w")],
                                    first.tensors["w"])
        got = await other.fetch("m", 1, sources=["p1"])
        np.testing.assert_array_equal(got.tensors["w"], t1["w"])


async def test_staging_into_the_live_buffers_is_refused() -> None:
    async with open_mesh(2, **CONFIG) as (pub, roll):
        await pub.publish("m", 1, weights(1))
        await pub.publish("m", 2, weights(2))
        await sealed([roll], 2)
        r = Rollout(roll, "m")
        live = await (await r.stage(1)).commit()
        with pytest.raises(LocalProtocolError, match="live version 1"):
            await r.stage(2, into={"w": live.tensors["w"][16:], "b": np.empty(10, "f4")})
