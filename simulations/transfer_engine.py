"""A deterministic discrete-event simulation of one version's fan-out in which every
reader runs the real :class:`~tensorhub.protocol.transfer.TransferSession`.

Theory of operation
-------------------
One virtual clock and one queue of callbacks (:class:`~simulations.events.EventQueue`:
ties broken by insertion order, so the same setup and seed give the same run).  Hosts
sit in DCs; bytes move over the flow-level network of :mod:`simulations.flows` (max-min
fair sharing, store-and-forward per chunk: a holder sends a chunk only once it has it
verified, as real relays do).  Each request takes half a round trip to reach its holder
and each reply half a round trip back.

*Readers* do what the shell (``tensorhub.read.transfer``) does, as events: ``window``
workers each ask the session for a job (:meth:`~TransferSession.pick`), open a stream
(a new connection costs one round trip), and keep asking for runs
(:meth:`~TransferSession.next_run`) while at least half the stream's window (or a
chunk) is free, as the TCP transport does; every reply is reported (``landed`` or
``failed``), and measured round trips and rates go to the session's
:class:`~tensorhub.protocol.sizing.StreamWindow` as the transport reports them.  A
stream that lands nothing within its source's stall limit ends ``stalled``; a worker
with nothing to do waits for news or until :meth:`~TransferSession.wake_at`.

*Holders* (the publisher, and every reader for what it has verified) answer a
connection's requests in order: a chunk they lack is waited for up to ``stall_timeout``
(the store's ``chunk_wait``) and then answered ``not_yet``, as the data-plane server
does.  A reader advertises each chunk as it lands; every other peer sees it
``gossip_delay`` later.  A *kill* (a scenario action) ends a host's process: its
connections reset (readers see a transport failure half a round trip later), a
connection to it is refused after one round trip, and the membership drops it from the
holder view ``detect_delay`` later.  The plan, when planning is on, comes from the real
:class:`~tensorhub.protocol.planner.Planner` (:mod:`simulations.transfer_coord`), made
once with every reader as a fetcher, or (``incremental_plan``) as each reader asks the
coordinator (``Setup.coordinator``; an answer takes a round trip) when it starts and
again while it runs, on the shell's schedule: its workers start with the first answer,
and a newer plan goes to :meth:`~TransferSession.replan`.
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_left
from collections.abc import Callable, Iterable
from functools import partial

from tensorhub.model import PeerInfo
from tensorhub.protocol.bans import Ban
from tensorhub.protocol.reading import PlanFollow, named_view, stream_cap, streams
from tensorhub.protocol.refs import Holding
from tensorhub.protocol.ring import Epoch
from tensorhub.protocol.transfer import FailureKind, TransferSession

from .events import EventQueue
from .flows import Link, Network
from .transfer_coord import SimCoordinator
from .transfer_setup import (
    KEY,
    MAX_EVENTS_PER_CHUNK,
    Conn,
    Reader,
    Result,
    Run,
    Setup,
    SimStream,
    manifest_of,
)


class Sim:
    """One run of a :class:`Setup` (see the module docstring)."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.rng = random.Random(setup.seed)
        self.now = 0.0
        self.queue = EventQueue()
        self.net = Network(self.queue)
        self.hosts = {h.name: h for h in setup.hosts}
        self.infos = {h.name: PeerInfo(h.name, f"tcp://{h.name}:1", f"{h.name}:2",
                                       (("dc", h.dc),)) for h in setup.hosts}
        self.m = manifest_of(setup.size, setup.chunk_size)
        n = self.m.num_chunks
        self.have = {h: bytearray(n) for h in self.hosts}
        self.have[setup.publisher][:] = b"\1" * n
        self.advertised: dict[str, bytearray] = {setup.publisher: bytearray(b"\1" * n)}
        self.holdings: dict[str, Holding] = {}
        self.view_version = 0
        self._views: dict[str, tuple[int, list[tuple[PeerInfo, Holding]]]] = {}
        self.waiters: dict[tuple[str, int], list[Conn]] = {}
        """(holder, chunk) -> connections waiting at that holder for that chunk."""
        self.dead: set[str] = set()
        self.listeners: set[Reader] = set()
        """Readers with a waiting worker or chunks a holder said it lacks."""
        self.wanting: list[set[Reader]] = [set() for _ in range(n)]
        """Per chunk, the readers that may have it pending (a superset, pruned when
        looked at: chunks go back to pending only through ``failed`` and
        ``stream_ended``, and this follows them there)."""
        self.lacking: set[Reader] = set()
        """Readers that may have been told a holder lacks a chunk (a superset, as
        above: ``lacks`` grows only through the same two calls)."""
        self.trace = hashlib.sha256()
        self.events = 0
        self.done: dict[str, float] = {}
        self.failed: dict[str, str] = {}
        self.coordinator = self.new_coordinator()
        self.readers = {name: self._reader(name) for name in setup.readers}
        for r in self.readers.values():
            self._returned(r, r.session.pending)
        self.quiet_pokes = setup.socket_window == 0

    def new_coordinator(self) -> SimCoordinator:
        """The version's coordinator (a subclass may plan with more of the topology)."""
        return SimCoordinator(self.setup, self.m.num_chunks)

    # -- the clock ----------------------------------------------------------------------

    def at(self, when: float, fn: Callable[[float], None]) -> None:
        self.queue.at(when, fn)

    def run(self, until: float = math.inf) -> Result:
        for name in self.setup.readers:
            self.at(self.rng.random() * self.setup.start_jitter,
                    partial(self._start, self.readers[name]))
        for when, host in self.setup.kills:
            self.at(when, partial(self.kill, host))
        limit = MAX_EVENTS_PER_CHUNK * len(self.readers) * self.m.num_chunks + 100_000
        while len(self.done) + len(self.failed) < len(self.readers):
            nxt = self.queue.pop()
            if nxt is None:
                break
            when, fn = nxt
            if when > until:
                break
            self.now = when
            self.events += 1
            if self.events > limit:
                raise RuntimeError(f"over {limit} events at t={when}: a livelock?")
            fn(when)
        for name in self.readers:
            if name not in self.done and name not in self.failed:
                self.failed[name] = f"unfinished at t={self.now}"
        live = [t for r, t in self.done.items()]
        sources = {r.name: dict(r.session.tally.bytes_by_source)
                   for r in self.readers.values()}
        wan = sum(link.carried for name, link in self.net.links.items()
                  if name.startswith("wan:"))
        return Result(dict(self.done), dict(self.failed), max(live, default=math.inf),
                      wan, sources, sum(r.session.tally.resourced_chunks
                                        for r in self.readers.values()),
                      self.events, self.trace.hexdigest(), self.coordinator.bound_s,
                      self.coordinator.asks, sum(r.replans for r in self.readers.values()))

    # -- setup --------------------------------------------------------------------------

    def _reader(self, name: str) -> Reader:
        setup, cfg = self.setup, self.setup.config
        window = streams(cfg, self.m.chunk_size)
        plan = self.plan_for(name) if setup.plan and name not in setup.upstream \
            and not setup.incremental_plan else []
        allowed = setup.upstream.get(name)
        session = TransferSession(
            now=0.0, me=name, manifest=self.m, holders=lambda: self.view(name, allowed),
            banned=self._no_ban, wanted=range(self.m.num_chunks),
            verified=[0] * self.m.num_chunks, window=window,
            stall_timeout=cfg.stall_timeout, upstream=allowed or frozenset(), plan=plan,
            window_cap=stream_cap(cfg, self.m.chunk_size),
            socket_window=setup.socket_window)
        return Reader(name, session)

    @staticmethod
    def _no_ban(now: float, name: str) -> Ban | None:
        return None

    def plan_for(self, reader: str) -> list[tuple[PeerInfo, int, int]]:
        """``reader``'s part of the plan made once with every reader."""
        return [(self.infos[r.peer], r.first, r.stop)
                for r in self.coordinator.sources(reader)]

    def ask(self, r: Reader) -> None:
        """``r`` asks the coordinator (at its start, then as its
        :class:`~tensorhub.protocol.reading.PlanFollow` schedules, as the shell does):
        the answer is made half a round trip later and lands a whole one later; a newer
        plan is taken."""
        coordinator = self.setup.coordinator or self.setup.publisher
        rtt, answer = self.rtt(r.name, coordinator), []
        self.at(self.now + rtt / 2, lambda t: answer.append(self.coordinator.ask(r.name)))

        def back(t: float) -> None:
            if r.dead or r.name in self.done:
                return
            sources, epoch = answer[0]
            stamp = (Epoch(1, coordinator, 0), epoch)
            first = r.follow is None
            if r.follow is None or r.follow.newer(stamp):
                moved = r.session.replan(t, [(self.infos[x.peer], x.first, x.stop)
                                             for x in sources])
                r.replans += not first and moved > 0
                ended = [x for x in r.streams if x.s.source.name in r.session.abandon]
                for st in ended:
                    st.s.stop = True  # its connection closes: what it asked is not sent
                    self.end(st, None)
                if r.follow is None:
                    r.follow = PlanFollow(t, stamp, "")
                else:
                    r.follow.took(t, stamp, moved, len(ended))
                self.notify(r)
            if first:
                for w in range(r.session.window):
                    self.worker(r, w)
            if self.setup.reask:
                self.at(t + r.follow.next_delay(), lambda _t: self.ask(r))
        self.at(self.now + rtt, back)

    # -- the holder view ----------------------------------------------------------------

    def view(self, me: str, allowed: frozenset[str] | None) -> list[tuple[PeerInfo, Holding]]:
        """What ``me`` sees advertised, as the shell's view does
        (:func:`~tensorhub.protocol.reading.named_view`).  Holders that advertised no
        chunk yet are left out: no session would read from them (named sources are
        added back, as holding nothing)."""
        cached = self._views.get("" if allowed is None else me)
        if cached is not None and cached[0] == self.view_version:
            return cached[1]
        live = [self.infos[n] for n in sorted(self.hosts) if n not in self.dead]
        found = named_view(self._every(), live, allowed, me)
        self._views["" if allowed is None else me] = (self.view_version, found)
        return found

    def _every(self) -> list[tuple[PeerInfo, Holding]]:
        cached = self._views.get("*")
        if cached is not None and cached[0] == self.view_version:
            return cached[1]
        every = [(self.infos[h], self._holding(h)) for h, bits in self.advertised.items()
                 if 1 in bits]
        self._views["*"] = (self.view_version, every)
        return every

    def _holding(self, name: str) -> Holding:
        held = self.holdings.get(name)
        if held is None:
            bits = self.advertised[name]
            n = len(bits)
            bitmap = bytearray((n + 7) // 8)
            for c in range(n):
                if bits[c]:
                    bitmap[c >> 3] |= 1 << (c & 7)
            held = self.holdings[name] = Holding(
                KEY.model, KEY.version, self.m.manifest_id(), self.setup.publisher, n,
                b"" if all(bits) else bytes(bitmap))
        return held

    def advertise(self, holder: str, chunk: int | None) -> None:
        """``holder`` announced ``chunk`` (None: that it is fetching, which changes no
        view: a holder with no chunk is left out); seen ``gossip_delay`` later."""
        def seen(t: float) -> None:
            if holder in self.dead:
                return
            bits = self.advertised.setdefault(holder, bytearray(self.m.num_chunks))
            if chunk is None or bits[chunk]:
                return
            bits[chunk] = 1
            self.holdings.pop(holder, None)
            self.view_version += 1
            self.poke(t, chunk, 0 not in bits)
        self.at(self.now + self.setup.gossip_delay, seen)

    def poke(self, now: float, chunk: int | None = None, complete: bool = False) -> None:
        """The view changed (a holder advertised ``chunk``, and is now ``complete``;
        None: a holder left): as ``Fetch.poke`` on every reader that listens.  A reader
        whose session lacks nothing and for which ``chunk`` is not pending is not
        woken: the news changes none of its picks (only that chunk's holders changed,
        and a holder's stream count only when it completes).  That holds while nothing
        else changes a pick unannounced; with a ``socket_window`` the streams per source
        follow each stream's measurements, so then every listener is woken, as the
        shell's ``Fetch.poke`` does on every change of the control plane."""
        listeners = self.listeners
        if not self.quiet_pokes or chunk is None or complete:
            woken, self.listeners = listeners, set()
        else:  # the listeners that lack nothing and have not ``chunk`` pending stay
            woken = set()
            concerned = self.wanting[chunk]
            for r in list(concerned):
                if not _has(r.session.pending, chunk):
                    concerned.discard(r)
                elif r in listeners:
                    woken.add(r)
            for r in list(self.lacking):
                if not r.session.lacks:
                    self.lacking.discard(r)
                elif r in listeners:
                    woken.add(r)
            listeners -= woken
        for r in sorted(woken, key=lambda r: r.name):
            if not r.dead and r.name not in self.done:
                r.session.view_changed()
                self.notify(r)

    def _returned(self, r: Reader, chunks: Iterable[int]) -> None:
        """``chunks`` went (back) to ``r``'s pending, and its holders' lacks may have
        grown (see ``wanting`` and ``lacking``)."""
        for c in chunks:
            self.wanting[c].add(r)
        if r.session.lacks:
            self.lacking.add(r)

    # -- readers: workers ---------------------------------------------------------------

    def _start(self, r: Reader, _now: float) -> None:
        self.advertise(r.name, None)  # downstream can find us
        if self.setup.incremental_plan and self.setup.plan and r.name not in self.setup.upstream:
            self.ask(r)  # the workers start with the answer
            return
        for w in range(r.session.window):
            self.worker(r, w)

    def notify(self, r: Reader) -> None:
        """Wake the waiting workers of ``r`` (a chunk back in pending, a stream ended,
        gossip).  They are woken one at a time, each once the one before found a job:
        one that finds none leaves the state as it was, so the rest would find none
        too (the shell wakes them all; the outcome is the same)."""
        if r.waiting and not r.chained:
            r.chained = True
            self.at(self.now, lambda t: self._wake_next(r))

    def _wake_next(self, r: Reader) -> None:
        r.chained = False
        while r.waiting and not r.dead:
            w = min(r.waiting)
            del r.waiting[w]
            self.worker(r, w)
            if w in r.waiting:
                return  # it found nothing to do

    def worker(self, r: Reader, w: int) -> None:
        """One turn of ``Fetch._worker``: pick a job and stream, or wait for news."""
        s, now = r.session, self.now
        if r.dead or r.busy[w] or s.done or w in r.waiting:
            return
        conns = r.conns[w]
        for name in [n for n in conns if not s.usable(now, n)]:
            self.close(conns.pop(name))
        job = s.pick(now)
        if job is None:
            if not s.pending:
                return  # the rest is claimed by other workers
            if s.expired(now):
                self.fail(r, "VersionUnavailable: " + s.missing_text())
                return
            r.waiting[w] = None
            self.listeners.add(r)
            wake_at = s.wake_at(now)
            armed = r.timers[w]
            if armed is None or armed > wake_at:
                r.timers[w] = wake_at

                def wake(t: float) -> None:
                    if r.timers[w] == t:
                        r.timers[w] = None
                        if w in r.waiting:
                            del r.waiting[w]
                            self.worker(r, w)
                self.at(wake_at, wake)
            return
        chunk, peer = job
        st = SimStream(s.open_stream(now, chunk, peer), Conn(r, peer.name), w)
        st.deadline = now + s.stall_limit(peer.name)
        r.busy[w] = True
        r.streams.append(st)
        self._watch(st)
        conn = conns.get(peer.name)
        if conn is not None and conn.alive:
            st.conn = conn
            conn.stream = st
            self.take(st)
            return
        conn = st.conn
        conn.stream = st
        rtt = self.rtt(r.name, peer.name)

        def connected(t: float) -> None:
            if st.over:
                return
            if peer.name in self.dead:
                self.end(st, "transport", f"connection to {peer.name} refused")
                return
            conns[peer.name] = conn
            self.take(st)
        self.at(now + rtt, connected)

    def _watch(self, st: SimStream) -> None:
        """The stream's cancel scope: stalled when its deadline passes."""
        def check(t: float) -> None:
            if st.over:
                return
            if t >= st.deadline:
                self.end(st, "stalled")
            else:
                self.at(st.deadline, check)
        self.at(st.deadline, check)

    def take(self, st: SimStream) -> None:
        """``stream_chunks``' loop: ask for a run when the window says
        (``StreamWindow.ask``); the stream ends when the session gives nothing and
        nothing is in flight."""
        r, s, conn = st.conn.reader, st.conn.reader.session, st.conn
        window = s.windows[st.s.source.name]
        if conn.min_rtt is not None:
            window.rtt(conn.min_rtt)
        budget = window.ask(st.ahead)
        if st.sizes and budget <= 0:
            return
        run = s.next_run(self.now, st.s, budget)
        if not run:
            if not st.sizes:
                self.end(st, None)
            return
        req = Run(self.now, not st.sizes, run[0])  # alone: nothing else in flight
        for c in run:
            first, stop = self.m.chunk_range(c)
            st.sizes[c] = stop - first
            st.ahead += stop - first
        half = self.rtt(r.name, conn.source) / 2

        def arrive(t: float) -> None:
            if conn.alive:
                conn.queue.extend((c, req) for c in run)
                self.serve(conn)
        self.at(self.now + half, arrive)

    def reply(self, st: SimStream, chunk: int, ok: bool, req: Run, header: float) -> None:
        """A reply reached the reader (its header at ``header``): the transport's
        bookkeeping, then ``landed``."""
        if st.over:
            return
        r, s, conn, now = st.conn.reader, st.conn.reader.session, st.conn, self.now
        name = st.s.source.name
        window = s.windows[name]
        st.ahead -= st.sizes.pop(chunk)
        if chunk == req.first and req.alone:  # request sent to the reply's first byte
            rtt = header - req.sent_at
            conn.min_rtt = rtt if conn.min_rtt is None else min(conn.min_rtt, rtt)
            window.rtt(rtt)
        nbytes = self.m.chunk_range(chunk)[1] - self.m.chunk_range(chunk)[0]
        if not ok:
            conn.last_end = None
            stop = s.failed(now, st.s, chunk, "not_yet",
                            f"chunk {chunk} is not verified at {name} yet")
            self._returned(r, (chunk,))
            self.listeners.add(r)
            self.notify(r)
        else:
            if chunk == req.first and req.alone:  # header to last byte: its own time
                window.delivered(nbytes, now - header)
            elif conn.last_end is not None and window.backlogged(conn.last_end - req.sent_at):
                window.delivered(nbytes, now - conn.last_end)
            conn.last_end = now
            self.trace.update(f"{now!r} {r.name} {chunk} {name}\n".encode())
            s.landed(now, st.s, chunk, nbytes)
            self.have[r.name][chunk] = 1
            for waiting in self.waiters.pop((r.name, chunk), ()):
                waiting.busy = False
                self.serve(waiting)
            self.advertise(r.name, chunk)
            stop = False
            if s.done:
                self.done[r.name] = now
        st.deadline = now + s.stall_limit(name)
        if stop:
            self.end(st, None)
        else:
            self.take(st)

    def end(self, st: SimStream, kind: FailureKind | None, detail: str = "") -> None:
        """The stream is over (``Fetch._stream``'s ``finally``)."""
        if st.over:
            return
        st.over = True
        r = st.conn.reader
        r.streams.remove(st)
        taken = list(st.s.taken)
        stop = r.session.stream_ended(self.now, st.s, kind, detail)
        self._returned(r, taken)
        st.conn.stream = None
        if stop or kind is not None:
            self.close(st.conn)
            r.conns[st.worker].pop(st.conn.source, None)
        r.busy[st.worker] = False
        self.notify(r)
        self.at(self.now, lambda t: self.worker(r, st.worker))

    def fail(self, r: Reader, why: str) -> None:
        self.failed[r.name] = why
        self.drop_reader(r)

    def drop_reader(self, r: Reader) -> None:
        r.dead = True
        for st in list(r.streams):
            st.over = True
            self.close(st.conn)
        r.streams.clear()
        for conns in r.conns:
            for conn in conns.values():
                self.close(conn)
            conns.clear()

    # -- holders ------------------------------------------------------------------------

    def serve(self, conn: Conn) -> None:
        """The holder's side of ``conn``: send the next chunk asked for, in order."""
        if conn.busy or not conn.alive or not conn.queue:
            return
        chunk, req = conn.queue[0]
        holder, reader = conn.source, conn.reader.name
        if not self.have[holder][chunk]:
            if conn.waited_out is req:
                self._answer(conn, False)
                return
            conn.busy = True
            self.waiters.setdefault((holder, chunk), []).append(conn)

            def give_up(t: float) -> None:
                waiting = self.waiters.get((holder, chunk), [])
                if conn in waiting and conn.queue and conn.queue[0] == (chunk, req):
                    waiting.remove(conn)
                    conn.busy = False
                    conn.waited_out = req
                    self._answer(conn, False)
            self.at(self.now + self.setup.config.stall_timeout, give_up)
            return
        conn.busy = True
        size = self.m.chunk_range(chunk)[1] - self.m.chunk_range(chunk)[0]
        cap = math.inf
        if self.setup.socket_window > 0:
            cap = self.setup.socket_window / max(self.rtt(holder, reader), 1e-6)
        began = self.now
        conn.flow = self.net.start(self.now, self.links(holder, reader), size,
                                   lambda t: self._sent(conn, began), cap)

    def _sent(self, conn: Conn, began: float) -> None:
        conn.flow = None
        conn.busy = False
        self._answer(conn, True, began)

    def _answer(self, conn: Conn, ok: bool, began: float | None = None) -> None:
        """The head of ``conn``'s queue is answered (its first byte left at ``began``,
        default now): it reaches the reader half a round trip later; the holder goes on
        with the next."""
        chunk, req = conn.queue.popleft()
        st = conn.stream
        half = self.rtt(conn.source, conn.reader.name) / 2
        header = (self.now if began is None else began) + half
        if st is not None:
            self.at(self.now + half, lambda t: self.reply(st, chunk, ok, req, header))
        self.serve(conn)

    def close(self, conn: Conn) -> None:
        if not conn.alive:
            return
        conn.alive = False
        if conn.flow is not None:
            self.net.cancel(self.now, conn.flow)
            conn.flow = None
        if conn.busy and conn.queue:
            chunk = conn.queue[0][0]
            waiting = self.waiters.get((conn.source, chunk), [])
            if conn in waiting:
                waiting.remove(conn)
        conn.queue.clear()

    def _reset(self, st: SimStream, host: str, _now: float) -> None:
        self.end(st, "transport", f"{host}: connection reset")

    def kill(self, host: str, _now: float = 0.0) -> None:
        """``host``'s process ends (see the module docstring)."""
        self.dead.add(host)
        now = self.now
        r = self.readers.get(host)
        if r is not None and host not in self.done:
            self.failed[host] = "killed"
        if r is not None:
            self.drop_reader(r)
        for other in self.readers.values():
            for conns in other.conns:
                conn = conns.pop(host, None)
                if conn is not None and conn.stream is None:
                    self.close(conn)
            for st in list(other.streams):
                if st.conn.source == host:
                    conn = st.conn
                    self.close(conn)
                    half = self.rtt(host, other.name) / 2
                    self.at(now + half, partial(self._reset, st, host))

        def forgotten(t: float) -> None:
            self.advertised.pop(host, None)
            self.holdings.pop(host, None)
            self.view_version += 1
            self.poke(t)
        self.at(now + self.setup.detect_delay, forgotten)

    # -- the network --------------------------------------------------------------------

    def rtt(self, a: str, b: str) -> float:
        da, db = self.hosts[a].dc, self.hosts[b].dc
        if da == db:
            return self.setup.rtt
        found = self.setup.wan.get((da, db)) or self.setup.wan.get((db, da))
        return found[1] if found is not None else self.setup.rtt

    def links(self, src: str, dst: str) -> tuple[Link, ...]:
        a, b = self.hosts[src], self.hosts[dst]
        out = [self.net.link(f"up:{src}", a.up), self.net.link(f"down:{dst}", b.down)]
        if a.dc != b.dc:
            found = self.setup.wan.get((a.dc, b.dc)) or self.setup.wan.get((b.dc, a.dc))
            if found is not None:
                out.append(self.net.link(f"wan:{a.dc}>{b.dc}", found[0]))
        return tuple(out)


def _has(ordered: list[int], x: int) -> bool:
    i = bisect_left(ordered, x)
    return i < len(ordered) and ordered[i] == x


def simulate(setup: Setup, until: float = math.inf) -> Result:
    return Sim(setup).run(until)
