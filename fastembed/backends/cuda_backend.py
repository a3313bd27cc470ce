"""Host side of the CUDA gather: module cache, launch geometry, the bad-id flag.

The kernel source is ``fastembed/kernels/gather.cu`` (package data), compiled
on first use by ``cupy.RawModule`` (CuPy caches the binary on disk) and kept
per device here. Ids are used in their own dtype (int32 or int64 kernel);
numpy ids are copied to the table's device. The kernel runs on the current
CuPy stream and nothing here synchronises, except the bad-id check.

Bad ids never read outside the table and never trigger a device-side assert
(which would leave the CUDA context unusable). The kernel records the first
bad position in a per-device flag and writes zeros for that row. By default
:func:`gather` then reads the flag (one synchronisation) and raises
IndexError naming position and value. Inside :func:`deferred_id_checks` the
read is skipped; :func:`raise_deferred_id_errors` reads the flag later.
Unlike the CPU backends, a caller's ``out`` on the GPU has been written by
the time a bad id is known (its bad rows are zero): checking first would
cost a second kernel and a synchronisation on every call.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .. import validate

NAME = "cuda"
KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "gather.cu"
#: (vector bytes, the CUDA type used for it); the widest that fits is used.
VECTOR_TYPES = ((16, "uint4"), (8, "uint2"), (4, "unsigned int"), (2, "unsigned short"), (1, "unsigned char"))
ID_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
#: Threads per block: one block per row; 128 threads x 16 bytes = 2 KiB per
#: pass, four passes over an 8 KiB row (float16 x 4096).
MAX_THREADS_PER_BLOCK = 256
#: Resident blocks per SM the grid is sized for (grid-stride beyond that).
BLOCKS_PER_SM = 32
NO_ERROR = np.uint64(0xFFFFFFFFFFFFFFFF)

_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("fastembed_deferred_id_checks", default=False)


@lru_cache(maxsize=None)
def unavailable_reasons() -> list[str]:
    if importlib.util.find_spec("cupy") is None:
        return ["cupy is not installed (pip install 'fastembed-gather[cuda12]' or '[cuda13]')"]
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # cupy raises its own CUDA error types
        return [f"cupy is installed but CUDA is unusable: {type(error).__name__}: {error}"]
    if count == 0:
        return ["cupy is installed but no CUDA device is visible"]
    return []


def not_supported_reasons(table: Any, ids: Any, out: Any) -> list[str]:
    if not validate.is_gpu_array(table):
        return ["the table is a host array; move it to the GPU explicitly (Embedding.to_device())"]
    if type(table).__module__.split(".")[0] != "cupy":
        return [f"the table is a {type(table).__module__} GPU array; the cuda backend takes cupy arrays"]
    return []


def to_device(table: Any, device_id: int) -> Any:
    """A copy of a host table on `device_id` (the one explicit host-to-device move).

    Tables of ml_dtypes types (bfloat16) travel as same-size unsigned words
    and keep a numpy-compatible dtype view on the device.
    """
    import cupy

    host = np.asarray(table)
    with cupy.cuda.Device(device_id):
        if host.dtype.kind == "V":
            return cupy.asarray(host.view(f"u{host.dtype.itemsize}"))
        return cupy.asarray(host)


@lru_cache(maxsize=None)
def _module(device_id: int) -> Any:
    import cupy

    names = [_kernel_name(id_type, vec_type) for id_type in ID_TYPES.values() for _, vec_type in VECTOR_TYPES]
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=("-std=c++17",), name_expressions=names)


@lru_cache(maxsize=None)
def _kernel(device_id: int, id_type: str, vec_type: str) -> Any:
    return _module(device_id).get_function(_kernel_name(id_type, vec_type))


@lru_cache(maxsize=None)
def _error_flag(device_id: int) -> Any:
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.full(1, NO_ERROR, dtype=cupy.uint64)


@lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _kernel_name(id_type: str, vec_type: str) -> str:
    return f"gather_rows<{id_type}, {vec_type}>"


def vector_bytes(row_bytes: int, *addresses: int) -> tuple[int, str]:
    """The widest vector (bytes, CUDA type) dividing the row size and every address."""
    for size, cuda_type in VECTOR_TYPES:
        if row_bytes % size == 0 and all(address % size == 0 for address in addresses):
            return size, cuda_type
    raise AssertionError("unreachable: 1-byte vectors divide everything")


def launch_geometry(n_ids: int, vecs_per_row: int, sm_count: int) -> tuple[int, int]:
    """(blocks, threads per block): a block per row, up to BLOCKS_PER_SM per SM."""
    threads = min(MAX_THREADS_PER_BLOCK, max(32, -(-vecs_per_row // 32) * 32))
    if vecs_per_row >= 512:
        threads = 128  # four 16-byte vectors per thread in flight per row
    blocks = max(1, min(n_ids, sm_count * BLOCKS_PER_SM))
    return blocks, threads


def gather(table: Any, ids: Any, out: Any = None) -> Any:
    import cupy

    device_id = table.device.id
    if out is None:
        with cupy.cuda.Device(device_id):
            out = cupy.empty(validate.output_shape(ids, table), dtype=table.dtype)
    flat_ids = ids.reshape(-1)
    n = int(flat_ids.size)
    if n == 0:
        return out
    row_bytes = table.shape[1] * table.dtype.itemsize
    size, vec_type = vector_bytes(row_bytes, table.data.ptr, out.data.ptr)
    vecs_per_row = row_bytes // size
    kernel = _kernel(device_id, ID_TYPES[np.dtype(flat_ids.dtype)], vec_type)
    flag = _error_flag(device_id)
    blocks, threads = launch_geometry(n, vecs_per_row, _sm_count(device_id))
    with cupy.cuda.Device(device_id):
        # CuPy does not check kernel argument types: pass exact C types.
        kernel(
            (blocks,),
            (threads,),
            (table, flat_ids, out, np.int64(n), np.int64(table.shape[0]), np.int64(vecs_per_row), flag),
        )
    if not _deferred.get():
        _raise_if_flagged(device_id, ids, table.shape[0])
    return out


def _raise_if_flagged(device_id: int, ids: Any, vocab_size: int) -> None:
    flag = _error_flag(device_id)
    position = int(flag.get()[0])  # synchronises with the stream
    if position != int(NO_ERROR):
        flag.fill(NO_ERROR)
        raise validate.out_of_range_error(ids, position, vocab_size)


@contextlib.contextmanager
def deferred_id_checks() -> Iterator[None]:
    """Skip the synchronising bad-id check in CUDA lookups inside this block.

    Bad ids still never read outside the table; their rows are written as
    zeros and the first bad position is kept until
    :func:`raise_deferred_id_errors` reads it.
    """
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def raise_deferred_id_errors(device_id: int = 0) -> None:
    """Raise IndexError if a deferred CUDA lookup on `device_id` saw a bad id, and clear the flag.

    The position counts from the start of that lookup's flattened ids; the
    value is not kept (the ids may be gone by now).
    """
    if unavailable_reasons():
        return
    flag = _error_flag(device_id)
    position = int(flag.get()[0])
    if position != int(NO_ERROR):
        flag.fill(NO_ERROR)
        raise IndexError(
            f"a deferred CUDA lookup on device {device_id} had an id out of range at flattened position "
            f"{position}; its row was written as zeros"
        )


def describe() -> dict[str, Any]:
    if unavailable_reasons():
        return {}
    import cupy

    devices = []
    for index in range(cupy.cuda.runtime.getDeviceCount()):
        properties = cupy.cuda.runtime.getDeviceProperties(index)
        devices.append(f"cuda:{index} {properties['name'].decode()} ({properties['totalGlobalMem'] / 2**30:.0f} GiB)")
    return {"cupy": cupy.__version__, "devices": devices}
