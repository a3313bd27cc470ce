"""Shared fixtures: random tables (never zeros), poisoned outputs, the CPU backends."""
from __future__ import annotations

import numpy as np
import pytest

import fastembed

REFERENCE_IDS = [5237, 23872, 301, 16652, 19602, 1148]
CPU_BACKENDS = [status.name for status in fastembed.backends() if status.available and status.name != "cuda"]
POISON_BYTE = 0xA5


def random_table(vocab_size: int, dim: int, dtype="float16", seed: int = 0) -> np.ndarray:
    return fastembed.Embedding.random(vocab_size, dim, dtype, seed).table


def poisoned(shape, dtype) -> np.ndarray:
    """An output buffer whose bytes are garbage, so an unwritten row cannot pass."""
    out = np.empty(shape, dtype=dtype)
    out.view(np.uint8).reshape(-1)[:] = POISON_BYTE
    return out


def assert_bit_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(actual.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))


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
