"""What is measured: fastembed's backends, what users would use instead, and copies (the limit).

A contender is prepared once per (table, batch size) and returns a callable
``call(ids)`` that does one lookup. Preparing allocates every output buffer
up front, so the timed call allocates only if the contender itself does.
"""
from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import fastembed
from fastembed import dispatch


@dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # "fastembed", "peer" or "limit"
    allocates: bool  # allocates its output on every call
    prepare: Callable[[Any, int], Callable[[Any], Any]]
    id_dtype: str = "int64"  # the dtype of the ids its calls receive


def _fastembed_out(backend: str) -> Callable:
    def prepare(table: np.ndarray, n: int) -> Callable:
        out = np.empty((n, table.shape[1]), table.dtype)
        _compile(table, out, backend)
        return lambda ids: fastembed.lookup(table, ids, out=out, backend=backend)

    return prepare


def _fastembed_alloc(table: np.ndarray, n: int) -> Callable:
    _compile(table, np.empty((n, table.shape[1]), table.dtype), "auto")
    return lambda ids: fastembed.lookup(table, ids)


def _fastembed_embedding(table: np.ndarray, n: int) -> Callable:
    embedding = fastembed.Embedding(table)
    _compile(table, np.empty((n, table.shape[1]), table.dtype), "auto")
    return lambda ids: embedding(ids)


def _compile(table: np.ndarray, out: np.ndarray, backend: str) -> None:
    """One lookup, then wait for its background compiles: timed calls never run a stand-in kernel."""
    fastembed.lookup(table, np.zeros(len(out), np.int64), out=out, backend=backend)
    fastembed.wait_for_compiles()


def _numpy_fancy(table: np.ndarray, n: int) -> Callable:
    return lambda ids: table[ids]


def _numpy_take_out(table: np.ndarray, n: int) -> Callable:
    out = np.empty((n, table.shape[1]), table.dtype)
    return lambda ids: np.take(table, ids, axis=0, out=out)


def _torch_tensor(array: np.ndarray) -> Any:
    """A torch tensor sharing `array`'s memory (bfloat16 through an int16 view)."""
    import torch

    torch.set_num_threads(_cpu_count())
    with warnings.catch_warnings():
        # A read-only table (memory-mapped with --table) is only ever read through the tensor.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def _torch_index_select_out(table: np.ndarray, n: int) -> Callable:
    import torch

    weight, out = _torch_tensor(table), _torch_tensor(np.empty((n, table.shape[1]), table.dtype))
    return lambda ids: torch.index_select(weight, 0, torch.from_numpy(ids), out=out)


def _torch_embedding(table: np.ndarray, n: int) -> Callable:
    import torch

    weight = _torch_tensor(table)
    return lambda ids: torch.nn.functional.embedding(torch.from_numpy(ids), weight)


def _copy_sources(table: np.ndarray, n: int) -> Callable[[np.ndarray], np.ndarray]:
    """A contiguous block of n table rows that moves with each id set (so it is not cached).

    For more rows than the table has, a source of n rows is built once, here,
    so that the timed copy never allocates.
    """
    table = np.asarray(table)  # np.memmap's slices are slower to make; the bytes are the same
    vocab_size = table.shape[0]
    if n > vocab_size:
        repeated = np.resize(table, (n, table.shape[1]))
        return lambda ids: repeated
    return lambda ids: table[int(ids[0]) % (vocab_size - n + 1) :][:n]


def _copy_numpy(table: np.ndarray, n: int) -> Callable:
    out, source = np.empty((n, table.shape[1]), table.dtype), _copy_sources(table, n)
    return lambda ids: np.copyto(out, source(ids))


def _copy_numba(stream: bool) -> Callable:
    def prepare(table: np.ndarray, n: int) -> Callable:
        from fastembed.backends import numba_backend

        kernels = numba_backend.kernels()
        word = numba_backend.word_dtype(table.shape[1] * table.dtype.itemsize)
        out = np.empty((n, table.shape[1]), table.dtype).view(word)
        source = _copy_sources(table, n)
        blocks = max(1, numba_backend.thread_count() * numba_backend.BLOCKS_PER_THREAD)
        if stream and kernels.can_stream(out):
            window = numba_backend.ALIAS_WINDOW
            return lambda ids: kernels.copy_parallel_stream(source(ids).view(word), out, blocks, window)
        return lambda ids: kernels.copy_parallel(source(ids).view(word), out, blocks)

    return prepare


def _copy_alloc(table: np.ndarray, n: int) -> Callable:
    """np.empty + numpy copy: the limit for an allocating lookup (page faults included)."""
    source = _copy_sources(table, n)

    def call(ids: np.ndarray) -> np.ndarray:
        out = np.empty((n, table.shape[1]), table.dtype)
        np.copyto(out, source(ids))
        return out

    return call


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def host_contenders(backends: list[str] | None = None) -> list[Contender]:
    """Every contender that can run on this machine for a host table."""
    contenders = []
    for module in dispatch.available_backends():
        if module.NAME == "cuda" or (backends and module.NAME not in backends):
            continue
        contenders.append(Contender(f"fastembed[{module.NAME}] out=", "fastembed", False, _fastembed_out(module.NAME)))
    contenders.append(Contender("fastembed auto out=", "fastembed", False, _fastembed_out("auto")))
    contenders.append(Contender("fastembed auto alloc", "fastembed", True, _fastembed_alloc))
    contenders.append(Contender("fastembed Embedding alloc", "fastembed", True, _fastembed_embedding))
    contenders.append(Contender("numpy table[ids]", "peer", True, _numpy_fancy))
    contenders.append(Contender("numpy take(out=)", "peer", False, _numpy_take_out))
    if importlib.util.find_spec("torch") is not None:
        contenders.append(Contender("torch index_select(out=)", "peer", False, _torch_index_select_out))
        contenders.append(Contender("torch F.embedding", "peer", True, _torch_embedding))
    contenders.append(Contender("copy numpy", "limit", False, _copy_numpy))
    if not dispatch.numba_backend.unavailable_reasons():
        contenders.append(Contender("copy numba", "limit", False, _copy_numba(stream=False)))
        contenders.append(Contender("copy numba-stream", "limit", False, _copy_numba(stream=True)))
    contenders.append(Contender("copy alloc", "limit", True, _copy_alloc))
    return contenders
