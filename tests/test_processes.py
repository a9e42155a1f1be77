"""Real peer processes on 127.0.0.1, driven through the demo worker's line protocol."""

from __future__ import annotations

import sys

from tensorhub.processes import LineProcess, free_ports

SIZE = 24 << 20


def spawn(procs: list[LineProcess], name: str, role: str, port: int, seed: str,
          expect: int) -> LineProcess:
    argv = [sys.executable, "-m", "tensorhub.ops.demo", "worker", "--name", name, "--role", role,
            "--listen", f"127.0.0.1:{port}", "--size", str(SIZE), "--expect", str(expect)]
    if seed:
        argv += ["--join", seed]
    p = LineProcess(name, argv)
    procs.append(p)
    return p


def test_publisher_and_three_fetchers_started_one_after_another(procs: list[LineProcess]) -> None:
    ports = free_ports(4)
    seed = f"127.0.0.1:{ports[0]}"
    pub = spawn(procs, "pub", "trainer", ports[0], "", 4)
    fetchers = [spawn(procs, f"f{i}", "rollout", ports[i + 1], seed, 4) for i in range(3)]
    for p in procs:
        p.expect("ready", 60)
    pub.send("publish 1")
    published = pub.expect("published", 60)
    sources = []
    for i, f in enumerate(fetchers):
        f.send(f"fetch 1 {i + 1}")  # start once the earlier fetchers are known holders
        ev = f.expect("fetched", 120)
        assert ev["version"] == 1
        assert ev["report"]["verified"] is True
        assert ev["checksum"] == published["checksum"]  # bytes equal the publisher's
        sources.append(ev["report"]["bytes_by_source"])
    # asserted from the peers' own statistics, not assumed
    stats = []
    for f in fetchers:
        f.send("stats")
        stats.append(f.expect("stats", 30))
    non_publisher = [s for s in stats if set(s["bytes_fetched_by_source"]) - {"pub"}]
    assert non_publisher, f"every fetcher read only from the publisher: {stats}"
    assert sum(st["bytes_served"] for st in stats) > 0  # fetchers served each other
    assert sources[0] == {"pub": sources[0]["pub"]}
