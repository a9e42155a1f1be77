"""Casting on the way: a consumer asks for other dtypes; the bytes are verified as
published, then cast.  Properties against torch's own ``.to()`` and against a naive
per-block fp8 reference; a casting fetch serves only the published bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import complete_holders, open_mesh, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from test_torch import Tiny, wait_version

from tensorhub import LocalProtocolError
from tensorhub.read.cast import Fp8, cast_all, plan, quantize
from tensorhub.torch import as_torch

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
TARGETS = ["float32", "bfloat16", "float16"]

values = arrays(np.float32, st.tuples(st.integers(1, 24), st.integers(1, 24)),
                elements=st.floats(-3e4, 3e4, width=32))


@settings(max_examples=60, deadline=None)
@given(values, st.sampled_from(FLOATS), st.sampled_from(TARGETS), st.booleans())
def test_a_plain_cast_equals_torchs_to(x: np.ndarray, src: torch.dtype, target: str,
                                       into: bool) -> None:
    t = torch.from_numpy(x).to(src)
    targets = plan({"w*": target}, {"w": t})
    dest = {"w": torch.full(t.shape, 9.0, dtype=getattr(torch, target))} if into else None
    out = cast_all({"w": t}, targets, dest)["w"]
    want = t.to(getattr(torch, target))
    assert out.dtype == want.dtype
    assert torch.equal(out.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
    if dest is not None:
        assert out is dest["w"]


def naive_fp8(x: torch.Tensor, dtype: torch.dtype, block: int | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile at a time, the definition in tensorhub.read.cast.Fp8 written out."""
    top = torch.finfo(dtype).max
    xf = x.float()
    if block is None or xf.dim() != 2:
        tiles = {(): (slice(None),)}
    else:
        tiles = {(i, j): (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
                 for i in range(math.ceil(xf.shape[0] / block))
                 for j in range(math.ceil(xf.shape[1] / block))}
    q = torch.empty(xf.shape, dtype=dtype)
    grid = () if not tiles or () in tiles else (max(i for i, _ in tiles) + 1,
                                                max(j for _, j in tiles) + 1)
    scale = torch.empty(grid, dtype=torch.float32)
    for at, where in tiles.items():
        part = xf[where]
        amax = part.abs().max()
        s = max(amax / top, torch.tensor(torch.finfo(torch.float32).tiny))
        scale[at] = s
        q[where] = (part / s).clamp(-top, top).to(dtype)
    return q, scale


@settings(max_examples=60, deadline=None)
@given(values, st.sampled_from([None, 1, 3, 8, 16]),
       st.sampled_from(["float8_e4m3fn", "float8_e5m2"]), st.sampled_from(FLOATS))
def test_fp8_with_scales_matches_the_naive_reference(x: np.ndarray, block: int | None,
                                                     name: str, src: torch.dtype) -> None:
    t = torch.from_numpy(x).to(src)
    dtype = getattr(torch, name)
    q, scale = quantize(t, Fp8(name, block))
    q_ref, scale_ref = naive_fp8(t, dtype, block)
    assert q.dtype == dtype and q.shape == t.shape and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # dequantized within fp8's precision: half an ulp, or half the smallest subnormal
    full = scale if block is None else scale.repeat_interleave(block, 0).repeat_interleave(
        block, 1)[: t.shape[0], : t.shape[1]]
    mant, tiny = (3, 2.0 ** -9) if name == "float8_e4m3fn" else (2, 2.0 ** -16)
    err = (q.float() * full - t.float()).abs()
    assert bool((err <= t.float().abs() * 2.0 ** -(mant + 1) + full * tiny).all())


def test_a_cast_spec_names_its_tensors_and_checks_the_dtype() -> None:
    src = {"a.weight": torch.zeros(2), "a.bias": torch.zeros(2, dtype=torch.float16),
           "ids": torch.zeros(2, dtype=torch.int64)}
    assert plan("float16", src) == {"a.weight": "float16"}  # ints stay, same dtype stays
    fp8 = Fp8()
    assert plan({"*.weight": fp8, "*": "bfloat16"}, src) == {
        "a.weight": fp8, "a.bias": "bfloat16"}
    with pytest.raises(LocalProtocolError, match="no dtype for 'float3'"):
        plan("float3", src)
    with pytest.raises(LocalProtocolError, match="block must be a positive int"):
        Fp8(block=0)


async def test_a_casting_fetch_verifies_then_casts_and_serves_only_published_bytes() -> None:
    async with open_mesh(3) as (pub, caster, third):
        g = torch.Generator().manual_seed(3)
        state = {"a.weight": torch.randn(300, 200, generator=g),
                 "a.bias": torch.randn(200, generator=g).to(torch.bfloat16),
                 "steps": torch.tensor(7)}
        manifest = await pub.publish("m", 1, state)
        await wait_version(caster, "m", 1)
        got = await caster.fetch("m", 1, cast={"*.weight": Fp8(block=128),
                                               "*.bias": "float16"})
        assert got.report.verified
        assert got.report.cast == {
            "a.weight": "float32->float8_e4m3fn (scale per 128x128 block)",
            "a.bias": "bfloat16->float16"}
        assert got.report.to_dict()["cast"] == got.report.cast
        out = as_torch(got)
        assert set(out) == {"a.weight", "a.weight_scale", "a.bias", "steps"}
        q, scale = naive_fp8(state["a.weight"], torch.float8_e4m3fn, 128)
        assert out["a.weight_scale"].shape == (3, 2) and torch.equal(out["a.weight_scale"], scale)
        assert torch.equal(out["a.weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(out["a.bias"], state["a.bias"].to(torch.float16))
        # what the caster holds and announces is the published version, bytes as published
        held = caster.store.get(manifest.key)
        assert held is not None and held.manifest.manifest_id() == manifest.manifest_id()
        assert [h.manifest_id for _, h in caster.control.holders(manifest.key)
                if _.name == "p1"] == [manifest.manifest_id()]
        assert held.arrays[0].dtype == np.float32
        # and a third peer reading from the caster only gets them, verified
        await wait_until(lambda: len(complete_holders(third, manifest.key)) >= 2,
                         what="the third peer seeing the caster hold m@1")
        again = await third.fetch("m", 1, sources=["p1"])
        assert again.report.bytes_by_source == {"p1": manifest.total_bytes}
        assert torch.equal(as_torch(again)["a.weight"], state["a.weight"])


async def test_a_casting_fetch_into_a_module_casts_in_place_and_checks_first() -> None:
    async with open_mesh(2) as (pub, reader):
        src = Tiny(dtype=torch.float32)
        with torch.no_grad():
            for p in src.parameters():
                p.normal_()
        await pub.publish("m", 1, src.state_dict())
        await wait_version(reader, "m", 1)
        wrong = Tiny(dtype=torch.float16)
        before = {k: v.clone() for k, v in wrong.state_dict().items()}
        with pytest.raises(LocalProtocolError, match=r"into\['embed.weight'\] is float16.*"
                                                     r"has bfloat16"):
            await reader.fetch("m", 1, into=wrong, cast={"embed.*": "bfloat16",
                                                          "proj.*": "float16"})
        assert all(torch.equal(v, before[k]) for k, v in wrong.state_dict().items())
        shared = {k: torch.empty_like(v) for k, v in Tiny().state_dict().items()}
        shared["proj.bias"] = shared["norm.bias"].view(torch.bfloat16)[:48]  # no memory of its own
        with pytest.raises(LocalProtocolError, match="share memory"):
            await reader.fetch("m", 1, into=shared, cast={"norm.*": "float32", "*": "bfloat16"})
        dst = Tiny(dtype=torch.bfloat16)  # an engine in bf16; its norm stays float32
        ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
        got = await reader.fetch("m", 1, into=dst, cast={"norm.*": "float32",
                                                         "*": "bfloat16"})
        assert got.report.cast == {k: "float32->bfloat16" for k in (
            "embed.weight", "proj.weight", "proj.bias")}
        sd = dst.state_dict()
        assert all(sd[k].data_ptr() == p for k, p in ptrs.items())
        for k, v in src.state_dict().items():
            assert torch.equal(sd[k], v.to(sd[k].dtype)), k
