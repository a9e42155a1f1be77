"""Single flight: fetches of one version in one peer share one transfer, whatever their
mix of ``into=``, layouts, threads, cancellations, unpublishes and closing.

Each example of the property test runs a random program against a fresh mesh of real
peers (ZeroMQ control plane, TCP data plane on loopback): a publisher whose uplink is
slowed to one chunk at a time (so that a transfer lasts long enough to be interleaved
with), a reader that runs the program, and a witness that checks the reader from
outside.  A program is a few callers, each starting after a random delay: fetches
(``into=None`` or arrays of their own; the publish layout or a resharded half; from a
trio task, some cancelled after a random time, or from a thread through
``trio.from_thread``, as :class:`tensorhub.BlockingPeer` calls), unpublishes, and the
reader closing.  Once every caller has ended, the outcome is checked against a model:

* every fetch returned exactly the version's bytes (its layout's slice), in the caller's
  ``into=`` or in the very arrays the reader serves; or it raised only what its caller
  caused (cancelled, ``PeerClosed`` once the reader closed, ``LocalProtocolError`` for
  an unpublish of a version in flight or not held);
* without cancellations, closing or unpublishing, each version moved at most once
  however many callers fetched it; the others ``joined`` its flight or read it as held;
* the store holds a version exactly when the model says (the last of the fetches and
  unpublishes of it that succeeded, in the order they returned), and nothing half-done
  is left: no partial or hidden version, no expected manifest, no lease, no flight;
* nothing is left of any fetch once the peers closed: no memory file, no descriptor;
* holdings and gossip agree with the store: the reader's statistics, the publisher's
  and the witness's view of the reader (it is a complete holder exactly when it holds
  the version, and after it closed it is none), a fetch from the reader by name; once
  every holder unpublished, no peer counts the version readable (``latest`` keeps
  naming it: it never goes back).
"""

from __future__ import annotations

import gc
import os
import threading
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import trio
from helpers import wait_until, wait_until_sync
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from slow_serving import slow_served

import tensorhub
from tensorhub import LocalProtocolError, PeerClosed, PeerConfig, Sharding, VersionKey
from tensorhub.transport.samehost import memory_files

MODEL = "m"
CHUNK = 64 << 10
ROWS, COLS = 64, 1024  # float32: 256 KiB a tensor, two tensors: 8 chunks
HALF = Sharding(0, 2, split={"w": 0, "b": 0})
EXPLORED: Counter[str] = Counter()
"""Outcomes over the whole run: the last test checks that every kind happened."""


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((ROWS, COLS), np.float32),
            "b": rng.standard_normal((ROWS, COLS), np.float32)}


def expected(layout: Sharding | None) -> dict[str, np.ndarray]:
    w = weights()
    return w if layout is None else {k: v[:ROWS // 2] for k, v in w.items()}


def key_of(layout: Sharding | None) -> VersionKey:
    return VersionKey(MODEL, 1) if layout is None else layout.key(MODEL, 1)


def config(name: str, **kw: Any) -> PeerConfig:
    return PeerConfig.local(name, transports=("tcp",), chunk_size=CHUNK, retain_latest=0,
                            **kw)


@asynccontextmanager
async def publisher_and_witness(delay: float
                                ) -> AsyncIterator[tuple[tensorhub.Peer, tensorhub.Peer]]:
    """The publisher (``delay`` seconds a chunk) with the version published, and a
    witness that joined it."""
    async with tensorhub.open_peer(config("pub", listen="127.0.0.1:0")) as pub, \
            tensorhub.open_peer(config("witness", join=(seed(pub),))) as witness:
        slow_served(pub, delay)
        await pub.publish(MODEL, 1, weights())
        await wait_until(lambda: sees_latest(pub, witness), what="v1 latest everywhere")
        yield pub, witness


async def sees_latest(*peers: tensorhub.Peer) -> bool:
    return all([await p.latest(MODEL) == 1 for p in peers])


def seed(peer: tensorhub.Peer) -> str:
    return peer.info.control.removeprefix("tcp://")


async def run_reader(pub: tensorhub.Peer, close: trio.Event, *,
                     task_status: trio.TaskStatus[tensorhub.Peer]) -> None:
    """The reader, open until ``close`` is set (closing ends the calls in flight)."""
    async with tensorhub.open_peer(config("reader", join=(seed(pub),))) as reader:
        await wait_until(lambda: sees_latest(reader), what="v1 latest at the reader")
        task_status.started(reader)
        await close.wait()


@dataclass
class Caller:
    """One caller of a program: what it does, when it starts, if it is cancelled."""

    what: str  # "fetch", "unpublish", "close"
    delay: float
    into: bool = False
    layout: Sharding | None = None
    thread: bool = False
    cancel_after: float | None = None


@st.composite
def callers(draw: st.DrawFn) -> Caller:
    what = draw(st.sampled_from(["fetch"] * 10 + ["unpublish"] * 3 + ["close"]))
    thread = what == "fetch" and draw(st.booleans())
    return Caller(
        what, draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.12, 0.25, 0.6])),
        into=draw(st.booleans()), layout=draw(st.sampled_from([None, None, HALF])),
        thread=thread,  # a thread's call cannot be cancelled (nor can BlockingPeer's)
        cancel_after=None if what != "fetch" or thread else draw(
            st.sampled_from([None, None, 0.0, 0.03, 0.1])))


