"""Coordinator election: rendezvous hashing, epochs, handover and soft state.

Theory of operation
-------------------
Election.  Every ``(model, version)`` has one *coordinator*: the member of the local
view with the highest rendezvous (HRW) score for that key.  A score depends only on the
key and the member's name, so peers with the same view agree without talking, and a
change of view moves only what it must: removing a member moves exactly the keys it
coordinated (each to its runner-up), adding one moves keys only to the newcomer.
:func:`rank` lists the runners-up (backup coordinators).  Ties between equal scores go
to the smaller name, so the order is total.

Stratified scores.  Plain HRW hashes each (key, member) pair independently, so loads
are balls in bins: with 1,000 peers and 10,000 versions (mean 10) the busiest peer
coordinates 2.0-2.4x the mean.  Versions of a model come in runs, so they are grouped in
blocks of ``BLOCK`` = 1024, and a member's score for version ``v`` is the pair
``(pi(v mod BLOCK), tiebreak)``, where ``pi`` is a pseudo-random permutation private to
(model, block, member).  Within a block every member holds each of the 1024 strata
exactly once, so no member is "strong" on more versions than another; this removes
about half the load variance: max/mean 1.6-2.1 at the size above (2.1 in ~2% of
seeds); keys scattered one per block get plain HRW's balance, no worse.  It is still
HRW -- a fixed score per (key, member), highest wins -- so both movement properties
hold exactly.  A bounded-load refinement would cap loads outright, but it places each
key by looking at the other keys' assignments: a leaving member's keys can push
unrelated keys past a cap, and the coordinator would depend on which versions a peer
knows of.  Virtual nodes do not help under HRW (each key still picks a peer uniformly).
Names and blocks are hashed once with BLAKE2b; the rest is a splitmix64 mix and a
4-round Feistel network over numpy ``uint64`` arrays, so results are identical in every
process (never Python's ``hash()``); 10,000 keys x 1,000 members take about 0.4 s.

Epochs.  While views differ, two peers may each believe they coordinate a version.  A
coordinator stamps its plans with an :class:`Epoch` ``(term, coordinator,
incarnation)``, compared in that order: a total order in which two epochs are equal
only if one incarnation of one coordinator issued both under one term.

1. A coordinator takes a version over with a term above every term it has seen: one
   Lamport clock per peer (:meth:`CoordinatorView.observe`) across all versions, so a
   term is never reused within an incarnation, even after stepping down and back.
2. A fetcher keeps, per version, the highest epoch it accepted (:class:`EpochTracker`).
   A lower epoch is STALE and ignored; the same epoch is ACCEPTed (a plan update); a
   higher epoch is a SWITCH, naming the epoch whose plan must be abandoned before the
   new one runs (verified chunks are kept; only who-pulls-from-whom is dropped).  So a
   fetcher runs one epoch at a time and only moves forward, whatever order plans arrive
   in and however many peers believe they coordinate.
3. A fetcher registers, with the highest epoch it accepted, only with the coordinator
   of its own view (:func:`route`): again whenever that changes, and whenever it accepts
   a plan from another coordinator.  A coordinator told of a higher epoch than its own
   moves to a fresh, higher term and re-stamps its plans (:meth:`CoordinatorView.register`),
   so once views agree the elected coordinator's plans win everywhere; a peer no longer
   elected steps down (:meth:`CoordinatorView.elect`) and its late plans are stale.
   While views still disagree, two coordinators may outbid each other; that costs plan
   churn (counted as switches), never safety.

Rule 2 is the safety property and holds under any views; rule 3 gives liveness once
membership converges.  :func:`split_view_trial` checks both with views that differ in
``d`` of the top-ranked members and plans delivered in random order.

Soft state.  A coordinator keeps only a :class:`CoordinatorState` per version: its epoch
and the registered fetchers.  It is rebuilt from the reference table when a version
moves to this peer, never handed over; the old coordinator simply drops its copy.
"""

from __future__ import annotations

import enum
import hashlib
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from ..bounds import U63, PeerName
from ..errors import LocalProtocolError
from ..model import VersionKey

BLOCK_BITS = 10
BLOCK = 1 << BLOCK_BITS
"""Versions per stratification block: about the number of peers where it helps most."""

U64 = npt.NDArray[np.uint64]
R = TypeVar("R")

