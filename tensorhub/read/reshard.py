"""Resharding fetch at one peer: a fetcher whose layout differs from the publishers'
assembles its slices from the publish shards that intersect them (the plan comes from
:func:`tensorhub.protocol.resharding.plan_reshard`; this module runs it).

Publish shards this peer holds itself are read in place, pinned meanwhile; the others'
manifests are read and only the chunks that overlap our slices are fetched, into
temporary buffers.  The slices are assembled in a worker thread and a manifest of our
own is built for them, so the result is held and served as a derived shard of its own
layout.  What this module needs of the read path is :class:`ShardReads`; it returns the
assembled version, and the reader adds, announces and counts it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any, Protocol

import numpy as np
import trio

from ..config import PeerConfig
from ..manifest.manifest import Manifest, build_manifest
from ..model import PeerInfo, VersionKey, byte_view
from ..protocol.layout import execute
from ..protocol.reading import check_schema
from ..protocol.resharding import plan_reshard
from ..protocol.sharding import Sharding
from ..protocol.sizing import choose_chunk_size
from ..protocol.versions import Seal
from .destination import allocate_flat, prepare_destination
from .ports import Ports
from .report import FetchReport
from .store import LocalVersion, Store
from .transfer import first_error


class ShardReads(Protocol):
    """What a resharding fetch asks of the read path."""

    async def read_manifest(self, key: VersionKey, allowed: frozenset[str] | None
                            ) -> tuple[Manifest, str]:
        """The manifest of ``key`` and its publisher, from a holder."""
        ...

    async def pull(self, part: LocalVersion, allowed: frozenset[str] | None,
                   only: Sequence[int]) -> FetchReport:
        """Fetch chunks ``only`` of ``part``'s version into ``part``."""
        ...


async def same_layout_holder(ports: Ports, me: PeerInfo, stall_timeout: float,
                             key: VersionKey, seal: Seal, allowed: frozenset[str] | None
                             ) -> bool:
    """Whether to read ``key`` whole from a holder of the same layout rather than
    reshard.  With named sources that hold neither ``key`` nor a publish shard yet,
    wait for them (up to ``stall_timeout``): a named source may be still starting."""
    deadline = trio.current_time() + stall_timeout
    while True:
        same = [p for p, _ in ports.holders(key) if p.name != me.name
                and (allowed is None or p.name in allowed)]
        if same or allowed is None:
            return bool(same)
        publish = {p.name for s in range(seal.world or 0)
                   for p, _ in ports.holders(
                       VersionKey(key.model, key.version, s, seal.layout_id or b""))}
        if publish & allowed or trio.current_time() >= deadline:
            return False
        with trio.move_on_at(deadline):
            await ports.changed()


async def reshard(reads: ShardReads, store: Store, config: PeerConfig, peers: int,
                  key: VersionKey, seal: Seal, spec: Sharding,
                  into: Mapping[str, Any] | None, allowed: frozenset[str] | None
                  ) -> tuple[LocalVersion, FetchReport]:
    """Assemble our slices of ``key`` from the publish shards that intersect them;
    the version (complete, verified, not yet in the store) and the report.  ``peers``:
    the live members, for the chunk size of our own manifest."""
    assert seal.world is not None and seal.layout_id is not None
    started = trio.current_time()
    src = [VersionKey(key.model, key.version, s, seal.layout_id)
           for s in range(seal.world)]
    try:
        with ExitStack() as held:
            # publish shards this peer holds itself are read in place (pinned meanwhile)
            mine = {s: local for s in range(seal.world)
                    if (local := held.enter_context(store.hold(src[s]))) is not None}
            local, reports = await _assemble(reads, config, peers, key, seal, spec, into,
                                             allowed, src, mine)
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    report = FetchReport(key.model, key.version, verified=True)
    for r in reports:
        report.add(r)
    report.seconds = trio.current_time() - started
    report.plan = (f"resharded from {len(src)} shards of layout "
                   f"{src[0].layout.hex()[:8] or 'whole'}"
                   + (f", {len(mine)} of them held here" if mine else ""))
    return local, report


async def _assemble(reads: ShardReads, config: PeerConfig, peers: int, key: VersionKey,
                    seal: Seal, spec: Sharding, into: Mapping[str, Any] | None,
                    allowed: frozenset[str] | None, src: list[VersionKey],
                    mine: dict[int, LocalVersion]) -> tuple[LocalVersion, list[FetchReport]]:
    got: dict[int, tuple[Manifest, str]] = {
        s: (local.manifest, local.publisher) for s, local in mine.items()}

    async def manifest_of(s: int) -> None:
        got[s] = await reads.read_manifest(src[s], allowed)

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

    async def pull(s: int) -> None:
        m, publisher = got[s]
        buf = np.empty(m.total_bytes, dtype=np.uint8)
        part = LocalVersion(m, [], publisher, verified=False,
                            flat=memoryview(buf))  # type: ignore[arg-type]
        reports.append(await reads.pull(part, allowed, plan.chunks[s]))
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

    def assemble() -> Manifest:
        for t, dest in zip(plan.tensors, arrays, strict=True):
            bufs = {s: b for s in manifests if (b := source(s, t.name)) is not None}
            execute(plan.plans[t.name], bufs, dest)
        return build_manifest(key, [(t.name, a) for t, a in zip(plan.tensors, arrays,
                                                              strict=True)],
                              choose_chunk_size(sum(a.nbytes for a in arrays),
                                                config.chunk_size, peers=peers)[0],
                              config.digest_algo, spec.size,
                              [(t.global_shape, t.start) for t in plan.tensors])

    manifest = await trio.to_thread.run_sync(assemble)
    temps.clear()
    local = LocalVersion(manifest, arrays, got[0][1] if 0 in got else "",
                         verified=True, flat=flat, derived=True)
    return local, reports

