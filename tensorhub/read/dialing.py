"""Choosing the transport for each holder: ``PeerConfig.transports`` in order.

At start every transport named is detected (:func:`tensorhub.transport.dial.detect`); a
one-sided one (``rdma``, ``cuda-ipc``, or a stand-in) that is named and not usable
here is a :class:`~tensorhub.errors.ConfigError` -- the peer does not start.  Then, for
each holder a read connects to, the transports are tried in order: one that needs the
same host is skipped for a holder on another (its ``host`` label differs), one the
holder refuses (it does not serve it, the same-host handshake fails, a queue pair
cannot be set up, a chunk lies in memory it cannot serve that way) is skipped from then
on for that holder; each reason is kept and
shown (``statistics().transports`` and ``transport_refusals``, the fetch report's
``transport_refusals``).  ``tcp``, when named, is the last resort and its failure is
the read's failure.  A TCP connection to a holder labelled on this host also tries to
show that the holder shares memory with this process
(:mod:`tensorhub.transport.samehost.loopback`), so its chunks are checked against the
fast local digests; the outcome is kept per holder (``statistics().tcp_local_digests``).
The peer serves every one-sided transport it names.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError, TransportError
from ..model import PeerInfo
from ..transport.base import Connection
from ..transport.dial import ONE_SIDED, SAME_HOST, detect, probe_backend
from ..transport.handshake import DataAuth
from ..transport.onesided.holder import OneSidedHost
from ..transport.onesided.reader import OneSidedConnection
from ..transport.onesided.registry import Registrations
from ..transport.samehost.loopback import prove_holder_shares_memory
from ..transport.samehost.reader import ShmConnection
from ..transport.tcp import TcpConnection


class Dialer:
    """See the module docstring."""

    def __init__(self, transports: Sequence[str]) -> None:
        self.transports = tuple(transports)
        self.found = {name: detect(name) for name in self.transports}
        """Per transport named: usable here, and what was found (or why not)."""
        missing = [f"{name}: {why}" for name, (ok, why) in self.found.items()
                   if name in ONE_SIDED and not ok]
        if missing:
            raise ConfigError("transports asked for and not usable on this host (remove "
                              "them from PeerConfig.transports / --transports): "
                              + "; ".join(missing))
        backends = []
        for name in self.transports:
            if name in ONE_SIDED:
                factory, _why = probe_backend(name)
                assert factory is not None
                backends.append(factory())
        self.host = OneSidedHost(backends)
        """What this peer serves one-sided (the data server's)."""
        self._readers = {b.name: Registrations(b) for b in backends}
        self.refusals: dict[str, dict[str, str]] = {}
        """Per holder: the transports skipped for it, and why."""
        self.chosen: dict[str, str] = {}
        """Per holder: the transport of the last connection opened to it."""
        self.local_digests: dict[str, str] = {}
        """Per holder on this host: whether the last TCP connection opened to it checks
        chunks against the fast local digests, and why (not)."""

    def describe(self) -> dict[str, str]:
        return {name: ("available: " if ok else "unavailable: ") + why
                for name, (ok, why) in self.found.items()}

    async def connect(self, me: PeerInfo, peer: PeerInfo, timeout: float,
                      auth: DataAuth | None) -> Connection:
        """A connection to ``peer`` over the first transport that works for it."""
        refused = self.refusals.setdefault(peer.name, {})
        host = me.label("host")
        for name in self.transports:
            if name == "tcp":
                conn: Connection = await self._tcp(peer, host, timeout, auth)
            elif name in refused:
                continue
            elif name in SAME_HOST and (host is None or peer.label("host") is None):
                refused[name] = (f"cannot tell whether {peer.name} shares this host: give "
                                 f"both peers a 'host' label (PeerConfig.labels; host label "
                                 f"{peer.label('host')!r}, ours {host!r})")
                continue
            elif name in SAME_HOST and peer.label("host") != host:
                refused[name] = (f"{peer.name} is on another host (host label "
                                 f"{peer.label('host')!r}, ours {host!r})")
                continue
            elif not self.found[name][0]:
                refused[name] = f"unavailable here: {self.found[name][1]}"
                continue
            else:
                try:
                    conn = await self._open(name, peer, timeout, auth, refused)
                except TransportError as exc:
                    refused[name] = str(exc)
                    continue
            self.chosen[peer.name] = name
            return conn
        raise TransportError(f"no transport reaches {peer.name}: " + "; ".join(
            f"{name}: {refused.get(name, '?')}" for name in self.transports))

    async def _tcp(self, peer: PeerInfo, host: str | None, timeout: float,
                   auth: DataAuth | None) -> TcpConnection:
        """A TCP connection to ``peer``; to a holder labelled on this host, one that
        checks chunks against the fast local digests where the holder is shown to
        share memory with this process (:mod:`..transport.samehost.loopback`)."""
        conn = await TcpConnection.connect(peer.data, peer.name, timeout, auth)
        if host is not None and peer.label("host") == host:
            try:
                self.local_digests[peer.name] = await prove_holder_shares_memory(
                    conn, peer.data, timeout, auth)
            except BaseException:
                await conn.aclose()
                raise
        return conn

    async def _open(self, name: str, peer: PeerInfo, timeout: float,
                    auth: DataAuth | None, refused: dict[str, str]) -> Connection:
        if name == "shm":
            return await ShmConnection.connect(peer.data, peer.name, timeout, auth)

        def later(why: str) -> None:  # a chunk it cannot serve so: skip it from now on
            refused[name] = why

        return await OneSidedConnection.open(peer.data, peer.name, timeout,
                                             self._readers[name], auth, later)

    def refusals_of(self, holder: str) -> str:
        """The transports skipped for ``holder``, and why, as one line ("" if none)."""
        return "; ".join(f"{t}: {why}" for t, why in self.refusals.get(holder, {}).items())

    def close(self) -> None:
        for reg in self._readers.values():
            reg.close()
        self.host.close()
