"""Whether a TCP data connection's holder is a process of this host whose memory this
one reads, so that its chunks may be checked against the manifest's fast local digests.

The same-host transport shows it in its handshake (:mod:`.reader`), and a fetch then
checks what it copies against ``Manifest.local_digests``: a holder that is this user's
(or root's) process, whose memory this one reads, could write this process's memory
too, so a cryptographic digest guards against nothing it could not do anyway.  A reader
that fetches from such a holder over TCP (loopback, or any address of this host) pays
the cryptographic check for nothing; :func:`prove_holder_shares_memory` shows the same
fact for a TCP connection, in three steps:

1. The other end of the connection is a socket of this network namespace: the kernel's
   table of TCP sockets (``/proc/net/tcp``, ``/proc/net/tcp6``) lists an established
   one whose local address is this connection's peer address and whose remote address
   is this connection's own.  Its inode names it.
2. The holder's same-host handshake (over its Unix socket, whose kernel-reported
   credentials say who answers: :class:`.reader.ShmConnection`) shows a process ``P``
   of this user (or root) holding the holder's name, whose memory this one reads.
3. ``P`` has that very socket open: ``/proc/P/fd`` links to ``socket:[inode]``.
   (Reading it needs the ptrace permission that step 2 showed.)

Anything else -- the holder in another network namespace or on another host, another
user's process, a kernel that forbids reading other processes' memory, a socket held
by some process other than the one that answered -- leaves the connection on the
cryptographic digests, and the reason is kept.  No step is skipped for speed: the proof
runs once per connection opened, and connections are kept between reads
(:mod:`tensorhub.read.connections`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import trio

from ...errors import RemoteProtocolError, TransportError
from ..base import NotServing
from ..handshake import DataAuth
from ..tcp import TcpConnection
from .reader import ShmConnection

_ESTABLISHED = "01"  # the state column of /proc/net/tcp


def _endpoint(field: str) -> tuple[str, int]:
    """``(address, port)`` of a ``/proc/net/tcp{,6}`` address column (hex words in the
    host's byte order), IPv4-mapped IPv6 addresses as IPv4."""
    host, _, port = field.partition(":")
    raw = b"".join(int(host[i:i + 8], 16).to_bytes(4, "little")
                   for i in range(0, len(host), 8))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), int(port, 16)


def _normal(name: tuple[str, int] | tuple[str, int, int, int]) -> tuple[str, int]:
    address = ipaddress.ip_address(name[0].partition("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), name[1]


def peer_socket_inode(sock: socket.socket | trio.socket.SocketType,
                      tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")
                      ) -> int | None:
    """The inode of the socket at the other end of TCP connection ``sock`` if that
    socket lives in this network namespace (an established entry of ``tables`` runs from
    our peer's address to ours), else None; 0 while the holder has not accepted the
    connection yet (the kernel lists it with no inode until then)."""
    mine, theirs = _normal(sock.getsockname()), _normal(sock.getpeername())
    for table in tables:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != _ESTABLISHED:
                continue
            try:
                if _endpoint(cols[1]) == theirs and _endpoint(cols[2]) == mine:
                    return int(cols[9])
            except ValueError:
                continue
    return None


def holds_socket(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has the socket ``inode`` open."""
    want = f"socket:[{inode}]"
    fds = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fds)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(fds / name) == want:
                return True
        except OSError:
            continue
    return False


async def prove_holder_shares_memory(conn: TcpConnection, address: str, timeout: float,
                                     auth: DataAuth | None) -> str:
    """Mark ``conn`` (to the holder whose data address is ``address``) as one whose
    holder shares memory with this process if the three steps of the module docstring
    show it; returns what was found, either way."""
    if await trio.to_thread.run_sync(peer_socket_inode, conn.sock) is None:
        return "the holder's end of the connection is not in this network namespace"
    try:
        shm = await ShmConnection.connect(address, conn.peer, timeout, auth)
    except (TransportError, RemoteProtocolError, NotServing, OSError) as exc:
        return f"no same-host handshake: {exc}"
    try:
        pid, shares = shm.holder_pid, shm.holder_shares_memory
    finally:
        await shm.aclose()
    if not shares:
        return f"pid {pid} is not this user's process (nor root's)"
    inode = await _accepted(conn, timeout)
    if not inode:
        return f"pid {pid} did not accept the connection within {timeout}s"
    if not await trio.to_thread.run_sync(holds_socket, pid, inode):
        return f"pid {pid} answered the handshake but does not hold the connection's socket"
    conn.holder_shares_memory = True
    return f"pid {pid}, a process of this user that this one reads, holds the connection"


ACCEPT_POLL = 0.005
"""Seconds between looks at the kernel's table while the holder has not accepted yet."""


async def _accepted(conn: TcpConnection, timeout: float) -> int | None:
    """The inode of the holder's end of ``conn`` once the holder has accepted it (a
    connection completes before the holder's server takes it from its queue); None if
    it is gone or not accepted within ``timeout``."""
    with trio.move_on_after(timeout):
        # the kernel's table grows with the host's connections: read it off the loop
        while (inode := await trio.to_thread.run_sync(peer_socket_inode, conn.sock)) == 0:
            await trio.sleep(ACCEPT_POLL)
        return inode
    return None
