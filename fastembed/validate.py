"""Every input check of fastembed, in one place.

The API calls these before dispatching; backends never validate, except for
the per-id bounds check, which a compiled kernel performs in its own pass and
reports back through :func:`out_of_range_error` so that the message is the
same whatever backend found the bad id.

Contracts:
- a *table* is a 2-D, C-contiguous array (numpy, np.memmap or cupy) of any
  fixed-size dtype that holds no Python objects;
- *ids* are integers of any dtype and any ndim, on the table's device;
  int32 and int64 ids are used as they are (no converting copy);
- *out* is a C-contiguous, writeable array of shape ``ids.shape + (dim,)``
  and the table's dtype, on the table's device, sharing no memory with the
  table or the ids.

Errors: TypeError for the wrong kind of thing, ValueError for the wrong
shape/layout, IndexError for an id out of range. Nothing the caller owns is
modified before every check has passed.
"""
from __future__ import annotations

from typing import Any

import numpy as np

#: Id dtypes the kernels take natively; any other integer dtype is converted.
NATIVE_ID_DTYPES = frozenset((np.dtype(np.int32), np.dtype(np.int64)))
_INT64, _INT32 = np.dtype(np.int64), np.dtype(np.int32)  # numpy's builtin dtypes are singletons


def device_of(array: Any) -> str:
    """Where an array lives: ``"cpu"`` or ``"cuda:N"``.

    Detected through ``__cuda_array_interface__`` so that cupy, torch and
    numba device arrays are recognised without importing any of them.
    """
    if hasattr(array, "__cuda_array_interface__"):
        device = getattr(array, "device", None)
        index = getattr(device, "id", getattr(device, "index", 0))
        return f"cuda:{index if index is not None else 0}"
    return "cpu"


def is_gpu_array(array: Any) -> bool:
    return hasattr(array, "__cuda_array_interface__")


def check_table(table: Any) -> None:
    """Raise unless `table` can be gathered from.

    Raises TypeError (not an array, object dtype) or ValueError (not 2-D, not
    C-contiguous). A non-contiguous table is refused rather than silently
    copied: the copy would be the size of the whole table.
    """
    if type(table) is np.ndarray and table.ndim == 2 and table.flags.c_contiguous and not table.dtype.hasobject:
        return  # the common case, kept cheap: every check below passes
    if not isinstance(table, np.ndarray) and not is_gpu_array(table):
        raise TypeError(
            "table must be a numpy array, np.memmap or cupy array, "
            f"got {type(table).__module__}.{type(table).__qualname__}"
        )
    if table.ndim != 2:
        raise ValueError(
            f"table must be 2-D (vocab_size, dim), got {table.ndim}-D with shape {tuple(table.shape)}"
        )
    dtype = np.dtype(table.dtype)
    if dtype.hasobject or dtype.itemsize == 0:
        raise TypeError(f"table dtype {dtype} cannot be gathered: it must be a fixed-size dtype without Python objects")
    if not table.flags.c_contiguous:
        raise ValueError(
            f"table must be C-contiguous, got strides {tuple(table.strides)} for shape {tuple(table.shape)}; "
            "fastembed never copies a table implicitly: pass np.ascontiguousarray(table) once"
        )


def as_ids(ids: Any, table: Any) -> Any:
    """Return `ids` as an integer array on the table's device.

    numpy ids that already are an array are returned as they are (no copy);
    lists, tuples and scalars are converted as numpy would. An empty list
    becomes an empty intp array, as in ``table[[]]``. Integer dtypes other
    than int32 and int64 are converted to int64 after their range has been
    checked (a copy of the ids, never of the table).

    Raises TypeError for non-integer ids (bool, float, complex, str, object)
    and for ids on another device than the table.
    """
    if type(ids) is np.ndarray and isinstance(table, np.ndarray):  # the common case, kept cheap
        dtype = ids.dtype
        if dtype is _INT64 or dtype is _INT32 or dtype in NATIVE_ID_DTYPES:
            return ids
        _check_integer_dtype(ids.dtype)
        return _native_ids(ids, table.shape[0])
    table_device, ids_device = device_of(table), device_of(ids)
    if table_device != ids_device:
        if ids_device == "cpu" and table_device.startswith("cuda"):
            # Host ids for a GPU table are copied to the device (documented).
            ids = _host_ids(ids)
            _check_integer_dtype(ids.dtype)
            ids = _native_ids(ids, table.shape[0])
            import cupy  # a GPU table means cupy is importable

            with cupy.cuda.Device(table.device.id):
                return cupy.asarray(ids)
        raise TypeError(
            f"ids live on {ids_device} but the table lives on {table_device}; "
            "move one of them explicitly (fastembed never moves data implicitly)"
        )
    if ids_device != "cpu":
        _check_integer_dtype(np.dtype(ids.dtype))
        return _native_ids(ids, table.shape[0])
    ids = _host_ids(ids)
    _check_integer_dtype(ids.dtype)
    return _native_ids(ids, table.shape[0])


def _host_ids(ids: Any) -> np.ndarray:
    if isinstance(ids, np.ndarray):
        return ids if type(ids) is np.ndarray else np.asarray(ids)  # np.matrix, np.memmap: a plain view
    if isinstance(ids, (bool, np.bool_)):
        raise TypeError("ids must be integers, got a bool")
    converted = np.asarray(ids)
    if converted.size == 0 and converted.dtype.kind == "f" and not isinstance(ids, np.generic):
        return converted.astype(np.intp)  # [] is float64 to numpy; table[[]] treats it as intp
    return converted


