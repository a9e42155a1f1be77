"""The trio shell of model-parallel groups and the staged flip, over in-process meshes of
real peers: a TP=2 consuming group reading a version published by a TP=4 group, switching
together or failing together, and a single rollout staging v+1 while v keeps serving."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio
from corrupting import corrupt_served
from helpers import open_mesh, wait_until

import tensorhub
from tensorhub import (
    Group,
    GroupSwitchError,
    LocalProtocolError,
    PeerConfig,
    Rollout,
    VersionKey,
    open_group,
)
from tensorhub.protocol import codec
from tensorhub.protocol.groups import GroupConfig, GroupEnvelope, Ready, Round
from tensorhub.protocol.sharding import Sharding

pytestmark = pytest.mark.usefixtures("busy_neighbour")  # rounds on a loaded host
SPLIT = {"w": 0}
CONFIG = GroupConfig(timeout=8.0, retry=0.2, join_grace=1.0)
Full = dict[str, np.ndarray[Any, Any]]


def full(version: int) -> Full:
    rng = np.random.default_rng(version)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32),
            "b": rng.standard_normal(10).astype(np.float32)}


async def publish_tp4(pubs: Sequence[tensorhub.Peer], version: int) -> Full:
    """Four ranks publish ``version``: rank r holds rows [16r, 16r+16) of ``w``, all of ``b``."""
    t = full(version)
    for r, p in enumerate(pubs):
        await p.publish("m", version, {"w": t["w"][16 * r:16 * (r + 1)].copy(),
                                       "b": t["b"].copy()},
                        layout=Sharding(r, 4, split=SPLIT))
    return t


async def sealed(peers: Sequence[tensorhub.Peer], version: int) -> None:
    with trio.fail_after(5):
        for p in peers:
            while (p.control.latest("m") or 0) < version:
                await p.wait_changed()


@asynccontextmanager
async def tp2(peers: Sequence[tensorhub.Peer], spare: Full | None = None
              ) -> AsyncIterator[list[Group]]:
    """A two-rank group on ``peers``, fetching TP=2 slices; rank 0 stages into ``spare``."""
    names = [p.info.name for p in peers]
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(open_group(
            p, "tp", names, k, model="m", layout=Sharding(k, 2, split=SPLIT), config=CONFIG,
            spare=spare if k == 0 else None)) for k, p in enumerate(peers)]


async def fetch_all(groups: Sequence[Group]) -> list[tensorhub.Fetched | GroupSwitchError]:
    """Every rank calls ``fetch_latest`` at once; what each got."""
    got: list[tensorhub.Fetched | GroupSwitchError | None] = [None] * len(groups)

    async def one(k: int) -> None:
        try:
            got[k] = await groups[k].fetch_latest(timeout=10)
        except GroupSwitchError as exc:
            got[k] = exc

    async with trio.open_nursery() as nursery:
        for k in range(len(groups)):
            nursery.start_soon(one, k)
    return [g for g in got if g is not None]


def check_slices(groups: Sequence[Group], t: Full, version: int) -> None:
    for k, g in enumerate(groups):
        assert g.live is not None and g.live.version == version
        np.testing.assert_array_equal(g.live.tensors["w"], t["w"][32 * k:32 * (k + 1)])
        np.testing.assert_array_equal(g.live.tensors["b"], t["b"])


async def test_tp2_group_switches_to_slices_of_a_tp4_publish() -> None:
    async with open_mesh(6, stall_timeout=1.0) as peers, tp2(peers[4:]) as groups:
        t = await publish_tp4(peers[:4], 1)
        await sealed(peers[4:5], 1)  # the leader's view decides; rank 1's may lag
        got = await fetch_all(groups)
        assert [type(g) for g in got] == [tensorhub.Fetched] * 2
        assert [g.version for g in got if isinstance(g, tensorhub.Fetched)] == [1, 1]
        check_slices(groups, t, 1)
        assert [g.statistics().switches for g in groups] == [1, 1]


async def test_three_versions_in_a_row_and_double_buffering() -> None:
    async with open_mesh(6, stall_timeout=1.0) as peers:
        spare = {"w": np.zeros((32, 32), np.float32), "b": np.zeros(10, np.float32)}
        async with tp2(peers[4:], spare) as groups:
            layout_id = Sharding(0, 2, split=SPLIT).layout_id

            async def released(v: int) -> None:  # unpublished, drained
                await wait_until(lambda: not any(
                    p.store.get(VersionKey("m", v, k, layout_id))
                    for k, p in enumerate(peers[4:])), 5, what=f"version {v} released")

            for v in (1, 2, 3):
                t = await publish_tp4(peers[:4], v)
                await sealed(peers[4:5], v)
                got = await fetch_all(groups)
                assert {g.version for g in got if isinstance(g, tensorhub.Fetched)} == {v}
                check_slices(groups, t, v)
                # rank 0 alternates between the spare and one set it allocated once
                assert (groups[0].live is not None
                        and (groups[0].live.tensors["w"] is spare["w"]) == (v != 2))
                if v > 1:  # the previous version is released (unpublished, drained)
                    await released(v - 1)
            assert all(g.statistics().release_errors == () for g in groups)


async def test_a_rank_that_cannot_stage_aborts_every_rank_with_one_error() -> None:
    # A short ban: the holder that sends bad bytes heals, and is read again after it.
    async with open_mesh(6, stall_timeout=1.0, ban_seconds=0.5) as peers, \
            tp2(peers[4:]) as groups:
        t1 = await publish_tp4(peers[:4], 1)
        await sealed(peers[4:5], 1)
        await fetch_all(groups)
        t2 = await publish_tp4(peers[:4], 2)
        await sealed(peers[4:], 2)
        # publish rank 3 now sends bad bytes: rank 1 (rows 32..64) cannot verify them
        corrupt_served(peers[3], 1 << 20)
        got = await fetch_all(groups)
        assert all(isinstance(g, GroupSwitchError) for g in got)
        assert len({str(g) for g in got}) == 1
        assert "rank 1 (p5) could not stage version 2" in str(got[0])
        check_slices(groups, t1, 1)  # all keep the old version
        # healed: the next round switches both; rank 0 reuses what it staged
        corrupt_served(peers[3], 0)
        fetches = peers[4].statistics().fetches
        got = await fetch_all(groups)
        assert {g.version for g in got if isinstance(g, tensorhub.Fetched)} == {2}
        check_slices(groups, t2, 2)
        assert peers[4].statistics().fetches == fetches
        assert [g.statistics().aborts for g in groups] == [1, 1]


async def test_a_rank_whose_peer_is_not_in_the_mesh_aborts_the_round() -> None:
    async with open_mesh(1) as (a,):
        await a.publish("m", 1, full(1))
        async with open_group(a, "g", ["p0", "ghost"], 0, model="m", config=CONFIG) as g:
            with pytest.raises(GroupSwitchError, match=r"ranks 1 \(ghost\)"):
                await g.fetch_latest(timeout=10)
            assert g.live is None


async def test_the_first_round_waits_for_a_rank_still_joining_the_mesh() -> None:
    """The leader asks to switch before rank 1's peer has joined: the round waits for it
    (join_grace) instead of aborting, and both ranks switch."""
    config = GroupConfig(timeout=8.0, retry=0.2, join_grace=20.0)
    async with open_mesh(5, stall_timeout=1.0) as peers:
        t = await publish_tp4(peers[:4], 1)
        await sealed(peers[4:5], 1)
        leader = peers[4]
        seed = peers[0].info.control.removeprefix("tcp://")
        split = {"w": 0}
        got: list[tensorhub.Fetched] = []
        async with open_group(leader, "tp", ["p4", "late"], 0, model="m",
                              layout=Sharding(0, 2, split=split), config=config) as g0, \
                trio.open_nursery() as nursery:
            async def lead() -> None:
                got.append(await g0.fetch_latest(timeout=30))

            nursery.start_soon(lead)
            await trio.sleep(1.0)  # several membership checks see "late" missing
            assert not got and g0.statistics().aborts == 0
            async with tensorhub.open_peer(PeerConfig.local(
                    "late", join=(seed,), chunk_size=1 << 20)) as late, \
                    open_group(late, "tp", ["p4", "late"], 1, model="m",
                               layout=Sharding(1, 2, split=split), config=config) as g1:
                got.append(await g1.fetch_latest(timeout=30))
                await wait_until(lambda: len(got) >= 2, 30, what="both ranks switched")
                check_slices([g0, g1], t, 1)
                await late.unpublish("m", 1, layout=Sharding(1, 2, split=split))
        assert [f.version for f in got] == [1, 1]


async def test_staged_flip_keeps_serving_v_until_commit_then_releases_it() -> None:
    async with open_mesh(3, planning=False) as (pub, roll, other):
        t1, t2, t3 = full(1), full(2), full(3)
        await pub.publish("m", 1, t1)
        await sealed([roll], 1)
        r = Rollout(roll, "m")
        first = await (await r.stage()).commit()
        assert first.previous is None and first.release_done
        assert await first.wait_released() is None and first.drain_seconds is None
        assert r.live is not None and r.live.version == 1
        await pub.publish("m", 2, t2)
        await sealed([roll], 2)
        staged = await r.stage(2)
        assert r.live.version == 1 and staged.version == 2
        # while v2 is staged, v1's live buffers still serve other peers
        got = await other.fetch("m", 1, sources=["p1"])
        np.testing.assert_array_equal(got.tensors["w"], t1["w"])
        assert set(got.report.bytes_by_source) == {"p1"}
        second = await staged.commit()
        assert r.live.version == 2 and second.version == 2 and second.previous == 1
        assert second.switch_seconds >= 0
        released = await second.wait_released()
        assert second.release_done and second.release_error is None
        assert second.drain_seconds is not None and second.drain_seconds >= 0
        assert released is not None and released["w"] is first.tensors["w"]
        assert roll.store.get(VersionKey("m", 1)) is None  # released: unpublished, drained
        with pytest.raises(LocalProtocolError, match="already committed"):
            await staged.commit()
        # double buffering: v3 lands in the buffers v1 had
        await pub.publish("m", 3, t3)
        await sealed([roll], 3)
        third = await r.stage(3, into=released)
        assert third.fetched.tensors["w"] is first.tensors["w"]
        np.testing.assert_array_equal(third.fetched.tensors["w"], t3["w"])
        assert await third.discard()
        assert r.live.version == 2 and roll.store.get(VersionKey("m", 3)) is None
        trivial = await r.stage(2)  # the live version stages without a fetch
        assert trivial.fetched is r.live and not await trivial.discard()


async def test_malformed_envelopes_are_counted_and_ignored() -> None:
    async with open_mesh(2) as (a, b), AsyncExitStack() as stack:
        groups = [await stack.enter_async_context(open_group(
            p, "g", ["p0", "p1"], k, model="m", config=CONFIG)) for k, p in enumerate((a, b))]
        forged = Ready(0, Round(0, 0), 1)  # p1 speaking as rank 0
        for body in (b"\xc1", codec.encode(GroupEnvelope("g", "p1", b""), 1 << 20),
                     codec.encode(forged, 1 << 20)):
            assert b.send_to("p0", GroupEnvelope("g", "p1", body))
        assert b.send_to("p0", GroupEnvelope("no-such-group", "p1", b""))
        await wait_until(lambda: groups[0].statistics().malformed_dropped >= 3
                         and a.statistics().malformed_dropped >= 1, 5,
                         what="the malformed envelopes counted")
        # the group still works
        await a.publish("m", 1, full(1))
        await sealed([a], 1)
        got = await fetch_all(groups)
        assert {g.version for g in got if isinstance(g, tensorhub.Fetched)} == {1}


async def test_open_group_refuses_misuse() -> None:
    async with open_mesh(1) as (a,):
        with pytest.raises(LocalProtocolError, match="is not peer"):
            async with open_group(a, "g", ["p0", "p1"], 1, model="m"):
                pass
        async with open_group(a, "g", ["p0"], 0, model="m"):
            with pytest.raises(LocalProtocolError, match="already open"):
                async with open_group(a, "g", ["p0"], 0, model="m"):
                    pass
        with a.group_inbox("g", lambda _envelope: None):  # "g" was let go of every time
            pass


async def test_a_round_that_aborts_at_once_is_still_a_checkpoint() -> None:
    """A rank seen live and gone since aborts the round before anything is awaited;
    fetch_latest still yields, so an engine retrying in a loop lets its peer run."""
    async with tensorhub.open_peer(PeerConfig.local("p0")) as a, trio.open_nursery() as n:
        seed = (a.info.control.removeprefix("tcp://"),)
        await a.publish("m", 1, full(1))
        leave = trio.Event()

        async def rank1(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            async with tensorhub.open_peer(PeerConfig.local("p1", join=seed)):
                task_status.started()
                await leave.wait()

        await n.start(rank1)
        async with open_group(a, "g", ["p0", "p1"], 0, model="m", config=CONFIG) as g:
            with trio.fail_after(10):
                while not a.control.membership.is_live("p1"):
                    await a.wait_changed()
            leave.set()
            with trio.fail_after(10):  # p1 left the mesh
                while a.control.membership.is_live("p1"):
                    await a.wait_changed()
            for _ in range(3):
                with trio.testing.assert_checkpoints(), \
                        pytest.raises(GroupSwitchError, match=r"ranks 1 \(p1\) are not live"):
                    await g.fetch_latest(timeout=10)
            assert g.live is None
