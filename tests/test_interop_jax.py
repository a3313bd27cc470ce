"""JAX CPU arrays in and out of lookup and Embedding, zero-copy (fastembed/arrays/jax_adapter.py, docs/interop.md)."""
from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (CI installs its CPU build: .ci/run)")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import fastembed  # noqa: E402
from fastembed import validate  # noqa: E402
from fastembed.arrays import jax_adapter  # noqa: E402
from helpers import CPU_BACKENDS, poisoned  # noqa: E402

VOCAB, DIM = 97, 24
TABLE_DTYPES = ["float16", "float32", "bfloat16", "float8_e4m3fn", "int8"]
IDS = [5, 96, 0, 41, 41, 17]


def numpy_table(dtype: str, seed: int = 0) -> np.ndarray:
    """Random values, never all zeros, in `dtype` (a numpy or ml_dtypes name)."""
    rng = np.random.default_rng(seed)
    if dtype == "int8":
        return rng.integers(-128, 128, (VOCAB, DIM), dtype=np.int8)
    values = rng.standard_normal((VOCAB, DIM), dtype=np.float32) + 0.5
    return values.astype(np.dtype(getattr(ml_dtypes, dtype, dtype)))


def jax_table(dtype: str, seed: int = 0) -> jax.Array:
    return jnp.asarray(numpy_table(dtype, seed))


def as_bits(array) -> np.ndarray:
    """The bytes of a host array (numpy or JAX), for bit-exact comparison."""
    host = np.asarray(array)
    return np.ascontiguousarray(host).view(np.uint8)


def assert_jax_bit_equal(actual, expected: np.ndarray) -> None:
    assert isinstance(actual, jax.Array), type(actual)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, actual.shape)
    np.testing.assert_array_equal(as_bits(actual), as_bits(expected))


