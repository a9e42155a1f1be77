"""Wire codec: typed frozen messages inside, msgpack at the edge.

Theory of operation
-------------------
Every control message is a frozen dataclass registered here under a small integer type
id.  Ids are only ever appended: a retired message keeps its number forever.  On the
wire a message is the msgpack array ``[type_id, field_1, field_2, ...]`` in the
dataclass's field order; nested dataclasses are nested arrays the same way (without a
type id).  Field types are read from the annotations once, at registration, and the
decoder checks every field against them: wrong types, wrong arity, unknown type ids,
over-long strings or collections and oversized frames all raise
:class:`RemoteProtocolError` -- never another exception.  Encoding a message that would
exceed the size cap raises :class:`LocalProtocolError` (that is our own fault).

Supported field types: ``int``, ``float``, ``str``, ``bytes``, ``bool``, ``X | None``,
``tuple[X, ...]``, fixed ``tuple[X, Y]`` and other frozen dataclasses made of these,
each optionally ``Annotated`` with the bounds of :mod:`tensorhub.bounds`: a ``float``
must be finite (an int is taken as one), an ``int`` needs a ``Range`` and a
``tuple[X, ...]`` a ``MaxLen`` (a ``str`` is capped at ``MAX_STR`` characters and
``bytes`` at the frame size unless a ``MaxLen`` says less); ``Valid`` adds a check of
the value (endpoint syntax, link reports).

The protocol version range this peer speaks is advertised in the join handshake
(``PROTOCOL_MIN`` .. ``PROTOCOL_MAX``); a peer with no overlap is refused.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from ..bounds import MaxLen, Range, Valid
from ..errors import LocalProtocolError, RemoteProtocolError

PROTOCOL_MIN = 1
PROTOCOL_MAX = 1
MAX_STR = 4096
MAX_ITEMS = 1 << 20
DEFAULT_MAX_BYTES = 4 << 20

T = TypeVar("T")
Check = Callable[[Any], Any]

_by_id: dict[int, type[Any]] = {}
_ids: dict[type[Any], int] = {}
_decoders: dict[type[Any], Check] = {}


def _bad(what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"malformed message: {what}")


def _scalar(kind: type[Any], bounds: tuple[Any, ...]) -> Check:
    lo = hi = 0
    limit = MAX_STR if kind is str else None
    for b in bounds:
        if isinstance(b, Range) and kind is int:
            lo, hi = b.lo, b.hi
        elif isinstance(b, MaxLen) and kind in (str, bytes):
            limit = b.n
        elif not isinstance(b, Valid):
            raise TypeError(f"{b!r} does not apply to a {kind.__name__} field")
    if kind is int and not any(isinstance(b, Range) for b in bounds):
        raise TypeError("an int wire field needs a Range (see tensorhub.bounds)")
    if kind is int:
        def check_int(value: Any) -> Any:
            if type(value) is not int:
                raise _bad(f"expected int, got {type(value).__name__}")
            if not lo <= value <= hi:
                raise _bad(f"integer {value} outside [{lo}, {hi}]")
            return value

        return check_int
    if kind is float:
        def check_float(value: Any) -> Any:
            if isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            elif type(value) is not float:
                raise _bad(f"expected float, got {type(value).__name__}")
            if not math.isfinite(value):
                raise _bad(f"float {value} is not finite")
            return value

        return check_float

    def check(value: Any) -> Any:
        if type(value) is not kind:
            raise _bad(f"expected {kind.__name__}, got {type(value).__name__}")
        if limit is not None and len(value) > limit:
            raise _bad(f"{kind.__name__} of length {len(value)} > {limit}")
        return value

    return check


def _validated(inner: Check, valid: list[Valid]) -> Check:
    def check(value: Any) -> Any:
        value = inner(value)
        for v in valid:
            try:
                v.check(value)
            except ValueError as exc:
                raise _bad(str(exc)) from None
        return value

    return check


def _checker(tp: Any, bounds: tuple[Any, ...] = ()) -> Check:
    """Build a validating converter from wire objects to ``tp`` (within ``bounds``)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _checker(args[0], (*bounds, *tp.__metadata__))
    valid = [b for b in bounds if isinstance(b, Valid)]
    if valid:
        return _validated(_checker(tp, tuple(b for b in bounds if not isinstance(b, Valid))),
                          valid)
    if tp in (int, float, str, bytes, bool):
        return _scalar(tp, bounds)
    if bounds and not (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        raise TypeError(f"bounds {bounds!r} do not apply to {tp!r}")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_checker(tp)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        inner = _checker(next(a for a in args if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        caps = [b.n for b in bounds if isinstance(b, MaxLen)]
        if not caps:
            raise TypeError(f"{tp!r} needs a MaxLen (see tensorhub.bounds)")
        cap = min(caps)
        item = _checker(args[0])

        def check_var(value: Any) -> tuple[Any, ...]:
            if not isinstance(value, list | tuple):
                raise _bad("expected a sequence")
            if len(value) > cap:
                raise _bad(f"{len(value)} items > {cap}")
            return tuple(item(v) for v in value)

        return check_var
    if origin is tuple and args:
        items = [_checker(a) for a in args]

        def check_fixed(value: Any) -> tuple[Any, ...]:
            if not isinstance(value, list | tuple) or len(value) != len(items):
                raise _bad(f"expected a {len(items)}-tuple")
            return tuple(c(v) for c, v in zip(items, value, strict=True))

        return check_fixed
    raise TypeError(f"unsupported wire field type {tp!r}")


def _dataclass_checker(cls: type[Any]) -> Check:
    if cls in _decoders:
        return _decoders[cls]
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    checks: list[Check] = []

    def check(value: Any) -> Any:
        if not isinstance(value, list | tuple) or len(value) != len(checks):
            raise _bad(f"{cls.__name__} needs {len(checks)} fields")
        try:
            return cls(*(c(v) for c, v in zip(checks, value, strict=True)))
        except RemoteProtocolError:
            raise
        except (ValueError, TypeError) as exc:  # a message's own __post_init__ refused it
            raise _bad(f"{cls.__name__}: {exc}") from None

    _decoders[cls] = check  # registered before recursing, so recursive types terminate
    try:
        checks.extend(_checker(hints[f.name]) for f in fields)
    except TypeError as exc:
        del _decoders[cls]
        raise TypeError(f"{cls.__name__}: {exc}") from None
    return check


def _to_wire(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [_to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init]
    if isinstance(obj, tuple):
        return [_to_wire(v) for v in obj]
    return obj


def fields_bytes(tag: bytes, *fields: Any) -> bytes:
    """The bytes a signature covers: ``tag`` (one per kind of signed claim, so a
    signature of one kind never passes for another) + the msgpack wire form of
    ``fields`` (each a wire value or message dataclass, as :func:`encode` writes it)."""
    packed: bytes = msgpack.packb(_to_wire(fields), use_bin_type=True)
    return tag + packed


def register(type_id: int, cls: type[T]) -> type[T]:
    """Give ``cls`` the wire id ``type_id`` (ids are never reused or renumbered)."""
    if type_id in _by_id or cls in _ids:
        raise LocalProtocolError(f"wire id {type_id} or class {cls.__name__} registered twice")
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise LocalProtocolError(f"{cls.__name__} must be a frozen dataclass")
    try:
        _dataclass_checker(cls)
    except TypeError as exc:
        raise LocalProtocolError(f"wire message {exc}") from None
    _by_id[type_id] = cls
    _ids[cls] = type_id
    return cls


def message(type_id: int) -> Callable[[type[T]], type[T]]:
    """Class decorator form of :func:`register`."""
    return lambda cls: register(type_id, cls)


def registered() -> dict[int, type[Any]]:
    return dict(_by_id)


def encode(msg: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    cls = type(msg)
    if cls not in _ids:
        raise LocalProtocolError(f"{cls.__name__} is not a registered wire message")
    try:
        data: bytes = msgpack.packb([_ids[cls], *_to_wire(msg)], use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:  # an int beyond 64 bits, ...
        raise LocalProtocolError(f"{cls.__name__} cannot be encoded: {exc}") from None
    if len(data) > max_bytes:
        raise LocalProtocolError(f"{cls.__name__} encodes to {len(data)} bytes > {max_bytes}")
    return data


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Bytes from the network -> a message; any defect raises RemoteProtocolError."""
    if len(data) > max_bytes:
        raise RemoteProtocolError(f"message of {len(data)} bytes exceeds the {max_bytes} cap")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=MAX_STR, max_bin_len=max_bytes, max_array_len=MAX_ITEMS,
            max_map_len=0, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise _bad(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, list) or not obj or type(obj[0]) is not int:
        raise _bad("expected [type_id, ...]")
    cls = _by_id.get(obj[0])
    if cls is None:
        raise _bad(f"unknown type id {obj[0]}")
    return _decoders[cls](obj[1:])
