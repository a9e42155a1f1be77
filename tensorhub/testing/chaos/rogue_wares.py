"""What the chaos bench's rogue (:mod:`tensorhub.testing.chaos.rogue`) serves: a data port that
answers with whatever an attack offers, framed as the real data plane frames it, and the
manifests it forges."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from ...manifest.manifest import build_manifest
from ...model import VersionKey
from ...protocol.dataplane import (
    BAD_REQUEST,
    NOT_HELD,
    OK,
    ChunkReply,
    ChunkRequest,
    ChunkRunRequest,
    ManifestRequest,
    Reply,
)
from ...transport.frames import encode_frame, recv_frame_blocking
from .worker import model_specs

# -- the data port it serves from ----------------------------------------------------------

Offer = tuple[bytes, Callable[[int], bytes]]
"""What the rogue serves for one version: manifest bytes, and chunk -> payload."""


class DataServer:
    """A plain-thread data-plane server that answers with whatever the attack offers."""

    def __init__(self, ip: str, admit: Callable[[socket.socket], str] | None = None) -> None:
        """``admit``: the holder's side of the data-plane handshake (the insider's)."""
        self.offers: dict[tuple[str, int], Offer] = {}
        self.admit = admit
        self.admitted = 0
        self.chunks_served = 0
        self.manifests_served = 0
        self._listener = socket.create_server((ip, 0))
        self.address = f"{ip}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if self.admit is not None:
                    self.admit(conn)
                    self.admitted += 1
                while True:
                    req = read_message(conn)
                    offer = self.offers.get((getattr(req, "model", ""),
                                             getattr(req, "version", -1)))
                    if isinstance(req, ManifestRequest) and offer is not None:
                        self.manifests_served += 1
                        conn.sendall(encode_frame(Reply(req.req_id, OK, len(offer[0]))) + offer[0])
                    elif isinstance(req, ChunkRequest) and offer is not None:
                        payload = offer[1](req.chunk)
                        self.chunks_served += 1
                        conn.sendall(encode_frame(Reply(req.req_id, OK, len(payload))) + payload)
                    elif isinstance(req, ChunkRunRequest) and offer is not None:
                        for chunk in range(req.first, req.first + req.count):  # streamed
                            payload = offer[1](chunk)
                            self.chunks_served += 1
                            conn.sendall(encode_frame(
                                ChunkReply(req.req_id, chunk, OK, len(payload))) + payload)
                    elif isinstance(req, ChunkRunRequest):
                        for chunk in range(req.first, req.first + req.count):
                            conn.sendall(encode_frame(ChunkReply(req.req_id, chunk,
                                                                 NOT_HELD, 0, "not here")))
                    elif isinstance(req, ManifestRequest | ChunkRequest):
                        conn.sendall(encode_frame(Reply(req.req_id, NOT_HELD, 0, "not here")))
                    else:
                        conn.sendall(encode_frame(Reply(getattr(req, "req_id", 0),
                                                        BAD_REQUEST, 0, "tcp only")))
            except Exception:  # the reader left or lied
                return


def read_message(conn: socket.socket) -> Any:
    """The next frame's message; a socket timeout with nothing arrived raises."""
    return recv_frame_blocking(conn, _stalled)


def _stalled() -> None:
    raise TimeoutError("no frame within the socket's timeout")


# -- manifests it forges -------------------------------------------------------------------


def forged_offer(model: str, version: int, size: int, chunk: int) -> tuple[bytes, Offer, int]:
    """A valid manifest of the real tensor layout with other content (zeros), its id and
    the offer serving it; the number of chunks."""
    specs = model_specs(size)
    arrays = [(n, np.zeros(s, np.dtype(d))) for n, s, d in specs]
    manifest = build_manifest(VersionKey(model, version), arrays, chunk, "xxh3-128")
    body = manifest.encode()

    def payload(c: int) -> bytes:
        start, stop = manifest.chunk_range(c)
        return bytes(max(0, stop - start))

    return manifest.manifest_id(), (body, payload), manifest.num_chunks


_HUGE: dict[int, bytes] = {}


def huge_manifest(model: str, version: int, tensors: int) -> bytes:
    """A well-formed manifest declaring ``tensors`` scalar tensors (the bulk is built
    once per count: a 4-million-name list takes seconds)."""
    if tensors not in _HUGE:
        n = tensors
        rest = {"tensors": {"names": [f"t{i}" for i in range(n)], "dtypes": ["<f4"],
                            "dtype": bytes(2 * n), "ndim": bytes(n), "dims": b"",
                            "sliced": b"", "global": b"", "start": b""},
                "chunk_size": 1 << 31, "digest_algo": "xxh3-128",
                "chunk_digests": [bytes(16)], "shard": [0, 1, b""]}
        _HUGE[tensors] = b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True)
                                  for k, v in rest.items())
    head = b"".join(msgpack.packb(x) for x in ("model", model, "version", version))
    return b"\x87" + head + _HUGE[tensors]  # a map of 7 entries
