"""What is measured: fastembed's backends, what users would use instead, and the limits.

A contender is prepared once per (table, batch size) and returns a callable
``call(ids)`` that does one lookup. Preparing allocates every output buffer
up front, so the timed call allocates only if the contender itself does.

The limits are not lookups; they tell how fast this machine moves the bytes
a lookup moves: contiguous copies of as many rows (the "copy" limits:
writing into a given output, or allocating it first), and a read of the
same scattered rows that writes nothing (the "scattered read" limit).
"""
from __future__ import annotations

import importlib.util
import platform
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import fastembed
from fastembed.arrays.numpy_adapter import data_address
from fastembed.tables import is_ml_dtype

#: The id of the scattered-read limit (its own limit line, not a copy).
SCATTERED_READ = "read-scattered"
#: Where torch's contenders come from when it is missing.
TORCH_HINT = "torch is not installed: its contenders are not measured (add them with: pip install torch)"


def slug(name: str) -> str:
    """A contender id from a display name: lower case words joined by '-' ("cupy table[ids]" -> "cupy-table-ids")."""
    return "-".join(re.findall(r"[a-z0-9]+", name.lower()))


@dataclass(frozen=True)
class Contender:
    """One way to do the lookup (or a limit), and how to prepare it.

    ``id`` is stable: reports and the gate's thresholds key on it, so a
    change of the display ``name`` cannot break the gate. When not given it
    is derived from the name (:func:`slug`).

    ``prepare(table, n)`` returns ``call(ids)``, which returns its output
    (a limit's call may return anything). A fastembed contender's call
    carries ``call.served_by``: the backend that serves it, as
    ``fastembed.select_backend(table, ids, out)`` reports it for that table,
    n ids and the prepared ``out`` (the backend named, when one is forced).
    """

    name: str  # display label
    kind: str  # "fastembed", "peer" or "limit"
    allocates: bool  # allocates its output on every call
    prepare: Callable[[Any, int], Callable[[Any], Any]]
    id_dtype: str = "int64"  # the dtype of the ids its calls receive
    id: str = ""
    #: ``expected(table, host_ids)``: what a lookup must return, checked before it is timed (no function:
    #: ``table[ids]``; a function returning None: nothing this machine can check it against).
    expected: Callable[[Any, np.ndarray], Any] | None = None

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", slug(self.name))


def _serving(call: Callable, table: Any, n: int, out: Any, backend: str) -> Callable:
    """`call` with ``call.served_by`` set: `backend`, or for "auto" what fastembed.select_backend picks."""
    if backend == "auto":
        backend = fastembed.select_backend(table, np.zeros(n, np.int64), out).backend
    call.served_by = backend  # type: ignore[attr-defined]
    return call


def _fastembed_out(backend: str) -> Callable:
    def prepare(table: np.ndarray, n: int) -> Callable:
        out = np.empty((n, table.shape[1]), table.dtype)
        _compile(table, out, backend)
        return _serving(lambda ids: fastembed.lookup(table, ids, out=out, backend=backend), table, n, out, backend)

    return prepare


def _fastembed_alloc(table: np.ndarray, n: int) -> Callable:
    _compile(table, np.empty((n, table.shape[1]), table.dtype), "auto")
    return _serving(lambda ids: fastembed.lookup(table, ids), table, n, None, "auto")


def _fastembed_embedding(table: np.ndarray, n: int) -> Callable:
    embedding = fastembed.Embedding(table)
    _compile(table, np.empty((n, table.shape[1]), table.dtype), "auto")
    return _serving(lambda ids: embedding(ids), table, n, None, "auto")


def _compile(table: np.ndarray, out: np.ndarray, backend: str) -> None:
    """One lookup, then wait for its background compiles: timed calls never run a stand-in kernel."""
    fastembed.lookup(table, np.zeros(len(out), np.int64), out=out, backend=backend)
    fastembed.wait_for_compiles()


def _numpy_fancy(table: np.ndarray, n: int) -> Callable:
    # A mapped --table is indexed as the array it is, as the fresh processes' baseline (processes.worker) indexes it:
    # np.memmap's Python-level indexing would slow numpy's small lookups.
    plain = np.asarray(table)
    return lambda ids: plain[ids]


