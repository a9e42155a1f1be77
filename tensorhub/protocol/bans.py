"""Bans of holders that served bytes failing their digest, and the hints about them.

Theory of operation
-------------------
A chunk that fails the publisher's digest proves that its holder sent bytes the
publisher never published (on a cryptographic digest, not by accident of ours: the
bytes were checked as they landed).  The fetcher that saw it bans the holder for
``ban_seconds``: no fetch of this peer reads from it until the ban expires, whatever
the reference table says it holds.  Bans expire by time alone; a new failure after
expiry bans again.

The peer also tells the other members (:class:`BanNotice`).  A notice is a *hint*: the
receiver only counts it per reporter, for ``statistics()``; it never bans anyone on
another peer's word (a lying peer could otherwise ban honest
holders mesh-wide).  Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..bounds import MaxLen, PeerName, Text

MAX_REASON = 200
"""Characters of a ban reason kept or sent."""

MAX_REPORTERS = 4096
"""Reporters counted; notices from further (made-up) names are not."""


@dataclass(frozen=True, slots=True)
class BanNotice:
    """From ``sender``: I banned ``banned``, whose chunk of ``version`` (``model@v``)
    failed its digest.  A hint only."""

    sender: PeerName
    banned: PeerName
    version: Text
    reason: Annotated[str, MaxLen(MAX_REASON)]


MESSAGES = (BanNotice,)


@dataclass(frozen=True, slots=True)
class Ban:
    until: float
    reason: str


class BanTable:
    """This peer's own bans (by holder name), and the notices other peers sent."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._bans: dict[str, Ban] = {}
        self.notices: dict[str, int] = {}
        """Notices received, per reporting peer (as the notice names it)."""

    def ban(self, now: float, holder: str, reason: str) -> bool:
        """Ban ``holder`` from now for ``seconds``; True if it was not banned already
        (the caller then tells the mesh)."""
        fresh = self.get(now, holder) is None
        self._bans[holder] = Ban(now + self.seconds, reason[:MAX_REASON])
        return fresh

    def get(self, now: float, holder: str) -> Ban | None:
        """The ban on ``holder`` in force at ``now``, or None."""
        ban = self._bans.get(holder)
        if ban is not None and ban.until <= now:
            del self._bans[holder]
            return None
        return ban

    def active(self, now: float) -> dict[str, tuple[float, str]]:
        """Holder -> (seconds left, reason) of every ban in force at ``now``."""
        for name in [n for n, b in self._bans.items() if b.until <= now]:
            del self._bans[name]
        return {n: (b.until - now, b.reason) for n, b in self._bans.items()}

    def hint(self, notice: BanNotice) -> None:
        """Count a notice from another peer; it bans nobody here."""
        if notice.sender in self.notices or len(self.notices) < MAX_REPORTERS:
            self.notices[notice.sender] = self.notices.get(notice.sender, 0) + 1
