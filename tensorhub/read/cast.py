"""Casting on the way: a consumer asks for other dtypes than the publisher's.

Theory of operation
-------------------
A casting fetch is a plain fetch followed by a cast.  The version is fetched as
published: every chunk lands in buffers this peer allocates and is verified against the
publisher's digests before it counts, exactly as without ``cast=``.  Those buffers hold
the published bytes, so the peer keeps and serves them as that version like any fetch
(``unpublish`` frees them).  Only then, in a worker thread, the verified tensors are cast
with torch into new tensors or the caller's ``into=`` ones.  The cast tensors are never
put in the store: they are not announced and never served, because their bytes are not
the version's (no digest of the publisher covers them).

What is cast: each floating-point tensor whose name matches a pattern of the spec
(:mod:`fnmatch`, first match wins) and whose dtype differs from the target; every other
tensor is returned as published.  A plain dtype name casts like torch's ``.to()``.  An
:class:`Fp8` target also returns the scales, as float32 tensors named ``NAME_scale``
(the vLLM naming, ``x.weight`` -> ``x.weight_scale``), with ``x ~= q.float() * scale``.
The fetch report's ``cast`` names every cast tensor with ``from->to``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

import trio

from ..dtypes import display
from ..errors import LocalProtocolError
from ..torch import (
    as_torch,
    check_into,
    destination,
    dtype_of,
    host_view,
    is_tensor,
    require_torch,
    torch_dtype,
)
from .destination import disjoint
from .report import Fetched

if TYPE_CHECKING:
    import torch

SCALE_SUFFIX = "_scale"


@dataclass(frozen=True)
class Fp8:
    """Cast to an fp8 dtype with scales.

    The scale of a tensor (``block=None``), or of each ``block`` x ``block`` tile of a
    2-D tensor (the last tiles cut short; tensors of other ranks get one scale), is
    ``amax / finfo(dtype).max`` over its values in float32, at least float32's smallest
    normal number (an all-zero or a tiny tile never divides by zero), and
    ``q = (x.float() / scale).clamp(-max, max).to(dtype)``.  The scale tensor has shape
    ``()`` per tensor, ``(ceil(rows / block), ceil(cols / block))`` per block.  Finite
    inputs only: an infinite value makes its scale infinite."""

    dtype: str = "float8_e4m3fn"
    block: int | None = None

    def __post_init__(self) -> None:
        if self.block is not None and (isinstance(self.block, bool) or self.block < 1):
            raise LocalProtocolError(f"Fp8 block must be a positive int, got {self.block!r}")

    def __str__(self) -> str:
        how = "per tensor" if self.block is None else f"per {self.block}x{self.block} block"
        return f"{self.dtype} (scale {how})"


Target = str | Fp8
CastSpec = Target | Mapping[str, Target]
"""A target for every tensor, or tensor-name pattern -> target (first match wins)."""


def plan(spec: CastSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, Target]:
    """Tensor name -> target, for the tensors ``spec`` casts (see the module text)."""
    rules = list(spec.items()) if isinstance(spec, Mapping) else [("*", spec)]
    for pattern, target in rules:
        if not isinstance(pattern, str) or not isinstance(target, str | Fp8):
            raise LocalProtocolError(
                f"cast= takes a dtype name, an Fp8, or a mapping of name pattern -> one of "
                f"those; got {pattern!r}: {target!r}")
        torch_dtype(target.dtype if isinstance(target, Fp8) else target)  # torch has it?
    out: dict[str, Target] = {}
    for name, t in tensors.items():
        found = next((tg for pat, tg in rules if fnmatchcase(name, pat)), None)
        if found is None or not t.is_floating_point():
            continue
        if isinstance(found, Fp8) or torch_dtype(found) != t.dtype:
            out[name] = found
    return out


def quantize(x: torch.Tensor, fp8: Fp8) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as ``fp8.dtype`` and its scales (see :class:`Fp8`)."""
    import torch
    dtype = torch_dtype(fp8.dtype)
    top, floor = torch.finfo(dtype).max, torch.finfo(torch.float32).tiny
    xf = x.float()
    b = fp8.block
    if b is None or xf.dim() != 2:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=torch.float32)
        scale = (amax / top).clamp_min(floor)
        return (xf / scale).clamp(-top, top).to(dtype), scale
    rows, cols = xf.shape
    br, bc = -(-rows // b), -(-cols // b)
    tiles = torch.nn.functional.pad(xf, (0, bc * b - cols, 0, br * b - rows)).view(br, b, bc, b)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = (amax / top).clamp_min(floor)
    q = (tiles / scale[:, None, :, None]).clamp(-top, top).to(dtype)
    return q.view(br * b, bc * b)[:rows, :cols].contiguous(), scale


def result_specs(src: Mapping[str, torch.Tensor], targets: Mapping[str, Target]
                 ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor a casting fetch returns: name -> (dtype name, shape)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, t in src.items():
        target = targets.get(name)
        if target is None:
            out[name] = (dtype_of(t), tuple(t.shape))
        elif isinstance(target, str):
            out[name] = (dtype_of(t.new_empty(0, dtype=torch_dtype(target))), tuple(t.shape))
        else:
            out[name] = (target.dtype, tuple(t.shape))
            b = target.block
            grid = () if b is None or t.dim() != 2 else tuple(-(-n // b) for n in t.shape)
            out[name + SCALE_SUFFIX] = ("<f4", grid)
    return out


def cast_all(src: Mapping[str, torch.Tensor], targets: Mapping[str, Target],
             into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Cast ``src`` by ``targets`` into new tensors, or copy into ``into`` (checked)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in src.items():
        target = targets.get(name)
        if target is None:
            out[name] = t
        elif isinstance(target, str):
            if into is not None:  # copy_ casts as .to() does, with no new tensor
                out[name] = into[name].copy_(t)
                continue
            out[name] = t.to(torch_dtype(target))
        else:
            out[name], out[name + SCALE_SUFFIX] = quantize(t, target)
    if into is not None:
        for name, t in out.items():
            if into[name] is not t:
                into[name].copy_(t)
        return dict(into)
    return out


def _check_into(into: Any, wanted: Mapping[str, tuple[str, tuple[int, ...]]]
                ) -> dict[str, torch.Tensor]:
    """``into`` as name -> torch tensor, each of the dtype and shape the cast gives."""
    given = destination(into)
    if not hasattr(given, "keys") or set(given.keys()) != set(wanted):
        keys = set(given.keys()) if hasattr(given, "keys") else set()
        raise LocalProtocolError(
            f"into= does not match the cast result: missing {sorted(set(wanted) - keys)[:5]}"
            f", unknown {sorted(keys - set(wanted))[:5]}")
    names = list(wanted)
    for name, (dtype, shape) in wanted.items():
        t = given[name]
        if not is_tensor(t):
            raise LocalProtocolError(f"into[{name!r}]: a casting fetch fills torch tensors")
        check_into(name, t, dtype, shape)
    disjoint(names, [host_view(given[n], n) for n in names])  # on the host, contiguous
    return dict(given)


async def cast_fetched(fetched: Fetched, spec: CastSpec, into: Any) -> Fetched:
    """``fetched`` (as published, verified) cast as ``spec`` says (see the module
    text), into new tensors or ``into`` (torch tensors, or an ``nn.Module``), which is
    checked in full against the cast result before any of its bytes is written."""
    require_torch()
    import torch
    src = as_torch(fetched)
    targets = plan(spec, src)
    wanted = result_specs(src, targets)
    dest = None if into is None else _check_into(into, wanted)
    start = time.perf_counter()

    def work() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return cast_all(src, targets, dest)

    out = await trio.to_thread.run_sync(work)
    report = fetched.report
    report.cast = {name: f"{display(dtype_of(src[name]))}->{target}" for name, target in
                   targets.items()}
    report.cast_seconds = time.perf_counter() - start
    tensors = {name: host_view(t, name) for name, t in out.items()}
    return Fetched(fetched.version, tensors, report)
