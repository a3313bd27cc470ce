"""CuPy arrays: CUDA device memory.

Recognised by their module name and ``__cuda_array_interface__``, so telling
a cupy array from anything else never imports cupy.
"""
from __future__ import annotations

from typing import Any

#: The dtypes cupy arrays hold, by numpy's character codes: bool, the integers, float16/32/64, complex64/128.
_DTYPE_CHARS = frozenset("?bhilqBHILQefdFD")


class CupyAdapter:
    name = "cupy"
    owned_by_type = True
    result_alignment = 0
    native_byte_order_only = True

    def stored_dtype(self, dtype: Any) -> Any:
        """CuPy has no ml_dtypes (bfloat16, float8): they live as unsigned words of the same size."""
        import numpy as np

        from ..tables import is_ml_dtype

        dtype = np.dtype(dtype)
        return np.dtype(f"u{dtype.itemsize}") if is_ml_dtype(dtype) else dtype

    def owns(self, array: Any) -> bool:
        return type(array).__module__.partition(".")[0] == "cupy" and hasattr(array, "__cuda_array_interface__")

    def device(self, array: Any) -> str:
        return f"cuda:{int(array.device.id)}"

    def snapshot(self, array: Any) -> Any:
        return array.view()

    def stream_context(self, array: Any) -> Any:
        """The array's device made current: CuPy allocates what a lookup converts (ids of other dtypes) on the current one."""
        import cupy

        return cupy.cuda.Device(int(array.device.id))

    def misaligned(self, view: Any) -> bool:
        """Whether the array's address is not a multiple of its itemsize (a byte view's ``view(dtype)`` at an odd offset)."""
        return view.data.ptr % max(1, view.dtype.itemsize) != 0

    def from_host(self, host: Any, device: str) -> Any:
        """A copy of host data on `device` (a table moved once, or ids given as numpy for a GPU table).

        ml_dtypes (bfloat16, float8; :meth:`stored_dtype`) and structured
        dtypes travel as unsigned words of their size.

        Raises:
            TypeError: a dtype cupy cannot carry: strings, datetimes, objects,
                long doubles, another byte order than the machine's, or a
                structured or ml_dtypes dtype of other than 1, 2, 4 or 8 bytes.
        """
        import cupy
        import numpy as np

        from ..tables import is_ml_dtype

        host = np.asarray(host, order="C")  # keeps 0-d ids 0-d, where ascontiguousarray makes them 1-d
        dtype = host.dtype
        if dtype.kind == "V" or is_ml_dtype(dtype):
            if dtype.itemsize not in (1, 2, 4, 8):
                raise TypeError(f"cannot move an array of dtype {dtype} to the GPU: cupy has no dtype of "
                                f"{dtype.itemsize} bytes to carry it")
            host = host.view(f"u{dtype.itemsize}")
        elif dtype.char not in _DTYPE_CHARS or not dtype.isnative:
            raise TypeError(f"cannot move an array of dtype {dtype} to the GPU: cupy arrays hold booleans and numbers "
                            "of up to 64 bits (128 complex) in native byte order only; convert the host array first "
                            "(array.astype(array.dtype.newbyteorder('=')) for another byte order)")
        with cupy.cuda.Device(device_index(device)):
            return cupy.asarray(host)

    def to_host(self, array: Any) -> Any:
        """A host copy of the array as numpy (on cupy's current stream, which it waits for)."""
        import cupy

        return cupy.asnumpy(array)

    def may_share_memory(self, first: Any, second: Any) -> bool:
        """Whether the device byte ranges the two arrays' elements span intersect (strided, reversed and broadcast arrays too)."""
        if not self.owns(second) or first.size == 0 or second.size == 0:
            return False
        first_start, first_stop = _span(first)
        second_start, second_stop = _span(second)
        return first_start < second_stop and second_start < first_stop

    def wrap(self, result: Any) -> Any:
        return result


def _span(array: Any) -> tuple[int, int]:
    """``(first byte, past the last)`` of the device memory a non-empty array's elements lie in, from its strides."""
    start = stop = int(array.data.ptr)
    for extent, stride in zip(array.shape, array.strides, strict=True):
        if stride < 0:
            start += (extent - 1) * stride
        else:
            stop += (extent - 1) * stride
    return start, stop + array.dtype.itemsize


def device_index(device: str) -> int:
    """The N of ``"cuda:N"``."""
    return int(device.partition(":")[2] or 0)


ADAPTER = CupyAdapter()
