"""Benchmark figures: one record per figure, printed as a table and as JSON."""

from __future__ import annotations

from typing import Any


def figure(name: str, value: float, unit: str, bound: float, better: str) -> dict[str, Any]:
    """A figure next to its bound; ``better`` is ``"higher"`` or ``"lower"``."""
    ok = value >= bound if better == "higher" else value <= bound
    return {"name": name, "value": round(value, 4), "unit": unit, "bound": bound,
            "better": better, "ok": ok}


def print_figures(figures: list[dict[str, Any]]) -> None:
    print(f"{'figure':<28} {'value':>9} {'bound':>7}  ok")
    for f in figures:
        sign = ">=" if f["better"] == "higher" else "<="
        print(f"{f['name']:<28} {f['value']:>9.3f} {sign}{f['bound']:>5}  "
              f"{'yes' if f['ok'] else 'NO'}")
