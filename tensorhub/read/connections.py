"""Idle data connections kept for the next read from the same holder.

Opening a data connection costs a TCP connect and, with keys, the handshake of
:mod:`tensorhub.transport.handshake` (two round trips through both peers' event loops
and an Ed25519 signature and check on each side).  A fetch used to open one connection
for the manifest and one per fetch worker for the chunks, then close them all: three
handshakes for a fetch of two chunks, each a few hundred microseconds on an idle
machine and a millisecond or more on a busy one (``tensorhub bench transfer --keys
both``).  Now a read hands its connection back here when it is done with it, and the
next read from the same holder (the fetch's chunks after its manifest, the next fetch,
the next version of a small model) takes it instead of opening one.

Only connections that are certainly in step are kept: TCP and one-sided ones (a
one-sided connection holds a lease only during a read, and keeping it keeps its queue
pair; a same-host ``shm`` connection may hold a version lease), nothing in flight, the
socket open with no byte waiting and not closed by the holder.  Nothing is weakened:
each kept connection was authenticated when it was opened, and all of them are closed
when the keyring changes (a rotation or a removal, ``Keyring.generation``), so a new
read never uses a handshake made under keys no longer listed.  A connection stays idle
here at most ``max_idle`` seconds (the holder closes idle ones itself after its
``data_idle_timeout``); at most ``per_holder`` are kept for one holder.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from ..model import PeerInfo
from ..transport.base import Connection
from ..transport.onesided.reader import OneSidedConnection
from ..transport.tcp import TcpConnection

Opener = Callable[[PeerInfo], Awaitable[Connection]]
_KEPT = (TcpConnection, OneSidedConnection)


class ConnectionPool:
    """Idle data connections by holder (see the module docstring)."""

    def __init__(self, open_connection: Opener, generation: Callable[[], int],
                 max_idle: float = 10.0, per_holder: int = 8) -> None:
        self._open = open_connection
        self._generation = generation
        self.max_idle = max_idle
        self.per_holder = per_holder
        self._idle: dict[str, list[tuple[float, TcpConnection]]] = {}
        self._kept_at = generation()
        self._closed = False
        self.opened = 0
        """Connections opened (statistics, tests)."""
        self.reused = 0
        """Reads that took a kept connection instead of opening one."""

    async def connect(self, peer: PeerInfo) -> Connection:
        """A connection to ``peer``: a kept one that is still usable, else a new one."""
        self._expire()
        idle = self._idle.get(peer.name)
        while idle:
            _at, conn = idle.pop()
            if conn.reusable():
                self.reused += 1
                return conn
            conn.close()
        self.opened += 1
        return await self._open(peer)

    async def release(self, conn: Connection) -> None:
        """Keep ``conn`` for a later read from the same holder, or close it."""
        self._expire()
        # Same-host connections (a subclass) are closed: they may hold a version lease.
        if self._closed or type(conn) not in _KEPT or not isinstance(conn, TcpConnection) \
                or not conn.reusable():
            await conn.aclose()
            return
        idle = self._idle.setdefault(conn.peer, [])
        idle.append((trio.current_time(), conn))
        while len(idle) > self.per_holder:
            idle.pop(0)[1].close()

    def close(self) -> None:
        """Close every kept connection; later releases close theirs."""
        self._closed = True
        self._drop_all()

    def flush(self) -> None:
        """Close every kept connection (this peer's identity changed: later reads
        open connections that prove the new one)."""
        self._drop_all()

    def _expire(self) -> None:
        generation = self._generation()
        if generation != self._kept_at:  # keys changed: no handshake made before counts
            self._kept_at = generation
            self._drop_all()
            return
        oldest = trio.current_time() - self.max_idle
        for where, idle in list(self._idle.items()):
            while idle and idle[0][0] < oldest:
                idle.pop(0)[1].close()
            if not idle:
                del self._idle[where]

    def _drop_all(self) -> None:
        idle, self._idle = self._idle, {}
        for entries in idle.values():
            for _at, conn in entries:
                conn.close()
