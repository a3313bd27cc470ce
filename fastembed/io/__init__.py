"""Memory-mapping embedding tables from safetensors, .npy and Hugging Face checkpoints, zero-copy.

Nothing here reads tensor data: the file is mapped read-only and pages are
read by the operating system only when a lookup touches a row, so a 16 GB
checkpoint costs a few KiB of memory per looked-up row.

* :func:`map_safetensors` / :func:`map_npy`: one file (``Embedding.from_safetensors``,
  ``Embedding.from_npy``).
* :func:`open_table`: a checkpoint directory, a shard index, or either file kind;
  picks the token embedding by the naming conventions of the common families.
* :class:`FileWatch`: notices that a mapped file shrank or changed.

Missing files raise FileNotFoundError; every other unusable file (a directory,
another format, a corrupt or hostile header) raises ValueError naming the file
and the problem.
"""
from __future__ import annotations

from .checkpoints import (
    TOKEN_EMBEDDING_ENDINGS,
    embedding_rank,
    open_table,
    read_config_shape,
    token_embedding_name,
)
from .npy import map_npy, read_npy_header
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
from .watch import FileChangedError, FileWatch

__all__ = [
    "MAX_ENTRY_BYTES",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "TOKEN_EMBEDDING_ENDINGS",
    "FileChangedError",
    "FileWatch",
    "SafetensorsHeader",
    "TensorEntry",
    "embedding_rank",
    "map_npy",
    "map_safetensors",
    "open_table",
    "read_config_shape",
    "read_npy_header",
    "read_safetensors_header",
    "scan_safetensors_header",
    "token_embedding_name",
]
