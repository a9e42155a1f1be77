"""The peer: a thin trio shell around the sans-IO control plane and the data plane.

One nursery holds every task: the ZeroMQ socket's owner, the control dispatcher (decode,
feed :class:`ControlPlane`, send what it returns), the timer task that ticks it at its
deadlines, and the TCP data server.  Time comes from trio's clock only.

No input ends the dispatcher: a frame that does not decode, a message of a kind the
control port does not take, or one whose sender field is not the connection it came on
(the only address a reply may go to) is dropped and counted (``malformed_dropped``); an
exception a handler raises on remote input is a bug, counted in ``internal_errors`` with
its text, logged, and the peer goes on.

Security (``PeerConfig.security``): the ZAP handler and the handshake monitor
(:mod:`.zap`) run beside the control socket, which serves with CURVE; a message whose
sender name differs from the member ZAP authenticated its connection as is refused.
Without security the peer says so in the log and in :meth:`Peer.statistics`.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio
import zmq

from ..cast import CastSpec, fetch_cast
from ..config import PeerConfig, parse_hostport
from ..device.staging import DeviceRings, device_publish
from ..errors import (
    ConsistencyError,
    LocalProtocolError,
    PeerClosed,
    RemoteProtocolError,
    TransportError,
    VersionUnavailable,
)
from ..manifest.manifest import Manifest, build_manifest
from ..model import (
    PeerInfo,
    VersionKey,
    as_host_array,
    check_model_name,
    check_version,
)
from ..processes import free_ports
from ..protocol import codec
from ..protocol.addressing import claimed_name, misaddressed
from ..protocol.bans import MAX_REASON, Ban, BanNotice, BanTable
from ..protocol.control import ControlPlane
from ..protocol.coordination import CoordinatorAnswer
from ..protocol.groups import GroupEnvelope
from ..protocol.membership import Outbound
from ..protocol.messages import register_all
from ..protocol.opstatus import StatusQuery, StatusReply
from ..protocol.retention import KeepAnswer, KeepQuery
from ..protocol.sharding import WHOLE, Sharding
from ..protocol.sizing import choose_chunk_size
from ..protocol.versions import Seal
from ..security import Identity
from ..torch import Into, destination
from ..transport.admission import ServerLimits
from ..transport.base import Connection
from ..transport.handshake import DataAuth
from ..transport.server import TcpServer
from . import keys
from .conflicts import Explainer
from .connections import ConnectionPool
from .dialing import Dialer
from .fetcher import Fetch, Fetched, FetchReport
from .operations import Operations, operation
from .opstatus import StatusDesk
from .plane import DataPlane
from .reshard import fetch_sealed
from .retention import Retention
from .stats import INSECURE, PeerStats, peer_statistics
from .store import LocalVersion, Store
from .switching import switch_interval
from .zap import HandshakeMonitor, ZapHandler
from .zmq_trio import CurveKeys, ZmqRouter

register_all()
log = logging.getLogger("tensorhub.peer")
INTERNAL_ERRORS_KEPT = 16


class Peer:
    """A member of the mesh.  Create it with :func:`open_peer`."""

    def __init__(self, config: PeerConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.config = config
        self.dialer = Dialer(config.transports)  # fails first if a transport is missing
        """Which transport reads each holder, and why not the others (:mod:`.dialing`)."""
        host, port = parse_hostport(config.listen)
        port = port or free_ports(1, host)[0]
        sec = config.security
        self._zap: ZapHandler | None = None
        self._monitor: HandshakeMonitor | None = None
        curve = None
        if sec is not None:
            self._zap = ZapHandler(ctx, sec.keyring)  # bound before anyone can connect
            curve = CurveKeys(*sec.cluster.z85(), *sec.identity.curve_keys())
        self._identity = None if sec is None else sec.identity
        self._sender_mismatch = 0
        try:
            self._router = ZmqRouter(ctx, f"tcp://{host}:{port}", config.max_message_bytes,
                                     config.gossip_queue, curve, config.control_rate)
            if sec is not None:
                self._monitor = HandshakeMonitor(self._router.socket)
        except BaseException:
            if self._zap is not None:
                self._zap.close()
            raise
        self.store = Store(chunk_wait=config.stall_timeout)
        self.device_rings = DeviceRings()
        security = getattr(config, "security", None)  # PeerConfig.security: keys, or None
        self._data_auth = None if security is None else \
            DataAuth(config.name, security.identity, security.keyring)
        keyring = None if security is None else security.keyring
        self._pool = ConnectionPool(self._connect,
                                    lambda: 0 if keyring is None else keyring.generation,
                                    max_idle=min(10.0, config.data_idle_timeout))
        """Data connections kept between reads (see :mod:`.connections`)."""
        self._server = TcpServer(self.store, self._count_sent, self._count_bad, ServerLimits(
            config.data_max_connections, config.data_max_connections_per_address,
            config.data_idle_timeout, config.data_frame_timeout,
            config.data_requests_per_second, config.lease_timeout), self._data_auth,
            self.dialer.host)
        self.store.on_dropped.append(self.dialer.host.dropped)
        data_host, data_port = parse_hostport(config.data_listen) if config.data_listen \
            else (host, 0)
        try:
            data_port = self._server.bind(data_host, data_port)
        except BaseException:
            self._close_sockets()
            raise
        self.info = PeerInfo(config.name, self._router.endpoint, f"{data_host}:{data_port}",
                             tuple(config.labels))
        self.control: ControlPlane
        self._changed = trio.Event()
        self._seen_changes = 0
        self._wake_ticker = trio.Event()
        self._fetches: set[Fetch] = set()
        self.chunking = "nothing published yet"
        """The chunk size of this peer's last publish, and why (``statistics().chunking``)."""
        self._closed = False
        self.operations = Operations(config.name)
        """The API calls in flight: closing the peer ends them with PeerClosed."""
        self._served = self._chunks_served = self._fetched = self._nfetches = self._malformed = 0
        self._switches, self._switch_seconds = 0, 0.0  # rollouts' swaps (stats.account_switch)
        self._casts, self._cast_seconds = 0, 0.0  # fetch(cast=...) (stats.account_cast)
        self._internal_errors = 0
        self._internal_texts: list[str] = []
        self._by_source: dict[str, int] = {}
        self._by_transport: dict[str, int] = {}
        self._integrity: dict[str, int] = {}
        self.bans = BanTable(config.ban_seconds)
        self._reports: list[dict[str, Any]] = []
        self.bad_inputs: list[str] = []
        self._resharding: set[VersionKey] = set()
        self.retention = Retention(self)
        self.conflicts = Explainer(self)  # which tensors ranks disagree on
        self.status_desk = StatusDesk(self)  # status queries (tensorhub status)
        self._group_inbox: dict[str, Callable[[GroupEnvelope], None]] = {}
        """Handlers of group messages by group name (see :mod:`tensorhub.peer.group`)."""
        self._nursery: trio.Nursery

    # -- lifecycle --------------------------------------------------------------------

    def _close_sockets(self) -> None:
        """Close the zmq sockets whose owner tasks never ran (startup failed)."""
        if self._monitor is not None:
            self._monitor.close()
        self._router.close()
        if self._zap is not None:
            self._zap.close()

    async def _start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        await nursery.start(self._server.serve)
        self.control = ControlPlane(self.info, self.config, random.Random(),
                                    trio.current_time(), time.time_ns() // 1000)
        if self._zap is not None and self._monitor is not None:
            await nursery.start(self._zap.run)
            await nursery.start(self._monitor.run)
        else:
            log.warning("peer %s: %s (control %s, data %s); make keys with `tensorhub "
                        "keygen` to run a closed mesh", self.info.name, INSECURE,
                        self.info.control, self.info.data)
        await nursery.start(self._router.run)
        nursery.start_soon(self._dispatch)
        nursery.start_soon(self._ticker)
        seeds = [f"tcp://{h}:{p}" for h, p in map(parse_hostport, self.config.join)]
        self._send(self.control.join(trio.current_time(), seeds))

    async def _leave(self) -> None:
        await self.operations.close(self.config.stall_timeout)
        self._closed = True
        self._pool.close()
        self.dialer.close()
        self._send(self.control.leave(trio.current_time()))
        await trio.sleep(min(0.2, self.config.gossip_interval * 2))  # let the news go out

    def _send(self, out: list[Outbound]) -> None:
        encoded: dict[int, bytes] = {}  # by id: one message to many members, encoded once
        for item in out:
            try:
                data = encoded.get(id(item.msg)) or encoded.setdefault(
                    id(item.msg), codec.encode(item.msg, self.config.max_message_bytes))
            except LocalProtocolError as exc:
                self.internal_error(f"cannot send {type(item.msg).__name__}: {exc}")
                continue
            self._router.send_nowait(item.dest, data, reply=item.reply)
        self._after_change()

    def _after_change(self) -> None:
        if self.control.changes != self._seen_changes:
            self._seen_changes = self.control.changes
            if self.retention.offloaded:
                self.retention.release_unretained()
            self._changed.set()
            self._changed = trio.Event()
            for f in self._fetches:
                f.poke()
        self._wake_ticker.set()

    async def _dispatch(self) -> None:
        while True:
            try:
                sender, data, member = await self._router.receive()
            except trio.EndOfChannel:
                return
            try:
                msg = codec.decode(data, self.config.max_message_bytes)
            except RemoteProtocolError as exc:
                self._count_bad(f"control message from {sender[:100]!r}: {exc}")
                continue
            if member is not None and claimed_name(msg) not in (None, member):
                self._sender_mismatch += 1
                self._count_bad(f"{type(msg).__name__} from member {member} claims to come "
                                f"from {claimed_name(msg)!r}")
                continue
            try:
                self._handle(sender, msg)
            except Exception as exc:  # a bug on remote input: count it, keep serving
                self.internal_error(f"{type(msg).__name__} from {sender[:100]!r}: "
                                    f"{type(exc).__name__}: {exc}", exc)

    def _handle(self, sender: str, msg: object) -> None:
        """One decoded message from the connection with routing id ``sender``."""
        problem = misaddressed(msg, sender, self.control.membership.members())
        if problem:
            self._count_bad(f"{type(msg).__name__} from {sender[:100]!r}: {problem}")
        elif isinstance(msg, BanNotice):
            self.bans.hint(msg)
        elif isinstance(msg, KeepQuery | KeepAnswer):
            self.retention.on_message(sender, msg)
        elif isinstance(msg, StatusQuery | StatusReply):
            self.status_desk.on_message(sender, msg)
        elif isinstance(msg, GroupEnvelope):
            handler = self._group_inbox.get(msg.group)
            if handler is None:
                self._count_bad(f"group message for unknown group {msg.group[:100]!r}")
            else:
                handler(msg)
        else:
            self._send(self.control.receive(trio.current_time(), msg))

    def internal_error(self, what: str, exc: BaseException | None = None) -> None:
        """Our own code failed on remote input: count, keep the text, log, go on."""
        self._internal_errors += 1
        self._internal_texts = [*self._internal_texts[-(INTERNAL_ERRORS_KEPT - 1):], what]
        log.error("tensorhub peer %s: internal error: %s", self.info.name, what, exc_info=exc)

    def send_to(self, peer: str, msg: object) -> bool:
        """Send a control message to peer ``peer`` by name (False if it is not a live
        member in our view; the message is then not sent)."""
        member = self.control.membership.members().get(peer)
        if member is None or not self.control.membership.is_live(peer):
            return False
        self._router.send_nowait(member.info.control,
                                 codec.encode(msg, self.config.max_message_bytes))
        return True

    def data_plane(self) -> DataPlane:
        """What fetching, resharding and retention use of this peer (:mod:`.plane`)."""
        return DataPlane(self)

    async def wait_changed(self) -> None:
        """Return at the next change of the reference table or of coordination answers."""
        await self._changed.wait()

    async def _ticker(self) -> None:
        while True:
            with trio.move_on_at(self.control.next_deadline()):
                await self._wake_ticker.wait()
            self._wake_ticker = trio.Event()
            now = trio.current_time()
            if now >= self.control.next_deadline():
                self._send(self.control.tick(now))

    def banned(self, holder: str) -> Ban | None:
        """This peer's ban on reading from ``holder`` now (until when, why), or None."""
        return self.bans.get(trio.current_time(), holder)

    def ban(self, holder: str, key: VersionKey, reason: str) -> None:
        """``holder`` served bytes of ``key`` that failed their digest: read nothing from
        it for ``ban_seconds``, and tell the other live members (a hint for them)."""
        if not self.bans.ban(trio.current_time(), holder, reason):
            return
        notice = BanNotice(self.info.name, holder, str(key), reason[:MAX_REASON])
        for member in self.control.membership.live_members():
            if member.name not in (holder, self.info.name):
                self.send_to(member.name, notice)

    def _count_sent(self, reader: str, nbytes: int) -> None:
        self._served += nbytes
        self._chunks_served += 1

    def _count_bad(self, what: str) -> None:
        self._malformed += 1
        if len(self.bad_inputs) < 100:
            self.bad_inputs.append(what)

    # -- API ----------------------------------------------------------------------------

    @operation
    async def publish(self, model: str, version: int, tensors: Mapping[str, Any], *,
                      layout: Sharding | None = None) -> Manifest:
        """Register references to ``tensors`` (copies nothing) as ``model@version``.

        With ``layout``, this process is one rank of a publishing group and ``tensors``
        are its slices: split tensors (``layout.split``) hold this rank's part, the
        others are whole.  The version becomes visible to readers (``latest``, ``fetch``,
        ``wait_for_version``) only once every rank has published and all agree: it is
        *sealed*.  Until then :meth:`unsealed` says what is missing."""
        spec = layout or WHOLE
        if not isinstance(spec, Sharding):
            raise LocalProtocolError(f"layout must be a Sharding, got {type(spec).__name__}")
        key = spec.key(check_model_name(model), check_version(version))
        trust = self.control.trust
        if trust is not None and not trust.keyring.may_publish(key.model, self.info.name):
            raise LocalProtocolError(f"{self.info.name} is not a publisher of model "
                                     f"{key.model!r} in the keyring (tensorhub keygen "
                                     "--publisher MODEL=NAME)")
        if not tensors and spec.size == 1:
            raise LocalProtocolError("publish needs at least one tensor")
        if self.store.get(key) is not None:
            raise LocalProtocolError(f"{key} is already held here; unpublish it first")
        device = device_publish(self.device_rings, tensors)
        arrays = device.layout if device is not None else \
            [(str(name), as_host_array(t, str(name))) for name, t in tensors.items()]
        placed = [spec.place(name, a.shape) for name, a in arrays]
        chunk_size, self.chunking = choose_chunk_size(
            sum(a.nbytes for _, a in arrays), self.config.chunk_size,
            peers=len(self.control.membership.live_members()))
        build = functools.partial(build_manifest, key, arrays, chunk_size,
                                  self.config.digest_algo, spec.size, placed,
                                  self.config.manifest_limits)
        manifest = await (trio.to_thread.run_sync(build) if device is None
                          else device.manifest(build, chunk_size))
        mid = manifest.manifest_id()
        for peer, holding in self.control.holders(key):
            if holding.manifest_id != mid:
                raise ConsistencyError(
                    f"{key} is already published by {peer.name} with different content")
        local = LocalVersion(manifest, [a for _, a in arrays], self.info.name, verified=True)
        if device is not None:  # served from the GPU through the staging ring
            local.arrays = [p.owner for p in device.places]
            local.source = device.source(manifest)
        signed = self.control.sign_announcement(local.holding())
        local.announced = (signed.publisher_gen, signed.publisher_sig)
        self.store.add(local)
        self._send(self.control.publish_holding(local.holding()))
        return manifest

    def unsealed(self, model: str) -> list[str]:
        """Versions of ``model`` newer than ``latest`` that some rank announced but that
        are not sealed, each with the reason (a rank missing, ranks disagreeing: which
        ranks, and on which tensors once their manifests have been compared)."""
        return [f"version {s.version}: {self.conflicts.reason(model, s)}"
                for s in self.control.unsealed(check_model_name(model))]

    async def latest(self, model: str) -> int | None:
        """The newest complete version of ``model`` any live holder has, or None."""
        await trio.lowlevel.checkpoint()
        return self.control.latest(check_model_name(model))

    @operation
    async def wait_for_version(self, model: str, newer_than: int | None = None) -> int:
        """Wait until a version of ``model`` newer than ``newer_than`` exists; return it."""
        check_model_name(model)
        while True:
            v = self.control.latest(model)
            if v is not None and (newer_than is None or v > newer_than):
                return v
            await self._changed.wait()

    @operation
    async def unpublish(self, model: str, version: int, *,
                        layout: Sharding | None = None) -> None:
        """Stop serving ``model@version`` from the caller's arrays now; return once reads
        of them have drained, after which the caller may overwrite them.  ``layout`` is
        the sharding it was published or fetched with.

        Retention: if the version must stay readable (one of the newest sealed
        versions its model keeps, ``retain_for``, or pinned here) and this peer is the last
        complete holder of its shard, the shard is first copied to host memory this peer
        keeps serving from, until it is no longer retained; with ``retention_offload``
        off that raises :class:`RetentionError` instead and nothing changes."""
        spec = layout or WHOLE
        key = spec.key(check_model_name(model), check_version(version))
        local = self.store.get(key)
        if local is None or local.hidden:
            raise LocalProtocolError(f"{key} is not held here")
        if await self.retention.offload_if_last(key, local):
            return
        self.withdraw(key)
        await self.store.wait_drained(key)
        self.retention.offloaded.discard(key)

    def withdraw(self, key: VersionKey) -> None:
        """Refuse new reads of ``key`` now and tell the mesh (unpublish's first half)."""
        if self.store.hide(key) is not None:
            self._send(self.control.drop_holding(key))

    def start_background(self, task: Callable[[], Awaitable[None]]) -> None:
        """Run ``task()`` in this peer's nursery, beyond the caller's task (it must catch
        its own errors; closing the peer cancels it).  PeerClosed once it is closing."""
        if self.operations.closed:
            raise PeerClosed(f"peer {self.info.name} was closed")
        self._nursery.start_soon(task)

    def pin(self, model: str, version: int) -> None:
        """Keep ``model@version`` readable while this peer lives (see :meth:`unpublish`)."""
        self.retention.pins.add((check_model_name(model), check_version(version)))

    def unpin(self, model: str, version: int) -> None:
        self.retention.pins.discard((check_model_name(model), check_version(version)))
        self.retention.release_unretained()

    @operation
    async def fetch(self, model: str, version: int | str = "latest",
                    into: Into | None = None, *, sources: Sequence[str] | None = None,
                    layout: Sharding | None = None, cast: CastSpec | None = None
                    ) -> Fetched:
        """Pull ``model@version`` into ``into`` (or new arrays); afterwards we hold it.
        ``into``: arrays or torch tensors by name, or an ``nn.Module``; ``cast``: see
        :mod:`tensorhub.cast`.

        Only sealed versions can be fetched (see :meth:`publish`).  ``layout`` asks for
        the slices rank ``layout.rank`` of that sharding holds (default: every tensor
        whole); they are assembled from whichever holders' slices intersect them, each
        source chunk verified against its digest before a byte of it is used.  Holders
        with the same layout and rank are read whole, without resharding.

        ``sources`` restricts the holders to read from (by peer name), e.g. to follow a
        plan; a named source that is itself still receiving is asked for every chunk and
        serves each as soon as it has verified it (pipelining).  The fetch waits up to
        ``stall_timeout`` for a named source to appear as a holder."""
        if cast is not None:
            return await fetch_cast(self, model, version, into, cast, sources=sources,
                                    layout=layout)
        into = None if into is None else destination(into)  # a module: its state_dict
        check_model_name(model)
        spec = layout or WHOLE
        if not isinstance(spec, Sharding):
            raise LocalProtocolError(f"layout must be a Sharding, got {type(spec).__name__}")
        if version == "latest":
            resolved = self.control.latest(model)
            if resolved is None:
                raise VersionUnavailable(model, "latest", "no sealed version is known")
        elif isinstance(version, int):
            resolved = check_version(version)
        else:
            raise LocalProtocolError(f"version must be an int or 'latest', got {version!r}")
        key = spec.key(model, resolved)
        held = self.store.get(key)
        if held is not None and held.complete and not held.hidden and into is None:
            names = held.manifest.table.names
            return Fetched(resolved, dict(zip(names, held.arrays, strict=True)),
                           FetchReport(model, resolved, verified=True, served_arrays=True))
        if held is not None or key in self._resharding:
            raise LocalProtocolError(f"{key} is already being fetched or held here")
        allowed = frozenset(sources) if sources is not None else None
        seal = await self._sealed(model, resolved, wait=allowed is not None)
        return await fetch_sealed(self, key, seal, spec, into, allowed)

    async def wait_sealed(self, model: str, version: int) -> None:
        """Wait up to ``stall_timeout`` until ``model@version`` is sealed in this peer's
        view (another peer's may have named it first); VersionUnavailable after that,
        ConsistencyError naming ranks and tensors when its ranks disagree."""
        await self._sealed(check_model_name(model), check_version(version), wait=True)

    async def _sealed(self, model: str, version: int, wait: bool) -> Seal:
        """The seal of ``model@version``; with ``wait``, wait up to ``stall_timeout`` for
        it (the view may lag behind a publish we were told about)."""
        deadline = trio.current_time() + self.config.stall_timeout
        while True:
            try:
                return self.control.seal(model, version)
            except ConsistencyError as exc:
                raise ConsistencyError(
                    await self.conflicts.explain(model, version, str(exc))) from None
            except VersionUnavailable:
                if not wait or trio.current_time() >= deadline:
                    raise
            with trio.move_on_at(deadline):
                await self._changed.wait()

    async def _connect(self, peer: PeerInfo) -> Connection:
        """A data connection to ``peer`` over the first of ``config.transports`` that
        works for it; the others' reasons are kept for statistics (:mod:`.dialing`)."""
        return await self.dialer.connect(self.info, peer, self.config.connect_timeout,
                                         self._data_auth)

    # -- coordinators ----------------------------------------------------------------------

    def coordinator(self, model: str, version: int) -> str:
        """The peer that coordinates ``model@version`` in this peer's current view."""
        return self.control.coordinator(VersionKey(check_model_name(model),
                                                   check_version(version)))

    @operation
    async def ask_coordinator(self, model: str, version: int, *, size: int = 0,
                              chunks: int = 0) -> CoordinatorAnswer:
        """Register as a fetcher with the coordinator of ``model@version``, routed through
        the mesh to whoever coordinates it; returns its name, epoch and fetchers.
        Retries while views settle, at once when the coordinator asked leaves the view;
        raises :class:`TransportError` if none answers."""
        key = VersionKey(check_model_name(model), check_version(version))
        last = "no answer"
        for _attempt in range(3):
            req_id, out = self.control.ask_coordinator(key, size, chunks)
            self._send(out)
            asked = self.control.coordinator(key)
            with trio.move_on_after(self.config.connect_timeout):
                while req_id not in self.control.coordination.answers \
                        and self.control.coordinator(key) == asked:
                    await self._changed.wait()
            answer = self.control.coordination.answers.pop(req_id, None)
            if isinstance(answer, CoordinatorAnswer):
                return answer
            last = answer or last
        raise TransportError(f"no coordinator answered for {key}: {last}")

    # -- security --------------------------------------------------------------------------

    def update_keyring(self, members: Mapping[str, Iterable[bytes]],
                       publishers: Mapping[str, Iterable[str]] | None = None) -> None:
        """Swap in a new member list (and publishers; None keeps them): key rotation
        without a restart.  Handshakes and signatures by removed keys stop counting at
        once; connections already made stay up."""
        keys.update_keyring(self, members, publishers)

    def rotate_identity(self, identity: Identity) -> None:
        """Sign and connect with ``identity`` from now on.  Its key must already be in
        the keyring for this peer's name (add it everywhere first, then switch, then
        remove the old one).  Our membership claim, our reference entry and the
        announcements we published are re-signed at once."""
        keys.rotate_identity(self, identity)
        self._identity = identity

    @property
    def identity(self) -> Identity | None:
        """This peer's current identity (it changes with :meth:`rotate_identity`;
        ``config.security.identity`` is the one it started with); None if insecure."""
        return self._identity

    # -- introspection -------------------------------------------------------------------

    def members(self) -> dict[str, tuple[PeerInfo, str]]:
        return {n: (m.info, m.status) for n, m in self.control.membership.members().items()}

    def statistics(self) -> PeerStats:
        return peer_statistics(self)


@asynccontextmanager
async def open_peer(config: PeerConfig) -> AsyncIterator[Peer]:
    """Run a peer for the duration of the ``async with`` block, then leave the mesh."""
    async with AsyncExitStack() as stack:  # unwound in reverse: the nursery ends first
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        stack.callback(ctx.term)
        peer = Peer(config, ctx)  # binds both sockets: a used port fails here, unwrapped
        stack.callback(peer._close_sockets)  # closed already unless startup failed
        stack.enter_context(switch_interval(config.switch_interval))
        nursery = await stack.enter_async_context(trio.open_nursery())
        await peer._start(nursery)
        try:
            yield peer
        finally:
            with trio.CancelScope(shield=True):
                await peer._leave()
            nursery.cancel_scope.cancel()
