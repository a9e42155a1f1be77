"""What a long-running peer does besides serving what it holds: its roles.

* :func:`serve_file` -- publish a safetensors file from a read-only mmap (no copy) for
  as long as the block runs; unpublish (and wait for reads to drain) before unmapping.
* :func:`follow` -- fetch every new sealed version of a model into host memory and
  serve it, releasing held versions older than the newest ``keep``: a cache, or the
  seed of a remote datacenter.
* :func:`fetch_to_file` -- fetch a version and write it as a safetensors file, telling
  a progress callback how far the fetch got.

Each role reports what it did as JSON-able events through an ``emit`` callback (the CLI
prints them one per line).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from ..errors import (
    ConsistencyError,
    LocalProtocolError,
    RemoteProtocolError,
    TransportError,
    VersionUnavailable,
)
from ..integrations.safetensors import MappedFile, map_safetensors, write_safetensors
from ..model import check_model_name, check_version

if TYPE_CHECKING:
    from ..peer.node import Peer
    from ..read.report import Fetched

Emit = Callable[[dict[str, Any]], None]
Progress = Callable[[int, int], None]
"""Told ``(bytes verified, bytes in all)`` while a fetch runs."""
PROGRESS_INTERVAL = 0.2


@asynccontextmanager
async def serve_file(peer: Peer, path: str | os.PathLike[str], model: str, version: int,
                     emit: Emit) -> AsyncIterator[MappedFile]:
    """Publish the safetensors file ``path`` as ``model@version`` from a read-only mmap
    until the block ends."""
    mapped = await trio.to_thread.run_sync(map_safetensors, path)
    try:
        manifest = await peer.publish(model, version, mapped.tensors)
        emit({"event": "serving", "file": str(mapped.path), "model": model,
              "version": version, "tensors": len(mapped.tensors), "bytes": mapped.nbytes,
              "chunks": manifest.num_chunks})
        try:
            yield mapped
        finally:
            with trio.CancelScope(shield=True):
                await peer.unpublish(model, version)
    finally:
        mapped.close()


async def follow(peer: Peer, model: str, keep: int, emit: Emit) -> None:
    """Fetch each new sealed version of ``model`` (the newest when several arrived at
    once) and serve it; keep the newest ``keep`` held here, unpublish older ones.  A
    version that cannot be fetched (its holders left) is reported and skipped."""
    check_model_name(model)
    if keep < 1:
        raise LocalProtocolError(f"--keep must be at least 1, got {keep}")
    held: list[int] = []
    last: int | None = None
    while True:
        version = await peer.wait_for_version(model, last)
        last = version
        try:
            got = await peer.fetch(model, version)
        except (VersionUnavailable, ConsistencyError, TransportError,
                RemoteProtocolError) as exc:
            emit({"event": "follow-skipped", "model": model, "version": version,
                  "error": str(exc)})
            continue
        except LocalProtocolError as exc:  # being fetched here already (another call)
            emit({"event": "follow-held", "model": model, "version": version,
                  "detail": str(exc)})
            continue
        if got.report.served_arrays:  # held here already (--serve, say): not ours to drop
            emit({"event": "follow-held", "model": model, "version": version,
                  "detail": "held here already"})
        else:
            held.append(version)
            emit({"event": "followed", "model": model, "version": version,
                  "bytes": got.report.bytes, "seconds": round(got.report.seconds, 4),
                  "sources": sorted(got.report.bytes_by_source),
                  "transports": sorted(set(got.report.transport_by_source.values()))})
        while len(held) > keep:
            old = held.pop(0)
            await peer.unpublish(model, old)
            emit({"event": "released", "model": model, "version": old})


async def fetch_to_file(peer: Peer, model: str, version: int | str,
                        out: str | os.PathLike[str], progress: Progress | None = None,
                        wait: float = 30.0) -> tuple[Fetched, int]:
    """Fetch ``model@version`` (``"latest"``: the newest sealed one, waiting up to
    ``wait`` seconds for the view to show one) and write it to ``out`` as safetensors;
    returns the fetch and the file's size."""
    check_model_name(model)
    if version != "latest" and not isinstance(version, int):
        raise LocalProtocolError(f"version must be an int or 'latest', got {version!r}")
    newer_than = None if version == "latest" else check_version(int(version)) - 1
    seen = None
    with trio.move_on_after(wait):  # a view just joined has not heard of it yet
        seen = await peer.wait_for_version(model, newer_than)
    if seen is None:
        which = "sealed version" if newer_than is None else f"sealed version >= {version}"
        raise VersionUnavailable(model, version, f"no {which} seen in {wait} s")
    resolved = seen if version == "latest" else int(version)
    async with trio.open_nursery() as nursery:
        if progress is not None:
            nursery.start_soon(_watch_progress, peer, model, resolved, progress)
        got = await peer.fetch(model, resolved)
        nursery.cancel_scope.cancel()
    if progress is not None:
        total = sum(a.nbytes for a in got.tensors.values())
        progress(total, total)
    size = await trio.to_thread.run_sync(write_safetensors, out, got.tensors,
                                         {"tensorhub": f"{model}@{resolved}"})
    return got, size


async def _watch_progress(peer: Peer, model: str, version: int, progress: Progress) -> None:
    """Tell ``progress`` the verified bytes of the fetch of ``model@version`` now and
    then (a display, not synchronisation: nothing waits for it)."""
    while True:
        for job in peer.reader.progress():
            if job.key.model == model and job.key.version == version:
                progress(job.bytes, job.total_bytes)
        await trio.sleep(PROGRESS_INTERVAL)
