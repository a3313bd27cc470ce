"""Host outputs of allocating lookups: a bounded cache of memory whose pages are already mapped.

An allocating lookup of thousands of rows returns a fresh output of tens to
hundreds of MiB. The OS maps and zeroes each page of such a block on its
first write, and glibc hands blocks this large back to the OS when they are
freed, so every call pays for the page faults again. An output of at least
:data:`MIN_BYTES` is therefore carved from a buffer kept here instead:

- the result is a numpy array whose base is a *lease* on a buffer; every
  view, slice, reshaped array, memoryview or tensor made from the result
  keeps that lease alive through numpy's base chain;
- when the last of them goes, the lease's finalizer returns the buffer to
  the cache, so a buffer is never handed out while anything can still
  reach it;
- at most :func:`limit` bytes of free buffers are kept (the setting
  ``FASTEMBED_OUTPUT_CACHE_BYTES``, read at the first large lookup or by
  ``python -m fastembed info``, or :func:`set_limit`; 0 turns the cache
  off); a returning buffer makes room by freeing the buffers that came back
  before it, oldest first (one larger than the limit is freed itself), so
  the cache follows the sizes in use rather than the largest ever seen;
  :func:`empty` releases every free buffer (``fastembed.empty_cache()``);
- a result still alive when the interpreter exits keeps its buffer: the
  exit does not return it (atexit handlers and daemon threads still run
  then, and may look up more rows).

Buffers in use are the caller's outputs and are not counted. The default
limit is a sixteenth of the machine's memory, at most 2 GiB: room for the
output of a 65,536-id float16 lookup of a 4,096-wide table (512 MiB) and a
few smaller ones.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import numpy as np

#: Outputs smaller than this come from numpy's allocator (glibc keeps them in its heap).
MIN_BYTES = 4 * 2**20
#: Buffers are sized in whole huge pages, so that slightly different batch sizes share them.
GRANULE = 2 * 2**20
#: Every cached buffer starts at a multiple of this many bytes (a cache line; what JAX needs to share a result).
ALIGNMENT = 64
ENVIRONMENT_VARIABLE = "FASTEMBED_OUTPUT_CACHE_BYTES"

_lock = threading.RLock()  # re-entrant: a finalizer may run while this thread holds it
_free: list[np.ndarray] = []  # free buffers (uint8), each faulted in
_free_bytes = 0


def _default_limit() -> int:
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        physical = 16 * 2**30
    return min(2 * 2**30, physical // 16)


def _read_limit() -> int:
    text = os.environ.get(ENVIRONMENT_VARIABLE)
    if text is None or not text.strip():
        return _default_limit()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={text!r} is not a whole number of bytes") from None
    if value < 0:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={text!r} is negative")
    return value


_limit: int | None = None  # read from the environment on first use


def limit() -> int:
    """The most bytes of free buffers kept.

    Raises:
        ValueError: FASTEMBED_OUTPUT_CACHE_BYTES is set to something other than a byte count. Until the
            setting is fixed or :func:`set_limit` is called, every allocating lookup of at least
            :data:`MIN_BYTES` that the numba backend is asked to serve raises it (also while numpy
            serves for it during a compile), and so does every one on a JAX table, whatever the
            backend. Other lookups with ``backend="numpy"`` do not read the setting.
    """
    global _limit
    value = _limit
    if value is None:
        with _lock:  # a set_limit() meanwhile takes precedence over the setting read here
            if _limit is None:
                _limit = _read_limit()
            value = _limit
    return value


def set_limit(nbytes: int) -> None:
    """Keep at most `nbytes` of free buffers (0 turns the cache off); frees the excess now.

    Raises:
        ValueError: a negative or non-integer size.
    """
    global _limit
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"the output cache limit is a number of bytes >= 0, got {nbytes!r}")
    with _lock:
        _limit = int(nbytes)
        _trim(_limit)


def cached_bytes() -> int:
    """Bytes of free buffers held now."""
    return _free_bytes


def empty() -> None:
    """Free every buffer the cache holds (outputs still in use are not touched)."""
    with _lock:
        _trim(0)


def new_output(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 0) -> np.ndarray:
    """An uninitialised C-contiguous array of `shape` and `dtype`, its pages mapped.

    From the cache for outputs of at least :data:`MIN_BYTES` (while the limit
    allows any; its buffers start at a multiple of :data:`ALIGNMENT` bytes),
    else from numpy, at a multiple of `alignment` bytes when that is not 0
    (at most :data:`ALIGNMENT`). Contents are whatever the buffer held: the
    caller overwrites every element.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < MIN_BYTES or limit() == 0:
        out = _aligned_empty(shape, dtype, alignment) if alignment else np.empty(shape, dtype)
        if nbytes >= MIN_BYTES:
            fault_in(out)
        return out
    buffer = _take(nbytes)
    lease = _Lease(buffer)
    # Not at exit: weakref runs pending finalizers then, and would free buffers that live results still use.
    weakref.finalize(lease, _give_back, buffer).atexit = False
    return np.asarray(lease)[:nbytes].view(dtype).reshape(shape)


