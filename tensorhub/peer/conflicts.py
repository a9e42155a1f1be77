"""Explaining a version whose ranks disagree, tensor by tensor, at one peer.

Sealing names the ranks and peers that disagree on a version's schema id or layout id
(:mod:`tensorhub.protocol.versions`); which tensors they disagree on only their
manifests say.  :class:`Explainer` fetches the manifest of every rank the conflicting
claims name (each checked against its manifest id; at most :data:`MAX_COMPARED`), and
:func:`~tensorhub.protocol.specdiff.spec_differences` compares them.  The text is kept
per ``(model, version)`` while the claims stay the same (at most :data:`KEPT`), so a
fetch that meets the conflict raises it completed, and :meth:`Peer.unsealed
<tensorhub.peer.node.Peer.unsealed>` shows it once known (asking starts it in the
background).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import trio

from ..errors import TensorHubError
from ..manifest.manifest import Manifest
from ..model import VersionKey
from ..protocol.specdiff import RankSpecs, spec_differences
from ..protocol.versions import LAYOUT, SPECS, Seal
from ..read.store import Store
from ..transport.base import NotServing

ManifestRead = Callable[[VersionKey, frozenset[str]], Awaitable[tuple[Manifest, str]]]
"""Reads a version's manifest (and its publisher) from one of the named holders."""

log = logging.getLogger("tensorhub.peer")
MAX_COMPARED = 64
"""Manifests fetched for one explanation (one per announced rank and manifest)."""
KEPT = 64
"""Explanations kept (the oldest is forgotten first), and explanations found out in the
background at once."""

Fingerprint = frozenset[tuple[int, bytes, bytes, bytes]]


def _fingerprint(seal: Seal) -> Fingerprint:
    return frozenset((c.shard, c.layout_id, c.manifest_id, c.schema) for c in seal.claims)


def explainable(seal: Seal) -> bool:
    """Whether the ranks of ``seal`` disagree on their tensors or their layout."""
    return any(c.what in (SPECS, LAYOUT) for c in seal.conflicts)


class Explainer:
    def __init__(self, me: str, store: Store, seal_status: Callable[[str, int], Seal | None],
                 read_manifest: ManifestRead,
                 spawn: Callable[[Callable[[], Awaitable[None]]], None],
                 internal_error: Callable[[str, BaseException], None]) -> None:
        """``seal_status(model, version)``: the seal as this peer sees it; ``spawn``:
        run a task in the peer's nursery (:class:`~tensorhub.errors.PeerClosed` once it
        is closing); ``internal_error``: count a bug of ours."""
        self.me, self.store, self._seal_status = me, store, seal_status
        self._read_manifest, self._spawn, self._internal_error = \
            read_manifest, spawn, internal_error
        self._known: OrderedDict[tuple[str, int], tuple[Fingerprint, str]] = OrderedDict()
        self._running: set[tuple[str, int, Fingerprint]] = set()

    def reason(self, model: str, seal: Seal) -> str:
        """Why ``seal`` is not sealed, with the tensors once known (else it starts
        finding them out in the background)."""
        why = seal.reason()
        if not explainable(seal):
            return why
        known = self._cached(model, seal)
        if known is None:
            self._start(model, seal)
        return f"{why}; {known}" if known else why

    async def explain(self, model: str, version: int, why: str) -> str:
        """``why`` (a conflict's text), completed with the tensors the ranks of
        ``model@version`` disagree on."""
        seal = self._seal_status(model, version)
        if seal is None or not explainable(seal):
            return why
        known = self._cached(model, seal)
        if known is None:
            known = await self._compute(model, seal)
        return f"{why}; {known}" if known else why

    def _cached(self, model: str, seal: Seal) -> str | None:
        got = self._known.get((model, seal.version))
        return got[1] if got is not None and got[0] == _fingerprint(seal) else None

    def _start(self, model: str, seal: Seal) -> None:
        job = (model, seal.version, _fingerprint(seal))
        if job in self._running or len(self._running) >= KEPT:
            return

        async def run() -> None:
            try:
                await self._compute(model, seal)
            except Exception as exc:  # a bug: count it, the peer goes on
                self._internal_error(f"explaining {model}@{seal.version}: "
                                     f"{type(exc).__name__}: {exc}", exc)
            finally:
                self._running.discard(job)

        try:
            self._spawn(run)
        except TensorHubError:  # the peer is closing: nothing to explain to
            return
        self._running.add(job)

    async def _compute(self, model: str, seal: Seal) -> str:
        wanted: dict[tuple[int, bytes, bytes], set[str]] = {}
        for c in seal.claims:
            wanted.setdefault((c.shard, c.layout_id, c.manifest_id), set()).add(c.origin)
        got: list[RankSpecs] = []

        async def one(shard: int, layout: bytes, mid: bytes, origins: set[str]) -> None:
            manifest = await self._manifest(VersionKey(model, seal.version, shard, layout),
                                            mid, origins)
            if manifest is not None:
                got.append(RankSpecs(shard, tuple(sorted(origins)), manifest.tensors))

        compared = sorted(wanted.items())[:MAX_COMPARED]
        async with trio.open_nursery() as nursery:
            for (shard, layout, mid), origins in compared:
                nursery.start_soon(one, shard, layout, mid, origins)
        got.sort(key=lambda r: (r.rank, r.origins))
        text = "; ".join(spec_differences(got, seal.world))
        if len(got) < len(compared):  # some manifest was not to be had: try again later
            return text
        self._known[(model, seal.version)] = (_fingerprint(seal), text)
        self._known.move_to_end((model, seal.version))
        while len(self._known) > KEPT:
            self._known.popitem(last=False)
        return text

    async def _manifest(self, key: VersionKey, mid: bytes, origins: set[str]
                        ) -> Manifest | None:
        """The manifest ``mid`` of ``key``: ours, or from one of ``origins``."""
        local = self.store.get(key)
        if local is not None and local.manifest.manifest_id() == mid:
            return local.manifest
        others = frozenset(origins - {self.me})
        if not others:
            return None
        try:
            manifest, _ = await self._read_manifest(key, others)
        except (TensorHubError, NotServing, OSError) as exc:
            log.info("peer %s: no manifest of %s to explain a conflict: %s",
                     self.me, key, exc)
            return None
        return manifest if manifest.manifest_id() == mid else None
