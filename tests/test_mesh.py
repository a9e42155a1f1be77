"""In-process meshes of real peers (real ZeroMQ, real TCP) driven from one trio loop."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import pytest
import trio
from corrupting import corrupt_served
from helpers import complete_holders, open_mesh, wait_until

import tensorhub
from tensorhub import LocalProtocolError, PeerConfig, VersionUnavailable
from tensorhub.protocol.coordination import CoordRequest


def weights(version: int, mib: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    n = mib << 18  # float32 elements per tensor pair
    return {
        "embed": rng.standard_normal((n // 1024, 512)).astype(np.float32),
        "layer.0.w": rng.standard_normal((n // 1024, 512)).astype(np.float32),
        "layer.0.bias": rng.standard_normal(777).astype(np.float16),
    }


async def test_publish_fetch_latest_and_sources() -> None:
    # Planning off: this is about the fetcher's own choice (a holder that is not the
    # publisher first); plans have their own test below.
    async with open_mesh(3, planning=False) as (pub, a, b):
        w = weights(1)
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            assert await a.wait_for_version("m", None) == 1
        assert await a.latest("m") == 1
        got = await a.fetch("m", "latest")
        assert got.version == 1 and got.report.verified
        for k in w:
            np.testing.assert_array_equal(got.tensors[k], w[k])
        assert got.report.bytes_by_source == {"p0": sum(x.nbytes for x in w.values())}
        key = pub.control.refs.local.holdings[0].key
        await wait_until(lambda: len(complete_holders(b, key)) >= 2,
                         what="b knowing a as a complete holder")
        into = {k: np.zeros_like(v) for k, v in w.items()}
        got_b = await b.fetch("m", 1, into=into)
        assert got_b.tensors["embed"] is into["embed"]
        for k in w:
            np.testing.assert_array_equal(into[k], w[k])
        # b preferred the holder that is not the publisher
        assert set(got_b.report.bytes_by_source) == {"p1"}
        assert b.statistics().bytes_fetched_by_source == {"p1": got_b.report.bytes}
        # a counts a chunk once its send call returns
        await wait_until(lambda: a.statistics().bytes_served >= got_b.report.bytes, 5,
                         what="a counting what it served")
        assert a.statistics().bytes_served == got_b.report.bytes


async def test_wait_for_version_sees_each_newer_version() -> None:
    async with open_mesh(2) as (pub, r):
        seen: list[int] = []

        async def waiter() -> None:
            last = None
            while len(seen) < 2:
                last = await r.wait_for_version("m", last)
                seen.append(last)

        async with trio.open_nursery() as n:
            n.start_soon(waiter)
            await pub.publish("m", 3, weights(3, 1))
            await wait_until(lambda: seen, what="the waiter seeing version 3")
            await pub.publish("m", 4, weights(4, 1))
        assert seen == [3, 4]


async def test_bad_input_gets_clear_errors_before_any_byte_moves() -> None:
    async with open_mesh(2) as (pub, r):
        with pytest.raises(VersionUnavailable, match="'nope'"):
            await r.fetch("nope", "latest")
        w = weights(1, 1)
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        with pytest.raises(VersionUnavailable, match="version 2"):
            await r.fetch("m", 2)
        bad_shape = {k: np.zeros_like(v) for k, v in w.items()}
        bad_shape["embed"] = np.zeros((3, 3), np.float32)
        with pytest.raises(LocalProtocolError, match="embed"):
            await r.fetch("m", 1, into=bad_shape)
        bad_dtype = {k: np.zeros_like(v) for k, v in w.items()}
        bad_dtype["layer.0.bias"] = np.zeros(777, np.float32)
        with pytest.raises(LocalProtocolError, match=r"layer\.0\.bias"):
            await r.fetch("m", 1, into=bad_dtype)
        assert r.statistics().bytes_fetched == 0
        with pytest.raises(LocalProtocolError, match="contiguous"):
            await pub.publish("m", 2, {"t": np.zeros((4, 4))[:, ::2]})
        with pytest.raises(LocalProtocolError, match="already held"):
            await pub.publish("m", 1, w)
        # after the failed attempts the good fetch still works
        got = await r.fetch("m", 1)
        np.testing.assert_array_equal(got.tensors["embed"], w["embed"])


async def test_malformed_control_messages_are_dropped_and_counted() -> None:
    import zmq

    async with open_mesh(2) as (pub, r):
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(pub.info.control)
        for junk in (b"", b"\xc1", b"\x93\x01\x02", b"\x91\xcd\xff\xff", b"x" * 100):
            s.send(junk)
        await wait_until(lambda: pub.statistics().malformed_dropped >= 5, 5,
                         what="5 malformed messages counted")
        s.close()
        ctx.term()
        # the peer keeps serving
        await pub.publish("m", 1, weights(1, 1))
        with trio.fail_after(10):
            assert await r.wait_for_version("m", None) == 1
        assert (await r.fetch("m", 1)).report.verified


async def test_unpublish_while_a_reader_is_mid_fetch() -> None:
    async with open_mesh(3, fetch_window=2) as (pub, holder, reader):
        w = weights(7, 32)
        await pub.publish("m", 7, w)
        with trio.fail_after(10):
            await holder.wait_for_version("m", None)
        await holder.fetch("m", 7)
        key = tensorhub.VersionKey("m", 7)
        await wait_until(lambda: len(complete_holders(reader, key)) >= 2,
                         what="the reader seeing both complete holders")
        result: list[tensorhub.Fetched] = []
        drained_at_return: list[int] = []

        async def read() -> None:
            result.append(await reader.fetch("m", 7))

        async with trio.open_nursery() as n:
            n.start_soon(read)
            local = holder.store.get(key)
            assert local is not None
            await wait_until(lambda: local.inflight, every=0,
                             what="a read from the holder under way")
            await holder.unpublish("m", 7)
            drained_at_return.append(local.inflight)
            served_after = holder.statistics().bytes_served
        assert drained_at_return == [0]
        assert holder.store.get(key) is None
        assert holder.statistics().bytes_served == served_after  # nothing served after return
        got = result[0]
        assert got.report.verified
        for k in w:
            np.testing.assert_array_equal(got.tensors[k], w[k])
        assert got.report.bytes_by_source.get("p1", 0) > 0  # it did read from the holder
        assert got.report.bytes_by_source.get("p0", 0) > 0  # and finished from the publisher


async def test_fetch_with_no_holder_left_names_what_is_missing() -> None:
    async with open_mesh(2, stall_timeout=0.5, retain_latest=0) as (pub, r):
        await pub.publish("m", 1, weights(1, 1))
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        await pub.unpublish("m", 1)
        with pytest.raises(VersionUnavailable) as info:
            with trio.fail_after(15):
                await r.fetch("m", 1)
        assert info.value.model == "m" and info.value.version == 1


async def test_coordinator_is_agreed_and_requests_route_to_it() -> None:
    async with open_mesh(4) as peers:
        key_model, version = "m", 11
        names = {p.coordinator(key_model, version) for p in peers}
        assert len(names) == 1  # one view, one coordinator
        (coord,) = names
        for p in peers:
            answer = await p.ask_coordinator(key_model, version)
            assert answer.coordinator == coord
            assert p.info.name in answer.fetchers
        # every registration reached the same coordinator under one epoch
        epochs = {(await p.ask_coordinator(key_model, version)).epoch for p in peers}
        assert len(epochs) == 1
        # a request that reaches a peer that is not the coordinator is forwarded there
        owner = next(p for p in peers if p.info.name == coord)
        asker, relay = [p for p in peers if p is not owner][:2]
        msg = CoordRequest(asker.info.control, asker.info.name, 99, key_model, version, None, 0)
        out = relay.control.receive(trio.current_time(), msg)
        assert [(o.dest, o.msg.hops) for o in out] == [(owner.info.control, 1)]
        assert relay.control.coordination.forwarded == 1
        assert owner.control.coordination.view.state(
            tensorhub.VersionKey(key_model, version)) is not None


async def test_fetchers_follow_the_coordinators_plan() -> None:
    async with open_mesh(4) as (pub, *rollouts):
        w = weights(2, 16)
        await pub.publish("m", 2, w)
        with trio.fail_after(10):
            for r in rollouts:
                await r.wait_for_version("m", None)
        results: dict[str, tensorhub.Fetched] = {}

        async def fetch(r: tensorhub.Peer) -> None:
            results[r.info.name] = await r.fetch("m", 2)

        async with trio.open_nursery() as n:
            for r in rollouts:
                n.start_soon(fetch, r)
        coordinator = pub.coordinator("m", 2)
        for name, got in results.items():
            rep = got.report
            assert rep.verified, name
            assert rep.plan.startswith(coordinator), rep.plan
            # the publisher's reference says the size: the plan was asked for while
            # the manifest was read, not one round trip after it
            assert " (asked while the manifest was read)" in rep.plan, rep.plan
            assert rep.planned_bytes == rep.bytes  # nothing had to leave the plan
            for k in w:
                np.testing.assert_array_equal(got.tensors[k], w[k])
        # the trainer is not the only source: fetchers serve each other (ROS)
        sources = {s for got in results.values() for s in got.report.bytes_by_source}
        assert sources - {"p0"}
        plan = next(p for p in [pub, *rollouts] if p.info.name == coordinator)
        assert plan.control.coordination.planners  # the coordinator holds the plan


async def test_a_fetcher_asking_again_learns_the_newer_plan_over_the_wire() -> None:
    """What a running fetch's re-ask (fetching.follow_plan) gets: the coordinator's
    current plan for it, stamped with the plan's epoch, newer after another joined."""
    async with open_mesh(3) as (pub, r1, r2):
        await pub.publish("m", 1, weights(1, 1))
        with trio.fail_after(10):
            for r in (r1, r2):
                await r.wait_for_version("m", None)
        size, chunks = 1 << 20, 16
        first = await r1.ask_coordinator("m", 1, size=size, chunks=chunks)
        assert [s.peer for s in first.sources] == ["p0"]  # alone: from the trainer
        joined = await r2.ask_coordinator("m", 1, size=size, chunks=chunks)
        again = await r1.ask_coordinator("m", 1, size=size, chunks=chunks)
        assert again.epoch == first.epoch  # the same coordinator and term
        assert again.plan_epoch == joined.plan_epoch > first.plan_epoch  # r2's join
        assert again.sources and {s.peer for s in again.sources} <= {"p0", r2.info.name}


