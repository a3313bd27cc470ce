"""torch CUDA tensors for the tests: real ones where torch and cupy see a GPU, else a test double.

The double stands in for torch's CUDA runtime only, over the CuPy test
double's device memory (tests/cupy_double), so that fastembed's own code for
torch CUDA tensors (fastembed/arrays/torch_adapter.py) runs unchanged:

- :class:`CudaTensor`, a real torch tensor (a subclass) whose storage is a
  CuPy-double allocation and which reports ``device == cuda:N``,
  ``is_cuda``, ``__dlpack_device__() == (kDLCUDA, N)``, and a
  ``__cuda_array_interface__``. torch's own Python code for ``__dlpack__``
  and ``torch.from_dlpack`` runs (refusing a tensor that requires grad, or on
  another device than torch's current one, and making a consumer's stream
  wait for torch's current stream when they differ); the double replaces
  only the C conversions (``torch._C._to_dlpack``, ``_to_dlpack_versioned``,
  ``_from_dlpack``) for these tensors.
- ``torch.cuda``: ``device_count``, ``current_device``, ``device(i)``,
  ``set_device``, ``current_stream``, ``default_stream``, ``Stream``,
  ``ExternalStream``, ``stream(s)``, ``Event``, per thread and device as
  torch keeps them; every stream-waits-for-event lands in :data:`stream_waits`.

Refused as real torch refuses them: ``.numpy()`` and ``np.asarray`` of a
CUDA tensor (TypeError), an operation mixing devices (RuntimeError), an
invalid device ordinal, a DLPack export from another device than the
current one (BufferError). ``.cpu()`` copies to a plain CPU tensor, and
``tensor.to("cuda:N")`` of a CPU tensor copies it into a new allocation on
device N, as torch's host-to-device copy does.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import torch

_state = threading.local()
#: Every torch stream-waits-for-event: (the waiting stream's pointer, the pointer of the stream the event was recorded on).
stream_waits: collections.deque = collections.deque(maxlen=256)
_NUMPY_OF = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
             torch.uint16: np.uint16, torch.int32: np.int32, torch.uint32: np.uint32, torch.int64: np.int64,
             torch.uint64: np.uint64, torch.float16: np.float16, torch.float32: np.float32,
             torch.float64: np.float64, torch.complex64: np.complex64, torch.complex128: np.complex128}
_TORCH_OF = {np.dtype(value): key for key, value in _NUMPY_OF.items()}
_cupy: ModuleType | None = None


class _Held:
    """Host bytes of a device allocation, exposed through ``__array_interface__``, holding what keeps it alive."""

    def __init__(self, array: np.ndarray, keep: Any) -> None:
        self.__array_interface__ = dict(array.__array_interface__)
        self.keep = (array, keep)


def _host_bytes(array: np.ndarray, keep: Any) -> np.ndarray:
    """A numpy array over `array`'s memory whose base keeps `keep` alive (numpy would collapse a plain view's bases)."""
    return np.asarray(_Held(array, keep))


class CudaTensor(torch.Tensor):
    """A torch tensor over host memory that the CuPy double treats as cuda:N memory."""

    __module__ = "torch"  # as type(real_tensor).__module__ reads
    _fe_index: int

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return torch.device("cuda", self._fe_index)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def numpy(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(f"can't convert cuda:{self._fe_index} device type tensor to numpy. "
                        "Use Tensor.cpu() to copy the tensor to host memory first.")

    def cpu(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.clone(self).as_subclass(torch.Tensor)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.requires_grad:
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad. If gradients "
                               "aren't required, use var.detach() to get Variable that doesn't require grad.")
        dtype = np.dtype(_NUMPY_OF[self.dtype])
        strides = None if self.is_contiguous() else tuple(s * dtype.itemsize for s in self.stride())
        return {"typestr": dtype.str, "shape": tuple(self.shape), "strides": strides,
                "data": (self.data_ptr() if self.numel() else 0, False), "version": 2}

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        indices, host = set(), False
        for value in (*args, *kwargs.values()):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, CudaTensor):
                    indices.add(item._fe_index)
                elif isinstance(item, torch.Tensor) and item.dim() > 0:
                    host = True
        if len(indices) > 1 or (indices and host):
            found = sorted(f"cuda:{i}" for i in indices) + (["cpu"] if host else [])
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{found[0]} and {found[1]}!")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if not indices:
            return result
        index = indices.pop()
        return _as_cuda_results(result, index)


def _as_cuda_results(result: Any, index: int) -> Any:
    if isinstance(result, CudaTensor):
        return result
    if isinstance(result, torch.Tensor):
        return _as_cuda(result, index)
    if isinstance(result, (list, tuple)):
        return type(result)(_as_cuda_results(item, index) for item in result)
    return result


def _as_cuda(tensor: torch.Tensor, index: int) -> CudaTensor:
    cuda = tensor.as_subclass(CudaTensor)
    cuda._fe_index = index
    return cuda


# -- the runtime: devices, streams, events -----------------------------------------------------------------------

def _count() -> int:
    return int(_cupy.cuda.runtime.getDeviceCount()) if _cupy is not None else 0


def _index(device: Any) -> int:
    if device is None:
        return _current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        index = _current_device() if device.index is None else device.index
    else:
        index = int(device)
    if not 0 <= index < _count():
        raise RuntimeError("CUDA error: invalid device ordinal")
    return index


def _current_device() -> int:
    return getattr(_state, "device", 0)


class _Device:
    """torch.cuda.device(i): makes device i current for torch inside the block."""

    def __init__(self, device: Any) -> None:
        self.index = _index(device)
        self._saved = 0

    def __enter__(self) -> None:
        self._saved = _current_device()
        _state.device = self.index

    def __exit__(self, *exc: Any) -> None:
        _state.device = self._saved


class StreamDouble:
    """torch.cuda.Stream: `cuda_stream` is its pointer (0 for the default stream)."""

    def __init__(self, device: Any = None, priority: int = 0, *, _pointer: int | None = None) -> None:
        self.device_index = _index(device)
        self.cuda_stream = id(self) if _pointer is None else int(_pointer)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def wait_event(self, event: EventDouble) -> None:
        stream_waits.append((self.cuda_stream, event.stream_pointer))

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.cuda_stream)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, StreamDouble) and (other.cuda_stream, other.device_index) == (
            self.cuda_stream, self.device_index)

    def __hash__(self) -> int:
        return hash((self.cuda_stream, self.device_index))


def _external_stream(pointer: int, device: Any = None) -> StreamDouble:
    return StreamDouble(device, _pointer=pointer)


class EventDouble:
    """torch.cuda.Event: records the stream it was recorded on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stream_pointer: int | None = None

    def record(self, stream: StreamDouble | None = None) -> None:
        self.stream_pointer = (_current_stream() if stream is None else stream).cuda_stream


