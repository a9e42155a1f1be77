"""The one-sided seam: what a backend that reads another process's memory offers.

A backend is small on purpose -- register memory, grant and revoke remote access to
it, open a link, post reads of remote ranges and poll for their completion -- so that
an in-process stand-in over host memory (:mod:`.standin`) implements exactly what the
real ones do (:mod:`tensorhub.transport.rdma`: RDMA READ on an RC queue pair;
:mod:`tensorhub.transport.cuda_ipc`: CUDA IPC memory handles), and the protocol above it
(:mod:`.holder`, :mod:`.reader`) is the same code for all of them.

:func:`read_ranges` is that shared reading loop: it cuts the reader's destination and
the holder's granted ranges into matching reads, keeps up to ``depth`` of them posted
and waits for every completion -- also after a failure, so no read still lands in the
destination once it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...errors import TransportError
from ...protocol.onesided import RemoteRange

MAX_READ = 1 << 20
"""Bytes one posted read moves at most: a long chunk is many reads in flight (and a
stand-in copy yields between them)."""


@dataclass(eq=False)
class Region:
    """Memory registered with a backend (pinned, and for RDMA known to the NIC)."""

    addr: int
    """Where it starts, in the registering process (a host or a device address)."""
    length: int
    handle: Any
    """The backend's own object (a memory region; the stand-in's byte view)."""
    key: bytes = b""
    """What a remote reader presents to read it: empty while remote access is off."""
    grants: int = field(default=0)
    """Keys handed out for it so far (statistics, tests)."""


class Link(Protocol):
    """A reader's end of a connected link (an RC queue pair, a CUDA stream)."""

    def post_read(self, wr_id: int, local: Region, local_addr: int, remote_addr: int,
                  key: bytes, length: int) -> None:
        """Start reading ``length`` bytes at the holder's ``remote_addr`` (in the region
        whose key is ``key``) into ``local_addr`` (inside ``local``)."""
        ...

    def poll(self, timeout: float) -> list[tuple[int, str | None]]:
        """Wait up to ``timeout`` seconds for completions: ``(wr_id, error or None)``
        each, at least one unless the time ran out."""
        ...

    def close(self) -> None: ...


class Dialing(Protocol):
    """A reader's half-open link: its endpoint goes to the holder in ``OneSidedHello``."""

    endpoint: bytes

    def connect(self, holder_endpoint: bytes) -> Link: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """One way of reading another process's memory (see the module docstring)."""

    name: str
    """The dial name (``PeerConfig.transports``): ``rdma``, ``cuda-ipc``, a stand-in's."""
    same_host: bool
    """Only between processes of one host (offered on the same-host socket only)."""
    depth: int
    """Reads a link keeps posted at once."""
    device_memory: bool
    """Serves a version held in device memory from its tensors in place (CUDA IPC);
    otherwise such a version is served from the host copies its staging ring makes."""

    def register(self, memory: Any) -> Region:
        """Register ``memory`` (a byte view of a whole buffer, or a device array),
        remote access off.  Costly (pinning): done once per buffer, by
        :class:`~.registry.Registrations`."""
        ...

    def deregister(self, region: Region) -> None: ...

    def grant(self, region: Region) -> None:
        """Turn remote access on: sets ``region.key`` (a new one where the backend can
        make one, so a key revoked before never works again)."""
        ...

    def revoke(self, region: Region) -> None:
        """Turn remote access off: a read that presents the old key fails."""
        ...

    def dial(self) -> Dialing:
        """A reader's new link, to be connected with the holder's endpoint."""
        ...

    def accept(self, endpoint: bytes) -> tuple[Link, bytes]:
        """The holder's end of a link to the reader whose endpoint is ``endpoint``, and
        the holder's endpoint to send back.  Raises ``ValueError`` on a malformed one."""
        ...


def pair_up(local: Sequence[tuple[Region, int, int]], remote: Sequence[RemoteRange]
            ) -> list[tuple[Region, int, int, bytes, int]]:
    """Cut the destination (``(region, address, length)`` pieces) and the granted
    ranges (the same number of bytes in all) into reads of at most :data:`MAX_READ`:
    ``(local region, local address, remote address, key, length)`` each."""
    out = []
    li = ri = lo = ro = 0
    while li < len(local) and ri < len(remote):
        region, laddr, llen = local[li]
        raddr, rlen, key = remote[ri]
        n = min(llen - lo, rlen - ro, MAX_READ)
        out.append((region, laddr + lo, raddr + ro, key, n))
        lo, ro = lo + n, ro + n
        if lo == llen:
            li, lo = li + 1, 0
        if ro == rlen:
            ri, ro = ri + 1, 0
    if li < len(local) or ri < len(remote):
        raise TransportError("destination and grant differ in size")  # checked before
    return out


def read_ranges(link: Link, reads: Sequence[tuple[Region, int, int, bytes, int]],
                depth: int, timeout: float) -> None:
    """Post ``reads`` on ``link``, up to ``depth`` at a time, and wait for all of them
    (blocking: run it in a worker thread).  Raises :class:`TransportError` with the
    first failure -- once every read posted has completed, so none lands later."""
    posted = done = 0
    error: str | None = None
    while done < posted or (posted < len(reads) and error is None):
        while error is None and posted < len(reads) and posted - done < depth:
            region, laddr, raddr, key, n = reads[posted]
            try:
                link.post_read(posted, region, laddr, raddr, key, n)
            except TransportError as exc:
                error = str(exc)
                break
            posted += 1
        if done == posted:
            break
        completions = link.poll(timeout)
        if not completions:
            raise TransportError(f"no read completed within {timeout}s; link abandoned")
        for _wr, failed in completions:
            done += 1
            if failed is not None and error is None:
                error = failed
    if error is not None:
        raise TransportError(f"one-sided read failed: {error}")
