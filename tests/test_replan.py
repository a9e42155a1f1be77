"""A coordinator that made its plan afresh answers a fetcher that asks again with the new
plan, stamped with a newer plan epoch (tensorhub/protocol/coordination.py); pure: the
membership view is a fixed table of nodes."""

from __future__ import annotations

from tensorhub.model import VersionKey
from tensorhub.protocol.coordination import Coordination, CoordReply
from tensorhub.protocol.topology import NodeInfo
from tensorhub.protocol.wan import Wan

KEY = VersionKey("m", 1)
SIZE, CHUNKS = 256 << 20, 64


class FixedView:
    """A settled view: these members are live; the trainer holds the version whole."""

    def __init__(self, nodes: list[NodeInfo]) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.wan = Wan()

    def live_names(self) -> list[str]:
        return sorted(self.nodes)

    def fetchers_of(self, key: VersionKey) -> list[str]:
        return []

    def complete_holders_of(self, key: VersionKey) -> list[str]:
        return ["trainer"]

    def node_info(self, name: str) -> NodeInfo | None:
        return self.nodes.get(name)


def two_dcs() -> FixedView:
    nic = 50e6
    return FixedView([NodeInfo(name, d, f"{d}-r0", name, nic, nic) for i, name in
                      enumerate(["trainer", *(f"h{i}" for i in range(1, 8))])
                      for d in ["dc0" if i < 4 else "dc1"]])


def ask(coordinator: Coordination, asker: Coordination, view: FixedView) -> CoordReply:
    _, msg, target = asker.request(KEY, view.live_names(), SIZE, CHUNKS)
    assert target == coordinator.me  # routed to it: no forwarding here
    dest, reply = coordinator.on_request(msg, view)
    assert dest == "reply" and isinstance(reply, CoordReply) and reply.ok, reply
    return reply


def test_a_fetcher_asking_again_gets_the_newer_plan_and_its_epoch() -> None:
    view = two_dcs()
    names = ["h6", "h1", "h2", "h3", "h7", "h4", "h5"]  # the order measured in the bench
    peers = {n: Coordination(n, f"tcp://{n}:1", 1) for n in [*names, "trainer"]}
    owner = peers[peers["h1"].coordinator(KEY, view.live_names())]
    first = {n: ask(owner, peers[n], view) for n in names}
    assert [s.peer for s in first["h6"].sources] == ["trainer"]  # it asked first
    planner = owner.planners[KEY]
    assert planner.statistics().rebuilds >= 1  # h1 could not fit: made afresh
    again = ask(owner, peers["h6"], view)
    assert again.sources == planner.sources("h6") != first["h6"].sources
    assert again.plan_epoch == planner.epoch > first["h6"].plan_epoch
    assert again.epoch == first["h6"].epoch  # the same coordinator, the same term
    assert planner.plan.estimate_s < 1.1 * planner.plan.bound_s
    peers["h6"].on_reply(again)  # what the fetch shell reads (fetching.ask_plan)
    answer = peers["h6"].answers[again.req_id]
    assert not isinstance(answer, str)
    assert answer.plan_epoch == again.plan_epoch and answer.sources == again.sources
