"""The fetch path of a peer: find a holder's manifest, ask for a plan, run the fetch.

:meth:`Peer.fetch <tensorhub.peer.node.Peer.fetch>` resolves the version and its seal
and calls :func:`fetch_key` for a key held as it is asked (a whole version, or a shard
in its publisher's layout); resharding (:mod:`.reshard`) reuses :func:`fetch_manifest`,
:func:`holder_view` and :func:`window` for each source shard.  While a fetch runs, the
peer announces the chunks it has verified (so downstream readers find it); a fetch that
fails or is cancelled, planning included, drops its partial copy and waits for reads of
it to drain before the caller sees the error.

A planned fetch asks its coordinator again while it runs (:func:`follow_plan`): the
coordinator plans each fetcher as it registers, and may make the plan afresh once more
have registered (``Planner.reconsider``); a newer plan names new sources for the chunks
not yet claimed.  The first ask comes ``REASK_FIRST`` after the plan came (every fetcher
that started with this one has registered by then), then with a doubling backoff up to
``REASK_MAX`` (both in :mod:`~tensorhub.protocol.transfer`): a handful of asks per
fetch, so a fan-out to a thousand fetchers costs its coordinator a few thousand cheap
answers, not one per chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from ..device.staging import staged_fetch
from ..errors import ConsistencyError, RemoteProtocolError, TransportError, VersionUnavailable
from ..manifest.manifest import Manifest
from ..model import PeerInfo, VersionKey
from ..protocol.refs import Holding
from ..protocol.ring import Epoch
from ..protocol.sizing import MIN_CHUNKS
from ..protocol.transfer import REASK_FIRST, REASK_MAX
from ..transport import copy_threads
from ..transport.base import NotServing
from .delta_fetch import add_to_report, fetch_deltas, known_rates, remember_links
from .destination import allocate_flat, prepare_destination
from .fetcher import Fetch, Fetched, FetchReport, HolderView, first_error
from .store import LocalVersion

if TYPE_CHECKING:
    from .node import Peer

PlanStamp = tuple[Epoch, int]
"""Which plan: the coordinator's epoch, then the plan's own (newer compares greater)."""
EarlyPlan = tuple[list[tuple[PeerInfo, int, int]], str, float, PlanStamp | None]
"""A plan asked for while the manifest was read: sources, note, seconds it took, stamp."""

NOTED_REPLANS = 3
"""Newer plans the fetch report's ``plan`` note lists one by one (the rest: a count)."""

INLINE_DECODE_BYTES = 64 << 10
"""Manifests up to this size are decoded on the event loop: about 2,000 tensors, well
under a millisecond, less than handing the work to a thread and back."""
INLINE_KNOWN_BYTES = 1 << 20
"""Manifests up to this size whose tensor columns were decoded lately (the next
version of a model) are decoded on the event loop too, the columns known by their bytes
(:mod:`tensorhub.manifest.columns`): 33,000 tensors (1,020 KiB) take 0.88 ms here,
against 1.13 ms through a thread; 16,000 take 0.41 ms.  One of new columns goes to a
thread, after about 0.25 ms spent finding that out (10,000 tensors)."""


