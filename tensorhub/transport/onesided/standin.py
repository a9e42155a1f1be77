"""In-process stand-ins for the one-sided backends, over host memory.

A :class:`StandinBackend` behaves as an RDMA device would towards the code above it:
registering memory gives a region, granting it a fresh random 32-bit key, revoking
forgets the key; a link is a pair of endpoints exchanged through the holder's data
connection; a posted read completes (on :meth:`~_Link.poll`) with the bytes copied, or
with the error a NIC reports -- a key not (or no longer) granted, a range outside the
region, a holder whose end of the link is gone.  Reader and holder must live in one
process (the "fabric" is this process's memory), which is what the conformance suite
and the peer tests run.  ``rdma-standin`` is served to any reader; ``cuda-ipc-standin``
only on the same-host socket, as CUDA IPC is.

``faults``: a test sets how many of the next reads (of any link of this backend) fail,
to drive the failure paths.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import struct
import time
import weakref
from collections import deque
from typing import Any

from ...errors import TransportError
from .backend import Link, Region
from .registry import extent

_ENDPOINT = struct.Struct("<QQ")  # backend id, link id
_backends: weakref.WeakValueDictionary[int, StandinBackend] = weakref.WeakValueDictionary()
_ids = itertools.count(1)


class StandinBackend:
    """See the module docstring."""

    depth = 16

    def __init__(self, name: str = "rdma-standin") -> None:
        self.name = name
        self.same_host = name.startswith("cuda-ipc")
        self.device_memory = self.same_host
        """As CUDA IPC: a device version's tensors are served in place (in tests, host
        memory posing as device memory)."""
        self.id = next(_ids)
        self._keys: dict[bytes, Region] = {}
        self._links: dict[int, _HolderLink] = {}
        self.faults = 0
        """Reads still to fail on purpose (tests)."""
        self.closed = False
        _backends[self.id] = self

    def register(self, memory: Any) -> Region:
        if not isinstance(memory, memoryview) and not (
                self.device_memory and hasattr(memory, "__cuda_array_interface__")):
            raise TransportError(f"{self.name}: host memory only, not "
                                 f"{type(memory).__name__}")
        return Region(*extent(memory), None)

    def deregister(self, region: Region) -> None:
        self.revoke(region)

    def grant(self, region: Region) -> None:
        self.revoke(region)
        key = os.urandom(4)
        while key in self._keys:  # pragma: no cover - one in four billion
            key = os.urandom(4)
        region.key = key
        self._keys[key] = region

    def revoke(self, region: Region) -> None:
        self._keys.pop(region.key, None)
        region.key = b""

    def dial(self) -> _Dialing:
        return _Dialing(self)

    def accept(self, endpoint: bytes) -> tuple[Link, bytes]:
        if len(endpoint) != _ENDPOINT.size:
            raise ValueError("malformed stand-in endpoint")
        _reader, link_id = _ENDPOINT.unpack(endpoint)
        link = _HolderLink(self, link_id)
        self._links[link_id] = link
        return link, _ENDPOINT.pack(self.id, link_id)

    def close(self) -> None:
        """The holder's device goes away: every link fails."""
        self.closed = True
        self._keys.clear()

    def _read(self, link_id: int, local_addr: int, remote_addr: int, key: bytes,
              length: int) -> str | None:
        """Serve one read against this (the holder's) memory: None, or the error."""
        link = self._links.get(link_id)
        if self.closed or link is None or link.closed:
            return "IBV_WC_RETRY_EXC_ERR: the holder's end of the link is gone"
        if self.faults > 0:
            self.faults -= 1
            return "IBV_WC_REM_OP_ERR: injected fault"
        region = self._keys.get(key)
        if region is None:
            return f"IBV_WC_REM_ACCESS_ERR: key {key.hex()} is not granted (revoked?)"
        if not region.addr <= remote_addr <= remote_addr + length <= region.addr + region.length:
            return "IBV_WC_REM_ACCESS_ERR: range outside the region"
        ctypes.memmove(local_addr, remote_addr, length)
        return None


class _HolderLink:
    def __init__(self, backend: StandinBackend, link_id: int) -> None:
        self.backend = backend
        self.link_id = link_id
        self.closed = False

    def post_read(self, wr_id: int, local: Region, local_addr: int, remote_addr: int,
                  key: bytes, length: int) -> None:
        raise TransportError("a holder's link posts no reads")

    def poll(self, timeout: float) -> list[tuple[int, str | None]]:
        return []

    def close(self) -> None:
        self.closed = True
        self.backend._links.pop(self.link_id, None)


class _Dialing:
    def __init__(self, backend: StandinBackend) -> None:
        self.backend = backend
        self.link_id = next(_ids)
        self.endpoint = _ENDPOINT.pack(backend.id, self.link_id)

    def connect(self, holder_endpoint: bytes) -> Link:
        if len(holder_endpoint) != _ENDPOINT.size:
            raise TransportError("malformed stand-in endpoint from the holder")
        holder_id, link_id = _ENDPOINT.unpack(holder_endpoint)
        holder = _backends.get(holder_id)
        if holder is None or link_id != self.link_id or holder.name != self.backend.name:
            raise TransportError(f"{self.backend.name}: no such holder endpoint in this "
                                 "process")
        return _ReaderLink(self.backend, holder, link_id)

    def close(self) -> None:
        pass


class _ReaderLink:
    """Reads complete in :meth:`poll`, one by one, in the order posted."""

    def __init__(self, backend: StandinBackend, holder: StandinBackend, link_id: int) -> None:
        self.backend = backend
        self.holder = holder
        self.link_id = link_id
        self._posted: deque[tuple[int, int, int, bytes, int]] = deque()
        self.closed = False

    def post_read(self, wr_id: int, local: Region, local_addr: int, remote_addr: int,
                  key: bytes, length: int) -> None:
        if self.closed:
            raise TransportError("link closed")
        if not local.addr <= local_addr <= local_addr + length <= local.addr + local.length:
            raise TransportError("local range outside its registered region")
        self._posted.append((wr_id, local_addr, remote_addr, key, length))

    def poll(self, timeout: float) -> list[tuple[int, str | None]]:
        if not self._posted:
            time.sleep(min(timeout, 0.001))
            return []
        wr_id, local_addr, remote_addr, key, length = self._posted.popleft()
        if self.backend.faults > 0:
            self.backend.faults -= 1
            return [(wr_id, "IBV_WC_LOC_PROT_ERR: injected fault")]
        return [(wr_id, self.holder._read(self.link_id, local_addr, remote_addr, key,
                                          length))]

    def close(self) -> None:
        self.closed = True
        self._posted.clear()
