"""torch tensors: CPU tensors seen as numpy arrays, CUDA tensors as cupy arrays, zero-copy, through DLPack.

Recognised by their module name, so telling a tensor from anything else never
imports torch. A snapshot of a CPU tensor is a numpy array sharing the
tensor's memory (``np.from_dlpack``: read-only of ``to_dlpack``'s export for
what a lookup reads, writeable of the tensor for an ``out``), so validation, dispatch and the host
backends see numpy alone. A snapshot of a CUDA tensor is a cupy array over the
same device memory (``cupy.from_dlpack``), so the cuda backend serves it as it
serves a cupy table. A result is handed back as a tensor over the result's
memory on the table's device (``torch.from_numpy``, ``torch.from_dlpack`` on a GPU). Dtypes numpy and cupy
lack (bfloat16, float8) travel as integer views of the same width: on the
host retyped with ml_dtypes, on a GPU as the unsigned words the cupy adapter
stores them in (bfloat16 as uint16); the bits are never converted.

A lookup on a torch CUDA table runs in :meth:`TorchAdapter.stream_context`:
the table's device is current (for torch and cupy) and cupy's current stream
is torch's current stream on that device, so the ids' copy or conversion,
the kernel and the result's allocation are ordered with the caller's torch
work, with no synchronisation added. Nothing moves between devices: ids or
``out`` on another device than the table are refused by validation.

A tensor that requires grad is gathered through an alias of it
(:meth:`TorchAdapter.alias`, no copy): lookup does not record autograd.
Tensors on other devices (``meta``, ``mps``, ...) are refused (TypeError),
and so are tensors whose operations
torch dispatches to Python (``__torch_dispatch__``: DTensor, FakeTensor,
wrapper subclasses), whose memory need not hold their values. Other
subclasses of ``torch.Tensor`` (a project's ``nn.Parameter`` subclass) are
torch tensors wherever they are defined: read as their memory lies, their
results plain tensors.

torch does not mark a tensor over read-only memory read-only (one made with
``torch.from_dlpack`` of a read-only memory map, say), so the numpy view of
it says it is writeable and a gather into it would kill the process.
Validation asks :meth:`TorchAdapter.writable` of a host ``out``, which
probes its memory (:mod:`fastembed.arrays.write_probe`): a few system calls
per lookup into a torch ``out``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import numpy_adapter, write_probe

#: torch dtype name -> the torch integer dtype of the same width, for the dtypes numpy has not (ml_dtypes has them).
_VIA_INTEGER = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
#: The same, keyed by torch dtype objects (torch dtype -> (torch integer dtype, name)); built on first use.
_via_torch: dict[Any, tuple[Any, str]] | None = None
#: torch's sub-byte "shell" dtypes, one value per byte, which torch exports through DLPack as int8 or uint8:
#: name -> that dtype's name.
_SHELL_DTYPES = {f"{sign}int{bits}": f"{sign}int8" for sign in ("", "u") for bits in range(1, 8)}
#: The same, keyed by torch dtype objects (torch dtype -> (name, stored name)); built on first use.
_shell_torch: dict[Any, tuple[str, str]] | None = None
_NO_CONTEXT = contextlib.nullcontext()

CUPY_MISSING = (
    "torch CUDA tensors are gathered by the cuda backend, which needs cupy: "
    "pip install 'fastembed-gather[cuda12]' (or '[cuda13]')"
)


class TorchAdapter:
    name = "torch"
    owned_by_type = True
    result_alignment = 0
    native_byte_order_only = True

    def stored_dtype(self, dtype: Any) -> Any:
        return dtype

    def dtype_name(self, array: Any) -> str | None:
        """A CUDA tensor's own dtype by name (``"bfloat16"``), which its snapshot holds as same-width words; None
        for a CPU tensor, whose snapshot has the tensor's dtype itself (so a later ``.data =`` on the caller's
        tensor, as ``module.half()`` does, cannot make a call read another dtype than its snapshot's)."""
        return None if array.device.type == "cpu" else str(array.dtype).removeprefix("torch.")

    def alias(self, array: Any) -> Any:
        """The tensor as read now: an alias over the same memory (no autograd), whose dtype, shape and storage a
        later ``.data =`` or ``set_`` on the caller's tensor leaves as they are.

        It is ``array.data``, which torch reads holding the GIL: ``detach()`` lets the GIL go, and a ``.data =``
        on another thread meanwhile could give it one tensor's dtype and shape over the other's memory.
        """
        try:
            return array.data
        except RuntimeError:  # vmap forbids `.data` on its wrappers
            import torch

            if torch._C._functorch.is_functorch_wrapped_tensor(array):
                raise TypeError(_FUNCTORCH_WRAPPER) from None
            raise

    def owns(self, array: Any) -> bool:
        # __dlpack__ tells a tensor (nn.Parameter included) from torch's other types (Size, storages, dtypes).
        kind = type(array)
        if kind.__module__.partition(".")[0] == "torch" and hasattr(array, "__dlpack__"):
            return True
        # A tensor subclass defined outside torch (a project's Parameter subclass, say): known by its ancestry.
        return any(base.__name__ == "Tensor" and base.__module__ == "torch" for base in kind.__mro__[1:])

    def device(self, array: Any) -> str:
        device = array.device
        if device.type == "cpu":
            return "cpu"
        return f"{device.type}:{device.index if device.index is not None else 0}"

    def snapshot(self, array: Any) -> Any:
        """A view of the tensor's memory (no copy), its shape, strides and dtype read once, for reading.

        Returns:
            A numpy array for a CPU tensor (read-only: numpy imports torch's
            ``to_dlpack`` export so, and it costs a fraction of
            ``np.from_dlpack(tensor)``), a cupy array on the same device for a CUDA tensor.

        Raises:
            As :meth:`writable_snapshot`.
        """
        return self._view(array, writable=False)

    def writable_snapshot(self, array: Any) -> Any:
        """A view of the tensor's memory as :meth:`snapshot` gives it, writeable (for an ``out``).

        Returns:
            A numpy array for a CPU tensor, a cupy array on the same device for a CUDA tensor.

        Raises:
            TypeError: a tensor on another kind of device, a dtype the view
                cannot hold, a nested tensor, a torch.func wrapper or a call that
                torch.compile traces, a bfloat16 or float8 CPU tensor without ml_dtypes,
                a CUDA tensor without cupy installed, or a lazy negation or
                conjugate view (its memory holds other values).
            ValueError: a tensor whose shape reaches past its storage (a
                storage shrunk in place, as FSDP frees parameters).
        """
        return self._view(array, writable=True)

    def _view(self, array: Any, writable: bool) -> Any:
        """The snapshot of :meth:`snapshot` (`writable`: False) or :meth:`writable_snapshot` (True)."""
        unreadable = _traced_or_wrapped(array)
        if unreadable is not None:
            raise TypeError(unreadable)
        if _dispatched_in_python(array):
            raise TypeError(
                f"this torch tensor is a {type(array).__module__}.{type(array).__qualname__}, whose operations "
                "torch dispatches to Python (DTensor, FakeTensor, wrapper subclasses): its memory need not hold its "
                "values, and fastembed reads memory as it lies; gather from the local or plain tensor it wraps")
        # An alias (no copy; lookup does not record autograd) that holds the memory itself: a `.data =` on the
        # caller's tensor meanwhile (another thread's) frees nothing the checks below and the view see.
        tensor = self.alias(array)
        device = self.device(tensor)
        if tensor.is_neg() or tensor.is_conj():
            # Memory read as it lies would give the values without the lazy sign or conjugation.
            raise TypeError(f"this torch tensor is a lazy {'negation' if tensor.is_neg() else 'conjugate'} view of "
                            "memory holding other values (torch's neg or conj bit); fastembed reads memory as it "
                            "lies: pass tensor.resolve_neg() / tensor.resolve_conj() (a copy) instead")
        if tensor.layout is not _strided_layout():
            raise TypeError(f"torch tensors of layout {tensor.layout} are not supported; fastembed reads strided "
                            "(dense) tensors: pass tensor.to_dense()")
        _check_storage_holds(tensor)
        shell = _shell_dtypes().get(tensor.dtype)
        if shell is not None:
            name, stored = shell
            raise TypeError(f"torch.{name} keeps one value per byte, which DLPack and numpy see as {stored}, and "
                            f"results would come back so: view the tensor as that dtype (tensor.view(torch.{stored})) "
                            "to gather its bytes")
        if device != "cpu":
            if device.startswith("cuda:"):
                return _cuda_view(tensor, _index(device))
            raise TypeError(f"torch tensors on {device} are not supported; fastembed reads CPU and CUDA tensors")
        via = _via_integer().get(tensor.dtype)
        if via is None:
            try:
                return _numpy_view(tensor, writable)
            except RecursionError:  # the caller's stack, not the dtype
                raise
            except (BufferError, RuntimeError, TypeError) as error:
                raise TypeError(f"torch dtype {tensor.dtype} cannot be seen as a numpy array: {error}") from None
        return _numpy_view(tensor.view(via[0]), writable).view(_ml_dtype(via[1]))

    def dtype_spec(self, dtype: Any) -> str | None:
        """A ``torch.dtype`` as the name numpy or ml_dtypes gives the same dtype (``torch.float16``: "float16"), else None."""
        if type(dtype).__module__ != "torch" or type(dtype).__name__ != "dtype":
            return None
        return str(dtype).removeprefix("torch.")

    def misaligned(self, view: Any) -> bool:
        """Whether a CUDA tensor's snapshot (a cupy array) starts off its itemsize; host snapshots are numpy's to judge."""
        from . import cupy_adapter

        return not isinstance(view, np.ndarray) and cupy_adapter.ADAPTER.misaligned(view)

    def mark_written(self, array: Any) -> None:
        """Bump the version counter of a tensor a lookup wrote in place (autograd checks it, as after ``copy_``)."""
        import torch

        torch.autograd.graph.increment_version(array)

    def memory_guard(self, array: Any) -> _StorageGuard:
        """A guard over the tensor's storage (see :class:`_StorageGuard`)."""
        return _StorageGuard(array)

    def stream_context(self, array: Any) -> Any:
        """The context a lookup on `array` (the caller's table, or a quantized table's rows) runs in.

        For a CUDA tensor: its device current for torch and cupy, and cupy's
        current stream wrapping torch's current stream there
        (``cupy.cuda.ExternalStream``), entered for the whole call. For a CPU
        tensor: a null context.
        """
        device = self.device(array)
        if not device.startswith("cuda:"):
            return _NO_CONTEXT
        return _on_torch_stream(_index(device))

    def wrap(self, result: Any) -> Any:
        """A result (numpy on the host, cupy on a GPU) as a tensor over the same memory; see :meth:`wrap_like`."""
        if isinstance(result, np.ndarray):
            return _host_tensor(result)
        return self.wrap_like(result, None)

    def wrap_like(self, result: Any, like: Any) -> Any:
        """`result`, gathered for the torch table or rows `like`, as a tensor over its memory on its device.

        On a GPU the result's dtype may be a stand-in: the words of `like`'s
        bfloat16 or float8 dtype, or uint16 for a bfloat16 result of a
        quantized table (cupy has no bfloat16); the tensor gets the real dtype.

        Raises:
            TypeError: a host result of an ml_dtypes dtype torch does not have.
        """
        if isinstance(result, np.ndarray):
            return _host_tensor(result)
        import torch

        stored = np.dtype(result.dtype)
        target = None
        if like is not None and _cuda_dtype(like.dtype) == stored:
            target = like.dtype
        elif stored == np.uint16 and like is not None:
            target = torch.bfloat16  # the cuda backend's bfloat16 output (a quantized table's rows are uint8)
        name = str(target).removeprefix("torch.")
        if target is None or name not in _VIA_INTEGER:
            return torch.from_dlpack(result)
        return torch.from_dlpack(result.view(np.dtype(_VIA_INTEGER[name]))).view(target)

    def from_host(self, host: np.ndarray, device: str = "cpu") -> Any:
        """Host data as a tensor on `device` (a copy on torch's current stream where it is a GPU)."""
        tensor = _host_tensor(host)
        return tensor if device == "cpu" else tensor.to(device)

    def to_host(self, array: Any) -> np.ndarray:
        """A host copy of a CUDA tensor as numpy (torch's own copy: it waits for the work queued on torch's current stream)."""
        return self.writable_snapshot(array.detach().cpu())  # the copy is the caller's, writeable as cupy's

    def writable(self, view: Any) -> bool:
        """Whether a gather can write into `view`, the snapshot of an ``out`` tensor (torch cannot tell read-only memory).

        Host snapshots only (a GPU snapshot is True): the first and last byte are
        probed as the module docstring says. Where the probe cannot run (no
        ``os.readv``: Windows) it answers True.
        """
        return not isinstance(view, np.ndarray) or write_probe.can_write(view)

    def write_refusal(self, array: Any) -> str | None:
        """Why a lookup must not write `array` in place, or None: it requires grad (no autograd is recorded), or it
        is an inference tensor outside inference mode (torch forbids the write)."""
        if array.requires_grad:
            return "out requires grad: lookup writes it in place and records no autograd; pass a tensor that does not"
        if array.is_inference():
            import torch

            if not torch.is_inference_mode_enabled():
                return ("out is an inference tensor (made under torch.inference_mode), and torch forbids writing one "
                        "in place outside inference mode; call the lookup inside torch.inference_mode(), or pass "
                        "another tensor")
        return None

    def byte_span(self, array: Any) -> tuple[int, int]:
        """The addresses on its device of a tensor's first byte and of the byte past its last element (equal: none).

        Read from the tensor itself, with no view made: two disjoint spans
        cannot share memory, which spares the exact test most of the time.
        """
        start = array.data_ptr()
        if array.numel() == 0:
            return start, start
        if array.is_contiguous():
            reach = array.numel() - 1
        else:
            reach = sum((size - 1) * stride for size, stride in zip(array.shape, array.stride(), strict=True))
        return start, start + (reach + 1) * array.element_size()

    def may_share_memory(self, first: Any, second: Any) -> bool:
        """Whether two snapshots share memory: numpy's exact test on the host, address ranges on a GPU."""
        if isinstance(first, np.ndarray):
            return numpy_adapter.ADAPTER.may_share_memory(first, second)
        from . import cupy_adapter

        return cupy_adapter.ADAPTER.may_share_memory(first, second)


