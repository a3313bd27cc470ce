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
checking at once never read each other's error), taken out of the thread's
set while a lookup uses it and dropped, never reset, once it holds an
error; deferred lookups share one flag per device until
:func:`raise_deferred_id_errors` reads it and, if it holds an error,
replaces it. A deferred launch and that check exclude each other, so no
deferred lookup's error is lost between the check's read and the swap.

Quantized tables (:class:`fastembed.formats.QuantizedTable` over cupy
arrays) are dequantized while gathering by ``fastembed/kernels/dequant.cu``,
one module per format compiled on first use, into float32, float16 or
bfloat16 (cupy has no bfloat16: those results are uint16 words).
:meth:`CudaBackend.dequantize` checks the ids in a first small kernel and
raises before anything is written, so a caller's ``out`` is untouched by a
bad id; inside :func:`deferred_id_checks` it skips that check and behaves
like the gather (bad rows zero, the position kept for later).
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import validate
from ..arrays.cupy_adapter import ADAPTER as CUPY
from ..formats import QuantizedTable
from .base import DENSE, Capabilities, missing_package

KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "gather.cu"
DEQUANT_SOURCE = KERNEL_SOURCE.with_name("dequant.cu")
#: (vector bytes, the CUDA type used for it); the widest that fits is used.
VECTOR_TYPES = ((16, "uint4"), (8, "uint2"), (4, "unsigned int"), (2, "unsigned short"), (1, "unsigned char"))
ID_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
#: Threads per block at most: one block per row, a warp per 32 vectors of it
#: (rows of 512 vectors or more take 128 threads: :func:`launch_geometry`).
MAX_THREADS_PER_BLOCK = 256
#: Resident blocks per SM the grid is sized for (grid-stride beyond that).
BLOCKS_PER_SM = 32
#: The flag's value while no bad id has been seen.
NO_ERROR = np.uint64(0xFFFFFFFFFFFFFFFF)
COMPILE_OPTIONS = ("-std=c++17",)
#: The dequantizing kernels must round every product and sum on its own, as the reference does.
DEQUANT_COMPILE_OPTIONS = ("-std=c++17", "--fmad=false", "--ftz=false")
#: Per format: (its type in dequant.cu, values one thread dequantizes per step; sizes the launch only).
DEQUANT_FORMATS = {
    "q8_0": ("Q8_0", 16), "q4_0": ("Q4_0", 16), "q4_1": ("Q4_1", 16), "q5_0": ("Q5_0", 16), "q5_1": ("Q5_1", 16),
    "q4_k": ("Q4_K", 16), "q5_k": ("Q5_K", 16), "q6_k": ("Q6_K", 32), "fp8_e4m3": ("FP8_E4M3", 8),
}
#: Output dtype name -> (its type in dequant.cu, the cupy dtype holding it).
DEQUANT_OUTPUTS = {"float32": ("F32", np.dtype(np.float32)), "float16": ("F16", np.dtype(np.float16)),
                   "bfloat16": ("BF16", np.dtype(np.uint16))}
#: Threads per block of the id check (one id per thread, grid-stride beyond the grid).
CHECK_THREADS = 256

_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("fastembed_deferred_id_checks", default=False)


def _kernel_name(id_type: str, vec_type: str) -> str:
    return f"gather_rows<{id_type}, {vec_type}>"


#: Every instantiation the module is compiled with (``name_expressions``).
KERNEL_NAMES = tuple(_kernel_name(id_type, vec_type) for id_type in ID_TYPES.values() for _, vec_type in VECTOR_TYPES)


def dequant_kernel_name(format_name: str, output: str, id_type: str) -> str:
    """The name expression of the dequantizing kernel for a format, output dtype name and CUDA id type."""
    return f"dequant_rows<{DEQUANT_FORMATS[format_name][0]}, {DEQUANT_OUTPUTS[output][0]}, {id_type}>"


def check_kernel_name(id_type: str) -> str:
    return f"check_ids<{id_type}>"


def dequant_kernel_names(format_name: str) -> tuple[str, ...]:
    """Every instantiation the module of `format_name` is compiled with: each output and id type, and the id checks."""
    return tuple(dequant_kernel_name(format_name, output, id_type) for output in DEQUANT_OUTPUTS
                 for id_type in ID_TYPES.values()) + tuple(check_kernel_name(t) for t in ID_TYPES.values())


