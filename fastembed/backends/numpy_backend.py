"""The NumPy backend: always available, exact, single-threaded; the readable reference.

Without ``out``, ``table.take(ids, axis=0)`` allocates the result and copies
the rows in one C call (:func:`take_new`; the numba backend uses it and
:func:`take_into` for its small gathers too). With ``out``,
``np.take(table, ids, axis=0, out=out, mode="clip")`` copies one row per id
straight into ``out``. ``mode="clip"`` matters: with ``mode="raise"`` and
``out=``, numpy (2.4) gathers into a temporary copy of ``out`` and copies it
back, an extra output-sized buffer. Clipping would hide bad
ids, so the range is checked first (min and max over the ids); clipping also
keeps a concurrent change of the ids inside the table.

A table whose data is not aligned to its itemsize (a file mapped at an odd
offset) is gathered through a byte view of its rows: ``take`` would first
copy the whole table to align it.

A quantized table is gathered as bytes and dequantized by the readable
reference of :mod:`fastembed.formats`, a bounded number of rows at a time
(:func:`dequantize_into`).
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .. import validate
from ..formats import FORMATS, QuantizedTable, dequantize_rows, row_bytes
from .base import DENSE, Capabilities, SmallGather

_BYTE = np.dtype(np.uint8)
#: Rows dequantized per step: bounds the float32 temporaries of the reference to a few MiB.
_DEQUANTIZE_ROWS_PER_STEP = 256
#: Rows placed per step: bounds the reference's temporary of gathered rows.
_PLACE_ROWS_PER_STEP = 256


class NumpyBackend:
    """The always-available host backend (see the module docstring)."""

    name = "numpy"
    capabilities = Capabilities(
        array_libraries=frozenset({"numpy"}), devices=frozenset({"cpu"}), formats=frozenset({DENSE, *FORMATS})
    )

    def unavailable_reasons(self) -> list[str]:
        return []

    def gather(self, table: np.ndarray, ids: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        return take_new(table, ids) if out is None else take_into(table, ids, out)

    def small_gather(self) -> SmallGather:
        """Every gather is :func:`take_new` or :func:`take_into`."""
        return SmallGather(sys.maxsize, take_new, sys.maxsize, take_into)

    def dequantize(self, table: QuantizedTable, ids: np.ndarray, out: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
        if out is None:
            out = np.empty(ids.shape + (table.dim,), dtype=dtype)
        return dequantize_into(table, ids, out)

    def place(self, table: np.ndarray, ids: np.ndarray, out: np.ndarray, positions: np.ndarray) -> None:
        """``out[positions[i]] = table[ids[i]]``, a bounded number of rows at a time (the readable reference).

        Through byte views of the rows: every byte is copied, a structured
        dtype's padding included, as the gather copies it.
        """
        check_range(ids, table.shape[0])
        source, target = byte_rows(table), byte_rows(out)
        for start in range(0, ids.size, _PLACE_ROWS_PER_STEP):
            stop = start + _PLACE_ROWS_PER_STEP
            target[positions[start:stop]] = source.take(ids[start:stop], 0)

    def describe(self) -> dict[str, Any]:
        return {"numpy": np.__version__}

    def reset(self) -> None:
        """Nothing to forget: the backend keeps no state."""


def byte_rows(table: np.ndarray) -> np.ndarray:
    """The table's rows as bytes, ``(vocab_size, row_bytes)`` uint8: aligned whatever the address (a view)."""
    return table.view(_BYTE).reshape(table.shape[0], row_bytes(table))


def take_into(table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Write ``table[ids]`` into `out` with numpy's take, after a range check; return `out`."""
    check_range(ids, table.shape[0])
    # Arguments by position (ids, axis, out, mode): numpy parses keywords on a slower path.
    # Through bytes where either is unaligned: take would first copy the table, or buffer the whole of out.
    if table.flags.aligned and out.flags.aligned:
        table.take(ids, 0, out, "clip")
    else:
        byte_rows(table).take(ids, 0, out.view(_BYTE).reshape(ids.shape + (row_bytes(table),)), "clip")
    return out


def check_range(ids: np.ndarray, vocab_size: int) -> None:
    """Raise the IndexError of :func:`fastembed.validate.out_of_range_error` for the first id outside the table.

    The smallest and the largest id are found by position (argmin, argmax:
    cheaper than min and max for the few ids of a decode step); one id is read directly.
    """
    n = ids.size
    if n == 1:
        if not 0 <= ids.item() < vocab_size:
            raise validate.out_of_range_error(ids, 0, vocab_size)
    elif n and (ids.item(ids.argmin()) < 0 or ids.item(ids.argmax()) >= vocab_size):
        validate.check_ids_in_range(ids, vocab_size)  # raises, naming position and value


def take_new(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``table[ids]`` as a new ``ids.shape + (dim,)`` array, through numpy's take (one C call).

    take raises for ids past the end but counts negative ids from the end,
    as Python does: the smallest id is checked first (argmin and item cost
    less than min for a few ids; one id is read directly). Either way the
    IndexError names the first bad id and its position.
    """
    n = ids.size
    if n and (ids.item() if n == 1 else ids.item(ids.argmin())) < 0:
        validate.check_ids_in_range(ids, len(table))  # raises
    try:
        if table.flags.aligned:
            return table.take(ids, 0)  # the axis by position: numpy parses a keyword argument more slowly
        return byte_rows(table).take(ids, 0).view(table.dtype).reshape(ids.shape + table.shape[1:])
    except IndexError:
        validate.check_ids_in_range(ids, len(table))  # raises, naming position and value
        raise


def take_scales(scales: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``scales[ids]`` (float32 row scales, ids in range), through their bytes where the scales are unaligned.

    ``take`` would first copy all the scales to align them.
    """
    if scales.flags.aligned:
        return scales.take(ids, mode="clip")
    return scales.view(_BYTE).reshape(-1, 4).take(ids, axis=0, mode="clip").view(scales.dtype).reshape(ids.shape)


def dequantize_into(table: QuantizedTable, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Write the dequantized rows ``table[ids]`` into `out` (its dtype: float32, float16 or bfloat16); return `out`.

    The reference every other backend matches bit for bit: float32 values
    from :func:`fastembed.formats.dequantize_rows`, converted by numpy's
    (or ml_dtypes') cast, which rounds to nearest even. Ids are range-checked
    first and clipped while gathering, so a concurrent change of the ids
    cannot read outside the table.
    """
    check_range(ids, table.data.shape[0])
    flat_ids = ids.reshape(-1)
    rows_out = out.reshape(-1, table.dim)
    with np.errstate(all="ignore"):  # overflow to infinity and NaN payloads are the defined results, whatever np.seterr says
        for start in range(0, flat_ids.size, _DEQUANTIZE_ROWS_PER_STEP):
            chosen = flat_ids[start : start + _DEQUANTIZE_ROWS_PER_STEP]
            data = table.data.take(chosen, axis=0, mode="clip")
            scales = None if table.scales is None else take_scales(table.scales, chosen)
            rows_out[start : start + chosen.size] = dequantize_rows(data, scales, table.format, table.dim)
    return out


BACKEND = NumpyBackend()