class _StorageGuard:
    """Keeps a tensor's storage alive, and notices when it was resized in place.

    torch does not pin memory exported through DLPack: ``param.data = other``
    drops the old storage, and ``resize_`` reallocates it, while a view of
    it lives on. Holding the storage keeps the first case safe (the view
    still reads the rows it was taken of); :meth:`check` catches the second
    before anything reads the freed memory.
    """

    __slots__ = ("_storage", "_pointer", "_nbytes")

    def __init__(self, tensor: Any) -> None:
        self._storage = tensor.untyped_storage()
        self._pointer = self._storage.data_ptr()
        self._nbytes = self._storage.nbytes()

    def check(self) -> None:
        """Raise ValueError if the storage's memory moved or changed size since the guard was made."""
        if self._storage.data_ptr() != self._pointer or self._storage.nbytes() != self._nbytes:
            raise ValueError(
                f"the torch tensor's storage was resized in place or moved ({self._nbytes} bytes at "
                f"{self._pointer:#x}, now {self._storage.nbytes()} at {self._storage.data_ptr():#x}: resize_, "
                "untyped_storage().resize_, or share_memory_(), which module.share_memory() calls) after this "
                "layer took its view of it; the old memory is gone, so build a new layer (after share_memory())"
            )


def _traced_or_wrapped(tensor: Any) -> str | None:
    """Why `tensor` has no memory fastembed can read (torch.compile tracing, a nested tensor), or None.

    Under torch.compile Dynamo hands the error to the caller (with
    ``fullgraph=True`` as an unsupported exception).
    """
    import torch

    if torch.compiler.is_compiling():
        return ("fastembed reads a tensor's memory, which torch.compile cannot trace: call it outside the compiled "
                "region (torch.compiler.disable), or use fastembed.torch.Embedding, which torch.compile traces as "
                "torch's embedding")
    if tensor.is_nested:
        return ("nested torch tensors are not supported: fastembed reads one strided block of memory; gather each "
                "component (tensor.unbind()) or use torch.nn.functional.embedding")
    if tensor._is_zerotensor():
        return ("this torch tensor is a ZeroTensor (all zeros, with no memory of its own for fastembed to read): "
                "use torch.nn.functional.embedding, or fastembed.torch.Embedding, which hands it to torch")
    if torch._is_functional_tensor(tensor):
        return ("this torch tensor is a functionalization wrapper, whose values live in the tensor it wraps: "
                "use torch.nn.functional.embedding, or fastembed.torch.Embedding, which hands it to torch")
    return None


