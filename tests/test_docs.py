"""The examples in docs/ run as pasted: the Python programs marked
``<!-- example: NAME -->`` (docs/api.md, docs/torch.md, docs/ray.md, docs/adapters.md)
and the shell
sessions so marked in the integration pages."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensorhub
from tensorhub.processes import free_ports

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


SHELL_EXAMPLE = re.compile(r"<!-- example: ([\w-]+) -->\n```bash\n(.*?)```", re.S)
SHELL_DOCS = ("safetensors.md", "operations.md")


def _shell_examples() -> list[tuple[str, str, str]]:
    return [(page, m.group(1), m.group(2)) for page in SHELL_DOCS
            for m in SHELL_EXAMPLE.finditer((DOCS.parent / page).read_text())]


def test_every_shell_page_has_an_example() -> None:
    assert {page for page, _, _ in _shell_examples()} == set(SHELL_DOCS)


@pytest.mark.parametrize(("page", "name", "script"), _shell_examples(),
                         ids=lambda v: v if "\n" not in v else "script")
def test_shell_example_runs_as_pasted(page: str, name: str, script: str,
                                      tmp_path: Path) -> None:
    """The ``tensorhub`` and ``python`` the page types are this checkout's."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for cmd, argv in (("tensorhub", f"{sys.executable} -m tensorhub.cli"),
                      ("python", sys.executable)):
        (bindir / cmd).write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
        (bindir / cmd).chmod(0o755)
    root = str(Path(tensorhub.__file__).resolve().parent.parent)
    port, metrics = free_ports(2)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
               PORT=str(port), METRICS=str(metrics), COLUMNS="100",
               PYTHONPATH=os.pathsep.join(
                   [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, f"{page} {name}: {out.stderr[-2000:]}"
    expected = {"safetensors-cli": "copy.safetensors equals model.safetensors",
                "watch-and-scrape": 'tensorhub_members{state="alive"} 1.0'}
    assert expected[name] in out.stdout, out.stdout


def test_engine_hook_example_runs_as_pasted(tmp_path: Path) -> None:
    stdout = run_example(tmp_path, "torch.md", "engine-hook")
    lines = [line for line in stdout.splitlines() if line.startswith("version ")]
    assert [line.split(":")[0] for line in lines] == ["version 1", "version 2", "version 3"]
    assert all("== trainer outputs: True (tag policy@" in line for line in lines), stdout


def test_ray_example_runs_as_pasted(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    stdout = run_example(tmp_path, "ray.md", "ray-actors")
    racks = [line.split("rack=")[1].split()[0] for line in stdout.splitlines()
             if line.startswith("peer at ")]
    assert racks == ["r1", "r1", "r2"], stdout
    lines = [line for line in stdout.splitlines() if line.startswith("version ")]
    assert [line.split(":")[0] for line in lines] == [
        f"version {v}" for v in (1, 1, 2, 2, 3, 3)], stdout
    assert all(f"has version {line.split()[1].rstrip(':')}, outputs == trainer's: True"
               in line for line in lines), stdout


def test_adapters_example_runs_as_pasted(tmp_path: Path) -> None:
    stdout = run_example(tmp_path, "adapters.md", "adapters")
    assert [line for line in stdout.splitlines() if line.startswith("version ")] == [
        f"version {v}: rollout serves [{v}]" for v in range(1, 5)]
    kept = [line for line in stdout.splitlines() if line.startswith("lora/")]
    assert kept[0] == "lora/user-0: keeps 3, readable [2, 3, 4], equal: True", stdout
    assert kept[1:] == [f"lora/user-{i}: keeps 2, readable [3, 4], equal: True"
                        for i in range(1, 8)], stdout
