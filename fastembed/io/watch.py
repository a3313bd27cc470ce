"""Noticing that the file behind a memory-mapped table shrank or changed, before a lookup.

A memory map follows the file, not a snapshot of it. If the file is
truncated while mapped, a lookup that touches a page past the new end gets
SIGBUS from the operating system and the process dies (Python cannot catch
it). If it is overwritten in place, lookups silently return the new bytes.
Replacing the file (writing a new one and renaming it over the path, as
``huggingface_hub`` and most tools do) is harmless: the map keeps the old
file's pages.

:class:`FileWatch` holds the file open and compares ``os.fstat`` of it with
what it was when the table was opened. That is one system call: about as
much as half of the smallest lookup (a few ids) costs, negligible next to a
batch of thousands (docs/loading.md gives the figures and the command). So
it is not made on every lookup: a caller that fears truncation calls
``check()`` where it chooses (per batch, per request, on a timer). It
narrows the window, it cannot close it: the file may still shrink between
``check()`` and the lookup. An in-place overwrite within one tick of the
kernel's file-time clock (a few ms) after opening leaves the modification
time unchanged and goes unnoticed.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from ..arrays.numpy_adapter import data_address
from ._files import FileIdentity, mapped_identity


def _filename(array: Any) -> str | None:
    """The file an np.memmap maps, or None for anything else."""
    if not isinstance(array, np.memmap) or not getattr(array, "filename", None):
        return None
    return str(array.filename)


def _end_in_file(array: Any) -> int:
    """Where in its file the last byte `array` reaches ends: a slice of a map lies anywhere in it, while its
    ``offset`` stays the whole map's."""
    mapped: Any = array
    while isinstance(mapped.base, np.ndarray):  # up to the array over the map itself, which starts at its offset
        mapped = mapped.base
    if not isinstance(mapped, np.memmap) or array.size == 0:
        return int(mapped.offset) if isinstance(mapped, np.memmap) else 0
    reach = sum((length - 1) * stride for length, stride in zip(array.shape, array.strides, strict=True) if stride > 0)
    return int(mapped.offset) + (data_address(array) - data_address(mapped)) + reach + array.itemsize


class FileChangedError(RuntimeError):
    """The file behind a memory-mapped table shrank or was modified in place since it was opened."""


