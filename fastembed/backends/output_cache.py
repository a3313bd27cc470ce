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
  the cache; it is handed out again only once a view of it that the lease
  alone holds is gone too, so a buffer is never handed out while anything
  can still reach it (not even a lease that a ``__del__`` method brings
  back to life during a garbage collection, after its finalizer ran);
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

import math
import os
import threading
import weakref
from typing import Any

import numpy as np

from .. import validate
from ..arrays.numpy_adapter import data_address
from . import interrupts

#: Outputs smaller than this come from numpy's allocator (glibc keeps them in its heap).
MIN_BYTES = 4 * 2**20
#: Buffers are sized in whole huge pages, so that slightly different batch sizes share them.
GRANULE = 2 * 2**20
#: Every cached buffer starts at a multiple of this many bytes (a cache line; what JAX needs to share a result).
ALIGNMENT = 64
ENVIRONMENT_VARIABLE = "FASTEMBED_OUTPUT_CACHE_BYTES"
#: The largest limit, from the setting or :func:`set_limit`: no memory holds more.
MAX_LIMIT = 2**64

_lock = threading.RLock()  # re-entrant: a finalizer may run while this thread holds it
# Free buffers (uint8, each faulted in) by id, the oldest returned first, each with a weak reference to the view
# its last lease held. A finalizer or a signal handler may run on a thread in the middle of the cache's code (the
# lock is re-entrant), and an exception may strike between any two steps; so every change is one dict operation,
# on a buffer a local name holds (its id stays its own), and no count or flag is kept beside it that such an
# interruption could leave half-updated.
_free: dict[int, tuple[np.ndarray, weakref.ref]] = {}


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
    digits = text.strip()
    shown = text if len(text) <= 40 else text[:40] + "..."
    if digits[:1] in ("-", "+") and digits[1:].isascii() and digits[1:].isdigit():
        negative = digits[0] == "-" and digits[1:].strip("0")
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={shown!r} is " + ("negative" if negative else
                         "signed: give the bytes as decimal digits alone"))
    if not (digits.isascii() and digits.isdigit()):  # int() would take "1_0" and "٥"
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={shown!r} is not a whole number of bytes (decimal digits)")
    significant = digits.lstrip("0") or "0"
    # Counted before int(), whose time grows with the square of the digits.
    if len(significant) > len(str(MAX_LIMIT)) or int(significant) > MAX_LIMIT:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={shown!r} is above 2**64 bytes (no memory holds more)")
    return int(significant)


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
        TypeError: not an integer.
        ValueError: a negative size, or one above 2**64 (no memory holds more).
    """
    global _limit
    limit = validate.checked_integer(nbytes, "the output cache limit is a number of bytes from 0 to 2**64", 0, MAX_LIMIT)
    with _lock:
        _limit = limit
        _trim(_limit)


def cached_bytes() -> int:
    """Bytes of free buffers held now."""
    return sum(buffer.size for buffer, _ in list(_free.values()))


def describe() -> str:
    """What the cache holds and may hold, or why its setting is refused, in one line (``python -m fastembed info``)."""
    try:
        most = limit()
    except ValueError as error:
        return (f"ERROR: {error}; large allocating lookups that take their output from the cache (those the numba "
                "backend serves, and those on a JAX table) raise until it is fixed")
    return (f"{cached_bytes() / 2**20:.0f} MiB of outputs kept for reuse, limit {most / 2**20:.0f} MiB "
            f"({ENVIRONMENT_VARIABLE}; fastembed.empty_cache())")


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
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or limit() == 0:
        out = aligned_empty(shape, dtype, alignment) if alignment else np.empty(shape, dtype)
        if nbytes >= MIN_BYTES:
            fault_in(out)
        return out
    buffer = _take(nbytes)
    lease = _Lease(buffer)
    # Not at exit: weakref runs pending finalizers then, and would free buffers that live results still use.
    weakref.finalize(lease, _give_back, buffer, weakref.ref(lease._view)).atexit = False
    return np.asarray(lease)[:nbytes].view(dtype).reshape(shape)


class _Lease:
    """Exposes a buffer to numpy: arrays made from it keep it (their base) alive."""

    __slots__ = ("__array_interface__", "__weakref__", "_view")

    def __reduce__(self) -> Any:
        # A copy or a pickle would carry the buffer's address without keeping the buffer leased.
        raise TypeError("an output cache lease cannot be copied or pickled; copy or pickle the array instead")

    def __init__(self, buffer: np.ndarray) -> None:
        # Kept out of the public interface: an array made from the buffer itself would hold it without the lease.
        # A view that only the lease holds: its weak reference dies when the lease is freed, and not when a garbage
        # collection runs the lease's finalizer (a numpy array is not in the collector's cycles, so its weak
        # references are never cleared by it).
        self._view = buffer[:]
        self.__array_interface__ = {
            "shape": buffer.shape, "typestr": "|u1", "data": (data_address(buffer), False), "version": 3,
        }


def _take(nbytes: int) -> np.ndarray:
    """The smallest free buffer of at least `nbytes` and at most twice that, or a new one faulted in."""
    with _lock:
        fitting = [entry for entry in list(_free.values()) if nbytes <= entry[0].size <= 2 * nbytes]
        for best, view in sorted(fitting, key=lambda entry: entry[0].size):
            # Else a finalizer's trim on this thread took it meanwhile; a view still alive means its lease lives on
            # (brought back to life after its finalizer ran), and the buffer is left to it.
            if _free.pop(id(best), None) is not None and view() is None:
                return best
    size = -(-nbytes // GRANULE) * GRANULE
    buffer = aligned_empty((size,), np.dtype(np.uint8), ALIGNMENT)
    fault_in(buffer)
    return buffer


def _give_back(buffer: np.ndarray, view: weakref.ref) -> None:
    """Finalizer of a lease: keep its buffer, freeing the buffers that came back before it, oldest first, to stay
    within the limit (a buffer larger than the limit is freed itself).

    Room is made before the buffer is kept, so an interruption leaves the cache within its limit; a Ctrl-C
    caught here is raised again (:func:`~fastembed.backends.interrupts.interrupt_again`), since Python only prints an exception that leaves a
    finalizer.
    """
    try:
        with _lock:
            keep = _limit or 0
            if buffer.size > keep:
                return
            total = cached_bytes() + buffer.size
            for older, _ in list(_free.values()):  # oldest first
                if total <= keep:
                    break
                if _free.pop(id(older), None) is not None:
                    total -= older.size
            if total <= keep:
                _free[id(buffer)] = (buffer, view)
    except KeyboardInterrupt:
        interrupts.interrupt_again()


def _trim(keep: int) -> None:
    """Free buffers, largest first, until at most `keep` bytes stay (with the lock held)."""
    total = cached_bytes()
    for buffer, _ in sorted(list(_free.values()), key=lambda entry: entry[0].size, reverse=True):
        if total <= keep:
            break
        if _free.pop(id(buffer), None) is not None:
            total -= buffer.size


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int) -> np.ndarray:
    """An uninitialised C-contiguous array whose data address is a multiple of `alignment` bytes."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -data_address(raw) % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _after_fork_in_child() -> None:
    """A fork copies the lock as it was: held, if another thread held it then, by a thread the child lacks."""
    global _lock
    _lock = threading.RLock()
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
