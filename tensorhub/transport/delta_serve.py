"""The holder's side of a delta run (:class:`~tensorhub.protocol.dataplane.DeltaRunRequest`).

For each chunk of the run, in order: wait (bounded) until the chunk of the new version is
verified here (a relay still receiving pipelines, as for full chunks), lease it and the
same chunk of the base, encode the delta in a worker thread
(:func:`~tensorhub.protocol.delta.encode_chunk`) and send a
:class:`~tensorhub.protocol.dataplane.DeltaReply` and the payload.  Encoding runs one
chunk ahead of sending, so the link and the encoder work at once.  A chunk this holder
lacks (either version) is answered with the lease's refusal (``NOT_HELD``, ``NOT_YET``)
and the run goes on.  Holder-side costs are counted in :class:`DeltaServed`
(``statistics().delta``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from ..errors import RemoteProtocolError
from ..model import VersionKey
from ..protocol.dataplane import NOT_HELD, OK, DeltaReply, DeltaRunRequest
from ..protocol.delta import RAW, encode_chunk
from .base import NotServing
from .frames import encode_frame

if TYPE_CHECKING:
    from .server import _ServerConn

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


def _encode(base: list[memoryview], new: list[memoryview]) -> tuple[bytes, int, float]:
    began = time.thread_time()
    old_b, new_b = b"".join(base), b"".join(new)
    delta = encode_chunk(old_b, new_b)
    return delta, len(new_b), time.thread_time() - began


async def serve_delta(conn: _ServerConn, req: DeltaRunRequest, served: DeltaServed) -> None:
    """Answer ``req`` on ``conn`` (see the module docstring)."""
    last = req.first + req.count - 1
    if last > _LAST_CHUNK:
        raise RemoteProtocolError(f"delta run of chunks {req.first}..{last} passes the "
                                  f"last chunk index {_LAST_CHUNK}")
    key = VersionKey(req.model, req.version, req.shard, req.layout)
    base = VersionKey(req.model, req.base, req.shard, req.layout)
    send, receive = trio.open_memory_channel[tuple[int, Any, bytes]](_AHEAD)

    async def encoder() -> None:
        provider = conn.server.provider
        async with send:
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
                    await send.send((chunk, ChunkRefusal(ns.status, ns.detail), b""))
                    continue
                served.chunks += 1
                served.raw_chunks += delta[0] == RAW
                served.chunk_bytes += size
                served.delta_bytes += len(delta)
                served.encode_seconds += cpu
                await send.send((chunk, min(int(cpu * 1e6), 2**32 - 1), delta))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(encoder)
        async with receive:
            async for chunk, info, delta in receive:
                if isinstance(info, ChunkRefusal):
                    head = DeltaReply(req.req_id, chunk, info.status, 0, 0, info.detail)
                    await conn.send_views([memoryview(encode_frame(head))])
                    continue
                head = DeltaReply(req.req_id, chunk, OK, len(delta), info)
                await conn.send_views([memoryview(encode_frame(head)), memoryview(delta)])
                conn.server.on_sent(conn.peer, len(delta))


@dataclass(frozen=True)
class ChunkRefusal:
    """A chunk of the run this holder does not serve, and why."""

    status: int
    detail: str
