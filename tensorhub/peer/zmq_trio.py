"""One ZeroMQ ROUTER socket, owned by exactly one trio task.

Theory of operation
-------------------
The zmq FD is edge-triggered and a zmq socket is not thread- or task-safe, so a single
task (:meth:`ZmqRouter.run`) does every operation on the socket.  Other tasks hand it
outbound frames through a bounded deque (:meth:`send_nowait`: gossip is dropped and
counted when the deque is full) and take inbound frames with :meth:`receive` from a
:class:`~tensorhub.peer.inbox.FairInbox`: per-sender bounded queues served round-robin,
each sender also held to a rate, so a flooding sender delays nobody else and costs
little (drop-and-count too).  After every operation the owner re-reads ``zmq.EVENTS``,
the only truth about readiness; it parks in ``wait_readable(fd)`` only when EVENTS says
there is nothing to read and nothing is waiting to be sent.  A sender wakes the parked
owner by cancelling its wait.  However busy, the owner yields to the scheduler every
``_BATCH`` operations, so a flood cannot starve the rest of the peer (dispatcher, data
plane, timers); reading no faster than that also throttles a flooder through TCP.

Addressing: every peer's routing id is its own control endpoint (``tcp://host:port``),
so the endpoint is all one needs to send to a peer.  That is the id *other* sockets give
the connections we make to them.  Locally, a connection we make gets a private random id
(``CONNECT_ROUTING_ID``), mapped back to the endpoint on receive: two peers that both
connect to each other then hold two connections with four distinct ids, never one id
named twice.  (With the endpoint as the local id too, a ROUTER keeps the first of two
connections that carry one id and silently ignores the other; a peer restarted on its
old address then raced the survivors' reconnects, and when each side kept a different
connection, every frame either way fell into an ignored one: the mesh never healed.)
``ROUTER_MANDATORY`` turns a send to an unknown peer into an error instead of a silent
drop; the owner then connects to that endpoint (a frame to a connection still in its
handshake waits in the connection's queue).  A *reply* (``send_nowait(..., reply=True)``)
goes only over a connection that already exists -- the one the request came on, or
one we made to that endpoint: the owner never connects to a reply's destination, so no
message can make a peer contact an address it names.

Security: with :class:`CurveKeys` the socket binds as a CURVE server with the cluster
key (the ZAP handler in :mod:`.zap` admits members only), then takes this member's
client keys for every connect (ZeroMQ captures the options at each bind and connect).
Frames that arrive over a connection a client made carry the member name ZAP gave it;
:meth:`receive` yields it beside the frame (None on connections we made).
"""

from __future__ import annotations

import collections
import errno
import secrets
from collections import OrderedDict
from dataclasses import dataclass

import trio
import zmq

from ..errors import ConfigError
from .inbox import FairInbox

_RETRY_FOR = 2.0
_RETRY_EVERY = 0.02
_BATCH = 8             # socket operations between two yields to the scheduler
_KNOWN_INBOUND = 4096  # routing ids remembered from inbound frames (oldest forgotten)


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
    inbound_waiting: int
    inbound_senders: int


