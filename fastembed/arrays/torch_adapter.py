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

#: torch dtype name -> (torch integer dtype of the same width, ml_dtypes name) for dtypes numpy has not.
_VIA_INTEGER = {
    "bfloat16": ("int16", "bfloat16"),
    "float8_e4m3fn": ("uint8", "float8_e4m3fn"),
    "float8_e5m2": ("uint8", "float8_e5m2"),
}

CUDA_NOT_SUPPORTED = "torch CUDA tensors are not supported yet; use cupy (Embedding.to_device())"


class TorchAdapter:
    name = "torch"

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
        import torch

        tensor = array.detach()  # a view without autograd history: lookup does not record autograd
        name = str(tensor.dtype).rpartition(".")[2]
        via = _VIA_INTEGER.get(name)
        if via is None:
            try:
                return np.from_dlpack(tensor)
            except (BufferError, RuntimeError, TypeError) as error:
                raise TypeError(f"torch dtype {tensor.dtype} cannot be seen as a numpy array: {error}") from None
        import ml_dtypes

        integers = np.from_dlpack(tensor.view(getattr(torch, via[0])))
        return integers.view(getattr(ml_dtypes, via[1]))

    def wrap(self, result: np.ndarray) -> Any:
        """A host result (a numpy array) as a tensor over the same memory."""
        import torch

        via = _VIA_INTEGER.get(np.dtype(result.dtype).name)
        if via is None:
            return torch.from_dlpack(result)
        return torch.from_dlpack(result.view(np.dtype(via[0]))).view(getattr(torch, result.dtype.name))

    def empty(self, shape: tuple[int, ...], dtype: Any, device: str = "cpu") -> Any:
        return self.wrap(np.empty(shape, dtype))

    def from_host(self, host: np.ndarray, device: str = "cpu") -> Any:
        if device != "cpu":
            raise TypeError(CUDA_NOT_SUPPORTED)
        return self.wrap(host)

    def may_share_memory(self, first: np.ndarray, second: Any) -> bool:
        """Whether two snapshots share memory (they are numpy arrays: exact, ``np.shares_memory``)."""
        return isinstance(second, np.ndarray) and bool(np.shares_memory(first, second))


ADAPTER = TorchAdapter()