def _streams() -> dict[int, list[StreamDouble]]:
    if not hasattr(_state, "streams"):
        _state.streams = {}
    return _state.streams


def _default_stream(device: Any = None) -> StreamDouble:
    return StreamDouble(device, _pointer=0)


def _current_stream(device: Any = None) -> StreamDouble:
    index = _index(device)
    stack = _streams().get(index)
    return stack[-1] if stack else _default_stream(index)


@contextlib.contextmanager
def _stream(stream: StreamDouble | None) -> Iterator[None]:
    """torch.cuda.stream(s): s current on its device (and its device current) inside the block."""
    if stream is None:
        yield
        return
    with _Device(stream.device_index):
        _streams().setdefault(stream.device_index, []).append(stream)
        try:
            yield
        finally:
            _streams()[stream.device_index].pop()


# -- DLPack: the C conversions, for CudaTensor only ---------------------------------------------------------------

def _to_dlpack(original: Any) -> Any:
    def convert(tensor: Any, dl_device: Any = None, copy: Any = None) -> Any:
        if not isinstance(tensor, CudaTensor):
            return original(tensor, dl_device=dl_device, copy=copy)
        index = tensor._fe_index
        if dl_device is not None and (int(dl_device[0]), int(dl_device[1])) != (_cupy.KDL_CUDA, index):
            raise BufferError(f"the double exports cuda:{index} memory in place only, not to {dl_device}")
        if copy:
            raise BufferError("the double never copies on export")
        dtype: Any = _NUMPY_OF.get(tensor.dtype)
        dtype = np.dtype(dtype) if dtype is not None else str(tensor.dtype).removeprefix("torch.")
        itemsize = tensor.element_size()
        return _cupy.DLPackCapsule(tensor.data_ptr(), tuple(tensor.shape), tuple(s * itemsize for s in tensor.stride()),
                                   dtype, index, tensor)

    return convert


