"""The backend registry and the choice of backend for a call.

Backends are tried in priority order (cuda, numba, numpy); ``auto`` takes the
first that is available on this machine and supports the call. Data stays
where it lives: a cupy table goes to cuda, a numpy table never moves to a
GPU by itself. A backend chosen by name (argument, or the FASTEMBED_BACKEND
environment variable, read at import, in place of ``auto``) is used or refused with its
reasons; it never falls back silently.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .backends import cuda_backend, numba_backend, numpy_backend

#: Priority order for ``auto``.
BACKENDS: dict[str, ModuleType] = {module.NAME: module for module in (cuda_backend, numba_backend, numpy_backend)}
ENVIRONMENT_VARIABLE = "FASTEMBED_BACKEND"
AUTO = "auto"


class BackendUnavailableError(RuntimeError):
    """A backend chosen by name cannot serve the call; the message says why."""


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run on this machine, and if not, why."""

    name: str
    available: bool
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Selection:
    """The backend a call would use, and why each other backend was skipped."""

    backend: str
    skipped: dict[str, list[str]]

    def __str__(self) -> str:
        lines = [f"selected: {self.backend}"]
        lines += [f"skipped {name}: {'; '.join(reasons)}" for name, reasons in self.skipped.items()]
        return "\n".join(lines)


def backend_statuses() -> list[BackendStatus]:
    statuses = []
    for name, module in BACKENDS.items():
        reasons = module.unavailable_reasons()
        statuses.append(BackendStatus(name, not reasons, list(reasons)))
    return statuses


def read_environment() -> None:
    """(Re)read FASTEMBED_BACKEND. Done once at import: a lookup does not pay
    for an environment read (about 1 us) on every call."""
    global _environment_choice
    _environment_choice = os.environ.get(ENVIRONMENT_VARIABLE) or AUTO


_environment_choice = AUTO
read_environment()


def requested_choice(backend: str) -> str:
    """Resolve ``auto`` through FASTEMBED_BACKEND, and reject unknown names."""
    if backend == AUTO:
        backend = _environment_choice
        source = f"{ENVIRONMENT_VARIABLE}={backend!r}"
    else:
        source = f"backend={backend!r}"
    if backend != AUTO and backend not in BACKENDS:
        raise ValueError(f"unknown backend in {source}; known backends: {', '.join([AUTO, *BACKENDS])}")
    return backend


def reasons_against(module: ModuleType, table: Any, ids: Any, out: Any) -> list[str]:
    return module.unavailable_reasons() or module.not_supported_reasons(table, ids, out)


def available_backends() -> tuple[ModuleType, ...]:
    """The backends that can run on this machine, in priority order (cached)."""
    global _available
    if _available is None:
        _available = tuple(module for module in BACKENDS.values() if not module.unavailable_reasons())
    return _available


_available: tuple[ModuleType, ...] | None = None


def refresh() -> None:
    """Forget cached availability and re-read FASTEMBED_BACKEND (after installing cupy, say)."""
    global _available
    _available = None
    _selected.clear()
    for module in BACKENDS.values():
        cache_clear = getattr(module.unavailable_reasons, "cache_clear", None)
        if cache_clear:
            cache_clear()
    read_environment()


def select(table: Any, ids: Any, out: Any, backend: str = AUTO) -> ModuleType:
    """The backend module that serves this call; raises if a named one cannot."""
    key = (backend, _environment_choice, type(table))
    try:
        remembered = _selected.get(key)
    except TypeError:  # an unhashable backend argument (a list, say)
        raise TypeError(f"backend must be a string, one of {', '.join([AUTO, *BACKENDS])}; "
                        f"got {type(backend).__name__}") from None
    if remembered is not None:
        return remembered
    module = _choose(table, ids, out, backend)
    # Support depends only on the table's type (the backend contract), so the
    # answer is remembered per requested backend, FASTEMBED_BACKEND and table
    # type: one dict lookup per call. refresh() forgets it.
    _selected[key] = module
    return module


def _choose(table: Any, ids: Any, out: Any, backend: str) -> ModuleType:
    choice = requested_choice(backend)
    if choice != AUTO:
        module = BACKENDS[choice]
        reasons = reasons_against(module, table, ids, out)
        if reasons:
            raise BackendUnavailableError(f"backend {choice!r} cannot serve this lookup: {'; '.join(reasons)}")
        return module
    for module in available_backends():
        if not module.not_supported_reasons(table, ids, out):
            return module
    raise AssertionError("unreachable: the numpy backend serves every host table")


_selected: dict[tuple[str, str, type], ModuleType] = {}


def explain(table: Any, ids: Any, out: Any = None, backend: str = AUTO) -> Selection:
    """Which backend `select` picks, with the reasons every other one was skipped."""
    chosen = select(table, ids, out, backend).NAME
    skipped = {}
    for name, module in BACKENDS.items():
        if name != chosen:
            skipped[name] = reasons_against(module, table, ids, out) or [f"{chosen} has priority"]
    return Selection(chosen, skipped)
