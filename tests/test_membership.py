"""SWIM + Lifeguard membership: unit scenarios and a hypothesis state machine.

The state machine drives a handful of Membership objects by hand on a virtual clock:
it delivers, drops and delays messages in any order, crashes and restarts peers, and
checks after every step that no view ever moves backwards (incarnation, then
alive < suspect < dead < left), that one peer whose messages always arrive promptly
(the "refuter") is never held dead, and, after a quiet period without loss, that every
live peer holds the same view.
"""

from __future__ import annotations

import dataclasses
import math
import random
import types
import typing

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from simulations.engine import LinkModel, Simulation
from tensorhub.config import PeerConfig
from tensorhub.model import PeerInfo
from tensorhub.protocol.broadcast import BroadcastQueue
from tensorhub.protocol.membership import (
    ALIVE,
    DEAD,
    LEFT,
    MESSAGES,
    STATUSES,
    SUSPECT,
    Ack,
    Gossip,
    IndirectPing,
    Membership,
    MemberState,
    Nack,
    Ping,
    PushPull,
    Update,
)
from tensorhub.protocol.suspicion import Health, Suspicion, suspicion_bounds

LOCAL = PeerConfig.local("t")


def _sim(n: int, seed: int, **overrides: typing.Any) -> Simulation:
    print(f"simulation seed {seed}")
    sim = Simulation(seed, LOCAL.replace(**overrides), LinkModel(delay=0.001, jitter=0.001))
    for _ in range(n):
        sim.add_node()
    for i in range(n):
        sim.start(i, [sim.infos[0].control] if i else [])
    sim.run_until(5.0)
    assert all(len(sim.nodes[i].live_members()) == n for i in range(n))  # type: ignore[union-attr]
    return sim


def _status(sim: Simulation, observer: int, subject: int) -> MemberState | None:
    node = sim.nodes[observer]
    assert node is not None
    return node.members().get(sim.infos[subject].name)


# -- plain unit tests ------------------------------------------------------------------

def test_crash_is_detected_by_everyone_within_the_bound() -> None:
    sim = _sim(8, seed=1)
    crashed_at = sim.now
    sim.crash(3)
    _, high = suspicion_bounds(LOCAL.suspicion_mult, LOCAL.suspicion_max_mult, 8,
                               LOCAL.probe_interval)
    bound = 2 * LOCAL.probe_interval + high + 2 * math.log2(8) * LOCAL.gossip_interval
    sim.run_until(crashed_at + bound)
    for i in sim.live():
        state = _status(sim, i, 3)
        assert state is not None and state.status == DEAD


def test_graceful_leave_is_learnt_as_left_not_dead() -> None:
    sim = _sim(6, seed=2)
    node = sim.nodes[2]
    assert node is not None
    sim._send(2, node.leave(sim.now))
    sim.run_until(sim.now + 1.0)  # a few gossip rounds; the leaver keeps retransmitting
    sim.crash(2)
    sim.run_until(sim.now + 2.0)
    for i in sim.live():
        state = _status(sim, i, 2)
        assert state is not None and state.status == LEFT


def test_restarted_peer_rejoins_with_a_fresh_incarnation() -> None:
    sim = _sim(6, seed=3)
    sim.crash(4)
    sim.run_until(sim.now + 8.0)
    old = {i: _status(sim, i, 4) for i in sim.live()}
    assert all(s is not None and s.status == DEAD for s in old.values())
    node = sim.start(4, [sim.infos[0].control])
    assert node.incarnation == 0
    restarted = sim.now
    sim.run_until(restarted + LOCAL.push_pull_interval)
    for i in sim.live():
        state = _status(sim, i, 4)
        assert state is not None and state.status == ALIVE
        assert state.incarnation == node.incarnation > 0


def test_slow_peer_refutes_and_is_not_declared_dead() -> None:
    sim = _sim(6, seed=4)
    sim.pause(1, 3 * LOCAL.probe_timeout + LOCAL.probe_interval)
    sim.run_until(sim.now + 10.0)
    node = sim.nodes[1]
    assert node is not None and node.incarnation >= 1  # it was suspected and refuted
    for i in sim.live():
        state = _status(sim, i, 1)
        assert state is not None and state.status == ALIVE


def test_partition_heals_into_one_view() -> None:
    sim = _sim(6, seed=5)
    sim.partition([0, 0, 0, 1, 1, 1])
    sim.run_until(sim.now + 30.0)  # long enough for deaths and reaped tombstones
    assert _status(sim, 0, 4) is None or _status(sim, 0, 4).status == DEAD  # type: ignore[union-attr]
    sim.heal()
    sim.run_until(sim.now + LOCAL.push_pull_interval + 2 * math.log2(6) * LOCAL.gossip_interval)
    digests = {sim.nodes[i].digest() for i in sim.live()}  # type: ignore[union-attr]
    assert len(digests) == 1
    assert all(len(sim.nodes[i].live_members()) == 6 for i in sim.live())  # type: ignore[union-attr]


