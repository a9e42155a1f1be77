"""What the read path needs of the peer it reads for, and nothing more.

:class:`~tensorhub.read.reader.Reader` owns everything a read is made of (connections,
link memory, fetches in flight, read counters); the rest belongs to the peer, which
hands the reader these ports when it builds it.  Each is one capability: a read-only
look at the mesh as the control plane sees it, or one effect on it.  The reader never
sees the peer itself, so nothing of the read path can reach into it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ..model import PeerInfo, VersionKey
from ..protocol.bans import Ban
from ..protocol.coordination import CoordinatorAnswer
from ..protocol.reading import View
from ..protocol.refs import Holding
from ..transport.handshake import DataAuth


class Measured(Protocol):
    """``Wan.observe``, as the read path calls it."""

    def __call__(self, src: str, dst: str, nbytes: int, seconds: float, *,
                 interim: bool = False) -> object: ...


@dataclass(frozen=True)
class Ports:
    """The reader's ports into its peer (see the module docstring)."""

    holders: Callable[[VersionKey], View]
    """Who holds a version, as the reference table says now."""
    live: Callable[[], list[PeerInfo]]
    """The live members in this peer's view."""
    members: Callable[[], Mapping[str, PeerInfo]]
    """Every member this peer knows, by name."""
    announcement: Callable[[VersionKey, bytes], tuple[int, bytes]]
    """The publisher's signed announcement of a version with this manifest id, which
    every copy carries (secure mode; ``(0, b"")`` without keys)."""
    announce: Callable[[Holding], None]
    """Tell the mesh what this peer holds of a version now."""
    withdraw: Callable[[VersionKey], None]
    """Refuse new reads of a version here now and tell the mesh it is gone."""
    ask_coordinator: Callable[[VersionKey, int, int], Awaitable[CoordinatorAnswer]]
    """Register with a version's coordinator, giving its size and chunk count; its
    answer (:class:`~tensorhub.errors.TransportError` when none came)."""
    changed: Callable[[], Awaitable[None]]
    """Return at the next change of the reference table or of the coordinators'
    answers."""
    banned: Callable[[str], Ban | None]
    """This peer's ban on reading from a holder now, or None."""
    ban: Callable[[str, VersionKey, str], None]
    """A holder served bytes of a version that failed their digest (and why)."""
    spawn: Callable[[Callable[[], Awaitable[None]]], None]
    """Run a task in the peer's nursery, beyond the caller's (it must catch its own
    errors; closing the peer cancels it)."""
    data_auth: Callable[[], DataAuth | None]
    """How this peer proves itself on a data connection it opens (it changes when the
    peer rotates its identity); None without keys."""
    measured: Measured
    """A transfer moved ``nbytes`` from DC ``src`` into DC ``dst`` in ``seconds`` of
    reading from ``src``: a sample of that link for the WAN model (``(src, dst, nbytes,
    seconds)``, ``interim=True`` for part of a transfer still running; one under its
    ``min_sample_bytes`` does not count)."""
