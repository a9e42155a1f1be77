"""Staged flips and model-parallel groups: fetch the next version while the live one keeps
serving, then switch to it in one step -- alone (:class:`Rollout`) or with every rank of
a tensor-parallel engine at once (:func:`open_group`).

Theory of operation
-------------------
Staging is :mod:`tensorhub.peer.rollout`: a group stages and switches through one
:class:`~tensorhub.peer.rollout.Rollout` per rank.

Groups.  :class:`Group` is the trio shell of one rank's
:class:`~tensorhub.protocol.groups.GroupMember` (read that module first).  Group
messages travel as :class:`~tensorhub.protocol.groups.GroupEnvelope` control messages;
the peer's dispatcher hands each to :meth:`Group._deliver`, which only queues it (bounded;
when full it is dropped and counted -- the protocol resends), so nothing this shell does
runs in, or can break, the peer's receive task.  Our tasks, in the group's own nursery:
the *receiver* decodes envelopes (malformed ones are counted, never fatal) and feeds the
member; the *ticker* calls ``tick`` at ``next_deadline``; the *watcher* tells the member
which ranks' peers membership says are live; the *worker* runs staging fetches, drops
and releases one after the other, so buffers are free before they are reused.

Effects.  ``Stage(round, v)``: if ``v`` is live, this rank is ready at once; if the
staging in hand holds (or is fetching) ``v``, it serves this round too; otherwise that
staging is cancelled and dropped and the worker fetches ``v`` with the group's layout
(into a spare buffer set if there is one), then reports ``staged``.  ``Switch``: the
staging becomes live in one step (a synchronous swap in the shell), and the previous
live version is released in the background (:mod:`.release`: hidden from new readers at
the swap; the worker waits for its drain before it reuses the buffers).  ``Discard``:
the round's error goes to every waiter; a failed staging is dropped, a good or
still-running one is kept, unseen by the engine, for a later round of the same version
(a round aborted because another rank was slow would otherwise restart every fetch from
zero); a Stage of another version, or closing the group, drops it.

Waiting.  :meth:`Group.fetch_latest` at the leader proposes the version its own view
calls latest and waits for that round's outcome; elsewhere it returns the newest outcome
since the caller's previous call, or waits for the next one.  Success returns the new
live version; an abort raises :class:`GroupSwitchError` with the leader's text, the same
at every rank, and every rank keeps its live version.  A rank's live version only changes
at ``Switch``, which the member emits only for a round every rank staged and the leader
committed: a group never runs with mixed versions.

With ``spare`` buffers the group double-buffers: each released live set and each dropped
staging set is reused for the next staging, so after the first switches no new memory is
taken.  Then stop using a previous live version's tensors before the next round starts.
Closing the group drops its staging; the live version stays held and served until the
caller unpublishes it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import trio

from ..errors import LocalProtocolError, RemoteProtocolError, TensorHubError, VersionUnavailable
from ..protocol import codec
from ..protocol.groups import (
    Abort,
    Commit,
    Discard,
    Failed,
    GroupConfig,
    GroupEnvelope,
    GroupMember,
    Output,
    Promise,
    Propose,
    Ready,
    Round,
    Send,
    Stage,
    Switch,
)
from ..protocol.sharding import Sharding
from ..read.report import Fetched
from .node import Peer
from .release import Release
from .rollout import Rollout, Staged

INBOX = 256
"""Group envelopes queued for the receiver; beyond that they are dropped and counted (the
protocol resends every ``GroupConfig.retry``)."""
KEPT = 64
"""Outcomes remembered by round, and release errors kept, per group (oldest forgotten)."""
_WIRE = (Propose, Promise, Ready, Failed, Commit, Abort)


class GroupSwitchError(TensorHubError):
    """A group round aborted: every rank raises the same text and keeps its live version."""


# -- groups ---------------------------------------------------------------------------------

def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error]


@dataclass
class _Staging:
    """The worker's staging of ``version``; ``round`` is the round to report it to (None
    once that round is over and no newer one asked for this version)."""

    version: int
    round: Round | None
    scope: trio.CancelScope
    staged: Staged | None = None
    error: str | None = None
    done: bool = False


@dataclass(frozen=True)
class _Outcome:
    round: Round
    version: int
    live: Fetched | None
    error: str


@dataclass(frozen=True)
class GroupStats:
    """A snapshot of one rank's group state."""

    name: str
    rank: int
    leader: int
    live_version: int | None
    staging: str
    """``"v7 fetching"`` / ``"v7 ready"`` / ``"v7 failed"``, or empty."""
    switches: int
    aborts: int
    last_error: str
    malformed_dropped: int
    """Envelopes that did not decode to a valid group message of this group."""
    inbox_dropped: int
    """Envelopes dropped because the receiver's queue was full."""
    unsent: int
    """Messages not sent because their destination was not live in our view."""
    release_errors: tuple[str, ...]