def test_lifeguard_suspicion_shrinks_with_confirmations() -> None:
    low, high = suspicion_bounds(4.0, 6.0, 1000, 1.0)
    assert low == pytest.approx(12.0) and high == pytest.approx(72.0)
    assert suspicion_bounds(4.0, 6.0, 3, 1.0)[0] == pytest.approx(4.0)  # floor of log10(10)
    s = Suspicion(100.0, 0, "a", 2, low, high)
    assert s.deadline() == pytest.approx(172.0)
    assert s.confirm("b") and not s.confirm("b") and not s.confirm("a")
    middle = s.deadline()
    assert 112.0 < middle < 172.0
    assert s.confirm("c") and s.deadline() == pytest.approx(112.0)
    assert not s.confirm("d")  # enough confirmations: no more shortening
    h = Health(8)
    h.apply(20)
    assert h.score == 7 and h.scale(0.5) == 4.0
    h.apply(-100)
    assert h.score == 0


def test_broadcast_queue_least_sent_first_bounded_and_retired() -> None:
    q: BroadcastQueue[str] = BroadcastQueue(bound=3)
    for s in "abc":
        q.put(s, s)
    assert q.take(2, limit=2) == ("c", "b")  # newest first among the never-sent
    assert q.take(2, limit=2) == ("a", "c")  # then the least sent
    q.put("b", "b2")  # replaces the older update about b, which starts again at zero
    assert q.take(1, limit=2) == ("b2",)
    assert q.take(5, limit=2) == ("b2", "a")  # c went out twice: retired
    assert len(q) == 0
    for s in "wxyz":
        q.put(s, s)
    assert len(q) == 3 and q.dropped == 1


def test_messages_are_plain_frozen_wire_types() -> None:
    allowed = {int, float, str, bytes, bool, type(None)}

    def check(tp: typing.Any) -> None:
        if tp in allowed:
            return
        if dataclasses.is_dataclass(tp):
            assert tp.__dataclass_params__.frozen  # type: ignore[union-attr]
            for hint in typing.get_type_hints(tp).values():
                check(hint)
            return
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        assert origin in (tuple, types.UnionType, typing.Union), tp
        for a in args:
            if a is not Ellipsis:
                check(a)

    for cls in MESSAGES:
        check(cls)
        assert {"sender", "sender_name"} <= {f.name for f in dataclasses.fields(cls)}


def test_messages_round_trip_through_the_wire_codec() -> None:
    from tensorhub.errors import RemoteProtocolError
    from tensorhub.protocol import codec, messages

    messages.register_all()
    info = PeerInfo("a", "tcp://a:1", "a:2", (("dc", "x"), ("rack", "r1")))
    alive, suspect = Update(0, "a", 3, "a", info), Update(1, "b", 0, "a", None)
    samples = [Ping("tcp://a:1", "a", 1, "b", (alive, suspect)),
               IndirectPing("tcp://a:1", "a", 2, "b", "tcp://b:1", ()),
               Ack("tcp://a:1", "a", 1, (alive,)),
               Nack("tcp://a:1", "a", 1), Gossip("tcp://a:1", "a", (suspect,)),
               PushPull("tcp://a:1", "a", b"d" * 12, (alive,), True)]
    assert {type(m) for m in samples} == set(MESSAGES)
    for msg in samples:
        assert codec.decode(codec.encode(msg)) == msg
    wire = bytearray(codec.encode(Gossip("tcp://a:1", "a", (suspect,))))
    wire[wire.index(b"\x01\xa1b")] = 9  # the update's kind: 1 -> 9
    with pytest.raises(RemoteProtocolError):
        codec.decode(bytes(wire))


def test_malformed_update_is_refused() -> None:
    info = PeerInfo("a", "a:1", "a:2")
    with pytest.raises(ValueError):
        Update(7, "a", 0, "a", info)
    with pytest.raises(ValueError):
        Update(0, "a", 0, "a", None)  # alive needs the member's info
    with pytest.raises(ValueError):
        Update(0, "b", 0, "b", info)


def test_misdirected_ping_is_not_acked() -> None:
    me = PeerInfo("a", "a:1", "a:2")
    m = Membership(me, LOCAL.replace(name="a"), random.Random(0), 0.0)
    assert m.receive(0.0, Ping("b:1", "b", 1, "someone-else", ())) == []
    assert m.statistics().misdirected == 1
    assert len(m.receive(0.0, Ping("b:1", "b", 2, "a", ()))) == 1


# -- the state machine -------------------------------------------------------------------

N = 5
FORCED = 0.02  # messages to and from the refuter arrive within this many seconds
CONFIG = LOCAL.replace(gossip_fanout=N - 1)
INFOS = [PeerInfo(f"p{i}", f"p{i}:1", f"p{i}:2", (("dc", "x"),)) for i in range(N)]
ADDR = {info.control: i for i, info in enumerate(INFOS)}
REFUTER = 0


class MembershipMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.rng = random.Random(0)
        self.nodes: list[Membership | None] = [None] * N
        self.life = [0] * N
        self.inflight: list[tuple[float, int, int, object]] = []  # sent at, src, dst, msg
        self.seen: dict[tuple[int, int, str], tuple[int, int]] = {}
        for i in range(N):
            self._start(i)

    def _start(self, i: int) -> None:
        node = Membership(INFOS[i], CONFIG.replace(name=INFOS[i].name),
                          random.Random(self.rng.getrandbits(32)), self.now)
        self.nodes[i] = node
        self.life[i] += 1
        seeds = [INFOS[j].control for j in range(N) if j != i and self.nodes[j] is not None]
        self._send(i, node.join(self.now, seeds))

    def _send(self, src: int, out: list[typing.Any]) -> None:
        for o in out:
            self.inflight.append((self.now, src, ADDR[o.dest], o.msg))

    def _deliver(self, k: int) -> None:
        _, _, dst, msg = self.inflight.pop(k)
        node = self.nodes[dst]
        if node is not None:
            self._send(dst, node.receive(self.now, msg))

    def _forced(self, k: int) -> bool:
        return REFUTER in (self.inflight[k][1], self.inflight[k][2])

    def _advance_to(self, end: float) -> None:
        """Run timers up to ``end``, delivering the refuter's messages on time."""
        while True:
            due = [(self.inflight[k][0] + FORCED, k) for k in range(len(self.inflight))
                   if self._forced(k)]
            forced_at, k = min(due, default=(math.inf, -1))
            deadlines = [(n.next_deadline(), i) for i, n in enumerate(self.nodes) if n]
            tick_at, i = min(deadlines)
            if min(forced_at, tick_at) > end:
                break
            if forced_at <= tick_at:
                self.now = max(self.now, forced_at)
                self._deliver(k)
            else:
                self.now = max(self.now, tick_at)
                node = self.nodes[i]
                assert node is not None
                self._send(i, node.tick(self.now))
            self.check_monotone()
        self.now = end

    @rule(dt=st.floats(0.005, 3.0))
    def advance(self, dt: float) -> None:
        self._advance_to(self.now + dt)

    @precondition(lambda self: self.inflight)
    @rule(k=st.integers(0, 10**6))
    def deliver(self, k: int) -> None:
        self._deliver(k % len(self.inflight))

    @precondition(lambda self: self.inflight)
    @rule(k=st.integers(0, 10**6), count=st.integers(1, 20))
    def deliver_many(self, k: int, count: int) -> None:
        for j in range(count):
            if not self.inflight:
                break
            self._deliver((k + j) % len(self.inflight))

    @precondition(lambda self: any(not self._forced(k) for k in range(len(self.inflight))))
    @rule(k=st.integers(0, 10**6))
    def drop(self, k: int) -> None:
        droppable = [j for j in range(len(self.inflight)) if not self._forced(j)]
        self.inflight.pop(droppable[k % len(droppable)])

    @rule(i=st.integers(1, N - 1))
    def crash(self, i: int) -> None:
        self.nodes[i] = None

    @rule(i=st.integers(1, N - 1))
    def restart(self, i: int) -> None:
        if self.nodes[i] is None:
            self._start(i)

    @invariant()
    def check_monotone(self) -> None:
        """No view moves backwards; the refuter is never held dead."""
        for o, node in enumerate(self.nodes):
            if node is None:
                continue
            current = set()
            for name, state in node.members().items():
                key = (state.incarnation, STATUSES.index(state.status))
                slot = (o, self.life[o], name)
                current.add(name)
                old = self.seen.get(slot)
                assert old is None or key >= old, f"{INFOS[o].name} saw {name} go {old}->{key}"
                self.seen[slot] = key
                if name == INFOS[REFUTER].name:
                    assert state.status in (ALIVE, SUSPECT), f"{INFOS[o].name} holds refuter {key}"
            for slot in [s for s in self.seen if s[0] == o and s[1] == self.life[o]]:
                if slot[2] not in current:  # reaped: may be learnt afresh later
                    del self.seen[slot]

    def teardown(self) -> None:
        """Quiescence: no loss, plenty of time -> one view everywhere."""
        while self.inflight:
            self._deliver(0)
        self._advance_until_quiet(self.now + 60.0)
        live = {INFOS[i].name for i, n in enumerate(self.nodes) if n is not None}
        views = []
        for node in self.nodes:
            if node is None:
                continue
            view = {n: (s.status, s.incarnation) for n, s in node.members().items()
                    if s.status in (ALIVE, SUSPECT)}
            assert set(view) == live and all(s == ALIVE for s, _ in view.values()), view
            views.append(view)
        assert all(v == views[0] for v in views)

    def _advance_until_quiet(self, end: float) -> None:
        while self.now < end:
            deadlines = [(n.next_deadline(), i) for i, n in enumerate(self.nodes) if n]
            tick_at, i = min(deadlines)
            if tick_at > end:
                break
            self.now = max(self.now, tick_at)
            node = self.nodes[i]
            assert node is not None
            self._send(i, node.tick(self.now))
            while self.inflight:  # a lossless LAN: everything arrives before the next tick
                self._deliver(0)


MembershipMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, print_blob=True)
TestMembershipMachine = MembershipMachine.TestCase