def _numpy_take_out(table: np.ndarray, n: int) -> Callable:
    out = np.empty((n, table.shape[1]), table.dtype)
    return lambda ids: np.take(table, ids, axis=0, out=out)


def _torch_tensor(array: np.ndarray) -> Any:
    """A torch tensor sharing `array`'s memory (ml_dtypes' bfloat16 and float8 through integer words)."""
    import torch

    torch.set_num_threads(usable_cores())
    with warnings.catch_warnings():
        # A read-only table (memory-mapped with --table) is only ever read through the tensor.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if is_ml_dtype(array.dtype):
            words = array.view(np.int16 if array.dtype.itemsize == 2 else np.uint8)
            return torch.from_numpy(words).view(getattr(torch, array.dtype.name))
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

    For more rows than the table has, a source of n rows is built here, so
    that the timed copy never allocates: one, shared by every copy limit of
    the case (the memory check counts one).
    """
    table = np.asarray(table)  # np.memmap's slices are slower to make; the bytes are the same
    vocab_size = table.shape[0]
    if n > vocab_size:
        key = (data_address(table), table.shape, table.dtype.str, n)
        if _repeated_rows[0] != key:
            _repeated_rows[:] = [None, None]  # the last case's source goes before this case's is built
            _repeated_rows[:] = [key, np.resize(table, (n, table.shape[1]))]
        repeated = _repeated_rows[1]
        return lambda ids: repeated
    return lambda ids: table[int(ids[0]) % (vocab_size - n + 1) :][:n]


#: The source of more rows than the table has that the copy limits of the latest such case share: [its key, the rows].
_repeated_rows: list[Any] = [None, None]


def _copy_numpy(table: np.ndarray, n: int) -> Callable:
    out, source = np.empty((n, table.shape[1]), table.dtype), _copy_sources(table, n)
    return lambda ids: np.copyto(out, source(ids))


def _copy_numba(stream: bool) -> Callable:
    def prepare(table: np.ndarray, n: int) -> Callable:
        from . import copy_kernels

        out = copy_kernels.word_view(np.empty((n, table.shape[1]), table.dtype))
        source = _copy_sources(table, n)
        if stream and copy_kernels.can_stream(out):
            window = copy_kernels.ALIAS_WINDOW
            return lambda ids: copy_kernels.copy_parallel_stream(copy_kernels.word_view(source(ids)), out, window)
        return lambda ids: copy_kernels.copy_parallel(copy_kernels.word_view(source(ids)), out)

    return prepare


def _read_scattered(table: np.ndarray, n: int) -> Callable:
    """Read the rows table[ids] and write nothing (copy_kernels.read_scattered): over threads where fastembed's
    gather uses them, on the calling thread below that size, where it gathers there too, as waking the workers
    would cost more."""
    from . import copy_kernels

    words = copy_kernels.word_view(table)
    if not copy_kernels.gathers_on_threads(n * table.shape[1] * table.dtype.itemsize):
        return lambda ids: copy_kernels.read_scattered_serial(words, ids)
    return lambda ids: copy_kernels.read_scattered(words, ids)


def _copy_alloc(table: np.ndarray, n: int) -> Callable:
    """np.empty + numpy copy: the limit for an allocating lookup (page faults included)."""
    source = _copy_sources(table, n)

    def call(ids: np.ndarray) -> np.ndarray:
        out = np.empty((n, table.shape[1]), table.dtype)
        np.copyto(out, source(ids))
        return out

    return call


def _copy_alloc_numba(stream: bool) -> Callable:
    """np.empty + the parallel numba copy: the allocating limit where the new output's page faults are taken over threads."""

    def prepare(table: np.ndarray, n: int) -> Callable:
        from . import copy_kernels

        source, window = _copy_sources(table, n), copy_kernels.ALIAS_WINDOW

        def call(ids: np.ndarray) -> np.ndarray:
            out = np.empty((n, table.shape[1]), table.dtype)
            words, rows = copy_kernels.word_view(out), copy_kernels.word_view(source(ids))
            if stream and copy_kernels.can_stream(words):
                copy_kernels.copy_parallel_stream(rows, words, window)
            else:
                copy_kernels.copy_parallel(rows, words)
            return out

        return call

    return prepare


