"""Hostile input through the codec and the sans-IO control plane (no sockets).

Every registered message type is decoded from wire objects that are mostly valid but
may hold boundary integers, wrong types, oversized collections or garbage strings in any
field: decoding returns a message within every field's bounds or raises
RemoteProtocolError.  Whatever decodes is then fed to ``ControlPlane.receive`` (and the
group messages to ``GroupMember.receive``), between ticks: nothing raises, and the plane
still accepts a legitimate member afterwards.
"""

from __future__ import annotations

import dataclasses
import random
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_strategies import BOUNDARY_INTS, hostile, valid

from tensorhub import PeerConfig
from tensorhub.bounds import Range
from tensorhub.errors import LocalProtocolError, RemoteProtocolError
from tensorhub.model import PeerInfo
from tensorhub.protocol import codec, groups
from tensorhub.protocol.addressing import CONTROL, misaddressed
from tensorhub.protocol.control import ControlPlane
from tensorhub.protocol.coordination import MAX_REQUESTED_KEYS, CoordReply, CoordRequest
from tensorhub.protocol.groups import GroupMember
from tensorhub.protocol.membership import ALIVE, Gossip, PushPull, Update
from tensorhub.protocol.messages import register_all

register_all()
MESSAGES = sorted(codec.registered().items())
GROUP = tuple(c for c in groups.MESSAGES if c is not groups.GroupEnvelope)
CONFIG = PeerConfig.local("me")
ME = PeerInfo("me", "tcp://127.0.0.1:7000", "127.0.0.1:7001", (("host", "h"),))
FRIENDS = [PeerInfo(f"f{i}", f"tcp://127.0.0.1:{7100 + i}", f"127.0.0.1:{7200 + i}")
           for i in range(3)]
LEGIT = PeerInfo("legit-" + "x" * 60, "tcp://10.1.2.3:4567", "10.1.2.3:4568")  # no draw is so long


def _decode_or_refuse(wire: bytes) -> Any:
    try:
        return codec.decode(wire)
    except RemoteProtocolError:
        return None


@pytest.mark.parametrize("type_id,cls", MESSAGES, ids=[c.__name__ for _, c in MESSAGES])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_decode_returns_a_bounded_message_or_refuses(type_id: int, cls: type,
                                                     data: st.DataObject) -> None:
    fields = data.draw(hostile(cls))
    if not isinstance(fields, list):
        fields = [fields]
    msg = _decode_or_refuse(msgpack.packb([type_id, *fields], use_bin_type=True))
    if msg is not None:
        assert type(msg) is cls
        assert codec.decode(codec.encode(msg)) == msg  # what decodes is within bounds


def _int_leaves(obj: Any, path: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    if type(obj) is int:
        return [path]
    if isinstance(obj, list):
        return [p for i, x in enumerate(obj) for p in _int_leaves(x, (*path, i))]
    return []


def _replace(obj: Any, path: tuple[int, ...], value: int) -> Any:
    if not path:
        return value
    return [_replace(x, path[1:], value) if i == path[0] else x for i, x in enumerate(obj)]


def _range_at(tp: Any, path: tuple[int, ...]) -> Range:
    """The Range of the int field at ``path`` of a wire object of type ``tp``."""
    bounds: list[Any] = []
    while True:
        while typing.get_origin(tp) is typing.Annotated:
            bounds += tp.__metadata__
            tp = typing.get_args(tp)[0]
        args = typing.get_args(tp)
        if not path:
            return next(b for b in bounds if isinstance(b, Range))
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp, include_extras=True)
            tp = hints[[f for f in dataclasses.fields(tp) if f.init][path[0]].name]
        elif type(None) in args:
            tp = next(a for a in args if a is not type(None))
            continue
        else:
            tp = args[0] if args[-1] is Ellipsis else args[path[0]]
        path, bounds = path[1:], []


@pytest.mark.parametrize("type_id,cls", MESSAGES, ids=[c.__name__ for _, c in MESSAGES])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_boundary_integers_in_every_int_field(type_id: int, cls: type,
                                              data: st.DataObject) -> None:
    """Every integer anywhere in a message in turn gets each boundary value: it decodes
    only within its field's range."""
    wire = msgpack.unpackb(codec.encode(data.draw(valid(cls))))
    for path in _int_leaves(wire)[1:]:  # [0] is the type id
        bounds = _range_at(cls, (path[0] - 1, *path[1:]))
        for value in (*BOUNDARY_INTS, 2**64 - 2, -(2**63) + 1, bounds.lo - 1, bounds.hi + 1):
            if not -(2**63) <= value < 2**64:
                continue  # msgpack itself cannot carry it
            mutated = _replace(wire, path, value)
            out = _decode_or_refuse(msgpack.packb(mutated, use_bin_type=True))
            if not bounds.lo <= value <= bounds.hi:
                assert out is None, (path, value)
            elif out is not None:
                assert codec.decode(codec.encode(out)) == out


