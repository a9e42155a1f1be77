"""The baselines' algorithms as closed forms (seconds), for the workloads of
:mod:`simulations.dataplane.workloads`.

Stop-and-broadcast ships full tensors: the trainer gathers each pipeline stage's
tensors on one rank (TP shards over NVLink) and NCCL broadcasts them to every rollout
GPU, which keeps its slice; the ``stages`` broadcasts run at once, so each rollout NIC
receives the whole model ``S``.  Ring: ``S/B`` plus one NCCL chunk per hop;
tree (NCCL's double binary tree): ``S/B`` plus two chunks per level.  Checkpoint-engine
style: the same broadcast in buckets with a barrier per bucket.  Star from the
trainer: every reader pulls its own bytes from the trainer GPUs that hold them.
Storage: the trainer writes the model once, every reader then reads its bytes; the
store's aggregate bandwidth is shared.  Across DCs, naive: every remote reader pulls its
own bytes from the trainer over the one WAN link; or one stop-and-broadcast whose rings
span both DCs (each crosses the WAN once, so the WAN carries the model once).
"""

from __future__ import annotations

import math

NCCL_CHUNK = 4 << 20
"""Bytes NCCL pipelines per step on a hop (NCCL_BUFFSIZE)."""


def gather_s(size: float, stages: int, nvlink_bps: float) -> float:
    """The trainer collects each stage's TP shards on one rank (an all-gather)."""
    return size / stages / nvlink_bps


def ring_broadcast_s(size: float, n: int, nic_bps: float, stages: int) -> float:
    return size / nic_bps + max(n - 2, 0) * NCCL_CHUNK * stages / nic_bps


def tree_broadcast_s(size: float, n: int, nic_bps: float, stages: int) -> float:
    return size / nic_bps + 2 * math.ceil(math.log2(max(n, 2))) * NCCL_CHUNK * stages / nic_bps


def checkpoint_engine_s(size: float, n: int, nic_bps: float, stages: int,
                        bucket: float = 2e9, barrier_s: float = 0.002) -> float:
    return ring_broadcast_s(size, n, nic_bps, stages) + math.ceil(size / bucket) * barrier_s


def star_s(readers: int, each: float, source_up: float, down: float) -> float:
    """Every reader pulls ``each`` bytes from sources with ``source_up`` in all."""
    return max(readers * each / source_up, each / down)


def storage_s(size: float, readers: int, each: float, store_bps: float, down: float) -> float:
    return size / store_bps + max(readers * each / store_bps, each / down)


def wan_star_s(readers: int, each: float, wan_bps: float, down: float) -> float:
    """Every remote reader pulls ``each`` bytes across one WAN link of ``wan_bps``."""
    return max(readers * each / wan_bps, each / down)


def wan_broadcast_s(size: float, n: int, nic_bps: float, wan_bps: float, stages: int,
                    wan_rtt_s: float) -> float:
    """A ring broadcast over ``n`` GPUs in two DCs: the ring of each stage crosses the
    WAN once, so the WAN carries ``size`` while each NIC receives it."""
    return (size / min(nic_bps, wan_bps) + max(n - 2, 0) * NCCL_CHUNK * stages / nic_bps
            + wan_rtt_s)
