"""Resharding fetch at one peer: a fetcher whose layout differs from the publishers'
assembles its slices from the publish shards that intersect them (the plan comes from
:func:`tensorhub.protocol.resharding.plan_reshard`; this module runs it)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from ..manifest.manifest import Manifest, build_manifest
from ..model import VersionKey, byte_view
from ..protocol.layout import execute
from ..protocol.resharding import plan_reshard
from ..protocol.sharding import Sharding
from ..protocol.sizing import choose_chunk_size
from ..protocol.versions import Seal
from ..transport import copy_threads
from .destination import allocate_flat, prepare_destination
from .fetcher import Fetch, Fetched, FetchReport, first_error
from .fetching import (
    check_schema,
    fetch_key,
    fetch_manifest,
    holder_view,
    socket_window,
    window,
    window_cap,
)
from .store import LocalVersion

if TYPE_CHECKING:
    from .node import Peer


async def fetch_sealed(peer: Peer, key: VersionKey, seal: Seal, spec: Sharding,
                       into: Mapping[str, Any] | None, allowed: frozenset[str] | None
                       ) -> Fetched:
    """Fetch ``key`` of a sealed version: read whole from holders of its layout, or
    reshard from the publish shards when none holds it in ``spec``'s layout."""
    if key.layout != seal.layout_id and not await same_layout_holder(
            peer, key, seal, allowed):
        return await reshard(peer, key, seal, spec, into, allowed)
    return await fetch_key(peer, key, into, allowed, key.layout != seal.layout_id,
                           seal.schema)


async def same_layout_holder(peer: Peer, key: VersionKey, seal: Seal,
                              allowed: frozenset[str] | None) -> bool:
    """Whether to read ``key`` whole from a holder of the same layout rather than
    reshard.  With named sources that hold neither ``key`` nor a publish shard yet,
    wait for them (up to ``stall_timeout``): a named source may be still starting."""
    deadline = trio.current_time() + peer.config.stall_timeout
    while True:
        same = [p for p, _ in peer.control.holders(key) if p.name != peer.info.name
                and (allowed is None or p.name in allowed)]
        if same or allowed is None:
            return bool(same)
        publish = {p.name for s in range(seal.world or 0)
                   for p, _ in peer.control.holders(
                       VersionKey(key.model, key.version, s, seal.layout_id or b""))}
        if publish & allowed or trio.current_time() >= deadline:
            return False
        with trio.move_on_at(deadline):
            await peer.wait_changed()



async def reshard(peer: Peer, key: VersionKey, seal: Seal, spec: Sharding,
                   into: Mapping[str, Any] | None, allowed: frozenset[str] | None
                   ) -> Fetched:
    """Assemble our slices from the publish shards that intersect them."""
    assert seal.world is not None and seal.layout_id is not None
    try:
        with peer.data_plane().resharding(key):
            return await _reshard_parts(peer, key, seal, spec, into, allowed)
    except BaseExceptionGroup as group:
        raise first_error(group) from None

async def _reshard_parts(peer: Peer, key: VersionKey, seal: Seal, spec: Sharding,
                         into: Mapping[str, Any] | None, allowed: frozenset[str] | None
                         ) -> Fetched:
    assert seal.world is not None and seal.layout_id is not None
    started = trio.current_time()
    src = [VersionKey(key.model, key.version, s, seal.layout_id)
           for s in range(seal.world)]
    with ExitStack() as held:
        # publish shards this peer holds itself are read in place (pinned meanwhile)
        mine = {s: local for s in range(seal.world)
                if (local := held.enter_context(peer.store.hold(src[s]))) is not None}
        return await _reshard_from(peer, key, seal, spec, into, allowed, src, mine,
                                        started)

