"""The engine hook: a version's weights as the ``(name, tensor)`` pairs an inference
engine's ``load_weights`` takes, and the tag an engine attaches to what it produces.

vLLM and SGLang model classes load weights from an iterable of ``(name, torch.Tensor)``
pairs (``model.load_weights(weights)``), copying each into the parameter it names.
:func:`weights` gives that iterable for a fetched version (or a rollout's live one),
as torch views of the fetched memory, with an optional renaming from the publisher's
names to the engine's.  :class:`EngineSync` ties it together: fetch a version (casting
on the way if asked), hand it to ``load_weights``, and set :attr:`EngineSync.tag`, the
:class:`VersionTag` the rollout loop attaches to every output it produces from then on.

Attribution.  :meth:`EngineSync.update` calls ``load_weights`` and sets the tag with no
checkpoint in between, so in a trio program an output computed between two checkpoints
with the tag read before it was produced by that version.  ``load_weights`` runs in the
trio thread (it is the engine's code); the version it loads stays held and served by
the peer until the next update has loaded, then it is unpublished.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import LocalProtocolError
from ..model import VersionKey, check_model_name
from ..protocol.sharding import WHOLE, Sharding
from ..torch import to_torch

if TYPE_CHECKING:
    import torch

    from ..peer.node import Peer
    from ..read.cast import CastSpec

Rename = Mapping[str, str] | Callable[[str], str | None]
"""Publisher name -> engine name: a mapping (names not in it pass unchanged) or a
function (returning None skips the tensor)."""


@dataclass(frozen=True)
class VersionTag:
    """Which weights produced an output: the model, its version, and the id of the
    manifest (digest of the tensor specs and chunk digests) the bytes were verified
    against."""

    model: str
    version: int
    manifest_id: bytes

    def __str__(self) -> str:
        return f"{self.model}@{self.version} ({self.manifest_id.hex()[:12]})"


def weights(source: Any, *, rename: Rename | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``source``: a :class:`~tensorhub.Fetched`, a
    :class:`~tensorhub.Committed` or :class:`~tensorhub.Staged` version, a
    :class:`~tensorhub.Rollout` (its live version), or a mapping of arrays.  Each tensor
    is a torch view of the fetched memory (no copy) with the published dtype, or the
    cast one."""
    if hasattr(source, "live"):  # a Rollout
        if source.live is None:
            raise LocalProtocolError(f"rollout of {source.model} has no live version yet")
        source = source.live
    source = getattr(source, "fetched", source)  # a Staged
    tensors = getattr(source, "tensors", source)
    if not isinstance(tensors, Mapping):
        raise LocalProtocolError(f"no weights in a {type(source).__name__}")
    for name, arr in tensors.items():
        new = _renamed(name, rename)
        if new is not None:
            yield new, to_torch(arr, name)


def _renamed(name: str, rename: Rename | None) -> str | None:
    if rename is None:
        return name
    if isinstance(rename, Mapping):
        return rename.get(name, name)
    return rename(name)


def tag_of(peer: Peer, model: str, version: int, *, layout: Sharding | None = None
           ) -> VersionTag:
    """The tag of ``model@version`` as this peer holds it (fetched or published)."""
    key = _key(model, version, layout)
    held = peer.store.get(key)
    if held is None or not held.complete:
        raise LocalProtocolError(f"{key} is not held here complete")
    return VersionTag(model, version, held.manifest.manifest_id())


def _key(model: str, version: int, layout: Sharding | None) -> VersionKey:
    return (layout or WHOLE).key(check_model_name(model), version)


class EngineSync:
    """Keeps an engine's weights at a version of ``model``: :meth:`update` fetches it,
    passes :func:`weights` to ``load_weights`` and sets :attr:`tag`."""

    def __init__(self, peer: Peer, model: str,
                 load_weights: Callable[[Iterator[tuple[str, torch.Tensor]]], object], *,
                 rename: Rename | None = None, cast: CastSpec | None = None,
                 layout: Sharding | None = None) -> None:
        self.peer = peer
        self.model = check_model_name(model)
        self.load_weights = load_weights
        self.rename = rename
        self.cast = cast
        self.layout = layout
        self.tag: VersionTag | None = None
        """The version the engine's weights are now; None before the first update."""

    async def update(self, version: int | str = "latest") -> VersionTag:
        """Fetch ``version`` (verified, cast if asked), load it into the engine, and
        return the new tag.  The version loaded before is unpublished afterwards."""
        if version == "latest" and self.tag is not None:
            newest = await self.peer.latest(self.model)
            version = version if newest is None else newest
        if self.tag is not None and version == self.tag.version:
            return self.tag
        fetched = await self.peer.fetch(self.model, version, cast=self.cast,
                                        layout=self.layout)
        tag = tag_of(self.peer, self.model, fetched.version, layout=self.layout)
        self.load_weights(weights(fetched, rename=self.rename))
        previous, self.tag = self.tag, tag  # no checkpoint since the load: see the module
        if previous is not None and self.peer.store.get(
                _key(self.model, previous.version, self.layout)) is not None:
            await self.peer.unpublish(self.model, previous.version, layout=self.layout)
        return tag
