"""The control plane of one peer: membership plus reference-table anti-entropy.

Theory of operation
-------------------
``ControlPlane`` is the single sans-IO object the peer shell drives: it takes
``(now, message)`` and returns :class:`Outbound` messages; the shell owns sockets and
clocks.  It composes two protocols:

* membership (:class:`~tensorhub.protocol.membership.Membership`, SWIM) decides who is
  alive and carries every peer's :class:`PeerInfo` (addresses, topology labels);
* the reference table (:class:`~tensorhub.protocol.refs.RefTable`) says who holds what.
  Every ``gossip_interval`` the peer sends its table digest to ``gossip_fanout`` random
  live members; a receiver answers with the entries that are newer on its side and,
  if the digest shows the sender knows something newer, with its own digest so the
  sender answers in turn (push-pull).  A local change is also pushed at once.

When membership declares a peer dead or departed, its references are forgotten here,
so a fetch is never routed to it.  ``changes`` counts table changes, so the shell can
wake waiters (``wait_for_version``, fetches waiting for a holder).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

from ..bounds import MAX_PEERS, ControlEndpoint, MaxLen, PeerName
from ..config import PeerConfig
from ..model import PeerInfo, VersionKey
from .coordination import Coordination, CoordReply, CoordRequest
from .membership import MemberEvent, Membership, Outbound
from .refs import Holding, OriginEntry, RefTable, Stamp
from .topology import NodeInfo
from .versions import Seal, ShardClaim, VersionView


@dataclass(frozen=True, slots=True)
class RefsDigest:
    sender: ControlEndpoint
    name: PeerName
    stamps: Annotated[tuple[Stamp, ...], MaxLen(MAX_PEERS)]
    answer_with_digest: bool


@dataclass(frozen=True, slots=True)
class RefsDelta:
    sender: ControlEndpoint
    name: PeerName
    entries: Annotated[tuple[OriginEntry, ...], MaxLen(MAX_PEERS)]


MESSAGES = (RefsDigest, RefsDelta)
_REFS_PART_BYTES = 512 << 10


class ControlPlane:
    def __init__(self, me: PeerInfo, config: PeerConfig, rng: random.Random, now: float,
                 generation: int) -> None:
        self.me = me
        self.config = config
        self.rng = rng
        self.membership = Membership(me, config, rng, now)
        self.refs = RefTable(me.name, generation)
        self.coordination = Coordination(me.name, me.control, generation)
        self.nic_bps = float(config.nic_bps)
        self.changes = 0
        self.versions = VersionView()
        """Which versions are sealed (published by every rank); ``latest`` per model."""
        self._fresh: set[str] = set()
        """Models whose seal status is current (others are recomputed when queried)."""
        self._next_gossip = now
        self._events: list[MemberEvent] = []

    # -- driving ------------------------------------------------------------------

    def join(self, now: float, seeds: Iterable[str]) -> list[Outbound]:
        return self.membership.join(now, list(seeds))

    def leave(self, now: float) -> list[Outbound]:
        return self.membership.leave(now)

    def next_deadline(self) -> float:
        return min(self.membership.next_deadline(), self._next_gossip)

    def tick(self, now: float) -> list[Outbound]:
        out = self.membership.tick(now)
        self._absorb_events()
        if now >= self._next_gossip:
            self._next_gossip = now + self.config.gossip_interval
            out += self._digest_to(self._random_peers(self.config.gossip_fanout), True)
        return out

    def receive(self, now: float, msg: object) -> list[Outbound]:
        if isinstance(msg, RefsDigest):
            return self._on_digest(msg)
        if isinstance(msg, RefsDelta):
            merged = [e for e in msg.entries if self._accept(e.origin) and self.refs.merge(e)]
            if merged:
                self._table_changed(merged)
            return []
        if isinstance(msg, CoordRequest):
            return self._on_coord_request(msg)
        if isinstance(msg, CoordReply):
            self.coordination.on_reply(msg)
            self.changes += 1
            return []
        out = self.membership.receive(now, msg)
        self._absorb_events()
        return out

    def drain_events(self) -> list[MemberEvent]:
        events, self._events = self._events, []
        return events

    # -- local holdings -----------------------------------------------------------

    def put_holding(self, holding: Holding) -> list[Outbound]:
        self.refs.put_local(holding)
        self._table_changed([self.refs.local])
        return self._push_local()

    def drop_holding(self, key: VersionKey) -> list[Outbound]:
        if not self.refs.drop_local(key):
            return []
        self._table_changed([self.refs.local])
        return self._push_local()

    # -- coordinators ---------------------------------------------------------------

    def live_names(self) -> list[str]:
        return [p.name for p in self.membership.live_members()]

    def coordinator(self, key: VersionKey) -> str:
        """Who coordinates ``key`` in this peer's view."""
        return self.coordination.coordinator(key, self.live_names())

    def ask_coordinator(self, key: VersionKey, size: int = 0, chunks: int = 0
                        ) -> tuple[int, list[Outbound]]:
        """Register with the coordinator of ``key`` (and, with ``size``/``chunks``, ask
        for a plan); the answer lands in ``coordination.answers[request id]``."""
        req_id, msg, target = self.coordination.request(key, self.live_names(), size, chunks)
        if target == self.me.name:
            return req_id, self._on_coord_request(msg)
        return req_id, [Outbound(self.membership.members()[target].info.control, msg)]

    # -- queries ------------------------------------------------------------------

    def holders(self, key: VersionKey) -> list[tuple[PeerInfo, Holding]]:
        members = self.membership.members()
        out = []
        for origin, holding in self.refs.holders(key):
            if origin == self.me.name:
                out.append((self.me, holding))
            elif origin in members and self.membership.is_live(origin):
                out.append((members[origin].info, holding))
        return out

    def of_version(self, model: str, version: int) -> list[tuple[PeerInfo, Holding]]:
        """Live holders of any shard, in any layout, of ``model@version``."""
        members = self.membership.members()
        out = []
        for origin, h in self.refs.of_model(model):
            if h.version != version:
                continue
            if origin == self.me.name:
                out.append((self.me, h))
            elif origin in members and self.membership.is_live(origin):
                out.append((members[origin].info, h))
        return out

    def claims(self, model: str) -> list[ShardClaim]:
        """What live holders announce of the publish shards of ``model``'s versions."""
        members = self.membership.members()
        return [ShardClaim(origin, h.version, h.shard, h.world, h.layout, h.complete,
                           h.manifest_id)
                for origin, h in self.refs.of_model(model)
                if not h.derived and h.shard < h.world
                and (origin == self.me.name
                     or (origin in members and self.membership.is_live(origin)))]

    def readable(self, model: str) -> list[int]:
        """Versions of ``model`` sealed now (every shard has a live complete holder and
        the holders agree), ascending."""
        self._refresh(model)
        return list(self.versions.sealed(model))

    def latest(self, model: str) -> int | None:
        """The newest sealed version; never goes backwards at this peer (a version
        whose holders all left stays ``latest``; fetching it then says what is missing)."""
        self._refresh(model)
        return self.versions.latest(model)

    def seal(self, model: str, version: int) -> Seal:
        """The seal of ``model@version`` now; raises unless it is sealed."""
        self._refresh(model)
        return self.versions.require(model, version)

    def unsealed(self, model: str) -> list[Seal]:
        """Versions newer than ``latest`` that are announced but not sealed, and why."""
        self._refresh(model)
        return list(self.versions.unsealed(model))

    def _refresh(self, model: str) -> None:
        if model not in self._fresh:
            self._fresh.add(model)
            self.versions.update(model, self.claims(model))

    # -- internals ----------------------------------------------------------------

    def _accept(self, origin: str) -> bool:
        return origin != self.me.name and self.membership.is_live(origin)

    def _absorb_events(self) -> None:
        events = self.membership.drain_events()
        for ev in events:
            self._events.append(ev)
            if ev.kind in ("dead", "left") and self.refs.forget(ev.name):
                self.changes += 1
                self._fresh.clear()
        for ev in events:
            if ev.kind in ("dead", "left"):
                self.coordination.peer_gone(ev.name)
        if events:
            self.coordination.elect(self)

    # MeshView, for the coordinator
    def fetchers_of(self, key: VersionKey) -> list[str]:
        return [origin for origin, h in self.refs.holders(key) if not h.complete]

    def complete_holders_of(self, key: VersionKey) -> list[str]:
        return [p.name for p, h in self.holders(key) if h.complete]

    def node_info(self, name: str) -> NodeInfo | None:
        member = self.membership.members().get(name)
        if member is None or not self.membership.is_live(name):
            return None
        return NodeInfo.from_peer(member.info, self.nic_bps)

    def _table_changed(self, entries: list[OriginEntry]) -> None:
        """Look only at the entries that changed: new versions join the election, and
        completed holdings turn fetchers into sources in the plans we keep."""
        self.changes += 1
        self._fresh.clear()  # cheap: each model is re-sealed on its next query
        self.coordination.learn({h.key for e in entries for h in e.holdings}, self)
        for e in entries:
            for h in e.holdings:
                if h.complete and h.key in self.coordination.planners:
                    self.coordination.peer_complete(h.key, e.origin)

    def _on_coord_request(self, msg: CoordRequest) -> list[Outbound]:
        dest, out = self.coordination.on_request(msg, self)
        if dest == "reply":
            if msg.sender == self.me.control and isinstance(out, CoordReply):
                self.coordination.on_reply(out)
                self.changes += 1
                return []
            if msg.hops == 0:  # straight from the asker: back over its connection
                return [Outbound(msg.sender, out, True)]
            dest = msg.name  # forwarded: to the asker's address in our own view
        member = self.membership.members().get(dest)
        if member is None or not self.membership.is_live(dest):
            return []
        return [Outbound(member.info.control, out)]

    def _random_peers(self, k: int) -> list[PeerInfo]:
        live = [p for p in self.membership.live_members() if p.name != self.me.name]
        return self.rng.sample(live, min(k, len(live)))

    def _digest_to(self, peers: Iterable[PeerInfo], answer: bool) -> list[Outbound]:
        stamps = self.refs.digest()
        return [Outbound(p.control, RefsDigest(self.me.control, self.me.name, stamps, answer))
                for p in peers]

    def _push_local(self) -> list[Outbound]:
        entry = self.refs.local
        return [Outbound(p.control, RefsDelta(self.me.control, self.me.name, (entry,)))
                for p in self._random_peers(self.config.gossip_fanout)]

    def _on_digest(self, msg: RefsDigest) -> list[Outbound]:
        out = [
            Outbound(msg.sender, RefsDelta(self.me.control, self.me.name, tuple(part)), True)
            for part in self.refs.newer_than(msg.stamps, _REFS_PART_BYTES)
        ]
        if msg.answer_with_digest and self.refs.wants_from(msg.stamps):
            out.append(Outbound(msg.sender, RefsDigest(
                self.me.control, self.me.name, self.refs.digest(), False), True))
        return out