def address(array) -> int:
    """Where an array's data starts: a numpy array's data pointer, or a JAX array's buffer."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    return int(array.unsafe_buffer_pointer())


def aligned_empty(shape: tuple[int, ...], dtype, alignment: int = jax_adapter.JAX_HOST_ALIGNMENT) -> np.ndarray:
    """A numpy array whose data starts at a multiple of `alignment` bytes."""
    from fastembed.backends.output_cache import aligned_empty

    return aligned_empty(shape, np.dtype(dtype), alignment)


@pytest.mark.parametrize("dtype", TABLE_DTYPES)
@pytest.mark.parametrize("ids_kind", ["numpy", "jax"])
@pytest.mark.parametrize("ids_dtype", ["int32", "int64", "int16"])
@pytest.mark.parametrize("ids_shape", [(6,), (2, 3), (3, 1, 2)])
def test_jax_table_gathers_bit_exact(backend, dtype, ids_kind, ids_dtype, ids_shape):
    host = numpy_table(dtype)
    table = jnp.asarray(host)
    host_ids = np.array(IDS, dtype=ids_dtype).reshape(ids_shape)
    with jax.enable_x64(ids_dtype == "int64"):  # JAX keeps int64 only with x64 enabled
        ids = host_ids if ids_kind == "numpy" else jnp.asarray(host_ids)
        assert ids.dtype == host_ids.dtype
        result = fastembed.lookup(table, ids, backend=backend)
    assert_jax_bit_equal(result, host[host_ids])


@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_embedding_over_a_jax_table(backend, dtype):
    host = numpy_table(dtype)
    table = jnp.asarray(host)
    emb = fastembed.Embedding(table)
    assert emb.table is table
    assert (emb.vocab_size, emb.dim, emb.device) == (VOCAB, DIM, "cpu")
    assert emb.dtype == host.dtype
    ids = jnp.array([[3, 1], [96, 3]], dtype=jnp.int32)
    assert_jax_bit_equal(emb(ids, backend=backend), host[np.asarray(ids)])
    out = poisoned((2, 2, DIM), host.dtype)
    assert emb(ids, out=out, backend=backend) is out  # a numpy out is written in place and returned
    np.testing.assert_array_equal(as_bits(out), as_bits(host[np.asarray(ids)]))


def test_from_pretrained_takes_a_jax_array(backend):
    host = numpy_table("bfloat16")
    emb = fastembed.Embedding.from_pretrained(jnp.asarray(host))
    assert emb.dtype == ml_dtypes.bfloat16
    assert_jax_bit_equal(emb([4, 2], backend=backend), host[[4, 2]])


@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_snapshots_are_read_only_views_of_the_jax_buffer(dtype):
    table = jax_table(dtype)
    view = validate.table_snapshot(table)
    assert type(view) is np.ndarray and view.shape == (VOCAB, DIM) and view.dtype == np.dtype(table.dtype)
    assert address(view) == address(table)
    assert not view.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 0
    ids = jnp.array([[1, 2], [3, 4]], dtype=jnp.int32)
    ids_view = validate.ids_snapshot(ids, view)  # ids are read into the call's own copy, as numpy ids are
    assert address(ids_view) != address(ids) and (ids_view == np.asarray(ids)).all()


def test_embedding_keeps_reading_the_buffer_after_the_jax_table_is_deleted(backend):
    """The numpy view holds a DLPack reference: JAX frees the buffer only once the layer lets go."""
    host = numpy_table("float32")
    table = jnp.array(host)  # a buffer of JAX's own, not an alias of `host`
    emb = fastembed.Embedding(table)
    table.delete()
    np.testing.assert_array_equal(np.asarray(emb([1, 2], backend=backend)), host[[1, 2]])


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16", "float8_e5m2"])
def test_results_share_an_aligned_buffer(dtype):
    """JAX aliases host memory aligned to JAX_HOST_ALIGNMENT bytes (and copies otherwise, still exactly)."""
    result = aligned_empty((6, DIM), np.dtype(getattr(ml_dtypes, dtype, dtype)))
    result[...] = numpy_table(dtype)[:6]
    wrapped = jax_adapter.ADAPTER.wrap(result)
    assert address(wrapped) == address(result)
    assert_jax_bit_equal(wrapped, result)
    assert wrapped.devices() == {jax.devices("cpu")[0]} and not wrapped.committed
    unaligned = aligned_empty((6 * DIM + 8,), result.dtype)[8:].reshape(6, DIM)  # 8 or 16 bytes past a boundary
    unaligned[...] = result
    assert_jax_bit_equal(jax_adapter.ADAPTER.wrap(unaligned), result)


def test_numpy_table_with_jax_ids_returns_numpy(backend):
    table = numpy_table("float32")
    ids = jnp.array([[4, 0], [2, 96]], dtype=jnp.int32)
    result = fastembed.lookup(table, ids, backend=backend)
    assert type(result) is np.ndarray
    np.testing.assert_array_equal(result, table[np.asarray(ids)])
    assert type(fastembed.Embedding(table)(jnp.array([1], dtype=jnp.int16))) is np.ndarray


def test_jax_table_with_numpy_ids_returns_jax(backend):
    host = numpy_table("float16")
    result = fastembed.lookup(jnp.asarray(host), np.array([9, 8], np.int64), backend=backend)
    assert_jax_bit_equal(result, host[[9, 8]])


def test_numpy_out_with_jax_table_and_ids_is_written_and_returned(backend):
    host = numpy_table("bfloat16")
    out = np.zeros((2, DIM), ml_dtypes.bfloat16)
    assert fastembed.lookup(jnp.asarray(host), jnp.array([9, 8]), out=out, backend=backend) is out
    np.testing.assert_array_equal(as_bits(out), as_bits(host[[9, 8]]))


@pytest.mark.parametrize("ids", [np.array([3, 0], np.int64), np.array([3, 0], np.int32)[::1], [3, 0]])
def test_numpy_ids_and_numpy_out_with_a_jax_table(backend, ids):
    """A numpy out and numpy ids take validation's fast path, which must not ask a JAX table for numpy flags."""
    host = numpy_table("float32")
    out = poisoned((2, DIM), np.float32)
    assert fastembed.lookup(jnp.asarray(host), ids, out=out, backend=backend) is out
    np.testing.assert_array_equal(out, host[[3, 0]])


def test_a_numpy_view_of_a_jax_table_is_refused_as_out():
    table = jax_table("float32")
    with pytest.raises(ValueError, match="read-only"):
        fastembed.lookup(table, [1], out=np.asarray(table)[:1])


@pytest.mark.parametrize("table_kind", ["numpy", "jax"])
def test_jax_out_is_refused_as_immutable(table_kind):
    host = numpy_table("float32")
    table = host if table_kind == "numpy" else jnp.asarray(host)
    out = jnp.zeros((2, DIM), jnp.float32)
    with pytest.raises(TypeError, match=r"out is a jax array, and jax arrays are immutable.*numpy out"):
        fastembed.lookup(table, [1, 2], out=out)
    with pytest.raises(TypeError, match="immutable"):
        fastembed.Embedding(table)([1, 2], out=out)
    assert not np.asarray(out).any()


