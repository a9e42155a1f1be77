"""Where a leased version's bytes lie: the reader's look-up of a byte range's pieces."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tensorhub.model import VersionKey
from tensorhub.transport.samehost.reader import _VersionLease

KEY = VersionKey("m", 1)


@st.composite
def lease_and_range(draw: st.DrawFn) -> tuple[list[tuple[int, int, int, int]], int, int]:
    """Pieces ``(fd, inode, offset, length)`` of a version (lengths >= 1), and a byte
    range ``[start, stop)`` within it."""
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=12))
    pieces = [(draw(st.integers(3, 9)), draw(st.integers(1, 1 << 40)),
               draw(st.integers(0, 1 << 33)), n) for n in lengths]
    total = sum(lengths)
    start = draw(st.integers(0, total - 1))
    stop = draw(st.integers(start + 1, total))
    return pieces, start, stop


def byte_places(rows: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int]]:
    """Every byte the rows name, as ``(fd, inode, offset)``, in order."""
    return [(fd, inode, offset + i) for fd, inode, offset, n in rows for i in range(n)]


@given(lease_and_range())
def test_the_pieces_of_a_range_name_exactly_its_bytes_in_order(
        case: tuple[list[tuple[int, int, int, int]], int, int]) -> None:
    pieces, start, stop = case
    total = sum(p[3] for p in pieces)
    lease = _VersionLease(KEY, 1, total, 8, np.array(pieces, dtype=np.uint64))
    got = lease.pieces_of(start, stop)
    assert got.dtype == np.uint64 and got.shape[1] == 4
    rows = [tuple(int(x) for x in r) for r in got.tolist()]
    assert all(n > 0 for *_, n in rows)
    assert byte_places(rows) == byte_places(pieces)[start:stop]  # type: ignore[arg-type]
