"""The copy threads' ``run_each``: every call queued at once, results in order, the
first error raised only once every call is done, and a cancelled caller still waits."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from tensorhub.transport.copy_threads import CopyPool


async def test_results_come_back_in_order_from_every_thread() -> None:
    pool = CopyPool()
    seen: set[int] = set()

    def work(i: int) -> int:
        seen.add(threading.get_ident())
        time.sleep(0.01)
        return i * i

    assert await pool.run_each(work, [(i,) for i in range(8)]) == [i * i for i in range(8)]
    assert threading.get_ident() not in seen and 1 <= len(seen) <= pool.threads
    assert await pool.run_each(work, []) == []


async def test_the_first_error_is_raised_after_every_call_is_done() -> None:
    pool = CopyPool()
    done: list[int] = []

    def work(i: int) -> int:
        if i == 1:
            raise ValueError("call 1 failed")
        time.sleep(0.02)
        done.append(i)
        return i

    with pytest.raises(ValueError, match="call 1 failed"):
        await pool.run_each(work, [(i,) for i in range(4)])
    assert sorted(done) == [0, 2, 3]  # the others ran to the end first


async def test_a_cancelled_caller_waits_for_its_calls() -> None:
    pool = CopyPool()
    done: list[int] = []

    def work(i: int) -> None:
        time.sleep(0.05)
        done.append(i)

    with trio.move_on_after(0.01):
        await pool.run_each(work, [(0,), (1,)])
    assert sorted(done) == [0, 1]  # they write memory the caller owns: never abandoned
