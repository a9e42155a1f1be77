"""The manifest phase of a fetch: ask holders for a version's manifest until one
serves it, as :class:`~tensorhub.protocol.reading.ManifestSearch` says whom and when;
check it against the reference's manifest id and parse it, off the event loop when it
is large."""

from __future__ import annotations

import trio

from ..errors import RemoteProtocolError, TransportError
from ..limits import ManifestLimits
from ..manifest.manifest import Manifest
from ..protocol.reading import ManifestSearch
from ..transport.base import NotServing
from .connections import ConnectionPool
from .ports import Ports

INLINE_DECODE_BYTES = 64 << 10
"""Manifests up to this size are decoded on the event loop: about 2,000 tensors, well
under a millisecond, less than handing the work to a thread and back."""
INLINE_KNOWN_BYTES = 1 << 20
"""Manifests up to this size whose tensor columns were decoded lately (the next
version of a model) are decoded on the event loop too, the columns known by their bytes
(:mod:`tensorhub.manifest.columns`): 33,000 tensors (1,020 KiB) take 0.88 ms here,
against 1.13 ms through a thread; 16,000 take 0.41 ms.  One of new columns goes to a
thread, after about 0.25 ms spent finding that out (10,000 tensors)."""


async def read_manifest(search: ManifestSearch, ports: Ports, pool: ConnectionPool,
                        limits: ManifestLimits) -> tuple[Manifest, str]:
    """The manifest of ``search.key`` and its publisher, from the first holder that
    serves one that checks out; :class:`~tensorhub.errors.VersionUnavailable` when the
    search gives up."""
    key = search.key
    while True:
        for source, holding in search.candidates(ports.holders(key), ports.live(),
                                                 ports.banned):
            try:
                conn = await pool.connect(source)
                try:
                    data = await conn.read_manifest(key)
                finally:  # kept for the chunks, when it is in step
                    await pool.release(conn)
                manifest = await decode_manifest(data, holding.manifest_id, limits)
                if manifest.key != key:
                    raise RemoteProtocolError(f"{source.name} sent a non-matching manifest")
                return manifest, holding.publisher
            except (TransportError, RemoteProtocolError, NotServing, OSError) as exc:
                search.failed(source.name, str(exc))
        with trio.move_on_at(search.wake_at(trio.current_time())):
            await ports.changed()


async def decode_manifest(data: bytes, manifest_id: bytes, limits: ManifestLimits
                          ) -> Manifest:
    """Check and parse a manifest; one over :data:`INLINE_DECODE_BYTES` in a worker
    thread (at the caps, decoding takes a second: the event loop must not wait)."""
    if len(data) <= INLINE_DECODE_BYTES:
        return Manifest.decode(data, manifest_id, limits)
    if len(data) <= INLINE_KNOWN_BYTES:
        known = Manifest.decode_known(data, manifest_id, limits)
        if known is not None:
            return known
    return await trio.to_thread.run_sync(Manifest.decode, data, manifest_id, limits)
