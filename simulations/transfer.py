"""Fan-out scenarios on the transfer simulator, every reader running the real
:class:`~tensorhub.protocol.transfer.TransferSession` (see
:mod:`simulations.transfer_engine` for the model, :mod:`simulations.flows` for the
network).

    python -m simulations.transfer --json
    python -m simulations.transfer --hosts 64 --chunks 64

Scenarios: (a) one DC, a trainer and ``hosts - 1`` readers with the coordinator's plan
(made with every reader at once; and one reader at a time as each asks, as the
coordinator does, with its rebuilds and the readers' re-asks, and without them; and
without a plan, for comparison); (b) a chain of ``depth`` readers, each naming the one
before it as its source, against one hop; (c) two DCs joined by a WAN link, with the
plan (at once, as readers ask, and without); (d) scenario (a) with a planned relay
killed mid-transfer.  Prints a table, then each figure next to its bound; with
``--json``, one JSON object as the last line:
``{"figures": [{"name", "value", "unit", "bound", "better"}, ...], "settings"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from tensorhub.bench.figures import figure, print_figures

from .transfer_engine import simulate
from .transfer_setup import Host, Result, Setup, fluid_bound_of

MBIT = 1e6 / 8
BASELINE_HOSTS = 16
"""Above this many hosts the runs without a plan are skipped: every reader then reads
the same chunks from the trainer at once, and each pick of the session looks at every
pending chunk of every holder, so those runs are slow to simulate (not to fetch)."""


@dataclass(frozen=True)
class Options:
    hosts: int = 8
    chunks: int = 64
    chunk_size: int = 4 << 20
    nic_mbit: float = 400.0
    wan_mbit: float = 400.0
    wan_rtt: float = 0.040
    rtt: float = 0.0002
    depth: int = 4
    gossip_delay: float = 0.01
    seed: int = 0
    socket_window: int = 0

    @property
    def size(self) -> int:
        return self.chunks * self.chunk_size


def one_dc(o: Options, *, plan: bool = True, hosts: int | None = None) -> Setup:
    """A trainer ``h0`` and readers ``h1..``, all in one DC."""
    n = o.hosts if hosts is None else hosts
    rate = o.nic_mbit * MBIT
    return Setup(tuple(Host(f"h{i}", "dc0", rate, rate) for i in range(n)), "h0",
                 tuple(f"h{i}" for i in range(1, n)), o.size, o.chunk_size, plan=plan,
                 rtt=o.rtt, gossip_delay=o.gossip_delay, seed=o.seed,
                 socket_window=o.socket_window)


def chain(o: Options, depth: int) -> Setup:
    """``h0 -> h1 -> ... -> h<depth>``, each reader naming the one before it."""
    base = one_dc(o, plan=False, hosts=depth + 1)
    return replace(base, upstream={f"h{i}": frozenset({f"h{i - 1}"})
                                   for i in range(1, depth + 1)})


def two_dc(o: Options, *, plan: bool = True) -> Setup:
    """Half the hosts in ``dc0`` (the trainer's), half in ``dc1``, one WAN link; the
    coordinator in ``dc1`` (as measured in the emulated cluster: its DC registers
    first)."""
    base = one_dc(o, plan=plan)
    half = (o.hosts + 1) // 2
    hosts = tuple(replace(h, dc="dc0" if i < half else "dc1")
                  for i, h in enumerate(base.hosts))
    return replace(base, hosts=hosts, wan={("dc0", "dc1"): (o.wan_mbit * MBIT, o.wan_rtt)},
                   coordinator=hosts[-1].name)


def with_kill(setup: Setup, at: float) -> tuple[Setup, str]:
    """``setup`` with the reader that relays the most planned chunks killed at ``at``."""
    from .transfer_engine import Sim

    sim = Sim(setup)
    relayed: dict[str, int] = {}
    for reader in setup.readers:
        for peer, first, stop in sim.plan_for(reader):
            if peer.name != setup.publisher:
                relayed[peer.name] = relayed.get(peer.name, 0) + stop - first
    victim = max(sorted(relayed), key=lambda n: relayed[n])
    return replace(setup, kills=((at, victim),)), victim


@dataclass
class Row:
    what: str
    seconds: float
    bound: float
    note: str = ""

    def text(self) -> str:
        return (f"{self.what:<44} {self.seconds:>8.3f} {self.bound:>8.3f} "
                f"{self.seconds / self.bound:>7.3f}  {self.note}")


def sources_note(result: Result, publisher: str, size: int) -> str:
    others = sum(n for by in result.bytes_by_source.values()
                 for src, n in by.items() if src != publisher)
    return f"{others / size:.2f} x size from readers"


def incremental(setup: Setup) -> list[tuple[str, Setup]]:
    """``setup`` planned one reader at a time as each starts, as the coordinator does:
    with rebuilds and re-asks, and without (each joiner attached, nobody moved)."""
    return [("plan made as readers ask", replace(setup, incremental_plan=True)),
            ("... no rebuild, no re-ask", replace(setup, incremental_plan=True,
                                                  rebuild=False, reask=False))]


def incremental_note(res: Result) -> str:
    return (f"{res.asks} asks, {res.replans} newer plans moved chunks"
            if res.replans or res.asks > len(res.done) else "nobody moved")


def run(o: Options) -> tuple[list[Row], list[dict[str, Any]], dict[str, Any]]:
    rows: list[Row] = []
    figures: list[dict[str, Any]] = []
    size = o.size

    fan = one_dc(o)
    bound = fluid_bound_of(fan)
    res = simulate(fan)
    rows.append(Row(f"fan-out, 1 DC, {o.hosts} hosts, plan", res.end, bound,
                    f"{sources_note(res, 'h0', size)}; {res.events} events"))
    figures.append(figure("sim_fanout_vs_fluid_bound", res.end / bound, "x", 1.15, "lower"))
    for what, setup in incremental(fan):
        inc = simulate(setup)
        rows.append(Row(f"fan-out, 1 DC, {what}", inc.end, bound, incremental_note(inc)))
    if o.hosts <= BASELINE_HOSTS:
        star = simulate(one_dc(o, plan=False))
        rows.append(Row("fan-out, 1 DC, no plan (gossip only)", star.end, bound,
                        sources_note(star, "h0", size)))

    single = simulate(chain(o, 1))
    deep = simulate(chain(o, o.depth))
    link = size / (o.nic_mbit * MBIT)
    rows.append(Row("single hop, h0 -> h1", single.end, link, "bound: the link time"))
    rows.append(Row(f"chain of {o.depth}, h0 -> h1 -> ... -> h{o.depth}", deep.end, link,
                    "levels done at " + ", ".join(
                        f"{deep.done[f'h{i}']:.3f}" for i in range(1, o.depth + 1))))
    floor = 1 + (o.depth - 1) / o.chunks
    rows.append(Row(f"chunk-pipeline floor: link + {o.depth - 1} chunk times",
                    link * floor, link))
    figures.append(figure("sim_chain4_time_vs_single" if o.depth == 4 else
                          f"sim_chain{o.depth}_time_vs_single", deep.end / single.end, "x",
                          1.3, "lower"))

    dcs = two_dc(o)
    bound2 = fluid_bound_of(dcs)
    res2 = simulate(dcs)
    rows.append(Row(f"fan-out, 2 DCs, WAN {o.wan_mbit:g} Mbit {o.wan_rtt * 1e3:g} ms, plan",
                    res2.end, bound2, f"{res2.wan_bytes / size:.3f} x size crossed DCs"))
    figures.append(figure("sim_interdc_bytes_vs_size", res2.wan_bytes / size, "x", 1.05,
                          "lower"))
    figures.append(figure("sim_2dc_fanout_vs_fluid_bound", res2.end / bound2, "x", 1.25,
                          "lower"))
    for i, (what, setup) in enumerate(incremental(dcs)):
        inc = simulate(setup)
        rows.append(Row(f"fan-out, 2 DCs, {what}", inc.end, bound2, incremental_note(inc)))
        if i == 0:  # with rebuilds and re-asks, as the peers run
            figures.append(figure("sim_2dc_asked_plan_vs_at_once", inc.end / res2.end, "x",
                                  1.1, "lower"))
    if o.hosts <= BASELINE_HOSTS:
        flat = simulate(two_dc(o, plan=False))
        rows.append(Row("fan-out, 2 DCs, no plan (gossip only)", flat.end, bound2,
                        f"{flat.wan_bytes / size:.3f} x size crossed DCs"))

    killed, victim = with_kill(fan, 0.4 * bound)
    res3 = simulate(killed)
    live = len(fan.readers) - 1
    rows.append(Row(f"fan-out, 1 DC, plan, relay {victim} killed at {0.4 * bound:.2f} s",
                    res3.end, bound, f"{len(res3.done)}/{live} live readers done, "
                    f"{res3.resourced} chunks re-sourced"))
    figures.append(figure("sim_kill_live_readers_done", len(res3.done) / live, "share",
                          1.0, "higher"))
    settings = {"hosts": o.hosts, "chunks": o.chunks, "chunk_bytes": o.chunk_size,
                "size_bytes": size, "nic_mbit": o.nic_mbit, "wan_mbit": o.wan_mbit,
                "wan_rtt_s": o.wan_rtt, "rtt_s": o.rtt, "depth": o.depth,
                "gossip_delay_s": o.gossip_delay, "seed": o.seed,
                "socket_window_bytes": o.socket_window,
                "network": "flow-level, max-min fair, store-and-forward per chunk",
                "trace": res.trace[:16]}
    return rows, figures, settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.transfer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=8, help="hosts, the trainer included")
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--nic-mbit", type=float, default=400.0)
    parser.add_argument("--wan-mbit", type=float, default=400.0)
    parser.add_argument("--wan-rtt-ms", type=float, default=40.0)
    parser.add_argument("--rtt-ms", type=float, default=0.2, help="round trip in a DC")
    parser.add_argument("--depth", type=int, default=4, help="readers in the chain")
    parser.add_argument("--gossip-ms", type=float, default=10.0,
                        help="from a chunk landing to every peer seeing it advertised")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--socket-window-mib", type=float, default=0.0,
                        help="bytes one connection keeps in flight (caps its rate at "
                             "this / rtt; the session's socket_window); 0: no cap")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    a = parser.parse_args(argv)
    if a.hosts < 2 or a.chunks < 1 or a.depth < 1:
        parser.error("need --hosts >= 2, --chunks >= 1, --depth >= 1")
    o = Options(a.hosts, a.chunks, int(a.chunk_mib * (1 << 20)), a.nic_mbit, a.wan_mbit,
                a.wan_rtt_ms / 1e3, a.rtt_ms / 1e3, a.depth, a.gossip_ms / 1e3, a.seed,
                int(a.socket_window_mib * (1 << 20)))
    started = time.perf_counter()
    rows, figures, settings = run(o)
    settings["wall_s"] = round(time.perf_counter() - started, 2)
    print(f"{'what':<44} {'seconds':>8} {'bound':>8} {'x bound':>7}")
    for row in rows:
        print(row.text())
    print()
    print_figures(figures)
    if a.json:
        print(json.dumps({"figures": figures, "settings": settings}))
    return 0 if all(f["ok"] for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