def holder_view(peer: Peer, allowed: frozenset[str] | None) -> HolderView:
    """Who holds a key in the peer's current view, limited to ``allowed`` names; a named
    source not advertising it yet is listed holding nothing (it is asked all the same)."""
    def view(k: VersionKey) -> list[tuple[PeerInfo, Holding]]:
        every = peer.control.holders(k)
        if allowed is None:
            return every
        found = [(p, h) for p, h in every if p.name in allowed]
        ref, waiting = not_advertising(peer, allowed, every, {p.name for p, _ in found})
        if ref is not None and waiting:
            nothing = replace(ref, bitmap=bytes((ref.num_chunks + 7) // 8))
            found += [(info, nothing) for info in waiting]
        return found
    return view


def not_advertising(peer: Peer, allowed: frozenset[str],
                    every: list[tuple[PeerInfo, Holding]], known: Collection[str]
                    ) -> tuple[Holding | None, list[PeerInfo]]:
    """The publisher's own reference of a key (what the version is), and the live named
    sources that are neither this peer nor in ``known`` (not advertising it yet)."""
    ref = next((h for p, h in every if p.name == h.publisher), None)
    return ref, [info for info in peer.control.membership.live_members()
                 if info.name in allowed and info.name not in known
                 and info.name != peer.info.name]


def window(peer: Peer, manifest: Manifest) -> int:
    """Streams (workers) of one fetch: ``fetch_window``, within ``max_inflight_bytes``
    at the floor of a window each (``sizing.MIN_CHUNKS`` chunks)."""
    return max(1, min(peer.config.fetch_window,
                      peer.config.max_inflight_bytes // (MIN_CHUNKS * manifest.chunk_size)))


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


def window_cap(peer: Peer, manifest: Manifest) -> int:
    """Bytes one stream of a fetch may keep requested ahead: its share of
    ``max_inflight_bytes``."""
    return peer.config.max_inflight_bytes // window(peer, manifest)


EARLY_RETRY = 0.02
"""Seconds between asks of a named source for a manifest it does not hold yet."""


async def fetch_key(peer: Peer, key: VersionKey, into: Mapping[str, Any] | None,
                    allowed: frozenset[str] | None, derived: bool, schema: bytes | None
                    ) -> Fetched:
    """Fetch one manifest's chunks (a whole version, or a shard) as they are held;
    ``schema`` is the sealed schema id its tensor specs must have.

    When the holders' references say the version's size, the coordinator is asked for
    the plan while the manifest is read (one round trip instead of two before the first
    chunk); a plan asked with numbers the manifest then contradicts is asked again."""
    planning = allowed is None and peer.config.planning and key.whole
    hint = size_hint(peer, key) if planning else None
    early: list[EarlyPlan] = []
    with peer.store.expecting(key):
        try:
            async with trio.open_nursery() as nursery:
                if hint is not None:
                    nursery.start_soon(_plan_into, early, peer, key, *hint)
                manifest, publisher = await fetch_manifest(peer, key, allowed)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        check_schema(manifest, schema)
        return await _fetch_chunks(peer, key, manifest, publisher, into, allowed, derived,
                                   early[0] if early and hint == (
                                       manifest.total_bytes, manifest.num_chunks) else None)


def size_hint(peer: Peer, key: VersionKey) -> tuple[int, int] | None:
    """(bytes, chunks) of ``key`` as its publisher's reference says (or, without one,
    as every holder that says a size agrees); None when unknown or disputed."""
    said = {(h.size, h.num_chunks) for p, h in peer.control.holders(key)
            if h.size > 0 and h.num_chunks > 0 and p.name == h.publisher}
    if not said:
        said = {(h.size, h.num_chunks) for _, h in peer.control.holders(key)
                if h.size > 0 and h.num_chunks > 0}
    return said.pop() if len(said) == 1 else None


async def _plan_into(out: list[EarlyPlan], peer: Peer, key: VersionKey, size: int,
                     chunks: int) -> None:
    asked = trio.current_time()
    plan, note, stamp = await ask_plan(peer, key, size, chunks)
    out.append((plan, note, trio.current_time() - asked, stamp))


async def _fetch_chunks(peer: Peer, key: VersionKey, manifest: Manifest, publisher: str,
                        into: Mapping[str, Any] | None, allowed: frozenset[str] | None,
                        derived: bool,
                        early: EarlyPlan | None) -> Fetched:
    flat, staged = None, None
    if into is None:
        arrays, flat = allocate_flat(manifest)
    elif (staged := staged_fetch(peer.device_rings, manifest, into)) is not None:
        arrays = staged.arrays
    else:
        arrays = prepare_destination(manifest, into)
    local = LocalVersion(manifest, arrays, publisher, verified=False, flat=flat,
                         derived=derived)
    if staged is not None:
        local.landing, local.source = staged.landing, staged.source
    local.announced = peer.control.announcement(key, manifest.manifest_id())
    peer.store.add(local)
    plane = peer.data_plane()
    last = [trio.current_time()]

    def progress() -> None:
        now = trio.current_time()
        if now - last[0] >= peer.config.gossip_interval and not local.complete:
            last[0] = now
            plane.announce(local)

    try:  # from here on, a failure or a cancellation (planning too) drops it
        plane.announce(local)  # downstream can find us
        if staged is not None:
            await staged.landing.ring.ready()
        plan: list[tuple[PeerInfo, int, int]] = []
        plan_note, plan_seconds, stamp = "planning off", None, None
        if early is not None:
            plan, plan_note, plan_seconds, stamp = early
            plan_note += " (asked while the manifest was read)"
        elif allowed is None and peer.config.planning and key.whole:
            asked = trio.current_time()
            plan, plan_note, stamp = await ask_plan(peer, key, manifest.total_bytes,
                                                    manifest.num_chunks)
            plan_seconds = trio.current_time() - asked
        elif not key.whole:
            plan_note = "no plan: shards are fetched from their holders directly"
        delta, delta_seconds = await fetch_deltas(peer, local, plan, allowed, progress)
        streams, cap = window(peer, manifest), window_cap(peer, manifest)
        if staged is not None:  # no more in flight than the ring has slots
            streams = staged.landing.streams(streams)
            cap = staged.landing.window_cap(streams)
        job = Fetch(me=peer.info.name, local=local, view=holder_view(peer, allowed),
                    upstream=allowed or frozenset(), plan=plan,
                    connect=plane.connect, release=plane.release,
                    window=streams, window_cap=cap,
                    socket_window=socket_window(), host=peer.info.label("host"),
                    rates=known_rates(peer), cores=copy_threads.pool.cores,
                    stall_timeout=peer.config.stall_timeout, on_progress=progress,
                    banned=peer.banned, on_bad_bytes=peer.ban)
        job.report.plan, job.report.plan_seconds = plan_note, plan_seconds
        with plane.running(job):
            report = await _run(peer, job, stamp)
        add_to_report(report, delta, delta_seconds)
        remember_links(peer, job)
    except BaseException:
        local.end_receiving()
        peer.withdraw(key)
        with trio.CancelScope(shield=True):
            await peer.store.wait_drained(key)
        raise
    finally:
        if staged is not None:
            local.landing = None
            with trio.CancelScope(shield=True):
                await staged.landing.settled()  # the tensors are the caller's again
            staged.close()
    local.end_receiving()
    plane.announce(local)
    plane.account(report)
    return Fetched(key.version, dict(zip(manifest.table.names, arrays, strict=True)),
                   report)


async def fetch_manifest(peer: Peer, key: VersionKey, allowed: frozenset[str] | None
                          ) -> tuple[Manifest, str]:
    def candidates() -> list[tuple[PeerInfo, Holding]]:
        found = []
        every = peer.control.holders(key)
        for p, h in every:
            if p.name == peer.info.name or (allowed is not None and p.name not in allowed):
                continue
            ban = peer.banned(p.name)
            if ban is None:
                found.append((p, h))
            else:
                banned[p.name] = f"banned here ({ban.reason})"
        if allowed is not None:  # named sources are asked before they advertise it
            ref, waiting = not_advertising(peer, allowed, every,
                                           {p.name for p, _ in found} | banned.keys())
            for info in waiting:
                if ref is not None and peer.banned(info.name) is None:
                    found.append((info, ref))
                    early.add(info.name)
        return found

    # The view may lag: a holder that just unpublished, a named source that has not
    # started.  Retry each holder when its reference changes, until stall_timeout.
    deadline = trio.current_time() + peer.config.stall_timeout
    tried: dict[str, Holding] = {}
    errors: dict[str, str] = {}
    banned: dict[str, str] = {}
    early: set[str] = set()
    """Named sources asked before their reference says they hold the version (one still
    starting its own fetch answers "not held"; asked again every EARLY_RETRY)."""
    plane = peer.data_plane()
    while True:
        early.clear()
        holders = candidates()
        if not holders and allowed is None and not errors:
            raise VersionUnavailable(key.model, key.version, "no live holder is known"
                                     if not banned else "no holder that is not banned: "
                                     + "; ".join(f"{k}: {v}" for k, v in banned.items()))
        fresh = [(p, h) for p, h in holders if tried.get(p.name) is not h]
        fresh.sort(key=lambda ph: (ph[1].publisher == ph[0].name, ph[0].name))
        for source, holding in fresh:
            tried[source.name] = holding
            try:
                conn = await plane.connect(source)
                try:
                    data = await conn.read_manifest(key)
                finally:  # kept for the chunks, when it is in step
                    await plane.release(conn)
                manifest = await decode_manifest(peer, data, holding.manifest_id)
                if manifest.key != key:
                    raise RemoteProtocolError(f"{source.name} sent a non-matching manifest")
                return manifest, holding.publisher
            except (TransportError, RemoteProtocolError, NotServing, OSError) as exc:
                errors[source.name] = str(exc)
        if trio.current_time() >= deadline:
            which = f" among {sorted(allowed)}" if allowed is not None else ""
            detail = "; ".join(f"{k}: {v}" for k, v in sorted({**banned, **errors}.items()))
            raise VersionUnavailable(key.model, key.version, f"no holder{which} served "
                                     f"the manifest ({detail or 'none known'})")
        wake = deadline
        if early:  # poll them: their reference may reach us only at the next gossip round
            wake = min(deadline, trio.current_time() + EARLY_RETRY)
            for name in early:
                tried.pop(name, None)
        with trio.move_on_at(wake):
            await peer.wait_changed()


def check_schema(manifest: Manifest, schema: bytes | None) -> None:
    """A manifest whose tensor specs are not the ones the version was sealed with
    (its announcement claimed specs it does not have) makes the fetch fail whole."""
    if manifest.schema_id() != schema:
        raise ConsistencyError(
            f"{manifest.key}: its manifest lists other tensor specs (schema "
            f"{manifest.schema_id().hex()[:8]}) than the version was sealed with "
            f"({(schema or b'').hex()[:8] or 'none'}); nothing of it is used")


async def decode_manifest(peer: Peer, data: bytes, manifest_id: bytes) -> Manifest:
    """Check and parse a manifest; one over :data:`INLINE_DECODE_BYTES` in a worker
    thread (at the caps, decoding takes a second: the event loop must not wait)."""
    limits = peer.config.manifest_limits
    if len(data) <= INLINE_DECODE_BYTES:
        return Manifest.decode(data, manifest_id, limits)
    if len(data) <= INLINE_KNOWN_BYTES:
        known = Manifest.decode_known(data, manifest_id, limits)
        if known is not None:
            return known
    return await trio.to_thread.run_sync(Manifest.decode, data, manifest_id, limits)


async def ask_plan(peer: Peer, key: VersionKey, size: int, chunks: int
                   ) -> tuple[list[tuple[PeerInfo, int, int]], str, PlanStamp | None]:
    """Our part of the coordinator's plan for a version of ``size`` bytes in ``chunks``
    chunks, as (source, first chunk, stop), a note and the plan's stamp; on any failure
    no plan (the fetch then picks holders itself), the reason and None."""
    try:
        answer = await peer.ask_coordinator(key.model, key.version, size=size,
                                            chunks=chunks)
    except TransportError as exc:
        return [], f"no plan: {exc}", None
    members = peer.control.membership.members()
    plan = [(members[s.peer].info, s.first, s.stop) for s in answer.sources
            if s.peer in members and s.peer != peer.info.name]
    if not plan:
        return [], f"no plan from {answer.coordinator}: {answer.detail or 'empty'}", None
    return (plan, f"{answer.coordinator} epoch {answer.epoch.term} plan {answer.plan_epoch}",
            (answer.epoch, answer.plan_epoch))


async def _run(peer: Peer, job: Fetch, stamp: PlanStamp | None) -> FetchReport:
    """Run ``job``; with a plan from a coordinator (``stamp``), follow newer plans
    while it runs (:func:`follow_plan`)."""
    if stamp is None:
        return await job.run()
    done: list[FetchReport] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow_plan, peer, job, stamp)
            done.append(await job.run())
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return done[0]


async def follow_plan(peer: Peer, job: Fetch, stamp: PlanStamp) -> None:
    """Ask the coordinator again, ``REASK_FIRST`` from now and then with a doubling
    backoff up to ``REASK_MAX``, until cancelled (the fetch ended); take a plan
    whose stamp is newer than ``stamp`` (:meth:`Fetch.replan`) and, when it changed
    anything of ours, say so in the report's ``plan`` note."""
    started, delay, taken = trio.current_time(), REASK_FIRST, 0
    base = job.report.plan
    m = job.manifest
    while True:
        await trio.sleep(delay)  # a schedule, not a wait for an event
        delay = min(REASK_MAX, 2 * delay)
        plan, _, new = await ask_plan(peer, m.key, m.total_bytes, m.num_chunks)
        if new is None or new <= stamp:
            continue
        moved, ended = job.replan(plan)
        what = (f"plan {new[1]}" if new[0] == stamp[0] else
                f"{new[0].coordinator} epoch {new[0].term} plan {new[1]}")
        stamp = new
        if not moved and not ended:
            continue  # a newer plan, the same sources for what we lack
        taken += 1
        if taken <= NOTED_REPLANS:
            base += (f", then {what} at {trio.current_time() - started:.2f} s ({moved} "
                     f"chunks to new sources, {ended} streams ended)")
            job.report.plan = base
        else:
            job.report.plan = f"{base}, then {taken - NOTED_REPLANS} more"
