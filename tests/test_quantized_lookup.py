"""Quantized tables through the public API: every CPU backend that declares a format, every output dtype, every error."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fastembed
from fastembed.dispatch import BACKENDS
from fastembed.formats import FORMATS, dequantize_rows
from helpers import CPU_BACKENDS, assert_bit_equal, poisoned, random_quantized

OUTPUT_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
DECLARED = [(backend, name) for backend in CPU_BACKENDS for name in FORMATS if name in BACKENDS[backend].capabilities.formats]


def reference(table, ids, dtype=np.float32):
    flat = np.asarray(ids).reshape(-1)
    scales = None if table.scales is None else table.scales[flat]
    rows = dequantize_rows(table.data[flat], scales, table.format, table.dim)
    return rows.astype(dtype).reshape(np.shape(ids) + (table.dim,))


@pytest.mark.parametrize(("backend", "name"), DECLARED)
@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=str)
def test_every_declared_format_gathers_the_reference_bit_for_bit(backend, name, dtype):
    table = random_quantized(name, 300, 512, seed=len(name))
    rng = np.random.default_rng(5)
    for ids in (rng.integers(0, 300, 40), rng.integers(0, 300, (3, 5)).astype(np.int32), np.array([299]), np.array([], np.int64)):
        assert_bit_equal(fastembed.lookup(table, ids, dtype=dtype, backend=backend), reference(table, ids, dtype))
        out = poisoned(ids.shape + (512,), dtype)
        assert fastembed.lookup(table, ids, out=out, dtype=dtype, backend=backend) is out
        assert_bit_equal(out, reference(table, ids, dtype))


@pytest.mark.parametrize(("backend", "name"), DECLARED)
def test_a_layers_allocating_lookups_are_the_reference_and_raise_as_lookup_does(backend, name):
    table = random_quantized(name, 300, 512, seed=len(name))
    emb = fastembed.Embedding(table)
    rng = np.random.default_rng(6)
    for ids in (rng.integers(0, 300, 40), rng.integers(0, 300, (3, 5)).astype(np.int32), np.array([299]),
                np.array([], np.int64), [7, 8], 5):
        for chosen in (backend, "auto"):
            result = emb(ids, backend=chosen)
            assert type(result) is np.ndarray
            assert_bit_equal(result, reference(table, ids))
            for dtype in (*OUTPUT_DTYPES, "float16", "bfloat16"):
                assert_bit_equal(emb(ids, backend=chosen, dtype=dtype), reference(table, ids, dtype))
    with pytest.raises(IndexError, match="id 300 at position 1 is out of range for a table of 300 rows"):
        emb([0, 300], backend=backend)
    with pytest.raises(IndexError, match="id 300 at position 1 is out of range for a table of 300 rows"):
        emb([0, 300], backend=backend, dtype=np.float16)
    with pytest.raises(TypeError, match="dequantizes into float32, float16, bfloat16, not int8"):
        emb([1], backend=backend, dtype=np.int8)
    with pytest.raises(TypeError, match="byte order"):
        emb([1], backend=backend, dtype=">f2")
    with pytest.raises(TypeError, match="ids must be integers"):  # the ids are checked first, as lookup() checks them
        emb([1.5], backend=backend, dtype=np.int8)
    with pytest.raises(IndexError, match="id -1 at position 0"):
        emb([-1, 2], backend=backend)
    with pytest.raises(TypeError, match="ids must be integers"):
        emb(np.array([1.0]), backend=backend)
    with pytest.raises(ValueError, match="backend"):
        emb([1], backend="fortran")


@pytest.mark.parametrize(("backend", "name"), DECLARED)
def test_an_out_of_range_id_leaves_out_untouched(backend, name):
    table = random_quantized(name, 50, 256)
    out = poisoned((3, 256), np.float32)
    before = out.copy()
    with pytest.raises(IndexError, match="id 50 at position 2 is out of range for a table of 50 rows"):
        fastembed.lookup(table, [0, 1, 50], out=out, backend=backend)
    assert_bit_equal(out, before)
    with pytest.raises(IndexError, match="id -1 at position 0"):
        fastembed.lookup(table, [-1], backend=backend)


def test_the_default_output_is_float32_and_auto_picks_a_backend_that_declares_the_format():
    emb = fastembed.Embedding(random_quantized("q4_k", 20, 256))
    assert emb.dtype == np.float32 and emb.format == "q4_k" and emb.dim == 256 and emb.vocab_size == 20
    assert emb.nbytes == 20 * 144
    assert "q4_k" in repr(emb)
    result = emb([[1, 2], [3, 4]])
    assert result.dtype == np.float32 and result.shape == (2, 2, 256)
    assert fastembed.dispatch.explain(emb.table).backend in {b for b, name in DECLARED if name == "q4_k"}


def test_an_embedding_keeps_its_own_view_of_a_quantized_table():
    table = random_quantized("q8_0", 20, 64)
    emb = fastembed.Embedding(table)
    expected = emb([3])
    table.data = np.zeros((1, 68), np.uint8)  # the caller rebinds its table's rows
    assert_bit_equal(emb([3]), expected)


@pytest.mark.parametrize("name", ["q8_0", "fp8_e4m3"])
def test_a_quantized_snapshot_is_read_only_and_the_callers_arrays_stay_writeable(name):
    from fastembed.validate import table_snapshot

    table = random_quantized(name, 20, 64)
    snapshot = table_snapshot(table)
    views = [snapshot.data] + ([] if snapshot.scales is None else [snapshot.scales])
    assert all(not view.flags.writeable for view in views)  # the kernels take them as they are
    fastembed.lookup(table, [3, 7])
    fastembed.Embedding(table)([1])
    assert table.data.flags.writeable and (table.scales is None or table.scales.flags.writeable)
    table.data[3] = table.data[4]  # the caller still owns its rows
    if table.scales is not None:
        table.scales[3] = table.scales[4]
    assert_bit_equal(fastembed.lookup(table, [3]), fastembed.lookup(table, [4]))


@pytest.mark.parametrize("dtype", [np.int8, np.float64, "float8_e4m3fn"])
def test_quantized_tables_dequantize_into_float32_float16_or_bfloat16_only(dtype):
    with pytest.raises(TypeError, match="dequantizes into float32, float16, bfloat16"):
        fastembed.lookup(random_quantized("q8_0", 4, 32), [1], dtype=dtype)


def test_out_must_have_the_output_dtype():
    table = random_quantized("q8_0", 4, 32)
    with pytest.raises(TypeError, match="expected float16"):
        fastembed.lookup(table, [1], out=np.empty((1, 32), np.float32), dtype=np.float16)
    with pytest.raises(ValueError, match=r"expected \(2, 32\)"):
        fastembed.lookup(table, [1, 2], out=np.empty((1, 32), np.float32))


def test_out_overlapping_the_scales_is_refused():
    table = random_quantized("fp8_e4m3", 8, 1)
    with pytest.raises(ValueError, match="overlaps the table"):
        fastembed.lookup(table, [1], out=table.scales[:1].reshape(1, 1))


def test_a_backend_that_does_not_declare_a_format_says_so():
    from fastembed.backends.base import not_supported_reasons

    reasons = not_supported_reasons(BACKENDS["numpy"], "numpy", "cpu", "q9_9")
    assert reasons == ["the numpy backend does not gather q9_9 tables"]


def test_a_table_of_a_block_format_of_the_callers_own_is_described_but_not_gathered():
    from fastembed.formats import BlockFormat, QuantizedTable

    mine = BlockFormat("mine", 4, 4, None, lambda blocks: blocks.astype(np.float32))
    table = QuantizedTable(np.zeros((3, 8), np.uint8), mine, 8)
    assert table.shape == (3, 8)
    with pytest.raises(fastembed.BackendUnavailableError, match="the numpy backend does not gather mine tables"):
        fastembed.lookup(table, [1])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("source", "target"), [("float16", "float32"), ("float32", "float16"), ("float32", "bfloat16"), ("bfloat16", "float64")])
def test_dense_tables_cast_into_the_requested_dtype(backend, source, target):
    table = fastembed.tables.random_table(3000, 40, source)
    ids = np.random.default_rng(6).integers(0, 3000, (7, 300))
    expected = table[ids].astype(fastembed.tables.resolve_dtype(target))
    assert_bit_equal(fastembed.lookup(table, ids, dtype=target, backend=backend), expected)
    out = poisoned(ids.shape + (40,), expected.dtype)
    fastembed.Embedding(table)(ids, out=out, backend=backend, dtype=target)
    assert_bit_equal(out, expected)
    assert fastembed.lookup(table, ids, dtype=source, backend=backend).dtype == table.dtype


def _nearest_even(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Each long double value rounded once to `dtype`: of the values of `dtype` around it, the nearest (ties: even)."""
    first = values.astype(dtype)  # possibly rounded twice, so one step off at most
    candidates = [np.nextafter(first, np.array(-np.inf, dtype)), first, np.nextafter(first, np.array(np.inf, dtype))]
    best = candidates[1].copy()
    for candidate in candidates:
        distance = np.abs(candidate.astype(values.dtype) - values)
        best_distance = np.abs(best.astype(values.dtype) - values)
        even = (candidate.view(np.uint16 if dtype.itemsize == 2 else np.uint32) & 1) == 0
        better = (distance < best_distance) | ((distance == best_distance) & even)
        best[better] = candidate[better]
    return best


