"""A rank's shard: where its rows live (host or GPU), and its rows, mapped from a checkpoint or viewed in an array."""

from __future__ import annotations

import math
import os
import re
from typing import Any, NamedTuple

import numpy as np

from .. import validate
from ..arrays import adapter_of, device_of, torch_adapter
from ..formats import QuantizedTable
from .layout import stored_range

#: What ``source`` is a checkpoint path as (as for Embedding.from_pretrained); anything else is a table.
_PATH_TYPES = (str, bytes, os.PathLike)
_NOT_SERVED = ("VocabParallelEmbedding serves host tables (numpy, np.memmap, torch CPU tensors) and torch CUDA "
               "tensors (or QuantizedTables of them); a {kind} on {device} is not served{hint}")
#: How a cupy table is served: as the torch tensor over its memory.
_CUPY_HINT = ": torch.from_dlpack(table) is a torch CUDA tensor over the same memory (no copy)"
#: ``device=`` for a checkpoint: the host, torch's current GPU, or GPU N.
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")


class _Shard(NamedTuple):
    """One rank's rows: the view (or QuantizedTable of views) gathered from, the caller's kind, the watch."""

    rows: Any  # np.ndarray or torch CUDA tensor, or a QuantizedTable of this rank's rows (and row scales)
    like: Any  # None for numpy tables; else the rows in the caller's library, so results follow the table's kind
    watch: Any  # a FileWatch over the mapped rows for a path source, else None
    vocab_size: int
    guards: tuple[Any, ...] = ()  # memory guards of a torch table's rows and scales (fastembed.arrays.memory_guards)


def shard_device(source: Any, device: Any) -> str:
    """Where this rank's shard lives: `device` for a checkpoint path (None: the host), an array's own device.

    Raises:
        ValueError: a `device` that is not ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` of
            a visible GPU; for an array, a `device` other than its own.
        TypeError: an array on a GPU that is not a torch CUDA tensor (a cupy array),
            or on another kind of device.
    """
    if isinstance(source, _PATH_TYPES):
        return _checked_device(device)
    rows = validate.storage(source)
    placement = device_of(rows)
    library = getattr(adapter_of(rows), "name", type(rows).__module__)
    if placement != "cpu" and not (placement.startswith("cuda:") and library == "torch"):
        raise TypeError(_NOT_SERVED.format(kind=f"{library} array", device=placement,
                                           hint=_CUPY_HINT if library == "cupy" else ""))
    if device is not None and _checked_device(device) != placement:
        raise ValueError(f"device={device!r} places a checkpoint's rows; an array's shard is a view of it, on "
                         f"{placement}: move the table there first")
    return placement


def _checked_device(device: Any) -> str:
    """``device=`` as ``"cpu"`` or ``"cuda:N"`` (``"cuda"``: torch's current GPU); None is the host."""
    name = "cpu" if device is None else str(device)
    if not _DEVICE_PATTERN.fullmatch(name):
        raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if name == "cpu":
        return name
    import torch

    count = torch.cuda.device_count()
    index = int(name[5:]) if name != "cuda" else torch.cuda.current_device() if count else 0
    if not index < count:
        raise ValueError(f"device={device!r}: torch sees {count} CUDA device(s)")
    return f"cuda:{index}"


def carrier(backend: str, device_type: str, capability: dict[str, list[str]]) -> str | None:
    """The backend of a group that carries tensors of `device_type` (``"cpu"``, ``"cuda"``), or None.

    `backend` is what ``torch.distributed.get_backend`` says: one backend
    (``"gloo"``, ``"nccl"``), whose device types torch lists in `capability`
    (``torch.distributed.Backend.backend_capability``), or one per device type
    (``"cpu:gloo,cuda:nccl"``).

    Example:
        >>> from fastembed.distributed.shards import carrier
        >>> capability = {"gloo": ["cpu", "cuda"], "nccl": ["cuda"]}
        >>> [carrier("nccl", kind, capability) for kind in ("cpu", "cuda")]
        [None, 'nccl']
        >>> [carrier("cpu:gloo,cuda:nccl", kind, capability) for kind in ("cpu", "cuda")]
        ['gloo', 'nccl']
    """
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(",")).get(device_type)
    return backend if device_type in capability.get(backend, ()) else None


def check_transport(backend: str, carriers: dict[str, str | None], placement: str) -> None:
    """Raise ValueError when the group (its `carriers` per device type) cannot carry the rows of a shard on `placement`."""
    kind = placement.partition(":")[0]
    if carriers[kind] is None:
        what = "a host table's rows as CPU tensors" if kind == "cpu" else "a GPU table's rows as CUDA tensors"
        raise ValueError(f"VocabParallelEmbedding communicates {what}, which a {backend!r} group cannot carry: use a "
                         "gloo group, or init_process_group(backend='cpu:gloo,cuda:nccl')")


