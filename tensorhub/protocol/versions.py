"""Version lifecycle: when a multi-rank publish is sealed, what ``latest`` means at a
peer, and which versions retention keeps readable.

Theory of operation
-------------------
Sealing.  Version ``v`` of a model is published by the ``world`` ranks of one publishing
group: rank ``s`` announces shard ``s`` of ``v`` in the reference table together with
``world``, a *layout id* (a digest of the whole declared layout; every rank of one
publish passes the same one), the manifest id of its shard and the shard's *schema id*
(:func:`tensorhub.model.schema_id`: a digest of the sorted name, dtype and whole-tensor
shape of every tensor; every rank lists every tensor, a split one by its own part, so
all ranks of a consistent publish announce the same one).  Any other holder whose
buffers contain all of publish shard ``s`` (whatever its own layout) may claim it too,
with the same ``world``, layout id, manifest id and schema id; a holder of only part of
a shard makes no claim for it.  :func:`seal_status` reads these announcements
(:class:`ShardClaim`) and says, per version, whether it is *sealed*: every shard
``0..world-1`` has at least one complete holder, and all holders agree on ``world``,
on the layout id, on the schema id and, per shard, on the manifest id.  Otherwise the
:class:`Seal` names what is missing and who disagrees with whom (by rank and origin).
So ranks that publish a tensor with another dtype or another whole shape, or one
tensor more or less, never seal (the schema ids differ), nor do ranks that split a
tensor along another dim or into other parts (the layout ids differ): a fetch of such a
version raises :class:`~tensorhub.errors.ConsistencyError`, which the peer completes
with a tensor-by-tensor account (:mod:`.specdiff`), and a fetch also refuses any
source manifest whose specs are not those of the seal's schema id.  A version that is
not sealed does not exist for readers; a rank that dies before its shard is complete
leaves the version unsealed everywhere, and :meth:`Seal.reason` reports it.  Sealing is
a pure function of the current table, so every peer that has merged the same entries
reaches the same verdict.

Latest.  A :class:`VersionView` keeps, per model, the seal status computed from the
latest table snapshot the shell gave it, plus the highest version it has ever seen
sealed.  ``latest`` is that maximum, so it never goes backwards at this peer even when
the version later loses holders; fetching such a version then raises
:class:`~tensorhub.errors.VersionUnavailable` (from :meth:`VersionView.require`) while
``latest`` keeps naming it until a newer one seals.  :meth:`VersionView.update` returns
the versions newer than everything reported before, ascending, each exactly once in the
view's lifetime: the shell wakes ``wait_for_version`` waiters with exactly that list.
The view is per process; a restarted peer starts a new, again monotonic, history.

Trusted announcements (secure mode: the view is built with a ``window``).  The shell
passes only claims whose publisher signature verifies and whose publisher may publish
the model.  On top of that the view (1) refuses versions more than ``window`` past
``latest`` (none while nothing is sealed: the first version sets the base), so a
publisher key cannot jump the numbering out of reach; (2) keeps, per version and shard,
the manifest it saw sealed, and ignores claims of another manifest for it afterwards:
a sealed version is never taken over; (3) before a version is sealed, when signed
claims of one shard name different manifests (a restarted publisher re-publishing the
number, a replay of an old announcement), counts only the *earliest* publish -- the
lowest ``(publisher generation, manifest id)`` -- so every peer that sees the same
claims picks the same manifest, and a later re-publish of a number is ignored rather
than reported as a conflict.  The schema id is under the publisher's signature like
the rest of an announcement, so nobody without a publisher key can make a version
unsealable by claiming another one; ranks of one publish that disagree are still a
conflict (each is the only, hence earliest, publish of its own shard).
:meth:`VersionView.counted` says which announcements count, so that fetches are routed
only to their holders.

Retention.  A :class:`RetentionPolicy` per model says which versions must stay
readable: the ``keep_latest`` newest sealed versions plus every pinned one
(:func:`retained`).  Before a holder drops its copy of a shard (unpublish, or making
room), :func:`must_offload` says whether it holds the last complete copy of a shard of
a retained version: then the shell first copies the shard into host memory and keeps
announcing (and serving) it from there, or, when the policy forbids offloading, the
call raises :class:`RetentionError`.  The host copy is dropped once :func:`retained`
no longer contains its version.  The decision is local to one table snapshot: if the
last two holders drop within one gossip round, each sees the other and both drop (not
covered here; closing it needs drop intents in the table).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from ..errors import ConsistencyError, LocalProtocolError, RetentionError, VersionUnavailable


@dataclass(frozen=True, slots=True)
class ShardClaim:
    """One holder's announcement of one shard of one version of a model."""

    origin: str
    version: int
    shard: int
    world: int
    layout_id: bytes
    complete: bool
    manifest_id: bytes = b""
    generation: int = 0
    """The publisher's generation when it published (secure mode's tie-break)."""
    schema: bytes = b""
    """The schema id of the shard's tensors (:func:`tensorhub.model.schema_id`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.shard < self.world:
            raise LocalProtocolError(
                f"{self.origin} claims shard {self.shard} of a world of {self.world}"
            )


@dataclass(frozen=True, slots=True)
class Conflict:
    """Holders of one version that disagree on one property, grouped by what they claim."""

    what: str
    """``"world"``, ``"layout id"``, ``"tensor specs"`` or ``"manifest of shard N"``."""
    claims: tuple[tuple[str, tuple[str, ...]], ...]
    """``(claimed value as text, origins claiming it)``, ordered by the origins."""

    def __str__(self) -> str:
        parts = "; ".join(f"{value} from {', '.join(who)}" for value, who in self.claims)
        return f"holders disagree on the {self.what}: {parts}"


@dataclass(frozen=True, slots=True)
class Seal:
    """The seal status of one version, as one table snapshot shows it."""

    version: int
    world: int | None
    """The world all holders agree on; None when they disagree."""
    layout_id: bytes | None
    missing: tuple[int, ...]
    """Shards with no complete holder (only known when the world is agreed)."""
    conflicts: tuple[Conflict, ...]
    schema: bytes | None = None
    """The schema id all holders agree on; None when they disagree."""
    claims: tuple[ShardClaim, ...] = field(default=(), repr=False, compare=False)
    """The claims this status was computed from."""

    @property
    def sealed(self) -> bool:
        return not self.missing and not self.conflicts

    def reason(self) -> str:
        """Why the version is not sealed (empty when it is)."""
        why = [str(c) for c in self.conflicts]
        if self.missing:
            why.append(f"shards {list(self.missing)} of {self.world} have no complete holder")
        return "; ".join(why)

    def check(self, model: str) -> None:
        """Raise unless sealed: ConsistencyError on disagreement, else VersionUnavailable."""
        if self.conflicts:
            raise ConsistencyError(f"model {model!r} version {self.version}: {self.reason()}")
        if self.missing:
            raise VersionUnavailable(model, self.version, self.reason())


SPECS = "tensor specs"
LAYOUT = "layout id"


def _ranks(shards: Iterable[int]) -> str:
    ranks = sorted(set(shards))
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _conflict(what: str, values: dict[str, set[str]]) -> tuple[Conflict, ...]:
    if len(values) < 2:
        return ()
    # Listed by who holds each value, so the message reads the same whatever the digests.
    rows = sorted((tuple(sorted(o)), v) for v, o in values.items())
    return (Conflict(what, tuple((v, o) for o, v in rows)),)


def _by_rank(what: str, values: dict[bytes, list[ShardClaim]]) -> tuple[Conflict, ...]:
    """A conflict on a digest, each value named with the ranks that claim it."""
    return _conflict(what, {f"{v.hex()[:8] or '-'} ({_ranks(c.shard for c in cs)})":
                            {c.origin for c in cs} for v, cs in values.items()})


def seal_status(claims: Iterable[ShardClaim]) -> dict[int, Seal]:
    """Seal status of every version that ``claims`` (all about one model) mention."""
    by_version: dict[int, list[ShardClaim]] = defaultdict(list)
    for c in claims:
        by_version[c.version].append(c)
    out: dict[int, Seal] = {}
    for version, cs in sorted(by_version.items()):
        worlds: dict[str, set[str]] = defaultdict(set)
        layouts: dict[bytes, list[ShardClaim]] = defaultdict(list)
        schemas: dict[bytes, list[ShardClaim]] = defaultdict(list)
        manifests: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        for c in cs:
            worlds[str(c.world)].add(c.origin)
            layouts[c.layout_id].append(c)
            schemas[c.schema].append(c)
            manifests[c.shard][c.manifest_id.hex()].add(c.origin)
        conflicts = (_conflict("world", worlds) + _by_rank(LAYOUT, layouts)
                     + _by_rank(SPECS, schemas))
        for shard, ms in sorted(manifests.items()):
            conflicts += _conflict(f"manifest of shard {shard}", ms)
        world = cs[0].world if len(worlds) == 1 else None
        missing: tuple[int, ...] = ()
        if world is not None:
            covered = {c.shard for c in cs if c.complete}
            missing = tuple(s for s in range(world) if s not in covered)
        layout_id = cs[0].layout_id if len(layouts) == 1 else None
        schema = cs[0].schema if len(schemas) == 1 else None
        out[version] = Seal(version, world, layout_id, missing, conflicts, schema, tuple(cs))
    return out


@dataclass
class _ModelState:
    latest: int | None = None
    seals: dict[int, Seal] = field(default_factory=dict)
    sealed_manifests: dict[tuple[int, int], bytes] = field(default_factory=dict)
    """Secure mode: ``(version, shard) -> manifest id`` of every version seen sealed."""
    counted: frozenset[tuple[int, int, bytes, bytes]] = frozenset()


def _winning(claims: list[ShardClaim], state: _ModelState, window: int
             ) -> list[ShardClaim]:
    """The claims that count in secure mode (see the module docstring)."""
    ceiling = None if state.latest is None else state.latest + window
    best: dict[tuple[int, int], tuple[int, bytes]] = {}
    for c in claims:
        if ceiling is not None and c.version > ceiling:
            continue
        at = (c.version, c.shard)
        sealed = state.sealed_manifests.get(at)
        rank = (c.generation, c.manifest_id) if sealed is None else (0, sealed)
        if at not in best or rank < best[at]:
            best[at] = rank
    return [c for c in claims if (c.version, c.shard) in best
            and best[(c.version, c.shard)][1] == c.manifest_id]


class VersionView:
    """One peer's view of which versions are sealed; ``latest`` never goes backwards.

    Call :meth:`update` with a model's claims whenever the reference table changes
    for that model; wake ``wait_for_version`` waiters with what it returns.
    """

    def __init__(self, window: int | None = None) -> None:
        """``window``: secure mode's version window (None: insecure, every claim counts)."""
        self._models: dict[str, _ModelState] = {}
        self._window = window

    def update(self, model: str, claims: Iterable[ShardClaim]) -> tuple[int, ...]:
        """Take a new table snapshot of ``model``; return the versions sealed in it that
        are newer than every version reported before, ascending (each reported once)."""
        state = self._models.setdefault(model, _ModelState())
        claims = list(claims)
        if self._window is not None:
            # A seal is kept while anyone announces its version, even with another
            # manifest (then forgotten: a version nobody holds any more is decided
            # afresh, by the earliest publish, if it comes back).
            mentioned = {c.version for c in claims}
            state.sealed_manifests = {at: m for at, m in state.sealed_manifests.items()
                                      if at[0] in mentioned}
            claims = _winning(claims, state, self._window)
            state.counted = frozenset((c.version, c.shard, c.layout_id, c.manifest_id)
                                      for c in claims)
        state.seals = seal_status(claims)
        if self._window is not None:
            for c in claims:
                if state.seals[c.version].sealed:
                    state.sealed_manifests.setdefault((c.version, c.shard), c.manifest_id)
        floor = -1 if state.latest is None else state.latest
        newer = tuple(v for v, s in state.seals.items() if s.sealed and v > floor)
        if newer:
            state.latest = newer[-1]
        return newer

    def counted(self, model: str) -> frozenset[tuple[int, int, bytes, bytes]]:
        """Secure mode: the ``(version, shard, layout id, manifest id)`` announcements
        of ``model`` that counted in the latest snapshot."""
        state = self._models.get(model)
        return frozenset() if state is None else state.counted

    def latest(self, model: str) -> int | None:
        """The highest version of ``model`` ever seen sealed here (None if none)."""
        state = self._models.get(model)
        return None if state is None else state.latest

    def sealed(self, model: str) -> tuple[int, ...]:
        """Versions of ``model`` sealed in the latest snapshot, ascending."""
        state = self._models.get(model)
        return () if state is None else tuple(v for v, s in state.seals.items() if s.sealed)

    def unsealed(self, model: str) -> tuple[Seal, ...]:
        """Versions newer than ``latest`` that holders announce but that are not sealed:
        the publishes still in progress or stuck (see :meth:`Seal.reason`)."""
        state = self._models.get(model)
        if state is None:
            return ()
        floor = -1 if state.latest is None else state.latest
        return tuple(s for v, s in state.seals.items() if v > floor and not s.sealed)

    def status(self, model: str, version: int) -> Seal | None:
        """The seal status of a version in the latest snapshot (None: not announced)."""
        state = self._models.get(model)
        return None if state is None else state.seals.get(version)

    def require(self, model: str, version: int) -> Seal:
        """The seal of a version about to be fetched; raises unless it is sealed now."""
        seal = self.status(model, version)
        if seal is None:
            raise VersionUnavailable(model, version, "no live peer holds any shard of it")
        seal.check(model)
        return seal


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Which versions of one model must stay readable while peers drop their copies."""

    keep_latest: int = 1
    """The newest ``keep_latest`` sealed versions are retained.  The default, 1, keeps
    ``latest`` fetchable for joiners; more costs host memory on the last holders; 0
    retains only pins."""
    pins: frozenset[int] = frozenset()
    """Versions retained whatever their age (e.g. an evaluation checkpoint)."""
    offload: bool = True
    """The last holder of a retained shard copies it to host memory before dropping it.
    False refuses such drops with :class:`RetentionError` instead (for peers whose host
    memory is too small to take a model)."""

    def __post_init__(self) -> None:
        if isinstance(self.keep_latest, bool) or not isinstance(self.keep_latest, int) \
                or self.keep_latest < 0:
            raise LocalProtocolError(f"keep_latest must be an int >= 0, got {self.keep_latest!r}")
        if not isinstance(self.pins, frozenset) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in self.pins):
            raise LocalProtocolError(f"pins must be a frozenset of versions, got {self.pins!r}")
        if not isinstance(self.offload, bool):
            raise LocalProtocolError(f"offload must be a bool, got {self.offload!r}")

    def pin(self, version: int) -> RetentionPolicy:
        return replace(self, pins=self.pins | {version})

    def unpin(self, version: int) -> RetentionPolicy:
        return replace(self, pins=self.pins - {version})


def retained(sealed_versions: Iterable[int], policy: RetentionPolicy) -> frozenset[int]:
    """The versions ``policy`` keeps readable, given a model's currently sealed versions."""
    newest = heapq.nlargest(policy.keep_latest, set(sealed_versions))
    return frozenset(newest) | policy.pins


def must_offload(model: str, version: int, shard: int, me: str,
                 claims: Iterable[ShardClaim], policy: RetentionPolicy) -> bool:
    """Whether peer ``me`` must copy ``shard`` of ``version`` to host memory before
    dropping it: it is the last complete holder of a shard of a retained version.

    ``claims`` are all the claims about ``model`` in the current table (``me``'s own
    included).  Raises :class:`RetentionError` when the copy is needed but the policy
    does not allow offloading.
    """
    claims = list(claims)
    sealed = [v for v, s in seal_status(claims).items() if s.sealed]
    if version not in retained(sealed, policy):
        return False
    holders = {c.origin for c in claims if c.version == version and c.shard == shard
               and c.complete}
    if holders != {me}:
        return False
    if not policy.offload:
        raise RetentionError(
            f"{me} holds the last complete copy of shard {shard} of model {model!r} "
            f"version {version}, which is retained, and offloading to host memory is off: "
            "unpin it, lower keep_latest, or enable offload"
        )
    return True
