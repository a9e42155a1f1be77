"""The transport seam: how a reader gets bytes from a holder.

A transport opens a :class:`Connection` to one holder; the connection asks for a
manifest, for one chunk or for a stream of chunks, and lands each chunk's bytes straight
in the destination segments it is given.  The serving side is the same for every transport: a
:class:`Provider` hands out *leases* on the memory of verified chunks, and the holder's
unpublish waits for leases to end.  Every transport is checked by one conformance suite
(``tests/transport_conformance.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeGuard

from ..model import VersionKey
from ..protocol.sizing import StreamWindow

Verifier = Callable[[Sequence[memoryview]], None]
"""``verify(dest)``: the check of a chunk once its bytes landed in ``dest``; raises if
they fail it."""


class SourceVerifier(Protocol):
    """A :data:`Verifier` that may also be given the chunk's bytes *at the source*, as a
    copy hands them over: ``check_source(blocks)`` reads each block once, in order,
    before it asks for the next, and raises as the verifier does.  A same-host reader
    then reads the holder's memory once (check and copy from the cache) instead of
    twice (copy, then check what landed).

    A fetch offers it only for checks against the manifest's fast local digests, which
    it uses only for a holder that could write this process's memory anyway
    (:attr:`Connection.holder_shares_memory`): such a holder gains nothing by changing
    a block between its check and its copy."""

    def __call__(self, landed: Sequence[memoryview]) -> None: ...

    def check_source(self, blocks: Iterable[memoryview]) -> None: ...


def checks_source(verify: Verifier | None) -> TypeGuard[SourceVerifier]:
    """Whether ``verify`` is a :class:`SourceVerifier`: a plain attribute look-up (0.1-0.2
    us here), where ``isinstance`` against a runtime-checkable protocol took 7-14 us --
    twice for every chunk, once on the event loop's thread."""
    return callable(getattr(verify, "check_source", None))


class DigestVerifier(Protocol):
    """A :data:`Verifier` that names its digest, so a reader may hash the chunk's bytes
    itself as they land and hand over the result: ``check_digest(digest, seconds)``
    raises as the verifier does (``seconds``: the time spent hashing)."""

    algo: str

    def __call__(self, landed: Sequence[memoryview]) -> None: ...

    def check_digest(self, digest: bytes, seconds: float) -> None: ...


def takes_digest(verify: Verifier | None) -> TypeGuard[DigestVerifier]:
    """Whether ``verify`` is a :class:`DigestVerifier` (an attribute look-up, as in
    :func:`checks_source`)."""
    return callable(getattr(verify, "check_digest", None))


Take = Callable[[int], Sequence[tuple[int, Sequence[Any], Verifier | None]]]
"""``take(budget)``: claim consecutive chunks to stream next, about ``budget`` bytes of
them (at least one chunk while any is left; none ends the stream): ``(chunk,
destination, verify)`` each."""
Landed = Callable[[int, "int | Exception"], bool]
"""``landed(chunk, result)``: the chunk's bytes landed and passed ``verify`` (``result``
is their count), or it failed with ``result`` (:class:`NotServing`: refused, the stream
goes on; anything else: its bytes are not to be used).  Returns False to end the stream
at once (a connection with chunks still in flight is then closed: they are not read)."""


class NotServing(Exception):
    """Raised by a :class:`Provider` to answer a request with a non-OK status."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Provider(Protocol):
    """What a holder serves: its manifests, and leases on verified chunk memory."""

    def manifest_bytes(self, key: VersionKey) -> bytes:
        """Encoded manifest of ``key``; raises :class:`NotServing` if not held."""
        ...

    async def wait_chunk(self, key: VersionKey, chunk: int) -> None:
        """If this holder is still receiving ``chunk``, wait (bounded) until it is
        verified, so a downstream reader pipelines behind us.  Returns at once when the
        chunk is verified, not held, or not expected here."""
        ...

    def lease(self, key: VersionKey, chunk: int) -> AbstractContextManager[Sequence[memoryview]]:
        """Pin the chunk's memory while it is being sent; raises :class:`NotServing`."""
        ...