def test_integer_beyond_64_bits_cannot_be_encoded() -> None:
    """The crash of the issue: a peer that computes incarnation + 1 past 2**64 - 1 gets
    LocalProtocolError (its own fault, counted by the shell), never OverflowError."""
    upd = Update(0, "a", 2**64, "a", PeerInfo("a", "tcp://h:1", "h:2"))
    with pytest.raises(LocalProtocolError):
        codec.encode(Gossip("tcp://h:1", "a", (upd,)))
    one_more = Update(0, "a", 2**63, "a", PeerInfo("a", "tcp://h:1", "h:2"))
    wire = codec.encode(Gossip("tcp://h:1", "a", (one_more,)))  # the cap + 1 encodes ...
    with pytest.raises(RemoteProtocolError, match="outside"):
        codec.decode(wire)  # ... and the receiver refuses it


@pytest.mark.parametrize("endpoint", [
    "a:1", "tcp://", "tcp://h", "tcp://h:0", "tcp://h:65536", "tcp://h:1;e:2", "ipc:///x",
    "tcp://a b:1", "tcp://[zz]:1", "tcp://h:+1", "tcp://h:１", "tcp://" + "a" * 300 + ":1",
    "tcp://-h:1", "tcp://*:1",
])
def test_bad_control_endpoints_are_refused_at_decode(endpoint: str) -> None:
    info = PeerInfo("a", endpoint, "h:2")
    wire = codec.encode(Gossip("tcp://h:1", "a", (Update(0, "a", 1, "a", info),)))
    with pytest.raises(RemoteProtocolError):
        codec.decode(wire)


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:1", "tcp://localhost:65535", "tcp://[::1]:80", "tcp://n-1.ex.com:9"])
def test_good_control_endpoints_decode(endpoint: str) -> None:
    info = PeerInfo("a", endpoint, "10.0.0.1:2", (("dc", "x"),))
    msg = Gossip(endpoint, "a", (Update(0, "a", 1, "a", info),))
    assert codec.decode(codec.encode(msg)) == msg


def test_labels_and_collections_are_capped() -> None:
    labels = tuple((f"k{i}", "v") for i in range(33))
    info = PeerInfo("a", "tcp://h:1", "h:2", labels)
    with pytest.raises(RemoteProtocolError, match="33 items"):
        codec.decode(codec.encode(Gossip("tcp://h:1", "a", (Update(0, "a", 1, "a", info),))))
    many = tuple(Update(1, f"m{i}", 0, "a", None) for i in range(257))
    with pytest.raises(RemoteProtocolError, match="257 items"):
        codec.decode(codec.encode(Gossip("tcp://h:1", "a", many)))


def _plane() -> ControlPlane:
    plane = ControlPlane(ME, CONFIG, random.Random(0), 0.0, 1)
    ups = tuple(Update(0, f.name, 0, f.name, f) for f in FRIENDS)
    plane.receive(0.0, Gossip(FRIENDS[0].control, FRIENDS[0].name, ups))
    return plane


def _hostile_control_message(data: st.DataObject) -> Any:
    """A decoded control message: drawn valid (boundary values favoured) or decoded from
    hostile wire objects (most of which the codec refuses)."""
    cls = data.draw(st.sampled_from(CONTROL))
    if data.draw(st.booleans()):
        return data.draw(valid(cls))
    fields = data.draw(hostile(cls))
    type_id = next(i for i, c in MESSAGES if c is cls)
    return _decode_or_refuse(msgpack.packb([type_id, *(fields if isinstance(fields, list)
                                                       else [fields])], use_bin_type=True))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_control_plane_survives_any_decoded_message(data: st.DataObject) -> None:
    plane = _plane()
    now = 0.0
    for _ in range(data.draw(st.integers(1, 12))):
        msg = _hostile_control_message(data)
        if msg is not None:
            for o in plane.receive(now, msg):
                codec.decode(codec.encode(o.msg))  # what we send, receivers accept
        now += data.draw(st.sampled_from([0.0, 0.05, 0.5, 5.0, 60.0]))
        for o in plane.tick(now):
            codec.decode(codec.encode(o.msg))
        plane.drain_events()
    # The plane still works: a member it has never heard of is accepted.
    plane.receive(now, Gossip(LEGIT.control, LEGIT.name,
                              (Update(0, LEGIT.name, 0, LEGIT.name, LEGIT),)))
    assert plane.membership.members()[LEGIT.name].status == ALIVE
    assert LEGIT in plane.membership.live_members()


