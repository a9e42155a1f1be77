"""Per-version coordinators on top of membership and the reference table.

Theory of operation
-------------------
Every peer runs the election of :mod:`tensorhub.protocol.ring` over its own view of the
live members.  A request about ``(model, version)`` -- today: "register me as a fetcher
and tell me who coordinates and under which epoch" -- is sent to the coordinator of the
sender's view; a peer that receives it but is not the coordinator in *its* view forwards
it to the one it believes in (at most ``MAX_HOPS`` times, then answers with an error),
so requests converge on the elected coordinator while views settle.  The coordinator's
state is soft: its registered fetchers are rebuilt from the reference table (every
fetcher advertises a holding as soon as it starts) whenever it takes a version over,
and registrations only speed that up.  Replies carry the coordinator's :class:`Epoch`;
the fetcher side keeps an :class:`EpochTracker`, so a reply from a superseded
coordinator is recognisably stale and ignored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Protocol

from ..bounds import (
    MAX_TEXT,
    U32,
    U63,
    U64,
    ControlEndpoint,
    MaxLen,
    PeerName,
    PeerNames,
    Range,
    Signature,
    Text,
)
from ..errors import LocalProtocolError, VersionUnavailable
from ..model import ModelName, VersionKey
from .codec import fields_bytes
from .planner import Planner
from .plans import PlannerConfig, SourceRange
from .ring import CoordinatorView, Epoch, EpochTracker, Local, Verdict, route
from .topology import NodeInfo, Topology
from .wan import Wan

MAX_HOPS = 4
_REQUEST_TAG = b"tensorhub/coordinator-request/1\0"
MAX_ASKED = 1024
MAX_REQUESTED_KEYS = 4096
"""Versions we coordinate only because someone asked (none is in our reference table);
beyond this many the least recently asked is forgotten: requests cannot grow our state
or the cost of elections without bound."""
"""Our own requests awaiting an answer (the oldest are forgotten); a reply to any other
request id is unsolicited and ignored."""


@dataclass(frozen=True, slots=True)
class CoordRequest:
    sender: ControlEndpoint  # the asking peer (replies go there directly)
    name: PeerName
    req_id: U63
    model: ModelName
    version: U63
    seen: Epoch | None
    hops: Annotated[int, Range(0, MAX_HOPS)]
    size: U64 = 0
    """Bytes of the version (0: the asker only wants to know who coordinates)."""
    chunks: U32 = 0
    sig: Signature = b""
    """Secure mode: the asker's signature over :meth:`signed_bytes`, so that a forwarded
    request (it arrives over the forwarder's connection) still speaks only for its asker."""

    def signed_bytes(self) -> bytes:
        """What the asker signs: everything but the hop count and the epoch seen, which
        may change on the way (:func:`~tensorhub.protocol.codec.fields_bytes`)."""
        return fields_bytes(_REQUEST_TAG, self.sender, self.name, self.req_id, self.model,
                            self.version, self.size, self.chunks)


@dataclass(frozen=True, slots=True)
class CoordReply:
    req_id: U63
    model: ModelName
    version: U63
    ok: bool
    epoch: Epoch | None
    fetchers: PeerNames
    detail: Text
    sources: Annotated[tuple[SourceRange, ...], MaxLen(1024)] = ()
    """The asker's part of the plan: which chunk ranges to pull from whom."""
    plan_epoch: U63 = 0
    """The plan's own epoch under the coordinator's (one more with each change), so
    that a fetcher asking again while it runs takes only a newer plan."""
    route: Text = ""
    """Which DC path the bytes into the asker's DC take, and the links' rates and where
    they come from (:meth:`Planner.route_of`); empty without a plan."""


MESSAGES = (CoordRequest, CoordReply)


@dataclass(frozen=True)
class CoordinatorAnswer:
    """What a fetcher learnt from the coordinator of a version."""

    key: VersionKey
    coordinator: str
    epoch: Epoch
    fetchers: tuple[str, ...]
    sources: tuple[SourceRange, ...] = ()
    detail: str = ""
    plan_epoch: int = 0
    route: str = ""


class MeshView(Protocol):
    """What the coordinator reads from membership, the reference table and the WAN."""

    wan: Wan
    """The links between DCs as this peer knows them: the plans it makes use them."""

    def live_names(self) -> list[str]: ...

    def fetchers_of(self, key: VersionKey) -> list[str]: ...

    def complete_holders_of(self, key: VersionKey) -> list[str]: ...

    def node_info(self, name: str) -> NodeInfo | None: ...


class Coordination:
    """Both roles of one peer: coordinator of some versions, fetcher of others."""

    def __init__(self, me: str, address: str, incarnation: int,
                 planner_config: PlannerConfig | None = None) -> None:
        self.me = me
        self.planner_config = planner_config or PlannerConfig()
        self.planners: dict[VersionKey, Planner] = {}
        """Plans of the versions this peer coordinates (soft state, like the rest)."""
        self.address = address
        self.view: CoordinatorView[None] = CoordinatorView(me, incarnation)
        self.tracker = EpochTracker()
        self._next_id = 0
        self.answers: dict[int, CoordinatorAnswer | str] = {}
        self._asked: dict[int, None] = {}
        self.forwarded = self.stale_replies = self.unsolicited = 0
        self.keys: set[VersionKey] = set()
        """Every version this peer knows of: the election runs over all of them."""
        self._requested: OrderedDict[VersionKey, None] = OrderedDict()
        """Keys known only from requests, least recently asked first."""

    def coordinator(self, key: VersionKey, live: Iterable[str]) -> str:
        found = route(key, live, self.me)
        return self.me if found is Local.LOCAL else str(found)

    def learn(self, keys: set[VersionKey], mesh: MeshView) -> None:
        """Versions seen in the reference table: elect over them, and keep them."""
        for key in keys:
            self._requested.pop(key, None)
        if not keys <= self.keys:
            self.keys |= keys
            self.elect(mesh)

    def elect(self, mesh: MeshView) -> None:
        """Re-run the election (after a view change): take over or drop versions."""
        handover = self.view.elect(sorted(self.keys), mesh.live_names(),
                                   lambda k: [(n, None) for n in mesh.fetchers_of(k)])
        for key in handover.lost:
            self.planners.pop(key, None)

    def peer_gone(self, name: str) -> None:
        """Re-attach the children of a dead or departed peer in every plan."""
        for key, planner in list(self.planners.items()):
            try:
                planner.remove_peer(name)
            except VersionUnavailable:
                del self.planners[key]  # its last copy went: plan again from scratch

    def peer_complete(self, key: VersionKey, name: str) -> None:
        planner = self.planners.get(key)
        if planner is not None and name in planner.fetchers:
            planner.mark_complete(name)

    def request(self, key: VersionKey, live: list[str], size: int = 0, chunks: int = 0
                ) -> tuple[int, CoordRequest, str]:
        """A registration for ``key``: (request id, message, member name to send to).
        With ``size`` and ``chunks`` the coordinator plans the asker into the transfer."""
        self._next_id += 1
        self._asked[self._next_id] = None
        if len(self._asked) > MAX_ASKED:
            del self._asked[next(iter(self._asked))]
        msg = CoordRequest(self.address, self.me, self._next_id, key.model, key.version,
                           self.tracker.current(key), 0, size, chunks)
        return self._next_id, msg, self.coordinator(key, live)

    def on_request(self, msg: CoordRequest, mesh: MeshView
                   ) -> tuple[str, CoordRequest | CoordReply]:
        """Handle or forward; returns (destination: 'reply' or a member name, message)."""
        key = VersionKey(msg.model, msg.version)
        live = mesh.live_names()
        target = route(key, live, self.me)
        if target is not Local.LOCAL:
            if msg.hops >= MAX_HOPS:
                return "reply", CoordReply(msg.req_id, msg.model, msg.version, False, None, (),
                                           f"no coordinator after {MAX_HOPS} hops")
            self.forwarded += 1
            fwd = CoordRequest(msg.sender, msg.name, msg.req_id, msg.model, msg.version,
                               msg.seen, msg.hops + 1, msg.size, msg.chunks, msg.sig)
            return str(target), fwd
        if msg.name not in live:
            return "reply", CoordReply(msg.req_id, msg.model, msg.version, False, None, (),
                                       f"{msg.name} is not a live member in {self.me}'s view")
        if key not in self.keys:
            self.keys.add(key)
            self._requested[key] = None
            if len(self._requested) > MAX_REQUESTED_KEYS:
                old, _ = self._requested.popitem(last=False)
                self.keys.discard(old)
                self.view.drop(old)
                self.planners.pop(old, None)
        elif key in self._requested:
            self._requested.move_to_end(key)
        self.view.adopt(key, [(n, None) for n in mesh.fetchers_of(key)])
        epoch = self.view.register(key, msg.name, None, msg.seen)
        state = self.view.state(key)
        fetchers = tuple(sorted(state.fetchers)) if state is not None else ()
        sources, detail, plan_epoch, path = (self._plan_for(key, msg, mesh) if msg.size > 0
                                             else ((), "", 0, ""))
        return "reply", CoordReply(msg.req_id, msg.model, msg.version, True, epoch, fetchers,
                                   detail, sources, plan_epoch, path)

    def _plan_for(self, key: VersionKey, msg: CoordRequest, mesh: MeshView
                  ) -> tuple[tuple[SourceRange, ...], str, int, str]:
        """Plan ``msg.name`` into the version's transfer: its sources, the plan's epoch
        and the route into its DC; () and why when we cannot.  A fetcher of the plan
        asking again gets the current plan's sources (after :meth:`Planner.reconsider`:
        the joins since the last rebuild may make a fresh plan clearly better)."""
        sources, detail = self._plan_sources(key, msg, mesh)
        planner = self.planners.get(key)
        if planner is None or not sources:
            return sources, detail, 0, ""
        try:
            path = planner.route_of(msg.name)[:MAX_TEXT]
        except LocalProtocolError:
            path = ""
        return sources, detail, planner.epoch, path

    def _plan_sources(self, key: VersionKey, msg: CoordRequest, mesh: MeshView
                      ) -> tuple[tuple[SourceRange, ...], str]:
        planner = self.planners.get(key)
        try:
            if planner is None:
                infos = [mesh.node_info(n) for n in
                         sorted({*mesh.complete_holders_of(key), msg.name})]
                topo = Topology(nodes=tuple(n for n in infos if n is not None), wan=mesh.wan)
                holders = [n.name for n in infos if n is not None and n.name != msg.name]
                if not holders or msg.name not in topo:
                    return (), "no complete holder known to the coordinator yet"
                planner = Planner(key, msg.size, msg.chunks, topo, dict.fromkeys(holders),
                                  [msg.name], config=self.planner_config)
                self.planners[key] = planner
            elif msg.name not in planner.participants:
                info = mesh.node_info(msg.name)
                if info is None:
                    return (), f"{msg.name} is not a live member in the coordinator's view"
                planner.topology.add(info)
                planner.add_fetcher(msg.name)
            elif msg.name in planner.fetchers:
                planner.reconsider()
            return (planner.sources(msg.name) if msg.name in planner.fetchers else ()), ""
        except (LocalProtocolError, VersionUnavailable) as exc:
            return (), f"no plan: {exc}"

    def on_reply(self, msg: CoordReply) -> None:
        if self._asked.pop(msg.req_id, 0) is not None:
            self.unsolicited += 1
            return
        if not msg.ok or msg.epoch is None:
            self.answers[msg.req_id] = msg.detail or "refused"
            return
        key = VersionKey(msg.model, msg.version)
        admission = self.tracker.offer(key, msg.epoch)
        if admission.verdict is Verdict.STALE:
            self.stale_replies += 1
            self.answers[msg.req_id] = f"stale epoch {msg.epoch} (have {self.tracker.current(key)})"
            return
        self.answers[msg.req_id] = CoordinatorAnswer(key, msg.epoch.coordinator, msg.epoch,
                                                     msg.fetchers, msg.sources, msg.detail,
                                                     msg.plan_epoch, msg.route)
