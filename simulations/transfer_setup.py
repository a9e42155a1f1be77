"""What a transfer simulation is made of: its setup (hosts, readers, the network, the
actions), its result, and the state of readers, streams and connections that
:class:`simulations.transfer_engine.Sim` moves (see that module for the model)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tensorhub.config import PeerConfig
from tensorhub.manifest.manifest import Manifest
from tensorhub.model import TensorSpec, VersionKey
from tensorhub.protocol.reading import PlanFollow
from tensorhub.protocol.topology import fluid_bound
from tensorhub.protocol.transfer import Stream, TransferSession

from .flows import Flow

KEY = VersionKey("sim", 1)
MAX_EVENTS_PER_CHUNK = 2000
"""Events per reader and chunk past which a run is taken to be stuck (a few tens are
normal)."""


@dataclass(frozen=True)
class Host:
    name: str
    dc: str
    up: float
    """NIC upload rate, bytes/s."""
    down: float


@dataclass(frozen=True)
class Setup:
    """One fan-out: who publishes, who reads, the network and the actions."""

    hosts: tuple[Host, ...]
    publisher: str
    readers: tuple[str, ...]
    size: int
    chunk_size: int
    plan: bool = True
    incremental_plan: bool = False
    """Plan the readers one at a time, as the coordinator does: each registers when it
    starts (``Planner.add_fetcher``); False: one plan with every reader as a fetcher."""
    reask: bool = True
    """With ``incremental_plan``: each reader asks again while it runs, as the shell
    does (:class:`~tensorhub.protocol.reading.PlanFollow`), and takes a newer plan."""
    coordinator: str | None = None
    """The host that coordinates the version (answers take a round trip to it); None:
    the publisher's."""
    rebuild: bool = True
    """The planner may make the plan afresh after a join (``PlannerConfig``'s
    ``rebuild_max_peers`` at its default; False: 0, joins never move anyone)."""
    upstream: dict[str, frozenset[str]] = field(default_factory=dict)
    """Named sources per reader (``fetch(allowed=...)``): they read only from these."""
    rtt: float = 0.0002
    """Round trip inside a DC, seconds."""
    wan: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    """``(dc, dc)`` -> (rate bytes/s each way, round trip s); unlisted pairs: no limit."""
    gossip_delay: float = 0.01
    detect_delay: float = 1.0
    start_jitter: float = 0.005
    """Readers start at uniform random times in ``[0, start_jitter)``."""
    kills: tuple[tuple[float, str], ...] = ()
    socket_window: int = 0
    """Bytes one connection keeps in flight (its rate is at most this / rtt); 0: none."""
    seed: int = 0
    config: PeerConfig = field(default_factory=lambda: PeerConfig("sim"))


@dataclass
class Result:
    done: dict[str, float]
    """Reader -> when its last chunk landed (readers that completed)."""
    failed: dict[str, str]
    end: float
    """When the last live reader completed."""
    wan_bytes: float
    bytes_by_source: dict[str, dict[str, int]]
    resourced: int
    events: int
    trace: str
    """sha256 over (time, reader, chunk, source) of every landing, in order."""
    bound_s: float | None = None
    """The planner's fluid bound, when planning was on."""
    asks: int = 0
    """Asks the coordinator answered (with ``incremental_plan``)."""
    replans: int = 0
    """Newer plans readers took while they ran that moved some of their chunks."""


def manifest_of(size: int, chunk_size: int) -> Manifest:
    """A manifest of one ``size``-byte tensor (digests are not checked here)."""
    chunks = -(-size // chunk_size)
    return Manifest(KEY.model, KEY.version, (TensorSpec("w", "|u1", (size,), 0),),
                    chunk_size, "xxh3-128", (bytes(16),) * chunks)


class Conn:
    """One reader worker's connection to one holder, as both ends see it."""

    __slots__ = (
        "alive",
        "busy",
        "flow",
        "last_end",
        "min_rtt",
        "queue",
        "reader",
        "source",
        "stream",
        "waited_out",
    )

    def __init__(self, reader: Reader, source: str) -> None:
        self.reader, self.source = reader, source
        self.queue: deque[tuple[int, Run]] = deque()
        """At the holder: chunks asked for, in order."""
        self.busy = False
        self.flow: Flow | None = None
        self.stream: SimStream | None = None
        self.alive = True
        self.min_rtt: float | None = None
        self.last_end: float | None = None
        self.waited_out: Run | None = None


@dataclass(eq=False)
class Run:
    sent_at: float
    alone: bool
    first: int


@dataclass(eq=False)
class SimStream:
    """The shell's side of one stream."""

    s: Stream
    conn: Conn
    worker: int
    sizes: dict[int, int] = field(default_factory=dict)
    ahead: int = 0
    deadline: float = 0.0
    over: bool = False


class Reader:
    def __init__(self, name: str, session: TransferSession) -> None:
        self.name, self.session = name, session
        self.conns: list[dict[str, Conn]] = [{} for _ in range(session.window)]
        self.busy: list[bool] = [False] * session.window
        self.waiting: dict[int, None] = {}
        """Workers waiting for news."""
        self.timers: list[float | None] = [None] * session.window
        """When each worker's wake-up timer fires (the earliest pending one)."""
        self.chained = False
        """A wake-up of the waiting workers is scheduled."""
        self.streams: list[SimStream] = []
        self.dead = False
        self.follow: PlanFollow | None = None
        """The plan it follows and when it asks next (None: no answer yet)."""
        self.replans = 0
        """Newer plans it took after its first that moved some of its chunks."""


def fluid_bound_of(setup: Setup) -> float:
    """No schedule beats this (as :func:`~tensorhub.protocol.topology.fluid_bound`):
    the publisher's uplink, the slowest reader's downlink, the sum of uplinks, and,
    for each DC without the publisher, the WAN links into it."""
    hosts = {h.name: h for h in setup.hosts}
    pub, readers = hosts[setup.publisher], [hosts[r] for r in setup.readers]
    bound = fluid_bound(setup.size, pub.up, min(h.down for h in readers),
                        [h.up for h in readers])
    for dc in sorted({h.dc for h in readers} - {pub.dc}):
        into = sum(rate for (a, b), (rate, _) in setup.wan.items() if b == dc and a != dc)
        if into > 0:
            bound = max(bound, setup.size / into)
    return bound

