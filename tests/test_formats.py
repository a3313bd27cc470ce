"""The block formats' numpy reference against llama.cpp's own (gguf.quants), the quantizers, and their error bounds."""
from __future__ import annotations

import re
import warnings

import ml_dtypes
import numpy as np
import pytest

import fastembed
from fastembed.formats import (
    FORMATS,
    BlockFormat,
    QuantizedTable,
    block_format,
    dequantize_rows,
    quantize_rows,
    row_bytes,
)
from helpers import assert_bit_equal, random_quantized, random_table

gguf_quants = pytest.importorskip("gguf.quants", reason="the gguf package is the reference for the GGUF layouts")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

GGUF_FORMATS = [name for name, fmt in FORMATS.items() if fmt.ggml_type is not None]


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_block_sizes_are_ggmls(name):
    fmt = FORMATS[name]
    assert GGML_QUANT_SIZES[GGMLQuantizationType(fmt.ggml_type)] == (fmt.block_values, fmt.block_bytes)
    assert GGMLQuantizationType(fmt.ggml_type).name.lower() == name


@pytest.mark.parametrize("name", GGUF_FORMATS)
@pytest.mark.parametrize("dim", [256, 768])
def test_reference_dequantization_is_ggufs_bit_for_bit(name, dim):
    table = random_quantized(name, 37, dim, seed=dim)
    expected = gguf_quants.dequantize(table.data, GGMLQuantizationType(FORMATS[name].ggml_type))
    assert_bit_equal(dequantize_rows(table.data, None, table.format, dim), expected.astype(np.float32))


def test_q8_0_quantizer_is_ggmls_byte_for_byte():
    rows = np.random.default_rng(1).normal(0, 0.02, (50, 256)).astype(np.float32)
    rows[3] = 0  # an all-zero block: scale 0, values 0
    data, scales = quantize_rows(rows, FORMATS["q8_0"])
    assert scales is None
    assert_bit_equal(data, gguf_quants.quantize(rows, GGMLQuantizationType.Q8_0))


def test_q8_0_error_is_bounded_by_its_block_scale():
    """|x - dequant(x)| <= d/2 + 127 * |d - d16| <= 0.5625 * d per block of 32, with d = absmax / 127."""
    rows = np.random.default_rng(2).standard_t(3, (64, 512)).astype(np.float32)
    data, _ = quantize_rows(rows, FORMATS["q8_0"])
    error = np.abs(dequantize_rows(data, None, FORMATS["q8_0"], 512) - rows).reshape(-1, 32)
    d = np.abs(rows).reshape(-1, 32).max(axis=1) / 127
    assert (error.max(axis=1) <= 0.5625 * d).all()


def test_fp8_e4m3_error_is_relative_with_a_subnormal_floor():
    """|x - dequant(x)| <= |x| / 16 + scale / 512 with scale = absmax / 448 per row (3 mantissa bits, subnormals below 2**-6)."""
    rows = np.random.default_rng(3).standard_t(3, (64, 300)).astype(np.float32)
    data, scales = quantize_rows(rows, FORMATS["fp8_e4m3"])
    assert data.dtype == np.uint8 and scales.dtype == np.float32
    error = np.abs(dequantize_rows(data, scales, FORMATS["fp8_e4m3"], 300) - rows)
    assert (error <= np.abs(rows) / 16 + scales[:, None] / 512).all()
    assert_bit_equal(scales, (np.abs(rows).max(axis=1) / np.float32(448)).astype(np.float32))


@pytest.mark.parametrize("exponent", [-150, -146, -140, -130, -127, -126, -120])
def test_fp8_e4m3_rows_of_tiny_values_keep_the_bound_and_stay_finite(exponent):
    """A row whose absmax / 448 is subnormal in float32 (or 0) gets the scale 2**-126: no NaN, the bound holds."""
    rows = np.random.default_rng(5).uniform(-1, 1, (3, 32)).astype(np.float32) * np.float32(2.0 ** (exponent + 8))
    rows[0, :2] = np.float32(2.0 ** exponent) * np.array([1.0, -0.75], np.float32)
    rows[2] = 0
    data, scales = quantize_rows(rows, FORMATS["fp8_e4m3"])
    values = dequantize_rows(data, scales, FORMATS["fp8_e4m3"], 32)
    assert np.isfinite(values).all()
    assert (np.abs(values - rows) <= np.abs(rows) / 16 + scales[:, None] / 512).all()
    assert scales[2] == 0 and (values[2] == 0).all()
    assert (scales[:2] >= np.finfo(np.float32).tiny).all()


