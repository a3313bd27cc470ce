"""A test double of the part of CuPy that fastembed uses, on host memory.

Never imported by the package: the test suite installs it as ``cupy``
(``tests/cupy_double/__init__.py``), or ``bench/gpu_check.sh`` puts its
folder first on PYTHONPATH for a dry run. "Device" arrays are numpy arrays
in guarded host allocations (256-byte canaries on both sides, 512-byte
aligned like CuPy's pool); ``data.ptr`` is their host address.

Kernels: ``RawModule(code=...)`` compiles the very code it is given with
g++ against ``tests/cuda_emulation`` (cuda_host.h + driver.cpp for
``gather_rows``, + dequant_driver.cpp for ``dequant_rows`` and
``check_ids``; once per code, cached in the temp folder), and a launch runs
it through that host emulation, blocks in a shuffled order. A dequantizing
module must be compiled with ``--fmad=false`` and without fast math, as a
GPU would otherwise fuse multiply-adds or flush subnormals. A launch checks what a real one
would need: grid and block tuples within CUDA's limits, exactly the
kernel's argument C types (numpy scalars of the right width, device arrays
for pointers: a Python int is refused), arrays on the current device,
vector-aligned pointers, and every load and store inside the kernel
aligned to its type (g++'s alignment sanitizer, which aborts the process
naming the address: x86 may run a misaligned access that a GPU faults on,
or crash without a word). It also checks what a real one would get wrong
silently or fatally: every read must lie inside the arrays the kernel
reads (table or data, scales, ids; a read outside them is an illegal
address), the output must hold the rows
written, and the canaries around the output and the flag must be intact.
An illegal address poisons the device like a real sticky CUDA error:
every later call on it raises, until the double is installed again.

Like CuPy, an array never converts to numpy implicitly (``np.asarray``
raises TypeError): ``.get()`` or ``cupy.asnumpy`` copy it to the host.
"""
from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import os
import re
import stat
import subprocess
import tempfile
import threading
import time
import types
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np

__version__ = "13.99.0+fastembed.double"
#: Tells tests (and gpu_check.sh's dry run) that this is the double.
IS_FASTEMBED_DOUBLE = True

_EMULATION = Path(__file__).resolve().parent.parent.parent / "cuda_emulation"
_DEVICE_COUNT = int(os.environ.get("FASTEMBED_CUPY_DOUBLE_DEVICES", "2"))
_SM_COUNT = 2  # few: 64 resident blocks, so batches above 64 ids take the grid-stride path
_ALIGN, _GUARD, _CANARY = 512, 256, 0xCD

# numpy dtypes re-exported as CuPy does.
bool_, int8, int16, int32, int64 = np.bool_, np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
float16, float32, float64, complex64, complex128 = np.float16, np.float32, np.float64, np.complex64, np.complex128
intp, dtype = np.intp, np.dtype


class CUDARuntimeError(RuntimeError):
    """A CUDA runtime error (cupy.cuda.runtime.CUDARuntimeError)."""


class CUDADriverError(RuntimeError):
    """A CUDA driver error (cupy.cuda.driver.CUDADriverError), e.g. an illegal address in a kernel."""


def _supported(dtype_like: Any) -> np.dtype:
    resolved = np.dtype(dtype_like)
    if resolved.kind not in "biufc":
        raise ValueError(f"Unsupported dtype {resolved}")
    return resolved


# -- devices and their sticky errors -------------------------------------------------------------------

_state = threading.local()
_sticky: dict[int, str] = {}  # device id -> the error that poisoned it


def _current() -> int:
    return getattr(_state, "device", 0)


def _check_device(device_id: int) -> None:
    if not 0 <= device_id < _DEVICE_COUNT:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {device_id}")
    if device_id in _sticky:
        raise CUDARuntimeError(f"cudaErrorIllegalAddress (sticky since an earlier kernel): {_sticky[device_id]}")


class Device:
    """cupy.cuda.Device: a context manager that makes its device current."""

    def __init__(self, device: int | None = None) -> None:
        self.id = _current() if device is None else int(device)
        if not 0 <= self.id < _DEVICE_COUNT:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")
        self._saved: list[int] = []

    @property
    def attributes(self) -> dict[str, int]:
        return {"MultiProcessorCount": _SM_COUNT, "MaxThreadsPerBlock": 1024, "WarpSize": 32}

    @property
    def compute_capability(self) -> str:
        return "90"

    def use(self) -> None:
        _state.device = self.id

    def synchronize(self) -> None:
        _check_device(self.id)

    def __enter__(self) -> Device:
        self._saved.append(_current())
        _state.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.device = self._saved.pop()

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


# -- memory --------------------------------------------------------------------------------------------

class _Allocation:
    """Host bytes standing in for one device allocation, with canaries on both sides."""

    live: weakref.WeakSet[_Allocation] = weakref.WeakSet()

    def __init__(self, size: int, device_id: int) -> None:
        _check_device(device_id)
        self.size, self.device = int(size), device_id
        self.raw = np.empty(self.size + 2 * _GUARD + _ALIGN, np.uint8)
        skip = (-(self.raw.ctypes.data + _GUARD)) % _ALIGN
        self.before = self.raw[skip : skip + _GUARD]
        self.bytes = self.raw[skip + _GUARD : skip + _GUARD + self.size]
        self.after = self.raw[skip + _GUARD + self.size : skip + 2 * _GUARD + self.size]
        self.before.fill(_CANARY)
        self.after.fill(_CANARY)
        self.ptr = self.bytes.ctypes.data
        _Allocation.live.add(self)

    def canaries_intact(self) -> bool:
        return bool((self.before == _CANARY).all() and (self.after == _CANARY).all())

    def holds(self, start: int, size: int) -> bool:
        return self.ptr <= start and start + size <= self.ptr + self.size