class Group:
    """One rank of a model-parallel consuming group.  Create it with :func:`open_group`."""

    def __init__(self, peer: Peer, name: str, members: Sequence[str], rank: int, *,
                 model: str, layout: Sharding | None, config: GroupConfig,
                 spare: Mapping[str, Any] | None, boot: int) -> None:
        self.peer = peer
        self.name = name
        self.members = tuple(members)
        self.rank = rank
        self.rollout = Rollout(peer, model, layout=layout)
        self._config = config
        self._member = GroupMember(members, rank, config=config, boot=boot)
        self._inbox_tx, self._inbox_rx = trio.open_memory_channel[GroupEnvelope](INBOX)
        self._live_ranks = frozenset(range(len(self.members)))  # the member's assumption
        self._joined: set[int] = {rank}
        """Ranks whose peers this one has seen live at least once."""
        self._joined_event = trio.Event()
        self._wake_ticker = trio.Event()
        self._staging: _Staging | None = None
        self._jobs: deque[tuple[str, Any]] = deque()
        """Worker jobs, run in order.  Bounded by the protocol, not by a limit: each
        Stage, Switch or Discard adds at most two, and a Stage cancels the staging before
        it, so the worker never sits on a superseded fetch."""
        self._jobs_added = trio.Event()
        self._recycle = spare is not None
        self._pool: list[Mapping[str, Any]] = [spare] if spare is not None else []
        self._last: _Outcome | None = None
        self._by_round: dict[Round, _Outcome] = {}
        self._outcomes = self._delivered = 0
        self._outcome_event = trio.Event()
        self._switches = self._aborts = 0
        self._malformed = self._inbox_dropped = self._unsent = 0
        self._release_errors: deque[str] = deque(maxlen=KEPT)
        self.bad_inputs: deque[str] = deque(maxlen=KEPT)

    @property
    def live(self) -> Fetched | None:
        """This rank's live version and tensors (None before the first switch)."""
        return self.rollout.live

    async def fetch_latest(self, *, timeout: float | None = None) -> Fetched:
        """Switch the whole group to the latest version (see the module docstring) and
        return this rank's new live version; :class:`GroupSwitchError` if the round
        aborted, :class:`trio.TooSlowError` after ``timeout`` seconds without an outcome.
        First it waits (``GroupConfig.join_grace``) until every rank's peer has been
        seen live."""
        # A round can end before anything is awaited (a rank seen live before is gone):
        # still a checkpoint, so an engine retrying in a loop lets its peer run.
        await trio.lowlevel.checkpoint()
        with trio.fail_after(timeout) if timeout is not None else nullcontext():
            # A group forms as its ranks' peers join the mesh: wait (up to join_grace) for
            # ranks never seen live yet, so that a rank still starting neither aborts the
            # round nor makes another rank believe itself the leader.  A rank seen live
            # before and gone since aborts a round at once.
            with trio.move_on_after(self._config.join_grace):
                while len(self._joined) < len(self.members):
                    self._check_live()
                    if len(self._joined) < len(self.members):
                        with trio.move_on_after(self.peer.config.probe_interval):
                            await self._joined_event.wait()
            if self._member.is_leader:
                if not self._member.running:
                    version = self.peer.control.latest(self.rollout.model)
                    if version is None:
                        raise VersionUnavailable(self.rollout.model, "latest",
                                                 "no sealed version is known")
                    self._apply(self._member.start(trio.current_time(), version))
                led = self._member.status().led
                while led not in self._by_round:
                    await self._outcome_event.wait()
                outcome = self._by_round[led]
            else:
                while self._outcomes == self._delivered:
                    await self._outcome_event.wait()
                assert self._last is not None
                outcome = self._last
        self._delivered = self._outcomes
        if outcome.live is None:
            raise GroupSwitchError(outcome.error)
        return outcome.live

    def statistics(self) -> GroupStats:
        """A frozen snapshot of this rank's group state and counters."""
        st = self._staging
        phase = "" if st is None else f"v{st.version} " + (
            "fetching" if not st.done else "failed" if st.error is not None else "ready")
        return GroupStats(
            self.name, self.rank, self._member.leader,
            None if self.live is None else self.live.version, phase, self._switches,
            self._aborts, "" if self._last is None else self._last.error, self._malformed,
            self._inbox_dropped, self._unsent, tuple(self._release_errors))

    # -- inputs ---------------------------------------------------------------------------

    def _deliver(self, envelope: GroupEnvelope) -> None:
        """Called by the peer's dispatcher: queue only, never block or raise."""
        try:
            self._inbox_tx.send_nowait(envelope)
        except trio.WouldBlock:
            self._inbox_dropped += 1

    def _count_bad(self, what: str) -> None:
        self._malformed += 1
        self.bad_inputs.append(what)

    async def _receive(self) -> None:
        max_bytes = self.peer.config.max_message_bytes
        async for env in self._inbox_rx:
            try:
                msg = codec.decode(env.body, max_bytes)
                if not isinstance(msg, _WIRE):
                    raise RemoteProtocolError(f"{type(msg).__name__} is not a group message")
                if not (0 <= msg.sender < len(self.members)
                        and self.members[msg.sender] == env.sender):
                    raise RemoteProtocolError(f"peer {env.sender!r} speaks as rank {msg.sender}")
                out = self._member.receive(trio.current_time(), msg)
            except RemoteProtocolError as exc:
                self._count_bad(f"group {self.name!r} message from {env.sender!r}: {exc}")
                continue
            except Exception as exc:  # a bug on remote input: counted, the group goes on
                self.peer.internal_error(f"group {self.name!r} message from {env.sender!r}: "
                                         f"{type(exc).__name__}: {exc}", exc)
                continue
            self._apply(out)

    async def _tick(self) -> None:
        while True:
            with trio.move_on_at(self._member.next_deadline()):
                await self._wake_ticker.wait()
            self._wake_ticker = trio.Event()
            now = trio.current_time()
            if now >= self._member.next_deadline():
                self._apply(self._member.tick(now))

    def _check_live(self) -> None:
        """Tell the member which ranks' peers membership now says are live."""
        membership = self.peer.control.membership
        live = frozenset(k for k, name in enumerate(self.members)
                         if k == self.rank or membership.is_live(name))
        if not live <= self._joined:
            self._joined |= live
            self._joined_event.set()
            self._joined_event = trio.Event()
        if live != self._live_ranks:
            self._live_ranks = live
            self._apply(self._member.set_live(trio.current_time(), live))

    async def _watch(self) -> None:
        while True:  # membership news does not always change the table: poll as well
            with trio.move_on_after(self.peer.config.probe_interval):
                await self.peer.wait_changed()
            self._check_live()

    # -- outputs --------------------------------------------------------------------------

    def _apply(self, out: list[Output]) -> None:
        for o in out:
            if isinstance(o, Send):
                env = GroupEnvelope(self.name, self.peer.info.name,
                                    codec.encode(o.msg, self.peer.config.max_message_bytes))
                if not self.peer.send_to(o.dest, env):
                    self._unsent += 1
            elif isinstance(o, Stage):
                self._on_stage(o)
            elif isinstance(o, Switch):
                self._on_switch(o)
            else:
                self._on_discard(o)
        self._wake_ticker.set()  # the deadline may have moved

    def _on_stage(self, o: Stage) -> None:
        live, cur = self.live, self._staging
        if live is not None and live.version == o.version:
            self._replace_staging(None)
            self._apply(self._member.staged(trio.current_time(), o.round, None))
        elif cur is not None and cur.version == o.version and cur.error is None:
            cur.round = o.round  # fetched or fetching: it serves this round too
            if cur.done:
                self._apply(self._member.staged(trio.current_time(), o.round, None))
        else:
            st = _Staging(o.version, o.round, trio.CancelScope())
            self._replace_staging(st)
            self._add_job("stage", st)

    def _on_switch(self, o: Switch) -> None:
        st, live = self._staging, self.live
        if st is not None and st.round == o.round and st.staged is not None:
            self._staging = None
            release = self.rollout.switch_nowait(st.staged)
            if release is not None:
                self._add_job("release", release)
        elif live is None or live.version != o.version:
            raise LocalProtocolError(f"switch to version {o.version} in round {o.round} "
                                     f"without a staging of it")
        self._switches += 1
        self._record(_Outcome(o.round, o.version, self.live, ""))

    def _on_discard(self, o: Discard) -> None:
        st = self._staging
        if st is not None and st.round == o.round:
            if st.error is not None:
                self._replace_staging(None)
            else:
                st.round = None  # kept for a later round of this version
        self._aborts += 1
        self._record(_Outcome(o.round, o.version, None, o.error))

    def _record(self, outcome: _Outcome) -> None:
        self._last = outcome
        self._by_round[outcome.round] = outcome
        while len(self._by_round) > KEPT:
            del self._by_round[next(iter(self._by_round))]
        self._outcomes += 1
        self._outcome_event.set()
        self._outcome_event = trio.Event()

    def _replace_staging(self, new: _Staging | None) -> None:
        cur, self._staging = self._staging, new
        if cur is not None:
            cur.round = None
            cur.scope.cancel()
            self._add_job("drop", cur)

    # -- the worker -----------------------------------------------------------------------

    def _add_job(self, kind: str, arg: Any) -> None:
        self._jobs.append((kind, arg))
        self._jobs_added.set()

    async def _work(self) -> None:
        while True:
            while not self._jobs:
                self._jobs_added = trio.Event()
                await self._jobs_added.wait()
            kind, arg = self._jobs.popleft()
            if kind == "stage":
                await self._stage(arg)
            elif kind == "drop":
                await self._drop(arg)
            else:
                await self._release(arg)

    async def _stage(self, st: _Staging) -> None:
        into = self._pool.pop() if self._pool else None
        with st.scope:
            try:
                st.staged = await self.rollout.stage(st.version, into=into)
            except* (TensorHubError, OSError) as group:  # fetches raise them in groups
                st.error = "; ".join(str(e) or type(e).__name__ for e in _leaves(group))
        st.done = True
        if st.staged is None and into is not None:
            self._pool.append(into)  # a fetch that failed has hidden and drained it
        if st is self._staging and st.round is not None:
            self._apply(self._member.staged(trio.current_time(), st.round, st.error))

    async def _drop(self, st: _Staging) -> None:
        if st.staged is None:
            return
        try:
            freed = await st.staged.discard()
        except TensorHubError as exc:
            self._release_errors.append(f"dropping staged version {st.version}: {exc}")
            return
        if freed and self._recycle:
            self._pool.append(st.staged.fetched.tensors)

    async def _release(self, release: Release) -> None:
        freed = await release.wait()
        if freed is None:
            self._release_errors.append(f"releasing version {release.version}: "
                                        f"{release.error}")
        elif self._recycle:
            self._pool.append(freed)

    async def _close(self) -> None:
        """Finish queued drops and releases and drop the staging (the live version stays)."""
        self._replace_staging(None)
        with trio.move_on_after(self.peer.config.stall_timeout):
            while self._jobs:
                kind, arg = self._jobs.popleft()
                if kind == "drop":
                    await self._drop(arg)
                elif kind == "release":
                    await self._release(arg)