@pytest.mark.parametrize("ids_dtype", ["int32", "int64", "int16"])
def test_bad_jax_ids_raise_index_error_with_position_and_value(backend, ids_dtype):
    table = jax_table("float16")
    out = np.full((2, 2, DIM), 7, np.float16)
    with jax.enable_x64(ids_dtype == "int64"):
        ids = jnp.array([[1, 2], [VOCAB, 3]], dtype=ids_dtype)
        with pytest.raises(IndexError, match=rf"id {VOCAB} at position \(1, 0\) is out of range"):
            fastembed.lookup(table, ids, out=out, backend=backend)
        with pytest.raises(IndexError, match=r"id -1 at position 1 is out of range"):
            fastembed.lookup(table, jnp.array([0, -1], dtype=ids_dtype), backend=backend)
    assert (out == 7).all()  # untouched on a host error


def test_non_integer_jax_ids_are_refused():
    table = jax_table("float32")
    with pytest.raises(TypeError, match="ids must be integers, got floating"):
        fastembed.lookup(table, jnp.array([1.0]))
    with pytest.raises(TypeError, match="ids must be integers, got bool"):
        fastembed.lookup(table, jnp.array([True]))


def test_scalar_and_empty_ids():
    host = numpy_table("bfloat16")
    table = jnp.asarray(host)
    assert_jax_bit_equal(fastembed.lookup(table, jnp.array(4)), host[4])
    for ids in (jnp.zeros((0,), jnp.int32), jnp.zeros((2, 0), jnp.int32), []):
        empty = fastembed.lookup(table, ids)
        assert isinstance(empty, jax.Array) and empty.shape == np.shape(ids) + (DIM,) and empty.dtype == host.dtype


def test_traced_values_are_refused_with_a_way_out():
    table = jax_table("float32")
    with pytest.raises(TypeError, match=r"traced JAX value.*jnp.take"):
        jax.jit(lambda t: fastembed.lookup(t, [1]))(table)
    with pytest.raises(TypeError, match=r"traced JAX value"):
        jax.jit(lambda ids: fastembed.lookup(np.ones((4, 2), np.float32), ids))(jnp.array([1]))


