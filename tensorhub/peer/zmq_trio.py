"""One ZeroMQ ROUTER socket, owned by exactly one trio task.

Theory of operation
-------------------
The zmq FD is edge-triggered and a zmq socket is not thread- or task-safe, so a single
task (:meth:`ZmqRouter.run`) does every operation on the socket.  Other tasks hand it
outbound frames through a bounded deque (:meth:`send_nowait`: gossip is dropped and
counted when the deque is full) and read inbound frames from a bounded channel
(also drop-and-count).  After every operation the owner re-reads ``zmq.EVENTS``, the
only truth about readiness; it parks in ``wait_readable(fd)`` only when EVENTS says
there is nothing to read and nothing is waiting to be sent.  A sender wakes the parked
owner by cancelling its wait.

Addressing: every peer's routing id is its own control endpoint (``tcp://host:port``),
so the endpoint is all one needs to send to a peer.  ``ROUTER_MANDATORY`` turns a send to
an unknown peer into an error instead of a silent drop; the owner then connects to that
endpoint and retries the frame for a short while before dropping and counting it.

Security: with :class:`CurveKeys` the socket binds as a CURVE server with the cluster
key (the ZAP handler in :mod:`.zap` admits members only), then takes this member's
client keys for every connect (ZeroMQ captures the options at each bind and connect).
Frames that arrive over a connection a client made carry the member name ZAP gave it;
the inbound channel yields it beside the frame (None on connections we made).
"""

from __future__ import annotations

import collections
import errno
from dataclasses import dataclass

import trio
import zmq

from ..errors import ConfigError

_RETRY_FOR = 2.0
_RETRY_EVERY = 0.02


@dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE keys: the cluster's server pair and this member's client pair."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@dataclass(frozen=True)
class RouterStats:
    received: int
    sent: int
    dropped_inbound: int
    dropped_outbound: int
    unreachable: int


class ZmqRouter:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
                 max_bytes: int, queue: int, curve: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTING_ID, endpoint.encode())
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + 1024)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, queue)
        sock.setsockopt(zmq.RCVHWM, queue)
        if curve is not None:
            sock.setsockopt(zmq.ZAP_DOMAIN, b"tensorhub")
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.server_secret)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"control address {endpoint} is already in use") from None
            raise ConfigError(f"cannot listen on {endpoint}: {exc}") from None
        self._sock = sock
        self._curve = curve
        self._client_keys = None if curve is None else (curve.client_public,
                                                        curve.client_secret)
        self._connected: set[str] = set()
        self._client_keys_set: tuple[bytes, bytes] | None = None
        if curve is not None:
            self._use_client_keys()
        self._queue = queue
        self._out: collections.deque[tuple[str, bytes]] = collections.deque()
        self._retry: list[tuple[float, str, bytes]] = []
        self._known: set[str] = set()
        self._first_try: dict[str, float] = {}
        self._wake: trio.CancelScope | None = None
        self.inbound_send, self.inbound = trio.open_memory_channel[
            tuple[str, bytes, str | None]](queue)
        self._received = self._sent = self._drop_in = self._drop_out = self._unreach = 0

    def close(self) -> None:
        """Close a socket whose owner task never ran (startup failed)."""
        self._sock.close(0)

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """For a monitor only (:class:`~.zap.HandshakeMonitor`); the owner task does
        every other operation."""
        return self._sock

    def set_client_keys(self, public: bytes, secret: bytes) -> None:
        """Connect with these CURVE client keys from now on (key rotation); the owner
        re-connects what it connected with the old ones before its next send."""
        self._client_keys = (public, secret)
        if self._wake is not None:
            self._wake.cancel()

    def _use_client_keys(self) -> None:
        assert self._curve is not None and self._client_keys is not None
        self._sock.setsockopt(zmq.CURVE_SERVER, 0)
        self._sock.setsockopt(zmq.CURVE_PUBLICKEY, self._client_keys[0])
        self._sock.setsockopt(zmq.CURVE_SECRETKEY, self._client_keys[1])
        self._sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server_public)
        self._client_keys_set = self._client_keys

    def statistics(self) -> RouterStats:
        return RouterStats(self._received, self._sent, self._drop_in, self._drop_out,
                           self._unreach)

    def send_nowait(self, dest: str, data: bytes) -> None:
        if len(self._out) >= self._queue:
            self._drop_out += 1
            return
        self._out.append((dest, data))
        if self._wake is not None:
            self._wake.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        fd: int = self._sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        task_status.started()
        try:
            while True:
                while self._step():
                    await trio.lowlevel.checkpoint_if_cancelled()
                timeout = _RETRY_EVERY if self._retry else float("inf")
                with trio.CancelScope() as self._wake, trio.move_on_after(timeout):
                    await trio.lowlevel.wait_readable(fd)
                self._wake = None
        finally:
            self._wake = None
            trio.lowlevel.notify_closing(fd)
            self._sock.close(0)
            self.inbound_send.close()

    def _step(self) -> bool:
        """Do one receive and one send if possible; True if anything happened."""
        did = False
        if self._curve is not None and self._client_keys is not self._client_keys_set:
            self._use_client_keys()
            for dest in self._connected:  # with the new key
                self._sock.disconnect(dest)
                self._sock.connect(dest)
        events: int = self._sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
        if events & zmq.POLLIN:
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            did = True
            if len(frames) == 2:
                sender = frames[0].bytes.decode("utf-8", "replace")
                self._known.add(sender)
                try:
                    self.inbound_send.send_nowait((sender, frames[1].bytes,
                                                   _user_id(frames[1])))
                    self._received += 1
                except trio.WouldBlock:
                    self._drop_in += 1
            else:
                self._drop_in += 1
        item = self._next_outbound()
        if item is not None:
            did = True
            self._send(*item)
        return did

    def _next_outbound(self) -> tuple[str, bytes] | None:
        if self._out:
            return self._out.popleft()
        if self._retry:
            now = trio.current_time()
            for i, (due, dest, data) in enumerate(self._retry):
                if due <= now:
                    del self._retry[i]
                    return dest, data
        return None

    def _send(self, dest: str, data: bytes) -> None:
        if dest not in self._known:
            self._known.add(dest)
            self._sock.connect(dest)
            if self._curve is not None:
                self._connected.add(dest)
        try:
            self._sock.send_multipart([dest.encode(), data], zmq.NOBLOCK)
            self._sent += 1
            self._first_try.pop(dest, None)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                # Not connected yet (handshake in flight) or the peer went away.
                self._unreach += 1
                self._retry_later(dest, data)
            else:
                self._drop_out += 1

    def _retry_later(self, dest: str, data: bytes) -> None:
        now = trio.current_time()
        # A destination unreachable for longer than _RETRY_FOR loses its frames.
        first = self._first_try.setdefault(dest, now)
        if now - first > _RETRY_FOR:
            self._drop_out += 1
            self._first_try.pop(dest, None)
            self._known.discard(dest)
            self._connected.discard(dest)
            return
        self._retry.append((now + _RETRY_EVERY, dest, data))


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP user id (a member name) of a frame from a client; None otherwise."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:  # no such property: NULL mechanism, or a connection we made
        return None
    return user if isinstance(user, str) and user else None
