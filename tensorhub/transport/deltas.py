"""Delta runs on the data plane (:class:`~tensorhub.protocol.dataplane.DeltaRunRequest`):
both sides.

*The holder* (:func:`serve_delta`, called by :mod:`.server`): for each chunk of the run,
in order, wait (bounded) until the chunk of the new version is verified here (a relay
still receiving pipelines, as for full chunks), lease it and the same chunk of the base,
encode the delta in a worker thread (:func:`~tensorhub.protocol.delta.encode_chunk`) and
send a :class:`~tensorhub.protocol.dataplane.DeltaReply` and the payload.  Encoding runs
ahead of sending, so the link and the encoder work at once.  A chunk this holder lacks
(either version) is answered with the lease's refusal (``NOT_HELD``, ``NOT_YET``) and the
run goes on.  Costs are counted in :class:`DeltaServed` (``statistics().delta``).

*The reader* (:func:`delta_run`): one TCP connection of its own to the holder's data
server (authenticated like any other, :func:`~tensorhub.transport.tcp.dial`), never kept
in the pool (a run stopped early leaves answers in flight).  Requests go out beside the
answers; delta payloads are small and arrive on the event loop (no reader thread), each
bounded by what its chunk may take (``limit``) before a byte of it is read.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from ..errors import RemoteProtocolError, TransportError
from ..model import VersionKey
from ..protocol.dataplane import (
    MAX_RUN_CHUNKS,
    NOT_HELD,
    OK,
    DeltaReply,
    DeltaRunRequest,
)
from ..protocol.delta import RAW, encode_chunk
from .base import NotServing, Provider
from .frames import encode_frame, recv_body, recv_frame, send_frame
from .handshake import DataAuth
from .sockio import tune
from .tcp import dial

_LAST_CHUNK = 2**32 - 1
_AHEAD = 2
"""Encoded chunks waiting to be sent at most (memory: two deltas, at most two chunks)."""


@dataclass
class DeltaServed:
    """What this holder's delta runs cost and sent (summed over all readers)."""

    chunks: int = 0
    raw_chunks: int = 0
    chunk_bytes: int = 0
    """Bytes of the chunks encoded (what they would have cost in full)."""
    delta_bytes: int = 0
    """Delta payload bytes sent."""
    encode_seconds: float = 0.0


@dataclass(frozen=True)
class ChunkRefusal:
    """A chunk of the run this holder does not serve, and why."""

    status: int
    detail: str


def _encode(base: list[memoryview], new: list[memoryview]) -> tuple[bytes, int, float]:
    began = time.thread_time()
    old_b, new_b = b"".join(base), b"".join(new)
    delta = encode_chunk(old_b, new_b)
    return delta, len(new_b), time.thread_time() - began


async def serve_delta(send_views: Callable[[list[Any]], Awaitable[None]],
                      on_sent: Callable[[int], None], provider: Provider,
                      req: DeltaRunRequest, served: DeltaServed) -> None:
    """Answer ``req`` from ``provider`` (see the module docstring): ``send_views`` sends
    buffers on the reader's connection in one write, ``on_sent(n)`` counts ``n`` payload
    bytes served."""
    last = req.first + req.count - 1
    if last > _LAST_CHUNK:
        raise RemoteProtocolError(f"delta run of chunks {req.first}..{last} passes the "
                                  f"last chunk index {_LAST_CHUNK}")
    key = VersionKey(req.model, req.version, req.shard, req.layout)
    base = VersionKey(req.model, req.base, req.shard, req.layout)
    send, receive = trio.open_memory_channel[tuple[int, Any, bytes]](_AHEAD)

    async def encoder() -> None:
        with send:
            for chunk in range(req.first, last + 1):
                try:
                    await provider.wait_chunk(key, chunk)
                    with provider.lease(base, chunk) as old, provider.lease(key, chunk) as new:
                        if sum(map(len, old)) != sum(map(len, new)):
                            raise NotServing(NOT_HELD, f"chunk {chunk} of {base} and of "
                                             f"{key} differ in length")
                        delta, size, cpu = await trio.to_thread.run_sync(
                            _encode, list(old), list(new))
                except NotServing as ns:
                    item: tuple[int, Any, bytes] = (chunk, ChunkRefusal(ns.status, ns.detail),
                                                    b"")
                else:
                    served.chunks += 1
                    served.raw_chunks += delta[0] == RAW
                    served.chunk_bytes += size
                    served.delta_bytes += len(delta)
                    served.encode_seconds += cpu
                    item = (chunk, min(int(cpu * 1e6), 2**32 - 1), delta)
                try:
                    await send.send(item)
                except trio.BrokenResourceError:
                    # The sender has ended (the reader left, or its send failed) and its
                    # error is the run's; raising here could end the run first and get
                    # a reader gone counted as bad input.
                    return

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(encoder)
            with receive:  # closed with no checkpoint: a failed send is the run's error
                async for chunk, info, delta in receive:
                    if isinstance(info, ChunkRefusal):
                        head = DeltaReply(req.req_id, chunk, info.status, 0, 0, info.detail)
                        await send_views([memoryview(encode_frame(head))])
                        continue
                    head = DeltaReply(req.req_id, chunk, OK, len(delta), info)
                    await send_views([memoryview(encode_frame(head)), memoryview(delta)])
                    on_sent(len(delta))
    except BaseExceptionGroup as group:  # the server tells a reader gone from bad input
        raise one_error(group) from None


def one_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error that ended a run's tasks, as one exception (callers and the server tell
    kinds apart): the link's or the remote's first, then any but a cancellation."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = list(exc.exceptions)
        elif not isinstance(exc, trio.Cancelled):
            leaves.append(exc)
    ours = (TransportError, RemoteProtocolError, OSError)
    return next((e for e in leaves if isinstance(e, ours)), leaves[0] if leaves else group)


# -- the reader's side --------------------------------------------------------------

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
        except BaseExceptionGroup as group:
            raise one_error(group) from None


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
