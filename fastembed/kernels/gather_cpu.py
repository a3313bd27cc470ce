"""The compiled CPU gather kernels (Numba).

Importing this module imports numba; only the numba backend does so, lazily.
Kernels never validate their inputs beyond the per-id bounds check, and they
never import the dispatcher.

Contract shared by every gather kernel here:
- ``table`` is the table viewed as its bytes, shape ``(vocab_size,
  row_bytes)``; Numba has no float16 on the CPU, and the kernels copy the
  rows' bytes, bit-exact for every dtype;
- ``ids`` is 1-D int32 or int64;
- ``out`` is bytes of shape ``(ids.size, row_bytes)`` (:func:`place_rows`:
  any number of rows, which ``positions`` choose);
- ``table`` and ``out`` are C-contiguous: rows are copied by address, a row
  ``row_bytes`` bytes after the one before;
- no row is copied before every id is known to lie in ``[0, vocab_size)``,
  so the caller's ``out`` survives a bad id untouched: :func:`gather_serial`
  scans the ids itself and returns -1 on success, else the position of the
  first bad id; the row loops (:func:`copy_rows`, :func:`stream_rows`,
  :func:`place_rows`), which run one block of rows each, leave that scan
  to their caller (:func:`first_bad_position`) and return the count of
  rows they skipped;
- every row is checked again as it is copied, so ids that another thread
  changes after the scan are never read out of bounds: such a row is
  skipped (:func:`gather_serial` then returns -2).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..arrays.numpy_adapter import data_address
from .cpu_intrinsics import copy_bytes, prefetch, store_fence, stream_store_16
from .jit_options import JIT as _JIT


@njit(**_JIT)
def first_bad_position(ids, vocab_size):
    """Position of the first id outside [0, vocab_size), or -1."""
    for i in range(ids.size):
        row = ids[i]
        if row < 0 or row >= vocab_size:
            return i
    return -1


# The row loops serve the serial kernel and, one block of rows per call, the
# parallel gathers of the numba backend, which run them on several threads
# (they release the GIL): a call costs nothing next to a block's copy.


CHANGED_DURING_COPY = -2


@njit(**_JIT)
def copy_rows(table, ids, out, start, stop, touch_pages_rows_ahead):
    """out[i] = table[ids[i]] for i in [start, stop), with ordinary stores; returns the rows skipped as out of range.

    Each row is one call of the C library's ``memcpy`` (:func:`copy_bytes`),
    which picks the copy for the CPU and the row's size. With
    ``touch_pages_rows_ahead`` > 0, the pages of the first rows that many
    are touched first, then each row starts with those of the row that many
    ahead (:func:`stream_rows` touches only the latter): the page
    translations of random rows are under way before their copies need them.
    """
    vocab_size = table.shape[0]
    row_bytes = table.shape[1] * table.itemsize
    table_address = table.ctypes.data
    out_address = out.ctypes.data
    skipped = 0
    if touch_pages_rows_ahead > 0:
        for i in range(start, min(start + touch_pages_rows_ahead, stop)):
            touch_row_pages(table_address, row_bytes, ids[i])
    for i in range(start, stop):
        if touch_pages_rows_ahead > 0:
            touch_row_pages(table_address, row_bytes, ids[min(i + touch_pages_rows_ahead, stop - 1)])
        row = ids[i]
        if row < 0 or row >= vocab_size:
            skipped += 1
            continue
        copy_bytes(out_address + np.uintp(i) * row_bytes, table_address + np.uintp(row) * row_bytes, row_bytes)
    return skipped


@njit(**_JIT)
def touch_pages(address, row_bytes):
    """One prefetch per 4 KiB page of the row at `address` (a hint: an address outside the table is never read)."""
    for page in range(0, row_bytes, 4096):
        prefetch(address + page)


@njit(**_JIT)
def stream_rows(table, ids, out, start, stop, prefetch_rows_ahead, touch_pages_rows_ahead, alias_window):
    """As :func:`copy_rows`, with non-temporal stores, for outputs of the backend's ``STREAM_MIN_OUT_BYTES`` or more.

    Non-temporal 16-byte stores fault on unaligned addresses: ``out`` must
    be 16-byte aligned and its rows a multiple of 16 bytes (:func:`can_stream`).

    With ``prefetch_rows_ahead`` > 0, each cache line copied comes with a
    prefetch of the same line of the row that many rows ahead: later rows
    are in flight while this one is copied, which the hardware prefetcher
    (it follows one address stream and stops at page boundaries) cannot
    guess from random ids.

    With ``touch_pages_rows_ahead`` > 0, each row also starts with one
    prefetch per 4 KiB page of the row that many rows ahead: random rows
    each need new page translations, and rows drawn from a narrower address
    range gather faster (docs/backends.md), so these are started early.

    ``alias_window``: see :func:`copies_backward`.

    Returns the rows skipped as out of range. Prefetches of a row ahead are
    hints: an out-of-range address there is never read.
    """
    row_bytes = table.shape[1] * table.itemsize
    vocab_size = table.shape[0]
    table_address = table.ctypes.data
    out_address = out.ctypes.data
    skipped = 0
    for i in range(start, stop):
        if touch_pages_rows_ahead > 0:
            touch_row_pages(table_address, row_bytes, ids[min(i + touch_pages_rows_ahead, stop - 1)])
        row = ids[i]
        if row < 0 or row >= vocab_size:
            skipped += 1
            continue
        ahead = ids[min(i + prefetch_rows_ahead, stop - 1)]
        stream_row(out_address + np.uintp(i) * row_bytes, table_address + np.uintp(row) * row_bytes, row_bytes,
                   prefetch_rows_ahead > 0, table_address + np.uintp(ahead) * row_bytes, alias_window)
    store_fence()
    return skipped


@njit(**_JIT)
def touch_row_pages(table_address, row_bytes, row):
    """One prefetch per 4 KiB page of the table's row `row` (a hint: a row outside the table is never read).

    The row loops pass the row's id, never the ids array: numba may count
    the references of an array passed to a function, atomic instructions
    that would come with every row.
    """
    touch_pages(table_address + np.uintp(row) * row_bytes, row_bytes)


@njit(**_JIT)
def place_rows(table, ids, out, positions, start, stop, stream, prefetch_rows_ahead, touch_pages_rows_ahead,
               alias_window):
    """out[positions[i]] = table[ids[i]] for i in [start, stop): rows gathered into chosen rows of `out`.

    The other rows of `out` are not written. With ``touch_pages_rows_ahead``
    > 0, pages are touched ahead as in :func:`stream_rows`; with `stream` (:func:`can_stream` must allow it),
    non-temporal stores that prefetch as it does, else ordinary stores.
    Returns the rows skipped because their id or position was out of range
    (nothing is read or written for them).
    """
    row_bytes = table.shape[1] * table.itemsize
    vocab_size = table.shape[0]
    out_rows = out.shape[0]
    table_address = table.ctypes.data
    out_address = out.ctypes.data
    skipped = 0
    for i in range(start, stop):
        if touch_pages_rows_ahead > 0:
            touch_row_pages(table_address, row_bytes, ids[min(i + touch_pages_rows_ahead, stop - 1)])
        row = ids[i]
        position = positions[i]
        if row < 0 or row >= vocab_size or position < 0 or position >= out_rows:
            skipped += 1
            continue
        if stream:
            ahead = ids[min(i + prefetch_rows_ahead, stop - 1)]
            stream_row(out_address + np.uintp(position) * row_bytes, table_address + np.uintp(row) * row_bytes,
                       row_bytes, prefetch_rows_ahead > 0, table_address + np.uintp(ahead) * row_bytes, alias_window)
        else:
            copy_bytes(out_address + np.uintp(position) * row_bytes, table_address + np.uintp(row) * row_bytes,
                       row_bytes)
    if stream:
        store_fence()
    return skipped


@njit(**_JIT)
def copies_backward(destination, source, alias_window):
    """Whether a row from `source` to `destination` is copied backward (4K aliasing).

    A load is checked against the stores still in flight by the low 12 bits
    of the addresses, and one that seems to match waits for them. Copying
    forward, each load comes right after the stores just below its offset,
    so a source that sits 1 to ``alias_window`` bytes below the destination,
    modulo 4 KiB, makes nearly every load wait. Those rows are copied
    backward, where loads follow stores above them. 0 copies every row
    forward, 4096 every row backward.
    """
    return (source - destination) & 4095 >= 4096 - alias_window


@njit(**_JIT)
def stream_row(destination, source, row_bytes, prefetch_ahead, ahead, alias_window):
    """Copy one row (addresses as integers) with non-temporal stores, in the direction :func:`copies_backward` picks.

    With `prefetch_ahead`, each cache line copied comes with a prefetch of the
    same line at address `ahead`.
    """
    if copies_backward(destination, source, alias_window):
        _stream_row_backward(destination, source, row_bytes, prefetch_ahead, ahead)
    else:
        _stream_row_forward(destination, source, row_bytes, prefetch_ahead, ahead)


@njit(**_JIT)
def _line_start(destination, row_bytes):
    """Bytes of a row at `destination` before the destination's next 64-byte cache line (a multiple of 16 there).

    A row whose destination starts inside a line (a numpy array's data
    starts 16 bytes into a page) is cut at the destination's line
    boundaries, not at its own, so that the prefetch before each group of
    four 16-byte stores never falls between the stores of one line.
    """
    return min((-destination) & 63, row_bytes)


@njit(**_JIT)
def _stream_row_forward(destination, source, row_bytes, prefetch_ahead, ahead):
    # The 16-byte pieces before the destination's first line boundary, its whole cache lines, each
    # completed in the write-combining buffer by consecutive stores, then the remaining pieces.
    head = _line_start(destination, row_bytes)
    lines_end = row_bytes - (row_bytes - head) % 64
    for offset in range(0, head, 16):
        stream_store_16(destination + offset, source + offset)
    for offset in range(head, lines_end, 64):
        if prefetch_ahead:
            prefetch(ahead + offset)
        stream_store_16(destination + offset, source + offset)
        stream_store_16(destination + offset + 16, source + offset + 16)
        stream_store_16(destination + offset + 32, source + offset + 32)
        stream_store_16(destination + offset + 48, source + offset + 48)
    if prefetch_ahead and lines_end < row_bytes:
        prefetch(ahead + row_bytes - 1)
    for offset in range(lines_end, row_bytes, 16):
        stream_store_16(destination + offset, source + offset)


@njit(**_JIT)
def _stream_row_backward(destination, source, row_bytes, prefetch_ahead, ahead):
    # _stream_row_forward in reverse: the pieces after the last whole line, last first, then the whole
    # lines from the last one down, each line from its last 16 bytes down, then the pieces before the first.
    head = _line_start(destination, row_bytes)
    lines_end = row_bytes - (row_bytes - head) % 64
    if prefetch_ahead and lines_end < row_bytes:
        prefetch(ahead + row_bytes - 1)
    for offset in range(row_bytes - 16, lines_end - 16, -16):
        stream_store_16(destination + offset, source + offset)
    for offset in range(lines_end - 64, head - 64, -64):
        if prefetch_ahead:
            prefetch(ahead + offset)
        stream_store_16(destination + offset + 48, source + offset + 48)
        stream_store_16(destination + offset + 32, source + offset + 32)
        stream_store_16(destination + offset + 16, source + offset + 16)
        stream_store_16(destination + offset, source + offset)
    for offset in range(head - 16, -16, -16):
        stream_store_16(destination + offset, source + offset)


@njit(**_JIT)
def gather_serial(table, ids, out, touch_pages_rows_ahead):
    """Gather on the calling thread with :func:`copy_rows`: outputs below the parallel size, and any that finds the
    parallel lock taken."""
    bad = first_bad_position(ids, table.shape[0])
    if bad >= 0:
        return bad
    # np.intp(0): a literal 0 would compile a second copy_rows
    if copy_rows(table, ids, out, np.intp(0), ids.size, touch_pages_rows_ahead):
        return CHANGED_DURING_COPY
    return -1


def can_stream(out) -> bool:
    """Whether :func:`stream_rows` may write `out` (2-D bytes): 16-byte aligned rows.

    A plain Python check (it costs a microsecond, nothing next to the 2 MiB
    or larger outputs that stream), kept out of the kernels so that each
    kernel compiles alone.
    """
    return (out.shape[1] * out.itemsize) % 16 == 0 and data_address(out) % 16 == 0
