"""Every input check of fastembed, in one place, on per-call snapshots.

A call first takes one *snapshot* of each array it was given: a fresh view
(:meth:`fastembed.arrays.ArrayAdapter.snapshot`) whose pointer, shape,
strides and dtype were read in one step. Validation, allocation and the
gather then use the snapshots alone, so another thread that reassigns
``table.shape`` or ``ids.dtype`` meanwhile cannot make a kernel write past
``out`` or read past the table.

Backends never validate, except for the per-id bounds check, which a kernel
performs in its own pass and reports through :func:`out_of_range_error`, so
that the message is the same whatever backend found the bad id.

Contracts:
- a *table* is a 2-D, C-contiguous array (numpy, np.memmap, cupy, a torch
  CPU or CUDA tensor, a JAX CPU array, or any other DLPack producer in host memory)
  of any fixed-size dtype that holds no Python objects;
- *ids* are integers of any dtype and ndim up to :data:`MAX_IDS_NDIM`, on the table's device (host
  ids for a GPU table are copied there); host ids are copied first in each
  call (int32 and int64 keep their dtype), so that no other thread can change
  their values, dtype or shape between the checks and the gather;
- a *quantized table* is a :class:`fastembed.formats.QuantizedTable` whose
  arrays fit its format (:func:`check_quantized`); it dequantizes into
  float32, float16 or bfloat16 (float32 unless ``dtype=`` says otherwise);
- *out* is a C-contiguous, writeable array of shape ``ids.shape + (dim,)``
  and the output dtype (:func:`output_dtype`: the table's dtype unless
  ``dtype=`` asks for another), on the table's device, sharing no memory
  with the table or the ids.

A torch CPU tensor (table, ids or out) is snapshotted as a numpy array over
its memory (zero-copy, :mod:`fastembed.arrays.torch_adapter`), so every check
below, and the backends, see numpy. So is a JAX CPU array (table or ids,
read-only: :mod:`fastembed.arrays.jax_adapter`); JAX arrays are immutable,
so one is never accepted as out. So is any other DLPack producer on the host
(table, ids or out: :mod:`fastembed.arrays.dlpack_adapter`), read-only where
it exports its memory read-only.

Errors: TypeError for the wrong kind of thing, ValueError for the wrong
shape/layout, IndexError for an id out of range. Nothing the caller owns is
modified before every check has passed.
"""
from __future__ import annotations

import contextlib
import functools
import math
import mmap
import numbers
import weakref
from typing import Any

import numpy as np

from .arrays import adapter_of, as_read, device_of, dtype_spec, host_copy, memory_guards, numpy_adapter, write_probe
from .backends.base import NATIVE_ID_DTYPES
from .formats import FORMATS, OUTPUT_DTYPES, QuantizedTable, is_fastembeds_own
from .tables import is_float_dtype, is_integer_dtype, resolve_dtype

_INT64, _INT32 = np.dtype(np.int64), np.dtype(np.int32)  # numpy's builtin dtypes are singletons
_NDARRAY = np.ndarray
_MEMMAP, _MMAP = np.memmap, mmap.mmap
#: Ids of these exact types hold no buffer: each call converts them into an array of its own.
_CONVERTED_IDS = (list, tuple, int)


def _numpy_max_ndim() -> int:
    """The most dimensions a numpy array may have (64 from numpy 2.0, 32 before)."""
    try:
        np.empty((0,) * 64)
    except ValueError:
        return 32
    return 64


#: The most dimensions ids may have: the result has one more.
MAX_IDS_NDIM = _numpy_max_ndim() - 1


def table_snapshot(table: Any) -> Any:
    """A validated snapshot of `table`.

    Raises:
        TypeError: not an array fastembed knows, or an object/empty dtype.
        ValueError: not 2-D, or not C-contiguous. A non-contiguous table is
            refused rather than silently copied: the copy would be the size
            of the whole table.
    """
    if type(table) is _NDARRAY or isinstance(table, _NDARRAY):  # np.memmap (every mapped checkpoint) too
        view = table.view() if type(table) is _NDARRAY else numpy_adapter.ADAPTER.snapshot(table)
        dtype = view.dtype
        if view.ndim == 2 and view.flags.c_contiguous and dtype.itemsize and not dtype.hasobject:
            return view  # the common case, kept cheap: every check below passes
    elif type(table) is QuantizedTable:
        return _quantized_snapshot(table)
    else:
        adapter = adapter_of(table)
        if adapter is None:
            raise TypeError(
                "table must be a numpy array, np.memmap, cupy array, torch CPU or CUDA tensor, or a JAX CPU array, "
                "or another library's host array exporting DLPack (__dlpack__ and __dlpack_device__); "
                f"got {type(table).__module__}.{type(table).__qualname__}"
            )
        view = adapter.snapshot(table)
    if view.ndim != 2:
        raise ValueError(f"table must be 2-D (vocab_size, dim), got {view.ndim}-D with shape {tuple(view.shape)}")
    dtype = np.dtype(view.dtype)
    if dtype.hasobject or dtype.itemsize == 0:
        raise TypeError(f"table dtype {dtype} cannot be gathered: it must be a fixed-size dtype without Python objects")
    if not view.flags.c_contiguous:
        raise ValueError(
            f"table must be C-contiguous, got strides {tuple(view.strides)} for shape {tuple(view.shape)}; "
            "fastembed never copies a table implicitly: pass np.ascontiguousarray(table) "
            "(a torch tensor: table.contiguous()) once"
        )
    return view


def read_once(table: Any) -> Any:
    """The caller's table as read now, for code that consults its arrays again after their snapshot.

    A quantized table's fields go into a table of its own, and each array is
    :func:`~fastembed.arrays.as_read` (a torch tensor: an alias that a later
    ``.data =`` on the caller's leaves over the memory, dtype and device it
    had): a snapshot of the result and every later read of it are of the
    same arrays, whatever another thread assigns to the caller's meanwhile.
    """
    if type(table) is QuantizedTable:
        data, fmt, dim, scales = table.data, table.format, table.dim, table.scales
        return QuantizedTable(as_read(data), fmt, dim, as_read(scales))
    return as_read(table)