_HALF = np.uint64(BLOCK_BITS // 2)
_HALF_MASK = np.uint64((1 << (BLOCK_BITS // 2)) - 1)
_TIE_SHIFT = np.uint64(BLOCK_BITS)
_PERM_SHIFT = np.uint64(64 - BLOCK_BITS)
_ROUND_KEYS = tuple(np.uint64(k) for k in (
    0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89))
_TIE_KEY = np.uint64(0x452821E638D01377)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_MAX_CELLS = 1 << 20  # scores computed per numpy pass (8 MiB per temporary)


def _mix(x: U64) -> U64:
    """splitmix64's finaliser: a bijective 64-bit mix (array arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def _blake64(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"tensorhub-ring").digest()
    return int.from_bytes(digest, "little")


@lru_cache(maxsize=1 << 16)
def _name_hash(name: str) -> int:
    return _blake64(f"peer\0{name}")


@lru_cache(maxsize=1 << 12)
def _block_hash(model: str, block: int) -> int:
    return _blake64(f"block\0{block}\0{model}")


def _scores(model: str, block: int, offsets: U64, names: Sequence[str]) -> U64:
    """Scores of ``names`` (columns) for versions ``block * BLOCK + offsets`` (rows)."""
    hashes = np.fromiter((_name_hash(n) for n in names), np.uint64, len(names))
    seeds = _mix(hashes ^ np.uint64(_block_hash(model, block)))[None, :]
    rows = offsets[:, None]
    left, right = rows >> _HALF, rows & _HALF_MASK
    for key in _ROUND_KEYS:  # Feistel rounds: a permutation of [0, BLOCK) per seed
        left, right = right, left ^ (_mix(seeds ^ key ^ right) & _HALF_MASK)
    stratum = (left << _HALF) | right
    tiebreak = _mix(seeds ^ _mix(rows ^ _TIE_KEY))
    return (stratum << _PERM_SHIFT) | (tiebreak >> _TIE_SHIFT)


def _members(live: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(live))
    if not names:
        raise LocalProtocolError("no live members to elect a coordinator from")
    return names


def _winners(scores: U64, names: Sequence[str]) -> list[str]:
    """Per row, the name with the highest score; an exact tie goes to the smaller name."""
    best = scores.argmax(axis=1)
    top = scores[np.arange(len(best)), best][:, None]
    out = [names[b] for b in best.tolist()]
    for row in np.flatnonzero((scores == top).sum(axis=1) > 1).tolist():
        out[row] = min(names[j] for j in np.flatnonzero(scores[row] == top[row]).tolist())
    return out


def _key_scores(key: VersionKey, names: Sequence[str]) -> U64:
    offsets = np.array([key.version & (BLOCK - 1)], np.uint64)
    return _scores(key.model, key.version >> BLOCK_BITS, offsets, names).reshape(-1)


def score(key: VersionKey, name: str) -> int:
    """The rendezvous score of ``name`` for ``key`` (an unsigned 64-bit int)."""
    return int(_key_scores(key, [name])[0])


def coordinators(keys: Iterable[VersionKey], live: Iterable[str]) -> list[str]:
    """The coordinator of each key (in order) among ``live``; the bulk form of
    :func:`coordinator`."""
    keys = list(keys)
    names = _members(live)
    width = len(names)
    groups: dict[tuple[str, int], list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault((k.model, k.version >> BLOCK_BITS), []).append(i)
    out = [""] * len(keys)
    step = max(1, _MAX_CELLS // width)
    for (model, block), idx in groups.items():
        for lo in range(0, len(idx), step):
            part = idx[lo:lo + step]
            offsets = np.fromiter((keys[i].version & (BLOCK - 1) for i in part),
                                  np.uint64, len(part))
            for i, name in zip(part, _winners(_scores(model, block, offsets, names), names),
                               strict=True):
                out[i] = name
    return out


def coordinator(key: VersionKey, live: Iterable[str]) -> str:
    """The live member with the highest score for ``key``."""
    return coordinators([key], live)[0]


def rank(key: VersionKey, live: Iterable[str], k: int) -> list[str]:
    """The top ``k`` members for ``key``, best first: the coordinator, then its backups."""
    names = _members(live)
    scores = dict(zip(names, _key_scores(key, names).tolist(), strict=True))
    return sorted(names, key=lambda n: (-scores[n], n))[:max(k, 0)]


class Local(enum.Enum):
    """Sentinel of :func:`route`: this peer coordinates the key itself."""

    LOCAL = "local"


LOCAL = Local.LOCAL


def route(key: VersionKey, live: Iterable[str], me: str) -> Local | str:
    """Where a request about ``key`` goes: :data:`LOCAL`, or the peer to forward it to.

    ``me`` always counts as live: a peer never routes around itself.
    """
    target = coordinator(key, [*live, me])
    return LOCAL if target == me else target


def moved(keys: Iterable[VersionKey], before: Iterable[str],
          after: Iterable[str]) -> dict[VersionKey, tuple[str, str]]:
    """The keys whose coordinator differs between two views: ``key -> (old, new)``."""
    keys = list(keys)
    old, new = coordinators(keys, before), coordinators(keys, after)
    return {k: (a, b) for k, a, b in zip(keys, old, new, strict=True) if a != b}


# -- epochs ---------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Epoch:
    """Stamp on every plan: compared by term, then coordinator name, then incarnation."""

    term: U63
    coordinator: PeerName
    incarnation: U63


MESSAGES = (Epoch,)


class Verdict(enum.Enum):
    ACCEPT = "accept"  # first plan of the version, or more of the current epoch
    SWITCH = "switch"  # a newer epoch: abandon the running plan, then run this one
    STALE = "stale"    # older than an accepted epoch: ignore


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    abandon: Epoch | None = None
    """On SWITCH: the epoch whose plan must be abandoned first."""


@dataclass(frozen=True)
class TrackerStatistics:
    versions: int
    accepted: int
    switches: int
    stale: int


class EpochTracker:
    """A fetcher's side: per version, the highest epoch accepted; only moves forward."""

    def __init__(self) -> None:
        self._current: dict[VersionKey, Epoch] = {}
        self._accepted = self._switches = self._stale = 0

    def offer(self, key: VersionKey, epoch: Epoch) -> Admission:
        """Judge a plan stamped ``epoch`` for ``key``."""
        current = self._current.get(key)
        if current is None or epoch == current:
            self._current[key] = epoch
            self._accepted += 1
            return Admission(Verdict.ACCEPT)
        if epoch < current:
            self._stale += 1
            return Admission(Verdict.STALE)
        self._current[key] = epoch
        self._switches += 1
        return Admission(Verdict.SWITCH, abandon=current)

    def current(self, key: VersionKey) -> Epoch | None:
        return self._current.get(key)

    def retire(self, key: VersionKey) -> None:
        """Forget ``key`` once the version is retired; until then the entry is what
        keeps late, stale plans out."""
        self._current.pop(key, None)

    def statistics(self) -> TrackerStatistics:
        return TrackerStatistics(len(self._current), self._accepted, self._switches,
                                 self._stale)


# -- the coordinator's side -----------------------------------------------------------


class CoordinatorState(Generic[R]):
    """Soft state of one coordinated version: its epoch and the registered fetchers.

    Built from ``(fetcher name, registration)`` pairs read off the reference table; the
    epoch is moved forward only by :class:`CoordinatorView`.
    """

    def __init__(self, key: VersionKey, epoch: Epoch,
                 registrations: Iterable[tuple[str, R]] = ()) -> None:
        self.key = key
        self.epoch = epoch
        self._fetchers = dict(registrations)

    @property
    def fetchers(self) -> Mapping[str, R]:
        return MappingProxyType(self._fetchers)

    def register(self, name: str, registration: R) -> None:
        self._fetchers[name] = registration

    def unregister(self, name: str) -> None:
        self._fetchers.pop(name, None)


@dataclass(frozen=True)
class Handover:
    gained: tuple[VersionKey, ...]
    lost: tuple[VersionKey, ...]


@dataclass(frozen=True)
class ViewStatistics:
    coordinated: int
    term: int
    takeovers: int
    bumps: int


class CoordinatorView(Generic[R]):
    """One peer's coordinator role: the versions it coordinates and their epochs."""

    def __init__(self, me: str, incarnation: int) -> None:
        self.me = me
        self.incarnation = incarnation
        self._term = 0
        self._states: dict[VersionKey, CoordinatorState[R]] = {}
        self._takeovers = self._bumps = 0

    def observe(self, epoch: Epoch) -> None:
        """Lamport catch-up: future terms exceed ``epoch.term``."""
        self._term = max(self._term, epoch.term)

    def _next_epoch(self) -> Epoch:
        # Terms stop at the wire's bound (a remote epoch can drive us there): past it
        # no receiver would decode our replies.
        self._term = min(self._term + 1, 2**63 - 1)
        return Epoch(self._term, self.me, self.incarnation)

    def state(self, key: VersionKey) -> CoordinatorState[R] | None:
        return self._states.get(key)

    def adopt(self, key: VersionKey, registrations: Iterable[tuple[str, R]]) -> None:
        """Take over ``key``, which the caller found this peer wins, without re-running
        the election of every other version."""
        if key not in self._states:
            self._states[key] = CoordinatorState(key, self._next_epoch(), registrations)
            self._takeovers += 1

    def drop(self, key: VersionKey) -> None:
        self._states.pop(key, None)

    def elect(self, keys: Iterable[VersionKey], live: Iterable[str],
              registrations: Callable[[VersionKey], Iterable[tuple[str, R]]]) -> Handover:
        """Re-run the election for every known version after a view change.

        Versions this peer now wins are taken over under a fresh epoch, their state
        rebuilt from ``registrations(key)``; versions it lost, or that are no longer in
        ``keys``, are dropped.
        """
        keys = list(dict.fromkeys(keys))
        won = {k for k, c in zip(keys, coordinators(keys, [*live, self.me]), strict=True)
               if c == self.me}
        lost = tuple(k for k in self._states if k not in won)
        for k in lost:
            del self._states[k]
        gained = tuple(k for k in keys if k in won and k not in self._states)
        for k in gained:
            self._states[k] = CoordinatorState(k, self._next_epoch(), registrations(k))
        self._takeovers += len(gained)
        return Handover(gained, lost)

    def register(self, key: VersionKey, name: str, registration: R,
                 seen: Epoch | None) -> Epoch:
        """Record a fetcher that has accepted up to ``seen``; returns the epoch to stamp
        plans with.  It differs from the previous one when ``seen`` was newer: then every
        registered fetcher needs a re-stamped plan."""
        state = self._states.get(key)
        if state is None:
            raise LocalProtocolError(f"{self.me} does not coordinate {key}; route it")
        state.register(name, registration)
        if seen is not None:
            self.observe(seen)
        if seen is not None and seen > state.epoch:
            state.epoch = self._next_epoch()
            self._bumps += 1
        return state.epoch

    def statistics(self) -> ViewStatistics:
        return ViewStatistics(len(self._states), self._term, self._takeovers, self._bumps)


# -- simulator figures ----------------------------------------------------------------


def _peer_names(num_peers: int, rng: random.Random) -> list[str]:
    return [f"peer-{i}-{rng.getrandbits(32):08x}" for i in range(num_peers)]


def _versions(num_versions: int, rng: random.Random) -> list[VersionKey]:
    """A run of consecutive versions of one model, from a random start."""
    model = f"model-{rng.getrandbits(32):08x}"
    start = rng.randrange(1 << 32)
    return [VersionKey(model, start + v) for v in range(num_versions)]


def coord_moved_extra(num_peers: int, num_versions: int, rng: random.Random) -> int:
    """Versions whose coordinator moved without having to, over every version: when a
    random peer leaves only its versions may move, and when a new one joins versions
    may move only to it.  The only correct answer is 0."""
    names = _peer_names(num_peers, rng)
    keys = _versions(num_versions, rng)
    gone, joiner = rng.choice(names), f"joiner-{rng.getrandbits(32):08x}"
    before = coordinators(keys, names)
    after_leave = coordinators(keys, [n for n in names if n != gone])
    after_join = coordinators(keys, [*names, joiner])
    return sum((old != new and old != gone) + (old != new2 and new2 != joiner)
               for old, new, new2 in zip(before, after_leave, after_join, strict=True))


def coord_max_over_mean(num_peers: int, num_versions: int, rng: random.Random) -> float:
    """Busiest coordinator's load over the mean load (versions per peer)."""
    loads = Counter(coordinators(_versions(num_versions, rng), _peer_names(num_peers, rng)))
    return max(loads.values()) * num_peers / num_versions


@dataclass(frozen=True)
class SplitViewTrial:
    dual_epoch_fetchers: int
    """Fetchers that ran plans of two epochs at once or went back to an older one: 0."""
    naive_dual_fetchers: int
    """Fetchers sent plans of two or more epochs: what an epoch-blind fetcher would run."""
    coordinators: int
    """Peers that took the version over at some point."""
    stale_plans: int
    switches: int
    unconverged: int
    """Fetchers not on the elected coordinator's final epoch once views agree: 0."""


_VIEW_CHANGES = 3
_Message = tuple[str, str, str, Epoch | None]  # (kind, to, sender, epoch)


def split_view_trial(rng: random.Random, num_peers: int, num_fetchers: int,
                     d: int) -> SplitViewTrial:
    """One version, ``num_peers`` peers.  The favourite coordinator has crashed in half
    the trials; three times, every peer's view differs from the truth in ``d`` of the
    top ``2d + 1`` candidates (missing live ones, or still listing the dead one), then
    views agree.  Every message is delivered in random order, view changes land while
    messages are in flight, and fetchers are checked against the epoch rules."""
    names = _peer_names(num_peers, rng)
    key = _versions(1, rng)[0]
    d = min(d, (num_peers - 1) // 2)
    contenders = rank(key, names, 2 * d + 2)  # every view's coordinator is one of them
    top = contenders[:-1]
    dead = {top[0]} if rng.random() < 0.5 else set()
    live = [n for n in names if n not in dead]
    fetchers = rng.sample(live, min(num_fetchers, len(live)))
    roles = {n: CoordinatorView[None](n, 1) for n in live}
    trackers = {f: EpochTracker() for f in fetchers}
    targets: dict[str, Local | str] = {}  # where each fetcher's view routes the version
    running: dict[str, Epoch | None] = dict.fromkeys(fetchers)
    received: dict[str, set[Epoch]] = {f: set() for f in fetchers}
    dual: set[str] = set()
    pending: list[_Message] = []

    def from_reference_table(_: VersionKey) -> list[tuple[str, None]]:
        return [(f, None) for f in fetchers]

    def register(f: str) -> None:
        target = targets[f]
        pending.append(("register", f if target is LOCAL else target, f,
                        trackers[f].current(key)))

    def change_views(views: dict[str, list[str]]) -> None:
        for n in contenders:
            role = roles.get(n)
            if role is not None and role.elect([key], views[n], from_reference_table).gained:
                state = role.state(key)
                assert state is not None
                pending.extend(("plan", f, n, state.epoch) for f in state.fetchers)
        for f in fetchers:
            targets[f] = route(key, views[f], f)
            register(f)

    def split_views() -> dict[str, list[str]]:
        out = {}
        for n in live:
            diff = set(rng.sample([c for c in top if c != n], d))
            out[n] = [m for m in live if m not in diff] + sorted(diff & dead)
        return out

    phases = [split_views() for _ in range(_VIEW_CHANGES)] + [dict.fromkeys(live, live)]
    change_views(phases.pop(0))
    budget = rng.randrange(len(pending) + 1)
    while pending or phases:
        if phases and (budget <= 0 or not pending):
            change_views(phases.pop(0))
            budget = rng.randrange(len(pending) + 1)
            continue
        budget -= 1
        i = rng.randrange(len(pending))
        pending[i], pending[-1] = pending[-1], pending[i]
        kind, to, sender, epoch = pending.pop()
        if kind == "plan":
            assert epoch is not None
            received[to].add(epoch)
            admission = trackers[to].offer(key, epoch)
            if admission.verdict is Verdict.STALE:
                continue
            was = running[to]
            if (was is not None and epoch < was) or (
                    admission.verdict is Verdict.ACCEPT and was not in (None, epoch)) or (
                    admission.verdict is Verdict.SWITCH and admission.abandon != was):
                dual.add(to)
            running[to] = epoch
            if epoch != was and targets[to] not in (LOCAL, epoch.coordinator):
                register(to)
            continue
        role = roles.get(to)
        state = role.state(key) if role is not None else None
        if role is None or state is None:
            continue  # dead, or not (or no longer) coordinating: the fetcher re-registers
        old = state.epoch
        new_epoch = role.register(key, sender, None, epoch)
        recipients = list(state.fetchers) if new_epoch != old else [sender]
        pending.extend(("plan", f, to, new_epoch) for f in recipients)

    final = roles[coordinator(key, live)].state(key)
    assert final is not None
    return SplitViewTrial(
        dual_epoch_fetchers=len(dual),
        naive_dual_fetchers=sum(len(r) > 1 for r in received.values()),
        coordinators=sum(r.statistics().takeovers > 0 for r in roles.values()),
        stale_plans=sum(t.statistics().stale for t in trackers.values()),
        switches=sum(t.statistics().switches for t in trackers.values()),
        unconverged=sum(t.current(key) != final.epoch for t in trackers.values()),
    )


def dual_epoch_plans(rng: random.Random, num_peers: int, num_fetchers: int, d: int) -> int:
    """Fetchers that executed plans of two epochs for one version (see
    :func:`split_view_trial`); the only correct answer is 0."""
    return split_view_trial(rng, num_peers, num_fetchers, d).dual_epoch_fetchers
