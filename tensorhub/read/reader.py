"""The read path of one peer: one owner for everything a read is made of.

Theory of operation
-------------------
A :class:`Reader` is built by its peer (:mod:`tensorhub.peer.node`) with narrow
:class:`~tensorhub.read.ports.Ports` and owns what reads are made of: the data
connections (the :class:`~tensorhub.read.dialing.Dialer` that picks a transport per
holder, and the :class:`~tensorhub.read.connections.ConnectionPool` that keeps idle
ones), the link-rate memory (:class:`~tensorhub.read.links.LinkMemory`), the fetches in
flight, and the read counters (:meth:`Reader.statistics`).

*Single flight.*  One transfer per version at a time.  :meth:`Reader.fetch` of a
version that no fetch here is moving starts a *flight*: a task in the peer's nursery
that moves the version into the caller's ``into=`` arrays, or into arrays this peer
allocates, and leaves it held (and served) here.  Any other fetch of that version
meanwhile -- another task, a :class:`~tensorhub.BlockingPeer` thread -- waits for the
flight and then reads the version as held here: the very arrays the peer serves
(``into=None``, ``FetchReport.served_arrays``) or a copy into its own host ``into=``
arrays; a copy into device memory is refused with a clear error.  Its report is the
flight's, marked ``joined``.  A waiter that is cancelled leaves the flight to the
others.  When the last waiter leaves, or the one whose ``into=`` arrays the flight
fills, the flight is cancelled and that caller returns only once the flight's cleanup is
over (the partial version withdrawn and its reads drained, its buffers its own again);
any other waiter then starts a flight of its own.  So the store holds one entry per
version, announced by one fetch and withdrawn by one cleanup, whatever the interleaving.
A version held here is not unpublished, and not published anew, while it is in flight
(:meth:`Reader.in_flight`: the peer refuses both).

*One fetch.*  A version held in its publishers' layout, or in ours by some holder, is
read whole (:meth:`Reader._whole`); else it is assembled from the publish shards
(:mod:`tensorhub.read.reshard`).  A whole read runs the phases of
:mod:`tensorhub.protocol.reading`: the manifest from a holder (with the coordinator
asked for the plan at the same time when the references say the version's size), the
plan, the delta phase (:mod:`tensorhub.read.deltas`), then the chunks
(:class:`~tensorhub.read.transfer.Transfer`, following newer plans as
:mod:`tensorhub.read.planning` asks for them).  From the moment the version is in the
store, the peer announces the chunks it has verified, so readers downstream find it;
a fetch that fails or is cancelled drops its partial copy and waits for reads of it to
drain before its error reaches anyone.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from ..config import PeerConfig
from ..device.landing import ThroughRing
from ..device.staging import DeviceRings, on_device, staged_fetch
from ..errors import LocalProtocolError, PeerClosed
from ..manifest.manifest import Manifest
from ..model import PeerInfo, VersionKey
from ..protocol.probing import ProbeSample
from ..protocol.reading import (
    ManifestSearch,
    Plan,
    PlanFollow,
    View,
    check_schema,
    named_view,
    size_hint,
    stream_cap,
    streams,
)
from ..protocol.sharding import Sharding
from ..protocol.versions import Seal
from ..torch import Into, destination
from ..transport import copy_threads
from ..transport.probe import probe
from .cast import CastSpec, cast_fetched
from .connections import ConnectionPool
from .deltas import Deltas, add_to_report
from .destination import allocate_flat, prepare_destination
from .dialing import Dialer
from .links import LinkMemory
from .manifests import read_manifest
from .planning import PlanAnswer, ask_plan, run_following
from .ports import Ports
from .report import Fetched, FetchReport
from .reshard import reshard, same_layout_holder
from .store import LocalVersion, Store
from .transfer import Transfer, first_error

REPORTS_KEPT = 64
"""Reports of finished fetches ``statistics().reports`` keeps (the newest)."""


@functools.cache
def socket_window() -> int:
    """Bytes one TCP connection can keep in flight here: the largest receive buffer
    autotuning grows to (``net.ipv4.tcp_rmem``), less the kernel's overhead share
    (``tcp_adv_win_scale``); 0 when the kernel does not say (one stream per source)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_rmem") as f:
            largest = int(f.read().split()[2])
        with open("/proc/sys/net/ipv4/tcp_adv_win_scale") as f:
            scale = int(f.read())
    except (OSError, ValueError, IndexError):
        return 0
    return largest - (largest >> scale) if scale > 0 else largest >> min(-scale, 30)