def kept_table(table: Any) -> tuple[Any, Any, tuple[Any, ...]]:
    """A table a layer keeps between calls: (the caller's arrays as read once, their snapshot, guards over their memory).

    The caller's arrays are read once (:func:`~fastembed.arrays.as_read`: a
    quantized table's fields into a table of its own, torch tensors as
    aliases that a later ``.data =`` on the caller's leaves alone), so the
    snapshot and the guards (:func:`~fastembed.arrays.memory_guards`) are of
    the same memory. The kept snapshot is taken after the guards and checked
    against them, so memory freed or moved meanwhile (another thread's
    ``resize_``) is refused now rather than read later.

    Raises:
        TypeError, ValueError: as :func:`table_snapshot`, which checks the
            table first; ValueError also when its memory was moved while the
            layer took its snapshot.
    """
    read = read_once(table)
    table_snapshot(read)  # the table's errors before any guard touches its memory
    guards = memory_guards(storage(read), read.scales if type(read) is QuantizedTable else None)
    view = table_snapshot(read)
    for guard in guards:
        guard.check()
    return read, view, guards


#: fastembed's own formats, kept alive here so that no other object can ever take one of their ids.
_OWN_FORMATS = tuple(FORMATS.values())
_OWN_FORMAT_IDS = frozenset(map(id, _OWN_FORMATS))
_UINT8, _FLOAT32 = np.dtype(np.uint8), np.dtype(np.float32)


def _quantized_snapshot(table: QuantizedTable) -> QuantizedTable:
    """A QuantizedTable over fresh views of `table`'s arrays, checked again (another thread may change them).

    Host views are read-only: no gather writes a table, and the numba
    kernels take read-only arrays, so a lookup passes them on as they are.
    """
    data, fmt, dim, scales = table.data, table.format, table.dim, table.scales
    if isinstance(data, _NDARRAY) and id(fmt) in _OWN_FORMAT_IDS and type(dim) is int and (
            scales is None or isinstance(scales, _NDARRAY)):
        # The common case, kept cheap: numpy arrays whose views pass every check of check_quantized.
        rows = numpy_adapter.ADAPTER.snapshot(data)
        row_scales = None if scales is None else numpy_adapter.ADAPTER.snapshot(scales)
        # The row width as fmt.row_bytes(dim) gives it, without that method's check of an int, a 2 us ABC test here.
        if (rows.dtype == _UINT8 and rows.ndim == 2 and rows.flags.c_contiguous and dim > 0
                and dim % fmt.block_values == 0 and rows.shape[1] == dim // fmt.block_values * fmt.block_bytes
                and (row_scales is None if not fmt.row_scale else (
                    row_scales is not None and row_scales.dtype == _FLOAT32 and row_scales.shape == rows.shape[:1]
                    and row_scales.flags.c_contiguous))):
            for view in (rows, row_scales):
                if view is not None and view.flags.writeable:  # setting a flag costs more than reading it
                    view.flags.writeable = False
            return QuantizedTable._checked(rows, fmt, dim, row_scales)
    data_adapter = adapter_of(data)
    scales_adapter = adapter_of(scales)
    snapshot = QuantizedTable(
        data if data_adapter is None else data_adapter.snapshot(data),
        table.format,
        table.dim,
        scales if scales_adapter is None else scales_adapter.snapshot(scales),
    )
    for view in (snapshot.data, snapshot.scales):
        if type(view) is _NDARRAY:
            view.flags.writeable = False
    return snapshot


def storage(table: Any) -> Any:
    """The array holding a table's rows: the table itself, or a quantized table's ``data``."""
    return table.data if type(table) is QuantizedTable else table


def output_dtype(table: Any, dtype: Any, rows: Any = None) -> np.dtype:
    """The dtype of ``table[ids]`` for a call with ``dtype=dtype`` (`table`: a snapshot).

    None means the table's dtype, or float32 for a quantized table; a torch
    dtype (``torch.float16``) means numpy's dtype of that name. A
    quantized table dequantizes into float32, float16 or bfloat16, in the
    machine's byte order; a dense
    floating-point host table casts into those or float64 (rounding to nearest
    even); any other table gives its own dtype only. `rows`, the caller's
    dense table, lets the dtype of a torch CUDA tensor that its snapshot holds
    as words (bfloat16 as uint16) name the table's own dtype.

    Raises:
        TypeError: a dtype the table cannot be gathered into, naming the
            choices; a cast of a dense table that is not on the host; a dtype
            in the other byte order for a table whose library has none
            (torch, JAX, cupy).
    """
    if type(table) is QuantizedTable:
        if dtype is None:
            return _FLOAT32
        target = resolve_dtype(dtype_spec(dtype))
        if target in _native_outputs():
            return target
        if target.name not in OUTPUT_DTYPES:
            raise TypeError(f"a {table.format.name} table dequantizes into {', '.join(OUTPUT_DTYPES)}, not {target}")
        if not target.isnative:
            raise TypeError(f"a {table.format.name} table dequantizes into the machine's byte order, not {target.str}; "
                            "pass the dtype's name and byte-swap the result if you need it")
        return target
    source = np.dtype(table.dtype)
    if dtype is None:
        return source
    target = resolve_dtype(dtype_spec(dtype))
    library = None if target.isnative or rows is None else adapter_of(rows)
    if library is not None and getattr(library, "native_byte_order_only", False):
        raise TypeError(f"a {library.name} table gathers into its library's arrays, which have no "
                        f"dtype {target.str} (the machine's byte order is the other one); pass the dtype's name")
    own = None if rows is None else _dtype_name(rows)  # a snapshot that holds words: the table's own dtype's name
    if (target == source and own is None) or (own is not None and own == target.name and target.isnative):
        return source
    if not isinstance(table, _NDARRAY):
        kind = adapter_of(table if rows is None else rows).name  # type: ignore[union-attr]
        raise TypeError(f"dtype= casts host tables only; gather this {kind} table in its own dtype "
                        f"({own or source}) and cast the result")
    if is_float_dtype(source) and (target if target.isnative else target.newbyteorder("=")) in _cast_outputs():
        return target
    raise TypeError(
        f"a table of dtype {own or source} can be gathered into its own dtype"
        + (f" or {', '.join(OUTPUT_DTYPES)}, float64" if is_float_dtype(source) else "")
        + f", not {target}"
    )


