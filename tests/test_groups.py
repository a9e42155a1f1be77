"""Model-parallel group switch: scenarios, and a stateful test over lossy, reordering
networks with staging failures, timeouts and crashes of any rank (the leader included)."""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
from hypothesis import seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tensorhub.errors import LocalProtocolError, RemoteProtocolError
from tensorhub.protocol import codec
from tensorhub.protocol.groups import (
    MESSAGES,
    NO_ROUND,
    Abort,
    Commit,
    Discard,
    Failed,
    GroupConfig,
    GroupMember,
    GroupMessage,
    Outcome,
    Output,
    Promise,
    Propose,
    Ready,
    Round,
    Send,
    Stage,
    Switch,
)

SEED = int(os.environ.get("TENSORHUB_SEED") or random.randrange(2**32))
print(f"tests/test_groups.py: hypothesis seed {SEED} (TENSORHUB_SEED={SEED} replays it)")

CONFIG = GroupConfig(timeout=10.0, retry=1.0)
Effect = Stage | Switch | Discard


@dataclass
class Wire:
    dst: int  # whichever incarnation of that rank is alive when it arrives gets it
    msg: GroupMessage


class Group:
    """A group of members over an in-memory network the caller schedules."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.names = [f"r{k}" for k in range(size)]
        self.now = 0.0
        self.members: list[GroupMember | None] = [None] * size
        self.life = [0] * size
        self.boots = 0
        self.net: list[Wire] = []
        self.stages: list[tuple[tuple[int, int], Round]] = []  # (incarnation, round)
        self.effects: dict[tuple[int, int], list[Effect]] = {}
        self.votes: dict[tuple[int, Round], dict[int, bool]] = {}  # -> {incarnation: ready}
        for k in range(size):
            self.boot(k)
        for k in range(size):
            self.tell(k)

    def inc(self, k: int) -> tuple[int, int]:
        return (k, self.life[k])

    def alive(self) -> list[int]:
        return [k for k in range(self.size) if self.members[k] is not None]

    def boot(self, k: int) -> None:
        self.life[k] += 1
        self.boots += 1  # a stamp that grows across the group, like the time of day
        self.members[k] = GroupMember(self.names, k, config=CONFIG, boot=self.boots)
        self.effects[self.inc(k)] = []
        self.tell(k)

    def crash(self, k: int) -> None:
        self.members[k] = None

    def member(self, k: int) -> GroupMember:
        m = self.members[k]
        assert m is not None
        return m

    def apply(self, k: int, outs: list[Output]) -> None:
        for o in outs:
            if isinstance(o, Send):
                d = self.names.index(o.dest)
                self.net.append(Wire(d, o.msg))
            else:
                self.effects[self.inc(k)].append(o)
                if isinstance(o, Stage):
                    self.stages.append((self.inc(k), o.round))

    def tell(self, k: int) -> None:
        """Member ``k`` learns the true set of live ranks."""
        self.apply(k, self.member(k).set_live(self.now, self.alive()))

    def deliver(self, i: int) -> None:
        w = self.net.pop(i)
        m = self.members[w.dst]
        if m is not None:  # messages of dead senders still arrive
            self.apply(w.dst, m.receive(self.now, w.msg))

    def report(self, i: int, error: str | None) -> None:
        who, r = self.stages.pop(i)
        m = self.members[who[0]]
        if who == self.inc(who[0]) and m is not None:
            staging = m.status().staging
            if staging is not None and staging[0] == r and staging[2] == "staging":
                self.votes.setdefault((who[0], r), {})[who[1]] = error is None
            self.apply(who[0], m.staged(self.now, r, error))

    def tick(self) -> None:
        for k in self.alive():
            self.apply(k, self.member(k).tick(self.now))

    def start(self, k: int, version: int) -> None:
        self.apply(k, self.member(k).start(self.now, version))

    def run(self, fail: frozenset[int] = frozenset(), ticks: int = 30) -> None:
        """Deliver everything in order and stage successfully (ranks in ``fail`` fail),
        letting timers fire when nothing is in flight, until every rank is settled or
        ``ticks`` timer rounds have passed."""
        while True:
            if self.net:
                self.deliver(0)
            elif self.stages:
                self.report(0, "disk full" if self.stages[0][0][0] in fail else None)
            else:
                due = min((self.member(k).next_deadline() for k in self.alive()),
                          default=math.inf)
                if due == math.inf or ticks == 0 or all(self.settled(k) for k in self.alive()):
                    return
                ticks -= 1
                self.now = max(self.now, due)
                self.tick()

    def settled(self, k: int) -> bool:
        st_ = self.member(k).status()
        return st_.staging is None and not st_.running

    def live_versions(self) -> set[int | None]:
        return {self.member(k).status().live_version for k in self.alive()}


def outcomes(effects: list[Effect]) -> dict[Round, Effect]:
    return {e.round: e for e in effects if not isinstance(e, Stage)}


# -- scenarios --------------------------------------------------------------------------

def test_all_ranks_stage_then_switch_together() -> None:
    g = Group(4)
    g.start(0, 7)
    g.run()
    assert g.live_versions() == {7}
    for effects in g.effects.values():
        assert [type(e) for e in effects] == [Stage, Switch]


def test_one_failed_rank_aborts_everyone_with_the_same_error() -> None:
    g = Group(4)
    g.start(0, 7)
    g.run()
    g.start(0, 8)
    g.run(fail=frozenset({2}))
    assert g.live_versions() == {7}
    last = [effects[-1] for effects in g.effects.values()]
    assert all(isinstance(e, Discard) for e in last)
    assert len({e.error for e in last if isinstance(e, Discard)}) == 1
    assert "rank 2 (r2) could not stage version 8: disk full" in str(last[0])


def test_timeout_aborts_the_round() -> None:
    g = Group(3)
    g.start(0, 5)
    while g.net:
        g.deliver(0)
    g.report(0, None)  # only one rank ever finishes staging
    g.now += CONFIG.timeout
    g.tick()
    g.stages.clear()
    g.run()
    errors = {e.error for es in g.effects.values() for e in es if isinstance(e, Discard)}
    assert len(errors) == 1 and "timed out" in errors.pop()
    assert g.live_versions() == {None}


def _commit_reaches_only(g: Group, ranks: set[int]) -> None:
    """Run a round of version 9 led by rank 0 up to its commit, delivered to ``ranks`` only."""
    g.start(0, 9)
    for _ in range(1000):
        if g.net and not isinstance(g.net[0].msg, Commit):
            g.deliver(0)
        elif g.stages:
            g.report(0, None)
        elif g.net:
            w = g.net.pop(0)
            if w.dst in ranks:
                g.apply(w.dst, g.member(w.dst).receive(g.now, w.msg))
        else:
            return


def test_leader_dies_after_a_partial_commit_and_the_new_leader_finishes_it() -> None:
    g = Group(4)
    _commit_reaches_only(g, {2})
    g.crash(0)
    for k in g.alive():
        g.tell(k)
    g.start(1, 10)  # aborts at once (rank 0 is gone) but settles the blocked round 0
    g.run()
    assert g.live_versions() == {9}
    errors = {e.error for k in (1, 2, 3) for e in g.effects[(k, 1)] if isinstance(e, Discard)}
    assert errors == {"ranks 0 (r0) are not live"}
    g.boot(0)
    for k in range(4):
        g.tell(k)
    g.start(0, 10)
    g.run()
    assert g.live_versions() == {10}


def test_leader_dies_before_any_commit_and_the_round_is_abandoned() -> None:
    g = Group(4)
    _commit_reaches_only(g, set())
    orphan = g.member(0).status().led
    g.crash(0)
    g.boot(0)  # back, fresh, and the leader again
    for k in g.alive():
        g.tell(k)
    g.start(0, 10)
    g.run()
    errors = {e.error for k in (1, 2, 3) for e in g.effects[(k, 1)] if isinstance(e, Discard)}
    assert errors == {f"round {orphan} was abandoned: its leader 0 (r0) left before deciding"}
    assert g.live_versions() == {10}


def test_a_dead_leaders_late_commit_cannot_undo_a_settled_abort() -> None:
    g = Group(4)
    g.start(0, 9)
    orphan = g.member(0).status().led
    late: list[Wire] = []
    while g.net or g.stages:
        if g.net and isinstance(g.net[0].msg, Commit):
            late.append(g.net.pop(0))  # the leader committed; the wire holds the news
        elif g.net:
            g.deliver(0)
        else:
            g.report(0, None)
    g.crash(0)
    g.boot(0)
    for k in range(4):
        g.tell(k)
    g.start(0, 10)
    while g.net and not isinstance(g.net[0].msg, Abort):
        g.deliver(0)  # everyone promised round 10's ballot; the settling abort is next
    g.net[:0] = late
    g.run()
    assert all(isinstance(outcomes(g.effects[(k, 1)])[orphan], Discard) for k in (1, 2, 3))
    assert g.live_versions() == {10}


def test_api_misuse_and_malformed_messages() -> None:
    g = Group(3)
    with pytest.raises(LocalProtocolError, match="not the leader"):
        g.start(1, 1)
    g.start(0, 1)
    with pytest.raises(LocalProtocolError, match="is running"):
        g.start(0, 2)
    m = g.member(1)
    for bad in (Propose(1, Round(4, 1), 1), Propose(7, Round(0, 1), 1),
                Propose(0, Round(-3, 1), 1), Propose(2, Round(3, 1), 1),
                Commit(2, Round(0, 1), 1, Round(0, 1))):
        with pytest.raises(RemoteProtocolError):
            m.receive(0.0, bad)
    with pytest.raises(RemoteProtocolError, match="voted for version"):
        g.member(0).receive(0.0, Ready(1, g.member(0).status().led, 99))
    with pytest.raises(LocalProtocolError):
        GroupConfig(timeout=1.0, retry=2.0)
    with pytest.raises(LocalProtocolError):
        GroupMember(["a", "a"], 0)


@pytest.mark.parametrize("msg", [
    Propose(1, Round(5, 2), 3), Ready(2, Round(5, 2), 3), Commit(1, Round(5, 2), 3, Round(9, 1)),
    Abort(1, Round(5, 2), 3, "boom", Round(9, 1)),
    Failed(2, Round(5, 2), 3, "disk full", Round(7, 1)),
    Promise(2, Round(9, 1), Round(5, 2), 3,
            (Outcome(Round(4, 2), 2, True, ""), Outcome(Round(6, 1), 2, False, "x"))),
])
def test_messages_are_wire_friendly(msg: GroupMessage) -> None:
    assert type(msg) in MESSAGES
    wire = msgpack.unpackb(msgpack.packb(codec._to_wire(msg)))
    assert codec._dataclass_checker(type(msg))(wire) == msg


# -- the stateful test ------------------------------------------------------------------

@seed(SEED)
class GroupMachine(RuleBasedStateMachine):
    """Random interleavings; the invariants hold after every step, and once faults
    heal, one more round brings every rank to the same version."""

    g: Group

    @initialize(size=st.integers(2, 8))
    def setup(self, size: int) -> None:
        self.g = Group(size)
        self.proposed: dict[Round, int] = {}
        self.promised: dict[tuple[int, int], Round] = {}
        self.led: dict[tuple[int, int], Round] = {}
        self.late: list[Wire] = []

    def _leaders(self) -> list[int]:
        return [k for k in self.g.alive()
                if self.g.member(k).is_leader and not self.g.member(k).running]

    @precondition(lambda self: self._leaders())
    @rule(pick=st.integers(0, 7), version=st.integers(1, 4))
    def start(self, pick: int, version: int) -> None:
        leaders = self._leaders()
        k = leaders[pick % len(leaders)]
        self.g.start(k, version)
        r = self.g.member(k).status().led
        assert r not in self.proposed and r > self.led.get(self.g.inc(k), NO_ROUND)
        self.proposed[r], self.led[self.g.inc(k)] = version, r

    @precondition(lambda self: self.g.net)
    @rule(i=st.integers(0, 10**6), count=st.integers(1, 6))
    def deliver(self, i: int, count: int) -> None:
        for j in range(count):
            if self.g.net:
                self.g.deliver((i + j) % len(self.g.net))

    @precondition(lambda self: self.g.net or self.g.stages)
    @rule(count=st.integers(1, 40))
    def make_progress(self, count: int) -> None:
        """A calm spell: messages arrive in order, staging succeeds."""
        for _ in range(count):
            if self.g.net:
                self.g.deliver(0)
            elif self.g.stages:
                self.g.report(0, None)

    @precondition(lambda self: self.g.net)
    @rule(i=st.integers(0, 10**6))
    def drop(self, i: int) -> None:
        self.g.net.pop(i % len(self.g.net))

    @precondition(lambda self: self.g.net)
    @rule(i=st.integers(0, 10**6))
    def hold_back(self, i: int) -> None:
        """Delay a message until a later ``release`` (the long tail of reordering)."""
        self.late.append(self.g.net.pop(i % len(self.g.net)))

    @precondition(lambda self: self.late)
    @rule(i=st.integers(0, 10**6))
    def release(self, i: int) -> None:
        self.g.net.insert(0, self.late.pop(i % len(self.late)))

    @precondition(lambda self: self.g.net)
    @rule(i=st.integers(0, 10**6))
    def duplicate(self, i: int) -> None:
        self.g.net.append(self.g.net[i % len(self.g.net)])

    @precondition(lambda self: self.g.stages)
    @rule(i=st.integers(0, 10**6), ok=st.sampled_from([True, True, True, False]))
    def finish_staging(self, i: int, ok: bool) -> None:
        self.g.report(i % len(self.g.stages), None if ok else "checksum mismatch")

    @precondition(lambda self: len(self.g.alive()) > 1)
    @rule(k=st.integers(0, 7), leader=st.booleans(), now=st.integers(0, 2))
    def crash(self, k: int, leader: bool, now: int) -> None:
        """A crash (one try in three, so that rounds also get to finish), often of the
        latest leader, its round in flight or its decision still on the wire."""
        if now == 0:
            alive = self.g.alive()
            latest = max(alive, key=lambda j: self.g.member(j).status().led)
            self.g.crash(latest if leader else alive[k % len(alive)])

    @rule(k=st.integers(0, 7))
    def restart(self, k: int) -> None:
        if self.g.members[k % self.g.size] is None:
            self.g.boot(k % self.g.size)

    @rule()
    def heal(self) -> None:
        """Every crashed rank restarts and every view catches up."""
        for k in range(self.g.size):
            if self.g.members[k] is None:
                self.g.boot(k)
        for k in range(self.g.size):
            self.g.tell(k)

    @rule(k=st.integers(0, 7))
    def notice(self, k: int) -> None:
        """One member's view catches up with who is live (views lag, never lie)."""
        self.g.tell(self.g.alive()[k % len(self.g.alive())])

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 11.0]))
    def advance(self, dt: float) -> None:
        self.g.now += dt
        self.g.tick()

    @invariant()
    def one_outcome_per_round(self) -> None:
        """Across live ranks, a round switches to its proposed version or aborts with one
        error -- never both; stage rounds and promises only grow."""
        if not hasattr(self, "g"):
            return
        switched: dict[Round, set[int]] = {}
        errors: dict[Round, set[str]] = {}
        for k in self.g.alive():
            who = self.g.inc(k)
            effects = self.g.effects[who]
            stage_rounds = [e.round for e in effects if isinstance(e, Stage)]
            assert stage_rounds == sorted(set(stage_rounds))
            done = [e.round for e in effects if not isinstance(e, Stage)]
            assert len(done) == len(set(done)), f"rank {k} decided a round twice"
            for e in effects:
                assert e.version == self.proposed[e.round]
                if isinstance(e, Switch):
                    switched.setdefault(e.round, set()).add(k)
                elif isinstance(e, Discard):
                    errors.setdefault(e.round, set()).add(e.error)
            last = [e.version for e in effects if isinstance(e, Switch)]
            assert self.g.member(k).status().live_version == (last[-1] if last else None)
            p = self.g.member(k).status().promised
            assert p >= self.promised.get(who, NO_ROUND)
            self.promised[who] = p
        for r in switched:
            assert r not in errors, f"round {r}: ranks {switched[r]} switched, others aborted"
            for k in self.g.alive():  # a commit needs every rank's ready vote
                votes = self.g.votes.get((k, r), {})
                assert votes.get(self.g.life[k], True) or any(votes.values()), \
                    f"round {r} committed over rank {k}'s failed vote"
        for r, errs in errors.items():
            assert len(errs) == 1, f"round {r} aborted with different errors: {errs}"

    def teardown(self) -> None:
        if not hasattr(self, "g"):
            return
        g = self.g
        for k in range(g.size):
            if g.members[k] is None:
                g.boot(k)
        for k in range(g.size):
            g.tell(k)
        final = 99
        for _ in range(6):
            g.run()
            if g.live_versions() == {final}:
                return
            if not g.member(0).running:
                g.start(0, final)
                self.proposed[g.member(0).status().led] = final
            self.one_outcome_per_round()
        raise AssertionError(f"no convergence: {[g.member(k).status() for k in range(g.size)]}")


GroupMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=100, deadline=None, print_blob=True)
TestGroupMachine = GroupMachine.TestCase


def test_a_late_proposal_from_a_dead_leader_is_aborted_everywhere() -> None:
    """Found by the stateful test: rank 1's new incarnation gets a copy of round 5.1's
    proposal from rank 0's dead incarnation after the other ranks saw 5.1 time out and a
    later round commit.  It stages and votes; the vote reaches nobody who leads 5.1, so
    it is blocked until the next leader settles 5.1 -- with the text the other ranks
    still remember, not as abandoned.  No rank switches to it."""
    m = GroupMachine()
    m.setup(size=5)
    steps: list[tuple[str, dict[str, Any]]] = [
        ("start", {"pick": 0, "version": 1}), ("duplicate", {"i": 0}),
        ("advance", {"dt": 11.0}), ("drop", {"i": 0}), ("hold_back", {"i": 3}),
        ("start", {"pick": 0, "version": 1}), ("make_progress", {"count": 35}),
        ("release", {"i": 0}), ("crash", {"k": 0, "leader": False, "now": 0}),
        ("crash", {"k": 0, "leader": False, "now": 0}), ("heal", {}),
        ("hold_back", {"i": 0}), ("start", {"pick": 0, "version": 1}), ("drop", {"i": 0}),
        ("release", {"i": 0})]
    for name, kwargs in steps:
        getattr(m, name)(**kwargs)
        m.one_outcome_per_round()
    m.teardown()
    m.one_outcome_per_round()
    first = Round(5, 1)
    errors = {k: e.error for k in m.g.alive() for e in m.g.effects[m.g.inc(k)]
              if isinstance(e, Discard) and e.round == first}
    assert not any(isinstance(e, Switch) and e.round == first
                   for k in m.g.alive() for e in m.g.effects[m.g.inc(k)])
    assert sorted(errors) == [1, 2, 3, 4] and set(errors.values()) == {
        "round 5.1 timed out after 10.0s waiting for ranks 0 (r0), 1 (r1), 2 (r2), 3 (r3), "
        "4 (r4)"}
