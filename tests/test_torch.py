"""torch in and out: CPU tensors published in place (bf16 and fp8 included, their dtype
carried by the manifest), fetched into a module or a state_dict in place, viewed as
torch tensors; mismatches refused before a byte moves; torch stays optional."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from helpers import open_mesh

import tensorhub
from tensorhub import LocalProtocolError
from tensorhub.torch import as_torch


class Tiny(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32, dtype=dtype)
        self.proj = torch.nn.Linear(32, 48, dtype=dtype)
        self.norm = torch.nn.LayerNorm(48, dtype=torch.float32)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def mixed_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w.bf16": torch.randn(256, 96, generator=g).to(torch.bfloat16),
        "w.fp8": torch.randn(128, 64, generator=g).to(torch.float8_e4m3fn),
        "w.e5m2": torch.randn(33, generator=g).to(torch.float8_e5m2),
        "w.fp32": torch.randn(1000, generator=g),
        "scalar.bf16": torch.tensor(3.5, dtype=torch.bfloat16),
        "ids": torch.arange(17, dtype=torch.int64),
    }


async def wait_version(peer: tensorhub.Peer, model: str, version: int) -> None:
    with trio.fail_after(10):
        while (await peer.latest(model) or -1) < version:
            await peer.wait_changed()


async def test_a_state_dict_of_every_dtype_is_served_in_place_and_lands_bit_exact() -> None:
    async with open_mesh(2) as (pub, reader):
        state = mixed_state(1)
        manifest = await pub.publish("m", 1, state)
        assert {t.name: t.dtype for t in manifest.tensors} == {
            "w.bf16": "bfloat16", "w.fp8": "float8_e4m3fn", "w.e5m2": "float8_e5m2",
            "w.fp32": "<f4", "scalar.bf16": "bfloat16", "ids": "<i8"}
        served = pub.store.get(manifest.key)
        assert served is not None
        for arr, t in zip(served.arrays, state.values(), strict=True):  # no copy
            assert arr.__array_interface__["data"][0] == t.data_ptr()
        await wait_version(reader, "m", 1)
        got = await reader.fetch("m", 1)
        assert got.report.verified and got.report.bytes == manifest.total_bytes
        views = as_torch(got)
        for name, t in state.items():
            assert views[name].dtype == t.dtype and views[name].shape == t.shape
            assert views[name].reshape(-1).view(torch.uint8).tolist() == \
                t.reshape(-1).view(torch.uint8).tolist(), name
        # the views share the fetched memory
        views["w.bf16"][0, 0] = 7.0
        assert as_torch(got)["w.bf16"][0, 0].item() == 7.0


async def test_fetch_into_a_module_or_a_state_dict_fills_it_in_place() -> None:
    async with open_mesh(2) as (pub, reader):
        src = Tiny()
        with torch.no_grad():
            for p in src.parameters():
                p.normal_()
            src.steps.fill_(5)
        await pub.publish("m", 1, src.state_dict())
        await wait_version(reader, "m", 1)
        dst = Tiny()
        ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
        got = await reader.fetch("m", 1, into=dst)
        assert got.report.verified and not got.report.served_arrays
        for k, v in dst.state_dict().items():
            assert v.data_ptr() == ptrs[k], f"{k} was reallocated"
            assert torch.equal(v, src.state_dict()[k]), k
        assert all(p.requires_grad for p in dst.parameters())
        assert dst.proj.weight.dtype == torch.bfloat16
        # a plain dict of tensors works the same way
        await reader.unpublish("m", 1)
        sd = {k: torch.empty_like(v) for k, v in src.state_dict().items()}
        await reader.fetch("m", 1, into=sd)
        assert all(torch.equal(sd[k], v) for k, v in src.state_dict().items())


async def test_a_mismatched_into_is_refused_before_any_byte_moves() -> None:
    async with open_mesh(2) as (pub, reader):
        await pub.publish("m", 1, Tiny().state_dict())
        await wait_version(reader, "m", 1)
        wrong_dtype = Tiny(dtype=torch.float16)  # bits that fit, under another meaning
        before = {k: v.clone() for k, v in wrong_dtype.state_dict().items()}
        with pytest.raises(LocalProtocolError, match=r"into\['embed.weight'\] is float16"):
            await reader.fetch("m", 1, into=wrong_dtype)
        bits = {k: v.view(torch.int16) if v.dtype == torch.bfloat16 else v
                for k, v in Tiny().state_dict().items()}
        with pytest.raises(LocalProtocolError, match=r"is int16.*has bfloat16"):
            await reader.fetch("m", 1, into=bits)
        shape = {k: torch.empty_like(v) for k, v in Tiny().state_dict().items()}
        shape["proj.bias"] = torch.empty(47, dtype=torch.bfloat16)
        with pytest.raises(LocalProtocolError, match=r"proj.bias.*\[47\].*\[48\]"):
            await reader.fetch("m", 1, into=shape)
        assert all(torch.equal(v, before[k]) for k, v in wrong_dtype.state_dict().items())
        assert pub.statistics().bytes_served == 0 and reader.store.versions == {}


async def test_device_and_strided_tensors_are_refused_with_the_reason() -> None:
    async with tensorhub.open_peer(tensorhub.PeerConfig.local("solo")) as peer:
        with pytest.raises(LocalProtocolError, match=r"on meta.*host memory only"):
            await peer.publish("m", 1, {"x": torch.empty(4, device="meta")})
        with pytest.raises(LocalProtocolError, match="not contiguous"):
            await peer.publish("m", 1, {"x": torch.zeros(4, 4, dtype=torch.bfloat16).t()})
        with pytest.raises(LocalProtocolError, match="no wire form"):
            await peer.publish("m", 1, {"x": torch.zeros(4, dtype=torch.float8_e4m3fnuz)})
        assert peer.store.versions == {}


def test_tensorhub_works_without_torch(tmp_path: Path) -> None:
    """With torch unimportable, numpy publish and fetch still work end to end."""
    script = tmp_path / "no_torch.py"
    script.write_text(
        "import sys\n"
        "sys.modules['torch'] = None  # import torch now raises ImportError\n"
        "import numpy as np, trio, tensorhub, tensorhub.read.cast, tensorhub.integrations.engine\n"
        "async def main():\n"
        "    async with tensorhub.open_peer(tensorhub.PeerConfig.local('a')) as a:\n"
        "        await a.publish('m', 1, {'x': np.arange(5.0)})\n"
        "        got = await a.fetch('m', 1)\n"
        "        print('ok', got.tensors['x'].tolist())\n"
        "        try:\n"
        "            await a.fetch('m', 1, cast='float16')\n"
        "        except tensorhub.LocalProtocolError as exc:\n"
        "            print('cast:', exc)\n"
        "trio.run(main)\n")
    root = str(Path(tensorhub.__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok [0.0, 1.0, 2.0, 3.0, 4.0]" in out.stdout
    assert "cast: this needs torch: pip install 'tensorhub[torch]'" in out.stdout


def test_numpy_arrays_tagged_as_bfloat16_publish_as_bfloat16() -> None:
    from tensorhub.dtypes import storage_dtype, tagged
    from tensorhub.limits import check_dtype
    raw = np.zeros(4, np.uint16)
    assert check_dtype("x", tagged(raw, "bfloat16").dtype) == "bfloat16"
    assert check_dtype("x", raw.dtype) == "<u2"
    assert storage_dtype("bfloat16") == np.dtype("<u2")
    assert as_torch({"x": tagged(raw, "bfloat16")})["x"].dtype == torch.bfloat16


def test_the_torch_bench_lands_equal_bytes_and_reports_its_figure(
        capsys: pytest.CaptureFixture[str]) -> None:
    from tensorhub.bench import torchbench
    assert torchbench.main(["--size", "4MiB", "--tensors", "8", "--runs", "2",
                            "--chunk", "1MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    [fig] = out["figures"]
    assert fig["name"] == "torch_bf16_vs_numpy" and fig["bound"] == 1.10 and fig["value"] > 0
    assert out["measured"]["landed_equal"] is True
    assert [len(v) for v in out["measured"]["times_s"].values()] == [2, 2]


async def test_a_bf16_tensor_reshards_into_a_ranks_slice() -> None:
    from tensorhub import Sharding
    async with open_mesh(2) as (pub, reader):
        w = torch.randn(64, 48).to(torch.bfloat16)
        await pub.publish("m", 1, {"w": w, "b": torch.ones(3, dtype=torch.float8_e4m3fn)})
        await wait_version(reader, "m", 1)
        got = await reader.fetch("m", 1, layout=Sharding(1, 2, split={"w": 1}))
        part = as_torch(got)
        assert part["w"].dtype == torch.bfloat16 and torch.equal(part["w"], w[:, 24:])
        assert part["b"].dtype == torch.float8_e4m3fn and part["b"].float().tolist() == [1.0] * 3
