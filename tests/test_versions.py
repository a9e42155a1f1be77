"""Version lifecycle: sealing, a monotonic ``latest``, retention -- against naive references."""

from __future__ import annotations

import os
import random
import re
from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import given, note, seed, settings
from hypothesis import strategies as st

from tensorhub.errors import ConsistencyError, LocalProtocolError, VersionUnavailable
from tensorhub.protocol.versions import (
    RetentionError,
    RetentionPolicy,
    ShardClaim,
    VersionView,
    must_offload,
    retained,
    seal_status,
)

SEED = int(os.environ.get("TENSORHUB_SEED") or random.randrange(2**32))
print(f"tests/test_versions.py: hypothesis seed {SEED} (TENSORHUB_SEED={SEED} replays it)")

MODEL = "llama"
ORIGINS = [f"p{i}" for i in range(6)]


def naive_seal(claims: list[ShardClaim]) -> dict[int, tuple[bool, list[int], dict[str, set[str]]]]:
    """Per version: (sealed, missing shards, {disagreement: origins named})."""
    out = {}
    for v in sorted({c.version for c in claims}):
        cs = [c for c in claims if c.version == v]
        named: dict[str, set[str]] = {}
        if len({c.world for c in cs}) > 1:
            named["world"] = {c.origin for c in cs}
        if len({c.layout_id for c in cs}) > 1:
            named["layout id"] = {c.origin for c in cs}
        if len({c.schema for c in cs}) > 1:
            named["tensor specs"] = {c.origin for c in cs}
        for s in {c.shard for c in cs}:
            if len({c.manifest_id for c in cs if c.shard == s}) > 1:
                named[f"manifest of shard {s}"] = {c.origin for c in cs if c.shard == s}
        missing = []
        if "world" not in named:
            missing = [s for s in range(cs[0].world)
                       if not any(c.shard == s and c.complete for c in cs)]
        out[v] = (not named and not missing, missing, named)
    return out


@st.composite
def claim_sets(draw: st.DrawFn) -> list[ShardClaim]:
    """Multi-rank publishes of a few versions, with fetchers' copies, unfinished shards,
    crashed ranks (shards nobody holds) and the odd rank that disagrees."""
    claims = []
    for v in draw(st.sets(st.integers(0, 5), max_size=4)):
        world = draw(st.integers(1, 4))
        layout = draw(st.sampled_from([b"L1", b"L2"]))
        for shard in range(world):
            for origin in draw(st.sets(st.sampled_from(ORIGINS), max_size=3)):
                w, lay, man, schema = world, layout, b"m%d" % shard, b"s"
                odd = draw(st.integers(0, 19))
                if odd == 0:
                    w = world + 1
                elif odd == 1:
                    lay = b"other"
                elif odd == 2:
                    man = b"forged"
                elif odd == 3:  # another dtype, shape or tensor set at this rank
                    schema = b"other"
                claims.append(ShardClaim(origin, v, shard, w, lay, draw(st.booleans()), man,
                                         schema=schema))
    return claims


@seed(SEED)
@given(claim_sets())
@settings(max_examples=300, deadline=None)
def test_sealed_iff_complete_coverage_and_agreement(claims: list[ShardClaim]) -> None:
    got = seal_status(claims)
    want = naive_seal(claims)
    assert set(got) == set(want)
    for v, (sealed, missing, named) in want.items():
        s = got[v]
        assert s.sealed == sealed and list(s.missing) == missing
        assert {c.what: {o for _, who in c.claims for o in who} for c in s.conflicts} == named
        assert (s.reason() == "") == sealed
        if named:
            with pytest.raises(ConsistencyError):
                s.check(MODEL)
        elif missing:
            with pytest.raises(VersionUnavailable, match=re.escape(f"shards {missing}")):
                s.check(MODEL)
        else:
            s.check(MODEL)
            assert s.world is not None and s.layout_id is not None


# -- latest and wake-ups, over random publish / copy / unpublish / crash sequences -------

