"""The cuda backend on a real GPU (skipped, with the reason, where there is none)."""
from __future__ import annotations

import numpy as np
import pytest

import fastembed
from fastembed.backends import cuda_backend
from conftest import random_table

pytestmark = pytest.mark.gpu
if cuda_backend.unavailable_reasons():
    pytest.skip(f"no usable GPU: {'; '.join(cuda_backend.unavailable_reasons())}", allow_module_level=True)

import cupy  # noqa: E402  (only reached with a GPU)


@pytest.mark.parametrize("width", [4096, 4095, 8, 1])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", ["float16", "float32", "int8", "float64"])
def test_gpu_lookup_matches_numpy(width, id_dtype, dtype):
    host = random_table(1000, width, dtype, seed=width)
    emb = fastembed.Embedding(host).to_device()
    assert emb.device == "cuda:0"
    ids = np.random.default_rng(width).integers(0, 1000, (7, 9)).astype(id_dtype)
    for given_ids in (ids, cupy.asarray(ids)):
        result = emb(given_ids)
        assert isinstance(result, cupy.ndarray) and result.shape == (7, 9, width)
        np.testing.assert_array_equal(cupy.asnumpy(result).view(np.uint8), host[ids].view(np.uint8))
    out = cupy.full((7, 9, width), 0xA5, dtype=cupy.uint8).view(emb.dtype) if emb.dtype.itemsize == 1 else cupy.empty((7, 9, width), emb.dtype)
    assert emb(cupy.asarray(ids), out=out) is out
    np.testing.assert_array_equal(cupy.asnumpy(out).view(np.uint8), host[ids].view(np.uint8))


def test_gpu_bad_ids_raise_and_the_context_survives():
    host = random_table(100, 64)
    table = fastembed.Embedding(host).to_device().table
    with pytest.raises(IndexError, match="id 100 at position 2"):
        fastembed.lookup(table, cupy.asarray([1, 2, 100, -5]))
    np.testing.assert_array_equal(cupy.asnumpy(fastembed.lookup(table, cupy.asarray([5, 6]))), host[[5, 6]])


def test_gpu_deferred_checks():
    host = random_table(100, 64)
    table = fastembed.Embedding(host).to_device().table
    with fastembed.deferred_id_checks():
        result = fastembed.lookup(table, cupy.asarray([1, 100, 3]))
    assert not cupy.asnumpy(result[1]).any()
    with pytest.raises(IndexError, match="position 1"):
        fastembed.raise_deferred_id_errors(0)
    fastembed.raise_deferred_id_errors(0)  # cleared


def test_gpu_empty_and_large_batches():
    host = random_table(5000, 256)
    table = fastembed.Embedding(host).to_device().table
    assert fastembed.lookup(table, cupy.asarray([], dtype=cupy.int64)).shape == (0, 256)
    ids = np.random.default_rng(0).integers(0, 5000, 200_000)
    np.testing.assert_array_equal(cupy.asnumpy(fastembed.lookup(table, ids)), host[ids])


def test_host_table_never_moves_to_the_gpu_implicitly():
    host = random_table(10, 8)
    assert fastembed.select_backend(host, [1]).backend != "cuda"
    with pytest.raises(TypeError, match="ids live on cuda:0 but the table lives on cpu"):
        fastembed.lookup(host, cupy.asarray([1]))
