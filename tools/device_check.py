"""Device check: GPU tensors through TensorHub on one GPU machine (<= 5 minutes on an H200).

The driver (this script without ``--role``) measures, in the same run:

- baselines: cupy's device-to-device copy, pinned host-to-device and device-to-host
  copies (``cudaMemcpy``), and a raw loopback TCP socket (``sendall`` -> ``recv_into``);
- a publisher process with ``--size`` bytes of GPU tensors (cupy arrays, and torch CUDA
  tensors when torch has CUDA), published in place (digests hashed on host copies made
  through the staging ring);
- a fetcher process per leg, fetching the version ``--runs`` times into its own GPU
  tensors: ``tcp`` (loopback TCP, chunks staged through pinned ring slots, checked
  there, then copied host-to-device) and ``cuda-ipc`` (the dial name of the CUDA IPC
  transport; where this build does not have it, the leg says so and is skipped).

It prints a table, then the figures ``ipc_vs_d2d`` (the IPC fetch's GB/s over cupy's
device-to-device copy) and ``staged_tcp_vs_min_link`` (the staged TCP fetch's GB/s over
the slowest link it crosses: loopback TCP, pinned H2D, pinned D2H), and with ``--json``
a JSON object as the last line.  Without a usable GPU it says why and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

TENSORS = 16
HOST = (("host", "this-gpu-host"),)
"""Both peers' ``host`` label: same-host transports (CUDA IPC) are dialled only between
peers whose labels say they share a host."""


def gpu_problem() -> str | None:
    try:
        import cupy
    except ImportError as exc:
        return f"cupy is not installed ({exc}); run tools/device_wheels.sh where the " \
               "registry is reachable and carry .whl/ along"
    try:
        if not cupy.cuda.is_available():
            return "cupy.cuda.is_available() is False (no driver or no GPU)"
    except Exception as exc:  # a broken CUDA library
        return f"cupy cannot reach CUDA: {exc}"
    return None


def torch_cuda() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def make_tensors(size: int, fill: bool) -> dict[str, Any]:
    """``TENSORS`` GPU tensors of ``size`` bytes in all: cupy float32, and torch bfloat16
    for every other one when torch has CUDA; filled with a pattern, or zeros."""
    import cupy
    per = size // TENSORS
    out: dict[str, Any] = {}
    use_torch = torch_cuda()
    for i in range(TENSORS):
        bits = (cupy.arange(per // 4, dtype=cupy.uint32) * cupy.uint32(2654435761 + i)) \
            if fill else cupy.zeros(per // 4, dtype=cupy.uint32)
        if use_torch and i % 2:
            import torch
            out[f"layer.{i}.bf16"] = torch.from_dlpack(bits.view(cupy.uint16)) \
                .view(torch.bfloat16).clone()
        else:
            out[f"layer.{i}.f32"] = bits.view(cupy.float32)
    cupy.cuda.Device().synchronize()
    return out


def as_bytes(t: Any) -> Any:
    import cupy
    if hasattr(t, "__cuda_array_interface__") and not hasattr(t, "data_ptr"):
        return t.view(cupy.uint8)
    import torch
    return cupy.from_dlpack(t.view(torch.int16)).view(cupy.uint8)


# -- roles ---------------------------------------------------------------------------

async def publisher(size: int) -> None:
    import trio

    from tensorhub import PeerConfig, open_peer
    tensors = make_tensors(size, fill=True)
    from tensorhub.transport.dial import detect
    ipc, _why = detect("cuda-ipc")  # a peer serves the one-sided transports it names
    config = PeerConfig.local("dc-pub", labels=HOST, transports=(
        ("cuda-ipc", "shm", "tcp") if ipc else ("shm", "tcp")))
    async with open_peer(config) as pub:
        t0 = time.perf_counter()
        await pub.publish("dc", 1, tensors)
        took = time.perf_counter() - t0
        print(json.dumps({"control": pub.info.control, "publish_s": took}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the driver closes stdin


async def fetcher(size: int, join: str, leg: str, runs: int) -> dict[str, Any]:
    import cupy
    import trio

    from tensorhub import ConfigError, PeerConfig, open_peer
    try:
        cfg = PeerConfig.local(f"dc-{leg}", join=(join.removeprefix("tcp://"),),
                               transports=(leg,), labels=HOST)
    except ConfigError as exc:
        return {"leg": leg, "absent": str(exc)}
    dst = make_tensors(size, fill=False)
    times, transports = [], set()
    async with open_peer(cfg) as peer:
        with trio.fail_after(60):
            await peer.wait_for_version("dc", None)
        for _ in range(runs):
            t0 = time.perf_counter()
            got = await peer.fetch("dc", 1, into=dst)
            cupy.cuda.Device().synchronize()
            times.append(time.perf_counter() - t0)
            transports |= set(got.report.transport_by_source.values())
            await peer.unpublish("dc", 1)
    want = make_tensors(size, fill=True)
    equal = all(bool(cupy.array_equal(as_bytes(dst[k]), as_bytes(want[k]))) for k in want)
    return {"leg": leg, "seconds": times, "transports": sorted(transports), "equal": equal}


# -- the driver ----------------------------------------------------------------------

def copy_gbps(nbytes: int, kind: str) -> float:
    """GB/s of ``cudaMemcpy`` of ``nbytes``: ``d2d``, pinned ``h2d`` or pinned ``d2h``."""
    import cupy
    rt = cupy.cuda.runtime
    dev = cupy.empty(nbytes, cupy.uint8)
    if kind == "d2d":
        other, direction = cupy.empty(nbytes, cupy.uint8), rt.memcpyDeviceToDevice
        dst, src = other.data.ptr, dev.data.ptr
    else:
        pinned = cupy.cuda.alloc_pinned_memory(nbytes)
        host = pinned.ptr
        dst, src, direction = ((dev.data.ptr, host, rt.memcpyHostToDevice) if kind == "h2d"
                               else (host, dev.data.ptr, rt.memcpyDeviceToHost))
    rt.memcpy(dst, src, nbytes, direction)  # warm
    best = []
    for _ in range(3):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        rt.memcpy(dst, src, nbytes, direction)
        cupy.cuda.Device().synchronize()
        best.append(time.perf_counter() - t0)
    return nbytes / statistics.median(best) / 1e9


def run_role(args: argparse.Namespace) -> int:
    import trio
    if args.role == "pub":
        trio.run(publisher, args.size)
        return 0
    print(json.dumps(trio.run(fetcher, args.size, args.join, args.leg, args.runs)),
          flush=True)
    return 0


def spawn(*argv: str, stdin: Any = subprocess.DEVNULL) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], text=True,
                            stdin=stdin, stdout=subprocess.PIPE)


def last_json(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{proc.args} failed (rc {proc.returncode}): {out[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def drive(args: argparse.Namespace) -> int:
    problem = gpu_problem()
    if problem is not None:
        print(f"device check: no usable GPU: {problem}")
        if args.json:
            print(json.dumps({"figures": [], "skipped": problem}))
        return 2
    import cupy

    from tensorhub.bench.figures import figure, print_figures
    from tensorhub.bench.transfer import raw_socket_seconds
    size, gib = args.size, 1 << 30
    base = {"d2d": copy_gbps(min(size, 4 * gib), "d2d"),
            "h2d_pinned": copy_gbps(gib, "h2d"), "d2h_pinned": copy_gbps(gib, "d2h"),
            "tcp_loopback_raw": gib / statistics.median(raw_socket_seconds(gib, 3)) / 1e9}
    cupy.get_default_memory_pool().free_all_blocks()
    pub = spawn("--role", "pub", "--size", str(size), stdin=subprocess.PIPE)
    assert pub.stdout is not None and pub.stdin is not None
    ready = json.loads(pub.stdout.readline())
    legs = {}
    try:
        for leg in ("tcp", "cuda-ipc"):
            try:
                legs[leg] = last_json(spawn("--role", "fetch", "--size", str(size), "--join",
                                            ready["control"], "--leg", leg, "--runs",
                                            str(args.runs)), timeout=150)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the next leg still runs
                legs[leg] = {"leg": leg, "failed": str(exc)[-600:]}
    finally:
        pub.stdin.close()
        pub.wait(30)
    gbps = {leg: size / statistics.median(r["seconds"]) / 1e9 for leg, r in legs.items()
            if "seconds" in r}
    kinds = "cupy + torch" if torch_cuda() else "cupy"
    print(f"device check: {size / gib:g} GiB as {TENSORS} tensors ({kinds}), "
          f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; publish "
          f"{ready['publish_s']:.2f} s")
    print(f"{'path':<44} {'GB/s':>7}")
    for name, value in base.items():
        print(f"{'baseline ' + name:<44} {value:>7.2f}")
    for leg, r in legs.items():
        if "absent" in r or "failed" in r:
            word = "absent" if "absent" in r else "FAILED"
            print(f"{'fetch ' + leg:<44} {word:>7}  ({r.get('absent') or r['failed']})")
        else:
            print(f"{'fetch ' + leg + ' via ' + '/'.join(r['transports']):<44} "
                  f"{gbps[leg]:>7.2f}  landed equal: {r['equal']}")
    min_link = min(base["tcp_loopback_raw"], base["h2d_pinned"], base["d2h_pinned"])
    figures = []
    if "cuda-ipc" in gbps:
        figures.append(figure("ipc_vs_d2d", gbps["cuda-ipc"] / base["d2d"], "x", 0.5,
                              "higher"))
    if "tcp" in gbps:
        figures.append(figure("staged_tcp_vs_min_link", gbps["tcp"] / min_link, "x", 0.7,
                              "higher"))
    print()
    print_figures(figures)
    ok = all(r.get("equal", True) and "failed" not in r for r in legs.values())
    if args.json:
        print(json.dumps({"figures": figures, "baselines_gbps": base, "fetch_gbps": gbps,
                          "legs": legs, "publish_s": ready["publish_s"],
                          "settings": {"size": size, "runs": args.runs,
                                       "tensors": TENSORS, "torch": torch_cuda()}}))
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="4GiB", help="bytes of the version (default 4GiB)")
    p.add_argument("--runs", type=int, default=3, help="fetches per leg (median; default 3)")
    p.add_argument("--json", action="store_true", help="last line: JSON with figures")
    p.add_argument("--role", choices=("pub", "fetch"), help=argparse.SUPPRESS)
    p.add_argument("--join", help=argparse.SUPPRESS)
    p.add_argument("--leg", help=argparse.SUPPRESS)
    args = p.parse_args()
    from tensorhub.ops.demo import parse_size
    args.size = parse_size(str(args.size))
    return run_role(args) if args.role else drive(args)


if __name__ == "__main__":
    sys.exit(main())
