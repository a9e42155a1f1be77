"""The peer learns the WAN, sans-IO: what a transfer measured of each DC pair
(protocol/linktime.py, folded by the read path), our measurements in our reference entry
(refs.py, control.py), others' heard and forgotten, the coordinator planning with the
peer's model (coordination.py), and who probes which link when (probing.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import pytest
import trio
from test_refs import holding as ref_holding
from test_replan import FixedView
from test_transfer_session import holding, manifest

from tensorhub import PeerConfig
from tensorhub.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from tensorhub.links import LinkSpec
from tensorhub.model import PeerInfo, VersionKey
from tensorhub.peer.wanprobe import LinkProbes
from tensorhub.protocol import codec
from tensorhub.protocol.control import ControlPlane, RefsDelta
from tensorhub.protocol.coordination import Coordination, CoordReply
from tensorhub.protocol.linktime import LinkTime
from tensorhub.protocol.membership import Gossip, Update
from tensorhub.protocol.messages import register_all
from tensorhub.protocol.probing import ProbeSample, ProbeSchedule, combine, rotation
from tensorhub.protocol.refs import OriginEntry, RefTable, Stamp
from tensorhub.protocol.topology import NodeInfo
from tensorhub.protocol.transfer import TransferSession
from tensorhub.protocol.trust import Trust
from tensorhub.protocol.wan import MAX_LINK_REPORTS, LinkReport, Wan
from tensorhub.security import ClusterKey, Identity, Keyring, Security

register_all()
MIB = 1 << 20
KEY = VersionKey("m", 1)
ALIVE_KIND, LEFT_KIND = 0, 3


def member(name: str, dc: str, port: int) -> PeerInfo:
    return PeerInfo(name, f"tcp://127.0.0.1:{port}", f"127.0.0.1:{port + 1}", (("dc", dc),))


ME = member("me", "west", 7000)
EAST = [member("e1", "east", 7100), member("e0", "east", 7200)]
WEST = [member("w1", "west", 7300)]


def plane(config: PeerConfig | None = None) -> ControlPlane:
    """Our control plane, with ``EAST`` and ``WEST`` live members."""
    p = ControlPlane(ME, config or PeerConfig.local("me"), random.Random(0), 0.0, 1)
    ups = tuple(Update(ALIVE_KIND, f.name, 0, f.name, f) for f in (*EAST, *WEST))
    p.receive(0.0, Gossip(EAST[0].control, EAST[0].name, ups))
    return p


# -- one transfer's measurement -------------------------------------------------------


def test_sources_of_one_dc_read_side_by_side_count_once_at_their_summed_rate() -> None:
    t = LinkTime()
    t.claimed(0.0, "east", 2)      # source a of east
    t.claimed(1.0, "east", 2)      # source b of east, meanwhile
    t.claimed(0.0, "west", 1)
    t.ended(2.0, "east", 1, 4 * MIB)
    t.ended(2.5, "west", 1, 1 * MIB)
    t.ended(3.0, "east", 2, 8 * MIB)
    assert t.samples() == [("west", MIB, 2.5)]  # east has a chunk in flight still
    t.ended(4.0, "east", 1, 4 * MIB)
    assert t.samples() == [("east", 16 * MIB, 4.0), ("west", MIB, 2.5)]
    t.claimed(10.0, "east", 1)  # idle from 4 to 10: not counted
    t.ended(11.0, "east", 1)    # given back (failed): time counts, no bytes
    assert t.samples()[0] == ("east", 16 * MIB, 5.0)
    with pytest.raises(LocalProtocolError):
        t.ended(12.0, "east", 1)  # nothing in flight


def test_interim_samples_split_a_running_transfer_the_last_sample_is_whole() -> None:
    t = LinkTime()
    t.claimed(0.0, "east", 12)
    for i in range(4):
        t.ended(0.5 * (i + 1), "east", 1, MIB)
    assert t.interim(1.5) == []  # a stream's start: too short to tell a link by
    assert t.interim(2.5) == [("east", 4 * MIB, 2.5)]  # in flight until now: time counts
    assert t.interim(2.5) == []  # nothing new
    t.ended(3.0, "east", 3, 3 * MIB)
    assert t.interim(5.0) == []  # three chunks: one more or less on the wire is a third
    t.ended(5.5, "east", 1, MIB)  # the link slowed down
    t.ended(6.0, "east", 4)  # given back: time, no bytes, no chunks landed
    t.claimed(9.0, "east", 1)  # idle from 6 to 9: not counted
    assert t.interim(10.0) == [("east", 4 * MIB, 4.5)]
    t.ended(11.0, "east", 1, MIB)
    assert t.samples() == [("east", 9 * MIB, 8.0)]  # the whole transfer, at its end
    t.claimed(12.0, "west", 5)
    t.ended(14.0, "west", 1, MIB)
    assert t.interim(14.5) == []  # west: 1 chunk landed; east: nothing new
    t.ended(15.0, "west", 4, 4 * MIB)
    assert t.interim(15.0) == [("west", 5 * MIB, 3.0)]


def test_a_transfer_session_times_each_source_dc() -> None:
    m = manifest(8, chunk_size=MIB // 8)
    west = member("w9", "west", 7400)
    session = TransferSession(
        now=0.0, me="me", manifest=m, holders=lambda: [(EAST[0], holding(m, None)),
                                                       (west, holding(m, None))],
        banned=lambda _now, _name: None, wanted=range(8), verified=[0] * 8, window=2,
        stall_timeout=10.0, dc="north")
    a = session.open_stream(0.0, 0, EAST[0])
    b = session.open_stream(0.0, 4, west)
    run_a = session.next_run(1.0, a, 4 * m.chunk_size)
    run_b = session.next_run(1.0, b, 4 * m.chunk_size)
    assert run_a and run_b
    for i, c in enumerate(run_a):
        session.landed(2.0 + i, a, c, m.chunk_size)
    session.stream_ended(2.0 + len(run_a), a)
    for c in run_b:
        session.landed(1.5, b, c, m.chunk_size)
    session.stream_ended(1.5, b)
    samples = dict((dc, (n, s)) for dc, n, s in session.link_time.samples())
    assert samples["east"] == (len(run_a) * m.chunk_size, float(len(run_a)))
    assert samples["west"] == (len(run_b) * m.chunk_size, 0.5)


def test_a_relay_still_receiving_does_not_time_the_link() -> None:
    """Reads from a source holding part of the version wait at its pace, not the
    link's: they move bytes but give no sample; once it holds everything they do."""
    m = manifest(8, chunk_size=MIB // 8)
    partial = {"held": holding(m, {0, 1, 2, 3})}
    session = TransferSession(
        now=0.0, me="me", manifest=m, holders=lambda: [(EAST[0], partial["held"])],
        banned=lambda _now, _name: None, wanted=range(8), verified=[0] * 8, window=1,
        stall_timeout=10.0, dc="west")
    s = session.open_stream(0.0, 0, EAST[0])
    run = session.next_run(0.0, s, 2 * m.chunk_size)
    assert run
    for c in run:
        session.landed(5.0, s, c, m.chunk_size)
    assert session.link_time.samples() == []
    partial["held"] = holding(m, None)  # the relay completed
    run = session.next_run(5.0, s, 2 * m.chunk_size)
    assert run
    for c in run:
        session.landed(6.0, s, c, m.chunk_size)
    session.stream_ended(6.0, s)
    assert session.link_time.samples() == [("east", len(run) * m.chunk_size, 1.0)]


# -- our measurements in our entry ------------------------------------------------------


def test_our_links_ride_in_our_entry_and_holdings_changes_keep_them() -> None:
    t = RefTable("a", 1)
    links = (LinkReport("east", "west", 1e6, 0.05),)
    seq = t.local.stamp.seq
    assert t.set_links(links) and t.local.stamp.seq == seq + 1
    assert not t.set_links(links)  # unchanged: no new stamp
    t.put_local(ref_holding("m", 1, {1}))
    assert t.local.links == links
    t.drop_local(KEY)
    assert t.local.links == links
    wire = codec.encode(RefsDelta("tcp://h:1", "a", (t.local,)))
    assert codec.decode(wire).entries[0].links == links


def test_the_entry_signature_covers_the_links() -> None:
    ident = Identity.generate()
    ring = Keyring({"a": [ident.public], "b": [Identity.generate().public]}, {})
    sec = Security(ident, ClusterKey.generate(), ring)
    mine = RefTable("a", 1, Trust(sec))
    mine.set_links((LinkReport("east", "west", 1e6),))
    theirs = RefTable("b", 1, Trust(replace(sec, identity=Identity.generate())))
    doctored = replace(mine.local, links=(LinkReport("east", "west", 1e12),))
    assert not theirs.merge(doctored)
    assert theirs.merge(mine.local)


@pytest.mark.parametrize("bad", [
    LinkReport("east", "east", 1e6), LinkReport("", "west", 1e6),
    LinkReport("east", "west", 0.0), LinkReport("east", "west", -1.0),
    LinkReport("east", "west", 1e14), LinkReport("east", "west", 1e6, -0.1),
    LinkReport("east", "west", 1e6, 11.0),
])
def test_implausible_link_reports_are_refused_at_decode(bad: LinkReport) -> None:
    entry = OriginEntry(Stamp("b", 1, 1), (), b"", (bad,))
    with pytest.raises(RemoteProtocolError, match="link report"):
        codec.decode(codec.encode(RefsDelta("tcp://h:1", "b", (entry,))))


def test_non_finite_rates_and_too_many_reports_are_refused_at_decode() -> None:
    entry = OriginEntry(Stamp("b", 1, 1), (), b"", (LinkReport("east", "west", 1e6),))
    wire = msgpack.unpackb(codec.encode(RefsDelta("tcp://h:1", "b", (entry,))))
    for value in (float("nan"), float("inf")):
        wire[3][0][3][0][2] = value
        with pytest.raises(RemoteProtocolError, match="finite"):
            codec.decode(msgpack.packb(wire))
    many = tuple(LinkReport(f"d{i}", "west", 1e6) for i in range(MAX_LINK_REPORTS + 1))
    with pytest.raises(RemoteProtocolError):
        codec.decode(codec.encode(RefsDelta("tcp://h:1", "b", (replace(entry, links=many),))))


def test_a_measurement_is_stamped_into_our_entry_at_the_next_tick_and_pushed() -> None:
    p = plane()
    assert p.tick(0.0) and not p.publish_links()  # nothing measured: nothing to stamp
    assert p.wan.observe("east", "west", 4 * MIB, 1.0)
    seq = p.refs.local.stamp.seq
    out = p.tick(0.01)  # within the gossip interval: only our entry goes out
    deltas = [o.msg for o in out if isinstance(o.msg, RefsDelta)]
    assert deltas and deltas[0].entries[0].links == p.wan.reports()
    assert p.refs.local.stamp.seq == seq + 1
    assert not p.publish_links()  # once
    assert not p.wan.observe("east", "west", MIB - 1, 1.0)  # under min_sample_bytes
    assert not p.publish_links()


def test_heard_reports_count_until_their_origin_leaves() -> None:
    p = plane()
    entry = OriginEntry(Stamp("e1", 1, 1), (), b"", (LinkReport("west", "east", 2e6, 0.1),))
    p.receive(0.0, RefsDelta(EAST[0].control, "e1", (entry,)))
    e = p.wan.estimate("west", "east")
    assert e is not None and (e.bps, e.how, e.reporters) == (2e6, "measured", 1)
    newer = OriginEntry(Stamp("e1", 1, 2), (), b"", ())  # e1 measures nothing any more
    p.receive(0.0, RefsDelta(EAST[0].control, "e1", (newer, entry)))  # the stale one loses
    assert p.wan.estimate("west", "east") is None
    p.receive(0.0, RefsDelta(EAST[0].control, "e1", (replace(newer, stamp=Stamp(
        "e1", 1, 3), links=entry.links),)))
    assert p.wan.rate("west", "east") == 2e6
    p.receive(0.0, Gossip(EAST[0].control, "e1", (Update(LEFT_KIND, "e1", 0, "e1", None),)))
    assert p.wan.estimate("west", "east") is None


def test_an_implausible_entry_built_in_memory_is_refused_and_counted() -> None:
    p = plane()
    bad = OriginEntry(Stamp("e1", 1, 1), (), b"", (LinkReport("west", "west", 1.0),))
    assert p.receive(0.0, RefsDelta(EAST[0].control, "e1", (bad,))) == []
    assert p.implausible_entries == 1 and p.refs.entry("e1") is None
    assert p.wan.pairs() == []


def test_declared_links_start_the_model() -> None:
    p = plane(PeerConfig.local("me", links=(LinkSpec("east", "west", 5e6, 0.02),)))
    e = p.wan.estimate("east", "west")
    assert e is not None and (e.bps, e.rtt_s, e.how) == (5e6, 0.02, "declared")


# -- the coordinator plans with the peer's model ------------------------------------------

def test_the_coordinator_plans_with_the_peers_wan_and_says_the_route() -> None:
    nic = 50e6
    view = FixedView([NodeInfo(n, dc, dc, n, nic, nic) for n, dc in (
        ("trainer", "east"), ("e1", "east"), ("w1", "west"), ("w2", "west"))])
    wan = view.wan = Wan((LinkSpec("east", "west", 1e6, 0.05),))
    peers = {n: Coordination(n, f"tcp://{n}:1", 1) for n in view.nodes}
    owner = peers[peers["w1"].coordinator(KEY, view.live_names())]
    _, msg, _ = peers["w1"].request(KEY, view.live_names(), 64 * MIB, 64)
    dest, reply = owner.on_request(msg, view)
    assert dest == "reply" and isinstance(reply, CoordReply) and reply.sources
    planner = owner.planners[KEY]
    assert planner.topology.wan is wan
    assert planner.topology.dc_link("east", "west") == (1e6, 0.05)
    assert "east" in reply.route and "declared" in reply.route
    assert codec.decode(codec.encode(reply)).route == reply.route
    wan.observe("east", "west", 64 * MIB, 2.0)  # measured since: the same model, live
    assert planner.topology.dc_link("east", "west")[0] == 32 * MIB
    peers["w1"].on_reply(reply)
    answer = peers["w1"].answers[reply.req_id]
    assert not isinstance(answer, str) and answer.route == reply.route


# -- who probes which link, when ----------------------------------------------------------


def test_only_each_dcs_smallest_named_member_probes_unmeasured_links_into_it() -> None:
    w0, w1 = member("w0", "west", 7500), member("w1", "west", 7600)
    e0, e1, s0 = member("e0", "east", 7700), member("e1", "east", 7800), \
        member("s0", "south", 7900)
    live = [w1, e1, e0, s0]
    wan = Wan((LinkSpec("south", "west", 1e6),))  # declared: still probed
    other = ProbeSchedule(w1, 0.0, after=5.0, every=600.0)
    assert other.due(10.0, [w0, *live], wan) == []  # w0 is west's prober
    mine = ProbeSchedule(w0, 0.0, after=5.0, every=600.0)
    assert mine.due(4.9, live, wan) == []  # membership settles first
    assert mine.due(5.0, live, wan) == [("east", e0), ("south", s0)]
    assert mine.due(6.0, live, wan) == []  # probed (or tried): not again for a while
    n0 = member("n0", "north", 8000)
    assert mine.due(7.0, [*live, n0], wan) == [("north", n0)]  # a new DC appears
    assert mine.due(605.0, live, wan) == [("east", e0), ("south", s0)]
    wan.observe("east", "west", 4 * MIB, 1.0)  # measured: never probed again
    assert mine.due(1300.0, live, wan) == [("south", s0)]
    nolabel = ProbeSchedule(PeerInfo("x", "tcp://h:1", "h:2"), 0.0, 0.0, 1.0)
    assert nolabel.due(10.0, live, wan) == []


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7])
def test_probers_in_step_each_read_a_different_dc(n: int) -> None:
    dcs = [f"dc{i}" for i in range(n)]
    orders = {d: rotation([*dcs, ""], d) for d in dcs}
    assert all(sorted(o) == sorted(set(dcs) - {d}) for d, o in orders.items())
    for step in range(n - 1):  # at each step the sources are a permutation of the DCs
        sources = [orders[d][step] for d in dcs]
        assert sorted(sources) == dcs and all(s != d for s, d in zip(sources, dcs, strict=True))
    w0, e0, s0 = member("w0", "west", 7500), member("e0", "east", 7700), \
        member("s0", "south", 7900)
    east = ProbeSchedule(e0, 0.0, after=0.0, every=600.0)
    assert east.due(1.0, [w0, s0], Wan(())) == [("south", s0), ("west", w0)]
    south = ProbeSchedule(s0, 0.0, after=0.0, every=600.0)
    assert south.due(1.0, [w0, e0], Wan(())) == [("west", w0), ("east", e0)]


