"""Adapters: many small models, each with its own versions and its own retention.

Fifty LoRA adapters (rank-8 A/B pairs on a 256-wide model) are fifty models on a real
mesh (ZeroMQ control, TCP and same-host data).  A trainer publishes versions of each and
unpublishes the one before, like a trainer that reuses its buffers; a rollout peer keeps
every adapter current with one :class:`~tensorhub.Rollout` each.  Retention is set per
model (``PeerConfig.retain``): the mesh keeps exactly the versions each adapter's rule
says, wherever they ended up.  And one adapter's flips never wait for another's readers.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing
from helpers import open_mesh

from tensorhub import Committed, ConfigError, PeerConfig, Rollout, Staged, VersionKey
from tensorhub.transport.samehost.reader import ShmConnection, shm_available

RANK, HIDDEN = 8, 256
ADAPTERS = [f"lora/{i:02d}" for i in range(50)]
RETAIN = (("lora/0*", 3), ("lora/*", 2))
"""Adapters lora/00 to lora/09 keep three versions readable, the others two."""
VERSIONS = 4
SHM, WHY_NOT = shm_available()

Weights = dict[str, np.ndarray[Any, Any]]


def adapter(name: str, version: int) -> Weights:
    """A LoRA adapter: A (rank x hidden) and B (hidden x rank) for two projections of
    two layers, 64 KiB in all."""
    rng = np.random.default_rng([zlib.crc32(name.encode()), version])
    out = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            base = f"layers.{layer}.{proj}"
            out[f"{base}.lora_A"] = rng.standard_normal((RANK, HIDDEN)).astype(np.float32)
            out[f"{base}.lora_B"] = rng.standard_normal((HIDDEN, RANK)).astype(np.float32)
    return out


def keeps(name: str) -> int:
    return 3 if name.startswith("lora/0") else 2


def assert_equal(got: Weights, want: Weights) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def held(peer: Any, model: str) -> set[int]:
    """Versions of ``model`` this peer serves now."""
    return {k.version for k, v in peer.store.versions.items()
            if k.model == model and not v.hidden}


async def test_fifty_adapters_stay_current_and_each_keeps_its_own_versions() -> None:
    async with open_mesh(3, retain=RETAIN) as (trainer, roll, reader):
        rollouts = {name: Rollout(roll, name) for name in ADAPTERS}
        for version in range(1, VERSIONS + 1):
            for name in ADAPTERS:
                await trainer.publish(name, version, adapter(name, version))
            if version > 1:  # the trainer reuses its buffers: it lets the last one go
                async with trio.open_nursery() as nursery:
                    for name in ADAPTERS:
                        nursery.start_soon(trainer.unpublish, name, version - 1)
            with trio.fail_after(30):
                while any(roll.control.latest(n) != version for n in ADAPTERS):
                    await roll.wait_changed()
            staged: dict[str, Staged] = {}

            async def stage(name: str, version: int, out: dict[str, Staged]) -> None:
                out[name] = await rollouts[name].stage(version)

            async with trio.open_nursery() as nursery:  # every adapter at once
                for name in ADAPTERS:
                    nursery.start_soon(stage, name, version, staged)
            done: list[Committed] = [await staged[n].commit() for n in ADAPTERS]
            for name in ADAPTERS:
                live = rollouts[name].live
                assert live is not None and live.version == version
                assert_equal(live.tensors, adapter(name, version))
            with trio.fail_after(30):
                for committed in done:
                    await committed.wait_released()
                    assert committed.release_error is None
        # Each adapter keeps exactly its own number of versions readable, in host copies
        # at the rollout (or at the trainer, when the rollout answered its keep query
        # too late): every older version is gone from every peer.
        want = {n: set(range(VERSIONS - keeps(n) + 1, VERSIONS + 1)) for n in ADAPTERS}
        with trio.fail_after(30):
            while any(set(reader.control.readable(n)) != want[n] for n in ADAPTERS):
                await reader.wait_changed()
        for name in ADAPTERS:
            assert VERSIONS in held(trainer, name) and VERSIONS in held(roll, name)
            assert held(trainer, name) | held(roll, name) == want[name]
            assert not held(reader, name)
        # and every kept version reads back as it was published
        for name in ADAPTERS:
            for version in sorted(want[name]):
                got = await reader.fetch(name, version)
                assert_equal(got.tensors, adapter(name, version))
        # Fifty models cost the control plane a reference entry per peer that lists what
        # it holds: bounded by retention, far under one control message.
        for peer in (trainer, roll):
            entry = peer.control.refs.local
            assert len(entry.holdings) == sum(len(held(peer, n)) for n in ADAPTERS)
            assert entry.wire_size() < peer.config.max_message_bytes // 64
        for peer in (trainer, roll, reader):
            assert peer.statistics().internal_errors == 0


@pytest.mark.skipif(not SHM, reason=WHY_NOT)
async def test_flipping_one_adapter_never_waits_for_another_adapters_readers() -> None:
    """A reader keeps reading the version of adapter X that the rollout replaced (a
    same-host version lease held until it closes), so X's release cannot drain.
    Meanwhile X flips again and again, and adapter Y is updated and read from the
    rollout over and over: every step of both finishes before X's reader lets go."""
    x, y = "lora/x", "lora/y"
    async with open_mesh(3, transports=("shm", "tcp")) as (trainer, roll, reader):
        for name in (x, y):
            await trainer.publish(name, 1, adapter(name, 1))
        with trio.fail_after(10):
            while roll.control.latest(x) != 1 or roll.control.latest(y) != 1:
                await roll.wait_changed()
        rx, ry = Rollout(roll, x), Rollout(roll, y)
        await (await rx.stage()).commit()
        await (await ry.stage()).commit()
        x1 = roll.store.get(VersionKey(x, 1))
        assert x1 is not None
        lease = await ShmConnection.connect(roll.info.data, roll.info.name, 5)
        chunk = np.empty(x1.manifest.total_bytes, np.uint8)  # one chunk: 64 KiB
        assert x1.manifest.num_chunks == 1
        await lease.read_chunk(VersionKey(x, 1), 0, [memoryview(chunk)])
        assert x1.inflight == 1
        await trainer.publish(x, 2, adapter(x, 2))
        with trio.fail_after(10):
            while roll.control.latest(x) != 2:
                await roll.wait_changed()
        stuck = await (await rx.stage(2)).commit()  # returns: the reader of v1 reads on
        events: list[tuple[str, int, bool]] = []
        """(adapter, version, whether X's v1 was still being read) per finished step."""

        async def update(rollout: Rollout, name: str, versions: range, read: bool) -> None:
            for version in versions:
                await trainer.publish(name, version, adapter(name, version))
                with trio.fail_after(10):
                    while roll.control.latest(name) != version:
                        await roll.wait_changed()
                done = await (await rollout.stage(version)).commit()
                await done.wait_released()  # the previous version drained: nobody read it
                assert done.release_error is None
                if read:  # and the rollout serves the new one to a reader at once
                    got = await reader.fetch(name, version, sources=[roll.info.name])
                    assert_equal(got.tensors, adapter(name, version))
                events.append((name, version, x1.inflight == 1 and not stuck.release_done))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(update, rx, x, range(3, 9), False)
                nursery.start_soon(update, ry, y, range(2, 10), True)
        assert [v for n, v, _ in events if n == x] == list(range(3, 9))
        assert [v for n, v, _ in events if n == y] == list(range(2, 10))
        assert all(still_read for _, _, still_read in events), events
        assert not stuck.release_done and x1.hidden  # refused to new readers meanwhile
        await lease.aclose()  # the reader lets go: only now does X's v1 finish draining
        with trio.fail_after(10):
            assert await stuck.wait_released() is not None
        assert stuck.release_error is None and roll.store.get(VersionKey(x, 1)) is None


def test_retention_rules_match_model_names_in_order() -> None:
    config = PeerConfig.local("p", retain=(*RETAIN, ("base", 0)), retain_latest=4)
    assert [config.retain_for(n) for n in ("lora/07", "lora/42", "base", "policy")] == \
        [3, 2, 0, 4]
    for bad in ((("lora/*", -1),), (("", 2),), (("lora/*", True),), (("lora/*",),),
                (("x", 1),) * 1025):
        with pytest.raises(ConfigError, match="retain must be"):
            PeerConfig.local("p", retain=bad)
