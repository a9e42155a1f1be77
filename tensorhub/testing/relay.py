"""A delaying TCP relay: the user-space stand-in for netem on the inter-DC path.

This kernel has no netem, so the emulated cluster (:mod:`tensorhub.testing.netns`) gets its
WAN latency from this relay, which runs in the router namespace between datacenters.

Theory of operation
-------------------
The relay accepts a TCP connection, opens one to the target (a fixed ``--to`` address, or,
with ``--original-dst``, the address the client really dialled before nftables redirected
it here: ``SO_ORIGINAL_DST``), and then runs two independent *pipes*, one per direction.
A pipe is a reader and a writer joined by a bounded FIFO queue:

* the reader stamps every chunk it receives with ``arrival + one_way_delay`` and queues it;
  when the queue holds ``buffer_bytes`` the reader stops reading, so the sender's TCP
  window closes (backpressure; buffering is bounded per direction);
* the writer sends chunks strictly in queue order, each no earlier than its stamp, so byte
  order is preserved and every byte is late by the one-way delay, however fast or slow
  the link after the relay is (that link's ``tc`` cap sets the rate).

Routes (``--routes``, a JSON list) give each (client subnet, destination subnet) pair its
own one-way delay and the ``SO_PRIORITY`` of each of its two sockets, which the emulated
cluster's ``htb`` qdiscs read as a class id to cap each pair of DCs at its own rate; a
connection no route matches gets ``--one-way-ms`` and priority 0.

End-of-stream is queued like data and forwarded as a half-close after the same delay; a
reset on either side resets both. The TCP handshake itself is not delayed: the client's
``connect`` completes at once and the first byte it sends pays the delay.

The file imports nothing from the package so that it can run by path (``python relay.py``)
without importing TensorHub. Performance: one asyncio loop, 64 KiB reads, no copies beyond
the ones the socket calls make; measured on one stream, about 3% of a core at 12 MB/s and
a quarter of a core at 200 MB/s (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import socket
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: ``getsockopt(SOL_IP, SO_ORIGINAL_DST)`` (``linux/netfilter_ipv4.h``): the address a
#: redirected connection was made to.
SO_ORIGINAL_DST = 80

_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Route:
    """What connections from ``src`` (the client's subnet) to ``dst`` (the destination's)
    get: a one-way delay each direction, and the ``SO_PRIORITY`` of the socket back to
    the client (``to_src_priority``) and of the one to the destination."""

    src: ipaddress.IPv4Network
    dst: ipaddress.IPv4Network
    one_way_delay_s: float
    to_src_priority: int = 0
    to_dst_priority: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Route:
        return cls(ipaddress.IPv4Network(raw["src"]), ipaddress.IPv4Network(raw["dst"]),
                   float(raw["one_way_ms"]) / 1000.0, int(raw.get("to_src_priority", 0)),
                   int(raw.get("to_dst_priority", 0)))


@dataclass(frozen=True)
class RelayConfig:
    """What one relay process does.

    ``target`` None means "the original destination of each redirected connection".
    ``one_way_delay_s`` is added to every byte in each direction, so a round trip through
    the relay gets twice that. ``buffer_bytes`` bounds what one direction of one
    connection may hold queued (it must cover rate x delay or it caps throughput).
    """

    listen: tuple[str, int]
    target: tuple[str, int] | None
    one_way_delay_s: float
    buffer_bytes: int = 4 * 1024 * 1024
    connect_timeout_s: float = 10.0
    routes: Sequence[Route] = ()
    """Per (client subnet, destination subnet): delay and priorities; first match wins."""

    def __post_init__(self) -> None:
        for delay in (self.one_way_delay_s, *(r.one_way_delay_s for r in self.routes)):
            if delay < 0:
                raise ValueError(f"one-way delays must be >= 0, got {delay}")
        if self.buffer_bytes < _CHUNK:
            raise ValueError(f"buffer_bytes must be >= {_CHUNK}, got {self.buffer_bytes}")


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a connection redirected by netfilter NAT was originally headed."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed_ip = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed_ip), port


async def serve(
    config: RelayConfig, ready: Callable[[tuple[str, int]], None] | None = None
) -> None:
    """Relay connections until cancelled; ``ready`` gets the bound address."""
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(config.listen)
    listener.listen(1024)
    listener.setblocking(False)
    connections: set[asyncio.Task[None]] = set()
    try:
        if ready is not None:
            ready(listener.getsockname())
        while True:
            client, _ = await loop.sock_accept(listener)
            task = asyncio.create_task(_relay_connection(config, client))
            connections.add(task)
            task.add_done_callback(connections.discard)
    finally:
        listener.close()
        for task in connections:
            task.cancel()


async def _relay_connection(config: RelayConfig, client: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        client.setblocking(False)
        upstream.setblocking(False)
        target = config.target or original_destination(client)
        route = _route(config, client.getpeername()[0], target[0])
        delay = config.one_way_delay_s if route is None else route.one_way_delay_s
        if route is not None:
            _prioritize(client, route.to_src_priority)
            _prioritize(upstream, route.to_dst_priority)
        try:
            await asyncio.wait_for(
                loop.sock_connect(upstream, target), config.connect_timeout_s
            )
        except (OSError, TimeoutError):
            _reset(client)  # the client sees a reset where it would have seen a refusal
            return
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            async with asyncio.TaskGroup() as pipes:
                pipes.create_task(_pipe(config, delay, client, upstream))
                pipes.create_task(_pipe(config, delay, upstream, client))
        except* OSError:
            _reset(client)
            _reset(upstream)
    finally:
        client.close()
        upstream.close()


def _route(config: RelayConfig, client_ip: str, target_ip: str) -> Route | None:
    src, dst = ipaddress.IPv4Address(client_ip), ipaddress.IPv4Address(target_ip)
    return next((r for r in config.routes if src in r.src and dst in r.dst), None)


def _prioritize(sock: socket.socket, priority: int) -> None:
    if priority:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, priority)


async def _pipe(config: RelayConfig, delay: float, src: socket.socket, dst: socket.socket
                ) -> None:
    """Copy ``src`` to ``dst`` in order, each chunk ``delay`` seconds late."""
    loop = asyncio.get_running_loop()
    # Chunks are at most _CHUNK bytes, so a count bound is also a byte bound.
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(
        maxsize=config.buffer_bytes // _CHUNK
    )

    async def read() -> None:
        while True:
            chunk = await loop.sock_recv(src, _CHUNK)
            await queue.put((loop.time() + delay, chunk))
            if not chunk:
                return

    async def write() -> None:
        while True:
            due, chunk = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                dst.shutdown(socket.SHUT_WR)
                return
            await loop.sock_sendall(dst, chunk)

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(read())
        tasks.create_task(write())


def _reset(sock: socket.socket) -> None:
    """Close with RST rather than FIN, so the other end learns of the failure."""
    with contextlib.suppress(OSError):  # already closed or never connected: nothing to reset
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--to", type=_address, help="fixed target HOST:PORT")
    where.add_argument(
        "--original-dst", action="store_true", help="target each connection's NAT original"
    )
    parser.add_argument("--one-way-ms", type=float, default=0.0)
    parser.add_argument("--buffer-bytes", type=int, default=RelayConfig.buffer_bytes)
    parser.add_argument("--routes", type=json.loads, default=[],
                        help='JSON list of {"src": CIDR, "dst": CIDR, "one_way_ms", '
                             '"to_src_priority", "to_dst_priority"}')
    args = parser.parse_args(argv)
    config = RelayConfig(
        listen=args.listen,
        target=args.to,
        one_way_delay_s=args.one_way_ms / 1000.0,
        buffer_bytes=args.buffer_bytes,
        routes=tuple(Route.from_dict(raw) for raw in args.routes),
    )

    def announce(address: tuple[str, int]) -> None:
        print(f"relay listening on {address[0]}:{address[1]}", flush=True)

    try:
        asyncio.run(serve(config, announce))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
