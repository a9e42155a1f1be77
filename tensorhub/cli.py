"""The ``tensorhub`` command: ``peer``, ``publish``, ``fetch``, ``demo``, ``status``,
``bench``, ``keygen``.

User errors (bad options, a port in use, an unreachable seed) end with one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import trio

from .config import PeerConfig, parse_labels
from .errors import ConfigError, TensorHubError
from .links import load_links
from .ops import commands
from .ops.commands import Role
from .security import load, read_keyring, write_keys

PRESETS = {"local": PeerConfig.local, "datacenter": PeerConfig.datacenter,
           "cross_dc": PeerConfig.cross_dc}


def _config(args: argparse.Namespace, name: str) -> PeerConfig:
    seeds = tuple(s for s in (args.join or "").split(",") if s)
    extra: dict[str, Any] = {}
    if getattr(args, "data_listen", None):
        extra["data_listen"] = args.data_listen
    if args.keys:
        extra["security"] = load(args.keys, name)
    if args.insecure:
        extra["allow_insecure"] = True
    if args.transports:
        extra["transports"] = tuple(t for t in args.transports.split(",") if t)
    if getattr(args, "links", None):
        extra["links"] = load_links(args.links)
    return PRESETS[args.preset](name, listen=args.listen, join=seeds, delta=args.delta,
                                labels=parse_labels(args.label or []), **extra)


async def _run_peer(config: PeerConfig, keys: str | None = None,
                    roles: Sequence[Role] = ()) -> None:
    """Run until SIGINT/SIGTERM; SIGHUP re-reads the keyring of ``keys`` (rotation).
    ``roles`` start once the peer is up and end (in reverse) before it leaves."""
    from pathlib import Path

    from .peer.node import open_peer

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with open_peer(config) as peer, AsyncExitStack() as stack:
            print(json.dumps({"event": "ready", "name": peer.info.name,
                              "control": peer.info.control, "data": peer.info.data,
                              "security": peer.statistics().security,
                              "transports": peer.statistics().transports}), flush=True)
            for role in roles:
                await role(peer, stack)
            async for signum in signals:
                if signum != signal.SIGHUP:
                    break
                if keys is None:
                    continue
                try:
                    _, ring = read_keyring(Path(keys) / "cluster.json")
                    peer.update_keyring(ring.members(), ring.publishers())
                    event = {"event": "keyring", "members": sorted(ring.members())}
                except TensorHubError as exc:  # a bad file keeps the keyring we have
                    event = {"event": "keyring", "error": str(exc)}
                print(json.dumps(event), flush=True)


async def _status(config: PeerConfig, settle: float) -> dict[str, Any]:
    from .ops.status import gather
    from .peer.node import open_peer

    async with open_peer(config) as peer:
        await trio.sleep(settle)
        report = await gather(peer, timeout=2.0)
        del report["time"]
        return report


def _print_status(report: dict[str, Any]) -> None:
    from .ops.status import WAN_COLUMNS, wan_rows

    print(f"{'member':<20} {'state':<8} {'control':<26} labels")
    for name, m in sorted(report["members"].items()):
        labels = ",".join(f"{k}={v}" for k, v in m["labels"].items())
        print(f"{name:<20} {m['state']:<8} {m['control']:<26} {labels}")
    print()
    print(f"{'version':<24} holders (chunks held)")
    for key, v in sorted(report["versions"].items()):
        holders = ", ".join(f"{n} ({h['chunks']})" for n, h in sorted(v["holders"].items()))
        print(f"{key:<24} {holders}")
    rows = wan_rows(report)
    if rows:
        print()
        print("links between DCs")
        for row in (WAN_COLUMNS, *rows):
            print(f"{row[0]:<12} {row[1]:<12} {row[2]:>10} {row[3]:>8} {row[4]:<9} {row[5]}")


def _add_peer_options(p: argparse.ArgumentParser, listen: str) -> None:
    p.add_argument("--listen", default=listen, help="control address HOST:PORT")
    p.add_argument("--join", default="", help="seed peers HOST:PORT[,HOST:PORT...]")
    p.add_argument("--label", action="append", metavar="KEY=VALUE",
                   help="topology label (dc, rack, host, ...); repeatable")
    p.add_argument("--preset", choices=sorted(PRESETS), default="datacenter",
                   help="timer preset (default: datacenter)")
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="join with this peer's keys from DIR (made by tensorhub keygen)")
    p.add_argument("--insecure", action="store_true",
                   help="allow running without --keys on a non-loopback address")
    p.add_argument("--delta", choices=("off", "auto", "always"), default="auto",
                   help="chunk deltas against an older version held here "
                        "(PeerConfig.delta; default auto: where they beat the link)")
    p.add_argument("--links", default=None, metavar="FILE",
                   help="the links between DCs, declared: the [[link]] tables of a TOML "
                        "file (PeerConfig.links; docs/cluster.md); measurements refine "
                        "them")
    p.add_argument("--transports", default=None, metavar="LIST",
                   help="data-plane transports in order of preference, e.g. rdma,shm,tcp "
                        "(PeerConfig.transports; default shm,tcp); each is detected at "
                        "start and one named but not usable here is an error")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorhub", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("peer", help="run one peer until SIGINT/SIGTERM")
    p.add_argument("--name", required=True)
    _add_peer_options(p, "127.0.0.1:7700")
    p.add_argument("--data-listen", default=None, help="data-plane HOST:PORT")
    commands.add_role_options(p)

    pub = sub.add_parser("publish", help="serve a safetensors file (mmap, no copy) as a "
                         "version until SIGINT/SIGTERM")
    pub.add_argument("file", metavar="FILE")
    pub.add_argument("--model", required=True)
    pub.add_argument("--version", type=int, required=True)
    pub.add_argument("--name", default=None, help="member name (default publish-PID)")
    _add_peer_options(pub, "127.0.0.1:0")
    pub.add_argument("--data-listen", default=None, help="data-plane HOST:PORT")
    commands.add_metrics_option(pub)

    f = sub.add_parser("fetch", help="fetch a version into a safetensors file")
    commands.add_fetch_options(f)
    f.add_argument("--name", default=None, help="member name (default fetch-PID)")
    _add_peer_options(f, "127.0.0.1:0")

    d = sub.add_parser("demo", help="spawn a local mesh on loopback and move weights")
    from .ops.demo import add_demo_options

    add_demo_options(d)

    b = sub.add_parser("bench", help="benchmarks (each prints figures; --json for JSON)")
    bsub = b.add_subparsers(dest="bench", required=True)
    from .bench import (
        chain,
        chaos,
        cluster_cli,
        delta,
        flip,
        rounds,
        rtt,
        staging,
        torchbench,
        transfer,
    )

    transfer.add_options(bsub.add_parser("transfer", help="data plane vs the raw socket"))
    flip.add_options(bsub.add_parser("flip", help="the staged flip's pause with readers "
                                     "pinned on the old version"))
    cluster_cli.add_options(bsub.add_parser("cluster", help="fan-out in an emulated cluster "
                                            "vs star, gloo and Ray (needs root)"))
    rtt.add_options(bsub.add_parser("rtt", help="one fetch vs one plain TCP stream at "
                                    "added round trips (needs root)"))
    chain.add_options(bsub.add_parser("chain", help="a 4-deep relay chain vs one hop at "
                                      "a capped NIC rate (needs root)"))
    chaos.add_options(bsub.add_parser("chaos", help="faults and a rogue peer against a "
                                      "mesh of processes; invariants checked per seed"))
    rounds.add_options(bsub.add_parser("rounds", help="model-parallel groups switching "
                                       "under a fast trainer on a busy host; aborts counted"))
    torchbench.add_options(bsub.add_parser("torch", help="a bf16 torch state_dict vs numpy"))
    staging.add_options(bsub.add_parser("staging", help="a fetch through the staging ring "
                                        "(the GPU path's host side) vs a plain fetch"))
    delta.add_options(bsub.add_parser("delta", help="RL-like steps as chunk deltas across "
                                      "an emulated 2-DC cluster vs full (needs root)"))

    s = sub.add_parser("status", help="print members and versions of a mesh")
    _add_peer_options(s, "127.0.0.1:0")
    s.add_argument("--name", default=None,
                   help="member name to join as (with --keys: a name in the keyring; "
                        "default status-PID)")
    s.add_argument("--settle", type=float, default=2.0,
                   help="seconds to gossip before printing")
    s.add_argument("--json", action="store_true")
    s.add_argument("--watch", action="store_true",
                   help="redraw members, versions, transfers and staleness (rich)")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    s.add_argument("--count", type=int, default=None,
                   help="with --watch: stop after this many drawings")
    k = sub.add_parser("keygen", help="make (or extend) a cluster's keys in DIR")
    k.add_argument("dir", metavar="DIR")
    k.add_argument("--peer", action="append", default=[], metavar="NAME",
                   help="a member to make a key for; repeatable")
    k.add_argument("--publisher", action="append", default=[], metavar="MODEL=NAME",
                   help="NAME may publish MODEL ('*': every model); repeatable")
    return parser


def _keygen(args: argparse.Namespace) -> None:
    publishers: dict[str, list[str]] = {}
    for item in args.publisher:
        model, sep, name = item.partition("=")
        if not sep or not model or not name:
            raise ConfigError(f"--publisher expects MODEL=NAME, got {item!r}")
        publishers.setdefault(model, []).append(name)
    if not args.peer and not publishers:
        raise ConfigError("keygen needs at least one --peer NAME (or --publisher)")
    for name in args.peer:
        PeerConfig.local(name)  # the same name rules as a peer's
    for path in write_keys(args.dir, args.peer, publishers):
        print(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in ("peer", "publish"):
            roles = commands.roles_of(args)
            name = args.name or f"publish-{os.getpid()}"
            trio.run(_run_peer, _config(args, name), args.keys, roles)
            return 0
        if args.command == "fetch":
            if not args.join:
                raise ConfigError("fetch needs --join HOST:PORT")
            config = _config(args, args.name or f"fetch-{os.getpid()}")
            print(json.dumps(trio.run(commands.run_fetch, config, args)), flush=True)
            return 0
        if args.command == "keygen":
            _keygen(args)
            return 0
        if args.command == "demo":
            from .ops.demo import run_demo

            return run_demo(args)
        if args.command == "bench":
            from .bench import chain, chaos, cluster_cli, flip, rounds, rtt, torchbench, transfer

            if args.bench == "torch":
                return torchbench.run_cli(args)
            if args.bench == "staging":
                from .bench import staging
                return staging.run_cli(args)
            if args.bench == "flip":
                return flip.run_cli(args)
            if args.bench == "cluster":
                return cluster_cli.run_cli(args)
            if args.bench == "rtt":
                return rtt.run_cli(args)
            if args.bench == "chain":
                return chain.run_cli(args)
            if args.bench == "chaos":
                return chaos.run_cli(args)
            if args.bench == "rounds":
                return rounds.run_cli(args)
            if args.bench == "delta":
                from .bench import delta

                return delta.run_cli(args)
            return transfer.run_cli(args)
        if args.command == "status":
            if not args.join:
                raise ConfigError("status needs --join HOST:PORT")
            if args.watch:
                trio.run(commands.run_watch,
                         _config(args, args.name or f"status-{os.getpid()}"), args)
                return 0
            report = trio.run(_status, _config(args, args.name or f"status-{os.getpid()}"),
                              args.settle)
            if args.json:
                print(json.dumps(report))
            else:
                _print_status(report)
            return 0
    except (TensorHubError, OSError) as exc:
        print(f"tensorhub {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # an error inside the peer's nursery (a role)
        from .read.transfer import first_error

        first = first_error(group)
        if not isinstance(first, TensorHubError | OSError):
            raise
        print(f"tensorhub {args.command}: error: {first}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
