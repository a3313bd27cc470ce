"""safetensors files: the header checked entry by entry in bounded memory, one tensor memory-mapped.

Layout: 8 bytes little-endian header length N, then N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
(padded with spaces), then the data; offsets count from the first byte after
the header.

Every malformed or hostile file raises ValueError naming the problem; no
offset is trusted before it has been checked against the file's size.

What a header may cost is bounded, whatever its content:

* at most :data:`MAX_HEADER_BYTES` (16 MiB) of header is read, and decoded
  once (the format itself allows 100 MB; real headers are far smaller: see
  :data:`MAX_HEADER_BYTES` and docs/loading.md); a longer one is refused
  before it is read;
* entries are matched one at a time (a regular expression for the layout
  writers use, else a JSON parse of at most :data:`MAX_ENTRY_BYTES`
  characters), checked and dropped: only the entries the caller keeps (the
  tensor asked for, or the few named like a token embedding) stay in memory,
  plus 16 bytes of offsets per tensor for the overlap check; no deep nesting
  or long list is ever built;
* ``__metadata__`` is matched by a regular expression (string by string
  before Python 3.11) and not kept.

So opening a file costs at most about twice its header length in memory (the
bytes and the decoded text, or the text and its longest name) and time linear in the header
length, whatever the header holds.
"""
from __future__ import annotations

import json
import math
import os
import re
from array import array
from collections.abc import Callable, Mapping
from json.decoder import scanstring  # type: ignore[attr-defined]
from types import MappingProxyType
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from ..formats import QuantizedTable, block_format
from ..tables import resolve_dtype
from ._files import OPENS, FileIdentity, check_tensor_name, describe, map_file, opened, shorten

#: safetensors dtype codes -> numpy dtype names (ml_dtypes for BF16 and F8).
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}
_ITEMSIZES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
              "U16": 2}
#: safetensors dtypes that pack values into fewer bits than a byte (MX formats' elements), by bits per value: a
#: checkpoint may hold them beside its table; no numpy dtype holds them packed, so none is a table.
PACKED_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}

#: The largest header accepted. The format allows 100 MB; the largest real
#: headers are a few hundred KiB (one shard of a mixture-of-experts model),
#: and a header listing every one of DeepSeek-V3's ~92,000 tensors in a single
#: file would be about 11 MB.
MAX_HEADER_BYTES = 16 * 2**20
#: The longest JSON text of one tensor entry (a real one is under 150 bytes).
MAX_ENTRY_BYTES = 4096

#: The header's key of its metadata (a str -> str map), which no tensor may take.
METADATA_KEY = "__metadata__"
#: Keys of ``__metadata__`` that describe a table saved by fastembed (:func:`fastembed.io.save_table`):
#: the table's tensor, and for a quantized table its block format and its values per row.
#: The rows are the uint8 tensor; a format with row scales keeps them, float32, in ``<tensor>.scales``.
METADATA_PREFIX = "fastembed."
TENSOR_KEY = "fastembed.tensor"
FORMAT_KEY = "fastembed.format"
DIM_KEY = "fastembed.dim"
SCALES_SUFFIX = ".scales"
_FASTEMBED_KEYS = frozenset((TENSOR_KEY, FORMAT_KEY, DIM_KEY))

_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _string(text: str, pos: int, fail: Callable[[str], ValueError], what: str) -> tuple[str, int]:
    """The JSON string starting at `pos`, and the position after it and any whitespace; `fail` makes the error."""
    if text[pos:pos + 1] != '"':
        raise fail(f"expected {what} at character {pos}")
    try:
        value, pos = scanstring(text, pos + 1, True)
    except ValueError as error:
        raise fail(str(error)) from None
    return value, _skip_whitespace(text, pos)


