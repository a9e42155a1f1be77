"""Shared-memory arrays: numpy buffers that a same-host reader maps instead of copying
through the kernel.

:func:`shared_empty` puts an array's memory in an anonymous memory file (``memfd``),
sealed so that it can never shrink, and maps it into this process.  A process-wide
registry maps the address range of each live file to its descriptor and inode, so that
the holder side of the same-host transport (:mod:`.holder`) can tell whether a leased
chunk lies in such files and, if so, grant the reader ``(fd, inode, offset, length)``
pieces instead of addresses.  The reader opens
``/proc/<holder pid>/fd/<fd>`` -- the kernel allows that exactly when it allows
``process_vm_readv``: same user, ptrace read permission -- checks the inode (descriptor
numbers get reused), maps the pages read-only and copies them with an ordinary memory
copy instead of the kernel's cross-process copy (``process_vm_readv``).

Lifetime: every view of the array keeps the mapping alive.  When the last one goes, the
mapping's finalizer (``__del__``, which the interpreter runs before the base type's
deallocation unmaps the pages) removes the registry entry and closes the descriptor:
no lookup can find a stale range, and no other thread can map a new file at the same
address while the old entry is still there.  (A weak-reference callback would run
*after* the unmapping, which releases the GIL: two threads then raced, and one found its
fresh mapping "registered twice".)  The finalizer may run inside a section of the same
thread that holds the registry's lock (any allocation there may start the garbage
collector): the lock is re-entrant, and the finalizer leaves the entry for that section
to remove as it ends instead of changing the registry under its feet (no new file can be
registered at that address before then).  The kernel frees the memory once no process
maps or holds the file any more -- a reader's mapping keeps it readable until the reader
lets go.

Fetch buffers: a fetch without ``into=`` lands in a new memory file
(:func:`fetch_buffer`), and allocating a memory file's pages costs far more than a
copy (measured on a 2-core VM: 0.76 s per GiB to fault in a new file's pages against
0.2 s for numpy's huge-page memory, and a whole 1 GiB fetch into ready arrays takes
0.34 s).  So the memory file of the last such buffer to be let go is kept, open and
unmapped, as the *spare*, and the next fetch buffer of the same size maps it again with
``MAP_POPULATE`` (0.08 s per GiB: the pages exist, only the page tables are filled).  A
training loop that fetches each step and drops an older version reuses one file after
another; the memory held beyond the live arrays is at most one buffer, until the next
fetch buffer is made (a spare of another size is closed then) or :func:`drop_spare`.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import fcntl
import mmap
import os
import stat
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import RemoteProtocolError, TransportError
from .checked_copy import copy_digest
from .streaming_copy import checked_then_copied, runs_of, stream_copy_all

Pieces = npt.NDArray[np.uint64]
"""``(fd, inode, offset, length)`` rows: where a chunk lies in the holder's memory files."""

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""A sealed file keeps its size: a reader's mapping can never fault past its end."""


