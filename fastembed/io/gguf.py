"""GGUF files (llama.cpp): the header checked in bounded memory and time, one 2-D tensor memory-mapped.

Layout, little-endian, the same in versions 2 and 3::

    "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x     (string key | u32 value type | value)
    tensor_count x (string name | u32 n_dims | n_dims x u64 dims, innermost first | u32 ggml type | u64 offset)
    padding to general.alignment (default 32) | data

A string is a u64 byte length and its UTF-8 bytes; an array value is a u32
item type, a u64 count and the items. Tensor offsets count from the start of
the data and are multiples of the alignment. A token table is
``[n_embd, n_vocab]`` in the file (dims innermost first): its rows are the
n_vocab axis.

Every length and count is checked against the bytes left before it is used,
so a hostile file costs time linear in its header (at most
:data:`MAX_GGUF_HEADER_BYTES`) and memory of 1 MiB or about twice its header,
whichever is more (never more than that limit), and a few names; metadata values are skipped,
never built. The header is read into memory as the scan reaches it, never
mapped: a file cut short meanwhile is an error, not a signal that kills the
process. Every malformed file raises ValueError
naming the file and the problem.
"""
from __future__ import annotations

import os
import struct
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from ..formats import FORMATS, BlockFormat, QuantizedTable
from ..tables import resolve_dtype
from ._files import FileIdentity, _changed, check_tensor_name, describe, map_file, opened, shorten

_OPENER = "fastembed.Embedding.from_gguf"
#: The tensor ``map_gguf`` opens when no name is given: llama.cpp's token embedding.
TOKEN_EMBEDDING = "token_embd.weight"
#: The most bytes of metadata and tensor list read before the data. Real files hold a
#: few MB (a tokenizer's vocabulary and merges); the limit bounds a hostile file's cost.
MAX_GGUF_HEADER_BYTES = 64 * 2**20
#: The most metadata entries accepted (real files have under a hundred; a tokenizer's
#: vocabulary is one entry, an array).
MAX_METADATA_ENTRIES = 65_536
#: The most tensors accepted (real files have a few thousand at most).
MAX_TENSORS = 262_144
#: The longest tensor name the loader accepts from other writers' files (ggml's own limit is 63 bytes).
MAX_NAME_BYTES = 4096
#: The longest tensor name save_table writes, in UTF-8 bytes: ggml's limit (a buffer of 64 with the closing NUL).
GGML_NAME_BYTES = 63
#: The most dimensions a ggml tensor has.
MAX_DIMS = 4
#: The alignment of the data when the file does not set ``general.alignment``.
DEFAULT_ALIGNMENT = 32
#: The bytes every GGUF file starts with.
MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_INT64_MAX = 2**63 - 1

#: ggml type code -> (name, values per block, bytes per block), as llama.cpp defines them.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
#: Dense ggml types fastembed maps as arrays, by code (little-endian; bfloat16 through ml_dtypes).
DENSE_TYPES = {0: "<f4", 1: "<f2", 30: "bfloat16"}
#: Block formats by ggml type code.
QUANTIZED_TYPES: dict[int, BlockFormat] = {fmt.ggml_type: fmt for fmt in FORMATS.values() if fmt.ggml_type is not None}

# Metadata value types: fixed sizes, and the two variable ones.
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
#: The metadata value type of a uint32.
UINT32_TYPE = 4
#: The metadata key of the data's alignment.
ALIGNMENT_KEY = b"general.alignment"
# The fewest bytes one metadata entry and one tensor description take (empty names, a u8 value, no dims).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_U64_ARRAYS = [struct.Struct(f"<{count}Q") for count in range(MAX_DIMS + 1)]
_TYPE_OFFSET = struct.Struct("<IQ")


def ggml_type_name(code: int) -> str:
    """The GGUF name of a ggml type code ("Q8_0"), or ``"type code N"`` for a code ggml does not define.

    Example:
        >>> from fastembed.io import ggml_type_name
        >>> ggml_type_name(8), ggml_type_name(99)
        ('Q8_0', 'type code 99')
    """
    known = GGML_TYPES.get(code)
    return known[0] if known is not None else f"type code {code}"


class GGUFTensor(NamedTuple):
    """One tensor description of a GGUF header, checked.

    Attributes:
        name: the tensor's name.
        dims: its dimensions, innermost first (``(n_embd, n_vocab)`` for a token table).
        ggml_type: its ggml type code.
        offset: its first byte in the file (the data section's start plus its offset).
    """

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


