"""Linux cross-memory attach: copying another process's memory with
``process_vm_readv`` (the same-host transport's path for plain arrays, and its handshake).

The kernel allows it when it allows ptrace reads of the other process: same user,
``kernel.yama.ptrace_scope`` 0, no seccomp filter.  Addresses travel as iovec rows;
:func:`readv_all` hands them to the kernel ``IOV_MAX`` at a time on each side.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import TransportError
from .memory_files import address_of

Iovecs = npt.NDArray[np.uint64]
"""``(address, length)`` rows: the layout of Linux ``struct iovec`` on 64-bit hosts."""

IOV_MAX = 1024  # iovecs per process_vm_readv call, on each side

_libc = ctypes.CDLL(None, use_errno=True)
_vm_readv: Any = getattr(_libc, "process_vm_readv", None)
if _vm_readv is not None:
    _vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                          ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _vm_readv.restype = ctypes.c_ssize_t

_WHY = {
    errno.EPERM: "not permitted: another user, or kernel.yama.ptrace_scope or a seccomp "
                 "filter forbids process_vm_readv",
    errno.ESRCH: "no such process: the holder is gone",
    errno.EFAULT: "an address is not mapped: the holder granted memory it does not have",
    errno.ENOSYS: "this kernel has no process_vm_readv",
}


def iovecs_of(views: Sequence[memoryview]) -> Iovecs:
    """The ``(address, length)`` of each non-empty view, neighbours in memory merged."""
    iov = np.array([(address_of(v), v.nbytes) for v in views if v.nbytes],
                   dtype=np.uint64).reshape(-1, 2)
    if len(iov) > 1:
        starts = np.flatnonzero(np.r_[True, iov[1:, 0] != iov[:-1, 0] + iov[:-1, 1]])
        iov = np.column_stack((iov[starts, 0], np.add.reduceat(iov[:, 1], starts)))
    return iov


class _Cursor:
    """A position in a list of iovecs, handed to the kernel IOV_MAX at a time."""

    def __init__(self, iov: Iovecs) -> None:
        self.iov = iov
        self.row = 0
        self.skip = 0  # bytes of ``iov[row]`` already consumed

    def batch(self) -> Iovecs:
        out = self.iov[self.row:self.row + IOV_MAX].copy()
        out[0, 0] += self.skip
        out[0, 1] -= self.skip
        return out

    def advance(self, n: int) -> None:
        lengths = self.iov[self.row:self.row + IOV_MAX, 1].astype(np.int64)
        ends = np.cumsum(lengths) - self.skip
        done = int(np.searchsorted(ends, n, side="right"))
        if done:
            self.row += done
            self.skip = n - int(ends[done - 1])
        else:
            self.skip += n



def readv_all(pid: int, local: Iovecs, remote: Iovecs) -> None:
    """Copy ``remote`` (memory of process ``pid``) into ``local``; same total length."""
    if _vm_readv is None:
        raise TransportError("this platform has no process_vm_readv")
    left = int(local[:, 1].sum())
    mine, theirs = _Cursor(local), _Cursor(remote)
    while left:
        lb, rb = mine.batch(), theirs.batch()
        n = _vm_readv(pid, lb.ctypes.data, len(lb), rb.ctypes.data, len(rb), 0)
        if n <= 0:
            err = ctypes.get_errno() if n < 0 else errno.EFAULT
            why = _WHY.get(err) or os.strerror(err)
            raise TransportError(f"reading holder pid {pid}: {errno.errorcode.get(err)}: {why}")
        mine.advance(n)
        theirs.advance(n)
        left -= n


def shm_available() -> tuple[bool, str]:
    """Whether this host lets peers read each other's memory, and why (not)."""
    if _vm_readv is None:
        return False, "this platform has no process_vm_readv (Linux only)"
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        scope = 0
    if scope:
        return False, (f"kernel.yama.ptrace_scope={scope} forbids reading another process's "
                       "memory; set it to 0 to move chunks through shared memory")
    src, dst = bytearray(b"tensorhub"), bytearray(9)
    try:
        readv_all(os.getpid(), iovecs_of([memoryview(dst)]), iovecs_of([memoryview(src)]))
        os.close(os.pidfd_open(os.getpid()))  # how a reader watches its holder
    except TransportError as exc:
        return False, str(exc)
    except OSError as exc:
        return False, f"pidfd_open: {exc.strerror} (needs Linux 5.3)"
    return True, "process_vm_readv works: one copy, no socket on the payload path"

