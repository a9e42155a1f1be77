"""Framing of data-plane connections (TCP and same-host alike): a 4-byte big-endian
length, then a codec-encoded message (see :mod:`tensorhub.protocol.dataplane`).

Receiving never allocates a declared size before the bytes arrive, and a frame is at
most ``MAX_FRAME``: a peer that declares a frame and stalls holds nothing.
"""

from __future__ import annotations

import struct
from typing import Any

import trio

from ..errors import RemoteProtocolError, TransportError
from ..protocol import codec
from ..protocol.dataplane import FRAME_HEADER, MAX_FRAME

_LEN = struct.Struct(">I")


async def _recv_exact(sock: trio.socket.SocketType, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = await sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportError("connection closed mid-frame")
        got += k


async def _send_all(sock: trio.socket.SocketType, view: memoryview) -> None:
    sent, n = 0, len(view)
    while sent < n:
        sent += await sock.send(view[sent:])


def _body_size(head: bytearray) -> int:
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME:
        raise RemoteProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    return int(size)


async def _recv_body(sock: trio.socket.SocketType, size: int) -> bytes:
    """A frame body of ``size`` bytes, grown as its bytes arrive: a peer that declares a
    frame and never sends it holds no memory for it."""
    body = bytearray()
    while len(body) < size:
        piece = await sock.recv(min(size - len(body), _BODY_PIECE))
        if not piece:
            raise TransportError("connection closed mid-frame")
        body += piece
    return bytes(body)


_BODY_PIECE = 64 << 10


async def _recv_frame(sock: trio.socket.SocketType) -> Any:
    head = bytearray(FRAME_HEADER)
    await _recv_exact(sock, memoryview(head))
    body = await _recv_body(sock, _body_size(head))
    return codec.decode(body, MAX_FRAME)


def _frame(msg: Any) -> bytes:
    data = codec.encode(msg, MAX_FRAME)
    return _LEN.pack(len(data)) + data


async def _send_frame(sock: trio.socket.SocketType, msg: Any) -> None:
    await _send_all(sock, memoryview(_frame(msg)))
