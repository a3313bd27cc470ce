"""Host side of the Numba CPU gather: kernel choice, word views, thread and fork guards.

The kernels (:mod:`fastembed.kernels.gather_cpu`) copy rows as unsigned
machine words, so this module turns any table into a word view: the widest
of 8, 4, 2 or 1 bytes that divides the row size. That is bit-exact for every
dtype (float16, bfloat16, float32, int8, ...).

Which kernel runs (each constant was measured; see docs/backends.md):

- one id: a slice copy of the row (one memcpy), no compiled call at all: the
  call's fixed cost is larger than the copy;
- fewer than ``PARALLEL_MIN_ROWS`` ids: the calling thread alone, so a
  decode step pays no thread wake-up. Without ``out``, numpy's ``take``
  (the numpy backend's :func:`~.numpy_backend.take_new`), which allocates
  and copies in one C call (0.79-0.99x the time of np.empty + the
  compiled call at 2-12 ids, 0.88-1.05x at 16-31); with ``out``, the
  serial kernel;
- an output of at least ``STREAM_MIN_OUT_BYTES`` on x86-64 whose rows are
  16-byte aligned: the parallel kernel with non-temporal stores;
- otherwise the parallel kernel with ordinary (cached) stores.

Safety, whatever threading layer numba picked:

- one parallel gather at a time per process (a lock). A thread that finds
  the lock taken runs the serial kernel instead of waiting: the other call
  already keeps every core busy. This also keeps numba's ``workqueue``
  layer, which aborts the process on concurrent entry, safe;
- in a process forked after the parent started numba's thread pool, the
  serial kernel only: GNU OpenMP kills such children and a forked workqueue
  pool can hang.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import threading
import weakref
from functools import lru_cache
from typing import Any

import numpy as np

from .. import validate
from . import background_compile, numpy_backend

NAME = "numba"

#: Below this many ids the serial kernel runs: waking the thread pool costs
#: microseconds (measured crossover: 8-16 ids in a tight loop, 32-64 with
#: 2 ms between calls; docs/backends.md).
PARALLEL_MIN_ROWS = 32
#: From this output size on, non-temporal stores win over cached stores, even
#: counting the caller's read of the output that cached stores leave in the
#: cache (bench/levers.py --stream-threshold: cached wins up to 1 MiB).
STREAM_MIN_OUT_BYTES = 2 * 2**20
#: The streaming kernel prefetches the row this many rows ahead, line by
#: line, as it copies this one (0: off). The next row (1) gained 8-18%; a
#: burst of a whole row ahead was within noise. 4 rows, with the page touch
#: below at 16, led 1 and 8 in 8 of 10 comparisons, by a median 2% of the
#: copy (docs/backends.md, "The levers, measured").
PREFETCH_ROWS_AHEAD = 4
#: ... and touches each 4 KiB page of the row this many rows ahead (0: off):
#: the touch was 0.3-5% faster than none in all five runs measured.
TOUCH_PAGES_ROWS_AHEAD = 16
#: ... and copies a row backward when its source sits 1 to this many bytes
#: below its destination modulo 4 KiB, where a forward copy's loads wait on
#: its own stores (4K aliasing). At 16 bytes below, forward reached 0.63-0.71
#: of the copy and backward 0.79-0.85; at distance 0, forward reached 0.86-0.88
#: (bench/levers.py --alias-offsets, docs/backends.md).
ALIAS_WINDOW = 32
#: Serve a batch serially while its parallel kernel compiles on a background
#: thread (see background_compile); False compiles in the caller's thread.
COMPILE_IN_BACKGROUND = True
#: Blocks of rows per thread in the parallel kernels (load balance).
BLOCKS_PER_THREAD = 4

_STREAMING_CPU = platform.machine().lower() in ("x86_64", "amd64")
_parallel_lock = threading.Lock()
_pool_started = False  # this process (or its parent before a fork) ran a parallel kernel
_kernels_module: Any = None


@lru_cache(maxsize=None)
def unavailable_reasons() -> list[str]:
    if importlib.util.find_spec("numba") is None:
        return ["numba is not installed (pip install numba)"]
    return []


def not_supported_reasons(table: Any, ids: Any, out: Any) -> list[str]:
    if not isinstance(table, np.ndarray):
        return [f"the table lives on {validate.device_of(table)}; the numba backend gathers host arrays"]
    return []


def kernels() -> Any:
    """The kernel module, imported (and numba with it) on first use."""
    global _kernels_module
    if _kernels_module is None:
        from ..kernels import gather_cpu

        _kernels_module = gather_cpu
    return _kernels_module


#: The word each row is copied in, by ``row_bytes % 8``: the widest dividing the row.
_WORD_FOR_REMAINDER = {0: np.dtype(np.uint64), 4: np.dtype(np.uint32), 2: np.dtype(np.uint16), 6: np.dtype(np.uint16)}
_BYTE = np.dtype(np.uint8)


def word_dtype(row_bytes: int) -> np.dtype:
    """The widest unsigned word (8, 4, 2 or 1 bytes) that divides the row size.

    Base addresses need not be aligned to it: a view of unaligned memory is
    flagged unaligned by numpy, and numba then compiles unaligned loads.
    """
    return _WORD_FOR_REMAINDER.get(row_bytes % 8, _BYTE)


def gather(table: np.ndarray, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    n = ids.size
    if n == 1:
        return _copy_one_row(table, ids, out)
    if out is None and n < PARALLEL_MIN_ROWS:
        return numpy_backend.take_new(table, ids)
    memo = _last_table  # one read: another thread may replace it
    if memo[0]() is not table or table.shape != memo[1]:
        memo = _remember(table)
    _, shape, table_words, word = memo
    one_dimensional = ids.ndim == 1
    parallel = n >= PARALLEL_MIN_ROWS and not _forked_after_pool_start
    if out is None:
        out = np.empty((n, shape[1]) if one_dimensional else ids.shape + shape[1:], table.dtype)
        if parallel and out.nbytes >= _FAULT_IN_MIN_BYTES:
            _fault_in(out)
    # Rows in words, as the kernels take them (views; a copy only for non-contiguous ids).
    if one_dimensional:
        flat_ids, out_words = ids, out.view(word)
    else:
        flat_ids, out_words = ids.reshape(-1), out.view(word).reshape(n, table_words.shape[1])
    if parallel:
        bad = _run_parallel(table_words, flat_ids, out_words)
    else:
        bad = (_kernels_module or kernels()).gather_serial(table_words, flat_ids, out_words)
    if bad >= 0:
        raise validate.out_of_range_error(ids, bad, table.shape[0])
    return out


def _fault_in(out: np.ndarray) -> None:
    """Write one byte per page of a new output, on this thread, before threads write it.

    Pages of a fresh allocation are mapped (and zeroed by the OS) on first
    write. When two threads took those faults at once, 3-15 of 121 allocating
    lookups of 64 and 512 MiB stalled (slower than twice numpy's median, the
    slowest 109-797 ms) on the development VM; faulted in on one thread first,
    0-2 did (bench/allocating.py --reps 121, docs/backends.md). numpy asks
    for transparent huge pages from 4 MiB on: one write per 2 MiB then maps
    a whole huge page.
    Smaller outputs are left alone (no stall was measured there).
    """
    flat = out.reshape(-1).view(np.uint8)
    stride = _HUGE_PAGE if flat.size >= _NUMPY_HUGE_PAGE_MIN and _numpy_advises_huge_pages() else _PAGE
    flat[::stride] = 0
    flat[-1:] = 0


_PAGE, _HUGE_PAGE, _NUMPY_HUGE_PAGE_MIN = 4096, 2 * 2**20, 4 * 2**20
_FAULT_IN_MIN_BYTES = _NUMPY_HUGE_PAGE_MIN


@lru_cache(maxsize=None)
def _numpy_advises_huge_pages() -> bool:
    """numpy's private switch for madvise(MADV_HUGEPAGE); False (4 KiB strides) when it cannot be read."""
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return bool(importlib.import_module(module)._get_madvise_hugepage())
        except (ImportError, AttributeError):
            continue
    return False