def _from_dlpack(original: Any) -> Any:
    def convert(capsule: Any) -> Any:
        if _cupy is None or not isinstance(capsule, _cupy.DLPackCapsule):
            return original(capsule)
        capsule.consume()
        host = capsule.host
        if host is None or not isinstance(capsule.dtype, np.dtype):
            raise BufferError("the double imports cupy arrays only")
        tensor = torch.from_numpy(_host_bytes(host, capsule.owner)) if host.size else torch.empty(
            host.shape, dtype=_TORCH_OF[host.dtype])
        return _as_cuda(tensor, capsule.device)

    return convert


# -- host-to-device copies: Tensor.to("cuda:N") of a CPU tensor ---------------------------------------------------

def _copy_to_device(host: torch.Tensor, index: int) -> CudaTensor:
    """A copy of a CPU tensor in a new CuPy-double allocation on device `index`."""
    host = host.contiguous()
    nbytes = host.numel() * host.element_size()
    with _cupy.cuda.Device(index):
        buffer = _cupy.empty((max(nbytes, 1),), _cupy.uint8)
    raw = torch.from_numpy(_host_bytes(buffer._host, buffer))[:nbytes]
    tensor = raw.view(host.dtype).view(host.shape)
    tensor.copy_(host)
    return _as_cuda(tensor, index)


def _to(original: Any) -> Any:
    """torch.Tensor.to: a CPU tensor's ``to(device)`` onto a CUDA device copies it there; everything else is torch's."""
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        targets = [value for value in (*args, kwargs.get("device")) if isinstance(value, (str, torch.device))]
        cuda = [torch.device(value) for value in targets if torch.device(value).type == "cuda"]
        if isinstance(self, CudaTensor) or not cuda:
            return original(self, *args, **kwargs)
        if len(args) + len(kwargs) - ("non_blocking" in kwargs) != 1:
            raise NotImplementedError("the double copies a CPU tensor to a device with tensor.to(device) only")
        return _copy_to_device(self, _index(cuda[0]))

    return to


# -- what the tests use, the same on the double and on a GPU ------------------------------------------------------

class TorchCuda:
    """torch CUDA tensors for one test: the double's or the GPU's, behind one small interface."""

    def __init__(self, cupy: ModuleType, double: bool) -> None:
        self.cupy, self.is_double = cupy, double

    def to_cuda(self, host: torch.Tensor, device: int = 0) -> torch.Tensor:
        """A copy of a CPU tensor on cuda:`device` (the test's data; fastembed never copies a table)."""
        if not self.is_double:
            return host.to(f"cuda:{device}")
        return _copy_to_device(host, device)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: int = 0) -> torch.Tensor:
        return self.to_cuda(torch.zeros(shape, dtype=dtype), device)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu()

    def launch_streams(self) -> list[int]:
        """The stream pointer of every kernel launch so far (the double only)."""
        return [launch[4] for launch in self.cupy.launches]


@contextlib.contextmanager
def installed(cupy: ModuleType) -> Iterator[TorchCuda]:
    """The double in torch.cuda and torch._C for the block (`cupy`: the CuPy double, installed as ``cupy``)."""
    global _cupy
    _cupy = cupy
    _state.__dict__.clear()
    stream_waits.clear()
    with contextlib.ExitStack() as undo:
        patch = undo.enter_context(_patching())
        patch(torch.cuda, "device_count", _count)
        patch(torch.cuda, "current_device", _current_device)
        patch(torch.cuda, "set_device", lambda device: setattr(_state, "device", _index(device)))
        patch(torch.cuda, "device", _Device)
        patch(torch.cuda, "current_stream", _current_stream)
        patch(torch.cuda, "default_stream", _default_stream)
        patch(torch.cuda, "Stream", StreamDouble)
        patch(torch.cuda, "ExternalStream", _external_stream)
        patch(torch.cuda, "Event", EventDouble)
        patch(torch.cuda, "stream", _stream)
        patch(torch._C, "_to_dlpack", _to_dlpack(torch._C._to_dlpack))
        patch(torch._C, "_to_dlpack_versioned", _to_dlpack(torch._C._to_dlpack_versioned))
        patch(torch._C, "_from_dlpack", _from_dlpack(torch._C._from_dlpack))
        patch(torch.Tensor, "to", _to(torch.Tensor.to))
        try:
            yield TorchCuda(cupy, True)
        finally:
            _cupy = None


@contextlib.contextmanager
def _patching() -> Iterator[Any]:
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def real_torch_cuda() -> bool:
    """Whether torch itself sees a CUDA device (then the tests use real CUDA tensors)."""
    return bool(torch.cuda.is_available())
