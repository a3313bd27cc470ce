"""Writing a table to a file the loaders map back, byte for byte: GGUF or safetensors.

* ``.gguf``: a GGUF version 3 file holding one tensor (``token_embd.weight`` by
  default): float32, float16 and bfloat16 tables as F32, F16 and BF16, and
  quantized tables whose format has a GGUF type (Q8_0, Q4_K, ...), their rows'
  bytes as they are. Written here (the format is a short header and the rows),
  so no GGUF package is needed.
* ``.safetensors``: written here too (a JSON header, then the tensors'
  bytes). A dense table is one
  tensor (``weight`` by default); a quantized table is its uint8 rows under
  the name, plus the float32 row scales under ``<name>.scales`` when its
  format has them. ``__metadata__`` names the table (``fastembed.tensor``) and,
  for a quantized table, its format and values per row (``fastembed.format``,
  ``fastembed.dim``), so :func:`~fastembed.io.map_safetensors` finds it without
  a name and maps it back as a QuantizedTable.

Both writers stream the rows 4 MiB at a time, converted to little-endian
row-major order chunk by chunk, so a memory-mapped, big-endian or
column-major table is never copied whole.

The file is written beside its destination and renamed over it at the end, so
a table mapped from the destination keeps its old pages (see docs/loading.md);
a file replaced keeps its permissions, and a symbolic link at the destination
is itself replaced, its target left as it was (a Hugging Face cache's
content-addressed blob stays intact); a directory, or a link to one, is
refused before anything is written.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import validate
from ..arrays import adapter_of
from ..formats import FORMATS, QuantizedTable, is_fastembeds_own
from ._files import check_tensor_name, path_text
from .gguf import ALIGNMENT_KEY, DEFAULT_ALIGNMENT, DENSE_TYPES, GGML_NAME_BYTES, MAGIC, TOKEN_EMBEDDING, UINT32_TYPE
from .safetensors import DIM_KEY, FORMAT_KEY, METADATA_KEY, SAFETENSORS_DTYPES, SCALES_SUFFIX, TENSOR_KEY

#: The tensor name a table is saved under in a safetensors file when none is given.
SAFETENSORS_NAME = "weight"
#: GGUF type codes of the dense dtypes a GGUF file holds, by numpy name (bfloat16 without importing ml_dtypes).
_GGUF_DENSE = {(spec if spec == "bfloat16" else np.dtype(spec).name): code for code, spec in DENSE_TYPES.items()}
#: The metadata key of the quantization version, and the version of ggml's block layouts that fastembed writes.
QUANTIZATION_VERSION_KEY = b"general.quantization_version"
GGML_QUANTIZATION_VERSION = 2
#: The safetensors dtype code of each dense dtype (numpy names) a safetensors file holds and the loaders map back.
_SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
#: Bytes written at a time (a memory-mapped table is streamed, never copied whole).
_CHUNK_BYTES = 4 * 2**20
#: Bytes of the destination's name that begin the temporary file's (file names are at most 255 bytes).
_TEMPORARY_PREFIX_BYTES = 128


def save_table(path: str | os.PathLike, table: Any, name: str | None = None) -> None:
    """Write `table` to a ``.gguf`` or ``.safetensors`` file that the loaders map back byte for byte.

    Args:
        path: the file to write; its suffix chooses the format. An existing file is
            replaced (by a rename: a table mapped from it keeps its old contents); the
            new file is flushed to disk first, so after a crash `path` holds the old
            table or the new one, whole.
        table: a 2-D host array (numpy, np.memmap, a torch CPU tensor, a JAX CPU
            array) or a :class:`~fastembed.formats.QuantizedTable` on the host.
        name: the tensor's name; None gives ``token_embd.weight`` in GGUF (what
            :func:`~fastembed.io.map_gguf` opens by default) and ``weight`` in safetensors.

    Raises:
        ValueError: another suffix; a `path` holding a NUL character; an empty or non-2-D table; a dtype or format the
            chosen file cannot hold (GGUF: float32/float16/bfloat16 and the formats with
            a GGUF type; fp8_e4m3 goes to .safetensors; safetensors: the dtypes
            :data:`~fastembed.io.safetensors.SAFETENSORS_DTYPES` names, which the loaders read back;
            a quantized table of a format of the caller's own);
            a GGUF tensor name over 63 bytes of UTF-8 or holding a NUL (llama.cpp's reader refuses or cuts it);
            a file the loaders would refuse (a safetensors entry of over 4,096 characters, found in the
            temporary file once the rows are written; the destination is left as it was); a safetensors
            tensor named ``__metadata__``;
            a `name` that is not valid Unicode text (a lone surrogate): nothing is written then.
        TypeError: a table that is no array (a list, None), or not on the host, or whose dtype numpy
            cannot hold (torch's float8 dtypes other than float8_e4m3fn and float8_e5m2); a `name` that
            is not a string; a `path` that is no str, bytes or os.PathLike.
        IsADirectoryError: `path` is a directory, a symbolic link to one, or ends in a separator; nothing is
            written.
        OSError: `path`'s name is too long, its folder cannot be reached (missing, a file used as a folder,
            a link loop: refused before anything is written), or the file cannot be created beside `path`,
            written or renamed over it (naming `path`, except for errors while writing, such as a full disk).

    Example:
        >>> import numpy as np, shutil, tempfile, os
        >>> from fastembed.io import map_gguf, save_table
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "table.gguf")
        >>> save_table(path, np.ones((4, 8), np.float16))
        >>> map_gguf(path).shape
        (4, 8)
        >>> shutil.rmtree(folder)
    """
    path = path_text(path, "fastembed.io.save_table", kinds=(str, bytes, os.PathLike))
    check_tensor_name(path, name)
    base = os.path.basename(path)
    suffix = base[base.rfind("."):].lower() if "." in base else ""  # a file named ".gguf" too, as pathlib would not
    if suffix not in (".gguf", ".safetensors"):
        if path and not os.path.basename(path):  # a directory is refused as one, whatever its name
            raise IsADirectoryError(errno.EISDIR, "a path ending in a separator names a directory, not a file to write",
                                    path)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a file to write", path)
        raise ValueError(f"{path}: save_table writes .gguf and .safetensors files, not {suffix or 'a file without a suffix'!r} "
                         "(a dense table goes to .npy with numpy.save)")
    table = _host_table(path, table)
    if suffix == ".gguf":
        _write_gguf(path, table, TOKEN_EMBEDDING if name is None else name)
    else:
        _write_safetensors(path, table, SAFETENSORS_NAME if name is None else name)


def _check_readable(path: Any, temporary: str, name: str, suffix: str) -> None:
    """Map the written `temporary` file as the loaders will map `path`; ValueError if they would refuse it.

    The loaders bound what a header may hold (a tensor name's length, say), so
    a table that fits the format can still make a file they refuse: it is
    not put in place.
    """
    from .gguf import map_gguf
    from .safetensors import map_safetensors

    try:
        (map_gguf if suffix == ".gguf" else map_safetensors)(temporary, name)
    except ValueError as refused:
        problem = str(refused).removeprefix(f"{temporary}: ")
        raise ValueError(f"{path}: not written, fastembed's loaders would refuse the file: {problem}") from None


def _host_table(path: Any, table: Any) -> np.ndarray | QuantizedTable:
    """`table` as a 2-D, non-empty, little-endian host array, or a QuantizedTable with host arrays."""
    if isinstance(table, QuantizedTable):
        table = validate.table_snapshot(table)  # host tensors as numpy arrays over their memory
        for array in (table.data, table.scales):
            if array is not None and not isinstance(array, np.ndarray):
                raise TypeError(f"{path}: save_table writes host tables; this {table.format.name} table's arrays are "
                                f"{type(array).__module__}.{type(array).__qualname__} (copy them to the host first)")
        if table.shape[0] == 0:
            raise ValueError(f"{path}: the table is empty (shape {table.shape})")
        if not is_fastembeds_own(table.format):  # a copy of one of fastembed's (pickled, say) reloads as it
            raise ValueError(f"{path}: GGUF and safetensors files hold fastembed's block formats "
                             f"({', '.join(FORMATS)}), not the caller's format {table.format.name!r}: "
                             "the loaders would not know how to dequantize it")
        return table
    adapter = None if isinstance(table, np.ndarray) else adapter_of(table)
    if adapter is None and not isinstance(table, np.ndarray):
        raise TypeError(f"{path}: save_table writes host tables (numpy arrays, np.memmaps, torch CPU tensors, JAX CPU "
                        f"arrays, QuantizedTables), not a {type(table).__module__}.{type(table).__qualname__}")
    if adapter is not None and adapter.device(table) == "cpu":
        table = adapter.snapshot(table)  # bfloat16 and float8 tensors too, which np.asarray cannot take
    try:
        array = np.asarray(table).view()  # a view of its own: another thread may reassign the caller's shape or dtype
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{path}: save_table writes host tables, got {type(table).__module__}.{type(table).__qualname__} "
                        f"(copy it to the host first): {error}") from None
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(f"{path}: a table is a non-empty 2-D array, got shape {array.shape}")
    return array  # big-endian or column-major arrays are converted chunk by chunk as they are written


def _write_gguf(path: Any, table: np.ndarray | QuantizedTable, name: str) -> None:
    """A GGUF v3 file: general.alignment (and general.quantization_version for a quantized tensor), one tensor, its rows.

    No general.architecture: the file holds a table, not a model of any architecture.
    """
    if isinstance(table, QuantizedTable):
        ggml_type, rows, dim = table.format.ggml_type, table.data, table.dim
        if ggml_type is None:  # fastembed's own formats only reach here (see _host_table)
            raise ValueError(f"{path}: GGUF has no type for {table.format.name} tables; save it as .safetensors")
    else:
        ggml_type, rows, dim = _GGUF_DENSE.get(table.dtype.name), table, table.shape[1]
        if ggml_type is None:
            raise ValueError(f"{path}: GGUF holds float32, float16 and bfloat16 tables, not {table.dtype}; "
                             "save it as .safetensors")
    encoded = name.encode("utf-8")
    if len(encoded) > GGML_NAME_BYTES or b"\0" in encoded:
        problem = "holds a NUL" if b"\0" in encoded else f"is {len(encoded)} bytes long"
        raise ValueError(f"{path}: the tensor name {problem}; a GGUF tensor name is at most {GGML_NAME_BYTES} bytes of "
                         "UTF-8 with no NUL (llama.cpp's reader refuses a longer one and cuts one at a NUL): pass "
                         "a shorter name or save as .safetensors")
    head = _gguf_header(name, dim, rows.shape[0], ggml_type, isinstance(table, QuantizedTable))
    data_bytes = rows.shape[0] * rows.shape[1] * rows.dtype.itemsize

    def write(temporary: str) -> None:
        with open(temporary, "wb") as handle:
            handle.write(head)
            _write_rows(handle, rows)
            handle.write(b"\0" * (-data_bytes % DEFAULT_ALIGNMENT))
        _check_readable(path, temporary, name, ".gguf")

    _replace(path, write)


def _gguf_string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _gguf_header(name: str, dim: int, vocab_size: int, ggml_type: int, quantized: bool) -> bytes:
    """Everything before the data, padded to the alignment; dims are innermost first: ``[dim, vocab_size]``."""
    entries = [(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)]
    if quantized:  # the GGUF specification requires it wherever a tensor is quantized
        entries.append((QUANTIZATION_VERSION_KEY, GGML_QUANTIZATION_VERSION))
    metadata = b"".join(_gguf_string(key) + struct.pack("<II", UINT32_TYPE, value) for key, value in entries)
    tensor = _gguf_string(name.encode("utf-8")) + struct.pack("<IQQIQ", 2, dim, vocab_size, ggml_type, 0)
    head = MAGIC + struct.pack("<IQQ", 3, 1, len(entries)) + metadata + tensor
    return head + b"\0" * (-len(head) % DEFAULT_ALIGNMENT)


def _write_rows(handle: Any, rows: np.ndarray) -> None:
    """Write the bytes of `rows` (2-D) in row-major order and little-endian, :data:`_CHUNK_BYTES` at a time.

    Rows already in that order are written from their own memory; others are converted one chunk at a time,
    each dropped before the next is made.
    """
    little = rows.dtype.newbyteorder("<")  # the same dtype where it already is little-endian (or has no order)
    step = max(1, _CHUNK_BYTES // max(1, rows.shape[1] * rows.dtype.itemsize))
    for start in range(0, rows.shape[0], step):
        chunk = np.ascontiguousarray(rows[start:start + step], dtype=little)
        handle.write(chunk.reshape(-1).view(np.uint8).data)
        del chunk


def _write_safetensors(path: Any, table: np.ndarray | QuantizedTable, name: str) -> None:
    """The table as safetensors tensors, with the metadata that lets the loaders find and rebuild it."""
    if name == METADATA_KEY:
        raise ValueError(f"{path}: a safetensors tensor cannot be named {METADATA_KEY!r}, the header's key for its "
                         "metadata; pass another name")
    metadata = {TENSOR_KEY: name}
    if isinstance(table, QuantizedTable):
        tensors: dict[str, tuple[str, list[int], np.ndarray]] = {name: ("U8", list(table.data.shape), table.data)}
        metadata.update({FORMAT_KEY: table.format.name, DIM_KEY: str(table.dim)})
        if table.scales is not None:
            tensors[name + SCALES_SUFFIX] = ("F32", [table.scales.shape[0]], table.scales.reshape(-1, 1))
    else:
        code = _SAFETENSORS_CODES.get(table.dtype.name)
        if code is None:
            raise ValueError(f"{path}: a safetensors file holds {', '.join(sorted(_SAFETENSORS_CODES))} tables, "
                             f"not {table.dtype}")
        tensors = {name: (code, list(table.shape), table)}
    # As the safetensors package lays tensors out: widest dtype first, then by name, so every tensor starts aligned.
    tensors = dict(sorted(tensors.items(), key=lambda item: (-item[1][2].dtype.itemsize, item[0])))
    header: dict[str, Any] = {METADATA_KEY: dict(sorted(metadata.items()))}
    begin = 0
    for tensor, (code, shape, rows) in tensors.items():
        end = begin + rows.size * rows.dtype.itemsize
        header[tensor] = {"dtype": code, "shape": shape, "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")  # the name is text: checked
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors package writes it

    def write(temporary: str) -> None:
        with open(temporary, "wb") as handle:
            handle.write(struct.pack("<Q", len(text)) + text)
            for _, _, rows in tensors.values():
                _write_rows(handle, rows)
        _check_readable(path, temporary, name, ".safetensors")

    _replace(path, write)


def _replace(path: Any, write: Callable[[str], None]) -> None:
    """Write a new file beside `path` with `write` (given its name), then rename it over `path`."""
    parent, base = os.path.split(path)
    if not base:
        raise IsADirectoryError(errno.EISDIR, "a path ending in a separator names a directory, not a file to write",
                                os.fspath(path))
    try:
        existing: os.stat_result | None = os.stat(path)  # follows a link: a link to a directory is refused as one
    except OSError as error:
        # A dangling or looping link at the destination is replaced like any link; other errors are refused
        # before the table is written, not at the rename after it.
        if error.errno not in (errno.ENOENT, errno.ELOOP) or (error.errno == errno.ELOOP and not os.path.islink(path)):
            raise OSError(error.errno, error.strerror, os.fspath(path)) from None
        existing = None
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file to write", os.fspath(path))
    folder = parent or os.curdir
    try:
        folder_mode = os.stat(folder).st_mode
    except OSError as error:
        raise OSError(error.errno, f"cannot write a file beside it: {error.strerror}", os.fspath(path)) from None
    if not stat.S_ISDIR(folder_mode):
        raise NotADirectoryError(errno.ENOTDIR, "cannot write a file beside it: its folder is not a directory",
                                 os.fspath(path))
    # The destination's name begins the temporary file's, cut (at a character) so that a name near the limit fits.
    prefix = os.fsencode(base)[:_TEMPORARY_PREFIX_BYTES].decode("utf-8", "ignore")
    temporary_name = f".{prefix}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    directory = _folder_safe_from_chdir(folder, temporary_name)
    destination, temporary = os.path.join(directory, base), os.path.join(directory, temporary_name)
    # A new file gets 0o666 less the umask, as any new file; a replacement is private until it takes the old mode,
    # since a descriptor opened meanwhile would keep reading it.
    replaces_a_file = existing is not None and stat.S_ISREG(existing.st_mode)
    not_created: OSError | None = None
    try:
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if replaces_a_file else 0o666)
        except OSError as error:  # nothing was created (O_EXCL): a file of that name is not this call's to remove
            not_created = OSError(error.errno, f"cannot write a file beside it: {error.strerror}", os.fspath(path))
            raise not_created from None
        try:
            created_mode = stat.S_IMODE(os.fstat(descriptor).st_mode)
        finally:
            os.close(descriptor)
        # A umask may leave the owner unable to write or read the file, which the write and the check below need.
        os.chmod(temporary, created_mode | stat.S_IRUSR | stat.S_IWUSR)
        # A file replaced keeps its permissions; anything else (a device a link points at, say) does not lend its own.
        mode = existing.st_mode if existing is not None and replaces_a_file else created_mode
        write(temporary)
        _flush_to_disk(temporary)  # else a crash after the rename could leave the path holding a part of the file
        os.chmod(temporary, mode)  # after the flush, which opens it for writing: the old mode may be read-only
        try:
            os.replace(temporary, destination)
        except OSError as error:  # named by the destination, not by the temporary file's name
            raise OSError(error.errno, error.strerror, os.fspath(path)) from None
    except BaseException as error:
        if error is not not_created:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise
    _flush_to_disk(directory, folder=True)  # the rename itself


def _folder_safe_from_chdir(folder: str, name: str) -> str:
    """`folder` as a path that another thread's ``os.chdir`` cannot move: absolute, unless that would not fit.

    The current folder is joined to it as it is, not normalised, so the system still resolves a link, then
    ``..``, as ``open()`` would. A relative folder stays relative where the absolute path of `name` in it
    would pass the system's length limit (a folder deeper than that, where ``open()`` of the relative path
    works), or where the current folder cannot be told.
    """
    if os.path.isabs(folder):
        return folder
    try:
        absolute = os.path.join(os.getcwd(), folder)
    except OSError:  # the current folder was removed: only the relative path still reaches it
        return folder
    try:
        limit = os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no limit to tell (Windows has no pathconf)
        return absolute
    return absolute if len(os.fsencode(os.path.join(absolute, name))) < limit else folder


def _flush_to_disk(path: str, folder: bool = False) -> None:
    """fsync `path`: a file (through a writable descriptor, as Windows needs), or, at best, a folder.

    A folder's sync only makes a rename durable sooner: the table is in place by then, so its failure (a
    folder that cannot be opened or synced, Windows) is let be.
    """
    if not folder:
        handle = os.open(path, os.O_RDWR)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
        return
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no O_DIRECTORY (Windows)
        handle = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