class FileWatch:
    """The size, modification time and change time of a mapped file, checked on demand.

    The change time (``st_ctime_ns``) is set by the kernel on every write and
    cannot be set back by a user, so a rewrite that restores the modification
    time (``touch -r``, ``rsync --inplace -t``) is still noticed. It also moves
    when the file loses its last link, as when a new file is renamed over the
    path (harmless: the map keeps the old file, which no path reaches any
    more), so it counts only while the file has a link; a change of the
    file's links or metadata alone (a hard link made, ``chmod``) is
    reported, a false alarm on the safe side.

    Args:
        path: the mapped file.
        needed_bytes: how many bytes from the file's start the table covers
            (the map's offset plus its length).
        mapped: the file as it was when it was mapped (a
            :class:`~fastembed.io.FileIdentity`: device, inode, size,
            modification and change time, as the loaders record it), or None when
            unknown. The file at `path` must still be that one,
            unchanged: else the watch would follow another file, or start
            from a change it never saw.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: the file is already shorter than `needed_bytes`, or is not
            `mapped` any more.
    """

    def __init__(self, path: str | os.PathLike, needed_bytes: int, *, mapped: FileIdentity | None = None) -> None:
        self.path = os.fspath(path)
        self.needed_bytes = int(needed_bytes)
        # Without waiting, should the path name a FIFO now (no regular file opened this way ever waits).
        self._fd: int | None = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        status = os.fstat(self._fd)
        self.size, self.mtime_ns, self.ctime_ns = status.st_size, status.st_mtime_ns, status.st_ctime_ns
        if mapped is not None and (status.st_dev, status.st_ino) != (mapped.device, mapped.inode):
            self.close()
            raise ValueError(f"{self.path}: no longer the file that was mapped (another program replaced it: a "
                             "download finishing?); open it again")
        if self.size < self.needed_bytes:
            self.close()
            raise ValueError(f"{self.path}: {self.size} bytes, shorter than the {self.needed_bytes} the table needs")
        if mapped is not None and FileIdentity.of(status) != mapped:
            self.close()
            raise ValueError(f"{self.path}: changed since it was mapped (another program rewrote it in place); "
                             "open it again")

    @classmethod
    def for_table(cls, table: Any) -> FileWatch | None:
        """A watch for a table returned by the loaders, or None for an in-memory table.

        Args:
            table: an np.memmap, or a :class:`~fastembed.formats.QuantizedTable` whose
                ``data`` is one (its ``scales``, when they are a map of the same file, are
                covered too).

        Returns:
            A FileWatch covering the mapped bytes, or None when the table's rows are not an
            np.memmap with a file name.

        Example:
            >>> import numpy as np, os, shutil, tempfile
            >>> folder = tempfile.mkdtemp()
            >>> path = os.path.join(folder, "table.npy")
            >>> np.save(path, np.ones((4, 8), np.float16))
            >>> from fastembed.io import FileWatch, map_npy
            >>> watch = FileWatch.for_table(map_npy(path))
            >>> watch.check()
            >>> watch.close()
            >>> FileWatch.for_table(np.ones((4, 8))) is None
            True
            >>> shutil.rmtree(folder)
        """
        from ..formats import QuantizedTable

        maps = [table.data, table.scales] if isinstance(table, QuantizedTable) else [table]
        filename = _filename(maps[0])
        if filename is None:
            return None
        needed = max(_end_in_file(array) for array in maps if _filename(array) == filename)
        return cls(filename, needed, mapped=mapped_identity(maps[0]))

    def check(self) -> None:
        """Raise when the file shrank below the table or was modified in place since it was opened.

        Costs one ``os.fstat`` on the open descriptor.

        Raises:
            FileChangedError: the file is now shorter than the table (a lookup could die with
                SIGBUS), or its size, modification time or change time changed (rows may have changed).
            ValueError: the watch was closed.

        Example:
            >>> import numpy as np, os, shutil, tempfile
            >>> folder = tempfile.mkdtemp()
            >>> path = os.path.join(folder, "table.npy")
            >>> np.save(path, np.ones((4, 8), np.float16))
            >>> from fastembed.io import FileWatch, map_npy
            >>> watch = FileWatch.for_table(map_npy(path))
            >>> watch.check()  # silent: the file is as it was mapped
            >>> watch.close()
            >>> shutil.rmtree(folder)
        """
        if self._fd is None:
            raise ValueError(f"{self.path}: the FileWatch is closed")
        status = os.fstat(self._fd)
        if status.st_size < self.needed_bytes:
            raise FileChangedError(
                f"{self.path} shrank to {status.st_size} bytes while memory-mapped; the table needs "
                f"{self.needed_bytes}. A lookup touching the lost pages would kill the process with SIGBUS: "
                "reopen the table from a complete file")
        ctime_moved = status.st_ctime_ns != self.ctime_ns and status.st_nlink > 0
        if status.st_size != self.size or status.st_mtime_ns != self.mtime_ns or ctime_moved:
            raise FileChangedError(
                f"{self.path} was modified in place while memory-mapped (size {self.size} -> {status.st_size}; "
                "its modification or change time changed): its rows may have changed; reopen the table")

    def close(self) -> None:
        """Close the descriptor (the table's memory map is not affected).

        Example:
            >>> import numpy as np, os, shutil, tempfile
            >>> folder = tempfile.mkdtemp()
            >>> path = os.path.join(folder, "table.npy")
            >>> np.save(path, np.ones((4, 8), np.float16))
            >>> from fastembed.io import FileWatch, map_npy
            >>> table = map_npy(path)
            >>> FileWatch.for_table(table).close()
            >>> table.shape
            (4, 8)
            >>> shutil.rmtree(folder)
        """
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileWatch:  # noqa: PYI034 - final class
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown os may be gone
            self.close()

    def __copy__(self) -> FileWatch:
        """A watch with the same baseline over a descriptor of its own (two closing one number would close a stranger's)."""
        twin = object.__new__(FileWatch)
        twin.__dict__.update(self.__dict__)
        twin._fd = None if self._fd is None else os.dup(self._fd)
        return twin

    def __deepcopy__(self, memo: dict) -> FileWatch:
        return self.__copy__()

    def __reduce__(self) -> Any:
        raise TypeError(f"a table memory-mapped from {self.path} cannot be pickled (its file watch holds an open "
                        "descriptor, and the table would travel as a copy of its rows); open the file again in the "
                        "other process with fastembed.Embedding.from_pretrained(path)")