def stands_for_other_memory(tensor: Any) -> bool:
    """Whether torch serves `tensor`'s values from elsewhere than its own memory: a ZeroTensor, a functionalization
    wrapper, or a subclass whose operations torch hands to Python (``__torch_dispatch__``)."""
    import torch

    return tensor._is_zerotensor() or torch._is_functional_tensor(tensor) or _dispatched_in_python(tensor)


#: Why a torch.func transform's tensors are refused (they are noticed when their storage is asked for).
_FUNCTORCH_WRAPPER = ("this torch tensor is a torch.func transform's wrapper (vmap, grad, jvp), which has no memory of "
                      "its own for fastembed to read: use torch.nn.functional.embedding inside transforms, or "
                      "fastembed.torch.Embedding, which hands them to torch")


def _dispatched_in_python(tensor: Any) -> bool:
    """Whether torch hands `tensor`'s operations to Python code (``__torch_dispatch__``): its memory need not be its values."""
    import torch

    return type(tensor) not in (torch.Tensor, torch.nn.Parameter) and torch._C._dispatch_keys(tensor).has(
        torch._C.DispatchKey.Python)


def _strided_layout() -> Any:
    """torch's strided (dense) layout (torch is imported by then: the caller holds a tensor)."""
    import torch

    return torch.strided


