"""Identities, signatures and keyrings (tensorhub.security)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import zmq
import zmq.utils.z85

from tensorhub.errors import ConfigError
from tensorhub.security import (
    ClusterKey,
    Identity,
    Keyring,
    curve_public,
    load,
    read_keyring,
    verify,
    write_keys,
)


def test_signatures_verify_only_for_the_signer_and_the_data() -> None:
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"claim")
    assert verify(a.public, b"claim", sig)
    assert not verify(b.public, b"claim", sig)
    assert not verify(a.public, b"claim!", sig)
    assert not verify(a.public, b"claim", sig[:-1] + bytes([sig[-1] ^ 1]))
    assert not verify(a.public[:31], b"claim", sig)  # malformed inputs are just "no"
    assert not verify(a.public, b"claim", b"short")


def test_keyring_binds_names_to_keys_and_rotates() -> None:
    old, new, other = Identity.generate(), Identity.generate(), Identity.generate()
    ring = Keyring({"a": [old.public], "b": [other.public]}, {"m": ["a"]})
    assert ring.verify_from("a", b"x", old.sign(b"x"))
    assert not ring.verify_from("b", b"x", old.sign(b"x"))  # a cannot speak for b
    assert not ring.verify_from("nobody", b"x", old.sign(b"x"))
    assert ring.may_publish("m", "a") and not ring.may_publish("m", "b")
    assert not ring.may_publish("other-model", "a")
    ring.replace({"a": [old.public, new.public], "b": [other.public]})  # add
    assert ring.verify_from("a", b"x", new.sign(b"x"))
    assert ring.may_publish("m", "a")  # publishers kept when not given
    ring.replace({"a": [new.public], "b": [other.public]})  # remove the old key
    assert not ring.verify_from("a", b"x", old.sign(b"x"))
    assert ring.verify_from("a", b"x", new.sign(b"x"))
    assert ring.name_of_curve(curve_public(new.public)) == "a"
    assert ring.name_of_curve(curve_public(old.public)) is None


def test_wildcard_publishers() -> None:
    a = Identity.generate()
    ring = Keyring({"a": [a.public]}, {"*": ["a"]})
    assert ring.may_publish("any", "a")
    ring.replace({"z": [a.public]})  # a is no longer a member: may not publish
    assert not ring.may_publish("any", "a")


def test_bad_keys_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        Identity(b"short")
    with pytest.raises(ConfigError):
        Keyring({"a": [b"x" * 31]})
    with pytest.raises(ConfigError):
        ClusterKey(b"")


def test_keygen_files_round_trip(tmp_path: Path) -> None:
    written = write_keys(tmp_path, ["trainer", "rollout-0"], {"m": ["trainer"]})
    assert {p.name for p in written} == {"cluster.json", "trainer.key", "rollout-0.key"}
    for p in written:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    sec = load(tmp_path, "trainer")
    assert sec.keyring.may_publish("m", "trainer")
    assert sec.identity.public in sec.keyring.keys_of("trainer")
    write_keys(tmp_path, ["rollout-1"])  # adding a member keeps the others and the secret
    cluster, ring = read_keyring(tmp_path / "cluster.json")
    assert cluster == sec.cluster
    assert set(ring.members()) == {"trainer", "rollout-0", "rollout-1"}
    with pytest.raises(ConfigError):
        load(tmp_path, "stranger")
    cluster_file = tmp_path / "cluster.json"
    doc = json.loads(cluster_file.read_text())
    doc["members"]["trainer"] = [Identity.generate().public.hex()]
    cluster_file.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="not listed"):
        load(tmp_path, "trainer")


def test_curve_keys_match_libsodium_conversion_and_zmq() -> None:
    ident = Identity.generate()
    pub, secret = ident.curve_keys()
    assert zmq.curve_public(secret) == pub
    cpub, csec = ClusterKey.generate().z85()
    assert zmq.curve_public(csec) == cpub
    assert len(zmq.utils.z85.decode(pub)) == 32