@pytest.mark.skipif(np.finfo(np.longdouble).nmant <= 52, reason="long double is float64 on this platform")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("target", ["float16", "float32"])
def test_a_long_double_table_casts_with_one_rounding(backend, target):
    """numpy casts long double to float16 through float64, rounding twice: just above a midpoint went to even."""
    target = np.dtype(target)
    bits = np.finfo(target).nmant
    grid = np.ldexp(np.random.default_rng(3).integers(2**bits, 2**(bits + 1), 2000), -bits).astype(np.longdouble)
    half, tiny = np.longdouble(2.0) ** (-bits - 1), np.longdouble(2.0) ** -62
    values = np.concatenate([grid + half + tiny, grid + half - tiny, grid + half, -(grid + half + tiny)])
    table = values.reshape(-1, 4)
    ids = np.arange(len(table))[::-1]
    assert_bit_equal(fastembed.lookup(table, ids, dtype=target, backend=backend),
                     _nearest_even(table[ids], target))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_cast_that_overflows_rounds_to_infinity_whatever_np_seterr_says(backend):
    """Values beyond float16 become infinities, as documented: np.seterr(over="raise") does not stop the cast half-way."""
    table = np.full((5000, 64), 1e6, np.float32)
    ids = np.arange(4999, -1, -1)
    out = poisoned((5000, 64), np.float16)
    with np.errstate(all="raise"):
        fastembed.lookup(table, ids, out=out, dtype=np.float16, backend=backend)
    assert np.isposinf(out).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_dequantizing_into_float16_overflows_to_infinity_whatever_np_seterr_says(backend):
    """fp8 rows whose scale takes them past float16's range: infinities, not a FloatingPointError half-way."""
    from fastembed.formats import QuantizedTable

    data = np.full((600, 32), 0x7E, np.uint8)  # float8_e4m3fn 448
    table = QuantizedTable(data, "fp8_e4m3", 32, np.full(600, 1e3, np.float32))
    out = poisoned((600, 32), np.float16)
    with np.errstate(all="raise"):
        fastembed.lookup(table, np.arange(600), out=out, dtype=np.float16, backend=backend)
    assert np.isposinf(out).all()


