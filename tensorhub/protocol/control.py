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
  sender answers in turn (push-pull).  A local change is also pushed at once: to
  ``gossip_fanout`` random live members, and a publish of our own to every one.

The plane also owns this peer's :class:`~.wan.Wan`: the links between DCs as declared
(``PeerConfig.links``), measured by this peer's reads and probes (the shell calls
:meth:`~.wan.Wan.observe`), and heard from every origin's reference entry, which carries
its own measurements (:meth:`publish_links` re-stamps ours when they changed).  The
coordinators of the versions this peer coordinates plan with it.

When membership declares a peer dead or departed, its references are forgotten here,
so a fetch is never routed to it (and its link reports no longer count); when it is
seen alive again (it refuted), they are welcome again, and a peer that refutes
re-stamps its own entry so the others pull it.

Secure mode (``PeerConfig.security``): one :class:`~.trust.Trust` signs and checks for
membership and the table; only version announcements signed by a publisher of the model
count for sealing, and fetches are routed only to holdings of those announcements.

``changes`` counts table changes, so the shell can wake waiters (``wait_for_version``,
fetches waiting for a holder).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Annotated

from ..bounds import MAX_PEERS, ControlEndpoint, MaxLen, PeerName
from ..config import PeerConfig
from ..model import PeerInfo, VersionKey
from .coordination import Coordination, CoordReply, CoordRequest
from .membership import MemberEvent, Membership, Outbound
from .refs import Holding, OriginEntry, RefTable, Stamp, announcement_bytes, check_links
from .topology import NodeInfo
from .trust import Trust
from .versions import Seal, ShardClaim, VersionView
from .wan import Wan