def _skip_whitespace(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace."""
    match = _WHITESPACE.match(text, pos)
    return match.end() if match is not None else pos
_OPENER = "fastembed.Embedding.from_safetensors"


class TensorEntry(NamedTuple):
    """One checked tensor of a safetensors header.

    Attributes:
        dtype: the safetensors dtype code ("BF16", "F32", ...).
        shape: the tensor's shape.
        begin: first byte of its data, counted from the start of the data section.
        end: one past its last byte.
    """

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsHeader(NamedTuple):
    """What a header scan keeps.

    Attributes:
        entries: the tensors the scan was asked to keep, by name.
        data_start: the file offset of the data section (8 + header length).
        tensor_count: how many tensors the header lists in all.
        sample: the names of the first few tensors (for messages).
        metadata: the ``__metadata__`` entries fastembed writes (:data:`TENSOR_KEY`,
            :data:`FORMAT_KEY`, :data:`DIM_KEY`, see :func:`fastembed.io.save_table`);
            no other entry is kept.
    """

    entries: dict[str, TensorEntry]
    data_start: int
    tensor_count: int
    sample: list[str]
    metadata: Mapping[str, str] = MappingProxyType({})


class _ReadHeader(SafetensorsHeader):
    """A header read from a file, with that file: its tensors are mapped from it only (an attribute, not a field, so
    that the tuple stays as documented)."""

    identity: FileIdentity | None = None


def scan_safetensors_header(
    path: str | os.PathLike, keep: Callable[[str, TensorEntry], bool] = lambda name, entry: True, sample: int = 12
) -> SafetensorsHeader:
    """Check every entry of a safetensors header, keeping only those `keep` accepts.

    Args:
        path: the file.
        keep: called as ``keep(name, entry)`` for each checked entry (its name and its TensorEntry); the
            entry is kept when it returns True.
        sample: how many tensor names (in header order) to keep for messages.

    Returns:
        The kept entries, the data section's offset, the tensor count and a name sample.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: a directory; a file that is not safetensors (saying what it looks
            like: .npy, PyTorch zip or pickle, GGUF, HDF5, Flax msgpack, ONNX, an index
            JSON, text; else that its first 8 bytes are not a header length); a header
            longer than :data:`MAX_HEADER_BYTES` or than the file; invalid JSON; a
            bad dtype, shape or data_offsets (of any JSON type); overlapping tensors;
            a tensor name given twice among the kept ones.

    Example:
        >>> import numpy as np, os, shutil, tempfile
        >>> from fastembed.io import save_table
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "model.safetensors")
        >>> save_table(path, np.ones((4, 8), np.float16))
        >>> from fastembed.io import scan_safetensors_header
        >>> header = scan_safetensors_header(path)
        >>> sorted(header.entries), header.tensor_count
        (['weight'], 1)
        >>> shutil.rmtree(folder)
    """
    with opened(path, _OPENER) as (handle, identity):
        raw = _header_bytes(path, handle, identity.size)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: header is not valid JSON (not UTF-8: {error})") from None
    data_start = 8 + len(raw)
    del raw
    header = _ReadHeader(*_scan(path, text, data_start, identity.size - data_start, keep, sample))
    header.identity = identity
    return header


def _header_bytes(path: Any, handle: BinaryIO, file_size: int) -> bytes:
    """The header's bytes (after its 8-byte length), read through `handle` once its length is checked."""
    head = handle.read(64)
    if file_size < 8:
        raise ValueError(_not_safetensors(path, head, f"{file_size} bytes, shorter than the 8-byte header length"))
    header_length = int.from_bytes(head[:8], "little")
    if header_length > file_size - 8 and head[8:9] == b"{":
        raise ValueError(f"{path}: header length {header_length} goes beyond the file ({file_size} bytes): "
                         "a truncated safetensors file (an incomplete download?)")
    if header_length > file_size - 8:
        raise ValueError(_not_safetensors(
            path, head, f"its first 8 bytes ({head[:8].hex(' ')}) are not a header length: read as one, they give "
                        f"{header_length}, beyond the file's {file_size} bytes; {OPENS}"))
    if header_length > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: header length {header_length} is over fastembed's limit of {MAX_HEADER_BYTES} bytes "
                         "(real checkpoints' headers are under a few MB; see fastembed.io.safetensors.MAX_HEADER_BYTES)")
    if head[8:9] != b"{":
        raise ValueError(_not_safetensors(path, head, "the header must be a JSON object, starting with '{'"))
    handle.seek(8)
    raw = handle.read(header_length)
    if len(raw) != header_length:  # the size was checked on this very file: it shrank meanwhile
        raise ValueError(f"{path}: changed while it was being opened (it shrank); open it again")
    return raw


