"""Worker threads for the data plane's copies and checks: the same-host reader's copies
(:mod:`.samehost.reader`) and the TCP reader's digest checks of streamed chunks
(:mod:`.tcp`), each taken by the next free thread without an event-loop hand-over."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
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
        self.cores = max(1, cores)
        """The cores this process may run on."""
        self._limit = min(8, self.cores)

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


    async def run_each(self, fn: Callable[..., _T], calls: Sequence[tuple[Any, ...]]
                       ) -> list[_T]:
        """``fn(*args)`` for each ``args`` of ``calls``, all queued at once (each taken
        by the next free thread); waits for every one, even when cancelled, and returns
        their results in order, or raises the first one's error once all are done."""
        if not calls:
            return []
        for _ in calls:
            self._start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        results: list[outcome.Outcome[_T] | None] = [None] * len(calls)
        left = [len(calls)]
        lock = threading.Lock()

        def job(i: int, args: tuple[Any, ...]) -> None:
            results[i] = outcome.capture(fn, *args)
            with lock:
                left[0] -= 1
                last = not left[0]
            if last:
                with suppress(trio.RunFinishedError):
                    token.run_sync_soon(done.set)

        for i, args in enumerate(calls):
            self._jobs.put(partial(job, i, args))
        with trio.CancelScope(shield=True):
            await done.wait()
        return [r.unwrap() for r in results if r is not None]

    @property
    def threads(self) -> int:
        """How many threads the pool runs at most (one per usable core, up to 8)."""
        return self._limit


pool = CopyPool()


def _new_pool() -> None:
    global pool
    pool = CopyPool()  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_new_pool)
