"""Shared fixtures: the CPU backends, the full-size table, cupy or its test double (helpers: tests/helpers.py)."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest


def _kernels_cache_dir() -> str:
    """A numba cache folder of its own for these kernel sources.

    Numba stamps a cached kernel with the file that defines it only, so an edit of a module it calls
    (dequant_blocks.py, cpu_intrinsics.py) would leave the old machine code in use.
    """
    kernels = Path(__file__).resolve().parent.parent / "fastembed" / "kernels"
    digest = hashlib.sha256()
    for source in sorted(kernels.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return str(kernels.parent.parent / ".pytest_cache" / f"numba-{digest.hexdigest()[:16]}")


# Before numba is imported. The user's setting wins; otherwise each pytest-xdist worker gets a folder of its own
# (it inherits the main process's setting): two processes that add kernels to one cache at once can each number a
# new file the same, leaving its index naming the other's code.
_OURS = _kernels_cache_dir()
if os.environ.get("NUMBA_CACHE_DIR", _OURS).startswith(_OURS):
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(_OURS, os.environ.get("PYTEST_XDIST_WORKER", "main"))

import fastembed  # noqa: E402
from helpers import CPU_BACKENDS  # noqa: E402


@pytest.fixture(autouse=True)
def _dispatch_forgets_each_tests_choices():
    """After every test, once its patches are undone (autouse fixtures are torn down last), dispatch chooses anew: a
    test that moved a backend's sizes would otherwise leave its cached small gather to the tests after it."""
    yield
    fastembed.dispatch._forget_choices()


@pytest.fixture(autouse=True)
def _torch_draws_the_same_numbers_whatever_ran_before():
    """Tests draw torch's random tensors from its global generator: seeded for each test, a failure comes back
    when the test runs alone. torch is not imported for it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)


@pytest.fixture(params=CPU_BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def full_table() -> np.ndarray:
    """The default 129,280 x 4,096 float16 table (about 1 GiB), built once."""
    return fastembed.Embedding.random().table


@pytest.fixture
def cupy_or_double():
    """cupy for the CUDA tests: the real one where it sees a device, else the CuPy test double
    (tests/cupy_double), installed as ``cupy`` for this test only, every cache cleared before and after."""
    from cupy_double import gpu_cupy

    with gpu_cupy() as module:
        yield module