def _check_storage_holds(tensor: Any) -> None:
    """Raise ValueError when `tensor`'s elements reach past the end of its storage.

    torch lets a storage shrink under its tensors (``untyped_storage().resize_(0)``
    is how FSDP frees a parameter) and exports such a tensor through DLPack
    all the same; reading it would read freed memory.
    """
    needed, held = storage_bytes(tensor)
    if needed > held:
        raise ValueError(f"this torch tensor of shape {tuple(tensor.shape)} needs {needed} bytes of its storage, which "
                         f"holds {held}: the storage was shrunk or freed (untyped_storage().resize_, as FSDP frees "
                         "parameters); gather from a tensor whose memory is there")


def storage_bytes(tensor: Any) -> tuple[int, int]:
    """The bytes of its storage `tensor`'s elements reach, and the bytes the storage holds ((0, 0) for a tensor of no
    elements, whose storage is not asked).

    Raises:
        TypeError: a torch.func transform's wrapper, which has no storage.
    """
    if tensor.numel() == 0:
        return 0, 0
    if tensor.is_contiguous():  # the common case, kept cheap
        last = tensor.storage_offset() + tensor.numel() - 1
    else:
        last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    try:
        held = tensor.untyped_storage().nbytes()
    except NotImplementedError:  # the one place a torch.func wrapper tells itself apart, at no cost to other tensors
        import torch

        if torch._C._functorch.is_functorch_wrapped_tensor(tensor):
            raise TypeError(_FUNCTORCH_WRAPPER) from None
        raise
    return (last + 1) * tensor.element_size(), held


