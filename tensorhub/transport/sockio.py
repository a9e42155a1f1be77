"""Blocking socket calls for the data plane's payload path, run in threads.

Payload moves in threads on a duplicate of a connection's descriptor: the syscalls run
without the GIL and without an event-loop round trip per ``recv``, and several
connections copy in parallel.  The holder sends each write in one worker-thread call;
the reader keeps one thread per connection (:class:`~.tcp.TcpConnection`).  The
descriptor stays non-blocking (trio sends on it too); Python's socket timeout makes the
threads' calls wait with poll() instead.  Measured here: 4 streams ~3.9 GB/s vs
~2.9 GB/s with trio's ``recv_into``.  Frames, the reader thread's included, are made and
read by :mod:`.frames`.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import socket
import time
from collections import deque
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import trio

from ..errors import TransportError

SEND_BUFFER = 4 << 20
"""Bytes of a holder's send buffer (Linux doubles it), when the kernel allows that much
(``net.core.wmem_max``): larger than send-side autotuning's usual ceiling (4 MiB), so a
holder's writes rarely wait.  The receive buffer is left to the kernel's autotuning
(``net.ipv4.tcp_rmem``), as a plain TCP stream's is: a fixed one caps the window at any
round trip -- at the default ``rmem_max`` of 208 KiB, a setting is cut to 416 KiB and
turns autotuning off -- and measured here (256 MiB over loopback, interleaved runs),
autotuning was faster than a fixed 8 MiB (1.00 vs 0.88 of a raw socket)."""


def send_segments(sock: socket.socket, segments: Sequence[Any]) -> None:
    """Send the segments (any C-contiguous buffers, sized by ``nbytes``) in order with
    vectored writes.  Where a write stopped is found by bisecting the segments' running
    ends: no Python step per segment (a chunk of 1,000 small tensors goes out in two or
    three writes)."""
    if len(segments) == 1:
        sock.sendall(segments[0])
        return
    ends = running_ends(segments)
    total = ends[-1] if ends else 0
    sent = i = 0
    while sent < total:
        batch = list(segments[i:i + IOV_BATCH])
        into_first = sent - (ends[i - 1] if i else 0)
        if into_first:
            batch[0] = bytes_of(batch[0])[into_first:]
        sent += sock.sendmsg(batch)
        i = bisect.bisect_right(ends, sent, i)


IOV_BATCH = 512  # buffers per sendmsg / recvmsg_into call (IOV_MAX is 1024 on Linux)


NBYTES = attrgetter("nbytes")


def recv_scattered(sock: socket.socket, dest: Sequence[Any], hasher: Any = None,
                   ends: list[int] | None = None) -> float:
    """Fill the buffers of ``dest`` in order with vectored reads: the kernel scatters
    the payload, however many tensors a chunk spans (measured: 4 MiB in 1,024 pieces in
    0.55 ms, vs 1.0-1.5 ms for a staging buffer and a copy per piece).  Empty buffers
    are passed along (an empty entry of a vectored read takes nothing).

    ``hasher``: given each buffer, in order, as soon as it is full (while its bytes are
    in the cache); returns the seconds that took.  ``ends``: the buffers' running
    ends (:func:`running_ends`), where the caller has them already."""
    pieces = dest if isinstance(dest, list) else list(dest)
    if ends is None:
        ends = running_ends(pieces)
    total = ends[-1] if ends else 0
    got = i = 0
    hashing = 0.0
    while got < total:
        batch = pieces[i:i + IOV_BATCH]
        into_first = got - (ends[i - 1] if i else 0)
        if into_first:
            batch[0] = bytes_of(batch[0])[into_first:]
        k = sock.recvmsg_into(batch)[0]
        if k == 0:
            raise TransportError("connection closed mid-payload")
        got += k
        full = bisect.bisect_right(ends, got, i)
        if hasher is not None and full > i:
            began = time.perf_counter()
            deque(map(hasher.update, pieces[i:full]), maxlen=0)
            hashing += time.perf_counter() - began
        i = full
    return hashing


def running_ends(buffers: Sequence[Any]) -> list[int]:
    """Where each buffer ends in the bytes of all of them laid end to end."""
    return list(itertools.accumulate(map(NBYTES, buffers)))


def bytes_of(buf: Any) -> memoryview:
    """A flat byte view of a C-contiguous buffer (itself when it is one already)."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def tune(sock: trio.socket.SocketType) -> None:
    """No Nagle; the send buffer of :data:`SEND_BUFFER` where the kernel allows it."""
    sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
    if _kernel_max("wmem_max") >= SEND_BUFFER:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, SEND_BUFFER)


@functools.cache
def _kernel_max(name: str) -> int:
    """``/proc/sys/net/core/<name>`` (0 where it cannot be read)."""
    try:
        with open(f"/proc/sys/net/core/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0