def _not_safetensors(path: Any, head: bytes, problem: str) -> str:
    looks = describe(path, head)
    if looks is not None and not looks.startswith("is a safetensors file"):
        return f"{path}: not a safetensors file: it {looks}"
    return f"{path}: not a safetensors file: {problem}"


def _scan(path: Any, text: str, data_start: int, data_size: int, keep: Callable[[str, TensorEntry], bool],
          sample_size: int, check_overlap: bool = True) -> SafetensorsHeader:
    def fail(problem: str) -> ValueError:
        return ValueError(f"{path}: header is not valid JSON: {problem}")

    length = len(text)
    pos = _skip_whitespace(text, 1)
    kept: dict[str, TensorEntry] = {}
    # Every name's hash (8 bytes, not the name): a name listed twice is refused, as safetensors refuses it,
    # whatever is kept, in memory bounded by the header's own length.
    name_hashes = array("q")
    sample: list[str] = []
    begins, ends = array("q"), array("q")
    tensor_count = 0
    seen_metadata = False
    metadata: dict[str, str] = {}
    if pos < length and text[pos] == "}":
        pos += 1
    else:
        while True:
            name, pos = _string(text, pos, fail, "a tensor name in double quotes")
            if pos >= length or text[pos] != ":":
                raise fail(f"expected ':' after {name[:80]!r}")
            pos = _skip_whitespace(text, pos + 1)
            if name == METADATA_KEY:
                if seen_metadata:
                    raise ValueError(f"{path}: __metadata__ is given twice")
                seen_metadata = True
                start, pos = pos, _skip_metadata(path, text, pos)
                # fastembed's keys are in the text as they are, unless spelled with \u escapes.
                if text.find(METADATA_PREFIX, start, pos) != -1 or text.find("\\u", start, pos) != -1:
                    _skip_metadata_slowly(path, text, start, metadata)
            else:
                entry, pos = _entry(path, name, text, pos, data_size)
                name_hashes.append(hash(name))
                tensor_count += 1
                if len(sample) < sample_size:
                    sample.append(name)
                if entry.end > entry.begin:
                    begins.append(entry.begin)
                    ends.append(entry.end)
                if keep(name, entry):
                    kept[name] = entry  # a name listed twice is refused below
            pos = _skip_whitespace(text, pos)
            if pos < length and text[pos] == ",":
                pos = _skip_whitespace(text, pos + 1)
                continue
            if pos < length and text[pos] == "}":
                pos += 1
                break
            raise fail(f"expected ',' or '}}' at character {pos}")
    if text[pos:].strip(" \t\n\r"):
        raise fail(f"extra data after the header object at character {pos}")
    _refuse_repeated_names(path, name_hashes, [*kept, *sample])
    if check_overlap:
        _check_overlap(path, text, begins, ends)
    return SafetensorsHeader(kept, data_start, tensor_count, sample, metadata)


def _unique_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's fields, refusing one given twice (which value counts would be a guess; safetensors refuses it)."""
    fields: dict[str, Any] = {}
    for key, value in pairs:
        if key in fields:
            raise ValueError(f"field {_short_repr(key)} is given twice")
        fields[key] = value
    return fields


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_fields)
_WS = r"[ \t\n\r]*"
_DIGITS = r"(?:0|[1-9]\d{0,19})"
_INT = _WS + "(" + _DIGITS + ")" + _WS
#: An entry as safetensors writers lay it out (any whitespace): parsed without building JSON objects.
#: Each whitespace run is followed by a character that is none, so a match costs time linear in the entry.
_CANONICAL_ENTRY = re.compile(
    r"\{" + _WS + r'"dtype"' + _WS + ":" + _WS + r'"([A-Z0-9_]{1,16})"' + _WS + "," + _WS + r'"shape"' + _WS + ":" + _WS
    + r"\[(" + _WS + "(?:" + _DIGITS + _WS + "(?:," + _WS + _DIGITS + _WS + ")*)?)" + r"\]" + _WS + "," + _WS
    + r'"data_offsets"' + _WS + ":" + _WS + r"\[" + _INT + "," + _INT + r"\]" + _WS + r"\}")


