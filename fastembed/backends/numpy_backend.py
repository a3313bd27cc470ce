"""The NumPy backend: always available, exact, single-threaded.

``np.take(table, ids, axis=0, out=out, mode="clip")`` copies one row per id
straight into ``out``. ``mode="clip"`` matters: with ``mode="raise"`` and
``out=``, numpy gathers into a temporary copy of ``out`` and copies it back
(numpy/numpy#28636), an extra output-sized buffer. Clipping would hide bad
ids, so the range is checked first (min and max over the ids).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import validate

NAME = "numpy"


def unavailable_reasons() -> list[str]:
    return []


def not_supported_reasons(table: Any, ids: Any, out: Any) -> list[str]:
    if not isinstance(table, np.ndarray):
        return [f"the table lives on {validate.device_of(table)}; the numpy backend gathers host arrays"]
    return []


def gather(table: np.ndarray, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    validate.check_ids_in_range(ids, table.shape[0])
    if out is None:
        out = np.empty(validate.output_shape(ids, table), dtype=table.dtype)
    # np.asarray drops np.memmap's subclass (a view, not a copy).
    np.take(np.asarray(table), ids, axis=0, out=out, mode="clip")
    return out


def describe() -> dict[str, Any]:
    return {"numpy": np.__version__}
