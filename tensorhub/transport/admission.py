"""What a data-plane server lets a reader have: connections, time, requests.

A holder's data server faces readers it does not control: a hung rollout process, a
flood, a client that declares a frame and never sends it.  :class:`ServerLimits` bounds
what each may hold -- connections (in total and per remote address), the time a frame
may take to arrive and a connection may sit idle, the rate of requests, the time a
same-host lease may be held -- and :class:`Admission` enforces the connection caps and
counts every refusal, so a holder's statistics say what it turned away and why
(:meth:`Admission.statistics`).

Memory per connection is bounded by construction elsewhere (the server never allocates
a declared frame size before the bytes arrive, and a frame is at most
``dataplane.MAX_FRAME``), and the server reads a connection's next request only after
answering the last, so a pipelining client waits in its own socket buffers.  A streamed
run (``ChunkRunRequest``, at most ``dataplane.MAX_RUN_CHUNKS`` chunks) costs the request
rate one token per chunk.
"""

from __future__ import annotations

import errno
import logging
from collections import Counter
from dataclasses import dataclass

from ..errors import ConfigError

log = logging.getLogger("tensorhub.dataplane")

ACCEPT_PRESSURE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""accept() errors that mean "out of descriptors or kernel memory for now": the server
backs off and keeps serving the connections it has."""

ACCEPT_TRANSIENT = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM,
                              errno.ENETDOWN, errno.ENOPROTOOPT, errno.EHOSTDOWN,
                              errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP,
                              errno.ENETUNREACH, errno.EAGAIN})
"""accept() errors about one pending connection (see accept(2)): skip it."""

ACCEPT_BACKOFF_MAX = 1.0  # seconds between accept() tries at most, under pressure


@dataclass(frozen=True)
class ServerLimits:
    """Per-connection and per-server bounds of a data server (from ``PeerConfig``)."""

    max_connections: int = 256
    max_connections_per_address: int = 64
    idle_timeout: float = 60.0
    frame_timeout: float = 10.0
    requests_per_second: float = 20000.0
    lease_timeout: float = 10.0
    evict_idle_after: float = 1.0
    """A TCP connection that has waited this long for its next request may be closed to
    make room for a new one that a cap would refuse (a reader keeps its connection
    between fetches).  Long enough that a reader in the middle of a fetch, which asks
    for its next chunk at once, is never the one closed."""
    probe_bytes: int = 0
    """The most bytes one link probe is answered with (``PeerConfig.wan_probe_bytes``);
    0: probes are refused."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_connections_per_address <= self.max_connections <= 1 << 20:
            raise ConfigError("data connection caps must satisfy "
                              "1 <= per address <= total <= 2**20")
        if not 0 <= self.probe_bytes <= 1 << 30:
            raise ConfigError("probe_bytes must be in [0, 1 GiB]")
        for name in ("idle_timeout", "frame_timeout", "requests_per_second", "lease_timeout",
                     "evict_idle_after"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be > 0 and finite")


@dataclass(frozen=True)
class ServerStats:
    """A snapshot of a data server's counters (``TcpServer.statistics()``)."""

    auth: str
    """``"members"`` when every connection must prove a keyring identity, else
    ``"insecure: ..."`` saying so."""
    connections_open: int
    connections_accepted: int
    refused_over_total: int
    """Connections closed at once because ``max_connections`` were open."""
    refused_over_address: int
    """... because their address had ``max_connections_per_address`` open."""
    refused_credentials: int
    """Same-host connections from another user (``SO_PEERCRED``)."""
    refused_auth: int
    """Connections that did not prove a member identity."""
    accept_errors: int
    """accept() failures under descriptor or memory pressure (the server backed off)."""
    idle_closed: int
    frame_timeouts: int
    """Connections closed because a frame (or a handshake) did not arrive in time."""
    throttled: int
    """Requests delayed by the per-connection request rate."""
    bad_frames: int
    """Connections closed for a malformed, oversized or out-of-turn frame."""
    leases_revoked: int
    """Same-host leases ended by the holder because the reader did not let go in time."""
    shm_over_tcp: int
    """Same-host requests that arrived over TCP (answered BAD_REQUEST)."""
    idle_evicted: int = 0
    """Idle connections (a reader keeps one between reads) closed to make room for a
    new one that a cap would have refused."""
    probes: int = 0
    """Link probes answered with bytes (:class:`~tensorhub.protocol.dataplane.
    ProbeRequest`; not counting those for no bytes, which time a round trip)."""
    probe_bytes: int = 0
    """Bytes of zeros sent for them."""


class Admission:
    """Connection caps and counters of one data server (event-loop only)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.open_by_address: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self._pressure_logged = 0

    @property
    def open(self) -> int:
        return sum(self.open_by_address.values())

    def crowded(self, address: str) -> bool:
        """True iff :meth:`admit` would refuse ``address`` now."""
        return self.open >= self.limits.max_connections or \
            self.open_by_address[address] >= self.limits.max_connections_per_address

    def admit(self, address: str) -> bool:
        """Take a connection slot for ``address``; False (and counted) if over a cap."""
        self.counts["connections_accepted"] += 1
        if self.open >= self.limits.max_connections:
            self.counts["refused_over_total"] += 1
            return False
        if self.open_by_address[address] >= self.limits.max_connections_per_address:
            self.counts["refused_over_address"] += 1
            return False
        self.open_by_address[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open_by_address[address] -= 1
        if not self.open_by_address[address]:
            del self.open_by_address[address]

    def accept_failed(self, exc: OSError, backoff: float) -> None:
        """Count an accept() failure under pressure; log the first of each burst and
        then every 100th, so a long shortage does not flood the log."""
        self.counts["accept_errors"] += 1
        if self._pressure_logged % 100 == 0:
            log.warning("data server: accept failed (%s, %d so far); backing off %.3fs and "
                        "serving the %d open connections", errno.errorcode.get(exc.errno or 0),
                        self.counts["accept_errors"], backoff, self.open)
        self._pressure_logged += 1

    def accepted(self) -> None:
        self._pressure_logged = 0

    def revoked(self, _reader: str) -> None:
        """Count a lease revoked from a reader that did not end it in time."""
        self.counts["leases_revoked"] += 1

    def statistics(self, auth: str) -> ServerStats:
        c = self.counts
        return ServerStats(
            auth=auth, connections_open=self.open,
            connections_accepted=c["connections_accepted"],
            refused_over_total=c["refused_over_total"],
            refused_over_address=c["refused_over_address"],
            refused_credentials=c["refused_credentials"], refused_auth=c["refused_auth"],
            accept_errors=c["accept_errors"], idle_closed=c["idle_closed"],
            frame_timeouts=c["frame_timeouts"], throttled=c["throttled"],
            bad_frames=c["bad_frames"], leases_revoked=c["leases_revoked"],
            shm_over_tcp=c["shm_over_tcp"], idle_evicted=c["idle_evicted"],
            probes=c["probes"], probe_bytes=c["probe_bytes"])


class RequestRate:
    """A token bucket: ``rate`` requests a second, bursts of up to one second's worth.
    :meth:`delay` says how long the next request must wait (0 when its tokens are free)."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.at = now

    def delay(self, now: float, cost: int = 1) -> float:
        """Take ``cost`` tokens (a request asking for that many chunks)."""
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= cost
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate
