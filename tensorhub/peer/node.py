"""The peer: a thin trio shell around the sans-IO control plane and the read path.

One nursery holds every task: the ZeroMQ socket's owner, the control dispatcher (decode,
feed :class:`ControlPlane`, send what it returns), the timer task that ticks it at its
deadlines, and the TCP data server.  Time comes from trio's clock only.  Reads are the
business of one object, the peer's :class:`~tensorhub.read.reader.Reader` (its
connections, link memory, fetches in flight and read counters); the peer builds it with
narrow :class:`~tensorhub.read.ports.Ports` and hands :meth:`Peer.fetch` to it.

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
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import asdict, replace
from typing import Any

import trio
import zmq

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
from ..model import PeerInfo, VersionKey, as_host_array, check_model_name, check_version
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
from ..protocol.trust import Trust
from ..protocol.versions import Seal
from ..read.cast import CastSpec
from ..read.dialing import Dialer
from ..read.ports import Ports
from ..read.reader import Reader
from ..read.report import Fetched
from ..read.store import LocalVersion, Store
from ..security import Identity
from ..torch import Into
from ..transport.admission import ServerLimits
from ..transport.handshake import DataAuth
from ..transport.server import TcpServer
from .conflicts import Explainer
from .operations import Operations, operation
from .opstatus import StatusDesk, status_reply
from .retention import Retention
from .stats import INSECURE, PeerStats, Switches, chunking_text, digest_text
from .switching import describe, switch_interval
from .wanprobe import LinkProbes
from .zap import HandshakeMonitor, ZapHandler
from .zmq_trio import CurveKeys, ZmqRouter

register_all()
log = logging.getLogger("tensorhub.peer")
INTERNAL_ERRORS_KEPT = 16


class Peer:
    """A member of the mesh.  Create it with :func:`open_peer`."""

    def __init__(self, config: PeerConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Inside trio (:func:`open_peer` builds it): binds both sockets."""
        self.config = config
        dialer = Dialer(config.transports)  # fails first if a transport is missing
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
        self._data_auth = None if sec is None else \
            DataAuth(config.name, sec.identity, sec.keyring)
        self._server = TcpServer(self.store, self._count_sent, self._count_bad, ServerLimits(
            config.data_max_connections, config.data_max_connections_per_address,
            config.data_idle_timeout, config.data_frame_timeout,
            config.data_requests_per_second, config.lease_timeout,
            probe_bytes=config.wan_probe_bytes), self._data_auth, dialer.host)
        self.store.on_dropped.append(dialer.host.dropped)
        data_host, data_port = parse_hostport(config.data_listen) if config.data_listen \
            else (host, 0)
        try:
            data_port = self._server.bind(data_host, data_port)
        except BaseException:
            self._close_sockets()
            raise
        self.info = PeerInfo(config.name, self._router.endpoint, f"{data_host}:{data_port}",
                             tuple(config.labels))
        self.control = ControlPlane(self.info, config, random.Random(), trio.current_time(),
                                    time.time_ns() // 1000)
        self._changed = trio.Event()
        self._seen_changes = 0
        self._wake_ticker = trio.Event()
        self.chunking = "nothing published yet"
        """The chunk size of this peer's last publish, and why (``statistics().chunking``)."""
        self.operations = Operations(config.name)
        """The API calls in flight: closing the peer ends them with PeerClosed."""
        self._served = self._chunks_served = self._malformed = 0
        self._internal_errors = 0
        self._internal_texts: list[str] = []
        self.switches = Switches()
        """Versions rollouts and group ranks made live here (:mod:`.rollout`)."""
        self.bans = BanTable(config.ban_seconds)
        self.bad_inputs: list[str] = []
        membership = self.control.membership
        self.reader = Reader(self.info, config, self.store, self.device_rings, dialer, Ports(
            holders=self.control.holders, live=membership.live_members,
            members=lambda: {n: m.info for n, m in membership.members().items()},
            announcement=self.control.announcement,
            announce=lambda holding: self._send(self.control.put_holding(holding)),
            withdraw=self.withdraw, ask_coordinator=self._ask_coordinator,
            changed=self.wait_changed, banned=self.banned, ban=self.ban,
            spawn=self.start_background, data_auth=lambda: self._data_auth,
            measured=self.control.wan.observe))
        """The read path: every fetch here, its connections, link memory and counters
        (:mod:`tensorhub.read`)."""
        self.link_probes = LinkProbes(self.info, config, self.control, self.reader.probe,
                                      trio.current_time())
        """Probes of the links into our DC that nobody measured (:mod:`.wanprobe`)."""
        self.retention = Retention(config.name, config, self.store, self.control,
                                   self.send_to, self.withdraw, self._count_bad,
                                   lambda task: self._nursery.start_soon(task))
        self.conflicts = Explainer(  # which tensors ranks disagree on
            config.name, self.store, self.control.seal_status, self.reader.read_manifest,
            self.start_background, self.internal_error)
        self.status_desk = StatusDesk(  # status queries (tensorhub status)
            config.name, self._status_reply,
            lambda to, data: self._router.send_nowait(to, data, reply=True), self.send_to,
            membership.live_members, self._count_bad, config.max_message_bytes)
        self._group_inbox: dict[str, Callable[[GroupEnvelope], None]] = {}
        """Handlers of group messages by group name (see :meth:`group_inbox`)."""
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
        nursery.start_soon(self.link_probes.run)
        seeds = [f"tcp://{h}:{p}" for h, p in map(parse_hostport, self.config.join)]
        self._send(self.control.join(trio.current_time(), seeds))

    async def _leave(self) -> None:
        await self.operations.close(self.config.stall_timeout)
        self.reader.close()
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
            self.reader.view_changed()
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

    @contextmanager
    def group_inbox(self, group: str, handler: Callable[[GroupEnvelope], None]
                    ) -> Iterator[None]:
        """Hand group ``group``'s messages to ``handler`` meanwhile (it must not block:
        it runs in the dispatcher); LocalProtocolError if the group is open here."""
        if group in self._group_inbox:
            raise LocalProtocolError(f"group {group!r} is already open on peer "
                                     f"{self.info.name!r}")
        self._group_inbox[group] = handler
        try:
            yield
        finally:
            del self._group_inbox[group]

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
        self._check_free(key)
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
        self._check_free(key)  # a fetch or another publish of it may have begun meanwhile
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

    def _check_free(self, key: VersionKey) -> None:
        """Publishing ``key`` needs it neither held nor being fetched here."""
        if self.reader.in_flight(key):
            raise LocalProtocolError(f"{key} is being fetched here; publish it once that "
                                     "fetch returned and it was unpublished")
        if self.store.get(key) is not None:
            raise LocalProtocolError(f"{key} is already held here; unpublish it first")

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
        the sharding it was published or fetched with.  A version still being fetched
        here is not held yet: LocalProtocolError (cancel the fetch instead).

        Retention: if the version must stay readable (one of the newest sealed
        versions its model keeps, ``retain_for``, or pinned here) and this peer is the last
        complete holder of its shard, the shard is first copied to host memory this peer
        keeps serving from, until it is no longer retained; with ``retention_offload``
        off that raises :class:`RetentionError` instead and nothing changes."""
        spec = layout or WHOLE
        key = spec.key(check_model_name(model), check_version(version))
        if self.reader.in_flight(key):
            raise LocalProtocolError(f"{key} is still being fetched here; cancel that "
                                     "fetch, or unpublish it once the fetch returned")
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
        :mod:`tensorhub.read.cast`.

        Only sealed versions can be fetched (see :meth:`publish`).  ``layout`` asks for
        the slices rank ``layout.rank`` of that sharding holds (default: every tensor
        whole); they are assembled from whichever holders' slices intersect them, each
        source chunk verified against its digest before a byte of it is used.  Holders
        with the same layout and rank are read whole, without resharding.

        ``sources`` restricts the holders to read from (by peer name), e.g. to follow a
        plan; a named source that is itself still receiving is asked for every chunk and
        serves each as soon as it has verified it (pipelining).  The fetch waits up to
        ``stall_timeout`` for a named source to appear as a holder.

        One transfer per version at a time: a fetch of a version that another fetch here
        is moving waits for it and gets the arrays this peer serves, or a copy in its
        own ``into=`` (``FetchReport.joined``; see :mod:`tensorhub.read.reader`).  A
        version held here complete is not moved again either."""
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
        allowed = frozenset(sources) if sources is not None else None
        sealed = functools.partial(self._sealed, model, resolved, wait=allowed is not None)
        return await self.reader.fetch(spec.key(model, resolved), sealed, spec, into,
                                       allowed, cast)

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
        return await self._ask_coordinator(
            VersionKey(check_model_name(model), check_version(version)), size, chunks)

    async def _ask_coordinator(self, key: VersionKey, size: int, chunks: int
                               ) -> CoordinatorAnswer:
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
        trust = self._trust()
        trust.keyring.replace(members, publishers)
        self.control.keyring_changed()
        self._after_change()

    def rotate_identity(self, identity: Identity) -> None:
        """Sign and connect with ``identity`` from now on.  Its key must already be in
        the keyring for this peer's name (add it everywhere first, then switch, then
        remove the old one).  Our membership claim, our reference entry and the
        announcements we published are re-signed at once."""
        trust = self._trust()
        if identity.public not in trust.keyring.keys_of(self.info.name):
            raise LocalProtocolError(f"the new key of {self.info.name} is not in the "
                                     "keyring yet: add it (update_keyring) before "
                                     "switching to it")
        trust.rotate(identity)
        if self._data_auth is not None:  # new data connections prove the new key
            self._data_auth = replace(self._data_auth, identity=identity)
            self._server.auth = self._data_auth
            self.reader.identity_changed()  # and so do reads from now on
        self._router.set_client_keys(*identity.curve_keys())
        for local in self.store.versions.values():
            if local.publisher == self.info.name and not local.derived:
                signed = self.control.sign_announcement(local.holding())
                local.announced = (signed.publisher_gen, signed.publisher_sig)
        self._send(self.control.renew(trio.current_time()))
        self._identity = identity

    def _trust(self) -> Trust:
        trust = self.control.trust
        if trust is None:
            raise LocalProtocolError("this peer runs without keys (PeerConfig.security)")
        return trust

    @property
    def identity(self) -> Identity | None:
        """This peer's current identity (it changes with :meth:`rotate_identity`;
        ``config.security.identity`` is the one it started with); None if insecure."""
        return self._identity

    # -- introspection -------------------------------------------------------------------

    def members(self) -> dict[str, tuple[PeerInfo, str]]:
        return {n: (m.info, m.status) for n, m in self.control.membership.members().items()}

    def _status_reply(self, nonce: int) -> StatusReply:
        return status_reply(nonce, self.info.name, self.store, self.reader.progress(),
                            self.reader.statistics(), self._served,
                            self.control.membership.statistics().suspicions)

    def statistics(self) -> PeerStats:
        """A snapshot of what this peer did and sees (see :class:`PeerStats`)."""
        rs, reads, dialer = self._router.statistics(), self.reader.statistics(), \
            self.reader.dialer
        trust = self.control.trust
        refused = dict(trust.refused) if trust is not None else {}
        if self._zap is not None and self._monitor is not None:
            refused["handshake"] = self._monitor.failed  # no CURVE, wrong cluster key, ...
            refused["not a member"] = self._zap.refused  # ... or a key not in the keyring
        if self._sender_mismatch:
            refused["sender name"] = self._sender_mismatch
        shm_ok, shm_why = dialer.found.get("shm", (False, "not enabled"))
        served = self._server.delta
        return PeerStats(
            name=self.info.name, control=self.info.control, data=self.info.data,
            members={n: m.status for n, m in self.control.membership.members().items()},
            holdings={str(k): ("complete" if v.complete else
                               f"{v.num_verified}/{v.manifest.num_chunks} chunks")
                      for k, v in self.store.versions.items() if not v.hidden},
            bytes_served=self._served, chunks_served=self._chunks_served,
            bytes_fetched=reads.bytes_fetched,
            bytes_fetched_by_source=reads.bytes_fetched_by_source,
            bytes_by_transport=reads.bytes_by_transport, fetches=reads.fetches,
            integrity_failures=reads.integrity_failures, malformed_dropped=self._malformed,
            gossip_dropped=rs.dropped_inbound + rs.dropped_outbound,
            control_received=rs.received, control_sent=rs.sent,
            internal_errors=self._internal_errors,
            internal_error_texts=tuple(self._internal_texts),
            shm="available" if shm_ok else f"unavailable: {shm_why}",
            shm_fallbacks={h: r["shm"] for h, r in dialer.refusals.items() if "shm" in r},
            transports=dialer.describe(), transport_chosen=dict(dialer.chosen),
            transport_refusals={h: dict(r) for h, r in dialer.refusals.items() if r},
            tcp_local_digests=dict(dialer.local_digests),
            registrations={name: asdict(st) for name, st in
                           dialer.host.statistics().items()},
            security=INSECURE if trust is None else (
                f"keys: {len(trust.keyring.members())} members, keyring generation "
                f"{trust.keyring.generation}; control socket CURVE with a member "
                "allow-list"),
            refused=refused, digest=digest_text(self.config.digest_algo),
            bans={n: f"{why} ({left:.0f} s left)"
                  for n, (left, why) in self.bans.active(trio.current_time()).items()},
            ban_notices=dict(self.bans.notices), reports=reads.reports,
            data_server=self._server.statistics(), switches=self.switches.count,
            switch_seconds=self.switches.seconds, casts=reads.casts,
            cast_seconds=reads.cast_seconds,
            delta={**reads.delta, "served_chunks": served.chunks,
                   "served_raw_chunks": served.raw_chunks,
                   "served_chunk_bytes": served.chunk_bytes,
                   "served_delta_bytes": served.delta_bytes,
                   "served_encode_seconds": served.encode_seconds},
            switch_interval=describe(self.config.switch_interval),
            chunking=chunking_text(self.config, self.chunking),
            fetches_joined=reads.fetches_joined, fetches_in_flight=reads.in_flight,
            control_waiting=rs.inbound_waiting, control_dropped=rs.dropped_inbound,
            wan={"links": self.control.wan.table(), "probes": self.link_probes.describe(),
                 "probed": dict(self.link_probes.notes),
                 "implausible_entries": self.control.implausible_entries})


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