class ZmqRouter:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
                 max_bytes: int, queue: int, curve: CurveKeys | None = None,
                 rate: float = float("inf")) -> None:
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
        self._connected: dict[str, bytes] = {}
        """Endpoints we connected to, and the local routing id of that connection."""
        self._ours: dict[bytes, str] = {}
        """Local routing ids of connections we made (any generation): their endpoint."""
        self._heard: OrderedDict[bytes, None] = OrderedDict()
        """Routing ids that connected to us (bounded): sending to them needs no connect."""
        self._client_keys_set: tuple[bytes, bytes] | None = None
        if curve is not None:
            self._use_client_keys()
        self._queue = queue
        self._out: collections.deque[tuple[str, bytes, bool]] = collections.deque()
        self._retry: list[tuple[float, str, bytes]] = []
        self._first_try: dict[str, float] = {}
        self._wake: trio.CancelScope | None = None
        self._inbox: FairInbox[tuple[bytes, str | None]] = FairInbox(
            queue, max(4, queue // 8), rate)
        self._inbox_ready = trio.Event()
        self._closed = False
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
        return RouterStats(self._received, self._sent, self._drop_in + self._inbox.dropped,
                           self._drop_out, self._unreach, len(self._inbox),
                           self._inbox.senders)

    def send_nowait(self, dest: str, data: bytes, *, reply: bool = False) -> None:
        """Queue ``data`` for the peer whose routing id is ``dest``.  A ``reply`` goes
        only over a connection that peer opened or we opened before (never a new
        connection) and may use at most half the queue, so replies to a flood cannot
        crowd out our own messages."""
        limit = self._queue // 2 if reply else self._queue
        if len(self._out) >= limit:
            self._drop_out += 1
            return
        self._out.append((dest, data, reply))
        if self._wake is not None:
            self._wake.cancel()

    async def receive(self) -> tuple[str, bytes, str | None]:
        """The next inbound ``(routing id, frame, member name ZAP gave the connection
        or None)``, senders served round-robin; raises :class:`trio.EndOfChannel` once
        the socket is closed."""
        while True:
            await trio.lowlevel.checkpoint()
            item = self._inbox.pop()
            if item is not None:
                sender, (frame, member) = item
                return sender.decode("utf-8", "replace"), frame, member
            if self._closed:
                raise trio.EndOfChannel
            self._inbox_ready = trio.Event()
            await self._inbox_ready.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        fd: int = self._sock.getsockopt(zmq.FD)  # type: ignore[assignment]
        task_status.started()
        try:
            while True:
                done = 0
                while self._step():
                    done += 1
                    if done % _BATCH == 0:
                        await trio.lowlevel.checkpoint()
                timeout = _RETRY_EVERY if self._retry else float("inf")
                with trio.CancelScope() as self._wake, trio.move_on_after(timeout):
                    await trio.lowlevel.wait_readable(fd)
                self._wake = None
        finally:
            self._wake = None
            trio.lowlevel.notify_closing(fd)
            self._sock.close(0)
            self._closed = True
            self._inbox_ready.set()

    def _step(self) -> bool:
        """Do one receive and one send if possible; True if anything happened."""
        did = False
        if self._curve is not None and self._client_keys is not self._client_keys_set:
            self._use_client_keys()
            for dest in list(self._connected):  # with the new key
                self._sock.disconnect(dest)
                self._connect(dest)
        events: int = self._sock.getsockopt(zmq.EVENTS)  # type: ignore[assignment]
        if events & zmq.POLLIN:
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            did = True
            if len(frames) == 2:
                routing_id = frames[0].bytes
                ours = self._ours.get(routing_id)
                if ours is None:
                    self._remember(routing_id)
                else:  # over a connection we made: its endpoint is the sender
                    routing_id = ours.encode()
                if self._inbox.put(routing_id, (frames[1].bytes, _user_id(frames[1])),
                                   trio.current_time()):
                    self._received += 1
                    self._inbox_ready.set()
            else:
                self._drop_in += 1
        item = self._next_outbound()
        if item is not None:
            did = True
            self._send(*item)
        return did

    def _next_outbound(self) -> tuple[str, bytes, bool] | None:
        if self._out:
            return self._out.popleft()
        if self._retry:
            now = trio.current_time()
            for i, (due, dest, data) in enumerate(self._retry):
                if due <= now:
                    del self._retry[i]
                    return dest, data, False
        return None

    def _remember(self, routing_id: bytes) -> None:
        heard = self._heard
        if routing_id in heard:
            heard.move_to_end(routing_id)
            return
        heard[routing_id] = None
        if len(heard) > _KNOWN_INBOUND:
            heard.popitem(last=False)

    def _connect(self, dest: str) -> bytes | None:
        """Connect to ``dest`` under a fresh local routing id (None: not an endpoint)."""
        local = b"\0" + secrets.token_bytes(12)  # a peer cannot name it, so never clashes
        self._sock.setsockopt(zmq.CONNECT_ROUTING_ID, local)
        try:
            self._sock.connect(dest)
        except zmq.ZMQError:  # not an endpoint zmq can use: nothing to send it to
            self._connected.pop(dest, None)
            return None
        self._connected[dest] = local
        self._ours[local] = dest
        return local

    def _send(self, dest: str, data: bytes, reply: bool) -> None:
        inbound = dest.encode()
        ids = [inbound] if reply or inbound in self._heard else []
        local = self._connected.get(dest)
        if local is not None:
            ids.append(local)
        elif not reply and not ids:
            local = self._connect(dest)
            if local is None:
                self._drop_out += 1
                return
            ids.append(local)
        for rid in ids:
            try:
                self._sock.send_multipart([rid, data], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    self._drop_out += 1
                    return
                self._unreach += 1  # that connection is gone: try the next one
                if rid == inbound:
                    self._heard.pop(inbound, None)
                continue
            self._sent += 1
            self._first_try.pop(dest, None)
            return
        if reply:
            self._drop_out += 1  # the connection it came on is gone
        else:
            self._retry_later(dest, data)

    def _retry_later(self, dest: str, data: bytes) -> None:
        now = trio.current_time()
        # A destination unreachable for longer than _RETRY_FOR loses its frames.
        first = self._first_try.setdefault(dest, now)
        if now - first > _RETRY_FOR:
            self._drop_out += 1
            self._first_try.pop(dest, None)
            return
        if dest not in self._connected and self._connect(dest) is None:
            self._drop_out += 1
            return
        self._retry.append((now + _RETRY_EVERY, dest, data))


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP user id (a member name) of a frame from a client; None otherwise."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:  # no such property: NULL mechanism, or a connection we made
        return None
    return user if isinstance(user, str) and user else None
