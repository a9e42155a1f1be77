"""Hypothesis strategies for wire messages, read from their annotated field types.

``valid(tp)`` draws values the codec accepts (within every field's bounds), favouring
the bounds themselves; ``hostile(tp)`` draws *wire objects* (what msgpack would hand the
decoder) that are mostly valid but, anywhere in the tree, may hold boundary integers
just outside a field's range, values of the wrong type, oversized collections or
garbage strings.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from hypothesis import strategies as st

from tensorhub.bounds import MaxLen, Range, Valid, check_control_endpoint, check_hostport
from tensorhub.links import MAX_LINK_BPS, MAX_LINK_RTT_S
from tensorhub.protocol.codec import _to_wire
from tensorhub.protocol.refs import check_links
from tensorhub.protocol.wan import LinkReport

BOUNDARY_INTS = (0, -1, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63))
HOSTS = ("127.0.0.1", "localhost", "10.0.0.7", "[::1]", "node-3.example")
GARBAGE = st.sampled_from([
    "", "\x00", "tcp://", "tcp://:1", "tcp://h:0", "tcp://h:65536", "tcp://h:99999999999",
    "h:-1", "tcp://a b:1", "tcp://[zz]:1", "ipc:///tmp/x", "tcp://h:1;evil:2", "x" * 5000,
    "tcp://" + "a" * 300 + ":1", "\u2603:1",
]) | st.text(max_size=30)
FLOATS = st.sampled_from([0.0, -0.0, 1.0, 1e-300, 1e300]) | st.floats(
    allow_nan=False, allow_infinity=False)
BAD_FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf")])
DC = st.sampled_from(["east", "west", "south", "dc-" + "x" * 250]) | st.text(min_size=1,
                                                                            max_size=8)
PLAUSIBLE_REPORTS = st.lists(st.builds(
    LinkReport, DC, DC, st.sampled_from([MAX_LINK_BPS, 1.0]) | st.floats(1.0, MAX_LINK_BPS),
    st.sampled_from([0.0, MAX_LINK_RTT_S]) | st.floats(0.0, MAX_LINK_RTT_S),
).filter(lambda r: r.src != r.dst), max_size=4).map(tuple)
"""What ``OriginEntry.links`` accepts (:func:`~tensorhub.protocol.refs.check_links`)."""


def _split(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    bounds: tuple[Any, ...] = ()
    while typing.get_origin(tp) is typing.Annotated:
        bounds = (*bounds, *tp.__metadata__)
        tp = typing.get_args(tp)[0]
    return tp, bounds


def _fields(cls: type) -> list[Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return [hints[f.name] for f in dataclasses.fields(cls) if f.init]


def _build(cls: type) -> Any:
    def build(values: tuple[Any, ...]) -> Any:
        try:
            return cls(*values)
        except (ValueError, TypeError):  # the message's own validation refused it
            return None
    return build


def valid(tp: Any) -> st.SearchStrategy[Any]:
    """Values of ``tp`` within its bounds."""
    tp, bounds = _split(tp)
    checks = {b.check for b in bounds if isinstance(b, Valid)}
    cap = min((b.n for b in bounds if isinstance(b, MaxLen)), default=None)
    if check_control_endpoint in checks or check_hostport in checks:
        prefix = "tcp://" if check_control_endpoint in checks else ""
        return st.builds(lambda h, p: f"{prefix}{h}:{p}", st.sampled_from(HOSTS),
                         st.integers(1, 65535))
    if check_links in checks:
        return PLAUSIBLE_REPORTS
    if tp is float:
        return FLOATS
    if tp is int:
        r = next(b for b in bounds if isinstance(b, Range))
        edges = [v for v in (r.lo, r.hi, r.lo + 1, r.hi - 1, 0) if r.lo <= v <= r.hi]
        return st.sampled_from(edges) | st.integers(r.lo, min(r.hi, r.lo + 8)) \
            | st.integers(r.lo, r.hi)
    if tp is str:
        return st.text(max_size=min(cap or 40, 40))
    if tp is bytes:
        return st.binary(max_size=min(cap or 64, 64))
    if tp is bool:
        return st.booleans()
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return st.tuples(*map(valid, _fields(tp))).map(_build(tp)).filter(
            lambda m: m is not None)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return st.none() | valid(next(a for a in args if a is not type(None)))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(valid(args[0]), max_size=min(cap or 4, 4)).map(tuple)
    if origin is tuple:
        return st.tuples(*map(valid, args))
    raise AssertionError(f"no strategy for {tp!r}")


WRONG = st.sampled_from([None, True, 1.5, "s", b"b", [], [1, 2], -1, 2**64 - 1])


def hostile(tp: Any) -> st.SearchStrategy[Any]:
    """Wire objects for a field of type ``tp``: usually valid, sometimes not at all."""
    base, bounds = _split(tp)
    cap = min((b.n for b in bounds if isinstance(b, MaxLen)), default=None)
    bad: list[st.SearchStrategy[Any]] = [WRONG]
    if base is int:
        r = next(b for b in bounds if isinstance(b, Range))
        bad.append(st.sampled_from([*BOUNDARY_INTS, r.lo - 1, r.hi + 1]).filter(
            lambda v: -(2**63) <= v < 2**64))
    elif base is str:
        bad.append(GARBAGE)
    elif base is float:
        bad.append(BAD_FLOATS)
    elif dataclasses.is_dataclass(base) and isinstance(base, type):
        good = st.tuples(*map(hostile, _fields(base))).map(list)
        return good | st.sampled_from([None, [], "x", 7])
    else:
        origin, args = typing.get_origin(base), typing.get_args(base)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            item = hostile(args[0])
            items = st.lists(item, max_size=3)
            if cap is not None:  # one more than allowed: the decoder must count first
                items = items | st.just(cap + 1).flatmap(
                    lambda n: st.lists(item, min_size=n, max_size=n) if n <= 300
                    else st.just([0] * n))
            return items | WRONG
        if origin in (types.UnionType, typing.Union):
            return st.none() | hostile(next(a for a in args if a is not type(None)))
        if origin is tuple:
            return st.tuples(*map(hostile, args)).map(list) | WRONG
    good = valid(tp).map(_to_wire)
    return st.one_of(good, good, good, *bad)
