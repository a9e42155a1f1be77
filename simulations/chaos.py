"""The chaos suite: faults and a rogue peer against a real mesh of processes.

    python -m simulations.chaos --seeds 200 --json

is ``tensorhub bench chaos``; see :mod:`tensorhub.bench.chaos`, docs/benchmarks.md (the current
figures) and docs/benchmarks-history.md (what each attack and figure means).
"""

from __future__ import annotations

import sys

from tensorhub.bench.chaos import main

if __name__ == "__main__":
    sys.exit(main())
