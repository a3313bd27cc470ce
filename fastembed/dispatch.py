"""The backend registry and the choice of backend for a call.

Backends are tried in priority order (cuda, numba, numpy); ``auto`` takes the
first that is available on this machine and whose declared capabilities
(:class:`fastembed.backends.base.Capabilities`) cover the call. Data stays
where it lives: a cupy table goes to cuda, a numpy table never moves to a
GPU by itself. A backend chosen by name (argument, or the FASTEMBED_BACKEND
environment variable, read at import, in place of ``auto``) is used or
refused with its reasons; it never falls back silently.
"""
from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import validate
from .arrays import adapter_of, device_of
from .backends import base, cuda_backend, numba_backend, numpy_backend
from .backends.base import Backend
from .formats import QuantizedTable

#: Priority order for ``auto``.
# An OrderedDict: registering reorders it by single moves (move_to_end), never emptying it, and the functions here
# read it through a snapshot (tuple() of it, taken in one step), so a registration on another thread never fails a
# lookup; where at most one backend sits on one side of the new one's place (fastembed's own three, whatever the
# place), no snapshot shows those already registered in another order.
BACKENDS: collections.OrderedDict[str, Backend] = collections.OrderedDict(
    (b.name, b) for b in (cuda_backend.BACKEND, numba_backend.BACKEND, numpy_backend.BACKEND))
#: fastembed's own backends, which :func:`unregister_backend` keeps.
BUILT_IN = tuple(BACKENDS)
ENVIRONMENT_VARIABLE = "FASTEMBED_BACKEND"
AUTO = "auto"


class BackendUnavailableError(RuntimeError):
    """A backend chosen by name cannot serve the call; the message says why."""


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run on this machine, and if not, why.

    Fields: ``name`` (``"numba"``...), ``available``, ``reasons`` (one line each; empty when available).
    """

    name: str
    available: bool
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Selection:
    """The backend a call would use, and why each other backend was skipped.

    Fields: ``backend`` (its name), ``skipped`` (each other backend's name to its reasons).
    """

    backend: str
    skipped: dict[str, list[str]]

    def __str__(self) -> str:
        lines = [f"selected: {self.backend}"]
        lines += [f"skipped {name}: {'; '.join(reasons)}" for name, reasons in self.skipped.items()]
        return "\n".join(lines)


def register_backend(backend: Backend, before: str | None = None) -> None:
    """Add `backend` to the registry, with priority just above `before` (None: lowest).

    Raises:
        TypeError: `backend` does not implement :class:`~fastembed.backends.base.Backend`, or declares
            quantized formats without a ``dequantize`` method (:class:`~fastembed.backends.base.DequantizingBackend`).
        ValueError: its name is taken or is ``"auto"``, or `before` is unknown.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"{backend!r} does not implement fastembed.backends.base.Backend")
    if backend.capabilities.formats - base.DENSE_ONLY and not isinstance(backend, base.DequantizingBackend):
        raise TypeError(f"{backend!r} declares quantized formats but has no dequantize method")
    if backend.name == AUTO:
        raise ValueError(f"{AUTO!r} names the automatic choice; give the backend another name")
    if backend.name in BACKENDS:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    if before is not None and before not in BACKENDS:
        raise ValueError(f"unknown backend {before!r}; known: {', '.join(BACKENDS)}")
    names = tuple(BACKENDS)
    BACKENDS[backend.name] = backend
    if before is not None:
        above, below = names[: names.index(before)], names[names.index(before) :]
        if len(above) <= 1 < len(below):  # the new one to the front, then the one above it back in front of it
            for name in (backend.name, *above):
                BACKENDS.move_to_end(name, last=False)
        else:  # those from `before` on moved behind it, in their order
            for name in below:
                BACKENDS.move_to_end(name)
    refresh()


def unregister_backend(name: str) -> None:
    """Remove a backend added with :func:`register_backend`.

    Raises:
        ValueError: no backend of that name was added (the built-in ones stay:
            ``backend=`` or FASTEMBED_BACKEND chooses among them).
    """
    if name in BUILT_IN or name not in BACKENDS:
        added = [known for known in BACKENDS if known not in BUILT_IN]
        raise ValueError(f"no backend named {name!r} was added with register_backend (added: "
                         f"{', '.join(added) or 'none'}; the built-in {', '.join(BUILT_IN)} stay)")
    del BACKENDS[name]
    refresh()


