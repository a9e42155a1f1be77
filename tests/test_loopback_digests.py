"""A TCP connection to a holder that shares memory with the reader (this host, this
user, memory the reader reads) checks chunks against the fast local digests; any other
is left on the cryptographic ones, and says why
(:mod:`tensorhub.transport.samehost.loopback`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import trio
from corrupting import corrupt_served
from helpers import open_mesh

from tensorhub import VersionUnavailable
from tensorhub.transport.samehost.loopback import (
    holds_socket,
    peer_socket_inode,
    prove_holder_shares_memory,
)
from tensorhub.transport.samehost.process_vm import shm_available
from tensorhub.transport.tcp import TcpConnection

OK, WHY = shm_available()
needs_proof = pytest.mark.skipif(not OK, reason=f"reading another process's memory: {WHY}")


def weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((1 << 20,)).astype(np.float32),
            "b": rng.standard_normal(999).astype(np.float16)}


TCP = ("tcp",)  # a holder and a reader over TCP only, with these host labels
SAME_HOST = [{"host": "box"}, {"host": "box"}]


@needs_proof
async def test_a_same_host_holder_over_tcp_is_checked_with_the_fast_digests() -> None:
    async with open_mesh(2, peer_labels=SAME_HOST, transports=TCP) as (pub, r):
        w = weights(1)
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        got = await r.fetch("m", 1)
        assert got.report.transport_by_source == {"p0": "tcp"}
        assert got.report.local_digest_chunks == got.report.chunks > 0
        assert "holds the connection" in r.statistics().tcp_local_digests["p0"]
        for k in w:
            np.testing.assert_array_equal(got.tensors[k], w[k])


@needs_proof
async def test_bad_bytes_from_a_same_host_holder_over_tcp_fail_the_fast_digest() -> None:
    async with open_mesh(2, peer_labels=SAME_HOST, transports=TCP,
                         planning=False) as (pub, r):
        await pub.publish("m", 1, weights(2))
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        corrupt_served(pub, 1)
        with pytest.raises(VersionUnavailable, match="failed its digest"):
            await r.fetch("m", 1)
        assert r.statistics().integrity_failures == {"p0": 1}
        assert "holds the connection" in r.statistics().tcp_local_digests["p0"]


async def test_a_holder_labelled_on_another_host_is_not_asked_for_the_proof() -> None:
    async with open_mesh(2, peer_labels=[{"host": "box"}, {"host": "other"}],
                         transports=TCP) as (pub, r):
        await pub.publish("m", 1, weights(3))
        with trio.fail_after(10):
            await r.wait_for_version("m", None)
        got = await r.fetch("m", 1)
        assert got.report.local_digest_chunks == 0 and got.report.chunks > 0
        assert r.statistics().tcp_local_digests == {}


RELAY = r"""
import socket, sys, threading
target = (sys.argv[1], int(sys.argv[2]))
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
a, _ = srv.accept()
b = socket.create_connection(target)
def pump(x, y):
    while data := x.recv(65536):
        y.sendall(data)
    y.shutdown(socket.SHUT_WR)
