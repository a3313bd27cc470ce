"""GPU contenders and the GPU platform for the benchmark (needs cupy and a CUDA device).

Contenders on a cupy table: fastembed's cuda backend (with its synchronising
bad-id check, and with the check deferred), cupy fancy indexing and
``cupy.take``, torch ``index_select(out=)`` and ``F.embedding`` with int32
and int64 ids (when torch with CUDA is installed), and the limits: a
device-to-device copy of the same bytes, and cupy.empty + that copy for
allocating contenders.

Timing uses CUDA events around a loop of calls on the current stream, so it
counts device time including each call's launch, as a user's stream sees it.
torch's contenders get their ids as torch tensors made when the id pool is
copied to the device (outside the timed loops), so they are not charged for
a DLPack conversion that a torch user would not make.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import fastembed

from .contenders import Contender
from .measure import ALLOCATING_LIMIT, Platform


def _cupy() -> Any:
    import cupy

    return cupy


def _seconds_per_call(call: Callable[[Any], Any], id_list: list[Any]) -> float:
    cupy = _cupy()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for ids in id_list:
        call(ids)
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / len(id_list)


def _device_bytes_in_use() -> int:
    in_use = _cupy().get_default_memory_pool().used_bytes()
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            in_use += torch.cuda.memory_allocated()
    return in_use


def _allocated_by_one_call(call: Callable[[Any], Any], ids: Any) -> int:
    """Device bytes held by one call's result (cupy's pool plus torch's allocator)."""
    before = _device_bytes_in_use()
    result = call(ids)
    _cupy().cuda.get_current_stream().synchronize()
    allocated = _device_bytes_in_use() - before
    del result
    return max(0, allocated)


#: Device ids -> (the cupy array, the same ids as a torch tensor), most recent last; bounded.
_TORCH_IDS: collections.OrderedDict[int, tuple[Any, Any]] = collections.OrderedDict()
#: More entries than two id pools (int64 and int32) of any one case hold.
_TORCH_IDS_KEPT = 2**17


def _ids_to_device(ids: Any) -> Any:
    """Host ids as a cupy array; with torch on CUDA, also kept as a torch tensor over the same memory."""
    device_ids = _cupy().asarray(ids)
    if _torch_cuda_available():
        import torch

        _TORCH_IDS[id(device_ids)] = (device_ids, torch.from_dlpack(device_ids))
        while len(_TORCH_IDS) > _TORCH_IDS_KEPT:
            _TORCH_IDS.popitem(last=False)
    return device_ids


def _as_torch(ids: Any) -> Any:
    entry = _TORCH_IDS.get(id(ids))
    if entry is not None and entry[0] is ids:
        return entry[1]
    import torch

    return torch.from_dlpack(ids)


GPU = Platform("cuda", _ids_to_device, _seconds_per_call, _device_bytes_in_use, _allocated_by_one_call)


def _empty(table: Any, n: int) -> Any:
    return _cupy().empty((n, table.shape[1]), table.dtype)


def _served_by_cuda(call: Callable) -> Callable:
    call.served_by = "cuda"  # type: ignore[attr-defined]
    return call


def _fastembed_cuda(deferred: bool) -> Callable:
    def prepare(table: Any, n: int) -> Callable:
        out = _empty(table, n)
        if not deferred:
            return _served_by_cuda(lambda ids: fastembed.lookup(table, ids, out=out, backend="cuda"))

        def call(ids: Any) -> Any:
            with fastembed.deferred_id_checks():
                return fastembed.lookup(table, ids, out=out, backend="cuda")

        return _served_by_cuda(call)

    return prepare


def _fastembed_cuda_alloc(table: Any, n: int) -> Callable:
    return _served_by_cuda(lambda ids: fastembed.lookup(table, ids, backend="cuda"))


def _cupy_fancy(table: Any, n: int) -> Callable:
    return lambda ids: table[ids]


def _cupy_take_out(table: Any, n: int) -> Callable:
    out = _empty(table, n)
    return lambda ids: _cupy().take(table, ids, axis=0, out=out)


def _torch_embedding(table: Any, n: int) -> Callable:
    import torch

    weight = torch.from_dlpack(table)  # shares the cupy table's memory
    return lambda ids: torch.nn.functional.embedding(_as_torch(ids), weight)


def _torch_index_select_out(table: Any, n: int) -> Callable:
    import torch

    weight = torch.from_dlpack(table)
    out = torch.empty((n, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    return lambda ids: torch.index_select(weight, 0, _as_torch(ids), out=out)


def _copy_sources(table: Any, n: int) -> Callable[[], Any]:
    """Each call: the next block of n contiguous table rows, stepping through the table.

    The offset comes from a host counter, not from the ids: reading an id
    back from the device would synchronise inside the timed loop. For more
    rows than the table has, n rows are built once, here.
    """
    vocab_size = table.shape[0]
    if n > vocab_size:
        repeated = _cupy().resize(table, (n, table.shape[1]))
        return lambda: repeated
    calls = iter(range(1 << 62))
    stride = 7919 * n  # a prime number of blocks: successive sources do not repeat soon
    return lambda: table[(next(calls) * stride) % (vocab_size - n + 1) :][:n]


def _copy_device(table: Any, n: int) -> Callable:
    out, next_source = _empty(table, n), _copy_sources(table, n)

    def call(ids: Any) -> None:
        rows = next_source()
        out.data.copy_from_device_async(rows.data, rows.nbytes)

    return call


def _copy_alloc(table: Any, n: int) -> Callable:
    next_source = _copy_sources(table, n)

    def call(ids: Any) -> Any:
        rows = next_source()
        out = _empty(table, n)
        out.data.copy_from_device_async(rows.data, rows.nbytes)
        return out

    return call


@functools.cache
def _torch_cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def gpu_contenders() -> list[Contender]:
    contenders = [
        Contender("fastembed[cuda] out=", "fastembed", False, _fastembed_cuda(deferred=False)),
        Contender("fastembed[cuda] out= deferred", "fastembed", False, _fastembed_cuda(deferred=True)),
        Contender("fastembed[cuda] out= deferred int32", "fastembed", False, _fastembed_cuda(deferred=True), id_dtype="int32"),
        Contender("fastembed[cuda] alloc", "fastembed", True, _fastembed_cuda_alloc),
        Contender("cupy table[ids]", "peer", True, _cupy_fancy),
        Contender("cupy.take(out=)", "peer", False, _cupy_take_out),
    ]
    if _torch_cuda_available():
        contenders.append(Contender("torch index_select(out=) int64", "peer", False, _torch_index_select_out))
        contenders.append(Contender("torch F.embedding int64", "peer", True, _torch_embedding))
        contenders.append(Contender("torch F.embedding int32", "peer", True, _torch_embedding, id_dtype="int32"))
    contenders.append(Contender("copy device-to-device", "limit", False, _copy_device))
    contenders.append(Contender(ALLOCATING_LIMIT, "limit", True, _copy_alloc))
    return contenders


def device_name() -> str:
    cupy = _cupy()
    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return properties["name"].decode()