def open_shard(source: Any, name: str | None, pad: int, rank: int, world_size: int, placement: str) -> _Shard:
    """This rank's rows of `source`: a map of only their bytes for a path (copied to `placement` if a GPU), a view for an array."""
    if isinstance(source, _PATH_TYPES):
        shard = _map_shard(os.fsdecode(source), name, pad, rank, world_size)
        return shard if placement == "cpu" else _copied_to(shard, placement)
    if name is not None:
        raise ValueError("name= picks a tensor of a checkpoint; it does not apply to an array source")
    read, view, guards = validate.kept_table(source)  # the caller's arrays read once, guarded
    vocab_size = int(view.shape[0])
    start, stop = stored_range(vocab_size, pad, rank, world_size)
    rows = validate.storage(read)  # what results follow: the table, or a quantized table's data
    like = None
    if not isinstance(rows, np.ndarray):
        like = rows.detach()[start:stop] if hasattr(rows, "detach") else rows  # torch: a view of the rows
    if placement != "cpu":  # torch CUDA tensors: gathered as they are, so that results are torch tensors on their GPU
        if isinstance(read, QuantizedTable):
            scales = None if read.scales is None else read.scales.detach()[start:stop]
            return _Shard(QuantizedTable(like, read.format, read.dim, scales), like, None, vocab_size, guards)
        return _Shard(like, like, None, vocab_size, guards)
    if isinstance(view, QuantizedTable):
        data, scales = view.data[start:stop], None if view.scales is None else view.scales[start:stop]
        # A snapshot's host views are read-only; a shard is, as a dense one, a view the caller may write where its own is.
        for part, own in ((data, read.data), (scales, read.scales)):
            if isinstance(own, np.ndarray) and own.flags.writeable and part is not None:
                part.flags.writeable = True
        return _Shard(QuantizedTable(data, view.format, view.dim, scales), like, None, vocab_size, guards)
    return _Shard(view[start:stop], like, None, vocab_size, guards)


def _map_shard(path: str | os.PathLike, name: str | None, pad: int, rank: int, world_size: int) -> _Shard:
    """Map only this rank's rows of the checkpoint's table; the loaders' map of the whole tensor is dropped unread."""
    from ..io import FileWatch, open_table
    from ..io._files import mapped_identity

    whole = open_table(path, name)
    arrays: list[Any] = [whole.data, whole.scales] if isinstance(whole, QuantizedTable) else [whole]
    if not all(array is None or isinstance(array, np.memmap) for array in arrays):
        raise TypeError(f"{path}: VocabParallelEmbedding maps plain tables; this one opens as {type(whole).__name__}")
    validate.table_snapshot(whole)  # 2-D and C-contiguous, as Embedding requires
    vocab_size = int(whole.shape[0])
    start, stop = stored_range(vocab_size, pad, rank, world_size)
    maps = [None if array is None else _map_rows(array, start, stop) for array in arrays]
    needed = max(int(array.offset) + int(array.itemsize) * stop * math.prod(array.shape[1:])
                 for array in arrays if array is not None)
    watch = FileWatch(str(arrays[0].filename), needed, mapped=mapped_identity(arrays[0]))
    rows: Any = QuantizedTable(maps[0], whole.format, whole.dim, maps[1]) if isinstance(whole, QuantizedTable) else maps[0]
    del whole, arrays  # the loaders' maps of the whole tensor, never read
    return _Shard(rows, None, watch, vocab_size)


def _copied_to(shard: _Shard, placement: str) -> _Shard:
    """A mapped shard's rows (and row scales) copied to the GPU `placement` as torch tensors; the maps are dropped."""
    def copy(rows: Any) -> Any:
        return None if rows is None else torch_adapter.ADAPTER.from_host(rows, placement)

    rows = shard.rows
    if isinstance(rows, QuantizedTable):
        data = copy(rows.data)
        return _Shard(QuantizedTable(data, rows.format, rows.dim, copy(rows.scales)), data, None, shard.vocab_size)
    data = copy(rows)
    return _Shard(data, data, None, shard.vocab_size)


def _map_rows(whole: np.memmap, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of a mapped array (a table's rows, or its row scales), mapping only their bytes."""
    shape = (stop - start, *whole.shape[1:])
    if stop == start:
        return np.empty(shape, whole.dtype)
    from ..io._files import map_file, mapped_identity

    row_bytes = whole.itemsize * math.prod(whole.shape[1:])
    # From the file the loader mapped and read the header of: a file renamed over the path meanwhile is refused.
    return map_file(str(whole.filename), whole.dtype, int(whole.offset) + start * row_bytes, shape,
                    identity=mapped_identity(whole))


def table_kind(rows: Any) -> str:
    """A table's rows in words for the agreement: its dtype (a torch dtype by its name), or its format."""
    return str(rows.format.name) if isinstance(rows, QuantizedTable) else str(rows.dtype).removeprefix("torch.")