threading.Thread(target=pump, args=(b, a), daemon=True).start()
pump(a, b)
"""


@contextmanager
def relay_to(address: str) -> Iterator[str]:
    """A process that forwards one TCP connection to ``address``: its address."""
    host, _, port = address.rpartition(":")
    proc = subprocess.Popen([sys.executable, "-c", RELAY, host, port], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        yield f"127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.kill()
        proc.wait()


@needs_proof
async def test_a_connection_whose_other_end_another_process_holds_is_not_trusted() -> None:
    """A relay in between: the holder answers the same-host handshake, but the TCP
    socket at the other end of the reader's connection is the relay's."""
    async with open_mesh(2, peer_labels=SAME_HOST, transports=TCP) as (pub, _r):
        with relay_to(pub.info.data) as relayed:
            conn = await TcpConnection.connect(relayed, "p0", 5)
            try:
                why = await prove_holder_shares_memory(conn, pub.info.data, 5, None)
            finally:
                await conn.aclose()
        assert "does not hold the connection's socket" in why, why
        assert not conn.holder_shares_memory
        direct = await TcpConnection.connect(pub.info.data, "p0", 5)
        try:
            why = await prove_holder_shares_memory(direct, pub.info.data, 5, None)
        finally:
            await direct.aclose()
        assert direct.holder_shares_memory, why


async def test_a_holder_with_no_same_host_socket_is_not_trusted() -> None:
    """A TCP server on this host that is no peer: the handshake finds nobody."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        address = f"127.0.0.1:{srv.getsockname()[1]}"
        conn = await TcpConnection.connect(address, "stranger", 5)
        try:
            why = await prove_holder_shares_memory(conn, address, 2, None)  # never accepted
        finally:
            await conn.aclose()
    assert why.startswith("no same-host handshake"), why
    assert not conn.holder_shares_memory


def test_the_other_end_of_a_loopback_connection_is_found_in_the_kernels_table() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv, \
            socket.create_connection(srv.getsockname()) as mine:
        theirs, _ = srv.accept()
        with theirs:
            inode = peer_socket_inode(mine)
            assert inode == Path(f"/proc/self/fd/{theirs.fileno()}").stat().st_ino
            assert holds_socket(os.getpid(), inode)
            assert peer_socket_inode(theirs) == Path(
                f"/proc/self/fd/{mine.fileno()}").stat().st_ino
        assert peer_socket_inode(mine, tables=("/nonexistent",)) is None


def test_a_socket_nobody_holds_is_held_by_nobody() -> None:
    with socket.socket() as s:
        inode = Path(f"/proc/self/fd/{s.fileno()}").stat().st_ino
    assert not holds_socket(os.getpid(), inode)  # closed: no longer in our table
    assert not holds_socket(2**22 + 12345, 1)  # no such process


HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   "
          "uid  timeout inode\n")


def test_the_kernels_table_is_parsed_for_ipv4_and_ipv6(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv, \
            socket.create_connection(srv.getsockname()) as mine:
        srv.accept()[0].close()
        mport, tport = mine.getsockname()[1], srv.getsockname()[1]
        v4 = f"   0: 0100007F:{tport:04X} 0100007F:{mport:04X} 01 0:0 0:0 0 1000 0 4242\n"
        mapped = "0000000000000000FFFF00000100007F"  # ::ffff:127.0.0.1, words in host order
        v6 = f"   0: {mapped}:{tport:04X} {mapped}:{mport:04X} 01 0:0 0:0 0 1000 0 4343\n"
        closing = v4.replace(" 01 ", " 06 ")  # not established
        queued = v4.replace(" 4242", " 0")  # not accepted yet: no inode
        table = tmp_path / "tcp"
        for rows, want in ((v4, 4242), (v6, 4343), (queued, 0), (closing, None),
                           ("junk\n", None), ("   0: zz:zz zz:zz 01 0 0 0 0 0 0 1\n", None)):
            table.write_text(HEADER + rows)
            assert peer_socket_inode(mine, tables=(str(table),)) == want, rows


def test_only_a_check_against_the_local_digests_may_read_the_holders_bytes() -> None:
    """A copying transport may run a check on the holder's memory as it copies only when
    the check is against the fast local digests (the holder could write this process's
    memory anyway); a cryptographic check reads what landed."""
    from tensorhub.read.transfer import DigestCheck, LocalDigestCheck
    from tensorhub.transport.base import checks_source

    fast = LocalDigestCheck(None, 0, "p0", "xxh3-128", b"")  # type: ignore[arg-type]
    strong = DigestCheck(None, 0, "p0", "blake3", b"")  # type: ignore[arg-type]
    assert checks_source(fast)
    assert not checks_source(strong)
