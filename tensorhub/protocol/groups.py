"""Model-parallel groups: all ranks of a consuming group switch versions together.

Theory of operation
-------------------
A group is ``size`` ranks (e.g. the four TP ranks of one engine), rank ``k`` being peer
``members[k]``, each running a :class:`GroupMember`.  The *leader* is the lowest rank a
member believes live.  A leader starts a *round*: it proposes the version its own
:class:`~.versions.VersionView` names (one view decides for all ranks).  Each rank stages
it (fetches its slices into staging while live buffers keep serving) and votes ``Ready``
or ``Failed``.  With all ``size`` votes ready the leader commits; on a failed vote, a rank
leaving, or the deadline, it aborts with one error text.  Commit -> every rank swaps
staging into live (``Switch``); abort -> every rank drops staging and raises the error
(``Discard``).  A round needs every rank live, so only rank 0 can lead one that commits;
while rank 0 is dead the group cannot switch (its engine is missing a GPU anyway).

Rounds are ballots: a :class:`Round` is ``(count, boot)``, ordered as a pair, of rank
``count % size``'s incarnation ``boot``; so no two proposals, even by one rank before and
after a restart, share a round.  A leader counts above every round it has seen.  A member
accepts a proposal only from the leader of its own view (deposed leaders are ignored) and
only for a round above the one it last *promised*; it promises it and answers
``Promise``.  A decision carries a ``ballot`` (the round of the leader sending it) and is
applied only if that is the member's promised round, so late decisions of a leader the
member has moved on from cannot reach it.  A proposal below a member's promise is
refused with ``Failed``, naming the promise, and the leader aborts and counts above it.

Leader death.  A member that voted ``Ready`` may not drop its staging on its own: the
leader may have committed and told someone else.  Offered a newer round, it is *blocked*:
it reports the undecided round in its ``Promise`` (with the last outcomes it learnt) and
stages nothing new.  The new leader settles that round: it relays the
outcome if any promise knows it; otherwise, once every rank has promised but the dead
owner -- so no live rank can still apply the owner's late decision -- the round cannot
have committed at a live rank and it aborts it with a text fixed by the round, so any two
settlers agree.  A rank that never voted ``Ready`` in a round abandons it silently when
it promises a newer one: without its vote that round can never commit.  So the shell of a
new leader calls :meth:`GroupMember.start` (with its latest version) when ranks wait on a
round; if ranks are missing, that round aborts at once but still settles.

Invariants (``tests/test_groups.py`` checks them after every step): at live ranks a
round switches, to the version proposed in it, or aborts with one error -- never both;
promises and each leader's rounds only grow; once faults heal, one round brings every
rank to one version.  Safety assumes that a rank declared dead has stopped (the shell
restarts it with a new member and ``boot``); what it did last is then moot.  Unanswered
proposals, votes and promises are resent every ``retry`` seconds from
:meth:`GroupMember.tick`; every handler is idempotent.  Outputs are plain data: a
:class:`Send` for a peer, and the effects :class:`Stage`, :class:`Switch`, :class:`Discard`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated

from ..bounds import MAX_PEER_NAME, U63, MaxLen, PeerName, Range, Rank, Text
from ..errors import LocalProtocolError, RemoteProtocolError

MAX_OUTCOMES = 64
"""Aborted outcomes a member remembers (oldest forgotten first), besides its last commit."""


# -- wire messages ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True, order=True)
class Round:
    """A ballot of rank ``count % size``'s incarnation ``boot``."""

    count: Annotated[int, Range(-1, 2**63 - 1)]
    boot: Annotated[int, Range(-1, 2**63 - 1)]

    def __str__(self) -> str:
        return f"{self.count}.{self.boot}"


NO_ROUND = Round(-1, -1)


@dataclass(frozen=True, slots=True)
class Outcome:
    """The decision of one round (inside :class:`Promise`)."""

    round: Round
    version: U63
    committed: bool
    error: Text


@dataclass(frozen=True, slots=True)
class Propose:
    sender: Rank
    round: Round
    version: U63


