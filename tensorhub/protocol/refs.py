"""The replicated reference table: who holds which chunks of which version.

Theory of operation
-------------------
ROS keeps no copy of the weights; what the mesh stores is *references*.  Each peer
(an *origin*) owns exactly one entry: the list of its own holdings -- for every
``(model, version)`` it holds, the manifest id, the original publisher and a bitmap of
the chunks it has verified.  Only the origin changes its entry, and every change bumps
the entry's ``(generation, seq)`` stamp.  ``generation`` grows across restarts (the
shell passes a boot stamp), ``seq`` within one run.

Other peers keep the newest entry they have seen per origin.  Merging keeps the larger
stamp, so merge is commutative, associative and idempotent: any order of deliveries
converges to the same table.  Anti-entropy is digest based: a peer sends the stamps of
all origins it knows (:meth:`RefTable.digest`); the receiver answers with just the
entries that are newer on its side (:meth:`RefTable.newer_than`), in parts bounded in
size, and asks back when the digest shows the sender knows something newer.

Entries of peers that membership declares dead or departed are dropped
(:meth:`RefTable.forget`) and refused until that origin shows a newer stamp, so a stale
copy gossiped by a slow peer cannot bring a dead holder back -- or until membership sees
the origin alive again (it refuted the suspicion: :meth:`RefTable.unforget`), when its
current entry is welcome again whatever its stamp.

An origin's entry also carries the links between DCs it measured
(:meth:`~.wan.Wan.reports`, at most :data:`~.wan.MAX_LINK_REPORTS`), so the WAN
estimates travel by the same anti-entropy as the holdings; each is range-checked at
decode (:func:`check_links`).

Signatures (with ``PeerConfig.security``; see trust.py).  An entry carries its origin's
signature over ``(stamp, holdings, links)``; :meth:`RefTable.merge` checks it before keeping
an entry, so nobody writes entries on behalf of another origin.  Each holding of a
published shard also carries its *publisher's* signature over what the publish
announced (:func:`announcement_bytes`: model, version, shard, world, layout, manifest
id, chunk count, publisher, the publisher's generation and the schema id); copies made by fetchers
carry the same signature, and sealing counts only holdings whose signature verifies
(see versions.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Annotated

from ..bounds import U32, U63, U64, MaxLen, PeerName, Rank, Signature, Valid, World
from ..errors import RemoteProtocolError
from ..model import LayoutId, ModelName, SchemaId, VersionKey
from .codec import fields_bytes
from .trust import Trust
from .wan import MAX_LINK_REPORTS, LinkReport, check_report

_TAG_ENTRY = b"tensorhub/ref-entry/2\0"
_TAG_ANNOUNCEMENT = b"tensorhub/version/2\0"
MAX_HOLDINGS = 1 << 16
"""Holdings in one origin's entry (versions x shards it holds)."""


@dataclass(frozen=True, slots=True)
class Holding:
    """One peer's holding of one version."""

    model: ModelName
    version: U63
    manifest_id: Annotated[bytes, MaxLen(64)]
    publisher: PeerName
    num_chunks: U32
    bitmap: bytes = b""
    """Verified chunks, bit ``i`` of byte ``i // 8`` for chunk ``i``; empty means all."""
    shard: Rank = 0
    world: World = 1
    layout: LayoutId = b""
    """Which shard of which layout (see :class:`~tensorhub.model.VersionKey`)."""
    derived: bool = False
    """False: these are the bytes of shard ``shard`` of the layout the version was
    published in (a publishing rank, or an exact copy), so the holding counts towards
    sealing and retention.  True: slices a consumer assembled in its own layout; they
    serve readers of that layout but say nothing about the publish."""
    publisher_gen: U63 = 0
    """The publisher's generation (boot stamp) when it published: see versions.py."""
    publisher_sig: Signature = b""
    """The publisher's signature over :func:`announcement_bytes` (secure mode)."""
    schema: SchemaId = b""
    """The schema id of the shard's tensors
    (:meth:`~tensorhub.manifest.manifest.Manifest.schema_id`): the same at every rank
    of a consistent publish (see versions.py)."""
    size: U64 = 0
    """Bytes of the shard's tensors (0: not said).  Advisory, under the origin's entry
    signature only: a fetcher asks the coordinator for a plan with it while it reads the
    manifest, and checks it against the manifest when that arrives."""

    @property
    def key(self) -> VersionKey:
        return VersionKey(self.model, self.version, self.shard, self.layout)

    @property
    def complete(self) -> bool:
        return not self.bitmap

    def has(self, chunk: int) -> bool:
        if not self.bitmap:
            return 0 <= chunk < self.num_chunks
        byte = chunk >> 3
        return 0 <= byte < len(self.bitmap) and bool(self.bitmap[byte] >> (chunk & 7) & 1)

    def count(self) -> int:
        if not self.bitmap:
            return self.num_chunks
        return sum(bin(b).count("1") for b in self.bitmap)


