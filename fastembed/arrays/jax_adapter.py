"""JAX arrays on the CPU: seen as read-only numpy arrays, zero-copy.

Recognised by their module name (``jax`` or ``jaxlib``) and ``__dlpack__``,
so telling a JAX array from anything else never imports jax. A snapshot of
a CPU array is a numpy array over the array's own buffer: ``np.from_dlpack``
for the dtypes DLPack carries, and JAX's host view (``np.asarray``, checked
to share the buffer) for those it does not (bfloat16, float8). Either way
the view is read-only, because JAX arrays are immutable, and the bits are
never converted.

A result is handed back with ``jax.device_put`` onto the host, uncommitted
(as a fresh ``jnp`` array is, so JAX moves it to wherever it is used): onto
JAX's default device where that is a host device (``jax.default_device``),
else the first host device. JAX
shares a numpy buffer only if its address is a multiple of
:data:`JAX_HOST_ALIGNMENT` bytes and copies it otherwise; numpy aligns its
allocations to 16 bytes only, so the API allocates a JAX table's result at
that alignment (:attr:`ArrayAdapter.result_alignment`,
:func:`fastembed.arrays.aligned_result`) and JAX shares it without a copy.

Refused with a TypeError naming the reason: JAX arrays on a GPU or another
accelerator (fastembed's CUDA backend takes cupy arrays), arrays sharded
over several devices, deleted (donated) arrays, and traced values inside
``jax.jit``/``vmap``/``grad``. A JAX array as ``out`` is refused in
:func:`fastembed.validate.out_snapshot` (:attr:`JaxAdapter.immutable`).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np

from ..tables import is_ml_dtype
from . import numpy_adapter

#: JAX's CPU client aliases host buffers aligned to this many bytes, and copies the others.
JAX_HOST_ALIGNMENT = 64
_MODULES = ("jax", "jaxlib")


class JaxAdapter:
    name = "jax"
    owned_by_type = True
    result_alignment = JAX_HOST_ALIGNMENT
    native_byte_order_only = True
    #: JAX arrays cannot be written: fastembed refuses one as ``out``.
    immutable = True

    def stored_dtype(self, dtype: Any) -> Any:
        return dtype

    def owns(self, array: Any) -> bool:
        # __dlpack__ tells an array (or a tracer) from jax's other types (devices, dtypes, shardings).
        return type(array).__module__.partition(".")[0] in _MODULES and hasattr(array, "__dlpack__")

    def device(self, array: Any) -> str:
        """``"cpu"`` for JAX's host devices, ``"cuda:N"`` (N the CUDA ordinal) for a GPU, else ``"<platform>:N"``.

        Raises:
            TypeError: a traced value, a deleted array, or an array sharded over several devices.
        """
        return _device_name(_single_device(array))

    def snapshot(self, array: Any) -> np.ndarray:
        """A read-only numpy array over a host JAX array's buffer (no copy).

        Raises:
            TypeError: the array is traced, deleted, sharded, not on the
                host, or of a dtype numpy cannot view (int4, say).
        """
        device = self.device(array)
        if device != "cpu":
            raise TypeError(_not_on_host(device))
        _check_whole_bytes(array.dtype)
        try:
            view = np.from_dlpack(array)
        except (BufferError, RuntimeError, TypeError):
            view = _host_view(array)  # a dtype DLPack does not carry: bfloat16, float8
        if view.flags.writeable:
            view.setflags(write=False)  # the buffer belongs to an immutable JAX array
        return view

    def wrap(self, result: np.ndarray) -> Any:
        """A host result (a numpy array) as a JAX array on the host, sharing its buffer where JAX allows.

        JAX shares the buffer when its address is a multiple of
        :data:`JAX_HOST_ALIGNMENT` and copies it otherwise; the JAX array
        keeps the numpy array alive. A 64-bit result keeps its dtype where
        JAX's 64-bit mode is off (as indexing a 64-bit JAX array does), where
        ``device_put`` alone would convert it to 32 bits.
        """
        import jax

        with jax.default_device(_host_device()), _keeping_64_bits(result.dtype):
            return jax.device_put(result)  # uncommitted, as a fresh jnp array is

    def from_host(self, host: np.ndarray, device: str = "cpu") -> Any:
        if device != "cpu":
            raise TypeError(_not_on_host(device))
        return self.wrap(host)

    #: Snapshots of JAX arrays are numpy arrays: the numpy adapter's exact test applies.
    may_share_memory = staticmethod(numpy_adapter.ADAPTER.may_share_memory)


def _host_device() -> Any:
    """JAX's default device where it is a host device (``jax.default_device``, as a fresh jnp array), else cpu:0."""
    import jax

    default = jax.config.jax_default_device
    return default if getattr(default, "platform", None) == "cpu" else jax.devices("cpu")[0]


