"""Ray: one TensorHub peer per Ray actor, labelled from where Ray placed it.

An actor class that inherits :class:`TensorHubActor` gains remote methods to start,
describe and stop its own peer; its code uses ``self.hub``, a
:class:`~tensorhub.integrations.blocking.BlockingPeer` (``publish``, ``fetch``,
``wait_for_version``...).
The driver starts the first actor's peer, which returns its address, and hands that
address to the others as their seed::

    seed = ray.get(trainer.start_peer.remote())
    ray.get([r.start_peer.remote(seeds=[seed]) for r in rollouts])

Labels come from the placement (:func:`labels_from_placement`): the Ray node's IP is
the ``host`` (peers on one machine read each other's memory directly), its id is
``ray-node``, ``dc`` and ``rack`` come from the node's labels (``ray start --labels``)
or from custom resources named ``dc:NAME`` / ``rack:NAME``, and the GPUs Ray assigned
to the actor are ``gpu``.  Transfer plans prefer a parent on the same host, then rack,
then DC (docs/concepts.md).

Ray is imported only by the functions that need it; ``import tensorhub`` never does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import security
from ..config import PeerConfig
from ..errors import LocalProtocolError
from .blocking import BlockingPeer

if TYPE_CHECKING:
    from types import ModuleType

TOPOLOGY_KEYS = ("dc", "rack")
"""Label keys read from Ray node labels, or from custom resources ``KEY:VALUE``."""

PRESETS = {"local": PeerConfig.local, "datacenter": PeerConfig.datacenter,
           "cross_dc": PeerConfig.cross_dc}


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise LocalProtocolError("this needs Ray: pip install 'tensorhub[ray]'") from None
    if not ray.is_initialized():
        raise LocalProtocolError("Ray is not initialized: call ray.init() first, or start "
                                 "the peer inside a Ray actor or task")
    return ray


def placement_labels(*, node_ip: str, node_id: str, node_labels: Mapping[str, str],
                     node_resources: Mapping[str, float], assigned: Mapping[str, float],
                     gpus: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """The labels of a peer placed as described (the pure rule behind
    :func:`labels_from_placement`).

    For ``dc`` and ``rack``: a node label of that key wins; else a custom resource
    ``KEY:VALUE`` assigned to this actor; else the node's, if it has exactly one such
    resource (a node offering several, an emulated cluster on one machine, says
    nothing about where an actor that asked for none of them runs).
    """
    labels = [("host", node_ip), ("ray-node", node_id)]
    for key in TOPOLOGY_KEYS:
        value = node_labels.get(key)
        if value is None:
            mine = _values(key, assigned)
            offered = _values(key, node_resources)
            value = mine[0] if len(mine) == 1 else offered[0] if len(offered) == 1 else None
        if value:
            labels.append((key, value))
    if gpus:
        labels.append(("gpu", ",".join(gpus)))
    return tuple(labels)


def _values(key: str, resources: Mapping[str, float]) -> list[str]:
    prefix = f"{key}:"
    return sorted(r[len(prefix):] for r, amount in resources.items()
                  if r.startswith(prefix) and len(r) > len(prefix) and amount > 0)


def labels_from_placement() -> tuple[tuple[str, str], ...]:
    """The labels of a peer started here: in a Ray actor or task, or the driver."""
    ray = _ray()
    ctx = ray.get_runtime_context()
    node_id: str = ctx.get_node_id()
    node: dict[str, Any] = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
    worker = ctx.worker.mode == ray.WORKER_MODE  # the driver is assigned no resources
    return placement_labels(
        node_ip=ray.util.get_node_ip_address(), node_id=node_id,
        node_labels=ctx.get_node_labels(), node_resources=node.get("Resources", {}),
        assigned=ctx.get_assigned_resources() if worker else {},
        gpus=[str(g) for g in ctx.get_accelerator_ids().get("GPU", [])] if worker else [])


def default_name() -> str:
    """The actor's name if it has one, else ``ray-`` and the start of its actor id (of
    the worker id outside an actor)."""
    ctx = _ray().get_runtime_context()
    name: str = ctx.get_actor_name() or ""
    return name or f"ray-{(ctx.get_actor_id() or ctx.get_worker_id())[:12]}"


def peer_config(seeds: Sequence[str] = (), *, name: str | None = None,
                listen_host: str | None = None, keys: str | Path | None = None,
                labels: Mapping[str, str] | None = None, preset: str = "datacenter",
                **options: Any) -> PeerConfig:
    """A :class:`PeerConfig` for a peer started here, labelled from the placement.

    ``seeds``: control addresses (``host:port``) of peers already in the mesh; none for
    the first.  ``name``: default :func:`default_name`.  ``listen_host``: default the
    Ray node's IP, which other nodes reach -- without keys only a loopback address is
    allowed, so on one machine pass ``"127.0.0.1"``.  ``keys``: a ``tensorhub keygen``
    directory every node can read, holding a key for this peer's name.  ``labels``
    are added to (and override) the placement's.  ``preset`` is one of ``local``,
    ``datacenter`` (the default) and ``cross_dc``; ``options`` are any other
    :class:`PeerConfig` fields.
    """
    if preset not in PRESETS:
        raise LocalProtocolError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    merged = dict(labels_from_placement())
    merged.update(labels or {})
    host = listen_host or _ray().util.get_node_ip_address()
    name = name or default_name()
    if keys is not None:
        options["security"] = security.load(keys, name)
    return PRESETS[preset](name, listen=f"{host}:0", join=tuple(seeds),
                           labels=tuple(merged.items()), **options)


def start_peer(seeds: Sequence[str] = (), **options: Any) -> BlockingPeer:
    """Start a peer here (see :func:`peer_config` for the options), running in a
    background thread; close it with ``close()``."""
    return BlockingPeer(peer_config(seeds, **options))


def address(hub: BlockingPeer) -> str:
    """The ``host:port`` other peers join through."""
    return hub.peer.info.control.removeprefix("tcp://")


class TensorHubActor:
    """A base class for Ray actors that are TensorHub peers.

    ``start_peer``, ``peer_address``, ``peer_labels`` and ``stop_peer`` are remote
    methods like any other of the actor; its own methods use :attr:`hub`.  The peer
    leaves the mesh when ``stop_peer`` is called or the actor exits gracefully.
    """

    _hub: BlockingPeer | None = None

    def start_peer(self, seeds: Sequence[str] = (), **options: Any) -> str:
        """Start this actor's peer (options: :func:`peer_config`); its address."""
        if self._hub is not None:
            raise LocalProtocolError(f"this actor's peer {self._hub.peer.info.name} "
                                     "is running already")
        self._hub = start_peer(seeds, **options)
        return address(self._hub)

    @property
    def hub(self) -> BlockingPeer:
        """This actor's peer; raises :class:`LocalProtocolError` before ``start_peer``."""
        if self._hub is None:
            raise LocalProtocolError("call start_peer() before using the actor's peer")
        return self._hub

    def peer_address(self) -> str:
        return address(self.hub)

    def peer_labels(self) -> dict[str, str]:
        return dict(self.hub.peer.info.labels)

    def stop_peer(self) -> None:
        """Leave the mesh and stop the peer's thread."""
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.close()

    def __ray_shutdown__(self) -> None:
        """Called by Ray when the actor exits gracefully."""
        self.stop_peer()
