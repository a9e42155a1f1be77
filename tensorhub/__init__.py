"""TensorHub: reference-oriented storage for LLM weights.

A versioned weight store (``publish``, ``fetch``, ``latest``) that keeps no copy of its
own: peers hold the bytes in their own buffers, the mesh tracks references, and every
reader becomes a source.
"""

from .config import PeerConfig
from .device.landing import ThroughRing
from .device.ring import StagingRing
from .errors import (
    ConfigError,
    ConsistencyError,
    IntegrityError,
    LocalProtocolError,
    PeerClosed,
    RemoteProtocolError,
    RetentionError,
    TensorHubError,
    TransportError,
    VersionUnavailable,
)
from .integrations.blocking import BlockingPeer
from .manifest.manifest import Manifest
from .model import PeerInfo, TensorSpec, VersionKey
from .peer.group import Group, GroupStats, GroupSwitchError, open_group
from .peer.node import Peer, open_peer
from .peer.rollout import Committed, Rollout, Staged
from .peer.stats import PeerStats
from .protocol.groups import GroupConfig
from .protocol.sharding import Sharding
from .read.report import Fetched, FetchReport
from .transport.samehost.memory_files import shared_empty

__version__ = "0.1.0"

__all__ = [
    "BlockingPeer",
    "Committed",
    "ConfigError",
    "ConsistencyError",
    "FetchReport",
    "Fetched",
    "Group",
    "GroupConfig",
    "GroupStats",
    "GroupSwitchError",
    "IntegrityError",
    "LocalProtocolError",
    "Manifest",
    "Peer",
    "PeerClosed",
    "PeerConfig",
    "PeerInfo",
    "PeerStats",
    "RemoteProtocolError",
    "RetentionError",
    "Rollout",
    "Sharding",
    "Staged",
    "StagingRing",
    "TensorHubError",
    "TensorSpec",
    "ThroughRing",
    "TransportError",
    "VersionKey",
    "VersionUnavailable",
    "__version__",
    "open_group",
    "open_peer",
    "shared_empty",
]
