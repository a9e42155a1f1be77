"""The reader's side of a delta run: one TCP connection of its own to a holder's data
server (authenticated like any other, :func:`~tensorhub.transport.tcp.dial`), asking
for chunks as :class:`~tensorhub.protocol.dataplane.DeltaRunRequest` runs and handing
each :class:`~tensorhub.protocol.dataplane.DeltaReply` and its payload to the caller.

Delta payloads are small and arrive on the event loop (no reader thread); each is
bounded by what its chunk may take (``limit``) before a byte of it is read.  The
connection is closed when the run ends, however it ends: it is never kept in the pool
(a run stopped early leaves replies in flight).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence

import trio

from ..errors import RemoteProtocolError
from ..model import VersionKey
from ..protocol.dataplane import MAX_RUN_CHUNKS, OK, DeltaReply, DeltaRunRequest
from .frames import recv_body, recv_frame, send_frame
from .handshake import DataAuth
from .sockio import tune
from .tcp import dial

Handler = Callable[[int, DeltaReply, bytes], Awaitable[bool]]
"""``handle(chunk, reply, payload)``: payload is empty unless ``reply.status == OK``;
returns False to end the run at once."""


def runs(chunks: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, count)`` runs of consecutive chunks (``chunks`` ascending), each of at
    most ``MAX_RUN_CHUNKS``."""
    out: list[tuple[int, int]] = []
    for c in chunks:
        if out and out[-1][0] + out[-1][1] == c and out[-1][1] < MAX_RUN_CHUNKS:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((c, 1))
    return out


async def delta_run(address: str, peer: str, timeout: float, auth: DataAuth | None,
                    key: VersionKey, base: int, chunks: Sequence[int],
                    limit: Callable[[int], int], handle: Handler) -> None:
    """Ask ``peer`` (data server at ``address``) for ``chunks`` of ``key`` as deltas
    against version ``base`` and hand each answer to ``handle``, in order.  ``limit(c)``
    is the most payload chunk ``c`` may have: more is the holder's fault
    (:class:`RemoteProtocolError`), as is an answer out of turn."""
    host, _, port = address.rpartition(":")
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    tune(sock)
    await dial(sock, (host, int(port)), peer, timeout, auth,
               f"cannot connect to {peer} at {address}")
    ids = itertools.count(1)
    asked = []
    for first, count in runs(chunks):
        req = DeltaRunRequest(next(ids), key.model, key.version, base, first, count,
                              key.shard, key.layout)
        asked.append(req)

    async def send_all() -> None:  # beside the replies: a holder's answers never wait
        for req in asked:
            await send_frame(sock, req)

    with sock:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all)
                for req in asked:
                    for chunk in range(req.first, req.first + req.count):
                        if not await _answer(sock, peer, req.req_id, chunk, limit, handle):
                            nursery.cancel_scope.cancel()
                            return
                nursery.cancel_scope.cancel()  # every answer is in: so were the requests
        except BaseExceptionGroup as group:  # one error, as callers expect it
            found = group.subgroup(lambda e: not isinstance(e, trio.Cancelled)) or group
            while isinstance(found, BaseExceptionGroup):
                found = found.exceptions[0]
            raise found from None


async def _answer(sock: trio.socket.SocketType, peer: str, req_id: int, chunk: int,
                  limit: Callable[[int], int], handle: Handler) -> bool:
    """Read the answer for ``chunk`` and hand it on; False: the caller is done."""
    reply = await recv_frame(sock)
    if not isinstance(reply, DeltaReply) or reply.req_id != req_id or reply.chunk != chunk:
        raise RemoteProtocolError(f"{peer} answered a delta run out of turn")
    payload = b""
    if reply.status == OK:
        if reply.length > limit(chunk):
            raise RemoteProtocolError(
                f"{peer} sent a {reply.length}-byte delta for chunk {chunk}, "
                f"at most {limit(chunk)} expected")
        payload = await recv_body(sock, reply.length)
    return await handle(chunk, reply, payload)
