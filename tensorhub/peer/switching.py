"""The interpreter's thread switch interval while peers run in this process.

A peer moves bytes in threads (readers, senders, checks) that give up the GIL for each
system call or hash and take it back after.  While another thread of the process runs
Python (an engine's scheduler, a training loop's bookkeeping), each take waits for that
thread's switch interval, 5 ms by default, and a fetch waits that long many times per
chunk.  Measured here (a 40 MB fetch over loopback beside one thread spinning in
Python): 259-391 ms at 5 ms, 35-59 ms at 0.5 ms; 18-20 ms with no such thread.

:func:`switch_interval` shortens it while at least one peer runs, where the process
still has Python's default, and puts the default back when the last one closes (unless
someone else changed it meanwhile).  ``PeerConfig.switch_interval`` = None leaves the
interval alone.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

PYTHON_DEFAULT = 0.005
"""``sys.getswitchinterval()`` of a process that never set it."""

_lock = threading.Lock()
_users = 0
_ours: float | None = None  # the interval the first peer set, while peers run


@contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """Shorten the switch interval to ``seconds`` while the block runs (see the module
    docstring)."""
    global _users, _ours
    with _lock:
        now = sys.getswitchinterval()
        if seconds is not None and _users == 0 and abs(now - PYTHON_DEFAULT) < 1e-9 \
                and seconds < now:
            sys.setswitchinterval(seconds)
            _ours = sys.getswitchinterval()
        if seconds is not None:
            _users += 1
    try:
        yield
    finally:
        if seconds is not None:
            with _lock:
                _users -= 1
                if _users == 0 and _ours is not None:
                    if abs(sys.getswitchinterval() - _ours) < 1e-9:
                        sys.setswitchinterval(PYTHON_DEFAULT)
                    _ours = None


def describe(seconds: float | None) -> str:
    """The switch interval now and why, for a peer configured with ``seconds``
    (``statistics().switch_interval``)."""
    now = sys.getswitchinterval()
    text = f"{now * 1000:g} ms"
    if seconds is None:
        return f"{text}: left as it is (PeerConfig.switch_interval is None)"
    if _ours is not None and abs(now - _ours) < 1e-9:
        return f"{text}: set by PeerConfig.switch_interval while peers run here"
    if abs(now - PYTHON_DEFAULT) < 1e-9:  # asked for a longer one: never lengthened
        return f"{text}: Python's default, left as it is"
    return f"{text}: set by this process, left as it is"