def _copy_one_row(table: np.ndarray, ids: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """One id is one contiguous row: a slice copy, a single memcpy.

    The compiled call's fixed cost (argument typing, word views) is larger
    than copying one row (docs/backends.md), and a decode step of one token
    is the most frequent lookup there is.
    """
    row = ids.item()
    if not 0 <= row < len(table):
        raise validate.out_of_range_error(ids, 0, len(table))
    source = np.asarray(table)[row : row + 1]  # np.asarray: np.memmap's slices copy slowly
    if out is None:
        copy = source.copy()
        return copy if ids.ndim == 1 else copy.reshape(ids.shape + copy.shape[1:])
    out[...] = source  # out has ids.shape + (dim,) with a single row: (1, dim) broadcasts
    return out


def _remember(table: np.ndarray) -> tuple[Any, tuple[int, ...], np.ndarray, np.dtype]:
    """Make (weak reference, shape, word view, word dtype) of `table` the remembered memo; return it.

    :func:`gather` reuses the memo while the same table comes back with the
    same shape: building the view costs about 0.45 us, 15% of a six-id
    lookup, and decode loops gather from one table over and over. The shape
    is part of the key because numpy lets a caller reassign ``table.shape``
    in place, and a stale view would then disagree with the output's row length.

    The view borrows the table's memory without referencing the table (an
    ordinary view would keep a dropped 1 GiB table alive until the next
    lookup of another table). It is used only while the weak reference
    returns the very table the caller passed, which keeps the memory alive;
    the weak reference also makes numpy refuse ``table.resize()``, the one
    way to move a live array's memory (short of ``refcheck=False``, which
    breaks every view).
    """
    global _last_table
    word = word_dtype(table.shape[1] * table.dtype.itemsize)
    # np.asarray drops np.memmap's subclass, whose view() and typing are slow.
    words = np.asarray(table).view(word)
    memo = (weakref.ref(table), table.shape, np.asarray(_BorrowedMemory(words.__array_interface__)), word)
    _last_table = memo  # one assignment, atomic
    return memo


class _BorrowedMemory:
    """Presents an array interface (address, shape, dtype, flags) to numpy, holding no reference to its owner."""

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface


def _no_table() -> None:
    return None


_last_table: tuple[Any, Any, Any, Any] = (_no_table, None, None, None)


def _run_parallel(table_words: np.ndarray, flat_ids: np.ndarray, out_words: np.ndarray) -> int:
    k = _kernels_module or kernels()
    stream = out_words.nbytes >= STREAM_MIN_OUT_BYTES and _STREAMING_CPU and k.can_stream(out_words)
    kernel = k.gather_parallel_stream if stream else k.gather_parallel
    options = (PREFETCH_ROWS_AHEAD, TOUCH_PAGES_ROWS_AHEAD, ALIAS_WINDOW) if stream else ()
    key = (kernel, table_words.dtype, flat_ids.dtype)
    if COMPILE_IN_BACKGROUND and not background_compile.is_ready(key):
        # Empty slices have the real arguments' types: the compile specialises for them.
        # The compile call gathers no row, so it never reads through table_words
        # (a borrowed view: it does not keep the table alive, see _remember).
        no_ids, no_rows = flat_ids[:0], out_words[:0]
        k.gather_serial(table_words, no_ids, no_rows)  # the serial kernel compiles first, here
        background_compile.start(key, lambda: _first_parallel_call(kernel, table_words, no_ids, no_rows, options))
        return k.gather_serial(table_words, flat_ids, out_words)
    if not _parallel_lock.acquire(blocking=False):
        return k.gather_serial(table_words, flat_ids, out_words)
    try:
        _note_pool_started()
        n_blocks = max(1, min(len(flat_ids), _blocks_per_call()))
        return kernel(table_words, flat_ids, out_words, n_blocks, *options)
    finally:
        _parallel_lock.release()


def _first_parallel_call(
    kernel: Any, table_words: np.ndarray, no_ids: np.ndarray, no_rows: np.ndarray, options: tuple
) -> None:
    """Compile `kernel` for these argument types with a call that copies nothing, and start the pool."""
    with _parallel_lock:
        _note_pool_started()
        kernel(table_words, no_ids, no_rows, 1, *options)


@lru_cache(maxsize=None)
def _blocks_per_call() -> int:
    """BLOCKS_PER_THREAD for each thread of numba's pool, read once.

    numba.get_num_threads() costs 1-2 us a call (a 64-id lookup takes about
    40); a caller's numba.set_num_threads() still decides how many threads
    share the blocks.
    """
    import numba

    return max(1, numba.config.NUMBA_NUM_THREADS) * BLOCKS_PER_THREAD


def thread_count() -> int:
    import numba

    return numba.get_num_threads()


def _note_pool_started() -> None:
    global _pool_started
    _pool_started = True


def _after_fork_in_child() -> None:
    global _forked_after_pool_start
    _forked_after_pool_start = _pool_started


#: True in a process forked after its parent started numba's thread pool.
_forked_after_pool_start = False
if hasattr(os, "register_at_fork"):  # POSIX; a flag set at fork, not a getpid() per call
    os.register_at_fork(after_in_child=_after_fork_in_child)


def describe() -> dict[str, Any]:
    if unavailable_reasons():
        return {}
    import numba

    return {
        "numba": numba.__version__,
        "threads": numba.get_num_threads(),
        "threading_layer": kernels_threading_layer(),
        "parallel_min_rows": PARALLEL_MIN_ROWS,
        "stream_min_out_bytes": STREAM_MIN_OUT_BYTES,
        "streaming_stores": _STREAMING_CPU,
    }


def kernels_threading_layer() -> str:
    import numba

    try:
        return numba.threading_layer()
    except ValueError:
        return f"not started yet (configured: {numba.config.THREADING_LAYER})"
