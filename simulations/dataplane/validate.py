"""The simulator against the emulated cluster: the same topology as each run saved in
``docs/results/netns_measured.json`` (``tensorhub bench cluster``, one and two DCs),
simulated with the transfer engine, side by side with the measured median.

Re-measure (root, nftables; CPU-heavy, so one run per configuration) with the command
stored next to each run, and replace the file."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from tensorhub.protocol.sizing import choose_chunk_size

from ..transfer import Options, one_dc, two_dc
from ..transfer_engine import simulate

MEASURED = Path(__file__).resolve().parents[2] / "docs" / "results" / "netns_measured.json"


def compare(path: Path = MEASURED) -> list[dict[str, Any]]:
    """One row per measured run: measured median, simulated, relative error."""
    rows = []
    for run in json.loads(path.read_text())["runs"]:
        s = run["settings"]
        size = s["size_bytes"]
        chunk, _ = choose_chunk_size(size)
        o = Options(hosts=s["hosts"], chunks=-(-size // chunk), chunk_size=chunk,
                    nic_mbit=s["nic_mbit"], wan_mbit=s["wan_mbit"] or 400.0,
                    wan_rtt=(s["wan_rtt_ms"] or 40.0) / 1e3)
        setup = one_dc(o) if s["dcs"] == 1 else two_dc(o)
        sim = simulate(setup).end
        measured = statistics.median(run["tensorhub_s"])
        rows.append({"name": run["name"], "command": run["command"], "measured_s": measured,
                     "simulated_s": sim, "error": abs(sim - measured) / measured})
    return rows
