"""Framing of data-plane connections (TCP and same-host alike): a 4-byte big-endian
length, then a codec-encoded message (see :mod:`tensorhub.protocol.dataplane`).

The one module that makes and reads frames, on both sides of a connection: on the
event loop (trio sockets: :func:`send_frame`, :func:`recv_frame`, and the exact reads
and writes under them) and in a reader's thread (a plain blocking socket:
:func:`recv_frame_blocking`, :func:`recv_exact_blocking`; see :mod:`.sockio`).

A frame is at most ``MAX_FRAME``.  Receiving on the event loop never allocates a
declared size before the bytes arrive: a peer that declares a frame and stalls holds
nothing.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Any

import trio

from ..errors import RemoteProtocolError, TransportError
from ..protocol import codec
from ..protocol.dataplane import FRAME_HEADER, MAX_FRAME

FRAME_LENGTH = struct.Struct(">I")
"""The header: a frame's body length."""

_BODY_PIECE = 64 << 10


def encode_frame(msg: Any) -> bytes:
    """``msg`` as one frame: header and body."""
    data = codec.encode(msg, MAX_FRAME)
    return FRAME_LENGTH.pack(len(data)) + data


def body_size(head: bytearray) -> int:
    """The body length a frame's header declares; over ``MAX_FRAME`` is the remote's
    fault."""
    (size,) = FRAME_LENGTH.unpack(head)
    if size > MAX_FRAME:
        raise RemoteProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    return int(size)


# -- on the event loop ---------------------------------------------------------------------


async def recv_exact(sock: trio.socket.SocketType, view: memoryview) -> None:
    """Fill ``view`` from ``sock``."""
    got, n = 0, len(view)
    while got < n:
        k = await sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportError("connection closed mid-frame")
        got += k


async def send_all(sock: trio.socket.SocketType, view: memoryview) -> None:
    sent, n = 0, len(view)
    while sent < n:
        sent += await sock.send(view[sent:])


async def recv_body(sock: trio.socket.SocketType, size: int) -> bytes:
    """A frame body of ``size`` bytes, grown as its bytes arrive: a peer that declares a
    frame and never sends it holds no memory for it."""
    body = bytearray()
    while len(body) < size:
        piece = await sock.recv(min(size - len(body), _BODY_PIECE))
        if not piece:
            raise TransportError("connection closed mid-frame")
        body += piece
    return bytes(body)


async def recv_rest_of_frame(sock: trio.socket.SocketType, head: bytearray, got: int) -> Any:
    """The message of a frame whose header's first ``got`` bytes are in ``head``."""
    await recv_exact(sock, memoryview(head)[got:])
    body = await recv_body(sock, body_size(head))
    return codec.decode(body, MAX_FRAME)


async def recv_frame(sock: trio.socket.SocketType) -> Any:
    """The next frame's message."""
    return await recv_rest_of_frame(sock, bytearray(FRAME_HEADER), 0)


async def send_frame(sock: trio.socket.SocketType, msg: Any) -> None:
    await send_all(sock, memoryview(encode_frame(msg)))


# -- in a thread, on a plain blocking socket -----------------------------------------------


def recv_exact_blocking(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (a frame's rest, or payload)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportError("connection closed mid-payload")
        got += k


def recv_frame_blocking(sock: socket.socket, on_idle: Callable[[], None]) -> Any:
    """The next frame's message, however long until its first byte: each time the
    socket's timeout passes with nothing, ``on_idle()`` decides whether to wait on (or
    raises)."""
    head = bytearray(FRAME_HEADER)
    view = memoryview(head)
    while True:
        try:
            got = sock.recv_into(view)
            break
        except TimeoutError:
            on_idle()
    if got == 0:
        raise TransportError("connection closed")
    recv_exact_blocking(sock, view[got:])
    body = bytearray(body_size(head))
    recv_exact_blocking(sock, memoryview(body))
    return codec.decode(bytes(body), MAX_FRAME)
