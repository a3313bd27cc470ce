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

        Both are arrays over memory maps (np.memmap, or views of one). Two
        mappings of a file have different addresses, which
        :meth:`may_share_memory` compares; a write through one is read
        through the other all the same. Each mapping is the ``mmap`` object at
        the root of the array's bases (which numpy never lets change), and
        what it maps (file, position, shared or copy-on-write) is what the
        kernel records for it (Linux: ``/proc/self/maps``), never the
        np.memmap's own attributes, which anyone may reassign: a file
        renamed, removed or replaced since it was mapped is still told
        apart. Elsewhere the np.memmap's ``offset``, ``mode`` and file name
        are trusted. False where either maps no file, or `first` is a
        copy-on-write mapping (its writes stay in the process). A
        copy-on-write `second` counts: it reads the file's own pages until
        it writes them, and a table is never written.
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
    """(the file `array` maps as (device, inode), its first byte there, end), or None where it maps none.

    `array` is a view of a memory map: its bases lead to the ``mmap``
    object, whose first byte lies at some position of its file; an address
    in it lies as far past that position as it lies past the mapping's first
    byte. With `writes`, the bytes a write through `array` reaches: none for
    a copy-on-write mapping, which never writes through to its file; else
    the bytes it reads, which a copy-on-write mapping reads from the file
    until it writes them.
    """
    mapping = mapping_of(array)
    if mapping is None or array.size == 0:
        return None
    address = _mapping_address(mapping)
    if address is None:
        return None
    facts = _mapping_facts(mapping, address, array)
    if facts is None:
        return None
    file, position, shared = facts
    if writes and not shared:
        return None
    first = position + data_address(array) - address
    reach = [stride * (size - 1) for stride, size in zip(array.strides, array.shape, strict=True)]
    low, high = sum(step for step in reach if step < 0), sum(step for step in reach if step > 0)
    return file, first + low, first + high + array.itemsize


def data_address(array: np.ndarray) -> int:
    """The address of `array`'s first element.

    Read from ``__array_interface__``: ``ndarray.ctypes`` imports a module on
    first use, which fails in a ``__del__`` that interpreter teardown runs.
    """
    return int(array.__array_interface__["data"][0])


def mapping_of(array: Any) -> mmap.mmap | None:
    """The ``mmap`` object whose memory `array` lies in: the first down its chain of bases, or None.

    The chain runs through arrays' bases, memoryviews' objects (np.frombuffer's) and the bases of
    numpy's stride tricks (:func:`~fastembed.arrays.write_probe.base_of`), each read once.
    """
    for _ in range(64):  # base chains are short; a cycle cannot be made, but nothing is trusted blindly
        if isinstance(array, mmap.mmap):
            return array
        array = write_probe.base_of(array)
        if array is None:
            return None
    return None


def _mapping_address(mapping: mmap.mmap) -> int | None:
    """The address of the first byte of `mapping`, or None once it is closed."""
    try:
        return data_address(np.frombuffer(mapping, np.uint8))
    except (ValueError, TypeError):
        return None


#: What each mapping found in the kernel's list maps, by the mmap object while it lives (it never changes):
#: ((device, inode) of the file, position in the file of its first byte, whether writes reach the file).
_FACTS_OF_MAPPING: weakref.WeakKeyDictionary[mmap.mmap, tuple[tuple[int, int], int, bool]] = weakref.WeakKeyDictionary()


def _mapping_facts(mapping: mmap.mmap, address: int, array: Any) -> tuple[tuple[int, int], int, bool] | None:
    """(file, position of its first byte in the file, shared) of `mapping`, whose first byte is at `address`; None: no file.

    From the kernel's list of this process's mappings where there is one;
    else from the np.memmap down `array`'s bases, if any.
    """
    facts = _FACTS_OF_MAPPING.get(mapping)
    if facts is None:
        listed = _listed_mapping(address)
        if listed is _UNLISTED:
            return _memmap_facts(array)
        if listed is None:
            return None
        facts = _FACTS_OF_MAPPING[mapping] = listed
    return facts


#: What :func:`_listed_mapping` answers where the kernel keeps no list of mappings.
_UNLISTED = ((-1, -1), -1, False)


def _listed_mapping(address: int) -> tuple[tuple[int, int], int, bool] | None:
    """(file, position in it of the byte at `address`, shared) by the kernel's list of this process's mappings.

    None where the list places no file mapping there (anonymous memory);
    :data:`_UNLISTED` where there is no such list (``/proc/self/maps`` is Linux's).
    """
    try:
        with open("/proc/self/maps", "rb") as maps:
            listing = maps.read()
    except OSError:
        return _UNLISTED
    # One line per mapping, ended by a newline, which is the only byte the kernel escapes in a file's name:
    # start-end perms offset major:minor inode [name], the numbers in hexadecimal but the inode.
    for line in listing.split(b"\n"):
        fields = line.split(b" ", 5)
        if len(fields) < 5:
            continue
        try:
            start, end = (int(bound, 16) for bound in fields[0].split(b"-"))
            if not start <= address < end:
                continue
            offset = int(fields[2], 16)
            major, minor = (int(number, 16) for number in fields[3].split(b":"))
            inode = int(fields[4])
        except ValueError:
            continue
        if not inode:
            return None
        return (os.makedev(major, minor), inode), offset + address - start, fields[1][3:4] == b"s"
    return None


def _memmap_facts(array: Any) -> tuple[tuple[int, int], int, bool] | None:
    """(file, position of its mapping's first byte, shared) from the np.memmap down `array`'s bases, or None.

    Where the kernel keeps no list of mappings: the np.memmap's attributes
    and its file's name now (a file renamed or removed since is not found).
    """
    memmap = memmap_of(array)
    if memmap is None or not getattr(memmap, "filename", None):
        return None
    try:
        facts = os.stat(str(memmap.filename))
    except (OSError, ValueError):
        return None
    start = memmap.offset - memmap.offset % mmap.ALLOCATIONGRANULARITY
    return (facts.st_dev, facts.st_ino), start, memmap.mode != "c"


def memmap_of(array: Any) -> np.memmap | None:
    """The np.memmap whose mapping `array`'s memory lies in: itself, or the first one down its base chain
    (:func:`~fastembed.arrays.write_probe.base_of`)."""
    for _ in range(64):  # base chains are short; a cycle cannot be made, but nothing is trusted blindly
        if isinstance(array, np.memmap):
            mapping = getattr(array, "_mmap", None)
            return array if isinstance(mapping, mmap.mmap) else None
        array = write_probe.base_of(array)
        if array is None:
            return None
    return None
