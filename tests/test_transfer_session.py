"""The fetch's policy as a pure state machine (tensorhub/protocol/transfer.py), driven
with explicit times and events: no sockets, no clock."""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.errors import LocalProtocolError
from tensorhub.manifest.manifest import Manifest, build_manifest
from tensorhub.model import PeerInfo, VersionKey
from tensorhub.protocol.bans import Ban
from tensorhub.protocol.pace import STALL_FLOOR
from tensorhub.protocol.refs import Holding, bitmap_of
from tensorhub.protocol.transfer import (
    FAILURE_KINDS,
    RETRY_BASE,
    FailureKind,
    Stream,
    TransferSession,
    chunk_size_note,
)

KEY = VersionKey("m", 1)
NAMES = ("h0", "h1", "h2", "h3")
STALLED: FailureKind = "stalled"


def manifest(chunks: int, chunk_size: int = 64, tensors: int = 1) -> Manifest:
    per = chunks * chunk_size // tensors
    arrays = [(f"t{i}", np.zeros(per, np.uint8)) for i in range(tensors)]
    return build_manifest(KEY, arrays, chunk_size, "xxh3-128")


def info(name: str) -> PeerInfo:
    return PeerInfo(name, f"tcp://{name}:1", f"{name}:2")


def holding(m: Manifest, chunks: set[int] | None, publisher: str = "trainer") -> Holding:
    """``chunks`` None: complete."""
    if chunks is None:
        bitmap = b""
    elif chunks:
        bitmap = bitmap_of(chunks, m.num_chunks)
    else:
        bitmap = bytes((m.num_chunks + 7) // 8)
    return Holding(KEY.model, KEY.version, m.manifest_id(), publisher, m.num_chunks,
                   bitmap)


class World:
    """Holders with chunk sets, bans, and one session reading from them."""

    def __init__(self, m: Manifest, held: dict[str, set[int] | None], *, timeout: float,
                 window: int = 2, wanted: Sequence[int] | None = None,
                 verified: Collection[int] = (),
                 plan: Sequence[tuple[str, int, int]] = (),
                 upstream: frozenset[str] = frozenset()) -> None:
        self.m = m
        self.held = held
        self.bans: dict[str, Ban] = {}
        marks = [int(c in verified) for c in range(m.num_chunks)]
        self.session = TransferSession(
            now=0.0, me="reader", manifest=m, holders=self.view, banned=self.banned,
            wanted=range(m.num_chunks) if wanted is None else wanted, verified=marks,
            window=window, stall_timeout=timeout, upstream=upstream,
            plan=[(info(n), a, b) for n, a, b in plan])

    def view(self) -> list[tuple[PeerInfo, Holding]]:
        return [(info(n), holding(self.m, c, "h0")) for n, c in self.held.items()]

    def banned(self, now: float, name: str) -> Ban | None:
        ban = self.bans.get(name)
        return ban if ban is not None and now < ban.until else None


# -- scenarios --------------------------------------------------------------------------


def test_a_sole_stalled_source_is_asked_again_with_twice_the_time() -> None:
    w = World(manifest(8), {"h1": None}, timeout=30.0)
    s = w.session
    chunk, peer = s.pick(0.0) or (-1, info("?"))
    assert (chunk, peer.name) == (0, "h1")
    stream = s.open_stream(0.0, chunk, peer)
    run = s.next_run(0.0, stream, 1 << 20)
    s.landed(0.5, stream, run[0], 64)
    limit = s.stall_limit("h1")
    assert s.stream_ended(0.5 + limit, stream, "stalled")  # its connection is closed
    assert s.tally.stall_retries == {"h1": 1} and s.tally.dropped_sources == {}
    assert s.pick(0.5 + limit) == (1, info("h1"))  # asked again at once
    assert s.stall_limit("h1") == 2 * limit
    assert s.pending == list(range(1, 8)) and not s.claimed


def test_a_stalled_source_with_a_replacement_is_benched_and_its_chunks_go_elsewhere() -> None:
    w = World(manifest(8), {"h1": None, "h2": None}, timeout=30.0, window=1)
    s = w.session
    stream = s.open_stream(0.0, 0, info("h1"))
    run = s.next_run(0.0, stream, 1 << 20)
    assert run == list(range(8))
    assert s.stream_ended(40.0 - 31.0, stream, "stalled")
    assert "stalled: no chunk of [0, 1, 2, 3]" in s.tally.dropped_sources["h1"]
    assert s.pick(9.0) == (0, info("h2"))
    until = s.benched["h1"]
    assert s.usable(until, "h1") and not s.usable(until - 1e-6, "h1")
    assert s.wake_at(9.0) == until
    other = s.open_stream(9.0, 0, info("h2"))
    for c in s.next_run(9.0, other, 1 << 20):
        s.landed(9.5, other, c, 64)
    assert s.tally.resourced_chunks == 8 and s.done


def test_planned_chunks_go_to_their_planned_source_and_fall_back_when_it_fails() -> None:
    w = World(manifest(8), {"h1": None, "h2": None, "h3": {0, 1}}, timeout=30.0, window=4,
              plan=[("h3", 0, 4), ("h1", 4, 8)])
    s = w.session
    a = s.open_stream(0.0, 0, info("h3"))
    assert s.next_run(0.0, a, 1 << 20) == [0, 1]  # the whole share that is planned to it
    assert s.pick(0.0) is not None and s.pick(0.0) == (4, info("h1"))  # one stream each
    b = s.open_stream(0.0, 4, info("h1"))
    assert s.next_run(0.0, b, 1 << 20) == [4, 5]
    assert s.pick(0.0) is None  # 2, 3: h3 has its stream; 6, 7: so has h1
    assert not s.failed(0.1, a, 1, "not_yet", "")  # the stream goes on
    s.stream_ended(0.2, a, "transport", "reset")
    assert s.tally.dropped_sources == {"h3": "reset"}
    assert s.benched["h3"] == pytest.approx(0.2 + RETRY_BASE)
    assert s.pick(0.2) == (0, info("h2"))  # its planned source is benched
    assert s.pick(0.2 + RETRY_BASE) == (0, info("h3"))  # back: its chunks are its again
    back = 0.2 + RETRY_BASE
    c = s.open_stream(back, 0, info("h3"))
    assert s.next_run(back, c, 1 << 20) == [0]  # 1: it said it lacks it
    s.view_changed()
    assert s.next_run(back, c, 1 << 20) == [1, 2]  # asked before it advertises them


def test_a_parent_still_receiving_is_asked_first_for_the_chunks_it_holds() -> None:
    """The parent gets [0, 8) and [8, 16) from two sources at once: a child that asked
    in order would wait on [0, 8) while [8, 16) piles up at the parent."""
    w = World(manifest(16), {"h1": {9, 10, 11}, "h0": None}, timeout=30.0, window=1,
              plan=[("h1", 0, 16)])
    s = w.session
    stream = s.open_stream(0.0, 0, info("h1"))
    run = s.next_run(0.0, stream, 5 * 64)
    assert run[0] == 9 and run == [9, 10, 11, 12, 13]  # planned chunks after it pipeline
    w.held["h1"] = set()  # nothing held any more (as far as the view says): lowest first
    s.view_changed()
    assert s.next_run(0.0, stream, 2 * 64) == [0, 1]
    w.held["h1"] = None  # complete: in order
    assert s.next_run(0.0, stream, 2 * 64) == [2, 3]


def test_a_parent_planned_for_several_stripes_is_asked_for_them_in_turn() -> None:
    """Our children read [0, 8) and [8, 16) from us, each child one: fetched in order,
    [8, 16) would start growing here only once [0, 8) had arrived whole."""
    w = World(manifest(16), {"h1": None}, timeout=30.0, window=1,
              plan=[("h1", 0, 8), ("h1", 8, 16)])
    s = w.session
    stream = s.open_stream(0.0, 0, info("h1"))
    runs = [s.next_run(0.0, stream, 3 * 64) for _ in range(5)]
    assert runs == [[0, 1, 2], [8, 9, 10], [3, 4, 5], [11, 12, 13], [6, 7]]
    assert s.next_run(0.0, stream, 8 * 64) == [14, 15]  # never past a stripe's end
    assert s.next_run(0.0, stream, 8 * 64) == []


def test_a_parent_still_receiving_several_stripes_is_asked_where_it_holds_chunks() -> None:
    w = World(manifest(16), {"h1": {9, 10}, "h0": None}, timeout=30.0, window=1,
              plan=[("h1", 0, 8), ("h1", 8, 16)])
    s = w.session
    stream = s.open_stream(0.0, 0, info("h1"))
    assert s.next_run(0.0, stream, 4 * 64) == [9, 10, 11, 12]  # held first, then pipelined
    w.held["h1"] = set()  # holds nothing: the least advanced stripe, from its lowest
    s.view_changed()
    assert s.next_run(0.0, stream, 2 * 64) == [0, 1]
    assert s.next_run(0.0, stream, 2 * 64) == [2, 3]  # 6 of 8 pending against 3 of 8
    assert s.next_run(0.0, stream, 2 * 64) == [4, 5]  # 4 of 8 against 3 of 8
    assert s.next_run(0.0, stream, 2 * 64) == [8]  # 9-12 are claimed already


def test_a_planned_parent_still_receiving_that_stalls_is_asked_again_not_passed_over(
        ) -> None:
    """Its slowness is its own sources': the others that hold the chunk are upstream of
    it, across a DC link or at the trainer.  Once complete, a stall is its own."""
    w = World(manifest(8), {"h1": {0}, "h0": None}, timeout=30.0, window=1,
              plan=[("h1", 0, 8)])
    s = w.session
    stream = s.open_stream(0.0, 0, info("h1"))
    run = s.next_run(0.0, stream, 2 * 64)
    s.landed(0.5, stream, run[0], 64)
    limit = s.stall_limit("h1")
    assert s.stream_ended(0.5 + limit, stream, "stalled")
    assert s.tally.stall_retries == {"h1": 1} and "h1" not in s.benched
    assert s.pick(0.5 + limit) == (1, info("h1"))  # not h0: asked again
    assert s.stall_limit("h1") == 2 * limit
    w.held["h1"] = None  # complete now: a stall is the source's own
    again = s.open_stream(1.0 + limit, 1, info("h1"))
    s.next_run(1.0 + limit, again, 2 * 64)
    s.stream_ended(1.0 + 3 * limit, again, "stalled")
    assert s.benched["h1"] > 1.0 + 3 * limit
    assert s.pick(1.0 + 3 * limit) == (1, info("h0"))


def test_a_newer_plan_moves_pending_chunks_and_ends_streams_it_sources_elsewhere() -> None:
    w = World(manifest(8), {"h1": None, "h2": None}, timeout=30.0, window=2,
              plan=[("h1", 0, 4), ("h2", 4, 8)])
    s = w.session
    a = s.open_stream(0.0, 0, info("h1"))
    assert s.next_run(0.0, a, 1 << 20) == [0, 1, 2, 3]  # the run planned to h1
    b = s.open_stream(0.0, 4, info("h2"))
    assert s.next_run(0.0, b, 1 << 20) == [4, 5]  # half of what is pending: work for a
    s.landed(0.1, a, 0, 64)
    s.landed(0.1, b, 4, 64)
    assert s.replan(0.1, [(info("h3"), 0, 6), (info("h2"), 6, 8)]) == 0  # 6, 7: still h2
    assert s.tally.replans == 1
    # h1's claims are now planned to h3: its stream is to end (the shell closes it);
    # h2 keeps 5, which the new plan does not give it either
    assert s.abandon == {"h1", "h2"}
    assert s.planned[6].name == "h2" and s.planned[1].name == "h3"
    a.stop = True  # as the shell does for each stream to a source in abandon
    assert s.stream_ended(0.1, a)  # no failure: nobody benched, the connection closes
    assert not s.benched and not s.tally.dropped_sources
    assert s.pending == [1, 2, 3, 6, 7] and s.claimed == {5: "h2"}
    assert s.pick(0.1) == (1, info("h3"))  # asked before h3 advertises them
    c = s.open_stream(0.1, 1, info("h3"))
    assert s.next_run(0.1, c, 1 << 20) == [1, 2, 3]
    s.landed(0.2, b, 5, 64)  # a claim that landed before its stream ended counts
    assert s.tally.planned_bytes == 3 * 64  # 0, 4, 5: each from its source when claimed
    assert s.replan(0.2, [(info("h3"), 0, 6)]) == 2  # 6, 7: planned to no one now
    assert s.abandon == frozenset()  # h3 is still the planned source of 1, 2, 3
    assert s.next_run(0.2, b, 1 << 20) == [6]  # unplanned: any holder that has it (one:
    # half of what is pending)


def test_one_stream_per_copy_and_the_publisher_only_for_what_no_copy_serves() -> None:
    # h0 published; h1 holds a whole copy, h2 the first half (still receiving)
    w = World(manifest(16), {"h0": None, "h1": None, "h2": set(range(8))}, timeout=30.0,
              window=4)
    s = w.session
    assert s.pick(0.0) == (0, info("h1"))
    a = s.open_stream(0.0, 0, info("h1"))
    assert s.next_run(0.0, a, 1 << 20) == [0, 1, 2, 3]
    assert s.pick(0.0) == (4, info("h2"))  # h1 has its one stream: chunks land in order
    b = s.open_stream(0.0, 4, info("h2"))
    assert s.next_run(0.0, b, 1 << 20) == [4, 5, 6]  # a share of the 12 left
    # 7..15: h1 could serve them and is at its stream, so the publisher is not asked
    assert s.pick(0.0) is None
    # a stream to h1 that filled its socket's window: a second one is worth it
    s.socket_window = 1000
    s.windows["h1"].rtt(0.1)
    s.windows["h1"].delivered(64, 64 / 1e4)  # 10 kB/s x 100 ms = 1000 bytes in flight
    assert s.streams_to(info("h1"), holding(w.m, None, "h0")) == 2
    assert s.streams_to(info("h2"), holding(w.m, set(range(8)), "h0")) == 1  # receiving
    # on our own host a complete holder gets every worker: copies are bound by cores
    s.host = "box"
    near = PeerInfo("h1", "tcp://h1:1", "h1:2", (("host", "box"),))
    assert s.streams_to(near, holding(w.m, None, "h0")) == 4
    assert s.streams_to(near, holding(w.m, set(range(8)), "h0")) == 1
    # ... unless this process has one core: more streams only switch threads
    for cores, streams in ((1, 1), (2, 4), (0, 4)):
        s.cores = cores
        assert s.streams_to(near, holding(w.m, None, "h0")) == streams, cores
    s.cores = 1  # a link one stream cannot fill still gets more
    assert s.streams_to(info("h1"), holding(w.m, None, "h0")) == 2
    s.cores = 0
    s.host = None
    assert s.pick(0.0) == (7, info("h1"))
    c = s.open_stream(0.0, 7, info("h1"))
    assert s.next_run(0.0, c, 1 << 20) == [7, 8, 9]
    assert s.pick(0.0) is None
    # h1 gone: what h2 has waits for h2's stream; only the rest goes to the publisher
    s.stream_ended(0.1, c, "refused", "gone")
    s.stream_ended(0.1, a, "refused", "gone")
    assert s.pick(0.1) == (8, info("h0"))


def test_refusal_and_bad_bytes_drop_a_source_for_the_whole_fetch() -> None:
    w = World(manifest(4), {"h1": None, "h2": None}, timeout=30.0)
    s = w.session
    a = s.open_stream(0.0, 0, info("h1"))
    run = s.next_run(0.0, a, 128)
    assert run == [0, 1]
    assert s.failed(0.1, a, 0, "integrity", "chunk 0 failed its digest")
    assert s.tally.integrity_failures == {"h1": 1} and s.tally.chunks_received == 1
    assert s.stream_ended(0.1, a)
    assert s.benched["h1"] == math.inf and s.pending == [0, 1, 2, 3]
    b = s.open_stream(0.1, 0, info("h2"))
    assert s.failed(0.1, b, s.next_run(0.1, b, 64)[0], "refused", "unpublished")
    s.stream_ended(0.1, b)
    assert s.tally.dropped_sources["h2"] == "refused: unpublished"
    assert s.pick(1e9) is None and not s.expired(30.1) and s.expired(30.2)  # from the last open
    assert s.missing_text().startswith("no live holder for 4 of 4 chunks (tensors ['t0'])")
    assert "h1: chunk 0 failed its digest" in s.missing_text()


def test_a_banned_holder_is_benched_until_its_ban_ends() -> None:
    w = World(manifest(4), {"h1": None, "h2": {3}}, timeout=30.0)
    w.bans["h1"] = Ban(5.0, "served bad bytes")
    s = w.session
    assert s.pick(0.0) == (3, info("h2"))
    assert s.tally.banned_sources == {"h1": "served bad bytes"}
    assert s.wake_at(0.0) == 5.0
    assert s.pick(5.0) == (0, info("h1"))
    assert "banned sources: h1: served bad bytes" in s.missing_text()


def test_the_fetch_fails_only_after_stall_timeout_with_nothing_in_flight() -> None:
    w = World(manifest(4, tensors=2), {"h1": None}, timeout=10.0, wanted=[2, 3, 3])
    s = w.session
    assert s.wanted == 2 and s.pending == [2, 3]
    stream = s.open_stream(0.0, 2, info("h1"))
    s.next_run(0.0, stream, 64)
    assert not s.expired(100.0)  # a chunk is in flight: its stall limit decides
    s.landed(100.0, stream, 2, 64)
    s.stream_ended(100.0, stream)
    w.held["h1"] = set()
    s.view_changed()
    assert s.pick(100.0) is None
    assert not s.expired(110.0) and s.expired(110.5)
    assert s.missing_text().startswith("no live holder for 1 of 2 chunks (tensors ['t1'])")
    with pytest.raises(LocalProtocolError):
        s.landed(111.0, stream, 3, 64)  # not in flight


def test_the_fetch_does_not_give_up_while_a_stream_to_a_live_holder_is_opening() -> None:
    """The cross-DC pull without DC labels at 1,024 GPUs: a reader's planned parent,
    itself still receiving, landed nothing within stall_timeout and was benched; when
    the bench ended a worker opened a stream to it again, and while that stream was
    connecting (open, nothing claimed yet) another worker found no job and ended the
    fetch with VersionUnavailable, although the parent was live and the publisher
    held every chunk.  A stream that never gets going ends the fetch a stall_timeout
    after it was opened, not never."""
    w = World(manifest(4), {"h0": None, "h1": set()}, timeout=10.0, window=2,
              plan=[("h1", 0, 4)])
    s = w.session
    first = s.open_stream(0.0, 0, info("h1"))
    assert s.next_run(0.0, first, 1 << 20) == [0, 1]  # half: work for both workers
    assert s.pick(0.0) is None  # one stream to a planned parent
    s.stream_ended(10.0, first, "stalled")  # a real timeout: benched for stall_timeout
    assert "h1" in s.tally.dropped_sources and not s.usable(19.0, "h1")
    assert s.pick(20.0) == (0, info("h1"))  # back, and its chunks are its again
    again = s.open_stream(20.0, 0, info("h1"))  # connecting: nothing claimed yet
    assert s.pick(20.0) is None  # one stream to a planned parent: the other worker waits
    assert not s.expired(20.0) and not s.expired(30.0)  # ... and must not end the fetch
    assert s.expired(30.5)  # but a stream that never claims does not hold it forever
    assert s.next_run(20.01, again, 1 << 20) == [0, 1]
    assert not s.expired(100.0)  # in flight: its stall limit decides
    s.stream_ended(30.01, again, "stalled")  # again: now the publisher serves them
    assert s.pick(30.01) == (0, info("h0"))


def test_first_and_last_landing_times_are_kept() -> None:
    w = World(manifest(3), {"h1": None}, timeout=10.0, window=1, verified={0})
    s = w.session
    tally = s.tally
    assert tally.first_landed is None and s.pending == [1, 2]
    stream = s.open_stream(1.0, 1, info("h1"))
    for at, c in zip((2.0, 3.5), s.next_run(1.0, stream, 1 << 20), strict=True):
        s.landed(at, stream, c, 64)
    assert (s.tally.first_landed, tally.last_landed) == (2.0, 3.5) and s.done
    assert s.tally.chunks == 2 and s.tally.reads == 1 and s.tally.bytes == 128


# -- random event sequences ---------------------------------------------------------------


OPS = ("pick", "run", "land", "end", "time", "pick", "run", "land", "fail", "end", "gossip",
       "ban", "replan")
"""Steps of the random sequences, the ones that move chunks more often."""


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_events_keep_every_chunk_in_exactly_one_state(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 12), "chunks")
    m = manifest(n)
    timeout = data.draw(st.sampled_from([0.5, 5.0, 30.0]), "stall_timeout")
    held: dict[str, set[int] | None] = {
        name: data.draw(st.none() | st.sets(st.integers(0, n - 1)), name)
        for name in data.draw(st.lists(st.sampled_from(NAMES), min_size=1, unique=True),
                          "holders")}
    wanted = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1), "wanted"))
    verified = data.draw(st.sets(st.sampled_from(wanted)), "verified")
    def draw_plan(label: str) -> list[tuple[str, int, int]]:
        return [(name, a, b) for name in data.draw(
            st.lists(st.sampled_from(NAMES), max_size=2, unique=True), label)
            for a, b in [sorted(data.draw(st.tuples(st.integers(0, n), st.integers(0, n))))]]

    plan = draw_plan("planned")
    upstream = frozenset(data.draw(st.sets(st.sampled_from(NAMES), max_size=1), "upstream"))
    w = World(m, held, timeout=timeout, window=data.draw(st.integers(1, 3), "window"),
              wanted=wanted, verified=verified, plan=plan, upstream=upstream)
    s = w.session
    planned = {c: name for name, a, b in plan for c in range(a, b)}
    now, progress, opened = 0.0, 0.0, 0.0
    done = set(verified)
    streams: list[Stream] = []
    never: set[str] = set()  # refused, bad bytes, protocol errors: not for this fetch
    not_before: dict[str, float] = {}

    def serves(name: str, chunk: int) -> bool:
        """Whether ``name`` is a source of ``chunk`` now: it holds it, or the plan in
        force names it (a newer plan may have dropped it)."""
        held = w.held.get(name, set())
        return held is None or chunk in held or planned.get(chunk) == name

    def may_use(name: str) -> bool:
        return name not in never and now >= not_before.get(name, 0.0) \
            and w.banned(now, name) is None

    def dropped(stream: Stream, kind: FailureKind, retries: int) -> None:
        name = stream.source.name
        if kind in ("refused", "integrity", "remote_protocol"):
            never.add(name)
        elif kind == "transport":
            not_before[name] = max(not_before.get(name, 0.0),
                                   now + min(timeout, RETRY_BASE))
        elif kind == "stalled" and s.tally.stall_retries.get(name, 0) == retries:
            not_before[name] = max(not_before.get(name, 0.0),
                                   now + min(timeout, STALL_FLOOR) - 1e-9)

    for _ in range(data.draw(st.integers(1, 80), "steps")):
        op = data.draw(st.sampled_from(OPS))
        if op == "time":
            now += data.draw(st.sampled_from([0.01, 0.3, 1.0, timeout, 2 * timeout]))
        elif op == "pick":
            job = s.pick(now)
            # The same as asking about every pending chunk in turn (pick skips those
            # off the plan while no holder has a free stream).
            holders = s._holders(now)
            assert job == next(((c, p) for c in s.pending
                                if (p := s._source_for(now, c, holders)) is not None), None)
            if job is not None:
                chunk, peer = job
                assert chunk in s.pending and may_use(peer.name)
                p = planned.get(chunk)
                if p is not None and s.usable(now, p) and chunk not in s.lacks.get(p, ()):
                    assert peer.name == p  # its planned source while usable
                streams.append(s.open_stream(now, chunk, peer))
                opened = now
        elif streams:
            stream = data.draw(st.sampled_from(streams))
            name = stream.source.name
            if op == "run":
                usable = {c: p for c, p in planned.items() if s.usable(now, p)
                          and c not in s.lacks.get(p, ())}
                before = list(s.pending)
                run = s.next_run(now, stream, data.draw(st.sampled_from([64, 256, 1 << 20])))
                assert set(run) <= set(before) and run == sorted(run)
                assert not run or may_use(name)
                assert all(usable.get(c, name) == name for c in run)
            elif op in ("land", "fail") and stream.taken:
                chunk = data.draw(st.sampled_from(sorted(stream.taken)))
                if op == "land":
                    s.landed(now, stream, chunk, 64)
                    done.add(chunk)
                    progress = now
                else:
                    kind = data.draw(st.sampled_from(FAILURE_KINDS))
                    retries = s.tally.stall_retries.get(name, 0)
                    s.failed(now, stream, chunk, kind, "why")
                    dropped(stream, kind, retries)
            elif op == "end":
                why: FailureKind | None = data.draw(
                    st.none() | st.just(STALLED) | st.sampled_from(FAILURE_KINDS))
                retries = s.tally.stall_retries.get(name, 0)
                lost = min(stream.taken, default=stream.first)
                s.stream_ended(now, stream, why)
                streams.remove(stream)
                if why is not None:
                    dropped(stream, why, retries)
                if why == "stalled" and s.tally.stall_retries.get(name, 0) > retries \
                        and lost in s.pending and not s.load.get(name) and may_use(name) \
                        and lost not in s.lacks.get(name, ()) and serves(name, lost):
                    assert s.usable(now, name) and s.pick(now) is not None  # asked again
        if op == "gossip":
            name = data.draw(st.sampled_from(NAMES))
            had = w.held.get(name, set())
            w.held[name] = None if had is None or data.draw(st.booleans()) else \
                had | {data.draw(st.integers(0, n - 1))}
            s.view_changed()
        elif op == "ban":
            name = data.draw(st.sampled_from(NAMES))
            w.bans[name] = Ban(now + data.draw(st.sampled_from([0.5, 10.0])), "bad")
        elif op == "replan":  # a newer plan; the shell ends the streams in abandon
            plan = draw_plan("replanned")
            s.replan(now, [(info(x), a, b) for x, a, b in plan])
            planned = {c: x for x, a, b in plan for c in range(a, b)}
            for stream in [x for x in streams if x.source.name in s.abandon]:
                stream.stop = True
                assert s.stream_ended(now, stream)  # its connection closes
                streams.remove(stream)
            assert all(planned.get(c) == src for c, src in s.claimed.items())
        # every wanted chunk is pending, claimed or verified, exactly once
        claimed = {c: st_.source.name for st_ in streams for c in st_.taken}
        assert s.claimed == claimed
        assert s.pending == sorted(set(s.pending))
        assert sorted([*s.pending, *claimed, *(done & set(wanted))]) == wanted
        assert s.done == (done >= set(wanted))
        assert s.tally.chunks == len(done - verified)
        assert {k: v for k, v in s.load.items() if v} == {
            name: sum(x.source.name == name for x in streams)
            for name in {x.source.name for x in streams}}
        assert s.expired(now) == (not claimed and now - max(progress, opened) > timeout)
        assert s.wake_at(now) > now


