"""The benchmark's physical limits on the CPU, compiled with Numba: copies and a scattered read.

None of these is a gather, and fastembed's lookup never calls them; they
tell how fast the machine can move the bytes a gather moves:

- :func:`copy_parallel` and :func:`copy_parallel_stream` copy a contiguous
  block of rows over threads (ordinary and non-temporal stores): the limit
  of writing an output of that size;
- :func:`read_scattered` reads the rows a gather would read (the same ids,
  touching pages ahead as the streaming gather does) and writes nothing:
  the limit of reading scattered rows at all (:func:`read_scattered_serial`
  on one thread, for outputs too small for the gather's threads).

Arrays are 2-D unsigned machine words (see :func:`word_view`): Numba has no
float16 on the CPU, and these loops read and write a word at a time.
Importing this module imports numba.
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import numpy as np
from numba import njit

from fastembed.arrays.numpy_adapter import data_address
from fastembed.backends import numba_backend
from fastembed.backends.cpu_workers import WORKERS
from fastembed.kernels.cpu_intrinsics import store_fence
from fastembed.kernels.gather_cpu import stream_row, touch_row_pages
from fastembed.kernels.jit_options import JIT as _JIT

#: Rows whose source sits 1 to this many bytes below the destination (modulo
#: 4 KiB) are streamed backward (see :func:`fastembed.kernels.gather_cpu.copies_backward`), as the backend does.
ALIAS_WINDOW = numba_backend.ALIAS_WINDOW

_WORDS = (np.dtype(np.uint64), np.dtype(np.uint32), np.dtype(np.uint16), np.dtype(np.uint8))


def parallel_unavailable() -> str | None:
    """Why the parallel kernels cannot run in this process (numba fails to load, a bad NUMBA_NUM_THREADS), or None
    when they can. Where they cannot, the limits that use them are not measured."""
    try:
        numba_backend.BACKEND.kernels()
        numba_backend.thread_count()
    except Exception as error:  # noqa: BLE001 - numba raises ValueError, and may raise others, for a bad setting
        return f"{type(error).__name__}: {error}"
    return None


def word_view(array: np.ndarray) -> np.ndarray:
    """`array` (2-D, rows contiguous) as its rows' widest unsigned words: 8, 4, 2 or 1 bytes."""
    array = np.asarray(array)  # np.memmap: a plain view of the same bytes
    row_bytes = array.shape[1] * array.dtype.itemsize
    word = next(w for w in _WORDS if row_bytes % w.itemsize == 0)
    return array.view(np.uint8).view(word) if array.dtype.itemsize == 1 else array.view(word)


def can_stream(destination: np.ndarray) -> bool:
    """Whether :func:`copy_parallel_stream` may write `destination`: 16-byte aligned rows.

    Non-temporal 16-byte stores fault on unaligned addresses.
    """
    return (destination.shape[1] * destination.itemsize) % 16 == 0 and data_address(destination) % 16 == 0


def _over_threads(rows: Callable[[int, int], int], n: int, out_bytes: int) -> int:
    """``rows(start, stop)`` over [0, n) on the calling thread and fastembed's workers, cut into blocks as the
    gather of an `out_bytes` output cuts its rows."""
    return WORKERS.run(rows, n, numba_backend.thread_count(), numba_backend.blocks_for(out_bytes))


@njit(**_JIT)
def _copy_rows(src, dst, start, stop):
    """Rows [start, stop) of ``src`` into ``dst``, with ordinary stores."""
    for i in range(start, stop):
        for w in range(src.shape[1]):
            dst[i, w] = src[i, w]
    return 0


def copy_parallel(src: np.ndarray, dst: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (the same 2-D word shape), in blocks of rows as the gather cuts them."""
    _over_threads(lambda start, stop: _copy_rows(src, dst, start, stop), src.shape[0], dst.nbytes)


@njit(**_JIT)
def _stream_rows(src, dst, start, stop, alias_window):
    """Rows [start, stop) of ``src`` into ``dst``, with non-temporal stores."""
    row_bytes = src.shape[1] * src.itemsize
    for i in range(start, stop):
        offset = np.uintp(i) * row_bytes
        stream_row(dst.ctypes.data + offset, src.ctypes.data + offset, row_bytes, False, 0, alias_window)
    store_fence()
    return 0


def copy_parallel_stream(src: np.ndarray, dst: np.ndarray, alias_window: int) -> None:
    """As :func:`copy_parallel`, with non-temporal stores; ``dst`` must pass :func:`can_stream`.

    ``alias_window``: see :func:`fastembed.kernels.gather_cpu.copies_backward`.
    """
    _over_threads(lambda start, stop: _stream_rows(src, dst, start, stop, alias_window), src.shape[0], dst.nbytes)


@njit(**_JIT)
def _xor_rows(table, ids, start, stop, touch_pages_rows_ahead):
    """The XOR of every word of rows ``table[ids[start:stop]]``: it depends on every word, so no read is dropped.

    Each row first touches the pages of the row ``touch_pages_rows_ahead``
    ahead (0: none), as the streaming gather does
    (:func:`fastembed.kernels.gather_cpu.touch_row_pages`): random
    rows each need new page translations, and a read that waits for them is
    not the fastest way to read the rows.
    """
    accumulator = table.dtype.type(0)
    row_bytes = table.shape[1] * table.itemsize
    table_address = table.ctypes.data
    for i in range(start, stop):
        if touch_pages_rows_ahead > 0:
            touch_row_pages(table_address, row_bytes, ids[min(i + touch_pages_rows_ahead, stop - 1)])
        row = ids[i]
        for w in range(table.shape[1]):
            accumulator ^= table[row, w]
    return accumulator


def read_scattered(table: np.ndarray, ids: np.ndarray) -> int:
    """Read every word of rows ``table[ids]`` over threads, write nothing; returns their XOR.

    Each block XORs its rows' words into its own accumulator, touching pages
    as far ahead as the streaming gather (outputs of 2 MiB and more) does
    (``TOUCH_PAGES_ROWS_AHEAD`` of the numba backend), at every size. Ids are
    not checked: the caller passes ids within the table.
    """
    blocks: list[int] = []
    touch = numba_backend.TOUCH_PAGES_ROWS_AHEAD

    def xor(start: int, stop: int) -> int:
        blocks.append(int(_xor_rows(table, ids, start, stop, touch)))
        return 0

    _over_threads(xor, ids.size, ids.size * table.shape[1] * table.itemsize)
    return functools.reduce(operator.xor, blocks, 0)


def gathers_on_threads(out_bytes: int) -> bool:
    """Whether fastembed's numba gather of an `out_bytes` output runs on its workers (else on the calling thread)."""
    return out_bytes >= numba_backend.PARALLEL_MIN_BYTES


def read_scattered_serial(table: np.ndarray, ids: np.ndarray) -> int:
    """:func:`read_scattered` on the calling thread: what reading a few rows costs without waking the workers."""
    return int(_xor_rows(table, ids, 0, ids.size, numba_backend.TOUCH_PAGES_ROWS_AHEAD))