OPS = st.lists(st.tuples(
    st.sampled_from(["publish", "finish", "copy", "unpublish", "crash", "disagree", "look"]),
    st.integers(0, 6),              # version
    st.sampled_from(ORIGINS),
    st.integers(0, 3),              # shard
), max_size=60)


@seed(SEED)
@given(OPS)
@settings(max_examples=500, deadline=None)
def test_latest_is_monotonic_and_each_newer_version_is_reported_once(
        ops: list[tuple[str, int, str, int]]) -> None:
    world = {v: 1 + v % 3 for v in range(7)}  # every publish of v agrees on this
    table: dict[tuple[str, int, int], ShardClaim] = {}  # (origin, version, shard)
    view = VersionView()
    reported: list[int] = []
    latest = None
    for op, v, origin, shard in ops:
        shard %= world[v]
        key = (origin, v, shard)
        if op == "publish":
            table[key] = ShardClaim(origin, v, shard, world[v], b"L", False)
        elif (op == "finish" and key in table) or (  # a copy needs a complete source
                op == "copy" and any(c.complete for k, c in table.items() if k[1:] == key[1:])):
            table[key] = ShardClaim(origin, v, shard, world[v], b"L", True)
        elif op == "unpublish":
            table = {k: c for k, c in table.items() if k[:2] != (origin, v)}
        elif op == "crash":
            table = {k: c for k, c in table.items() if k[0] != origin}
        elif op == "disagree":
            table[key] = ShardClaim(origin, v, shard, world[v], b"X", True)
        sealed_now = {v for v, (ok, _, _) in naive_seal(list(table.values())).items() if ok}
        newer = view.update(MODEL, table.values())
        note(f"{op} v{v} {origin} shard {shard} -> sealed {sorted(sealed_now)}, woke {newer}")
        floor = -1 if latest is None else latest
        assert list(newer) == sorted(u for u in sealed_now if u > floor)
        assert not set(newer) & set(reported)
        reported += newer
        latest = max(reported, default=None)
        assert view.latest(MODEL) == latest
        assert set(view.sealed(MODEL)) == sealed_now
        assert all(s.version > floor and not s.sealed for s in view.unsealed(MODEL))
        if latest is not None and latest not in sealed_now:  # it lost holders, or a dissenter
            with pytest.raises((VersionUnavailable, ConsistencyError)):
                view.require(MODEL, latest)
        elif latest is not None:
            assert view.require(MODEL, latest).sealed
    assert reported == sorted(reported)
    with pytest.raises(VersionUnavailable, match="no live peer"):
        view.require("other-model", 1)


def test_a_rank_that_dies_before_sealing_leaves_the_version_unsealed_and_says_so() -> None:
    view = VersionView()
    v1 = [ShardClaim(f"t{r}", 1, r, 4, b"tp4", True) for r in range(4)]
    assert view.update(MODEL, v1) == (1,)
    v2 = [ShardClaim(f"t{r}", 2, r, 4, b"tp4", r != 3) for r in range(4)]
    assert view.update(MODEL, v1 + v2) == ()
    assert view.latest(MODEL) == 1
    (stuck,) = view.unsealed(MODEL)
    assert stuck.version == 2 and stuck.missing == (3,)
    assert "shards [3] of 4 have no complete holder" in stuck.reason()
    odd = ShardClaim("t9", 2, 3, 8, b"tp8", True)
    assert view.update(MODEL, [*v1, *v2, odd]) == ()
    (stuck,) = view.unsealed(MODEL)
    assert "t9" in stuck.reason() and "world" in stuck.reason()


def test_ranks_announcing_other_tensor_specs_never_seal_and_are_named() -> None:
    good, odd = b"\x01" * 16, b"\x02" * 16
    claims = [ShardClaim(f"t{r}", 1, r, 4, b"tp4", True, b"m%d" % r, 0,
                         odd if r == 2 else good) for r in range(4)]
    claims.append(ShardClaim("copy", 1, 2, 4, b"tp4", True, b"m2", 0, odd))
    for window in (None, 8):  # secure mode: each rank's only publish is its earliest
        view = VersionView(window)
        assert view.update(MODEL, claims) == ()
        (stuck,) = view.unsealed(MODEL)
        assert stuck.schema is None
        assert stuck.reason() == (
            "holders disagree on the tensor specs: 02020202 (rank 2) from copy, t2; "
            "01010101 (ranks 0, 1, 3) from t0, t1, t3")
        with pytest.raises(ConsistencyError, match=r"version 1: holders disagree on the "
                                                   r"tensor specs"):
            view.require(MODEL, 1)
    agreed = [replace(c, schema=good) for c in claims]
    assert seal_status(agreed)[1].sealed and seal_status(agreed)[1].schema == good