def _check_integer_dtype(dtype: np.dtype) -> None:
    if dtype.kind not in "iu":
        what = {"b": "bool", "f": "floating", "c": "complex", "U": "string", "S": "bytes", "O": "object"}
        raise TypeError(
            f"ids must be integers, got {what.get(dtype.kind, 'non-integer')} dtype {dtype}"
        )


def _native_ids(ids: Any, vocab_size: int) -> Any:
    """Convert ids of a non-native integer dtype to int64, after a range check.

    The check comes first because uint64 values above 2**63 would wrap to
    negative numbers in the conversion and hide the caller's mistake.
    """
    if np.dtype(ids.dtype) in NATIVE_ID_DTYPES:
        return ids
    check_ids_in_range(ids, vocab_size)
    return ids.astype(np.int64)


def check_ids_in_range(ids: Any, vocab_size: int) -> None:
    """Raise IndexError naming the first id outside ``[0, vocab_size)``.

    Used by backends that cannot check bounds inside their own gather pass.
    Two reductions over the ids (min and max); the search for the position
    runs only when one of them is out of range.
    """
    if ids.size == 0:
        return
    if int(ids.min()) >= 0 and int(ids.max()) < vocab_size:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    first = int(bad.reshape(-1).argmax())
    raise out_of_range_error(ids, first, vocab_size)


def out_of_range_error(ids: Any, flat_position: int, vocab_size: int) -> IndexError:
    """The one IndexError for a bad id, given its position in ``ids.ravel()``."""
    shape = tuple(ids.shape)
    if len(shape) == 1:
        position: Any = flat_position
    else:
        position = tuple(int(i) for i in np.unravel_index(flat_position, shape))
    value = int(ids.reshape(-1)[flat_position])
    return IndexError(
        f"id {value} at position {position} is out of range for a table of "
        f"{vocab_size} rows (valid ids are 0..{vocab_size - 1})"
    )


def output_shape(ids: Any, table: Any) -> tuple[int, ...]:
    return ids.shape + (table.shape[1],)


def check_out(out: Any, ids: Any, table: Any) -> None:
    """Raise unless `out` can receive ``table[ids]`` without any copy.

    Raises TypeError (wrong type, dtype or device) or ValueError (wrong shape,
    not C-contiguous, read-only, overlapping the table or the ids).
    """
    if type(out) is np.ndarray and type(ids) is np.ndarray and isinstance(table, np.ndarray):
        # The common case, kept cheap: every check below passes (the overlap
        # checks through the ownership shortcut of _host_arrays_may_overlap).
        flags = out.flags
        if (
            out.shape == ids.shape + table.shape[1:]
            and out.dtype == table.dtype
            and flags.c_contiguous
            and flags.writeable
            and flags.owndata
            and out is not table
            and out is not ids
            and table.flags.owndata
            and ids.flags.owndata
        ):
            return
    if not (isinstance(out, np.ndarray) or is_gpu_array(out)):
        raise TypeError(f"out must be an array, got {type(out).__module__}.{type(out).__qualname__}")
    on_host = isinstance(out, np.ndarray)
    if on_host != isinstance(table, np.ndarray) or (not on_host and device_of(out) != device_of(table)):
        raise TypeError(
            f"out lives on {device_of(out)} but the table lives on {device_of(table)}; they must be on the same device"
        )
    if out.shape != ids.shape + table.shape[1:]:
        raise ValueError(
            f"out has shape {tuple(out.shape)}, expected {output_shape(ids, table)} (ids.shape + (dim,))"
        )
    if out.dtype != table.dtype:
        raise TypeError(f"out has dtype {np.dtype(out.dtype)}, expected the table's dtype {np.dtype(table.dtype)}")
    flags = out.flags
    if not flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous, got strides {tuple(out.strides)}")
    if on_host:
        if not flags.writeable:
            raise ValueError("out is read-only")
        if _host_arrays_may_overlap(out, flags.owndata, table):
            raise ValueError("out overlaps the table: gathering into it would overwrite rows being read")
        if isinstance(ids, np.ndarray) and _host_arrays_may_overlap(out, flags.owndata, ids):
            raise ValueError("out overlaps the ids: gathering into it would overwrite ids being read")
    elif _gpu_ranges_overlap(out, table) or _gpu_ranges_overlap(out, ids):
        raise ValueError("out overlaps the table or the ids on the GPU")


def _host_arrays_may_overlap(out: np.ndarray, out_owns_data: bool, other: np.ndarray) -> bool:
    """Whether `out` and `other` share memory.

    Two different arrays that each own their buffer (numpy allocated it and
    will free it) cannot overlap; that shortcut costs two attribute reads,
    where ``np.shares_memory`` costs about 0.3 us, a tenth of a one-token
    lookup. Views and memory maps take the exact test.
    """
    if out_owns_data and other is not out and other.flags.owndata:
        return False
    return bool(np.shares_memory(out, other))


def _gpu_ranges_overlap(a: Any, b: Any) -> bool:
    if not is_gpu_array(b):
        return False
    a_start, b_start = a.data.ptr, b.data.ptr
    return a_start < b_start + b.nbytes and b_start < a_start + a.nbytes and a.nbytes > 0 and b.nbytes > 0
