"""safetensors files in and out of a mesh, from the command line (real processes, the
real safetensors library reading back), and the header parser byte by byte."""

from __future__ import annotations

import json
import math
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

from tensorhub.errors import LocalProtocolError
from tensorhub.integrations.safetensors import map_safetensors, parse_header, write_safetensors
from tensorhub.processes import LineProcess, free_ports
from tensorhub.transport.samehost.reader import shm_available

CLI = [sys.executable, "-m", "tensorhub.cli"]


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((300, 64)).astype(np.float32),
            "head.weight": rng.standard_normal((64, 33)).astype(np.float16),
            "steps": np.arange(7, dtype=np.int64) * seed,
            "mask": rng.random(13) > 0.5, "scalar": np.array(seed, np.uint8),
            "empty": np.zeros((0, 4), np.int32)}


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118


def _assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert np.array_equal(got[k], want[k]), k


def _publish(procs: list[LineProcess], path: Path, version: int, port: int,
             *extra: str, tensors: int = len(_tensors(0))) -> LineProcess:
    p = LineProcess(f"publish v{version}", [
        *CLI, "publish", str(path), "--model", "m", "--version", str(version), "--name",
        f"pub{version}", "--listen", f"127.0.0.1:{port}", "--preset", "local", *extra])
    procs.append(p)
    event = p.expect("serving", 60)
    assert event["version"] == version and event["tensors"] == tensors
    return p