@functools.cache
def _native_outputs() -> frozenset[np.dtype]:
    """The dtypes of :data:`~fastembed.formats.OUTPUT_DTYPES` in the machine's byte order that resolve here (bfloat16
    needs ml_dtypes): a set lookup instead of reading ``dtype.name``, which numpy computes on every read (and cannot
    while the interpreter exits)."""
    found = set()
    for name in OUTPUT_DTYPES:
        with contextlib.suppress(TypeError):
            found.add(resolve_dtype(name))
    return frozenset(found)


@functools.cache
def _cast_outputs() -> frozenset[np.dtype]:
    """The dtypes a dense floating-point host table casts into, in the machine's byte order: the quantized tables'
    outputs and float64."""
    return _native_outputs() | {np.dtype(np.float64)}


def table_dtype(table: Any, rows: Any) -> np.dtype:
    """The dtype of results without ``dtype=``, as the caller's `rows` hold it (`table`: their snapshot).

    :func:`output_dtype` with ``dtype=None`` (float32 for a quantized table),
    except where the snapshot holds the rows as words of their width (a torch
    CUDA bfloat16 or float8 tensor, seen by cupy as uint16 or uint8): then the
    rows' own dtype, from ml_dtypes.

    Raises:
        TypeError: such a dtype while ml_dtypes is not installed.
    """
    stored = output_dtype(table, None)
    own = None if type(table) is QuantizedTable else _dtype_name(rows)
    return stored if own is None or own == stored.name else resolve_dtype(own)


def _dtype_name(array: Any) -> str | None:
    """The name of `array`'s own dtype where its adapter knows one beyond its snapshot's (torch), else None."""
    dtype_name = getattr(adapter_of(array), "dtype_name", None)
    return None if dtype_name is None else dtype_name(array)


def is_real_number_dtype(dtype: np.dtype) -> bool:
    """numpy bools, integers and floats, and the ml_dtypes integers and floats: what casts to float32."""
    return dtype.kind == "b" or is_integer_dtype(dtype) or is_float_dtype(dtype)


def quantized_dim(dim: Any) -> int:
    """`dim` as an int: a Python or numpy integer (not a bool); TypeError naming it otherwise."""
    return checked_integer(dim, "a quantized table's dim must be an integer (values per row)", -math.inf, math.inf)


def checked_integer(value: Any, must_be: str, low: float, high: float) -> int:
    """`value` as an int: a Python or numpy integer (not a bool) from `low` to `high`.

    Raises:
        TypeError: not an integer, saying ``f"{must_be}, got {value!r}"``.
        ValueError: outside the range, saying the same.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{must_be}, got {value!r}")
    if not low <= int(value) <= high:
        bits = int(value).bit_length()  # repr of an integer of over 4,300 digits raises (sys.set_int_max_str_digits)
        raise ValueError(f"{must_be}, got {value!r}" if bits <= 128 else f"{must_be}, got an integer of {bits} bits")
    return int(value)


def random_table_arguments(vocab_size: Any, dim: Any, dtype: Any, seed: Any) -> tuple[int, int, np.dtype, int]:
    """The arguments of a new random table, checked: integer sizes and seed >= 0, a fixed-size dtype without objects.

    Raises:
        TypeError: a size or seed that is not an integer; no dtype, or one without a fixed size, with Python
            objects, or of sub-arrays.
        ValueError: a negative size or seed.
    """
    vocab_size = checked_integer(vocab_size, "vocab_size must be an integer >= 0", 0, math.inf)
    dim = checked_integer(dim, "dim must be an integer >= 0", 0, math.inf)
    seed = checked_integer(seed, "seed must be an integer >= 0", 0, math.inf)
    if dtype is None:  # numpy would read None as float64
        raise TypeError("dtype must be given: a numpy dtype or its name")
    resolved = resolve_dtype(dtype)
    if resolved.hasobject or resolved.itemsize == 0:
        raise TypeError(f"a table's dtype must have a fixed size and no Python objects, got {resolved}")
    if resolved.subdtype is not None:
        raise TypeError(f"a table's dtype holds rows of scalars, not sub-arrays: got {resolved}")
    return vocab_size, dim, resolved, seed


def checked_seconds(value: Any, must_be: str, low: float, high: float) -> float:
    """`value` as a float: a real number (not a bool) from `low` to `high` (NaN is outside every range).

    Raises:
        TypeError: not a real number, saying ``f"{must_be}, got {value!r}"``.
        ValueError: outside the range, saying the same.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{must_be}, got {value!r}")
    number: Any = value  # compared as it is: float() of a huge int overflows
    if not low <= number <= high:
        raise ValueError(f"{must_be}, got {value!r}")
    try:
        return float(number)
    except OverflowError:  # an int beyond every float, within a range without an upper end
        return math.inf


