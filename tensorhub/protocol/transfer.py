"""One fetch's policy, as a state machine: which chunk next, from whom, and what a
failure means.

Theory of operation
-------------------
A fetch pulls the chunks of a version it does not have yet from holders.  Every wanted
chunk is in exactly one state: *pending*, *claimed* by one stream, or *verified*.  The
shell (``tensorhub.read.transfer``) runs a bounded number of workers; each asks
:meth:`TransferSession.pick` for the lowest pending chunk and the best holder that has it
-- a holder other than the original publisher first, then the one we are reading least
from -- and opens a stream to it (:meth:`~TransferSession.open_stream`).  The stream
claims runs (:meth:`~TransferSession.next_run`): the lowest pending chunk that holder is
the source of (of those, first the ones a parent still receiving already holds) and the
pending chunks right after it that it has too, about the stream's
window in bytes (:class:`~tensorhub.protocol.sizing.StreamWindow`, sized from the
bandwidth-delay product measured on that source) and no more than leaves work for every
worker.  It keeps claiming until the holder is the source of nothing pending.  A chunk
that landed and passed its digest is reported with :meth:`~TransferSession.landed` and
never fetched again; one that did not goes back to pending.

*Plans and named sources.*  The coordinator's plan names a source per chunk; it is that
chunk's source while usable, asked even before it advertises the chunk (it pipelines).
Named sources (``upstream``) are asked for any chunk likewise.  A planned parent, or a
named one still receiving, gets :data:`RELAY_DEPTH` streams.  A newer plan
(:meth:`~TransferSession.replan`: the coordinator made the plan afresh) names new sources
for the pending chunks and for those claimed elsewhere (their streams end).

*Streams per source.*  Any other source gets one stream, so its chunks land in order and
a relay downstream of this reader forwards each a chunk-time after it arrives; a second
only when one stream filled what one TCP connection keeps in flight
(``socket_window``; see :mod:`~tensorhub.protocol.sizing`).  A complete holder on this
peer's own host (same ``host`` label) gets every worker's stream: a same-host copy is
bound by cores and memory, not by a link, and several streams copy and check on several
cores.  While the copies that have
a chunk are at their streams, the original publisher is not asked for it: a worker
waits instead (a copy's one stream fills our link; the publisher's uplink is the one
every reader shares).

*Failures* (:data:`FailureKind`, reported with :meth:`~TransferSession.failed` for one
chunk or :meth:`~TransferSession.stream_ended` for the rest of a stream).  ``not_yet``:
the holder lacks that chunk for now (it is not asked for it again until gossip changes,
:meth:`~TransferSession.view_changed`).  ``refused``, ``integrity`` (bytes that failed
their digest) and ``remote_protocol``: the holder is dropped for this fetch; the shell
also bans one that sent bad bytes, and banned holders are benched until their ban ends.
``transport``: the connection failed; the holder is benched for a backoff from
:data:`RETRY_BASE`, doubling with each failure in a row, up to ``stall_timeout``.

*Stalls.*  A stream that lands no chunk for longer than its source's limit per chunk
(:meth:`~TransferSession.stall_limit`, from :class:`~tensorhub.protocol.pace.Pace`: the
source's measured pace, never under a floor that holds on a loaded host) is ``stalled``;
the limit applies to progress, chunk by chunk, not to a whole run.  The stalled source
gets twice as long next time; its chunks go to another holder that has them, and only
when there is none is the same source asked again at once: a slow but live sole source is
never dropped.  Nor is a planned parent still receiving (:meth:`~TransferSession.
_relaying`): it goes at its own sources' pace, and the other holders are upstream of it.
What ends a fetch is a real timeout: no chunk landed for
``stall_timeout`` with nothing in flight and no stream opened for as long
(:meth:`~TransferSession.expired`: a stream still connecting has claimed nothing yet,
and a worker that finds no job meanwhile must not end the fetch; one that never gets
going ends it ``stall_timeout`` after it was opened); then, or
when no holder is left for some chunk, the shell raises ``VersionUnavailable`` with
:meth:`~TransferSession.missing_text`.  A worker with nothing to do waits for news --
a chunk back in pending, gossip, a benched holder coming back -- at most until
:meth:`~TransferSession.wake_at`.

Nothing here reads a clock or performs I/O: every event carries its ``now``; holder views
and bans come in as callables that only look at memory.  The counts of what happened
(:class:`TransferTally`) become the fetch report in the shell.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..errors import LocalProtocolError
from ..manifest.manifest import Manifest
from ..model import PeerInfo
from .bans import Ban
from .linktime import LinkTime
from .pace import Pace
from .refs import Holding
from .sizing import MIN_AUTO_CHUNK, StreamWindow, choose_chunk_size, size_text

RELAY_DEPTH = 1
"""Streams to one planned parent (or named parent still receiving).  One: chunks arrive
in order, one after the other, and each level of a tree lags its parent by one
chunk-time; the stream's window keeps the parent's next chunks asked for, and the parent
sends each as it lands.  Measured in the 8-host emulated cluster (256 MiB, 4 MiB chunks,
one request at a time): 1 gave 1.16x the fluid bound, 2 gave 1.28x (two chunks share
our link, so every level lags by two)."""

LOOKAHEAD = 1024
"""Pending chunks past the lowest one a parent still receiving is the source of that a
run may start at, when the parent holds that one already (:meth:`TransferSession.
_first_run`): the scan per run stays bounded whatever the version's chunk count."""

