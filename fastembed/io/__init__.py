"""Memory-mapping embedding tables from safetensors, GGUF, .npy and Hugging Face checkpoints, zero-copy; saving them.

Nothing here reads tensor data: the file is mapped read-only and pages are
read by the operating system only when a lookup touches a row, so a 16 GB
checkpoint costs a few KiB of memory per looked-up row.

* :func:`map_safetensors` / :func:`map_gguf` / :func:`map_npy`: one file
  (``Embedding.from_safetensors``, ``Embedding.from_gguf``, ``Embedding.from_npy``);
  GGUF's quantized types and quantized tables fastembed saved come back as a
  :class:`~fastembed.formats.QuantizedTable` of mapped rows.
* :func:`open_table`: a checkpoint directory, a shard index, or any of these files;
  picks the token embedding by the naming conventions of the common families.
* :func:`save_table`: a table (dense or quantized) to a ``.gguf`` or
  ``.safetensors`` file that the loaders map back byte for byte.
* :class:`FileWatch`: notices that a mapped file shrank or changed.

Missing files raise FileNotFoundError; a BF16 or F8 tensor (safetensors) or a
BF16 tensor (GGUF) raises TypeError naming the package when ml_dtypes is not
installed; every other unusable file (a directory, another format, a corrupt
or hostile header) raises ValueError naming the file and the problem.
"""
from __future__ import annotations

from ._files import FileIdentity
from .checkpoints import (
    TOKEN_EMBEDDING_ENDINGS,
    embedding_rank,
    open_table,
    read_config_shape,
    token_embedding_name,
)
from .gguf import MAX_GGUF_HEADER_BYTES, GGUFTensor, ggml_type_name, map_gguf, scan_gguf
from .npy import map_npy, map_npy_rows, read_npy_header
from .safetensors import (
    MAX_ENTRY_BYTES,
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    SafetensorsHeader,
    TensorEntry,
    map_safetensors,
    read_safetensors_header,
    scan_safetensors_header,
)
from .save import save_table
from .watch import FileChangedError, FileWatch

__all__ = [
    "MAX_ENTRY_BYTES",
    "MAX_GGUF_HEADER_BYTES",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "TOKEN_EMBEDDING_ENDINGS",
    "FileChangedError",
    "FileIdentity",
    "FileWatch",
    "GGUFTensor",
    "SafetensorsHeader",
    "TensorEntry",
    "embedding_rank",
    "ggml_type_name",
    "map_gguf",
    "map_npy",
    "map_npy_rows",
    "map_safetensors",
    "open_table",
    "read_config_shape",
    "read_npy_header",
    "read_safetensors_header",
    "save_table",
    "scan_gguf",
    "scan_safetensors_header",
    "token_embedding_name",
]
