"""One frozen configuration object, with presets and a reason for every default.

``PeerConfig.local()`` has fast timers for tests and the demo on one machine,
``PeerConfig.datacenter()`` suits a LAN fleet, ``PeerConfig.cross_dc()`` tolerates
long round trips.  Every value is validated when the object is built.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from .bounds import MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS, MAX_PEER_NAME
from .errors import ConfigError
from .limits import MAX_MANIFEST_BYTES, MAX_MODEL_NAME, ManifestLimits
from .links import LinkSpec, check_links
from .manifest.digests import DIGEST_ALGOS
from .security import Security

TRANSPORTS = ("rdma", "cuda-ipc", "shm", "tcp", "rdma-standin", "cuda-ipc-standin")
"""Every transport ``PeerConfig.transports`` may name (:mod:`tensorhub.transport.dial`)."""

MAX_RETAIN_RULES = 1024
"""``PeerConfig.retain`` rules (each model's lookup tries them in order)."""

DEFAULT_CHUNK_SIZE = 4 << 20
"""The smallest automatic chunk size (:mod:`tensorhub.protocol.sizing`), and what
benchmarks force to compare with earlier runs."""


def parse_hostport(text: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; raises :class:`ConfigError` on bad input."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class PeerConfig:
    name: str
    """Unique name of this peer in the mesh."""

    listen: str = "127.0.0.1:0"
    """Control-plane (ZeroMQ ROUTER) address. Port 0 picks a free port."""

    data_listen: str | None = None
    """Data-plane TCP address; ``None`` uses the control host with a free port."""

    join: tuple[str, ...] = ()
    """Seed peers' control addresses (``host:port``) to join through."""

    labels: tuple[tuple[str, str], ...] = ()
    """Topology labels (``dc``, ``rack``, ``host``, free-form)."""

    # -- control plane ----------------------------------------------------------
    gossip_interval: float = 1.0
    """Seconds between gossip rounds. Lower spreads news faster, costs bandwidth."""

    gossip_fanout: int = 3
    """Peers contacted per gossip round. log-ish spread; 3 covers 1,000 peers in ~7 rounds."""

    probe_interval: float = 1.0
    """SWIM: seconds between probes of one member."""

    probe_timeout: float = 0.5
    """SWIM: wait for a direct ack before asking others to probe indirectly."""

    indirect_checks: int = 3
    """SWIM: members asked to probe a silent member on our behalf."""

    suspicion_mult: float = 4.0
    """Suspicion timeout = mult * log10(max(N, 10)) * probe_interval (memberlist's rule)."""

    suspicion_max_mult: float = 6.0
    """Upper bound of the suspicion timeout, as a multiple of its minimum (Lifeguard)."""

    retransmit_mult: int = 4
    """Each update is piggybacked about mult * log(N+1) times."""

    push_pull_interval: float = 30.0
    """Full state exchange with one random member; repairs what gossip missed."""

    dead_reap_after: float = 60.0
    """Seconds a dead/left tombstone is kept before it is forgotten."""

    max_message_bytes: int = 4 << 20
    """Largest control message accepted; larger ones are dropped and counted."""

    gossip_queue: int = 1024
    """Inbound/outbound control messages buffered; excess gossip is dropped and counted."""

    control_rate: float = 1000.0
    """Control messages a second one sender may have handled (bursts of ``gossip_queue``
    / 8); beyond that its messages are dropped and counted.  Peers send tens a second:
    this only bounds what a flooding sender costs us."""

    # -- data plane -------------------------------------------------------------
    chunk_size: int | None = None
    """Bytes per chunk of what this peer publishes: the unit of verification, so of
    store-and-forward.  ``None`` (the default) lets the system choose from each
    version's size and the live peers it knows: about 64 chunks a version and per level
    of the relay tree that many peers can form, a power of two from 4 to 64 MiB
    (:func:`tensorhub.protocol.sizing.choose_chunk_size`; ``statistics().chunking``
    and each fetch report say what was chosen).  Each level of a transfer tree lags its
    parent by one chunk-time; per-chunk costs grow below ~4 MiB.  Measured (8 emulated
    hosts, 400 Mbit, 256 MiB): 2/4/8 MiB -> 1.28/1.16/1.30x bound."""

    digest_algo: str = "blake3"
    """Per-chunk digest of what this peer publishes (see ``digests.DIGEST_ALGOS``).
    ``blake3`` is cryptographic: a holder cannot serve other bytes that pass, so readers
    may take chunks from any holder.  Measured here, 1 GiB in 4 MiB chunks: blake3 6 GB/s
    per core (publish hashes with every core: 11 GB/s on 2), xxh3-128 16, sha256 1.4; all
    run off the event loop.  ``xxh3-128`` is for a trusted fleet only (every holder
    honest): its digests can be forged in milliseconds; ``statistics()`` says so."""

    ban_seconds: float = 300.0
    """A holder that served a chunk failing its digest is not read from again, by any
    fetch of this peer, for this long (and other peers are told, as a hint).  Longer
    protects better against a lying holder; shorter forgives a flaky one sooner."""

    max_tensors: int = 1 << 18
    """Most tensors a manifest may list (262,144), checked by publish and by readers
    before they allocate (the reason for the default: ``limits.ManifestLimits``).  A
    publisher checks its own value: keep it equal across the mesh."""

    max_chunks: int = 1 << 22
    """Most chunks a manifest may list (16 TiB in 4 MiB chunks)."""

    max_manifest_bytes: int = MAX_MANIFEST_BYTES
    """Largest encoded manifest published or accepted (at most 64 MiB, what the data
    plane carries)."""

    fetch_window: int = 4
    """Streams per fetch (one connection each).  Each keeps a window of chunks requested
    ahead of what has landed, sized from the bandwidth-delay product measured on its
    source (at least four chunks), so one stream fills a link at any round trip; several
    spread a fetch over several holders and its checks over several cores."""

    max_inflight_bytes: int = 512 << 20
    """Bytes of chunk requests in flight per fetch, over all its streams: the cap on the
    measured windows (a stream's share is this over the number of streams) and on the
    number of streams (the floor of a window each, four chunks).  Costs the reader nothing -- chunks
    land in their destination -- and the holder only its socket buffers; 512 MiB covers
    a 40 Gbit link at 100 ms.  Raise it for faster long links."""

    nic_bps: float = 12.5e9
    """NIC bandwidth (bytes/s) assumed for peers without a ``nic_bps`` label: 100 Gbit.
    The planner's fan-out limits follow from it; label peers whose NIC differs."""

    links: tuple[LinkSpec, ...] = ()
    """Links between DCs the operator declares (:mod:`tensorhub.links`; the CLI's
    ``--links FILE``): where this peer's planner starts for a DC pair nobody measured
    yet.  Measured and gossiped estimates replace them (:mod:`tensorhub.protocol.wan`)."""

    wan_probe_bytes: int = 8 << 20
    """Link probes (:mod:`tensorhub.protocol.probing`): the most bytes this peer's data
    server sends for one probe request, and what this peer asks for on each of a probe's
    parallel streams.  Where nobody measured the link from another DC into ours, one
    peer of our DC times a read of that many bytes per stream from one peer of that DC,
    so the planner starts from a measurement instead of a guess.  8 MiB a stream gets a
    300 Mbit, 150 ms link past TCP slow start for the half of the probe that is timed;
    larger is more exact on faster, longer links and costs the link more.  0 disables
    probes, asked and served."""

    wan_probe_after: float = 5.0
    """Seconds after joining before this peer probes links: membership has settled by
    then, so each DC's prober (its smallest-named live member) is agreed on."""

    wan_probe_every: float = 600.0
    """A link is probed at most once in this many seconds (a failed probe waits as long);
    only links nobody has measured are probed at all."""

    planning: bool = True
    """Ask the version's coordinator for a plan (who pulls what from whom). Off: every
    fetcher picks holders itself (nearest, least loaded)."""

    retain_latest: int = 1
    """Retention: the newest ``retain_latest`` complete versions of every model (unless
    :attr:`retain` says otherwise for it; and the versions pinned at this peer) must
    stay readable.  When this peer is the last complete holder of such a version,
    ``unpublish`` first copies it to host memory."""

    retain: tuple[tuple[str, int], ...] = ()
    """Retention per model: ``(pattern, n)`` pairs; the first whose ``fnmatch`` pattern
    matches a model's name (``"lora/*"``, or the name itself) sets how many of its
    newest versions stay readable, instead of ``retain_latest``.  Many small models
    (adapters) each keep what they need: ``(("lora/*", 2),)``; a trainer that
    unpublishes each version once it publishes the next then holds one version of each
    and its peers' host copies hold the rest.  Keep it equal across the mesh, like
    ``retain_latest``: each peer applies its own to what it unpublishes."""

    retention_offload: bool = True
    """Off: ``unpublish`` of the last copy of a retained version raises RetentionError
    instead of copying it (for hosts without memory to spare)."""

    delta: str = "auto"
    """Chunk deltas against an older version of the model held here (see
    :mod:`tensorhub.read.deltas`).  ``"auto"`` (the default): ask a holder of both
    versions for what changed where encoding and applying beat the link measured to it
    (so across DCs and on slow links, not on a fast LAN or loopback), and copy chunks
    that did not change from the older version instead of fetching them; ``"always"``:
    deltas whatever the link; ``"off"``: every chunk in full.  Costs the holder CPU
    (about 1 GB/s of chunk per core at 1% changed) and saves the link what did not
    change."""

    transports: tuple[str, ...] = ("shm", "tcp")
    """Data-plane transports in order of preference (the dial; see
    ``docs/transports.md``): ``rdma`` (RDMA READ, pyverbs), ``cuda-ipc`` (device to
    device on one host, cupy), ``shm`` (one copy from another process's memory on one
    host), ``tcp`` (everywhere); ``rdma-standin`` and ``cuda-ipc-standin`` are in-process
    stand-ins for tests.  Same-host transports are tried only with a holder of the same
    ``host`` label.  Each is detected at start: ``rdma`` or ``cuda-ipc`` named and not
    usable here fails the start with the reason (no silent fallback); a holder that
    refuses one is read over the next, and the reason shows in ``statistics()``.
    Without ``tcp`` a holder no listed transport reaches is not read from."""

    switch_interval: float | None = 0.0005
    """The interpreter's thread switch interval, in seconds, while peers run in this
    process, where it still has Python's default (5 ms); put back when the last peer
    closes.  The data plane's threads give up the GIL for each system call and take it
    back after, each time waiting up to this long while another thread runs Python (see
    :mod:`tensorhub.peer.switching`).  None leaves it alone."""

    stall_timeout: float = 10.0
    """A source that makes no progress for this long is abandoned and its chunks re-sourced."""

    connect_timeout: float = 5.0
    """Seconds to wait for a data-plane connection."""

    data_max_connections: int = 256
    """Data connections a holder keeps open at once; more are closed at once (counted in
    ``statistics().data_server``).  Each costs two descriptors: keep it well under the
    process's descriptor limit (1,024 by default).  A fetch opens one per holder it
    reads from (``fetch_window`` at most) and keeps them for its next reads (10 s at
    most); at a cap, the connection that has waited longest for a request (over a
    second) is closed to make room.  Raise it for hundreds of concurrent readers."""

    data_max_connections_per_address: int = 64
    """Data connections from one IP address (or one local user) at once: one host
    cannot take every slot.  Every process of a host shares its address -- raise it
    for hosts running many readers (8 GPUs x ``fetch_window`` = 32 by default)."""

    data_idle_timeout: float = 60.0
    """A data connection that sends no request for this long is closed.  Readers
    reconnect on demand, so lower only costs a reconnect; higher lets idle clients hold
    slots longer."""

    data_frame_timeout: float = 10.0
    """A request frame must arrive whole within this long once its first byte has, else
    the connection is closed: a client that declares a frame and stalls holds a slot
    (and what it sent) no longer than this."""

    data_requests_per_second: float = 20000.0
    """Requests one data connection may make per second (bursts of one second's worth);
    faster ones are delayed, not refused.  4 MiB chunks at this rate are 80 GB/s, so
    only a flood of small requests ever waits."""

    lease_timeout: float = 30.0
    """How long a reader may hold a holder's memory without answering: a same-host
    chunk lease until its ``ShmDone``, a revoked version lease until its ``ShmRelease``,
    one TCP chunk send.  Past it the holder revokes the lease and closes the
    connection, so ``unpublish`` returns within about this long even when a reader
    hangs.  Lower bounds unpublish tighter but cuts off readers that are slow (a 1 GiB
    chunk over 1 Gbit/s takes ~9 s)."""

    # -- security -----------------------------------------------------------------
    security: Security | None = field(default=None, compare=False, hash=False)
    """This peer's identity, the cluster key and the keyring (``tensorhub keygen``,
    ``security.load``).  With it only members join, gossip and publish, and every claim
    is signed by its origin (an Ed25519 signature per change: ~50 us to check).
    ``None`` runs *insecure*: any process that reaches the ports can join, read and
    publish -- allowed only on loopback addresses unless ``allow_insecure`` is set."""

    allow_insecure: bool = False
    """Run without ``security`` on non-loopback addresses (a trusted, isolated network:
    benchmarks in network namespaces).  Said loudly in ``statistics()`` and the log."""

    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """Free-form options for experiments; never read by the core."""

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_PEER_NAME or any(c.isspace() for c in self.name):
            raise ConfigError(f"peer name must be 1-{MAX_PEER_NAME} non-space chars, "
                              f"got {self.name!r}")
        parse_hostport(self.listen)
        if self.data_listen is not None:
            parse_hostport(self.data_listen)
        for seed in self.join:
            parse_hostport(seed)
        if len(self.labels) > MAX_LABELS:
            raise ConfigError(f"at most {MAX_LABELS} labels")
        if not isinstance(self.labels, tuple):  # a dict would pass below as 2-char keys
            raise ConfigError(f"labels must be a tuple of (key, value) pairs, got a "
                              f"{type(self.labels).__name__} (tuple(d.items()) for a dict)")
        for item in self.labels:
            if not isinstance(item, tuple | list) or len(item) != 2 \
                    or not all(isinstance(s, str) and s for s in item) \
                    or len(item[0]) > MAX_LABEL_KEY or len(item[1]) > MAX_LABEL_VALUE:
                raise ConfigError(f"labels must be (key, value) pairs of non-empty strings of "
                                  f"<= {MAX_LABEL_KEY} and <= {MAX_LABEL_VALUE} chars, "
                                  f"got {item!r}")
        positive = (
            "gossip_interval", "probe_interval", "probe_timeout", "suspicion_mult",
            "push_pull_interval", "dead_reap_after", "stall_timeout", "connect_timeout",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if self.probe_timeout >= self.probe_interval:
            raise ConfigError("probe_timeout must be shorter than probe_interval")
        if self.suspicion_max_mult < 1:
            raise ConfigError("suspicion_max_mult must be >= 1")
        for name in ("gossip_fanout", "indirect_checks", "retransmit_mult", "fetch_window"):
            if not 1 <= getattr(self, name) <= 64:
                raise ConfigError(f"{name} must be in [1, 64]")
        if self.chunk_size is not None and not 4096 <= self.chunk_size <= 1 << 30:
            raise ConfigError("chunk_size must be None (automatic) or in [4 KiB, 1 GiB]")
        if not 64 << 10 <= self.max_message_bytes <= 1 << 30:
            raise ConfigError("max_message_bytes must be in [64 KiB, 1 GiB]")
        if self.gossip_queue < 16:
            raise ConfigError("gossip_queue must be >= 16")
        if not self.control_rate > 0:
            raise ConfigError("control_rate must be > 0")
        if not 0 <= self.retain_latest <= 1 << 20:
            raise ConfigError("retain_latest must be in [0, 2**20]")
        if len(self.retain) > MAX_RETAIN_RULES or not all(
                isinstance(rule, tuple) and len(rule) == 2
                and isinstance(rule[0], str) and 0 < len(rule[0]) <= MAX_MODEL_NAME
                and type(rule[1]) is int and 0 <= rule[1] <= 1 << 20
                for rule in self.retain):
            raise ConfigError(f"retain must be at most {MAX_RETAIN_RULES} (pattern, n) pairs: "
                              f"a pattern of 1-{MAX_MODEL_NAME} chars, n in [0, 2**20]")
        if self.switch_interval is not None and not 1e-5 <= self.switch_interval <= 0.1:
            raise ConfigError("switch_interval must be None or in [1e-5, 0.1] seconds")
        if self.delta not in ("off", "auto", "always"):
            raise ConfigError(f"delta must be 'off', 'auto' or 'always', got {self.delta!r}")
        if not self.nic_bps > 0:
            raise ConfigError("nic_bps must be > 0")
        check_links(self.links)
        if self.wan_probe_bytes != 0 and not 1 << 20 <= self.wan_probe_bytes <= 1 << 30:
            raise ConfigError("wan_probe_bytes must be 0 (no probes) or in [1 MiB, 1 GiB]")
        if not 0 <= self.wan_probe_after < float("inf"):
            raise ConfigError("wan_probe_after must be >= 0 and finite")
        if not 0 < self.wan_probe_every < float("inf"):
            raise ConfigError("wan_probe_every must be > 0 and finite")
        if self.max_inflight_bytes < 4096:
            raise ConfigError("max_inflight_bytes must be >= 4096")
        if not 1 <= self.data_max_connections_per_address <= self.data_max_connections \
                <= 1 << 20:
            raise ConfigError("data connection caps must satisfy 1 <= "
                              "data_max_connections_per_address <= data_max_connections <= 2**20")
        for name in ("data_idle_timeout", "data_frame_timeout", "data_requests_per_second",
                     "lease_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be > 0 and finite")
        if not self.transports or not set(self.transports) <= set(TRANSPORTS) \
                or len(set(self.transports)) != len(self.transports):
            raise ConfigError("transports must name, once each and in order of "
                              f"preference, some of {', '.join(TRANSPORTS)}")
        if self.digest_algo not in DIGEST_ALGOS:
            raise ConfigError(f"digest_algo must be one of {', '.join(DIGEST_ALGOS)}")
        if self.security is not None and not isinstance(self.security, Security):
            raise ConfigError("security must be a tensorhub.security.Security (or None)")
        if self.security is None and not self.allow_insecure:
            hosts = [parse_hostport(self.listen)[0]]
            if self.data_listen is not None:
                hosts.append(parse_hostport(self.data_listen)[0])
            wide = [h for h in hosts if not is_loopback(h)]
            if wide:
                raise ConfigError(
                    f"peer {self.name!r} listens on {wide[0]} without keys: anyone who can "
                    "reach it could join, read and publish.  Make keys with `tensorhub "
                    "keygen DIR --peer NAME ...` and pass them (`--keys DIR`, or "
                    "PeerConfig(security=tensorhub.security.load(DIR, NAME))), or opt out "
                    "by name with allow_insecure=True (`--insecure`)")
        if not 0 < self.ban_seconds <= 1e6:
            raise ConfigError("ban_seconds must be in (0, 1e6]")
        ManifestLimits(self.max_tensors, self.max_chunks, self.max_manifest_bytes)  # checks

    def retain_for(self, model: str) -> int:
        """How many of ``model``'s newest versions retention keeps readable
        (:attr:`retain`, else :attr:`retain_latest`)."""
        for pattern, n in self.retain:
            if fnmatchcase(model, pattern):
                return n
        return self.retain_latest

    @property
    def manifest_limits(self) -> ManifestLimits:
        """The caps on manifests, published or received."""
        return ManifestLimits(self.max_tensors, self.max_chunks, self.max_manifest_bytes)

    def replace(self, **changes: Any) -> PeerConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def local(cls, name: str, **overrides: Any) -> PeerConfig:
        """Fast timers: peers on one machine, tests and the demo. Loopback RTT is ~50 us."""
        base: dict[str, Any] = dict(
            gossip_interval=0.1, probe_interval=0.2, probe_timeout=0.1,
            push_pull_interval=2.0, dead_reap_after=10.0, stall_timeout=3.0,
            connect_timeout=2.0, lease_timeout=5.0, wan_probe_after=1.0,
        )
        base.update(overrides)
        return cls(name=name, **base)

    @classmethod
    def datacenter(cls, name: str, **overrides: Any) -> PeerConfig:
        """The defaults: LAN round trips of well under a millisecond, thousands of peers."""
        return cls(name=name, **overrides)

    @classmethod
    def cross_dc(cls, name: str, **overrides: Any) -> PeerConfig:
        """Round trips of tens of ms between sites: slower probes, longer suspicion."""
        base: dict[str, Any] = dict(
            gossip_interval=2.0, probe_interval=2.0, probe_timeout=1.0,
            suspicion_mult=6.0, push_pull_interval=60.0, dead_reap_after=300.0,
            stall_timeout=30.0, connect_timeout=15.0,
        )
        base.update(overrides)
        return cls(name=name, **base)


def parse_labels(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` strings (the CLI's ``--label``) as ``PeerConfig.labels`` pairs."""
    out = []
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k or not v:
            raise ConfigError(f"--label expects KEY=VALUE, got {item!r}")
        out.append((k, v))
    return tuple(out)
