"""The public surface: exactly these names, each importable from ``tensorhub``."""

from __future__ import annotations

import tensorhub

PUBLIC = {
    "BlockingPeer", "ConfigError", "ConsistencyError", "FetchReport", "Fetched",
    "IntegrityError", "LocalProtocolError", "Manifest", "Peer", "PeerClosed", "PeerConfig",
    "PeerInfo", "PeerStats", "RemoteProtocolError", "RetentionError", "Sharding", "TensorHubError",
    "TensorSpec", "TransportError", "VersionKey", "VersionUnavailable", "__version__",
    "open_peer", "Committed", "Group", "GroupConfig", "GroupStats", "GroupSwitchError",
    "Rollout", "Staged", "open_group", "shared_empty", "StagingRing", "ThroughRing",
}


def test_public_names_are_exactly_the_documented_ones() -> None:
    assert set(tensorhub.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(tensorhub, name) is not None


def test_errors_say_whose_fault() -> None:
    assert issubclass(tensorhub.IntegrityError, tensorhub.RemoteProtocolError)
    assert issubclass(tensorhub.RetentionError, tensorhub.LocalProtocolError)
    assert issubclass(tensorhub.VersionUnavailable, LookupError)
    assert all(issubclass(getattr(tensorhub, n), tensorhub.TensorHubError)
               for n in PUBLIC if n.endswith("Error") and n != "TensorHubError")


def test_importing_tensorhub_and_its_torch_modules_does_not_import_torch() -> None:
    import subprocess
    import sys
    code = ("import sys, tensorhub, tensorhub.read.cast, tensorhub.integrations.engine, "
            "tensorhub.torch; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"
