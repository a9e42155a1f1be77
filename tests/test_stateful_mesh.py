"""Hypothesis stateful test: random interleavings against a mesh of real peers.

Four real peers (real ZeroMQ control plane, real TCP data plane on loopback) run in one
trio loop on a background thread; the state machine drives them step by step through
``trio.from_thread``.  Two of them (``t0``, ``t1``) are the ranks of a TP=2 publishing
group, the other two (``r0``, ``r1``) consume.  Rules: a rank publishes its slices of
the version in progress, a rank unpublishes, a consumer fetches with a random layout
(the publish layout, another TP=2 split, TP=3 with unequal parts, or whole), a consumer
releases what it holds, a peer crashes (no goodbye) and restarts with an empty store.

After every step the mesh is let settle (every live peer's reference table and
membership agree) and the invariants are checked against a small model:

* no torn bytes -- every fetched array equals the slice of exactly the version the
  fetch reported (each version's content differs);
* unsealed versions are never visible -- ``latest`` never names a version that has not
  sealed, and fetching a version whose publish is in progress raises;
* ``latest`` is monotonic per peer incarnation;
* a retained version (the newest sealed one) stays fetchable while, for every shard,
  some live peer published, fetched (in the publish layout) or offloaded it: fetches
  succeed exactly when the model says so.
"""

from __future__ import annotations

import subprocess
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import trio
from helpers import wait_until
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import tensorhub
from tensorhub import GroupConfig, GroupSwitchError, PeerConfig, Rollout, VersionUnavailable
from tensorhub.protocol.sharding import Sharding

T = TypeVar("T")
EXPLORED: Counter[str] = Counter()
"""Rule outcomes over the whole run: the test checks that every kind was exercised."""
MODEL = "m"
PUBLISH = Sharding(0, 2, split={"w": 0, "o": 1})
LAYOUTS: dict[str, Sharding | None] = {
    "publish-0": PUBLISH.at(0),
    "publish-1": PUBLISH.at(1),
    "swap-0": Sharding(0, 2, split={"w": 1, "o": 0}),
    "swap-1": Sharding(1, 2, split={"w": 1, "o": 0}),
    "tp3-2": Sharding(2, 3, split={"w": 0, "b": 0}, parts={"w": [24, 32, 8], "b": [16, 16, 16]}),
    "whole": None,
}


GROUP = Sharding(0, 2, split={"w": 1, "o": 1})
"""The consuming group's layout (ranks r0, r1): used by nothing else in the test."""
ROLLOUT = Sharding(3, 4, split={"w": 0, "b": 0})
"""The staged-flip rollout's layout at r1."""