@dataclass(eq=False)
class _Flight:
    """One version moving into this peer (see the module docstring)."""

    key: VersionKey
    into: Mapping[str, Any] | None
    """The arrays it fills (the caller's that started it), or None: the peer's own."""
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    """Set once it has ended, its cleanup included."""
    result: Fetched | None = None
    error: BaseException | None = None
    waiters: int = 0
    abandoned: bool = False
    """Cancelled because its callers left (or the one whose arrays it fills)."""


@dataclass(frozen=True)
class FetchProgress:
    """A transfer running here, as progress displays and ``tensorhub status`` see it."""

    key: VersionKey
    total_bytes: int
    bytes: int
    """Bytes received (verified or not) so far."""
    bytes_by_source: dict[str, int]
    transport_by_source: dict[str, str]
    streaming_from: tuple[str, ...]
    """The source of each stream open now (a source twice: two streams)."""


@dataclass(frozen=True)
class ReadStats:
    """What this peer's reads did (a snapshot; see ``PeerStats`` for each field)."""

    bytes_fetched: int
    bytes_fetched_by_source: dict[str, int]
    bytes_by_transport: dict[str, int]
    fetches: int
    fetches_joined: int
    integrity_failures: dict[str, int]
    reports: tuple[dict[str, Any], ...]
    casts: int
    cast_seconds: float
    delta: dict[str, float]
    in_flight: int


@dataclass
class _Counts:
    bytes: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    by_transport: dict[str, int] = field(default_factory=dict)
    fetches: int = 0
    joined: int = 0
    integrity: dict[str, int] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)
    casts: int = 0
    cast_seconds: float = 0.0


