"""A link probe over TCP: time a read of zeros from a holder's data server.

The reader opens :data:`~tensorhub.protocol.probing.PROBE_STREAMS` connections (each
authenticated like any data connection) and on each sends a
:class:`~tensorhub.protocol.dataplane.ProbeRequest` for no bytes -- its answer times a
round trip -- then one for ``nbytes``, and times the second half of what arrives.  The
payload lands in one small scratch buffer per stream, reused: a probe holds no more
than that whatever the holder declares, and a holder that declares more than was asked
is refused.  See :mod:`tensorhub.protocol.probing` for who probes what, and why only the
second half is timed.
"""

from __future__ import annotations

import trio

from ..errors import RemoteProtocolError, TransportError
from ..protocol.dataplane import OK, ProbeRequest, Reply
from ..protocol.probing import PROBE_STREAMS, ProbeSample, combine
from .frames import recv_frame, send_frame
from .handshake import DataAuth
from .tcp import TcpConnection

MARK_BYTES = 64 << 10
"""A stream notes its tail's progress every this many bytes (an 8 MiB stream: 64
marks), so the window all streams shared can be cut out of each."""

SCRATCH = 1 << 20
"""Bytes of the buffer each stream lands the zeros in, over and over."""


async def probe(address: str, peer: str, nbytes: int, timeout: float,
                auth: DataAuth | None = None, streams: int = PROBE_STREAMS) -> ProbeSample:
    """Probe the link from ``peer`` (data server at ``address``): ``streams`` streams
    of ``nbytes`` each, side by side, all within ``timeout`` seconds.  A failure, a
    refusal or the timeout raises :class:`TransportError`; a holder that breaks the
    protocol, :class:`RemoteProtocolError`."""
    got: list[tuple[int, int, float, float, float]] = []
    marks: list[list[tuple[float, int]]] = []

    async def one() -> None:
        conn = await TcpConnection.connect(address, peer, timeout, auth)
        try:
            mine: list[tuple[float, int]] = []
            got.append(await _timed(conn, nbytes, mine))
            marks.append(mine)
        finally:
            await conn.aclose()

    try:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                for _ in range(streams):
                    nursery.start_soon(one)
    except trio.TooSlowError:
        raise TransportError(f"the probe of {peer} took over {timeout:g} s") from None
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        if isinstance(first, OSError):
            raise TransportError(f"the probe of {peer} failed: {first}") from None
        raise first from None
    return combine(got, marks)


async def _timed(conn: TcpConnection, nbytes: int, marks: list[tuple[float, int]]
                 ) -> tuple[int, int, float, float, float]:
    """One stream: ``(bytes, tail bytes, tail start, end, round trip)``; ``marks`` gets
    ``(time, tail bytes so far)`` from the tail's start, every :data:`MARK_BYTES` and
    at the end."""
    sock = conn.sock
    sent = trio.current_time()
    await _ask(conn, ProbeRequest(1, 0), 0)
    rtt = trio.current_time() - sent
    length = await _ask(conn, ProbeRequest(2, nbytes), nbytes)
    scratch = memoryview(bytearray(max(1, min(length, SCRATCH))))
    half, got = length // 2, 0
    tail_at = trio.current_time()
    while got < length:  # never past the half way in one read: the tail starts there
        k = await sock.recv_into(scratch, min(len(scratch), (half if got < half else length)
                                              - got))
        if k == 0:
            raise TransportError(f"{conn.peer} closed the connection mid-probe")
        got += k
        if got == half:
            tail_at = trio.current_time()
            marks.append((tail_at, 0))
        elif marks and (got - half - marks[-1][1] >= MARK_BYTES or got == length):
            marks.append((trio.current_time(), got - half))
    end = trio.current_time()
    if not marks or marks[-1][1] != length - half:
        marks.append((end, length - half))
    return length, length - half, tail_at, end, rtt


async def _ask(conn: TcpConnection, req: ProbeRequest, most: int) -> int:
    """Send ``req``; the payload length its answer declares (at most ``most``)."""
    await send_frame(conn.sock, req)
    reply = await recv_frame(conn.sock)
    if not isinstance(reply, Reply) or reply.req_id != req.req_id:
        raise RemoteProtocolError(f"{conn.peer} answered a probe out of turn")
    if reply.status != OK:
        raise TransportError(f"{conn.peer} refused the probe: {reply.detail or reply.status}")
    if reply.length > most:
        raise RemoteProtocolError(f"{conn.peer} declared {reply.length} probe bytes, "
                                  f"{most} asked")
    return int(reply.length)
