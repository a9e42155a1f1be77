"""One-sided transport, holder side: opening links (``OneSidedHello``) and leasing
chunks (``OneSidedChunkRequest``), handed over by
:class:`~tensorhub.transport.server.TcpServer`; see :mod:`tensorhub.protocol.onesided`
for the protocol and :mod:`.reader` for the reader side.

Leases and drain are those of the same-host transport (:mod:`..samehost.holder`): a
chunk stays leased from its grant until the reader's ``OneSidedDone``; a reader that
does not answer within ``lease_timeout`` is cut off -- its connection shut down and its
end of the link closed (a queue pair torn down: reads still posted fail) -- before the
lease ends, so ``unpublish`` returns within about ``lease_timeout`` even when a reader
hangs, and the reader, which checks the connection after its reads, never uses bytes read
past its lease.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from contextlib import ExitStack, suppress
from typing import Any

import trio

from ...errors import RemoteProtocolError, TransportError
from ...model import VersionKey
from ...protocol.dataplane import BAD_REQUEST, WRONG_TRANSPORT, Reply
from ...protocol.onesided import (
    OneSidedChunkRequest,
    OneSidedDone,
    OneSidedHello,
    OneSidedWelcome,
    grant_frames,
)
from ..base import NotServing, Provider
from ..frames import recv_frame, send_frame
from ..samehost.holder import LeaseTerms
from .backend import Backend, Link
from .registry import Registrations, RegistrationStats


class OneSidedHost:
    """A holder's one-sided backends, their registrations, and the link of each data
    connection that opened one."""

    def __init__(self, backends: Iterable[Backend]) -> None:
        self.backends = {b.name: b for b in backends}
        self.registrations = {name: Registrations(b) for name, b in self.backends.items()}
        self.links_opened = 0

    def dropped(self, local: Any) -> None:
        """A version was unpublished and drained (``Store.on_dropped``): revoke the keys
        of buffers no published version lies in any more."""
        for reg in self.registrations.values():
            reg.dropped(local)
            reg.dropped(local.manifest.key)

    def statistics(self) -> dict[str, RegistrationStats]:
        return {name: reg.statistics() for name, reg in self.registrations.items()}

    def close(self) -> None:
        for reg in self.registrations.values():
            reg.close()


class LinkSlot:
    """What one data connection opened: a backend and its end of the link."""

    def __init__(self) -> None:
        self.backend: str | None = None
        self.link: Link | None = None

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None


async def serve_onesided(sock: trio.socket.SocketType, peer: str, provider: Provider,
                         host: OneSidedHost, slot: LinkSlot,
                         req: OneSidedHello | OneSidedChunkRequest, local: bool,
                         terms: LeaseTerms) -> None:
    """Answer one one-sided request on a data connection (``local``: the same-host
    socket)."""
    if isinstance(req, OneSidedHello):
        backend = host.backends.get(req.backend)
        why = None
        if backend is None:
            why = (f"{req.backend!r} is not served here (serving: "
                   f"{', '.join(host.backends) or 'no one-sided backend'})")
        elif backend.same_host and not local:
            why = f"{req.backend} is answered on the same-host socket only"
        elif slot.link is not None:
            raise RemoteProtocolError(f"{peer} opened a second link on one connection")
        if why is not None or backend is None:
            await send_frame(sock, Reply(req.req_id, BAD_REQUEST, 0, why or ""))
            return
        try:
            link, endpoint = backend.accept(req.endpoint)
        except ValueError as exc:
            raise RemoteProtocolError(f"{peer}: {exc}") from None
        slot.backend, slot.link = backend.name, link
        host.links_opened += 1
        await send_frame(sock, OneSidedWelcome(req.req_id, endpoint))
        return
    if slot.link is None or slot.backend is None:
        await send_frame(sock, Reply(req.req_id, BAD_REQUEST, 0, "no link open: "
                                     "OneSidedHello first"))
        return
    key = VersionKey(req.model, req.version, req.shard, req.layout)
    await _serve_chunk(sock, peer, provider, host.registrations[slot.backend], slot, key,
                       req, terms)


async def _serve_chunk(sock: trio.socket.SocketType, peer: str, provider: Provider,
                       reg: Registrations, slot: LinkSlot, key: VersionKey,
                       req: OneSidedChunkRequest, terms: LeaseTerms) -> None:
    with ExitStack() as stack:
        try:
            await provider.wait_chunk(key, req.chunk)
            segments: Sequence[Any] = stack.enter_context(provider.lease(key, req.chunk))
        except NotServing as ns:
            await send_frame(sock, Reply(req.req_id, ns.status, 0, ns.detail))
            return
        get = getattr(provider, "get", None)  # the version itself, if the provider says
        user = (get(key) if get is not None else None) or key
        try:
            ranges = reg.remote_ranges(segments, user)
        except (TypeError, TransportError) as exc:
            await send_frame(sock, Reply(req.req_id, WRONG_TRANSPORT, 0, f"cannot serve "
                                         f"chunk {req.chunk} of {key} so: {exc}"))
            return
        total = sum(n for _, n, _ in ranges)
        done: Any = None
        with trio.move_on_after(terms.timeout) as waited:
            for frame in grant_frames(req.req_id, total, ranges):
                await send_frame(sock, frame)
            try:
                done = await recv_frame(sock)
            except TransportError:
                slot.close()
                return  # the reader went away; its lease ends here
        if waited.cancelled_caught:
            slot.close()  # reads still posted fail...
            with suppress(OSError):  # ...and the reader's check after them sees this
                sock.shutdown(socket.SHUT_RDWR)
            terms.on_revoked(peer)
            raise TransportError(f"{peer} held chunk {req.chunk} of {key} for over "
                                 f"{terms.timeout}s; lease revoked")
        if done != OneSidedDone(req.req_id):
            raise RemoteProtocolError(f"expected OneSidedDone({req.req_id}), got {done!r:.80}")
        terms.on_sent(peer, total)
