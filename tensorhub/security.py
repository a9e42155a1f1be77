"""Cluster identity: who may join, speak, read, serve and publish.

Theory of operation
-------------------
* Every peer has an **identity**: an Ed25519 signing key (a 32-byte seed).  Its public key
  is what the rest of the mesh knows it by.  A peer signs what it says about itself
  (membership claims, its reference-table entry) and, when it publishes, the manifest.
* The **keyring** says who belongs: member names, each with one or more public keys (more
  than one while a key is being rotated), and for each model the member names allowed to
  publish it (``"*"`` stands for every model).  A signature counts only if it verifies
  under a key the keyring lists *for the name that claims it*, so nobody speaks for
  another member.  The keyring is the one mutable piece: a running peer swaps in a new
  one (:meth:`Keyring.replace`) to add, switch or remove keys without a restart.
* The **cluster key** is a CURVE (Curve25519) server key pair shared by the members.  Every
  control socket serves with it, so a member can reach any other knowing only its address,
  and ZeroMQ's ZAP handshake admits only clients whose CURVE key belongs to a listed
  member (the client key is the Curve25519 form of the member's Ed25519 key).  An outsider
  without a member key cannot complete the handshake; one without the cluster key cannot
  pose as a server.

Files (made by ``tensorhub keygen``): ``cluster.json`` -- the cluster secret, the members
and the publishers, the same file for every peer -- and ``NAME.key`` -- one peer's seed,
readable only by its owner.  Nothing here does I/O but :func:`load` / :func:`write_keys`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import nacl.bindings as sodium
import nacl.exceptions
import nacl.signing

from .errors import ConfigError

SEED_BYTES = 32
PUBLIC_BYTES = 32
SIGNATURE_BYTES = 64
ANY_MODEL = "*"


_Z85 = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def _z85(raw: bytes) -> bytes:
    """ZeroMQ's Z85 text form of ``raw`` (a multiple of 4 bytes), as CURVE options take keys."""
    out = bytearray()
    for i in range(0, len(raw), 4):
        value = int.from_bytes(raw[i:i + 4], "big")
        out += bytes(_Z85[value // 85**k % 85] for k in range(4, -1, -1))
    return bytes(out)


@dataclass(frozen=True)
class Identity:
    """One peer's signing key."""

    seed: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.seed, bytes) or len(self.seed) != SEED_BYTES:
            raise ConfigError(f"an identity seed is {SEED_BYTES} bytes")
        object.__setattr__(self, "_key", nacl.signing.SigningKey(self.seed))

    @classmethod
    def generate(cls) -> Identity:
        return cls(os.urandom(SEED_BYTES))

    @property
    def public(self) -> bytes:
        """The Ed25519 public key (32 bytes)."""
        key: nacl.signing.SigningKey = object.__getattribute__(self, "_key")
        return bytes(key.verify_key)

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature of ``data``."""
        key: nacl.signing.SigningKey = object.__getattribute__(self, "_key")
        return bytes(key.sign(data).signature)

    def curve_keys(self) -> tuple[bytes, bytes]:
        """``(public, secret)`` of this identity's CURVE client key, Z85-encoded."""
        secret = sodium.crypto_sign_ed25519_sk_to_curve25519(self.seed + self.public)
        return curve_public(self.public), _z85(secret)


def verify(public: bytes, data: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is ``public``'s Ed25519 signature of ``data``."""
    if len(public) != PUBLIC_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        nacl.signing.VerifyKey(public).verify(data, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError,
            nacl.exceptions.TypeError):
        return False
    return True


def curve_public(public: bytes) -> bytes:
    """The Z85 CURVE public key that belongs to Ed25519 public key ``public``."""
    return _z85(sodium.crypto_sign_ed25519_pk_to_curve25519(public))


@dataclass(frozen=True)
class ClusterKey:
    """The CURVE server key pair every member's control socket serves with."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != 32:
            raise ConfigError("a cluster secret is 32 bytes")

    @classmethod
    def generate(cls) -> ClusterKey:
        return cls(os.urandom(32))

    def z85(self) -> tuple[bytes, bytes]:
        """``(public, secret)`` Z85-encoded, as ZeroMQ's CURVE options take them."""
        return _z85(sodium.crypto_scalarmult_base(self.secret)), _z85(self.secret)


class Keyring:
    """Who belongs and who may publish: the mutable, thread-safe part of security.

    ``members`` maps a member name to its public keys; ``publishers`` maps a model (or
    ``"*"``) to the names allowed to publish it."""

    def __init__(self, members: Mapping[str, Iterable[bytes]],
                 publishers: Mapping[str, Iterable[str]] | None = None) -> None:
        self._lock = threading.Lock()
        self.generation = -1
        """Bumped by every change (0 once built): what was checked under an older
        generation is checked again."""
        self._set(members, publishers or {})

    def _set(self, members: Mapping[str, Iterable[bytes]],
             publishers: Mapping[str, Iterable[str]]) -> None:
        keys = {str(n): frozenset(bytes(k) for k in ks) for n, ks in members.items()}
        for name, ks in keys.items():
            if not name or any(len(k) != PUBLIC_BYTES for k in ks):
                raise ConfigError(f"member {name!r}: public keys are {PUBLIC_BYTES} bytes")
        pubs = {str(m): frozenset(str(n) for n in ns) for m, ns in publishers.items()}
        with self._lock:
            self._keys = keys
            self._publishers = pubs
            self._by_curve = {curve_public(k): n for n, ks in keys.items() for k in ks}
            self.generation += 1

    def replace(self, members: Mapping[str, Iterable[bytes]],
                publishers: Mapping[str, Iterable[str]] | None = None) -> None:
        """Swap in a new member list (rotation: add a key, switch to it, remove the old
        one).  Signatures by removed keys stop counting at once."""
        self._set(members, self.publishers() if publishers is None else publishers)

    def members(self) -> dict[str, frozenset[bytes]]:
        with self._lock:
            return dict(self._keys)

    def publishers(self) -> dict[str, frozenset[str]]:
        with self._lock:
            return dict(self._publishers)

    def keys_of(self, name: str) -> frozenset[bytes]:
        with self._lock:
            return self._keys.get(name, frozenset())

    def name_of_curve(self, curve_z85: bytes) -> str | None:
        """The member whose CURVE client key this is (ZAP admission), or None."""
        with self._lock:
            return self._by_curve.get(curve_z85)

    def verify_from(self, name: str, data: bytes, signature: bytes) -> bool:
        """True iff ``signature`` over ``data`` verifies under one of ``name``'s keys."""
        return any(verify(k, data, signature) for k in self.keys_of(name))

    def may_publish(self, model: str, name: str) -> bool:
        with self._lock:
            allowed = self._publishers.get(model, self._publishers.get(ANY_MODEL, frozenset()))
            return name in allowed and name in self._keys


@dataclass(frozen=True)
class Security:
    """``PeerConfig.security``: this peer's identity, the cluster key and the keyring."""

    identity: Identity
    cluster: ClusterKey
    keyring: Keyring = field(compare=False, hash=False)
    version_window: int = 1000
    """A new version may be at most this far past the model's ``latest``: a publisher's
    key cannot be used to jump a model's numbering out of reach."""

    def __post_init__(self) -> None:
        if not 1 <= self.version_window <= 1 << 40:
            raise ConfigError("version_window must be in [1, 2**40]")


# -- files ------------------------------------------------------------------------------


def write_keys(directory: str | Path, names: Iterable[str],
               publishers: Mapping[str, Iterable[str]] | None = None) -> list[Path]:
    """Create ``cluster.json`` (or add members to an existing one) and a ``NAME.key`` per
    new name in ``directory``; returns the files written.  Existing keys are kept."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cluster_file = d / "cluster.json"
    if cluster_file.exists():
        doc = json.loads(cluster_file.read_text())
    else:
        doc = {"cluster_secret": ClusterKey.generate().secret.hex(), "members": {},
               "publishers": {}}
    written = []
    for name in names:
        key_file = d / f"{name}.key"
        if key_file.exists():
            continue
        ident = Identity.generate()
        _write_private(key_file, json.dumps({"name": name, "seed": ident.seed.hex()}) + "\n")
        doc["members"].setdefault(name, []).append(ident.public.hex())
        written.append(key_file)
    for model, who in (publishers or {}).items():
        doc["publishers"][model] = sorted(set(doc["publishers"].get(model, [])) | set(who))
    _write_private(cluster_file, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return [cluster_file, *written]


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_keyring(cluster_file: str | Path) -> tuple[ClusterKey, Keyring]:
    try:
        doc = json.loads(Path(cluster_file).read_text())
        cluster = ClusterKey(bytes.fromhex(doc["cluster_secret"]))
        members = {n: [bytes.fromhex(k) for k in ks] for n, ks in doc["members"].items()}
        return cluster, Keyring(members, doc.get("publishers", {}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"cannot read keyring {cluster_file}: {exc}") from None


def load(directory: str | Path, name: str, **options: int) -> Security:
    """The :class:`Security` of peer ``name`` from a ``tensorhub keygen`` directory."""
    d = Path(directory)
    cluster, keyring = read_keyring(d / "cluster.json")
    try:
        doc = json.loads((d / f"{name}.key").read_text())
        identity = Identity(bytes.fromhex(doc["seed"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read the key of {name!r} in {d}: {exc}") from None
    if identity.public not in keyring.keys_of(name):
        raise ConfigError(f"{name}.key is not listed for {name!r} in {d / 'cluster.json'}")
    return Security(identity, cluster, keyring, **options)
