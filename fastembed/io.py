"""Memory-mapping embedding tables from safetensors and .npy files, zero-copy.

Nothing here reads tensor data: the file is mapped read-only and pages are
read by the operating system only when a lookup touches a row, so a 16 GB
checkpoint costs a few KiB of memory per looked-up row.

safetensors layout: 8 bytes little-endian header length N, then N bytes of
JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the data; offsets count from the first byte after the header.

Every malformed or hostile file raises ValueError naming the problem; no
offset is trusted before it has been checked against the file's size.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from .tables import resolve_dtype

#: safetensors dtype codes -> numpy dtype names (ml_dtypes for BF16 and F8).
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
#: Tensor name endings that mark a token embedding, as checkpoints name it.
EMBEDDING_NAME_ENDINGS = (
    "embed_tokens.weight", "word_embeddings.weight", "wte.weight", "tok_embeddings.weight",
    "embeddings.weight", "embedding.weight", "token_embedding.weight", "shared.weight",
)
#: The safetensors format caps its header at 100 MB; larger is hostile.
MAX_HEADER_BYTES = 100_000_000


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, dict[str, Any]], int]:
    """The validated tensor entries of a safetensors file, and the data's start offset.

    Raises ValueError for an empty/truncated file, a header length beyond the
    file, invalid JSON, bad dtypes/shapes/offsets (negative, outside the
    data, overlapping, or disagreeing with shape x dtype size).
    """
    file_size = os.path.getsize(path)
    if file_size < 8:
        raise ValueError(f"{path}: not a safetensors file: {file_size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        if header_length > min(MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(f"{path}: header length {header_length} goes beyond the file ({file_size} bytes)")
        raw_header = handle.read(header_length)
    try:
        header = json.loads(raw_header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path}: header is not valid JSON: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    data_start = 8 + header_length
    data_size = file_size - data_start
    entries = {name: _checked_entry(path, name, entry, data_size) for name, entry in header.items() if name != "__metadata__"}
    _check_no_overlap(path, entries)
    return entries, data_start


def _checked_entry(path: Any, name: str, entry: Any, data_size: int) -> dict[str, Any]:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: entry must be an object")
    dtype_code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype_code not in SAFETENSORS_DTYPES:
        raise ValueError(f"{where}: unknown dtype {dtype_code!r}; known: {', '.join(SAFETENSORS_DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise ValueError(f"{where}: data_offsets must be two integers, got {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise ValueError(f"{where}: data_offsets {offsets} lie outside the data section (0..{data_size})")
    itemsize = _itemsize(dtype_code)
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        raise ValueError(f"{where}: shape {shape} x {dtype_code} is {expected} bytes but data_offsets span {end - begin}")
    return {"dtype": dtype_code, "shape": shape, "data_offsets": offsets}


def _itemsize(dtype_code: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}.get(dtype_code, 1)


def _check_no_overlap(path: Any, entries: dict[str, dict[str, Any]]) -> None:
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], name) for name, e in entries.items() if e["data_offsets"][1] > e["data_offsets"][0])
    for (_, first_end, first), (second_begin, _, second) in zip(spans, spans[1:]):
        if second_begin < first_end:
            raise ValueError(f"{path}: tensors {first!r} and {second!r} overlap in the data section")


def embedding_tensor_name(entries: dict[str, dict[str, Any]], path: Any = "") -> str:
    """The single 2-D tensor whose name marks it as the token embedding; raises listing candidates."""
    candidates = [name for name, e in entries.items() if len(e["shape"]) == 2 and name.endswith(EMBEDDING_NAME_ENDINGS)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        two_d = [name for name, e in entries.items() if len(e["shape"]) == 2]
        raise ValueError(f"{path}: no tensor is named like a token embedding ({', '.join(EMBEDDING_NAME_ENDINGS)}); "
                         f"pass name=; 2-D tensors: {two_d}")
    raise ValueError(f"{path}: several tensors look like token embeddings, pass name= one of {candidates}")


def map_safetensors(path: str | os.PathLike, name: str | None = None) -> np.memmap:
    """Memory-map one 2-D tensor of a safetensors file, read-only, without reading its data."""
    entries, data_start = read_safetensors_header(path)
    if name is None:
        name = embedding_tensor_name(entries, path)
    elif name not in entries:
        raise ValueError(f"{path}: no tensor named {name!r}; tensors: {sorted(entries)}")
    entry = entries[name]
    if len(entry["shape"]) != 2:
        raise ValueError(f"{path}: tensor {name!r} has shape {entry['shape']}; an embedding table is 2-D")
    if 0 in entry["shape"]:
        raise ValueError(f"{path}: tensor {name!r} is empty (shape {entry['shape']})")
    dtype = resolve_dtype(SAFETENSORS_DTYPES[entry["dtype"]])
    return np.memmap(path, dtype=dtype, mode="r", offset=data_start + entry["data_offsets"][0], shape=tuple(entry["shape"]))


def map_npy(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a 2-D .npy file read-only; raises ValueError for a corrupt or unsuitable file."""
    try:
        table = np.load(Path(path), mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError, SyntaxError) as error:
        raise ValueError(f"{path}: not a readable .npy file: {error}") from None
    if not isinstance(table, np.ndarray) or table.ndim != 2:
        raise ValueError(f"{path}: holds shape {getattr(table, 'shape', None)}; an embedding table is 2-D")
    return table
