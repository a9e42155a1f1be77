"""What the tests share: meshes of real peers on loopback, and one way to wait.

``open_mesh`` opens peers ``p0``, ``p1``, ... in this process (real ZeroMQ, real TCP),
each joining ``p0``, and returns once they see each other.  ``wait_until`` polls a
condition on trio's clock and fails with an ``AssertionError`` saying what did not happen
in time; ``wait_until_sync`` does the same on the wall clock, for a test that drives
peers from its own thread.  A test waits with these, or on an event; it never sleeps in
a loop of its own.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio

import tensorhub
from tensorhub import PeerConfig
from tensorhub.security import ClusterKey, Identity, Keyring, Security

POLL = 0.01
"""Seconds between two looks at a condition: short beside every timeout here."""


def _failed(what: str, timeout: float) -> AssertionError:
    return AssertionError(f"waited {timeout:g} s for {what or 'the condition'}, in vain")


async def wait_until(cond: Callable[[], object], timeout: float = 10.0, *, what: str = "",
                     every: float = POLL) -> None:
    """Return once ``cond()`` holds, looking every ``every`` seconds of trio's clock
    (``every=0``: at every turn of the scheduler, to catch a passing state); an
    AssertionError naming ``what`` if it does not hold within ``timeout`` seconds.
    ``cond`` may be async (a look that asks a peer over the wire)."""
    with trio.move_on_after(timeout):
        while not await _holds(cond):
            await trio.sleep(every)
        return
    raise _failed(what, timeout)


async def _holds(cond: Callable[[], object]) -> object:
    got = cond()
    return await got if inspect.isawaitable(got) else got


def wait_until_sync(cond: Callable[[], object], timeout: float = 10.0, *, what: str = "",
                    every: float = POLL) -> None:
    """:func:`wait_until` for a thread that is not trio's: the wall clock, ``time.sleep``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise _failed(what, timeout)
        time.sleep(every)


def all_live(peers: Sequence[tensorhub.Peer]) -> bool:
    """Every peer counts at least as many live members as there are ``peers``."""
    return all(len(p.control.membership.live_members()) >= len(peers) for p in peers)


def converged(peers: Sequence[tensorhub.Peer]) -> bool:
    """Every peer sees exactly ``peers`` live, and every member it knows of alive."""
    names = {p.info.name for p in peers}
    return all({i.name for i in p.control.membership.live_members()} == names
               and all(s == "alive" for s in p.statistics().members.values())
               for p in peers)


def complete_holders(peer: tensorhub.Peer, key: tensorhub.VersionKey) -> set[str]:
    """The peers ``peer`` sees holding all of ``key``."""
    return {p.name for p, h in peer.control.holders(key) if h.complete}


class Keys:
    """An in-memory ``tensorhub keygen``: one cluster key, one identity per name."""

    def __init__(self, names: list[str], publishers: dict[str, list[str]]) -> None:
        self.cluster = ClusterKey.generate()
        self.ids = {n: Identity.generate() for n in names}
        self.publishers = publishers

    def security(self, name: str, **options: int) -> Security:
        # every peer its own Keyring object, as every process reads its own file
        ring = Keyring({n: [i.public] for n, i in self.ids.items()}, self.publishers)
        return Security(self.ids[name], self.cluster, ring, **options)


@asynccontextmanager
async def open_mesh(n: int, *, peer_labels: Sequence[Mapping[str, str]] = (),
                    keys: Keys | None = None,
                    ready: Callable[[list[tensorhub.Peer]], bool] = all_live,
                    **cfg: Any) -> AsyncIterator[list[tensorhub.Peer]]:
    """Peers ``p0`` ... ``p{n-1}`` on loopback, ``PeerConfig.local`` with 1 MiB chunks and
    ``cfg`` over that, each joining ``p0``; peer ``i`` labelled ``peer_labels[i]``
    (when given) and secured with its own identity from ``keys`` (when given).  Returns once
    ``ready(peers)`` holds (15 s at most: ``converged`` is the strict test); the peers
    leave when the block ends, the last one first."""
    assert not peer_labels or len(peer_labels) == n, "one set of labels per peer"
    async with AsyncExitStack() as stack:
        peers: list[tensorhub.Peer] = []
        for i in range(n):
            name = f"p{i}"
            own: dict[str, Any] = {"chunk_size": 1 << 20}
            if peers:
                own["join"] = (peers[0].info.control.removeprefix("tcp://"),)
            if peer_labels:
                own["labels"] = tuple(peer_labels[i].items())
            if keys is not None:
                own["security"] = keys.security(name)
            peers.append(await stack.enter_async_context(
                tensorhub.open_peer(PeerConfig.local(name, **{**own, **cfg}))))
        await wait_until(lambda: ready(peers), 15,
                         what=f"{n} peers {ready.__name__.replace('_', ' ')}")
        yield peers
