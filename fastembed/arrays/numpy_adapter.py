"""numpy arrays (np.memmap and other subclasses included): host memory."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import write_probe


class NumpyAdapter:
    name = "numpy"
    owned_by_type = True
    result_alignment = 0

    def stored_dtype(self, dtype: Any) -> Any:
        return dtype

    def owns(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def device(self, array: Any) -> str:
        return "cpu"

    def snapshot(self, array: np.ndarray) -> np.ndarray:
        # A base-class view: np.memmap's subclass makes slicing and typing slower, and the bytes are the same.
        return array.view() if type(array) is np.ndarray else array.view(np.ndarray)

    def from_host(self, host: np.ndarray, device: str = "cpu") -> np.ndarray:
        return host

    def may_share_memory(self, first: np.ndarray, second: Any) -> bool:
        """Whether two snapshots share memory (exact: ``np.shares_memory``)."""
        return isinstance(second, np.ndarray) and bool(np.shares_memory(first, second))

    def wrap(self, result: np.ndarray) -> np.ndarray:
        return result

    def writable(self, view: np.ndarray) -> bool:
        """Whether a gather can write `view` (an ``out``): probed where another library lent its memory.

        A numpy view of a torch tensor over a read-only map says it is writeable (torch marks nothing
        read-only): :mod:`fastembed.arrays.write_probe`.
        """
        return not write_probe.lent(view) or write_probe.can_write(view)


ADAPTER = NumpyAdapter()

