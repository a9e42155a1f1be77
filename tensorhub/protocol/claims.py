"""Which membership claims count in secure mode (a pure helper of membership.py).

Theory of operation
-------------------
A membership claim (an ``Update``) names its ``origin`` and carries its signature.  With
security on, :class:`ClaimCheck` decides whether a claim that would change the view
counts:

* *alive* and *left* are claims about oneself: ``origin`` must be the member and the
  signature its own.  An alive claim must not take the control or data address of
  another live member (or ours).  Each accepted one raises the highest incarnation the
  member has signed itself (:attr:`ClaimCheck.self_signed`).
* *suspect* and *dead* are accusations: signed by their accuser (a member other than
  the accused), and counted only at an incarnation no higher than the accused has itself
  signed, so nobody can accuse a future incarnation or evict a member for good.
* about *us*: our own earlier claims (an earlier life) or an accusation of our current
  incarnation by a member make us refute; anything else is ignored.

Refusals are counted on the :class:`~.trust.Trust` under ``"membership claim"``.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..model import PeerInfo
from .swim_wire import KIND_ALIVE, KIND_LEFT, Update
from .trust import Trust


class ClaimCheck:
    def __init__(self, trust: Trust, me: str) -> None:
        self.trust = trust
        self.me = me
        self.self_signed: dict[str, int] = {}
        """The highest incarnation seen signed by each member itself."""

    def about_other(self, u: Update, live: Iterable[PeerInfo]) -> bool:
        """Does claim ``u`` about another member count?  ``live``: the live members'
        info, ourselves included (for the address check of alive claims)."""
        if u.kind == KIND_ALIVE or u.kind == KIND_LEFT:
            ok = (u.origin == u.name and self.trust.check(u.name, u.signed_bytes(), u.sig)
                  and not (u.kind == KIND_ALIVE and _takes_address(u, live)))
            if ok and u.incarnation > self.self_signed.get(u.name, -1):
                self.self_signed[u.name] = u.incarnation
        else:
            ok = (u.origin != u.name and u.incarnation <= self.self_signed.get(u.name, -1)
                  and self.trust.check(u.origin, u.signed_bytes(), u.sig))
        return self._verdict(ok)

    def about_me(self, u: Update, incarnation: int) -> bool:
        """Does claim ``u`` about us (at ``incarnation`` now) count, so that we refute?"""
        if u.kind == KIND_ALIVE or u.kind == KIND_LEFT:
            ok = u.origin == self.me and self.trust.check(self.me, u.signed_bytes(), u.sig)
        else:
            ok = (u.incarnation <= incarnation and u.origin != self.me
                  and self.trust.check(u.origin, u.signed_bytes(), u.sig))
        return self._verdict(ok)

    def _verdict(self, ok: bool) -> bool:
        if not ok:
            self.trust.refuse("membership claim")
        return ok


def _takes_address(u: Update, live: Iterable[PeerInfo]) -> bool:
    assert u.info is not None
    control, data = u.info.control, u.info.data
    return any(info.name != u.name and (info.control == control or info.data == data)
               for info in live)
