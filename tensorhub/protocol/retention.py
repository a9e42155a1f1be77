"""Retention hand-over: who keeps the last copy when holders unpublish at once.

Theory of operation
-------------------
A holder that unpublishes a retained shard must not drop it if it is the last complete
copy (:func:`~tensorhub.protocol.versions.must_offload`).  Its reference table alone
cannot tell: two holders that unpublish within one gossip round each still see the
other, and both would drop.  So before dropping, the leaving holder marks the shard
*leaving* and asks the other complete holders in its view directly (:class:`KeepQuery`)
whether they still keep it.  A holder answers ``keeps`` only if it holds the shard
complete, from caller or offloaded memory, and is not leaving it itself
(:class:`KeepAnswer`).  The asker drops only on a ``keeps``; on ``False`` from all of
them, or no answer within the timeout (a dead or unreachable holder), it offloads.

Why this is safe: of two holders leaving at once, each marks itself leaving before it
asks, so each sees the other leaving (or gone) and both offload; retention keeps one
copy too many, never none.  A holder that answered ``keeps`` and leaves later asks in
turn; the one it answered has then left or is leaving, so it offloads.  Only a crash of
the holder that answered ``keeps`` loses the copy -- the contract covers live holders.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bounds import U63, PeerName, Rank
from ..model import LayoutId, ModelName


@dataclass(frozen=True, slots=True)
class KeepQuery:
    """From ``asker``: do you keep ``model@version`` shard ``shard`` of ``layout``?"""

    asker: PeerName
    nonce: U63
    model: ModelName
    version: U63
    shard: Rank
    layout: LayoutId


@dataclass(frozen=True, slots=True)
class KeepAnswer:
    nonce: U63
    keeps: bool


MESSAGES = (KeepQuery, KeepAnswer)
