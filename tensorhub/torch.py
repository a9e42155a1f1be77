"""torch tensors in and out of TensorHub, without copies.

Publishing takes CPU torch tensors (a ``state_dict``, parameters included) and serves
their memory in place: :func:`host_view` views a contiguous tensor as a numpy array of
the same bytes (``bfloat16`` and the fp8 types as tagged raw bits, see
:mod:`tensorhub.dtypes`).  Fetching fills ``into=`` an ``nn.Module`` (its parameters and
buffers, by ``state_dict`` names) or a dict of torch tensors in place, and
:func:`as_torch` views every fetched array as a torch tensor of the published dtype.

torch is optional: this module imports it only when one of its functions runs, and
:func:`tensorhub.model.as_host_array` calls here only for objects that are torch
tensors (so torch is already loaded).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from .dtypes import EXTENDED, dtype_name, tagged
from .errors import LocalProtocolError

if TYPE_CHECKING:
    import torch

_RAW_BITS = {1: "uint8", 2: "int16"}

Into: TypeAlias = "Mapping[str, Any] | torch.nn.Module"
"""What ``fetch(into=...)`` takes: a mapping of name -> array or tensor, or a module."""


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (without importing torch)."""
    mod = sys.modules.get("torch")
    return mod is not None and isinstance(obj, mod.Tensor)


def is_module(obj: Any) -> bool:
    """Whether ``obj`` is an ``nn.Module`` (without importing torch)."""
    mod = sys.modules.get("torch")
    return mod is not None and isinstance(obj, mod.nn.Module)


def require_torch() -> None:
    """Raise a :class:`LocalProtocolError` saying how to get torch if it is missing."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise LocalProtocolError("this needs torch: pip install 'tensorhub[torch]'") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name (``"bfloat16"``, ``"<f4"``, ...)."""
    require_torch()
    import torch
    if name in EXTENDED:
        found = getattr(torch, name, None)
    else:
        try:
            found = torch.from_numpy(np.empty(0, np.dtype(name))).dtype
        except TypeError:
            found = None
    if not isinstance(found, torch.dtype):
        raise LocalProtocolError(f"torch {torch.__version__} has no dtype for {name!r}")
    return found


def dtype_of(t: torch.Tensor) -> str:
    """The manifest dtype name of a torch tensor's dtype."""
    name = str(t.dtype).removeprefix("torch.")
    if name in EXTENDED:
        return name
    try:
        return np.dtype(name).str
    except TypeError:
        raise LocalProtocolError(f"torch dtype {t.dtype} has no wire form") from None


def host_view(t: torch.Tensor, name: str) -> np.ndarray[Any, Any]:
    """A contiguous CPU tensor's memory as a numpy array (no copy): its own dtype where
    numpy has it, else the tagged raw bits of :mod:`tensorhub.dtypes`."""
    import torch
    if t.device.type != "cpu":
        raise LocalProtocolError(
            f"tensor {name!r} is on {t.device}; TensorHub serves host memory only here "
            "(CUDA tensors go through a staging ring; move others with .cpu())")
    if not t.is_contiguous():
        raise LocalProtocolError(
            f"tensor {name!r} is not contiguous; TensorHub serves it in place and will "
            "not copy it (pass t.contiguous())")
    t = t.detach()
    dtype = dtype_of(t)
    if dtype in EXTENDED:
        raw = t.view(getattr(torch, _RAW_BITS[t.element_size()])).numpy()
        return tagged(raw, dtype)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:
        raise LocalProtocolError(f"tensor {name!r}: cannot view as host memory ({exc})") \
            from None


def destination(into: Any) -> Mapping[str, Any]:
    """``into=`` as a mapping of name -> tensor: a module's ``state_dict`` (its
    parameters and buffers, sharing their memory) or the mapping itself."""
    return into.state_dict() if is_module(into) else into  # type: ignore[no-any-return]


def check_into(name: str, t: Any, dtype: str, shape: tuple[int, ...]) -> None:
    """A torch ``into=`` tensor must have the manifest's dtype, not just its width
    (``bfloat16`` into ``int16`` would land the bits under another meaning)."""
    got = dtype_of(t)
    if got != dtype or tuple(t.shape) != shape:
        from .dtypes import display
        raise LocalProtocolError(
            f"into[{name!r}] is {display(got)}{list(t.shape)}, the version has "
            f"{display(dtype)}{list(shape)}")


def as_torch(tensors: Any) -> dict[str, torch.Tensor]:
    """Torch views (sharing memory) of a :class:`~tensorhub.Fetched`'s tensors, or of a
    mapping of numpy arrays, each with its published dtype (``bfloat16`` included)."""
    arrays = getattr(tensors, "tensors", tensors)
    return {name: to_torch(arr, name) for name, arr in arrays.items()}


def to_torch(arr: np.ndarray[Any, Any], name: str = "tensor") -> torch.Tensor:
    """One array as a torch tensor sharing its memory (see :func:`as_torch`)."""
    require_torch()
    import torch
    if is_tensor(arr):
        return arr  # type: ignore[return-value]
    extended = dtype_name(arr.dtype)
    try:
        t = torch.from_numpy(arr)
    except TypeError as exc:
        raise LocalProtocolError(f"tensor {name!r}: no torch view of {arr.dtype} ({exc})") \
            from None
    return t if extended is None else t.view(torch_dtype(extended))