@dataclass(frozen=True, slots=True)
class Promise:
    """``sender`` accepts ``round``; ``blocked`` is the round it is ready in but that is
    undecided (:data:`NO_ROUND` for none), ``outcomes`` what it learnt since its last commit."""

    sender: Rank
    round: Round
    blocked: Round
    blocked_version: U63
    outcomes: Annotated[tuple[Outcome, ...], MaxLen(MAX_OUTCOMES + 1)]


@dataclass(frozen=True, slots=True)
class Ready:
    sender: Rank
    round: Round
    version: U63


@dataclass(frozen=True, slots=True)
class Failed:
    sender: Rank
    round: Round
    version: U63
    error: Text
    promised: Round
    """The sender's promised round; above ``round`` when the proposal was stale."""


@dataclass(frozen=True, slots=True)
class Commit:
    sender: Rank
    round: Round
    version: U63
    ballot: Round


@dataclass(frozen=True, slots=True)
class Abort:
    sender: Rank
    round: Round
    version: U63
    error: Text
    ballot: Round


@dataclass(frozen=True, slots=True)
class GroupEnvelope:
    """A group message between peers: ``body`` is the codec encoding of one of the
    messages above, for group ``group``, from peer ``sender``.  Peers may be in several
    groups; the envelope tells the shell which :class:`GroupMember` it is for."""

    group: Annotated[str, MaxLen(MAX_PEER_NAME)]
    sender: PeerName
    body: bytes


MESSAGES = (Propose, Promise, Ready, Failed, Commit, Abort, GroupEnvelope)
GroupMessage = Propose | Promise | Ready | Failed | Commit | Abort


# -- outputs ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Send:
    dest: str
    msg: GroupMessage


@dataclass(frozen=True, slots=True)
class Stage:
    """Fetch ``version`` into staging (replacing what staging holds), then call
    :meth:`GroupMember.staged` with ``round``."""

    round: Round
    version: int


@dataclass(frozen=True, slots=True)
class Switch:
    """Swap staging (holding ``version``) into live, in one step."""

    round: Round
    version: int


@dataclass(frozen=True, slots=True)
class Discard:
    """Round ``round`` aborted: drop its staging, if any, and raise ``error`` to waiters."""

    round: Round
    version: int
    error: str


Output = Send | Stage | Switch | Discard


@dataclass(frozen=True, slots=True)
class GroupConfig:
    timeout: float = 120.0
    """Seconds a leader waits for all votes before aborting; covers one full staging
    fetch of a rank's slices, so set it above the slowest expected fetch."""
    retry: float = 1.0
    """Seconds between retransmissions of unanswered proposals, votes and promises;
    lower recovers faster from loss at the cost of control traffic."""
    join_grace: float = 30.0
    """Seconds the leader's first round waits for ranks whose peers it has never seen
    live (still starting); after that the round aborts naming them.  A rank seen live
    once and gone since aborts a round at once."""

    def __post_init__(self) -> None:
        if not (0 < self.retry <= self.timeout < math.inf):
            raise LocalProtocolError(
                f"need 0 < retry <= timeout < inf, got retry={self.retry}, timeout={self.timeout}")
        if not 0 <= self.join_grace < math.inf:
            raise LocalProtocolError(f"need 0 <= join_grace < inf, got {self.join_grace}")


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """``staging`` is ``(round, version, phase)`` with phase staging, ready or failed;
    ``led`` the latest round this member started (NO_ROUND if none), ``running`` whether
    it is still undecided."""

    rank: int
    leader: int
    promised: Round
    live_version: int | None
    staging: tuple[Round, int, str] | None
    led: Round
    running: bool


@dataclass
class _Pending:
    round: Round
    version: int
    phase: str  # "staging" -> "ready" | "failed"
    error: str = ""


@dataclass
class _Lead:
    round: Round
    version: int
    deadline: float
    ready: set[int] = field(default_factory=set)
    promises: dict[int, Promise] = field(default_factory=dict)
    decision: Outcome | None = None


def _remember(book: dict[Round, Outcome], o: Outcome) -> None:
    book[o.round] = o
    if o.committed:  # the latest commit is enough to know of commits
        for r in [r for r, x in book.items() if x.committed and r < o.round]:
            del book[r]
    # Aborts are kept across commits: a restarted rank may still get a late copy of an
    # old round's proposal and block on it; whoever settles it then relays this text.
    aborts = sorted(r for r, x in book.items() if not x.committed)
    for r in aborts[:max(0, len(aborts) - MAX_OUTCOMES)]:
        del book[r]