@pytest.mark.parametrize("declared_mbit", [None, 300.0])
def test_a_probe_far_under_a_declared_rate_is_taken_twice(declared_mbit: float | None
                                                          ) -> None:
    """A real control plane and the real probe task; the probe itself is a function
    returning samples of 129 then 300 Mbit (what two probes of one link read)."""
    config = PeerConfig.local("me", links=() if declared_mbit is None else (
        LinkSpec("east", "west", declared_mbit * 1e6 / 8),))
    control = plane(config)
    reads = iter([129.0, 300.0])
    asked = []

    async def probe(target: PeerInfo, nbytes: int) -> ProbeSample:
        asked.append(target.name)
        mbit = next(reads)
        return ProbeSample(4 * nbytes, 2 * nbytes, 2 * nbytes * 8 / (mbit * 1e6), 0.08)

    probes = LinkProbes(ME, config, control, probe, 0.0)
    trio.run(probes.probe_link, "east", EAST[1])
    got = control.wan.estimate("east", "west")
    assert got is not None and got.how == "measured"
    if declared_mbit is None:  # nothing to doubt it by: one probe
        assert asked == ["e0"] and got.bps * 8 / 1e6 == pytest.approx(129.0)
    else:
        assert asked == ["e0", "e0"] and got.bps * 8 / 1e6 == pytest.approx(300.0)


