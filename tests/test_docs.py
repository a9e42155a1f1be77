"""The example in docs/api.md runs as pasted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import tensorhub

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def test_sharded_groups_example_runs_as_pasted(tmp_path: Path) -> None:
    text = DOCS.read_text()
    match = re.search(r"<!-- example: sharded-groups -->\n```python\n(.*?)```", text, re.S)
    assert match, "the example block is missing from docs/api.md"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    root = str(Path(tensorhub.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("engine rank")]
    for rank in (0, 1):
        served = [int(line.split("version ")[1].split(":")[0]) for line in lines
                  if line.startswith(f"engine rank {rank}")]
        assert served and served[-1] == 3 and served == sorted(served), out.stdout


def test_engine_hook_example_runs_as_pasted(tmp_path: Path) -> None:
    text = (DOCS.parent / "torch.md").read_text()
    match = re.search(r"<!-- example: engine-hook -->\n```python\n(.*?)```", text, re.S)
    assert match, "the example block is missing from docs/torch.md"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    root = str(Path(tensorhub.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("version ")]
    assert [line.split(":")[0] for line in lines] == ["version 1", "version 2", "version 3"]
    assert all("== trainer outputs: True (tag policy@" in line for line in lines), out.stdout