class GroupMember:
    """One rank's side of the group switch.  Feed it :meth:`receive`, :meth:`staged`,
    :meth:`set_live` and :meth:`tick` (at :meth:`next_deadline`); act on what they return."""

    def __init__(self, members: Sequence[str], rank: int, *,
                 config: GroupConfig = GroupConfig(), boot: int = 0) -> None:
        """``boot`` must differ between incarnations of one rank.  A leader counts rounds
        from it, so a stamp that grows across restarts and is roughly comparable across
        peers (seconds since the epoch at start) spares a restarted leader a first round
        refused as stale."""
        if len(members) < 1 or len(set(members)) != len(members) or not 0 <= rank < len(members):
            raise LocalProtocolError(f"rank {rank} of members {list(members)!r}")
        self.members = tuple(members)
        self.rank = rank
        self.size = len(members)
        self._cfg = config
        self._live = set(range(self.size))
        self._boot = boot
        self._highest = boot - 1  # the highest round count seen
        self._promised = NO_ROUND
        self._promised_version = 0
        self._pending: _Pending | None = None
        self._outcomes: dict[Round, Outcome] = {}  # applied here, by round
        self._live_version: int | None = None
        self._lead: _Lead | None = None
        self._led: dict[Round, Outcome] = {}  # decisions of rounds this member led
        self._retry_at = 0.0

    # -- queries -------------------------------------------------------------------------

    @property
    def leader(self) -> int:
        return min(self._live)

    @property
    def is_leader(self) -> bool:
        return self.leader == self.rank

    @property
    def running(self) -> bool:
        """True while a round this member leads is undecided."""
        return self._lead is not None and self._lead.decision is None

    def status(self) -> GroupStatus:
        p = self._pending
        return GroupStatus(self.rank, self.leader, self._promised, self._live_version,
                           None if p is None else (p.round, p.version, p.phase),
                           self._lead.round if self._lead else NO_ROUND, self.running)

    def next_deadline(self) -> float:
        due = [self._lead.deadline] if self.running and self._lead else []
        if self._unpromised() or self._pending is not None:
            due.append(self._retry_at)
        return min(due, default=math.inf)

    def _unpromised(self) -> set[int]:
        """Ranks to propose to again: those without a promise, while our round is undecided
        or while a promiser is blocked (settling needs every promise)."""
        lead = self._lead
        if lead is None or not self.is_leader:
            return set()
        missing = set(range(self.size)) - set(lead.promises)
        blocked = any(p.blocked != NO_ROUND for p in lead.promises.values())
        return missing if lead.decision is None or blocked else set()

    # -- inputs --------------------------------------------------------------------------

    def start(self, now: float, version: int) -> list[Output]:
        """Leader only: propose ``version`` (from this leader's view) to the group."""
        if not self.is_leader:
            raise LocalProtocolError(f"rank {self.rank} is not the leader (rank {self.leader} is)")
        if self.running:
            raise LocalProtocolError(f"round {self._lead.round if self._lead else ''} is running")
        base = max(self._highest, self._promised.count) + 1
        self._highest = base + (self.rank - base) % self.size
        r = Round(self._highest, self._boot)
        self._lead = _Lead(r, version, now + self._cfg.timeout)
        self._retry_at = now + self._cfg.retry
        out: list[Output] = []
        for k in range(self.size):
            self._send(out, k, Propose(self.rank, r, version))
        gone = [k for k in range(self.size) if k not in self._live]
        if gone:
            self._decide(out, False, f"ranks {self._named(gone)} are not live")
        return out

    def staged(self, now: float, round: Round, error: str | None = None) -> list[Output]:
        """The caller finished a :class:`Stage` of ``round``: ``error`` None means verified."""
        p = self._pending
        out: list[Output] = []
        if p is not None and p.round == round and p.phase == "staging":  # else superseded
            p.phase, p.error = ("ready", "") if error is None else ("failed", error)
            self._vote(out, p)
        return out

    def set_live(self, now: float, ranks: Iterable[int]) -> list[Output]:
        """Membership changed: ``ranks`` are the ranks this peer now believes live."""
        live = set(ranks) | {self.rank}
        if not live <= set(range(self.size)):
            raise LocalProtocolError(f"live ranks {sorted(live)} in a group of {self.size}")
        self._live = live
        out: list[Output] = []
        lead = self._lead
        if lead is not None and lead.decision is None:
            gone = [k for k in range(self.size) if k not in live]
            if gone:
                self._decide(out, False, f"ranks {self._named(gone)} left the group "
                                         f"during round {lead.round}")
        self._settle(out, None)  # a rank gone may be the last promise settling waits for
        return out

    def receive(self, now: float, msg: GroupMessage) -> list[Output]:
        """A message from another rank; malformed ones raise RemoteProtocolError."""
        self._check(msg)
        out: list[Output] = []
        self._dispatch(out, msg)
        return out

    def tick(self, now: float) -> list[Output]:
        out: list[Output] = []
        lead = self._lead
        if lead is not None and lead.decision is None and now >= lead.deadline:
            waiting = self._named(k for k in range(self.size) if k not in lead.ready)
            self._decide(out, False, f"round {lead.round} timed out after "
                                     f"{self._cfg.timeout}s waiting for ranks {waiting}")
        if now >= self._retry_at:
            self._retry_at = now + self._cfg.retry
            for k in sorted(self._unpromised()):
                assert lead is not None
                self._send(out, k, Propose(self.rank, lead.round, lead.version))
            p = self._pending
            if p is not None and p.round == self._promised:
                self._vote(out, p)
            elif p is not None:
                self._promise(out)
        return out

    # -- member side -----------------------------------------------------------------------

    def _dispatch(self, out: list[Output], msg: GroupMessage) -> None:
        self._highest = max(self._highest, msg.round.count)
        if isinstance(msg, Propose):
            self._on_propose(out, msg)
        elif isinstance(msg, Commit | Abort):
            self._on_decision(out, msg)
        elif isinstance(msg, Promise):
            if self._lead is not None and msg.round == self._lead.round:
                self._lead.promises[msg.sender] = msg
                self._settle(out, msg.sender)
        else:
            self._on_vote(out, msg)

    def _on_propose(self, out: list[Output], p: Propose) -> None:
        if p.sender != self.leader:
            return  # a deposed leader, or one this member does not know of yet
        if p.round < self._promised:
            self._send(out, p.sender, Failed(
                self.rank, p.round, p.version,
                f"stale round {p.round}: rank {self.rank} promised round {self._promised}",
                self._promised))
            return
        if p.round == self._promised:  # a retransmission: answer again
            self._promise(out)
            if self._pending is not None and self._pending.round == p.round:
                self._vote(out, self._pending)
            return
        self._promised, self._promised_version = p.round, p.version
        if self._pending is not None and self._pending.phase != "ready":
            self._pending = None  # it never voted ready there: that round cannot commit
        self._promise(out)
        self._stage_promised(out)

    def _stage_promised(self, out: list[Output]) -> None:
        if self._pending is None and self._promised not in self._outcomes:
            self._pending = _Pending(self._promised, self._promised_version, "staging")
            out.append(Stage(self._promised, self._promised_version))

    def _promise(self, out: list[Output]) -> None:
        p = self._pending
        blocked = p is not None and p.round < self._promised
        self._send(out, self._promised.count % self.size, Promise(
            self.rank, self._promised, p.round if p and blocked else NO_ROUND,
            p.version if p and blocked else 0, tuple(self._outcomes.values())))

    def _vote(self, out: list[Output], p: _Pending) -> None:
        if p.phase == "ready":
            self._send(out, p.round.count % self.size, Ready(self.rank, p.round, p.version))
        elif p.phase == "failed":
            self._send(out, p.round.count % self.size,
                       Failed(self.rank, p.round, p.version, p.error, self._promised))

    def _on_decision(self, out: list[Output], d: Commit | Abort) -> None:
        if d.ballot != self._promised:
            return  # from a leader whose round this member has left behind
        p = self._pending
        if p is not None and (p.round, p.version) == (d.round, d.version) \
                and (isinstance(d, Abort) or p.phase == "ready"):
            if isinstance(d, Commit):
                self._live_version = p.version
                out.append(Switch(p.round, p.version))
            else:
                out.append(Discard(p.round, p.version, d.error))
            self._pending = None
            _remember(self._outcomes, Outcome(d.round, d.version, isinstance(d, Commit),
                                              d.error if isinstance(d, Abort) else ""))
            self._stage_promised(out)
        elif isinstance(d, Abort) and (p is None or p.round != d.round) \
                and d.round == self._promised and d.round not in self._outcomes:
            # blocked on an older round, this member never staged the promised one
            _remember(self._outcomes, Outcome(d.round, d.version, False, d.error))
            out.append(Discard(d.round, d.version, d.error))

    # -- leader side -------------------------------------------------------------------------

    def _on_vote(self, out: list[Output], v: Ready | Failed) -> None:
        if isinstance(v, Failed):
            self._highest = max(self._highest, v.promised.count)
        lead = self._lead
        done = self._led.get(v.round)
        if done is not None:  # a retransmission after the decision: repeat it
            self._send(out, v.sender, self._decision_msg(done, v.round))
        elif lead is not None and v.round == lead.round:
            if v.version != lead.version:
                raise RemoteProtocolError(
                    f"rank {v.sender} voted for version {v.version} in round {v.round} "
                    f"of version {lead.version}")
            if isinstance(v, Failed):
                self._decide(out, False, f"rank {self._named([v.sender])} could not stage "
                                         f"version {v.version}: {v.error}")
            else:
                lead.ready.add(v.sender)
                if len(lead.ready) == self.size:
                    self._decide(out, True, "")

    def _decide(self, out: list[Output], committed: bool, error: str) -> None:
        lead = self._lead
        assert lead is not None and lead.decision is None
        lead.decision = Outcome(lead.round, lead.version, committed, error)
        _remember(self._led, lead.decision)
        for k in range(self.size):
            self._send(out, k, self._decision_msg(lead.decision, lead.round))

    def _settle(self, out: list[Output], sender: int | None) -> None:
        """Relay or decide the outcome of rounds that promisers of our round are blocked on."""
        lead = self._lead
        if lead is None or not self.is_leader:
            return
        promised = set(lead.promises)
        known: dict[Round, Outcome] = {}
        for pr in lead.promises.values():
            known.update((o.round, o) for o in pr.outcomes)
        for pr in lead.promises.values():
            owner = pr.blocked.count % self.size
            # every rank but the blocked round's owner, if that one is gone, has promised
            everyone = set(range(self.size)) - ({owner} - self._live) <= promised
            if pr.blocked == NO_ROUND or not (everyone or pr.sender == sender):
                continue
            o = known.get(pr.blocked)
            if o is None and everyone:
                o = Outcome(pr.blocked, pr.blocked_version, False,
                            f"round {pr.blocked} was abandoned: its leader "
                            f"{self._named([owner])} left before deciding")
            if o is not None:
                self._send(out, pr.sender, self._decision_msg(o, lead.round))

    def _decision_msg(self, o: Outcome, ballot: Round) -> Commit | Abort:
        if o.committed:
            return Commit(self.rank, o.round, o.version, ballot)
        return Abort(self.rank, o.round, o.version, o.error, ballot)

    # -- plumbing ----------------------------------------------------------------------------

    def _send(self, out: list[Output], rank: int, msg: GroupMessage) -> None:
        if rank == self.rank:
            self._dispatch(out, msg)
        else:
            out.append(Send(self.members[rank], msg))

    def _named(self, ranks: Iterable[int]) -> str:
        return ", ".join(f"{k} ({self.members[k]})" for k in ranks)

    def _check(self, msg: GroupMessage) -> None:
        problem = ""
        if not 0 <= msg.sender < self.size or msg.sender == self.rank:
            problem = f"sender rank {msg.sender} in a group of {self.size}"
        elif msg.round.count < 0:
            problem = f"round {msg.round}"
        elif isinstance(msg, Propose) and msg.round.count % self.size != msg.sender:
            problem = f"rank {msg.sender} proposes round {msg.round} of another rank"
        elif isinstance(msg, Commit | Abort) and msg.ballot.count % self.size != msg.sender:
            problem = f"rank {msg.sender} decides under ballot {msg.ballot}"
        if problem:
            raise RemoteProtocolError(f"group message {type(msg).__name__}: {problem}")