@asynccontextmanager
async def open_group(peer: Peer, name: str, members: Sequence[str], rank: int, *,
                     model: str, layout: Sharding | None = None,
                     config: GroupConfig | None = None,
                     spare: Mapping[str, Any] | None = None,
                     boot: int | None = None) -> AsyncIterator[Group]:
    """Run rank ``rank`` of the consuming group ``name`` (peer ``members[k]`` is rank
    ``k``; ``members[rank]`` must be ``peer``) for ``model``, fetching its slices with
    ``layout`` (usually ``Sharding(rank, len(members), ...)``).  ``spare`` is a buffer
    set (tensor name -> array) to stage into; with it the group double-buffers.
    ``config`` sets the round timeout and resend interval (default :class:`GroupConfig`).
    ``boot`` tells incarnations of a rank apart (default: microseconds since the epoch)."""
    if not 0 <= rank < len(members) or members[rank] != peer.info.name:
        raise LocalProtocolError(f"rank {rank} of {list(members)!r} is not peer "
                                 f"{peer.info.name!r}")
    group = Group(peer, name, members, rank, model=model, layout=layout,
                  config=config or GroupConfig(), spare=spare,
                  boot=time.time_ns() // 1000 if boot is None else boot)
    group._check_live()
    with peer.group_inbox(name, group._deliver):  # refused when the group is open here
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(group._receive)
                nursery.start_soon(group._tick)
                nursery.start_soon(group._watch)
                nursery.start_soon(group._work)
                try:
                    yield group
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await group._close()
