"""The data server under hostile or hung clients: memory, descriptors, caps, rates.

Servers under load run in their own process (their memory and descriptors are what is
measured); the caps and timers are checked on a server in this process.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from helpers import wait_until

from tensorhub.config import PeerConfig
from tensorhub.errors import ConfigError
from tensorhub.peer.node import open_peer
from tensorhub.protocol.dataplane import (
    BAD_REQUEST,
    MAX_FRAME,
    OK,
    ManifestRequest,
    Reply,
    ShmChunkRequest,
    ShmHello,
    ShmVersionRequest,
)
from tensorhub.read.store import Store
from tensorhub.testing.conformance import Published, publish, running
from tensorhub.transport.admission import ServerLimits
from tensorhub.transport.frames import encode_frame, recv_exact, recv_frame
from tensorhub.transport.samehost.reader import ShmConnection
from tensorhub.transport.server import TcpServer
from tensorhub.transport.tcp import TcpConnection

ROOT = Path(__file__).resolve().parents[1]
SEED = random.randrange(2**32)
print(f"tests/test_dataplane_limits.py: seed {SEED}")

SERVER_PROCESS = """
import dataclasses, json, random, resource, sys, trio
sys.path.insert(0, "tests")
import tensorhub.testing.conformance as transport_conformance
from tensorhub.config import PeerConfig
from tensorhub.errors import ConfigError
from tensorhub.peer.node import open_peer
from tensorhub.read.store import Store
from tensorhub.transport.admission import ServerLimits
from tensorhub.transport.server import TcpServer
from tensorhub.transport.samehost.reader import ShmConnection
seed, size, chunk, nofile, limits = sys.argv[1:6]
store = Store()
transport_conformance.publish(store, random.Random(seed), [int(size)], int(chunk))
server = TcpServer(store, lambda peer, n: None, lambda what: None,
                   ServerLimits(**json.loads(limits)))
print("port", server.bind("127.0.0.1", 0), flush=True)
if int(nofile):
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(nofile), int(nofile)))

async def main():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve)
        while await trio.to_thread.run_sync(sys.stdin.readline):
            print(json.dumps(dataclasses.asdict(server.statistics())), flush=True)
        nursery.cancel_scope.cancel()