class _Reader:
    """A position in the file's bytes that never moves past the header limit or the file's end.

    `buffer` holds the file's first bytes; with `source` (the file open at
    their end) the rest are read from it as positions reach them, in
    growing pieces, up to the limit.
    """

    def __init__(self, path: Any, buffer: bytes, size: int, source: BinaryIO | None = None) -> None:
        self.path, self.size, self._source = path, size, source
        self.buffer = bytearray(buffer)
        self.limit = min(size, MAX_GGUF_HEADER_BYTES)
        self.pos = 0

    def _load(self, end: int) -> None:
        """Read on to byte `end` (at most the limit) at least, and as far again as is read already."""
        have = len(self.buffer)
        if self._source is None or end <= have:
            return
        self.buffer += self._source.read(min(self.limit, max(end, 2 * have, 2**20)) - have)
        if len(self.buffer) < end:  # the file is shorter than when it was opened
            raise _changed(self.path)

    def fail(self, problem: str) -> ValueError:
        return ValueError(f"{self.path}: {problem}")

    def take(self, count: int, what: Any) -> int:
        """Move past `count` bytes of `what` (a string, or a function making it); returns where they start."""
        start = self.pos
        if count > self.limit - start:
            raise self._beyond(start, count, what)
        self.pos = start + count
        if self.pos > len(self.buffer):
            self._load(self.pos)
        return start

    def _beyond(self, start: int, count: int, what: Any) -> ValueError:
        what = what() if callable(what) else what
        if start + count > self.size:
            return self.fail(f"truncated GGUF file: {what} at byte {start} needs {count} bytes, "
                             f"the file ends at byte {self.size}")
        return self.fail(f"the GGUF header (metadata and tensor list) runs past fastembed's limit of "
                         f"{MAX_GGUF_HEADER_BYTES} bytes at {what} (real files hold a few MB; "
                         "see fastembed.io.gguf.MAX_GGUF_HEADER_BYTES)")

    def u32(self, what: Any) -> int:
        return int(_U32.unpack_from(self.buffer, self.take(4, what))[0])

    def u64(self, what: Any) -> int:
        return int(_U64.unpack_from(self.buffer, self.take(8, what))[0])

    def string(self, what: Any) -> tuple[int, int]:
        """Move past a string; returns (where its bytes start, its length)."""
        length = self.u64(what)
        return self.take(length, what), length

    def skip_strings(self, count: int, what: Any) -> None:
        """Move past `count` strings (an array of them), reading only their lengths."""
        buffer, pos, limit, unpack = self.buffer, self.pos, self.limit, _U64.unpack_from
        loaded = len(buffer)
        for _ in range(count):
            if pos + 8 > loaded:
                if pos + 8 > limit:
                    raise self._beyond(pos, 8, what)
                self._load(pos + 8)
                loaded = len(buffer)  # the same bytearray, extended
            pos += 8 + unpack(buffer, pos)[0]
        if pos > limit:
            raise self._beyond(self.pos, pos - self.pos, what)
        self.pos = pos

    def text(self, start: int, length: int, limit: int = 200) -> str:
        """Bytes of the file as text for messages, cut to `limit` bytes."""
        return bytes(self.buffer[start:start + min(length, limit)]).decode("utf-8", "replace")


def _header_counts(reader: _Reader, head: bytes) -> tuple[int, int, int]:
    """Check the magic and version; returns (version, tensor_count, kv_count)."""
    if not head.startswith(MAGIC):
        looks = describe(reader.path, head)
        raise reader.fail(f"not a GGUF file: it {looks}" if looks else
                          f"not a GGUF file (no 'GGUF' magic); {_OPENER} opens .gguf files")
    reader.take(4, "the magic")
    version = reader.u32("the version")
    if version not in _VERSIONS:
        if version & 0xFFFF == 0 and (version >> 24) in _VERSIONS:
            raise reader.fail(f"a big-endian GGUF file (version {version >> 24}); fastembed reads little-endian GGUF files")
        old = " (version 1 counted in 32 bits; convert it with a current llama.cpp)" if version == 1 else ""
        raise reader.fail(f"GGUF version {version}{old} is not supported; fastembed reads versions 2 and 3")
    tensor_count = reader.u64("the tensor count")
    kv_count = reader.u64("the metadata count")
    room = reader.size - reader.pos
    if kv_count > MAX_METADATA_ENTRIES:
        raise reader.fail(f"the header lists {kv_count} metadata entries, over fastembed's limit of "
                          f"{MAX_METADATA_ENTRIES} (real files have under a hundred)")
    if tensor_count > MAX_TENSORS:
        raise reader.fail(f"the header lists {tensor_count} tensors, over fastembed's limit of {MAX_TENSORS} "
                          "(real files have a few thousand at most)")
    if kv_count > room // _MIN_KV_BYTES:
        raise reader.fail(f"the header lists {kv_count} metadata entries, more than the file's {reader.size} bytes can hold")
    if tensor_count > (room - kv_count * _MIN_KV_BYTES) // _MIN_TENSOR_BYTES:
        raise reader.fail(f"the header lists {tensor_count} tensors, more than the file's {reader.size} bytes can hold")
    return version, tensor_count, kv_count