def _fetch(join: int, out: Path, *extra: str) -> dict[str, object]:
    run = subprocess.run([*CLI, "fetch", "--model", "m", "--out", str(out), "--join",
                          f"127.0.0.1:{join}", "--preset", "local", *extra],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "100.0%" in run.stderr  # the plain progress lines (stderr is not a TTY)
    summary: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return summary


def test_publish_from_one_process_fetch_from_another_reads_back_equal(
        tmp_path: Path, procs: list[LineProcess]) -> None:
    want = _tensors(3)
    save_file(want, str(tmp_path / "model.safetensors"), metadata={"origin": "test"})
    (port,) = free_ports(1)
    _publish(procs, tmp_path / "model.safetensors", 1, port)
    out = tmp_path / "copy.safetensors"
    summary = _fetch(port, out, "--version", "latest")
    assert summary["version"] == 1 and summary["verified"] is True
    assert summary["sources"] == {"pub1": sum(a.nbytes for a in want.values())}
    got, meta = _read(out)
    _assert_equal(got, want)
    assert meta == {"tensorhub": "m@1"}
    assert not list(tmp_path.glob(".*.part"))  # no temporary file left behind


def test_fetch_on_a_terminal_draws_a_progress_bar(tmp_path: Path,
                                                  procs: list[LineProcess]) -> None:
    """With stderr on a terminal (a pty here) ``tensorhub fetch`` draws rich's bar
    instead of plain lines; stdout still ends with the JSON summary."""
    pytest.importorskip("rich")
    want = _tensors(5)
    save_file(want, str(tmp_path / "model.safetensors"))
    (port,) = free_ports(1)
    _publish(procs, tmp_path / "model.safetensors", 1, port)
    master, slave = pty.openpty()
    run = subprocess.Popen(
        [*CLI, "fetch", "--model", "m", "--out", str(tmp_path / "copy.safetensors"),
         "--join", f"127.0.0.1:{port}", "--preset", "local"],
        stdout=subprocess.PIPE, stderr=slave, text=True,
        env=dict(os.environ, TERM="xterm", COLUMNS="100"))
    os.close(slave)
    screen = b""
    try:
        while select.select([master], [], [], 120)[0]:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            screen += data
        assert run.stdout is not None
        stdout = run.stdout.read()
        assert run.wait(timeout=60) == 0, screen[-2000:]
    finally:
        os.close(master)
        run.kill()
    text = screen.decode(errors="replace")
    assert "fetch m@latest" in text and "100%" in text and "\u2501" in text, text  # ━
    assert not re.search(r"\d+/\d+ bytes", text)  # no plain lines
    assert json.loads(stdout.strip().splitlines()[-1])["verified"] is True
    _assert_equal(_read(tmp_path / "copy.safetensors")[0], want)


def test_torch_bf16_and_fp8_files_are_served_and_written_back_equal(
        tmp_path: Path, procs: list[LineProcess]) -> None:
    """Dtypes numpy lacks travel as tagged raw bits: a file torch wrote with bf16 and
    fp8 tensors is published, fetched to a file, and read back by safetensors as the
    same dtypes and bits."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    g = torch.Generator().manual_seed(5)
    want = {"lora_A": torch.randn(8, 256, generator=g).to(torch.bfloat16),
            "lora_B": torch.randn(256, 8, generator=g).to(torch.float8_e4m3fn),
            "scale": torch.randn(4, 3, generator=g).to(torch.float8_e5m2),
            "bias": torch.randn(256, generator=g)}
    save_torch(want, str(tmp_path / "model.safetensors"))
    mapped = map_safetensors(tmp_path / "model.safetensors")
    assert {k: v.dtype.metadata and v.dtype.metadata["tensorhub.dtype"]
            for k, v in mapped.tensors.items()} == {
        "lora_A": "bfloat16", "lora_B": "float8_e4m3fn", "scale": "float8_e5m2",
        "bias": None}
    mapped.close()
    (port,) = free_ports(1)
    _publish(procs, tmp_path / "model.safetensors", 1, port, tensors=len(want))
    out = tmp_path / "copy.safetensors"
    summary = _fetch(port, out, "--version", "1")
    assert summary["verified"] is True
    with safe_open(str(out), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(got[k].view(torch.uint8), w.view(torch.uint8)), k


def test_an_unknown_dtype_is_refused_with_one_line_naming_the_tensor(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    (tmp_path / "f4.safetensors").write_bytes(
        len(raw).to_bytes(8, "little") + raw + b"\0")
    (port,) = free_ports(1)
    run = subprocess.run([*CLI, "publish", str(tmp_path / "f4.safetensors"), "--model",
                          "m", "--version", "1", "--listen", f"127.0.0.1:{port}",
                          "--preset", "local"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "tensor 'w' has unknown dtype 'F4'" in run.stderr, run.stderr


def test_every_truncation_of_a_file_is_refused_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.int16)}, str(path))
    data = path.read_bytes()
    n = 8 + int.from_bytes(data[:8], "little")
    for cut in range(len(data)):  # byte by byte: a clear error, never another exception
        with pytest.raises(LocalProtocolError):
            parse_header(path, data[:cut], cut)
    _, specs, _ = parse_header(path, data, len(data))
    assert {k: v[2] for k, v in specs.items()} == {"a": n, "b": n + 24}


def test_mapped_tensors_are_read_only_views_of_the_file(tmp_path: Path) -> None:
    want = _tensors(5)
    save_file(want, str(tmp_path / "x.safetensors"))
    mapped = map_safetensors(tmp_path / "x.safetensors")
    try:
        _assert_equal(mapped.tensors, want)
        for arr in mapped.tensors.values():
            assert not arr.flags.writeable and arr.base is not None  # a view, not a copy
        write_safetensors(tmp_path / "y.safetensors", mapped.tensors)
    finally:
        mapped.close()
    _assert_equal(_read(tmp_path / "y.safetensors")[0], want)


def test_follow_peer_holds_and_serves_each_new_version(
        tmp_path: Path, procs: list[LineProcess]) -> None:
    ports = free_ports(3)
    for v in (1, 2):
        save_file(_tensors(v), str(tmp_path / f"v{v}.safetensors"))
    first = _publish(procs, tmp_path / "v1.safetensors", 1, ports[0],
                     "--label", "host=h1")
    follower = LineProcess("follower", [
        *CLI, "peer", "--name", "cache", "--listen", f"127.0.0.1:{ports[1]}", "--join",
        f"127.0.0.1:{ports[0]}", "--preset", "local", "--follow", "m", "--keep", "1",
        "--label", "host=h1"])
    procs.append(follower)
    got = follower.expect("followed", 60)
    assert got["version"] == 1 and got["sources"] == ["pub1"], got
    # same host label: read from the publisher's mmap across processes where allowed
    assert got["transports"] == (["shm"] if shm_available()[0] else ["tcp"])
    second = LineProcess("serve v2", [  # a bare peer with the --serve role
        *CLI, "peer", "--name", "pub2", "--listen", f"127.0.0.1:{ports[2]}", "--join",
        f"127.0.0.1:{ports[0]}", "--preset", "local", "--serve",
        str(tmp_path / "v2.safetensors"), "--model", "m", "--version", "2"])
    procs.append(second)
    assert second.expect("serving", 60)["version"] == 2
    got = follower.expect("followed", 60)
    assert got["version"] == 2 and got["sources"] == ["pub2"]
    assert follower.expect("released", 30)["version"] == 1  # --keep 1
    for p in (first, second):  # the publishers go: the cache alone serves version 2
        p.p.terminate()
        assert p.p.wait(timeout=20) == 0
    summary = _fetch(ports[1], tmp_path / "from-cache.safetensors", "--version", "2")
    assert summary["sources"] == {"cache": sum(a.nbytes for a in _tensors(2).values())}
    _assert_equal(_read(tmp_path / "from-cache.safetensors")[0], _tensors(2))


def test_follow_never_releases_the_version_its_own_peer_serves(
        tmp_path: Path, procs: list[LineProcess]) -> None:
    ports = free_ports(3)
    for v in (1, 2, 3):
        save_file(_tensors(v), str(tmp_path / f"v{v}.safetensors"))
    both = LineProcess("serve+follow", [
        *CLI, "peer", "--name", "both", "--listen", f"127.0.0.1:{ports[0]}", "--preset",
        "local", "--serve", str(tmp_path / "v1.safetensors"), "--model", "m", "--version",
        "1", "--follow", "m", "--keep", "1"])
    procs.append(both)
    assert both.expect("serving", 60)["version"] == 1
    assert both.expect("follow-held", 60)["version"] == 1
    for v in (2, 3):
        _publish(procs, tmp_path / f"v{v}.safetensors", v, ports[v - 1], "--join",
                 f"127.0.0.1:{ports[0]}")
        assert both.expect("followed", 60)["version"] == v
    assert both.expect("released", 30)["version"] == 2  # 1 is served, not followed
    summary = _fetch(ports[0], tmp_path / "v1-again.safetensors", "--version", "1")
    assert summary["sources"] == {"both": sum(a.nbytes for a in _tensors(1).values())}


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)
_ENTRY = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "I64", "U8", "BOOL", "BF16", "X9", 3]),
    "shape": st.lists(st.integers(-1, 2**40) | st.booleans(), max_size=3) | _JSONISH,
    "data_offsets": st.lists(st.integers(-1, 2**40) | st.booleans(), max_size=3) | _JSONISH,
})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | st.dictionaries(st.text(max_size=6), _ENTRY | _JSONISH,
                                                max_size=3).map(
    lambda h: json.dumps(h).encode()), st.integers(0, 64), st.booleans())
def test_any_header_is_parsed_or_refused_with_one_clear_error(
        body: bytes, tail: int, deep: bool) -> None:
    """Raw bytes, wrong types, huge or negative counts, offsets that overflow int64 and
    JSON nested past the parser's recursion limit: a LocalProtocolError, never another."""
    if deep:
        body = b"[" * 100_000 + body
    data = len(body).to_bytes(8, "little") + body + bytes(tail)
    try:
        start, tensors, _ = parse_header(Path("fuzz.safetensors"), data, len(data))
    except LocalProtocolError:
        return
    for dtype, shape, at in tensors.values():  # what it accepts lies within the file
        assert start <= at and at + math.prod(shape) * dtype.itemsize <= len(data)
