""".npy files: the header read by numpy's own parser, every failure a ValueError, the data memory-mapped."""
from __future__ import annotations

import ast
import io
import math
import os
import struct
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from ._files import FileIdentity, describe, map_file, opened

_OPENER = "fastembed.Embedding.from_npy"
#: numpy's own default limit on a .npy header's length (np.load's max_header_size).
MAX_HEADER_BYTES = 10_000
#: The header length's field and the header's text encoding, per format version.
_HEADER_FRAMES = {(1, 0): ("<H", "latin1"), (2, 0): ("<I", "latin1"), (3, 0): ("<I", "utf8")}


def read_npy_header(path: str | os.PathLike) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """The shape, Fortran order, dtype and data offset of a .npy file, checked against its size.

    Args:
        path: the file.

    Returns:
        (shape, fortran_order, dtype, offset of the first data byte).

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: a directory; not a .npy file (saying what it looks like); a corrupt
            header (whatever numpy's parser raised on it: SyntaxError, OverflowError,
            tokenize.TokenError, ...) or a negative dimension; object dtypes; data shorter
            than the header says.

    Example:
        >>> import numpy as np, os, shutil, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "table.npy")
        >>> np.save(path, np.ones((4, 8), np.float16))
        >>> from fastembed.io import read_npy_header
        >>> read_npy_header(path)  # shape, Fortran order, dtype, data offset
        ((4, 8), False, dtype('float16'), 128)
        >>> shutil.rmtree(folder)
    """
    return _read_header(path)[:4]


def _read_header(path: str | os.PathLike) -> tuple[tuple[int, ...], bool, np.dtype, int, FileIdentity]:
    """:func:`read_npy_header`, and the file the header was read from."""
    with opened(path, _OPENER) as (handle, identity):
        head = handle.read(64)
        if not head.startswith(b"\x93NUMPY"):
            looks = describe(path, head)
            raise ValueError(f"{path}: not a .npy file: it {looks}" if looks else
                             f"{path}: not a .npy file (no \\x93NUMPY magic); {_OPENER} opens .npy files")
        handle.seek(0)
        try:
            version = npy_format.read_magic(handle)
            shape, fortran_order, dtype = _parse_header(handle, version)
        except Exception as error:  # noqa: BLE001 - any failure of numpy's parser on hostile bytes
            raise ValueError(f"{path}: not a readable .npy file: corrupt header ({type(error).__name__}: {error})") from None
        offset = handle.tell()
    if dtype.hasobject:
        raise ValueError(f"{path}: not a readable .npy file: dtype {dtype} holds Python objects (a pickle); "
                         "fastembed never unpickles")
    if dtype.itemsize == 0:
        raise ValueError(f"{path}: not a table fastembed can gather: dtype {dtype} has no bytes per value")
    if not all(type(size) is int and size >= 0 for size in shape):
        raise ValueError(f"{path}: not a readable .npy file: corrupt header (shape {shape!r})")
    needed = math.prod(shape) * dtype.itemsize
    if offset + needed > identity.size:
        raise ValueError(f"{path}: truncated .npy file: the header says {needed} bytes of {dtype} data {list(shape)}, "
                         f"the file holds {identity.size - offset}")
    return tuple(shape), bool(fortran_order), dtype, offset, identity


def _parse_header(handle: Any, version: tuple[int, int]) -> tuple[Any, bool, np.dtype]:
    """(shape, fortran_order, dtype) of the header after the magic; its length is checked before it is read."""
    frame = _HEADER_FRAMES.get(version)
    if frame is None:
        raise ValueError(f"format version {version[0]}.{version[1]}; numpy writes versions 1.0, 2.0 and 3.0")
    length_format, encoding = frame
    length_field = handle.read(struct.calcsize(length_format))
    (length,) = struct.unpack(length_format, length_field)
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {length} bytes; at most {MAX_HEADER_BYTES} are read")
    header = handle.read(length)
    if len(header) != length:
        raise ValueError(f"the header is cut short: {len(header)} of its {length} bytes")
    if encoding == "latin1":  # numpy's own parser, which also reads the headers numpy wrote under Python 2
        parse = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        return parse(io.BytesIO(length_field + header), max_header_size=MAX_HEADER_BYTES)
    return _parsed_header(header.decode(encoding))


