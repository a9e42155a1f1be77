"""SWIM membership with Lifeguard, as a pure (sans-IO) state machine.

Theory of operation
-------------------
Each peer holds a *view*: for every member name an ``(incarnation, status)`` pair, the
statuses ranked ``alive < suspect < dead < left``.  An update about a member wins iff
its ``(incarnation, rank)`` is greater, so views merge like max-registers and agree
whatever the order of delivery.  Only a member raises its own incarnation: when it
hears a claim about itself that would beat "alive at my incarnation" (a suspicion, a
death, its old address after a restart) it *refutes* by announcing alive at that
incarnation + 1, at once to ``gossip_fanout`` members and to whoever told it.

Failure detection (SWIM): each probe interval we ping one member from a shuffled
round-robin list.  No ack within ``probe_timeout``: ``indirect_checks`` others ping it
for us and nack if they hear nothing.  No ack by the end of the interval: we suspect
it and tell it so.  A suspicion turns into death when its Lifeguard timer runs out
(suspicion.py: log(N)-scaled, shortened by independent confirmations).  Missed nacks
and refutations lower our local health, which stretches our probe interval, probe
timeout and suspicion timeouts.

Dissemination: every change is queued (broadcast.py) and piggybacked on pings, acks
and gossip rounds to ``gossip_fanout`` members, about ``retransmit_mult*log10(N+1)``
times each.  A gossip round runs at most once per ``gossip_interval``, and at once when
news arrives after a quiet spell.  Every ``push_pull_interval`` we send our view digest
to one member; if the digests differ the two exchange full state.  A joiner sends its
full state to its seeds.  A "dead" learnt by state exchange only makes us suspect
(memberlist's rule): a stale view cannot kill a healthy member.  Tombstones (dead/left)
are forgotten after ``dead_reap_after``; the addresses of failed members are kept for
RECONNECT_TIMEOUT and, as Serf does, we now and then exchange state with one, which
heals partitions.

Signed claims (with ``PeerConfig.security``; see trust.py).  Every claim is signed by
its origin; claims.py says which count (nobody speaks, refutes or accuses in advance
for another, nor takes its address), and is asked only when a claim would change the
view.  Only alive claims carry info that counts (the signature covers it).  A secure
member starts at the incarnation it is given (the shell passes its boot stamp), so a
restarted member outranks every claim about its previous life.

Inputs carry ``now``; outputs are :class:`Outbound` messages, plus :class:`MemberEvent`
records the caller drains.  No clock, no socket, randomness only from the rng given.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

from ..config import PeerConfig
from ..errors import LocalProtocolError
from ..model import PeerInfo
from .broadcast import BroadcastQueue
from .claims import ClaimCheck
from .probe import Probe, Prober
from .suspicion import Health, Suspicion
from .swim_wire import (
    KIND_ALIVE,
    KIND_DEAD,
    KIND_LEFT,
    KIND_SUSPECT,
    MESSAGES,
    PIGGYBACK_GOSSIP,
    PIGGYBACK_PROBE,
    Ack,
    Gossip,
    IndirectPing,
    MemberEvent,
    Message,
    Nack,
    Outbound,
    Ping,
    PushPull,
    Update,
)
from .trust import Trust
from .view import ALIVE, DEAD, LEFT, RANK, STATUSES, SUSPECT, MemberState, View

__all__ = [
    "ALIVE", "DEAD", "LEFT", "MESSAGES", "STATUSES", "SUSPECT", "Ack", "Gossip", "IndirectPing",
    "MemberEvent", "MemberState", "Membership", "MembershipStatistics", "Message", "Nack",
    "Outbound", "Ping", "PushPull", "Update",
]


HEALTH_LIMIT = 8           # Lifeguard: timeouts stretch up to 8x on an unhealthy peer
NACK_AFTER = 0.8           # a relay nacks after this fraction of probe_timeout
RECONNECT_TIMEOUT = 24 * 3600.0  # failed members' addresses kept this long (as Serf)
RECONNECT_MAX = 4096       # ... and at most this many (oldest forgotten first)
EVENTS_MAX = 65536         # undrained events kept; older ones are dropped and counted

_T_SUSPECT, _T_REAP, _T_FORGET = range(3)
_HANDLED = frozenset(MESSAGES)
MAX_INCARNATION = 2**63 - 1  # what an incarnation field may carry (bounds.U63)


@dataclass(frozen=True)
class MembershipStatistics:
    incarnation: int
    alive: int
    suspect: int
    tombstones: int
    health: int
    probes: int
    probes_failed: int
    suspicions: int
    refutations: int
    received: int
    misdirected: int
    push_pulls: int
    reconnects: int
    broadcast_queue: int
    broadcasts_dropped: int
    events_dropped: int


class Membership:
    """One peer's SWIM + Lifeguard membership.  Call :meth:`tick` at (or after)
    :meth:`next_deadline`, :meth:`receive` for every message; send what they return."""

    def __init__(self, me: PeerInfo, config: PeerConfig, rng: random.Random,
                 now: float, trust: Trust | None = None, incarnation: int = 0) -> None:
        self.me = me
        self._cfg = config
        self._rng = rng
        self._name = me.name
        self._addr = me.control
        self._inc = incarnation
        self._trust = trust
        self._check = ClaimCheck(trust, me.name) if trust is not None else None
        self._left = False
        self._seeds: tuple[str, ...] = ()
        self._view = View(me.name, RECONNECT_MAX)
        self._suspicions: dict[str, Suspicion] = {}
        self._queue: BroadcastQueue[Update] = BroadcastQueue(config.gossip_queue)
        self._health = Health(HEALTH_LIMIT)
        self._timers: list[tuple[float, int, int, str]] = []
        self._timer_seq = 0
        self._prober = Prober(rng)
        self._events: deque[MemberEvent] = deque(maxlen=EVENTS_MAX)
        self._events_dropped = 0
        self._refuted = False
        self._counts = dict.fromkeys(
            ("probes", "probes_failed", "suspicions", "refutations", "received",
             "misdirected", "push_pulls", "reconnects"), 0)
        self._next_probe = now + rng.random() * config.probe_interval
        self._next_gossip = now + rng.random() * config.gossip_interval
        self._next_push_pull = now + rng.random() * config.push_pull_interval
        self._set_self(ALIVE, now)

    # -- public API ------------------------------------------------------------------

    @property
    def incarnation(self) -> int:
        return self._inc

    def join(self, now: float, seeds: Iterable[str]) -> list[Outbound]:
        """Send our full state to each seed (a control address) and ask for theirs.
        While we know no other member, the join is retried every probe interval."""
        self._seeds = tuple(s for s in seeds if s != self._addr)
        out: list[Outbound] = []
        self._send_join(out)
        return out

    def leave(self, now: float) -> list[Outbound]:
        """Announce a graceful departure.  Afterwards only keep calling :meth:`tick`
        for a few gossip rounds (to retransmit the news); probes are answered with it."""
        if self._left:
            return []
        self._left = True
        self._prober.current = None
        record = self._set_self(LEFT, now)
        return [Outbound(self._view.control(n), Gossip(self._addr, self._name, (record,)))
                for n in self._view.pick(self._rng, self._cfg.gossip_fanout, None)]

    def next_deadline(self) -> float:
        deadline = self._next_gossip if len(self._queue) else math.inf
        if self._left:
            return deadline
        deadline = min(deadline, self._next_probe, self._next_push_pull,
                       self._prober.relay_deadline())
        p = self._prober.current
        if p is not None:
            deadline = min(deadline, p.deadline())
        if self._timers:
            deadline = min(deadline, self._timers[0][0])
        return deadline

    def tick(self, now: float) -> list[Outbound]:
        out: list[Outbound] = []
        if self._left:
            if now >= self._next_gossip:
                self._gossip(now, out)
            return out
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, kind, name = heapq.heappop(timers)
            if kind == _T_SUSPECT:
                self._suspicion_expired(now, name, out)
            elif kind == _T_REAP:
                self._reap(now, name)
            else:
                entry = self._view.failed.get(name)
                if entry is not None and entry[1] + RECONNECT_TIMEOUT <= now:
                    del self._view.failed[name]
        for requester, seq in self._prober.overdue_relays(now):
            out.append(Outbound(requester, Nack(self._addr, self._name, seq), True))
        p = self._prober.current
        if p is not None:
            if not p.indirect and now >= p.ack_deadline:
                self._send_indirect(p, out)
            if now >= p.end:
                self._probe_failed(now, p, out)
        if now >= self._next_probe:
            self._start_probe(now, out)
        if now >= self._next_gossip:
            self._gossip(now, out)
        if now >= self._next_push_pull:
            self._push_pull(now, out)
        return out

    def receive(self, now: float, msg: object) -> list[Outbound]:
        """Handle one membership message (anything else is a LocalProtocolError)."""
        kind = type(msg)
        if kind not in _HANDLED:
            raise LocalProtocolError(f"not a membership message: {kind.__name__}")
        m = cast(Message, msg)
        self._counts["received"] += 1
        out: list[Outbound] = []
        if self._left:
            if kind is Ping or kind is IndirectPing or kind is PushPull:
                out.append(Outbound(m.sender, Gossip(
                    self._addr, self._name, (self._view.records[self._name],)), True))
            return out
        self._refuted = False
        replied = False
        if kind is Ping:
            ping = cast(Ping, m)
            self._merge(now, ping.updates, False, out)
            if ping.target == self._name:
                out.append(Outbound(ping.sender, Ack(
                    self._addr, self._name, ping.seq, self._piggyback(ping.sender_name)), True))
                replied = True
            else:
                self._counts["misdirected"] += 1
        elif kind is Ack:
            ack = cast(Ack, m)
            self._merge(now, ack.updates, False, out)
            self._on_ack(ack, out)
        elif kind is Nack:
            self._prober.nacked(cast(Nack, m).seq)
        elif kind is IndirectPing:
            ind = cast(IndirectPing, m)
            self._merge(now, ind.updates, False, out)
            self._relay(now, ind, out)
        elif kind is Gossip:
            self._merge(now, cast(Gossip, m).updates, False, out)
        else:
            replied = self._on_push_pull(now, cast(PushPull, m), out)
        if self._refuted and not replied:  # whoever accused us hears the refutation
            out.append(Outbound(m.sender, Gossip(
                self._addr, self._name, (self._view.records[self._name],)), True))
        return out

    def members(self) -> Mapping[str, MemberState]:
        """Every member we know, tombstones and ourselves included (a read-only view)."""
        return MappingProxyType(self._view.states)

    def live_members(self) -> list[PeerInfo]:
        """Alive and suspect members (ourselves included), by name."""
        states = self._view.states
        return sorted((states[n].info for n in (*self._view.live, self._name)
                       if states[n].status in (ALIVE, SUSPECT)), key=lambda info: info.name)

    def is_live(self, name: str) -> bool:
        return self._view.is_live(name) or (name == self._name and not self._left)

    def digest(self) -> bytes:
        """Order-free digest of the live part of the view: equal digests, equal views."""
        return self._view.digest()

    def drain_events(self) -> list[MemberEvent]:
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()
        return events

    def statistics(self) -> MembershipStatistics:
        statuses = [st.status for st in self._view.states.values()]
        return MembershipStatistics(
            incarnation=self._inc, alive=statuses.count(ALIVE), suspect=statuses.count(SUSPECT),
            tombstones=statuses.count(DEAD) + statuses.count(LEFT), health=self._health.score,
            broadcast_queue=len(self._queue), broadcasts_dropped=self._queue.dropped,
            events_dropped=self._events_dropped, **self._counts)

    # -- the view ----------------------------------------------------------------------

    def _merge(self, now: float, updates: tuple[Update, ...], sync: bool,
               out: list[Outbound]) -> None:
        keys = self._view.keys
        for u in updates:
            kind = u.kind
            if sync and kind == KIND_DEAD:
                kind = KIND_SUSPECT  # a remote view's "dead" only makes us suspect
            key = keys.get(u.name)
            if key is not None:  # the common case, old news, is decided here
                new = u.incarnation * 4 + kind
                if new < key or (new == key and kind != KIND_SUSPECT):
                    continue
            if self._check is not None and u.name != self._name \
                    and not self._check.about_other(u, self._live_infos()):
                continue
            self._apply(now, u, kind, out)

    def _live_infos(self) -> Iterable[PeerInfo]:
        states = self._view.states
        return (states[n].info for n in (*self._view.live, self._name))

    def _apply(self, now: float, u: Update, kind: int, out: list[Outbound]) -> None:
        name = u.name
        if name == self._name:
            self._about_me(now, u, out)
            return
        st = self._view.states.get(name)
        if st is None:  # a tombstone of a member we do not know teaches nothing
            if u.info is not None and u.kind <= KIND_SUSPECT:
                self._change(now, name, kind, u.incarnation, u.origin, u.info, u)
            return
        if u.incarnation == st.incarnation and kind == RANK[st.status]:
            if kind == KIND_SUSPECT:
                if u.kind != kind and self._trust is not None:  # a remote "dead": ours now
                    self._confirm(name, self._name, None)
                else:
                    self._confirm(name, u.origin, u.sig)
            return
        # Secure mode: only a member's own (signed) alive claim may change its info.
        info = u.info
        if info is None or info == st.info or (self._trust is not None and u.kind != KIND_ALIVE):
            info = st.info
        self._change(now, name, kind, u.incarnation, u.origin, info, u)

    def _change(self, now: float, name: str, kind: int, inc: int, origin: str,
                info: PeerInfo, heard: Update | None = None) -> None:
        if heard is not None and heard.kind == kind:
            # Share the record we were sent (peers' views hold one object) and its
            # signature, which does not depend on info except for alive claims, and
            # those carry the info they are stored with.
            record = heard if heard.info is info else heard.with_info(info)
        else:  # ours, or a remote "dead" taken as a suspicion: secure mode makes it ours
            record = self._signed(Update(kind, name, inc, self._name if self._trust
                                         else origin, info))
        old = self._view.set(name, MemberState(info, STATUSES[kind], inc), record, now)
        old_kind = RANK[old.status] if old is not None else KIND_LEFT
        if kind <= KIND_SUSPECT < old_kind:
            self._prober.insert(name)
        self._suspicions.pop(name, None)
        if kind == KIND_SUSPECT:
            s = Suspicion.for_cluster(now, inc, origin, len(self._view.live) + 1, self._cfg,
                                      self._health)
            self._suspicions[name] = s
            self._push_timer(s.deadline(), _T_SUSPECT, name)
        if kind >= KIND_DEAD:
            self._push_timer(now + self._cfg.dead_reap_after, _T_REAP, name)
        if kind != KIND_ALIVE:  # suspicions and deaths travel without the member's info
            record = heard if heard is not None and heard.kind == kind and heard.info is None \
                else record.with_info(None)
        self._queue.put(name, record)
        if kind == KIND_ALIVE:
            event = "joined" if old_kind >= KIND_DEAD else ALIVE
        else:
            event = STATUSES[kind]
        self._emit(MemberEvent(event, name, inc))

    def _confirm(self, name: str, accuser: str, sig: bytes | None) -> None:
        """Count ``accuser``'s suspicion (``sig``: its signature; None: ours, to make)."""
        s = self._suspicions.get(name)
        if s is not None and s.confirm(accuser):
            self._push_timer(s.deadline(), _T_SUSPECT, name)
            claim = Update(KIND_SUSPECT, name, s.incarnation, accuser, None,
                           b"" if sig is None else sig)
            self._queue.put(name, self._signed(claim) if sig is None else claim)

    def _signed(self, u: Update) -> Update:
        """``u`` (our own claim) with our signature in secure mode."""
        if self._trust is None:
            return u
        return Update(u.kind, u.name, u.incarnation, u.origin, u.info,
                      self._trust.sign(u.signed_bytes()))

    def _about_me(self, now: float, u: Update, out: list[Outbound]) -> None:
        if self._left or u.incarnation < self._inc or u.incarnation >= MAX_INCARNATION:
            return  # (at the top a refutation would not decode anywhere: nothing to do)
        if u.incarnation == self._inc and u.kind == KIND_ALIVE and u.info == self.me:
            return
        if self._check is not None and not self._check.about_me(u, self._inc):
            return
        if u.kind != KIND_ALIVE:
            self._health.apply(1)
        self._inc = u.incarnation + 1
        record = self._set_self(ALIVE, now)
        self._counts["refutations"] += 1
        self._refuted = True
        out.extend(Outbound(self._view.control(n), Gossip(self._addr, self._name, (record,)))
                   for n in self._view.pick(self._rng, self._cfg.gossip_fanout, None))

    def renew(self, now: float) -> list[Outbound]:
        """Announce ourselves alive at a new incarnation (signed with the current key:
        after a key rotation, so that our claims verify once the old key is removed)."""
        if self._left:
            return []
        self._inc += 1
        record = self._set_self(ALIVE, now)
        return [Outbound(self._view.control(n), Gossip(self._addr, self._name, (record,)))
                for n in self._view.pick(self._rng, self._cfg.gossip_fanout, None)]

    def _set_self(self, status: str, now: float) -> Update:
        kind = RANK[status]
        record = self._signed(Update(kind, self._name, self._inc, self._name, self.me))
        self._view.set(self._name, MemberState(self.me, status, self._inc), record, now)
        self._queue.put(self._name, record)
        return record

    def _suspicion_expired(self, now: float, name: str, out: list[Outbound]) -> None:
        s = self._suspicions.get(name)
        if s is None or s.deadline() > now:
            return
        info = self._view.states[name].info
        self._change(now, name, KIND_DEAD, s.incarnation, self._name, info)
        # If it is only slow, it refutes when it hears this.
        out.append(Outbound(info.control, Gossip(
            self._addr, self._name, (self._view.records[name].with_info(None),))))

    def _reap(self, now: float, name: str) -> None:
        if self._view.reap(name, now, self._cfg.dead_reap_after) and name in self._view.failed:
            self._push_timer(self._view.failed[name][1] + RECONNECT_TIMEOUT, _T_FORGET, name)

    def _emit(self, event: MemberEvent) -> None:
        if len(self._events) == EVENTS_MAX:
            self._events_dropped += 1
        self._events.append(event)

    # -- probing ---------------------------------------------------------------------

    def _start_probe(self, now: float, out: list[Outbound]) -> None:
        interval = self._health.scale(self._cfg.probe_interval)
        self._next_probe = now + interval
        target = self._prober.next_target(self._view)
        if target is None:
            self._send_join(out)  # we know nobody (yet): keep knocking on the seeds
            return
        self._counts["probes"] += 1
        timeout = self._health.scale(self._cfg.probe_timeout)
        p = self._prober.begin(target, now + timeout, now + interval)
        out.append(Outbound(self._view.control(target), Ping(
            self._addr, self._name, p.seq, target, self._piggyback(target))))

    def _send_indirect(self, p: Probe, out: list[Outbound]) -> None:
        p.indirect = True
        st = self._view.states.get(p.target)
        if st is None:
            return
        helpers = self._view.pick(self._rng, self._cfg.indirect_checks, p.target)
        p.nacks_expected = len(helpers)
        for name in helpers:
            out.append(Outbound(self._view.control(name), IndirectPing(
                self._addr, self._name, p.seq, p.target, st.info.control,
                self._queue.take(PIGGYBACK_PROBE, self._limit()))))

    def _probe_failed(self, now: float, p: Probe, out: list[Outbound]) -> None:
        self._prober.current = None
        self._counts["probes_failed"] += 1
        # Lifeguard: missing nacks mean *we* may be the problem.
        self._health.apply(p.nacks_expected - p.nacks if p.nacks_expected else 1)
        st = self._view.states.get(p.target)
        if st is None or st.status == SUSPECT:
            self._confirm(p.target, self._name, None)
            return
        if st.status != ALIVE:
            return
        self._counts["suspicions"] += 1
        self._change(now, p.target, KIND_SUSPECT, st.incarnation, self._name, st.info)
        out.append(Outbound(st.info.control, Gossip(self._addr, self._name, (
            self._view.records[p.target].with_info(None),))))

    def _on_ack(self, msg: Ack, out: list[Outbound]) -> None:
        relay = self._prober.relays.pop(msg.seq, None)
        if relay is not None:
            out.append(Outbound(relay[0], Ack(self._addr, self._name, relay[1], ()), True))
        elif self._prober.acked(msg.seq):
            self._health.apply(-1)

    def _relay(self, now: float, msg: IndirectPing, out: list[Outbound]) -> None:
        """Ping ``msg.target`` at the address *our* view has for it (a member we do not
        know is not pinged: the message's ``target_control`` is never contacted)."""
        if msg.target == self._name or not self._view.is_live(msg.target):
            self._counts["misdirected"] += 1
            return
        seq = self._prober.relay(msg.sender, msg.seq, now + NACK_AFTER * self._cfg.probe_timeout)
        out.append(Outbound(self._view.control(msg.target),
                            Ping(self._addr, self._name, seq, msg.target, ())))

    # -- dissemination -------------------------------------------------------------------

    def _limit(self) -> int:
        return self._cfg.retransmit_mult * math.ceil(math.log10(len(self._view.live) + 2))

    def _piggyback(self, dest: str) -> tuple[Update, ...]:
        updates = self._queue.take(PIGGYBACK_PROBE, self._limit())
        st = self._view.states.get(dest)
        if st is not None and (st.status == SUSPECT or st.status == DEAD):
            updates = (self._view.records[dest], *updates)  # so that it can refute
        return updates

    def _gossip(self, now: float, out: list[Outbound]) -> None:
        interval = self._cfg.gossip_interval
        nxt = self._next_gossip + interval
        self._next_gossip = nxt if nxt > now else now + interval
        if not len(self._queue):
            return
        limit = self._limit()
        for name in self._view.pick(self._rng, self._cfg.gossip_fanout, None):
            updates = self._queue.take(PIGGYBACK_GOSSIP, limit)
            if not updates:
                break
            out.append(Outbound(self._view.control(name), Gossip(
                self._addr, self._name, updates)))

    def _push_pull(self, now: float, out: list[Outbound]) -> None:
        interval = self._cfg.push_pull_interval
        nxt = self._next_push_pull + interval
        self._next_push_pull = nxt if nxt > now else now + interval
        view = self._view
        if view.live:
            self._counts["push_pulls"] += 1
            peer = view.pick(self._rng, 1, None)[0]
            out.append(Outbound(view.control(peer), PushPull(
                self._addr, self._name, view.digest(), (), False)))
        failed = len(view.failed)
        if failed and self._rng.random() < failed / (len(view.live) + 1):
            names = list(view.failed)
            control = view.failed[names[int(self._rng.random() * failed)]][0]
            self._counts["reconnects"] += 1
            out.append(Outbound(control, PushPull(
                self._addr, self._name, view.digest(), view.full_state(), True)))

    def _on_push_pull(self, now: float, msg: PushPull, out: list[Outbound]) -> bool:
        if msg.members:
            self._merge(now, msg.members, True, out)
        view = self._view
        if msg.want_reply or (not msg.members and msg.digest != view.digest()):
            out.append(Outbound(msg.sender, PushPull(
                self._addr, self._name, view.digest(), view.full_state(), not msg.want_reply),
                True))
            return True
        return False

    def _send_join(self, out: list[Outbound]) -> None:
        for seed in self._seeds:
            out.append(Outbound(seed, PushPull(
                self._addr, self._name, self._view.digest(), self._view.full_state(), True)))

    def _push_timer(self, when: float, kind: int, name: str) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (when, self._timer_seq, kind, name))
