"""torch tensors on the CPU: seen as numpy arrays, zero-copy, through DLPack.

Recognised by their module name, so telling a tensor from anything else never
imports torch. A snapshot of a CPU tensor is a numpy array sharing the
tensor's memory (``np.from_dlpack``), so validation, dispatch and the
backends see numpy alone; a result is handed back as a tensor over the same
memory (``torch.from_dlpack``). Dtypes numpy lacks (bfloat16, float8) travel
as integer views of the same width and are retyped with ml_dtypes.

A tensor that requires grad is gathered through ``tensor.detach()`` (no
copy): lookup does not record autograd. torch CUDA tensors are refused for
now (TypeError): a GPU table goes through cupy (``Embedding.to_device()``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import numpy_adapter

#: torch dtype name -> the torch integer dtype of the same width, for the dtypes numpy has not (ml_dtypes has them).
_VIA_INTEGER = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
#: The same, keyed by torch dtype objects (torch dtype -> (torch integer dtype, name)); built on first use.
_via_torch: dict[Any, tuple[Any, str]] | None = None

CUDA_NOT_SUPPORTED = "torch CUDA tensors are not supported yet; use cupy (Embedding.to_device())"


class TorchAdapter:
    name = "torch"
    result_alignment = 0

    def stored_dtype(self, dtype: Any) -> Any:
        return dtype

    def owns(self, array: Any) -> bool:
        # __dlpack__ tells a tensor (nn.Parameter included) from torch's other types (Size, storages, dtypes).
        return type(array).__module__.partition(".")[0] == "torch" and hasattr(array, "__dlpack__")

    def device(self, array: Any) -> str:
        device = array.device
        if device.type == "cpu":
            return "cpu"
        return f"{device.type}:{device.index if device.index is not None else 0}"

    def snapshot(self, array: Any) -> np.ndarray:
        """A numpy array over the tensor's memory (no copy), its shape, strides and dtype read once."""
        device = self.device(array)
        if device != "cpu":
            if device.startswith("cuda"):
                raise TypeError(f"{CUDA_NOT_SUPPORTED} (got a tensor on {device})")
            raise TypeError(f"torch tensors on {device} are not supported; fastembed reads CPU tensors")
        tensor = array.detach() if array.requires_grad else array  # no copy: lookup does not record autograd
        via = _via_integer().get(tensor.dtype)
        if via is None:
            try:
                return np.from_dlpack(tensor)
            except (BufferError, RuntimeError, TypeError) as error:
                raise TypeError(f"torch dtype {tensor.dtype} cannot be seen as a numpy array: {error}") from None
        return np.from_dlpack(tensor.view(via[0])).view(_ml_dtype(via[1]))

    def wrap(self, result: np.ndarray) -> Any:
        """A host result (a numpy array) as a tensor over the same memory."""
        import torch

        if result.dtype.kind != "V":  # numpy's own dtypes; ml_dtypes' (bfloat16, float8) are kind V
            return torch.from_dlpack(result)
        name = result.dtype.name
        if name not in _VIA_INTEGER:
            raise TypeError(f"a {name} result has no torch dtype")
        return torch.from_dlpack(result.view(np.dtype(_VIA_INTEGER[name]))).view(getattr(torch, name))

    def from_host(self, host: np.ndarray, device: str = "cpu") -> Any:
        if device != "cpu":
            raise TypeError(CUDA_NOT_SUPPORTED)
        return self.wrap(host)

    #: Snapshots of tensors are numpy arrays: the numpy adapter's exact test applies.
    may_share_memory = staticmethod(numpy_adapter.ADAPTER.may_share_memory)


def _via_integer() -> dict[Any, tuple[Any, str]]:
    global _via_torch
    if _via_torch is None:
        import torch

        _via_torch = {
            getattr(torch, name): (getattr(torch, integer), name)
            for name, integer in _VIA_INTEGER.items()
            if hasattr(torch, name)
        }
    return _via_torch


def _ml_dtype(name: str) -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(
            f"torch {name} tensors need ml_dtypes (numpy has no {name}): pip install 'fastembed-gather[bfloat16]'"
        ) from None
    return getattr(ml_dtypes, name)


ADAPTER = TorchAdapter()
