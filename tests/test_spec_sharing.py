"""A publisher's versions of one model share one tuple of tensor specs while the
tensors stay the same, and hash the arrays themselves: publishing makes no object per
tensor that outlives the last versions held, so the garbage collector's full
collections stay short however many versions go by."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from helpers import open_mesh
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.manifest.digests import digest_of
from tensorhub.manifest.manifest import build_manifest
from tensorhub.manifest.table import SpecRow, built_specs
from tensorhub.model import TensorSpec, VersionKey


def weights(n: int, seed: int) -> list[tuple[str, np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(seed)
    return [(f"layer.{i}", rng.standard_normal(97 + i % 5).astype(np.float32))
            for i in range(n)]


@pytest.mark.parametrize("algo", ["xxh3-128", "blake3", "sha256"])
def test_the_next_version_of_the_same_tensors_shares_the_specs(algo: str) -> None:
    w1, w2 = weights(300, 1), weights(300, 2)
    m1 = build_manifest(VersionKey("shared-specs", 1), w1, 4096, algo)
    m2 = build_manifest(VersionKey("shared-specs", 2), w2, 4096, algo)
    assert m2.tensors is m1.tensors
    assert m2.table is m1.table
    assert m2.chunk_digests != m1.chunk_digests  # the bytes are each version's own
    # the digests are those of each version's bytes, chunk by chunk
    for m, w in ((m1, w1), (m2, w2)):
        flat = b"".join(a.tobytes() for _, a in w)
        assert [digest_of(algo, [flat[c * 4096:(c + 1) * 4096]])
                for c in range(m.num_chunks)] == list(m.chunk_digests)


def test_other_tensors_get_specs_of_their_own() -> None:
    w = weights(50, 1)
    m1 = build_manifest(VersionKey("other-specs", 1), w, 4096, "xxh3-128")
    changed = [*w[:-1], (w[-1][0], np.zeros(3, np.float32))]
    m2 = build_manifest(VersionKey("other-specs", 2), changed, 4096, "xxh3-128")
    assert m2.tensors is not m1.tensors
    assert m2.tensors[-1].shape == (3,) and m1.tensors[-1].shape == w[-1][1].shape
    assert m2.tensors[:-1] == m1.tensors[:-1]
    # another model with the same tensors does not disturb the first one's entry
    m3 = build_manifest(VersionKey("another", 1), changed, 4096, "xxh3-128")
    m4 = build_manifest(VersionKey("other-specs", 3), changed, 4096, "xxh3-128")
    assert m4.tensors is m2.tensors and m3.tensors == m2.tensors


_rows = st.lists(st.tuples(
    st.sampled_from(["a", "b", "c"]), st.sampled_from(["<f4", "|u1", "<f2"]),
    st.lists(st.integers(0, 4), max_size=2).map(tuple), st.integers(0, 99),
    st.sampled_from([(), (8,)]), st.sampled_from([(), (1,)])), max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["p", "q"]), _rows), min_size=1, max_size=6))
def test_shared_specs_are_always_those_of_the_rows_given(
        builds: list[tuple[str, list[SpecRow]]]) -> None:
    """Whatever builds came before, the specs handed out equal fresh ones of the rows."""
    for model, rows in builds:
        got = built_specs((f"property-{model}", 0, b""), list(rows))
        assert got == tuple(TensorSpec(*row) for row in rows)


async def test_publishing_version_after_version_keeps_one_spec_per_tensor() -> None:
    async with open_mesh(1) as (pub,):
        def specs_alive() -> int:
            gc.collect()
            return sum(type(o) is TensorSpec for o in gc.get_objects())

        w = dict(weights(2000, 0))
        await pub.publish("churn", 1, w)
        await pub.publish("churn", 2, w)
        before = specs_alive()
        for v in range(3, 9):
            await pub.publish("churn", v, w)
            await pub.unpublish("churn", v - 2)
        assert specs_alive() - before < 100  # not 2,000 more a version
