"""Status queries at one peer: answer them, and ask them (``tensorhub status``).

See :mod:`tensorhub.protocol.opstatus` for the messages and why they exist.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import trio

from ..model import PeerInfo
from ..protocol.opstatus import (
    MAX_HELD,
    MAX_LINKS,
    HeldVersion,
    LinkBytes,
    StatusQuery,
    StatusReply,
    encode_reply,
)
from ..read.reader import FetchProgress, ReadStats
from ..read.store import Store


def status_reply(nonce: int, name: str, store: Store, progress: Iterable[FetchProgress],
                 reads: ReadStats, served: int, suspicions: int) -> StatusReply:
    """What peer ``name`` says about itself now: what it holds, its transfers running,
    its totals."""
    held = [HeldVersion(k.model, k.version, k.shard, v.manifest.total_bytes,
                        v.num_verified, v.manifest.num_chunks)
            for k, v in store.versions.items() if not v.hidden]
    links = [LinkBytes(p.key.model, p.key.version, src,
                       p.transport_by_source.get(src, "?")[:32], n, p.total_bytes)
             for p in progress for src, n in p.bytes_by_source.items()]
    left_out = max(0, len(held) - MAX_HELD) + max(0, len(links) - MAX_LINKS)
    return StatusReply(
        nonce, name, tuple(held[:MAX_HELD]), tuple(links[:MAX_LINKS]),
        reads.bytes_fetched, served, reads.fetches, sum(reads.integrity_failures.values()),
        suspicions, left_out)


class StatusDesk:
    """A peer's status queries: those it answers, and the replies to its own."""

    def __init__(self, me: str, reply: Callable[[int], StatusReply],
                 answer: Callable[[str, bytes], None], send_to: Callable[[str, object], bool],
                 live: Callable[[], list[PeerInfo]], count_bad: Callable[[str], None],
                 max_message_bytes: int) -> None:
        """``reply(nonce)``: what this peer says now; ``answer(sender, data)``: send
        encoded bytes back over the connection a query came on; ``send_to(name, msg)``:
        send to a live member by name (False if it is not one)."""
        self.me, self._reply, self._answer, self._send_to = me, reply, answer, send_to
        self._live, self._count_bad = live, count_bad
        self._max = max_message_bytes
        self._nonces = itertools.count(1)
        self._waiting: dict[int, tuple[str, trio.MemorySendChannel[StatusReply]]] = {}

    def on_message(self, sender: str, msg: StatusQuery | StatusReply) -> None:
        """A query to answer (over the connection it came on, ``sender``), or a reply to
        one of ours (dropped and counted if we did not ask ``sender`` that)."""
        if isinstance(msg, StatusQuery):
            self._answer(sender, encode_reply(self._reply(msg.nonce), self._max))
            return
        waiting = self._waiting.get(msg.nonce)
        if waiting is None or waiting[0] != sender:
            self._count_bad(f"unexpected status reply from {sender[:100]}")
            return
        del self._waiting[msg.nonce]
        waiting[1].send_nowait(msg)

    async def ask_all(self, timeout: float) -> dict[str, StatusReply]:
        """Ask every live member but ourselves; the replies that came within
        ``timeout`` seconds, by member name."""
        members = [m for m in self._live() if m.name != self.me]
        send, receive = trio.open_memory_channel[StatusReply](len(members) + 1)
        asked: list[int] = []
        for member in members:
            nonce = next(self._nonces)
            self._waiting[nonce] = (member.control, send)
            asked.append(nonce)
            if not self._send_to(member.name, StatusQuery(nonce)):
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
