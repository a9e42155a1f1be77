"""Signing what this peer says and checking what others say, for the sans-IO protocols.

Theory of operation
-------------------
With ``PeerConfig.security`` set, every claim that gossip carries names its origin and
is signed by it: membership claims (:mod:`.membership`), reference-table entries
(:mod:`.refs`) and version announcements (a publisher's signature that every copy of a
holding carries along).  The bytes signed are a domain tag per kind of claim followed
by the msgpack wire form of the claim's fields without the signature
(:func:`~tensorhub.protocol.codec.fields_bytes`), so a signature of one kind never
passes for another and the wire format is the only canonical form.

:class:`Trust` is the one object the protocols share: it signs with this peer's
identity (swapped by :meth:`Trust.rotate`), checks signatures against the keyring (a
signature counts only under a key listed for the name that claims it, so nobody speaks
for another member), remembers verdicts on announcements (the same signed holding is
checked once per keyring generation, not at every re-seal) and counts what it refused.
Without security there is no ``Trust``: nothing is signed or checked.

Ed25519 (pynacl) costs about 20 us to sign and 50 us to check here; protocols check a
claim only when it would change their state, so old news costs nothing.
"""

from __future__ import annotations

from ..security import Identity, Keyring, Security

_VERDICTS_MAX = 1 << 16


class Trust:
    """This peer's signer and checker (see the module docstring)."""

    def __init__(self, security: Security) -> None:
        self.identity: Identity = security.identity
        self.keyring: Keyring = security.keyring
        self.version_window = security.version_window
        self.refused: dict[str, int] = {}
        """Claims refused, by kind (``"membership claim"``, ``"reference entry"``, ...)."""
        self._verdicts: dict[tuple[str, bytes, bytes], bool] = {}
        self._keyring_generation = self.keyring.generation

    def sign(self, data: bytes) -> bytes:
        return self.identity.sign(data)

    def check(self, name: str, data: bytes, signature: bytes) -> bool:
        """True iff ``signature`` over ``data`` verifies under a key of member ``name``."""
        return self.keyring.verify_from(name, data, signature)

    def check_cached(self, name: str, data: bytes, signature: bytes) -> bool:
        """:meth:`check` for claims re-examined often (announcements at every re-seal);
        verdicts are forgotten when the keyring changes."""
        if self.keyring.generation != self._keyring_generation:
            self._keyring_generation = self.keyring.generation
            self._verdicts.clear()
        key = (name, data, signature)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if len(self._verdicts) >= _VERDICTS_MAX:
                self._verdicts.clear()
            verdict = self._verdicts[key] = self.check(name, data, signature)
        return verdict

    def refuse(self, kind: str) -> None:
        self.refused[kind] = self.refused.get(kind, 0) + 1

    def rotate(self, identity: Identity) -> None:
        """Sign with ``identity`` from now on (it must already be in the keyring)."""
        self.identity = identity
