from __future__ import annotations

import os
import sys

import pytest

# Peers spawned by tests run with the interpreter that runs the tests.
os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture
def python() -> str:
    return sys.executable
