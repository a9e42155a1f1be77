"""Edges of the API: closing and cancelling leak nothing and say PeerClosed, into=
arrays that share memory are refused, a fetch of what is held says it returns the live
arrays, and BlockingPeer takes every argument Peer takes."""

from __future__ import annotations

import gc
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio
from helpers import open_mesh, wait_until, wait_until_sync
from test_mesh import weights

import tensorhub
from tensorhub import BlockingPeer, LocalProtocolError, PeerClosed, PeerConfig
from tensorhub.read import destination
from tensorhub.transport.samehost import memory_files


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_blocking_peer_takes_every_argument_peer_takes() -> None:
    shared = [n for n, _ in inspect.getmembers(BlockingPeer, inspect.isfunction)
              if not n.startswith("_") and hasattr(tensorhub.Peer, n)]
    assert {"publish", "fetch", "unpublish", "latest", "wait_for_version"} <= set(shared)
    for name in shared:
        mine = inspect.signature(getattr(BlockingPeer, name)).parameters
        theirs = inspect.signature(getattr(tensorhub.Peer, name)).parameters
        assert [(p.name, p.kind, p.default) for p in mine.values()] == \
            [(p.name, p.kind, p.default) for p in theirs.values()], name


async def test_into_arrays_that_share_memory_are_refused_before_any_byte_moves() -> None:
    async with open_mesh(2) as (pub, reader):
        w = weights(1, mib=1)
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        same = np.zeros_like(w["embed"])
        buf = np.zeros(w["embed"].nbytes + w["layer.0.w"].nbytes // 2, np.uint8)
        overlapping = {"embed": buf[:w["embed"].nbytes].view(np.float32).reshape(
                           w["embed"].shape),
                       "layer.0.w": buf[-w["layer.0.w"].nbytes:].view(np.float32).reshape(
                           w["layer.0.w"].shape),
                       "layer.0.bias": np.zeros_like(w["layer.0.bias"])}
        for into in ({"embed": same, "layer.0.w": same,
                      "layer.0.bias": np.zeros_like(w["layer.0.bias"])}, overlapping):
            with pytest.raises(LocalProtocolError, match="share memory"):
                await reader.fetch("m", 1, into=into)
        assert pub.statistics().bytes_served == 0 and reader.store.versions == {}
        got = await reader.fetch("m", 1, into={k: np.zeros_like(v) for k, v in w.items()})
        assert got.report.verified and not got.report.served_arrays


def test_the_same_into_arrays_are_not_checked_again_until_one_of_them_is_gone() -> None:
    names = ["a", "b", "c"]
    arrays = [np.zeros(4, np.float32) for _ in names]
    assert destination.disjoint(names, arrays) is arrays
    last = destination._last
    assert last is not None and last.valid and last.ids == [id(a) for a in arrays]
    buf = np.zeros(8, np.float32)  # other arrays, overlapping: still refused
    with pytest.raises(LocalProtocolError, match="share memory"):
        destination.disjoint(names, [arrays[0], buf[:4], buf[2:6]])
    assert destination._last is last  # a refusal is not remembered
    destination.disjoint(names, arrays)
    assert destination._last is last  # the same arrays: the record is reused
    del arrays[2]
    gc.collect()
    assert not last.valid  # one is gone: its id may be reused, so check again
    arrays.append(np.zeros(4, np.float32))
    destination.disjoint(names, arrays)
    assert destination._last is not last and destination._last.valid  # checked anew


async def test_a_fetch_of_a_version_held_here_says_it_returns_the_served_arrays() -> None:
    async with tensorhub.open_peer(PeerConfig.local("solo")) as peer:
        w = {"x": np.arange(10, dtype=np.float32)}
        await peer.publish("m", 1, w)
        got = await peer.fetch("m", 1)
        assert got.report.served_arrays and got.tensors["x"] is w["x"]
        assert got.report.to_dict()["served_arrays"] is True


def test_closing_a_blocking_peer_mid_fetch_raises_peer_closed_in_the_caller() -> None:
    with BlockingPeer(PeerConfig.local("pub")) as pub:
        seed = pub.peer.info.control.removeprefix("tcp://")
        pub.publish("m", 1, {"w": np.ones(1 << 16, np.float32)})
        reader = BlockingPeer(PeerConfig.local("reader", join=(seed,), stall_timeout=60.0))
        try:
            assert reader.wait_for_version("m", None) == 1
            threads = threading.active_count()
            outcome: list[BaseException | None] = []

            def fetch() -> None:
                try:  # a named source that never appears: the fetch waits for it
                    reader.fetch("m", 1, sources=["nobody"])
                    outcome.append(None)
                except BaseException as exc:
                    outcome.append(exc)

            caller = threading.Thread(target=fetch)
            caller.start()

            wait_until_sync(lambda: len(reader.peer.operations) > 0, 30,
                            what="the fetch under way")
        finally:
            reader.close()
        caller.join(30)
        assert not caller.is_alive()
        assert len(outcome) == 1 and type(outcome[0]) is PeerClosed, outcome
        assert threading.active_count() <= threads
        with pytest.raises(PeerClosed):
            reader.fetch("m", 1)


async def test_a_closing_peer_ends_a_waiting_call_with_peer_closed() -> None:
    got: list[BaseException] = []
    async with trio.open_nursery() as nursery, \
            tensorhub.open_peer(PeerConfig.local("p")) as peer:
            async def wait() -> None:
                try:
                    await peer.wait_for_version("m", None)
                except PeerClosed as exc:
                    got.append(exc)

            nursery.start_soon(wait)
            await wait_until(lambda: len(peer.operations), 5, every=0,
                             what="the wait under way")
    assert len(got) == 1
    with pytest.raises(PeerClosed):
        await peer.fetch("m", 1)


def collecting(cond: Callable[[], object]) -> Callable[[], bool]:
    """``cond``, with a garbage collection after each look at it that finds it false."""
    def check() -> bool:
        if cond():
            return True
        gc.collect()
        return False
    return check


async def _cancel_after_first_chunk(reader: tensorhub.Peer, into: dict[str, Any] | None
                                    ) -> None:
    key = tensorhub.VersionKey("m", 1)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            def a_chunk_verified() -> bool:
                local = reader.store.get(key)
                return local is not None and local.num_verified > 0

            async def watch() -> None:
                await wait_until(a_chunk_verified, 30, every=0, what="a chunk verified")
                scope.cancel()

            nursery.start_soon(watch)
            await reader.fetch("m", 1, into=into)
    assert scope.cancelled_caught


@pytest.mark.parametrize("own_arrays", [False, True])
async def test_a_cancelled_fetch_leaks_nothing_and_the_next_fetch_succeeds(
        own_arrays: bool) -> None:
    async with open_mesh(2, planning=False, fetch_window=1) as (pub, reader):
        w = weights(1, mib=16)
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        into = None
        if own_arrays:  # the caller's shared memory, reused after the cancel
            into = {k: tensorhub.shared_empty(v.shape, v.dtype) for k, v in w.items()}
        gc.collect()
        memory_files.drop_spare()
        fds, regions = open_fds(), memory_files.registered()
        await _cancel_after_first_chunk(reader, into)
        # The cancelled fetch lets go of its partial version, memory file, connections
        # and their threads (a thread mid-recv ends once its socket is shut).  A memory
        # file the fetch made is kept as the spare for the next fetch buffer: closed here.
        spares: list[bool] = []

        def let_go() -> bool:
            if not (reader.store.versions or memory_files.registered() != regions
                    or not open_fds() <= fds):
                return True
            gc.collect()
            spares.append(memory_files.drop_spare())
            return False

        await wait_until(let_go, what="the cancelled fetch letting go of everything")
        spares.append(memory_files.drop_spare())  # (its descriptor number may be an old one's)
        assert any(spares) == (into is None)
        got = await reader.fetch("m", 1, into=into)
        assert got.report.verified
        for k, v in w.items():
            np.testing.assert_array_equal(got.tensors[k], v)
            if into is not None:
                assert got.tensors[k] is into[k]


def test_shared_empty_is_thread_safe() -> None:
    gc.collect()
    before, fds = memory_files.registered(), open_fds()
    errors: list[BaseException] = []
    kept: list[np.ndarray[Any, Any]] = []

    def churn(seed: int) -> None:
        try:
            for i in range(400):
                a = tensorhub.shared_empty(4096 * (1 + (i + seed) % 3), np.uint8)
                a[:] = seed
                if i % 50 == 0:
                    kept.append(a)
                del a
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert memory_files.registered() == before + len(kept)
    assert all(memory_files.pieces_of([memoryview(a)]) is not None for a in kept)
    kept.clear()
    gc.collect()
    assert memory_files.registered() == before and open_fds() <= fds


def _inode(arr: np.ndarray[Any, Any]) -> int:
    pieces = memory_files.pieces_of([memoryview(arr)])  # type: ignore[arg-type]
    assert pieces is not None
    return int(pieces[0][1])


async def test_a_fetch_without_into_lands_in_the_memory_of_one_let_go() -> None:
    """Fetch, drop, fetch the next version: the second fetch lands in the first's memory
    file (mapped again, its pages already there), and its tensors are the new ones."""
    async with open_mesh(2, planning=False) as (pub, reader):
        for v in (1, 2):
            await pub.publish("m", v, weights(v, mib=2))
        with trio.fail_after(10):
            await reader.wait_for_version("m", 1)
        memory_files.drop_spare()
        first = await reader.fetch("m", 1)
        inode = _inode(first.tensors["embed"])
        size = first.report.bytes
        await reader.unpublish("m", 1)
        del first
        await wait_until(collecting(lambda: memory_files.spare_bytes() == size),
                         what="the store letting go of it too")
        second = await reader.fetch("m", 2)
        assert _inode(second.tensors["embed"]) == inode
        for k, v in weights(2, mib=2).items():
            np.testing.assert_array_equal(second.tensors[k], v)
        await reader.unpublish("m", 2)
        del second
        await wait_until(collecting(memory_files.drop_spare),
                         what="nothing holding it: it is the spare")
