"""The CUDA backend: host side of the row gather on a cupy table.

The kernel source is ``fastembed/kernels/gather.cu`` (package data), compiled
on first use by ``cupy.RawModule`` (CuPy caches the binary on disk) and kept
per device in :data:`BACKEND`, the one object that holds this backend's
state (modules, kernels, bad-id flags, SM counts, availability). Ids are
used in their own dtype (int32 or int64 kernel); the API copies host ids to
the table's device before they get here. The kernel runs on the current
CuPy stream and nothing here synchronises, except the bad-id check.

Bad ids never read outside the table and never trigger a device-side assert
(which would leave the CUDA context unusable): the kernel checks every id
before it copies that row, writes zeros for a bad row and records the
smallest bad position in a flag. By default :meth:`CudaBackend.gather` then
reads the flag (one synchronisation) and raises IndexError naming position
and value. Inside :func:`deferred_id_checks` the read is skipped;
:func:`raise_deferred_id_errors` reads the flag later. Unlike the CPU
backends, a caller's ``out`` on the GPU has been written by the time a bad
id is known (its bad rows are zero): checking first would cost a second
kernel and a synchronisation on every call.

Flags: immediate checks use one flag per thread and device (two threads
checking at once never read each other's error); deferred lookups share
one flag per device until :func:`raise_deferred_id_errors` reads it.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import validate
from .base import Capabilities

KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "gather.cu"
#: (vector bytes, the CUDA type used for it); the widest that fits is used.
VECTOR_TYPES = ((16, "uint4"), (8, "uint2"), (4, "unsigned int"), (2, "unsigned short"), (1, "unsigned char"))
ID_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
#: Threads per block: one block per row; 128 threads x 16 bytes = 2 KiB per
#: pass, four passes over an 8 KiB row (float16 x 4096).
MAX_THREADS_PER_BLOCK = 256
#: Resident blocks per SM the grid is sized for (grid-stride beyond that).
BLOCKS_PER_SM = 32
#: The flag's value while no bad id has been seen.
NO_ERROR = np.uint64(0xFFFFFFFFFFFFFFFF)
COMPILE_OPTIONS = ("-std=c++17",)

_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("fastembed_deferred_id_checks", default=False)


def _kernel_name(id_type: str, vec_type: str) -> str:
    return f"gather_rows<{id_type}, {vec_type}>"


#: Every instantiation the module is compiled with (``name_expressions``).
KERNEL_NAMES = tuple(_kernel_name(id_type, vec_type) for id_type in ID_TYPES.values() for _, vec_type in VECTOR_TYPES)


class CudaBackend:
    """Gathers rows of a cupy table on its CUDA device (see the module docstring)."""

    name = "cuda"
    capabilities = Capabilities(array_libraries=frozenset({"cupy"}), devices=frozenset({"cuda"}))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget availability, compiled modules, kernels, bad-id flags and SM counts.

        For tests (installing or removing cupy) and after installs; arrays
        handed out before stay valid.
        """
        with self._lock:
            self._unavailable: list[str] | None = None
            self._modules: dict[int, Any] = {}
            self._kernels: dict[tuple[int, str, str], Any] = {}
            self._deferred_flags: dict[int, Any] = {}
            self._thread_flags = threading.local()  # .flags: {device id: flag} of one thread
            self._sm_counts: dict[int, int] = {}

    # -- availability ---------------------------------------------------------------------------------

    def unavailable_reasons(self) -> list[str]:
        reasons = self._unavailable
        if reasons is None:
            reasons = self._unavailable = _probe()
        return list(reasons)

    # -- the gather -----------------------------------------------------------------------------------

    def gather(self, table: Any, ids: Any, out: Any | None) -> Any:
        """Write ``table[ids]`` into ``out`` (None: a new cupy array on the table's device) and return it.

        ``table`` is a 2-D C-contiguous cupy array, ``ids`` an int32/int64
        cupy array and ``out`` a C-contiguous cupy array, all on one device
        (validated by :mod:`fastembed.validate`). Raises IndexError for a bad
        id unless inside :func:`deferred_id_checks`.
        """
        import cupy

        device_id = int(table.device.id)
        id_type = ID_TYPES.get(np.dtype(ids.dtype))
        if id_type is None:
            raise TypeError(f"the cuda backend takes int32 or int64 ids, got {np.dtype(ids.dtype)}")
        with cupy.cuda.Device(device_id):
            if out is None:
                out = cupy.empty(tuple(ids.shape) + (int(table.shape[1]),), dtype=table.dtype)
            n = int(ids.size)
            if n == 0:
                return out
            # The kernel reads ids as one contiguous run: a strided view is compacted first.
            flat_ids = ids if ids.ndim == 1 and ids.flags.c_contiguous else cupy.ascontiguousarray(ids).reshape(-1)
            vocab_size = int(table.shape[0])
            row_bytes = int(table.shape[1]) * table.dtype.itemsize
            size, vec_type = vector_bytes(row_bytes, table.data.ptr, out.data.ptr)
            vecs_per_row = row_bytes // size
            kernel = self._kernel(device_id, id_type, vec_type)
            deferred = _deferred.get()
            flag = self._deferred_flag(device_id) if deferred else self._thread_flag(device_id)
            blocks, threads = launch_geometry(n, vecs_per_row, self._sm_count(device_id))
            # CuPy does not check kernel argument types: pass the exact C types.
            kernel(
                (blocks,),
                (threads,),
                (table, flat_ids, out, np.int64(n), np.int64(vocab_size), np.int64(vecs_per_row), flag),
            )
            if not deferred:
                position = int(flag.get()[0])  # synchronises with the stream
                if position != int(NO_ERROR):
                    flag.fill(NO_ERROR)
                    raise validate.out_of_range_error(ids, position, vocab_size)
        return out

    def describe(self) -> dict[str, Any]:
        if self.unavailable_reasons():
            return {}
        import cupy

        devices = []
        for index in range(cupy.cuda.runtime.getDeviceCount()):
            properties = cupy.cuda.runtime.getDeviceProperties(index)
            name = properties["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            devices.append(f"cuda:{index} {name} ({properties['totalGlobalMem'] / 2**30:.0f} GiB)")
        return {"cupy": cupy.__version__, "devices": devices}

    # -- per-device state -----------------------------------------------------------------------------

    def _once(self, cache: dict[Any, Any], key: Any, make: Any) -> Any:
        """``cache[key]``, made by ``make()`` by one thread only the first time."""
        value = cache.get(key)
        if value is None:
            with self._lock:
                value = cache.get(key)
                if value is None:
                    value = cache[key] = make()
        return value

    def _module(self, device_id: int) -> Any:
        def compile_module() -> Any:
            import cupy

            with cupy.cuda.Device(device_id):
                return cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=COMPILE_OPTIONS,
                                      name_expressions=list(KERNEL_NAMES))

        return self._once(self._modules, device_id, compile_module)

    def _kernel(self, device_id: int, id_type: str, vec_type: str) -> Any:
        key = (device_id, id_type, vec_type)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = self._module(device_id).get_function(_kernel_name(id_type, vec_type))
        return kernel

    def _new_flag(self, device_id: int) -> Any:
        import cupy

        with cupy.cuda.Device(device_id):
            return cupy.full(1, NO_ERROR, dtype=cupy.uint64)

    def _thread_flag(self, device_id: int) -> Any:
        local = self._thread_flags
        flags = getattr(local, "flags", None)
        if flags is None:
            flags = local.flags = {}
        flag = flags.get(device_id)
        if flag is None:
            flag = flags[device_id] = self._new_flag(device_id)
        return flag

    def _deferred_flag(self, device_id: int) -> Any:
        return self._once(self._deferred_flags, device_id, lambda: self._new_flag(device_id))

    def _sm_count(self, device_id: int) -> int:
        count = self._sm_counts.get(device_id)
        if count is None:
            import cupy

            count = self._sm_counts[device_id] = int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])
        return count

    def _take_deferred_error(self, device_id: int) -> int | None:
        """The smallest bad position recorded by deferred lookups on `device_id` (clearing it), or None."""
        flag = self._deferred_flags.get(device_id)
        if flag is None:
            return None  # no deferred lookup ran there since the last reset
        import cupy

        with cupy.cuda.Device(device_id):
            position = int(flag.get()[0])
            if position == int(NO_ERROR):
                return None
            flag.fill(NO_ERROR)
        return position