def address_of(view: memoryview) -> int:
    """Where a non-empty buffer starts in memory (ctypes is quicker; numpy takes
    read-only buffers too)."""
    if view.readonly:
        return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Mapping(mmap.mmap):
    """A memory file's mapping, registered while it lives.  A Python subclass, for the
    finalizer that the interpreter runs before the base type unmaps the pages."""

    start = 0
    fd = -1
    spare = 0
    """Bytes of the file, when it is to be kept as the spare once unmapped (else 0)."""

    def __del__(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            _release(self.start, fd, self.spare)


_lock = threading.RLock()
_depth = 0
"""How many :func:`_locked` sections the thread holding ``_lock`` is in."""
_gone: list[tuple[int, int, int]] = []
"""``(start, fd, spare)`` of mappings finalized and not yet unregistered.  Any
allocation inside a section may start the garbage collector, which may free a mapping;
its finalizer, on the thread in the section, must neither wait for its own lock nor
change the registry under the section's feet, so it opens a nested section that only
leaves its entry here, and the outermost section unregisters it as it ends, before the
lock is let go."""
_starts: list[int] = []  # sorted start addresses of the live regions
_regions: dict[int, tuple[int, int, int]] = {}  # start -> (end, fd, inode)
_spare: tuple[int, int] | None = None  # (bytes, fd) of the kept fetch-buffer file


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """A section of the registry, under its lock.  The outermost one unregisters the
    mappings finalized meanwhile as it ends (their descriptors closed after the lock)."""
    global _depth
    closing: list[int] = []
    with _lock:
        _depth += 1
        try:
            yield
        finally:
            if _depth == 1:
                while _gone:
                    closing.append(_unregister(*_gone.pop()))
            _depth -= 1
    for fd in closing:
        if fd >= 0:
            os.close(fd)


def shared_empty(shape: int | Sequence[int], dtype: npt.DTypeLike = np.float32
                 ) -> np.ndarray[Any, Any]:
    """A new uninitialised array, like ``numpy.empty``, whose memory same-host readers
    can map: a peer that publishes arrays allocated here serves them to fetchers on its
    host with a plain memory copy (transport ``shm-memfd``) instead of the kernel's
    ``process_vm_readv`` (``shm``).  Each call holds one file descriptor while the array
    lives, and a reader opens and maps each file once per connection, so allocate many
    tensors as views of one larger array.  Falls back to ``numpy.empty`` where the
    platform has no ``memfd_create`` (and for empty arrays)."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    if nbytes <= 0 or not hasattr(os, "memfd_create"):
        return np.empty(dims, dtype=dt)
    return np.frombuffer(_map(_new_file(nbytes), nbytes), dtype=dt).reshape(dims)


def fetch_buffer(nbytes: int) -> np.ndarray[Any, Any]:
    """A new uninitialised ``uint8`` array of ``nbytes`` for a fetch to land in, like
    :func:`shared_empty`; its memory file is kept as the spare when the array and its
    views are gone, and the spare is mapped again for the next fetch buffer of the same
    size (see the module docstring)."""
    global _spare
    if nbytes <= 0 or not hasattr(os, "memfd_create"):
        return np.empty(max(nbytes, 0), np.uint8)
    with _locked():
        spare, _spare = _spare, None
    if spare is not None and spare[0] != nbytes:
        os.close(spare[1])
        spare = None
    mapping = _map(_new_file(nbytes) if spare is None else spare[1], nbytes,
                   populate=spare is not None)
    mapping.spare = nbytes
    return np.frombuffer(mapping, dtype=np.uint8)


def spare_bytes() -> int:
    """Bytes of the kept fetch-buffer file (0: none)."""
    with _locked():
        return 0 if _spare is None else _spare[0]


def drop_spare() -> bool:
    """Close the kept fetch-buffer file, if any, giving its memory back; whether there
    was one."""
    global _spare
    with _locked():
        spare, _spare = _spare, None
    if spare is not None:
        os.close(spare[1])
    return spare is not None


def _new_file(nbytes: int) -> int:
    fd = os.memfd_create("tensorhub", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(fd: int, nbytes: int, populate: bool = False) -> _Mapping:
    """``fd`` mapped and registered; the mapping owns ``fd`` from here on (``populate``:
    fill the page tables now, for a file whose pages exist)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    try:
        mapping = _Mapping(fd, nbytes, flags=flags)
    except BaseException:
        os.close(fd)
        raise
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    _register(start, start + nbytes, fd, os.fstat(fd).st_ino)
    mapping.start, mapping.fd = start, fd
    return mapping


def _register(start: int, end: int, fd: int, inode: int) -> None:
    with _locked():
        i = bisect.bisect_left(_starts, start)
        if i < len(_starts) and _starts[i] == start:  # pragma: no cover - a bug
            raise AssertionError(f"memory at {start:#x} registered twice")
        _starts.insert(i, start)
        _regions[start] = (end, fd, inode)


def _release(start: int, fd: int, spare: int = 0) -> None:
    """The mapping at ``start`` is going: unregister it and close ``fd``, or keep it as
    the spare (``spare``: its bytes), closing the one it replaces.  Run by the mapping's
    finalizer, on whichever thread let go of it last; inside a section of that thread,
    that section does it as it ends."""
    with _locked():
        _gone.append((start, fd, spare))


def _unregister(start: int, fd: int, spare: int) -> int:
    """:func:`_release`'s work, at the end of the outermost section; returns the
    descriptor to close (-1: none)."""
    global _spare
    _starts.pop(bisect.bisect_left(_starts, start))
    del _regions[start]
    if spare > 0:
        spare_fd = fd
        fd = -1 if _spare is None else _spare[1]
        _spare = (spare, spare_fd)
    return fd


def registered() -> int:
    """How many shared arrays are alive in this process (for tests and statistics)."""
    return len(_starts)


def pieces_of(segments: Sequence[memoryview]) -> Pieces | None:
    """Where ``segments`` lie in this process's memory files, neighbours merged; None
    unless every non-empty segment lies wholly in one."""
    rows: list[tuple[int, int, int, int]] = []
    with _locked():
        for seg in segments:
            if not seg.nbytes:
                continue
            at = address_of(seg)
            i = bisect.bisect_right(_starts, at) - 1
            if i < 0:
                return None
            start = _starts[i]
            end, fd, inode = _regions[start]
            if at + seg.nbytes > end:
                return None
            offset = at - start
            if rows and rows[-1][0] == fd and rows[-1][2] + rows[-1][3] == offset:
                rows[-1] = (fd, inode, rows[-1][2], rows[-1][3] + seg.nbytes)
            else:
                rows.append((fd, inode, offset, seg.nbytes))
    return np.array(rows, dtype=np.uint64).reshape(-1, 4) if rows else None


# -- reader side: the holder's files, mapped ------------------------------------------


_Key = tuple[int, int, int]  # (holder pid, holder's descriptor, inode)

KEEP_IDLE_S = 60.0
"""A mapping unused this long is dropped even while its holder keeps the file."""

_maps_lock = threading.Lock()
_maps: dict[_Key, tuple[npt.NDArray[np.uint8], float]] = {}  # -> (pages, last used)
_sweeping = False


def _still_open(key: _Key) -> bool:
    """Whether the holder still has that very file open under that descriptor."""
    pid, fd, inode = key
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
    except OSError:
        return False


def sweep_mappings(pid: int | None = None) -> int:
    """Drop the cached mappings (of holder ``pid``, or of every holder) whose file the
    holder closed or that went unused for :data:`KEEP_IDLE_S`; returns how many remain.
    A mapping keeps its file's memory alive, so one is kept only while the holder has
    the file open too: then keeping it costs no memory."""
    now = time.monotonic()
    with _maps_lock:
        used = {k: at for k, (_, at) in _maps.items() if pid is None or k[0] == pid}
    gone = [k for k, at in used.items() if now - at > KEEP_IDLE_S or not _still_open(k)]
    with _maps_lock:
        for k in gone:
            if _maps.get(k, (None, now))[1] == used[k]:  # unless reused meanwhile
                del _maps[k]
        return len(_maps)


def _sweeper() -> None:
    """Sweep every second while any mapping is cached, so that a holder's freed memory is
    released within about a second even when this process reads nothing more."""
    global _sweeping
    while True:
        time.sleep(1.0)
        with _maps_lock:
            if not _maps:
                _sweeping = False
                return
        sweep_mappings()


def cached_mappings() -> int:
    """How many holder files this process keeps mapped (for tests and statistics)."""
    with _maps_lock:
        return len(_maps)


def _forget_after_fork() -> None:
    global _sweeping
    _maps.clear()  # a child reads through its own connections, with its own mappings
    _sweeping = False


os.register_at_fork(after_in_child=_forget_after_fork)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int64)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Pages:
    """A read-only mapping as numpy sees it; unmapped once no array uses it."""

    def __init__(self, at: int, size: int) -> None:
        self.__array_interface__ = {"data": (at, True), "shape": (size,),
                                    "typestr": "|u1", "version": 3}
        weakref.finalize(self, _libc.munmap, at, size).atexit = False


