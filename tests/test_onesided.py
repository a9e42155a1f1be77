"""The one-sided seam beyond the conformance suite: the registration cache (once per
buffer, reused across versions), keys revoked on unpublish, a stale key's read failing
cleanly, the failure paths, and the grant decoder (fuzzed)."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from test_onesided_conformance import onesided_holder

from tensorhub.errors import RemoteProtocolError, TransportError
from tensorhub.protocol.dataplane import NOT_YET, OK, ChunkReply
from tensorhub.protocol.onesided import (
    GRANT_ROWS,
    MAX_KEY,
    ROW,
    OneSidedChunkRequest,
    OneSidedDone,
    OneSidedGrant,
    OneSidedRunRequest,
    grant_frames,
    granted_ranges,
)
from tensorhub.read.store import LocalVersion, Store
from tensorhub.testing.conformance import SEED, publish, read_into, rng_for
from tensorhub.transport.admission import ServerLimits
from tensorhub.transport.base import NotServing
from tensorhub.transport.frames import recv_frame, send_frame
from tensorhub.transport.onesided.backend import MAX_READ, Region, pair_up, read_ranges
from tensorhub.transport.onesided.holder import OneSidedHost
from tensorhub.transport.onesided.reader import OneSidedConnection
from tensorhub.transport.onesided.registry import Registrations
from tensorhub.transport.onesided.standin import StandinBackend

print(f"tests/test_onesided.py: seed {SEED}")


def standin() -> StandinBackend:
    return StandinBackend("rdma-standin")


def linked(holder: StandinBackend, reader: StandinBackend) -> Any:
    dialing = reader.dial()
    _end, endpoint = holder.accept(dialing.endpoint)
    return dialing.connect(endpoint)


def read(link: Any, reader: Registrations, ranges: list[tuple[int, int, bytes]],
         size: int) -> bytes:
    buf = np.zeros(size, np.uint8)
    local, _ = reader.local_pieces([memoryview(buf)])  # type: ignore[arg-type]
    read_ranges(link, pair_up(local, ranges), 4, 5)
    return buf.tobytes()


def test_keys_are_revoked_on_unpublish_and_a_stale_key_reads_nothing() -> None:
    holder, reader = Registrations(standin()), Registrations(standin())
    link = linked(holder.backend, reader.backend)  # type: ignore[arg-type]
    arrays = [np.arange(n, dtype=np.uint8) for n in (1000, 3000)]
    v1, v2 = object(), object()
    segments = [memoryview(a)[100:900] for a in arrays]
    ranges = holder.remote_ranges(segments, v1)
    assert read(link, reader, ranges, 1600) == b"".join(s.tobytes() for s in segments)
    holder.dropped(v1)  # unpublished and drained: the keys go
    with pytest.raises(TransportError, match="not granted"):
        read(link, reader, ranges, 1600)
    again = holder.remote_ranges(segments, v2)  # the next version, in the same arrays
    assert {k for _, _, k in again}.isdisjoint({k for _, _, k in ranges})
    assert read(link, reader, again, 1600) == b"".join(s.tobytes() for s in segments)
    stats = holder.statistics()
    assert (stats.registered, stats.granted, stats.revoked) == (2, 4, 2)
    assert stats.reused == 2  # v2 registered nothing


def test_a_buffer_shared_by_two_versions_keeps_its_key_until_both_are_gone() -> None:
    holder = Registrations(standin())
    buf = np.zeros(4096, np.uint8)
    one = holder.remote_ranges([memoryview(buf)[:100]], "v1")
    two = holder.remote_ranges([memoryview(buf)[100:]], "v2")
    assert one[0][2] == two[0][2]
    holder.dropped("v1")
    assert holder.statistics().revoked == 0
    holder.dropped("v2")
    assert holder.statistics().revoked == 1


def test_a_freed_buffer_is_deregistered_and_never_read_through() -> None:
    holder = Registrations(standin())
    buf = np.zeros(4096, np.uint8)
    view = buf[10:20]  # a view keeps its base alive; the base is what is registered
    holder.remote_ranges([memoryview(view)], "v1")
    assert holder.statistics().live == 1
    del buf, view
    assert holder.statistics().live == 0 and holder.statistics().deregistered == 1


def test_memory_that_cannot_be_weakly_referenced_is_registered_for_one_use() -> None:
    reader = Registrations(standin())
    buf = bytearray(100)
    pieces, transient = reader.local_pieces([memoryview(buf)])
    assert len(pieces) == 1 and len(transient) == 1
    reader.release(transient)
    assert reader.statistics().live == 0 and reader.statistics().transient == 1
    holder = Registrations(standin())
    with pytest.raises(TypeError):  # a holder never serves such memory one-sided
        holder.remote_ranges([memoryview(bytearray(10))], "v")


def test_a_failed_read_waits_for_every_read_posted() -> None:
    holder, reader = Registrations(standin()), Registrations(standin())
    link = linked(holder.backend, reader.backend)  # type: ignore[arg-type]
    src = np.arange(8 * MAX_READ, dtype=np.uint64).view(np.uint8)
    ranges = holder.remote_ranges([memoryview(src)], "v")
    reader.backend.faults = 1  # type: ignore[attr-defined]
    with pytest.raises(TransportError, match="injected"):
        read(link, reader, ranges, src.nbytes)
    assert not link._posted  # nothing left to land after the error


@given(st.data())
def test_pair_up_covers_both_sides_exactly(data: st.DataObject) -> None:
    total = data.draw(st.integers(1, 3 * MAX_READ))

    def cuts() -> list[tuple[int, int]]:
        """``(offset, length)`` pieces of ``[0, total)``."""
        points = sorted(data.draw(st.sets(st.integers(1, max(1, total - 1)), max_size=6)))
        bounds = [0, *[p for p in points if p < total], total]
        return [(a, b - a) for a, b in pairwise(bounds)]

    region = Region(0, total, None)
    local = [(region, at, n) for at, n in cuts()]
    theirs_cut = cuts()
    remote = [(10_000 + 7 * i + at, n, b"k") for i, (at, n) in enumerate(theirs_cut)]
    reads = pair_up(local, remote)
    assert all(0 < r[4] <= MAX_READ for r in reads)
    mine, theirs = np.zeros(total, np.int64), np.zeros(total, np.int64)
    starts = {addr: at for (addr, _n, _k), (at, _) in zip(remote, theirs_cut, strict=True)}
    for _region, laddr, raddr, _key, n in reads:
        mine[laddr:laddr + n] += 1
        base = max(a for a in starts if a <= raddr)  # the piece raddr lies in
        theirs[raddr - base + starts[base]:raddr - base + starts[base] + n] += 1
    assert (mine == 1).all() and (theirs == 1).all()


# -- the grant decoder --------------------------------------------------------------------


@given(st.data())
def test_granted_ranges_round_trip(data: st.DataObject) -> None:
    key_size = data.draw(st.integers(1, MAX_KEY))
    keys = data.draw(st.lists(st.binary(min_size=key_size, max_size=key_size), min_size=1,
                              max_size=5))
    pieces = data.draw(st.lists(st.tuples(st.integers(0, 2**48), st.integers(1, 1 << 30),
                                          st.sampled_from(keys)), min_size=1, max_size=40))
    want = sum(n for _, n, _ in pieces)
    got: list[tuple[int, int, bytes]] = []
    for frame in grant_frames(7, want, pieces):
        got += granted_ranges(frame, want, sum(n for _, n, _ in got))
    assert got == pieces


def test_a_long_grant_is_cut_into_frames() -> None:
    pieces = [(i * 16, 8, bytes([i % 3]) * 4) for i in range(GRANT_ROWS + 5)]
    frames = grant_frames(1, 8 * len(pieces), pieces)
    assert [f.more for f in frames] == [True, False]
    assert len(frames[0].ranges) == GRANT_ROWS * ROW.size


@given(req_id=st.integers(0, 2**63 - 1), length=st.integers(0, 2**64 - 1),
       key_size=st.integers(1, MAX_KEY), keys=st.binary(max_size=600),
       ranges=st.binary(max_size=300) | st.lists(
           st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                     st.integers(0, 2**64 - 1)), max_size=6).map(
           lambda rows: b"".join(ROW.pack(*r) for r in rows)),
       more=st.booleans(), want=st.integers(0, 2**40), got=st.integers(0, 2**40))
def test_hostile_grants_are_refused_as_the_holders_fault(
        req_id: int, length: int, key_size: int, keys: bytes, ranges: bytes, more: bool,
        want: int, got: int) -> None:
    msg = OneSidedGrant(req_id, length, key_size, keys, ranges, more)
    try:
        out = granted_ranges(msg, want, got)
    except RemoteProtocolError:
        return
    assert got + sum(n for _, n, _ in out) <= want
    assert all(n > 0 and addr + n <= 2**64 and len(k) == key_size for addr, n, k in out)


# -- over the wire ---------------------------------------------------------------------------


async def test_a_failed_read_closes_the_connection_and_ends_the_lease() -> None:
    rng = rng_for("onesided-fail")
    async with onesided_holder(standin) as holder:
        pub = publish(holder.store, rng, [300_000], chunk_size=100_000)
        conn = await holder.connect()
        assert isinstance(conn, OneSidedConnection)
        conn._reg.backend.faults = 1  # type: ignore[attr-defined]
        buf = np.zeros(100_000, np.uint8)
        with pytest.raises(TransportError, match="injected"):
            await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
        with trio.fail_after(5):
            await pub.local.drained.wait()  # the holder saw the connection end
        with pytest.raises(TransportError):
            await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
        again = await holder.connect()
        await read_into(again, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
        assert np.array_equal(buf, pub.chunk(0))
        await again.aclose()


async def test_unpublish_revokes_and_a_republish_in_the_same_arrays_registers_nothing(
        ) -> None:
    rng = rng_for("onesided-republish")
    hosts: list[OneSidedHost] = []
    async with onesided_holder(standin, hosts) as holder:
        store: Store = holder.store
        pub = publish(store, rng, [70_000, 50_000, 9], chunk_size=32_768)
        conn = await holder.connect()
        m = pub.local.manifest
        for c in range(m.num_chunks):
            buf = np.zeros(len(pub.chunk(c)), np.uint8)
            await read_into(conn, pub, c, [memoryview(buf)])  # type: ignore[arg-type]
        (stats,) = hosts[0].statistics().values()
        assert (stats.registered, stats.granted, stats.revoked) == (3, 3, 0)
        store.hide(m.key)
        await store.wait_drained(m.key)
        (stats,) = hosts[0].statistics().values()
        assert stats.revoked == 3  # no key of v1 reads anything now
        v2 = LocalVersion(replace(m, version=2), pub.local.arrays, "holder", verified=True)
        store.add(v2)  # v2 in the very same arrays
        buf = np.zeros(len(pub.chunk(0)), np.uint8)
        await conn.read_chunk(v2.manifest.key, 0, [memoryview(buf)])  # type: ignore[list-item]
        assert np.array_equal(buf, pub.chunk(0))
        (stats,) = hosts[0].statistics().values()
        assert stats.registered == 3 and stats.granted == 4  # a new key, nothing pinned
        await conn.aclose()


async def test_a_reader_that_never_ends_its_lease_is_cut_off_and_its_key_revoked() -> None:
    """A reader that takes a grant and never says ``OneSidedDone`` loses the lease after
    ``lease_timeout``: its connection is shut down and its link closed before the lease
    ends, so unpublish returns; then the key is revoked too."""
    rng = rng_for("onesided-hang")
    limits = ServerLimits(lease_timeout=0.3)
    async with onesided_holder(standin, limits=limits) as holder:
        pub = publish(holder.store, rng, [50_000], chunk_size=50_000)
        key = pub.local.manifest.key
        conn = await holder.connect()
        assert isinstance(conn, OneSidedConnection) and conn._link is not None
        await send_frame(conn._sock, OneSidedChunkRequest(99, key.model, key.version, 0))
        grant = await recv_frame(conn._sock)
        assert isinstance(grant, OneSidedGrant) and pub.local.inflight == 1
        holder.store.hide(key)
        with trio.fail_after(5):
            await holder.store.wait_drained(key)  # within about lease_timeout
        with pytest.raises(TransportError):
            await recv_frame(conn._sock)  # cut off
        ranges = granted_ranges(grant, 50_000, 0)
        with pytest.raises(TransportError, match=r"gone|not granted"):
            read(conn._link, conn._reg, ranges, 50_000)
        await conn.aclose()


async def test_a_run_leases_its_chunks_in_one_round_trip_until_one_done() -> None:
    """``OneSidedRunRequest``: a ``ChunkReply`` per chunk in order (a chunk the holder
    lacks refused, the run going on), every granted chunk leased until the one
    ``OneSidedDone``."""
    rng = rng_for("onesided-run")
    async with onesided_holder(standin) as holder:
        pub = publish(holder.store, rng, [40_000], chunk_size=10_000, verified=False)
        for c in (0, 1, 3):
            pub.local.mark_verified(c)
        pub.local.end_receiving()  # chunk 2 will not come: NOT_YET at once
        key = pub.local.manifest.key
        conn = await holder.connect()
        assert isinstance(conn, OneSidedConnection) and conn._link is not None
        await send_frame(conn._sock, OneSidedRunRequest(5, key.model, key.version, 0, 4))
        statuses = []
        for c in range(4):
            head = await recv_frame(conn._sock)
            assert isinstance(head, ChunkReply) and head.chunk == c
            statuses.append(head.status)
            if head.status == OK:
                grant = await recv_frame(conn._sock)
                assert isinstance(grant, OneSidedGrant)
                got = read(conn._link, conn._reg, granted_ranges(grant, 10_000, 0), 10_000)
                assert got == pub.chunk(c).tobytes()
        assert statuses == [OK, OK, NOT_YET, OK]
        assert pub.local.inflight == 3  # all leased, until the reader is done
        await send_frame(conn._sock, OneSidedDone(5))
        with trio.fail_after(5):
            await pub.local.drained.wait()
        bufs = [np.zeros(10_000, np.uint8) for _ in range(4)]
        got_all = await conn.read_chunks(key, [0, 1, 2, 3], [[memoryview(b)] for b in bufs],  # type: ignore[misc]
                                         [None] * 4)
        assert got_all[:2] == [10_000] * 2 and got_all[3] == 10_000
        assert isinstance(got_all[2], NotServing) and got_all[2].status == NOT_YET
        assert all(np.array_equal(bufs[c], pub.chunk(c)) for c in (0, 1, 3))
        await conn.aclose()


async def test_a_holder_refuses_a_backend_it_does_not_serve_or_one_off_its_socket() -> None:
    async with onesided_holder(standin) as holder:
        address = holder.address
        assert address is not None
        other = Registrations(StandinBackend("cuda-ipc-standin"))
        other.backend.same_host = False  # type: ignore[misc]  # ask over TCP instead
        with pytest.raises(TransportError, match="not served here"):
            await OneSidedConnection.open(address, "holder", 5, other)
    async with onesided_holder(lambda: StandinBackend("cuda-ipc-standin")) as holder:
        assert holder.address is not None
        tcp = Registrations(StandinBackend("cuda-ipc-standin"))
        tcp.backend.same_host = False  # type: ignore[misc]
        with pytest.raises(TransportError, match="same-host socket only"):
            await OneSidedConnection.open(holder.address, "holder", 5, tcp)


def test_the_pyverbs_api_the_rdma_backend_uses_exists() -> None:
    """Without a device nothing can be registered or connected, but every pyverbs name
    :mod:`tensorhub.transport.rdma` uses can be checked where pyverbs is installed (run
    with the system's ``dist-packages`` on the path)."""
    from tensorhub.transport import rdma
    try:
        v = rdma._verbs()
    except ImportError as exc:
        pytest.skip(f"pyverbs not importable here: {exc}")
    e = v["enums"]
    for name in ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ", "IBV_QPT_RC",
                 "IBV_REREG_MR_CHANGE_ACCESS", "IBV_MTU_1024", "IBV_WR_RDMA_READ",
                 "IBV_SEND_SIGNALED", "IBV_WC_SUCCESS"):
        assert hasattr(e, name), name
    assert all(hasattr(v["mr"].MR, m) for m in ("rereg", "close"))
    assert hasattr(v["qp"].QP, "to_rts") and hasattr(v["cq"].CQ, "poll")
    assert hasattr(v["device"].Context, "query_device")
    attr = v["qp"].QPAttr(port_num=1)
    gid = v["addr"].GID("fe80:0000:0000:0000:0000:0000:0000:0001")
    attr.ah_attr = v["addr"].AHAttr(gr=v["addr"].GlobalRoute(dgid=gid, sgid_index=0),
                                    is_global=1, dlid=3, port_num=1)
    attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.path_mtu = 7, 1, 2, e.IBV_MTU_1024
    attr.max_rd_atomic = attr.max_dest_rd_atomic = 4
    attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
    v["qp"].QPCap(max_send_wr=16, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    sge = v["wr"].SGE(0x1000, 10, 5)
    wr = v["wr"].SendWR(wr_id=1, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge],
                        send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(7, 0x2000)
    factory, why = rdma.probe()
    print(f"rdma probe: {why}")
    assert factory is not None or why.startswith("no RDMA device")
