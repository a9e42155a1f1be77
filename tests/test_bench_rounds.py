"""``tensorhub bench rounds`` end to end, tiny: real peer processes (4 publisher ranks,
groups of 2 and 3 ranks, a busy neighbour), through the CLI in a subprocess.  Aborts are
not asserted away (they are what the bench measures); that its figures agree with its
table and with each other is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorhub
from tensorhub.bench.rounds_worker import (
    PUBLISH,
    base_slices,
    consume_layout,
    drop_old,
    mismatches,
    version_of,
)


def test_a_tiny_run_switches_every_group_and_its_figures_match_its_table() -> None:
    root = str(Path(tensorhub.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run(
        [sys.executable, "-m", "tensorhub.cli", "bench", "rounds", "--rounds", "3",
         "--busy", "1", "--size", "1MiB", "--chunk", "16KiB", "--deadline", "60", "--json"],
        capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    doc = json.loads(lines[-1])
    figures = {f["name"]: f for f in doc["figures"]}
    assert set(figures) == {"group_aborts", "group_rounds", "mixed_or_wrong_slices",
                            "round_seconds_median", "versions_behind_median"}
    groups = doc["measured"]["groups"]
    assert [g["ranks"] for g in groups.values()] == [2, 3]
    assert figures["group_rounds"]["value"] == min(g["switches"] for g in groups.values()) >= 3
    assert figures["group_rounds"]["ok"]
    assert figures["mixed_or_wrong_slices"]["value"] == 0
    assert figures["group_aborts"]["value"] == sum(
        g["aborts"] + g["timeouts"] + g["errors"] for g in groups.values())
    assert doc["settings"]["security"] is True and doc["settings"]["busy"] == 1
    for name, g in groups.items():
        # every rank checked the slices of the switches it saw, the leader all of its own
        assert g["checked"][f"{name}r0"] == g["switches"]
        assert all(n >= 1 for n in g["checked"].values())
        assert len(g["round_s"]) == len(g["versions_behind"]) == g["switches"]
        assert all(b >= 0 for b in g["versions_behind"])
        row = next(line for line in lines if line.startswith(f"{name} "))
        assert row.split()[1:7] == [str(g[k]) for k in ("ranks", "switches", "aborts",
                                                        "timeouts", "errors", "wrong")]
        for text in g["texts"]:  # every abort text is printed
            assert f"  {name}: {text}" in lines
    for f in doc["figures"]:
        assert re.search(rf"^{f['name']} +{f['value']:.3f} ", out.stdout, re.M), f


@pytest.mark.parametrize("size", [2, 3])
def test_the_check_accepts_every_version_and_refuses_any_other(size: int) -> None:
    """A consuming rank's slices of version v pass; v's neighbours, one word of another
    version, a wrong dtype or a missing tensor do not."""
    nbytes = 1 << 20
    pub = [version_of(base_slices(nbytes, PUBLISH.at(r)), 7) for r in range(4)]
    layout = consume_layout(1, size)
    want = base_slices(nbytes, layout)
    full = {}  # the publishers' slices put together, then cut as the consumer does
    for name in pub[0]:
        dim = PUBLISH.dim_of(name)
        full[name] = pub[0][name] if dim is None else np.concatenate(
            [p[name] for p in pub], axis=dim)
    got = {k: np.ascontiguousarray(v[tuple(slice(a, b) for a, b in layout.box(k, v.shape))])
           for k, v in full.items()}
    assert mismatches(want, 7, got) == []
    assert mismatches(want, 6, got) and mismatches(want, 8, got)
    mixed = {k: v.copy() for k, v in got.items()}
    mixed["l0.qkv"].reshape(-1).view(np.uint16)[5] ^= np.uint16(1)
    assert mismatches(want, 7, mixed) == ["l0.qkv: other bytes than version 7"]
    assert mismatches(want, 7, {**got, "embed": got["embed"].astype(np.float32)})
    assert mismatches(want, 7, {k: v for k, v in got.items() if k != "embed"})


def test_publishers_drop_what_no_group_can_stage_and_force_only_past_max_held() -> None:
    held = list(range(1, 11))
    assert drop_old(held, 3, 4, 6) == [(1, False), (2, False), (3, True), (4, True)]
    assert held == [5, 6, 7, 8, 9, 10]
    assert drop_old(held, 100, 4, 6) == [(5, False), (6, False)] and held == [7, 8, 9, 10]
    assert drop_old(held, 0, 2, 8) == [] and held == [7, 8, 9, 10]  # a group still on 0
