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

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..model import VersionKey
from .ring import CoordinatorView, Epoch, EpochTracker, Local, Verdict, route

MAX_HOPS = 4


@dataclass(frozen=True, slots=True)
class CoordRequest:
    sender: str  # control address of the asking peer (replies go there directly)
    name: str
    req_id: int
    model: str
    version: int
    seen: Epoch | None
    hops: int


@dataclass(frozen=True, slots=True)
class CoordReply:
    req_id: int
    model: str
    version: int
    ok: bool
    epoch: Epoch | None
    fetchers: tuple[str, ...]
    detail: str


MESSAGES = (CoordRequest, CoordReply)


@dataclass(frozen=True)
class CoordinatorAnswer:
    """What a fetcher learnt from the coordinator of a version."""

    key: VersionKey
    coordinator: str
    epoch: Epoch
    fetchers: tuple[str, ...]


class Coordination:
    """Both roles of one peer: coordinator of some versions, fetcher of others."""

    def __init__(self, me: str, address: str, incarnation: int) -> None:
        self.me = me
        self.address = address
        self.view: CoordinatorView[None] = CoordinatorView(me, incarnation)
        self.tracker = EpochTracker()
        self._next_id = 0
        self.answers: dict[int, CoordinatorAnswer | str] = {}
        self.forwarded = self.stale_replies = 0
        self.keys: set[VersionKey] = set()
        """Every version this peer knows of: the election runs over all of them."""

    def coordinator(self, key: VersionKey, live: Iterable[str]) -> str:
        found = route(key, live, self.me)
        return self.me if found is Local.LOCAL else str(found)

    def elect(self, live: Iterable[str],
              fetchers_of: Callable[[VersionKey], Iterable[str]]) -> None:
        """Re-run the election (after a view change): take over or drop versions."""
        self.view.elect(sorted(self.keys), live, lambda k: [(n, None) for n in fetchers_of(k)])

    def request(self, key: VersionKey, live: list[str]) -> tuple[int, CoordRequest, str]:
        """A registration for ``key``: (request id, message, control name to send to)."""
        self._next_id += 1
        msg = CoordRequest(self.address, self.me, self._next_id, key.model, key.version,
                           self.tracker.current(key), 0)
        return self._next_id, msg, self.coordinator(key, live)

    def on_request(self, msg: CoordRequest, live: list[str],
                   fetchers_of: Callable[[VersionKey], Iterable[str]]
                   ) -> tuple[str, CoordRequest | CoordReply]:
        """Handle or forward; returns (destination: 'reply' or a member name, message)."""
        key = VersionKey(msg.model, msg.version)
        target = route(key, live, self.me)
        if target is not Local.LOCAL:
            if msg.hops >= MAX_HOPS:
                return "reply", CoordReply(msg.req_id, msg.model, msg.version, False, None, (),
                                           f"no coordinator after {MAX_HOPS} hops")
            self.forwarded += 1
            fwd = CoordRequest(msg.sender, msg.name, msg.req_id, msg.model, msg.version,
                               msg.seen, msg.hops + 1)
            return str(target), fwd
        if self.view.state(key) is None:
            self.keys.add(key)
            self.elect(live, fetchers_of)
        epoch = self.view.register(key, msg.name, None, msg.seen)
        state = self.view.state(key)
        fetchers = tuple(sorted(state.fetchers)) if state is not None else ()
        return "reply", CoordReply(msg.req_id, msg.model, msg.version, True, epoch, fetchers, "")

    def on_reply(self, msg: CoordReply) -> None:
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
                                                     msg.fetchers)