async def test_planning_off_lets_fetchers_choose() -> None:
    async with open_mesh(2, planning=False) as (pub, r):
        await pub.publish("m", 1, weights(1, 1))
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        got = await r.fetch("m", 1)
        assert got.report.plan == "planning off" and got.report.planned_bytes == 0


async def test_same_host_peers_use_shared_memory_and_say_so() -> None:
    from tensorhub.transport.samehost.reader import shm_available

    ok, why = shm_available()
    if not ok:
        pytest.skip(f"same-host transport unavailable here: {why}")
    async with open_mesh(2, labels=(("host", "box1"),)) as (pub, r):
        w = weights(3, 4)
        await pub.publish("m", 3, w)
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        got = await r.fetch("m", 3)
        assert got.report.transport_by_source == {"p0": "shm"}
        assert r.statistics().bytes_by_transport == {"shm": got.report.bytes}
        assert r.statistics().shm == "available"
        # the holder is this user's process: chunks checked against the fast digests
        assert got.report.local_digest_chunks == got.report.chunks > 0
        for k in w:
            np.testing.assert_array_equal(got.tensors[k], w[k])


async def test_a_same_host_holder_that_serves_bad_bytes_fails_the_fast_digest() -> None:
    from tensorhub.transport.samehost.reader import shm_available

    ok, why = shm_available()
    if not ok:
        pytest.skip(f"same-host transport unavailable here: {why}")
    async with open_mesh(2, labels=(("host", "box1"),), planning=False) as (pub, r):
        w = weights(3, mib=1)
        await pub.publish("m", 3, w)
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        assert r.statistics().shm == "available"
        corrupt_served(pub, 1)  # one flipped byte in one chunk, over shared memory
        with pytest.raises(VersionUnavailable, match="failed its digest"):
            await r.fetch("m", 3)
        assert r.statistics().integrity_failures == {"p0": 1}
        assert set(r.statistics().bytes_by_transport) <= {"shm", "shm-memfd"}