def test_refutation_at_the_top_incarnation_encodes() -> None:
    """The issue's attack, sans-IO: a claim about us at 2**63 - 1 (the highest that
    decodes); whatever we answer still encodes."""
    plane = _plane()
    for kind in range(4):
        top = Update(kind, ME.name, 2**63 - 1, "f0", ME if kind == 0 else None)
        for o in plane.receive(1.0, Gossip(FRIENDS[0].control, "f0", (top,))):
            codec.decode(codec.encode(o.msg))  # and the receivers accept it
        for o in plane.tick(2.0):
            codec.decode(codec.encode(o.msg))
    assert plane.membership.is_live(ME.name)


def test_full_state_with_boundary_members_is_merged() -> None:
    plane = _plane()
    records = tuple(Update(k, f"b{i}", inc, "f0", PeerInfo(f"b{i}", f"tcp://h:{i + 1}",
                                                          f"h:{i + 2}") if k <= 1 else None)
                    for i, (k, inc) in enumerate((k, inc) for k in range(4)
                                                 for inc in (0, 2**32, 2**63 - 1)))
    out = plane.receive(0.0, PushPull(FRIENDS[0].control, "f0", b"", records, True))
    assert out and all(codec.decode(codec.encode(o.msg)) == o.msg for o in out)


def test_sender_fields_must_be_the_connection_they_came_on() -> None:
    plane = _plane()
    members = plane.membership.members()
    f1 = FRIENDS[1]
    ok = [(Gossip(f1.control, "f1", ()), f1.control),
          (CoordRequest("tcp://elsewhere:1", "f2", 1, "m", 1, None, 2), f1.control),
          (groups.GroupEnvelope("g", "f1", b""), f1.control)]
    bad = [(Gossip("tcp://elsewhere:1", "f1", ()), f1.control),
           (CoordRequest("tcp://elsewhere:1", "f2", 1, "m", 1, None, 0), f1.control),
           (groups.GroupEnvelope("g", "f2", b""), f1.control),
           (groups.GroupEnvelope("g", "stranger", b""), f1.control),
           (groups.Ready(0, groups.Round(0, 0), 1), f1.control)]
    assert [misaddressed(m, r, members) for m, r in ok] == ["", "", ""]
    assert all(misaddressed(m, r, members) for m, r in bad)


def test_coordinator_requests_cannot_grow_state_without_bound() -> None:
    plane = _plane()
    coord = plane.coordination
    for i in range(MAX_REQUESTED_KEYS * 8):  # a quarter of them is ours to coordinate
        plane.receive(0.0, CoordRequest(FRIENDS[1].control, "f1", i, "m", i, None, 0))
    assert len(coord.keys) == MAX_REQUESTED_KEYS
    assert coord.view.statistics().coordinated <= MAX_REQUESTED_KEYS
    # strangers do not register, and replies to requests never made are ignored
    out = plane.receive(0.0, CoordRequest(FRIENDS[1].control, "stranger", 1, "m", 1, None, 0))
    assert all(not o.msg.ok for o in out if isinstance(o.msg, CoordReply))
    plane.receive(0.0, CoordReply(12345, "m", 1, False, None, (), "forged"))
    assert coord.answers == {} and coord.unsolicited == 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_group_member_refuses_or_handles_any_decoded_message(data: st.DataObject) -> None:
    member = GroupMember(["a", "b", "c"], 1)
    now = 0.0
    for _ in range(data.draw(st.integers(1, 8))):
        msg = data.draw(valid(data.draw(st.sampled_from(GROUP))))
        try:
            out = member.receive(now, msg)
        except RemoteProtocolError:
            continue
        for o in out:
            if isinstance(o, groups.Send):
                codec.decode(codec.encode(o.msg))
        now += 1.0
        for o in member.tick(now):
            if isinstance(o, groups.Send):
                codec.decode(codec.encode(o.msg))
