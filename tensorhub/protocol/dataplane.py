"""Messages of the data plane: a reader asks a holder for a manifest or a chunk.

Theory of operation
-------------------
A data-plane connection carries strictly alternating request / reply exchanges.  Each
frame is a 4-byte big-endian length followed by a codec-encoded message.  A ``Reply``
with ``status == OK`` and ``length > 0`` is followed by exactly ``length`` raw payload
bytes, which the reader lands straight in its destination buffer; nothing else on the
connection is unframed.  Status codes say why a holder would not serve, so a reader can
tell "try another holder" (``NOT_HELD``, ``NOT_YET``) from "you asked nonsense"
(``BAD_REQUEST``).
"""

from __future__ import annotations

from dataclasses import dataclass

OK = 0
NOT_HELD = 1
"""The holder does not (or no longer) serve this version: unpublished or never held."""
NOT_YET = 2
"""The holder is still fetching this chunk itself."""
BAD_REQUEST = 3
"""The request names a chunk outside the manifest or is otherwise invalid."""

FRAME_HEADER = 4
MAX_FRAME = 1 << 20  # requests and reply headers are small; manifests travel as payload


@dataclass(frozen=True, slots=True)
class ManifestRequest:
    req_id: int
    model: str
    version: int


@dataclass(frozen=True, slots=True)
class ChunkRequest:
    req_id: int
    model: str
    version: int
    chunk: int


@dataclass(frozen=True, slots=True)
class Reply:
    req_id: int
    status: int
    length: int
    detail: str = ""


MESSAGES = (ManifestRequest, ChunkRequest, Reply)