class Connection(Protocol):
    """One reader's connection to one holder, used by one task at a time.  A read that
    fails or is cancelled mid-exchange closes the connection (ending the holder's lease);
    a :class:`NotServing` refusal leaves it usable.

    A connection whose ``lands_arrays`` attribute is true (TCP) also takes the
    destination arrays themselves as ``dest`` (any C-contiguous buffers, sized by
    ``nbytes``), so a chunk of many small tensors costs the fetcher no view per tensor;
    the others get byte views."""

    transport: str
    peer: str
    lands_arrays: bool
    lands_device: bool
    """Whether ``dest`` may be device memory (objects with ``__cuda_array_interface__``,
    :class:`~tensorhub.device.buffers.DeviceBytes`): a fetch into GPU tensors then
    lands chunks in place instead of in its staging ring (CUDA IPC)."""
    holder_shares_memory: bool
    """Whether the holder is shown to be a process of this host run by this user (or
    root): one that could write this reader's memory anyway.  The fetcher then checks
    chunks against the manifest's fast ``local_digests`` (see
    :attr:`~tensorhub.manifest.manifest.Manifest.local_digests`)."""
    batch_bytes: int
    """How many bytes of consecutive chunks a reader should hand one :meth:`read_chunks`
    call: nonzero only where each read has a cost worth sharing (a same-host version
    lease: one worker-thread call per read)."""

    async def read_manifest(self, key: VersionKey) -> bytes: ...

    async def read_chunk(
        self, key: VersionKey, chunk: int, dest: Sequence[memoryview],
        verify: Verifier | None = None,
    ) -> int:
        """Fill ``dest`` (whose sizes add up to the chunk) and return the bytes read.
        ``verify(dest)``, if given, runs once the bytes have landed -- in the same worker
        thread where the transport copies in one -- and raises if they are bad."""
        ...

    async def read_chunks(
        self, key: VersionKey, chunks: Sequence[int], dests: Sequence[Sequence[memoryview]],
        verifies: Sequence[Verifier | None],
    ) -> list[int | Exception]:
        """Read several chunks, each as :meth:`read_chunk` would: one entry per chunk
        read, in order -- its bytes, or the exception it failed with (its bytes are not
        to be used).  Chunks past the end of the list were not read.  Raises, as
        :meth:`read_chunk` does, when no chunk was read."""
        ...

    async def stream_chunks(self, key: VersionKey, take: Take, landed: Landed,
                            window: StreamWindow) -> None:
        """Stream chunks of ``key``: ask for what ``take`` gives while fewer than
        ``window.bytes()`` are in flight, and report each chunk to ``landed`` as it lands
        (verified).  Returns once ``take`` gives nothing and every chunk taken has been
        reported, or ``landed`` said stop.  Raises (the connection then closed) when the
        connection fails: chunks taken and not reported were not read.  A transport
        that measures its streams tells ``window`` what it saw."""
        ...

    async def aclose(self) -> None: ...


async def read_each(conn: Connection, key: VersionKey, chunks: Sequence[int],
                    dests: Sequence[Sequence[memoryview]], verifies: Sequence[Verifier | None]
                    ) -> list[int | Exception]:
    """:meth:`Connection.read_chunks` as one :meth:`~Connection.read_chunk` after
    another, up to the first that fails."""
    out: list[int | Exception] = []
    for chunk, dest, verify in zip(chunks, dests, verifies, strict=True):
        try:
            out.append(await conn.read_chunk(key, chunk, dest, verify))
        except Exception as exc:
            if not out:
                raise
            out.append(exc)
            break
    return out


async def stream_each(conn: Connection, key: VersionKey, take: Take, landed: Landed) -> None:
    """:meth:`Connection.stream_chunks` as reads one after another, each of up to
    ``conn.batch_bytes`` (for a transport whose reads cost no round trip, or that has no
    streamed runs); a refusal or a failed check is reported and the stream goes on."""
    queue: list[tuple[int, Sequence[Any], Verifier | None]] = []
    failed: dict[int, Exception] = {}

    def guarded(chunk: int, verify: Verifier | None) -> Verifier | None:
        if verify is None:
            return None
        if checks_source(verify):
            kind = _GuardedDigestSource if takes_digest(verify) else _GuardedSource
            return kind(chunk, verify, failed)
        return _Guarded(chunk, verify, failed)

    while True:
        if not queue:
            queue = list(take(max(conn.batch_bytes, 1)))
            if not queue:
                return
        chunks = [c for c, _, _ in queue]
        try:
            results = await conn.read_chunks(key, chunks, [d for _, d, _ in queue],
                                             [guarded(c, v) for c, _, v in queue])
        except NotServing as ns:  # the first chunk, refused; the connection is in step
            results = [ns]
        for chunk, result in zip(chunks, results, strict=False):
            if not landed(chunk, failed.pop(chunk, result)):
                return
        del queue[:len(results)]


class _Guarded:
    """A chunk's check whose failure is kept as that chunk's result, not raised (the
    read of the other chunks goes on): :func:`stream_each`."""

    def __init__(self, chunk: int, verify: Verifier, failed: dict[int, Exception]) -> None:
        self.chunk, self.verify, self.failed = chunk, verify, failed

    def __call__(self, landed: Sequence[memoryview]) -> None:
        try:
            self.verify(landed)
        except Exception as exc:  # that chunk's result, not the read's
            self.failed[self.chunk] = exc


class _GuardedSource(_Guarded):
    """:class:`_Guarded` for a :class:`SourceVerifier`, which it stays."""

    verify: SourceVerifier

    def check_source(self, blocks: Iterable[memoryview]) -> None:
        try:
            self.verify.check_source(blocks)
        except Exception as exc:  # that chunk's result, not the read's
            self.failed[self.chunk] = exc


class _GuardedDigestSource(_GuardedSource):
    """:class:`_GuardedSource` for a verifier that is a :class:`DigestVerifier` too,
    which it stays (a same-host copy may hash what it copies:
    :mod:`tensorhub.transport.samehost.checked_copy`)."""

    verify: Any

    @property
    def algo(self) -> str:
        algo: str = self.verify.algo
        return algo

    def check_digest(self, digest: bytes, seconds: float) -> None:
        try:
            self.verify.check_digest(digest, seconds)
        except Exception as exc:  # that chunk's result, not the read's
            self.failed[self.chunk] = exc