class MemoryPointer:
    """cupy.cuda.MemoryPointer: an address inside one allocation."""

    def __init__(self, allocation: _Allocation, ptr: int) -> None:
        self._allocation, self.ptr = allocation, int(ptr)

    @property
    def device(self) -> Device:
        return Device(self._allocation.device)

    @property
    def device_id(self) -> int:
        return self._allocation.device

    def _span(self, size: int) -> None:
        if not self._allocation.holds(self.ptr, size):
            raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: {size} bytes at {self.ptr:#x} run past their allocation")

    def copy_from_device_async(self, src: MemoryPointer, size: int, stream: Any = None) -> None:
        _check_device(self._allocation.device)
        self._span(size)
        src._span(size)
        ctypes.memmove(self.ptr, src.ptr, int(size))

    copy_from_device = copy_from_device_async

    def copy_from_host(self, mem: Any, size: int) -> None:
        self._span(size)
        ctypes.memmove(self.ptr, mem, int(size))

    def copy_to_host(self, mem: Any, size: int) -> None:
        self._span(size)
        ctypes.memmove(mem, self.ptr, int(size))

    def memset_async(self, value: int, size: int, stream: Any = None) -> None:
        self._span(size)
        ctypes.memset(self.ptr, int(value), int(size))

    def __int__(self) -> int:
        return self.ptr


class MemoryPool:
    """cupy.get_default_memory_pool(): counts the bytes of live allocations (rounded to 512)."""

    def used_bytes(self) -> int:
        return sum(-(-a.size // _ALIGN) * _ALIGN for a in list(_Allocation.live))

    def total_bytes(self) -> int:
        return self.used_bytes()

    def free_all_blocks(self, stream: Any = None) -> None:
        pass

    def n_free_blocks(self) -> int:
        return 0


_POOL = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _POOL


# -- arrays --------------------------------------------------------------------------------------------

class _Flags:
    def __init__(self, host: np.ndarray, owndata: bool) -> None:
        self.c_contiguous = bool(host.flags.c_contiguous)
        self.f_contiguous = bool(host.flags.f_contiguous)
        self.owndata = owndata

    def __getitem__(self, key: str) -> bool:
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous, "OWNDATA": self.owndata}[key]


def _device_copy(host: np.ndarray, device_id: int) -> ndarray:
    host = np.asarray(host)
    result = ndarray(host.shape, _supported(host.dtype), _device=device_id)
    result._host[...] = host
    return result


def _reduction(name: str):
    def method(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(getattr(self._live(), name)(*args, **kwargs))

    method.__name__ = name
    return method


def _operator(name: str):
    def method(self, other: Any) -> Any:
        if isinstance(other, ndarray) and other._allocation.device != self._allocation.device:
            raise ValueError("arrays on different devices")
        return self._wrap(getattr(self._live(), name)(_unwrap(other)))

    method.__name__ = name
    return method


_REDUCTIONS = ("min", "max", "argmin", "argmax", "sum", "any", "all", "mean")
_OPERATORS = ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__or__", "__and__", "__xor__", "__add__",
              "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__mod__", "__ror__", "__rand__")


class ndarray:
    """cupy.ndarray over host memory (see the module docstring)."""

    __array_priority__ = 100.0
    __array_ufunc__ = None  # numpy defers to these operators instead of converting

    def __init__(self, shape: Any, dtype: Any = float, memptr: Any = None, strides: Any = None, order: str = "C",
                 _device: int | None = None) -> None:
        resolved = _supported(dtype)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        allocation = _Allocation(int(np.prod(shape, dtype=np.int64)) * resolved.itemsize,
                                 _current() if _device is None else _device)
        self._allocation = allocation
        self._host = allocation.bytes.view(resolved).reshape(shape, order=order)
        self._owndata = True

    @classmethod
    def _view_of(cls, host: np.ndarray, allocation: _Allocation) -> ndarray:
        array = cls.__new__(cls)
        array._allocation, array._host, array._owndata = allocation, host, False
        return array

    def _wrap(self, result: Any) -> Any:
        """A result of a numpy operation on the host data, as a device array on this array's device."""
        if isinstance(result, np.ndarray):
            if result.size and np.may_share_memory(result, self._allocation.bytes):
                return ndarray._view_of(result, self._allocation)
            return _device_copy(result, self._allocation.device)
        if isinstance(result, (np.generic, bool, int, float, complex)):
            return _device_copy(np.asarray(result), self._allocation.device)
        return result

    def _live(self) -> np.ndarray:
        _check_device(self._allocation.device)
        return self._host

    # -- attributes ---------------------------------------------------------------------------------
    def _set_shape(self, shape: Any) -> None:
        """In place, as cupy allows for contiguous arrays (a new host view: the old one may be held by readers)."""
        self._host = self._host.reshape(shape)

    shape = property(lambda self: self._host.shape, _set_shape)
    dtype = property(lambda self: self._host.dtype)
    strides = property(lambda self: self._host.strides)
    size = property(lambda self: int(self._host.size))
    ndim = property(lambda self: self._host.ndim)
    nbytes = property(lambda self: int(self._host.nbytes))
    itemsize = property(lambda self: self._host.itemsize)
    flags = property(lambda self: _Flags(self._host, self._owndata))
    device = property(lambda self: Device(self._allocation.device))
    data = property(lambda self: MemoryPointer(self._allocation, self._host.ctypes.data if self._host.size else self._allocation.ptr))
    T = property(lambda self: self._wrap(self._host.T))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        host = self._host
        return {
            "shape": host.shape, "typestr": host.dtype.str, "descr": host.dtype.descr,
            "strides": None if host.flags.c_contiguous else host.strides,
            "data": (self.data.ptr if host.size else 0, False), "version": 3,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self._allocation.device)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> DLPackCapsule:
        """A capsule over this array's memory for a consumer working on `stream` (the DLPack protocol).

        As CuPy does: None means the legacy default stream, -1 no
        synchronisation; a consumer stream other than the current one waits
        for it (an event, logged in :data:`stream_waits`). Refused: stream 0,
        which DLPack disallows, a non-int stream, another device, a copy.
        """
        if stream is not None and type(stream) is not int:
            raise TypeError(f"stream must be an int or None, got {type(stream).__name__}")
        if stream == 0:
            raise ValueError("stream=0 is disallowed by the DLPack protocol (ambiguous): use 1 for the legacy stream")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"the double exports cuda:{self._allocation.device} memory only, not {dl_device}")
        if copy:
            raise BufferError("the double never copies on export")
        with Device(self._allocation.device):
            _check_device(self._allocation.device)
            current = get_current_stream().ptr or 1
            consumer = 1 if stream is None else stream
            if consumer != -1 and consumer != current:
                stream_waits.append((consumer, current))
        return DLPackCapsule(self.data.ptr, self.shape, self.strides, self.dtype, self._allocation.device, self,
                             self._host)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    # -- views, copies, host transfers -------------------------------------------------------------
    def view(self, dtype: Any = None) -> ndarray:
        host = self._host.view() if dtype is None else self._host.view(_supported(dtype))
        return ndarray._view_of(host, self._allocation)

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        if len(shape) == 1 and not np.isscalar(shape[0]):
            shape = tuple(shape[0])
        return self._wrap(self._host.reshape(shape, order=order))

    def ravel(self, order: str = "C") -> ndarray:
        return self._wrap(self._host.ravel(order))

    def astype(self, dtype: Any, copy: bool = True, **kwargs: Any) -> ndarray:
        resolved = _supported(dtype)
        if not copy and resolved == self.dtype:
            return self
        return _device_copy(self._live().astype(resolved), _current())  # as CuPy: on the current device

    def copy(self, order: str = "C") -> ndarray:
        return _device_copy(self._live(), _current())

    def get(self, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
        host = np.array(self._live(), copy=True, order=order)
        if out is not None:
            out[...] = host
            return out
        return host

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        self._live()[...] = arr

    def fill(self, value: Any) -> None:
        self._live().fill(value)

    # -- indexing ------------------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> ndarray:
        return self._wrap(self._live()[_unwrap_key(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._live()[_unwrap_key(key)] = _unwrap(value)

    def __len__(self) -> int:
        return len(self._host)

    def __iter__(self):
        for index in range(len(self)):
            yield self[index]

    # -- scalars (each synchronises on a real GPU) ---------------------------------------------------
    def _scalar(self) -> Any:
        if self.size != 1:
            raise TypeError("only size-1 arrays can be converted to Python scalars")
        return self._live().reshape(-1)[0]

    def __int__(self) -> int:
        return int(self._scalar())

    def __float__(self) -> float:
        return float(self._scalar())

    def __bool__(self) -> bool:
        return bool(self._scalar())

    def item(self) -> Any:
        return self._scalar().item()

    def tolist(self) -> Any:
        return self._live().tolist()

    # -- operators: see _OPERATORS, attached below the class
    __hash__ = None  # type: ignore[assignment]

    def __invert__(self) -> ndarray:
        return self._wrap(~self._live())

    def __neg__(self) -> ndarray:
        return self._wrap(-self._live())

    def __repr__(self) -> str:
        return f"array({np.array2string(self._host, separator=', ')}, dtype={self.dtype}) [double, cuda:{self._allocation.device}]"


for _name in _REDUCTIONS:
    setattr(ndarray, _name, _reduction(_name))
for _name in _OPERATORS:
    setattr(ndarray, _name, _operator(_name))
ndarray.__module__ = "cupy"  # as CuPy reports it (cupy._core.core.ndarray is exported as cupy.ndarray)


def _unwrap(value: Any) -> Any:
    if isinstance(value, ndarray):
        return value._live()
    return value


def _unwrap_key(key: Any) -> Any:
    if isinstance(key, tuple):
        return tuple(_unwrap(k) for k in key)
    return _unwrap(key)


# -- array creation and functions ----------------------------------------------------------------------

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3


class DLPackCapsule:
    """A DLPack capsule as the doubles exchange it (the CuPy double and tests/torch_cuda_double.py).

    `strides` in bytes; `dtype` a numpy dtype, or the name of one CuPy lacks
    (``"bfloat16"``, ``"float8_e4m3fn"``); `host` the producer's own host view
    where it has one. A capsule is consumed once, as a real one is.
    """

    def __init__(self, ptr: int, shape: tuple, strides: tuple, dtype: Any, device: int, owner: Any,
                 host: np.ndarray | None = None) -> None:
        self.ptr, self.shape, self.strides, self.dtype = int(ptr), tuple(shape), tuple(strides), dtype
        self.device, self.owner, self.host, self.consumed = int(device), owner, host, False

    def consume(self) -> DLPackCapsule:
        if self.consumed:
            raise ValueError("this DLPack capsule was already consumed")
        self.consumed = True
        return self


def from_dlpack(array: Any, *, device: Any = None, copy: Any = None) -> ndarray:
    """cupy.from_dlpack: a device array over the memory of `array` (no copy), as CuPy does it.

    The producer's device is made current and its ``__dlpack__`` is called
    with CuPy's current stream there (1 for the null stream). Refused like
    CuPy: host (CPU) arrays, dtypes CuPy has not (bfloat16, float8: ValueError
    "Unsupported dtype"), memory that is no device allocation of the double
    (an illegal address on a GPU), a capsule used twice. A zero-size capsule
    (torch gives it a null pointer) becomes an empty array on its device.
    """
    if copy:
        raise NotImplementedError("the double never copies in from_dlpack")
    if not hasattr(array, "__dlpack__"):
        return _from_capsule(array)
    kind, device_id = array.__dlpack_device__()
    if int(kind) != KDL_CUDA:
        raise BufferError(f"CuPy reads CUDA device memory through DLPack; got device type {int(kind)}")
    with Device(int(device_id)):
        stream = get_current_stream().ptr or 1
        try:
            capsule = array.__dlpack__(stream=stream, max_version=(1, 0))
        except TypeError:
            capsule = array.__dlpack__(stream=stream)
    return _from_capsule(capsule)


def _from_capsule(capsule: Any) -> ndarray:
    if not isinstance(capsule, DLPackCapsule):
        raise TypeError(f"the double reads only the doubles' DLPack capsules, got {type(capsule).__name__}")
    capsule.consume()
    dtype = capsule.dtype
    if not isinstance(dtype, np.dtype) or dtype.kind not in "biufc":
        raise ValueError(f"Unsupported dtype {dtype}")
    extent = 0 if 0 in capsule.shape else dtype.itemsize + sum(
        (n - 1) * abs(stride) for n, stride in zip(capsule.shape, capsule.strides, strict=True))
    low = capsule.ptr + sum((n - 1) * stride for n, stride in zip(capsule.shape, capsule.strides, strict=True) if stride < 0)
    allocation = next((a for a in list(_Allocation.live) if a.device == capsule.device and a.holds(low, extent)), None)
    if allocation is None and extent == 0:  # DLPack gives a zero-size tensor a null pointer, and CuPy takes it
        return ndarray(capsule.shape, dtype, _device=capsule.device)
    if allocation is None:
        raise CUDADriverError(f"{extent} bytes at {capsule.ptr:#x} are no memory of cuda:{capsule.device}: "
                              "CUDA_ERROR_ILLEGAL_ADDRESS")
    host = np.ndarray(capsule.shape, dtype, buffer=allocation.bytes, offset=capsule.ptr - allocation.ptr,
                      strides=capsule.strides)
    array = ndarray._view_of(host, allocation)
    array._dlpack_owner = capsule.owner  # the producer's memory stays alive as long as this view
    return array


def asarray(a: Any, dtype: Any = None, order: Any = None) -> ndarray:
    if isinstance(a, ndarray):  # stays where it is, like CuPy
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.asarray(a, dtype=dtype)
    return _device_copy(host, _current())


def array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K", ndmin: int = 0) -> ndarray:
    if isinstance(obj, ndarray):
        return obj.astype(dtype or obj.dtype) if copy else asarray(obj, dtype)
    return _device_copy(np.array(obj, dtype=dtype, ndmin=ndmin), _current())


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else a.copy()


def asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(shape, dtype, order=order)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    result = empty(shape, dtype, order)
    result.fill(0)
    return result


def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    result = empty(shape, dtype, order)
    result.fill(1)
    return result


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    result = empty(shape, np.asarray(fill_value).dtype if dtype is None else dtype, order)
    result.fill(fill_value)
    return result


def empty_like(a: ndarray, dtype: Any = None) -> ndarray:
    with Device(a.device.id):
        return empty(a.shape, dtype or a.dtype)


def zeros_like(a: ndarray, dtype: Any = None) -> ndarray:
    with Device(a.device.id):
        return zeros(a.shape, dtype or a.dtype)


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return _device_copy(np.arange(*args, dtype=dtype), _current())


def take(a: ndarray, indices: Any, axis: int | None = None, out: ndarray | None = None) -> ndarray:
    result = np.take(a._live(), _unwrap(indices), axis=axis, mode="wrap")  # CuPy's take wraps
    if out is None:
        return a._wrap(result)
    out._live()[...] = result
    return out


def resize(a: ndarray, new_shape: Any) -> ndarray:
    return _device_copy(np.resize(a._live(), new_shape), a.device.id)


def may_share_memory(a: ndarray, b: ndarray, max_work: Any = None) -> bool:
    return bool(np.may_share_memory(a._host, b._host))


def shares_memory(a: ndarray, b: ndarray, max_work: Any = None) -> bool:
    return bool(np.shares_memory(a._host, b._host))


# -- streams, events, runtime --------------------------------------------------------------------------

class Stream:
    """cupy.cuda.Stream: the double runs everything at once, so synchronising is a no-op.

    Streams are tracked as CuPy tracks them: one current stream per device and
    thread (the null stream until a ``with stream:`` or ``use()``), a stream
    belongs to the device current when it was made (``device_id``; -1 for the
    null stream), and entering or using it on another device is refused.
    Every launch records the pointer of the stream it ran on (:data:`launches`).
    """

    null: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        self.ptr = 0 if null else id(self)
        self.device_id = -1 if null else _current()

    @classmethod
    def from_external(cls, obj: Any) -> Stream:
        """A stream over a foreign one that speaks the CUDA stream protocol (``__cuda_stream__``), on the current device."""
        version, pointer = obj.__cuda_stream__()
        if version != 0 or not isinstance(pointer, int):
            raise TypeError(f"__cuda_stream__() must return (0, int), got ({version!r}, {pointer!r})")
        stream = cls.__new__(cls)
        stream.ptr, stream.device_id = pointer, _current()
        return stream

    def _device(self) -> int:
        if self.device_id not in (-1, _current()):
            raise RuntimeError(f"The device that the stream is created on ({self.device_id}) does not match "
                               f"with the current device ({_current()})")
        return _current() if self.device_id == -1 else self.device_id

    def synchronize(self) -> None:
        _check_device(_current())

    def __enter__(self) -> Stream:
        device = self._device()
        _stream_stack(device).append(self)
        _state.__dict__.setdefault("stream_devices", []).append(device)
        return self

    def __exit__(self, *exc: Any) -> None:
        _stream_stack(_state.stream_devices.pop()).pop()

    def use(self) -> Stream:
        stack = _stream_stack(self._device())
        stack[-1] = self
        return self

    def record(self, event: Any = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        stream_waits.append((self.ptr, event.stream_ptr))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return hash(self.ptr)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ptr} (device {self.device_id})>"


class ExternalStream(Stream):
    """cupy.cuda.ExternalStream(ptr, device_id=-1): a stream CuPy does not own (deprecated by CuPy 14)."""

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        warnings.warn("ExternalStream is deprecated. Use Stream.from_external() instead", DeprecationWarning,
                      stacklevel=2)
        self.ptr, self.device_id = int(ptr), int(device_id)


Stream.null = Stream(null=True)
#: Every stream-waits-for-event: (the waiting stream's pointer, the pointer of the stream the event was recorded on).
stream_waits: collections.deque = collections.deque(maxlen=256)


def _stream_stack(device: int) -> list[Stream]:
    stacks = _state.__dict__.setdefault("streams", {})
    return stacks.setdefault(device, [Stream.null])


class Event:
    """cupy.cuda.Event: host times (the double's kernels run when launched)."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self.time: float | None = None
        self.stream_ptr: int | None = None

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()
        self.stream_ptr = (get_current_stream() if stream is None else stream).ptr

    def synchronize(self) -> None:
        _check_device(_current())

    @property
    def done(self) -> bool:
        return True


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    """Milliseconds between two recorded events."""
    if start_event.time is None or end_event.time is None:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: an event was not recorded")
    return (end_event.time - start_event.time) * 1e3


def get_current_stream(device_id: int = -1) -> Stream:
    return _stream_stack(_current() if device_id == -1 else device_id)[-1]


def _device_count() -> int:
    return _DEVICE_COUNT


def _properties(device_id: int) -> dict[str, Any]:
    if not 0 <= device_id < _DEVICE_COUNT:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {device_id}")
    return {"name": b"fastembed CuPy double (host emulation)", "totalGlobalMem": 2**30, "multiProcessorCount": _SM_COUNT,
            "major": 9, "minor": 0, "maxThreadsPerBlock": 1024}


runtime = types.ModuleType("cupy.cuda.runtime")
runtime.getDeviceCount = _device_count
runtime.getDeviceProperties = _properties
runtime.getDevice = _current
runtime.CUDARuntimeError = CUDARuntimeError
runtime.runtimeGetVersion = lambda: 13000
runtime.driverGetVersion = lambda: 13000

cuda = types.ModuleType("cupy.cuda")
cuda.Device, cuda.Stream, cuda.Event, cuda.MemoryPointer = Device, Stream, Event, MemoryPointer
cuda.ExternalStream = ExternalStream
cuda.get_elapsed_time, cuda.get_current_stream, cuda.runtime = get_elapsed_time, get_current_stream, runtime
cuda.CUDADriverError, cuda.CUDARuntimeError = CUDADriverError, CUDARuntimeError
cuda.is_available = lambda: _DEVICE_COUNT > 0
cuda.memory = types.SimpleNamespace(MemoryPointer=MemoryPointer, MemoryPool=MemoryPool)


# -- kernels: the host emulation of the given source ---------------------------------------------------

_ID_TYPES = {"int": np.dtype(np.int32), "long long": np.dtype(np.int64)}
_VECTOR_TYPES = {"uint4": 16, "uint2": 8, "unsigned int": 4, "unsigned short": 2, "unsigned char": 1}
_NAME = re.compile(r"^gather_rows<\s*(int|long long)\s*,\s*(uint4|uint2|unsigned int|unsigned short|unsigned char)\s*>$")
_DEQUANT_NAME = re.compile(r"^dequant_rows<\s*(\w+)\s*,\s*(F32|F16|BF16)\s*,\s*(int|long long)\s*>$")
_CHECK_NAME = re.compile(r"^check_ids<\s*(int|long long)\s*>$")
_OUTPUTS = {"F32": (0, 4), "F16": (1, 2), "BF16": (2, 2)}  # dequant.cu output type -> (driver index, bytes)
#: Per kind of module: the driver in tests/cuda_emulation and the file name it includes the code as.
_DRIVERS = {"gather": ("driver.cpp", "gather.cu"), "dequant": ("dequant_driver.cpp", "dequant.cu")}
#: Options the dequantizing module must (not) be compiled with: a real GPU would otherwise fuse or flush.
_DEQUANT_REQUIRED, _DEQUANT_FORBIDDEN = ("--fmad=false",), ("--use_fast_math", "-use_fast_math", "--ftz=true")
_CXX_FLAGS = ("-O2", "-Wall", "-Werror", "-ffp-contract=off", "-fno-strict-aliasing", "-shared", "-fPIC",
              "-fsanitize=alignment", "-fno-sanitize-recover=all")
_libraries: dict[str, ctypes.CDLL] = {}
_build_lock = threading.Lock()
#: Every launch: (kernel name, grid, block, device, stream pointer); tests read which instantiation ran, and where.
launches: collections.deque = collections.deque(maxlen=256)
_launch_counter = iter(range(1 << 62))
_P, _LL, _I, _U = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_uint
_ENTRIES = {  # entry point -> argument types (see the drivers)
    "fe_emulated_gather": [_I, _I, _U, _U, _P, _P, _P, _P, _LL, _LL, _LL, _P, _P, _I, ctypes.POINTER(_P)],
    "fe_emulated_dequant": [_I, _I, _I, _U, _U, _P, _P, _P, _P, _P, _LL, _LL, _LL, _LL, _P, _P, _I, ctypes.POINTER(_P)],
    "fe_emulated_check_ids": [_I, _U, _U, _P, _P, _LL, _LL, _P, _P, _I, ctypes.POINTER(_P)],
}


def _library(code: str, options: tuple[str, ...], kind: str = "gather") -> ctypes.CDLL:
    """The host emulation of `code` through the `kind` driver (a shared library built by g++, cached by content)."""
    standard = next((o for o in options if o.startswith("-std=")), "-std=c++17")
    driver, source = _DRIVERS[kind]
    parts = [code, standard, kind, *_CXX_FLAGS, _compiler_version()]
    parts += [(_EMULATION / name).read_text() for name in ("cuda_host.h", driver)]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    with _build_lock:
        library = _libraries.get(key)
        if library is not None:
            return library
        path = _build_folder() / f"{key}.so"
        if not path.exists():
            with tempfile.TemporaryDirectory() as folder:
                (Path(folder) / source).write_text(code)
                built = Path(folder) / "module.so"
                compiled = subprocess.run(
                    ["g++", *_CXX_FLAGS, standard, f"-I{folder}", f"-I{_EMULATION}", str(_EMULATION / driver),
                     "-o", str(built)], capture_output=True, text=True)
                if compiled.returncode:
                    raise CompileException(compiled.stderr)
                os.replace(built, path)  # atomic: concurrent sessions never load half a file
        library = ctypes.CDLL(str(path))
        for entry, argtypes in _ENTRIES.items():
            function = getattr(library, entry, None)
            if function is not None:
                function.restype, function.argtypes = ctypes.c_int, argtypes
        if kind == "dequant":
            library.fe_dequant_format_name.restype = ctypes.c_char_p
            library.fe_dequant_format_name.argtypes = [ctypes.c_int]
        _libraries[key] = library
        return library


@functools.cache
def _compiler_version() -> str:
    """What ``g++ --version`` says: a library built by another compiler is built again."""
    return subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout


def _build_folder() -> Path:
    """This user's folder of built emulations, which no other user can write: a library is loaded from it as it is."""
    folder = Path(tempfile.gettempdir()) / f"fastembed-cupy-double-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    status = folder.lstat()
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise RuntimeError(f"{folder} is not a folder only this user can write: remove it")
    return folder


def _format_indices(library: ctypes.CDLL) -> dict[str, int]:
    """The dequant driver's format type names -> its indices."""
    indices, index = {}, 0
    while (name := library.fe_dequant_format_name(index)) is not None:
        indices[name.decode()] = index
        index += 1
    return indices


class CompileException(Exception):
    """cupy.cuda.compiler.CompileException: the source did not compile."""


def _kind_of(name: str) -> str:
    if _NAME.match(name):
        return "gather"
    if _DEQUANT_NAME.match(name) or _CHECK_NAME.match(name):
        return "dequant"
    raise CompileException(f"name expression {name!r} is not an instantiation of gather_rows, dequant_rows or check_ids")


class RawModule:
    """cupy.RawModule(code=..., options=..., name_expressions=...), run by the host emulation."""

    def __init__(self, code: str | None = None, *, path: str | None = None, options: tuple = (), backend: str = "nvrtc",
                 translate_cucomplex: bool = False, enable_cooperative_groups: bool = False,
                 name_expressions: Any = None, jitify: bool = False) -> None:
        if code is None:
            raise NotImplementedError("the double compiles source code only (code=...)")
        if not isinstance(options, tuple) or not all(isinstance(o, str) for o in options):
            raise TypeError(f"options must be a tuple of str, got {options!r}")
        self.code, self.options = code, options
        self.name_expressions = None if name_expressions is None else list(name_expressions)
        kinds = {_kind_of(name) for name in self.name_expressions or ()}
        if len(kinds) > 1:
            raise CompileException("the double compiles gather_rows and the dequantizing kernels as separate modules")
        self.kind = kinds.pop() if kinds else "gather"
        if self.kind == "dequant" and (any(o not in options for o in _DEQUANT_REQUIRED)
                                       or any(o in options for o in _DEQUANT_FORBIDDEN)):
            raise CompileException(f"the dequantizing kernels must be compiled with {' '.join(_DEQUANT_REQUIRED)} and "
                                   f"without {', '.join(_DEQUANT_FORBIDDEN)}: a GPU would otherwise fuse multiply-adds "
                                   f"or flush subnormals and differ from the reference; got {options}")
        self._library = _library(code, options, self.kind)
        if self.kind == "dequant":
            formats = _format_indices(self._library)
            for name in self.name_expressions or ():
                match = _DEQUANT_NAME.match(name)
                if match and match.group(1) not in formats:
                    raise CompileException(f"{name}: no format type {match.group(1)!r} in the source")

    def get_function(self, name: str) -> _Kernel:
        if self.name_expressions is None or name not in self.name_expressions:
            raise KeyError(f"{name!r} was not among the name expressions the module was compiled with")
        if self.kind == "gather":
            id_type, vec_type = _NAME.match(name).groups()  # type: ignore[union-attr]
            return RawKernel(self._library, name, _ID_TYPES[id_type], _VECTOR_TYPES[vec_type])
        dequant = _DEQUANT_NAME.match(name)
        if dequant:
            fmt, output, id_type = dequant.groups()
            return DequantKernel(self._library, name, _ID_TYPES[id_type], _format_indices(self._library)[fmt],
                                 *_OUTPUTS[output])
        return CheckKernel(self._library, name, _ID_TYPES[_CHECK_NAME.match(name).group(1)])  # type: ignore[union-attr]


def _argument_error(name: str, index: int, expected: str, got: Any) -> TypeError:
    return TypeError(f"{name}: argument {index} must be {expected}, got {type(got).__module__}.{type(got).__name__} {got!r}")


class _Kernel:
    """What every launch checks: dimensions, argument C types, devices, ids, alignment, reads, canaries.

    A subclass names its arguments (``_SIGNATURE``), which of them are
    pointers and which ``long long``, and implements ``_launch``.
    """

    _SIGNATURE: tuple[str, ...] = ()
    _POINTERS: tuple[int, ...] = ()
    _SCALARS: tuple[int, ...] = ()

    def __init__(self, library: ctypes.CDLL, name: str, id_dtype: np.dtype) -> None:
        self._library, self.name, self._id_dtype = library, name, id_dtype

    def __call__(self, grid: Any, block: Any, args: Any, *, shared_mem: int = 0, stream: Any = None,
                 enable_cooperative_groups: bool = False) -> None:
        name = self.name
        grid_x, block_x = _dimension(name, "grid", grid, 2**31 - 1), _dimension(name, "block", block, 1024)
        if not isinstance(args, tuple) or len(args) != len(self._SIGNATURE):
            raise TypeError(f"{name}: args must be a tuple of {len(self._SIGNATURE)} ({', '.join(self._SIGNATURE)})")
        for index in self._POINTERS:
            if not isinstance(args[index], ndarray):
                raise _argument_error(name, index, f"a cupy array ({self._SIGNATURE[index]} is a pointer)", args[index])
        for index in self._SCALARS:  # long long: exactly 8 bytes; a Python int is not a C type
            if type(args[index]) not in (np.int64, np.longlong):
                raise _argument_error(name, index, "numpy.int64 (long long)", args[index])
        device_id = _current()
        _check_device(device_id)
        for index in self._POINTERS:
            if args[index].device.id != device_id:
                raise CUDADriverError(f"{name}: argument {index} lives on cuda:{args[index].device.id}, "
                                      f"launched on cuda:{device_id}: CUDA_ERROR_ILLEGAL_ADDRESS")
        if any(int(args[index]) < 0 for index in self._SCALARS):
            raise ValueError(f"{name}: negative sizes")
        launch_stream = get_current_stream() if stream is None else stream
        if launch_stream.device_id not in (-1, device_id):
            raise CUDADriverError(f"{name}: a stream of cuda:{launch_stream.device_id} used on cuda:{device_id}: "
                                  "CUDA_ERROR_INVALID_HANDLE")
        order = np.random.default_rng(next(_launch_counter)).permutation(grid_x).astype(np.uint32)
        launches.append((name, grid_x, block_x, device_id, launch_stream.ptr))
        fault = ctypes.c_void_p(0)
        status, written = self._launch(grid_x, block_x, order, args, fault)
        if status == 1:
            raise CUDADriverError(f"{name}: no such instantiation in the emulation")
        if status == 2 or not all(array._allocation.canaries_intact() for array in written):
            what = f"read at {fault.value:#x} outside the readable arrays" if status == 2 else "write past an allocation"
            _sticky[device_id] = f"{name}: {what}"
            raise CUDADriverError(f"{name}: CUDA_ERROR_ILLEGAL_ADDRESS ({what}); the device is unusable from now on")

    def _launch(self, grid: int, block: int, order: np.ndarray, args: tuple, fault: ctypes.c_void_p) -> tuple[int, list]:
        """Run the launch: (driver status, the arrays written, whose canaries are then checked)."""
        raise NotImplementedError

    def _check_ids(self, ids: ndarray, n: int) -> None:
        if ids.dtype != self._id_dtype:
            raise TypeError(f"{self.name}: the ids are {ids.dtype}, the kernel reads {self._id_dtype}")
        if not ids.flags.c_contiguous or ids.size != n:
            raise ValueError(f"{self.name}: the kernel reads n_ids={n} consecutive ids; got ids of shape {ids.shape}, "
                             f"strides {ids.strides}")

    def _check_aligned(self, *arrays: tuple[int, ndarray, int]) -> None:
        for index, array, unit in arrays:
            if array.size and array.data.ptr % unit:
                raise CUDADriverError(f"{self.name}: argument {index} at {array.data.ptr:#x} is not {unit}-byte "
                                      "aligned: CUDA_ERROR_MISALIGNED_ADDRESS")

    def _check_flag(self, flag: ndarray) -> None:
        if flag.dtype != np.uint64 or flag.size < 1:
            raise CUDADriverError(f"{self.name}: the error flag must be one unsigned long long")

    def _check_out(self, out: ndarray, nbytes: int) -> None:
        if out.nbytes < nbytes or not out.flags.c_contiguous:
            raise CUDADriverError(f"{self.name}: out holds {out.nbytes} bytes, the kernel writes {nbytes}: "
                                  "CUDA_ERROR_ILLEGAL_ADDRESS")


def _readable(*arrays: ndarray) -> Any:
    """The (start, end) byte ranges of `arrays`, as the drivers take them."""
    return (ctypes.c_void_p * (2 * len(arrays)))(*[p for a in arrays for p in (a.data.ptr, a.data.ptr + a.nbytes)])


class RawKernel(_Kernel):
    """One instantiation of gather_rows<Id, Vec>; calling it launches it (synchronously, blocks shuffled)."""

    _SIGNATURE = ("table", "ids", "out", "n_ids", "vocab_size", "vecs_per_row", "error_position")
    _POINTERS, _SCALARS = (0, 1, 2, 6), (3, 4, 5)

    def __init__(self, library: ctypes.CDLL, name: str, id_dtype: np.dtype, vec_bytes: int) -> None:
        super().__init__(library, name, id_dtype)
        self._vec = vec_bytes

    def _launch(self, grid: int, block: int, order: np.ndarray, args: tuple, fault: ctypes.c_void_p) -> tuple[int, list]:
        table, ids, out, n_ids, vocab_size, vecs_per_row, flag = args
        n, vocab, vecs, vec = int(n_ids), int(vocab_size), int(vecs_per_row), self._vec
        self._check_ids(ids, n)
        self._check_aligned((0, table, vec), (1, ids, ids.dtype.itemsize), (2, out, vec), (6, flag, 8))
        self._check_out(out, n * vecs * vec)
        self._check_flag(flag)
        status = self._library.fe_emulated_gather(
            ids.dtype.itemsize, vec, grid, block, order.ctypes.data, table.data.ptr, ids.data.ptr, out.data.ptr,
            n, vocab, vecs, flag.data.ptr, _readable(table, ids), 2, ctypes.byref(fault))
        return status, [out, flag]


class DequantKernel(_Kernel):
    """One instantiation of dequant_rows<Format, Output, Id>: reads only data, scales and ids; writes out and the flag."""

    _SIGNATURE = ("data", "scales", "ids", "out", "n_ids", "vocab_size", "row_bytes", "dim", "error_position")
    _POINTERS, _SCALARS = (0, 1, 2, 3, 8), (4, 5, 6, 7)

    def __init__(self, library: ctypes.CDLL, name: str, id_dtype: np.dtype, fmt: int, output: int,
                 output_bytes: int) -> None:
        super().__init__(library, name, id_dtype)
        self._format, self._output, self._output_bytes = fmt, output, output_bytes

    def _launch(self, grid: int, block: int, order: np.ndarray, args: tuple, fault: ctypes.c_void_p) -> tuple[int, list]:
        data, scales, ids, out, n_ids, vocab_size, row_bytes, dim, flag = args
        n = int(n_ids)
        if data.dtype != np.uint8 or scales.dtype != np.float32:
            raise TypeError(f"{self.name}: data must be uint8 and scales float32, got {data.dtype} and {scales.dtype}")
        if out.dtype.itemsize != self._output_bytes:
            raise TypeError(f"{self.name}: the kernel writes {self._output_bytes}-byte values, out is {out.dtype}")
        self._check_ids(ids, n)
        self._check_aligned((1, scales, 4), (2, ids, ids.dtype.itemsize), (3, out, self._output_bytes), (8, flag, 8))
        self._check_out(out, n * int(dim) * self._output_bytes)
        self._check_flag(flag)
        status = self._library.fe_emulated_dequant(
            self._format, self._output, ids.dtype.itemsize, grid, block, order.ctypes.data, data.data.ptr,
            scales.data.ptr, ids.data.ptr, out.data.ptr, n, int(vocab_size), int(row_bytes), int(dim), flag.data.ptr,
            _readable(data, scales, ids), 3, ctypes.byref(fault))
        return status, [out, flag]


class CheckKernel(_Kernel):
    """One instantiation of check_ids<Id>: reads the ids, writes only the flag."""

    _SIGNATURE = ("ids", "n_ids", "vocab_size", "error_position")
    _POINTERS, _SCALARS = (0, 3), (1, 2)

    def _launch(self, grid: int, block: int, order: np.ndarray, args: tuple, fault: ctypes.c_void_p) -> tuple[int, list]:
        ids, n_ids, vocab_size, flag = args
        self._check_ids(ids, int(n_ids))
        self._check_aligned((0, ids, ids.dtype.itemsize), (3, flag, 8))
        self._check_flag(flag)
        status = self._library.fe_emulated_check_ids(
            ids.dtype.itemsize, grid, block, order.ctypes.data, ids.data.ptr, int(n_ids), int(vocab_size),
            flag.data.ptr, _readable(ids), 1, ctypes.byref(fault))
        return status, [flag]


def _dimension(name: str, what: str, value: Any, limit: int) -> int:
    if not isinstance(value, tuple) or not 1 <= len(value) <= 3 or not all(isinstance(v, (int, np.integer)) for v in value):
        raise TypeError(f"{name}: {what} must be a tuple of 1 to 3 ints, got {value!r}")
    if any(int(v) < 1 for v in value) or int(value[0]) > limit or any(int(v) != 1 for v in value[1:]):
        raise CUDADriverError(f"{name}: {what} {value} is not a valid 1-D launch: CUDA_ERROR_INVALID_VALUE")
    return int(value[0])


def _reset_double() -> None:
    """Clear sticky errors, the launch and stream logs, the current device and streams (a fresh 'process' for the next test)."""
    _sticky.clear()
    launches.clear()
    stream_waits.clear()
    _state.device = 0
    _state.__dict__.pop("streams", None)
    _state.__dict__.pop("stream_devices", None)
