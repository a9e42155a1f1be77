"""The CLI's operator commands: ``publish`` and ``fetch`` of safetensors files, a
peer's roles (``--serve``, ``--follow``, ``--metrics-port``) and ``status --watch``.

:func:`roles_of` turns a ``tensorhub peer`` or ``tensorhub publish`` command line into
the roles :func:`tensorhub.cli._run_peer` starts once the peer is up; each prints its
events as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import trio

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import PeerConfig
    from ..peer.node import Peer

Role = Callable[["Peer", AsyncExitStack], Awaitable[None]]


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def add_role_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve", default=None, metavar="FILE",
                   help="publish this safetensors file (mmap, no copy) as --model@--version")
    p.add_argument("--model", default=None, help="the model --serve publishes as")
    p.add_argument("--version", type=int, default=None, help="the version --serve publishes")
    p.add_argument("--follow", action="append", default=[], metavar="MODEL",
                   help="fetch every new sealed version of MODEL and serve it; repeatable")
    p.add_argument("--keep", type=int, default=1,
                   help="versions a --follow peer keeps per model (default 1)")
    add_metrics_option(p)


def add_metrics_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics "
                        "(needs the ops extra)")


def add_fetch_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--version", default="latest", help="N or latest (default)")
    p.add_argument("--out", required=True, metavar="FILE", help="safetensors file to write")
    p.add_argument("--wait", type=float, default=30.0,
                   help="seconds to wait for a sealed version to appear (latest)")


def roles_of(args: argparse.Namespace) -> list[Role]:
    """The roles a ``peer`` / ``publish`` command line asks for (checked here, before
    the peer starts)."""
    roles: list[Role] = []
    serve = getattr(args, "serve", None) or getattr(args, "file", None)
    if serve is not None:
        if args.model is None or args.version is None:
            raise ConfigError("--serve FILE needs --model M and --version V")
        model, version = args.model, args.version

        async def serving(peer: Peer, stack: AsyncExitStack) -> None:
            from .roles import serve_file

            await stack.enter_async_context(serve_file(peer, serve, model, version, emit))
        roles.append(serving)
    elif getattr(args, "model", None) is not None or getattr(args, "version", None) is not None:
        raise ConfigError("--model and --version go with --serve FILE")
    follows = list(getattr(args, "follow", []))
    if follows:
        keep = args.keep

        async def following(peer: Peer, stack: AsyncExitStack) -> None:
            from .roles import follow

            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)  # runs first: the tasks end
            for model in follows:
                nursery.start_soon(follow, peer, model, keep, emit)
        roles.append(following)
    port = getattr(args, "metrics_port", None)
    if port is not None:
        from .metrics import require

        require("prometheus_client")

        async def metrics(peer: Peer, stack: AsyncExitStack) -> None:
            from .metrics import serve_metrics

            bound = await stack.enter_async_context(serve_metrics(peer, port))
            emit({"event": "metrics", "url": f"http://127.0.0.1:{bound}/metrics"})
        roles.insert(0, metrics)
    return roles


class _Plain:
    """Progress as lines (not a terminal): at most one a second, and the last.  The rate
    counts from the first report (the fetch's start), not from the wait for a version."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.start: float | None = None
        self.shown = -1.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.start is None:
            self.start = now
        if now - self.shown < 1.0 and done < total:
            return
        self.shown = now
        elapsed = now - self.start
        rate = f" {done / elapsed / 1e6:.1f} MB/s" if elapsed > 0 else ""
        pct = 100.0 * done / total if total else 100.0
        print(f"{self.what}: {pct:5.1f}% {done}/{total} bytes{rate}",
              file=sys.stderr, flush=True)


async def run_fetch(config: PeerConfig, args: argparse.Namespace) -> dict[str, Any]:
    """``tensorhub fetch``: join, fetch, write the file, leave; the summary."""
    from ..peer.node import open_peer
    from .roles import fetch_to_file

    version: int | str = args.version
    if version != "latest":
        try:
            version = int(version)
        except ValueError:
            raise ConfigError(f"--version expects N or latest, got {version!r}") from None
    what = f"fetch {args.model}@{version}"
    try:  # a bar on a terminal when rich is there (the ops extra), else plain lines
        import rich.progress as bars
    except ImportError:
        bars = None  # type: ignore[assignment]
    async with open_peer(config) as peer:
        if bars is not None and sys.stderr.isatty():
            from rich.console import Console

            with bars.Progress(*bars.Progress.get_default_columns(), bars.DownloadColumn(),
                               bars.TransferSpeedColumn(),
                               console=Console(stderr=True)) as bar:
                task = bar.add_task(what, total=None)

                def show(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)
                got, size = await fetch_to_file(peer, args.model, version, args.out, show,
                                                args.wait)
        else:
            got, size = await fetch_to_file(peer, args.model, version, args.out,
                                            _Plain(what), args.wait)
    r = got.report
    return {"event": "fetched", "model": args.model, "version": got.version,
            "out": args.out, "file_bytes": size, "bytes": r.bytes,
            "seconds": round(r.seconds, 4), "sources": r.bytes_by_source,
            "transports": r.transport_by_source, "verified": r.verified}


async def run_watch(config: PeerConfig, args: argparse.Namespace) -> None:
    """``tensorhub status --watch``."""
    from ..peer.node import open_peer
    from .metrics import require
    from .status import watch

    require("rich")
    async with open_peer(config) as peer:
        await trio.sleep(args.settle)
        await watch(peer, args.interval, args.count, timeout=2.0)