def test_fp8_values_are_ml_dtypes_float8_e4m3fn():
    rows = np.random.default_rng(4).normal(0, 1, (4, 16)).astype(np.float32)
    data, scales = quantize_rows(rows, FORMATS["fp8_e4m3"])
    assert_bit_equal(data, (rows / scales[:, None]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def test_a_zero_row_quantizes_to_zeros():
    for name in ("q8_0", "fp8_e4m3"):
        data, scales = quantize_rows(np.zeros((2, 64), np.float32), FORMATS[name])
        assert not dequantize_rows(data, scales, FORMATS[name], 64).any()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_values_cannot_be_quantized(bad):
    rows = np.ones((2, 64), np.float32)
    rows[1, 5] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_rows(rows, FORMATS["q8_0"])


def test_formats_that_come_from_files_only_are_refused_by_the_quantizer():
    with pytest.raises(ValueError, match="q4_k tables come from GGUF"):
        quantize_rows(np.ones((1, 256), np.float32), FORMATS["q4_k"])


def test_unknown_format_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown quantized format 'q3_x'.*q8_0"):
        block_format("q3_x")
    assert block_format("Q8_0") is FORMATS["q8_0"]


def test_row_bytes_come_from_the_format():
    assert FORMATS["q4_k"].row_bytes(4096) == 16 * 144
    assert row_bytes(random_quantized("q6_k", 3, 512)) == 2 * 210
    assert row_bytes(np.zeros((3, 5), np.float16)) == 10
    with pytest.raises(ValueError, match="multiple of 32 values, not 48"):
        FORMATS["q8_0"].row_bytes(48)
    with pytest.raises(ValueError, match="a fp8_e4m3 row holds 1 value or more, not 0"):
        FORMATS["fp8_e4m3"].row_bytes(0)
    for not_a_count in (64.0, "64", True):
        with pytest.raises(TypeError, match="counted by an integer"):
            FORMATS["q8_0"].row_bytes(not_a_count)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: QuantizedTable(np.zeros((4, 68), np.int8), "q8_0", 64), TypeError, "uint8"),
        (lambda: QuantizedTable(np.zeros((4, 67), np.uint8), "q8_0", 64), ValueError, r"\(vocab_size, 68\)"),
        (lambda: QuantizedTable(np.zeros((4, 136), np.uint8)[:, ::2], "q8_0", 64), ValueError, "C-contiguous"),
        (lambda: QuantizedTable(np.zeros((4, 68), np.uint8), "q8_0", 64, np.ones(4, np.float32)), ValueError, "inside the blocks"),
        (lambda: QuantizedTable(np.zeros((4, 64), np.uint8), "fp8_e4m3", 64), TypeError, "float32 scales"),
        (lambda: QuantizedTable(np.zeros((4, 64), np.uint8), "fp8_e4m3", 64, np.ones(4)), TypeError, "float32 scales"),
        (lambda: QuantizedTable(np.zeros((4, 64), np.uint8), "fp8_e4m3", 64, np.ones(3, np.float32)), ValueError, r"\(4,\)"),
        (lambda: QuantizedTable(np.zeros((4, 64), np.uint8), "fp8_e4m3", 64, np.ones(8, np.float32)[::2]), ValueError,
         r"C-contiguous, got strides \(8,\)"),
        (lambda: QuantizedTable([[0] * 68], "q8_0", 64), TypeError, "uint8 array"),
    ],
)
def test_quantized_tables_that_do_not_fit_their_format_are_refused(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_q8_0_error_of_blocks_with_subnormal_scales_is_bounded_by_the_subnormal_spacing():
    """Below absmax = 127 * 2**-14 the float16 scale is subnormal: |d - d16| <= 2**-25 instead of d * 2**-11."""
    rows = np.random.default_rng(7).uniform(-1e-3, 1e-3, (64, 256)).astype(np.float32)
    data, _ = quantize_rows(rows, FORMATS["q8_0"])
    error = np.abs(dequantize_rows(data, None, FORMATS["q8_0"], 256) - rows).reshape(-1, 32)
    d = np.abs(rows).reshape(-1, 32).max(axis=1) / 127
    assert (error.max(axis=1) <= (0.5 + 2.0**-16) * d + 127 * 2.0**-25).all()


def test_q8_0_rounds_as_cs_roundf_where_float32_addition_would_not():
    """0.49999997 + 0.5 is 1.0 in float32; roundf(0.49999997) is 0, as in ggml's quantizer and gguf's."""
    below_half = np.nextafter(np.float32(0.5), np.float32(0))
    rows = np.random.default_rng(8).uniform(-100, 100, (2, 32)).astype(np.float32)
    rows[0, :4] = [127, below_half, -below_half, 2.5]  # d = 1
    rows[1, :2] = [127 * 3.41015625, 363.1816101074219]  # x * (1 / d) in float32 lands just below a half-way point
    data, _ = quantize_rows(rows, FORMATS["q8_0"])
    assert_bit_equal(data, gguf_quants.quantize(rows, GGMLQuantizationType.Q8_0))
    assert list(data[0, 2:6].view(np.int8)) == [127, 0, 0, 3]
    error = np.abs(dequantize_rows(data, None, FORMATS["q8_0"], 32) - rows)
    assert (error <= (0.5 + 2.0**-16) * np.abs(rows).max(axis=1, keepdims=True) / 127).all()


def test_q8_0_blocks_too_small_for_an_inverse_scale_store_zeros_without_warnings():
    rows = np.zeros((1, 64), np.float32)
    rows[0, :32] = np.float32(1e-38) * np.linspace(-1, 1, 32, dtype=np.float32)  # 1 / d overflows
    rows[0, 32:] = np.float32(2e-30) * np.linspace(-1, 1, 32, dtype=np.float32)  # 1 / d finite, d16 = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data, _ = quantize_rows(rows, FORMATS["q8_0"])
    assert not data[0, :34].any()
    assert_bit_equal(data[0, 34:], gguf_quants.quantize(rows[:, 32:], GGMLQuantizationType.Q8_0)[0])
    assert not dequantize_rows(data, None, FORMATS["q8_0"], 64).any()


@pytest.mark.parametrize("name", ["q8_0", "fp8_e4m3"])
def test_quantizing_gives_the_same_bytes_whatever_np_seterr_says(name):
    rng = np.random.default_rng(5)
    small = (rng.standard_normal((4, 64)) * 0.002).astype(np.float32)  # q8_0 scales in float16's subnormals
    mixed = np.ones((1, 64), np.float32)
    mixed[0, 5] = 1e-44  # one float32 subnormal beside ones: underflows in fp8's division
    for rows in (small, mixed):
        expected = quantize_rows(rows, name)
        with np.errstate(all="raise"):
            got = quantize_rows(rows, name)
        assert_bit_equal(got[0], expected[0])
        assert (got[1] is None) == (expected[1] is None)


@pytest.mark.skipif(np.finfo(np.longdouble).max <= np.finfo(np.float64).max, reason="long double is float64 here")
def test_a_finite_long_double_beyond_float32_is_named_as_such_without_warnings():
    rows = np.ones((1, 32), np.longdouble)
    rows[0, 3] = np.longdouble("1e400")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="beyond float32's range"):
            quantize_rows(rows, "q8_0")


