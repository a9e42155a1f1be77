"""Bounds of wire fields: which values a field of a wire message may carry.

Every field of a wire message has a type annotated with one of the markers below
(``typing.Annotated``, so type checkers still see ``int``, ``str``, ``bytes`` or a tuple).
The codec (:mod:`tensorhub.protocol.codec`) reads them once, when a message is
registered, and refuses a message with any field outside its bounds with
:class:`~tensorhub.errors.RemoteProtocolError`: nothing out of range reaches a handler.
It refuses to register an ``int`` field without a :class:`Range` or a variable-length
tuple without a :class:`MaxLen`, so no field can be left unbounded by oversight.

Widths are chosen so that the arithmetic peers do on a value cannot break encoding:
versions and every counter a peer increments (incarnations, sequence numbers,
generations, terms, rounds) are below 2**63, so one more still fits msgpack's uint64.
(A receiver refuses that one more -- and counts it -- it never raises OverflowError.)

Endpoints are parsed at the edge too: a control address is ``tcp://HOST:PORT`` and a
data address ``HOST:PORT``, HOST a DNS name or an IP address, PORT in 1..65535.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any


@dataclass(frozen=True, slots=True)
class Range:
    """An ``int`` field lies in ``[lo, hi]``."""

    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class MaxLen:
    """A ``str`` (characters), ``bytes`` (bytes) or tuple (items) holds at most ``n``."""

    n: int


@dataclass(frozen=True, slots=True)
class Valid:
    """A field's value must pass ``check`` (which raises ValueError if it does not)."""

    check: Callable[[Any], object]


MAX_PEERS = 1 << 16
"""Members one message may list (a full membership state, a reference digest)."""
MAX_WORLD = 1 << 16
"""Ranks of one publishing or consuming group."""
MAX_PEER_NAME = 200
MAX_LABELS = 32
MAX_LABEL_KEY = 64
MAX_LABEL_VALUE = 256
MAX_TEXT = 4096
"""Free text (error details)."""
MAX_SIG = 128
"""Bytes of a signature (Ed25519's are 64)."""

U8 = Annotated[int, Range(0, 2**8 - 1)]
U16 = Annotated[int, Range(0, 2**16 - 1)]
U32 = Annotated[int, Range(0, 2**32 - 1)]
U63 = Annotated[int, Range(0, 2**63 - 1)]
"""Versions, and counters a peer increments: one more still encodes."""
U64 = Annotated[int, Range(0, 2**64 - 1)]
"""Sizes and addresses, never incremented."""
Rank = Annotated[int, Range(0, MAX_WORLD - 1)]
World = Annotated[int, Range(1, MAX_WORLD)]
PeerName = Annotated[str, MaxLen(MAX_PEER_NAME)]
Text = Annotated[str, MaxLen(MAX_TEXT)]
PeerNames = Annotated[tuple[PeerName, ...], MaxLen(MAX_PEERS)]
Signature = Annotated[bytes, MaxLen(MAX_SIG)]

_DNS_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def check_host(host: str) -> str:
    """A DNS name, an IPv4 address or an IPv6 address (bare or in brackets)."""
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ipaddress.ip_address(host[1:-1] if bracketed else host)
        return host
    except ValueError:
        if bracketed:
            raise ValueError(f"not an IPv6 address: {host!r}") from None
    if not 0 < len(host) <= 253 or not all(_DNS_LABEL.fullmatch(p) for p in host.split(".")):
        raise ValueError(f"not a host name or IP address: {host[:80]!r}")
    return host


@functools.lru_cache(maxsize=8192)  # gossip repeats the same few endpoints endlessly
def check_hostport(text: str) -> str:
    """``HOST:PORT`` with a sane host and a port in 1..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit() and len(port) <= 5) \
            or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {text[:80]!r}")
    check_host(host)
    return text


@functools.lru_cache(maxsize=8192)
def check_control_endpoint(text: str) -> str:
    """``tcp://HOST:PORT``: the only control endpoints a peer connects to."""
    if not text.startswith("tcp://"):
        raise ValueError(f"expected tcp://HOST:PORT, got {text[:80]!r}")
    check_hostport(text[6:])
    return text


ControlEndpoint = Annotated[str, MaxLen(300), Valid(check_control_endpoint)]
DataEndpoint = Annotated[str, MaxLen(300), Valid(check_hostport)]
Labels = Annotated[
    tuple[tuple[Annotated[str, MaxLen(MAX_LABEL_KEY)], Annotated[str, MaxLen(MAX_LABEL_VALUE)]],
          ...],
    MaxLen(MAX_LABELS)]
