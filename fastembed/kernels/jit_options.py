"""The options every CPU kernel is compiled with, in one place.

Compiled kernels are cached on disk where numba finds a place to write
them (beside the package, under ``NUMBA_CACHE_DIR``, or in the user's
cache folder). Where it finds none (a read-only install in a container
whose user has no writable home), numba refuses to define a kernel that
asks for caching, so the kernels are then compiled in every process
instead: slower to start, as fast once compiled.
"""
from __future__ import annotations

from typing import Any

from numba import njit


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