RETRY_BASE = 0.1
"""Seconds before a source whose connection failed is tried again; doubles with each
failure in a row, up to ``stall_timeout``."""

FailureKind = Literal["not_yet", "refused", "integrity", "remote_protocol", "stalled",
                      "transport"]
FAILURE_KINDS: tuple[FailureKind, ...] = get_args(FailureKind)

Holders = Callable[[], Sequence[tuple[PeerInfo, Holding]]]
"""Who holds the version in the current view (memory only, no I/O)."""
BanCheck = Callable[[float, str], Ban | None]
"""``(now, holder name)`` -> the ban on it then (until when, why), or None."""


@dataclass
class TransferTally:
    """What a session did; the names are those of the fetch report's fields."""

    bytes: int = 0
    chunks: int = 0
    chunks_received: int = 0
    reads: int = 0
    resourced_chunks: int = 0
    planned_bytes: int = 0
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    integrity_failures: dict[str, int] = field(default_factory=dict)
    dropped_sources: dict[str, str] = field(default_factory=dict)
    banned_sources: dict[str, str] = field(default_factory=dict)
    stall_retries: dict[str, int] = field(default_factory=dict)
    replans: int = 0
    """Newer plans taken while the fetch ran (:meth:`TransferSession.replan`)."""
    first_landed: float | None = None
    """When the first chunk landed (verified), or None."""
    last_landed: float | None = None


@dataclass
class Stream:
    """One stream from one source, as the session sees it."""

    source: PeerInfo
    first: int
    """The chunk it was opened for (the one a failure before any claim is about)."""
    last: float
    """When the stream opened, or its last chunk landed or failed."""
    taken: dict[int, None] = field(default_factory=dict)
    """Chunks claimed by this stream that have neither landed nor failed, in order."""
    claimed: int = 0
    stop: bool = False
    """The source failed: its connection is to be closed."""
    whole: bool = False
    """Its source was seen holding the whole version (it stays so while it serves)."""
    timed: set[int] = field(default_factory=set)
    """Of ``taken``, the chunks asked of a source that held the whole version: only
    those time the link (:mod:`.linktime`); a relay still receiving times its own pace."""


def chunk_size_note(manifest: Manifest) -> str:
    """The version's chunk size, as its publisher chose it, and whether that is the
    automatic choice for its size.  The automatic choice also counts the publisher's
    live peers, which a reader does not know: any power of two from the floor up to the
    choice for a publisher alone may be automatic in a wider mesh."""
    size, total = manifest.chunk_size, manifest.total_bytes
    auto, _ = choose_chunk_size(total)
    if size == auto:
        return f"{size_text(size)} chosen by the publisher: automatic for {size_text(total)}"
    if MIN_AUTO_CHUNK <= size < auto and size & (size - 1) == 0:
        return (f"{size_text(size)} chosen by the publisher: automatic for "
                f"{size_text(total)} in its mesh (smaller chunks for a wider relay tree; "
                f"{size_text(auto)} alone), or its PeerConfig.chunk_size")
    return (f"{size_text(size)} chosen by the publisher: its PeerConfig.chunk_size "
            f"(automatic would be {size_text(auto)} alone, at least "
            f"{size_text(min(auto, MIN_AUTO_CHUNK))} in a wide mesh)")


