"""TensorHub: reference-oriented storage for LLM weights.

A versioned weight store (``publish``, ``fetch``, ``latest``) that keeps no copy of its
own: peers hold the bytes in their own buffers, the mesh tracks references, and every
reader becomes a source.
"""

from .api import BlockingPeer
from .config import PeerConfig
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
from .model import Manifest, PeerInfo, TensorSpec, VersionKey
from .peer.fetcher import FetchReport
from .peer.node import Fetched, Peer, PeerStats, open_peer
from .protocol.sharding import Sharding

__version__ = "0.1.0"

__all__ = [
    "BlockingPeer",
    "ConfigError",
    "ConsistencyError",
    "FetchReport",
    "Fetched",
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
    "Sharding",
    "TensorHubError",
    "TensorSpec",
    "TransportError",
    "VersionKey",
    "VersionUnavailable",
    "__version__",
    "open_peer",
]
