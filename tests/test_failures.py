"""Real processes: a peer killed with SIGKILL is seen dead by all, its references vanish."""

from __future__ import annotations

import math
import signal
import sys
import time

from helpers import wait_until_sync

from tensorhub import PeerConfig
from tensorhub.processes import LineProcess, free_ports
from tensorhub.protocol.suspicion import suspicion_bounds

N = 6
SIZE = 4 << 20


def detection_bound(cfg: PeerConfig, n: int) -> float:
    """m*T_probe + suspicion_max + c*log2(N)*T_gossip with m = 3, c = 3 (issue 3)."""
    _, suspicion_max = suspicion_bounds(cfg.suspicion_mult, cfg.suspicion_max_mult, n,
                                        cfg.probe_interval)
    return 3 * cfg.probe_interval + suspicion_max + 3 * math.log2(n) * cfg.gossip_interval


def test_kill_9_is_detected_everywhere_and_references_disappear(procs: list[LineProcess]) -> None:
    ports = free_ports(N)
    seed = f"127.0.0.1:{ports[0]}"
    for i in range(N):
        argv = [sys.executable, "-m", "tensorhub.ops.demo", "worker", "--name", f"p{i}",
                "--role", "trainer" if i == 0 else "rollout", "--listen",
                f"127.0.0.1:{ports[i]}", "--size", str(SIZE), "--expect", str(N)]
        procs.append(LineProcess(f"p{i}", argv + (["--join", seed] if i else [])))
    for p in procs:
        p.expect("ready", 60)
    procs[0].send("publish 1")
    procs[0].expect("published", 60)
    victim = procs[3]
    victim.send("fetch 1")
    victim.expect("fetched", 60)
    survivors = [p for p in procs if p is not victim]

    def views() -> list[dict[str, object]]:
        out = []
        for p in survivors:
            p.send("stats")
            out.append(p.expect("stats", 30))
        return out

    wait_until_sync(lambda: all("p3" in v["holders"].get("demo-llm@1", [])  # type: ignore[union-attr]
                                for v in views()), 30, every=0.1,
                    what="the victim showing up as a holder")

    bound = detection_bound(PeerConfig.local("x"), N)
    victim.p.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    vs: list[dict[str, object]] = []

    def all_see_p3_dead() -> bool:
        vs[:] = views()
        return all(v["members"].get("p3") == "dead" for v in vs)  # type: ignore[union-attr]

    wait_until_sync(all_see_p3_dead, bound - (time.monotonic() - killed), every=0.05,
                    what=f"all seeing p3 dead (bound {bound:.1f} s from the kill)")
    for v in vs:
        assert "p3" not in v["holders"].get("demo-llm@1", []), v  # type: ignore[union-attr]
        assert v["holders"]["demo-llm@1"]  # type: ignore[index]