def test_q8_0_refuses_exactly_the_blocks_whose_float16_scale_would_be_infinite():
    largest_kept = np.nextafter(np.float32(65520 * 127), np.float32(0))
    data, _ = quantize_rows(np.full((1, 32), largest_kept, np.float32), "q8_0")
    assert data[0, :2].view(np.float16)[0] == 65504
    with pytest.raises(ValueError, match="65520 x 127 = 8,321,040, not 8321040"):
        quantize_rows(np.full((1, 32), 65520 * 127, np.float32), "q8_0")


def test_the_quantizer_takes_a_format_or_its_name_and_refuses_other_rows_by_name():
    rows = np.ones((2, 32), np.float32)
    assert_bit_equal(quantize_rows(rows, "Q8_0")[0], quantize_rows(rows, FORMATS["q8_0"])[0])
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(np.ones(32, np.float32), "q8_0")
    with pytest.raises(TypeError, match="complex128 rows"):
        quantize_rows(np.ones((2, 32), complex), "fp8_e4m3")
    with pytest.raises(TypeError, match="<U1 rows"):
        quantize_rows(np.full((2, 32), "a"), "q8_0")


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
def test_rows_of_ml_dtypes_integers_are_quantized_as_their_values(fmt):
    values = np.random.default_rng(3).integers(-8, 8, (3, 64))
    for dtype in (ml_dtypes.int4, ml_dtypes.uint4):
        rows = (values % 16 if dtype is ml_dtypes.uint4 else values).astype(dtype)
        expected = quantize_rows(rows.astype(np.float32), fmt)
        got = quantize_rows(rows, fmt)
        assert_bit_equal(got[0], expected[0])
        if expected[1] is not None:
            assert_bit_equal(got[1], expected[1])
    with pytest.raises(TypeError, match="V4 rows"):
        quantize_rows(np.zeros((2, 32), "V4"), fmt)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_an_integer_block_beyond_the_limit_is_refused_naming_its_magnitude(dtype):
    rows = np.zeros((1, 32), dtype)
    rows[0, 3] = np.iinfo(dtype).min  # whose abs in its own dtype wraps to itself
    with pytest.raises(ValueError, match=re.escape(f"not {float(-int(np.iinfo(dtype).min)):.10g};")):
        quantize_rows(rows, "q8_0")