async def publish_shared(pub: tensorhub.Peer, reader: tensorhub.Peer,
                         w: dict[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
    """Publish copies of ``w`` in shared arrays (memory files) as ``m@4``, once
    ``reader`` knows of it; the shared arrays."""
    shared = {k: tensorhub.shared_empty(v.shape, v.dtype) for k, v in w.items()}
    for k, v in w.items():
        shared[k][...] = v
    await pub.publish("m", 4, shared)
    with trio.fail_after(10):
        await reader.wait_for_version("m", None)
    return shared


async def test_same_host_reads_of_shared_arrays_take_several_chunks_at_a_time() -> None:
    """A publisher's arrays in memory files: the reader gets a lease on the whole
    version and copies neighbouring chunks in one call each."""
    from tensorhub.transport.samehost.reader import shm_available

    ok, why = shm_available()
    if not ok:
        pytest.skip(f"same-host transport unavailable here: {why}")
    async with open_mesh(2, labels=(("host", "box1"),)) as (pub, r):
        w = weights(4, 32)
        await publish_shared(pub, r, w)
        got = await r.fetch("m", 4)
        assert got.report.transport_by_source == {"p0": "shm-memfd"}
        chunks = -(-sum(v.nbytes for v in w.values()) // (1 << 20))  # 1 MiB chunks
        assert got.report.chunks == got.report.chunks_received == chunks
        assert got.report.reads < got.report.chunks / 2
        # checked against the fast digests, as the copy read the holder's bytes
        assert got.report.local_digest_chunks == chunks
        for k in w:
            np.testing.assert_array_equal(got.tensors[k], w[k])


async def test_a_shared_array_written_after_publish_fails_the_check_its_copy_ran() -> None:
    """The publisher's user writes into a published array (a bug the fast digests are
    there to catch): the same-host reader, which checks the holder's bytes as its copy
    reads them, finds the chunk bad and ends with a clear error."""
    from tensorhub.transport.samehost.reader import shm_available

    ok, why = shm_available()
    if not ok:
        pytest.skip(f"same-host transport unavailable here: {why}")
    async with open_mesh(2, labels=(("host", "box1"),), planning=False) as (pub, r):
        shared = await publish_shared(pub, r, weights(4, 32))
        name = sorted(shared)[1]
        flat = shared[name].reshape(-1).view(np.uint8)
        flat[len(flat) // 2] ^= 0xFF
        with pytest.raises(VersionUnavailable, match="failed its digest"):
            await r.fetch("m", 4)
        assert r.statistics().integrity_failures == {"p0": 1}
        assert set(r.statistics().bytes_by_transport) <= {"shm-memfd"}


async def test_different_hosts_use_tcp() -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(tensorhub.open_peer(
            PeerConfig.local("a", labels=(("host", "box1"),))))
        b = await stack.enter_async_context(tensorhub.open_peer(PeerConfig.local(
            "b", labels=(("host", "box2"),), join=(a.info.control.removeprefix("tcp://"),))))
        await a.publish("m", 1, weights(1, 1))
        with trio.fail_after(10):
            await b.wait_for_version("m", None)
        got = await b.fetch("m", 1)
        assert got.report.transport_by_source == {"a": "tcp"}


async def test_last_holder_of_the_latest_version_offloads_it_before_unpublishing(
        caplog: pytest.LogCaptureFixture) -> None:
    async with open_mesh(2) as (pub, r):
        w = weights(5, 2)
        expected = {k: v.copy() for k, v in w.items()}
        await pub.publish("m", 5, w)
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        with caplog.at_level(logging.INFO, logger="tensorhub.peer"):
            await pub.unpublish("m", 5)  # the only copy of the latest version
        # the operator is told why the memory stays in use
        assert [m for m in caplog.messages if "keeps a host copy" in m] == [
            f"peer {pub.info.name}: unpublish of m@5 keeps a host copy "
            f"({sum(v.nbytes for v in w.values())} bytes) until it is no longer retained: "
            "no other complete holder is known"]
        for v in w.values():
            v[...] = 0  # the trainer reuses its buffers at once
        got = await r.fetch("m", 5)  # served from the publisher's host copy
        for k in w:
            np.testing.assert_array_equal(got.tensors[k], expected[k])
        assert pub.statistics().holdings == {"m@5": "complete"}
        # a newer version makes 5 unretained: the host copy goes away everywhere
        await pub.publish("m", 6, weights(6, 1))
        await wait_until(lambda: "m@5" not in pub.statistics().holdings,
                         what="the host copy of m@5 gone")
        with trio.fail_after(10):
            assert await r.wait_for_version("m", 5) == 6


async def test_retention_without_offload_refuses_and_keeps_serving() -> None:
    async with open_mesh(2, retention_offload=False) as (pub, r):
        w = weights(1, 1)
        await pub.publish("m", 1, w)
        with pytest.raises(tensorhub.RetentionError, match="last complete copy"):
            await pub.unpublish("m", 1)
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        got = await r.fetch("m", 1)  # nothing was lost
        np.testing.assert_array_equal(got.tensors["embed"], w["embed"])
        await wait_until(lambda: complete_holders(pub, tensorhub.VersionKey("m", 1)) - {"p0"}
                         == {"p1"}, what="the publisher seeing p1 hold m@1")
        await pub.unpublish("m", 1)  # now r holds it too: no retention needed
        assert pub.statistics().holdings == {}


async def _both_hold(a: tensorhub.Peer, b: tensorhub.Peer, key: tensorhub.VersionKey) -> None:
    await wait_until(lambda: all(complete_holders(x, key) >= {"p0", "p1"} for x in (a, b)),
                     what=f"p0 and p1 each seeing both hold {key}")


async def test_two_last_holders_unpublishing_at_once_keep_a_copy() -> None:
    """Each still sees the other in its reference table; asked directly, each says it is
    leaving, so both offload rather than both drop."""
    async with open_mesh(3) as (pub, r, late):
        w = weights(1, 1)
        expected = {k: v.copy() for k, v in w.items()}
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        await r.fetch("m", 1)
        await _both_hold(pub, r, tensorhub.VersionKey("m", 1))
        async with trio.open_nursery() as n:
            n.start_soon(pub.unpublish, "m", 1)
            n.start_soon(r.unpublish, "m", 1)
        kept = [p.info.name for p in (pub, r) if p.statistics().holdings == {"m@1": "complete"}]
        assert kept, "both holders dropped the last copies of the latest version"
        for v in w.values():
            v[...] = 0
        got = await late.fetch("m", 1)
        for k in w:
            np.testing.assert_array_equal(got.tensors[k], expected[k])


async def test_a_holder_that_confirmed_keeping_offloads_when_it_leaves_later() -> None:
    async with open_mesh(2) as (pub, r):
        await pub.publish("m", 1, weights(1, 1))
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        await r.fetch("m", 1)
        await _both_hold(pub, r, tensorhub.VersionKey("m", 1))
        await pub.unpublish("m", 1)  # r confirms it keeps it: pub drops
        assert pub.statistics().holdings == {}
        await r.unpublish("m", 1)  # r still sees pub in its table; pub says it left
        assert r.statistics().holdings == {"m@1": "complete"}
        assert r.statistics().malformed_dropped == pub.statistics().malformed_dropped == 0


async def test_pinned_version_stays_readable_and_latest_never_goes_back() -> None:
    async with open_mesh(2, retain_latest=0) as (pub, r):
        await pub.publish("m", 1, weights(1, 1))
        pub.pin("m", 1)
        await pub.unpublish("m", 1)
        assert pub.statistics().holdings == {"m@1": "complete"}  # kept: pinned
        with trio.fail_after(10):
            assert await r.wait_for_version("m", None) == 1
        pub.unpin("m", 1)
        await wait_until(lambda: not r.control.readable("m"),
                         what="the host copy gone everywhere")
        assert await r.latest("m") == 1  # monotonic, though nobody holds it now
        with pytest.raises(VersionUnavailable):
            await r.fetch("m", "latest")


async def test_a_fetch_that_fails_part_way_raises_one_plain_error() -> None:
    """Every chunk from the only holder is corrupt: the fetch ends with a plain
    VersionUnavailable naming what is missing (not an exception group), whole or
    resharded."""
    async with open_mesh(2, planning=False, stall_timeout=0.5) as (pub, reader):
        w = weights(3, mib=1)
        await pub.publish("m", 3, w)
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        corrupt_served(pub, 10**6)
        with pytest.raises(VersionUnavailable, match="no live holder") as info:
            await reader.fetch("m", 3)
        assert not isinstance(info.value, BaseExceptionGroup)
        # The holder that sent bad bytes is banned now: later fetches, resharded or
        # not, do not read from it again, and say so.
        failures = reader.statistics().integrity_failures["p0"]  # reads in flight: >= 1
        split = tensorhub.Sharding(0, 2, split={"embed": 1})
        with pytest.raises(VersionUnavailable, match="banned") as info:
            await reader.fetch("m", 3, layout=split)
        assert not isinstance(info.value, BaseExceptionGroup)
        stats = reader.statistics()
        assert stats.integrity_failures == {"p0": failures}
        assert "failed its digest" in stats.bans["p0"]