# -- a simulated run --------------------------------------------------------------------


def simulate(rates: dict[str, float], chunks: int, chunk_size: int, window: int) -> float:
    """Holders serve their streams' chunks first come first served at their rates; the
    reader's link is not the limit.  Returns when the last chunk landed."""
    m = manifest(chunks, chunk_size)
    w = World(m, dict.fromkeys(rates), timeout=60.0, window=window)
    s = w.session
    busy = dict.fromkeys(rates, 0.0)
    events: list[tuple[float, int, int]] = []  # (time, worker, chunk)
    streams: dict[int, Stream] = {}

    def start(worker: int, now: float) -> None:
        """The worker picks, claims a run and has it scheduled; or it is done."""
        stream = streams.get(worker)
        while True:
            if stream is None:
                job = s.pick(now)
                if job is None:
                    assert not s.pending  # every holder has every chunk
                    return
                stream = streams[worker] = s.open_stream(now, *job)
            name = stream.source.name
            run = s.next_run(now, stream, s.windows[name].bytes())
            if run:
                break
            s.stream_ended(now, stream)
            stream = None
            del streams[worker]
        for c in run:
            busy[name] = max(busy[name], now) + chunk_size / rates[name]
            heapq.heappush(events, (busy[name], worker, c))

    for worker in range(window):
        start(worker, 0.0)
    end = 0.0
    while events:
        end, worker, c = heapq.heappop(events)
        stream = streams[worker]
        s.landed(end, stream, c, chunk_size)
        if not stream.taken:
            start(worker, end)
    assert s.done and s.tally.bytes == chunks * chunk_size
    return end


