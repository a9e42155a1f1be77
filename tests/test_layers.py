"""The floors of the house hold: the import-linter contracts in ``pyproject.toml``
(layers from the vocabulary up to the command line, a sans-IO protocol, a library that
imports neither the test tools nor the benchmarks, no import circles in any folder,
``TYPE_CHECKING`` imports included) are kept.  ``tox -e lint`` runs the same check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_are_kept() -> None:
    # In a process of its own: import-linter configures logging, which would disable
    # the loggers of peers that later tests open.
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, "
            "no_cache=True))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout and "4 kept" in out.stdout, out.stdout