def _skip_value(reader: _Reader, value_type: int, key: Any) -> None:
    """Move past one metadata value of `value_type` (arrays of arrays are refused, as llama.cpp does).

    `key` makes the entry's key for messages; it is called only when one is raised.
    """
    size = _VALUE_SIZES.get(value_type)
    if size is not None:
        reader.take(size, lambda: f"the value of {key()!r}")
    elif value_type == _STRING:
        reader.string(lambda: f"the value of {key()!r}")
    elif value_type == _ARRAY:
        _skip_array(reader, key)
    else:
        raise reader.fail(f"metadata {key()!r} has unknown value type {value_type}")


def _skip_array(reader: _Reader, key: Any) -> None:
    """Move past an array value: its item type, its count and its items."""
    item_type = reader.u32(lambda: f"the item type of {key()!r}")
    count = reader.u64(lambda: f"the item count of {key()!r}")
    size = _VALUE_SIZES.get(item_type)
    if item_type == _STRING:
        size = 8  # each string's length, at least
    elif item_type == _ARRAY:
        raise reader.fail(f"metadata {key()!r} is an array of arrays, which fastembed does not read (nor does llama.cpp)")
    elif size is None:
        raise reader.fail(f"metadata {key()!r} is an array of unknown value type {item_type}")
    if count > (reader.limit - reader.pos) // size:
        raise reader._beyond(reader.pos, count * size, f"the {count} items of {key()!r}")
    if item_type == _STRING:
        reader.skip_strings(count, lambda: f"the strings of {key()!r}")
    else:
        reader.take(count * size, "")


