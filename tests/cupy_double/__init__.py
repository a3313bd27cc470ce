"""Choosing the cupy the GPU tests run against: the real one where it sees a device, else the double.

The double (``tests/cupy_double/cupy``) is loaded once per process and put
in ``sys.modules["cupy"]`` only for the duration of a test (:func:`gpu_cupy`),
with the dispatcher's and the cuda backend's caches cleared before and
after, so nothing outside those tests ever sees it. ``bench/gpu_check.sh``
dry runs put this folder first on PYTHONPATH instead: there ``import cupy``
is the double for the whole process, and :func:`gpu_cupy` takes it as real.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

FOLDER = Path(__file__).resolve().parent
_double: ModuleType | None = None
_MISSING = object()


def real_cupy() -> ModuleType | None:
    """The installed cupy when it imports and sees a CUDA device; else None."""
    existing = sys.modules.get("cupy")
    if existing is not None and existing is _double:
        return None
    if existing is None and importlib.util.find_spec("cupy") is None:
        return None
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # not importable, or no usable driver
        return None


def is_double(module: ModuleType) -> bool:
    return bool(getattr(module, "IS_FASTEMBED_DOUBLE", False))


def load_double() -> ModuleType:
    """The double as a module named ``cupy``, loaded once per process (not left in sys.modules)."""
    global _double
    if _double is None:
        saved = sys.modules.pop("cupy", _MISSING)
        sys.path.insert(0, str(FOLDER))
        try:
            _double = importlib.import_module("cupy")
        finally:
            sys.path.remove(str(FOLDER))
            if saved is _MISSING:
                sys.modules.pop("cupy", None)
            else:
                sys.modules["cupy"] = saved  # type: ignore[assignment]
    return _double


def _forget_cached_answers() -> None:
    from fastembed import dispatch
    from fastembed.backends import cuda_backend

    dispatch.refresh()
    cuda_backend.BACKEND.reset()


@contextlib.contextmanager
def gpu_cupy() -> Iterator[ModuleType]:
    """Real cupy with a device where there is one; otherwise the double, installed as ``cupy`` meanwhile."""
    real = real_cupy()
    if real is not None:
        _forget_cached_answers()
        try:
            yield real
        finally:
            _forget_cached_answers()
        return
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: the CuPy double builds its host emulation of the kernels with it")
    double = load_double()
    saved = sys.modules.get("cupy", _MISSING)
    sys.modules["cupy"] = double
    double._reset_double()
    _forget_cached_answers()
    try:
        yield double
    finally:
        if saved is _MISSING:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved  # type: ignore[assignment]
        _forget_cached_answers()
