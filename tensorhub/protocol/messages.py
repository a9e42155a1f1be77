"""The table of wire type ids.  Ids are only ever appended, never reused or renumbered.

Each protocol module lists its messages in a ``MESSAGES`` tuple; this table gives each
a fixed id block so that a module can append messages without shifting anyone else.
"""

from __future__ import annotations

from . import (
    bans,
    codec,
    control,
    coordination,
    dataplane,
    groups,
    membership,
    onesided,
    opstatus,
    retention,
    wan,
)

_BLOCKS: tuple[tuple[int, tuple[type, ...]], ...] = (
    (1, dataplane.MESSAGES),     # 1..9: data plane
    (10, control.MESSAGES),      # 10..19: reference-table anti-entropy
    (20, membership.MESSAGES),   # 20..49: SWIM membership
    (50, coordination.MESSAGES), # 50..59: per-version coordinators
    (60, groups.MESSAGES),       # 60..69: model-parallel group switches
    (70, retention.MESSAGES),    # 70..79: retention hand-over
    (80, dataplane.MESSAGES_2),  # 80..89: data plane, continued (same-host version leases)
    (90, bans.MESSAGES),         # 90..99: ban notices (hints about holders of bad bytes)
    (100, dataplane.MESSAGES_3), # 100..109: data plane, continued (authentication)
    (110, opstatus.MESSAGES),    # 110..119: status queries (tensorhub status)
    (120, dataplane.MESSAGES_4), # 120..129: data plane, continued (streamed runs)
    (130, dataplane.MESSAGES_5), # 130..139: data plane, continued (chunk deltas)
    (140, onesided.MESSAGES),    # 140..149: one-sided data plane (RDMA READ, CUDA IPC)
    (150, wan.MESSAGES),         # 150..159: links between DCs (in reference entries)
    (160, dataplane.MESSAGES_6), # 160..169: data plane, continued (link probes)
)


def register_all() -> None:
    """Register every message class with the codec (idempotent)."""
    if codec.registered():
        return
    for (base, classes), (following, _) in zip(_BLOCKS, (*_BLOCKS[1:], (1 << 16, ())), strict=True):
        if base + len(classes) > following:
            raise AssertionError(f"message block {base} overflows into {following}")
    for base, classes in _BLOCKS:
        for offset, cls in enumerate(classes):
            codec.register(base + offset, cls)
