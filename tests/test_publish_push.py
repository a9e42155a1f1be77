"""A publish is pushed to every live member at once; every other change of a peer's
references goes to ``gossip_fanout`` of them (``ControlPlane.publish_holding``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import open_mesh, wait_until

from tensorhub import PeerConfig
from tensorhub.model import PeerInfo, VersionKey
from tensorhub.protocol.control import PUSH_HOLDINGS, ControlPlane, RefsDelta
from tensorhub.protocol.membership import Gossip, Outbound
from tensorhub.protocol.refs import Holding


def plane(i: int) -> ControlPlane:
    name = f"p{i}"
    me = PeerInfo(name, f"tcp://127.0.0.1:{7000 + i}", f"127.0.0.1:{7500 + i}")
    return ControlPlane(me, PeerConfig.local(name), random.Random(i), 0.0, 1000)


def knowing(n: int) -> tuple[ControlPlane, list[ControlPlane]]:
    """A publisher that knows ``n - 1`` other planes as live members, and them."""
    pub, others = plane(0), [plane(i) for i in range(1, n)]
    for p in others:
        record = p.membership._view.records[p.me.name]
        pub.receive(0.5, Gossip(p.me.control, p.me.name, (record,)))
    assert len(pub.membership.live_members()) == n
    mine = pub.membership._view.records[pub.me.name]
    for p in others:  # they know the publisher, so its references count with them
        p.receive(0.5, Gossip(pub.me.control, pub.me.name, (mine,)))
    return pub, others


def deltas(out: list[Outbound]) -> list[str]:
    return sorted(o.dest for o in out if isinstance(o.msg, RefsDelta))


@pytest.mark.parametrize("n", [2, 4, 9, 40])
def test_a_publish_reaches_every_live_member_and_a_progress_note_a_few(n: int) -> None:
    pub, others = knowing(n)
    fanout = pub.config.gossip_fanout
    published = pub.sign_announcement(Holding("m", 1, b"a" * 16, "", 4))
    out = pub.publish_holding(published)
    assert deltas(out) == sorted(p.me.control for p in others)
    for p in others:  # each member learns the version from that one message
        for o in out:
            if o.dest == p.me.control:
                p.receive(1.0, o.msg)
        assert [h.name for h, _ in p.holders(VersionKey("m", 1))] == ["p0"]
    progress = pub.put_holding(Holding("m", 2, b"b" * 16, "p9", 4, bytes(1)))
    assert len(deltas(progress)) == min(fanout, n - 1)
    assert set(deltas(progress)) <= {p.me.control for p in others}
    assert len(deltas(pub.drop_holding(VersionKey("m", 2)))) == min(fanout, n - 1)


def test_an_entry_of_many_holdings_is_pushed_to_fewer_members() -> None:
    """A publisher holding 2,000 versions (an adapter trainer) pushes its entry to as
    many members as :data:`PUSH_HOLDINGS` allows, all of them once it holds few again;
    all get one message object (the shell encodes it once)."""
    pub, _ = knowing(40)
    many = tuple(Holding("lora", v, b"x" * 16, "p0", 1) for v in range(1, 2001))
    pub.refs.bump_local(many)
    out = pub.publish_holding(pub.sign_announcement(Holding("m", 1, b"a" * 16, "", 4)))
    want = max(pub.config.gossip_fanout, PUSH_HOLDINGS // 2001)
    assert 0 < want < 39 and len(deltas(out)) == want
    assert len({id(o.msg) for o in out}) == 1
    pub.refs.bump_local(())
    out = pub.publish_holding(pub.sign_announcement(Holding("m", 2, b"b" * 16, "", 4)))
    assert len(deltas(out)) == 39


async def test_in_a_mesh_every_reader_sees_a_publish_before_a_gossip_round() -> None:
    """Six peers with gossip every 60 s: only the publish's own push can tell the
    readers, and every one of them hears of the version."""
    async with open_mesh(6, gossip_interval=60.0) as peers:
        pub, readers = peers[0], peers[1:]
        await pub.publish("m", 1, {"w": np.arange(8, dtype="f4")})
        await wait_until(lambda: all(r.control.latest("m") == 1 for r in readers), 20,
                         what="every reader hearing of m@1")
        got = await readers[-1].fetch("m", 1)
        assert got.tensors["w"].tolist() == list(range(8))
