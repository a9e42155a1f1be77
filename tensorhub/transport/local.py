"""The same-host control socket: where a holder answers same-host requests, and who asks.

Same-host requests (``ShmHello``, ``ShmChunkRequest``, ``ShmVersionRequest``) lease the
holder's memory to the asker, so they are answered only over a Unix-domain socket, whose
kernel says who is at the other end (``SO_PEERCRED``: pid, uid, gid).  A holder answers
only its own user (or root); the TCP data port refuses these requests.

The socket lives in the abstract namespace (no file to clean up; it vanishes with the
process) under a name derived from the holder's advertised data address, so a reader
that knows that address finds it without another field in ``PeerInfo``.  The abstract
namespace belongs to the network namespace: a holder in another one is not found, and
the reader uses TCP, as it would for another host.
"""

from __future__ import annotations

import os
import socket
import struct

import trio

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def local_name(data_address: str) -> bytes:
    """The abstract-namespace name of the holder's same-host socket."""
    return b"\0tensorhub-data:" + data_address.encode()


def credentials(sock: trio.socket.SocketType) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket, as the
    kernel recorded them when the connection was made."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return pid, uid, gid


def same_user(uid: int) -> bool:
    """Whether a process of user ``uid`` may lease this process's memory: the same user
    (who could read it with ptrace anyway), or root."""
    return uid in (os.getuid(), 0)
