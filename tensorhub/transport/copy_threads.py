"""Worker threads for the data plane's copies and checks: the same-host reader's copies
(:mod:`.samehost.reader`) and the TCP reader's digest checks of streamed chunks
(:mod:`.tcp`), each taken by the next free thread without an event-loop hand-over."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any, TypeVar

import outcome
import trio

_T = TypeVar("_T")


class CopyPool:
    """Worker threads for copies and checks, one per usable core (at most 8), fed
    from one queue.  Unlike ``trio.to_thread`` a thread that finishes a copy takes the
    next queued one at once, without waiting for the event loop to hand it over: with
    a few reads in flight the cores never idle between chunks (on a 2-core host that
    hand-over took longer than the copy)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._threads = 0
        self._lock = threading.Lock()
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cores = os.cpu_count() or 2
        self._limit = max(1, min(8, cores))

    def _work(self) -> None:
        while True:
            self._jobs.get()()

    def _start(self) -> None:
        with self._lock:
            if self._threads < self._limit:
                self._threads += 1
                threading.Thread(target=self._work, name="tensorhub-shm-copy",
                                 daemon=True).start()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` in a pool thread, not waiting for it (it must not raise)."""
        self._start()
        self._jobs.put(fn)

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in a pool thread; waits for it even when cancelled (the copy
        writes into memory the caller owns and reads memory the holder leased)."""
        self._start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[outcome.Outcome[_T]] = []

        def job() -> None:
            result.append(outcome.capture(fn, *args))
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        self._jobs.put(job)
        with trio.CancelScope(shield=True):
            await done.wait()
        return result[0].unwrap()


pool = CopyPool()


def _new_pool() -> None:
    global pool
    pool = CopyPool()  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_new_pool)
