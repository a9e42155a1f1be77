"""Every transport passes the conformance suite; then what is particular to shared memory.

The shared-memory holders of the suite run in this process (a reader may read its own
memory): ``shm`` over plain arrays (``process_vm_readv``), ``shm-memfd`` over arrays from
``shared_empty`` (the reader maps the holder's memory files); the tests that need a holder
to really die run it as a separate process and SIGKILL it.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
import xxhash
from corrupting import CorruptingProvider
from helpers import wait_until

import tensorhub.testing.conformance as transport_conformance
from tensorhub import shared_empty
from tensorhub.errors import IntegrityError, RemoteProtocolError, TransportError
from tensorhub.manifest.manifest import Manifest
from tensorhub.model import TensorSpec, VersionKey
from tensorhub.protocol.dataplane import (
    BAD_REQUEST,
    NOT_HELD,
    NOT_YET,
    ChunkReply,
    ChunkRequest,
    ChunkRunRequest,
    Reply,
    ShmChunkRequest,
    ShmFileGrant,
    ShmGrant,
    ShmHello,
    ShmVersionGrant,
    ShmVersionRequest,
    ShmWelcome,
)
from tensorhub.protocol.sizing import StreamWindow
from tensorhub.read.destination import allocate_flat
from tensorhub.read.store import Store
from tensorhub.security import Identity, Keyring
from tensorhub.testing.conformance import *  # noqa: F403
from tensorhub.testing.conformance import (
    SEED,
    Holder,
    OpenHolder,
    Published,
    landing,
    publish,
    read_into,
    rng_for,
    running,
)
from tensorhub.transport import tcp
from tensorhub.transport.base import NotServing
from tensorhub.transport.frames import recv_frame, send_frame
from tensorhub.transport.handshake import DataAuth
from tensorhub.transport.local import local_name
from tensorhub.transport.memory import MemoryServer
from tensorhub.transport.samehost import holder as shm_holder
from tensorhub.transport.samehost import memory_files, process_vm
from tensorhub.transport.samehost import reader as shm_reader
from tensorhub.transport.samehost.reader import ShmConnection, iovecs_of, shm_available
from tensorhub.transport.server import TcpServer
from tensorhub.transport.tcp import TcpConnection

ROOT = Path(__file__).resolve().parents[1]
SHM, WHY_NOT = shm_available()
print(f"shared memory transport: {SHM} ({WHY_NOT})")
needs_shm = pytest.mark.skipif(not SHM, reason=WHY_NOT)


async def read_whole(conn: Any, pub: Published, c: int) -> None:
    """Read chunk ``c`` into one fresh buffer and check its bytes."""
    buf = np.zeros(len(pub.chunk(c)), dtype=np.uint8)
    await read_into(conn, pub, c, [memoryview(buf)])  # type: ignore[arg-type]
    assert np.array_equal(buf, pub.chunk(c)), f"chunk {c}"


@asynccontextmanager
async def memory_holder() -> AsyncIterator[Holder]:
    store, sent = Store(), list[int]()
    server = MemoryServer(store, lambda _reader, n: sent.append(n))

    async def kill() -> None:
        server.close()
        await trio.lowlevel.checkpoint()

    yield Holder(store, lambda: server.connect("holder"), kill, None, sent)


MEMBERS = {"holder": Identity.generate(), "reader": Identity.generate()}
KEYRING = Keyring({name: [ident.public] for name, ident in MEMBERS.items()})


def member(name: str) -> DataAuth:
    return DataAuth(name, MEMBERS[name], KEYRING)


@asynccontextmanager
async def tcp_holder(connection: type[TcpConnection], auth: bool = False, corrupt: int = 0
                     ) -> AsyncIterator[Holder]:
    """A TcpServer in this process; ``connection`` is TcpConnection or ShmConnection;
    with ``auth`` every connection opens with the members' handshake; the first
    ``corrupt`` chunks it serves have a flipped byte (:mod:`corrupting`)."""
    store, sent, bad = Store(), list[int](), list[str]()
    served = CorruptingProvider(store, corrupt) if corrupt else store
    server = TcpServer(served, lambda _peer, n: sent.append(n), bad.append,
                       auth=member("holder") if auth else None)
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    async with running(server) as kill:
        reader = member("reader") if auth else None
        yield Holder(store, lambda: connection.connect(address, "holder", 5, reader), kill,
                     address if not auth else None, sent, bad)


HOLDERS: dict[str, Callable[[], Any]] = {
    "memory": memory_holder,
    "tcp": partial(tcp_holder, TcpConnection),
    "shm": partial(tcp_holder, ShmConnection),
    "shm-memfd": partial(tcp_holder, ShmConnection),  # holder arrays from shared_empty
    "tcp+keys": partial(tcp_holder, TcpConnection, auth=True),
    "shm+keys": partial(tcp_holder, ShmConnection, auth=True),
    "shm-memfd+keys": partial(tcp_holder, ShmConnection, auth=True),
}


@pytest.fixture(params=sorted(HOLDERS))
def open_holder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> OpenHolder:
    if request.param.startswith("shm") and not SHM:
        pytest.skip(WHY_NOT)
    if request.param.startswith("shm-memfd"):
        monkeypatch.setattr(transport_conformance, "EMPTY", shared_empty)
    opener: OpenHolder = HOLDERS[request.param]
    return opener


# -- shared memory: the copy ------------------------------------------------------------


def scattered(rng: random.Random, data: bytes, pieces: int) -> tuple[bytearray, list[memoryview]]:
    """``data`` cut at random into pieces laid out with gaps (so none merge)."""
    points = sorted(rng.sample(range(1, len(data)), pieces - 1))
    bounds = list(zip([0, *points], [*points, len(data)], strict=True))
    room = bytearray(len(data) + pieces)
    view = memoryview(room)
    out = [view[a + i:b + i] for i, (a, b) in enumerate(bounds)]
    for (a, b), v in zip(bounds, out, strict=True):
        v[:] = data[a:b]
    return room, out


@needs_shm
def test_copy_batches_any_cuts_on_both_sides() -> None:
    """process_vm_readv takes IOV_MAX pieces a side: cuts that disagree still line up."""
    rng = rng_for("cuts")
    for _ in range(12):
        data = rng.randbytes(rng.randrange(4000, 300_000))
        _src_room, src = scattered(rng, data, rng.randrange(1, 3000))
        _dst_room, dst = scattered(rng, bytes(len(data)), rng.randrange(1, 3000))
        assert len(iovecs_of(src)) == len(src)
        process_vm.readv_all(os.getpid(), iovecs_of(dst), iovecs_of(src))
        assert b"".join(dst) == data


def test_iovecs_merge_neighbours_and_skip_empty_views() -> None:
    buf = memoryview(bytearray(100))
    iov = iovecs_of([buf[0:10], buf[10:10], buf[10:40], buf[50:60]])
    base = iovecs_of([buf])[0, 0]
    assert iov.tolist() == [[base, 40], [base + 50, 10]]
    assert iovecs_of([buf.toreadonly()[50:60]]).tolist() == [[base + 50, 10]]


# -- shared memory: a holder in another process ----------------------------------------

HOLDER_PROCESS = """
import random, sys, trio
sys.path.insert(0, "tests")
import tensorhub.testing.conformance as transport_conformance
from tensorhub import shared_empty
from tensorhub.read.store import Store
from tensorhub.protocol.sizing import StreamWindow
from tensorhub.transport.server import TcpServer
if sys.argv[4] == "shared":
    transport_conformance.EMPTY = shared_empty
