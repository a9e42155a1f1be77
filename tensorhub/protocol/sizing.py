"""How big the units of a transfer are: the chunk a version is cut into, and the window
a reader keeps requested ahead on one stream.

Theory of operation
-------------------
*Chunks.*  A chunk is the unit of verification, so of store-and-forward: each level of
a relay tree lags its parent by one chunk-time, which wants small chunks; every chunk
costs a reply header, a digest and a wake-up or two on each side, which wants large
ones.  :func:`choose_chunk_size` aims at :data:`TARGET_CHUNKS` chunks per level of
the deepest relay tree the mesh allows, and at no fewer than that per version, rounded
to a power of two between :data:`MIN_AUTO_CHUNK` and :data:`MAX_AUTO_CHUNK`.  A tree
over ``n`` readers is about ``log2(n + 1)`` levels deep (``log2`` of the peers in the
mesh, publisher included), and each level lags one chunk-time at a share of the NIC (a
parent feeds two children at half its NIC each): ``C`` chunks over ``L`` levels add
about ``2 L / C`` of the transfer, so ``C = 64 L`` keeps the lag near 3%.  Measured: 256
MiB in the 8-host emulated cluster at 400 Mbit gave 1.28/1.16/1.30x the fluid bound at
2/4/8 MiB chunks (64 chunks of 4 MiB is the best); 1 GiB over loopback lost ~1.3 ms a
chunk on a slower host, a third of the transfer at 4 MiB chunks.  Simulated (the
data-plane simulator, Uber Kraken's test: 3 GB to 2,600 hosts at 300 MB/s, a 10 s
bound): 716 chunks of 4 MiB, this rule's choice in that mesh, ended at 10.29 s at the
median and 10.31 s at the 99th percentile; 45 chunks of 64 MiB, the choice without the
mesh's width, at 14.63 s (the closed form's lag: 5 s over 11.3 levels).  A publisher's
explicit ``PeerConfig.chunk_size`` overrides the choice.

*Windows.*  A reader streams chunks from a holder (``ChunkRunRequest``) and keeps a
window of bytes requested ahead of what has landed, so no chunk waits for a round trip.
As TCP does for its own window, :class:`StreamWindow` sizes it from the stream's
bandwidth-delay product: ``GAIN x rate x min_rtt``, never under :data:`MIN_CHUNKS`
chunks (one landing while the next is already on its way) and never over a cap from
the configuration.  ``min_rtt`` is the least time seen from a request sent on an idle
connection to its first reply (a holder still receiving the chunk only adds to it, so
the minimum is the link's); ``rate`` is smoothed from the time between consecutive
chunks of one stream while the holder already had the next one's request (it was sent
at least ``min_rtt`` before the previous chunk landed: :meth:`StreamWindow.backlogged`),
so a sample measures the link and the holder, never a wait for a request; and from the
first chunk of a run asked on an idle connection, from its reply's header to its last
byte (the rate is known at the first landing, not the second).  (Counting
samples where the request was still on its way let each stall lower the rate, the
window with it, and so cause the next stall: at 1 Gbit and 100 ms the rate settled at
94-101 MB/s of 125.)  A window starts from the rate the last fetch measured from the
same source, when there is one, instead of from the floor.  Nothing here reads a clock:
callers pass durations in.

*When to ask.*  A new run is asked for when half the window is free (few, large runs:
a holder's thread hand-off per run, not per chunk), or sooner, as soon as a chunk is
free, when what is in flight would otherwise fall under the bandwidth-delay product
plus a chunk (:meth:`StreamWindow.ask`): a request takes a round trip to bring bytes,
and the link must not run dry meanwhile.  Waiting for half the window lets it fall to
a chunk under the product, an idle link for part of each round trip where the product
is as large as the window's floor (1 Gbit at 100 ms: 12.5 MB against 16 MiB).

*Streams per source.*  A reader keeps one stream to each source
(:meth:`StreamWindow.streams`): its chunks then land in order, one after the other, so a
relay downstream of it forwards each chunk one chunk-time after it arrives.  Several
streams to one source land chunks interleaved (measured in a 4-deep chain at 400 Mbit:
four streams to the publisher left the next hop a second behind, the chunks it reads in
order arriving in a stride).  A second stream is opened only when one cannot fill the
link: when the bytes one stream had in flight (rate x min round trip) reached what one
TCP connection can keep in flight (its socket's window, a share of the kernel's largest
receive buffer), the link's bandwidth-delay product is beyond one connection.
"""