def content(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {
        "w": rng.standard_normal((64, 48)).astype(np.float32),
        "o": rng.integers(-1000, 1000, (48, 80)).astype(np.int16),
        "b": rng.standard_normal(48).astype(np.float16),
    }


def sliced(full: dict[str, np.ndarray], spec: Sharding | None) -> dict[str, np.ndarray]:
    if spec is None:
        return full
    return {k: np.ascontiguousarray(v[tuple(slice(a, b) for a, b in spec.box(k, v.shape))])
            for k, v in full.items()}


class MeshThread:
    """A trio loop on a background thread that owns the peers."""

    def __init__(self) -> None:
        self.token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.peers: dict[str, tuple[tensorhub.Peer, trio.CancelScope]] = {}
        self.groups: dict[str, tuple[tensorhub.Group, trio.CancelScope]] = {}

    async def _main(self) -> None:
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self.token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float = 30,
             **kwargs: Any) -> T:
        async def bounded() -> T:
            with trio.fail_after(timeout):
                return await fn(*args, **kwargs)
        return trio.from_thread.run(bounded, trio_token=self.token)

    async def _run_peer(self, config: PeerConfig, *, task_status: Any) -> None:
        with trio.CancelScope() as scope:
            async with tensorhub.open_peer(config) as peer:
                task_status.started((peer, scope))
                await trio.sleep_forever()

    async def start_peer(self, name: str, join: tuple[str, ...]) -> tensorhub.Peer:
        config = PeerConfig.local(name, join=join, chunk_size=4096, stall_timeout=2.0,
                                  planning=False)
        peer, scope = await self.nursery.start(self._run_peer, config)
        self.peers[name] = (peer, scope)
        return peer

    async def _run_group(self, name: str, rank: int, *, task_status: Any) -> None:
        peer = self.peers[name][0]
        with trio.CancelScope() as scope:
            async with tensorhub.open_group(
                    peer, "engine", ["r0", "r1"], rank, model=MODEL, layout=GROUP.at(rank),
                    config=GroupConfig(timeout=10.0, retry=0.2)) as group:
                task_status.started((group, scope))
                await trio.sleep_forever()

    async def open_group(self, name: str, rank: int) -> None:
        self.groups[name] = await self.nursery.start(self._run_group, name, rank)

    async def crash(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            group[1].cancel()
            await trio.sleep(0)
        peer, scope = self.peers.pop(name)

        async def no_goodbye() -> None:
            await trio.lowlevel.checkpoint()
        # a crash: the peer goes without a word (fault injection reaching into the peer,
        # as no public call leaves without telling the mesh)
        peer._leave = no_goodbye  # type: ignore[method-assign]
        scope.cancel()
        await trio.sleep(0)

    def close(self) -> None:
        if self.token is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(20)


@dataclass
class Model:
    next_version: int = 1
    in_progress: int | None = None
    ranks_done: set[int] = field(default_factory=set)
    sealed_ever: set[int] = field(default_factory=set)
    claims: dict[tuple[int, int], set[str]] = field(default_factory=dict)
    """(version, shard) -> live peers holding that publish shard complete."""
    offloaded: dict[tuple[int, int], str] = field(default_factory=dict)
    held: dict[str, set[tuple[int, str]]] = field(default_factory=dict)
    """peer -> (version, layout name) it holds (publish ranks: 'publish-<rank>')."""
    latest_seen: dict[str, int] = field(default_factory=dict)

    def fetchable(self, version: int) -> bool:
        return version in self.sealed_ever and all(
            self.claims.get((version, s)) for s in range(2))

    def readable(self) -> list[int]:
        return sorted(v for v in self.sealed_ever if self.fetchable(v))


class MeshMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mesh = MeshThread()
        self.model = Model()
        self.crashes = 0
        first = self.mesh.call(self.mesh.start_peer, "t0", ())
        self.seed = first.info.control.removeprefix("tcp://")
        for name in ("t1", "r0", "r1"):
            self.mesh.call(self.mesh.start_peer, name, (self.seed,))
        for name in ("t0", "t1", "r0", "r1"):
            self.model.held[name] = set()
        for rank in (0, 1):
            self.mesh.call(self.mesh.open_group, f"r{rank}", rank)
        self.rollout = Rollout(self.peer("r1"), MODEL, layout=ROLLOUT)
        self.settle()

    def teardown(self) -> None:
        self.mesh.close()

    # -- helpers -----------------------------------------------------------------------

    def peer(self, name: str) -> tensorhub.Peer:
        return self.mesh.peers[name][0]

    def settle(self) -> None:
        """Wait until every live peer sees exactly the live peers, and every live
        origin's newest reference entry."""
        def converged() -> bool:
            peers = [p for p, _ in self.mesh.peers.values()]
            names = {p.info.name for p in peers}
            stamps = {p.info.name: p.control.refs.local.stamp for p in peers}
            return all({i.name for i in p.control.membership.live_members()} == names
                       and {e.origin: e.stamp for e in p.control.refs.origins()
                            if e.origin in stamps} == stamps for p in peers)
        # the call's own bound is later than the wait's: the wait's error says what
        self.mesh.call(wait_until, converged, 30, timeout=35,
                       what="every live peer seeing the live peers and their newest entries")
        self._drop_unretained()

    def retained(self, version: int, peer: str) -> bool:
        """What ``peer`` keeps readable (retain_latest=1): the newest readable version,
        and versions newer than its ``latest`` (not sealed in its view yet)."""
        readable = self.model.readable()
        latest = self.peer(peer).control.latest(MODEL)
        return readable[-1:] == [version] or latest is None or version > latest

    def _drop_unretained(self) -> None:
        """Offloaded host copies go once their version is no longer retained."""
        for (v, s), who in list(self.model.offloaded.items()):
            if not self.retained(v, who):
                del self.model.offloaded[(v, s)]
                self.model.claims[(v, s)].discard(who)
                self.model.held[who].discard((v, f"publish-{s}"))

    def live(self) -> list[str]:
        return sorted(self.mesh.peers)

    # -- rules -------------------------------------------------------------------------

    @initialize()
    def first_version(self) -> None:
        self.publish_rank(0)
        self.publish_rank(1)

    @rule(rank=st.sampled_from([0, 1]))
    def publish_rank(self, rank: int) -> None:
        """Publish this rank's slices of the version in progress (starting the next
        version if none is)."""
        if self.model.in_progress is None:
            self.model.in_progress = self.model.next_version
            self.model.next_version += 1
            self.model.ranks_done = set()
        v = self.model.in_progress
        name = f"t{rank}"
        if rank in self.model.ranks_done or name not in self.mesh.peers:
            return
        spec = PUBLISH.at(rank)
        self.mesh.call(self.peer(name).publish, MODEL, v, sliced(content(v), spec),
                       layout=spec)
        EXPLORED["publish"] += 1
        self.model.ranks_done.add(rank)
        self.model.claims.setdefault((v, rank), set()).add(name)
        self.model.held[name].add((v, f"publish-{rank}"))
        if self.model.ranks_done == {0, 1}:
            self.model.sealed_ever.add(v)
            self.model.in_progress = None
        self.settle()

    @rule(data=st.data())
    def unpublish(self, data: st.DataObject) -> None:
        options = sorted((n, v, lay) for n in self.live() for v, lay in self.model.held[n])
        if not options:
            return
        name, v, lay = data.draw(st.sampled_from(options))
        spec = LAYOUTS[lay]
        shard = int(lay.split("-")[1]) if lay.startswith("publish") else None
        retained = self.retained(v, name)
        others = self.model.claims.get((v, shard), set()) - {name} if shard is not None else set()
        self.mesh.call(self.peer(name).unpublish, MODEL, v, layout=spec)
        EXPLORED["unpublish"] += 1
        if shard is not None and retained and not others \
                and (v, shard) not in self.model.offloaded:
            self.model.offloaded[(v, shard)] = name  # kept as a host copy
            EXPLORED["offload"] += 1
        elif self.model.offloaded.get((v, shard)) == name and not others:
            pass  # unpublishing a host copy of a retained shard keeps it (last holder)
        else:  # another holder keeps it (it confirms so): this copy, host or not, goes
            self.model.held[name].discard((v, lay))
            if shard is not None:
                self.model.claims[(v, shard)].discard(name)
                if self.model.offloaded.get((v, shard)) == name:
                    del self.model.offloaded[(v, shard)]
        self.settle()

    @precondition(lambda self: any(n.startswith("r") for n in self.mesh.peers))
    @rule(data=st.data(), layout=st.sampled_from(sorted(LAYOUTS)),
          which=st.sampled_from(["latest", "newest", "in-progress", "old"]))
    def fetch(self, data: st.DataObject, layout: str, which: str) -> None:
        name = data.draw(st.sampled_from([n for n in self.live() if n.startswith("r")]))
        peer = self.peer(name)
        spec = LAYOUTS[layout]
        if which == "latest":
            version: int | str = "latest"
            target = self.model.latest_seen.get(name)
        elif which == "in-progress":
            target = self.model.in_progress
            version = target if target is not None else 10**6
        elif which == "old" and self.model.sealed_ever:
            target = data.draw(st.sampled_from(sorted(self.model.sealed_ever)))
            version = target
        else:
            target = max(self.model.sealed_ever, default=None)
            version = target if target is not None else 10**6
        already = target is not None and (target, layout) in self.model.held[name]
        expect_ok = target is not None and (already or self.model.fetchable(target))
        try:
            got = self.mesh.call(peer.fetch, MODEL, version, layout=spec)
        except (VersionUnavailable, tensorhub.ConsistencyError) as exc:
            assert not expect_ok, f"{name} could not fetch {version} ({layout}): {exc}"
            EXPLORED["fetch refused"] += 1
            return
        except tensorhub.LocalProtocolError as exc:
            # already holds this version in another form (e.g. mid-fetch): never torn
            assert "already" in str(exc), exc
            return
        assert expect_ok or (target is None and version == "latest"), (
            f"{name} fetched {version} ({layout}) that the model says is not fetchable")
        assert got.version in self.model.sealed_ever, f"fetched unsealed {got.version}"
        want = sliced(content(got.version), spec)
        assert set(got.tensors) == set(want)
        for k, arr in got.tensors.items():
            np.testing.assert_array_equal(arr, want[k], err_msg=f"torn {k} of {got.version}")
        EXPLORED[f"fetch {'whole' if spec is None else 'sliced'}"] += 1
        self.model.held[name].add((got.version, layout))
        if layout.startswith("publish"):
            shard = int(layout.split("-")[1])
            self.model.claims.setdefault((got.version, shard), set()).add(name)
        self.settle()

    @precondition(lambda self: self.crashes < 2 and len(self.mesh.peers) == 4)
    @rule(name=st.sampled_from(["t0", "t1", "r0", "r1"]))
    def crash_and_restart(self, name: str) -> None:
        self.crashes += 1
        EXPLORED["crash+restart"] += 1
        self.mesh.call(self.mesh.crash, name)
        for holders in self.model.claims.values():
            holders.discard(name)
        for key, who in list(self.model.offloaded.items()):
            if who == name:
                del self.model.offloaded[key]
        self.model.held[name] = set()
        self.model.latest_seen.pop(name, None)
        if self.model.in_progress is not None and name.startswith("t"):
            self.model.ranks_done.discard(int(name[1]))
        self.settle()  # the others see it dead
        join = tuple(p.info.control.removeprefix("tcp://") for p, _ in self.mesh.peers.values())
        self.mesh.call(self.mesh.start_peer, name, join)
        if name.startswith("r"):
            self.mesh.call(self.mesh.open_group, name, int(name[1]))
        if name == "r1":
            self.rollout = Rollout(self.peer("r1"), MODEL, layout=ROLLOUT)
        self.settle()

    @precondition(lambda self: len(self.mesh.groups) == 2)
    @rule()
    def group_switch(self) -> None:
        """Both ranks of the consuming group call fetch_latest together: they end on the
        same version with correct slices, or both fail with the same error."""
        groups = {n: g for n, (g, _) in self.mesh.groups.items()}
        proposal = self.peer("r0").control.latest(MODEL)
        if proposal is None:
            return
        before = {n: None if g.live is None else g.live.version for n, g in groups.items()}

        async def both() -> dict[str, tuple[str, Any]]:
            results: dict[str, tuple[str, Any]] = {}

            async def one(name: str) -> None:
                try:
                    results[name] = ("ok", await groups[name].fetch_latest(timeout=25))
                except GroupSwitchError as exc:
                    results[name] = ("error", str(exc))
            async with trio.open_nursery() as nursery:
                for name in groups:
                    nursery.start_soon(one, name)
            return results

        results = self.mesh.call(both, timeout=40)
        kinds = {kind for kind, _ in results.values()}
        assert len(kinds) == 1, f"ranks disagree on the outcome: {results}"
        trivial = all(v == proposal for v in before.values())
        expect_ok = trivial or self.model.fetchable(proposal)
        if kinds == {"error"}:
            texts = {text for _, text in results.values()}
            assert len(texts) == 1, f"ranks got different errors: {texts}"
            assert not expect_ok, f"group could not switch to fetchable {proposal}: {texts}"
            EXPLORED["group abort"] += 1
            return
        versions = {got.version for _, got in results.values()}
        assert versions == {proposal}, f"group switched to {versions}, proposed {proposal}"
        assert expect_ok, f"group switched to {proposal}, which the model says is gone"
        for name, (_, got) in results.items():
            want = sliced(content(proposal), GROUP.at(int(name[1])))
            for k, arr in got.tensors.items():
                np.testing.assert_array_equal(arr, want[k], err_msg=f"{name} torn {k}")
        EXPLORED["group switch"] += 1
        self.settle()

    # Two rules, not one with a drawn flag: hypothesis draws False first and often, and a
    # run could end without a single commit; each rule is chosen as often as the others.
    @precondition(lambda self: "r1" in self.mesh.peers)
    @rule()
    def staged_commit(self) -> None:
        self._staged_flip(commit=True)

    @precondition(lambda self: "r1" in self.mesh.peers)
    @rule()
    def staged_discard(self) -> None:
        self._staged_flip(commit=False)

    def _staged_flip(self, commit: bool) -> None:
        """The rollout at r1 stages the latest version next to its live one, then
        commits (the previous one is released) or discards it."""
        peer = self.peer("r1")
        proposal = peer.control.latest(MODEL)
        if proposal is None:
            return
        live = self.rollout.live
        try:
            staged = self.mesh.call(self.rollout.stage, "latest")
        except (VersionUnavailable, tensorhub.ConsistencyError):
            assert not (live is not None and live.version == proposal) \
                and not self.model.fetchable(proposal)
            EXPLORED["stage refused"] += 1
            return
        if live is not None:  # the live version is still held and served while staged
            assert live.version == proposal or peer.store.get(tensorhub.VersionKey(
                MODEL, live.version, ROLLOUT.rank, ROLLOUT.layout_id)) is not None
        if commit:
            done = self.mesh.call(staged.commit)
            assert done.version == proposal and self.rollout.live is not None
            self.mesh.call(done.wait_released)  # the previous version drains, then goes
            assert done.release_done and done.release_error is None, done.release_error
            EXPLORED["staged commit"] += 1
        else:
            self.mesh.call(staged.discard)
            EXPLORED["staged discard"] += 1
        self.settle()

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def group_ranks_agree(self) -> None:
        """A group never runs with mixed versions (a restarted rank has none until the
        next switch)."""
        lives = {g.live.version for g, _ in self.mesh.groups.values() if g.live is not None}
        assert len(lives) <= 1, f"group ranks on versions {lives}"
        for name, (g, _) in self.mesh.groups.items():
            if g.live is not None:
                want = sliced(content(g.live.version), GROUP.at(int(name[1])))
                for k, arr in g.live.tensors.items():
                    np.testing.assert_array_equal(arr, want[k], err_msg=f"{name} live {k}")

    @invariant()
    def rollout_live_is_intact(self) -> None:
        live = self.rollout.live
        if live is not None:
            want = sliced(content(live.version), ROLLOUT)
            for k, arr in live.tensors.items():
                np.testing.assert_array_equal(arr, want[k], err_msg=f"rollout live {k}")

    @invariant()
    def latest_is_sealed_and_monotonic(self) -> None:
        readable = self.model.readable()
        for name in self.live():
            latest = self.peer(name).control.latest(MODEL)
            before = self.model.latest_seen.get(name)
            if latest is None:
                assert before is None and not readable, (name, before, readable)
                continue
            assert latest in self.model.sealed_ever, f"{name} sees unsealed {latest}"
            assert latest != self.model.in_progress
            assert before is None or latest >= before, f"{name}: latest {before} -> {latest}"
            assert not readable or latest >= readable[-1]
            self.model.latest_seen[name] = latest

    @invariant()
    def in_progress_is_invisible(self) -> None:
        v = self.model.in_progress
        if v is None:
            return
        for name in self.live():
            sealed = self.peer(name).control.readable(MODEL)
            assert v not in sealed, f"{name} sees version {v} sealed before every rank published"

    @invariant()
    def retained_is_fetchable(self) -> None:
        readable = self.model.readable()
        if not readable:
            return
        newest = readable[-1]
        for name in self.live():
            self.peer(name).control.seal(MODEL, newest)  # raises if not sealed there


def test_mesh_interleavings(busy_neighbour: subprocess.Popen[bytes]) -> None:
    """Runs next to a process spinning on a core: on a loaded two-core host no group
    round may abort and no fetch of a fetchable version may fail."""
    run_state_machine_as_test(
        MeshMachine,
        settings=settings(max_examples=12, stateful_step_count=20, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )
    print("explored:", dict(EXPLORED))
    for kind in ("publish", "unpublish", "fetch sliced", "fetch refused", "crash+restart",
                 "group switch", "staged commit"):
        assert EXPLORED[kind] > 0, f"no {kind} step ran: {dict(EXPLORED)}"
    assert busy_neighbour.poll() is None  # it was spinning the whole time