def test_dense_casts_refuse_what_is_not_a_float_cast():
    with pytest.raises(TypeError, match="a table of dtype int32 can be gathered into its own dtype, not float32"):
        fastembed.lookup(np.zeros((3, 2), np.int32), [1], dtype=np.float32)
    with pytest.raises(TypeError, match="not int8"):
        fastembed.lookup(np.zeros((3, 2), np.float32), [1], dtype=np.int8)


def test_quantize_then_lookup_is_close_to_the_dense_rows():
    emb = fastembed.Embedding.random(2000, 128, "float32")
    ids = np.arange(0, 2000, 7)
    for kind, tolerance in (("q8_0", 0.0625 / 127 * 0.57), ("fp8_e4m3", 0.0625 / 16)):
        quantized = emb.quantize(kind)
        assert quantized.format == kind and quantized.vocab_size == 2000 and quantized.dim == 128
        assert np.abs(quantized(ids) - emb(ids)).max() <= tolerance


def test_quantize_refuses_what_it_cannot_quantize():
    with pytest.raises(TypeError, match="dense floating-point host table"):
        fastembed.Embedding(np.zeros((4, 32), np.int16)).quantize("q8_0")
    with pytest.raises(TypeError, match="dense floating-point host table"):
        fastembed.Embedding(random_quantized("q8_0", 4, 32)).quantize("q8_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        fastembed.Embedding(np.ones((4, 40), np.float32)).quantize("q8_0")


def test_quantize_takes_a_format_as_well_as_its_name():
    from fastembed.formats import FORMATS

    emb = fastembed.Embedding(np.ones((4, 32), np.float32))
    assert emb.quantize(FORMATS["fp8_e4m3"]).format == "fp8_e4m3"


def test_a_quantized_table_over_torch_or_jax_bytes_gives_their_kind_of_result():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    table = random_quantized("q4_0", 30, 64)
    expected = reference(table, [3, 29])
    over_torch = fastembed.formats.QuantizedTable(torch.from_numpy(table.data), "q4_0", 64)
    result = fastembed.lookup(over_torch, [3, 29])
    assert isinstance(result, torch.Tensor)
    assert_bit_equal(result.numpy(), expected)
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed")
    result = fastembed.lookup(fastembed.formats.QuantizedTable(jnp.asarray(table.data), "q4_0", 64), [3, 29])
    assert type(result).__module__.startswith("jax")
    assert_bit_equal(np.asarray(result), expected)


@pytest.mark.parametrize(("kind", "suffix"), [("q8_0", ".gguf"), ("q8_0", ".safetensors"), ("fp8_e4m3", ".safetensors")])
def test_a_saved_quantized_table_loads_back_memory_mapped_and_gathers_the_same_rows(tmp_path, kind, suffix):
    emb = fastembed.Embedding.random(500, 64, "float32").quantize(kind)
    path = tmp_path / f"table{suffix}"
    emb.save(path)
    loaded = fastembed.Embedding.from_gguf(path) if suffix == ".gguf" else fastembed.Embedding.from_pretrained(path)
    assert loaded.format == kind and isinstance(loaded.table.data, np.memmap)
    ids = np.arange(0, 500, 3)
    assert_bit_equal(loaded(ids, dtype="bfloat16"), emb(ids, dtype="bfloat16"))
    loaded.check_file()


def test_a_dense_gguf_table_opens_through_from_pretrained(tmp_path):
    emb = fastembed.Embedding.random(100, 32, "float16")
    emb.save(tmp_path / "model.gguf")
    loaded = fastembed.Embedding.from_pretrained(tmp_path / "model.gguf")
    assert loaded.format == "dense" and loaded.dtype == np.float16
    assert_bit_equal(loaded([5, 99]), emb([5, 99]))


@pytest.mark.parametrize("rows", [0, 1])
@pytest.mark.parametrize("dim", [256, 64])
def test_quantizing_into_a_format_only_files_hold_is_refused_whatever_the_rows(rows, dim):
    """Whatever the width too: a row of 64 values cannot be q4_k, but no width makes fastembed write q4_k."""
    with pytest.raises(ValueError, match="q4_k tables come from GGUF files"):
        fastembed.Embedding(np.ones((rows, dim), np.float32)).quantize("q4_k")
    assert fastembed.Embedding(np.ones((0, 64), np.float32)).quantize("q8_0").table.data.shape == (0, 68)
