"""One small adapter per array library: what fastembed needs to know of an array.

Everything that depends on which library made an array (detecting it, where
it lives, a fresh view of it, copying host ids to it, address ranges) lives in
that library's adapter, so adding an array type touches one module here plus
its entry in :data:`ADAPTERS`. Adapters import their library lazily; the
numpy adapter is the only one loaded by ``import fastembed`` (the cupy, torch
and jax adapter modules are loaded, but never import their library until they
are given one of its arrays). Any other DLPack producer on the host
(``__dlpack__`` and ``__dlpack_device__``) is seen through numpy's
``from_dlpack`` by the DLPack adapter, tried last; its results are numpy arrays.
"""
from __future__ import annotations

import contextlib
from typing import Any, Protocol

import numpy as np

from . import cupy_adapter, dlpack_adapter, jax_adapter, numpy_adapter, torch_adapter


class ArrayAdapter(Protocol):
    """The operations fastembed performs on arrays of one library.

    Besides these members, an adapter defines those of
    :data:`OPTIONAL_HOOKS` that its library needs; fastembed asks for each
    by name and does without it where an adapter has none.
    """

    name: str
    #: Whether :meth:`owns` answers the same for every object of a type (its
    #: answer is then remembered per type); False where it reads the object.
    owned_by_type: bool
    #: Byte alignment a host result must have for :meth:`wrap` to share it
    #: (0: any); fastembed then allocates such results itself, so none is copied.
    result_alignment: int

    def owns(self, array: Any) -> bool:
        """Whether `array` is an array of this library (never imports the library to say no)."""
        ...

    def device(self, array: Any) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        ...

    def snapshot(self, array: Any) -> Any:
        """A fresh view of `array`: its pointer, shape, strides and dtype fixed for one call.

        Another thread may reassign ``array.shape`` or ``array.dtype``; the
        view keeps what was read here, under the GIL, in one step.
        """
        ...

    def from_host(self, host: Any, device: str) -> Any:
        """Host data (a numpy array) as an array of this library on `device` (a copy where the device is not the host)."""
        ...

    def may_share_memory(self, first: Any, second: Any) -> bool:
        """Whether two arrays of this library share memory (exact for contiguous arrays)."""
        ...

    def stored_dtype(self, dtype: Any) -> Any:
        """The dtype this library's arrays hold values of `dtype` in (cupy: bfloat16 as uint16 words; else `dtype`)."""
        ...

    def wrap(self, result: Any) -> Any:
        """A result gathered from a snapshot, as an array of this library (zero-copy).

        The identity where snapshots are this library's own arrays (numpy,
        cupy); a tensor over the numpy result's memory for torch; a JAX
        array for jax (sharing that memory where JAX allows).
        """
        ...