def _single_device(array: Any) -> Any:
    """The one device holding `array`.

    Raises:
        TypeError: a traced value (it has no buffer yet), a deleted array, or an array on several devices.
    """
    import jax

    if isinstance(array, jax.core.Tracer):
        raise TypeError(
            "a traced JAX value (inside jax.jit, vmap or grad) has no buffer to gather from: "
            "call fastembed outside the traced function, or use jnp.take inside it"
        )
    if array.is_deleted():
        raise TypeError("the JAX array has been deleted (donated to a jitted function, or .delete())")
    devices = array.devices()
    if len(devices) != 1:
        raise TypeError(
            f"the JAX array is sharded or replicated over {len(devices)} devices; fastembed reads an array "
            "on one device: pass one shard, or jax.device_put(array, jax.devices('cpu')[0])"
        )
    return next(iter(devices))


def _device_name(device: Any) -> str:
    if device.platform == "cpu":
        return "cpu"
    if device.platform in ("gpu", "cuda"):
        return f"cuda:{device.local_hardware_id}"
    return f"{device.platform}:{device.id}"


def _not_on_host(device: str) -> str:
    message = f"JAX arrays on {device} are not supported: fastembed reads JAX arrays on the CPU"
    if device.startswith("cuda"):
        message += (
            "; its CUDA backend takes cupy arrays: pass cupy.from_dlpack(array) (zero-copy), "
            "or move the array to the host with jax.device_put(array, jax.devices('cpu')[0])"
        )
    return message


def _keeping_64_bits(dtype: np.dtype) -> Any:
    """A context in which ``jax.device_put`` keeps `dtype` where JAX's 64-bit mode off would narrow it (its mode on for this thread), else a null one."""
    if dtype.itemsize < 8:
        return contextlib.nullcontext()  # the common case, kept cheap: JAX narrows only 64-bit dtypes
    import jax

    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        enable_x64 = getattr(jax, "enable_x64", None)
        if enable_x64 is None:
            enable_x64 = jax.experimental.enable_x64  # its home before jax 0.8
        return enable_x64(True)
    return contextlib.nullcontext()


def _check_whole_bytes(dtype: Any) -> None:
    """Raise TypeError for a JAX dtype of fewer bits than its numpy dtype's bytes hold (int4: numpy's view would be an unpacked copy)."""
    dtype = np.dtype(dtype)
    bits = _value_bits(dtype)
    if bits < 8 * dtype.itemsize:
        raise TypeError(f"JAX dtype {dtype} packs {bits}-bit values, which numpy holds one per byte: a numpy view "
                        "of the array would be an unpacked copy; fastembed reads arrays of whole-byte values")


@functools.cache
def _value_bits(dtype: np.dtype) -> int:
    """Bits per value of `dtype`: ml_dtypes' own count for its dtypes (int4: 4), else the itemsize's."""
    if not is_ml_dtype(dtype):
        return 8 * dtype.itemsize  # numpy's own dtypes: JAX stores them as numpy does
    import ml_dtypes

    try:
        return int(ml_dtypes.iinfo(dtype).bits)
    except (TypeError, ValueError):
        return int(ml_dtypes.finfo(dtype).bits)


def _host_view(array: Any) -> np.ndarray:
    """JAX's own numpy view of a host array, for dtypes DLPack lacks; a TypeError if it would be a copy.

    Raises:
        TypeError: the view would be a copy, or JAX cannot give one (the
            array was deleted by another thread since it was checked).
    """
    try:
        view = np.asarray(array)
        address = array.unsafe_buffer_pointer() if view.size else None
    except Exception as error:  # noqa: BLE001 - whatever JAX raises, the caller gets the documented TypeError
        raise TypeError(f"the JAX array cannot be seen as a numpy array: {error}") from None
    if view.size and numpy_adapter.data_address(view) != address:
        raise TypeError(f"JAX dtype {array.dtype} cannot be seen as a numpy array without a copy")
    return view


ADAPTER = JaxAdapter()
