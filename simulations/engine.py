"""A deterministic discrete-event simulator that drives the real protocol objects.

Theory of operation
-------------------
One seeded ``random.Random`` decides everything random (link jitter and loss, each
peer's own rng seed, scenario choices), one virtual clock advances, and one heap holds
what happens next: message deliveries, peer wake-ups (each peer's
``Membership.next_deadline()``; an outdated wake-up is skipped) and scenario actions.
Ties in time are broken by insertion order, so the same seed gives the same run.

The link model gives each message a delay (``delay`` + uniform ``jitter``), a chance
of loss (the link's, plus extra loss on chosen peers' links) and, when ``bandwidth``
is set, a serialisation delay behind earlier messages on the sender's NIC.  Faults:
a crashed peer loses its object (a restart makes a fresh one, incarnation 0); a
paused peer queues what it receives and sleeps through its deadlines until it
resumes; a partition drops every message between groups, in flight or not.

Every delivered message is recorded as (time, sender, receiver, type) and hashed
(sha256) into :attr:`Simulation.trace_hash`.  Nothing here knows the protocol's
rules: it only calls ``join``/``tick``/``receive`` and reads ``drain_events``.
"""

from __future__ import annotations

import copyreg
import gc
import hashlib
import heapq
import pickle
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from tensorhub.config import PeerConfig
from tensorhub.model import PeerInfo
from tensorhub.protocol.membership import (
    MESSAGES,
    MemberEvent,
    Membership,
    MemberState,
    Outbound,
    PushPull,
    Update,
)

_DELIVER, _TICK, _CALL = range(3)
_TYPE_CODE = {cls: i for i, cls in enumerate(MESSAGES)}
_TRACE_FOLD = 1 << 20

Observer = Callable[[float, int, list[MemberEvent]], None]


@dataclass(frozen=True)
class LinkModel:
    delay: float = 0.0005       # one-way seconds (LAN)
    jitter: float = 0.0005      # + uniform [0, jitter)
    loss: float = 0.0           # probability a message is lost
    bandwidth: float | None = None  # bytes/s per sender NIC; None: not modelled


_FIELDS: dict[type, tuple[str, ...]] = {}


def _plain(obj: Any) -> Any:
    names = _FIELDS.get(type(obj))
    if names is None:
        names = _FIELDS[type(obj)] = tuple(f.name for f in fields(obj))
    return [getattr(obj, n) for n in names]


_packer = msgpack.Packer(default=_plain, use_bin_type=True)


def _reduce_frozen(obj: Any) -> tuple[type, tuple[Any, ...]]:
    """Pickle a frozen slots dataclass as a constructor call (3x faster to load)."""
    return type(obj), tuple(_plain(obj))


for _cls in (MemberState, Update):
    copyreg.pickle(_cls, _reduce_frozen)


def wire_size(msg: Any) -> int:
    """Bytes of ``msg`` packed as msgpack arrays of its fields (as dataclasses.astuple)."""
    return len(_packer.pack(msg)) + 1  # + the codec's type id


def peer_info(i: int) -> PeerInfo:
    """Fixed-width names and addresses, so message sizes do not grow with N."""
    return PeerInfo(f"peer-{i:05d}", f"sim-{i:05d}:7946", f"sim-{i:05d}:7947",
                    (("dc", "dc0"), ("rack", f"r{i // 32:03d}")))