store = Store()
transport_conformance.publish(store, random.Random(sys.argv[1]), [int(sys.argv[2])],
                              int(sys.argv[3]))
server = TcpServer(store, lambda peer, n: None, lambda what: print("bad", what, flush=True))
print("port", server.bind("127.0.0.1", 0), flush=True)
trio.run(server.serve)
"""


@pytest.fixture
def holder_process() -> Any:
    """Start a holder of one version in a new process: returns (proc, address, Published)."""
    procs: list[subprocess.Popen[str]] = []

    def start(seed: str, size: int, chunk: int, arrays: str = "plain"
              ) -> tuple[subprocess.Popen[str], str, Published]:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER_PROCESS, seed, str(size),
                                 str(chunk), arrays], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("port "):
                mirror = publish(Store(), random.Random(seed), [size], chunk)
                return proc, f"127.0.0.1:{line.split()[1]}", mirror
        raise AssertionError("holder process did not start")

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(5)


@needs_shm
@pytest.mark.parametrize("arrays", ["plain", "shared"])
@pytest.mark.parametrize("when", ["before the copy", "after the copy"])
async def test_holder_process_killed_mid_read(holder_process: Any, when: str, arrays: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    proc, address, pub = holder_process(f"{SEED}:{when}", 24 << 20, 8 << 20, arrays)
    conn = await ShmConnection.connect(address, "holder", 10)
    buf = np.zeros(8 << 20, dtype=np.uint8)
    await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
    assert np.array_equal(buf, pub.chunk(0))  # one copy from another process's arrays
    assert conn.transport == {"plain": "shm", "shared": "shm-memfd"}[arrays]

    where, name = {"plain": (shm_reader, "readv_all"),
                   "shared": (memory_files.MappedFiles, "copy")}[arrays]
    copy = getattr(where, name)

    def dying_copy(*args: Any) -> None:
        if when == "after the copy":
            copy(*args)
        proc.kill()
        proc.wait(5)
        if when == "before the copy":
            copy(*args)  # shared: the file stays mapped, the copy works; the check fails

    monkeypatch.setattr(where, name, dying_copy)
    error = "ESRCH" if (when, arrays) == ("before the copy", "plain") else "exited"
    with pytest.raises(TransportError, match=error):
        await read_into(conn, pub, 1, [memoryview(buf)])  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="closed"):
        await read_into(conn, pub, 2, [memoryview(buf)])  # type: ignore[arg-type]
    await conn.aclose()


# -- shared memory: the holder's lease -------------------------------------------------


@needs_shm
async def test_lease_ends_when_the_reader_goes_away_or_misbehaves() -> None:
    rng = rng_for("shm-lease")
    async with tcp_holder(ShmConnection) as holder:
        assert holder.address is not None
        pub = publish(holder.store, rng, [100_000], chunk_size=65_536)
        for follow_up in (None, ChunkRequest(2, "m", 1, 0)):
            async with local_connection(holder.address) as sock:
                await send_frame(sock, ShmChunkRequest(1, "m", 1, 0))
                grant = await recv_frame(sock)
                assert isinstance(grant, ShmGrant) and grant.length == 65_536
                await trio.testing.wait_all_tasks_blocked()
                assert pub.local.inflight == 1  # held until ShmDone...
                if follow_up is not None:
                    await send_frame(sock, follow_up)
                    with trio.fail_after(5):
                        while await sock.recv(1 << 16):
                            pass
            with trio.fail_after(5):  # ...or until the reader leaves or breaks the protocol
                await pub.local.drained.wait()
        assert len(holder.bad) == 1 and "ShmDone" in holder.bad[0]


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
@pytest.mark.parametrize("bad", [b"\x00\x00\x00\x03\xc1\xc1\xc1",  # not msgpack
                                 b"\xff\xff\xff\xff"])  # a frame over MAX_FRAME
async def test_bad_input_under_a_version_lease_ends_only_that_connection(bad: bytes) -> None:
    """Bad bytes where the holder waits for ShmRelease: that connection ends, its lease
    with it, reported as the protocol error it is; the server serves the next reader."""
    rng = rng_for("version-lease-bad-input")
    async with tcp_holder(ShmConnection) as holder:
        assert holder.address is not None
        pub = publish(holder.store, rng, [100_000], chunk_size=65_536)
        async with local_connection(holder.address) as sock:
            await send_frame(sock, ShmVersionRequest(1, "m", 1, 0))
            grant = await recv_frame(sock)
            assert isinstance(grant, ShmVersionGrant) and not grant.more
            await sock.send(bad)
            with trio.fail_after(5):  # the holder ends the connection
                while await sock.recv(1 << 16):
                    pass
        with trio.fail_after(5):
            await pub.local.drained.wait()
        assert len(holder.bad) == 1
        assert "malformed message" in holder.bad[0] or "exceeds" in holder.bad[0]
        conn = await holder.connect()
        await read_whole(conn, pub, 1)
        await conn.aclose()


class StoreWithABug(Store):
    """A store whose manifest lookup fails the way an unforeseen bug would."""

    def manifest_bytes(self, key: VersionKey) -> bytes:
        raise KeyError(f"bug looking up {key}")


async def test_a_request_that_meets_a_bug_ends_only_its_connection() -> None:
    """No reader's input is known to raise anything but a protocol or transport error
    (the test above was the last found); should one meet a bug, the server -- which runs
    in the peer's nursery -- ends that connection, reports the error by type, and serves
    on, instead of taking the peer down with it."""
    rng = rng_for("bug")
    store, bad = StoreWithABug(), list[str]()
    pub = publish(store, rng, [10_000], chunk_size=4096)
    server = TcpServer(store, lambda _peer, _n: None, bad.append)
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        conn = await TcpConnection.connect(address, "holder", 5)
        with pytest.raises(TransportError):
            await conn.read_manifest(pub.local.manifest.key)
        await conn.aclose()
        assert len(bad) == 1 and "KeyError answering a request: 'bug looking up m@1'" in bad[0]
        conn = await TcpConnection.connect(address, "holder", 5)
        await read_whole(conn, pub, 2)
        await conn.aclose()
        nursery.cancel_scope.cancel()


@needs_shm
@pytest.mark.parametrize("kind", ["memory", "shm"])
async def test_cancelled_read_ends_the_lease_before_close(kind: str) -> None:
    """These two need no aclose: the lease ends with the cancelled read."""
    rng = rng_for("cancel-no-close")
    async with HOLDERS[kind]() as holder:
        pub = publish(holder.store, rng, [64 << 20], chunk_size=64 << 20)
        conn = await holder.connect()
        buf = np.zeros(64 << 20, dtype=np.uint8)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_into, conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
            await landing(buf, 0)
            nursery.cancel_scope.cancel()
        with trio.fail_after(10):
            await pub.local.drained.wait()
        await conn.aclose()


@needs_shm
async def test_a_corrupting_holder_flips_a_byte_of_what_the_reader_gets() -> None:
    rng = rng_for("shm-corrupt")
    async with tcp_holder(ShmConnection, corrupt=1) as holder:
        pub = publish(holder.store, rng, [10_000], chunk_size=10_000)
        conn = await holder.connect()
        for flipped in (True, False):
            buf = np.zeros(10_000, dtype=np.uint8)
            await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
            assert bool(buf[0] != pub.data[0]) is flipped
            assert np.array_equal(buf[1:], pub.data[1:10_000])
        await conn.aclose()


@needs_shm
@pytest.mark.parametrize("arrays", ["plain", "shared"])
async def test_verify_runs_after_the_copy_and_its_error_follows_shm_done(
        arrays: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy and check share one worker-thread call; a failed check still ends the lease
    in step, then surfaces."""
    if arrays == "shared":
        monkeypatch.setattr(transport_conformance, "EMPTY", shared_empty)
    rng = rng_for(f"shm-verify-{arrays}")
    async with tcp_holder(ShmConnection) as holder:
        pub = publish(holder.store, rng, [10_000], chunk_size=10_000)
        conn = await holder.connect()
        seen: list[bytes] = []

        def verify(landed: Any) -> None:
            seen.append(b"".join(landed))
            raise IntegrityError("bad bytes", source="holder")

        buf = np.zeros(10_000, dtype=np.uint8)
        with pytest.raises(IntegrityError):
            await conn.read_chunk(pub.local.manifest.key, 0, [memoryview(buf)], verify)  # type: ignore[arg-type]
        assert seen == [pub.chunk(0).tobytes()]
        assert conn.transport == {"plain": "shm", "shared": "shm-memfd"}[arrays]
        with trio.fail_after(5):
            await pub.local.drained.wait()
        assert holder.sent == [10_000]  # the holder saw ShmDone
        await conn.aclose()


