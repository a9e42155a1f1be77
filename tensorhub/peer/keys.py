"""Key rotation at a running peer: a new keyring, or a new identity for this peer.

The :class:`~tensorhub.peer.node.Peer` methods ``update_keyring`` and ``rotate_identity``
are the API; this is what they do to the peer's parts (trust, data-plane authentication,
pooled connections, the control router, the announcements it signed)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from ..errors import LocalProtocolError
from ..security import Identity

if TYPE_CHECKING:
    from .node import Peer


def update_keyring(peer: Peer, members: Mapping[str, Iterable[bytes]],
                   publishers: Mapping[str, Iterable[str]] | None) -> None:
    trust = peer.control.trust
    if trust is None:
        raise LocalProtocolError("this peer runs without keys (PeerConfig.security)")
    trust.keyring.replace(members, publishers)
    peer.control.keyring_changed()
    peer._after_change()


def rotate_identity(peer: Peer, identity: Identity) -> None:
    trust = peer.control.trust
    if trust is None:
        raise LocalProtocolError("this peer runs without keys (PeerConfig.security)")
    if identity.public not in trust.keyring.keys_of(peer.info.name):
        raise LocalProtocolError(f"the new key of {peer.info.name} is not in the keyring "
                                 "yet: add it (update_keyring) before switching to it")
    trust.rotate(identity)
    if peer._data_auth is not None:  # new data connections prove the new key
        peer._data_auth = replace(peer._data_auth, identity=identity)
        peer._server.auth = peer._data_auth
        peer._pool.flush()  # and so do reads from now on
    peer._router.set_client_keys(*identity.curve_keys())
    for local in peer.store.versions.values():
        if local.publisher == peer.info.name and not local.derived:
            signed = peer.control.sign_announcement(local.holding())
            local.announced = (signed.publisher_gen, signed.publisher_sig)
    peer._send(peer.control.renew(trio.current_time()))