@dataclass
class Outcome:
    caller: Caller
    order: int = -1
    """When it ended, among the program's callers."""
    status: str = "ok"  # "ok", "cancelled", "error"
    result: tensorhub.Fetched | None = None
    error: Exception | None = None
    into: dict[str, np.ndarray] | None = None
    served: bool | None = None
    """For a fetch without into=, returning in the task that called it: whether its
    arrays are the very arrays the reader serves the version from."""
    notes: list[str] = field(default_factory=list)


async def run_program(reader: tensorhub.Peer, program: list[Caller], close: trio.Event
                      ) -> list[Outcome]:
    outcomes: list[Outcome] = []
    token = trio.lowlevel.current_trio_token()

    async def one(c: Caller) -> None:
        await trio.sleep(c.delay)
        out = Outcome(c)
        if c.into:
            out.into = {k: np.zeros_like(v) for k, v in expected(c.layout).items()}

        def in_loop() -> Any:
            return reader.fetch(MODEL, 1, out.into, layout=c.layout)

        try:
            with trio.CancelScope() as scope:
                if c.cancel_after is not None:
                    scope.deadline = trio.current_time() + c.cancel_after
                if c.what == "close":
                    close.set()
                elif c.what == "unpublish":
                    await reader.unpublish(MODEL, 1, layout=c.layout)
                elif c.thread:  # as BlockingPeer does: from a thread, into this loop
                    out.result = await trio.to_thread.run_sync(
                        lambda: trio.from_thread.run(in_loop, trio_token=token))
                else:
                    out.result = await in_loop()
                    local = reader.store.get(key_of(c.layout))  # no checkpoint since
                    out.served = local is not None and all(
                        out.result.tensors[n] is a
                        for n, a in zip(local.manifest.table.names, local.arrays,
                                        strict=True))
            if scope.cancelled_caught:
                out.status = "cancelled"
        except Exception as exc:
            out.status, out.error = "error", exc
        out.order = len(outcomes)
        outcomes.append(out)

    async with trio.open_nursery() as nursery:
        for c in program:
            nursery.start_soon(one, c)
    return outcomes


def check_returns(outcomes: list[Outcome], closed: bool) -> None:
    """Every caller got the exact bytes, or only the error it caused."""
    for out in outcomes:
        c = out.caller
        if out.status == "cancelled":
            assert c.cancel_after is not None, out
            EXPLORED["fetch cancelled"] += 1
            continue
        if out.status == "error":
            if isinstance(out.error, PeerClosed):
                assert closed, out
                EXPLORED[f"{c.what} ended by close"] += 1
                continue
            assert c.what == "unpublish" and isinstance(out.error, LocalProtocolError), \
                repr(out.error)
            why = "in flight" if "being fetched" in str(out.error) else "not held"
            assert why == "in flight" or "not held here" in str(out.error), out.error
            EXPLORED[f"unpublish refused: {why}"] += 1
            continue
        if c.what != "fetch":
            EXPLORED[f"{c.what} done"] += 1
            continue
        got = out.result
        assert got is not None and got.version == 1 and got.report.verified
        want = expected(c.layout)
        assert set(got.tensors) == set(want)
        for name, arr in want.items():
            np.testing.assert_array_equal(got.tensors[name], arr)
        if out.into is not None:
            assert all(got.tensors[n] is out.into[n] for n in want), "not the caller's into="
        elif out.served is not None:
            assert out.served, "into=None must return the arrays the reader serves"
        how = "joined" if got.report.joined else "moved" if got.report.bytes else "held"
        EXPLORED[f"fetch {how}"] += 1
        EXPLORED[f"fetch {how}, {'into' if c.into else 'served'}"
                 f"{', thread' if c.thread else ''}{', half' if c.layout else ''}"] += 1