#: The optional members of an adapter, beside :class:`ArrayAdapter`'s, and what each is for. fastembed asks for
#: them by name (``getattr(adapter, name, None)``); a test checks that every adapter's members and every name asked
#: for are listed here, so that a misspelled hook cannot silently turn a check off.
OPTIONAL_HOOKS = {
    "immutable": "True where the library's arrays cannot be written (JAX): validation refuses one as out",
    "native_byte_order_only": "True where the library has no dtypes in the other byte order (torch, JAX, cupy): "
    "validation refuses dtype= in that order for its tables before any work, since their results could not hold it",
    "stream_context": "stream_context(array): the device or stream made current for a lookup (torch CUDA tensors, "
    "cupy arrays; call_context)",
    "wrap_like": "wrap_like(result, like): a result given the caller's table's dtype back (torch; result_like)",
    "dtype_name": "dtype_name(array): the array's own dtype by name, which validation checks where a snapshot "
    "holds it as words of the same width (torch)",
    "dtype_spec": "dtype_spec(dtype): the library's own dtype object as numpy takes it, by name, else None "
    "(torch; dtype_spec)",
    "writable": "writable(view): whether an out's snapshot may be written, where the library cannot tell "
    "read-only memory (torch), or its arrays may hold memory another library lent (numpy, DLPack)",
    "writable_snapshot": "writable_snapshot(array): a writeable snapshot of an out, where snapshot() is read-only "
    "because a writeable view costs more (torch)",
    "write_refusal": "write_refusal(array): why a lookup must not write the array in place, or None (torch: "
    "requires grad, an inference tensor outside inference mode)",
    "read_only_note": "the sentence validation adds when it refuses a read-only out whose memory may be writable "
    "(DLPack: numpy imports an export older than DLPack 1.0 read-only)",
    "misaligned": "misaligned(view): whether a device array starts at an address that is not a multiple of its "
    "itemsize (torch, cupy), which the GPU kernels cannot read as elements",
    "alias": "alias(array): the array as read now, over the same memory, which later assignments to the caller's "
    "object (torch: .data =, set_) leave as it is (torch; as_read)",
    "memory_guard": "memory_guard(array): a guard that says when the library freed or moved the memory a view was "
    "taken of (torch: resize_, a swapped .data; memory_guards)",
    "to_host": "to_host(array): a numpy copy of a device array (torch, cupy; host_copy)",
    "mark_written": "mark_written(array): tell the library its array was written in place (torch's version "
    "counter, which autograd checks; mark_written)",
    "byte_span": "byte_span(array): (first byte, past the last), read without making a view (torch: data_ptr()), "
    "so that validation tells an out and ids with disjoint spans apart without the exact test",
    "same_file_bytes": "same_file_bytes(out, table): whether two arrays write and read the same bytes of one file "
    "through different mappings, which their addresses cannot show (numpy: np.memmap)",
}


#: Every known adapter; the first that owns an array describes it. The DLPack adapter takes any
#: other object with ``__dlpack__`` and ``__dlpack_device__``, so it comes last.
ADAPTERS: tuple[ArrayAdapter, ...] = (
    numpy_adapter.ADAPTER,
    cupy_adapter.ADAPTER,
    torch_adapter.ADAPTER,
    jax_adapter.ADAPTER,
    dlpack_adapter.ADAPTER,
)


#: The adapter found for each type of array seen, where its adapter tells arrays by their type alone.
_ADAPTER_OF_TYPE: dict[type, ArrayAdapter] = {}
#: More types than any program passes: a program making types per call cannot grow the memo without bound.
_MAX_TYPES_REMEMBERED = 64


def adapter_of(array: Any) -> ArrayAdapter | None:
    """The adapter of `array`'s library, or None for anything fastembed does not know as an array."""
    kind = type(array)
    adapter = _ADAPTER_OF_TYPE.get(kind)
    if adapter is not None:
        return adapter
    for adapter in ADAPTERS:
        if adapter.owns(array):
            if getattr(adapter, "owned_by_type", False):  # a lookup asks several times per call, each try of the adapters costs
                if len(_ADAPTER_OF_TYPE) >= _MAX_TYPES_REMEMBERED:
                    _ADAPTER_OF_TYPE.clear()
                _ADAPTER_OF_TYPE[kind] = adapter
            return adapter
    return None


def result_like(result: Any, table: Any) -> Any:
    """`result` (gathered from a snapshot of `table`) as an array of the caller's `table`'s library.

    The one place a result is wrapped back: lookup and Embedding call it only
    when the caller's table is not a plain numpy array, so that path costs
    nothing. A numpy table with ids or ``out`` of another library still
    returns numpy: the result follows the table.
    """
    adapter = adapter_of(table)
    if adapter is None:
        return result
    wrap_like = getattr(adapter, "wrap_like", None)
    return adapter.wrap(result) if wrap_like is None else wrap_like(result, table)


def host_copy(array: Any) -> Any:
    """A numpy copy of a device array (a torch CUDA tensor, a cupy array), through its adapter's ``to_host(array)``.

    Raises:
        TypeError: an array of a library whose device arrays fastembed cannot copy to the host.
    """
    to_host = getattr(adapter_of(array), "to_host", None)
    if to_host is None:
        raise TypeError(f"fastembed cannot copy a {type(array).__module__}.{type(array).__qualname__} on "
                        f"{device_of(array)} to the host")
    return to_host(array)


