"""Chunk deltas between real peers: a reader that holds the last version gets the next
one as deltas, checked chunk by chunk; a holder whose deltas are wrong is banned and the
chunks come in full from another; a plan's remote seed pulls the deltas across."""

from __future__ import annotations

import numpy as np
import trio
from test_mesh import mesh

from tensorhub import VersionKey
from tensorhub.manifest import digest_of


def step(w: dict[str, np.ndarray], fraction: float, seed: int) -> dict[str, np.ndarray]:
    """An RL-like step: ``fraction`` of the values of each tensor changed a little."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in w.items():
        new = v.copy()
        flat = new.reshape(-1)
        idx = rng.choice(flat.size, max(1, int(flat.size * fraction)), replace=False)
        flat[idx] = flat[idx] * (1 + 0.01 * rng.standard_normal(idx.size)).astype(v.dtype)
        out[k] = new
    return out


def weights(mib: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    n = mib << 18
    return {"a": (rng.standard_normal(n) * 0.02).astype(np.float16),
            "b": (rng.standard_normal(n) * 0.02).astype(np.float16),
            "frozen": rng.standard_normal(1 << 18).astype(np.float32)}


async def wait_complete(peer, key: VersionKey, n: int) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(10):
        while len([h for _, h in peer.control.holders(key) if h.complete]) < n:
            await trio.sleep(0.01)


def same_bytes(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for k, v in want.items():
        assert digest_of("blake3", [memoryview(got[k]).cast("B")]) == \
            digest_of("blake3", [memoryview(v).cast("B")]), k


async def test_a_reader_with_the_last_version_gets_the_next_as_deltas() -> None:
    async with mesh(2, planning=False, delta="always") as (pub, reader):
        w1 = weights()
        await pub.publish("m", 1, w1)
        await wait_complete(reader, VersionKey("m", 1), 1)
        first = await reader.fetch("m", 1)
        assert first.report.delta["note"].startswith("no older version")
        w2 = step(w1, 0.01, 1)
        w2["frozen"] = w1["frozen"]  # one tensor, its chunks, did not change
        await pub.publish("m", 2, w2)
        await wait_complete(reader, VersionKey("m", 2), 1)
        got = await reader.fetch("m", 2)
        r = got.report
        assert r.verified and r.delta["base"] == 1, r.delta
        assert r.unchanged_chunks >= 1  # the frozen tensor's chunk: not sent
        assert r.delta_chunks == 4 and r.bytes == 0, r.to_dict()
        assert 0 < r.delta_bytes < 0.05 * sum(v.nbytes for v in w2.values())
        assert r.delta_encode_seconds > 0 and r.delta_apply_seconds > 0
        same_bytes(got.tensors, w2)
        stats = reader.statistics().delta
        assert stats["delta_bytes"] == r.delta_bytes and stats["delta_chunks"] == r.delta_chunks
        served = pub.statistics().delta
        assert served["served_chunks"] == r.delta_chunks
        assert served["served_delta_bytes"] == r.delta_bytes