def test_a_float64_block_just_below_the_limit_is_refused_naming_its_own_value_and_float32():
    with pytest.raises(ValueError, match="round to float32 below .* not 8321039.9"):
        quantize_rows(np.full((1, 32), 8321039.9), "q8_0")


def test_a_format_object_of_the_callers_own_is_not_quantized_as_the_format_of_its_name():
    import dataclasses

    lookalike = dataclasses.replace(FORMATS["q8_0"], dequantize_blocks=lambda blocks: blocks.astype(np.float32))
    with pytest.raises(ValueError, match="its own q8_0 and fp8_e4m3"):
        quantize_rows(np.ones((1, 32), np.float32), lookalike)


@pytest.mark.parametrize("name", ["q8_0", "fp8_e4m3"])
def test_a_pickled_copy_of_a_format_quantizes_as_the_format_itself(name):
    """A table's format after a trip through pickle (multiprocessing) is accepted by tables, lookups and saves:
    the quantizer refused it, naming it as not one of fastembed's own."""
    import pickle

    rows = random_table(5, 64, "float32")
    copy = pickle.loads(pickle.dumps(FORMATS[name]))
    assert copy is not FORMATS[name]
    for made, expected in zip(quantize_rows(rows, copy), quantize_rows(rows, name), strict=True):
        assert (made is None and expected is None) or made.tobytes() == expected.tobytes()
    assert fastembed.Embedding(rows).quantize(copy).format == name


@pytest.mark.parametrize("fields, error, words", [
    (("mine", 0, 34, None), ValueError, "block_values must be 1 or more, got 0"),
    (("mine", 32, -1, None), ValueError, "block_bytes must be 1 or more, got -1"),
    (("mine", 32.0, 34, None), TypeError, "block_values must be an integer, got 32.0"),
    (("mine", True, 34, None), TypeError, "block_values must be an integer, got True"),
    (("mine", 32, 34, "8"), TypeError, "ggml_type must be an integer or None"),
    (("", 32, 34, None), TypeError, "name must be a non-empty string"),
])
def test_a_block_format_no_layout_can_have_is_refused_when_made(fields, error, words):
    """Checked when the format is made, before a row size divides by zero."""
    with pytest.raises(error, match=words):
        BlockFormat(*fields, lambda blocks: blocks.astype(np.float32))
    with pytest.raises(TypeError, match="dequantize_blocks must be callable"):
        BlockFormat("mine", 32, 34, None, None)


def test_quantized_table_cannot_be_subclassed():
    """The API recognises quantized tables by their exact type: a subclass would be refused as an unknown array."""
    with pytest.raises(TypeError, match="QuantizedTable cannot be subclassed"):
        type("Mine", (QuantizedTable,), {"__slots__": ()})


def test_float64_values_below_float32s_range_quantize_as_their_float32_zero():
    rows = np.array([[1e-50, -3e-47, 2e-300, 0.0]])
    data, scales = quantize_rows(rows, "fp8_e4m3")
    assert not data.any() and scales.tolist() == [0.0]
    data, _ = quantize_rows(np.tile(rows, 8), "q8_0")
    assert not data.any()


def test_q8_0_blocks_of_absmax_65500_25_or_more_dequantize_beyond_float16():
    """docs/quantized.md: such a block's float16 output holds infinities (127 x 516 = 65,532)."""
    for absmax, finite in ((65500.0, True), (65500.25, False), (65504.0, False)):
        block = np.linspace(-1, 1, 32, dtype=np.float32)
        block[-1] = absmax
        data, _ = quantize_rows(block[None], "q8_0")
        values = dequantize_rows(data, None, FORMATS["q8_0"], 32)
        with np.errstate(over="ignore"):
            assert np.isfinite(values.astype(np.float16)).all() == finite
