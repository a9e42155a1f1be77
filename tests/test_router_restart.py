"""A peer restarted on its old control address reaches, and is reached by, a peer that
had connected to its previous incarnation (real ZeroMQ routers on loopback).

The survivor's connection to the old incarnation outlives it (ZeroMQ reconnects it to
whatever listens at the address next).  Before connections we make got private local
routing ids, that connection kept the restarted peer's routing id at the survivor, so
the new incarnation's own connection was ignored there, and whatever it sent was lost:
the chaos bench's "the mesh did not heal" after a kill -9 and restart.
"""

from __future__ import annotations

import trio
import zmq
from helpers import wait_until

from tensorhub.errors import ConfigError
from tensorhub.peer.zmq_trio import ZmqRouter
from tensorhub.processes import free_ports


def _endpoint() -> str:
    return f"tcp://127.0.0.1:{free_ports(1)[0]}"


async def _rebind(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> ZmqRouter:
    """A router on ``endpoint`` once ZeroMQ has let go of the previous one's port."""
    routers: list[ZmqRouter] = []

    def bound() -> bool:
        try:
            routers.append(ZmqRouter(ctx, endpoint, 1 << 16, 64))
        except ConfigError:  # the closed socket's listener is still being torn down
            return False
        return True

    await wait_until(bound, what=f"a router bound to {endpoint}")
    return routers[0]


async def _next(router: ZmqRouter) -> tuple[str, bytes]:
    with trio.fail_after(10):
        sender, frame, _ = await router.receive()
    return sender, frame


async def test_a_peer_restarted_on_its_address_is_heard_both_ways() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a_ep, b_ep = _endpoint(), _endpoint()
    try:
        async with trio.open_nursery() as outer:
            b = ZmqRouter(ctx, b_ep, 1 << 16, 64)
            await outer.start(b.run)
            async with trio.open_nursery() as first:
                a = ZmqRouter(ctx, a_ep, 1 << 16, 64)
                await first.start(a.run)
                b.send_nowait(a_ep, b"ping")  # b connects to the first incarnation
                assert await _next(a) == (b_ep, b"ping")
                a.send_nowait(b_ep, b"ack", reply=True)
                assert await _next(b) == (a_ep, b"ack")
                first.cancel_scope.cancel()  # its socket closes: the process is gone
            async with trio.open_nursery() as second:
                a = await _rebind(ctx, a_ep)  # the same address again
                await second.start(a.run)
                a.send_nowait(b_ep, b"join")  # the new incarnation connects to b
                assert await _next(b) == (a_ep, b"join")
                b.send_nowait(a_ep, b"welcome")
                assert await _next(a) == (b_ep, b"welcome")
                a.send_nowait(b_ep, b"ack", reply=True)
                assert await _next(b) == (a_ep, b"ack")
                second.cancel_scope.cancel()
            outer.cancel_scope.cancel()
    finally:
        ctx.term()


async def test_two_peers_that_connect_to_each_other_both_hear_everything() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a_ep, b_ep = _endpoint(), _endpoint()
    try:
        async with trio.open_nursery() as nursery:
            a = ZmqRouter(ctx, a_ep, 1 << 16, 64)
            b = ZmqRouter(ctx, b_ep, 1 << 16, 64)
            await nursery.start(a.run)
            await nursery.start(b.run)
            a.send_nowait(b_ep, b"a0")  # both connect at once: two connections
            b.send_nowait(a_ep, b"b0")
            got_a = [await _next(a)]
            got_b = [await _next(b)]
            for i in range(1, 20):
                a.send_nowait(b_ep, b"a%d" % i)
                b.send_nowait(a_ep, b"b%d" % i)
                got_b.append(await _next(b))
                got_a.append(await _next(a))
            assert got_a == [(b_ep, b"b%d" % i) for i in range(20)]
            assert got_b == [(a_ep, b"a%d" % i) for i in range(20)]
            nursery.cancel_scope.cancel()
    finally:
        ctx.term()