def _read_metadata(reader: _Reader, kv_count: int) -> int:
    """Move past every metadata entry; returns the data alignment (``general.alignment``, else 32)."""
    alignment = None
    for index in range(kv_count):
        key_start, key_length = reader.string(lambda index=index: f"the key of metadata entry {index}")

        def key(start: int = key_start, length: int = key_length) -> str:
            return reader.text(start, length, 80)

        value_type = reader.u32(lambda: f"the value type of {key()!r}")
        if key_length != len(ALIGNMENT_KEY) or reader.buffer[key_start:key_start + key_length] != ALIGNMENT_KEY:
            _skip_value(reader, value_type, key)
            continue
        if alignment is not None:
            raise reader.fail("general.alignment is given twice")
        if value_type != UINT32_TYPE:
            raise reader.fail(f"general.alignment must be a uint32 (GGUF value type 4), not value type {value_type}")
        alignment = reader.u32("general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
            raise reader.fail(f"general.alignment {alignment} is not a power of two")
    return DEFAULT_ALIGNMENT if alignment is None else alignment


def _read_tensor(reader: _Reader, index: int, alignment: int) -> tuple[bytes, tuple[int, ...], int, int]:
    """One tensor description: (name bytes, dims, ggml type code, offset in the data), checked in itself."""
    def what() -> str:
        return f"the description of tensor {index}"

    name_start, name_length = reader.string(what)
    if name_length > MAX_NAME_BYTES:
        raise reader.fail(f"tensor {index}'s name is {name_length} bytes long, over fastembed's limit of {MAX_NAME_BYTES}")
    raw_name = bytes(reader.buffer[name_start:name_start + name_length])
    n_dims = reader.u32(what)
    if n_dims > MAX_DIMS:
        raise reader.fail(f"tensor {_quoted(raw_name)} has {n_dims} dimensions; ggml tensors have at most {MAX_DIMS}")
    dims = _U64_ARRAYS[n_dims].unpack_from(reader.buffer, reader.take(8 * n_dims, what))
    elements = 1
    for size in dims:
        elements *= size
    if elements > _INT64_MAX or any(size > _INT64_MAX for size in dims):
        raise reader.fail(f"tensor {_quoted(raw_name)} has dimensions {list(dims)}, whose product overflows 64 bits")
    ggml_type, offset = _TYPE_OFFSET.unpack_from(reader.buffer, reader.take(12, what))
    if offset % alignment:
        raise reader.fail(f"tensor {_quoted(raw_name)} starts at data offset {offset}, "
                          f"not a multiple of the alignment {alignment}")
    return raw_name, dims, ggml_type, offset


def _quoted(raw_name: bytes) -> str:
    return repr(raw_name[:200].decode("utf-8", "replace"))


def scan_gguf(path: str | os.PathLike, name: str | None = TOKEN_EMBEDDING) -> GGUFTensor:
    """Check a GGUF file's header and find one tensor's description.

    Args:
        path: the ``.gguf`` file.
        name: the tensor to find; None: ``token_embd.weight``.

    Returns:
        The tensor's name, dims, ggml type and absolute file offset. Its bytes
        are not checked against the file here (see :func:`map_gguf`).

    Raises:
        TypeError: `path` is not a path, or `name` not a string.
        FileNotFoundError: no file at `path`.
        ValueError: a directory; not a GGUF file (saying what it looks like); a
            version other than 2 and 3, a big-endian file; truncated; counts the file
            cannot hold; a header over :data:`MAX_GGUF_HEADER_BYTES`; an unknown
            metadata value type; a bad general.alignment; a tensor with more than 4
            dims, dims whose product overflows, an offset not a multiple of the
            alignment; no tensor `name`, listing candidates; `name` given twice.

    Example:
        >>> import numpy as np, os, shutil, tempfile
        >>> from fastembed.io import save_table
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "model.gguf")
        >>> save_table(path, np.ones((4, 8), np.float16))
        >>> from fastembed.io import scan_gguf
        >>> tensor = scan_gguf(path)
        >>> tensor.name, tensor.dims
        ('token_embd.weight', (8, 4))
        >>> shutil.rmtree(folder)
    """
    return _scan_file(path, name)[0]


def _scan_file(path: str | os.PathLike, name: str | None) -> tuple[GGUFTensor, FileIdentity]:
    """:func:`scan_gguf`, and the file the header was read from (the tensor is mapped from it only)."""
    check_tensor_name(path, name)
    name = TOKEN_EMBEDDING if name is None else name
    with opened(path, _OPENER) as (handle, identity):
        head = handle.read(24)
        if len(head) < 24 or not head.startswith(MAGIC):
            _header_counts(_Reader(path, head, len(head)), head)  # raises: not GGUF, or truncated
        return _scan(_Reader(path, head, identity.size, handle), head, name), identity


def _scan(reader: _Reader, head: bytes, name: str) -> GGUFTensor:
    _, tensor_count, kv_count = _header_counts(reader, head)
    alignment = _read_metadata(reader, kv_count)
    wanted = name.encode("utf-8")
    found: tuple[tuple[int, ...], int, int] | None = None
    found_index = -1
    extents = np.empty((tensor_count, 2), np.uint64)  # each tensor's bytes in the data: [start, end)
    tensors_start = reader.pos
    sample: list[str] = []
    near: list[str] = []
    for index in range(tensor_count):
        raw_name, dims, ggml_type, offset = _read_tensor(reader, index, alignment)
        extents[index] = offset, min(offset + _data_bytes(dims, ggml_type), _U64_MAX)
        if raw_name == wanted:
            if found is not None:
                raise reader.fail(f"tensor {name!r} is listed twice")
            found, found_index = (dims, ggml_type, offset), index
        elif len(sample) < 12 or len(near) < 12:
            text = raw_name.decode("utf-8", "replace")
            if len(sample) < 12:
                sample.append(text)
            if len(near) < 12 and ("embd" in text or "embed" in text):
                near.append(text)
    if found is None:
        raise reader.fail(f"no tensor named {name!r}; tensors named like an embedding: {shorten(near)}; "
                          f"the first tensors: {shorten(sample, tensor_count)}")
    data_start = -(-reader.pos // alignment) * alignment
    _check_apart(reader, extents, found_index, tensors_start, alignment, name)
    dims, ggml_type, offset = found
    return GGUFTensor(name, dims, ggml_type, data_start + offset)


_U64_MAX = 2**64 - 1


def _data_bytes(dims: tuple[int, ...], ggml_type: int) -> int:
    """The bytes a tensor of `dims` and `ggml_type` takes in the data.

    A type ggml does not define counts its first byte, all that is known of it.
    """
    known = GGML_TYPES.get(ggml_type)
    if known is None:
        return 1
    elements = 1
    for size in dims:
        elements *= size
    _, block_values, block_bytes = known
    return -(-elements // block_values) * block_bytes


def _check_apart(reader: _Reader, extents: np.ndarray, index: int, tensors_start: int, alignment: int,
                 name: str) -> None:
    """Refuse a table whose bytes share any with another tensor's (llama.cpp refuses any layout but one after another).

    A tensor of a type ggml does not define is known by its first byte only.
    """
    start, end = extents[index]
    starts, ends = extents[:, 0], extents[:, 1]
    sharing = ((starts < end) & (start < ends)) | ((start < starts) & (starts < end))
    sharing[index] = False
    if sharing.any():
        other = int(np.argmax(sharing))
        reader.pos = tensors_start
        for position in range(other + 1):
            other_name = _read_tensor(reader, position, alignment)[0]
        raise reader.fail(f"tensor {name!r} (bytes {start} to {end} of the data) shares bytes with tensor "
                          f"{_quoted(other_name)} (bytes {starts[other]} to {ends[other]}): a GGUF file's tensors "
                          "lie one after another")


def _check_table(path: Any, tensor: GGUFTensor, file_size: int) -> tuple[int, int, int]:
    """Check that `tensor` is a 2-D table fastembed reads, inside the file; returns (n_vocab, n_embd, row bytes)."""
    where = f"{path}: tensor {tensor.name!r}"
    if len(tensor.dims) != 2:
        raise ValueError(f"{where} has {len(tensor.dims)} dimensions {list(tensor.dims)}; an embedding table is 2-D")
    n_embd, n_vocab = tensor.dims
    if tensor.ggml_type not in DENSE_TYPES and tensor.ggml_type not in QUANTIZED_TYPES:
        readable = [GGML_TYPES[code][0] for code in (*DENSE_TYPES, *QUANTIZED_TYPES)]
        name = ggml_type_name(tensor.ggml_type)
        raise ValueError(f"{where} has {name if name.startswith('type code') else 'type ' + name}, which fastembed does not read; "
                         f"it reads {', '.join(readable)}")
    if n_embd == 0 or n_vocab == 0:
        raise ValueError(f"{where} is empty (dims {list(tensor.dims)})")
    type_name, block_values, block_bytes = GGML_TYPES[tensor.ggml_type]
    if n_embd % block_values:
        raise ValueError(f"{where}: a {type_name} row holds a multiple of {block_values} values, not {n_embd}")
    row_bytes = n_embd // block_values * block_bytes
    if tensor.offset + n_vocab * row_bytes > file_size:
        raise ValueError(f"{where}: its {n_vocab * row_bytes} bytes ({n_vocab} rows of {row_bytes}) at byte "
                         f"{tensor.offset} go beyond the file ({file_size} bytes)")
    return n_vocab, n_embd, row_bytes


def map_gguf(path: str | os.PathLike, name: str | None = None) -> np.memmap | QuantizedTable:
    """Memory-map one 2-D tensor of a GGUF file (version 2 or 3), read-only, without reading its data.

    Args:
        path: the ``.gguf`` file.
        name: the tensor; None opens llama.cpp's token embedding, ``token_embd.weight``.

    Returns:
        F32, F16 and BF16 tensors: a read-only np.memmap of shape ``(n_vocab, n_embd)``
        (BF16 as ml_dtypes.bfloat16). Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K:
        a :class:`~fastembed.formats.QuantizedTable` whose ``data`` is the read-only
        ``(n_vocab, row_bytes)`` uint8 np.memmap of the rows.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: as :func:`scan_gguf`; the tensor is not 2-D, is empty, has another
            type (named, "IQ2_XS"), a width that is not a whole number of blocks, or
            bytes beyond the end of the file.
        TypeError: a BF16 tensor needs ml_dtypes and it is missing.

    Example:
        >>> import numpy as np, os, shutil, tempfile
        >>> from fastembed.formats import QuantizedTable, FORMATS, quantize_rows
        >>> from fastembed.io import map_gguf, save_table
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "model.gguf")
        >>> rows, _ = quantize_rows(np.ones((10, 64), np.float32), FORMATS["q8_0"])
        >>> save_table(path, QuantizedTable(rows, "q8_0", 64))
        >>> map_gguf(path)
        QuantizedTable(q8_0, vocab_size=10, dim=64)
        >>> shutil.rmtree(folder)
    """
    tensor, identity = _scan_file(path, TOKEN_EMBEDDING if name is None else name)
    n_vocab, n_embd, row_bytes = _check_table(path, tensor, identity.size)
    if tensor.ggml_type in DENSE_TYPES:
        dtype = resolve_dtype(DENSE_TYPES[tensor.ggml_type])
        return map_file(path, dtype, tensor.offset, (n_vocab, n_embd), identity=identity)
    data = map_file(path, np.uint8, tensor.offset, (n_vocab, row_bytes), identity=identity)
    return QuantizedTable(data, QUANTIZED_TYPES[tensor.ggml_type], n_embd)
