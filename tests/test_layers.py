"""The floors of the house hold: the import-linter contracts in ``pyproject.toml``
(layers from the vocabulary up to the command line, a sans-IO protocol, a library that
imports neither the test tools nor the benchmarks, no import circles in any folder,
``TYPE_CHECKING`` imports included) are kept.  ``tox -e lint`` runs the same check."""

from __future__ import annotations

from pathlib import Path

import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_are_kept(capsys: pytest.CaptureFixture[str]) -> None:
    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "0 broken" in out and "4 kept" in out, out
