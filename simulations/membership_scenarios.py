"""Membership scenarios of issue 3: detection, false positives, convergence,
partitions, restarts, control-plane cost and simulator speed.

Each scenario restores a warm cluster (``Context.warm``: every peer knows every other
and gossip has gone quiet) under each seed, injects its faults at virtual times drawn
from the simulation's rng, watches the peers' MemberEvents and views, and reports
figures next to bounds derived from the PeerConfig timers:

* detection within ``M_PROBES*T_probe + suspicion_max + C_ROUNDS*log2(N)*T_gossip``;
* dissemination within ``C_ROUNDS*log2(N)`` gossip rounds;
* one view after a heal within ``push_pull_interval + C_ROUNDS*log2(N)*T_gossip``;
* a restarted peer alive everywhere within ``push_pull_interval``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial

from tensorhub.protocol.membership import ALIVE, MemberEvent, Membership
from tensorhub.protocol.suspicion import suspicion_bounds

from .engine import Simulation
from .report import (
    C_ROUNDS,
    M_PROBES,
    Context,
    Figure,
    one_view,
    percentile,
    run_checked,
    scenario,
)


def detect_bound(ctx: Context, n: int) -> float:
    cfg = ctx.config
    _, high = suspicion_bounds(cfg.suspicion_mult, cfg.suspicion_max_mult, n, cfg.probe_interval)
    return M_PROBES * cfg.probe_interval + high + C_ROUNDS * math.log2(n) * cfg.gossip_interval


def heal_bound(ctx: Context, n: int) -> float:
    return ctx.config.push_pull_interval + C_ROUNDS * math.log2(n) * ctx.config.gossip_interval


def _names(sim: Simulation) -> dict[str, int]:
    return {info.name: i for i, info in enumerate(sim.infos)}


@scenario("crash_detection")
def crash_detection(ctx: Context) -> list[Figure]:
    """Three peers crash at random times; every live peer must mark each dead."""
    n = ctx.nodes
    bound = detect_bound(ctx, n)
    everyone: list[float] = []
    first: list[float] = []
    false_deaths = 0
    for seed in ctx.seed_list(ctx.seeds):
        times, falses = _detect_run(ctx, n, seed, bound)
        everyone += [max(t) for t in times]
        first += [min(t) for t in times]
        false_deaths += falses
    p50, p99 = percentile(everyone, 50), percentile(everyone, 99)
    detail = (f"N={n}, {len(everyone)} crashes over {ctx.seeds} seeds; all peers know: "
              f"p50 {p50:.1f} s, p99 {p99:.1f} s, max {max(everyone):.1f} s; first peer: "
              f"p50 {percentile(first, 50):.1f} s; false deaths {false_deaths}")
    return [
        Figure("detect_p99_s", p99, "s", round(bound, 1), "lower", detail),
        Figure("detect_max_over_bound", max(everyone) / bound, "", 1.0, "lower",
               f"bound {bound:.1f} s = {M_PROBES:g}*T_probe + suspicion_max + "
               f"{C_ROUNDS:g}*log2(N)*T_gossip"),
    ]


def _detect_run(ctx: Context, n: int, seed: int, bound: float) -> tuple[list[list[float]], int]:
    """Per victim, each live peer's detection delay (inf: never); and false deaths."""
    sim = ctx.sim(n, seed)
    names = _names(sim)
    start = sim.now
    victims = sim.rng.sample(range(n), 3)
    crashed_at: dict[int, float] = {}
    dead_at: dict[int, dict[int, float]] = {v: {} for v in victims}
    false_deaths = 0

    def watch(now: float, i: int, events: list[MemberEvent]) -> None:
        nonlocal false_deaths
        for e in events:
            if e.kind == "dead":
                if names[e.name] in dead_at:
                    dead_at[names[e.name]].setdefault(i, now)
                else:
                    false_deaths += 1

    def crash(v: int) -> None:
        crashed_at[v] = sim.now
        sim.crash(v)

    def detected() -> bool:
        live = sim.live()
        return len(crashed_at) == len(victims) and all(
            all(i in seen for i in live) for seen in dead_at.values())

    sim.observers.append(watch)
    for k, v in enumerate(victims):
        sim.at(start + 5 + 10 * k + 5 * sim.rng.random(), partial(crash, v))
    run_checked(sim, start + 35 + 2 * bound, 0.5, detected)
    ctx.record(sim)
    return [[dead_at[v].get(i, math.inf) - crashed_at.get(v, 0.0) for i in sim.live()]
            for v in victims], false_deaths