PUSH_HOLDINGS = 16_384
"""A publish pushes our entry to at most this many holdings' worth of members (about 1
MiB at some 64 bytes a holding): every member of a 1,000-peer mesh for an entry of up to
16 holdings, 16 members for one of 1,000 (an adapter trainer's), never fewer than
``gossip_fanout``."""


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
        self.trust = Trust(config.security) if config.security is not None else None
        """Signer and checker of gossip in secure mode (None: insecure)."""
        self.membership = Membership(me, config, rng, now, self.trust,
                                     generation if self.trust is not None else 0)
        self.refs = RefTable(me.name, generation, self.trust)
        self.generation = generation
        self.coordination = Coordination(me.name, me.control, generation)
        self.nic_bps = float(config.nic_bps)
        self.wan = Wan(config.links)
        """The links between DCs as this peer knows them (see the module docstring)."""
        self._wan_seen = self.wan.changes
        self.implausible_entries = 0
        """Reference entries refused for link reports out of range (the codec refuses
        them first; this counts any that reach the plane another way)."""
        self.changes = 0
        self.versions = VersionView(
            self.trust.version_window if self.trust is not None else None)
        """Which versions are sealed (published by every rank); ``latest`` per model."""
        self._fresh: set[str] = set()
        """Models whose seal status is current (others are recomputed when queried)."""
        self._next_gossip = now
        self._events: list[MemberEvent] = []
        self._trusted: dict[str, frozenset[tuple[int, int, bytes, bytes]]] = {}
        """Secure mode, per model: the (version, shard, layout, manifest id) of the
        announcements that count (recomputed after table changes)."""

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
        return out + self.publish_links()

    def receive(self, now: float, msg: object) -> list[Outbound]:
        if isinstance(msg, RefsDigest):
            return self._on_digest(msg)
        if isinstance(msg, RefsDelta):
            merged = [e for e in msg.entries
                      if self._accept(e.origin) and self._plausible(e) and self.refs.merge(e)]
            for e in merged:
                self.wan.hear(e.origin, e.links)
            if merged:
                self._table_changed(merged)
                return self._readopt()
            return []
        if isinstance(msg, CoordRequest):
            return self._on_coord_request(msg)
        if isinstance(msg, CoordReply):
            self.coordination.on_reply(msg)
            self.changes += 1
            return []
        inc = self.membership.incarnation
        out = self.membership.receive(now, msg)
        self._absorb_events()
        if self.membership.incarnation != inc:  # we refuted: peers that forgot us pull again
            self.refs.bump_local()
            self._table_changed([self.refs.local])
            out += self._push_local()
        return out

    def renew(self, now: float) -> list[Outbound]:
        """After a key rotation: re-announce ourselves and our entry, signed anew."""
        out = self.membership.renew(now)
        self.refs.bump_local(tuple(self._resigned(h) for h in self.refs.local.holdings))
        self._table_changed([self.refs.local])
        return out + self._push_local()

    def keyring_changed(self) -> None:
        """The keyring was replaced: re-examine every announcement (cached verdicts are
        dropped with the keyring generation)."""
        self._fresh.clear()
        self.changes += 1

    def sign_announcement(self, holding: Holding) -> Holding:
        """Our publish of ``holding``: stamped with our generation, signed in secure mode."""
        return self._resigned(replace(holding, publisher=self.me.name,
                                      publisher_gen=self.generation))

    def _current_announcement(self, h: Holding) -> Holding:
        """Our copy ``h`` of another publisher's announcement, with the publisher's
        current signature: after it rotated its key, the one it re-signed with (found in
        its own entry), so that the copy still counts once the old key is removed."""
        if (self.trust is None or h.derived or h.publisher == self.me.name
                or self._signed_by_publisher(h)):
            return h
        entry = self.refs.entry(h.publisher)
        for p in entry.holdings if entry is not None else ():
            if replace(p, bitmap=h.bitmap, publisher_sig=h.publisher_sig) == h \
                    and self._signed_by_publisher(p):
                return replace(h, publisher_sig=p.publisher_sig)
        return h

    def _readopt(self) -> list[Outbound]:
        """Re-sign-adopt our copies (see :meth:`_current_announcement`); push if any."""
        if self.trust is None:
            return []
        mine = self.refs.local.holdings
        fresh = tuple(self._current_announcement(h) for h in mine)
        if fresh == mine:
            return []
        self.refs.bump_local(fresh)
        self._table_changed([self.refs.local])
        return self._push_local()

    def _resigned(self, h: Holding) -> Holding:
        if self.trust is None or h.publisher != self.me.name or h.derived:
            return h
        return replace(h, publisher_sig=self.trust.sign(announcement_bytes(h)))

    def announcement(self, key: VersionKey, manifest_id: bytes) -> tuple[int, bytes]:
        """The publisher's ``(generation, signature)`` of ``key`` with ``manifest_id``,
        as a holder we trust announces it: a fetched copy carries it along."""
        for _, h in self.holders(key):
            if not h.derived and h.manifest_id == manifest_id:
                return h.publisher_gen, h.publisher_sig
        return 0, b""

    def drain_events(self) -> list[MemberEvent]:
        events, self._events = self._events, []
        return events

    # -- local holdings -----------------------------------------------------------

    def put_holding(self, holding: Holding, *, everyone: bool = False) -> list[Outbound]:
        """Add or replace our holding of ``holding.key``, pushed to ``gossip_fanout``
        live members (``everyone``: see :meth:`publish_holding`).  Our newest link
        measurements go with it."""
        self._sync_links()
        self.refs.put_local(self._current_announcement(holding))
        self._table_changed([self.refs.local])
        return self._push_local(everyone)

    def publish_holding(self, holding: Holding) -> list[Outbound]:
        """Our own publish of ``holding``: as :meth:`put_holding`, but pushed at once to
        every live member rather than to ``gossip_fanout`` of them.  Readers waiting for
        the version then hear of it one message after the publish, not after gossip
        rounds (every ``gossip_interval``, 1 s by default, to 3 members a round): in an
        8-peer mesh the first fetch after a publish waited 0.04-0.9 s for that.  The
        cost is one message per member per publish.  Every other change (a reader's
        progress on a fetch, a drop) still goes to ``gossip_fanout`` members, as each
        reader's would cost the mesh n messages.  An entry of many holdings goes to
        fewer members (:data:`PUSH_HOLDINGS`); gossip brings it to the rest."""
        return self.put_holding(holding, everyone=True)

    def publish_links(self) -> list[Outbound]:
        """Our entry re-stamped with our newest link measurements and pushed to
        ``gossip_fanout`` live members, if they changed since it was last stamped (the
        plane does this at each :meth:`tick`: at most one push a gossip round)."""
        if not self._sync_links():
            return []
        self._table_changed([self.refs.local])
        return self._push_local()

    def _sync_links(self) -> bool:
        """Put our measurements in our entry if they changed; True if it was re-stamped."""
        if self.wan.changes == self._wan_seen:
            return False
        self._wan_seen = self.wan.changes
        return self.refs.set_links(self.wan.reports())

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
        if self.trust is not None:
            msg = replace(msg, sig=self.trust.sign(msg.signed_bytes()))
        if target == self.me.name:
            return req_id, self._on_coord_request(msg)
        return req_id, [Outbound(self.membership.members()[target].info.control, msg)]

    # -- queries ------------------------------------------------------------------

    def holders(self, key: VersionKey) -> list[tuple[PeerInfo, Holding]]:
        members = self.membership.members()
        out = []
        for origin, holding in self.refs.holders(key):
            if not self._counts(holding):
                continue
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
            if h.version != version or not self._counts(h):
                continue
            if origin == self.me.name:
                out.append((self.me, h))
            elif origin in members and self.membership.is_live(origin):
                out.append((members[origin].info, h))
        return out

    def claims(self, model: str) -> list[ShardClaim]:
        """What live holders announce of the publish shards of ``model``'s versions
        (secure mode: only announcements signed by a publisher of the model)."""
        members = self.membership.members()
        return [ShardClaim(origin, h.version, h.shard, h.world, h.layout, h.complete,
                           h.manifest_id, h.publisher_gen, h.schema)
                for origin, h in self.refs.of_model(model)
                if not h.derived and h.shard < h.world and self._signed_by_publisher(h)
                and (origin == self.me.name
                     or (origin in members and self.membership.is_live(origin)))]

    def _signed_by_publisher(self, h: Holding) -> bool:
        trust = self.trust
        return trust is None or (trust.keyring.may_publish(h.model, h.publisher)
                                 and trust.check_cached(h.publisher, announcement_bytes(h),
                                                        h.publisher_sig))

    def _counts(self, h: Holding) -> bool:
        """Secure mode: may fetches be routed to holding ``h``?  Derived holdings (a
        consumer's own layout) yes; copies of a publish only of an announcement that
        counts (signed by a publisher, the manifest that wins the version)."""
        if self.trust is None or h.derived:
            return True
        self._refresh(h.model)
        trusted = self._trusted.get(h.model)
        if trusted is None:
            trusted = self._trusted[h.model] = self.versions.counted(h.model)
        return (h.version, h.shard, h.layout, h.manifest_id) in trusted

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

    def seal_status(self, model: str, version: int) -> Seal | None:
        """The seal status of ``model@version`` now, sealed or not (None: unknown)."""
        self._refresh(model)
        return self.versions.status(model, version)

    def unsealed(self, model: str) -> list[Seal]:
        """Versions newer than ``latest`` that are announced but not sealed, and why."""
        self._refresh(model)
        return list(self.versions.unsealed(model))

    def _refresh(self, model: str) -> None:
        if model not in self._fresh:
            self._fresh.add(model)
            self._trusted.pop(model, None)
            self.versions.update(model, self.claims(model))

    # -- internals ----------------------------------------------------------------

    def _accept(self, origin: str) -> bool:
        return origin != self.me.name and self.membership.is_live(origin)

    def _plausible(self, entry: OriginEntry) -> bool:
        try:
            check_links(entry.links)
        except ValueError:
            self.implausible_entries += 1
            return False
        return True

    def _absorb_events(self) -> None:
        events = self.membership.drain_events()
        for ev in events:
            self._events.append(ev)
            if ev.kind in ("dead", "left") and self.refs.forget(ev.name):
                self.changes += 1
                self._fresh.clear()
            elif ev.kind in ("alive", "joined"):
                self.refs.unforget(ev.name)
        for ev in events:
            if ev.kind in ("dead", "left"):
                self.wan.forget(ev.name)
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
        if self.trust is not None and not self.trust.check(msg.name, msg.signed_bytes(),
                                                           msg.sig):
            self.trust.refuse("coordinator request")  # nobody registers another member
            return []
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

    def _push_local(self, everyone: bool = False) -> list[Outbound]:
        """Our entry to ``gossip_fanout`` random live members; ``everyone``: to every
        live member, as far as :data:`PUSH_HOLDINGS` allows.  One message object for
        all of them (the shell encodes it once)."""
        entry = self.refs.local
        k = self.config.gossip_fanout
        if everyone:
            k = max(k, PUSH_HOLDINGS // max(1, len(entry.holdings)))
        msg = RefsDelta(self.me.control, self.me.name, (entry,))
        return [Outbound(p.control, msg) for p in self._random_peers(k)]

    def _on_digest(self, msg: RefsDigest) -> list[Outbound]:
        out = [
            Outbound(msg.sender, RefsDelta(self.me.control, self.me.name, tuple(part)), True)
            for part in self.refs.newer_than(msg.stamps, _REFS_PART_BYTES)
        ]
        if msg.answer_with_digest and self.refs.wants_from(msg.stamps):
            out.append(Outbound(msg.sender, RefsDigest(
                self.me.control, self.me.name, self.refs.digest(), False), True))
        return out
