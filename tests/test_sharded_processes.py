"""Real processes: 4 publisher ranks (TP=4 along dim 0) and 2 consuming groups of TP=2
(split along dim 1, so every fetch reshards), three versions, bytes checked against
numpy slicing in each consumer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import tensorhub
from tensorhub.processes import LineProcess, free_ports

WORKER = str(Path(__file__).with_name("sharded_worker.py"))


def test_tp4_publish_two_tp2_groups_three_versions(procs: list[LineProcess],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # the worker is a script: let it import the tensorhub these tests run against
    root = str(Path(tensorhub.__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    names = [f"t{r}" for r in range(4)] + [f"g{g}r{k}" for g in range(2) for k in range(2)]
    # Every port from one call, data ports too: a data port the kernel picked for one
    # worker could be a control port handed to a worker that has not bound it yet.
    ports = free_ports(2 * len(names))
    seed = f"127.0.0.1:{ports[0]}"
    by_name: dict[str, LineProcess] = {}
    for i, name in enumerate(names):
        argv = [sys.executable, WORKER, "--name", name, "--listen", f"127.0.0.1:{ports[i]}",
                "--data-listen", f"127.0.0.1:{ports[len(names) + i]}",
                "--expect", str(len(names))]
        if name.startswith("t"):
            argv += ["--role", "publisher", "--rank", name[1]]
        else:
            argv += ["--role", "consumer", "--group", name[1], "--rank", name[3]]
        if i:
            argv += ["--join", seed]
        by_name[name] = p = LineProcess(name, argv)
        procs.append(p)
    for p in procs:
        p.expect("ready", 90)
    consumers = [n for n in names if n.startswith("g")]

    def send(name: str, **cmd: object) -> None:
        by_name[name].send(json.dumps(cmd))

    for v in (1, 2, 3):
        for r in range(3):
            send(f"t{r}", cmd="publish", version=v)
            by_name[f"t{r}"].expect("published", 30)
        # three of four ranks: the version does not exist for readers
        send("g1r1", cmd="latest")
        seen = by_name["g1r1"].expect("latest", 30)
        assert seen["version"] == (v - 1 if v > 1 else None), seen
        send("t3", cmd="publish", version=v)
        by_name["t3"].expect("published", 30)
        for n in consumers:
            send(n, cmd="switch", after=v - 1 if v > 1 else None)
        results = {n: by_name[n].expect("switched", 90) for n in consumers}
        for n, res in results.items():
            assert "error" not in res, (n, res)
            assert res["equal"] is True, (n, res)
        for g in range(2):  # both ranks of each group on the same, newest version
            assert results[f"g{g}r0"]["version"] == results[f"g{g}r1"]["version"] == v
    for p in procs:
        p.send(json.dumps({"cmd": "quit"}))
    for p in procs:
        assert p.p.wait(30) == 0