@scenario("false_positives")
def false_positives(ctx: Context) -> list[Figure]:
    """5% of peers pause for 1-3x the probe timeout every 2-8 s, with 10% loss on
    their links, for ``ctx.hour`` virtual seconds; nobody has crashed."""
    n = ctx.nodes
    counts = {"dead": 0, "suspect": 0, "refuted": 0}
    for seed in ctx.seed_list(ctx.hour_seeds):
        sim = ctx.sim(n, seed)
        start = sim.now
        slowed = sim.rng.sample(range(n), max(1, n // 20))

        def watch(now: float, i: int, events: list[MemberEvent]) -> None:
            for e in events:
                if e.kind in counts:
                    counts[e.kind] += 1

        sim.observers.append(watch)
        for i in slowed:
            sim.extra_loss[i] = 0.10
            sim.at(start + sim.rng.uniform(0, 8), partial(_stall, sim, i, ctx.config.probe_timeout))
        sim.run_until(start + ctx.hour)
        counts["refuted"] += sum(node.incarnation for node in sim.nodes if node)
        ctx.record(sim)
    return [Figure("false_deaths", counts["dead"], "", 0, "lower",
                   f"N={n}, {max(1, n // 20)} slowed peers, {ctx.hour:g} s virtual x "
                   f"{ctx.hour_seeds} seeds; {counts['suspect']} suspect events, "
                   f"{counts['refuted']} refutations")]


def _stall(sim: Simulation, i: int, probe_timeout: float) -> None:
    """Pause peer ``i`` for 1-3 probe timeouts, then again after 2-8 s, forever."""
    pause = sim.rng.uniform(1, 3) * probe_timeout
    sim.pause(i, pause)
    sim.at(sim.now + pause + sim.rng.uniform(2, 8), partial(_stall, sim, i, probe_timeout))


@scenario("convergence")
def convergence(ctx: Context) -> list[Figure]:
    """A new peer joins (through 3 random seeds); rounds until all N peers list it."""
    n = ctx.nodes
    worst: dict[float, float] = {}
    for seed in ctx.seed_list(ctx.seeds):
        sim = ctx.sim(n, seed)
        for loss in (0.0, 0.05, 0.20):
            sim.link = dataclasses.replace(ctx.link, loss=loss)
            took, others = _join_run(sim, n)
            c = took / ctx.config.gossip_interval / math.log2(others)
            worst[loss] = max(worst.get(loss, 0.0), c)
            sim.link = ctx.link
            sim.run_until(sim.now + 10)  # let the news settle before the next join
        ctx.record(sim)
    detail = ", ".join(f"c at {loss:.0%} loss: {c:.2f}" for loss, c in worst.items())
    return [Figure("converge_rounds_c", max(worst.values()), "", C_ROUNDS, "lower",
                   f"N={n}, {ctx.seeds} seeds, worst case; {detail}")]


def _join_run(sim: Simulation, n: int) -> tuple[float, int]:
    """Seconds until every other live peer lists a new joiner; how many peers that is."""
    j = sim.add_node()
    name = sim.infos[j].name
    joined: dict[int, float] = {}

    def watch(now: float, i: int, events: list[MemberEvent]) -> None:
        for e in events:
            if e.kind == "joined" and e.name == name:
                joined.setdefault(i, now)

    sim.observers[:] = [watch]
    started = sim.now
    sim.start(j, [sim.infos[k].control for k in sim.rng.sample(range(n), 3)])
    others = [i for i in sim.live() if i != j]
    run_checked(sim, started + 120, 0.1, lambda: all(i in joined for i in others))
    return max(joined.get(i, math.inf) for i in others) - started, len(others)


def _groups(sim: Simulation, n: int, shape: str) -> list[int]:
    size = {"halves": n // 2, "minority": max(2, n // 20), "isolated": 1}[shape]
    cut = set(sim.rng.sample(range(n), size))
    return [1 if i in cut else 0 for i in range(n)]


@scenario("partitions")
def partitions(ctx: Context) -> list[Figure]:
    """Halves, a 5% minority and a single peer cut off for each duration, then healed:
    time from the heal until every live peer holds the same, complete view."""
    n = ctx.partition_nodes
    bound = heal_bound(ctx, n)
    worst = (0.0, "")
    for seed in ctx.seed_list(ctx.partition_seeds):
        for shape in ("halves", "minority", "isolated"):
            for duration in ctx.partition_durations:
                sim = ctx.sim(n, seed)
                sim.partition(_groups(sim, n, shape))
                sim.run_until(sim.now + duration)
                sim.heal()
                healed = sim.now
                done = run_checked(sim, healed + 3 * bound, 0.5, partial(one_view, sim))
                took = sim.now - healed if done else math.inf
                if took / bound >= worst[0]:
                    worst = (took / bound, f"{shape} for {duration:g} s: {took:.1f} s")
                ctx.record(sim)
    return [Figure("partition_heal_over_bound", worst[0], "", 1.0, "lower",
                   f"N={n}, {ctx.partition_seeds} seeds, durations "
                   f"{'/'.join(f'{d:g}' for d in ctx.partition_durations)} s; worst {worst[1]}; "
                   f"bound {bound:.1f} s = push_pull + {C_ROUNDS:g}*log2(N)*T_gossip")]


@scenario("restart")
def restart(ctx: Context) -> list[Figure]:
    """A peer crashes and restarts (incarnation 0) 10-50 s later, while the others
    still hold it suspect or dead; time until every peer holds it alive again."""
    n = ctx.nodes
    bound = ctx.config.push_pull_interval
    took: list[float] = []
    held: list[float] = []
    for seed in ctx.seed_list(ctx.seeds):
        sim = ctx.sim(n, seed)
        for victim in sim.rng.sample(range(n), 2):
            sim.crash(victim)
            sim.run_until(sim.now + sim.rng.uniform(10, 50))
            name = sim.infos[victim].name
            live = sim.live()
            states = [sim.nodes[i].members().get(name) for i in live]  # type: ignore[union-attr]
            held.append(sum(s is None or s.status != ALIVE for s in states) / len(states))
            node = sim.start(victim, [sim.infos[k].control for k in sim.rng.sample(live, 3)])
            started = sim.now
            done = run_checked(sim, started + 3 * bound, 0.1, partial(_rejoined, sim, node))
            took.append(sim.now - started if done else math.inf)
            sim.run_until(sim.now + 5)
        ctx.record(sim)
    return [Figure("restart_rejoin_over_bound", max(took) / bound, "", 1.0, "lower",
                   f"N={n}, {len(took)} restarts; at restart {min(held):.0%}-{max(held):.0%} "
                   f"of peers held it suspect/dead; p50 {percentile(took, 50):.1f} s, "
                   f"max {max(took):.1f} s; bound push_pull_interval {bound:g} s")]


def _rejoined(sim: Simulation, node: Membership) -> bool:
    """Every live peer holds ``node`` alive at its current incarnation."""
    for i in sim.live():
        s = sim.nodes[i].members().get(node.me.name)  # type: ignore[union-attr]
        if s is None or s.status != ALIVE or s.incarnation != node.incarnation:
            return False
    return True


@scenario("gossip_cost")
def gossip_cost(ctx: Context) -> list[Figure]:
    """Control-plane bytes sent per peer per second in steady state, N=16 vs N=1024."""
    duration = 120.0
    rates = {}
    for n in (16, 1024):
        sim = ctx.sim(n, 1)
        sim.measure_bytes = True
        sim.run_until(sim.now + duration)
        rates[n] = sim.bytes_sent / n / duration
        ctx.record(sim)
    return [Figure("gossip_bytes_ratio_1024_vs_16", rates[1024] / rates[16], "", 1.5, "lower",
                   f"{rates[16]:.0f} B/peer/s at N=16, {rates[1024]:.0f} at N=1024 "
                   f"(steady state, all messages incl. push-pull, msgpack of the fields)")]


@scenario("speed")
def speed(ctx: Context) -> list[Figure]:
    """1,000 peers for 10 virtual minutes from a cold start (bootstrap included),
    1% loss, a crash every minute and a restart of each 20 s later."""
    started = time.perf_counter()
    sim = Simulation(1, ctx.config, dataclasses.replace(ctx.link, loss=0.01))
    sim.bootstrap(1000)
    for k in range(9):
        victim = sim.rng.randrange(1, 1000)
        sim.at(60.0 * (k + 1), partial(sim.crash, victim))
        sim.at(60.0 * (k + 1) + 20, partial(sim.start, victim, [sim.infos[0].control]))
    sim.run_until(600.0)
    wall = time.perf_counter() - started
    ctx.record(sim)
    return [Figure("wall_s_1000x10min", wall, "s", 180.0, "lower",
                   f"{sim.delivered} messages delivered, {sim.delivered / wall:.0f} per wall s")]