class _FastCheck:
    """A check against a chunk's xxh3-128 that a same-host copy may run as it copies
    (as the fetch's :class:`LocalDigestCheck`): records how it was asked."""

    algo = "xxh3-128"

    def __init__(self, expected: bytes) -> None:
        self.expected, self.asked = expected, list[str]()

    def _check(self, digest: bytes) -> None:
        if digest != self.expected:
            raise IntegrityError("bad bytes", source="holder")

    def __call__(self, landed: Sequence[memoryview]) -> None:
        self.asked.append("landed")
        self._check(xxhash.xxh3_128(b"".join(landed)).digest())

    def check_source(self, blocks: Any) -> None:
        self.asked.append("source")
        h = xxhash.xxh3_128()
        for b in blocks:
            h.update(b)
        self._check(h.digest())

    def check_digest(self, digest: bytes, seconds: float) -> None:
        self.asked.append("digest")
        assert seconds >= 0
        self._check(digest)


@needs_shm
@pytest.mark.parametrize("good", [True, False])
async def test_a_memfd_copy_computes_the_fast_digest_itself(good: bool,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """From memory files, a chunk checked against its xxh3-128 is hashed by the copy
    that lands it (one read of the holder's bytes), where the routine runs: the check
    gets the digest; a wrong one fails the read, after the whole chunk landed."""
    from tensorhub.transport.samehost import checked_copy

    monkeypatch.setattr(transport_conformance, "EMPTY", shared_empty)
    rng = rng_for(f"shm-one-pass-{good}")
    async with tcp_holder(ShmConnection) as holder:
        pub = publish(holder.store, rng, [300_001, 5, 70_000], chunk_size=200_003)
        conn = await holder.connect()
        for c in range(pub.local.manifest.num_chunks):
            want = xxhash.xxh3_128(pub.chunk(c).tobytes()).digest()
            check = _FastCheck(want if good else bytes(16))
            buf = np.zeros(len(pub.chunk(c)) + 3, dtype=np.uint8)[3:]  # misaligned
            parts = [memoryview(buf[:1000]), memoryview(buf[1000:])]
            if good:
                await conn.read_chunk(pub.local.manifest.key, c, parts, check)  # type: ignore[arg-type]
            else:
                with pytest.raises(IntegrityError):
                    await conn.read_chunk(pub.local.manifest.key, c, parts, check)  # type: ignore[arg-type]
            assert check.asked == ["digest" if checked_copy.available() else "source"]
            assert np.array_equal(buf, pub.chunk(c))
            if not good:
                break  # a chunk that failed its check ends the connection
        await conn.aclose()


# -- shared memory: version leases (complete holders of memory-file arrays) -------------


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_a_complete_memfd_holder_leases_the_whole_version_once() -> None:
    """One grant for the whole version, then no message per chunk; the lease holds (so
    unpublish waits) until the reader lets go, and the holder counts what it copied."""
    rng = rng_for("version-lease")
    async with tcp_holder(ShmConnection) as holder:
        pub = publish(holder.store, rng, [rng.randrange(1, 100_000) for _ in range(30)],
                      chunk_size=65_536 + 7)
        conn = await holder.connect()
        assert isinstance(conn, ShmConnection)
        order = list(range(pub.local.manifest.num_chunks)) * 2
        rng.shuffle(order)
        for c in order:
            await read_whole(conn, pub, c)
        assert (conn.version_leases, conn.chunk_grants) == (1, 0)
        assert conn.transport == "shm-memfd" and holder.sent == []
        await trio.testing.wait_all_tasks_blocked()
        assert pub.local.inflight == 1  # the version lease, between reads too
        await conn.aclose()
        with trio.fail_after(5):
            await pub.local.drained.wait()
        await wait_until(lambda: sum(holder.sent) >= sum(len(pub.chunk(c)) for c in order), 5,
                         every=0.001, what="the holder counting every chunk sent")
        assert sorted(holder.sent) == sorted(len(pub.chunk(c)) for c in order)


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
@pytest.mark.parametrize("ending", ["next read", "close", "read of another version",
                                    "manifest"])
async def test_unpublish_waits_for_the_version_lease_to_end(ending: str) -> None:
    rng = rng_for(f"version-lease-drain-{ending}")
    async with tcp_holder(ShmConnection) as holder:
        pub = publish(holder.store, rng, [50_000], chunk_size=16_384)
        other = publish(holder.store, rng, [20_000], chunk_size=16_384, version=2)
        key = pub.local.manifest.key
        conn = await holder.connect()
        buf = np.zeros(16_384, dtype=np.uint8)
        await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
        drained = trio.Event()

        async def unpublish() -> None:
            holder.store.hide(key)
            await holder.store.wait_drained(key)
            drained.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(unpublish)
            await trio.testing.wait_all_tasks_blocked()
            assert not drained.is_set() and pub.local.inflight == 1
            if ending == "next read":
                with pytest.raises(NotServing) as info:
                    await read_into(conn, pub, 1, [memoryview(buf)])  # type: ignore[arg-type]
                assert info.value.status == NOT_HELD
            elif ending == "close":
                await conn.aclose()
            elif ending == "manifest":
                assert await conn.read_manifest(other.local.manifest.key) \
                    == other.local.encoded_manifest
            else:
                await read_into(conn, other, 1, [memoryview(buf[:3616])])  # type: ignore[arg-type]
                assert np.array_equal(buf[:3616], other.chunk(1))
            with trio.fail_after(5):
                await drained.wait()
        assert holder.store.get(key) is None and not holder.bad
        await conn.aclose()


@pytest.fixture
def landings(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Each worker-thread call of the same-host reader's leased copies: the offset in
    the holder's file of each chunk it landed."""
    calls: list[list[int]] = []
    land = shm_reader._land_batch

    def counted(files: Any, jobs: Any) -> Any:
        calls.append([int(pieces[0, 2]) for pieces, _, _ in jobs])
        return land(files, jobs)

    monkeypatch.setattr(shm_reader, "_land_batch", counted)
    return calls


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_a_leased_batch_is_copied_and_checked_in_one_worker_thread_call(
        landings: list[list[int]]) -> None:
    rng = rng_for("leased-batch")
    async with tcp_holder(ShmConnection) as holder:
        pub = publish(holder.store, rng, [1_000_000, 1_100_000], chunk_size=300_000)
        key, count = pub.local.manifest.key, pub.local.manifest.num_chunks
        conn = await holder.connect()
        buf = np.zeros(len(pub.chunk(0)), dtype=np.uint8)
        await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]
        bufs = [np.zeros(len(pub.chunk(c)), dtype=np.uint8) for c in range(1, count)]
        got = await conn.read_chunks(key, range(1, count), [[memoryview(b)] for b in bufs],  # type: ignore[arg-type]
                                     [None] * (count - 1))
        assert got == [len(pub.chunk(c)) for c in range(1, count)]
        assert all(np.array_equal(b, pub.chunk(c)) for c, b in enumerate(bufs, 1))
        assert list(map(len, landings)) == [1, count - 1]
        assert isinstance(conn, ShmConnection) and conn.version_leases == 1
        await conn.aclose()
        with trio.fail_after(5):
            await pub.local.drained.wait()
        await wait_until(lambda: len(holder.sent) >= count, 5, every=0.001,
                         what="the holder counting every chunk copied under its lease")
        assert sorted(holder.sent) == sorted(len(pub.chunk(c)) for c in range(count))


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_a_first_batch_asks_for_the_lease_then_reads_the_rest_in_one_call(
        landings: list[list[int]]) -> None:
    """A stream's first batch on a fresh connection: the first chunk gets the version
    lease, the others are copied under it in one worker-thread call, not one by one."""
    rng = rng_for("first-batch")
    async with tcp_holder(ShmConnection) as holder:
        pub = publish(holder.store, rng, [1_000_000, 1_100_000], chunk_size=300_000)
        key, count = pub.local.manifest.key, pub.local.manifest.num_chunks
        conn = await holder.connect()
        bufs = [np.zeros(len(pub.chunk(c)), dtype=np.uint8) for c in range(count)]
        got = await conn.read_chunks(key, range(count), [[memoryview(b)] for b in bufs],  # type: ignore[arg-type]
                                     [None] * count)
        assert got == [len(pub.chunk(c)) for c in range(count)]
        assert all(np.array_equal(b, pub.chunk(c)) for c, b in enumerate(bufs))
        assert list(map(len, landings)) == [1, count - 1]
        assert isinstance(conn, ShmConnection) and conn.version_leases == 1
        await conn.aclose()


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_a_leased_batch_from_mapped_files_is_shared_by_the_copy_threads(
        landings: list[list[int]]) -> None:
    """Once every file a batch reads is mapped, the batch goes to the copy threads as
    consecutive parts of about equal bytes, queued at once; results stay in chunk order,
    a failed check in the last part included."""
    if shm_reader.copy_threads.pool.threads < 2:
        pytest.skip("one usable core: one copy thread")
    rng = rng_for("split-batch")
    async with tcp_holder(ShmConnection) as holder:
        pub = publish(holder.store, rng, [3_000_000], chunk_size=300_000)  # one file
        key, count = pub.local.manifest.key, pub.local.manifest.num_chunks
        conn = await holder.connect()
        buf = np.zeros(len(pub.chunk(0)), dtype=np.uint8)
        await read_into(conn, pub, 0, [memoryview(buf)])  # type: ignore[arg-type]

        class Bad(Exception):
            pass

        def refuse(_landed: Sequence[memoryview]) -> None:
            raise Bad("refused by the check")

        bufs = [np.zeros(len(pub.chunk(c)), dtype=np.uint8) for c in range(1, count)]
        verifies = [None] * (count - 2) + [refuse]
        got = await conn.read_chunks(key, range(1, count), [[memoryview(b)] for b in bufs],  # type: ignore[arg-type]
                                     verifies)
        assert got[:-1] == [len(pub.chunk(c)) for c in range(1, count - 1)]
        assert isinstance(got[-1], Bad)
        assert all(np.array_equal(b, pub.chunk(c)) for c, b in enumerate(bufs, 1))
        threads = shm_reader.copy_threads.pool.threads
        parts = landings[1:]
        assert len(parts) == min(threads, count - 1)
        assert [o for p in parts for o in p] == [c * 300_000 for c in range(1, count)]
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        await conn.aclose()


def reader_mappings(inode: int) -> list[str]:
    """The address ranges of this process's read-only shared mappings of the file
    ``inode`` (a reader's; the holder's own are writable)."""
    with open("/proc/self/maps") as maps:
        rows = [line.split() for line in maps]
    return [r[0] for r in rows if len(r) > 4 and r[4] == str(inode) and r[1] == "r--s"]


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_connections_share_one_mapping_until_the_holder_lets_go_of_its_file() -> None:
    """Mapping a holder's file (and faulting its pages in) happens once per reader
    process, not once per connection; the mapping goes once the holder closes the file
    (it would otherwise keep the holder's freed memory alive)."""
    rng = rng_for("mapping-cache")
    async with tcp_holder(ShmConnection) as holder:
        pub = publish(holder.store, rng, [300_000], chunk_size=100_000)
        pieces = memory_files.pieces_of(pub.local.segments(0))
        assert pieces is not None
        fd, inode = int(pieces[0][0]), int(pieces[0][1])
        seen = []
        for _ in range(3):  # connections one after another, as fetches make them
            conn = await holder.connect()
            for c in range(3):
                await read_whole(conn, pub, c)
            await conn.aclose()
            seen += reader_mappings(inode)
        assert len(seen) == 3 and len(set(seen)) == 1  # one mapping, kept all along
        assert memory_files.sweep_mappings(os.getpid()) >= 1  # the holder still has the file
        assert reader_mappings(inode) == seen[:1]

        key = pub.local.manifest.key
        holder.store.hide(key)
        await holder.store.wait_drained(key)
        del pub, pieces
        gc.collect()
        assert not os.path.exists(f"/proc/self/fd/{fd}") or os.fstat(fd).st_ino != inode
        # the sweeper thread notices within about a second
        await wait_until(lambda: not reader_mappings(inode), every=0.05,
                         what="the sweeper unmapping the gone file")

        # A new file, very likely under the same descriptor number: a new mapping.
        pub = publish(holder.store, rng, [300_000], chunk_size=100_000, version=2)
        conn = await holder.connect()
        await read_whole(conn, pub, 1)
        await conn.aclose()


@needs_shm
async def test_a_dead_holders_files_are_unmapped(holder_process: Any) -> None:
    proc, address, pub = holder_process(f"{SEED}:dead-mapped", 3 << 20, 1 << 20, "shared")
    conn = await ShmConnection.connect(address, "holder", 10)
    await read_whole(conn, pub, 1)
    ((_fd, inode),) = conn._files.mapped
    await conn.aclose()
    assert len(reader_mappings(inode)) == 1  # kept: the holder still has the file
    proc.kill()
    proc.wait(5)
    memory_files.sweep_mappings(proc.pid)
    gc.collect()
    assert not reader_mappings(inode)


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_a_holder_still_receiving_grants_chunk_by_chunk() -> None:
    """No version lease from an incomplete holder (partial-prefix serving): per-chunk
    grants, right bytes, NOT_YET for what it lacks."""
    rng = rng_for("version-lease-partial")
    async with tcp_holder(ShmConnection) as holder:
        pub = publish(holder.store, rng, [100_000], chunk_size=16_384, verified=False)
        for c in range(3):
            pub.local.mark_verified(c)
        conn = await holder.connect()
        assert isinstance(conn, ShmConnection)
        for c in (0, 2, 1):
            await read_whole(conn, pub, c)
        pub.local.end_receiving()
        buf = np.zeros(len(pub.chunk(3)), dtype=np.uint8)
        with pytest.raises(NotServing) as info:
            await read_into(conn, pub, 3, [memoryview(buf)])  # type: ignore[arg-type]
        assert info.value.status == NOT_YET
        assert (conn.version_leases, conn.chunk_grants) == (0, 3)
        assert conn.transport == "shm-memfd"
        await conn.aclose()
        with trio.fail_after(5):
            await pub.local.drained.wait()


@needs_shm
@pytest.mark.usefixtures("shared_arrays")
async def test_a_corrupting_memfd_holder_flips_the_first_chunk_read() -> None:
    rng = rng_for("version-lease-corrupt")
    async with tcp_holder(ShmConnection, corrupt=1) as holder:
        pub = publish(holder.store, rng, [30_000], chunk_size=10_000)
        conn = await holder.connect()
        assert isinstance(conn, ShmConnection)
        for c, flipped in ((1, True), (1, False), (2, False)):
            buf = np.zeros(10_000, dtype=np.uint8)
            await read_into(conn, pub, c, [memoryview(buf)])  # type: ignore[arg-type]
            assert bool(buf[0] != pub.chunk(c)[0]) is flipped
            assert np.array_equal(buf[1:], pub.chunk(c)[1:])
        assert (conn.version_leases, conn.chunk_grants) == (0, 3)
        await conn.aclose()


@needs_shm
async def test_holder_process_killed_during_a_version_lease(holder_process: Any) -> None:
    proc, address, pub = holder_process(f"{SEED}:lease-kill", 24 << 20, 4 << 20, "shared")
    conn = await ShmConnection.connect(address, "holder", 10)
    buf = np.zeros(4 << 20, dtype=np.uint8)
    for c in range(2):
        await read_into(conn, pub, c, [memoryview(buf)])  # type: ignore[arg-type]
        assert np.array_equal(buf, pub.chunk(c))
    assert (conn.version_leases, conn.chunk_grants) == (1, 0)
    proc.kill()
    proc.wait(5)
    with pytest.raises(TransportError, match="exited"):  # checked before each copy too
        await read_into(conn, pub, 2, [memoryview(buf)])  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="closed"):
        await read_into(conn, pub, 3, [memoryview(buf)])  # type: ignore[arg-type]
    await conn.aclose()


