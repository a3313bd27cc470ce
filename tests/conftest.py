"""Shared fixtures: the CPU backends, the full-size table, cupy or its test double (helpers: tests/helpers.py)."""
from __future__ import annotations

import numpy as np
import pytest

import fastembed
from helpers import CPU_BACKENDS


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
