"""RL-like weight steps for the delta benchmark (``tensorhub bench delta``): bf16 weights
and a version that changes a seeded fraction of their values by small amounts.

bf16 values are kept as their 16-bit patterns (``uint16`` arrays: numpy has no bf16),
as a trainer's ``torch.bfloat16`` state dict lies in memory.  A step multiplies the
chosen values by ``1 + 0.01 * N(0, 1)`` and rounds back to bf16, so some of the chosen
values round to themselves, as in training.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_BLOCK = 1 << 24  # values generated at a time (64 MiB of float32 scratch)


def bf16_weights(size: int, seed: int) -> dict[str, np.ndarray[Any, Any]]:
    """One tensor of ``size`` bytes of bf16 values, ``N(0, 0.02)``."""
    rng = np.random.default_rng(seed)
    out = np.empty(size // 2, np.uint16)
    for at in range(0, out.size, _BLOCK):
        f = rng.standard_normal(min(_BLOCK, out.size - at), dtype=np.float32) * 0.02
        out[at:at + f.size] = f.view(np.uint32) >> 16
    return {"weights": out}


def rl_step(arrays: dict[str, np.ndarray[Any, Any]], fraction: float, seed: int
            ) -> dict[str, np.ndarray[Any, Any]]:
    """A copy of ``arrays`` (bf16 patterns) with about ``fraction`` of the values of each
    changed a little (positions drawn with replacement: a few are drawn twice)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, arr in arrays.items():
        new = arr.copy()
        flat = new.reshape(-1)
        idx = rng.integers(0, flat.size, int(flat.size * fraction))
        v = (flat[idx].astype(np.uint32) << 16).view(np.float32)
        v = v * (1 + 0.01 * rng.standard_normal(idx.size, dtype=np.float32))
        flat[idx] = ((v.view(np.uint32) + 0x8000) >> 16).astype(np.uint16)
        out[name] = new
    return out
