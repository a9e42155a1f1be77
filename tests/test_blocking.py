"""BlockingPeer: the same methods as plain blocking calls, for trainer / engine code."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tensorhub import BlockingPeer, ConfigError, PeerClosed, PeerConfig, VersionUnavailable


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
            trainer.unpublish("m", 5)
            deadline = time.monotonic() + 10
            while trainer.statistics().holdings and time.monotonic() < deadline:
                time.sleep(0.01)
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
