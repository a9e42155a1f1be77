"""The fetch path of a peer: find a holder's manifest, ask for a plan, run the fetch.

:meth:`Peer.fetch <tensorhub.peer.node.Peer.fetch>` resolves the version and its seal
and calls :func:`fetch_key` for a key held as it is asked (a whole version, or a shard
in its publisher's layout); resharding (:mod:`.reshard`) reuses :func:`fetch_manifest`,
:func:`holder_view` and :func:`window` for each source shard.  While a fetch runs, the
peer announces the chunks it has verified (so downstream readers find it); a fetch that
fails or is cancelled, planning included, drops its partial copy and waits for reads of
it to drain before the caller sees the error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..errors import ConsistencyError, RemoteProtocolError, TransportError, VersionUnavailable
from ..manifest import Manifest
from ..model import PeerInfo, VersionKey
from ..protocol.refs import Holding
from ..protocol.sizing import MIN_CHUNKS
from ..transport.base import NotServing
from .destination import allocate_flat, prepare_destination
from .fetcher import Fetch, Fetched, HolderView
from .store import LocalVersion

if TYPE_CHECKING:
    from .node import Peer

INLINE_DECODE_BYTES = 64 << 10
"""Manifests up to this size are decoded on the event loop: about 2,000 tensors, well
under a millisecond, less than handing the work to a thread and back."""


def holder_view(peer: Peer, allowed: frozenset[str] | None) -> HolderView:
    """Who holds a key in the peer's current view, limited to ``allowed`` names."""
    def view(k: VersionKey) -> list[tuple[PeerInfo, Holding]]:
        found = peer.control.holders(k)
        return found if allowed is None else [(p, h) for p, h in found if p.name in allowed]
    return view


def window(peer: Peer, manifest: Manifest) -> int:
    """Streams (workers) of one fetch: ``fetch_window``, within ``max_inflight_bytes``
    at the floor of a window each (``sizing.MIN_CHUNKS`` chunks)."""
    return max(1, min(peer.config.fetch_window,
                      peer.config.max_inflight_bytes // (MIN_CHUNKS * manifest.chunk_size)))


def window_cap(peer: Peer, manifest: Manifest) -> int:
    """Bytes one stream of a fetch may keep requested ahead: its share of
    ``max_inflight_bytes``."""
    return peer.config.max_inflight_bytes // window(peer, manifest)


async def fetch_key(peer: Peer, key: VersionKey, into: Mapping[str, Any] | None,
                    allowed: frozenset[str] | None, derived: bool, schema: bytes | None
                    ) -> Fetched:
    """Fetch one manifest's chunks (a whole version, or a shard) as they are held;
    ``schema`` is the sealed schema id its tensor specs must have."""
    manifest, publisher = await fetch_manifest(peer, key, allowed)
    check_schema(manifest, schema)
    flat = None
    if into is None:
        arrays, flat = allocate_flat(manifest)
    else:
        arrays = prepare_destination(manifest, into)
    local = LocalVersion(manifest, arrays, publisher, verified=False, flat=flat,
                         derived=derived)
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
        plan: list[tuple[PeerInfo, int, int]] = []
        plan_note = "planning off"
        if allowed is None and peer.config.planning and key.whole:
            plan, plan_note = await ask_plan(peer, key, manifest)
        elif not key.whole:
            plan_note = "no plan: shards are fetched from their holders directly"
        job = Fetch(me=peer.info.name, local=local, view=holder_view(peer, allowed),
                    upstream=allowed or frozenset(), plan=plan,
                    connect=plane.connect, release=plane.release,
                    window=window(peer, manifest), window_cap=window_cap(peer, manifest),
                    stall_timeout=peer.config.stall_timeout, on_progress=progress,
                    banned=peer.banned, on_bad_bytes=peer.ban)
        job.report.plan = plan_note
        with plane.running(job):
            report = await job.run()
    except BaseException:
        local.end_receiving()
        peer.withdraw(key)
        with trio.CancelScope(shield=True):
            await peer.store.wait_drained(key)
        raise
    local.end_receiving()
    plane.announce(local)
    plane.account(report)
    return Fetched(key.version, dict(zip(manifest.table.names, arrays, strict=True)),
                   report)


async def fetch_manifest(peer: Peer, key: VersionKey, allowed: frozenset[str] | None
                          ) -> tuple[Manifest, str]:
    def candidates() -> list[tuple[PeerInfo, Holding]]:
        found = []
        for p, h in peer.control.holders(key):
            if p.name == peer.info.name or (allowed is not None and p.name not in allowed):
                continue
            ban = peer.banned(p.name)
            if ban is None:
                found.append((p, h))
            else:
                banned[p.name] = f"banned here ({ban.reason})"
        return found

    # The view may lag: a holder that just unpublished, a named source that has not
    # started.  Retry each holder when its reference changes, until stall_timeout.
    deadline = trio.current_time() + peer.config.stall_timeout
    tried: dict[str, Holding] = {}
    errors: dict[str, str] = {}
    banned: dict[str, str] = {}
    plane = peer.data_plane()
    while True:
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
        with trio.move_on_at(deadline):
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
    return await trio.to_thread.run_sync(Manifest.decode, data, manifest_id, limits)


async def ask_plan(peer: Peer, key: VersionKey, manifest: Manifest
                    ) -> tuple[list[tuple[PeerInfo, int, int]], str]:
    """Our part of the coordinator's plan as (source, first chunk, stop); on any
    failure no plan (the fetch then picks holders itself) and the reason."""
    try:
        answer = await peer.ask_coordinator(key.model, key.version,
                                            size=manifest.total_bytes,
                                            chunks=manifest.num_chunks)
    except TransportError as exc:
        return [], f"no plan: {exc}"
    members = peer.control.membership.members()
    plan = [(members[s.peer].info, s.first, s.stop) for s in answer.sources
            if s.peer in members and s.peer != peer.info.name]
    if not plan:
        return [], f"no plan from {answer.coordinator}: {answer.detail or 'empty'}"
    return plan, f"{answer.coordinator} epoch {answer.epoch.term}"