class CudaBackend:
    """Gathers rows of a cupy table on its CUDA device (see the module docstring)."""

    name = "cuda"
    capabilities = Capabilities(array_libraries=frozenset({"cupy"}), devices=frozenset({"cuda"}),
                                formats=frozenset({DENSE, *DEQUANT_FORMATS}))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deferred_lock = threading.Lock()  # a deferred launch and a check of the deferred flag, one at a time
        self.reset()

    def reset(self) -> None:
        """Forget availability, compiled modules, kernels, bad-id flags and SM counts.

        For tests (installing or removing cupy) and after installs; arrays
        handed out before stay valid.
        """
        with self._lock, self._deferred_lock:
            self._unavailable: list[str] | None = None
            self._modules: dict[int, Any] = {}
            self._kernels: dict[tuple[int, str, str], Any] = {}  # also (device, format, name) of dequant kernels
            self._deferred_flags: dict[int, Any] = {}
            self._thread_flags = threading.local()  # .flags: {device id: flag} of one thread
            self._sm_counts: dict[int, int] = {}
            self._dequant_modules: dict[tuple[int, str], Any] = {}
            self._scratch_flags: dict[int, Any] = {}
            self._no_scales: dict[int, Any] = {}

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
            blocks, threads = launch_geometry(n, vecs_per_row, self._sm_count(device_id))

            def launch(flag: Any) -> None:
                # CuPy does not check kernel argument types: pass the exact C types.
                kernel(
                    (blocks,),
                    (threads,),
                    (table, flat_ids, out, np.int64(n), np.int64(vocab_size), np.int64(vecs_per_row), flag),
                )

            if _deferred.get():
                self._launch_deferred(device_id, launch)
            else:
                position = self._launch_checked(device_id, launch)
                if position is not None:
                    raise validate.out_of_range_error(ids, position, vocab_size)
        return out

    def dequantize(self, table: QuantizedTable, ids: Any, out: Any | None, dtype: np.dtype) -> Any:
        """Write the dequantized ``table[ids]`` as `dtype` into ``out`` (None: a new cupy array) and return it.

        ``table`` is a validated :class:`QuantizedTable` over cupy arrays,
        ``ids`` an int32/int64 cupy array and ``out`` a C-contiguous cupy
        array of ``ids.shape + (dim,)`` on the table's device (uint16 words
        for bfloat16). Results are bit for bit
        :func:`fastembed.formats.dequantize_rows` rounded to `dtype`, but
        for NaNs, which are the device's canonical NaN (docs/gpu.md).

        Raises:
            IndexError: a bad id (:func:`fastembed.validate.out_of_range_error`),
                before anything is written; inside :func:`deferred_id_checks`
                the rows of bad ids are zero and nothing is raised.
            TypeError: ids, a format or a dtype this backend has no kernel for.
        """
        import cupy

        data, fmt, dim = table.data, table.format, int(table.dim)
        device_id = int(data.device.id)
        id_type = ID_TYPES.get(np.dtype(ids.dtype))
        if id_type is None:
            raise TypeError(f"the cuda backend takes int32 or int64 ids, got {np.dtype(ids.dtype)}")
        output = np.dtype(dtype).name
        if fmt.name not in DEQUANT_FORMATS or output not in DEQUANT_OUTPUTS:
            raise TypeError(f"the cuda backend dequantizes {', '.join(DEQUANT_FORMATS)} into "
                            f"{', '.join(DEQUANT_OUTPUTS)}, not {fmt.name} into {output}")
        with cupy.cuda.Device(device_id):
            if out is None:
                out = cupy.empty(tuple(ids.shape) + (dim,), dtype=DEQUANT_OUTPUTS[output][1])
            n = int(ids.size)
            if n == 0:
                return out
            flat_ids = ids if ids.ndim == 1 and ids.flags.c_contiguous else cupy.ascontiguousarray(ids).reshape(-1)
            vocab_size = int(data.shape[0])
            scales = table.scales if fmt.row_scale else self._no_scales_array(device_id)
            kernel = self._kernel_of(device_id, fmt.name, dequant_kernel_name(fmt.name, output, id_type))
            units_per_row = -(-dim // DEQUANT_FORMATS[fmt.name][1])
            blocks, threads = launch_geometry(n, units_per_row, self._sm_count(device_id))

            def launch(flag: Any) -> None:
                kernel(
                    (blocks,),
                    (threads,),
                    (data, scales, flat_ids, out, np.int64(n), np.int64(vocab_size), np.int64(data.shape[1]),
                     np.int64(dim), flag),
                )

            if _deferred.get():
                self._launch_deferred(device_id, launch)
            else:
                self._check_ids(device_id, fmt.name, id_type, ids, flat_ids, vocab_size)
                # Checked ids can only turn bad if another writer changes them meanwhile; no one reads this flag.
                launch(self._once(self._scratch_flags, device_id, lambda: self._new_flag(device_id)))
        return out

    def _check_ids(self, device_id: int, format_name: str, id_type: str, ids: Any, flat_ids: Any,
                   vocab_size: int) -> None:
        """Raise the IndexError of the first id outside [0, vocab_size) (one small kernel and one synchronisation)."""
        n = int(flat_ids.size)
        blocks = max(1, min(-(-n // CHECK_THREADS), self._sm_count(device_id) * BLOCKS_PER_SM))
        kernel = self._kernel_of(device_id, format_name, check_kernel_name(id_type))
        position = self._launch_checked(
            device_id, lambda flag: kernel((blocks,), (CHECK_THREADS,), (flat_ids, np.int64(n), np.int64(vocab_size), flag))
        )
        if position is not None:
            raise validate.out_of_range_error(ids, position, vocab_size)

    # -- bad-id flags ---------------------------------------------------------------------------------

    def _launch_checked(self, device_id: int, launch: Callable[[Any], None]) -> int | None:
        """Run ``launch(flag)`` with this thread's flag and return the smallest bad position it recorded, or None.

        The flag is out of the thread's dict while in use and goes back only
        when it is read clean (a flag with an error is dropped, never reset):
        a Ctrl-C at any point leaves no flag that a later lookup could read
        an old error from.
        """
        local = self._thread_flags
        flags = getattr(local, "flags", None)
        if flags is None:
            flags = local.flags = {}
        flag = flags.pop(device_id, None)
        if flag is None:
            flag = self._new_flag(device_id)  # filled on this stream, before the launch on it
        launch(flag)
        position = int(flag.get()[0])  # synchronises with the stream
        if position != int(NO_ERROR):
            return position
        flags[device_id] = flag
        return None

    def _launch_deferred(self, device_id: int, launch: Callable[[Any], None]) -> None:
        """Run ``launch(flag)`` with the device's deferred flag, which a check cannot swap meanwhile."""
        with self._deferred_lock:
            flag = self._deferred_flags.get(device_id)
            if flag is None:
                flag = self._deferred_flags[device_id] = self._new_shared_flag(device_id)
            launch(flag)

    def _take_deferred_error(self, device_id: int) -> int | None:
        """The smallest bad position recorded by deferred lookups on `device_id` (replacing the flag), or None.

        Deferred lookups launch under the same lock, so every one is either
        before the device synchronisation (and counted here) or after the
        swap (and counted by the next check); a Ctrl-C before the swap
        leaves the error to the next check.
        """
        import cupy

        with self._deferred_lock:
            flag = self._deferred_flags.get(device_id)
            if flag is None:
                return None  # no deferred lookup ran there since the last error
            with cupy.cuda.Device(device_id) as device:
                # Lookups may have run on any stream (torch's among them): wait for all of them.
                device.synchronize()
                position = int(flag.get()[0])
                if position == int(NO_ERROR):
                    return None
                self._deferred_flags[device_id] = self._new_shared_flag(device_id)
        return position

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

    def _dequant_module(self, device_id: int, format_name: str) -> Any:
        def compile_module() -> Any:
            import cupy

            with cupy.cuda.Device(device_id):
                return cupy.RawModule(code=DEQUANT_SOURCE.read_text(), options=DEQUANT_COMPILE_OPTIONS,
                                      name_expressions=list(dequant_kernel_names(format_name)))

        return self._once(self._dequant_modules, (device_id, format_name), compile_module)

    def _kernel_of(self, device_id: int, format_name: str, name: str) -> Any:
        """Kernel `name` of the dequantizing module of `format_name` on `device_id`."""
        key = (device_id, format_name, name)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = self._dequant_module(device_id, format_name).get_function(name)
        return kernel

    def _no_scales_array(self, device_id: int) -> Any:
        """A one-float array passed as the scales of the formats that keep theirs in the blocks (never read)."""
        def make() -> Any:
            import cupy

            with cupy.cuda.Device(device_id):
                return cupy.zeros(1, dtype=cupy.float32)

        return self._once(self._no_scales, device_id, make)

    def _new_flag(self, device_id: int) -> Any:
        """A "no error" flag, filled on the current stream (a launch on another stream must wait for it)."""
        import cupy

        with cupy.cuda.Device(device_id):
            return cupy.full(1, NO_ERROR, dtype=cupy.uint64)

    def _new_shared_flag(self, device_id: int) -> Any:
        """A "no error" flag that launches on any stream may use: its fill is waited for."""
        import cupy

        flag = self._new_flag(device_id)
        with cupy.cuda.Device(device_id):
            cupy.cuda.get_current_stream().synchronize()
        return flag

    def _sm_count(self, device_id: int) -> int:
        count = self._sm_counts.get(device_id)
        if count is None:
            import cupy

            count = self._sm_counts[device_id] = int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])
        return count


def _probe() -> list[str]:
    missing = missing_package("cupy", "pip install 'fastembed-gather[cuda12]' or '[cuda13]'")
    if missing is not None:
        return [missing]
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
    A :class:`QuantizedTable` moves its data and scales and comes back as a
    QuantizedTable over cupy arrays.

    Raises:
        TypeError: a dtype cupy cannot carry (:meth:`fastembed.arrays.cupy_adapter.CupyAdapter.from_host`).
    """
    device = f"cuda:{device_id}"
    if isinstance(table, QuantizedTable):
        data = CUPY.from_host(table.data, device)
        scales = None if table.scales is None else CUPY.from_host(table.scales, device)
        return QuantizedTable(data, table.format, table.dim, scales)
    return CUPY.from_host(table, device)


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
        threads = 128  # 128 x 16 bytes = 2 KiB per pass: four passes over an 8 KiB row, four vectors per thread in flight
    blocks = max(1, min(n_ids, sm_count * BLOCKS_PER_SM))
    return blocks, threads


@contextlib.contextmanager
def deferred_id_checks() -> Iterator[None]:
    """Skip the synchronising bad-id check in CUDA lookups inside this block.

    Bad ids still never read outside the table; their rows are written as
    zeros and the smallest bad position is kept until
    :func:`raise_deferred_id_errors` reads it. Host lookups are not
    affected: they raise at once.

    Example:
        >>> import numpy as np, fastembed
        >>> with fastembed.deferred_id_checks():  # CUDA lookups in here skip their synchronising check
        ...     rows = fastembed.lookup(np.eye(3, dtype=np.float32), [2])
        >>> fastembed.raise_deferred_id_errors()  # IndexError if one of them had a bad id
    """
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def checked_device_index(device: Any) -> int:
    """`device` as the index of a CUDA device of this machine (where cupy sees none, only its type and sign are checked).

    Raises:
        TypeError: not an int (a device object or "cuda:0" names no index here).
        ValueError: a negative index, or one past the devices cupy sees.
    """
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
        raise TypeError(f"a CUDA device is given by its index (an int), got {type(device).__name__} {device!r}")
    index = int(device)
    if index < 0:
        raise ValueError(f"no CUDA device {index}")
    if not BACKEND.unavailable_reasons():
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        if index >= count:
            raise ValueError(f"no CUDA device {index}: this machine has {count} (0 to {count - 1})")
    return index


def raise_deferred_id_errors(device_id: int = 0) -> None:
    """Raise IndexError if a deferred CUDA lookup on `device_id` saw a bad id, and clear the flag.

    It waits for all work on the device first (a device synchronisation),
    so lookups on any stream, torch's included, are counted. The position
    counts from the start of a lookup's flattened ids (the smallest over the deferred lookups since the
    last check); the value is not kept (the ids may be gone by now).

    Args:
        device_id: the CUDA device whose deferred lookups are checked (default 0).

    Returns:
        None, also where the cuda backend is unavailable (no cupy or no
        device: then no CUDA lookup can have run).

    Raises:
        IndexError: a deferred lookup on `device_id` had an id out of range.
        TypeError: `device_id` is not an integer (a device object or "cuda:0" would
            name no device's flag, and hide a pending error).
        ValueError: no such device.

    Example:
        >>> import fastembed
        >>> fastembed.raise_deferred_id_errors(0)  # silent: no deferred lookup saw a bad id
    """
    device_id = checked_device_index(device_id)
    if BACKEND.unavailable_reasons():
        return
    position = BACKEND._take_deferred_error(device_id)
    if position is not None:
        raise IndexError(
            f"a deferred CUDA lookup on device {device_id} had an id out of range at flattened position "
            f"{position}; its row was written as zeros"
        )