def _map_read_only(fd: int, size: int) -> npt.NDArray[np.uint8]:
    """``fd``'s first ``size`` bytes, mapped shared and read-only, holding no descriptor.
    (``mmap.mmap`` keeps a duplicate of the descriptor while the mapping lives -- before
    Python 3.13 unavoidably -- which cost a reader one descriptor per holder file it
    keeps mapped, after its connections closed too: 6,000 for a holder of 6,000 small
    arrays, where the usual limit is 1,024.)"""
    at = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if at is None or at == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return np.asarray(_Pages(at, size))


class MappedFiles:
    """The holder's memory files that one reader connection reads, read-only:
    ``(fd, inode)`` -> the file's pages.  Used by one worker thread at a time.

    Mappings are shared by every connection of this process and kept after they close
    (a process-wide cache keyed by holder pid, descriptor and inode), so a reader that
    fetches version after version from buffers the holder reuses maps them once: mapping
    a file and faulting its pages in costs about 40 ms per GiB here, unmapping about 12.
    Each connection checks a cached mapping once, before its first use, against
    ``/proc/<pid>/fd/<fd>``: while the mapping lives its inode cannot be reused, so the
    same inode there means the same file.  A mapping is dropped once its holder closes
    the file or exits (checked by :meth:`close` and a sweeper thread every second), or
    after :data:`KEEP_IDLE_S` unused."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.pid = 0
        """The holder's process id, once its handshake is checked."""
        self.mapped: dict[tuple[int, int], npt.NDArray[np.uint8]] = {}
        """The files this connection checked and uses."""

    def _open(self, fd: int, inode: int) -> npt.NDArray[np.uint8]:
        got = self.mapped.get((fd, inode))
        if got is not None:
            return got
        key = (self.pid, fd, inode)
        global _sweeping
        with _maps_lock:  # one mapping per file, however many connections ask at once
            cached = _maps.get(key)
            got = cached[0] if cached is not None and _still_open(key) else self._map(fd, inode)
            _maps[key] = (got, time.monotonic())
            start, _sweeping = not _sweeping, True
        if start:
            threading.Thread(target=_sweeper, name="tensorhub-shm-sweep", daemon=True).start()
        self.mapped[fd, inode] = got
        return got

    def _map(self, fd: int, inode: int) -> npt.NDArray[np.uint8]:
        path = f"/proc/{self.pid}/fd/{fd}"
        try:
            mine = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise TransportError(f"opening memory file {fd} of {self.peer} ({path}): "
                                 f"{exc.strerror}; the holder exited or closed it") from None
        try:
            st = os.fstat(mine)
            if st.st_ino != inode:
                raise TransportError(
                    f"{path} of {self.peer} is inode {st.st_ino}, not the granted {inode}: "
                    "the holder exited or reused the descriptor")
            try:
                seals = fcntl.fcntl(mine, fcntl.F_GET_SEALS)
            except OSError:  # not a memory file at all
                seals = 0
            if not (stat.S_ISREG(st.st_mode) and seals & fcntl.F_SEAL_SHRINK and st.st_size):
                raise RemoteProtocolError(f"{self.peer} granted {path}, which is not a "
                                          "non-empty memory file sealed against shrinking")
            return _map_read_only(mine, st.st_size)
        finally:
            os.close(mine)  # the mapping keeps the file

    def copy(self, parts: Sequence[tuple[Pieces, Sequence[memoryview]]]) -> None:
        """For each ``(pieces, dest)``: copy the granted ``(fd, inode, offset, length)``
        pieces, in order, into ``dest`` (whose sizes add up to theirs).  Neighbouring
        pieces are copied as one run (:func:`.streaming_copy.stream_copy_all`)."""
        stream_copy_all([pair for pieces, dest in parts for pair in self._pairs(pieces, dest)])

    def checked_then_copied(self, pieces: Pieces, dest: Sequence[memoryview]
                            ) -> Iterator[memoryview]:
        """Copy the granted pieces into ``dest`` as :meth:`copy` does, handing out each
        block of the holder's bytes for a check just before it is copied
        (:func:`.streaming_copy.checked_then_copied`)."""
        return checked_then_copied(self._pairs(pieces, dest))

    def copy_digest(self, pieces: Pieces, dest: Sequence[memoryview]) -> bytes:
        """Copy the granted pieces into ``dest`` as :meth:`copy` does, and return the
        xxh3-128 digest of the holder's bytes as the copy read them
        (:func:`.checked_copy.copy_digest`)."""
        pairs = self._pairs(pieces, dest)  # keeps the mappings while their bytes are read
        runs = runs_of(pairs)
        return copy_digest(runs, sum(n for _, _, n in runs))

    def _pairs(self, pieces: Pieces, dest: Sequence[memoryview]
              ) -> list[tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]]:
        """``(destination, source)`` arrays of equal length that together copy the
        granted pieces, in order, into ``dest`` (whose sizes add up to theirs)."""
        sources = []
        for fd, inode, offset, length in pieces.tolist():
            pages = self._open(fd, inode)
            if offset + length > len(pages):
                raise RemoteProtocolError(
                    f"{self.peer} granted bytes {offset}..{offset + length} of a "
                    f"{len(pages)}-byte memory file")
            sources.append(pages[offset:offset + length])
        targets = [np.frombuffer(d, np.uint8) for d in dest if d.nbytes]
        out = []
        si = ti = so = to = 0
        while si < len(sources):
            src, dst = sources[si], targets[ti]
            n = min(len(src) - so, len(dst) - to)
            out.append((dst[to:to + n], src[so:so + n]))
            so, to = so + n, to + n
            if so == len(src):
                si, so = si + 1, 0
            if to == len(dst):
                ti, to = ti + 1, 0
        return out

    def close(self) -> None:
        """Let go of this connection's files; the cache keeps those the holder still has
        open (a mapping goes once no copy and no cache entry uses it)."""
        self.mapped.clear()
        if self.pid:
            sweep_mappings(self.pid)
