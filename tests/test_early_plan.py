"""A fetch asks for its plan while it reads the manifest: the size it asks with comes
from the holders' references, and a reader the plan sends to it before its manifest is
in is told "not yet" and served once the version is added (not "not held")."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from tensorhub.manifest.manifest import build_manifest
from tensorhub.model import VersionKey
from tensorhub.protocol.dataplane import NOT_HELD, NOT_YET
from tensorhub.read.store import LocalVersion, Store
from tensorhub.transport.base import NotServing

ALGO = "blake3"


def version(n: int = 3) -> LocalVersion:
    arrays = [np.arange(1000 * n, dtype=np.float32)]
    manifest = build_manifest(VersionKey("m", 7), [("w", arrays[0])], 1024, ALGO)
    return LocalVersion(manifest, arrays, "pub", verified=True)


def test_holding_says_the_size_of_its_bytes() -> None:
    local = version()
    holding = local.holding()
    assert holding.size == local.manifest.total_bytes == 12000
    assert holding.num_chunks == local.manifest.num_chunks


async def test_an_expected_version_is_not_yet_then_served() -> None:
    store, local = Store(chunk_wait=30.0), version()
    key = local.manifest.key
    served: list[int] = []

    async def reader() -> None:
        await store.wait_chunk(key, 2)  # waits for the version to be added
        with store.lease(key, 2) as views:
            served.append(sum(len(v) for v in views))

    with store.expecting(key):
        with pytest.raises(NotServing) as err, store.lease(key, 2):
            pass
        assert err.value.status == NOT_YET
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert not served  # still waiting: the manifest is not in
            store.add(local)
    assert served == [1024]
    assert key not in store.expected


async def test_a_fetch_that_gives_up_leaves_not_held() -> None:
    store = Store(chunk_wait=30.0)
    key = VersionKey("m", 9)
    woke: list[bool] = []

    async def reader() -> None:
        await store.wait_chunk(key, 0)
        woke.append(True)

    async with trio.open_nursery() as nursery:
        with store.expecting(key):
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert not woke
        # the fetch gave up before adding the version: the waiting reader wakes at once
    assert woke == [True]
    with pytest.raises(NotServing) as err, store.lease(key, 0):
        pass
    assert err.value.status == NOT_HELD
