"""Codec: every registered message round-trips; garbage and mutations are rejected cleanly."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_strategies import valid as strategy_for

from tensorhub.errors import LocalProtocolError, RemoteProtocolError
from tensorhub.protocol import codec
from tensorhub.protocol.messages import register_all

register_all()
MESSAGES = sorted(codec.registered().items())


def _valid(msg: Any) -> bool:
    try:
        codec.encode(msg)
    except (LocalProtocolError, ValueError, TypeError):
        return False
    return True


ANY = st.one_of(*(strategy_for(cls) for _, cls in MESSAGES)).filter(_valid)


def test_registry_is_not_empty_and_ids_are_unique() -> None:
    ids = [i for i, _ in MESSAGES]
    assert len(ids) >= 5 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("type_id,cls", MESSAGES, ids=[c.__name__ for _, c in MESSAGES])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_message_round_trips(type_id: int, cls: type, data: st.DataObject) -> None:
    msg = data.draw(strategy_for(cls).filter(_valid))
    wire = codec.encode(msg)
    assert msgpack.unpackb(wire)[0] == type_id
    assert codec.decode(wire) == msg


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        codec.decode(data)


@settings(max_examples=300, deadline=None)
@given(ANY, st.data())
def test_mutated_messages_are_rejected_or_valid(msg: Any, data: st.DataObject) -> None:
    wire = bytearray(codec.encode(msg))
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
    pos = data.draw(st.integers(0, len(wire) - 1))
    if kind == "flip":
        wire[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del wire[pos:]
    else:
        wire[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        out = codec.decode(bytes(wire))
    except RemoteProtocolError:
        return
    # Whatever decodes must be a well-typed registered message that re-encodes.
    assert type(out) in dict(MESSAGES).values()
    assert codec.decode(codec.encode(out)) == out


@settings(max_examples=200, deadline=None)
@given(ANY)
def test_decoding_one_byte_at_a_time_prefixes_never_crash(msg: Any) -> None:
    wire = codec.encode(msg)
    for i in range(len(wire)):
        with pytest.raises(RemoteProtocolError):
            codec.decode(wire[:i])
    assert codec.decode(wire) == msg


@settings(max_examples=20, deadline=None)
@given(strategy_for(MESSAGES[0][1]))
def test_oversized_messages_are_refused_both_ways(msg: Any) -> None:
    wire = codec.encode(msg)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        codec.decode(wire, max_bytes=len(wire) - 1)
    with pytest.raises(LocalProtocolError):
        codec.encode(msg, max_bytes=len(wire) - 1)


@pytest.mark.parametrize("payload", [
    [], [999], ["x"], [1, "not-an-int", "m", 1], [1, 2, 3], {"a": 1}, [True, 1],
])
def test_wrong_shapes_are_remote_errors(payload: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        codec.decode(msgpack.packb(payload))


def test_unregistered_class_cannot_be_encoded() -> None:
    @dataclasses.dataclass(frozen=True)
    class Stray:
        x: int

    with pytest.raises(LocalProtocolError):
        codec.encode(Stray(1))