# -- shared memory: a holder that lies ---------------------------------------------------


@asynccontextmanager
async def fake_holder(answer: Callable[[Any], list[Any]]) -> AsyncIterator[str]:
    """A server that answers each request frame with the frames ``answer`` returns, on a
    TCP port and on the same-host socket of that address (one connection in all)."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    local = trio.socket.socket(trio.socket.AF_UNIX)
    await local.bind(local_name(address))
    local.listen(1)

    async def serve(on: trio.socket.SocketType) -> None:
        sock, _ = await on.accept()
        with sock:
            try:
                while True:
                    for frame in answer(await recv_frame(sock)):
                        await send_frame(sock, frame)
            except (TransportError, OSError):
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, listener)
        nursery.start_soon(serve, local)
        yield address
        nursery.cancel_scope.cancel()
    listener.close()
    local.close()


@asynccontextmanager
async def local_connection(address: str) -> AsyncIterator[trio.socket.SocketType]:
    """A raw connection to the same-host socket of the holder at ``address``."""
    sock = trio.socket.socket(trio.socket.AF_UNIX)
    with sock:
        await sock.connect(local_name(address))
        yield sock


def welcome(req: Any, **changes: Any) -> ShmWelcome:
    good = dict(req_id=req.req_id, pid=os.getpid(), token=shm_holder._token,
                token_at=shm_holder._token_at)
    return ShmWelcome(**{**good, **changes})


def gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


@needs_shm
@pytest.mark.parametrize("lie, error", [
    (lambda r: [Reply(r.req_id, 3, 0, "unexpected ShmHello")], "does not serve shared memory"),
    (lambda r: [welcome(r, token=bytes(16))], "another process"),
    (lambda r: [welcome(r, pid=gone_pid())], "another host or in another pid namespace"),
    (lambda r: [welcome(r, token_at=8)], "EFAULT"),
    (lambda r: [welcome(r, req_id=r.req_id + 1)], "out of turn"),
    (lambda r: [welcome(r, pid=0)], "malformed"),
])
async def test_connect_refuses_a_holder_it_cannot_read(lie: Any, error: str) -> None:
    async with fake_holder(lie) as address:
        with pytest.raises((TransportError, RemoteProtocolError), match=error):
            await ShmConnection.connect(address, "liar", 5)


KEY = VersionKey("m", 1)
BUF = np.zeros(4096, dtype=np.uint8)  # memory the fake holders below grant
AT = int(iovecs_of([memoryview(BUF)])[0, 0])  # type: ignore[arg-type]


def grants(*frames: tuple[int, list[tuple[int, int]], bool]) -> Callable[[Any], list[Any]]:
    def answer(req: Any) -> list[Any]:
        if isinstance(req, ShmHello):
            return [welcome(req)]
        return [ShmGrant(req.req_id, length, np.array(iov, dtype="<u8").tobytes(), more)
                for length, iov, more in frames]
    return answer


@needs_shm
@pytest.mark.parametrize("answer, error", [
    (grants((4096, [(AT, 4095)], False)), "granted 4095 of 4096"),
    (grants((4000, [(AT, 4000)], False)), "granted 4000 bytes for a 4096-byte chunk"),
    (grants((4096, [(AT, 4096), (AT, 1)], False)), "more than 4096"),
    (grants((4096, [(AT, 0), (AT, 4096)], False)), "malformed grant"),
    (grants((4096, [], True)), "malformed grant"),
    (grants((4096, [(AT, 1 << 40)], False)), "malformed grant"),
    (grants((4096, [(8, 4096)], False)), "EFAULT"),
    (lambda r: [welcome(r)] if isinstance(r, ShmHello) else
     [ShmGrant(r.req_id, 4096, b"x" * 15, False)], "malformed grant"),
])
async def test_read_refuses_a_bad_grant(answer: Any, error: str) -> None:
    async with fake_holder(answer) as address:
        conn = await ShmConnection.connect(address, "liar", 5)
        with pytest.raises((TransportError, RemoteProtocolError), match=error):
            await conn.read_chunk(KEY, 0, [memoryview(bytearray(4096))])
        with pytest.raises(TransportError, match="closed"):  # out of step: closed
            await conn.read_chunk(KEY, 0, [memoryview(bytearray(4096))])


SHARED = shared_empty(4096, np.uint8)  # a memory file the fake holders below grant
FD, INODE = (int(x) for x in memory_files.pieces_of([memoryview(SHARED)])[0, :2])  # type: ignore[index, arg-type]


def unsealed_file() -> tuple[int, int]:
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, 4096)
    return fd, os.fstat(fd).st_ino


UNSEALED = unsealed_file()


def file_grants(*frames: tuple[Any, list[tuple[int, int, int, int]], bool]
                ) -> Callable[[Any], list[Any]]:
    """Answers with ShmFileGrant frames (or a ShmGrant, for a frame whose kind is it)."""
    def answer(req: Any) -> list[Any]:
        if isinstance(req, ShmHello):
            return [welcome(req)]
        return [kind(req.req_id, 4096, np.array(rows, dtype="<u8").tobytes(), more)
                for kind, rows, more in frames]
    return answer


@needs_shm
async def test_read_maps_a_granted_memory_file() -> None:
    """The honest grant the lies below are made of: it reads, over ``shm-memfd``."""
    SHARED[:] = np.arange(4096) % 251
    async with fake_holder(file_grants((ShmFileGrant, [(FD, INODE, 0, 4096)], False))
                           ) as address:
        conn = await ShmConnection.connect(address, "holder", 5)
        buf = bytearray(4096)
        halves = [memoryview(buf)[:1000], memoryview(buf)[1000:]]
        assert await conn.read_chunk(KEY, 0, halves) == 4096
        assert bytes(buf) == SHARED.tobytes() and conn.transport == "shm-memfd"
        await conn.aclose()


@needs_shm
@pytest.mark.parametrize("answer, error", [
    (file_grants((ShmFileGrant, [(FD, INODE + 1, 0, 4096)], False)), "not the granted"),
    (file_grants((ShmFileGrant, [(FD, INODE, 1, 4096)], False)), "of a 4096-byte memory file"),
    (file_grants((ShmFileGrant, [(FD, INODE, 0, 2048), (FD, INODE, 4000, 2048)], False)),
     "of a 4096-byte memory file"),
    (file_grants((ShmFileGrant, [(1 << 30, INODE, 0, 4096)], False)), "opening memory file"),
    (file_grants((ShmFileGrant, [(*UNSEALED, 0, 4096)], False)), "sealed against shrinking"),
    (file_grants((ShmFileGrant, [(FD, INODE, 0, 0), (FD, INODE, 0, 4096)], False)),
     "malformed grant"),
    (file_grants((ShmFileGrant, [(1 << 31, INODE, 0, 4096)], False)), "malformed grant"),
    (file_grants((ShmFileGrant, [(FD, INODE, 1 << 62, 4096)], False)), "malformed grant"),
    (file_grants((ShmFileGrant, [(FD, INODE, 0, 2048)], True),
                 (ShmGrant, [(AT, 2048)], False)), "out of turn"),
    (lambda r: [welcome(r)] if isinstance(r, ShmHello) else
     [ShmFileGrant(r.req_id, 4096, b"x" * 31, False)], "malformed grant"),
])
async def test_read_refuses_a_bad_file_grant(answer: Any, error: str) -> None:
    async with fake_holder(answer) as address:
        conn = await ShmConnection.connect(address, "liar", 5)
        buf = bytearray(4096)
        with pytest.raises((TransportError, RemoteProtocolError), match=error):
            await conn.read_chunk(KEY, 0, [memoryview(buf)])
        assert not any(buf)
        with pytest.raises(TransportError, match="closed"):  # out of step: closed
            await conn.read_chunk(KEY, 0, [memoryview(bytearray(4096))])


def version_grants(*frames: tuple[int, int, list[tuple[int, int, int, int]], bool],
                   then: Sequence[Any] = ()) -> Callable[[Any], list[Any]]:
    """Answers a version request with ShmVersionGrant frames ``(length, chunk_size,
    rows, more)``, then the frames ``then``."""
    def answer(req: Any) -> list[Any]:
        if isinstance(req, ShmHello):
            return [welcome(req)]
        if isinstance(req, ShmVersionRequest):
            return [ShmVersionGrant(req.req_id, length, chunk, np.array(rows, "<u8").tobytes(),
                                    more) for length, chunk, rows, more in frames] + [*then]
        return []
    return answer


@needs_shm
async def test_read_maps_a_version_grant() -> None:
    SHARED[:] = np.arange(4096) % 253
    async with fake_holder(version_grants((4096, 1024, [(FD, INODE, 0, 1000),
                                                        (FD, INODE, 1000, 3096)], False))
                           ) as address:
        conn = await ShmConnection.connect(address, "holder", 5)
        for c in (3, 0, 1, 2):
            buf = bytearray(1024)
            assert await conn.read_chunk(KEY, c, [memoryview(buf)[:10],
                                                  memoryview(buf)[10:]]) == 1024
            assert bytes(buf) == SHARED[c * 1024:(c + 1) * 1024].tobytes()
        with pytest.raises(NotServing) as info:
            await conn.read_chunk(KEY, 4, [memoryview(bytearray(1024))])
        assert info.value.status == BAD_REQUEST
        assert (conn.version_leases, conn.chunk_grants) == (1, 0)
        await conn.aclose()


@needs_shm
@pytest.mark.parametrize("answer, error", [
    (version_grants((4096, 1024, [(FD, INODE + 1, 0, 4096)], False)), "not the granted"),
    (version_grants((4096, 1024, [(FD, INODE, 3500, 4096)], False)),
     "of a 4096-byte memory file"),
    (version_grants((4096, 1024, [(*UNSEALED, 0, 4096)], False)), "sealed against shrinking"),
    (version_grants((4096, 1024, [(FD, INODE, 0, 4095)], False)), "granted 4095 of 4096"),
    (version_grants((4096, 1024, [(FD, INODE, 0, 4096), (FD, INODE, 0, 1)], False)),
     "more than 4096"),
    (version_grants((4096, 1024, [(FD, INODE, 0, 0), (FD, INODE, 0, 4096)], False)),
     "malformed grant"),
    (version_grants((4096, 0, [(FD, INODE, 0, 4096)], False)), "malformed version grant"),
    (version_grants((4096, 1024, [(1 << 31, INODE, 0, 4096)], False)), "malformed grant"),
    (version_grants((4096, 1024, [(FD, INODE, 0, 2048)], True),
                    (4096, 2048, [(FD, INODE, 2048, 2048)], False)), "out of turn"),
    (version_grants((4096, 2048, [(FD, INODE, 0, 4096)], False)), "has 2048 bytes, not 1024"),
    (version_grants((4096, 1024, [(FD, INODE, 0, 4096)], False), then=[Reply(9, 0, 0)]),
     "out of turn"),
])
async def test_read_refuses_a_bad_version_grant(answer: Any, error: str) -> None:
    async with fake_holder(answer) as address:
        conn = await ShmConnection.connect(address, "liar", 5)
        buf = bytearray(1024)
        with pytest.raises((TransportError, RemoteProtocolError), match=error):
            await conn.read_chunk(KEY, 0, [memoryview(buf)])
            await trio.sleep(0.05)  # a frame out of turn is seen before the next read
            await conn.read_chunk(KEY, 1, [memoryview(buf)])
        with pytest.raises(TransportError, match="closed"):  # out of step: closed
            await conn.read_chunk(KEY, 0, [memoryview(bytearray(1024))])


# -- shared memory: the allocator -------------------------------------------------------


def maps_inode(inode: int) -> bool:
    """Whether this process maps the file with ``inode``."""
    with open("/proc/self/maps") as maps:
        return any(line.split()[4] == str(inode) for line in maps if len(line.split()) > 4)


def test_shared_arrays_are_registered_until_the_last_view_goes() -> None:
    before = memory_files.registered()
    arr = shared_empty((3, 1000), np.float32)
    assert arr.shape == (3, 1000) and arr.dtype == np.float32 and arr.flags.writeable
    pieces = memory_files.pieces_of([memoryview(arr)])  # type: ignore[arg-type]
    assert pieces is not None and memory_files.registered() == before + 1
    fd, inode, offset, length = (int(x) for x in pieces[0])
    assert (offset, length) == (0, 12_000) and maps_inode(inode)
    view = arr[1:]
    del arr
    assert memory_files.registered() == before + 1  # a view keeps the memory
    assert memory_files.pieces_of([memoryview(view)]).tolist() == [[fd, inode, 4000, 8000]]  # type: ignore[union-attr, arg-type]
    del view
    assert memory_files.registered() == before
    assert not maps_inode(inode)  # unmapped...
    assert not os.path.exists(f"/proc/self/fd/{fd}") or os.fstat(fd).st_ino != inode  # ...closed


def test_pieces_merge_neighbours_and_need_every_segment_shared() -> None:
    a, b = shared_empty(8192, np.uint8), shared_empty(100, np.uint8)
    (fa, ia, _, _), (fb, ib, _, _) = (memory_files.pieces_of([memoryview(x)])[0]  # type: ignore[index, arg-type]
                                      for x in (a, b))
    va, vb = memoryview(a), memoryview(b)  # type: ignore[arg-type]
    assert memory_files.pieces_of([va[10:20], va[20:20], va[20:30].toreadonly(), vb[5:], va[:1]]
                           ).tolist() == [[fa, ia, 10, 20], [fb, ib, 5, 95], [fa, ia, 0, 1]]  # type: ignore[union-attr]
    plain = memoryview(bytearray(10))
    assert memory_files.pieces_of([va[:10], plain]) is None
    assert memory_files.pieces_of([va[8000:], memoryview(np.empty(300, np.uint8))]) is None  # type: ignore[arg-type]
    assert memory_files.pieces_of([]) is None
    assert shared_empty(0, np.uint8).size == 0


def test_fetched_arrays_are_shared() -> None:
    """A fetcher re-serves what it fetched at memory speed: allocate_flat is shared."""
    specs = (TensorSpec("a", "<f4", (10, 3), 0), TensorSpec("b", "<f2", (7,), 120))
    manifest = Manifest("m", 1, specs, 4096, "xxh3-128", (bytes(16),))
    arrays, flat = allocate_flat(manifest)
    assert flat is not None
    pieces = memory_files.pieces_of([memoryview(a) for a in arrays])  # type: ignore[arg-type]
    assert pieces is not None and pieces[:, 2:].tolist() == [[0, 134]]


def inode_of(arr: np.ndarray[Any, Any]) -> int:
    pieces = memory_files.pieces_of([memoryview(arr)])  # type: ignore[arg-type]
    assert pieces is not None
    return int(pieces[0][1])


def fd_is(fd: int, inode: int) -> bool:
    return os.path.exists(f"/proc/self/fd/{fd}") and os.fstat(fd).st_ino == inode


def test_a_fetch_buffer_reuses_the_memory_file_of_the_last_one_let_go() -> None:
    memory_files.drop_spare()
    before = memory_files.registered()
    a = memory_files.fetch_buffer(3 * 4096 + 5)
    a[:] = 7
    first = inode_of(a)
    fd = int(memory_files.pieces_of([memoryview(a)])[0][0])  # type: ignore[index, arg-type]
    view = a[10:]
    del a
    assert memory_files.registered() == before + 1  # a view keeps it mapped
    del view
    assert memory_files.registered() == before and not maps_inode(first)
    assert fd_is(fd, first) and memory_files.spare_bytes() == 3 * 4096 + 5  # the spare
    b = memory_files.fetch_buffer(3 * 4096 + 5)
    assert inode_of(b) == first and b.flags.writeable and b.dtype == np.uint8
    assert bool((b == 7).all())  # the same pages, mapped again (and the caller's to fill)
    b[:] = 1
    del b
    c = memory_files.fetch_buffer(4096)  # another size: a new file, the spare closed
    assert inode_of(c) != first and not fd_is(fd, first)
    del c
    assert memory_files.drop_spare() and not memory_files.drop_spare()
    assert memory_files.registered() == before and memory_files.spare_bytes() == 0


def test_only_the_last_fetch_buffer_let_go_is_kept() -> None:
    memory_files.drop_spare()
    a, b = memory_files.fetch_buffer(8192), memory_files.fetch_buffer(8192)
    ia, ib = inode_of(a), inode_of(b)
    fa = int(memory_files.pieces_of([memoryview(a)])[0][0])  # type: ignore[index, arg-type]
    del a, b  # a is let go first, then b replaces it as the spare
    assert not fd_is(fa, ia)
    c = memory_files.fetch_buffer(8192)
    assert inode_of(c) == ib
    d = memory_files.fetch_buffer(8192)  # nothing spare: a new file
    assert inode_of(d) not in (ia, ib)
    del c, d
    memory_files.drop_spare()


def test_shared_empty_memory_is_never_kept() -> None:
    memory_files.drop_spare()
    a = shared_empty(8192, np.uint8)
    inode = inode_of(a)
    del a
    assert not memory_files.drop_spare()
    b = memory_files.fetch_buffer(8192)
    assert inode_of(b) != inode
    del b
    memory_files.drop_spare()


# -- TCP: the reader's standing thread ---------------------------------------------------


async def test_tcp_frame_nobody_asked_for_closes_the_connection() -> None:
    """A holder that answers twice: the extra frame ends the connection, and never lands
    in a later read's memory."""
    def twice(req: Any) -> list[Any]:
        return [Reply(req.req_id, NOT_YET, 0, "not yet"), Reply(req.req_id + 100, 0, 4096)]

    async with fake_holder(twice) as address:
        conn = await TcpConnection.connect(address, "liar", 5)
        dest = [memoryview(bytearray(4096))]
        with pytest.raises(NotServing):
            await conn.read_chunk(KEY, 0, dest)
        with pytest.raises((TransportError, RemoteProtocolError),
                           match=r"nobody asked for|out of turn"):
            await conn.read_chunk(KEY, 0, dest)
        assert not any(dest[0])
        with pytest.raises((TransportError, OSError)):  # out of step: closed
            await conn.read_chunk(KEY, 0, dest)
        await conn.aclose()