def _string_object_pattern() -> re.Pattern[str] | None:
    """An object of strings, matched by the regex engine without building a Python object.

    Needs possessive quantifiers (Python 3.11+), which keep no backtracking state over a
    16 MiB metadata object; None before 3.11, where a scanstring loop serves.
    """
    ws = "[ \t\n\r]*+"
    string = r'"(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+"'
    pair = string + ws + ":" + ws + string
    try:
        return re.compile(r"\{" + ws + "(?:" + pair + "(?:" + ws + "," + ws + pair + ")*+)?" + ws + r"\}")
    except re.error:
        return None


_STRING_OBJECT = _string_object_pattern()


def _entry(path: Any, name: str, text: str, pos: int, data_size: int) -> tuple[TensorEntry, int]:
    """Parse and check the entry object starting at text[pos]; returns it and the position after it.

    Only the next MAX_ENTRY_BYTES characters are parsed, so no entry can build more than
    a few hundred KiB of Python objects, whatever it nests.
    """
    canonical = _CANONICAL_ENTRY.match(text, pos, pos + MAX_ENTRY_BYTES)
    if canonical is not None:
        dtype_code, shape_text, begin_text, end_text = canonical.groups()
        shape = tuple(map(int, shape_text.split(","))) if shape_text.strip() else ()
        begin, end = int(begin_text), int(end_text)
        if dtype_code in SAFETENSORS_DTYPES and end <= data_size and (end - begin) * 8 == _data_bits(shape, dtype_code):
            return TensorEntry(dtype_code, shape, begin, end), canonical.end()
        entry = {"dtype": dtype_code, "shape": list(shape), "data_offsets": [begin, end]}
        return _checked_entry(f"{path}: tensor {name!r}", entry, data_size), canonical.end()  # raises
    where = f"{path}: tensor {name!r}"
    if text[pos:pos + 1] != "{":
        raise ValueError(f"{where}: entry must be an object")
    chunk = text[pos:pos + MAX_ENTRY_BYTES]
    try:
        entry, used = _DECODER.raw_decode(chunk)
    except (ValueError, RecursionError) as error:
        if len(chunk) == MAX_ENTRY_BYTES:
            raise ValueError(f"{where}: entry is not valid JSON within its first {MAX_ENTRY_BYTES} characters "
                             f"(a real entry is under 200): {error}") from None
        raise ValueError(f"{path}: header is not valid JSON: the entry of tensor {name!r}: {error}") from None
    return _checked_entry(where, entry, data_size), pos + used