def backend_statuses() -> list[BackendStatus]:
    """Every registered backend in priority order, whether it can run here, and if not, why.

    Exported as ``fastembed.backend_statuses`` (``fastembed.backends`` is the
    package of the backends themselves).

    Returns:
        One :class:`BackendStatus` per backend, the one ``"auto"`` tries first first.

    Example:
        >>> import fastembed
        >>> fastembed.backend_statuses()[-1]
        BackendStatus(name='numpy', available=True, reasons=[])
    """
    statuses = []
    for name, backend in tuple(BACKENDS.items()):
        reasons = backend.unavailable_reasons()
        statuses.append(BackendStatus(name, not reasons, list(reasons)))
    return statuses


def read_environment() -> None:
    """(Re)read FASTEMBED_BACKEND. Done once at import: a lookup does not pay
    for an environment read on every call."""
    global _environment_choice, generation
    _environment_choice = os.environ.get(ENVIRONMENT_VARIABLE) or AUTO
    generation += 1


_environment_choice = AUTO
#: Changes whenever an answer of :func:`select` may change (FASTEMBED_BACKEND re-read, :func:`refresh`).
generation = 0
#: :func:`small_gather_for_ndarray`'s last answer: (the :data:`generation` it holds for, below_bytes, gather_new,
#: calling_thread_below_bytes, gather_into).
ndarray_small_gather: tuple[int, int, Callable[[Any, Any], Any], int, Callable[[Any, Any, Any], Any]] = (
    -1, 0, lambda table, ids: None, 0, lambda table, ids, out: None)
#: The backend chosen per (requested backend, FASTEMBED_BACKEND, table type), or per (requested backend,
#: FASTEMBED_BACKEND, data type, format) for a QuantizedTable.
_selected: dict[tuple[Any, ...], Backend] = {}
read_environment()


def requested_choice(backend: str, environment: str | None = None) -> str:
    """Resolve ``auto`` through FASTEMBED_BACKEND (`environment`: its value as read; None: now), and reject unknown names."""
    if backend == AUTO:
        backend = _environment_choice if environment is None else environment
        source = f"{ENVIRONMENT_VARIABLE}={backend!r}"
    else:
        source = f"backend={backend!r}"
    if backend != AUTO and backend not in BACKENDS:
        raise ValueError(f"unknown backend in {source}; known backends: {', '.join([AUTO, *BACKENDS])}")
    return backend


def reasons_against(backend: Backend, table: Any) -> list[str]:
    """Why `backend` cannot serve a call on `table` (a snapshot): the machine first, then its declared capabilities."""
    unavailable = backend.unavailable_reasons()
    if unavailable:
        return unavailable
    rows = validate.storage(table)
    library = adapter_of(rows).name  # type: ignore[union-attr]  # a snapshot's rows always have an adapter
    kind = table.format.name if type(table) is QuantizedTable else base.DENSE
    return base.not_supported_reasons(backend, library, device_of(rows), kind)


def available_backends() -> tuple[Backend, ...]:
    """The backends that can run on this machine, in priority order (cached)."""
    global _available
    if _available is not None:
        return _available
    seen = generation
    available = tuple(backend for backend in tuple(BACKENDS.values()) if not backend.unavailable_reasons())
    if generation == seen:  # else the choices were forgotten meanwhile: this answer may be stale
        _available = available
    return available


_available: tuple[Backend, ...] | None = None


def refresh() -> None:
    """Forget every cached answer and re-read FASTEMBED_BACKEND (after installing cupy, say).

    Resets every backend's own state too (:meth:`Backend.reset`).
    """
    _forget_choices()
    for backend in tuple(BACKENDS.values()):
        backend.reset()
    read_environment()  # last: its new generation retires any answer remembered while the backends reset


def _forget_choices() -> None:
    """Forget the backends chosen so far: the next call of each kind chooses again."""
    global _available, generation
    _available = None
    _selected.clear()
    generation += 1


base.on_availability_change(_forget_choices)