def check_quantized(table: Any) -> None:
    """Check that a :class:`fastembed.formats.QuantizedTable`'s arrays fit its format.

    Raises:
        TypeError: `data` is not a uint8 array fastembed knows; a row-scale
            format's `scales` are missing, not float32, of another array
            library than `data`, or on another device.
        ValueError: `data` is not 2-D and C-contiguous, or its rows are not
            ``format.row_bytes(dim)`` bytes; scales given to a format that keeps
            them in its blocks, not one per row, not C-contiguous, or on a GPU
            at an address that is not a multiple of 4; a format of its own under
            the name of one of fastembed's (the backends' kernels go by the name).
    """
    fmt, data, scales = table.format, table.data, table.scales
    known = FORMATS.get(fmt.name.lower())  # the loaders read a saved format's name case-insensitively
    if known is not None and not is_fastembeds_own(fmt):
        raise ValueError(
            f"a format named {fmt.name!r} must be fastembed's own {known.name} layout ({known}); "
            "give a format of your own a name of its own (names are compared case-insensitively)"
        )
    given = data
    adapter = adapter_of(data)
    own = _dtype_name(data)  # a torch float8 tensor on a GPU: its snapshot holds the bytes as uint8
    if adapter is not None:
        data = adapter.snapshot(data)  # a torch or JAX host array: a numpy view, as the gather will see it
    if adapter is None or np.dtype(data.dtype) != np.uint8 or own not in (None, "uint8"):
        raise TypeError(
            f"a {fmt.name} table's data must be a uint8 array (numpy, np.memmap, cupy, or a torch or JAX host array), got "
            f"{type(given).__module__}.{type(given).__qualname__} of dtype {own or getattr(data, 'dtype', None)}"
        )
    expected = fmt.row_bytes(table.dim)
    if data.ndim != 2 or data.shape[1] != expected:
        raise ValueError(
            f"a {fmt.name} table of dim {table.dim} holds rows of {expected} bytes: data must have shape "
            f"(vocab_size, {expected}), got {tuple(data.shape)}"
        )
    if not data.flags.c_contiguous:
        raise ValueError(f"a {fmt.name} table's data must be C-contiguous, got strides {tuple(data.strides)}")
    if not fmt.row_scale:
        if scales is not None:
            raise ValueError(f"the {fmt.name} format keeps its scales inside the blocks: scales must be None")
        return
    if scales is None or adapter_of(scales) is not adapter:
        raise TypeError(f"a {fmt.name} table needs float32 scales, one per row, in the same array library as its data")
    scales = adapter.snapshot(scales)  # torch or JAX scales: a numpy view, whose dtype numpy can compare
    if np.dtype(scales.dtype) != np.float32:
        raise TypeError(f"a {fmt.name} table needs float32 scales, one per row, got {np.dtype(scales.dtype)}")
    if device_of(scales) != device_of(data):
        raise TypeError(f"the scales live on {device_of(scales)} but the rows on {device_of(data)}")
    if tuple(scales.shape) != (data.shape[0],):
        raise ValueError(f"scales must have shape ({data.shape[0]},), one per row, got {tuple(scales.shape)}")
    if not scales.flags.c_contiguous:
        raise ValueError(f"scales must be C-contiguous, got strides {tuple(scales.strides)}: pass np.ascontiguousarray(scales)")
    if _misaligned(scales, adapter):
        raise ValueError(f"the scales on {device_of(scales)} start at an address that is not a multiple of 4 bytes, "
                         "and the GPU kernels read them as float32: pass an aligned copy (scales.copy()) once")


def _misaligned(view: Any, adapter: Any) -> bool:
    """Whether a device array (of `adapter`'s library) starts at an address that is not a multiple of its itemsize.

    Only adapters of device arrays say (host arrays: their own flags do).
    """
    misaligned = getattr(adapter, "misaligned", None)
    return misaligned is not None and misaligned(view)


def ids_snapshot(ids: Any, table: Any) -> Any:
    """A snapshot of `ids` as integers on the table's device (`table`: a snapshot).

    Host ids are the call's own copy (C-contiguous), taken before anything
    else of them is read: the checks and the gather read the same values,
    dtype and shape, whatever another thread writes into or reassigns on the
    caller's ids meanwhile. int32 and int64 keep their dtype; lists, tuples
    and scalars are converted as numpy would, an empty list to an empty intp
    array (as in ``table[[]]``); int32/int64 of the other byte order are
    put in the machine's in the call's copy; other integer dtypes are
    converted to int64 after their range has been checked (in the call's
    copy for uint64, else into a second copy of the ids; never of the
    table). Host ids for a GPU table are copied to its device; ids on the
    GPU are used where they are.

    Raises:
        TypeError: non-integer ids (bool, float, complex, str, object), ids
            on another device than the table, or for a GPU table, GPU ids of
            a library fastembed has no adapter for.
        ValueError: ids of more than :data:`MAX_IDS_NDIM` dimensions (63 with
            numpy 2), for which the result cannot be an array.
        IndexError: an integer too large for 64 bits, or (for converted
            dtypes) an id outside the table.
    """
    # The common cases, kept cheap: host ids for a table whose rows numpy holds (dense, or a quantized table's bytes).
    numpy_rows = type(table) is _NDARRAY or (type(table) is QuantizedTable and type(table.data) is _NDARRAY)
    if type(ids) is _NDARRAY and numpy_rows:
        # Copied before anything is read: another thread may reassign the caller's ids.dtype or shape at any time.
        own = ids.copy()
        dtype = own.dtype
        if (dtype is _INT64 or dtype is _INT32 or dtype in NATIVE_ID_DTYPES) and own.ndim <= MAX_IDS_NDIM:
            return own
        _check_integer_dtype(dtype)
        return _native_ids(own, table.shape[0], owned=True)  # converted from the call's copy
    if type(ids) in _CONVERTED_IDS and numpy_rows:
        converted = _converted_ids(ids, table.shape[0])
        _check_integer_dtype(converted.dtype)
        return _native_ids(converted, table.shape[0], owned=True)  # numpy's conversion: the call's own array
    ndim = getattr(ids, "ndim", 0)
    if type(ndim) is int and ndim > MAX_IDS_NDIM:  # checked first: a library's array of more has no numpy view
        raise _too_many_dimensions(ndim)
    rows = storage(table)
    table_device = device_of(rows)
    # adapter_of first: a tensor's __cuda_array_interface__ is a property that may raise (torch: requires grad).
    if table_device != "cpu" and adapter_of(ids) is None and hasattr(ids, "__cuda_array_interface__"):
        # Neither its device nor its layout can be told for certain: refused before either is guessed.
        raise TypeError(f"ids are a {type(ids).__module__}.{type(ids).__qualname__} on a GPU, of a library fastembed "
                        "has no adapter for: pass them as a cupy array (cupy.asarray(ids) wraps them without a copy) "
                        "or a torch CUDA tensor")
    ids_device = _ids_device(ids)
    if ids_device != table_device:
        if ids_device != "cpu" or table_device == "cpu":
            raise _devices_differ(ids_device, table_device)
        # Host ids for a GPU table are copied to the device (documented), after the host-side checks.
        host = _host_ids(ids, table.shape[0])
        _check_integer_dtype(host.dtype)
        host = _native_ids(host, table.shape[0])
        return adapter_of(rows).from_host(host, table_device)  # type: ignore[union-attr]
    if ids_device != "cpu":
        adapter = adapter_of(ids)
        view = adapter.snapshot(ids)  # type: ignore[union-attr] # GPU ids of no adapter are refused above
        own = _dtype_name(ids)
        if own is not None and own != np.dtype(view.dtype).name:  # bfloat16 and float8 travel as unsigned words
            raise TypeError(f"ids must be integers, got non-integer dtype {own}")
        _check_integer_dtype(np.dtype(view.dtype))
        native = _native_ids(view, table.shape[0])
        return native.copy() if _misaligned(native, adapter) else native  # the kernels read ids element by element
    adapter = None if isinstance(ids, np.ndarray) else adapter_of(ids)
    host = _host_ids(ids, table.shape[0], adapter)
    _check_integer_dtype(host.dtype)
    native = _native_ids(host, table.shape[0])
    # A converted dtype, or a list numpy has just converted, is the call's own already.
    own = native if native is not host or type(ids) in _CONVERTED_IDS else native.copy()
    if adapter is None and type(ids) not in _CONVERTED_IDS and not isinstance(ids, (np.ndarray, np.generic)):
        _remember_converted(own, host)  # an array-like's array, which may be the caller's memory (a scalar's is new)
    return own


