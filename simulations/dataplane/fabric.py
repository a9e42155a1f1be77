"""The cluster a data-plane simulation runs on: GPUs in hosts, hosts under leaf
switches, leaves under a spine, DCs joined by WAN links.

Theory of operation
-------------------
Every GPU is one endpoint (one peer process per GPU, as TensorHub runs).  A GPU sends
on its own NIC (``nic_bps`` each way) and, to a GPU of the same host, over NVLink
(``nvlink_bps`` each way, per GPU).  A flow between hosts crosses the sender's NIC
uplink and the receiver's NIC downlink; between leaves it also crosses the sender
leaf's uplink to the spine and the receiver leaf's downlink from it, each carrying
``gpus under the leaf x nic_bps / oversubscription``, when oversubscribed (a
non-blocking leaf carries at most what the NICs under it send, so it never limits a
flow, and leaving it out saves the max-min sharing of :mod:`simulations.flows` the
work); between DCs it also crosses the link of that ordered DC pair, ``wan:{a}>{b}``.
Each ordered pair may have its own rate and round trip (:attr:`FabricSpec.wan`: the
real WAN is asymmetric, and a direct link may be slower than a path through a third
DC); a pair not listed runs at ``wan_bps`` with a ``wan_rtt_s`` round trip.  Round
trips: ``rtt_s`` inside a DC, the pair's across.  Links are those of
:class:`simulations.flows.Network`, shared by every fan-out that runs at once on the
fabric.

The planner sees what a peer would gossip: ``dc``, ``rack`` (the leaf) and ``host``
labels and the NIC rate (:meth:`Fabric.node`); the DC pairs' links are what an operator
declares (:meth:`FabricSpec.declared`, the ``[[link]]`` tables of :mod:`tensorhub.links`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tensorhub.links import LinkSpec
from tensorhub.protocol.topology import NodeInfo

from ..flows import Link, Network

GBIT = 1e9 / 8


@dataclass(frozen=True)
class FabricSpec:
    """The shape and speeds of one cluster (defaults: Hopper hosts, 400 Gb/s RDMA)."""

    gpus_per_host: int = 8
    hosts_per_leaf: int = 16
    nic_bps: float = 400 * GBIT
    nvlink_bps: float = 3600 * GBIT
    """Per GPU, each way (H100 NVLink: 450 GB/s)."""
    oversubscription: float = 1.0
    """Leaf downlink capacity over its uplink capacity (1: non-blocking)."""
    rtt_s: float = 10e-6
    """Round trip inside a DC (RDMA)."""
    wan_bps: float = 200 * GBIT
    """Each way of a DC pair's link not in ``wan``."""
    wan_rtt_s: float = 0.010
    """The round trip of a DC pair not in ``wan``."""
    wan: Mapping[tuple[str, str], tuple[float, float]] = field(default_factory=dict,
                                                               hash=False)
    """``(src DC, dst DC) -> (bytes/s, round trip s)``: the one-way links of their own.
    A round trip is the pair's, the same both ways (as :mod:`tensorhub.testing.clusterspec`
    has it): ``b -> a`` not listed takes ``a -> b``'s round trip and ``wan_bps``."""

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1 or self.hosts_per_leaf < 1 or self.oversubscription < 1:
            raise ValueError("need gpus_per_host >= 1, hosts_per_leaf >= 1, "
                             "oversubscription >= 1")
        for (a, b), (bps, rtt) in self.wan.items():
            if a == b or not (math.isfinite(bps) and bps > 0 and math.isfinite(rtt)
                              and rtt >= 0):
                raise ValueError(f"wan link {a}>{b}: need two DCs, a rate > 0 and a "
                                 f"round trip >= 0, got {bps!r} bytes/s, {rtt!r} s")
            back = self.wan.get((b, a))
            if back is not None and back[1] != rtt:
                raise ValueError(f"wan link {a}>{b}: the round trip is the same both ways, "
                                 f"got {rtt:g} s and {back[1]:g} s back")

    def wan_link(self, src: str, dst: str) -> tuple[float, float]:
        """The ``src -> dst`` DC link's rate (bytes/s) and round trip (s)."""
        there, back = self.wan.get((src, dst)), self.wan.get((dst, src))
        rtt = there[1] if there else back[1] if back else self.wan_rtt_s
        return (there[0] if there else self.wan_bps), rtt

    def declared(self) -> tuple[LinkSpec, ...]:
        """The links of ``wan`` as an operator declares them to the peers."""
        return tuple(LinkSpec(a, b, bps, rtt) for (a, b), (bps, rtt) in sorted(self.wan.items()))


@dataclass(frozen=True)
class Place:
    dc: str
    leaf: str
    host: str


class Fabric:
    """Places GPUs and answers which links a flow crosses and its round trip."""

    def __init__(self, spec: FabricSpec, net: Network) -> None:
        self.spec, self.net = spec, net
        self.places: dict[str, Place] = {}
        self._hosts = 0

    def add_hosts(self, dc: str, hosts: int, prefix: str = "g") -> list[list[str]]:
        """``hosts`` more hosts in ``dc`` (leaves filled in order); returns the GPU names
        of each new host, ``{prefix}{host}.{gpu}``."""
        out = []
        s = self.spec
        for _ in range(hosts):
            h = self._hosts
            self._hosts += 1
            leaf = f"{dc}/leaf{h // s.hosts_per_leaf}"
            gpus = [f"{prefix}{h}.{g}" for g in range(s.gpus_per_host)]
            for name in gpus:
                self.places[name] = Place(dc, leaf, f"{dc}/host{h}")
            out.append(gpus)
        return out

    def node(self, name: str) -> NodeInfo:
        """What the peer on GPU ``name`` tells the mesh about itself."""
        p = self.places[name]
        return NodeInfo(name, p.dc, p.leaf, p.host, self.spec.nic_bps, self.spec.nic_bps)

    def rtt(self, a: str, b: str) -> float:
        da, db = self.places[a].dc, self.places[b].dc
        return self.spec.rtt_s if da == db else self.spec.wan_link(da, db)[1]

    def links(self, src: str, dst: str) -> tuple[Link, ...]:
        a, b, s, net = self.places[src], self.places[dst], self.spec, self.net
        if a.host == b.host:
            return (net.link(f"nvl-up:{src}", s.nvlink_bps),
                    net.link(f"nvl-down:{dst}", s.nvlink_bps))
        out = [net.link(f"up:{src}", s.nic_bps), net.link(f"down:{dst}", s.nic_bps)]
        if a.leaf != b.leaf and s.oversubscription > 1:
            spine = s.gpus_per_host * s.hosts_per_leaf * s.nic_bps / s.oversubscription
            out += [net.link(f"leaf-up:{a.leaf}", spine),
                    net.link(f"leaf-down:{b.leaf}", spine)]
        if a.dc != b.dc:
            out.append(net.link(f"wan:{a.dc}>{b.dc}", s.wan_link(a.dc, b.dc)[0]))
        return tuple(out)
