"""Small segments are hashed together (``digests._update_coalesced``): the digest is
still the one of the bytes in order, for every algorithm, any sizes, any thread."""

from __future__ import annotations

import hashlib
import threading

import blake3
import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.manifest.digests import COALESCE_BELOW, DIGEST_ALGOS, HASHED_BLOCK, digest_of

ONE_SHOT = {"blake3": lambda b: blake3.blake3(b).digest(),
            "sha256": lambda b: hashlib.sha256(b).digest(),
            "xxh3-128": lambda b: xxhash.xxh3_128(b).digest()}

SIZES = st.one_of(st.integers(0, 64), st.integers(4000, 5000),
                  st.integers(COALESCE_BELOW - 2, COALESCE_BELOW + 2),
                  st.integers(HASHED_BLOCK - 3, HASHED_BLOCK + 3))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(SIZES, max_size=12), seed=st.integers(0, 2**32 - 1))
def test_the_digest_of_segments_is_the_digest_of_their_bytes_in_order(
        sizes: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    segments = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    whole = b"".join(s.tobytes() for s in segments)
    for algo in DIGEST_ALGOS:
        assert digest_of(algo, segments) == ONE_SHOT[algo](whole), (algo, sizes)


def test_arrays_of_any_dtype_and_shape_are_hashed_as_their_bytes() -> None:
    rng = np.random.default_rng(7)
    segments = [rng.random((3, 5)).astype(np.float32), rng.random(7),
                np.arange(4096, dtype=np.int16).reshape(64, 64), memoryview(b"tail")]
    whole = b"".join(bytes(memoryview(s).cast("B")) for s in segments)
    for algo in DIGEST_ALGOS:
        assert digest_of(algo, segments) == ONE_SHOT[algo](whole)


def test_threads_hashing_at_once_each_get_their_own_digest() -> None:
    """The scratch buffer is per thread: eight threads hashing 1,000 small segments
    each, at once, all get the digest of their own bytes."""
    results: dict[int, bool] = {}

    def work(i: int) -> None:
        rng = np.random.default_rng(i)
        segments = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(1000)]
        whole = b"".join(s.tobytes() for s in segments)
        results[i] = all(digest_of("blake3", segments) == ONE_SHOT["blake3"](whole)
                         for _ in range(3))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: True for i in range(8)}