from __future__ import annotations

import math

from ..errors import LocalProtocolError

TARGET_CHUNKS = 64
"""Chunks a version is cut into at the least, and per level of the relay tree the
mesh allows (see the module docstring)."""
MIN_AUTO_CHUNK = 4 << 20
MAX_AUTO_CHUNK = 64 << 20

MIN_CHUNKS = 4
"""Chunks a stream always keeps requested, whatever the measured product: a new run is
asked for when half the window is free, so the holder always has the next run queued
and each run asks for two chunks or more.  Measured (1 GiB over loopback, interleaved
fetches, 5 rounds): a floor of 4 gave 0.99 of a raw socket at 4 MiB chunks and 1.06 at
16 MiB, a floor of 2 (a run per chunk) 0.80 and 0.80."""

GAIN = 2.0
"""Window over the measured bandwidth-delay product: room for the estimate to be low
and for the holder's own hiccups (a thread hand-off, a chunk still arriving)."""

SOCKET_FULL = 0.8
"""A stream whose bytes in flight reached this share of its socket's window is taken to
be limited by the window, not by the link (:meth:`StreamWindow.streams`)."""

RATE_GAIN = 0.25
"""Weight of a new rate sample of a whole chunk in the smoothed per-byte time; a shorter
one (a version's tail chunk) weighs in proportion to its bytes, for a few bytes' time is
all fixed cost (a 1.5 KB tail at 40 us on loopback reads as 40 MB/s, and weighed as a
whole chunk it pulled a 1 GB/s estimate to 60 MB/s and tipped the delta choice).  A
first sample under this share of a chunk is not taken as the rate at all."""


def choose_chunk_size(total_bytes: int, override: int | None = None,
                      peers: int = 1) -> tuple[int, str]:
    """The chunk size for a version of ``total_bytes`` published in a mesh of ``peers``
    live members (the publisher included; 1: the version's size alone decides), and
    why (see the module docstring)."""
    if override is not None:
        return override, f"{size_text(override)}: set by PeerConfig.chunk_size"
    if total_bytes < 0 or peers < 1:
        raise LocalProtocolError(f"need total_bytes >= 0 and peers >= 1, got {total_bytes} "
                                 f"and {peers}")
    levels = math.log2(peers)
    target = TARGET_CHUNKS * max(1.0, levels)
    size = MIN_AUTO_CHUNK
    while size < MAX_AUTO_CHUNK and size * target < total_bytes:
        size *= 2
    aim = f"about {TARGET_CHUNKS} chunks" if levels <= 1 else (
        f"about {target:.0f} chunks: {TARGET_CHUNKS} for each of the {levels:.3g} levels "
        f"of a relay tree over {peers} peers")
    return size, (f"{size_text(size)}: automatic for {size_text(total_bytes)} ({aim}, "
                  f"{size_text(MIN_AUTO_CHUNK)} to {size_text(MAX_AUTO_CHUNK)})")


