"""The registry of shared-memory arrays stays consistent, and never deadlocks, when a
mapping is finalized while its own thread holds the registry's lock.

Any allocation inside a locked section may start the garbage collector, and the
collector may free a mapping whose finalizer unregisters it.  A holder once hung in
``pieces_of`` this way: its finalizer waited for the lock its own thread held.  Each
case runs in a child process with a time limit, so a regression fails instead of
hanging the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")


def run_child(code: str, timeout: float = 60.0) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child hung for {timeout} s (a finalizer waiting for its own lock)")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_mapping_let_go_inside_pieces_of_is_unregistered_and_closed() -> None:
    out = run_child("""
        import os
        from collections.abc import Sequence
        import numpy as np
        from tensorhub.transport.samehost.memory_files import pieces_of, registered, shared_empty

        class LastReferences(Sequence):
            # each segment comes with its array's last reference, let go as the loop
            # moves on to the next: its mapping is finalized inside the locked section
            def __init__(self, n):
                self.arrays = [shared_empty(4096, np.uint8) for _ in range(n)]
            def __len__(self):
                return len(self.arrays)
            def __getitem__(self, i):
                if not self.arrays:
                    raise IndexError(i)
                return memoryview(self.arrays.pop())

        before = registered()
        rows = pieces_of(LastReferences(5))
        assert rows is not None and rows.shape == (5, 4), rows
        assert registered() == before, (registered(), before)
        for fd in rows[:, 0].tolist():  # every file's descriptor was closed
            try:
                os.fstat(int(fd))
            except OSError:
                continue
            raise AssertionError(f"descriptor {fd} still open")
        keep = shared_empty(4096, np.uint8)  # the registry still works
        assert registered() == before + 1
        print("ok")
    """)
    assert out.strip() == "ok"


def test_fetch_buffers_collected_as_garbage_during_lookups_on_three_threads() -> None:
    """Cyclic garbage holding fetch buffers (their files kept as the spare) and shared
    arrays, collected at any allocation on any thread, while all three look up
    pieces: every lookup answers, and at the end the registry holds exactly the live
    arrays and at most one spare file.  (Under load, the first attempt at a fix still
    hung here: a collection between clearing its "in a section" mark and letting the lock
    go.)"""
    out = run_child("""
        import gc, threading
        import numpy as np
        from tensorhub.transport.samehost import memory_files as mf

        gc.set_threshold(5)
        live = mf.shared_empty(1 << 16, np.uint8)
        segs = [memoryview(live)[i:i + 256] for i in range(0, 1 << 16, 512)]
        errors = []

        class Cycle:
            pass

        def churn(n):
            try:
                for i in range(n):
                    c = Cycle()
                    c.me = c
                    c.arr = mf.fetch_buffer(8192) if i % 2 else mf.shared_empty(4096, np.uint8)
                    rows = mf.pieces_of(segs)
                    assert rows is not None and int(rows[:, 3].sum()) == 256 * len(segs)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=churn, args=(2000,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gc.collect()
        assert not errors, errors
        assert mf.registered() == 1, mf.registered()
        assert mf.spare_bytes() in (0, 8192), mf.spare_bytes()
        print("ok")
    """)
    assert out.strip() == "ok"
