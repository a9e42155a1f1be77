"""Reference table: merge is commutative, associative, idempotent; anti-entropy converges."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tensorhub.model import VersionKey
from tensorhub.protocol.refs import Holding, OriginEntry, RefTable, Stamp, bitmap_of

ORIGINS = ["a", "b", "c", "d"]


def holding(model: str, version: int, chunks: set[int], n: int = 10) -> Holding:
    return Holding(model, version, b"m" * 16, "a", n, bitmap_of(chunks, n))


def entry_for(origin: str, generation: int, seq: int) -> OriginEntry:
    """An origin never issues two contents under one stamp: content follows the stamp."""
    rnd = random.Random(f"{origin}/{generation}/{seq}")
    versions = sorted(rnd.sample(range(12), rnd.randrange(4)))
    return OriginEntry(Stamp(origin, generation, seq), tuple(
        holding("m", v, set(range(rnd.randrange(11)))) for v in versions))


entries = st.builds(entry_for, st.sampled_from(ORIGINS), st.integers(0, 3), st.integers(0, 20))


def table_with(entries_: list[OriginEntry]) -> RefTable:
    t = RefTable("observer", 0)
    for e in entries_:
        t.merge(e)
    return t


def snapshot(t: RefTable) -> dict[str, OriginEntry]:
    return {e.origin: e for e in t.origins() if e.origin != "observer"}


@settings(max_examples=200, deadline=None)
@given(st.lists(entries, max_size=12), st.randoms(use_true_random=False))
def test_merge_order_does_not_matter(es: list[OriginEntry], rnd: random.Random) -> None:
    shuffled = es[:]
    rnd.shuffle(shuffled)
    assert snapshot(table_with(es)) == snapshot(table_with(shuffled))


@settings(max_examples=200, deadline=None)
@given(st.lists(entries, max_size=12))
def test_merge_is_idempotent(es: list[OriginEntry]) -> None:
    assert snapshot(table_with(es)) == snapshot(table_with(es + es))


@settings(max_examples=100, deadline=None)
@given(st.lists(entries, max_size=8), st.lists(entries, max_size=8), st.lists(entries, max_size=8))
def test_merge_is_associative(x: list[OriginEntry], y: list[OriginEntry],
                              z: list[OriginEntry]) -> None:
    left = table_with(x + y)
    for e in z:
        left.merge(e)
    right_yz = snapshot(table_with(y + z))
    right = table_with(x)
    for e in right_yz.values():
        right.merge(e)
    assert snapshot(left) == snapshot(right)


def test_bitmap_and_holding() -> None:
    h = holding("m", 1, {0, 3, 9})
    assert [c for c in range(10) if h.has(c)] == [0, 3, 9]
    assert h.count() == 3 and not h.complete
    full = holding("m", 1, set(range(10)))
    assert full.complete and full.bitmap == b"" and full.count() == 10 and not full.has(10)


def test_forget_refuses_stale_copies_until_newer_stamp() -> None:
    t = RefTable("me", 0)
    e1 = OriginEntry(Stamp("b", 1, 5), (holding("m", 1, set(range(10))),))
    assert t.merge(e1)
    assert t.holders(VersionKey("m", 1))
    assert t.forget("b")
    assert not t.merge(e1)  # a slow peer re-gossips the dead holder: refused
    assert not t.holders(VersionKey("m", 1))
    assert t.merge(OriginEntry(Stamp("b", 2, 0), ()))  # restarted with a new generation


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**32), st.integers(1, 30))
def test_digest_anti_entropy_converges(n: int, seed: int, updates: int) -> None:
    rnd = random.Random(seed)
    tables = [RefTable(f"p{i}", 1) for i in range(n)]
    for _ in range(updates):
        t = rnd.choice(tables)
        v = rnd.randrange(5)
        if rnd.random() < 0.7:
            t.put_local(holding("m", v, set(range(rnd.randrange(11)))))
        else:
            t.drop_local(VersionKey("m", v))
    # push-pull rounds with random partners until quiet (bounded)
    for _ in range(4 * n):
        for t in tables:
            other = rnd.choice([o for o in tables if o is not t])
            for part in other.newer_than(t.digest(), max_bytes=256):  # pull
                for e in part:
                    t.merge(e)
            if other.wants_from(t.digest()):  # push what the partner lacks
                for part in t.newer_than(other.digest(), max_bytes=256):
                    for e in part:
                        other.merge(e)
    want = {t.me: t.local for t in tables}
    for t in tables:
        assert {e.origin: e for e in t.origins()} == want


def test_newer_than_splits_into_bounded_parts() -> None:
    t = RefTable("me", 0)
    for i in range(50):
        t.merge(OriginEntry(Stamp(f"o{i}", 0, 1), (holding("m", 1, {1}),)))
    parts = t.newer_than((), max_bytes=1000)
    assert len(parts) > 1
    assert sum(len(p) for p in parts) == 51
    assert all(sum(e.wire_size() for e in p) <= 1000 for p in parts)


class RefTableMachine(RuleBasedStateMachine):
    """Random interleavings of local changes, digest exchanges, crashes and restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = {name: 1 for name in ORIGINS}
        self.tables = {name: RefTable(name, 1) for name in ORIGINS}
        self.dead: set[str] = set()
        self.seen: dict[tuple[str, str], Stamp] = {}

    def live(self) -> list[str]:
        return [n for n in ORIGINS if n not in self.dead]

    @rule(who=st.sampled_from(ORIGINS), version=st.integers(0, 3),
          chunks=st.sets(st.integers(0, 9)), drop=st.booleans())
    def change(self, who: str, version: int, chunks: set[int], drop: bool) -> None:
        if who in self.dead:
            return
        t = self.tables[who]
        if drop:
            t.drop_local(VersionKey("m", version))
        else:
            t.put_local(holding("m", version, chunks))

    @rule(a=st.sampled_from(ORIGINS), b=st.sampled_from(ORIGINS),
          max_bytes=st.sampled_from([200, 4096]))
    def exchange(self, a: str, b: str, max_bytes: int) -> None:
        if a in self.dead or b in self.dead or a == b:
            return
        ta, tb = self.tables[a], self.tables[b]
        for part in tb.newer_than(ta.digest(), max_bytes):
            for e in part:
                if e.origin not in self.dead:
                    ta.merge(e)
        if tb.wants_from(ta.digest()):  # push-pull: a knows something newer
            for part in ta.newer_than(tb.digest(), max_bytes):
                for e in part:
                    if e.origin not in self.dead:
                        tb.merge(e)

    @rule(who=st.sampled_from(ORIGINS))
    def crash(self, who: str) -> None:
        if who in self.dead or len(self.dead) >= 2:
            return
        self.dead.add(who)
        for n in self.live():
            self.tables[n].forget(who)  # membership declared it dead everywhere

    @rule(who=st.sampled_from(ORIGINS))
    def restart(self, who: str) -> None:
        if who not in self.dead:
            return
        self.dead.discard(who)
        self.gen[who] += 1
        self.tables[who] = RefTable(who, self.gen[who])
        # a new table: what the old one had seen says nothing about what it may learn
        for key in [k for k in self.seen if k[0] == who]:
            del self.seen[key]

    @invariant()
    def stamps_never_go_backwards(self) -> None:
        for n in self.live():
            for e in self.tables[n].origins():
                prev = self.seen.get((n, e.origin))
                if prev is not None and e.origin not in self.dead:
                    assert (e.stamp.generation, e.stamp.seq) >= (prev.generation, prev.seq)
                self.seen[(n, e.origin)] = e.stamp

    @invariant()
    def dead_origins_hold_nothing(self) -> None:
        for n in self.live():
            assert not any(e.origin in self.dead for e in self.tables[n].origins())

    def teardown(self) -> None:
        # Quiescence: everyone exchanges with everyone; then all live tables agree.
        live = self.live()
        for _ in range(2):
            for a in live:
                for b in live:
                    self.exchange(a, b, 4096)
        want = {n: self.tables[n].local for n in live}
        for n in live:
            got = {e.origin: e for e in self.tables[n].origins()}
            assert got == want


TestRefTableMachine = RefTableMachine.TestCase
TestRefTableMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
