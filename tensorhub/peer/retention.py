"""Retention at one peer: which versions it keeps readable, and what its unpublish does
with the last copy of one (see :mod:`tensorhub.protocol.retention` for the hand-over
between holders leaving at once)."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Awaitable, Callable

import trio

from ..config import PeerConfig
from ..errors import RetentionError
from ..model import VersionKey
from ..protocol.control import ControlPlane
from ..protocol.retention import KeepAnswer, KeepQuery
from ..read.store import LocalVersion, Store

log = logging.getLogger("tensorhub.peer")


class Retention:
    """A peer's pins, its host copies of retained versions, and the keep queries it has
    asked or answers."""

    def __init__(self, me: str, config: PeerConfig, store: Store, control: ControlPlane,
                 send_to: Callable[[str, object], bool],
                 withdraw: Callable[[VersionKey], None], count_bad: Callable[[str], None],
                 spawn: Callable[[Callable[[], Awaitable[None]]], None]) -> None:
        """``send_to(name, message)``: send a control message to a live member (False
        if it is not one); ``withdraw(key)``: refuse new reads of a version and tell the
        mesh; ``count_bad``: count an unexpected message; ``spawn``: run a task in the
        peer's nursery."""
        self.me, self.config, self.store, self.control = me, config, store, control
        self._send_to, self._withdraw, self._count_bad, self._spawn = \
            send_to, withdraw, count_bad, spawn
        self.pins: set[tuple[str, int]] = set()
        self.offloaded: set[VersionKey] = set()
        """Versions served from our own host copies, not caller arrays."""
        self._leaving: set[VersionKey] = set()
        """Retained shards being unpublished here: we no longer vouch for keeping them."""
        self._asks: dict[int, tuple[trio.MemorySendChannel[bool], str]] = {}
        self._nonces = itertools.count(1)

    def retained(self, key: VersionKey) -> bool:
        """Pinned, one of the newest sealed versions its model keeps
        (``PeerConfig.retain_for``), or newer than ``latest`` here: a version this peer
        does not see sealed yet may be sealed already at others (the last rank's claim
        still on its way), so its last copy is kept until a newer version seals."""
        if (key.model, key.version) in self.pins:
            return True
        control = self.control
        keep = self.config.retain_for(key.model)
        if not keep:
            return False
        newest = control.readable(key.model)[-keep:]
        latest = control.latest(key.model)
        return key.version in newest or latest is None or key.version > latest

    def may_offload(self, key: VersionKey, local: LocalVersion) -> bool:
        """Whether unpublishing ``local`` may have to keep a copy of it (a complete,
        retained shard): only then does :meth:`offload_if_last` wait for anything."""
        return local.complete and not local.derived and self.retained(key)

    async def offload_if_last(self, key: VersionKey, local: LocalVersion) -> bool:
        """Before ``local`` is unpublished: if it is the last complete copy of a retained
        shard, copy it to host memory we keep serving from and return True (unpublish is
        then done); :class:`RetentionError` if offload is off.  False: drop it."""
        if not self.may_offload(key, local):
            return False
        self._leaving.add(key)
        try:
            others = self._other_complete_holders(key)
            if await self._kept_elsewhere(key, others):
                return False
            if not self.config.retention_offload:
                raise RetentionError(
                    f"{key} is retained and this peer holds its last complete copy; "
                    "offload is off (PeerConfig.retention_offload), so it stays published")
            copies = await trio.to_thread.run_sync(local.host_copy)
            copy = LocalVersion(local.manifest, copies, local.publisher, verified=True)
            copy.announced = local.announced
            await self.store.swap(copy)
            self.offloaded.add(key)
            log.info("peer %s: unpublish of %s keeps a host copy (%d bytes) until it is no "
                     "longer retained: %s", self.me, key, local.manifest.total_bytes,
                     f"none of {others} confirmed keeping it" if others
                     else "no other complete holder is known")
            return True
        finally:
            self._leaving.discard(key)  # the caller hides it with no await in between

    def _other_complete_holders(self, key: VersionKey) -> list[str]:
        me = self.me
        return [p.name for p, h in self.control.holders(key)
                if h.complete and not h.derived and p.name != me]

    async def _kept_elsewhere(self, key: VersionKey, others: list[str]) -> bool:
        """Whether one of ``others`` (complete holders) confirms it keeps ``key``; False
        when none does within two probe intervals."""
        if not others:
            return False
        send, recv = trio.open_memory_channel[bool](len(others))
        nonces = []
        members = self.control.membership.members()
        for name in others:
            nonce = next(self._nonces)
            if self._send_to(name, KeepQuery(self.me, nonce, key.model, key.version,
                                             key.shard, key.layout)):
                self._asks[nonce] = (send, members[name].info.control)
                nonces.append(nonce)
        try:
            with trio.move_on_after(self.config.probe_interval * 2):
                for _ in nonces:
                    if await recv.receive():
                        return True
            return False
        finally:
            for nonce in nonces:
                self._asks.pop(nonce, None)

    def on_message(self, sender: str, msg: KeepQuery | KeepAnswer) -> None:
        """A keep query to answer, or the answer to one of ours (``sender``: the control
        endpoint it came from)."""
        if isinstance(msg, KeepAnswer):
            ask = self._asks.get(msg.nonce)
            if ask is None or sender != ask[1]:  # late (timed out), or not who we asked
                self._count_bad(f"unexpected retention answer from {sender}")
                return
            del self._asks[msg.nonce]
            ask[0].send_nowait(msg.keeps)
            return
        key = VersionKey(msg.model, msg.version, msg.shard, msg.layout)
        local = self.store.get(key)
        keeps = (local is not None and not local.hidden and local.complete
                 and not local.derived and key not in self._leaving)
        self._send_to(msg.asker, KeepAnswer(msg.nonce, keeps))

    def release_unretained(self) -> None:
        """Drop host copies of versions that are no longer retained."""
        for key in [k for k in self.offloaded if not self.retained(k)]:
            self.offloaded.discard(key)
            if self.store.get(key) is not None:
                self._withdraw(key)
                self._spawn(functools.partial(self.store.wait_drained, key))