def announcement_bytes(h: Holding) -> bytes:
    """What a publisher signs when it publishes (and every copy carries)."""
    return fields_bytes(_TAG_ANNOUNCEMENT, h.model, h.version, h.shard, h.world, h.layout,
                        h.manifest_id, h.num_chunks, h.publisher, h.publisher_gen, h.schema)


def bitmap_of(chunks: Iterable[int], num_chunks: int) -> bytes:
    """Bitmap for a set of chunk indices; all chunks -> ``b""`` (complete)."""
    buf = bytearray((num_chunks + 7) // 8)
    n = 0
    for c in chunks:
        if not buf[c >> 3] >> (c & 7) & 1:
            buf[c >> 3] |= 1 << (c & 7)
            n += 1
    return b"" if n == num_chunks else bytes(buf)


@dataclass(frozen=True, slots=True)
class Stamp:
    origin: PeerName
    generation: U63
    seq: U63

    def newer_than(self, other: Stamp | None) -> bool:
        return other is None or (self.generation, self.seq) > (other.generation, other.seq)


def check_links(reports: tuple[LinkReport, ...]) -> None:
    """Raise ValueError (the codec's :class:`~tensorhub.bounds.Valid` contract) unless
    every report is a plausible measurement: two different DCs, a rate in (0,
    ``MAX_LINK_BPS``], a round trip in [0, ``MAX_LINK_RTT_S``], at most
    :data:`~.wan.MAX_LINK_REPORTS` of them."""
    if len(reports) > MAX_LINK_REPORTS:
        raise ValueError(f"{len(reports)} link reports (at most {MAX_LINK_REPORTS})")
    for r in reports:
        try:
            check_report(r)
        except RemoteProtocolError as exc:
            raise ValueError(str(exc)) from None


LinkReports = Annotated[tuple[LinkReport, ...], MaxLen(MAX_LINK_REPORTS), Valid(check_links)]


@dataclass(frozen=True, slots=True)
class OriginEntry:
    stamp: Stamp
    holdings: Annotated[tuple[Holding, ...], MaxLen(MAX_HOLDINGS)]
    sig: Signature = b""
    """The origin's signature over :meth:`signed_bytes` (secure mode)."""
    links: LinkReports = ()
    """The DC links the origin measured itself (:meth:`~.wan.Wan.reports`)."""

    def signed_bytes(self) -> bytes:
        return fields_bytes(_TAG_ENTRY, self.stamp, self.holdings, self.links)

    @property
    def origin(self) -> str:
        return self.stamp.origin

    def wire_size(self) -> int:
        """An upper estimate of the encoded size, for splitting deltas into parts."""
        return 128 + sum(
            192 + len(h.model) + len(h.publisher) + len(h.bitmap) + len(h.layout)
            + len(h.schema)
            for h in self.holdings
        ) + sum(32 + len(r.src.encode()) + len(r.dst.encode()) for r in self.links)


class RefTable:
    """This peer's view of every origin's holdings, plus its own entry."""

    def __init__(self, me: str, generation: int, trust: Trust | None = None) -> None:
        self.me = me
        self._trust = trust
        self._entries: dict[str, OriginEntry] = {
            me: self._signed(OriginEntry(Stamp(me, generation, 0), ()))
        }
        self._forgotten: dict[str, Stamp] = {}

    # -- own entry -------------------------------------------------------------

    @property
    def local(self) -> OriginEntry:
        return self._entries[self.me]

    def _signed(self, entry: OriginEntry) -> OriginEntry:
        if self._trust is None:
            return entry
        return replace(entry, sig=self._trust.sign(entry.signed_bytes()))

    def _set_local(self, holdings: tuple[Holding, ...],
                   links: tuple[LinkReport, ...] | None = None) -> None:
        local = self.local
        self._entries[self.me] = self._signed(OriginEntry(
            replace(local.stamp, seq=local.stamp.seq + 1), holdings,
            links=local.links if links is None else links))

    def set_links(self, links: tuple[LinkReport, ...]) -> bool:
        """Put our own link measurements in our entry (re-stamped); False if unchanged."""
        if links == self.local.links:
            return False
        self._set_local(self.local.holdings, links)
        return True

    def bump_local(self, holdings: tuple[Holding, ...] | None = None) -> None:
        """Re-stamp (and re-sign) our entry, so every peer pulls it again: after we
        refuted a suspicion (peers that forgot us want a newer stamp) or rotated keys."""
        self._set_local(self.local.holdings if holdings is None else holdings)

    def put_local(self, holding: Holding) -> None:
        """Add or replace our holding of ``holding.key``."""
        rest = tuple(h for h in self.local.holdings if h.key != holding.key)
        self._set_local((*rest, holding))

    def drop_local(self, key: VersionKey) -> bool:
        before = self.local.holdings
        after = tuple(h for h in before if h.key != key)
        if len(after) == len(before):
            return False
        self._set_local(after)
        return True

    # -- anti-entropy ------------------------------------------------------------

    def digest(self) -> tuple[Stamp, ...]:
        return tuple(e.stamp for e in self._entries.values())

    def newer_than(self, digest: Iterable[Stamp], max_bytes: int) -> list[list[OriginEntry]]:
        """Entries we hold that are newer than ``digest``, split into parts <= max_bytes."""
        theirs = {s.origin: s for s in digest}
        parts: list[list[OriginEntry]] = []
        size = max_bytes
        for origin, entry in sorted(self._entries.items()):
            if not entry.stamp.newer_than(theirs.get(origin)):
                continue
            cost = entry.wire_size()
            if size + cost > max_bytes and (not parts or parts[-1]):
                parts.append([])
                size = 0
            parts[-1].append(entry)
            size += cost
        return parts

    def wants_from(self, digest: Iterable[Stamp]) -> bool:
        """True when ``digest`` shows an origin stamp newer than what we hold."""
        for s in digest:
            mine = self._entries.get(s.origin)
            if s.origin != self.me and s.newer_than(mine.stamp if mine else None) and s.newer_than(
                self._forgotten.get(s.origin)
            ):
                return True
        return False

    def merge(self, entry: OriginEntry) -> bool:
        """Keep ``entry`` if it is newer than what we hold; True if the table changed."""
        origin = entry.origin
        if origin == self.me:
            return False  # only we write our own entry
        gone = self._forgotten.get(origin)
        if gone is not None and not entry.stamp.newer_than(gone):
            return False
        held = self._entries.get(origin)
        if not entry.stamp.newer_than(held.stamp if held else None):
            return False
        if self._trust is not None and not self._trust.check(
                origin, entry.signed_bytes(), entry.sig):
            self._trust.refuse("reference entry")
            return False
        self._forgotten.pop(origin, None)
        self._entries[origin] = entry
        return True

    def forget(self, origin: str) -> bool:
        """Drop a dead or departed origin's entry and refuse its stale copies."""
        entry = self._entries.pop(origin, None) if origin != self.me else None
        if entry is not None:
            self._forgotten[origin] = entry.stamp
        return entry is not None

    def unforget(self, origin: str) -> None:
        """``origin`` is alive again (it refuted a suspicion or death): accept its
        entry again, whatever its stamp."""
        self._forgotten.pop(origin, None)

    # -- queries -----------------------------------------------------------------

    def entry(self, origin: str) -> OriginEntry | None:
        return self._entries.get(origin)

    def origins(self) -> Iterator[OriginEntry]:
        return iter(self._entries.values())

    def holders(self, key: VersionKey) -> list[tuple[str, Holding]]:
        out = []
        for origin, entry in self._entries.items():
            for h in entry.holdings:
                if h.key == key:
                    out.append((origin, h))
        return sorted(out, key=lambda oh: oh[0])

    def of_model(self, model: str) -> list[tuple[str, Holding]]:
        """Every ``(origin, holding)`` of any version, shard or layout of ``model``."""
        return [(origin, h) for origin, entry in self._entries.items()
                for h in entry.holdings if h.model == model]