def _parsed_header(text: str) -> tuple[Any, bool, np.dtype]:
    """A version 3.0 header (UTF-8 text), which numpy's public parsers would decode as latin-1: checked as numpy checks one."""
    fields = ast.literal_eval(text)
    if not isinstance(fields, dict) or set(fields) != {"descr", "fortran_order", "shape"}:
        raise ValueError(f"the header is not a dictionary of descr, fortran_order and shape: {text[:200]!r}")
    shape, fortran_order = fields["shape"], fields["fortran_order"]
    if not isinstance(shape, tuple) or not all(isinstance(size, int) for size in shape):
        raise ValueError(f"shape is not a tuple of integers: {shape!r}")
    if not isinstance(fortran_order, bool):
        raise ValueError(f"fortran_order is not a bool: {fortran_order!r}")
    return shape, fortran_order, npy_format.descr_to_dtype(fields["descr"])


def map_npy(path: str | os.PathLike) -> np.memmap:
    """Memory-map a 2-D .npy file read-only, zero-copy.

    Args:
        path: the .npy file (format version 1, 2 or 3).

    Returns:
        A read-only np.memmap (Fortran-ordered when the file is).

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: as :func:`read_npy_header`; the array is not 2-D (a sub-array
            dtype such as ``('<f4', (4,))`` adds dimensions) or is empty.

    Example:
        >>> import numpy as np, os, shutil, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "table.npy")
        >>> np.save(path, np.ones((4, 8), np.float16))
        >>> from fastembed.io import map_npy
        >>> map_npy(path).shape
        (4, 8)
        >>> shutil.rmtree(folder)
    """
    shape, fortran_order, dtype, offset, identity = _read_header(path)
    if dtype.subdtype is not None:
        raise ValueError(f"{path}: dtype {dtype} is a sub-array type (each element holds {dtype.subdtype[0]} of shape "
                         f"{dtype.shape}); an embedding table's dtype is a scalar type")
    if len(shape) != 2:
        raise ValueError(f"{path}: holds shape {shape}; an embedding table is 2-D")
    if 0 in shape:
        raise ValueError(f"{path}: holds an empty array of shape {shape}")
    return map_file(path, dtype, offset, shape, order="F" if fortran_order else "C", identity=identity)


def map_npy_rows(path: str | os.PathLike) -> np.memmap:
    """:func:`map_npy` for a table whose rows are gathered: the file must be in row-major (C) order.

    Args:
        path: a ``.npy`` file holding a 2-D array.

    Returns:
        A read-only C-contiguous ``np.memmap`` over the file's data (nothing is read yet).

    Raises:
        FileNotFoundError, ValueError: as :func:`map_npy`; and a ValueError for a
            Fortran-order file, whose rows are not contiguous (gathering them would
            need a copy of the whole table), saying how to rewrite it once.

    Example:
        >>> import numpy as np, os, shutil, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "table.npy")
        >>> np.save(path, np.ones((4, 8), np.float16))
        >>> from fastembed.io import map_npy_rows
        >>> map_npy_rows(path)[2].dtype
        dtype('float16')
        >>> shutil.rmtree(folder)
    """
    table = map_npy(path)
    if not table.flags.c_contiguous:
        raise ValueError(
            f"{path}: stores its array in Fortran (column-major) order, so a row's values are not contiguous in "
            "the file and fastembed would have to copy the whole table to gather rows; rewrite it once in "
            "row-major order: np.save(path, np.ascontiguousarray(np.load(path, mmap_mode='r')))")
    return table
