"""The error vocabulary of TensorHub.

Every error says whose fault it is:

* :class:`LocalProtocolError` -- the caller (or this peer) asked for something that
  cannot be done: a wrong shape, an unknown option, a buffer that is not contiguous.
  Fix the call.
* :class:`RemoteProtocolError` -- another peer sent something malformed, oversized or
  inconsistent.  The peer keeps running; the message is dropped and counted.
* :class:`VersionUnavailable` -- the mesh has no (or no longer any) holder for what was
  asked; it names the model, the version and what is missing.
* :class:`IntegrityError` -- bytes did not match the publisher's manifest digest; it
  names the source that sent them.
"""

from __future__ import annotations


class TensorHubError(Exception):
    """Base class of every error TensorHub raises on purpose."""


class ConfigError(TensorHubError, ValueError):
    """A configuration value is out of range or inconsistent."""


class LocalProtocolError(TensorHubError):
    """The caller or this peer did something the protocol does not allow."""


class RemoteProtocolError(TensorHubError):
    """A remote peer sent malformed, oversized or inconsistent input."""


class IntegrityError(RemoteProtocolError):
    """Received bytes do not match the manifest digest.

    ``source`` names the peer that sent them, so it can be avoided.
    """

    def __init__(self, message: str, *, source: str) -> None:
        super().__init__(message)
        self.source = source


class VersionUnavailable(TensorHubError, LookupError):
    """No live holder can serve (part of) the requested version."""

    def __init__(self, model: str, version: int | str, detail: str = "") -> None:
        self.model = model
        self.version = version
        self.detail = detail
        text = f"model {model!r} version {version!r} is unavailable"
        super().__init__(f"{text}: {detail}" if detail else text)


class RetentionError(LocalProtocolError):
    """Dropping this copy would lose the last replica of a version that must stay readable
    (and offloading it to host memory is configured off)."""


class ConsistencyError(TensorHubError):
    """Peers or ranks disagree about something that must be identical."""


class TransportError(TensorHubError):
    """A data-plane connection failed (refused, reset, stalled)."""


class PeerClosed(TensorHubError):
    """The peer was closed while the operation was running."""