def usable_cores() -> int:
    """The cores this process may run on."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def host_backends() -> list[str]:
    """The registered fastembed backends that serve host tables (their declared devices include the CPU)."""
    from fastembed.dispatch import BACKENDS

    return [name for name, backend in tuple(BACKENDS.items()) if "cpu" in backend.capabilities.devices]


def host_contenders(backends: list[str] | None = None) -> list[Contender]:
    """Every contender that can run on this machine for a host table.

    ``backends``: the fastembed backends to measure forced one by one (default:
    every available one); the auto contenders, peers and limits always run.
    """
    available = [status.name for status in fastembed.backend_statuses() if status.available]
    stream = platform.machine().lower() in ("x86_64", "amd64")  # non-temporal stores: x86-64 only
    contenders = _host_contenders(available, backends, torch_installed(), stream)
    if "numba" in available:
        from . import copy_kernels

        problem = copy_kernels.parallel_unavailable()
        if problem is not None:
            warnings.warn(f"the numba copy kernels cannot run here ({problem}): the limits that use them are not "
                          "measured", RuntimeWarning, stacklevel=2)
            contenders = [contender for contender in contenders if contender.id not in _NUMBA_LIMITS]
    return contenders


#: The limits measured by the numba copy kernels on fastembed's workers (fastembed.benchmark.copy_kernels).
_NUMBA_LIMITS = ("copy-numba", "copy-numba-stream", SCATTERED_READ, "copy-alloc-numba")


def known_host_contender_ids() -> set[str]:
    """The id of every contender a host run measures on some machine (this one's, or one with every backend,
    torch and x86-64 stores): what a gate check may name."""
    everything = [status.name for status in fastembed.backend_statuses()]
    return {contender.id for contender in _host_contenders(everything, None, True, True)}


def _host_contenders(available: list[str], backends: list[str] | None, torch: bool, stream: bool) -> list[Contender]:
    """The host contenders, given the backends available, whether torch is installed and whether stores stream."""
    contenders = []
    for name in available:
        if name == "cuda" or (backends and name not in backends):
            continue
        contenders.append(Contender(f"fastembed[{name}] out=", "fastembed", False, _fastembed_out(name),
                                    id=f"fastembed-{name}-out"))
    contenders += [
        Contender("fastembed auto out=", "fastembed", False, _fastembed_out("auto"), id="fastembed-auto-out"),
        Contender("fastembed auto alloc", "fastembed", True, _fastembed_alloc, id="fastembed-auto-alloc"),
        Contender("fastembed Embedding alloc", "fastembed", True, _fastembed_embedding, id="fastembed-embedding-alloc"),
        Contender("numpy table[ids]", "peer", True, _numpy_fancy, id="numpy-fancy"),
        Contender("numpy take(out=)", "peer", False, _numpy_take_out, id="numpy-take-out"),
    ]
    if torch:
        contenders.append(Contender("torch index_select(out=)", "peer", False, _torch_index_select_out,
                                    id="torch-index-select-out"))
        contenders.append(Contender("torch F.embedding", "peer", True, _torch_embedding, id="torch-embedding"))
    contenders.append(Contender("copy numpy", "limit", False, _copy_numpy, id="copy-numpy"))
    if "numba" in available:
        contenders.append(Contender("copy numba", "limit", False, _copy_numba(stream=False), id="copy-numba"))
        if stream:
            contenders.append(Contender("copy numba-stream", "limit", False, _copy_numba(stream=True),
                                        id="copy-numba-stream"))
        contenders.append(Contender("scattered read", "limit", False, _read_scattered, id=SCATTERED_READ))
    contenders.append(Contender("copy alloc", "limit", True, _copy_alloc, id="copy-alloc"))
    if "numba" in available:
        contenders.append(Contender("copy alloc numba", "limit", True, _copy_alloc_numba(stream), id="copy-alloc-numba"))
    return contenders


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None
