"""The runnable examples in the public API's docstrings run, and every public name has a docstring."""
from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

import fastembed

MODULES = ["fastembed", "fastembed.api", "fastembed.dispatch", "fastembed.validate", "fastembed.io",
           "fastembed.io.checkpoints", "fastembed.io.gguf", "fastembed.io.npy", "fastembed.io.safetensors",
           "fastembed.io.save", "fastembed.io.watch", "fastembed.formats", "fastembed.tables", "fastembed.arrays",
           "fastembed.backends.base", "fastembed.backends.cpu_workers", "fastembed.backends.cuda_backend", "fastembed.torch", "fastembed.distributed",
           "fastembed.distributed.shards", "fastembed.io._files"]  # examples of private helpers too
#: Modules that import torch: their examples run where it is installed.
NEED_TORCH = ("fastembed.torch", "fastembed.distributed", "fastembed.distributed.shards")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    if name in NEED_TORCH:
        pytest.importorskip("torch")
    module = importlib.import_module(name)
    failures, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0
    if name in ("fastembed", "fastembed.api"):
        assert attempted >= 3, f"{name}: the public API's examples were not found"


@pytest.mark.parametrize("name", fastembed.__all__)
def test_public_names_are_documented(name):
    value = getattr(fastembed, name)
    if isinstance(value, str):
        return
    assert inspect.getdoc(value), f"fastembed.{name} has no docstring"


def _public_functions() -> list:
    """Every public function of the ``fastembed``, ``fastembed.io`` and ``fastembed.formats`` namespaces, and every
    public method of their classes (the layer's call included)."""
    import fastembed.formats
    import fastembed.io

    found = []
    for namespace in (fastembed, fastembed.io, fastembed.formats):
        found += _public_functions_of(namespace)
    return found


def _public_functions_of(namespace) -> list:
    found = []
    for name in namespace.__all__:
        value = getattr(namespace, name)
        if inspect.isfunction(value):
            found.append(value)
        elif inspect.isclass(value) and not issubclass(value, BaseException):
            for method, member in vars(value).items():
                public = not method.startswith("_") or method == "__call__"
                if public and (inspect.isfunction(member) or isinstance(member, (classmethod, staticmethod))):
                    found.append(getattr(value, method))
    return found


@pytest.mark.parametrize("function", [fastembed.Embedding, *_public_functions()], ids=lambda f: f.__qualname__)
def test_the_public_functions_carry_a_runnable_example(function):
    assert ">>>" in inspect.getdoc(function)


def test_the_torch_layer_carries_runnable_examples():
    torch_layer = pytest.importorskip("fastembed.torch").Embedding
    assert ">>>" in inspect.getdoc(torch_layer) and ">>>" in inspect.getdoc(torch_layer.forward)


@pytest.mark.parametrize("name", ["fastembed.formats", "fastembed.torch", "fastembed.distributed"])
def test_modules_with_public_names_beside_imported_ones_say_which_are_public(name):
    """``__all__`` names what the module defines, every function and class of it documented; nothing it imports."""
    if name in NEED_TORCH:
        pytest.importorskip("torch")
    module = importlib.import_module(name)
    defined = [public for public, value in vars(module).items() if not public.startswith("_")
               and (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == name]
    assert sorted(defined) == sorted(public for public in module.__all__ if not public.isupper())
    assert all(inspect.getdoc(getattr(module, public)) for public in defined)