def test_a_probe_of_several_streams_is_their_tails_over_the_time_they_ran() -> None:
    # Tails overlapping from 1.2 to 2.0: the link carried 4 MiB/1.0 s + 4 MiB/1.3 s.
    s = combine([(8 * MIB, 4 * MIB, 1.0, 2.0, 0.15), (8 * MIB, 4 * MIB, 1.2, 2.5, 0.12)])
    assert (s.nbytes, s.tail_bytes, s.rtt_s) == (16 * MIB, 8 * MIB, 0.12)
    assert s.tail_bytes / s.tail_seconds == pytest.approx(4 * MIB / 1.0 + 4 * MIB / 1.3)
    # One after the other (no overlap): the tails over the whole time, never the sum.
    s = combine([(8 * MIB, 4 * MIB, 1.0, 2.0, 0.1), (8 * MIB, 4 * MIB, 2.0, 3.0, 0.1)])
    assert s.tail_seconds == 2.0
    assert combine([]).tail_seconds == 0.0


def test_a_probe_with_marks_reads_the_window_all_streams_shared() -> None:
    """Two streams on a 10 MiB/s link: the first runs alone at 10 MiB/s from 0 to 1,
    both at 5 MiB/s each from 1 to 3, the second alone from 3 to 3.5.  Each tail's own
    rate sums to 20/3 + 15/2.5 = 12.7 MiB/s; the common window [1, 3] reads 10."""
    first = [(0.0, 0), (1.0, 10 * MIB), (3.0, 20 * MIB)]
    second = [(1.0, 0), (3.0, 10 * MIB), (3.5, 15 * MIB)]
    streams = [(40 * MIB, 20 * MIB, 0.0, 3.0, 0.1), (30 * MIB, 15 * MIB, 1.0, 3.5, 0.1)]
    s = combine(streams, [first, second])
    assert s.tail_bytes / s.tail_seconds == pytest.approx(10 * MIB)
    assert combine(streams).tail_bytes / combine(streams).tail_seconds > 12.5 * MIB  # high
    # A common window under COMMON_SHARE of the longest tail: the old rule.
    short = [(40 * MIB, 20 * MIB, 0.0, 3.0, 0.1), (30 * MIB, 15 * MIB, 2.9, 3.5, 0.1)]
    marks = [first, [(2.9, 0), (3.0, 1 * MIB), (3.5, 15 * MIB)]]
    assert combine(short, marks) == combine(short)


@pytest.mark.parametrize("options", [
    {"wan_probe_bytes": 1}, {"wan_probe_bytes": (1 << 30) + 1}, {"wan_probe_after": -1.0},
    {"wan_probe_after": float("inf")}, {"wan_probe_every": 0.0},
])
def test_probe_options_are_checked(options: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        PeerConfig.local("me", **options)
    assert PeerConfig.local("me", wan_probe_bytes=0).wan_probe_bytes == 0
