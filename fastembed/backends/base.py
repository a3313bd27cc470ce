"""The interface every backend implements, and the capabilities it declares.

A backend is an object with a ``name``, declared :class:`Capabilities`, and
four methods (:class:`Backend`); :class:`DequantizingBackend`,
:class:`SmallGatherBackend` and :class:`PlacingBackend` each add one it may
have. The dispatcher derives why a backend cannot serve a call from those
declarations (:func:`not_supported_reasons`); no
backend writes that logic itself. Adding a backend is one module that
defines such an object, plus one call to
:func:`fastembed.dispatch.register_backend`.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

#: The id dtypes every kernel takes as they are; validation converts other integer ids to int64.
NATIVE_ID_DTYPES: frozenset[np.dtype] = frozenset((np.dtype(np.int32), np.dtype(np.int64)))
#: The format name of an ordinary (not quantized) table.
DENSE = "dense"
DENSE_ONLY: frozenset[str] = frozenset({DENSE})


@dataclass(frozen=True)
class Capabilities:
    """What a backend can gather, declared once.

    Attributes:
        array_libraries: the array libraries whose tables it gathers, by
            adapter name (``"numpy"``, ``"cupy"``, see :mod:`fastembed.arrays`);
            ``ids`` and ``out`` arrive on the table's device and library.
        devices: the device kinds it runs on (``"cpu"``, ``"cuda"``).
        formats: the table formats it gathers: ``"dense"`` (any fixed-size
            dtype) and the names of the block formats it dequantizes
            (:data:`fastembed.formats.FORMATS`), for which it implements
            :class:`DequantizingBackend`.
    """

    array_libraries: frozenset[str]
    devices: frozenset[str]
    formats: frozenset[str] = DENSE_ONLY


@runtime_checkable
class Backend(Protocol):
    """A gather implementation behind ``lookup(..., backend=NAME)``.

    Contract of :meth:`gather`: ``table``, ``ids`` and ``out`` are per-call
    snapshots made by :mod:`fastembed.validate` (fresh views that no other
    thread can reshape) and already validated, except for the range of the
    ids, which the backend checks and reports through
    :func:`fastembed.validate.out_of_range_error`. It writes ``table[ids]``
    into ``out`` (``None``: a new output of shape ``ids.shape + (dim,)``
    where the table lives) and returns it. It never reads outside the table
    and never writes outside ``out``, even if another thread changes the
    ids' values meanwhile.
    """

    name: str
    capabilities: Capabilities

    def unavailable_reasons(self) -> list[str]:
        """Why the backend cannot run on this machine at all; empty when it can (cheap after the first call)."""
        ...

    def gather(self, table: Any, ids: Any, out: Any | None) -> Any:
        """Write ``table[ids]`` into ``out`` (or a new array) and return it."""
        ...

    def describe(self) -> dict[str, Any]:
        """Facts for ``python -m fastembed info`` (versions, threads, devices)."""
        ...

    def reset(self) -> None:
        """Forget cached state (availability, compiled-kernel bookkeeping); for tests and after installs."""
        ...


@runtime_checkable
class DequantizingBackend(Backend, Protocol):
    """A backend that also gathers quantized tables (it declares their formats in its capabilities).

    Contract of :meth:`dequantize`: as :meth:`Backend.gather`, for a
    :class:`fastembed.formats.QuantizedTable` snapshot whose ``data`` (and
    ``scales``) live where the backend runs. It writes the dequantized rows
    ``dequantize_rows(table.data[ids], ...)`` (float32, bit for bit the
    reference of :mod:`fastembed.formats`) converted to `dtype` (float32,
    float16 or bfloat16: rounded to nearest even) into ``out`` (``None``: a
    new ``ids.shape + (dim,)`` array of `dtype`) and returns it.
    """

    def dequantize(self, table: Any, ids: Any, out: Any | None, dtype: np.dtype) -> Any:
        """Write the dequantized ``table[ids]`` as `dtype` into ``out`` (or a new array) and return it."""
        ...


@runtime_checkable
class PlacingBackend(Backend, Protocol):
    """A host backend that also gathers rows into chosen rows of an output (:meth:`place`).

    The distributed layer's shared-memory exchange uses it to put each row
    straight where its result needs it. The numpy backend is its reference.
    """

    def place(self, table: Any, ids: Any, out: Any, positions: Any) -> None:
        """Write ``table[ids[i]]`` into ``out[positions[i]]`` for every i; the other rows of `out` stay as they are.

        The arguments passed :func:`fastembed.validate.place_arguments`:
        `table` (dense) and `out` (the table's dtype and row width) are 2-D,
        C-contiguous host arrays, `ids` and `positions` that function's int64
        copies, every position a distinct row of `out` (rows placed at one
        position by several threads could interleave).

        Raises:
            IndexError: an id outside the table (:func:`fastembed.validate.out_of_range_error`);
                nothing is written.
        """
        ...


#: Called when a backend finds out that it cannot run after its answer was given (a library that fails to
#: load on a background thread): the dispatcher registers one that forgets the choices it remembered.
_availability_listeners: list[Callable[[], None]] = []


def on_availability_change(listener: Callable[[], None]) -> None:
    """Call `listener` whenever a backend's :meth:`Backend.unavailable_reasons` changes after a first answer."""
    _availability_listeners.append(listener)


def availability_changed() -> None:
    """Tell the listeners that a backend's :meth:`Backend.unavailable_reasons` has changed."""
    for listener in list(_availability_listeners):
        listener()


class SmallGather(NamedTuple):
    """A backend's own gathers of small outputs, which callers may call without dispatch.

    ``gather_new(table, ids)`` and ``gather_into(table, ids, out)`` do
    exactly what the backend's ``gather(table, ids, None)`` and
    ``gather(table, ids, out)`` do for a numpy table snapshot whose output
    (``ids.size`` times the table's row stride) is smaller than
    ``below_bytes``: same snapshots, same contract.
    ``calling_thread_below_bytes`` (at least ``below_bytes``): outputs
    smaller than it are gathered on the calling thread alone, by
    ``gather_new`` or by the backend's own serial code. ``gather_into``
    None (as a backend that predates it builds this): the backend's
    ``gather`` serves outputs into an ``out``.
    """

    below_bytes: int
    gather_new: Callable[[Any, Any], Any]
    calling_thread_below_bytes: int
    gather_into: Callable[[Any, Any, Any], Any] | None = None


@runtime_checkable
class SmallGatherBackend(Backend, Protocol):
    """A host backend whose small allocating lookups a decode loop may call directly (:class:`SmallGather`).

    A few ids take microseconds, and with cold caches (a decode step after a
    forward pass) each layer between the caller and numpy's ``take`` costs
    microseconds more; :mod:`fastembed.dispatch` hands this to the lookup API.
    """

    def small_gather(self) -> SmallGather:
        """The gathers of small lookups, and below which output size they are the backend's whole gather."""
        ...


def not_supported_reasons(backend: Backend, array_library: str, device: str, table_format: str = DENSE) -> list[str]:
    """Why `backend` cannot serve a call whose table is an `array_library` array on `device` in `table_format`.

    Derived from the backend's declared :class:`Capabilities` only.
    """
    capabilities = backend.capabilities
    reasons = []
    if table_format not in capabilities.formats:
        reasons.append(f"the {backend.name} backend does not gather {table_format} tables")
    if array_library not in capabilities.array_libraries:
        reasons.append(
            f"the table is a {array_library} array on {device}; the {backend.name} backend gathers "
            f"{' or '.join(sorted(capabilities.array_libraries))} arrays"
        )
    elif device.split(":")[0] not in capabilities.devices:
        reasons.append(f"the table lives on {device}; the {backend.name} backend runs on {', '.join(sorted(capabilities.devices))}")
    if reasons and "cuda" in capabilities.devices and device == "cpu":
        reasons.append("fastembed never moves a table implicitly: move it once with Embedding.to_device()")
    return reasons


def missing_package(name: str, install: str) -> str | None:
    """Why the package `name` cannot be imported, found without importing it (`install`: how to get it), or None.

    A finder that refuses it (an import hook raising ImportError) or a stub module left in ``sys.modules``
    without a spec makes ``importlib.util.find_spec`` raise: that is a reason too, not an error of the call.
    """
    try:
        found = importlib.util.find_spec(name)
    except Exception as error:  # whatever another library's finder raises
        return f"{name} cannot be imported here ({type(error).__name__}: {error})"
    return None if found is not None else f"{name} is not installed ({install})"