def _index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


@contextlib.contextmanager
def _on_torch_stream(index: int) -> Iterator[None]:
    """cuda:`index` current for torch and cupy, and torch's current stream there as cupy's current stream."""
    import torch

    try:
        import cupy
    except ImportError:
        raise TypeError(CUPY_MISSING) from None
    with torch.cuda.device(index), cupy.cuda.Device(index):
        with _cupy_stream(cupy, torch.cuda.current_stream(index).cuda_stream):
            yield


class _StreamHandle:
    """A stream pointer in the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("pointer",)

    def __init__(self, pointer: int) -> None:
        self.pointer = pointer

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.pointer)


def _cupy_stream(cupy: Any, pointer: int) -> Any:
    """A cupy stream over the CUDA stream at `pointer`, on the current device (cupy 14 deprecates ExternalStream)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(pointer))
    return cupy.cuda.ExternalStream(pointer)


def _cuda_view(tensor: Any, index: int) -> Any:
    """A cupy array over a CUDA tensor's memory; bfloat16 and float8 as the unsigned words cupy stores them in."""
    via = _via_integer().get(tensor.dtype)
    if via is not None:
        tensor = tensor.view(via[0])
    elif _cuda_dtype(tensor.dtype) is None:
        raise TypeError(f"torch dtype {tensor.dtype} cannot be seen as a cupy array: cupy has no such dtype")
    with _on_torch_stream(index):  # the DLPack exchange then needs no cross-stream event
        import cupy

        view = cupy.from_dlpack(tensor)
    if via is not None and np.dtype(view.dtype).kind == "i":
        view = view.view(np.dtype(f"u{view.dtype.itemsize}"))
    return view