def small_gather_for_ndarray(table: Any) -> tuple[int, int, Callable[[Any, Any], Any], int, Callable[[Any, Any, Any], Any]]:
    """The small gathers of the backend ``"auto"`` picks for a table whose snapshot is a numpy array (`table`).

    The lookup API keeps calling the answer, :data:`ndarray_small_gather`,
    directly for outputs below its size while :data:`generation` is the one it
    holds for: every numpy snapshot gets the same backend, and a decode
    step then skips the dispatch and backend layers (each costs microseconds
    with cold caches). The answer is read once per generation: a backend's
    size that changes meanwhile (``numba_backend.SERIAL_MIN_BYTES`` set at
    run time) reaches the API with the next generation. For a backend that is
    no :class:`~fastembed.backends.base.SmallGatherBackend`, the small gathers
    are its ``gather`` itself, at every size.

    Returns:
        ``(generation, below_bytes, gather_new, calling_thread_below_bytes, gather_into)``
        (:class:`~fastembed.backends.base.SmallGather`).

    Raises:
        BackendUnavailableError: as :func:`select` (FASTEMBED_BACKEND names a
            backend that cannot serve host tables).
        ValueError: as :func:`select` (FASTEMBED_BACKEND names no registered backend).
    """
    global ndarray_small_gather
    seen = generation  # read before choosing: a refresh meanwhile makes the next call choose again
    chosen = select(table, AUTO)
    if isinstance(chosen, base.SmallGatherBackend):
        small = chosen.small_gather()
    else:
        small = base.SmallGather(sys.maxsize, lambda table, ids: chosen.gather(table, ids, None), sys.maxsize)
    ndarray_small_gather = (seen, small.below_bytes, small.gather_new, small.calling_thread_below_bytes,
                            chosen.gather if small.gather_into is None else small.gather_into)
    return ndarray_small_gather


def placing_backend(table: Any) -> base.PlacingBackend:
    """The backend that places rows of `table` (a host numpy snapshot) into chosen output rows.

    ``"auto"``'s choice for the table where it is a
    :class:`~fastembed.backends.base.PlacingBackend`, else the numpy backend.

    Raises:
        BackendUnavailableError, ValueError: as :func:`select`.
    """
    chosen = select(table, AUTO)
    return chosen if isinstance(chosen, base.PlacingBackend) else numpy_backend.BACKEND


def select(table: Any, backend: str = AUTO) -> Backend:
    """The backend that serves a call on `table` (a snapshot); raises if a named one cannot.

    Support depends only on the table's array library and device kind, which
    its type decides, and its format, so the answer is remembered per
    requested backend, FASTEMBED_BACKEND, table type and format: one dict
    lookup per call. FASTEMBED_BACKEND is part of the key, so a choice made
    while another thread re-reads it is never used under the new value.

    Raises:
        TypeError: a `backend` that is not a string.
        ValueError: an unknown backend name (in `backend` or FASTEMBED_BACKEND).
        BackendUnavailableError: a named backend cannot serve `table`.
    """
    kind = type(table)
    environment = _environment_choice
    key = (backend, environment, kind) if kind is not QuantizedTable else (
        backend, environment, type(table.data), table.format.name)
    if not isinstance(backend, str):  # before the dict: b"numba" hashes as "numba", and -bb makes comparing them raise
        raise TypeError(
            f"backend must be a string, one of {', '.join([AUTO, *BACKENDS])}; got {type(backend).__name__}")
    remembered = _selected.get(key)
    if remembered is not None:
        return remembered
    seen = generation
    chosen = _choose(table, backend, environment)
    if generation == seen:  # else the choices were forgotten meanwhile: this one may be stale
        _selected[key] = chosen
    return chosen


def _choose(table: Any, backend: str, environment: str) -> Backend:
    choice = requested_choice(backend, environment)
    if choice != AUTO:
        named = BACKENDS.get(choice)
        if named is None:  # unregistered since requested_choice() checked the name
            raise ValueError(f"unknown backend {choice!r}; known backends: {', '.join([AUTO, *BACKENDS])}")
        reasons = reasons_against(named, table)
        if reasons:
            raise BackendUnavailableError(f"backend {choice!r} cannot serve this lookup: {'; '.join(reasons)}")
        return named
    for candidate in available_backends():
        if not reasons_against(candidate, table):
            return candidate
    raise BackendUnavailableError(
        "no backend can serve this lookup: "
        + "; ".join(f"{name}: {', '.join(reasons_against(b, table))}" for name, b in tuple(BACKENDS.items()))
    )


def explain(table: Any, backend: str = AUTO) -> Selection:
    """Which backend `select` picks for `table` (a snapshot), with the reasons every other one was skipped."""
    environment = _environment_choice  # read once: the choice and its reasons come from one value
    select(table, backend)  # raises what a lookup would: a backend argument that is no string, one that cannot serve
    chosen = _choose(table, backend, environment).name
    if requested_choice(backend, environment) != AUTO:
        named_by = f"backend={backend!r}" if backend != AUTO else f"{ENVIRONMENT_VARIABLE}={environment!r}"
        return Selection(chosen, {name: [f"not requested ({named_by})"] for name in tuple(BACKENDS) if name != chosen})
    skipped = {}
    for name, candidate in tuple(BACKENDS.items()):
        if name != chosen:
            skipped[name] = reasons_against(candidate, table) or [f"{chosen} has priority"]
    return Selection(chosen, skipped)