def listed(p: tensorhub.Peer, key: VersionKey) -> bool:
    return any(i.name == "reader" and h.complete for i, h in p.control.holders(key))


async def check_state(pub: tensorhub.Peer, reader: tensorhub.Peer, witness: tensorhub.Peer,
                      outcomes: list[Outcome], closed: bool) -> None:
    """The store, the holdings, the gossip and latest agree with the model."""
    stats = reader.statistics()
    assert stats.internal_errors == 0, stats.internal_error_texts
    assert stats.fetches_in_flight == 0
    assert not reader.store.expected, "a manifest is still expected"
    for key, local in reader.store.versions.items():
        assert local.complete and not local.hidden, f"{key} left half-done"
        assert local.inflight == 0, f"{key} still leased"
    for layout in (None, HALF):
        key = key_of(layout)
        mine = [o for o in outcomes if key_of(o.caller.layout) == key]
        done = sorted((o for o in mine if o.status == "ok" and o.caller.what != "close"),
                      key=lambda o: o.order)
        held = bool(done) and done[-1].caller.what == "fetch"
        if not closed:
            assert (reader.store.get(key) is not None) == held, (key, held, done)
            assert (str(key) in stats.holdings) == held, (key, stats.holdings)
        calm = not closed and all(o.caller.cancel_after is None for o in mine) and not any(
            o.caller.what == "unpublish" and o.status == "ok" for o in mine)
        moved = [o for o in mine if o.result is not None and not o.result.report.joined
                 and o.result.report.bytes]
        if calm:
            assert len(moved) <= 1, f"{key} moved {len(moved)} times by {len(mine)} calls"
        if closed:  # the reader left: nobody lists it any more
            await wait_until(lambda k=key: not listed(pub, k) and not listed(witness, k),
                             what=f"{key}: the closed reader unlisted")
            continue
        await wait_until(lambda k=key, h=held: listed(pub, k) == h and listed(witness, k) == h,
                         what=f"{key}: the mesh's view of the reader to be {held}")
        if held and key.whole:
            got = await witness.fetch(MODEL, 1, sources=["reader"])
            np.testing.assert_array_equal(got.tensors["w"], weights()["w"])
            await witness.unpublish(MODEL, 1)
            EXPLORED["witness read from the reader"] += 1
        if held:
            await reader.unpublish(MODEL, 1, layout=layout)
            assert reader.store.get(key) is None
    await pub.unpublish(MODEL, 1)  # the last holder: nothing is retained (retain_latest=0)
    await gone_everywhere(pub, witness, *(() if closed else (reader,)))


async def gone_everywhere(*peers: tensorhub.Peer) -> None:
    """No peer counts version 1 readable any more; ``latest`` still names it."""
    await wait_until(lambda: not any(p.control.readable(MODEL) for p in peers),
                     what="the version nobody holds unreadable everywhere")
    for p in peers:
        assert await p.latest(MODEL) == 1, p.info.name


async def scenario(program: list[Caller]) -> None:
    with trio.fail_after(60):  # a hang is a failure too
        await run_scenario(program)


async def run_scenario(program: list[Caller]) -> None:
    async with publisher_and_witness(0.02) as (pub, witness), trio.open_nursery() as n:
        close = trio.Event()
        reader = await n.start(run_reader, pub, close)
        outcomes = await run_program(reader, program, close)
        closed = close.is_set()
        if closed:  # let it finish leaving
            await wait_until(lambda: reader.operations.closed, what="the reader closed")
        check_returns(outcomes, closed)
        await check_state(pub, reader, witness, outcomes, closed)
        close.set()


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(callers(), min_size=2, max_size=5))
# besides the random ones, one program for each kind of outcome the last test wants
@example([Caller("fetch", 0.0), Caller("fetch", 0.0, into=True),
          Caller("unpublish", 0.01)])  # moved, joined, refused in flight
@example([Caller("fetch", 0.0), Caller("unpublish", 0.6), Caller("fetch", 0.8, into=True),
          Caller("fetch", 1.2)])  # moved, unpublished, moved again, held
@example([Caller("fetch", 0.0, cancel_after=0.03), Caller("fetch", 0.0, thread=True),
          Caller("unpublish", 0.0)])  # cancelled, joined; not held yet
@example([Caller("fetch", 0.0, layout=HALF), Caller("close", 0.05)])  # ended by close
def test_single_flight_holds_under_random_interleavings(program: list[Caller]) -> None:
    fds, shared = leftovers()
    trio.run(scenario, program)
    # every fetch that ended, whichever way, let go of its memory files and descriptors
    # (the peers are closed: their sockets too; the kept spare buffer is dropped here)
    wait_until_sync(lambda: leftovers()[1] == shared and leftovers()[0] <= fds,
                    what="memory files and descriptors let go")