def host_ids_snapshot(ids: Any, table: Any, device: str) -> np.ndarray:
    """A host snapshot of `ids` for a caller that checks them on the host, whose table lives on `device`.

    `table` is a host snapshot the ids are checked against as by
    :func:`ids_snapshot`. Ids on `device` (a GPU) are copied to the host
    first: one copy, which waits for the work queued before it.

    Raises:
        TypeError: as :func:`ids_snapshot`, and for ids on another device than `device`.
        IndexError: as :func:`ids_snapshot`.
    """
    ids_device = _ids_device(ids)
    if ids_device == "cpu":
        return ids_snapshot(ids, table)
    if ids_device != device:
        raise _devices_differ(ids_device, device)
    return ids_snapshot(host_copy(ids), table)


def _ids_device(ids: Any) -> str:
    """:func:`device_of` the ids, its TypeError (a sharded or deleted JAX array, say) saying they are the ids."""
    try:
        return device_of(ids)
    except TypeError as error:
        raise TypeError(f"ids: {error}") from None


def _devices_differ(ids_device: str, table_device: str) -> TypeError:
    return TypeError(f"ids live on {ids_device} but the table lives on {table_device}; "
                     "move one of them explicitly (fastembed never moves data implicitly)")


#: The default of :func:`_host_ids`'s `adapter`: not looked up yet (None is an answer: no adapter).
_LOOK_UP = object()


def _host_ids(ids: Any, vocab_size: int, adapter: Any = _LOOK_UP) -> np.ndarray:
    """Host ids as a numpy snapshot (a view of an array, or the array numpy converts a list to); `adapter`: the ids'
    adapter (or None) where the caller has looked it up already."""
    if isinstance(ids, np.ndarray):
        return ids.view(_NDARRAY)  # np.matrix, np.memmap: a plain view
    if adapter is _LOOK_UP:
        adapter = adapter_of(ids)
    if adapter is not None:
        return adapter.snapshot(ids)  # a host tensor: a numpy view of it
    return _converted_ids(ids, vocab_size)


def _converted_ids(ids: Any, vocab_size: int) -> np.ndarray:
    """Ids that are no array (a list, a tuple, a number) as the new array numpy converts them to.

    Raises:
        TypeError: a bool; elements whose library refuses numpy their values (a torch tensor that requires grad).
        ValueError: nested lists of different lengths.
        IndexError: an integer that fits no 64-bit integer (or an id outside `vocab_size` rows before it).
    """
    if isinstance(ids, (bool, np.bool_)):
        raise TypeError("ids must be integers, got a bool")
    try:
        converted = np.asarray(ids)
    except ValueError as error:  # nested lists of different lengths
        raise ValueError(f"ids must form a rectangular array of integers: {error}") from None
    except RuntimeError as error:  # torch's and JAX's refusal of an element's values
        raise TypeError(f"ids must be integers numpy can read: {error}") from None
    if converted.dtype.kind in "fO" and not isinstance(ids, np.generic):
        if converted.size == 0:
            return converted.astype(np.intp)  # [] is float64 to numpy; table[[]] treats it as intp
        integers = _integers_as_int64(ids, vocab_size)
        if integers is not None:
            return integers
    return converted


def _integers_as_int64(ids: Any, vocab_size: int) -> np.ndarray | None:
    """Integers that numpy had to store as floats or objects (huge ones, or int64 beside uint64) as int64.

    The ids are read once more, as Python objects, and that reading alone
    gives the values and the shape: a list another thread resizes between
    the two readings yields the rows of the second, never a mix of both.

    Returns None where they are not all integers (the dtype check then names the kind).

    Raises:
        IndexError: naming the first id outside a table of `vocab_size` rows (it may fit no 64-bit integer).
    """
    try:
        values = np.array(ids, dtype=object)
    except ValueError:  # grown ragged since the first reading
        return None
    shape = values.shape
    flat = values.reshape(-1)
    if not all(isinstance(value, (int, np.integer)) and not isinstance(value, bool) for value in flat):
        return None
    for position, value in enumerate(flat):
        if not 0 <= int(value) < vocab_size:
            if not -(2**63) <= int(value) < 2**63:
                raise IndexError(f"id {int(value)} at position {_position(position, shape)} does not fit a 64-bit "
                                 "integer: it is out of range")
            raise _bad_id_error(int(value), position, shape, vocab_size)
    return np.array([int(value) for value in flat], np.int64).reshape(shape)


