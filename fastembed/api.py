"""The public lookup API: ``lookup`` and ``Embedding``. Thin on purpose.

Each call validates (``fastembed.validate``), picks a backend
(``fastembed.dispatch``) and hands over; nothing here knows a kernel.
``lookup`` and ``Embedding.__call__`` spell out the same three steps rather
than share a helper: one Python call is 0.1-0.2 us, 3-5% of a six-id lookup
(docs/backends.md, "Small batches").
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import dispatch, validate


def lookup(table: Any, ids: Any, *, out: Any = None, backend: str = "auto") -> Any:
    """Return ``table[ids]``: shape ``ids.shape + (table.shape[1],)``, the table's dtype.

    table: 2-D C-contiguous numpy/memmap (host) or cupy (GPU) array, any dtype.
    ids: integers of any dtype and ndim (lists and scalars as numpy accepts them)
        in ``[0, table.shape[0])``; int32/int64 are used without a copy.
    out: optional preallocated C-contiguous array of the result's shape and
        dtype, on the table's device; it is filled and returned.
    backend: "auto" (or FASTEMBED_BACKEND), "numba", "numpy" or "cuda".

    Raises TypeError/ValueError for malformed inputs, IndexError naming the
    first bad id's position and value, BackendUnavailableError when a named
    backend cannot serve the call. On a host error ``out`` is left untouched.
    """
    validate.check_table(table)
    ids = validate.as_ids(ids, table)
    if out is not None:
        validate.check_out(out, ids, table)
    return dispatch.select(table, ids, out, backend).gather(table, ids, out)


class Embedding:
    """A callable embedding layer over a table it references, never copies.

    ``emb(ids, out=None, backend="auto")`` is ``lookup(emb.table, ids, ...)``
    without re-validating the table on every call.
    """

    def __init__(self, table: Any) -> None:
        validate.check_table(table)
        self._table = table

    def __call__(self, ids: Any, out: Any = None, backend: str = "auto") -> Any:
        table = self._table  # validated once, in __init__; the rest as in lookup()
        ids = validate.as_ids(ids, table)
        if out is not None:
            validate.check_out(out, ids, table)
        return dispatch.select(table, ids, out, backend).gather(table, ids, out)

    @property
    def table(self) -> Any:
        """The referenced table (numpy, np.memmap or cupy array)."""
        return self._table

    @property
    def vocab_size(self) -> int:
        return int(self._table.shape[0])

    @property
    def dim(self) -> int:
        return int(self._table.shape[1])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._table.dtype)

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return validate.device_of(self._table)

    def __repr__(self) -> str:
        return f"Embedding(vocab_size={self.vocab_size}, dim={self.dim}, dtype={self.dtype}, device={self.device!r})"

    @classmethod
    def random(
        cls, vocab_size: int = 129280, dim: int = 4096, dtype: Any = "float16", seed: int = 0
    ) -> "Embedding":
        """A table of random values (never zeros for floats), built in seconds.

        Floats: random sign, magnitudes in [1/64, 1/32) (an embedding's
        scale); integers: uniform over their dtype's range; other dtypes:
        random bytes. See :func:`fastembed.tables.random_table`.
        """
        from .tables import random_table

        return cls(random_table(vocab_size, dim, dtype, seed))

    @classmethod
    def from_safetensors(cls, path: str | os.PathLike, name: str | None = None) -> "Embedding":
        """Memory-map one tensor of a safetensors file, read-only, zero-copy.

        name=None picks the single 2-D tensor named like a token embedding
        (``embed_tokens.weight``, ``wte.weight``, ...) or raises listing the
        candidates. Raises ValueError for corrupt or hostile files, TypeError
        when BF16/F8 needs ml_dtypes and it is missing.
        """
        from .io import map_safetensors

        return cls(map_safetensors(path, name))

    @classmethod
    def from_npy(cls, path: str | os.PathLike) -> "Embedding":
        """Memory-map a 2-D .npy file, read-only, zero-copy."""
        from .io import map_npy

        return cls(map_npy(path))

    def to_device(self, device: int = 0) -> "Embedding":
        """An Embedding over a copy of this table on CUDA device `device` (explicit, one copy).

        Raises BackendUnavailableError when cupy or a device is missing.
        """
        from .backends import cuda_backend
        from .dispatch import BackendUnavailableError

        reasons = cuda_backend.unavailable_reasons()
        if reasons:
            raise BackendUnavailableError(f"cannot move the table to cuda:{device}: {'; '.join(reasons)}")
        return cls(cuda_backend.to_device(self._table, device))
