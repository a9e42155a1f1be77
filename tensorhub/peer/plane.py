"""The narrow surface a peer's data-plane modules drive it through.

Fetching (:mod:`.fetching`), resharding (:mod:`.reshard`) and retention
(:mod:`.retention`) need a few things of their :class:`~tensorhub.peer.node.Peer` beyond
its public API: its pooled data connections, announcing a holding, a place on the list
of fetches in flight, a background task, the statistics a fetch counts in.
:meth:`Peer.data_plane <tensorhub.peer.node.Peer.data_plane>` hands them a
:class:`DataPlane` with just those; like :mod:`.stats` and :mod:`.keys`, this module is
part of the peer and the one place outside it that knows its internals.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..model import PeerInfo, VersionKey
from ..transport.base import Connection
from ..transport.handshake import DataAuth
from .fetch_report import FetchReport
from .stats import account, count_integrity
from .store import LocalVersion

if TYPE_CHECKING:
    from .fetcher import Fetch
    from .node import Peer


class DataPlane:
    """What the data-plane modules may do with their peer (see the module docstring)."""

    def __init__(self, peer: Peer) -> None:
        self._peer = peer

    async def connect(self, holder: PeerInfo) -> Connection:
        """A data connection to ``holder``: a kept one, or a new one."""
        return await self._peer._pool.connect(holder)

    @property
    def data_auth(self) -> DataAuth | None:
        """How this peer proves itself on a data connection it opens itself (a delta
        run, :mod:`.delta_fetch`); None without keys."""
        return self._peer._data_auth

    async def release(self, conn: Connection) -> None:
        """Hand back a connection a read is done with (kept if it is in step)."""
        await self._peer._pool.release(conn)

    def announce(self, local: LocalVersion) -> None:
        """Tell the mesh what this peer holds of ``local`` now (its verified chunks)."""
        peer = self._peer
        peer._send(peer.control.put_holding(local.holding()))

    @contextmanager
    def running(self, job: Fetch) -> Iterator[None]:
        """``job`` is in flight meanwhile: gossip wakes it, statistics and progress
        displays see it.  A failure counts the bad bytes it met."""
        fetches = self._peer._fetches
        fetches.add(job)
        try:
            yield
        except BaseException:
            count_integrity(self._peer, job.report)
            raise
        finally:
            fetches.discard(job)

    @contextmanager
    def resharding(self, key: VersionKey) -> Iterator[None]:
        """A resharding fetch of ``key`` runs meanwhile (another fetch of it is refused)."""
        ongoing = self._peer._resharding
        ongoing.add(key)
        try:
            yield
        finally:
            ongoing.discard(key)

    def account(self, report: FetchReport) -> None:
        """Count a finished fetch in the peer's statistics."""
        account(self._peer, report)

    def count_bad(self, what: str) -> None:
        """Count (and keep the text of) an input from a remote that was dropped."""
        self._peer._count_bad(what)

    def spawn(self, task: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``task(*args)`` in the peer's nursery (also while it is closing)."""
        self._peer._nursery.start_soon(task, *args)