@pytest.mark.parametrize("dtype", ["int4", "uint4", "float4_e2m1fn", "int2"])
def test_packed_sub_byte_dtypes_are_refused_before_any_copy(dtype):
    import tracemalloc

    table = jnp.ones((4096, 1024), getattr(jnp, dtype))  # 4 Mi values: 4 MiB unpacked by numpy
    table.block_until_ready()
    tracemalloc.start()
    try:
        with pytest.raises(TypeError, match=f"JAX dtype {dtype} packs .*-bit values"):
            fastembed.lookup(table, [1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


@pytest.mark.parametrize("dtype", ["int64", "float64", "uint64", "complex128"])
def test_64_bit_results_keep_their_dtype_and_memory_with_jax_64_bit_mode_off(dtype):
    assert not jax.config.jax_enable_x64
    host = (np.arange(40).reshape(10, 4) * (2**40 + 0.1)).astype(dtype)
    with jax.enable_x64(True):
        table = jnp.asarray(host)
    result = fastembed.lookup(table, [9, 0, 3])
    assert_jax_bit_equal(result, host[[9, 0, 3]])
    assert not jax.config.jax_enable_x64  # the caller's setting is left as it was


def test_a_float64_result_of_a_float32_jax_table_is_float64_and_shared(monkeypatch):
    table = jax_table("float32")
    seen = []
    put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda array, *args, **kwargs: seen.append(array) or put(array, *args, **kwargs))
    result = fastembed.lookup(table, IDS, dtype=np.float64)
    assert_jax_bit_equal(result, numpy_table("float32")[IDS].astype(np.float64))
    assert address(result) == address(seen[-1])


def test_a_jax_table_deleted_while_its_view_is_taken_is_a_type_error(monkeypatch):
    table = jax_table("bfloat16")  # read through JAX's host view: DLPack has no bfloat16
    device = table.devices().pop()
    table.delete()
    monkeypatch.setattr(jax_adapter, "_single_device", lambda array: device)  # deleted after the check
    with pytest.raises(TypeError, match="the JAX array cannot be seen as a numpy array"):
        fastembed.lookup(table, [1])


def test_deleted_jax_arrays_are_refused():
    table = jax_table("float32")
    table.delete()
    with pytest.raises(TypeError, match="has been deleted"):
        fastembed.lookup(table, [1])


def test_dispatch_picks_a_cpu_backend_for_jax_inputs():
    table = jax_table("float16")
    assert fastembed.select_backend(table, jnp.array([1, 2])).backend == CPU_BACKENDS[0]
    assert fastembed.select_backend(table, [1], backend="numpy").backend == "numpy"


def fake_jax_array(platform: str = "gpu", index: int = 1):
    """Something jax_adapter takes for a JAX array on an accelerator (there is none here)."""
    fake = types.new_class("ArrayImpl")
    fake.__module__ = "jaxlib._jax"
    fake.__dlpack__ = lambda self: None
    device = types.SimpleNamespace(platform=platform, id=index, local_hardware_id=index)
    fake.devices = lambda self: [device]
    fake.is_deleted = lambda self: False
    return fake()


def test_jax_gpu_arrays_are_refused_naming_where_they_live_and_how_to_move():
    host = numpy_table("float32")
    assert jax_adapter.ADAPTER.device(fake_jax_array("gpu", 1)) == "cuda:1"
    assert jax_adapter.ADAPTER.device(fake_jax_array("tpu", 2)) == "tpu:2"
    with pytest.raises(TypeError, match=r"JAX arrays on cuda:1 are not supported.*cupy.from_dlpack\(array\)"):
        fastembed.lookup(fake_jax_array(), [1])
    with pytest.raises(TypeError, match=r"JAX arrays on tpu:2 are not supported"):
        fastembed.Embedding(fake_jax_array("tpu", 2))
    with pytest.raises(TypeError, match="ids live on cuda:1 but the table lives on cpu"):
        fastembed.lookup(host, fake_jax_array())
    with pytest.raises(TypeError, match="ids live on cuda:1 but the table lives on cpu"):
        fastembed.lookup(jnp.asarray(host), fake_jax_array())


def test_jax_objects_that_are_not_arrays_are_not_arrays():
    with pytest.raises(TypeError, match=r"or a JAX CPU array, or another library.s host array exporting DLPack .*; got"):
        fastembed.lookup(jax.devices("cpu")[0], [0])
    with pytest.raises(TypeError, match=r"or a JAX CPU array, or another library.s host array exporting DLPack .*; got"):
        fastembed.lookup(jnp.float32, [0])


def test_sharded_jax_arrays_are_refused():
    """In a fresh interpreter with two host devices: an array over both has no one buffer to view."""
    refusal, kind, ids_refusal = _printed_with_host_devices(2, (
        "import jax, numpy as np, fastembed\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec\n"
        "mesh = Mesh(np.array(jax.devices('cpu')), ('x',))\n"
        "table = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, PartitionSpec('x')))\n"
        "try:\n"
        "    fastembed.lookup(table, [1])\n"
        "except TypeError as error:\n"
        "    print(error)\n"
        "one = jax.device_put(np.ones((8, 4), np.float32), jax.devices('cpu')[1])\n"
        "print(type(fastembed.lookup(one, [1])).__name__)\n"
        "try:\n"
        "    fastembed.lookup(np.ones((8, 4), np.float32), jax.device_put(np.arange(2), table.sharding))\n"
        "except TypeError as error:\n"
        "    print(error)\n"
    ))
    assert "sharded or replicated over 2 devices" in refusal
    assert kind == "ArrayImpl"
    assert ids_refusal.startswith("ids: the JAX array is sharded or replicated over 2 devices")


def test_import_fastembed_does_not_import_jax():
    code = (
        "import sys, numpy as np, fastembed\n"
        "fastembed.lookup(np.ones((4, 3), np.float32), [1, 2])\n"
        "fastembed.Embedding(np.ones((4, 3), np.float32))(np.array([0]), out=np.empty((1, 3), np.float32))\n"
        "assert 'jax' not in sys.modules and 'jaxlib' not in sys.modules, 'jax was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("how", ["lookup", "embedding", "dtype="])
def test_results_of_a_jax_table_are_never_copied(monkeypatch, dtype, how):
    """fastembed allocates a JAX table's result at JAX's alignment, so wrapping it shares the buffer."""
    import fastembed.api

    buffers = []

    def recorded(table, shape, dtype):
        buffer = fastembed.arrays.aligned_result(table, shape, dtype)
        buffers.append(buffer)
        return buffer

    monkeypatch.setattr(fastembed.api, "aligned_result", recorded)
    table = jax_table(dtype)
    ids = np.random.default_rng(1).integers(0, VOCAB, (50, 3))
    if how == "lookup":
        result = fastembed.lookup(table, ids)
    elif how == "embedding":
        result = fastembed.Embedding(table)(ids)
    else:
        result = fastembed.lookup(table, ids, dtype="float32")
    assert isinstance(result, jax.Array) and len(buffers) == 1
    assert address(result) == address(buffers[0])
    expected = numpy_table(dtype)[ids]
    assert_jax_bit_equal(result, expected.astype(np.float32) if how == "dtype=" else expected)


def test_large_results_of_a_jax_table_come_from_the_output_cache():
    from fastembed.backends import output_cache

    table = jnp.asarray(numpy_table("float32"))
    ids = np.random.default_rng(2).integers(0, VOCAB, 60000)  # 5.8 MB of float32: above the cache's minimum
    first = fastembed.lookup(table, ids)
    where = address(first)
    assert where % jax_adapter.JAX_HOST_ALIGNMENT == 0
    del first
    second = fastembed.lookup(table, ids)
    assert address(second) == where  # the first result's buffer, returned when JAX let it go
    assert_jax_bit_equal(second, numpy_table("float32")[ids])
    output_cache.empty()


def test_a_quantized_jax_table_keeps_jax_arrays_and_results():
    host = np.random.default_rng(5).standard_normal((50, 64)).astype(np.float32)
    quantized = fastembed.Embedding(jnp.asarray(host)).quantize("fp8_e4m3")
    assert type(quantized.table.data).__module__.startswith("jax")
    result = quantized([3, 1])
    assert type(result).__module__.startswith("jax")
    expected = fastembed.Embedding(host).quantize("fp8_e4m3")([3, 1])
    np.testing.assert_array_equal(np.asarray(result).view(np.uint32), expected.view(np.uint32))


def test_a_quantized_jax_table_is_a_table_of_its_own_not_a_cached_output():
    """A new table is kept for long: from the output cache it could take a buffer twice its size, and would go
    back to the cache, not to the system, when dropped."""
    import gc

    from fastembed.backends import output_cache

    host = np.random.default_rng(6).standard_normal((2048, 4096)).astype(np.float32)  # q8_0: 8.5 MiB of rows
    output_cache.empty()
    kept = fastembed.lookup(jnp.asarray(host), np.arange(640))  # 10 MiB, dropped below: a buffer the table would fit
    del kept
    gc.collect()
    cached = output_cache.cached_bytes()
    quantized = fastembed.Embedding(jnp.asarray(host)).quantize("q8_0")
    data = np.asarray(quantized.table.data)
    assert data.ctypes.data % jax_adapter.JAX_HOST_ALIGNMENT == 0
    assert output_cache.cached_bytes() == cached  # no buffer taken from the cache
    del quantized, data
    gc.collect()
    assert output_cache.cached_bytes() == cached  # and none given to it
    output_cache.empty()


def test_a_dtype_in_the_other_byte_order_is_refused_for_a_jax_table():
    table = jnp.ones((10, 4), jnp.float32)
    with pytest.raises(TypeError, match="a jax table gathers into its library's arrays, which have no dtype"):
        fastembed.lookup(table, [1], dtype=np.dtype(np.float32).newbyteorder())


def test_a_bfloat16_table_deleted_while_its_host_view_is_taken_is_a_type_error(monkeypatch):
    """Another thread's delete() may land between JAX's numpy view and the check of its address."""
    table = jnp.ones((8, 4), jnp.bfloat16)
    real_asarray = np.asarray

    def view_then_delete(array, *args, **kwargs):
        view = real_asarray(array, *args, **kwargs)
        if array is table:
            table.delete()
        return view

    monkeypatch.setattr(jax_adapter.np, "asarray", view_then_delete)
    with pytest.raises(TypeError, match="cannot be seen as a numpy array"):
        fastembed.lookup(table, [1])


def test_a_result_goes_to_jaxs_default_host_device_as_a_fresh_array_does():
    """In a fresh interpreter with four host devices, inside jax.default_device(cpu:2)."""
    assert _printed_with_host_devices(4, (
        "import jax, jax.numpy as jnp, numpy as np, fastembed\n"
        "third = jax.devices('cpu')[2]\n"
        "table = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), third)\n"
        "with jax.default_device(third):\n"
        "    print(fastembed.lookup(table, [1]).devices() == jnp.zeros(1).devices() == {third})\n"
        "print(fastembed.lookup(table, [1]).devices() == {jax.devices('cpu')[0]})\n"
    )) == ["True", "True"]


def _printed_with_host_devices(count: int, code: str) -> list[str]:
    """The lines `code` prints in a fresh interpreter whose JAX has `count` host devices."""
    flags = f"import os; os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count={count}'\n"
    result = subprocess.run([sys.executable, "-c", flags + code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()