def _probe() -> list[str]:
    if importlib.util.find_spec("cupy") is None:
        return ["cupy is not installed (pip install 'fastembed-gather[cuda12]' or '[cuda13]')"]
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # a broken install, or cupy's own CUDA error types
        return [f"cupy is installed but CUDA is unusable: {type(error).__name__}: {error}"]
    if count == 0:
        return ["cupy is installed but no CUDA device is visible"]
    return []


BACKEND = CudaBackend()


def to_device(table: Any, device_id: int) -> Any:
    """A copy of a host table on `device_id` (the one explicit host-to-device move).

    CuPy has no bfloat16 (or other ml_dtypes) arrays: such tables travel as
    same-size unsigned words (bfloat16 -> uint16), and lookups return those
    words; ``cupy.asnumpy(rows).view(ml_dtypes.bfloat16)`` reads them back.
    """
    import cupy

    host = np.ascontiguousarray(table)
    if host.dtype.kind == "V" or host.dtype.type.__module__.partition(".")[0] == "ml_dtypes":
        if host.dtype.itemsize not in (1, 2, 4, 8):
            raise TypeError(f"cannot move a table of dtype {host.dtype} to the GPU: cupy has no dtype of "
                            f"{host.dtype.itemsize} bytes to carry it")
        host = host.view(f"u{host.dtype.itemsize}")
    with cupy.cuda.Device(device_id):
        return cupy.asarray(host)


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


@contextlib.contextmanager
def deferred_id_checks() -> Iterator[None]:
    """Skip the synchronising bad-id check in CUDA lookups inside this block.

    Bad ids still never read outside the table; their rows are written as
    zeros and the smallest bad position is kept until
    :func:`raise_deferred_id_errors` reads it.
    """
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def raise_deferred_id_errors(device_id: int = 0) -> None:
    """Raise IndexError if a deferred CUDA lookup on `device_id` saw a bad id, and clear the flag.

    Reading the flag synchronises with the current stream: call it on the
    stream the lookups ran on. The position counts from the start of a
    lookup's flattened ids (the smallest over the deferred lookups since the
    last check); the value is not kept (the ids may be gone by now).
    """
    if BACKEND.unavailable_reasons():
        return
    position = BACKEND._take_deferred_error(device_id)
    if position is not None:
        raise IndexError(
            f"a deferred CUDA lookup on device {device_id} had an id out of range at flattened position "
            f"{position}; its row was written as zeros"
        )
