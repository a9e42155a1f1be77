"""Status queries at one peer: answer them, and ask them (``tensorhub status``).

See :mod:`tensorhub.protocol.opstatus` for the messages and why they exist.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import trio

from ..protocol.opstatus import (
    MAX_HELD,
    MAX_LINKS,
    HeldVersion,
    LinkBytes,
    StatusQuery,
    StatusReply,
    encode_reply,
)

if TYPE_CHECKING:
    from .node import Peer


def status_reply(peer: Peer, nonce: int) -> StatusReply:
    """What ``peer`` says about itself now."""
    held = [HeldVersion(k.model, k.version, k.shard, v.manifest.total_bytes,
                        v.num_verified, v.manifest.num_chunks)
            for k, v in peer.store.versions.items() if not v.hidden]
    links = [LinkBytes(job.key.model, job.key.version, src,
                       job.report.transport_by_source.get(src, "?")[:32], n,
                       job.manifest.total_bytes)
             for job in list(peer._fetches) for src, n in job.report.bytes_by_source.items()]
    left_out = max(0, len(held) - MAX_HELD) + max(0, len(links) - MAX_LINKS)
    return StatusReply(
        nonce, peer.info.name, tuple(held[:MAX_HELD]), tuple(links[:MAX_LINKS]),
        peer._fetched, peer._served, peer._nfetches, sum(peer._integrity.values()),
        peer.control.membership.statistics().suspicions, left_out)


class StatusDesk:
    """A peer's status queries: those it answers, and the replies to its own."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self._nonces = itertools.count(1)
        self._waiting: dict[int, tuple[str, trio.MemorySendChannel[StatusReply]]] = {}

    def on_message(self, sender: str, msg: StatusQuery | StatusReply) -> None:
        """A query to answer (over the connection it came on, ``sender``), or a reply to
        one of ours (dropped and counted if we did not ask ``sender`` that)."""
        peer = self.peer
        if isinstance(msg, StatusQuery):
            data = encode_reply(status_reply(peer, msg.nonce), peer.config.max_message_bytes)
            peer._router.send_nowait(sender, data, reply=True)
            return
        waiting = self._waiting.get(msg.nonce)
        if waiting is None or waiting[0] != sender:
            peer._count_bad(f"unexpected status reply from {sender[:100]}")
            return
        del self._waiting[msg.nonce]
        waiting[1].send_nowait(msg)

    async def ask_all(self, timeout: float) -> dict[str, StatusReply]:
        """Ask every live member but ourselves; the replies that came within
        ``timeout`` seconds, by member name."""
        peer = self.peer
        members = [m for m in peer.control.membership.live_members()
                   if m.name != peer.info.name]
        send, receive = trio.open_memory_channel[StatusReply](len(members) + 1)
        asked: list[int] = []
        for member in members:
            nonce = next(self._nonces)
            self._waiting[nonce] = (member.control, send)
            asked.append(nonce)
            if not peer.send_to(member.name, StatusQuery(nonce)):
                del self._waiting[nonce]
                asked.pop()
        replies: dict[str, StatusReply] = {}
        try:
            with trio.move_on_after(timeout):
                while len(replies) < len(asked):
                    reply = await receive.receive()
                    replies[reply.name] = reply
        finally:
            for nonce in asked:
                self._waiting.pop(nonce, None)
        return replies