def leftovers() -> tuple[set[str], int]:
    """The descriptors open in this process, and its shared arrays alive."""
    gc.collect()
    memory_files.drop_spare()
    return set(os.listdir("/proc/self/fd")), memory_files.registered()


def test_the_property_test_explored_every_kind() -> None:
    """Runs after the property test (file order): every kind of outcome happened."""
    print("single flight, explored:", dict(sorted(EXPLORED.items())))
    for kind in ("fetch joined", "fetch moved", "fetch held", "fetch cancelled",
                 "fetch ended by close", "unpublish done", "unpublish refused: in flight",
                 "unpublish refused: not held", "witness read from the reader"):
        assert EXPLORED[kind] > 0, (kind, EXPLORED)


# -- the race of the issue, and BlockingPeer threads --------------------------------------

async def test_a_cancelled_fetch_leaves_the_other_callers_transfer_alone() -> None:
    """Two tasks fetch a 16 MiB version from a slow holder at once and the first is
    cancelled after 0.15 s: the second gets the version from the one transfer (16 MiB
    moved, not 32), the reader holds and serves it and unpublishes it, and once the
    publisher unpublishes too no peer counts the version readable."""
    big = {"w": np.arange(4 << 20, dtype=np.float32)}  # 16 MiB: 256 chunks of 64 KiB
    async with tensorhub.open_peer(config("pub", listen="127.0.0.1:0")) as pub, \
            tensorhub.open_peer(config("reader", join=(seed(pub),))) as reader, \
            tensorhub.open_peer(config("witness", join=(seed(pub),))) as witness:
        slow_served(pub, 0.002)
        await pub.publish(MODEL, 1, big)
        await wait_until(lambda: sees_latest(reader), what="v1 latest at the reader")
        got: list[tensorhub.Fetched] = []

        async def second() -> None:
            got.append(await reader.fetch(MODEL, 1))

        async with trio.open_nursery() as n:
            with trio.move_on_after(0.15) as first:
                n.start_soon(second)
                await reader.fetch(MODEL, 1)
        assert first.cancelled_caught
        np.testing.assert_array_equal(got[0].tensors["w"], big["w"])
        stats = reader.statistics()
        assert stats.bytes_fetched == big["w"].nbytes and stats.fetches == 1
        assert stats.holdings == {str(VersionKey(MODEL, 1)): "complete"}
        await wait_until(lambda: listed(pub, VersionKey(MODEL, 1)), what="the reader listed")
        from_reader = await witness.fetch(MODEL, 1, sources=["reader"])
        np.testing.assert_array_equal(from_reader.tensors["w"], big["w"])
        await witness.unpublish(MODEL, 1)
        await reader.unpublish(MODEL, 1)
        await pub.unpublish(MODEL, 1)
        await gone_everywhere(pub, reader, witness)


def test_blocking_peer_threads_share_one_transfer() -> None:
    """Four threads of one BlockingPeer fetch the same version at once, two into arrays
    of their own: one transfer, exact bytes everywhere."""
    async def serve(ready: threading.Event, stop: threading.Event,
                    address: list[str]) -> None:
        async with publisher_and_witness(0.01) as (pub, _):
            address.append(seed(pub))
            ready.set()
            await trio.to_thread.run_sync(stop.wait)

    ready, stop, address = threading.Event(), threading.Event(), []
    mesh = threading.Thread(target=trio.run, args=(serve, ready, stop, address))
    mesh.start()
    try:
        assert ready.wait(30)
        with tensorhub.BlockingPeer(config("reader", join=(address[0],))) as bp:
            wait_until_sync(lambda: bp.latest(MODEL) == 1, what="v1 latest at the reader")
            results: list[Any] = [None] * 4
            intos = [None, None, *({k: np.zeros_like(v) for k, v in weights().items()}
                                   for _ in range(2))]

            def call(i: int) -> None:
                results[i] = bp.fetch(MODEL, 1, intos[i])

            threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            for got, into in zip(results, intos, strict=True):
                for name, arr in weights().items():
                    np.testing.assert_array_equal(got.tensors[name], arr)
                    if into is not None:
                        assert got.tensors[name] is into[name]
            stats = bp.statistics()
            assert stats.fetches == 1 and stats.bytes_fetched == 2 * ROWS * COLS * 4
            assert sum(r.report.joined for r in results) >= 1
    finally:
        stop.set()
        mesh.join(30)
