"""The one-sided transports pass the conformance suite: the in-process stand-ins
(``rdma-standin`` over TCP, ``cuda-ipc-standin`` over the same-host socket) on every
run, and the real backends (``rdma``: pyverbs; ``cuda-ipc``: cupy) where this machine
has the device -- otherwise they skip, saying why.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from transport_conformance import *  # noqa: F403
from transport_conformance import Holder, OpenHolder

from tensorhub.peer.store import Store
from tensorhub.transport.dial import probe_backend
from tensorhub.transport.onesided.backend import Backend
from tensorhub.transport.onesided.holder import OneSidedHost
from tensorhub.transport.onesided.reader import OneSidedConnection
from tensorhub.transport.onesided.registry import Registrations
from tensorhub.transport.server import TcpServer

DIALS = ("rdma-standin", "cuda-ipc-standin", "rdma", "cuda-ipc")


@asynccontextmanager
async def onesided_holder(make: Callable[[], Backend], hosts: list[OneSidedHost] | None = None
                          ) -> AsyncIterator[Holder]:
    """A TcpServer serving one-sided reads with a backend from ``make()`` (its
    :class:`OneSidedHost` appended to ``hosts``); readers use another backend instance
    from it (one registration cache for all of them)."""
    store, sent, bad = Store(), list[int](), list[str]()
    host = OneSidedHost([make()])
    if hosts is not None:
        hosts.append(host)
    store.on_dropped.append(host.dropped)
    server = TcpServer(store, lambda _peer, n: sent.append(n), bad.append, onesided=host)
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    reader = Registrations(make())
    scope, stopped = trio.CancelScope(), trio.Event()

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await server.serve(task_status=task_status)
        stopped.set()

    async def kill() -> None:
        scope.cancel()
        await stopped.wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(run)
        yield Holder(store, lambda: OneSidedConnection.open(address, "holder", 5, reader),
                     kill, address, sent, bad)
        scope.cancel()
    reader.close()
    host.close()


@pytest.fixture(params=DIALS)
def open_holder(request: pytest.FixtureRequest) -> OpenHolder:
    make, why_not = probe_backend(request.param)
    if make is None:
        pytest.skip(f"{request.param}: {why_not}")
    opener: Any = lambda: onesided_holder(make)  # noqa: E731
    return opener  # type: ignore[no-any-return]
