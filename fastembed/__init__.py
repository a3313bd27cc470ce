"""fastembed: the embedding lookup of a language model, at memory-copy speed.

``lookup(table, ids)`` returns ``table[ids]`` through the fastest backend that
can serve it (CUDA for a cupy table, Numba on the CPU, NumPy always).
Importing this package imports numpy only; numba and cupy load on first use.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# Every module the functions below use is imported here: a __del__ run by the final garbage collection may call
# them, when Python refuses imports, even of modules already loaded.
from . import arrays, dispatch, validate
from .api import Embedding, lookup
from .backends import background_compile, output_cache
from .backends.cuda_backend import deferred_id_checks, raise_deferred_id_errors
from .dispatch import BackendStatus, BackendUnavailableError, Selection, backend_statuses

__version__ = "0.1.0"

__all__ = [
    "lookup",
    "Embedding",
    "backend_statuses",
    "select_backend",
    "BackendStatus",
    "BackendUnavailableError",
    "Selection",
    "deferred_id_checks",
    "raise_deferred_id_errors",
    "wait_for_compiles",
    "empty_cache",
    "set_output_cache_limit",
    "__version__",
]


def select_backend(table: Any, ids: Any, out: Any = None, backend: str = "auto", dtype: Any = None) -> Selection:
    """Which backend ``lookup(table, ids, out=out, dtype=dtype, backend=backend)`` would use, and why the others were skipped.

    Validates like :func:`lookup` (same exceptions) but gathers nothing;
    the ids of a GPU table are left to the lookup, which checks them on the
    device (or defers the check, see :func:`deferred_id_checks`).

    Args:
        table, ids, out, backend, dtype: as for :func:`lookup`.

    Returns:
        A :class:`Selection`: the backend's name, and for each other backend why it was skipped.

    Raises:
        TypeError, ValueError, IndexError: as :func:`lookup` for bad arguments
            (ValueError also for an unknown backend name).
        BackendUnavailableError: a named backend cannot serve the call.

    Example:
        >>> import numpy as np, fastembed
        >>> fastembed.select_backend(np.zeros((4, 3), np.float32), [1], backend="numpy").backend
        'numpy'
    """
    table_view = validate.table_snapshot(table)
    rows = validate.storage(table)
    with arrays.call_context(rows):  # as lookup: ids on a GPU are converted on the table's device
        ids_view = validate.ids_snapshot(ids, table_view)
        target = validate.output_dtype(table_view, dtype, rows)
        if out is not None:
            validate.out_snapshot(out, ids_view, table_view, table, ids, target)
    selection = dispatch.explain(table_view, backend)
    if isinstance(validate.storage(table_view), np.ndarray):  # a host lookup checks int32/int64 ids as it gathers
        validate.check_ids_in_range(ids_view, int(table_view.shape[0]))
    return selection


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Block until every kernel compiling in the background is ready, or `timeout` seconds have passed.

    No lookup compiles on the caller's thread: a call whose kernels are
    not compiled yet is served by numpy while they compile on a background
    thread. Dense gathers below 256 KiB of output (2 MiB for rows narrower
    than 1 KiB) never need them (quantized lookups do, at any size), so a server that
    wants full speed from its first large request makes one lookup of at
    least that size at start-up (and one quantized lookup per format and
    output dtype it uses), then calls this.

    Args:
        timeout: the most seconds to wait (None: until done).

    Returns:
        True when no compile is running any more (each finished or failed:
        ``python -m fastembed info`` lists failures under
        ``compile_failures``); False when the timeout came first (the
        compiles go on, and calls stay served meanwhile).

    Raises:
        TypeError: `timeout` is not a real number (an int, a float, a Fraction; a Decimal is none).
        ValueError: `timeout` is negative or NaN.

    Example:
        >>> import fastembed
        >>> fastembed.wait_for_compiles(timeout=60)
        True
    """
    if timeout is not None:
        timeout = validate.checked_seconds(timeout, "timeout must be None or a number of seconds >= 0", 0, float("inf"))
    return background_compile.wait(timeout)


def empty_cache() -> None:
    """Free the output buffers kept for reuse by allocating lookups (outputs in use are untouched).

    Large allocating lookups on the host (4 MiB of output or more, without
    ``out=``: those the numba backend serves, except dense ones with
    ``dtype=``, and those on a JAX table) take their output from a bounded cache of buffers whose
    pages are already mapped; an output goes back to the cache when the
    last array or view over it is gone. The cache keeps that memory between lookups;
    call this to hand it back to the OS (after a burst of large batches, for
    instance). Later lookups refill the cache as they need it. See
    docs/backends.md; ``python -m fastembed info`` shows what it holds.

    Example:
        >>> import fastembed
        >>> fastembed.empty_cache()
    """
    output_cache.empty()


def set_output_cache_limit(nbytes: int) -> None:
    """Keep at most `nbytes` of free output buffers for reuse (0: none); the excess is freed now.

    The default is a sixteenth of the machine's memory, at most 2 GiB, or
    FASTEMBED_OUTPUT_CACHE_BYTES when set (read at the first allocating
    lookup of 4 MiB or more that the numba backend is asked to serve, other
    than a dense one with ``dtype=``, or on a JAX table whatever the backend;
    a call to this function takes precedence).

    Args:
        nbytes: bytes of free buffers to keep, an integer >= 0.

    Raises:
        TypeError: not an integer.
        ValueError: a negative size, or one above 2**64 (no memory holds more).

    Example:
        >>> import fastembed
        >>> fastembed.set_output_cache_limit(1 << 30)
    """
    output_cache.set_limit(nbytes)