def test_claims_are_validated() -> None:
    with pytest.raises(LocalProtocolError, match="shard 4 of a world of 4"):
        ShardClaim("p", 1, 4, 4, b"L", True)


# -- retention ---------------------------------------------------------------------------

policies = st.builds(RetentionPolicy, st.integers(0, 4),
                     st.frozensets(st.integers(0, 9), max_size=3), st.booleans())


@seed(SEED)
@given(st.sets(st.integers(0, 9)), policies)
@settings(max_examples=300, deadline=None)
def test_retained_matches_reference(sealed: set[int], policy: RetentionPolicy) -> None:
    newest = sorted(sealed, reverse=True)[:policy.keep_latest]
    assert retained(sealed, policy) == set(newest) | policy.pins


@seed(SEED)
@given(claim_sets(), policies, st.sampled_from(ORIGINS), st.integers(0, 5), st.integers(0, 3))
@settings(max_examples=300, deadline=None)
def test_must_offload_exactly_for_the_last_complete_holder_of_a_retained_shard(
        claims: list[ShardClaim], policy: RetentionPolicy, me: str, v: int, shard: int) -> None:
    sealed = {u for u, (ok, _, _) in naive_seal(claims).items() if ok}
    keep = v in set(sorted(sealed, reverse=True)[:policy.keep_latest]) | policy.pins
    holders = {c.origin for c in claims if (c.version, c.shard) == (v, shard) and c.complete}
    want = keep and holders == {me}
    if want and not policy.offload:
        with pytest.raises(RetentionError, match="last complete copy"):
            must_offload(MODEL, v, shard, me, claims, policy)
    else:
        assert must_offload(MODEL, v, shard, me, claims, policy) == want


def test_retention_scenario_last_holder_offloads_then_copy_is_dropped() -> None:
    by_origin: dict[str, list[ShardClaim]] = defaultdict(list)
    for v in (1, 2):
        for r in range(2):
            by_origin[f"t{r}"].append(ShardClaim(f"t{r}", v, r, 2, b"L", True))
    by_origin["roll"].append(ShardClaim("roll", 2, 0, 2, b"L", True))
    claims = [c for cs in by_origin.values() for c in cs]
    policy = RetentionPolicy()  # keep the latest: version 2
    assert not must_offload(MODEL, 1, 0, "t0", claims, policy)      # not retained
    assert not must_offload(MODEL, 2, 0, "t0", claims, policy)      # "roll" also holds it
    assert must_offload(MODEL, 2, 1, "t1", claims, policy)          # the last copy
    with pytest.raises(RetentionError):
        must_offload(MODEL, 2, 1, "t1", claims, RetentionPolicy(offload=False))
    assert must_offload(MODEL, 1, 1, "t1", claims, policy.pin(1))
    assert not must_offload(MODEL, 1, 1, "t1", claims, policy.pin(1).unpin(1))
    newer = [*claims, *(ShardClaim(f"t{r}", 3, r, 2, b"L", True) for r in range(2))]
    assert not must_offload(MODEL, 2, 1, "t1", newer, policy)       # 3 sealed: 2 may go


@pytest.mark.parametrize("kwargs", [
    {"keep_latest": -1}, {"keep_latest": True}, {"keep_latest": 1.0},
    {"pins": {1}}, {"pins": frozenset({-1})}, {"offload": 1},
])
def test_retention_policy_is_validated(kwargs: dict[str, object]) -> None:
    with pytest.raises(LocalProtocolError):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]