@pytest.mark.parametrize("rates", [
    {"h1": 100e6},
    {"h1": 100e6, "h2": 100e6},
    {"h1": 100e6, "h2": 50e6, "h3": 25e6},
])
def test_simulated_holders_serve_a_version_at_their_summed_rate(
        rates: dict[str, float]) -> None:
    chunk, chunks = 1 << 20, 64
    ideal = chunks * chunk / sum(rates.values())
    took = simulate(rates, chunks, chunk, window=len(rates))
    assert ideal * (1 - 1e-9) <= took  # the simulation cannot beat physics
    # the tail: the slowest holder's last run (the floor of 4 chunks) at worst
    assert took <= ideal + 4 * chunk / min(rates.values())


def relay_chain(depth: int, chunks: int, chunk_size: int, rate: float) -> list[float]:
    """Each reader of a chain follows a plan naming the one before it (still receiving)
    as the source of every chunk; a chunk crosses a link at ``rate`` once its sender has
    it.  Returns when each level has the whole version."""
    m = manifest(chunks, chunk_size)
    sender_has = [0.0] * chunks  # the original holder: everything from the start
    ends = []
    for level in range(depth):
        w = World(m, {}, timeout=60.0, window=1, plan=[(f"r{level}", 0, chunks)])
        s = w.session
        got = [0.0] * chunks
        now = link = 0.0
        while not s.done:
            job = s.pick(now)
            assert job is not None and job[1].name == f"r{level}"  # asked before it has it
            stream = s.open_stream(now, *job)
            while run := s.next_run(now, stream, s.windows[job[1].name].bytes()):
                for c in run:
                    link = max(link, sender_has[c]) + chunk_size / rate
                    s.landed(link, stream, c, chunk_size)
                    got[c] = link
                now = link
            s.stream_ended(now, stream)
        sender_has = got
        ends.append(max(got))
    return ends


