"""Who may connect to the control socket: ZeroMQ's ZAP handler, and a handshake monitor.

Theory of operation
-------------------
With security, every control socket is a CURVE server with the cluster key.  CURVE alone
proves only that a client knows the server's *public* key; libzmq then asks the ZAP
handler bound at ``inproc://zeromq.zap.01`` in the same context whether to admit the
client's key -- and, with no handler bound, admits every key.  :class:`ZapHandler` is
bound before the control socket listens, and admits a CURVE client key only when the
keyring (consulted at every handshake, so rotation takes effect at once) lists it for a
member; the member's name becomes the connection's ZAP user id, which every frame from
it carries (``User-Id``), so the peer can check who a message claims to come from.

:class:`HandshakeMonitor` reads the control socket's monitor events and counts failed
handshakes (a client without CURVE, a wrong server key, a refused key): refusals that
never reach the ZAP handler.

Each class owns one zmq socket and one trio task, and handles the edge-triggered FD as
:mod:`.zmq_trio` does: drain while ``EVENTS`` says readable, then wait on the FD.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from ..security import Keyring

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


async def _serve(sock: zmq.Socket[bytes], handle: Callable[[], None],
                 task_status: trio.TaskStatus[None]) -> None:
    """Call ``handle`` while ``sock`` is readable; park on its edge-triggered FD."""
    fd: int = sock.getsockopt(zmq.FD)  # type: ignore[assignment]
    task_status.started()
    try:
        while True:
            events: int = sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
            while events & zmq.POLLIN:
                handle()
                await trio.lowlevel.checkpoint_if_cancelled()
                events = sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
            await trio.lowlevel.wait_readable(fd)
    finally:
        trio.lowlevel.notify_closing(fd)
        sock.close(0)


class ZapHandler:
    """Admits CURVE clients whose key belongs to a member of ``keyring``."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keyring: Keyring) -> None:
        self.keyring = keyring
        sock: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._sock = sock
        self.admitted = 0
        self.refused = 0

    def close(self) -> None:
        """Close a socket whose owner task never ran (startup failed)."""
        self._sock.close(0)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await _serve(self._sock, self._answer_one, task_status)

    def _answer_one(self) -> None:
        request = self._sock.recv_multipart(zmq.NOBLOCK)
        self._sock.send_multipart(self.answer(request), zmq.NOBLOCK)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request (RFC 27): 200 with the member's name as user
        id, or 400.  A REP socket must answer every request, even a malformed one."""
        request_id = request[1] if len(request) > 1 else b""
        name = None
        if len(request) == 7 and request[0] == b"1.0" and request[5] == b"CURVE" \
                and len(request[6]) == 32:
            name = self.keyring.name_of_curve(z85.encode(request[6]))
        if name is None:
            self.refused += 1
            return [b"1.0", request_id, b"400", b"not a member of this cluster", b"", b""]
        self.admitted += 1
        return [b"1.0", request_id, b"200", b"OK", name.encode(), b""]


class HandshakeMonitor:
    """Counts failed handshakes on a socket (its monitor's events)."""

    def __init__(self, watched: zmq.Socket[bytes]) -> None:
        self._sock: zmq.Socket[bytes] = watched.get_monitor_socket(HANDSHAKE_FAILURES)
        self.failed = 0

    def close(self) -> None:
        self._sock.close(0)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await _serve(self._sock, self._read_one, task_status)

    def _read_one(self) -> None:
        event = parse_monitor_message(self._sock.recv_multipart(zmq.NOBLOCK))
        if event["event"] & HANDSHAKE_FAILURES:
            self.failed += 1
