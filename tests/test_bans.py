"""Cryptographic chunk digests by default, and holders that serve bad bytes are banned
across fetches; other peers hear of it only as a hint."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from corrupting import corrupt_served
from helpers import complete_holders, open_mesh, wait_until
from test_mesh import weights

import tensorhub
from tensorhub import IntegrityError, PeerConfig, VersionKey
from tensorhub.manifest.digests import DIGEST_SIZES, digest_of
from tensorhub.manifest.manifest import build_manifest
from tensorhub.protocol.bans import Ban, BanNotice, BanTable
from tensorhub.read.transfer import Transfer


async def test_the_default_digest_is_cryptographic_and_one_flipped_bit_fails() -> None:
    cfg = PeerConfig.local("x")
    assert cfg.digest_algo == "blake3"
    arr = np.random.default_rng(0).integers(0, 255, 3 * 4096, dtype=np.uint8)
    m = build_manifest(VersionKey("m", 1), [("w", arr)], 4096, cfg.digest_algo)
    assert m.digest_algo == "blake3" and {len(d) for d in m.chunk_digests} == {
        DIGEST_SIZES["blake3"]}
    flipped = arr.copy()
    flipped[5000] ^= 1  # one bit of chunk 1
    assert digest_of("blake3", [memoryview(flipped[4096:8192])]) != m.chunk_digests[1]
    assert digest_of("blake3", [memoryview(arr[4096:8192])]) == m.chunk_digests[1]
    # the fetcher's check names the source of the bad chunk
    local = tensorhub.read.store.LocalVersion(m, [flipped], "pub", verified=False)
    job = Transfer(me="me", local=local, view=lambda k: [], connect=None,  # type: ignore[arg-type]
                upstream=frozenset(), window=1, stall_timeout=1.0, on_progress=lambda: None,
                banned=lambda n: None, on_bad_bytes=lambda *a: None)
    with pytest.raises(IntegrityError, match="chunk 1") as info:
        job._verifier(1, "liar")([memoryview(flipped[4096:8192])])
    assert info.value.source == "liar"


async def test_statistics_say_whether_the_digest_holds_against_lying_holders() -> None:
    async with tensorhub.open_peer(PeerConfig.local("a")) as a, \
            tensorhub.open_peer(PeerConfig.local("b", digest_algo="xxh3-128")) as b:
        assert "cryptographic" in a.statistics().digest
        assert "trusted fleet only" in b.statistics().digest


def test_bans_expire_and_notices_are_only_counted() -> None:
    table = BanTable(seconds=10.0)
    assert table.ban(100.0, "liar", "chunk 3 failed")
    assert not table.ban(101.0, "liar", "again")  # already banned: no second notice
    assert table.get(110.9, "liar") == Ban(111.0, "again")
    assert table.active(105.0) == {"liar": (6.0, "again")}
    assert table.get(111.0, "liar") is None and table.active(111.0) == {}
    table.hint(BanNotice("p2", "honest", "m@1", "trust me"))
    assert table.notices == {"p2": 1} and table.get(111.0, "honest") is None


async def test_a_holder_that_served_bad_bytes_is_not_contacted_again() -> None:
    # Full chunks only (no delta against v1 for v2): the bytes each source sent are
    # then all in the report's ``bytes_by_source``.
    async with open_mesh(3, planning=False, delta="off") as (pub, liar, reader):
        w = weights(1, mib=2)
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            await liar.wait_for_version("m", None)
        await liar.fetch("m", 1)
        key = VersionKey("m", 1)
        await wait_until(lambda: len(complete_holders(reader, key)) >= 2,
                         what="the reader seeing the liar as a complete holder")
        corrupt_served(liar, 1 << 30)
        # The reader prefers a holder that is not the publisher: the liar first.
        got = await reader.fetch("m", 1)
        assert got.report.verified and got.report.integrity_failures.get("p1", 0) >= 1
        assert "failed its digest" in got.report.dropped_sources["p1"]
        for k, v in w.items():
            np.testing.assert_array_equal(got.tensors[k], v)
        stats = reader.statistics()
        assert "failed its digest" in stats.bans["p1"]
        # The others hear of it as a hint, and ban nobody on the reader's word.
        await wait_until(lambda: pub.statistics().ban_notices == {"p2": 1},
                         what="the publisher hearing the reader's ban notice")
        assert pub.statistics().bans == {} and liar.statistics().ban_notices == {}

        # A later version: the liar holds it too, but the reader does not ask it.
        await pub.publish("m", 2, weights(2, mib=2))
        with trio.fail_after(10):
            await liar.wait_for_version("m", 1)
        await liar.fetch("m", 2)
        key2 = VersionKey("m", 2)
        await wait_until(lambda: len(complete_holders(reader, key2)) >= 2,
                         what="the reader seeing two complete holders of m@2")
        served = liar.statistics().chunks_served
        got2 = await reader.fetch("m", 2)
        assert got2.report.verified and set(got2.report.bytes_by_source) == {"p0"}
        assert "p1" in got2.report.banned_sources and not got2.report.integrity_failures
        assert liar.statistics().chunks_served == served
        assert reader.statistics().integrity_failures == got.report.integrity_failures