class Reader:
    """The read path of one peer (see the module docstring)."""

    def __init__(self, me: PeerInfo, config: PeerConfig, store: Store, rings: DeviceRings,
                 dialer: Dialer, ports: Ports) -> None:
        """``dialer``: made first by the peer, which serves through its one-sided host;
        the reader owns it from then on (closes it)."""
        self.me, self.config, self.store, self.rings, self.ports = \
            me, config, store, rings, ports
        self.dialer = dialer
        """Which transport reads each holder, and why not the others (:mod:`.dialing`)."""
        keyring = None if config.security is None else config.security.keyring
        self.pool = ConnectionPool(self._connect,
                                   lambda: 0 if keyring is None else keyring.generation,
                                   max_idle=min(10.0, config.data_idle_timeout))
        """Data connections kept between reads (see :mod:`.connections`)."""
        self.links = LinkMemory()
        self.deltas = Deltas(me, config, store, self.links, ports)
        self._flights: dict[VersionKey, _Flight] = {}
        self._transfers: set[Transfer] = set()
        """Transfers running (gossip wakes them; progress displays read them)."""
        self._counts = _Counts()

    # -- the API ------------------------------------------------------------------------

    async def fetch(self, key: VersionKey, sealed: Callable[[], Awaitable[Seal]],
                    spec: Sharding, into: Into | None, allowed: frozenset[str] | None,
                    cast: CastSpec | None = None) -> Fetched:
        """``key`` in the caller's ``into=`` arrays (or an ``nn.Module``'s state) or in
        arrays this peer serves; held here afterwards.  ``sealed()``: the version's seal
        (awaited only when bytes must move); ``allowed``: the holders to read from (None:
        any); ``cast``: see :mod:`.cast`.  One transfer per version at a time (see the
        module docstring)."""
        if cast is not None:
            fetched = await self.fetch(key, sealed, spec, None, allowed)
            out = await cast_fetched(fetched, cast, into)
            if out.report.cast:
                self._counts.casts += 1
                self._counts.cast_seconds += out.report.cast_seconds
            return out
        dest = None if into is None else destination(into)
        joined: FetchReport | None = None
        while True:
            held = self.store.get(key)
            flight = self._flights.get(key)
            if flight is None and held is not None:
                if held.complete and not held.hidden:
                    return await self._from_held(held, dest, joined)
                if not held.hidden:
                    raise LocalProtocolError(f"{key} is held here incomplete, and no "
                                             "fetch of it runs")  # a bug of ours
                await self.store.wait_drained(key)  # unpublished here: gone once drained
                continue
            if flight is not None and dest is not None and _device(dest):
                raise LocalProtocolError(
                    f"{key} is being fetched here already, into other buffers; a copy "
                    "into device tensors is not made: fetch it again once that fetch "
                    "returned, into host arrays, or without into=")
            mine = flight is None
            if flight is None:
                flight = self._take_off(key, sealed, spec, dest, allowed)
            await self._wait(flight, mine)
            if flight.error is None:
                assert flight.result is not None
                if mine:
                    return flight.result
                joined = flight.result.report
            elif mine or not flight.abandoned:
                raise flight.error
            # a joiner: read it as held now, or fly again if its flight was abandoned

    def in_flight(self, key: VersionKey) -> bool:
        """Whether a fetch of ``key`` is running here."""
        return key in self._flights

    def view_changed(self) -> None:
        """Gossip changed the reference table: wake the transfers waiting for a source."""
        for transfer in self._transfers:
            transfer.poke()

    async def read_manifest(self, key: VersionKey, allowed: frozenset[str] | None
                            ) -> tuple[Manifest, str]:
        """The manifest of ``key`` and its publisher, from a holder (``allowed``: among
        those named); :class:`~tensorhub.errors.VersionUnavailable` if none serves it
        within ``stall_timeout``."""
        search = ManifestSearch(trio.current_time(), key, self.me.name, allowed,
                                self.config.stall_timeout)
        return await read_manifest(search, self.ports, self.pool,
                                   self.config.manifest_limits)

    async def pull(self, part: LocalVersion, allowed: frozenset[str] | None,
                   only: Sequence[int]) -> FetchReport:
        """Fetch chunks ``only`` of ``part``'s version into ``part`` (a publish shard a
        resharding fetch needs a few chunks of); its report."""
        m = part.manifest
        transfer = self._transfer(part, allowed, only=only, streams=streams(
            self.config, m.chunk_size), cap=stream_cap(self.config, m.chunk_size))
        with self._running(transfer):
            return await transfer.run()

    async def probe(self, holder: PeerInfo, nbytes: int) -> ProbeSample:
        """Time a read of ``nbytes`` zeros a stream from ``holder`` over TCP: a link
        probe (:mod:`tensorhub.transport.probe`), within ``connect_timeout +
        stall_timeout``."""
        return await probe(holder.data, holder.name, nbytes,
                           self.config.connect_timeout + self.config.stall_timeout,
                           self.ports.data_auth())

    def progress(self) -> list[FetchProgress]:
        """The transfers running here now."""
        return [FetchProgress(t.key, t.manifest.total_bytes, r.bytes, dict(r.bytes_by_source),
                              dict(r.transport_by_source), t.streaming_from())
                for t in list(self._transfers) for r in (t.report,)]

    def statistics(self) -> ReadStats:
        c = self._counts
        return ReadStats(
            bytes_fetched=c.bytes, bytes_fetched_by_source=dict(c.by_source),
            bytes_by_transport=dict(c.by_transport), fetches=c.fetches,
            fetches_joined=c.joined, integrity_failures=dict(c.integrity),
            reports=tuple(c.reports), casts=c.casts, cast_seconds=c.cast_seconds,
            delta=dict(self.deltas.totals), in_flight=len(self._flights))

    def identity_changed(self) -> None:
        """This peer now proves another key: reads from now on open new connections."""
        self.pool.flush()

    def close(self) -> None:
        """End every flight (the peer is closing) and close every connection."""
        for flight in self._flights.values():
            flight.abandoned = True
            flight.scope.cancel()
        self.pool.close()
        self.dialer.close()

    # -- single flight ------------------------------------------------------------------

    def _take_off(self, key: VersionKey, sealed: Callable[[], Awaitable[Seal]],
                  spec: Sharding, into: Mapping[str, Any] | None,
                  allowed: frozenset[str] | None) -> _Flight:
        flight = self._flights[key] = _Flight(key, into)

        async def fly() -> None:
            try:
                with flight.scope:
                    seal = await sealed()
                    flight.result = await self._move(key, seal, spec, into, allowed)
                if flight.scope.cancelled_caught:
                    flight.abandoned = True
                    flight.error = PeerClosed(f"the fetch of {key} was abandoned")
            except Exception as exc:  # the callers' error, not the nursery's
                flight.error = exc
            except BaseException:  # the peer's nursery is ending: so does this
                flight.error = PeerClosed(f"peer {self.me.name} was closed")
                flight.abandoned = True
                raise
            finally:
                if self._flights.get(key) is flight:
                    del self._flights[key]
                flight.done.set()

        try:
            self.ports.spawn(fly)
        except BaseException:
            del self._flights[key]
            raise
        return flight

    async def _wait(self, flight: _Flight, mine: bool) -> None:
        """Wait for ``flight`` to end.  Cancelled: when nobody else waits, or when the
        flight fills this caller's arrays, end it and return once it has cleaned up."""
        flight.waiters += 1
        try:
            await flight.done.wait()
        except BaseException:
            if not flight.done.is_set() and (
                    flight.waiters == 1 or (mine and flight.into is not None)):
                flight.abandoned = True
                flight.scope.cancel()
                with trio.CancelScope(shield=True):
                    await flight.done.wait()
            raise
        finally:
            flight.waiters -= 1

    async def _from_held(self, held: LocalVersion, into: Mapping[str, Any] | None,
                         joined: FetchReport | None) -> Fetched:
        """The version ``held`` complete here: the arrays it is served from, or a copy
        into ``into``; the report a flight we joined made, or one saying which."""
        m = held.manifest
        key = m.key
        if joined is not None:
            self._counts.joined += 1
            report = joined.copy()
            report.joined = True
        else:
            report = FetchReport(key.model, key.version, verified=True)
        if into is None:
            report.served_arrays = True
            return Fetched(key.version, dict(zip(m.table.names, held.arrays, strict=True)),
                           report)
        if _device(into) or held.source is not None:
            raise LocalProtocolError(
                f"{key} is held here already, in other buffers; a copy is made only "
                "between host arrays: fetch without into= (the arrays this peer serves), "
                "or unpublish it first")
        arrays = prepare_destination(m, into)
        report.served_arrays = False
        with self.store.hold(key) as pinned:  # unpublish waits for the copy
            assert pinned is held  # complete, in host memory, and no await since the look
            began = trio.current_time()
            await trio.to_thread.run_sync(_copy_all, pinned.arrays, arrays)
            report.copy_seconds = trio.current_time() - began
        return Fetched(key.version, dict(zip(m.table.names, arrays, strict=True)), report)

    # -- one fetch ----------------------------------------------------------------------

    async def _move(self, key: VersionKey, seal: Seal, spec: Sharding,
                    into: Mapping[str, Any] | None, allowed: frozenset[str] | None
                    ) -> Fetched:
        """Fetch ``key``: whole from holders of its layout, or resharded from the
        publish shards when none holds it in ``spec``'s layout."""
        if key.layout != seal.layout_id and not await same_layout_holder(
                self.ports, self.me, self.config.stall_timeout, key, seal, allowed):
            local, report = await reshard(self, self.store, self.config,
                                          len(self.ports.live()), key, seal, spec, into,
                                          allowed)
            self.store.add(local)
            self.ports.announce(local.holding())
            self._account(report)
            return Fetched(key.version, dict(zip(local.manifest.table.names, local.arrays,
                                                 strict=True)), report)
        return await self._whole(key, into, allowed, key.layout != seal.layout_id,
                                 seal.schema)

    async def _whole(self, key: VersionKey, into: Mapping[str, Any] | None,
                     allowed: frozenset[str] | None, derived: bool, schema: bytes | None
                     ) -> Fetched:
        """Fetch one manifest's chunks (a whole version, or a shard) as they are held;
        ``schema`` is the sealed schema id its tensor specs must have.

        When the holders' references say the version's size, the coordinator is asked
        for the plan while the manifest is read (one round trip instead of two before
        the first chunk); a plan asked with numbers the manifest then contradicts is
        asked again."""
        planning = allowed is None and self.config.planning and key.whole
        hint = size_hint(self.ports.holders(key)) if planning else None
        early: list[tuple[PlanAnswer, float]] = []

        async def plan_early(size: int, chunks: int) -> None:
            asked = trio.current_time()
            answer = await ask_plan(self.ports, self.me.name, key, size, chunks)
            early.append((answer, trio.current_time() - asked))

        with self.store.expecting(key):
            try:
                async with trio.open_nursery() as nursery:
                    if hint is not None:
                        nursery.start_soon(plan_early, *hint)
                    manifest, publisher = await self.read_manifest(key, allowed)
            except BaseExceptionGroup as group:
                raise first_error(group) from None
            check_schema(manifest, schema)
            return await self._chunks(key, manifest, publisher, into, allowed, derived,
                                       early[0] if early and hint == (
                                           manifest.total_bytes, manifest.num_chunks)
                                       else None)

    async def _chunks(self, key: VersionKey, manifest: Manifest, publisher: str,
                      into: Mapping[str, Any] | None, allowed: frozenset[str] | None,
                      derived: bool, early: tuple[PlanAnswer, float] | None) -> Fetched:
        flat, staged = None, None
        if into is None:
            arrays, flat = allocate_flat(manifest)
        elif (staged := staged_fetch(self.rings, manifest, into)) is not None:
            arrays = staged.arrays
        else:
            arrays = prepare_destination(manifest, into)
        local = LocalVersion(manifest, arrays, publisher, verified=False, flat=flat,
                             derived=derived)
        if staged is not None:
            local.landing, local.source = staged.landing, staged.source
        local.announced = self.ports.announcement(key, manifest.manifest_id())
        self.store.add(local)
        last = [trio.current_time()]

        def progress() -> None:
            now = trio.current_time()
            if now - last[0] >= self.config.gossip_interval and not local.complete:
                last[0] = now
                self.ports.announce(local.holding())

        try:  # from here on, a failure or a cancellation (planning too) drops it
            self.ports.announce(local.holding())  # downstream can find us
            if staged is not None:
                await staged.landing.ring.ready()
            (plan, plan_note, stamp, route), plan_seconds = await self._plan(
                key, manifest, allowed, early)
            delta, delta_seconds = await self.deltas.run(local, plan, allowed, progress)
            n, cap = streams(self.config, manifest.chunk_size), \
                stream_cap(self.config, manifest.chunk_size)
            if staged is not None:  # no more in flight than the ring has slots
                n = staged.landing.streams(n)
                cap = staged.landing.window_cap(n)
            transfer = self._transfer(local, allowed, plan=plan, streams=n, cap=cap,
                                      on_progress=progress)
            transfer.report.plan, transfer.report.plan_seconds = plan_note, plan_seconds
            transfer.report.route = route
            with self._running(transfer):
                if stamp is None:
                    report = await transfer.run()
                else:
                    report = await run_following(
                        transfer, PlanFollow(trio.current_time(), stamp, plan_note),
                        functools.partial(ask_plan, self.ports, self.me.name, key,
                                          manifest.total_bytes, manifest.num_chunks),
                        functools.partial(self._measured, transfer, interim=True))
            add_to_report(report, delta, delta_seconds)
            self.links.remember(transfer.session.windows.items())
        except BaseException:
            local.end_receiving()
            self.ports.withdraw(key)
            with trio.CancelScope(shield=True):
                await self.store.wait_drained(key)
            raise
        finally:
            if staged is not None:
                local.landing = None
                with trio.CancelScope(shield=True):
                    await staged.landing.settled()  # the tensors are the caller's again
                staged.close()
        local.end_receiving()
        self.ports.announce(local.holding())
        self._account(report)
        return Fetched(key.version, dict(zip(manifest.table.names, arrays, strict=True)),
                       report)

    async def _plan(self, key: VersionKey, manifest: Manifest,
                    allowed: frozenset[str] | None, early: tuple[PlanAnswer, float] | None
                    ) -> tuple[PlanAnswer, float | None]:
        """The plan to follow (a note on it, its stamp, its route), and how long asking
        took."""
        if early is not None:
            answer, seconds = early
            return answer._replace(
                note=answer.note + " (asked while the manifest was read)"), seconds
        if not key.whole:
            return PlanAnswer([], "no plan: shards are fetched from their holders directly",
                              None), None
        if allowed is not None:
            return PlanAnswer([], "no plan: the caller named the sources", None), None
        if not self.config.planning:
            return PlanAnswer([], "planning off", None), None
        asked = trio.current_time()
        answer = await ask_plan(self.ports, self.me.name, key, manifest.total_bytes,
                                manifest.num_chunks)
        return answer, trio.current_time() - asked

    def _transfer(self, local: LocalVersion, allowed: frozenset[str] | None, *,
                  streams: int, cap: int, plan: Plan | None = None,
                  only: Sequence[int] | None = None,
                  on_progress: Callable[[], None] = lambda: None) -> Transfer:
        ports, me = self.ports, self.me.name

        def view(key: VersionKey) -> View:
            every = ports.holders(key)
            return every if allowed is None else named_view(every, ports.live(), allowed, me)

        return Transfer(me=me, local=local, view=view,
                        upstream=allowed or frozenset(), plan=plan or (),
                        connect=self.pool.connect, release=self.pool.release,
                        window=streams, window_cap=cap, socket_window=socket_window(),
                        host=self.me.label("host"), dc=self.me.label("dc"),
                        rates=self.links.rates,
                        cores=copy_threads.pool.cores,
                        stall_timeout=self.config.stall_timeout, on_progress=on_progress,
                        banned=ports.banned, on_bad_bytes=ports.ban, only=only)

    async def _connect(self, holder: PeerInfo) -> Any:
        """A data connection to ``holder`` over the first of ``config.transports`` that
        works for it; the others' reasons are kept for statistics (:mod:`.dialing`)."""
        return await self.dialer.connect(self.me, holder, self.config.connect_timeout,
                                         self.ports.data_auth())

    # -- counters -----------------------------------------------------------------------

    @contextmanager
    def _running(self, transfer: Transfer) -> Iterator[None]:
        """``transfer`` runs meanwhile: gossip wakes it, progress displays see it.  A
        failure counts the bad bytes it met; a success tells the WAN model what it
        measured of the links into our DC (:meth:`_measured`)."""
        self._transfers.add(transfer)
        try:
            yield
        except BaseException:
            self._count_integrity(transfer.report)
            raise
        finally:
            self._transfers.discard(transfer)
        self._measured(transfer)

    def _measured(self, transfer: Transfer, interim: bool = False) -> None:
        """For each other DC the transfer read from: its bytes over the time reads from
        that DC were in flight (:mod:`~tensorhub.protocol.linktime`), a sample of the
        link into ours; ``interim``: what came since the last such sample, the transfer
        still running."""
        here = self.me.label("dc")
        if not here:
            return
        times = transfer.session.link_time
        for dc, nbytes, seconds in (times.interim(trio.current_time()) if interim
                                    else times.samples()):
            if dc and dc != here:
                self.ports.measured(dc, here, nbytes, seconds, interim=interim)

    def _count_integrity(self, report: FetchReport) -> None:
        for src, n in report.integrity_failures.items():
            self._counts.integrity[src] = self._counts.integrity.get(src, 0) + n

    def _account(self, report: FetchReport) -> None:
        """Count a finished fetch."""
        c = self._counts
        c.fetches += 1
        c.bytes += report.bytes
        for src, n in report.bytes_by_source.items():
            c.by_source[src] = c.by_source.get(src, 0) + n
            tr = report.transport_by_source.get(src, "?")
            c.by_transport[tr] = c.by_transport.get(tr, 0) + n
            why = self.dialer.refusals_of(src)
            if why:
                report.transport_refusals[src] = why
        self._count_integrity(report)
        c.reports = [*c.reports[-(REPORTS_KEPT - 1):], report.to_dict()]


def _device(into: Mapping[str, Any]) -> bool:
    """Whether ``into`` lands through a staging ring or holds device tensors."""
    return isinstance(into, ThroughRing) or on_device(into.values())


def _copy_all(src: Sequence[np.ndarray[Any, Any]], dest: Sequence[np.ndarray[Any, Any]]
              ) -> None:
    for s, d in zip(src, dest, strict=True):
        np.copyto(d, s, casting="no")
