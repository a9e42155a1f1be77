"""The one-sided transports pass the conformance suite: the in-process stand-ins
(``rdma-standin`` over TCP, ``cuda-ipc-standin`` over the same-host socket) on every
run, and the real backends (``rdma``: pyverbs; ``cuda-ipc``: cupy) where this machine
has the device -- otherwise they skip, saying why.  CUDA IPC exports device memory
only, so its holder serves device copies of the suite's arrays (:class:`DeviceMirror`)
and its readers copy device to host.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import numpy as np
import pytest

from tensorhub.model import VersionKey
from tensorhub.read.store import LocalVersion, Store
from tensorhub.testing.conformance import *  # noqa: F403
from tensorhub.testing.conformance import Holder, OpenHolder, running
from tensorhub.transport.admission import ServerLimits
from tensorhub.transport.base import Provider
from tensorhub.transport.dial import probe_backend
from tensorhub.transport.onesided.backend import Backend
from tensorhub.transport.onesided.holder import OneSidedHost
from tensorhub.transport.onesided.reader import OneSidedConnection
from tensorhub.transport.onesided.registry import Registrations, extent, owner_of, whole
from tensorhub.transport.server import TcpServer

DIALS = ("rdma-standin", "cuda-ipc-standin", "rdma", "cuda-ipc")


@asynccontextmanager
async def onesided_holder(make: Callable[[], Backend], hosts: list[OneSidedHost] | None = None,
                          serve: Callable[[Store], Provider] = lambda store: store,
                          limits: ServerLimits | None = None) -> AsyncIterator[Holder]:
    """A TcpServer serving ``serve(store)`` one-sided with a backend from ``make()`` (its
    :class:`OneSidedHost` appended to ``hosts``); readers use another backend instance
    from it (one registration cache for all of them)."""
    store, sent, bad = Store(), list[int](), list[str]()
    host = OneSidedHost([make()])
    if hosts is not None:
        hosts.append(host)
    store.on_dropped.append(host.dropped)
    server = TcpServer(serve(store), lambda _peer, n: sent.append(n), bad.append, limits,
                       onesided=host)
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    reader = Registrations(make())
    async with running(server) as kill:
        yield Holder(store, lambda: OneSidedConnection.open(address, "holder", 5, reader),
                     kill, address, sent, bad)
    reader.close()
    host.close()


class DeviceMirror:
    """Serves a store's chunks from device copies of its arrays (cupy), made when a
    chunk is first leased: what a GPU holder serves over CUDA IPC."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cupy: Any = importlib.import_module("cupy")
        self._mirrors: dict[int, tuple[Any, Any]] = {}  # id(owner) -> (owner, device copy)

    def manifest_bytes(self, key: VersionKey) -> bytes:
        return self.store.manifest_bytes(key)

    async def wait_chunk(self, key: VersionKey, chunk: int) -> None:
        await self.store.wait_chunk(key, chunk)

    def get(self, key: VersionKey) -> LocalVersion | None:
        return self.store.get(key)

    @contextmanager
    def lease(self, key: VersionKey, chunk: int) -> Iterator[Sequence[Any]]:
        with self.store.lease(key, chunk) as segments:
            yield [self._on_device(s) for s in segments if s.nbytes]

    def _on_device(self, piece: memoryview) -> Any:
        owner = owner_of(piece)
        _, mirror = self._mirrors.get(id(owner), (None, None))
        if mirror is None:
            host = np.frombuffer(whole(owner), np.uint8)
            mirror = self._cupy.asarray(host)
            self._mirrors[id(owner)] = (owner, mirror)
        start = extent(piece)[0] - extent(whole(owner))[0]
        return mirror[start:start + piece.nbytes]


@pytest.fixture(params=DIALS)
def open_holder(request: pytest.FixtureRequest) -> OpenHolder:
    make, why_not = probe_backend(request.param)
    if make is None:
        pytest.skip(f"{request.param}: {why_not}")
    serve: Any = DeviceMirror if request.param == "cuda-ipc" else (lambda store: store)
    opener: Any = lambda: onesided_holder(make, serve=serve)  # noqa: E731
    return opener  # type: ignore[no-any-return]
