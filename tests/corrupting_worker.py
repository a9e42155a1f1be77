"""``python tests/corrupting_worker.py CHUNKS <demo worker options>``: a demo worker
(``python -m tensorhub.ops.demo worker ...``, the same lines in and events out) whose data
server hands out the first ``CHUNKS`` chunks readers ask it for with one byte flipped
(:func:`corrupting.corrupt_served`): a holder process that sends bad bytes."""

from __future__ import annotations

import runpy
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from corrupting import corrupt_served

from tensorhub.peer import node


def main(chunks: int, worker_argv: list[str]) -> None:
    real_open_peer = node.open_peer

    @asynccontextmanager
    async def open_corrupting_peer(*args: Any, **kwargs: Any) -> AsyncIterator[node.Peer]:
        async with real_open_peer(*args, **kwargs) as peer:
            corrupt_served(peer, chunks)
            yield peer

    node.open_peer = open_corrupting_peer  # the demo worker opens its peer through this
    sys.argv = ["tensorhub.ops.demo", "worker", *worker_argv]
    runpy.run_module("tensorhub.ops.demo", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