async def _reshard_from(peer: Peer, key: VersionKey, seal: Seal, spec: Sharding,
                        into: Mapping[str, Any] | None, allowed: frozenset[str] | None,
                        src: list[VersionKey], mine: dict[int, LocalVersion],
                        started: float) -> Fetched:
    got: dict[int, tuple[Manifest, str]] = {
        s: (local.manifest, local.publisher) for s, local in mine.items()}

    async def manifest_of(s: int) -> None:
        got[s] = await fetch_manifest(peer, src[s], allowed)

    async with trio.open_nursery() as nursery:
        for s in range(len(src)):
            if s not in mine:
                nursery.start_soon(manifest_of, s)
    manifests = {s: m for s, (m, _) in got.items()}
    for m in manifests.values():
        check_schema(m, seal.schema)
    plan = await trio.to_thread.run_sync(plan_reshard, spec, manifests)
    skeleton = Manifest(key.model, key.version, plan.tensors, 1, "blake3", (),
                        key.shard, spec.size, key.layout)
    flat = None
    if into is None:
        arrays, flat = allocate_flat(skeleton)
    else:
        arrays = prepare_destination(skeleton, into)
    temps: dict[int, np.ndarray[Any, Any]] = {}
    reports: list[FetchReport] = []
    plane = peer.data_plane()

    async def pull(s: int) -> None:
        m, publisher = got[s]
        buf = np.empty(m.total_bytes, dtype=np.uint8)
        part = LocalVersion(m, [], publisher, verified=False,
                            flat=memoryview(buf))  # type: ignore[arg-type]
        job = Fetch(me=peer.info.name, local=part, view=holder_view(peer, allowed),
                    upstream=allowed or frozenset(), connect=plane.connect,
                    release=plane.release,
                    window=window(peer, m), window_cap=window_cap(peer, m),
                    socket_window=socket_window(), host=peer.info.label("host"),
                    cores=copy_threads.pool.cores,
                    stall_timeout=peer.config.stall_timeout,
                    on_progress=lambda: None, banned=peer.banned, on_bad_bytes=peer.ban,
                    only=plan.chunks[s])
        with plane.running(job):
            reports.append(await job.run())
        temps[s] = buf

    async with trio.open_nursery() as nursery:
        for s in plan.chunks:
            if s not in mine:
                nursery.start_soon(pull, s)

    def source(s: int, name: str) -> Any:
        """The bytes of tensor ``name`` in publish shard ``s``."""
        index = manifests[s].table.index().get(name)
        if index is None:
            return None
        if s in mine:
            return byte_view(mine[s].arrays[index])
        t = manifests[s].tensors[index]
        return temps[s][t.offset:t.end] if s in temps else None

    peers = len(peer.control.membership.live_members())  # read here, not in the thread

    def assemble() -> Manifest:
        for t, dest in zip(plan.tensors, arrays, strict=True):
            bufs = {s: b for s in manifests if (b := source(s, t.name)) is not None}
            execute(plan.plans[t.name], bufs, dest)
        return build_manifest(key, [(t.name, a) for t, a in zip(plan.tensors, arrays,
                                                              strict=True)],
                              choose_chunk_size(sum(a.nbytes for a in arrays),
                                                peer.config.chunk_size,
                                                peers=peers)[0],
                              peer.config.digest_algo,
                              spec.size, [(t.global_shape, t.start)
                                          for t in plan.tensors])

    manifest = await trio.to_thread.run_sync(assemble)
    temps.clear()
    local = LocalVersion(manifest, arrays, got[0][1] if 0 in got else "",
                         verified=True, flat=flat, derived=True)
    peer.store.add(local)
    plane.announce(local)
    report = FetchReport(key.model, key.version, verified=True)
    for r in reports:
        report.add(r)
    report.seconds = trio.current_time() - started
    report.plan = (f"resharded from {len(src)} shards of layout "
                   f"{src[0].layout.hex()[:8] or 'whole'}"
                   + (f", {len(mine)} of them held here" if mine else ""))
    plane.account(report)
    return Fetched(key.version, {t.name: a for t, a in zip(plan.tensors, arrays,
                                                             strict=True)}, report)
