"""tensorhub.integrations.ray on a local Ray: actors placed on emulated racks (custom
resources) and GPU slots start peers labelled from their placement, join through the
first one's address, and move versions between them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import helpers
import numpy as np
import pytest
from helpers import wait_until_sync

from tensorhub import security
from tensorhub.config import is_loopback
from tensorhub.errors import ConfigError, LocalProtocolError
from tensorhub.integrations.ray import TensorHubActor, peer_config, placement_labels

MODEL = "policy"


def make_tensors(seed: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {"embed.weight": rng.standard_normal((256, 64), dtype=np.float32),
            "layers.0.mlp.weight": rng.standard_normal((64, 128)).astype(np.float16),
            "step": np.array([seed], dtype=np.int64)}


def digest(tensors: dict[str, Any]) -> str:
    h = blake3.blake3()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).tobytes())
    out: str = h.hexdigest()
    return out


def torch_model(seed: int) -> Any:
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4)).to(torch.bfloat16)


def torch_outputs(model: Any) -> list[float]:
    import torch
    with torch.no_grad():
        x = torch.linspace(-1, 1, 3 * 16, dtype=torch.bfloat16).reshape(3, 16)
        out: list[float] = model(x).float().flatten().tolist()
    return out


class Worker(TensorHubActor):
    """A trainer or a rollout: the same actor class, as in many RL stacks."""

    def publish(self, version: int) -> str:
        tensors = make_tensors(version)
        self.hub.publish(MODEL, version, tensors)
        return digest(tensors)

    def fetch_newer(self, newer_than: int | None) -> tuple[int, str, list[str]]:
        version = self.hub.wait_for_version(MODEL, newer_than)
        got = self.hub.fetch(MODEL, version)
        return version, digest(got.tensors), sorted(got.report.bytes_by_source)

    def publish_torch(self, version: int) -> list[float]:
        self.model = torch_model(version)
        self.hub.publish("torch-policy", version, self.model.state_dict())
        return torch_outputs(self.model)

    def fetch_torch(self, version: int) -> list[float]:
        model = torch_model(seed=1000)  # other weights until the fetch fills them
        self.hub.wait_for_version("torch-policy", version - 1)
        self.hub.fetch("torch-policy", version, into=model)
        return torch_outputs(model)

    def peer_name(self) -> str:
        return self.hub.peer.info.name

    def member_state_once_not(self, name: str, state: str | None) -> str | None:
        """``name``'s state in this peer's view once it is not ``state`` (an
        AssertionError after 20 s: a BlockingPeer has no event for membership changes,
        so this polls)."""
        seen: list[str | None] = []

        def changed() -> bool:
            seen[:] = [self.hub.statistics().members.get(name)]
            return seen[0] != state

        wait_until_sync(changed, 20, every=0.02, what=f"{name} no longer {state}")
        return seen[0]


def test_placement_rule() -> None:
    base: dict[str, Any] = dict(node_ip="10.0.0.5", node_id="n1", node_labels={},
                                node_resources={}, assigned={}, gpus=[])
    assert placement_labels(**base) == (("host", "10.0.0.5"), ("ray-node", "n1"))
    # A node offering one rack and one dc: every actor on it is there.
    one = dict(base, node_resources={"rack:a": 8.0, "dc:eu": 8.0, "CPU": 8.0})
    assert dict(placement_labels(**one)) == {
        "host": "10.0.0.5", "ray-node": "n1", "dc": "eu", "rack": "a"}
    # Several racks on one node: only what the actor was given says which.
    several = dict(base, node_resources={"rack:a": 1.0, "rack:b": 1.0})
    assert "rack" not in dict(placement_labels(**several))
    assert dict(placement_labels(**dict(several, assigned={"rack:b": 1.0})))["rack"] == "b"
    # A node label wins over resources; GPUs are listed.
    labelled = dict(several, node_labels={"rack": "c"}, assigned={"rack:b": 1.0},
                    gpus=["2", "3"])
    assert dict(placement_labels(**labelled))["rack"] == "c"
    assert dict(placement_labels(**labelled))["gpu"] == "2,3"


def test_importing_the_integration_does_not_import_ray() -> None:
    code = "import sys, tensorhub.integrations.ray; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_starting_a_peer_needs_ray_running() -> None:
    ray = pytest.importorskip("ray")
    from tensorhub.integrations.ray import start_peer
    if ray.is_initialized():
        pytest.skip("Ray is running in this process")
    with pytest.raises(LocalProtocolError, match=r"ray\.init\(\)"):
        start_peer()


PLACEMENTS = {  # actor -> (rack resource it asks for, GPUs)
    "trainer": ("r1", 1), "rollout-r1": ("r1", 0), "rollout-r2-gpu": ("r2", 1),
    "rollout-r2": ("r2", 0),
}


@pytest.fixture(scope="module")
def actors() -> Iterator[dict[str, Any]]:
    ray = pytest.importorskip("ray")
    # This module is not importable in Ray's workers: ship its classes by value (and
    # the tests' helpers they call).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(helpers)
    ray.init(num_cpus=len(PLACEMENTS), num_gpus=2, resources={"rack:r1": 2, "rack:r2": 2},
             labels={"dc": "eu"}, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(Worker)
        handles = {name: remote.options(name=name if name == "trainer" else None,
                                        resources={f"rack:{rack}": 1}, num_gpus=gpus).remote()
                   for name, (rack, gpus) in PLACEMENTS.items()}
        seed = ray.get(handles["trainer"].start_peer.remote(listen_host="127.0.0.1",
                                                            preset="local"))
        ray.get([h.start_peer.remote(seeds=[seed], listen_host="127.0.0.1", preset="local")
                 for name, h in handles.items() if name != "trainer"])
        yield handles
        ray.get([h.stop_peer.remote() for h in handles.values()])
    finally:
        ray.shutdown()


def test_labels_come_from_the_placement(actors: dict[str, Any]) -> None:
    import ray
    labels = dict(zip(actors, ray.get([h.peer_labels.remote() for h in actors.values()]),
                      strict=True))
    node = ray.nodes()[0]
    for name, (rack, gpus) in PLACEMENTS.items():
        got = labels[name]
        assert got["host"] == node["NodeManagerAddress"], got
        assert got["ray-node"] == node["NodeID"], got
        assert got["dc"] == "eu" and got["rack"] == rack, got
        assert ("gpu" in got) == bool(gpus), got
    assert {labels["trainer"]["gpu"], labels["rollout-r2-gpu"]["gpu"]} == {"0", "1"}
    # Unnamed actors' peers are named after their actor ids; all joined the first.
    names = ray.get([h.peer_name.remote() for h in actors.values()])
    assert names[0] == "trainer" and all(n.startswith("ray-") for n in names[1:])
    assert len(set(names)) == len(names)
    seen = [actors["trainer"].member_state_once_not.remote(n, None) for n in names[1:]]
    assert ray.get(seen) == ["alive"] * (len(names) - 1)
    addresses = ray.get([h.peer_address.remote() for h in actors.values()])
    assert len(set(addresses)) == len(actors)
    assert all(a.startswith("127.0.0.1:") for a in addresses)


def test_rollouts_fetch_each_version_the_trainer_publishes(actors: dict[str, Any]) -> None:
    import ray
    rollouts = [h for name, h in actors.items() if name != "trainer"]
    waiting = [h.fetch_newer.remote(None) for h in rollouts]  # before anything is published
    published = ray.get(actors["trainer"].publish.remote(1))
    first = ray.get(waiting)
    assert [(v, d) for v, d, _ in first] == [(1, published)] * len(rollouts)
    assert all(sources for _, _, sources in first)
    assert any("trainer" in sources for _, _, sources in first)  # the one first holder
    second = ray.get(actors["trainer"].publish.remote(2))
    assert second != published
    results = ray.get([h.fetch_newer.remote(1) for h in rollouts])
    assert [(v, d) for v, d, _ in results] == [(2, second)] * len(rollouts)


def test_a_torch_state_dict_lands_in_each_rollouts_module(actors: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    import ray
    expected = ray.get(actors["trainer"].publish_torch.remote(7))
    rollouts = [h for name, h in actors.items() if name != "trainer"]
    assert ray.get([h.fetch_torch.remote(7) for h in rollouts]) == [expected] * len(rollouts)


def test_a_keyed_mesh_listens_on_the_node_address(actors: dict[str, Any],
                                                  tmp_path: Path) -> None:
    """Ray's placement as on a cluster: each peer listens on its node's IP and joins with
    its key from a directory every node reads (the actor's name is the peer's)."""
    import ray
    names = ("keyed-trainer", "keyed-rollout")
    security.write_keys(tmp_path, names, publishers={MODEL: [names[0]]})
    remote = ray.remote(Worker)
    trainer, rollout = (remote.options(name=n, num_cpus=0).remote() for n in names)
    try:
        seed = ray.get(trainer.start_peer.remote(keys=str(tmp_path), preset="local"))
        ray.get(rollout.start_peer.remote(seeds=[seed], keys=str(tmp_path), preset="local"))
        assert seed.rpartition(":")[0] == ray.nodes()[0]["NodeManagerAddress"]
        published = ray.get(trainer.publish.remote(1))
        version, got, sources = ray.get(rollout.fetch_newer.remote(None))
        assert (version, got, sources) == (1, published, ["keyed-trainer"])
    finally:
        ray.get([trainer.stop_peer.remote(), rollout.stop_peer.remote()])


def test_without_keys_only_loopback_is_allowed(actors: dict[str, Any]) -> None:
    import ray
    node_ip = ray.nodes()[0]["NodeManagerAddress"]
    if is_loopback(node_ip):
        pytest.skip(f"Ray's node address here is loopback ({node_ip})")
    with pytest.raises(ConfigError, match="without keys"):
        peer_config(name="driver")
    config = peer_config(name="driver", listen_host="127.0.0.1")
    assert config.listen == "127.0.0.1:0"
    # The driver holds no Ray resources: its node's labels, no rack (two offered), no GPU.
    assert dict(config.labels) == {"host": node_ip, "ray-node": ray.nodes()[0]["NodeID"],
                                   "dc": "eu"}


def test_a_peer_leaves_when_its_actor_exits(actors: dict[str, Any]) -> None:
    """Ray calls ``__ray_shutdown__`` when an actor's last handle goes: the peer leaves
    (the others see it ``left``, not dead after missed probes)."""
    import ray
    trainer = actors["trainer"]
    seed = ray.get(trainer.peer_address.remote())
    leaver = ray.remote(Worker).options(num_cpus=0).remote()
    ray.get(leaver.start_peer.remote(seeds=[seed], name="leaver", listen_host="127.0.0.1",
                                     preset="local"))
    assert ray.get(trainer.member_state_once_not.remote("leaver", None)) == "alive"
    del leaver
    assert ray.get(trainer.member_state_once_not.remote("leaver", "alive")) == "left"