def _check_integer_dtype(dtype: np.dtype) -> None:
    if not is_integer_dtype(dtype):
        what = {"b": "bool", "f": "floating", "c": "complex", "U": "string", "S": "bytes", "O": "object"}
        raise TypeError(f"ids must be integers, got {what.get(dtype.kind, 'non-integer')} dtype {dtype}")


def _native_ids(ids: Any, vocab_size: int, owned: bool = False) -> Any:
    """`ids` with at most :data:`MAX_IDS_NDIM` dimensions as the kernels take them: native int32/int64 ids as
    they are, others converted to int64 after a range check.

    The check comes first because uint64 values above 2**63 would wrap to
    negative numbers in the conversion and hide the caller's mistake. Ids the
    call `owned` (its own host copy) are put in the machine's byte order
    where they are (int32/int64 ids are then native ids), and uint64 ids
    become int64 where they are, so the call holds one array of them.

    Raises:
        ValueError: ids of more than :data:`MAX_IDS_NDIM` dimensions.
        IndexError: converted ids outside ``[0, vocab_size)`` (as :func:`check_ids_in_range`).
    """
    if len(ids.shape) > MAX_IDS_NDIM:
        raise _too_many_dimensions(len(ids.shape))
    dtype = np.dtype(ids.dtype)
    if owned and not dtype.isnative:
        dtype = dtype.newbyteorder("=")
        ids = ids.byteswap(inplace=True).view(dtype)
    if dtype in NATIVE_ID_DTYPES:
        return ids
    # Checked and converted from one reading (another thread may be writing the caller's ids): a lossless
    # conversion is that reading; uint64 is read as it is (copied unless the call owns it), since converting
    # would wrap its largest values.
    if np.can_cast(dtype, np.int64, "safe"):
        own = ids.astype(np.int64)
    elif owned:
        own = ids
    else:
        own = ids.copy()
    check_ids_in_range(own, vocab_size)
    if own.dtype == np.int64:
        return own
    # In range, so below 2**63: a native uint64's bits are those of the same int64.
    return own.view(np.int64) if own.dtype == np.uint64 and own.dtype.isnative else own.astype(np.int64)


def _too_many_dimensions(ndim: int) -> ValueError:
    return ValueError(f"ids have {ndim} dimensions; at most {MAX_IDS_NDIM}, since the result "
                      f"has one more and an array has at most {MAX_IDS_NDIM + 1}")


def check_ids_in_range(ids: Any, vocab_size: int) -> None:
    """Raise IndexError naming the first id outside ``[0, vocab_size)``.

    The one bounds check for ids checked apart from a gather pass: converted
    ids here, the backends that cannot check inside their own pass,
    ``select_backend`` and the distributed layer's ids. Two reductions over the ids (min and max); the search for the position
    runs only when one of them is out of range.
    """
    if ids.size == 0:
        return
    if isinstance(ids, np.ndarray):  # ufuncs, not ids.min(), which imports a numpy module on first use (not at exit)
        low, high = np.minimum.reduce(ids, axis=None), np.maximum.reduce(ids, axis=None)
    else:  # a GPU library's ids reduce on their device
        low, high = ids.min(), ids.max()
    if int(low) >= 0 and int(high) < vocab_size:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    first = int(bad.reshape(-1).argmax())
    raise out_of_range_error(ids, first, vocab_size)


def out_of_range_error(ids: Any, flat_position: int, vocab_size: int) -> IndexError:
    """The one IndexError for a bad id, given its position in ``ids.ravel()``."""
    return _bad_id_error(int(ids.reshape(-1)[flat_position]), flat_position, tuple(ids.shape), vocab_size)


def _bad_id_error(value: int, flat_position: int, shape: tuple[int, ...], vocab_size: int) -> IndexError:
    """The IndexError naming id `value` at `flat_position` of ids of `shape`, outside a table of `vocab_size` rows."""
    valid = f"valid ids are 0..{vocab_size - 1}" if vocab_size else "it has no rows, so no id is valid"
    return IndexError(f"id {value} at position {_position(flat_position, shape)} is out of range for a table of "
                      f"{vocab_size} rows ({valid})")


def _position(flat_position: int, shape: tuple[int, ...]) -> Any:
    """A position in ``ids.ravel()`` as the caller indexes ids of `shape`: an int for 1-D ids, else a tuple."""
    return flat_position if len(shape) == 1 else tuple(int(i) for i in np.unravel_index(flat_position, shape))