def _cuda_dtype(torch_dtype: Any) -> np.dtype | None:
    """The dtype a torch dtype is held in on a GPU (bfloat16: uint16), or None where cupy has none."""
    name = str(torch_dtype).removeprefix("torch.")
    if name in _VIA_INTEGER:
        return np.dtype(f"u{np.dtype(_VIA_INTEGER[name]).itemsize}")
    try:
        dtype = np.dtype(name)
    except TypeError:
        return None
    # numpy's own dtypes only: with ml_dtypes imported numpy also knows names such as "float8_e8m0fnu".
    return dtype if dtype.kind in "biufc" and dtype.type.__module__ == "numpy" else None


def _exports_buffer(dtype: np.dtype) -> bool:
    """Whether arrays of `dtype` export a buffer and DLPack: numpy's own numeric dtypes, not ml_dtypes'.

    ml_dtypes' are kind V (bfloat16, float8_e4m3fn) or kind f (float8_e5m2), so the kind alone does not tell.
    """
    return dtype.kind != "V" and dtype.type.__module__ == "numpy"


class _Export:
    """A DLPack export of a CPU tensor, made by ``torch.utils.dlpack.to_dlpack``, handed to ``np.from_dlpack``."""

    __slots__ = ("capsule",)

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # DLPack's kDLCPU


def _numpy_view(tensor: Any, writable: bool) -> np.ndarray:
    """A numpy array over a CPU tensor's memory: read-only through ``to_dlpack``, else through ``tensor.__dlpack__``.

    The tensor method's checks (requires grad, conjugate bit, streams) cost
    microseconds that a decode step notices; the snapshot has made them already.
    `tensor` is the alias :meth:`TorchAdapter._view` made (:meth:`TorchAdapter.alias`),
    which holds the memory this view reads or writes.
    """
    global _to_dlpack
    if writable:
        return np.from_dlpack(tensor)
    if _to_dlpack is None:
        from torch.utils.dlpack import to_dlpack

        _to_dlpack = to_dlpack
    return np.from_dlpack(_Export(_to_dlpack(tensor)))


#: torch.utils.dlpack.to_dlpack, imported on first use (an import statement per call costs a decode step a microsecond).
_to_dlpack: Any = None


def _host_tensor(result: np.ndarray) -> Any:
    """A host result (a numpy array) as a CPU tensor over the same memory."""
    import torch

    # from_numpy for writeable arrays (every result): the zero-copy tensor from_dlpack gives, a few times cheaper.
    # A read-only array (host ids or a mapped shard that from_host copies to a GPU at once) goes through
    # from_dlpack, which takes it without a warning but cannot mark the tensor read-only: never hand one to a user.
    share = torch.from_numpy if result.flags.writeable else torch.from_dlpack
    if _exports_buffer(result.dtype):
        tensor = share(result)
    else:
        name = result.dtype.name
        if name not in _VIA_INTEGER:
            raise TypeError(f"a {name} result has no torch dtype")
        tensor = share(result.view(np.dtype(_VIA_INTEGER[name]))).view(getattr(torch, name))
    # numpy gives an empty array strides of 0, which torch's views into other dtypes refuse; torch's own are C's
    return tensor if result.size else tensor.new_empty(tensor.shape)  # on the host, whatever torch's default device


def _via_integer() -> dict[Any, tuple[Any, str]]:
    global _via_torch
    if _via_torch is None:
        import torch

        _via_torch = {
            getattr(torch, name): (getattr(torch, integer), name)
            for name, integer in _VIA_INTEGER.items()
            if hasattr(torch, name)
        }
    return _via_torch


def _shell_dtypes() -> dict[Any, tuple[str, str]]:
    """torch's shell dtypes this torch has -> (name, the name of the byte dtype DLPack exports them as)."""
    global _shell_torch
    if _shell_torch is None:
        import torch

        _shell_torch = {getattr(torch, name): (name, stored) for name, stored in _SHELL_DTYPES.items()
                        if hasattr(torch, name)}
    return _shell_torch


def _ml_dtype(name: str) -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(
            f"torch {name} tensors need ml_dtypes (numpy has no {name}): pip install 'fastembed-gather[bfloat16]'"
        ) from None
    return getattr(ml_dtypes, name)


ADAPTER = TorchAdapter()