def dtype_spec(dtype: Any) -> Any:
    """`dtype` as numpy takes it: another library's dtype object (``torch.float16``) by its name, anything else as given.

    Adapters whose library has dtype objects of its own (torch) provide
    ``dtype_spec(dtype)``; numpy, cupy and JAX use numpy's dtypes.
    """
    for adapter in ADAPTERS:
        spec = getattr(adapter, "dtype_spec", None)
        name = None if spec is None else spec(dtype)
        if name is not None:
            return name
    return dtype


def as_read(array: Any) -> Any:
    """`array` as read now, for a layer that keeps it between calls (None stays None).

    The adapter's ``alias(array)`` where it has one (a torch tensor:
    an alias, which the caller's later ``.data =`` leaves over the memory
    and dtype the layer's view was taken of); otherwise the array itself.
    """
    alias = getattr(adapter_of(array), "alias", None) if array is not None else None
    return array if alias is None else alias(array)


def memory_guards(*arrays: Any) -> tuple[Any, ...]:
    """Guards over the memory of `arrays` (None entries skipped), for a layer that keeps views of them between calls.

    Each guard keeps its array's memory alive and has a ``check()`` that
    raises ValueError when that memory was resized or freed in place. Only
    libraries that free memory a view was taken of have them (torch): for
    numpy, cupy and JAX arrays the views themselves keep the memory alive.
    """
    guards = []
    for array in arrays:
        make = getattr(adapter_of(array), "memory_guard", None) if array is not None else None
        if make is not None:
            guards.append(make(array))
    return tuple(guards)


def mark_written(out: Any) -> Any:
    """Tell `out`'s library that a lookup wrote it in place, as its own in-place operations do; returns `out`.

    For a torch tensor this bumps its version counter, so that autograd
    refuses a backward pass through a graph that saved the old values
    (as after ``out.copy_(...)``); other libraries keep no such count.
    """
    mark = getattr(adapter_of(out), "mark_written", None)
    if mark is not None:
        mark(out)
    return out


_NO_CONTEXT = contextlib.nullcontext()


def call_context(table: Any) -> Any:
    """The context manager a lookup on the caller's `table` (or a quantized table's rows) runs in.

    The adapter's ``stream_context(table)`` where it has one (a torch CUDA
    tensor: its device, and torch's current stream as cupy's; a cupy array:
    its device); otherwise a
    null context. The API enters it only for tables whose snapshot is not a
    numpy array, around the ids' snapshot, the backend call and the wrapping
    of the result.
    """
    adapter = adapter_of(table)
    stream_context = getattr(adapter, "stream_context", None)
    return _NO_CONTEXT if stream_context is None else stream_context(table)


def aligned_result(table: Any, shape: tuple[int, ...], dtype: Any, from_cache: bool = True) -> Any:
    """A new host array to hand back as an array of the caller's `table`'s library, or None to let numpy allocate.

    Not None only where the table's library shares a host result's memory
    at a stricter alignment than numpy gives (:attr:`ArrayAdapter.result_alignment`).
    A large one comes from the output cache's buffers if `from_cache` (a
    lookup's output), else from numpy (an array kept for long, such as a
    new table, which must not hold a cached buffer, nor leave one behind).
    """
    adapter = adapter_of(table)
    alignment = 0 if adapter is None else adapter.result_alignment
    if not alignment:
        return None
    from ..backends import output_cache  # large results come from its cache of mapped, aligned buffers

    if not from_cache:
        return output_cache.aligned_empty(tuple(shape), np.dtype(dtype), alignment)
    return output_cache.new_output(shape, dtype, alignment)


def device_of(array: Any) -> str:
    """Where `array` lives: ``"cpu"`` for host data (and for non-arrays, which numpy would convert).

    A GPU array of a library without an adapter is still recognised by its
    ``__cuda_array_interface__``, so that errors can say where it lives.
    """
    adapter = adapter_of(array)
    if adapter is not None:
        return adapter.device(array)
    if hasattr(array, "__cuda_array_interface__"):
        device = getattr(array, "device", None)
        index = getattr(device, "id", getattr(device, "index", 0))
        return f"cuda:{index if index is not None else 0}"
    return "cpu"
