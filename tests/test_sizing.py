"""Chunk sizes and stream windows (:mod:`tensorhub.protocol.sizing`): pure rules, checked
against what they promise for any input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorhub.errors import LocalProtocolError
from tensorhub.protocol.sizing import (
    GAIN,
    MAX_AUTO_CHUNK,
    MIN_AUTO_CHUNK,
    MIN_CHUNKS,
    TARGET_CHUNKS,
    StreamWindow,
    choose_chunk_size,
)

MIB = 1 << 20


@given(st.integers(0, 1 << 45), st.integers(1, 1 << 16))
def test_automatic_chunks_are_powers_of_two_within_bounds_near_the_target(
        total: int, peers: int) -> None:
    size, why = choose_chunk_size(total, peers=peers)
    assert MIN_AUTO_CHUNK <= size <= MAX_AUTO_CHUNK
    assert size & (size - 1) == 0
    chunks = -(-total // size)
    target = TARGET_CHUNKS * max(1.0, math.log2(peers))  # a level of the tree a chunk-time
    if MIN_AUTO_CHUNK < size < MAX_AUTO_CHUNK:
        assert target / 2 < chunks <= target, (total, peers, size)
    if size == MIN_AUTO_CHUNK:
        assert chunks <= target
    assert "automatic" in why and (peers <= 2) == ("levels" not in why)


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(1, 1 << 16),
       st.integers(1, 1 << 16))
def test_bigger_versions_and_smaller_meshes_never_get_smaller_chunks(
        a: int, b: int, p: int, q: int) -> None:
    lo, hi = sorted((a, b))
    few, many = sorted((p, q))
    assert choose_chunk_size(lo, peers=many)[0] <= choose_chunk_size(hi, peers=many)[0]
    assert choose_chunk_size(hi, peers=many)[0] <= choose_chunk_size(hi, peers=few)[0]


def test_known_sizes_and_the_override() -> None:
    assert choose_chunk_size(256 * MIB)[0] == 4 * MIB  # the cluster's best (1.16x bound)
    assert choose_chunk_size(256 * MIB, peers=8)[0] == 4 * MIB  # that cluster's mesh
    assert choose_chunk_size(1 << 30)[0] == choose_chunk_size(1 << 30, peers=2)[0] == 16 * MIB
    assert choose_chunk_size(1 << 30, peers=8)[0] == 8 * MIB  # 3 levels: 128 chunks
    assert choose_chunk_size(1 << 40)[0] == MAX_AUTO_CHUNK
    assert choose_chunk_size(1 << 40, peers=1 << 12)[0] == MAX_AUTO_CHUNK
    size, why = choose_chunk_size(3_000_000_000, peers=2601)  # Uber Kraken's test
    assert size == 4 * MIB and "726 chunks" in why and "11.3 levels" in why
    assert choose_chunk_size(3_000_000_000)[0] == 64 * MIB
    assert choose_chunk_size(1 << 30, 4 * MIB, peers=100) == (
        4 * MIB, "4 MiB: set by PeerConfig.chunk_size")
    with pytest.raises(LocalProtocolError):
        choose_chunk_size(-1)
    with pytest.raises(LocalProtocolError):
        choose_chunk_size(1 << 30, peers=0)


def test_a_window_starts_at_the_floor_and_follows_the_bandwidth_delay_product() -> None:
    w = StreamWindow(4 * MIB, 1 << 30)
    assert w.bytes() == MIN_CHUNKS * 4 * MIB and "nothing measured" in w.why()
    w.rtt(0.040)
    assert w.bytes() == w.floor  # a round trip alone says nothing of the rate
    w.delivered(4 * MIB, 4 * MIB / 500e6)  # 500 MB/s: 4 Gbit
    assert w.rate == pytest.approx(500e6)
    assert w.bytes() == pytest.approx(GAIN * 500e6 * 0.040, abs=1) and "BDP" in w.why()
    w.rtt(0.100)  # a longer sample (a holder that waited) does not count
    assert w.min_rtt == 0.040
    w.rtt(0.0001)  # loopback: the floor
    assert w.bytes() == w.floor and "floor" in w.why()


def test_a_window_is_capped_and_never_below_two_chunks() -> None:
    w = StreamWindow(16 * MIB, 64 * MIB)
    w.rtt(0.080)
    w.delivered(16 * MIB, 16 * MIB / 12.5e9)  # 100 Gbit at 80 ms: a 1 GB product
    assert w.bytes() == 64 * MIB and "cap" in w.why()
    small = StreamWindow(16 * MIB, 1)  # a cap under the floor: the floor wins
    assert small.bytes() == MIN_CHUNKS * 16 * MIB
    with pytest.raises(LocalProtocolError):
        StreamWindow(0, 1)


@given(st.lists(st.tuples(st.integers(1, 1 << 30), st.floats(1e-6, 10)), max_size=30),
       st.lists(st.floats(0, 10), max_size=10), st.integers(4096, 1 << 28),
       st.integers(1, 1 << 34))
def test_the_window_stays_between_floor_and_cap(samples: list[tuple[int, float]],
                                                rtts: list[float], chunk: int,
                                                cap: int) -> None:
    w = StreamWindow(chunk, cap)
    for rtt in rtts:
        w.rtt(rtt)
    for n, secs in samples:
        w.delivered(n, secs)
        assert MIN_CHUNKS * chunk <= w.bytes() <= max(cap, MIN_CHUNKS * chunk)
    assert w.min_rtt == (min(rtts) if rtts else None)


def test_one_stream_per_source_unless_one_fills_its_socket_window() -> None:
    w = StreamWindow(4 << 20, 1 << 30)
    assert w.streams(16 << 20, 4) == 1  # nothing measured yet
    w.rtt(0.010)
    w.delivered(4 << 20, (4 << 20) / 50e6)  # 50 MB/s x 10 ms = 0.5 MB in flight
    assert w.streams(16 << 20, 4) == 1
    assert w.streams(0, 4) == 1  # the kernel did not say: one
    far = StreamWindow(4 << 20, 1 << 30)
    far.rtt(0.100)
    far.delivered(4 << 20, (4 << 20) / 160e6)  # one stream carried 16 MB in flight
    assert far.streams(16 << 20, 4) == 2  # near what one socket keeps: a second
    assert far.streams(16 << 20, 1) == 1
    assert far.streams(8 << 20, 4) == 2  # the product is twice what a socket keeps
    assert far.streams(2 << 20, 4) == 4  # never over ``most``


@given(st.floats(1e3, 1e11), st.floats(1e-5, 1.0), st.integers(0, 1 << 30),
       st.integers(1, 64))
def test_streams_per_source_stay_between_one_and_most(rate: float, rtt: float, sock: int,
                                                       most: int) -> None:
    w = StreamWindow(1 << 20, 1 << 30)
    w.rtt(rtt)
    w.delivered(1 << 20, (1 << 20) / rate)
    n = w.streams(sock, most)
    assert 1 <= n <= max(1, most)
    if sock and rate * rtt < 0.8 * sock:
        assert n == 1


def test_a_run_is_asked_for_before_the_link_can_run_dry() -> None:
    """Half the window free asks; so does a free chunk once what is in flight is under
    the bandwidth-delay product and a chunk (1 Gbit at 100 ms: 12.5 MB against a 16 MiB
    floor, where waiting for half the window idles the link each round trip)."""
    chunk = 4 * MIB
    w = StreamWindow(chunk, 1 << 30)
    assert w.ask(0) == w.floor  # nothing in flight: the whole window
    assert w.ask(w.floor - chunk) == 0  # a chunk free, nothing measured: wait for half
    assert w.ask(w.floor // 2) == w.floor // 2
    w.rtt(0.100)
    w.delivered(chunk, chunk / 125e6)
    bdp = w.bdp()
    assert bdp is not None and bdp == pytest.approx(12.5e6, rel=1e-6)
    window = w.bytes()
    assert window == pytest.approx(GAIN * 12.5e6, abs=1)
    assert w.ask(window - chunk // 2) == 0  # less than a chunk free
    assert w.ask(bdp + chunk + 1) == 0  # enough in flight to cover a round trip
    assert w.ask(bdp + chunk - 1) == window - (bdp + chunk - 1)  # not any more
    loopback = StreamWindow(chunk, 1 << 30)
    loopback.rtt(0.0004)
    loopback.delivered(chunk, chunk / 3e9)  # the product is tiny: runs of half a window
    assert loopback.ask(loopback.floor - chunk) == 0
    assert loopback.ask(loopback.floor // 2) == loopback.floor // 2


@given(st.integers(4096, 1 << 26), st.integers(1, 1 << 34), st.floats(1e3, 1e11),
       st.floats(1e-5, 1.0), st.integers(0, 1 << 36))
def test_an_ask_fits_the_window_and_keeps_the_product_in_flight(
        chunk: int, cap: int, rate: float, rtt: float, ahead: int) -> None:
    w = StreamWindow(chunk, cap)
    w.rtt(rtt)
    w.delivered(chunk, chunk / rate)
    got = w.ask(ahead)
    free = w.bytes() - ahead
    assert 0 <= got <= max(free, 0)
    if ahead > 0 and got:
        assert got >= chunk  # never a request for less than a chunk
    bdp = w.bdp()
    assert bdp is not None
    if ahead > 0 and free >= chunk and (ahead < bdp + chunk or free >= w.bytes() // 2):
        assert got == free


def test_only_samples_of_a_backlogged_holder_count_and_a_known_rate_is_the_start() -> None:
    w = StreamWindow(4 * MIB, 1 << 30)
    assert w.backlogged(0.0)  # no round trip measured yet: any request ahead counts
    w.rtt(0.100)
    assert w.backlogged(0.100) and w.backlogged(math.inf)
    assert not w.backlogged(0.050)  # still on its way when the holder ran out of work
    seeded = StreamWindow(4 * MIB, 1 << 30, rate=125e6)
    assert seeded.rate == pytest.approx(125e6) and seeded.bytes() == seeded.floor
    seeded.rtt(0.100)  # the pooled connection's round trip: the product at once
    assert seeded.bytes() == pytest.approx(GAIN * 12.5e6, abs=1)
    assert StreamWindow(4 * MIB, 1 << 30, rate=0.0).rate is None


def test_a_short_chunk_moves_the_rate_by_its_bytes_not_as_a_whole_chunk() -> None:
    """A version's tail chunk of a few bytes takes mostly fixed time: weighed as a whole
    chunk it would pull a measured 1 GB/s down to a fraction of that."""
    w = StreamWindow(MIB, 1 << 30)
    for _ in range(3):
        w.delivered(MIB, MIB / 1e9)
    assert w.rate == pytest.approx(1e9)
    w.delivered(1554, 40e-6)  # 39 MB/s, from 1.5 KB
    assert w.rate is not None and w.rate > 0.99e9
    w.delivered(MIB, MIB / 0.5e9)  # a whole chunk at half the rate moves it a quarter
    assert 1 / w.rate == pytest.approx(0.75 / 1e9 + 0.25 / 0.5e9, rel=0.01)
    first = StreamWindow(MIB, 1 << 30)
    first.delivered(1554, 40e-6)  # alone, a tail chunk is no measure of the link
    assert first.rate is None and first.bytes() == first.floor
    first.delivered(MIB // 2, MIB / 2 / 1e9)
    assert first.rate == pytest.approx(1e9)
