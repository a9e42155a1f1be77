"""Which ranks of a publish disagree on which tensors (a pure helper of sealing).

Theory of operation
-------------------
Sealing (:mod:`.versions`) compares digests: a version whose ranks announce different
schema ids or layout ids is a conflict, and the seal can name the ranks and peers on
each side, but not the tensors, which only the ranks' manifests list.  When a reader
meets such a conflict, the peer fetches the manifest each disagreeing rank announced
(checked against its manifest id, as any manifest) and :func:`spec_differences` says,
tensor by tensor, what differs:

* the dtype, the whole tensor's shape, or whether a rank holds it whole or a slice:
  ``tensor 'qkv': rank 2 (peer t2) has float64 [96, 40], ranks 0, 1, 3 (peers t0, t1,
  t3) have float32 [96, 40]``;
* a tensor that some ranks list and others do not: ``tensor 'x' only at rank 3 (peer
  t3), not at ranks 0, 1, 2 (peers ..)``;
* when every rank agrees on all that and every rank's manifest is at hand, whether the
  ranks' slices tile the tensor (each element held by exactly one rank): ranks that
  split it along another dim, or into other parts, do not.

Nothing here performs I/O.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..dtypes import display
from ..model import TensorSpec

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RankSpecs:
    """The tensor specs one rank announced, and the peers that announced them."""

    rank: int
    origins: tuple[str, ...]
    tensors: Sequence[TensorSpec]


def spec_differences(ranks: Sequence[RankSpecs], world: int | None) -> list[str]:
    """One line per tensor the ranks disagree on, in name order (none if they agree).

    ``ranks`` may hold several entries of one rank (holders that announced different
    manifests for it); the tiling check runs only when there is exactly one entry per
    rank ``0..world-1``."""
    index = [{t.name: t for t in r.tensors} for r in ranks]
    whole_world = world is not None and sorted(r.rank for r in ranks) == list(range(world))
    lines = []
    for name in sorted({n for specs in index for n in specs}):
        specs = [specs.get(name) for specs in index]
        groups: dict[tuple[str, tuple[int, ...], bool] | None, list[RankSpecs]] = \
            defaultdict(list)
        for r, t in zip(ranks, specs, strict=True):
            groups[None if t is None else (t.dtype, t.full_shape, bool(t.global_shape))
                   ].append(r)
        if len(groups) > 1:
            lines.append(_disagreement(name, groups))
        elif whole_world and specs[0] is not None and specs[0].global_shape:
            present = [(r, t) for r, t in zip(ranks, specs, strict=True) if t is not None]
            line = _tiling(name, specs[0].full_shape, present)
            if line:
                lines.append(line)
    return lines


def _who(ranks: Sequence[RankSpecs]) -> str:
    numbers = sorted({r.rank for r in ranks})
    peers = sorted({o for r in ranks for o in r.origins})
    many = "s" if len(numbers) > 1 else ""
    return (f"rank{many} {', '.join(map(str, numbers))} "
            f"(peer{'s' if len(peers) > 1 else ''} {', '.join(peers)})")


def _disagreement(name: str, groups: dict[tuple[str, tuple[int, ...], bool] | None,
                                          list[RankSpecs]]) -> str:
    present = [k for k in groups if k is not None]
    if None in groups and len(present) == 1:
        return f"tensor {name!r} only at {_who(groups[present[0]])}, not at {_who(groups[None])}"
    show_kind = len({k[2] for k in present}) > 1
    parts = []
    for key, who in sorted(groups.items(), key=lambda kv: (len(kv[1]),
                                                           min(r.rank for r in kv[1]))):
        single = len({r.rank for r in who}) == 1
        if key is None:
            parts.append(f"{_who(who)} {'lacks' if single else 'lack'} it")
            continue
        dtype, shape, sliced = key
        kind = (" as a slice" if sliced else " whole") if show_kind else ""
        parts.append(f"{_who(who)} {'has' if single else 'have'} "
                     f"{display(dtype)} {list(shape)}{kind}")
    return f"tensor {name!r}: {', '.join(parts)}"


def _tiling(name: str, shape: tuple[int, ...],
            present: list[tuple[RankSpecs, TensorSpec]]) -> str:
    """Unless the ranks' slices cover the tensor exactly once, a line that says so."""
    boxes = [(r, t.box) for r, t in present]
    covered = sum(_volume(b) for _, b in boxes)
    disjoint = all(not _overlap(a, b) for i, (_, a) in enumerate(boxes)
                   for _, b in boxes[i + 1:])
    if disjoint and covered == math.prod(shape):
        return ""
    held = ", ".join(f"{_who([r])} {_text(b)}" for r, b in sorted(boxes, key=lambda rb:
                                                                     rb[0].rank))
    return (f"tensor {name!r}: the ranks' slices do not tile its {list(shape)} "
            f"({'overlapping' if not disjoint else 'with gaps'}): {held}")


def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _overlap(x: Box, y: Box) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(x, y, strict=True))


def _text(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"
