"""The read policy of one fetch, around its chunk transfer: how many streams it opens,
which holder it asks for the manifest and when it gives up, which plan it follows and
when it asks for a newer one, and which holders its delta phase reads from.

Theory of operation
-------------------
A fetch runs in phases.  The trio shell (:mod:`tensorhub.read`) does their I/O and the
simulator (:mod:`simulations`) replays them on a virtual clock; both drive the objects
and functions here, which never read a clock or touch a socket: time is passed in.

*The holder view* (:func:`named_view`).  Who holds a version, as the reference table
says, limited to the named sources when the caller named some.  A named source that
does not advertise the version yet (it is still starting its own fetch) is listed as
holding nothing, so a reader asks it all the same and it serves each chunk once it has
verified it (pipelining).

*Manifest* (:class:`ManifestSearch`).  Every holder in the view but this peer and those
this peer bans is a candidate; copies held by others than the publisher are asked first
(the publisher's uplink is the scarcest), then by name.  A holder is asked again only
once its reference changed (a new one arrived by gossip); a named source not advertising
the version yet is asked again every :data:`EARLY_RETRY` seconds.  With no holder known
and no source named, the fetch fails at once; otherwise it waits for the view to change
until ``stall_timeout`` after it began, then fails naming each holder's reason.

*Plan* (:func:`plan_of`, :class:`PlanFollow`).  A whole version is fetched along the
plan of its coordinator.  While the chunks flow the fetch asks again, :data:`REASK_FIRST`
after the first answer and then at doubling intervals up to :data:`REASK_MAX` -- a
handful of asks per fetch, so a fan-out to a thousand fetchers costs its coordinator a
few thousand cheap answers, not one per chunk -- and takes a plan only when its stamp
(coordinator epoch, then plan epoch) is newer than the one it follows.

*Deltas* (:func:`delta_base`, :func:`delta_sources`, :func:`link_estimate`,
:func:`delta_skip`).  A reader holding an older complete version of the model reads the
changed chunks as deltas from holders of both versions, not on its own host (a
same-host copy beats any delta), best first: same DC, then not the publisher.  With
``delta="auto"`` a source is asked only where encoding and applying outrun the link
(:func:`~tensorhub.protocol.delta.delta_pays`), the link being what the last fetch from
that source measured, or before any what the two NIC labels say.

*Streams* (:func:`streams`, :func:`stream_cap`).  A fetch opens ``fetch_window`` streams,
fewer where ``max_inflight_bytes`` cannot give each the floor of a window
(:data:`~tensorhub.protocol.sizing.MIN_CHUNKS` chunks); each stream keeps at most its
share of ``max_inflight_bytes`` requested ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace

from ..config import PeerConfig
from ..errors import ConsistencyError, LocalProtocolError, VersionUnavailable
from ..manifest.manifest import Manifest
from ..model import PeerInfo, VersionKey
from .bans import Ban
from .coordination import CoordinatorAnswer
from .delta import DEFAULT_ENCODE_BPS, delta_pays
from .refs import Holding
from .ring import Epoch
from .sizing import MIN_CHUNKS
from .topology import NodeInfo

View = list[tuple[PeerInfo, Holding]]
"""Holders of one version as a reader sees them: who, and what its reference says."""
Plan = list[tuple[PeerInfo, int, int]]
"""A reader's part of a plan: (source, first chunk, stop) per range."""
PlanStamp = tuple[Epoch, int]
"""Which plan: the coordinator's epoch, then the plan's own (newer compares greater)."""
BanCheck = Callable[[str], Ban | None]
"""Holder name -> the peer's ban on it now (until when, and why), or None."""

EARLY_RETRY = 0.02
"""Seconds between asks of a named source for a manifest it does not hold yet."""
REASK_FIRST = 0.2
"""Seconds from a plan's answer to a planned fetch's first ask for a newer one (every
fetcher that started with it has registered by then; see ``Planner.reconsider``)."""
REASK_MAX = 3.2
"""Longest wait between two asks (each waits twice the one before, up to this): a
handful of asks per fetch, not one per chunk."""
NOTED_REPLANS = 3
"""Newer plans the fetch report's ``plan`` note lists one by one (the rest: a count)."""


# -- the holder view --------------------------------------------------------------------

def not_advertising(allowed: Collection[str], every: View, live: Iterable[PeerInfo],
                    known: Collection[str], me: str) -> tuple[Holding | None, list[PeerInfo]]:
    """The publisher's own reference of a version (what the version is), and the live
    named sources that are neither ``me`` nor in ``known`` (not advertising it yet)."""
    ref = next((h for p, h in every if p.name == h.publisher), None)
    return ref, [info for info in live
                 if info.name in allowed and info.name not in known and info.name != me]