class TransferSession:
    """The policy of one fetch (see the module docstring)."""

    def __init__(self, *, now: float, me: str, manifest: Manifest, holders: Holders,
                 banned: BanCheck, wanted: Iterable[int], verified: Sequence[int],
                 window: int, stall_timeout: float, upstream: frozenset[str] = frozenset(),
                 plan: Sequence[tuple[PeerInfo, int, int]] = (),
                 window_cap: int = 256 << 20, socket_window: int = 0,
                 host: str | None = None, rates: Mapping[str, float] | None = None,
                 cores: int = 0, dc: str | None = None) -> None:
        """``wanted``: the chunks to fetch (those already ``verified``, non-zero, are
        skipped);
        ``window``: the number of workers; ``plan``: ``(source, first, stop)`` ranges;
        ``socket_window``: bytes one TCP connection keeps in flight (0: unknown);
        ``host``: this peer's ``host`` label (holders with the same one share its host);
        ``rates``: bytes a second earlier fetches measured per source (each source's
        window starts from it); ``cores``: the cores this process may run on (0:
        unknown); ``dc``: this peer's ``dc`` label (reads from other DCs time their
        links, :attr:`link_time`; None: none are timed)."""
        if window < 1:
            raise LocalProtocolError(f"window must be >= 1, got {window}")
        self.me = me
        self.manifest = manifest
        self.holders = holders
        self.banned = banned
        self.upstream = upstream
        """Named sources: asked for any chunk even before they advertise it."""
        self.planned: dict[int, PeerInfo] = {
            c: peer for peer, first, stop in plan for c in range(first, stop)}
        self.stripes = _stripes(plan)
        """Per planned source: its ranges of the plan (the plan's stripes), which its
        streams take turns at (:meth:`_first_run`)."""
        self.window = window
        self.window_cap = window_cap
        self.socket_window = socket_window
        self.host = host
        self.dc = dc
        self.cores = cores
        self.stall_timeout = stall_timeout
        self.started = now
        self.last_progress = now
        self.last_open = now
        """When the latest stream was opened (:meth:`expired`)."""
        wanted = sorted(set(wanted))
        self.wanted = len(wanted)
        self.pending = [c for c in wanted if not verified[c]]
        """Chunks to fetch that no stream has claimed, in order."""
        self.claimed: dict[int, str] = {}
        """Chunk -> the source whose stream claimed it."""
        self.abandon: frozenset[str] = frozenset()
        """Sources whose streams the last :meth:`replan` asks the shell to end."""
        self.on_plan: set[int] = set()
        """Claimed chunks whose source is the one the plan named when they were claimed
        (their bytes count as planned, whatever a newer plan says)."""
        self.load: dict[str, int] = {}
        """Streams open per source."""
        self.most_streams: dict[str, int] = {}
        """The most streams open at once per source (for the report)."""
        self.benched: dict[str, float] = {}
        """Sources not to use until the given time (``inf``: not for this fetch)."""
        self.failures: dict[str, int] = {}
        """Connection failures in a row per source (the retry backoff)."""
        self.lacks: dict[str, set[int]] = {}
        """Chunks a source said it does not have yet, until the view changes."""
        self.tried: set[int] = set()
        """Chunks claimed by a source that was then dropped (a landing counts as
        re-sourced)."""
        self.pace = Pace(ceiling=stall_timeout)
        """Each source's measured pace, for stall limits that fit each link and load."""
        self.windows: dict[str, StreamWindow] = {}
        """Each source's stream window, from what its streams measured."""
        self.rates = dict(rates or {})
        self.tally = TransferTally()
        self.link_time = LinkTime()
        """Per source DC: bytes landed and the time reads from it were in flight (what
        the shell folds into the WAN model; :mod:`.linktime`)."""

    # -- questions --------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Every wanted chunk verified."""
        return not self.pending and not self.claimed

    def usable(self, now: float, name: str) -> bool:
        """Whether ``name`` may be read from now (not us, not benched, not banned)."""
        if name == self.me or self.benched.get(name, 0.0) > now:
            return False
        ban = self.banned(now, name)
        if ban is not None:  # benched too: a waiting worker wakes when the ban ends
            self.tally.banned_sources[name] = ban.reason
            self.benched[name] = ban.until
            return False
        return True

    def stall_limit(self, name: str) -> float:
        """Seconds a stream from ``name`` may go without landing a chunk."""
        return self.pace.limit(name, self.manifest.chunk_size)

    def expired(self, now: float) -> bool:
        """Nothing in flight, no chunk landed and no stream opened for
        ``stall_timeout``: the fetch fails (with :meth:`missing_text`).  A stream being
        opened has claimed nothing yet; counting it as in flight for as long as it is
        open would let one that never gets going hold the fetch forever."""
        return not self.claimed and \
            now - max(self.last_progress, self.last_open) > self.stall_timeout

    def wake_at(self, now: float) -> float:
        """When a worker that found nothing to do should look again, news or not: the
        end of the earliest bench, or ``stall_timeout`` from now."""
        wake = now + self.stall_timeout
        for until in self.benched.values():
            if now < until < wake:
                wake = until
        return wake

    def missing_text(self) -> str:
        """What is missing and why, for ``VersionUnavailable``."""
        m = self.manifest
        names = sorted({m.tensors[s.index].name for c in self.pending
                        for s in m.segments(*m.chunk_range(c))})
        t = self.tally
        dropped = "; ".join(f"{k}: {v}" for k, v in sorted(t.dropped_sources.items()))
        banned = "; ".join(f"{k}: {v}" for k, v in sorted(t.banned_sources.items())
                           if k not in t.dropped_sources)
        return (f"no live holder for {len(self.pending)} of {self.wanted} chunks "
                f"(tensors {names[:8]}{' ...' if len(names) > 8 else ''})"
                + (f"; dropped sources: {dropped}" if dropped else "")
                + (f"; banned sources: {banned}" if banned else ""))

    def pick(self, now: float) -> tuple[int, PeerInfo] | None:
        """The lowest pending chunk that has a source now, and that source.

        While every usable holder has all the streams it gets, only a chunk with a free
        planned source can have one, so the others are passed over without asking each
        holder about each of them: a worker asks whenever a stream ends, and with one
        stream to one holder that was the whole pending list every time (in-process,
        1 GiB in 4 MiB chunks: 6-13 ms of held GIL a fetch)."""
        holders = self._holders(now)

        @functools.cache
        def any_free() -> bool:
            return any(self.load.get(p.name, 0) < self.streams_to(p, h) for p, h in holders())

        for chunk in self.pending:
            if self._usable_plan(now, chunk) is None and not any_free():
                continue  # off the plan, and no holder could take it now
            peer = self._source_for(now, chunk, holders)
            if peer is not None:
                return chunk, peer
        return None

    # -- events -----------------------------------------------------------------------

    def replan(self, now: float, plan: Sequence[tuple[PeerInfo, int, int]]) -> int:
        """The coordinator's newer plan (``(source, first, stop)`` ranges): it names the
        source of every chunk not verified.  Chunks claimed from a source the new plan
        does not name for them are given back: the sources of such claims are in
        :attr:`abandon`, and the shell ends their streams now (``stream.stop``: the
        connection closes, so what was asked is not sent; then :meth:`stream_ended`
        with no failure, so nobody is benched).  Letting them finish where they are
        was measured worse: a relay still receiving a chunk may now be downstream of us
        for it (a wait on ourselves, until the stall limit), and a claim at the trainer
        spends the uplink every reader shares.  Simulated, 64 hosts in 2 DCs: 5.9x the
        bound letting every claim finish, 1.56x letting those finish whose source holds
        the chunk, 1.35x giving all back (1.32x for the plan made at once).
        At most the chunk on the wire is lost per stream.  Workers waiting for a source
        should look again.  Returns how many pending chunks changed source."""
        new = {c: peer for peer, first, stop in plan for c in range(first, stop)}

        def name(peer: PeerInfo | None) -> str | None:
            return None if peer is None else peer.name

        moved = sum(name(self.planned.get(c)) != name(new.get(c)) for c in self.pending)
        self.abandon = frozenset(
            src for c, src in self.claimed.items() if name(new.get(c)) != src)
        self.planned = new
        self.stripes = _stripes(plan)
        self.tally.replans += 1
        return moved

    def view_changed(self) -> None:
        """Gossip changed the holder view: holders may have chunks they lacked."""
        self.lacks.clear()

    def open_stream(self, now: float, chunk: int, source: PeerInfo) -> Stream:
        """A worker opens a stream to ``source``, picked as the source of ``chunk``."""
        name = source.name
        self.last_open = max(self.last_open, now)
        if name not in self.windows:
            self.windows[name] = StreamWindow(self.manifest.chunk_size, self.window_cap,
                                              self.rates.get(name))
        self.load[name] = self.load.get(name, 0) + 1
        self.most_streams[name] = max(self.most_streams.get(name, 0), self.load[name])
        return Stream(source, chunk, now)

    def next_run(self, now: float, stream: Stream, budget: int) -> list[int]:
        """Claim the next run for ``stream``: the lowest pending chunk its source is the
        source of, and the pending chunks right after it that it has too (planned chunks
        stay with their planned source), about ``budget`` bytes and no more than leaves
        work for every worker.  Empty: the stream is done."""
        name = stream.source.name
        if not self.usable(now, name):
            return []
        holders = self._holders(now)
        found = self._first_run(now, holders, name)
        if found is None:
            return []
        at, stop = found
        chunk = self.pending[at]
        share = max(1, -(-len(self.pending) // self.window))
        out, size = [chunk], self._size(chunk)
        holding = None if all(c in self.planned for c in self.pending[at + 1:at + share]) \
            else next((h for p, h in holders() if p.name == name), None)
        for nxt in self.pending[at + 1:at + share]:
            planned = self.planned.get(nxt)
            mine = planned.name == name if planned is not None else (
                name in self.upstream or (holding is not None and holding.has(nxt)))
            if nxt != out[-1] + 1 or nxt >= stop or not mine or nxt in self.lacks.get(name, ()) \
                    or size + self._size(nxt) > budget:
                break
            out.append(nxt)
            size += self._size(nxt)
        for c in out:
            self.pending.remove(c)
            self.claimed[c] = name
            if (planned := self.planned.get(c)) is not None and planned.name == name:
                self.on_plan.add(c)
        stream.taken.update(dict.fromkeys(out))
        stream.claimed += len(out)
        self.tally.reads += 1
        if not stream.whole and self.dc is not None and _dc(stream) != self.dc:
            held = next((h for p, h in holders() if p.name == name), None)
            stream.whole = held is not None and held.complete
        if stream.whole:
            stream.timed.update(out)
            self.link_time.claimed(now, _dc(stream), len(out))
        return out

    def _first_run(self, now: float, holders: Callable[[], list[tuple[PeerInfo, Holding]]],
                   name: str) -> tuple[int, int] | None:
        """Where ``name``'s next run starts in ``pending``, and the chunk it stops before:
        the lowest chunk it is the source of; but for a planned parent still receiving,
        the lowest of its planned chunks it already holds, as far as our view says
        (within :data:`LOOKAHEAD` of that lowest one; the view of holders is listed only
        then).  A parent still receiving gets its chunks in several stripes at once, from
        several sources; asked strictly in order, a child waits on the slowest stripe
        while the others pile up at the parent, and fetches them all after it (in the
        emulated cluster: the two children of a seed fed at 100 Mbit over each of two
        links ended 3 s after it, at 200 Mbit each).

        A source the plan names for several stripes is asked for them in turn: each run
        comes from the stripe with the largest share of its chunks still pending, and
        stops at that stripe's end.  Our own children read those stripes from us, each
        child its own, so each must grow here from the start: fetched in order, the last
        stripe reached a child only once the first had arrived whole (in the emulated
        cluster, a DC fed that stripe through a relay two levels down got it 8 s late,
        19.5 s against 12 s for the fan-out).  A stripe where a parent still receiving
        holds a pending chunk goes before one where it holds none."""
        ranges = self.stripes.get(name)
        if ranges is not None:
            found = self._stripe_run(now, holders, name, ranges)
            if found is not None:
                return found
        # off the plan (none of our planned chunks can be asked of it now): the lowest
        first = next((i for i, c in enumerate(self.pending)
                      if (peer := self._source_for(now, c, holders, name)) is not None
                      and peer.name == name), None)
        return None if first is None else (first, self.manifest.num_chunks)

    def _held_in(self, name: str, holding: Holding, at: int, stop_at: int) -> int | None:
        """The first index of ``pending`` from ``at`` (within :data:`LOOKAHEAD`, before
        index ``stop_at``) whose chunk is planned to ``name`` and held there."""
        lacks = self.lacks.get(name, ())
        for i in range(at, min(stop_at, at + LOOKAHEAD + 1)):
            c = self.pending[i]
            mine = self.planned.get(c)
            if mine is not None and mine.name == name and holding.has(c) and c not in lacks:
                return i
        return None

    def _stripe_run(self, now: float, holders: Callable[[], list[tuple[PeerInfo, Holding]]],
                    name: str, ranges: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        """:meth:`_first_run` for a planned source, or None when none of its stripes has
        a pending chunk it may be asked for now."""
        pending = self.pending
        spans = []
        for first, stop in ranges:
            lo, hi = bisect.bisect_left(pending, first), bisect.bisect_left(pending, stop)
            if lo < hi:
                spans.append(((hi - lo) / (stop - first), -first, lo, hi, stop))
        spans.sort(reverse=True)  # the least advanced stripe first, then the lowest
        holding = None
        start: tuple[int, int] | None = None
        for _share, _first, lo, hi, stop in spans:
            at = next((i for i in range(lo, hi)
                       if (peer := self._source_for(now, pending[i], holders, name))
                       is not None and peer.name == name), None)
            if at is None:
                continue
            if holding is None:
                holding = next((h for p, h in holders() if p.name == name), None)
            if holding is None or holding.complete:
                return at, stop
            held = self._held_in(name, holding, at, hi)
            if held is not None:
                return held, stop
            if start is None:
                start = at, stop
        return start

    def landed(self, now: float, stream: Stream, chunk: int, nbytes: int) -> None:
        """``chunk`` of ``stream`` arrived (``nbytes``) and passed its digest."""
        name = stream.source.name
        on_plan = chunk in self.on_plan
        self._unclaim(stream, chunk)
        if chunk in stream.timed:
            stream.timed.discard(chunk)
            self.link_time.ended(now, _dc(stream), 1, nbytes)
        self.pace.completed(name, nbytes, now - stream.last)
        stream.last = now
        self.failures.pop(name, None)
        self.last_progress = now
        t = self.tally
        if t.first_landed is None:
            t.first_landed = now
        t.last_landed = now
        t.chunks_received += 1
        t.chunks += 1
        t.bytes += nbytes
        if chunk in self.tried:
            t.resourced_chunks += 1
        t.bytes_by_source[name] = t.bytes_by_source.get(name, 0) + nbytes
        if on_plan:
            t.planned_bytes += nbytes

    def failed(self, now: float, stream: Stream, chunk: int, kind: FailureKind,
               detail: str) -> bool:
        """``chunk`` of ``stream`` did not land (``kind``, ``detail`` says why): it goes
        back to pending.  True when the stream must end (its connection closed)."""
        self._unclaim(stream, chunk)
        if chunk in stream.timed:
            stream.timed.discard(chunk)
            self.link_time.ended(now, _dc(stream), 1)
        self.pending.append(chunk)
        self.pending.sort()
        stream.last = now
        stream.stop = self._failed(now, stream.source.name, chunk, kind, detail) \
            or stream.stop
        return stream.stop

    def stream_ended(self, now: float, stream: Stream, kind: FailureKind | None = None,
                     detail: str = "") -> bool:
        """``stream`` is over: its source is the source of nothing pending, or it failed
        (``kind``; ``stalled`` when nothing landed within :meth:`stall_limit`).  Chunks it
        claimed and did not land go back to pending.  True when its connection must be
        closed (the source failed)."""
        name = stream.source.name
        if kind is not None:
            if kind == "stalled" and not detail:
                detail = (f"stalled: no chunk of {sorted(stream.taken)[:4]} in "
                          f"{self.stall_limit(name):.2f}s")
            chunk = min(stream.taken, default=stream.first)
            stream.stop = self._failed(now, name, chunk, kind, detail) or stream.stop
        self.load[name] -= 1
        self.link_time.ended(now, _dc(stream), len(stream.timed))
        stream.timed.clear()
        for c in stream.taken:
            del self.claimed[c]
            self.on_plan.discard(c)
            self.pending.append(c)
        stream.taken.clear()
        self.pending.sort()
        return stream.stop

    # -- policy -----------------------------------------------------------------------

    def _failed(self, now: float, name: str, chunk: int, kind: FailureKind,
                detail: str) -> bool:
        if kind == "not_yet":
            self.lacks.setdefault(name, set()).add(chunk)
            return False
        if kind == "refused":
            self._drop(now, name, f"refused: {detail}", math.inf)
        elif kind == "integrity":
            t = self.tally
            t.chunks_received += 1  # received in full, then refused
            t.integrity_failures[name] = t.integrity_failures.get(name, 0) + 1
            self._drop(now, name, detail, math.inf)
        elif kind == "remote_protocol":
            self._drop(now, name, detail, math.inf)
        elif kind == "stalled":
            self._stalled(now, name, chunk, detail)
        elif kind == "transport":
            # Maybe a passing fault: retry this source after a backoff (membership
            # removes it from the view meanwhile if it died).
            n = self.failures[name] = self.failures.get(name, 0) + 1
            self._drop(now, name, detail,
                       min(self.stall_timeout, RETRY_BASE * 2 ** min(n - 1, 16)))
        else:
            raise LocalProtocolError(f"unknown failure kind {kind!r}")
        return True

    def _stalled(self, now: float, name: str, chunk: int, why: str) -> None:
        """A stream from ``name`` landed nothing within its limit (see the module
        docstring)."""
        self.pace.stalled(name)
        if now - self.last_progress >= self.stall_timeout:  # a real timeout
            self._drop(now, name, why, self.stall_timeout)
        elif self._others_have(now, name, chunk) and not self._relaying(name, chunk):
            self._drop(now, name, why, self.stall_limit(name))
        else:  # the only source, or our relay: ask it again, with twice the time
            r = self.tally.stall_retries
            r[name] = r.get(name, 0) + 1

    def _relaying(self, name: str, chunk: int) -> bool:
        """Whether ``name`` is ``chunk``'s planned parent and still receiving.  Such a
        parent is slow when its own sources are: it goes at the plan's pace, and the
        other holders of the chunk are upstream of it, across a DC link or at the
        trainer, whose uplinks the plan has already given out.  Read there, the chunk
        crossed the WAN a second time (in the emulated cluster, fan-outs whose relays
        stalled moved 1.3-1.5x the inter-DC bytes they needed).  So it is asked again,
        with twice the time; if it is gone, membership takes it out of the view and the
        coordinator out of the plan, and a fetch with no progress at all still ends."""
        planned = self.planned.get(chunk)
        if planned is None or planned.name != name:
            return False
        held = next((h for p, h in self.holders() if p.name == name), None)
        return held is not None and not held.complete

    def _others_have(self, now: float, name: str, chunk: int) -> bool:
        """Whether a usable holder other than ``name`` could serve ``chunk``."""
        planned = self.planned.get(chunk)
        if planned is not None and planned.name != name and self.usable(now, planned.name):
            return True
        return any(p.name != name and self.usable(now, p.name)
                   and (h.has(chunk) or p.name in self.upstream)
                   for p, h in self.holders())

    def _drop(self, now: float, name: str, reason: str, bench_for: float) -> None:
        self.tally.dropped_sources[name] = reason
        self.benched[name] = max(self.benched.get(name, 0.0), now + bench_for)
        self.tried.update(c for c, src in self.claimed.items() if src == name)

    def _unclaim(self, stream: Stream, chunk: int) -> None:
        if chunk not in stream.taken:
            raise LocalProtocolError(f"chunk {chunk} is not in flight on this stream")
        del stream.taken[chunk]
        del self.claimed[chunk]
        self.on_plan.discard(chunk)

    def _source_for(self, now: float, chunk: int,
                    holders: Callable[[], list[tuple[PeerInfo, Holding]]],
                    streaming: str | None = None) -> PeerInfo | None:
        """The best source of ``chunk`` now, or None; ``streaming`` names the source of
        the stream asking (its own stream does not count in its load, and it wins ties).
        ``holders()``: the usable holders (asked only for a chunk off the plan)."""
        def load(name: str) -> int:
            return self.load.get(name, 0) - (name == streaming)

        planned = self._usable_plan(now, chunk)
        if planned is not None:
            # A planned parent gets one stream, so chunks arrive in order one after the
            # other: more would share our link between several chunks and delay our own
            # children (and theirs) by that many chunk-times.
            return planned if load(planned.name) < RELAY_DEPTH else None
        best: tuple[tuple[int, int, bool, str], PeerInfo] | None = None
        copy_busy = False  # a holder other than the publisher has it, at its streams
        for peer, holding in holders():
            if chunk in self.lacks.get(peer.name, ()) or not (
                    holding.has(chunk) or peer.name in self.upstream):
                continue
            publisher = holding.publisher == peer.name
            if load(peer.name) >= self.streams_to(peer, holding):
                copy_busy |= not publisher
                continue  # chunks in order from each source
            rank = (int(publisher), load(peer.name), peer.name != streaming, peer.name)
            if best is None or rank < best[0]:
                best = (rank, peer)
        if best is not None and best[0][0] and copy_busy:
            return None  # the publisher serves only what no copy can (ROS)
        return None if best is None else best[1]

    def _usable_plan(self, now: float, chunk: int) -> PeerInfo | None:
        """``chunk``'s planned source if it is usable and not known to lack it (then it
        is the chunk's only candidate: :meth:`_source_for`), else None."""
        planned = self.planned.get(chunk)
        if planned is None or not self.usable(now, planned.name) \
                or chunk in self.lacks.get(planned.name, ()):
            return None
        return planned

    def streams_to(self, peer: PeerInfo, holding: Holding) -> int:
        """Streams to keep to ``peer``: one, so its chunks land in order (a source still
        receiving: always one); more only on a link one cannot fill
        (:meth:`~tensorhub.protocol.sizing.StreamWindow.streams`), or from a complete
        holder on this host, where a copy is bound by cores, not by a link -- unless
        this process has one core, where more streams only add thread switches (1 GiB
        in 4 MiB chunks over loopback TCP, every process on one core: 0.59 s with one
        stream, 0.67 with two or four; on two cores 0.48 / 0.42 / 0.39)."""
        if not holding.complete:
            return 1
        if self.host is not None and peer.label("host") == self.host:
            return 1 if self.cores == 1 else self.window
        window = self.windows.get(peer.name)
        if window is None:
            return 1
        return window.streams(self.socket_window, self.window)

    def _holders(self, now: float) -> Callable[[], list[tuple[PeerInfo, Holding]]]:
        """The usable holders, listed once when first asked (a planned chunk needs none:
        the view may hold thousands)."""
        return functools.cache(
            lambda: [(p, h) for p, h in self.holders() if self.usable(now, p.name)])

    def _size(self, chunk: int) -> int:
        first, stop = self.manifest.chunk_range(chunk)
        return stop - first


def _dc(stream: Stream) -> str:
    return stream.source.label("dc") or ""


def _stripes(plan: Sequence[tuple[PeerInfo, int, int]]) -> dict[str, list[tuple[int, int]]]:
    """Per source named in ``plan``: its ranges, in order."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for peer, first, stop in plan:
        ranges.setdefault(peer.name, []).append((first, stop))
    return {name: sorted(r) for name, r in ranges.items()}
