"""What users run today to move weights, measured inside an emulated cluster.

Three baselines, each returning the seconds from "go" until every receiver holds the
trainer's bytes (the receivers' SHA-256 digests are checked against the trainer's after
the clock stops; hashing is not timed, as these tools do not verify):

* :func:`star` -- every receiver pulls the bytes from the trainer over one plain TCP
  connection (``sendall`` of a memoryview -> ``recv_into``), one process per host;
* :func:`gloo_broadcast` -- ``torch.distributed.broadcast`` with the gloo backend, the
  trainer is rank 0 (the CPU stand-in for an NCCL stop-and-broadcast stage);
* :func:`ray_object_store` -- a Ray head node on the trainer host and a worker node on each
  receiver host; ``ray.put`` on the trainer, then ``ray.get`` (an actor argument) on every
  receiver host.

Host 0 is the trainer; every other host of the cluster receives. Workers run this file by
path (``python baselines.py _worker ...``), so they start without importing TensorHub and
need only the standard library plus torch or ray. Protocol with a worker: it prints
``ready [digest]`` when set up, reads one line (go) from stdin, does the transfer and prints
one JSON line ``{"end": monotonic, "digest": ..., "bytes": ...}``; the clock on Linux is
system-wide, so ends from all namespaces compare with the harness's start. torch and ray
are the optional ``bench`` extra and are imported only inside workers.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorhub.testing.netns import Cluster

_SELF = str(Path(__file__).resolve())
_PORT = 29500
_SETUP_TIMEOUT_S = 300.0
_RUN_TIMEOUT_S = 600.0


class BaselineError(RuntimeError):
    """A baseline failed to run or delivered wrong bytes; says which host and why."""


# -- harness side -----------------------------------------------------------------------


def star(cluster: Cluster, size: int) -> float:
    """Every receiver pulls ``size`` bytes from the trainer over TCP; seconds."""
    trainer, receivers = cluster.hosts[0], cluster.hosts[1:]
    server = _worker(cluster, trainer.name, "star-serve", str(size), str(len(receivers)))
    digest = _ready(server)
    clients = [_worker(cluster, h.name, "star-pull", trainer.ip, str(size)) for h in receivers]
    for client in clients:
        _ready(client)
    seconds = _timed(clients, digest, size)
    server.wait(timeout=30)  # frees the port for the next baseline
    return seconds


def gloo_broadcast(cluster: Cluster, size: int) -> float:
    """``torch.distributed.broadcast`` (gloo) from the trainer to every host; seconds."""
    trainer = cluster.hosts[0]
    ranks = [
        _worker(cluster, h.name, "gloo", trainer.ip, str(size), str(rank), str(len(cluster.hosts)))
        for rank, h in enumerate(cluster.hosts)
    ]
    digests = [_ready(rank) for rank in ranks]
    return _timed(ranks, digests[0], size)


def ray_object_store(cluster: Cluster, size: int) -> float:
    """``ray.put`` on the trainer, ``ray.get`` on every receiver host; seconds.

    Starts a Ray head node on the trainer and a worker node per receiver (one at a time:
    parallel starts collide), each with its own temp dir, and ends them all afterwards.
    """
    trainer = cluster.hosts[0]
    temp_root = cluster.scratch_dir / "ray"
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",  # worker nodes fail with InvalidAuthToken otherwise
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    store = 2 * size + 128 * 1024 * 1024
    try:
        for host in cluster.hosts:
            node = (
                ["--head", "--port", "6379", "--include-dashboard", "false"]
                if host is trainer
                else ["--address", f"{trainer.ip}:6379"]
            )
            argv = [sys.executable, "-m", "ray.scripts.scripts", "start", *node,
                    "--node-ip-address", host.ip, "--num-cpus", "1",
                    "--resources", json.dumps({f"host_{host.name}": 1}),
                    "--object-store-memory", str(store),
                    "--temp-dir", str(temp_root / host.name), "--disable-usage-stats"]  # fmt: skip
            started = cluster.run(host, argv, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)  # fmt: skip
            out, _ = started.communicate(timeout=_SETUP_TIMEOUT_S)
            if started.returncode != 0:
                raise BaselineError(f"ray start on {host.name} failed:\n{out[-2000:]}")
        receivers = ",".join(h.name for h in cluster.hosts[1:])
        driver = _worker(cluster, trainer.name, "ray-driver", f"{trainer.ip}:6379", str(size),
                         receivers, env=env)  # fmt: skip
        return _timed([driver], _ready(driver), size)
    finally:
        for host in cluster.hosts:
            cluster.end_processes(host)
        shutil.rmtree(temp_root, ignore_errors=True)  # teardown removes it too


def star_bound_s(cluster: Cluster, size: int) -> float:
    """Fluid bound of the star: the trainer's upload, the slowest receiver's download, and
    each remote DC's link from the trainer's DC."""
    trainer, receivers = cluster.hosts[0], cluster.hosts[1:]
    bound = max(len(receivers) * size / (trainer.nic_mbit * 1e6 / 8),
                max((size / (h.nic_mbit * 1e6 / 8) for h in receivers), default=0.0))
    for dc in range(cluster.dcs):
        if dc != trainer.dc:
            remote = sum(1 for h in cluster.hosts if h.dc == dc)
            bound = max(bound, remote * size / cluster.spec.link(trainer.dc, dc).bytes_per_s)
    return bound


BASELINES: dict[str, Callable[[Cluster, int], float]] = {
    "star": star,
    "gloo": gloo_broadcast,
    "ray": ray_object_store,
}


def _worker(cluster: Cluster, host: str, *args: str, env: dict[str, str] | None = None) -> (
    subprocess.Popen[str]
):
    return cluster.run(
        host, [sys.executable, _SELF, "_worker", *args], env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _line(process: subprocess.Popen[str], timeout_s: float) -> str:
    # Imported here, not at the top: workers run this file by path, without the package.
    from tensorhub.testing.netns import read_line

    try:
        return read_line(process, timeout_s)
    except (TimeoutError, EOFError) as error:
        raise BaselineError(str(error)) from error


def _ready(process: subprocess.Popen[str]) -> str:
    word, _, digest = _line(process, _SETUP_TIMEOUT_S).partition(" ")
    if word != "ready":
        raise BaselineError(f"{process.args!r} said {word!r} instead of ready")
    return digest


def _timed(workers: Sequence[subprocess.Popen[str]], digest: str, size: int) -> float:
    """Say go to ready workers; check their bytes; return seconds to the last one's end."""
    start = time.monotonic()
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
    ends = []
    for worker in workers:
        for result in _results(_line(worker, _RUN_TIMEOUT_S)):
            if result["bytes"] != size or result["digest"] != digest:
                raise BaselineError(f"{worker.args!r} got wrong bytes: {result}")
            ends.append(float(result["end"]))
        worker.wait(timeout=30)
    return max(ends) - start