def _checked_entry(where: str, entry: Any, data_size: int) -> TensorEntry:
    dtype_code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype_code, str) or not (dtype_code in SAFETENSORS_DTYPES or dtype_code in PACKED_BITS):
        raise ValueError(f"{where}: unknown dtype {_short_repr(dtype_code)}; known: "
                         f"{', '.join([*SAFETENSORS_DTYPES, *PACKED_BITS])}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative integers, got {_short_repr(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise ValueError(f"{where}: data_offsets must be two integers, got {_short_repr(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise ValueError(f"{where}: data_offsets {offsets} lie outside the data section (0..{data_size})")
    bits = _data_bits(shape, dtype_code)
    if (end - begin) * 8 != bits:
        size = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits (no whole number of bytes)"
        raise ValueError(f"{where}: shape {shape} x {dtype_code} is {size} but data_offsets span {end - begin} bytes")
    return TensorEntry(dtype_code, tuple(shape), begin, end)


def _data_bits(shape: Any, dtype_code: str) -> int:
    """Bits of a tensor's data (packed values may fill no whole byte, which no data_offsets can span)."""
    return math.prod(shape) * PACKED_BITS.get(dtype_code, 8 * _ITEMSIZES.get(dtype_code, 1))


def _refuse_repeated_names(path: Any, name_hashes: array, known: list[str]) -> None:
    """Raise ValueError when two tensor names hash alike: a name listed twice (named where it is among `known`)."""
    ordered = np.sort(np.frombuffer(name_hashes, dtype=np.int64))
    repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if repeated:
        named = [name for name in known if hash(name) in repeated]
        which = f"tensor {_short_repr(named[0])}" if named else "a tensor name"
        raise ValueError(f"{path}: {which} is listed twice in the header")


def _short_repr(value: Any, limit: int = 80) -> str:
    return _shortened(repr(value), limit)


def _shortened(text: str, limit: int) -> str:
    """`text`, cut after `limit` characters (a hostile header's values can be megabytes long)."""
    return text if len(text) <= limit else text[:limit] + "..."


def _skip_metadata(path: Any, text: str, pos: int) -> int:
    """Check that text[pos] starts an object of strings (not kept); returns the position after it."""
    if _STRING_OBJECT is not None:
        match = _STRING_OBJECT.match(text, pos)
        if match is None:
            raise ValueError(f"{path}: __metadata__ must be an object of strings (the format's str -> str map), "
                             f"got {text[pos:pos + 60]!r}...")
        return match.end()
    return _skip_metadata_slowly(path, text, pos)


def _skip_metadata_slowly(path: Any, text: str, pos: int, collect: dict[str, str] | None = None) -> int:
    """_skip_metadata one string at a time (Python 3.10); keeps fastembed's own entries in `collect`."""
    def fail(problem: str) -> ValueError:
        return ValueError(f"{path}: __metadata__ must be an object of strings (the format's str -> str map): {problem}")

    if text[pos:pos + 1] != "{":
        raise fail("it is not an object")
    pos = _skip_whitespace(text, pos + 1)
    if text[pos:pos + 1] == "}":
        return pos + 1
    while True:
        key, pos = _string(text, pos, fail, "a string key")
        if text[pos:pos + 1] != ":":
            raise fail(f"expected ':' at character {pos}")
        value, pos = _string(text, _skip_whitespace(text, pos + 1), fail, "a string value")
        if collect is not None and key in _FASTEMBED_KEYS:
            if len(value) > MAX_ENTRY_BYTES:
                raise ValueError(f"{path}: __metadata__ {key} is {len(value)} characters long, over {MAX_ENTRY_BYTES}")
            if key in collect:  # which one describes the table would be a guess (q4_0 and q4_k rows are one size)
                raise ValueError(f"{path}: __metadata__ gives {key} more than once")
            collect[key] = value
        if text[pos:pos + 1] == ",":
            pos = _skip_whitespace(text, pos + 1)
        elif text[pos:pos + 1] == "}":
            return pos + 1
        else:
            raise fail(f"expected ',' or '}}' at character {pos}")


def _check_overlap(path: Any, text: str, begins: array, ends: array) -> None:
    """Raise naming two tensors whose data overlap (16 bytes of memory per tensor)."""
    if len(begins) < 2:
        return
    begin_array = np.frombuffer(begins, dtype=np.int64)
    end_array = np.frombuffer(ends, dtype=np.int64)
    order = np.argsort(begin_array, kind="stable")
    overlaps = np.flatnonzero(begin_array[order][1:] < end_array[order][:-1])
    if overlaps.size:
        wanted = {int(order[overlaps[0]]), int(order[overlaps[0] + 1])}
        found: dict[int, str] = {}
        nonempty = iter(range(len(begins)))

        def keep(name: str, entry: TensorEntry) -> bool:
            if entry.end > entry.begin:
                index = next(nonempty)
                if index in wanted:
                    found[index] = name
            return False

        # A second pass, only to name the two tensors.
        _scan(path, text, 0, 1 << 62, keep, 0, check_overlap=False)
        first, second = (found.get(index, "?") for index in sorted(wanted, key=lambda i: begins[i]))
        raise ValueError(f"{path}: tensors {first!r} and {second!r} overlap in the data section")


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorEntry], int]:
    """Every checked tensor entry of a safetensors file, and the data's start offset.

    Keeps every entry (about 300 bytes of memory each); loaders use
    :func:`scan_safetensors_header`, which keeps only what they need.

    Args:
        path: a safetensors file.

    Returns:
        ``(entries, data_start)``: each tensor's :class:`TensorEntry` by name, and
        the file offset at which the tensors' data begins.

    Raises:
        FileNotFoundError, ValueError: as :func:`scan_safetensors_header`.

    Example:
        >>> import numpy as np, os, shutil, tempfile
        >>> from fastembed.io import save_table
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "model.safetensors")
        >>> save_table(path, np.ones((4, 8), np.float16))
        >>> from fastembed.io import read_safetensors_header
        >>> entries, data_start = read_safetensors_header(path)
        >>> entries["weight"].shape
        (4, 8)
        >>> shutil.rmtree(folder)
    """
    header = scan_safetensors_header(path)
    return header.entries, header.data_start


def map_tensor(path: str | os.PathLike, entry: TensorEntry, data_start: int, name: str,
               identity: FileIdentity | None = None) -> np.memmap:
    """Memory-map one checked 2-D tensor read-only (from the file `identity` names, when given: see :func:`map_file`).

    Raises:
        ValueError: the tensor is not 2-D or is empty; the file changed since its header was read.
        TypeError: BF16/F8 need ml_dtypes and it is missing.
    """
    if len(entry.shape) != 2:
        raise ValueError(f"{path}: tensor {name!r} has shape {list(entry.shape)}; an embedding table is 2-D")
    if 0 in entry.shape:
        raise ValueError(f"{path}: tensor {name!r} is empty (shape {list(entry.shape)})")
    if entry.dtype in PACKED_BITS:
        raise ValueError(f"{path}: tensor {name!r} is {entry.dtype}, which packs {PACKED_BITS[entry.dtype]}-bit values "
                         "into bytes; fastembed gathers tables of whole-byte values (and GGUF's block formats)")
    dtype = resolve_dtype(SAFETENSORS_DTYPES[entry.dtype])
    return map_file(path, dtype, data_start + entry.begin, entry.shape, identity=identity)


def _identity(header: SafetensorsHeader) -> FileIdentity | None:
    """The file `header` was read from (a header :func:`scan_safetensors_header` read), else None."""
    return header.identity if isinstance(header, _ReadHeader) else None


def map_entry(path: str | os.PathLike, header: SafetensorsHeader, name: str) -> np.memmap | QuantizedTable:
    """Memory-map the kept tensor `name`: a dense table, or the quantized table fastembed's metadata describes.

    A tensor the header's ``fastembed.tensor`` metadata names, with a
    ``fastembed.format``, is a :class:`~fastembed.formats.QuantizedTable`: its uint8
    rows, and for a format with row scales the float32 ``<name>.scales`` (which
    `header` must have kept), both mapped read-only.

    Raises:
        ValueError: as :func:`map_tensor`; fastembed metadata that does not fit the tensors.
        TypeError: BF16/F8 need ml_dtypes and it is missing.
    """
    metadata = header.metadata
    if metadata.get(TENSOR_KEY) != name or FORMAT_KEY not in metadata:
        return map_tensor(path, header.entries[name], header.data_start, name, _identity(header))
    where = f"{path}: tensor {name!r}"
    try:
        fmt = block_format(metadata[FORMAT_KEY])
        text = metadata.get(DIM_KEY, "")
        if not (isinstance(text, str) and text.isascii() and text.isdigit()):
            raise ValueError(f"a dim is written in decimal digits, not {_short_repr(text)}")
        dim = int(text)
        if not 0 < dim < 2**48:  # beyond any file's bytes, and kept out of later messages
            raise ValueError(f"a dim is a positive count of values, not {_short_repr(dim)}")
        row_bytes = fmt.row_bytes(dim)
    except ValueError as error:
        raise ValueError(f"{where}: the metadata {FORMAT_KEY}={_short_repr(metadata[FORMAT_KEY])}, "
                         f"{DIM_KEY}={_short_repr(metadata.get(DIM_KEY))} do not describe a quantized table: "
                         f"{_shortened(str(error), 200)}") from None
    entry = header.entries[name]
    if entry.dtype != "U8" or len(entry.shape) != 2 or entry.shape[1] != row_bytes or entry.shape[0] == 0:
        raise ValueError(f"{where}: a {fmt.name} table of dim {dim} is stored as U8 rows of shape "
                         f"(vocab_size, {row_bytes}), not {entry.dtype} {list(entry.shape)}")
    data = map_file(path, np.uint8, header.data_start + entry.begin, entry.shape, identity=_identity(header))
    if not fmt.row_scale:
        return QuantizedTable(data, fmt, dim)
    scales_entry = header.entries.get(name + SCALES_SUFFIX)
    if scales_entry is None or scales_entry.dtype != "F32" or scales_entry.shape != entry.shape[:1]:
        found = "missing" if scales_entry is None else f"{scales_entry.dtype} {list(scales_entry.shape)}"
        raise ValueError(f"{where}: a {fmt.name} table keeps its row scales as F32 [{entry.shape[0]}] in "
                         f"{name + SCALES_SUFFIX!r}, found {found}")
    scales = map_file(path, "<f4", header.data_start + scales_entry.begin, scales_entry.shape, identity=_identity(header))
    return QuantizedTable(data, fmt, dim, scales)


def map_safetensors(path: str | os.PathLike, name: str | None = None) -> np.memmap | QuantizedTable:
    """Memory-map one 2-D tensor of a safetensors file, read-only, without reading its data.

    Args:
        path: a .safetensors file.
        name: the tensor; None picks the one fastembed's ``fastembed.tensor`` metadata
            names (a file written by :func:`fastembed.io.save_table`), else the token
            embedding by the naming conventions of the common model families (see
            :func:`fastembed.io.token_embedding_name`).

    Returns:
        A read-only np.memmap of the tensor; or, for a quantized table fastembed saved
        (``fastembed.format`` metadata), a :class:`~fastembed.formats.QuantizedTable` of
        memory-mapped rows (and row scales).

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: as :func:`scan_safetensors_header`; no tensor `name` (listing a few);
            no tensor or several tensors named like a token embedding (listing them);
            the tensor is not 2-D or is empty; fastembed metadata that does not fit
            the tensors.
        TypeError: BF16/F8 need ml_dtypes and it is missing; `name` is not a string.

    Example:
        >>> import numpy as np, os, shutil, tempfile
        >>> from fastembed.io import save_table
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "model.safetensors")
        >>> save_table(path, np.ones((4, 8), np.float16))
        >>> from fastembed.io import map_safetensors
        >>> map_safetensors(path).shape
        (4, 8)
        >>> shutil.rmtree(folder)
    """
    from .checkpoints import MAX_CANDIDATES, is_embedding_candidate, select_in_file

    check_tensor_name(path, name)
    if name is None:
        name, header = select_in_file(path)
    else:
        near: list[str] = []
        wanted = (name, name + SCALES_SUFFIX)

        def keep(tensor: str, entry: TensorEntry) -> bool:
            if tensor != name and len(entry.shape) == 2 and is_embedding_candidate(tensor) and len(near) < MAX_CANDIDATES:
                near.append(tensor)
            return tensor in wanted

        header = scan_safetensors_header(path, keep=keep)
        if name not in header.entries:
            raise ValueError(f"{path}: no tensor named {name!r}; tensors named like a token embedding: {shorten(near)}; "
                             f"the header's first tensors: {shorten(header.sample, header.tensor_count)}")
    return map_entry(path, header, name)