def named_view(every: View, live: Iterable[PeerInfo], allowed: Collection[str] | None,
               me: str) -> View:
    """``every`` holder, limited to ``allowed`` names; a live named source not
    advertising the version yet is listed holding nothing (it is asked all the same)."""
    if allowed is None:
        return every
    found = [(p, h) for p, h in every if p.name in allowed]
    ref, waiting = not_advertising(allowed, every, live, {p.name for p, _ in found}, me)
    if ref is not None and waiting:
        nothing = replace(ref, bitmap=bytes((ref.num_chunks + 7) // 8))
        found += [(info, nothing) for info in waiting]
    return found


def size_hint(every: View) -> tuple[int, int] | None:
    """(bytes, chunks) of a version as its publisher's reference says (or, without one,
    as every holder that says a size agrees); None when unknown or disputed."""
    said = {(h.size, h.num_chunks) for p, h in every
            if h.size > 0 and h.num_chunks > 0 and p.name == h.publisher}
    if not said:
        said = {(h.size, h.num_chunks) for _, h in every if h.size > 0 and h.num_chunks > 0}
    return said.pop() if len(said) == 1 else None


# -- the manifest phase -----------------------------------------------------------------

class ManifestSearch:
    """Whom to ask for a version's manifest, and when to give up (see the module text).

    Each round: :meth:`candidates` (those to ask now, best first), :meth:`failed` for
    each that did not serve it, then :meth:`wake_at` (when to look again; it raises
    :class:`VersionUnavailable` once ``stall_timeout`` has passed)."""

    def __init__(self, now: float, key: VersionKey, me: str,
                 allowed: Collection[str] | None, stall_timeout: float) -> None:
        self.key, self.me, self.allowed = key, me, allowed
        self.deadline = now + stall_timeout
        self._tried: dict[str, Holding] = {}
        """The reference each holder had when it was last asked."""
        self.errors: dict[str, str] = {}
        self.banned: dict[str, str] = {}
        self._early: set[str] = set()
        """Named sources asked before their reference says they hold the version."""

    def candidates(self, every: View, live: Iterable[PeerInfo], banned: BanCheck) -> View:
        """The holders to ask now, best first (they count as asked); raises
        :class:`VersionUnavailable` when no holder is known at all and none was named."""
        self._early.clear()
        found: View = []
        for p, h in every:
            if p.name == self.me or (self.allowed is not None and p.name not in self.allowed):
                continue
            ban = banned(p.name)
            if ban is None:
                found.append((p, h))
            else:
                self.banned[p.name] = f"banned here ({ban.reason})"
        if self.allowed is not None:  # named sources are asked before they advertise it
            ref, waiting = not_advertising(self.allowed, every, live,
                                           {p.name for p, _ in found} | self.banned.keys(),
                                           self.me)
            for info in waiting:
                if ref is not None and banned(info.name) is None:
                    found.append((info, ref))
                    self._early.add(info.name)
        if not found and self.allowed is None and not self.errors:
            raise VersionUnavailable(
                self.key.model, self.key.version, "no live holder is known"
                if not self.banned else "no holder that is not banned: "
                + "; ".join(f"{k}: {v}" for k, v in self.banned.items()))
        fresh = [(p, h) for p, h in found if self._tried.get(p.name) is not h]
        fresh.sort(key=lambda ph: (ph[1].publisher == ph[0].name, ph[0].name))
        for p, h in fresh:
            self._tried[p.name] = h
        return fresh

    def failed(self, holder: str, why: str) -> None:
        """``holder`` did not serve the manifest (``why``)."""
        self.errors[holder] = why

    def wake_at(self, now: float) -> float:
        """None of this round's candidates served it: when to look again (earlier when
        the view changes); :class:`VersionUnavailable` once the time is up."""
        if now >= self.deadline:
            which = f" among {sorted(self.allowed)}" if self.allowed is not None else ""
            detail = "; ".join(f"{k}: {v}" for k, v in
                               sorted({**self.banned, **self.errors}.items()))
            raise VersionUnavailable(self.key.model, self.key.version,
                                     f"no holder{which} served the manifest "
                                     f"({detail or 'none known'})")
        if not self._early:
            return self.deadline
        for name in self._early:  # their reference may reach us only at the next gossip
            self._tried.pop(name, None)
        return min(self.deadline, now + EARLY_RETRY)


def check_schema(manifest: Manifest, schema: bytes | None) -> None:
    """A manifest whose tensor specs are not the ones the version was sealed with
    (its announcement claimed specs it does not have) makes the fetch fail whole."""
    if manifest.schema_id() != schema:
        raise ConsistencyError(
            f"{manifest.key}: its manifest lists other tensor specs (schema "
            f"{manifest.schema_id().hex()[:8]}) than the version was sealed with "
            f"({(schema or b'').hex()[:8] or 'none'}); nothing of it is used")


# -- the plan ---------------------------------------------------------------------------

def plan_of(answer: CoordinatorAnswer, members: Mapping[str, PeerInfo], me: str
            ) -> tuple[Plan, str, PlanStamp | None]:
    """Our part of a coordinator's plan as (source, first chunk, stop), a note, and the
    plan's stamp; an empty plan, why, and None when it names no source we know."""
    plan = [(members[s.peer], s.first, s.stop) for s in answer.sources
            if s.peer in members and s.peer != me]
    if not plan:
        return [], f"no plan from {answer.coordinator}: {answer.detail or 'empty'}", None
    return (plan, f"{answer.coordinator} epoch {answer.epoch.term} plan {answer.plan_epoch}",
            (answer.epoch, answer.plan_epoch))


class PlanFollow:
    """Asking the coordinator again while the chunks flow (see the module text), and
    the ``plan`` note of the fetch report that says which newer plans were taken."""

    def __init__(self, now: float, stamp: PlanStamp, note: str) -> None:
        self.started = now
        self.stamp = stamp
        self.base = self.note = note
        self._delay = REASK_FIRST
        self.taken = 0
        """Newer plans taken that changed something of ours."""

    def next_delay(self) -> float:
        """Seconds from now (the last answer, or the first plan) to the next ask."""
        delay, self._delay = self._delay, min(REASK_MAX, 2 * self._delay)
        return delay

    def newer(self, stamp: PlanStamp | None) -> bool:
        """Whether an answer stamped ``stamp`` is a plan to take."""
        return stamp is not None and stamp > self.stamp

    def took(self, now: float, stamp: PlanStamp, moved: int, ended: int) -> None:
        """The plan stamped ``stamp`` was taken: ``moved`` pending chunks changed source
        and ``ended`` streams ended (both 0: the same sources for what we lack)."""
        what = (f"plan {stamp[1]}" if stamp[0] == self.stamp[0] else
                f"{stamp[0].coordinator} epoch {stamp[0].term} plan {stamp[1]}")
        self.stamp = stamp
        if not moved and not ended:
            return
        self.taken += 1
        if self.taken <= NOTED_REPLANS:
            self.base += (f", then {what} at {now - self.started:.2f} s ({moved} chunks "
                          f"to new sources, {ended} streams ended)")
            self.note = self.base
        else:
            self.note = f"{self.base}, then {self.taken - NOTED_REPLANS} more"


# -- the delta phase --------------------------------------------------------------------

def delta_base(held: Iterable[VersionKey], key: VersionKey) -> VersionKey | None:
    """The newest older version of ``key``'s model, shard and layout among ``held``
    (the complete versions this peer holds), or None."""
    older = [k for k in held if k.model == key.model and k.shard == key.shard
             and k.layout == key.layout and k.version < key.version]
    return max(older, key=lambda k: k.version, default=None)


def delta_sources(me: PeerInfo, base_holders: View, new_holders: View, plan: Plan,
                  banned: BanCheck, allowed: Collection[str] | None) -> list[PeerInfo]:
    """Holders of the base, complete, that hold (or, planned, will hold) the new
    version; not ``me``, not banned, not on its host; best first (same DC, then not the
    publisher, then by name)."""
    holding_new = {p.name: h for p, h in new_holders}
    planned = {p.name for p, _, _ in plan}
    host, dc = me.label("host"), me.label("dc")
    found = [p for p, h in base_holders
             if h.complete and (p.name in holding_new or p.name in planned)
             and p.name != me.name and banned(p.name) is None
             and (allowed is None or p.name in allowed)
             and (host is None or p.label("host") != host)]
    return sorted(found, key=lambda p: (
        p.label("dc") != dc, (h := holding_new.get(p.name)) is not None
        and h.publisher == p.name, p.name))


def link_estimate(measured: float | None, me: PeerInfo, source: PeerInfo,
                  nic_bps: float) -> float:
    """Bytes/s from ``source``: as the last fetch from it measured, else as the two NIC
    labels say (``nic_bps`` where a peer has none): the planner's numbers."""
    if measured is not None:
        return measured
    try:
        ours, theirs = NodeInfo.from_peer(me, nic_bps), NodeInfo.from_peer(source, nic_bps)
    except LocalProtocolError:  # a malformed label: as if unlabelled
        return nic_bps
    return min(ours.down_bps, theirs.up_bps)


def delta_skip(mode: str, link_bps: float, measured: bool, encode_bps: float | None,
               apply_bps: float | None) -> str | None:
    """None when a source is to be asked for deltas now (``mode`` ``always``, or
    ``auto`` where they pay); else why full chunks are faster from it."""
    if mode == "always":
        return None
    encode = DEFAULT_ENCODE_BPS if encode_bps is None else encode_bps
    if delta_pays(link_bps, encode, apply_bps):
        return None
    apply = "?" if apply_bps is None else f"{apply_bps / 1e6:.0f}"
    how = "measured" if measured else "from the NIC labels"
    return (f"link {link_bps / 1e6:.0f} MB/s ({how}) is faster than encoding "
            f"{encode / 1e6:.0f} / applying {apply} MB/s")


# -- the chunk phase --------------------------------------------------------------------

def streams(config: PeerConfig, chunk_size: int) -> int:
    """Streams (workers) of one fetch: ``fetch_window``, within ``max_inflight_bytes``
    at the floor of a window each (``MIN_CHUNKS`` chunks of ``chunk_size``)."""
    return max(1, min(config.fetch_window,
                      config.max_inflight_bytes // (MIN_CHUNKS * chunk_size)))


def stream_cap(config: PeerConfig, chunk_size: int) -> int:
    """Bytes one stream of a fetch may keep requested ahead: its share of
    ``max_inflight_bytes``."""
    return config.max_inflight_bytes // streams(config, chunk_size)