def _results(line: str) -> list[dict[str, Any]]:
    decoded = json.loads(line)
    return decoded if isinstance(decoded, list) else [decoded]


# -- worker side (runs inside a namespace, by path) ---------------------------------------


def _serve_star(size: int, connections: int) -> None:
    import socket
    import threading

    payload = os.urandom(size)
    listener = socket.create_server(("0.0.0.0", _PORT), backlog=connections)
    print("ready", hashlib.sha256(payload).hexdigest(), flush=True)
    senders = []
    for _ in range(connections):
        conn, _ = listener.accept()
        senders.append(threading.Thread(target=conn.sendall, args=(memoryview(payload),)))
        senders[-1].start()
    for sender in senders:
        sender.join()


def _pull_star(ip: str, size: int, go: IO[str]) -> dict[str, Any]:
    import socket

    buffer = bytearray(b"\0") * size  # pre-faulted
    view = memoryview(buffer)
    print("ready", flush=True)
    go.readline()
    got = 0
    with socket.create_connection((ip, _PORT)) as conn:
        while got < size and (n := conn.recv_into(view[got:])):
            got += n
    end = time.monotonic()
    return {"end": end, "digest": hashlib.sha256(view[:got]).hexdigest(), "bytes": got}


def _gloo(ip: str, size: int, rank: int, world: int, go: IO[str]) -> dict[str, Any]:
    from datetime import timedelta

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no reverse-DNS warnings
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://{ip}:{_PORT}", rank=rank, world_size=world,
        timeout=timedelta(seconds=_RUN_TIMEOUT_S),
    )  # fmt: skip
    buffer = bytearray(os.urandom(size)) if rank == 0 else bytearray(b"\0") * size
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)  # shares ``buffer``
    dist.barrier()
    print("ready", hashlib.sha256(buffer).hexdigest() if rank == 0 else "", flush=True)
    go.readline()
    dist.broadcast(tensor, src=0)
    end = time.monotonic()
    dist.destroy_process_group()
    return {"end": end, "digest": hashlib.sha256(buffer).hexdigest(), "bytes": len(buffer)}


def _ray_driver(address: str, size: int, receivers: list[str], go: IO[str]) -> list[dict[str, Any]]:
    import logging

    import numpy as np
    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)

    class Receiver:
        def ping(self) -> bool:
            return True

        def take(self, array: Any) -> dict[str, Any]:  # Ray resolved the ref: bytes are here
            end = time.monotonic()
            return {"end": end, "digest": hashlib.sha256(array).hexdigest(), "bytes": array.nbytes}

    actor_class: Any = ray.remote(num_cpus=0)(Receiver)
    actors = [actor_class.options(resources={f"host_{h}": 1}).remote() for h in receivers]
    ray.get([actor.ping.remote() for actor in actors])
    raw = os.urandom(size)
    payload = np.frombuffer(raw, dtype=np.uint8)
    print("ready", hashlib.sha256(raw).hexdigest(), flush=True)
    go.readline()
    ref = ray.put(payload)
    results: list[dict[str, Any]] = ray.get([actor.take.remote(ref) for actor in actors])
    return results


