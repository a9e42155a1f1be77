"""BlockingPeer: the same methods as plain blocking calls, for trainer / engine code."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import wait_until_sync

from tensorhub import BlockingPeer, ConfigError, PeerClosed, PeerConfig, VersionUnavailable
from tensorhub.protocol.sharding import WHOLE


def complete_holders(peer: BlockingPeer, model: str, version: int) -> list[str]:
    """Who ``peer`` sees holding all of ``model@version``, read on its own event loop."""
    key = WHOLE.key(model, version)

    def names() -> list[str]:
        return sorted(p.name for p, h in peer.peer.control.holders(key) if h.complete)

    # reaching in: BlockingPeer has no public call that runs code on its loop, nor one
    # that shows another peer's holdings
    result: list[str] = peer._call(peer._sync, names)
    return result


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
            wait_until_sync(lambda: complete_holders(trainer, "m", 5) == ["rollout", "trainer"],
                            what="the trainer seeing the rollout hold m@5")
            assert complete_holders(trainer, "m", 5) == ["rollout", "trainer"]
            trainer.unpublish("m", 5)
            wait_until_sync(lambda: not trainer.statistics().holdings,
                            what="the trainer holding nothing")
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