trio.run(main)
"""


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[str], address: str, pub: Published) -> None:
        self.proc = proc
        self.address = address
        self.pub = pub

    def stats(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        got: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return got

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")

    async def until(self, what: str, pred: Any) -> dict[str, Any]:
        """Ask for statistics until ``pred(stats)`` (the server is another process: there
        is nothing to wait on but its answers)."""
        last: list[dict[str, Any]] = []

        def holds() -> bool:
            last[:] = [self.stats()]
            return bool(pred(last[0]))

        await wait_until(holds, 30, every=0.05, what=what)
        return last[0]


@pytest.fixture
def server_process() -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def start(nofile: int = 0, **limits: Any) -> ServerProcess:
        seed = f"{SEED}:{len(procs)}"
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_PROCESS, seed, str(1 << 20), str(1 << 18),
             str(nofile), json.dumps(limits)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith("port "):
            line = proc.stdout.readline()
        assert line, "server process did not start"
        pub = publish(Store(), random.Random(seed), [1 << 20], 1 << 18)
        return ServerProcess(proc, f"127.0.0.1:{line.split()[1]}", pub)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(5)


def raw(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=30)


async def read_all_chunks(address: str, pub: Published) -> None:
    conn = await TcpConnection.connect(address, "holder", 5)
    try:
        for c in range(pub.local.manifest.num_chunks):
            buf = np.zeros(len(pub.chunk(c)), dtype=np.uint8)
            await conn.read_chunk(pub.local.manifest.key, c, [memoryview(buf)])
            assert np.array_equal(buf, pub.chunk(c))
    finally:
        await conn.aclose()


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


async def test_stalled_frames_hold_no_memory_and_time_out(server_process: Any) -> None:
    """320 clients each declare a maximal frame, send a few bytes and hang: the server
    allocates nothing for what never arrived, serves another reader meanwhile, and
    closes every stalled connection after ``frame_timeout``."""
    server = server_process(max_connections=512, max_connections_per_address=512,
                            frame_timeout=2.0)
    await read_all_chunks(server.address, server.pub)  # warm: imports, buffers
    before = server.rss()
    hung = [raw(server.address) for _ in range(320)]
    try:
        for sock in hung:
            sock.sendall(struct.pack(">I", MAX_FRAME) + b"\x95" * 100)
        await server.until("all connected", lambda s: s["connections_open"] >= 320)
        grown = server.rss() - before
        assert grown < 32 << 20, f"RSS grew {grown >> 20} MiB for 320 stalled frames"
        await read_all_chunks(server.address, server.pub)
        stats = await server.until("timed out", lambda s: s["frame_timeouts"] >= 320)
        assert stats["connections_open"] == 0
        assert all(closed_by_server(sock) for sock in hung)
    finally:
        for sock in hung:
            sock.close()


async def test_out_of_descriptors_the_server_backs_off_and_serves_on(
        server_process: Any) -> None:
    """With 64 descriptors and 100 idle connections, accept() fails with EMFILE: the
    server counts it, backs off, keeps serving a reader already connected (even a chunk
    send that cannot get a thread-side descriptor), and accepts again once clients go."""
    server = server_process(nofile=64, max_connections=1000,
                            max_connections_per_address=1000)
    keeper = await TcpConnection.connect(server.address, "holder", 5)
    key = server.pub.local.manifest.key
    assert await keeper.read_manifest(key) == server.pub.local.encoded_manifest
    idle = [raw(server.address) for _ in range(100)]
    try:
        stats = await server.until("out of descriptors", lambda s: s["accept_errors"] > 0)
        assert stats["connections_open"] < 64
        assert await keeper.read_manifest(key) == server.pub.local.encoded_manifest
        buf = np.zeros(len(server.pub.chunk(0)), dtype=np.uint8)
        await keeper.read_chunk(key, 0, [memoryview(buf)])
        assert np.array_equal(buf, server.pub.chunk(0))
    finally:
        for sock in idle:
            sock.close()
        await keeper.aclose()
    await server.until("drained", lambda s: s["connections_open"] == 0
                       and s["connections_accepted"] >= 101)
    await read_all_chunks(server.address, server.pub)
    assert server.proc.poll() is None


@asynccontextmanager
async def served(**limits: Any) -> AsyncIterator[tuple[TcpServer, str, Published]]:
    store = Store()
    pub = publish(store, random.Random(SEED), [100_000], 4096)
    server = TcpServer(store, lambda peer, n: None, lambda what: None, ServerLimits(**limits))
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    async with running(server):
        yield server, address, pub


async def hung_up(sock: trio.socket.SocketType) -> None:
    with trio.fail_after(10):
        while await sock.recv(1 << 16):
            pass


async def connect(address: str) -> trio.socket.SocketType:
    host, _, port = address.rpartition(":")
    sock = trio.socket.socket()
    await sock.connect((host, int(port)))
    return sock


async def test_connections_over_a_cap_are_closed_and_counted() -> None:
    async with served(max_connections=3, max_connections_per_address=2) as (server, addr, _pub):
        first, second = await connect(addr), await connect(addr)
        third = await connect(addr)
        with first, second, third:
            await hung_up(third)  # over the per-address cap
            assert server.statistics().refused_over_address == 1
            await first.send(encode_frame(ManifestRequest(1, "m", 1)))
            reply = await recv_frame(first)
            assert isinstance(reply, Reply) and reply.status == OK  # the others still served
        await trio.testing.wait_all_tasks_blocked()
        assert server.statistics().connections_open == 0


async def test_idle_connections_are_closed_and_counted() -> None:
    async with served(idle_timeout=0.2) as (server, addr, _pub):
        with await connect(addr) as sock:
            await hung_up(sock)
        assert server.statistics().idle_closed == 1


async def test_a_request_flood_is_throttled_not_refused() -> None:
    async with served(requests_per_second=100) as (server, addr, _pub):
        with await connect(addr) as sock:
            await sock.send(b"".join(encode_frame(ManifestRequest(i, "m", 1)) for i in range(250)))
            for i in range(250):
                reply = await recv_frame(sock)
                assert isinstance(reply, Reply) and (reply.req_id, reply.status) == (i, OK)
                await recv_exact(sock, memoryview(bytearray(reply.length)))
        assert server.statistics().throttled >= 100


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigError):
        ServerLimits(max_connections=4, max_connections_per_address=8)
    with pytest.raises(ConfigError):
        ServerLimits(lease_timeout=float("inf"))
    with pytest.raises(ConfigError):
        PeerConfig.local("p", data_max_connections=0)
    with pytest.raises(ConfigError):
        PeerConfig.local("p", data_frame_timeout=0)


# -- same-host requests: only on the local socket, only from the same user -------------


async def test_same_host_requests_over_tcp_are_refused() -> None:
    async with served() as (server, addr, pub):
        key = pub.local.manifest.key
        with await connect(addr) as sock:
            for req in (ShmHello(1), ShmChunkRequest(2, key.model, key.version, 0),
                        ShmVersionRequest(3, key.model, key.version, 0)):
                await sock.send(encode_frame(req))
                reply = await recv_frame(sock)
                assert reply == Reply(req.req_id, BAD_REQUEST, 0, reply.detail)
                assert "local socket" in reply.detail
            await sock.send(encode_frame(ManifestRequest(4, key.model, key.version)))
            reply = await recv_frame(sock)  # the connection stays usable for TCP requests
            assert isinstance(reply, Reply) and reply.status == OK
        assert server.statistics().shm_over_tcp == 3
        assert pub.local.inflight == 0


OTHER_USER = """
import os, socket, sys
from tensorhub.transport.local import local_name
os.setgid(65534)
os.setuid(65534)  # before connecting: the kernel records who connects
sock = socket.socket(socket.AF_UNIX)
sock.connect(local_name(sys.argv[1]))
try:
    sock.sendall(bytes.fromhex(sys.argv[2]))
    print(sock.recv(1 << 16).hex(), flush=True)
except (ConnectionResetError, BrokenPipeError):
    print("reset", flush=True)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
async def test_the_local_socket_refuses_another_user() -> None:
    async with served() as (server, addr, _pub):
        proc = await trio.run_process(
            [sys.executable, "-c", OTHER_USER, addr, encode_frame(ShmHello(1)).hex()],
            cwd=ROOT, capture_stdout=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.stdout.decode().strip() in ("", "reset")  # closed before any answer
        assert server.statistics().refused_credentials == 1
        conn = await ShmConnection.connect(addr, "holder", 5)  # our own user is served
        await conn.aclose()


async def test_a_peer_applies_its_config_and_reports_its_data_server() -> None:
    config = PeerConfig.local("p", data_max_connections=4,
                              data_max_connections_per_address=1)
    async with open_peer(config) as peer:
        first, second = await connect(peer.info.data), await connect(peer.info.data)
        with first, second:
            await hung_up(second)
        stats = peer.statistics().data_server
        assert stats is not None and stats.refused_over_address == 1
        assert stats.auth.startswith("insecure")
