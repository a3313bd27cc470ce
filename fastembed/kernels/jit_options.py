"""The options every CPU kernel is compiled with, in one place.

Compiled kernels are cached on disk where numba finds a place to write
them (beside the package, under ``NUMBA_CACHE_DIR``, or in the user's
cache folder). Where it finds none (a read-only install in a container
whose user has no writable home), numba refuses to define a kernel that
asks for caching, so the kernels are then compiled in every process
instead: slower to start, as fast once compiled. Where a write to the
cache fails (a full disk, a folder made read-only), the kernels compiled
are kept in memory and the cache is turned off for the rest of the
process (:func:`stop_caching`).
"""
from __future__ import annotations

import sys
from typing import Any

from numba import njit
from numba.core.dispatcher import Dispatcher


def _can_cache() -> bool:
    """Whether numba finds a place to cache kernels defined in this folder (it looks beside their source first)."""

    def probe() -> int:
        return 0

    try:
        njit(cache=True)(probe)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return False
    return True


#: Whether compiled kernels are cached on disk (``python -m fastembed info`` shows it).
CACHED = _can_cache()
#: numba.njit's options for every kernel.
JIT: dict[str, Any] = dict(cache=CACHED, nogil=True, boundscheck=False)
#: Why the cache was turned off in this process after a write to it failed; None while it was not.
WRITE_FAILURE: str | None = None


def is_a_cache_write_failure(error: BaseException) -> bool:
    """Whether `error` is an OSError that numba's cache raised while saving a compiled kernel."""
    if not isinstance(error, OSError):
        return False
    frame = error.__traceback__
    while frame is not None:
        code = frame.tb_frame.f_code
        if code.co_name in ("save_overload", "_save_overload") and "caching" in code.co_filename:
            return True
        frame = frame.tb_next
    return False


def stop_caching(error: BaseException) -> None:
    """Turn the on-disk cache off for fastembed's kernels in this process, those defined later included.

    numba adds a compiled kernel to the dispatcher before it saves it, so what compiled stays usable.
    """
    global CACHED, WRITE_FAILURE
    CACHED, WRITE_FAILURE = False, f"{type(error).__name__}: {error}"
    JIT["cache"] = False
    for name, module in list(sys.modules.items()):
        if name.startswith("fastembed.") and module is not None:
            for value in list(vars(module).values()):
                cache = getattr(value, "_cache", None) if isinstance(value, Dispatcher) else None
                if cache is not None:  # numba has no public switch on a dispatcher; its cache has one
                    cache.disable()
