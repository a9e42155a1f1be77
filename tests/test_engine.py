"""The engine hook: a trainer peer publishes each version of a small real torch model,
a rollout peer loads it through a vLLM-style ``load_weights``; after every update the
rollout's outputs on fixed inputs equal the trainer's and the tag names the version."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch
import trio
from helpers import open_mesh

from tensorhub import LocalProtocolError, Rollout
from tensorhub.integrations.engine import EngineSync, VersionTag, weights


class TinyPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 50)
        self.loaded: list[set[str]] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As vLLM model classes do: look each name up, copy into the parameter."""
        params = dict(self.named_parameters())
        done = set()
        with torch.no_grad():
            for name, w in weights:
                params[name].copy_(w)
                done.add(name)
        self.loaded.append(done)
        return done


def train(model: TinyPolicy, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        ids = torch.randint(0, 50, (4, 6))
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


PROMPTS = torch.tensor([[1, 2, 3], [4, 5, 6]])


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16])
async def test_after_each_update_the_rollout_equals_the_trainer_and_is_tagged(
        engine_dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    async with open_mesh(2) as (trainer_peer, rollout_peer):
        trainer, engine = TinyPolicy(), TinyPolicy().to(engine_dtype)
        opt = torch.optim.Adam(trainer.parameters(), lr=0.05)
        cast = None if engine_dtype == torch.float32 else "bfloat16"
        sync = EngineSync(rollout_peer, "policy", engine.load_weights,
                          rename=lambda n: n.removeprefix("trainer."), cast=cast)
        assert sync.tag is None
        for version in (1, 2, 3):
            train(trainer, opt)
            reference = copy.deepcopy(trainer).to(engine_dtype)
            with torch.no_grad():
                want = reference(PROMPTS)
                assert not torch.equal(engine(PROMPTS), want)  # stale until the update
            manifest = await trainer_peer.publish(
                "policy", version, {f"trainer.{k}": v for k, v in trainer.state_dict().items()})
            with trio.fail_after(10):
                await rollout_peer.wait_for_version("policy", version - 1)
            tag = await sync.update()
            assert tag == sync.tag == VersionTag("policy", version, manifest.manifest_id())
            with torch.no_grad():
                assert torch.equal(engine(PROMPTS), want)
            assert engine.loaded[-1] == {k for k, _ in engine.named_parameters()}
            # the rollout holds just the version it loaded; the trainer stops serving
            # its memory before the next optimizer step writes it
            assert {k.version for k in rollout_peer.store.versions} == {version}
            await trainer_peer.unpublish("policy", version)
        assert await sync.update() == sync.tag and len(engine.loaded) == 3  # no reload


async def test_weights_come_from_every_kind_of_version_as_torch_views() -> None:
    async with open_mesh(2) as (pub, reader):
        state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                 "b": torch.ones(4, dtype=torch.bfloat16), "skip": torch.zeros(1)}
        await pub.publish("m", 1, state)
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        rollout = Rollout(reader, "m")
        with pytest.raises(LocalProtocolError, match="no live version"):
            list(weights(rollout))
        staged = await rollout.stage(1)
        committed = await staged.commit()
        rename = lambda n: None if n == "skip" else f"model.{n}"  # noqa: E731
        for source in (staged, committed, rollout, rollout.live, committed.tensors):
            got = dict(weights(source, rename=rename))
            assert list(got) == ["model.a", "model.b"]
            assert got["model.b"].dtype == torch.bfloat16
            assert torch.equal(got["model.a"], state["a"])
        assert dict(weights(committed, rename={"a": "x"})).keys() == {"x", "b", "skip"}
        view = dict(weights(committed))["a"]
        view[0, 0] = 42.0  # a view of the fetched memory, not a copy
        assert committed.tensors["a"][0, 0] == 42.0