def test_a_relay_chain_lags_one_chunk_time_a_level() -> None:
    chunks, chunk, rate = 32, 1 << 20, 50e6
    ends = relay_chain(4, chunks, chunk, rate)
    assert ends == pytest.approx([(chunks + level) * chunk / rate for level in range(4)])


def test_the_chunk_size_note_allows_for_the_publishers_mesh() -> None:
    """A publisher's automatic chunk size counts its live peers, which the reader does
    not know: a power of two between the floor and the choice for a publisher alone
    may be automatic; anything else is the publisher's setting."""
    mib = 1 << 20
    for chunk, says in ((16 * mib, "automatic for 1 GiB"),
                        (8 * mib, "automatic for 1 GiB in its mesh"),
                        (4 * mib, "automatic for 1 GiB in its mesh"),
                        (2 * mib, "its PeerConfig.chunk_size (automatic would be 16 MiB"),
                        (12 * mib, "its PeerConfig.chunk_size")):
        m = build_manifest(KEY, [("w", np.zeros(1 << 30, np.uint8))], chunk, "xxh3-128")
        note = chunk_size_note(m)
        assert note.startswith(f"{chunk // mib} MiB chosen by the publisher: ")
        assert says in note, note


def test_a_window_starts_from_the_rate_earlier_fetches_measured_from_its_source() -> None:
    m = manifest(8)
    session = TransferSession(
        now=0.0, me="reader", manifest=m, holders=lambda: [], banned=lambda _n, _s: None,
        wanted=range(m.num_chunks), verified=[0] * m.num_chunks, window=1,
        stall_timeout=30.0, rates={"h1": 125e6})
    session.open_stream(0.0, 0, info("h1"))
    session.open_stream(0.0, 0, info("h2"))
    assert session.windows["h1"].rate == pytest.approx(125e6)
    assert session.windows["h2"].rate is None  # nothing measured from it: the floor
