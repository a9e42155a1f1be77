"""BlockingPeer: the same methods as plain blocking calls, for trainer / engine code."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from tensorhub import BlockingPeer, ConfigError, PeerClosed, PeerConfig, VersionUnavailable
from tensorhub.protocol.sharding import WHOLE


def complete_holders(peer: BlockingPeer, model: str, version: int) -> list[str]:
    """Who ``peer`` sees holding all of ``model@version``, read on its own event loop."""
    key = WHOLE.key(model, version)

    def names() -> list[str]:
        return sorted(p.name for p, h in peer.peer.control.holders(key) if h.complete)

    result: list[str] = peer._call(peer._sync, names)
    return result


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_blocking_publish_fetch_unpublish() -> None:
    with BlockingPeer(PeerConfig.local("trainer")) as trainer:
        seed = trainer.peer.info.control.removeprefix("tcp://")
        with BlockingPeer(PeerConfig.local("rollout", join=(seed,))) as rollout:
            w = {"w": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)}
            trainer.publish("m", 5, w)
            assert rollout.wait_for_version("m", None) == 5
            assert rollout.latest("m") == 5
            got = rollout.fetch("m", "latest")
            np.testing.assert_array_equal(got.tensors["w"], w["w"])
            assert rollout.statistics().bytes_fetched_by_source == {"trainer": w["w"].nbytes}
            # Until the trainer hears that the rollout holds m@5 too, it holds the last copy
            # of a retained version, and unpublish rightly keeps a host copy of it.
            wait_until(lambda: complete_holders(trainer, "m", 5) == ["rollout", "trainer"])
            assert complete_holders(trainer, "m", 5) == ["rollout", "trainer"]
            trainer.unpublish("m", 5)
            wait_until(lambda: not trainer.statistics().holdings)
            assert trainer.statistics().holdings == {}
            with pytest.raises(VersionUnavailable):
                trainer.fetch("m", 6)
    with pytest.raises(PeerClosed):
        trainer.latest("m")


def test_blocking_peer_reports_startup_errors() -> None:
    with BlockingPeer(PeerConfig.local("a")) as a:
        used = a.peer.info.control.removeprefix("tcp://")
        with pytest.raises(ConfigError, match="already in use"):
            BlockingPeer(PeerConfig.local("b", listen=used))
