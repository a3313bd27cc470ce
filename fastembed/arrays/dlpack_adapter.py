"""Any other DLPack producer on the host: seen as a numpy array over its memory, zero-copy.

An object of a library without an adapter of its own (not numpy, cupy, torch
or jax, which are detected first) is an array to fastembed when it has
``__dlpack__`` and ``__dlpack_device__`` (the array API's interchange
protocol). Telling one from anything else calls no method of it, so no
library is imported.

A snapshot is ``np.from_dlpack(array, copy=False)``: a numpy array over the
producer's own memory, read-only when the producer exports it read-only
(DLPack 1.0's read-only flag) or through the protocol older than DLPack 1.0
(a ``__dlpack__`` without ``max_version``, which cannot say its memory is
writable, so numpy imports it read-only); validation refuses such an array
as ``out``, naming both causes. With numpy 2.1 or later, a producer that can
export only a copy (it raises when asked for none) is a TypeError: a copy as
``out`` would never reach the caller, and a copy as a table would be a
hidden one; older numpy cannot ask. It accepts
the host device types (CPU, and CUDA or ROCm pinned host memory) and the
dtypes numpy has; a dtype numpy lacks (bfloat16 exported by another
library, say) is a TypeError naming it. A result on such a table is the
numpy array itself: fastembed cannot build the producer's array type back.

An array on a GPU or another device is refused with a TypeError naming the
device (fastembed's CUDA backend takes cupy arrays and torch CUDA tensors).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import numpy_adapter, write_probe

#: Whether np.from_dlpack takes copy= (numpy 2.1 on), to ask a producer for its memory and never a copy.
_NUMPY_ASKS_FOR_NO_COPY = np.lib.NumpyVersion(np.__version__) >= "2.1.0"
#: DLPack device types whose memory the host reads directly: kDLCPU, kDLCUDAHost, kDLROCMHost.
HOST_DEVICE_TYPES = frozenset((1, 3, 11))
#: Names of the other DLPack device types, for messages (dlpack.h's DLDeviceType).
_DEVICE_NAMES = {2: "cuda", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm", 12: "ext_dev",
                 13: "cuda_managed", 14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}


class DlpackAdapter:
    name = "dlpack"
    owned_by_type = False
    result_alignment = 0
    read_only_note = ("; numpy imports DLPack exports read-only when the producer marks them so, or when its "
                      "__dlpack__ predates DLPack 1.0 (it takes no max_version), which cannot say its memory is "
                      "writable: pass a numpy array, or a producer of DLPack 1.0 over writeable memory")

    def stored_dtype(self, dtype: Any) -> Any:
        return dtype

    def owns(self, array: Any) -> bool:
        # A class (np.ndarray itself, say) has the methods too, unbound: it is not an array.
        return not isinstance(array, type) and hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__")

    def device(self, array: Any) -> str:
        """``"cpu"`` for host memory, ``"cuda:N"`` for a CUDA device, else the DLPack device type's name and index.

        Raises:
            TypeError: ``__dlpack_device__()`` does not return a (device type, index) pair of integers.
        """
        try:
            reported = array.__dlpack_device__()
        except Exception as error:  # noqa: BLE001 - whatever the producer raises, the caller gets one TypeError
            raise TypeError(f"{_kind(array)}.__dlpack_device__() failed: {error}") from None
        try:
            device_type, index = (int(value) for value in reported)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{_kind(array)}.__dlpack_device__() must return (device type, device index), as DLPack says: {error}"
            ) from None
        if device_type in HOST_DEVICE_TYPES:
            return "cpu"
        return f"{_DEVICE_NAMES.get(device_type, f'dlpack device type {device_type}')}:{index}"

    def snapshot(self, array: Any) -> np.ndarray:
        """A numpy array over the producer's memory (``np.from_dlpack``; never a copy with numpy 2.1 on), read-only where the export is.

        Raises:
            TypeError: the array is not in host memory (naming its device), or
                numpy cannot take it (a dtype numpy lacks, a malformed export, an
                error raised by the producer itself).
        """
        device = self.device(array)
        if device != "cpu":
            raise TypeError(
                f"a {_kind(array)} array on {device} is not supported: fastembed reads DLPack arrays of other "
                "libraries in host memory (its CUDA backend takes cupy arrays and torch CUDA tensors: "
                "cupy.from_dlpack(array) is zero-copy); copy it to the host explicitly"
            )
        try:
            if not _NUMPY_ASKS_FOR_NO_COPY:
                return np.from_dlpack(array)
            try:
                return np.from_dlpack(array, copy=False)  # a producer that could only export a copy raises
            except TypeError as refused:
                # A producer older than DLPack 1.0 takes no copy= (nor max_version=), and numpy imports it read-only.
                # Asked again every time: one wrapper type may hold producers of both kinds.
                legacy = np.from_dlpack(array)
                if legacy.flags.writeable:  # not such a producer: one that refused copy=False with a TypeError
                    raise refused from None
                return legacy
        except Exception as error:  # noqa: BLE001 - whatever the producer raises, the caller gets one TypeError
            raise TypeError(f"a {_kind(array)} array cannot be seen as a numpy array through DLPack: {error}") from None

    def from_host(self, host: np.ndarray, device: str = "cpu") -> np.ndarray:
        if device != "cpu":
            raise TypeError(f"fastembed cannot make an array of another library on {device}")
        return host

    #: Snapshots are numpy arrays: the numpy adapter's exact test applies.
    may_share_memory = staticmethod(numpy_adapter.ADAPTER.may_share_memory)

    def wrap(self, result: np.ndarray) -> np.ndarray:
        """The numpy result itself: fastembed does not know how to build the producer's array type."""
        return result

    def writable(self, view: np.ndarray) -> bool:
        """Whether a gather can write `view` (an ``out``): a producer may export read-only memory as writable
        (torch does), so the memory is probed (:mod:`fastembed.arrays.write_probe`)."""
        return write_probe.can_write(view)


def _kind(array: Any) -> str:
    return f"{type(array).__module__}.{type(array).__qualname__}"


ADAPTER = DlpackAdapter()