class Simulation:
    def __init__(self, seed: int, config: PeerConfig, link: LinkModel,
                 measure_bytes: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.config = config
        self.link = link
        self.measure_bytes = measure_bytes or link.bandwidth is not None
        self.now = 0.0
        self.nodes: list[Membership | None] = []
        self.infos: list[PeerInfo] = []
        self.index: dict[str, int] = {}
        self.group: list[int] = []
        self.extra_loss: list[float] = []
        self.observers: list[Observer] = []
        self.sent = 0
        self.delivered = 0
        self.dropped = 0
        self.bytes_sent = 0
        self._heap: list[tuple[float, int, int, int, int, Any]] = []
        self._seq = 0
        self._tick_at: list[float] = []
        self._paused: list[bool] = []
        self._backlog: list[list[tuple[int, Any]]] = []
        self._nic_free: list[float] = []
        self._rngs: list[random.Random | None] = []  # each peer's own rng
        self._partitioned = False
        self._hash = hashlib.sha256()
        self._trace_t = array("q")
        self._trace_e = array("q")

    # -- building ----------------------------------------------------------------------

    def add_node(self, info: PeerInfo | None = None) -> int:
        i = len(self.nodes)
        info = info or peer_info(i)
        self.infos.append(info)
        self.index[info.control] = i
        self.nodes.append(None)
        self.group.append(0)
        self.extra_loss.append(0.0)
        self._tick_at.append(float("inf"))
        self._paused.append(False)
        self._backlog.append([])
        self._nic_free.append(0.0)
        self._rngs.append(None)
        return i

    def start(self, i: int, seeds: list[str]) -> Membership:
        """(Re)start peer ``i`` with a fresh Membership and join through ``seeds``."""
        rng = random.Random(self.rng.getrandbits(64))
        node = Membership(self.infos[i], self.config.replace(name=self.infos[i].name),
                          rng, self.now)
        self.nodes[i] = node
        self._rngs[i] = rng
        self._paused[i] = False
        self._backlog[i].clear()
        self._tick_at[i] = float("inf")
        self._after(i, node, node.join(self.now, seeds))
        return node

    def bootstrap(self, n: int) -> None:
        """``n`` peers that already know each other: each is handed everyone's record,
        as if from a state exchange; run until their gossip queues drain."""
        first = len(self.nodes)
        for _ in range(n):
            self.add_node()
        records = tuple(Update(0, info.name, 0, info.name, info) for info in self.infos[first:])
        for i in range(first, first + n):
            node = self.start(i, [])
            msg = PushPull(self.infos[first].control, self.infos[first].name, b"", records, False)
            self._after(i, node, node.receive(self.now, msg))
        gc.freeze()  # the views just built live on; spare the collector from rescanning them

    def snapshot(self) -> bytes:
        """The whole simulation, pickled (scheduled actions must not be pending)."""
        state = dict(self.__dict__, observers=[], _hash=None)
        if any(entry[2] == _CALL for entry in self._heap):
            raise RuntimeError("cannot snapshot with scheduled actions pending")
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def restore(cls, data: bytes, seed: int) -> Simulation:
        """A copy of a snapshot that continues under ``seed``: the simulator's rng and
        every peer's rng are reseeded from it, and the trace starts afresh."""
        sim = cls.__new__(cls)
        gc.disable()  # millions of long-lived objects: collecting while loading them is waste
        try:
            sim.__dict__.update(pickle.loads(data))
        finally:
            gc.enable()
        gc.freeze()  # ... and scanning them on every later collection too
        sim.seed = seed
        sim.rng = random.Random(seed)
        for rng in sim._rngs:
            if rng is not None:
                rng.seed(sim.rng.getrandbits(64))
        sim._hash = hashlib.sha256()
        del sim._trace_t[:], sim._trace_e[:]
        sim.sent = sim.delivered = sim.dropped = sim.bytes_sent = 0
        return sim

    # -- faults --------------------------------------------------------------------------

    def crash(self, i: int) -> None:
        self.nodes[i] = None
        self._paused[i] = False
        self._backlog[i].clear()

    def pause(self, i: int, duration: float) -> None:
        if self.nodes[i] is None or self._paused[i]:
            return
        self._paused[i] = True
        self.at(self.now + duration, lambda: self._resume(i))

    def partition(self, groups: list[int]) -> None:
        self.group = list(groups)
        self._partitioned = True

    def heal(self) -> None:
        self.group = [0] * len(self.nodes)
        self._partitioned = False

    def live(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node is not None]

    # -- running ---------------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], object]) -> None:
        self._push(when, _CALL, 0, 0, action)

    def run_until(self, end: float, stop: Callable[[], bool] | None = None) -> None:
        """Process events up to virtual time ``end`` (or until ``stop()`` after a call)."""
        heap = self._heap
        nodes = self.nodes
        pop = heapq.heappop
        while heap and heap[0][0] <= end:
            t, _, kind, a, b, payload = pop(heap)
            self.now = t
            if kind == _DELIVER:
                node = nodes[b]
                if node is None or (self._partitioned and self.group[a] != self.group[b]):
                    self.dropped += 1
                elif self._paused[b]:
                    self._backlog[b].append((a, payload))
                else:
                    self._deliver(a, b, node, payload)
            elif kind == _TICK:
                node = nodes[a]
                if node is None or self._paused[a] or t != self._tick_at[a]:
                    continue
                deadline = node.next_deadline()
                if deadline > t:
                    self._tick_at[a] = deadline
                    self._push(deadline, _TICK, a, 0, None)
                    continue
                self._tick_at[a] = float("inf")
                self._after(a, node, node.tick(t))
            else:
                payload()
                if stop is not None and stop():
                    return
        self.now = max(self.now, end)

    def trace_hash(self) -> str:
        self._fold()
        return self._hash.copy().hexdigest()

    # -- internals ---------------------------------------------------------------------

    def _push(self, when: float, kind: int, a: int, b: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, kind, a, b, payload))

    def _deliver(self, src: int, dst: int, node: Membership, msg: Any) -> None:
        self.delivered += 1
        self._trace_t.append(int(self.now * 1e9))
        self._trace_e.append((src << 32) | (dst << 8) | _TYPE_CODE[type(msg)])
        if len(self._trace_t) >= _TRACE_FOLD:
            self._fold()
        self._after(dst, node, node.receive(self.now, msg))

    def _after(self, i: int, node: Membership, out: list[Outbound]) -> None:
        if out:
            self._send(i, out)
        events = node.drain_events()
        if events:
            for observer in self.observers:
                observer(self.now, i, events)
        deadline = node.next_deadline()
        if deadline < self._tick_at[i]:
            self._tick_at[i] = deadline = max(deadline, self.now)
            self._push(deadline, _TICK, i, 0, None)

    def _send(self, src: int, out: list[Outbound]) -> None:
        link = self.link
        rnd = self.rng.random
        for o in out:
            dst = self.index.get(o.dest)
            self.sent += 1
            size = 0
            if self.measure_bytes:
                size = wire_size(o.msg)
                self.bytes_sent += size
            if dst is None or (self._partitioned and self.group[src] != self.group[dst]):
                self.dropped += 1
                continue
            loss = link.loss
            extra = self.extra_loss[src] + self.extra_loss[dst]
            if extra:
                loss = 1 - (1 - loss) * (1 - self.extra_loss[src]) * (1 - self.extra_loss[dst])
            if loss and rnd() < loss:
                self.dropped += 1
                continue
            when = self.now
            if link.bandwidth is not None:
                when = self._nic_free[src] = max(when, self._nic_free[src]) + size / link.bandwidth
            self._push(when + link.delay + rnd() * link.jitter, _DELIVER, src, dst, o.msg)

    def _resume(self, i: int) -> None:
        node = self.nodes[i]
        if node is None or not self._paused[i]:
            return
        self._paused[i] = False
        backlog, self._backlog[i] = self._backlog[i], []
        for src, msg in backlog:
            if self.nodes[i] is node:
                self._deliver(src, i, node, msg)
        self._tick_at[i] = float("inf")
        self._after(i, node, [])

    def _fold(self) -> None:
        self._hash.update(self._trace_t.tobytes())
        self._hash.update(self._trace_e.tobytes())
        del self._trace_t[:], self._trace_e[:]