class _Lease:
    """Exposes a buffer to numpy: arrays made from it keep it (their base) alive."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __reduce__(self) -> Any:
        # A copy or a pickle would carry the buffer's address without keeping the buffer leased.
        raise TypeError("an output cache lease cannot be copied or pickled; copy or pickle the array instead")

    def __init__(self, buffer: np.ndarray) -> None:
        self.__array_interface__ = {
            "shape": buffer.shape, "typestr": "|u1", "data": (buffer.ctypes.data, False), "version": 3,
            "buffer_owner": buffer,  # not read by numpy: keeps the buffer alive as long as the lease
        }


def _take(nbytes: int) -> np.ndarray:
    """The smallest free buffer of at least `nbytes` and at most twice that, or a new one faulted in."""
    global _free_bytes
    with _lock:
        if not _depth:  # else a signal handler's lookup interrupted this thread inside the cache: a new buffer
            _enter()
            try:
                fitting = [i for i, b in enumerate(_free) if nbytes <= b.size <= 2 * nbytes]
                if fitting:
                    best = min(fitting, key=lambda i: _free[i].size)
                    buffer = _free.pop(best)
                    _free_bytes -= buffer.size
                    return buffer
            finally:
                _leave()
    size = -(-nbytes // GRANULE) * GRANULE
    buffer = _aligned_empty((size,), np.dtype(np.uint8), ALIGNMENT)
    fault_in(buffer)
    return buffer


def _give_back(buffer: np.ndarray) -> None:
    """Finalizer of a lease: keep its buffer (see :func:`_keep`), or later, when this thread is inside the cache's code."""
    with _lock:
        if _depth:  # a garbage collection in the middle of this thread's _take or _trim ran this finalizer
            _returned_meanwhile.append(buffer)
            return
        _enter()
        try:
            _keep(buffer)
        finally:
            _leave()


def _keep(buffer: np.ndarray) -> None:
    """Keep `buffer`, freeing the oldest free buffers to stay within the limit (with the lock held)."""
    global _free_bytes
    keep = _limit or 0
    if buffer.size > keep:
        return
    while _free_bytes + buffer.size > keep:
        _free_bytes -= _free.pop(0).size  # returned first, so least recently used
    _free.append(buffer)
    _free_bytes += buffer.size


def _trim(keep: int) -> None:
    """Free buffers, largest first, until at most `keep` bytes stay (with the lock held)."""
    global _free_bytes
    if _depth:
        return  # a signal handler interrupted this thread inside the cache: the lists stay as they are; _keep trims later
    while _free and _free_bytes > keep:  # again when buffers came back meanwhile (kept on the way out)
        _enter()
        try:
            while _free and _free_bytes > keep:
                largest = max(range(len(_free)), key=lambda i: _free[i].size)
                _free_bytes -= _free.pop(largest).size
        finally:
            _leave()


# Any allocation can start a garbage collection, which may run a lease's finalizer on this very thread while it
# is inside _take or _trim (the lock is re-entrant): the finalizer then leaves its buffer here, and the outermost
# of those calls keeps it on the way out, so no list of buffers changes under a loop reading it. A signal handler's
# lookup there takes a new buffer, and its empty_cache() frees nothing, for the same reason.
_depth = 0  # how many of the cache's calls the thread holding the lock is inside
_returned_meanwhile: list[np.ndarray] = []


def _enter() -> None:
    """This thread (holding the lock) enters the cache's code: finalizers run meanwhile leave their buffers for later."""
    global _depth
    _depth += 1


def _leave() -> None:
    """This thread leaves the cache's code: on leaving the outermost call, keep the buffers left meanwhile."""
    global _depth
    _depth -= 1
    while not _depth and _returned_meanwhile:
        buffer = _returned_meanwhile.pop()
        _depth += 1
        try:
            _keep(buffer)
        finally:
            _depth -= 1


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int) -> np.ndarray:
    """An uninitialised C-contiguous array whose data address is a multiple of `alignment` bytes."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _after_fork_in_child() -> None:
    """A fork copies the lock as it was: held, if another thread held it then, by a thread the child lacks."""
    global _lock, _free_bytes, _depth
    _lock = threading.RLock()
    _depth = 0
    _free.extend(_returned_meanwhile)  # left by that thread's finalizers: buffers no result uses any more
    _returned_meanwhile.clear()
    _free_bytes = sum(buffer.size for buffer in _free)  # that thread may have been between its two updates
    if _limit is not None:
        _trim(_limit)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def fault_in(out: Any) -> None:
    """Write one byte per page of a new array, on this thread, before kernel threads write it.

    Pages of a fresh allocation are mapped (and zeroed by the OS) on first
    write; when several threads take those faults at once, some lookups
    stall for far longer than the copy (docs/backends.md).
    """
    flat = out.reshape(-1).view(np.uint8)
    flat[::_PAGE] = 0
    flat[-1:] = 0


_PAGE = 4096