class StreamWindow:
    """The window of one source's streams (see the module docstring)."""

    def __init__(self, chunk_bytes: int, cap: int, rate: float | None = None) -> None:
        """``rate``: bytes a second this source's streams were last measured at (a
        prior the stream's own samples then move)."""
        if chunk_bytes <= 0 or cap <= 0:
            raise LocalProtocolError("chunk_bytes and cap must be > 0")
        self.chunk_bytes = chunk_bytes
        self.floor = MIN_CHUNKS * chunk_bytes
        self.cap = max(cap, self.floor)
        self.min_rtt: float | None = None
        self._per_byte: float | None = 1.0 / rate if rate is not None and rate > 0 else None

    def rtt(self, seconds: float) -> None:
        """A request sent on an idle connection got its first reply after ``seconds``."""
        if seconds >= 0 and (self.min_rtt is None or seconds < self.min_rtt):
            self.min_rtt = seconds

    def backlogged(self, lead: float) -> bool:
        """Whether a chunk asked for ``lead`` seconds before the previous chunk landed
        gives a rate sample: its request had reached the holder before the holder ran
        out of work, i.e. a round trip or more ahead (any lead before one is measured)."""
        return lead >= (self.min_rtt or 0.0)

    def delivered(self, nbytes: int, seconds: float) -> None:
        """A chunk of ``nbytes`` took ``seconds`` to arrive: since the one before it
        landed, with the stream backlogged (see :meth:`backlogged`), or since its own
        reply header."""
        if nbytes <= 0 or seconds <= 0:
            return
        sample, share = seconds / nbytes, min(1.0, nbytes / self.chunk_bytes)
        if self._per_byte is None:
            if share >= RATE_GAIN:  # a few bytes alone say nothing of the link
                self._per_byte = sample
        else:
            self._per_byte += (sample - self._per_byte) * RATE_GAIN * share

    @property
    def rate(self) -> float | None:
        """Bytes a second, smoothed (None before a sample)."""
        return None if self._per_byte is None else 1.0 / self._per_byte

    def bytes(self) -> int:
        """Bytes to keep requested ahead on one stream."""
        rate = self.rate
        if rate is None or self.min_rtt is None:
            return self.floor
        return int(min(self.cap, max(self.floor, GAIN * rate * self.min_rtt)))

    def bdp(self) -> int | None:
        """The measured bandwidth-delay product in bytes (None before a measure)."""
        rate = self.rate
        if rate is None or self.min_rtt is None:
            return None
        return int(rate * self.min_rtt)

    def ask(self, ahead: int) -> int:
        """Bytes to ask for now, with ``ahead`` requested and not landed (0: not now;
        see the module docstring): all that is free when nothing is in flight, when
        half the window is free, or when a chunk is free and what is in flight is under
        the bandwidth-delay product plus a chunk."""
        free = self.bytes() - ahead
        if ahead <= 0:
            return max(free, 0)
        if free < self.chunk_bytes:
            return 0
        if free >= self.bytes() // 2:
            return free
        bdp = self.bdp()
        return free if bdp is not None and ahead < bdp + self.chunk_bytes else 0

    def streams(self, socket_window: int, most: int) -> int:
        """Streams worth keeping to this source (see the module docstring): one, or,
        when what one stream carried filled ``socket_window`` bytes in flight, enough
        to carry the measured product, at most ``most``."""
        rate = self.rate
        if rate is None or self.min_rtt is None or socket_window <= 0:
            return 1
        bdp = rate * self.min_rtt
        if bdp < SOCKET_FULL * socket_window:
            return 1
        return max(1, min(most, max(2, 1 + int(bdp // socket_window))))

    def why(self) -> str:
        """The window and where it comes from, for reports."""
        w = self.bytes()
        rate = self.rate
        if rate is None or self.min_rtt is None:
            return f"{size_text(w)}: the floor of {MIN_CHUNKS} chunks (nothing measured yet)"
        bdp = rate * self.min_rtt
        bound = "the floor" if w == self.floor and w > GAIN * bdp else \
            "the cap" if w == self.cap and w < GAIN * bdp else f"{GAIN:g} x the BDP"
        return (f"{size_text(w)} ({bound}): rate {rate / 1e6:.0f} MB/s x min rtt "
                f"{self.min_rtt * 1e3:.2f} ms = {size_text(int(bdp))} in flight")


def size_text(n: int) -> str:
    """``n`` bytes for people: ``16 MiB``, ``4.27 MiB``, ``512 B``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"
    return f"{n} B"