STREAM_LIES = {
    "another chunk": lambda r: [ChunkReply(r.req_id, r.first + 1, NOT_YET, 0)],
    "another run": lambda r: [ChunkReply(r.req_id + 1, r.first, NOT_YET, 0)],
    "a plain reply": lambda r: [Reply(r.req_id, NOT_YET, 0)],
    "a wrong length": lambda r: [ChunkReply(r.req_id, r.first, 0, 4095)],
    "a refusal, then another chunk": lambda r: [ChunkReply(r.req_id, r.first, NOT_YET, 0),
                                                ChunkReply(r.req_id, r.first + 2, 0, 4096)],
}


@pytest.mark.parametrize("lie", sorted(STREAM_LIES))
async def test_tcp_stream_refuses_replies_out_of_turn(lie: str) -> None:
    """A holder that answers a run out of turn ends the stream with a protocol error;
    nothing lands, nothing that came before the lie is affected."""
    answer = STREAM_LIES[lie]

    def serve(req: Any) -> list[Any]:
        return answer(req) if isinstance(req, ChunkRunRequest) else []

    async with fake_holder(serve) as address:
        conn = await TcpConnection.connect(address, "liar", 5)
        dests = {c: memoryview(bytearray(4096)) for c in range(3)}
        reported: list[tuple[int, int | Exception]] = []
        taken: list[int] = []

        def take(_budget: int) -> list[tuple[int, Any, Any]]:
            run = [c for c in dests if c not in taken]
            taken.extend(run)
            return [(c, [dests[c]], None) for c in run]

        def landed(c: int, result: int | Exception) -> bool:
            reported.append((c, result))
            return True

        with pytest.raises((TransportError, RemoteProtocolError),
                           match=r"nobody asked for|out of turn|expected 4096"):
            with trio.fail_after(10):
                await conn.stream_chunks(KEY, take, landed, StreamWindow(4096, 1 << 20))
        assert all(isinstance(r, NotServing) for _, r in reported)
        assert not any(any(d) for d in dests.values())
        assert not conn.reusable()
        await conn.aclose()


async def test_tcp_idle_connection_outlives_the_reader_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader thread's socket timeout is a safety net for a reply asked for; between
    reads the connection waits as long as it is open."""
    monkeypatch.setattr(tcp, "_THREAD_TIMEOUT", 0.2)
    idle: list[int] = []
    on_idle = TcpConnection._on_idle

    def counted(self: TcpConnection, token: trio.lowlevel.TrioToken) -> None:
        idle.append(1)
        on_idle(self, token)

    monkeypatch.setattr(TcpConnection, "_on_idle", counted)
    rng = rng_for("tcp-idle")
    async with tcp_holder(TcpConnection) as holder:
        pub = publish(holder.store, rng, [10_000], chunk_size=4096)
        conn = await holder.connect()

        async def two_timeouts_pass() -> None:
            want = len(idle) + 2
            await wait_until(lambda: len(idle) >= want, what="two idle timeouts")

        for _ in range(2):
            await read_whole(conn, pub, 1)
            await two_timeouts_pass()  # with nothing asked
        await conn.aclose()
