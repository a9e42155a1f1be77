"""The examples in docs/ run as pasted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import tensorhub

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def run_example(tmp_path: Path, page: str, example: str) -> str:
    """Run the ``<!-- example: NAME -->`` block of ``docs/PAGE`` as pasted; its stdout."""
    text = (DOCS.parent / page).read_text()
    match = re.search(rf"<!-- example: {example} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"the example block {example} is missing from docs/{page}"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    root = str(Path(tensorhub.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_sharded_groups_example_runs_as_pasted(tmp_path: Path) -> None:
    stdout = run_example(tmp_path, "api.md", "sharded-groups")
    lines = [line for line in stdout.splitlines() if line.startswith("engine rank")]
    for rank in (0, 1):
        served = [int(line.split("version ")[1].split(":")[0]) for line in lines
                  if line.startswith(f"engine rank {rank}")]
        assert served and served[-1] == 3 and served == sorted(served), stdout


def test_engine_hook_example_runs_as_pasted(tmp_path: Path) -> None:
    stdout = run_example(tmp_path, "torch.md", "engine-hook")
    lines = [line for line in stdout.splitlines() if line.startswith("version ")]
    assert [line.split(":")[0] for line in lines] == ["version 1", "version 2", "version 3"]
    assert all("== trainer outputs: True (tag policy@" in line for line in lines), stdout
