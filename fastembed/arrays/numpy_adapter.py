"""numpy arrays (np.memmap and other subclasses included): host memory."""
from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from . import write_probe


class NumpyAdapter:
    name = "numpy"
    owned_by_type = True
    result_alignment = 0

    def stored_dtype(self, dtype: Any) -> Any:
        return dtype

    def owns(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def device(self, array: Any) -> str:
        return "cpu"

    def snapshot(self, array: np.ndarray) -> np.ndarray:
        # A base-class view: np.memmap's subclass makes slicing and typing slower, and the bytes are the same.
        return array.view() if type(array) is np.ndarray else array.view(np.ndarray)

    def from_host(self, host: np.ndarray, device: str = "cpu") -> np.ndarray:
        return host

    def may_share_memory(self, first: np.ndarray, second: Any) -> bool:
        """Whether two snapshots share memory (exact: ``np.shares_memory``)."""
        return isinstance(second, np.ndarray) and bool(np.shares_memory(first, second))

    def same_file_bytes(self, first: Any, second: Any) -> bool:
        """Whether a write through `first` reaches bytes of a file that `second` maps too.

        Both are np.memmap arrays or views of them. Two mappings of a file have
        different addresses, which :meth:`may_share_memory` compares; a write
        through one is read through the other all the same. False where either
        maps no file, `first` is a copy-on-write mapping (its writes stay in
        the process), or a file cannot be looked at any more (renamed or
        removed since it was mapped: the name then leads elsewhere). A
        copy-on-write `second` counts: it reads the file's own pages until it
        writes them, and a table is never written.
        """
        span_a, span_b = _file_span(first, writes=True), _file_span(second, writes=False)
        if span_a is None or span_b is None:
            return False
        (file_a, start_a, stop_a), (file_b, start_b, stop_b) = span_a, span_b
        return file_a == file_b and start_a < stop_b and start_b < stop_a

    def wrap(self, result: np.ndarray) -> np.ndarray:
        return result

    def writable(self, view: np.ndarray) -> bool:
        """Whether a gather can write `view` (an ``out``): probed where another library lent its memory.

        A numpy view of a torch tensor over a read-only map says it is writeable (torch marks nothing
        read-only): :mod:`fastembed.arrays.write_probe`.
        """
        return not write_probe.lent(view) or write_probe.can_write(view)


ADAPTER = NumpyAdapter()


def _file_span(array: Any, writes: bool) -> tuple[tuple[int, int], int, int] | None:
    """((device, inode) of the file, first byte, end) that `array` maps, or None.

    `array` is an np.memmap or a view of one (a plain ndarray whose base
    chain leads to it). np.memmap maps its file from ``offset`` rounded down
    to the allocation granularity, and a memmap view keeps its parent's
    ``offset`` and mapping: the file position of an address is that start
    plus the address's distance from the mapping's first byte. With
    `writes`, the bytes a write through `array` reaches: none for a
    copy-on-write mapping (mode ``"c"``), which never writes through to its
    file; else the bytes it reads, which a copy-on-write mapping reads from
    the file until it writes them.
    """
    memmap = memmap_of(array)
    if memmap is None or (writes and memmap.mode == "c") or array.size == 0:
        return None
    try:
        base = np.frombuffer(getattr(memmap, "_mmap"), np.uint8).ctypes.data  # noqa: B009 - numpy's own attribute
        facts = os.stat(str(memmap.filename))
    except (ValueError, OSError, TypeError):  # a closed mapping, a file renamed or removed since
        return None
    first = memmap.offset - memmap.offset % mmap.ALLOCATIONGRANULARITY + array.ctypes.data - base
    reach = [stride * (size - 1) for stride, size in zip(array.strides, array.shape, strict=True)]
    low, high = sum(step for step in reach if step < 0), sum(step for step in reach if step > 0)
    return (facts.st_dev, facts.st_ino), first + low, first + high + array.itemsize


def memmap_of(array: Any) -> np.memmap | None:
    """The np.memmap whose mapping `array`'s memory lies in: itself, or the first one down its base chain."""
    for _ in range(64):  # base chains are short; a cycle cannot be made, but nothing is trusted blindly
        if isinstance(array, np.memmap):
            mapping = getattr(array, "_mmap", None)
            return array if isinstance(mapping, mmap.mmap) and getattr(array, "filename", None) else None
        if not isinstance(array, np.ndarray):
            return None
        array = array.base
    return None
