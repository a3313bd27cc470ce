"""numpy arrays (np.memmap and other subclasses included): host memory."""
from __future__ import annotations

import mmap
import os
import weakref
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
        through one is read through the other all the same. The files are
        the ones mapped, as the kernel records them (Linux: ``/proc/self/maps``),
        so a file renamed, removed or replaced since it was mapped is still
        told apart; elsewhere they are looked up by the mappings' file names,
        and a file renamed or removed since then is not found. False where either
        maps no file, or `first` is a copy-on-write mapping (its writes stay in
        the process). A copy-on-write `second` counts: it reads the file's own
        pages until it writes them, and a table is never written.
        """
        span_a, span_b = _file_span(first, writes=True), _file_span(second, writes=False)
        if span_a is None or span_b is None:
            return False
        (mapping_a, start_a, stop_a), (mapping_b, start_b, stop_b) = span_a, span_b
        if not (start_a < stop_b and start_b < stop_a):
            return False
        files = _mapped_files((mapping_a, mapping_b))
        return files[0] is not None and files[0] == files[1]

    def wrap(self, result: np.ndarray) -> np.ndarray:
        return result

    def writable(self, view: np.ndarray) -> bool:
        """Whether a gather can write `view` (an ``out``): probed where another library lent its memory.

        A numpy view of a torch tensor over a read-only map says it is writeable (torch marks nothing
        read-only): :mod:`fastembed.arrays.write_probe`.
        """
        return not write_probe.lent(view) or write_probe.can_write(view)


ADAPTER = NumpyAdapter()


def _file_span(array: Any, writes: bool) -> tuple[np.memmap, int, int] | None:
    """(the np.memmap whose mapping holds `array`, first byte in its file, end) that `array` maps, or None.

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
    base = _mapping_address(memmap)
    if base is None:
        return None
    first = memmap.offset - memmap.offset % mmap.ALLOCATIONGRANULARITY + array.ctypes.data - base
    reach = [stride * (size - 1) for stride, size in zip(array.strides, array.shape, strict=True)]
    low, high = sum(step for step in reach if step < 0), sum(step for step in reach if step > 0)
    return memmap, first + low, first + high + array.itemsize


def _mapping_address(memmap: np.memmap) -> int | None:
    """The address of the first byte of `memmap`'s mapping, or None once the mapping is closed."""
    try:
        return int(np.frombuffer(getattr(memmap, "_mmap"), np.uint8).ctypes.data)  # noqa: B009 - numpy's own attribute
    except (ValueError, TypeError):
        return None


def _mapped_files(memmaps: tuple[np.memmap, ...]) -> list[tuple[int, int] | None]:
    """(device, inode) of the file each of `memmaps` maps, or None where it cannot be told.

    Where the kernel lists the process's mappings (``/proc/self/maps``), the
    file mapped at each mapping's first byte, whatever its name is now (read
    once per mapping: a mapping's file never changes); else, or where the
    list has no file at that address, the file the mapping's name leads to now.
    """
    files = [_FILE_OF_MAPPING.get(getattr(memmap, "_mmap")) for memmap in memmaps]  # noqa: B009 - numpy's own attribute
    wanted = {k: _mapping_address(memmap) for k, memmap in enumerate(memmaps) if files[k] is None}
    if wanted:
        listed = _listed_files([address for address in wanted.values() if address is not None])
        for k, address in wanted.items():
            mapped = listed.get(address) if address is not None else None
            if mapped is not None:
                _FILE_OF_MAPPING[getattr(memmaps[k], "_mmap")] = mapped  # noqa: B009 - numpy's own attribute
            files[k] = mapped if mapped is not None else _file_by_name(memmaps[k])
    return files


#: The file of each mapping found in the kernel's list: (device, inode) by the mmap object, while it lives.
_FILE_OF_MAPPING: weakref.WeakKeyDictionary[mmap.mmap, tuple[int, int]] = weakref.WeakKeyDictionary()


def _listed_files(addresses: list[int]) -> dict[int, tuple[int, int]]:
    """(device, inode) of the file mapped at each of `addresses`, by the kernel's list of this process's mappings.

    Addresses the list does not place in a file mapping are left out, as is
    everything where there is no such list (``/proc/self/maps`` is Linux's).
    """
    try:
        with open("/proc/self/maps", "rb") as maps:
            listing = maps.read()
    except OSError:
        return {}
    found: dict[int, tuple[int, int]] = {}
    # One line per mapping, ended by a newline, which is the only byte the kernel escapes in a file's name:
    # start-end perms offset major:minor inode [name], the numbers in hexadecimal but the inode.
    for line in listing.split(b"\n"):
        if len(found) == len(addresses):
            break
        fields = line.split(b" ", 5)
        if len(fields) < 5:
            continue
        try:
            start, end = (int(bound, 16) for bound in fields[0].split(b"-"))
            major, minor = (int(number, 16) for number in fields[3].split(b":"))
            inode = int(fields[4])
        except ValueError:
            continue
        for address in addresses:
            if start <= address < end and inode and address not in found:
                found[address] = (os.makedev(major, minor), inode)
    return found


def _file_by_name(memmap: np.memmap) -> tuple[int, int] | None:
    """(device, inode) of the file `memmap`'s file name leads to now, or None (a file of no name too)."""
    if not getattr(memmap, "filename", None):
        return None
    try:
        facts = os.stat(str(memmap.filename))
    except (OSError, ValueError):
        return None
    return facts.st_dev, facts.st_ino


def memmap_of(array: Any) -> np.memmap | None:
    """The np.memmap whose mapping `array`'s memory lies in: itself, or the first one down its base chain."""
    for _ in range(64):  # base chains are short; a cycle cannot be made, but nothing is trusted blindly
        if isinstance(array, np.memmap):
            mapping = getattr(array, "_mmap", None)
            return array if isinstance(mapping, mmap.mmap) else None
        if not isinstance(array, np.ndarray):
            return None
        array = array.base
    return None