def place_arguments(table: np.ndarray, ids: np.ndarray, out: np.ndarray,
                    positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Check the arguments of a host backend's ``place``; the ids and the positions as int64 copies of their own.

    The checks that follow the copies read only the copies, and so does the
    backend, so no other thread can change them once checked; the ids'
    range is the backend's to check, as for a gather.

    Args:
        table: a dense 2-D, C-contiguous numpy table (a plain ``numpy.ndarray``, no Python objects in it).
        ids: 1-D integers, one per row placed (a plain ``numpy.ndarray``).
        out: a 2-D, C-contiguous, writeable plain ``numpy.ndarray`` of the table's dtype and row width,
            sharing no memory with the table.
        positions: 1-D integers, one per id: the rows of `out` they go to (a plain ``numpy.ndarray``).

    Returns:
        ``(ids, positions)`` as new 1-D int64 arrays.

    Raises:
        TypeError: an argument that is not a plain ``numpy.ndarray`` (a list, a tensor, a masked array),
            ids or positions that are not integers, a table holding Python objects, an `out` of another
            dtype than the table.
        ValueError: a table or `out` that is not 2-D and C-contiguous, an `out` that is read-only,
            overlaps the table or whose rows are not as wide as the table's, positions that are not one
            per id, not rows of `out` or not distinct.
        IndexError: an id or a position that fits no 64-bit integer.
    """
    for name, array in (("table", table), ("ids", ids), ("out", out), ("positions", positions)):
        if type(array) is not np.ndarray:
            raise TypeError(f"{name} must be a numpy.ndarray (not a subclass), got {type(array).__name__}")
    for name, array in (("ids", ids), ("positions", positions)):
        if array.dtype.kind not in "iu":
            raise TypeError(f"{name} must be integers, got {array.dtype}")
        if array.dtype == np.uint64 and array.size and int(array.max()) >= 2**63:
            raise IndexError(f"{name} must fit a 64-bit integer, got {int(array.max())}")
    if table.dtype.hasobject:
        raise TypeError(f"the table must hold no Python objects, got {table.dtype}")
    for name, array in (("table", table), ("out", out)):
        if array.ndim != 2 or not array.flags.c_contiguous:
            raise ValueError(f"{name} must be a 2-D, C-contiguous array, got shape {array.shape} and strides "
                             f"{array.strides}")
    if out.dtype != table.dtype:
        raise TypeError(f"out must have the table's dtype {table.dtype}, got {out.dtype}")
    if out.shape[1] != table.shape[1] or not out.flags.writeable:
        raise ValueError(f"out must be writeable rows of {table.shape[1]} values, got shape {out.shape}"
                         f"{'' if out.flags.writeable else ', read-only'}")
    if np.may_share_memory(out, table):
        raise ValueError("out overlaps the table: rows placed would change rows still to be read")
    ids, positions = ids.astype(np.int64), positions.astype(np.int64)  # copies: nothing else can change them
    n = ids.size
    if ids.ndim != 1 or positions.ndim != 1 or positions.size != n:
        raise ValueError(f"ids and positions must be 1-D, one position per id; got shapes {ids.shape} and "
                         f"{positions.shape}")
    if n and (int(positions.min()) < 0 or int(positions.max()) >= out.shape[0]):
        raise ValueError(f"positions must lie in [0, {out.shape[0]}), the rows of out; got {int(positions.min())} "
                         f"to {int(positions.max())}")
    ordered = np.sort(positions)
    repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
    if repeated.size:  # threads placing rows at one position could leave a mix of them there
        raise ValueError(f"positions must be distinct, got {int(ordered[repeated[0]])} more than once")
    return ids, positions


def output_shape(ids: Any, table: Any) -> tuple[int, ...]:
    """``ids.shape + (dim,)``: the shape of ``table[ids]``."""
    return tuple(ids.shape) + (table.shape[1],)


def _result_dtype_name(table: Any, caller_table: Any, dtype: Any) -> str | None:
    """The name of a lookup's output dtype (`table`: a snapshot), or None where only its snapshot's dtype is known."""
    if type(table) is QuantizedTable or (dtype is not None and np.dtype(dtype) != np.dtype(table.dtype)):
        return np.dtype(dtype).name
    return _dtype_name(storage(caller_table))


def out_snapshot(out: Any, ids: Any, table: Any, caller_table: Any, caller_ids: Any, dtype: Any = None) -> Any:
    """A validated snapshot of `out` that can receive ``table[ids]`` without any copy.

    `ids` and `table` are snapshots; `caller_table` and `caller_ids` are what
    the caller passed (their ownership flags make the overlap test cheap);
    `dtype` is the output dtype (:func:`output_dtype`; None: the table's).

    Raises:
        TypeError: wrong type, dtype or device.
        ValueError: wrong shape, not C-contiguous, read-only (also read-only
            memory under a torch tensor, which torch does not flag: the adapter's
            ``writable`` probes it), a tensor torch forbids writing in place there
            (the adapter's ``write_refusal``), or overlapping the table or the ids
            (also through another mapping of the table's file: the adapter's
            ``same_file_bytes``).
    """
    quantized = type(table) is QuantizedTable
    if type(out) is _NDARRAY and type(table.data if quantized else table) is _NDARRAY and (
            dtype is not None or not quantized):
        view = out.view()
        flags = view.flags
        if (
            view.shape == ids.shape + table.shape[1:]
            and view.dtype == (table.dtype if dtype is None else dtype)
            and flags.c_contiguous
            and flags.writeable
        ):
            if (
                not quantized
                and out.flags.owndata
                and ((type(caller_ids) is _NDARRAY and caller_ids.flags.owndata and out is not caller_ids)
                     or type(caller_ids) in _CONVERTED_IDS)
                and (
                    (type(caller_table) is _NDARRAY  # a tensor or JAX table has no flags: the tests below
                     and caller_table.flags.owndata
                     and out is not caller_table)
                    or (type(caller_table) is _MEMMAP and type(caller_table.base) is _MMAP
                        and not np.may_share_memory(view, table))
                )
            ):
                # Different arrays that each own their buffer cannot overlap; ids given as a list or a number have
                # no memory to share. A memory map (np.load's mmap_mode) holds its mmap object but not the mapping,
                # which a close or resize can free under it: its address range is tested, the rest need not be.
                return view
            base = out.base
            if not np.may_share_memory(view, table.data if quantized else table) and not (
                quantized and table.scales is not None and np.may_share_memory(view, table.scales)
            ) and not np.may_share_memory(
                view, _caller_ids_memory(caller_ids, ids)
            ) and ((type(base) is _NDARRAY and base.base is None)
                   or (not write_probe.lent(out) and numpy_adapter.mapping_of(out) is None)):
                # Disjoint address ranges cannot overlap (a mapped table, views): the exact test is left for the rest,
                # and so is memory another library lent, which may be read-only whatever numpy says, and a view of a
                # mapped file, which another mapping of the table's file may alias (a view of an array owning its
                # memory, the decode loop's out=buffer[:n], is told apart without the walk).
                return view
    adapter = adapter_of(out)
    if adapter is None:
        raise TypeError(f"out must be an array, got {type(out).__module__}.{type(out).__qualname__}")
    if getattr(adapter, "immutable", False):
        raise TypeError(
            f"out is a {adapter.name} array, and {adapter.name} arrays are immutable: lookup cannot write into one; "
            "pass a numpy out (np.empty(ids.shape + (dim,), dtype)), or no out to get a new array of the table's kind"
        )
    rows = storage(table)
    if adapter.device(out) != device_of(rows):
        raise TypeError(
            f"out lives on {adapter.device(out)} but the table lives on {device_of(rows)}; "
            "they must be on the same device"
        )
    write_refusal = getattr(adapter, "write_refusal", None)
    refusal = None if write_refusal is None else write_refusal(out)
    if refusal is not None:
        raise ValueError(refusal)
    # A torch CPU tensor: a numpy view over its memory, like the table's snapshot, but writeable.
    view = getattr(adapter, "writable_snapshot", adapter.snapshot)(out)
    if adapter_of(view) is not adapter_of(rows):
        raise TypeError(
            f"out is a {type(out).__module__} array and the table a {type(table).__module__} array; "
            "the kernels write only into arrays of the table's kind"
        )
    if tuple(view.shape) != output_shape(ids, table):
        raise ValueError(f"out has shape {tuple(view.shape)}, expected {output_shape(ids, table)} (ids.shape + (dim,))")
    if adapter.device(out) != "cpu" and _dtype_name(out) is not None:
        # A GPU snapshot holds bfloat16 and float8 as words, which other dtypes of their width share.
        wanted = _result_dtype_name(table, caller_table, dtype)
        if wanted is not None and _dtype_name(out) != wanted:
            raise TypeError(f"out has dtype {_dtype_name(out)}, expected {wanted} (the output dtype of this lookup)")
    expected = adapter_of(view).stored_dtype(np.dtype(table.dtype) if dtype is None else np.dtype(dtype))  # type: ignore[union-attr]
    if view.dtype != expected:
        named = _dtype_name(out) if adapter.device(out) != "cpu" else None  # not the words a GPU snapshot holds
        raise TypeError(f"out has dtype {named or np.dtype(view.dtype)}, expected {expected} (the output dtype of "
                        "this lookup)")
    flags = view.flags
    if not flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous, got strides {tuple(view.strides)}")
    if type(table) is QuantizedTable and _misaligned(view, adapter):
        raise ValueError(f"out on {adapter.device(out)} starts at an address that is not a multiple of its "
                         f"{view.dtype.itemsize}-byte items, and the GPU kernels write them one by one: pass an "
                         "aligned out")
    if isinstance(view, np.ndarray) and not flags.writeable:
        raise ValueError("out is read-only memory: lookup writes into out; pass a writeable array"
                         + getattr(adapter, "read_only_note", ""))
    writable = getattr(adapter, "writable", None)
    if writable is not None and not writable(view):
        raise ValueError(
            "out is read-only memory, which its array does not mark read-only (a torch tensor over a read-only "
            "mapping, such as torch.from_dlpack of np.load(path, mmap_mode='r'), or a numpy or DLPack view of one: "
            "torch marks nothing read-only): lookup writes into out; pass writeable memory"
        )
    scales = table.scales if type(table) is QuantizedTable else None
    if adapter.may_share_memory(view, rows) or (scales is not None and adapter.may_share_memory(view, scales)):
        raise ValueError("out overlaps the table: gathering into it would overwrite rows being read")
    same_file_bytes = getattr(adapter, "same_file_bytes", None)
    # The snapshots' bytes: the caller's arrays may be reshaped or restrided meanwhile (their maps are the same).
    if same_file_bytes is not None and any(same_file_bytes(view, part) for part in (rows, scales) if part is not None):
        raise ValueError("out maps bytes of the table's own file (another np.memmap of it): gathering into it would "
                         "overwrite rows being read")
    if _out_overlaps_ids(adapter, view, out, caller_ids, ids):
        raise ValueError("out overlaps the ids: gathering into it would overwrite them")
    return view


def _out_overlaps_ids(adapter: Any, view: Any, out: Any, caller_ids: Any, ids: Any) -> bool:
    """Whether `out` (`view`, its snapshot by `adapter`) shares memory with the caller's ids (`ids`: the call's snapshot)."""
    span = getattr(adapter, "byte_span", None)
    if span is not None and adapter_of(caller_ids) is adapter:
        out_start, out_stop = span(out)
        ids_start, ids_stop = span(caller_ids)
        if out_stop <= ids_start or ids_stop <= out_start:
            return False  # disjoint address ranges, told apart without a view of the ids
    return bool(adapter.may_share_memory(view, _caller_ids_memory(caller_ids, ids)))


#: id of a call's snapshot of an array-like's ids -> (a weak reference to that snapshot, the array numpy converted
#: the array-like to), for as long as the snapshot lives: the overlap check reads it without converting them again.
_CONVERTED_FROM: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _remember_converted(snapshot: np.ndarray, converted: np.ndarray) -> None:
    key = id(snapshot)
    _CONVERTED_FROM[key] = (weakref.ref(snapshot, lambda _gone: _CONVERTED_FROM.pop(key, None)), converted)


def _caller_ids_memory(caller_ids: Any, ids: Any) -> Any:
    """The caller's ids as an array over their memory (`ids`, the call's snapshot, may be a copy of them)."""
    if isinstance(caller_ids, np.ndarray):
        return caller_ids
    if type(caller_ids) in _CONVERTED_IDS:
        return ids  # converted for this call: no memory of the caller's to share
    remembered = _CONVERTED_FROM.get(id(ids))
    if remembered is not None and remembered[0]() is ids:
        return remembered[1]  # an array-like's array, as numpy converted it once for this call
    adapter = adapter_of(caller_ids)
    if adapter is not None:
        return adapter.snapshot(caller_ids)  # on a GPU too: ids of another dtype or at an odd address are copied there
    try:
        memory = memoryview(caller_ids)  # a memoryview, bytearray or other buffer (never an __array__ conversion)
    except TypeError:
        return ids  # a list or another object, converted for this call
    try:
        return np.asarray(memory)
    except (TypeError, ValueError):  # a buffer format numpy cannot read: the ids were converted another way
        return ids
