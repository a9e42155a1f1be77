"""The transport dial: which data-plane transports exist, and whether this host can
use each one.

``PeerConfig.transports`` names transports in order of preference.  A peer detects each
one named when it starts (:func:`detect`); a one-sided transport (RDMA, CUDA IPC, or a
stand-in of one) that is named and not usable here fails the start with the reason --
never a silent fallback.  ``shm`` keeps its own rule (it depends on the pair of
processes as much as on the host: checked per holder, refusals shown), and ``tcp``
works everywhere.  The real backends' modules are imported only here, only when named.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import TRANSPORTS
from .onesided.backend import Backend
from .onesided.standin import StandinBackend

ONE_SIDED = ("rdma", "cuda-ipc", "rdma-standin", "cuda-ipc-standin")
SAME_HOST = frozenset({"shm", "cuda-ipc", "cuda-ipc-standin"})
"""Transports tried only with a holder on this host (the same ``host`` label)."""

BackendFactory = Callable[[], Backend]


def probe_backend(name: str) -> tuple[BackendFactory | None, str]:
    """How to make a one-sided backend named ``name`` on this host, or None and why
    not."""
    if name in ("rdma-standin", "cuda-ipc-standin"):
        return (lambda: StandinBackend(name)), "in-process stand-in over host memory"
    if name == "rdma":
        from . import rdma
        return rdma.probe()
    if name == "cuda-ipc":
        from . import cuda_ipc
        return cuda_ipc.probe()
    raise ValueError(f"{name!r} is not a one-sided transport (transports: "
                     f"{', '.join(TRANSPORTS)})")


def detect(name: str) -> tuple[bool, str]:
    """Whether transport ``name`` is usable on this host, and what was found (or why
    not)."""
    if name == "tcp":
        return True, "always"
    if name == "shm":
        from .samehost.process_vm import shm_available
        return shm_available()
    factory, why = probe_backend(name)
    return factory is not None, why
