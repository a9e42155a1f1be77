"""Assembling a routine's listing, to compare with the machine code a module ships."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tensorhub.transport.samehost.streaming_copy import native

needs_assembler = pytest.mark.skipif(
    not (native() is None and shutil.which("as") and shutil.which("objcopy")),
    reason="needs GNU as and objcopy for x86-64")


def assembled(listing: str, where: Path) -> bytes:
    """The ``.text`` bytes of ``listing`` (GNU as syntax), assembled in ``where``."""
    (where / "routine.s").write_text(listing)
    subprocess.run(["as", "routine.s", "-o", "routine.o"], cwd=where, check=True)
    subprocess.run(["objcopy", "-O", "binary", "-j", ".text", "routine.o", "routine.bin"],
                   cwd=where, check=True)
    return (where / "routine.bin").read_bytes()


def printed_switched_off(variable: str, script: str) -> list[str]:
    """The words ``script`` prints, run in a fresh interpreter with ``variable=0``."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                         text=True, check=True, env={**os.environ, variable: "0"}).stdout
    return out.split()
