"""A dense gather into another dtype (``lookup(..., dtype=)``), through a bounded scratch buffer.

The backend gathers a few rows at a time into a scratch array of the
table's dtype, and numpy's cast (ml_dtypes' for bfloat16) writes them into
the output: the only allocations are the output and the scratch, which is
bounded (:data:`SCRATCH_BYTES`), never a table-sized or output-sized
temporary. Host tables only: a GPU table gathers in its own dtype.
"""
from __future__ import annotations

import numpy as np

from .backends.base import Backend
from .backends.numpy_backend import check_range

#: Bytes of the scratch rows: small enough to stay in the cache between the gather and the cast.
SCRATCH_BYTES = 1 << 20


def gather_cast(backend: Backend, table: np.ndarray, ids: np.ndarray, out: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """``table[ids].astype(dtype)`` written into `out` (or a new array), gathered by `backend`.

    Args:
        backend: the backend that gathers the rows (host tables).
        table, ids, out: validated snapshots (``out`` of `dtype`, or None).
        dtype: the output dtype (validated by :func:`fastembed.validate.output_dtype`).

    Raises:
        IndexError: an id out of range, before anything is written.
    """
    check_range(ids, table.shape[0])
    if out is None:
        out = np.empty(ids.shape + (table.shape[1],), dtype=dtype)
    flat_ids = ids.reshape(-1)
    rows_out = out.reshape(flat_ids.size, table.shape[1])  # not -1: a table of no columns has nothing to divide by
    step = max(1, SCRATCH_BYTES // max(1, table.shape[1] * table.dtype.itemsize))
    scratch = np.empty((min(step, flat_ids.size), table.shape[1]), dtype=table.dtype)
    wider_than_double = table.dtype.kind == "f" and table.dtype.itemsize > 8 and np.dtype(dtype).itemsize < 8
    # Overflow to infinity is the documented rounding, not an error: a caller's np.seterr must not stop the cast half-way.
    with np.errstate(all="ignore"):
        for start in range(0, flat_ids.size, step):
            chosen = flat_ids[start : start + step]
            rows = scratch[: chosen.size]
            backend.gather(table, chosen, rows)
            rows_out[start : start + chosen.size] = _rounded_to_odd(rows) if wider_than_double else rows
    return out


def _rounded_to_odd(rows: np.ndarray) -> np.ndarray:
    """Rows of a float dtype wider than float64 (long double) as float64, rounded to odd.

    numpy casts long double to float16 through a float narrower than long
    double, rounding twice: a value just above a float16 midpoint lands on
    it, then goes to even. A float64 rounded to odd (an inexact result keeps
    an odd last bit) rounds once more to any dtype of at most 51 bits as the
    value itself would, so these results are the correctly rounded ones
    where numpy's ``astype`` is not.
    """
    nearest = rows.astype(np.float64)
    inexact = (nearest.astype(rows.dtype) != rows) & np.isfinite(nearest) & (nearest.view(np.uint64) & 1 == 0)
    nearest[inexact] = np.nextafter(nearest[inexact], np.where(rows[inexact] > nearest[inexact], np.inf, -np.inf))
    return nearest
