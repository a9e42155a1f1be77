"""One-sided transport, holder side: opening links (``OneSidedHello``) and leasing
chunks (``OneSidedChunkRequest``, or a run of them: ``OneSidedRunRequest``), handed over by
:class:`~tensorhub.transport.server.TcpServer`; see :mod:`tensorhub.protocol.onesided`
for the protocol and :mod:`.reader` for the reader side.

Leases and drain are those of the same-host transport (:mod:`..samehost.holder`): a
chunk (every chunk of a run) stays leased from its grant until the reader's
``OneSidedDone``; a reader that
does not answer within ``lease_timeout`` is cut off -- its connection shut down and its
end of the link closed (a queue pair torn down: reads still posted fail) -- before the
lease ends, so ``unpublish`` returns within about ``lease_timeout`` even when a reader
hangs, and the reader, which checks the connection after its reads, never uses bytes read
past its lease.
"""

from __future__ import annotations

import socket
from collections.abc import Hashable, Iterable, Sequence
from contextlib import AbstractContextManager, ExitStack, suppress
from typing import Any, Protocol, runtime_checkable

import trio

from ...errors import RemoteProtocolError, TransportError
from ...model import VersionKey
from ...protocol.dataplane import BAD_REQUEST, OK, WRONG_TRANSPORT, ChunkReply, Reply
from ...protocol.onesided import (
    OneSidedChunkRequest,
    OneSidedDone,
    OneSidedHello,
    OneSidedRunRequest,
    OneSidedWelcome,
    grant_frames,
)
from ..base import NotServing, Provider
from ..frames import recv_frame, send_frame
from ..samehost.holder import LeaseTerms
from .backend import Backend, Link
from .registry import Registrations, RegistrationStats


@runtime_checkable
class DeviceProvider(Protocol):
    """A provider that can hand a backend reading device memory (CUDA IPC) a device
    version's tensors in place (the peer's store)."""

    async def wait_chunk(self, key: VersionKey, chunk: int, stage: bool = True) -> None: ...

    def lease_device(self, key: VersionKey, chunk: int
                     ) -> AbstractContextManager[Sequence[Any] | None]: ...


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
                         req: OneSidedHello | OneSidedChunkRequest | OneSidedRunRequest,
                         local: bool,
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
    reg = host.registrations[slot.backend]
    get = getattr(provider, "get", None)  # the version itself, if the provider says
    user = (get(key) if get is not None else None) or key
    run = isinstance(req, OneSidedRunRequest)
    first, count = (req.first, req.count) if isinstance(req, OneSidedRunRequest) \
        else (req.chunk, 1)
    chunks = range(first, first + count)
    if chunks[-1] >= 1 << 32:
        raise RemoteProtocolError(f"run of chunks {first}..{chunks[-1]} passes the last "
                                  "chunk index a reply can name")
    with ExitStack() as leases:
        granted: list[int] = []
        for chunk in chunks:
            granted += await _grant(sock, provider, reg, leases, user, key, req.req_id,
                                    chunk, run)
        if granted:
            await _wait_done(sock, peer, slot, req.req_id, terms,
                             f"chunks {chunks[0]}..{chunks[-1]} of {key}")
            for n in granted:
                terms.on_sent(peer, n)


async def _grant(sock: trio.socket.SocketType, provider: Provider, reg: Registrations,
                 leases: ExitStack, user: Hashable, key: VersionKey, req_id: int,
                 chunk: int, run: bool) -> list[int]:
    """Lease ``chunk`` (into ``leases``) and grant it: ``[its bytes]``; or refuse it
    (a ``Reply``, or in a run a ``ChunkReply``, with the status) and return ``[]``.  In
    a run an OK ``ChunkReply`` comes before the grant."""
    async def refuse(status: int, detail: str) -> list[int]:
        await send_frame(sock, ChunkReply(req_id, chunk, status, 0, detail) if run
                         else Reply(req_id, status, 0, detail))
        return []

    # a backend that reads device memory gets a device version's tensors in place
    in_place = provider if reg.backend.device_memory \
        and isinstance(provider, DeviceProvider) else None
    try:
        if in_place is not None:
            await in_place.wait_chunk(key, chunk, stage=False)
        else:
            await provider.wait_chunk(key, chunk)
        with ExitStack() as lease:
            segments: Sequence[Any] | None = None
            if in_place is not None:
                segments = lease.enter_context(in_place.lease_device(key, chunk))
            if segments is None:
                segments = lease.enter_context(provider.lease(key, chunk))
            ranges = reg.remote_ranges(segments, user)
            leases.push(lease.pop_all())
    except NotServing as ns:
        return await refuse(ns.status, ns.detail)
    except (TypeError, TransportError) as exc:
        return await refuse(WRONG_TRANSPORT, f"cannot serve chunk {chunk} of {key} so: {exc}")
    total = sum(n for _, n, _ in ranges)
    if run:
        await send_frame(sock, ChunkReply(req_id, chunk, OK, total))
    for frame in grant_frames(req_id, total, ranges):
        await send_frame(sock, frame)
    return [total]


async def _wait_done(sock: trio.socket.SocketType, peer: str, slot: LinkSlot, req_id: int,
                     terms: LeaseTerms, what: str) -> None:
    """Wait for the reader's ``OneSidedDone`` (the caller ends the leases then).  A
    reader silent for ``terms.timeout`` is cut off first: its link closed (reads still
    posted fail) and its connection shut down (its check after each read sees that)."""
    done: Any = None
    with trio.move_on_after(terms.timeout) as waited:
        try:
            done = await recv_frame(sock)
        except TransportError:
            slot.close()
            raise  # the reader went away; its leases end here
    if waited.cancelled_caught:
        slot.close()
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        terms.on_revoked(peer)
        raise TransportError(f"{peer} held {what} for over {terms.timeout}s; "
                             "lease revoked")
    if done != OneSidedDone(req_id):
        raise RemoteProtocolError(f"expected OneSidedDone({req_id}), got {done!r:.80}")
