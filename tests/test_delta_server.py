"""A holder's side of a delta run (``tensorhub.transport.deltas.serve_delta``) over a
real data server and socket: a reader that leaves a run midway is a reader gone, never
bad input, whatever the run's encoder was doing when it left."""

from __future__ import annotations

import errno
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio
from helpers import wait_until

from tensorhub.protocol.dataplane import DeltaRunRequest
from tensorhub.read.store import Store
from tensorhub.testing.conformance import publish, rng_for
from tensorhub.transport import deltas
from tensorhub.transport import server as server_module
from tensorhub.transport.admission import ServerLimits
from tensorhub.transport.frames import send_frame
from tensorhub.transport.server import TcpServer

CHUNK = 1 << 18
CHUNKS = 48


async def settled(read: Callable[[], int]) -> int:
    """Poll ``read()`` until it holds still for a few polls; its value then."""
    seen: list[int] = []

    def still() -> bool:  # the same five reads in a row, 0.05 s apart
        seen[:] = [*seen[-4:], read()]
        return len(seen) == 5 and len(set(seen)) == 1

    await wait_until(still, 30, every=0.05, what="the count holding still")
    return seen[-1]


async def test_a_reader_that_resets_a_stalled_delta_run_is_not_bad_input() -> None:
    """The reader asks for a run, reads nothing (the holder's send stalls on a full
    socket and its encoder waits on a full queue), then resets the connection: the
    holder's send fails and the encoder, waiting, finds the queue closed.  Neither is
    counted as a malformed frame (``bad_frames``) nor reported as bad input."""
    store = Store()
    bad: list[str] = []
    server = TcpServer(store, lambda peer, n: None, bad.append, ServerLimits())
    port = server.bind("127.0.0.1", 0)
    rng = rng_for("delta-reset")
    publish(store, rng, [CHUNKS * CHUNK], CHUNK, version=1)
    publish(store, rng, [CHUNKS * CHUNK], CHUNK, version=2)  # unrelated: raw deltas
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        for attempt in range(3):
            sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            await sock.connect(("127.0.0.1", port))
            await send_frame(sock, DeltaRunRequest(1, "m", 2, 1, 0, CHUNKS))
            encoded = await settled(lambda: server.delta.chunks)
            assert encoded < CHUNKS * (attempt + 1), "the run never stalled"
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset: the holder's stalled send fails at once
            await wait_until(lambda: not server.statistics().connections_open, 30,
                             what="the reset connection closed")
        stats = server.statistics()
        assert stats.connections_accepted == 3 and stats.connections_open == 0
        assert stats.bad_frames == 0 and bad == [], bad
        nursery.cancel_scope.cancel()


async def test_a_send_that_fails_as_the_encoder_finishes_is_a_reader_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The race CI met: the holder's send fails (the reader left) in the same pass of
    the event loop as the encoder's next chunk comes back from its thread.  The sender
    ends first and closes the queue; if the encoder then found the queue closed and
    raised, its error ended the run, cancelled the sender's, and a reader gone was
    counted as bad input.  Here both wake-ups are lined up (the loop is held busy while
    both threads finish) in every round; the trio scheduler picks their order."""
    store = Store()
    bad: list[str] = []
    server = TcpServer(store, lambda peer, n: None, bad.append, ServerLimits())
    port = server.bind("127.0.0.1", 0)
    rng = rng_for("delta-race")
    small = 1 << 16
    publish(store, rng, [4 * small], small, version=1)
    publish(store, rng, [4 * small], small, version=2)
    token = trio.lowlevel.current_trio_token()
    encode, failed, calls = deltas._encode, [], []
    sending, encoded = threading.Event(), threading.Event()

    def encode_when_the_send_fails(base: Any, new: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:  # a round's first chunk: at once; the next, as the send fails
            return encode(base, new)
        sending.wait(10)
        out = encode(base, new)
        encoded.set()
        return out

    def failing_send(sock: socket.socket, segments: Any) -> None:
        token.run_sync_soon(time.sleep, 0.1)  # hold the loop while both threads finish
        sending.set()
        encoded.wait(10)
        time.sleep(0.02)  # the encoder's thread has handed back its chunk
        failed.append(1)
        raise ConnectionResetError(errno.ECONNRESET, "the reader reset the connection")

    monkeypatch.setattr(deltas, "_encode", encode_when_the_send_fails)
    monkeypatch.setattr(server_module, "send_segments", failing_send)
    rounds = 24

    async def round_ended(n: int) -> None:
        await wait_until(lambda: not server.statistics().connections_open
                         and len(failed) > n, 30, what=f"round {n} ended")

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        for n in range(rounds):
            sending.clear()
            encoded.clear()
            calls.clear()
            with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM) as sock:
                await sock.connect(("127.0.0.1", port))
                await send_frame(sock, DeltaRunRequest(1, "m", 2, 1, 0, 4))
                await round_ended(n)
        nursery.cancel_scope.cancel()
    assert len(failed) == rounds
    assert server.statistics().bad_frames == 0 and bad == [], bad