def _worker_main(kind: str, args: list[str]) -> None:
    go = sys.stdin
    result: dict[str, Any] | list[dict[str, Any]]
    if kind == "star-serve":
        _serve_star(int(args[0]), int(args[1]))
        return
    if kind == "star-pull":
        result = _pull_star(args[0], int(args[1]), go)
    elif kind == "gloo":
        result = _gloo(args[0], int(args[1]), int(args[2]), int(args[3]), go)
    elif kind == "ray-driver":
        result = _ray_driver(args[0], int(args[1]), args[2].split(","), go)
    else:
        raise SystemExit(f"unknown worker {kind!r}")
    print(json.dumps(result), flush=True)


# -- command line -----------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
_EXTRAS = {"gloo": ("torch", "pip install torch==2.13.0"), "ray": ("ray", "pip install ray")}


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864 (B, KiB, MiB, GiB; case-insensitive)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64MiB)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_chunk(text: str) -> int:
    """``--chunk``: ``"auto"`` -> 0 (the system chooses from the version's size), else a
    size as :func:`parse_size` reads it."""
    return 0 if text.strip().lower() == "auto" else parse_size(text)


def chunk_text(chunk: int, size: int) -> str:
    """How a benchmark's header says its chunk size: forced, or what ``auto`` gives."""
    from ..protocol.sizing import choose_chunk_size

    if chunk:
        return f"chunk {chunk / 2**20:g} MiB (forced)"
    auto, _ = choose_chunk_size(size)
    return f"chunk auto ({auto / 2**20:g} MiB for this size)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tensorhub.bench.baselines",
        description="Time star TCP, gloo broadcast and Ray's object store in an emulated "
        "cluster: host 0 is the trainer, --hosts more hosts receive.",
    )
    parser.add_argument("--hosts", type=int, default=8, help="receiving hosts (+1 trainer)")
    parser.add_argument("--nic-mbit", type=float, default=400.0)
    parser.add_argument("--size", type=parse_size, default=parse_size("64MiB"))
    parser.add_argument("--dcs", type=int, default=1)
    parser.add_argument("--wan-mbit", type=float, default=None)
    parser.add_argument("--wan-delay-ms", type=float, default=0.0, help="added round trip")
    parser.add_argument("--baselines", default="star,gloo,ray", help="comma-separated")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.baselines.split(",") if name.strip()]
    for name in chosen:
        if name not in BASELINES:
            parser.error(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
        if name in _EXTRAS and importlib.util.find_spec(_EXTRAS[name][0]) is None:
            parser.error(f"{name} needs {_EXTRAS[name][0]}: {_EXTRAS[name][1]} (bench extra)")

    from tensorhub.testing.netns import open_cluster

    seconds: dict[str, float] = {}
    wan_bytes: dict[str, int] = {}
    with open_cluster(
        args.hosts + 1, args.nic_mbit, dcs=args.dcs, wan_mbit=args.wan_mbit,
        wan_delay_ms=args.wan_delay_ms,
    ) as cluster:  # fmt: skip
        bound = star_bound_s(cluster, args.size)
        for name in chosen:
            wan_before = cluster.wan_bytes() if cluster.dcs > 1 else 0
            seconds[f"{name}_s"] = took = BASELINES[name](cluster, args.size)
            line = f"{name:>6}  {took:7.2f} s  {took / bound:5.2f} x star bound"
            if cluster.dcs > 1:
                wan_bytes[f"{name}_wan_bytes"] = crossed = cluster.wan_bytes() - wan_before
                line += f"  {crossed / args.size:5.2f} x size crossed the WAN"
            print(line, flush=True)
    print(f"{'bound':>6}  {bound:7.2f} s  (star fluid bound)")
    if args.json:
        settings = {
            "hosts": args.hosts + 1, "receivers": args.hosts, "nic_mbit": args.nic_mbit,
            "size_bytes": args.size, "dcs": args.dcs, "wan_mbit": args.wan_mbit,
            "wan_delay_ms": args.wan_delay_ms, "mtu": cluster.mtu,
        }  # fmt: skip
        figures = [{"name": k, "value": round(v, 3), "unit": "s"} for k, v in seconds.items()]
        baselines = {**seconds, "star_bound_s": bound, **wan_bytes}
        print(json.dumps({"figures": figures, "settings": settings, "baselines": baselines}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_worker"]:
        _worker_main(sys.argv[2], sys.argv[3:])
    else:
        try:
            sys.exit(main())
        except KeyboardInterrupt:
            print("interrupted; the cluster was removed", file=sys.stderr)
            sys.exit(130)
