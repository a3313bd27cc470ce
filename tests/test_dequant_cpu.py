"""The numba backend's dequantizing gather: every block format, output dtype and kernel path, bit for bit the reference."""
from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import fastembed
from fastembed.formats import FORMATS, QuantizedTable, dequantize_rows
from fastembed.tables import random_quantized_table
from helpers import assert_bit_equal, poisoned
from helpers import dequantized as reference

numba_backend = pytest.importorskip("fastembed.backends.numba_backend")
BACKEND = numba_backend.BACKEND
if BACKEND.unavailable_reasons():
    pytest.skip(f"numba backend unavailable: {BACKEND.unavailable_reasons()}", allow_module_level=True)
dequant_cpu = pytest.importorskip("fastembed.kernels.dequant_cpu")

OUTPUT_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
#: Offsets of each format's float16 fields in its block.
HALF_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2),
               "q6_k": (208,)}
#: float16 bits: infinities, NaN, the smallest and largest subnormals, zeros, the largest finite, one.
SPECIAL_HALVES = [0x7C00, 0xFC00, 0x7E00, 0x0001, 0x83FF, 0x0000, 0x8000, 0x7BFF, 0x3C00]


@pytest.fixture(autouse=True)
def _compile_in_the_foreground(monkeypatch):
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)


@pytest.fixture(params=["serial", "parallel", "stream", "serial-stream"])
def kernel_path(request, monkeypatch):
    """Each kernel path on small tables: thresholds moved; "serial-stream" is a big batch while another thread's
    lookup holds the parallel lock."""
    if request.param != "serial":
        monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(numba_backend, "STREAM_MIN_OUT_BYTES", 2**62 if request.param == "parallel" else 0)
    if request.param in ("stream", "serial-stream"):
        streaming_every_output(monkeypatch)
    if request.param != "serial-stream":
        yield request.param
        return
    with BACKEND._parallel_lock:
        yield request.param


def streaming_every_output(monkeypatch) -> None:
    """Streamed stores for every format and output, also those the backend keeps to cached stores on this CPU (a CPU
    with more vector registers streams them)."""
    monkeypatch.setattr(BACKEND.dequantize_kernels(), "streams_well", lambda mode: True)


def dims(name: str) -> list[int]:
    """One block, three blocks; fp8_e4m3 rows of 1, 8, 96, 296 and 300 values.

    fp8_e4m3: scalar tails, vectors, streamable or not; 16-bit outputs of
    rows below 128 values decoded value by value, from 128 looked up in the
    row's table where the CPU has one (see the kernels' FP8_TABLE_LOOKUP).
    """
    values = FORMATS[name].block_values
    return [1, 8, 96, 296, 300] if values == 1 else [values, 3 * values]


def lookup_both_ways(table, ids, dtype):
    """The backend's result without out, and with a poisoned out; both must be exact (every element written)."""
    allocated = BACKEND.dequantize(table, ids, None, dtype)
    out = poisoned(ids.shape + (table.dim,), dtype)
    assert BACKEND.dequantize(table, ids, out, dtype) is out
    return allocated, out


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=str)
def test_every_format_output_and_kernel_path_is_the_reference_bit_for_bit(kernel_path, name, dtype):
    rng = np.random.default_rng(len(name))
    for dim in dims(name):
        table = random_quantized_table(name, 300, dim, seed=dim)
        id_sets = (rng.integers(0, 300, 40), rng.integers(0, 300, (3, 5)).astype(np.int32), np.array([299]),
                   np.array([], np.int64), np.zeros((2, 0), np.int32))
        for ids in id_sets:
            for result in lookup_both_ways(table, ids, dtype):
                assert_bit_equal(result, reference(table, ids, dtype))


@pytest.mark.parametrize("name", [name for name in FORMATS if FORMATS[name].ggml_type is not None])
def test_the_float32_values_are_ggufs_own_dequantization(name):
    """llama.cpp's reference (the gguf package) gives the same bits as the kernels."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf.constants import GGMLQuantizationType

    table = random_quantized_table(name, 64, 512, seed=3)
    ids = np.arange(64)[::-1].copy()
    expected = gguf_quants.dequantize(table.data[ids], GGMLQuantizationType(FORMATS[name].ggml_type))
    assert_bit_equal(BACKEND.dequantize(table, ids, None, np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("name", HALF_FIELDS)
def test_special_float16_scales_round_like_the_reference(name):
    """Infinite, NaN, subnormal, zero and largest float16 scale fields: overflow, NaN and subnormal outputs.

    One special field per block, the others finite, so that no value meets
    two NaNs of different signs (whose order of operations the reference
    does not fix).
    """
    fmt = FORMATS[name]
    table = random_quantized_table(name, 40, 3 * fmt.block_values, seed=11)
    blocks = table.data.reshape(-1, fmt.block_bytes)
    for k, (bits, offset) in enumerate((bits, offset) for offset in HALF_FIELDS[name] for bits in SPECIAL_HALVES):
        blocks[3 * k + 1, offset : offset + 2] = np.array([bits], "<u2").view(np.uint8)
    ids = np.arange(40)
    for dtype in OUTPUT_DTYPES:
        assert_bit_equal(BACKEND.dequantize(table, ids, None, dtype), reference(table, ids, dtype))
    assert np.isnan(reference(table, ids)).any() and np.isinf(reference(table, ids, np.float16)).any()


def test_fp8_special_bytes_and_row_scales_round_like_the_reference():
    """Every float8_e4m3fn byte (NaN codes included) by finite scales; non-finite, zero and subnormal row scales.

    Scales on either side of float32's largest / 2**8, where a scale multiplied by 2**8 would overflow.
    """
    dim = 300  # 256 + 32 vector lanes, then 12 scalar values: every byte goes through both
    data = ((np.arange(64 * dim) % 256).astype(np.uint8)).reshape(64, dim)
    scales = np.random.default_rng(2).uniform(-4, 4, 64).astype(np.float32)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 3e38, 1.0, 1.3e36, -1.4e36], np.float32)
    finite_bytes = data[: len(specials)]
    finite_bytes[(finite_bytes & 0x7F) == 0x7F] = 1  # a NaN value times a NaN scale: two NaNs (see above)
    scales[: len(specials)] = specials
    table = QuantizedTable(data, "fp8_e4m3", dim, scales)
    ids = np.random.default_rng(4).permutation(64)
    for dtype in OUTPUT_DTYPES:
        assert_bit_equal(BACKEND.dequantize(table, ids, None, dtype), reference(table, ids, dtype))


def streamable_poisoned(size: int) -> np.ndarray:
    """A poisoned uint16 buffer at a 16-byte boundary (plus 0 or 48 bytes: both sides of a 64-byte line)."""
    buffer = poisoned(size + 64, np.uint16)
    start = (-buffer.ctypes.data % 64) // 2 + 24
    return buffer[start : start + size]


@pytest.mark.parametrize("name", ["fp8_e4m3", "q4_0", "q4_1", "q4_k"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_table_lookups_are_the_decode_bit_for_bit_on_any_cpu(name, stream):
    """The 16-bit table-lookup code, which dequantize() takes only where the CPU indexes tables in registers.

    fp8_e4m3: every code by finite scales, zeros and subnormals included;
    the 4-bit formats: special float16 scale fields. Every output mode.
    """
    kernels = BACKEND.dequantize_kernels()
    fmt = FORMATS[name]
    if name == "fp8_e4m3":
        dim = 296  # a table of 128 entries, 288 values looked up in vectors and 8 one by one
        rows = [((np.arange(dim) * 7) % 256).astype(np.uint8)] * 6
        scales = np.array([1.0, -3.5, 0.0, -0.0, 1e-45, 3e38], np.float32)
    else:
        table = random_quantized_table(name, len(SPECIAL_HALVES), 3 * fmt.block_values, seed=5)
        for k, bits in enumerate(SPECIAL_HALVES):
            blocks = table.data[k].reshape(3, fmt.block_bytes)
            blocks[1, HALF_FIELDS[name][-1] : HALF_FIELDS[name][-1] + 2] = np.array([bits], "<u2").view(np.uint8)
        rows, dim, scales = list(table.data), table.dim, np.ones(len(SPECIAL_HALVES), np.float32)
    dtypes = {kernels.FLOAT16: np.float16, kernels.BFLOAT16: ml_dtypes.bfloat16}
    if name == "fp8_e4m3":  # the 4-bit formats' bit-operation rounding is their decode's
        dtypes[kernels.FLOAT16_BITS] = np.float16
    for row, scale in zip(rows, scales, strict=True):
        with np.errstate(over="ignore", invalid="ignore"):
            values = dequantize_rows(row[None], scale[None] if name == "fp8_e4m3" else None, fmt, dim)[0]
        for mode, dtype in dtypes.items():
            out = streamable_poisoned(dim)
            kernels.looked_up(kernels.FORMAT_CODES[name], row, scale, out, mode, stream)
            with np.errstate(over="ignore", invalid="ignore"):
                assert_bit_equal(out, values.astype(dtype).view(np.uint16))


@pytest.mark.parametrize("scale", [1.0, -3.5, 1e-40, np.inf])
def test_the_integer_bit_fp8_vectors_match_ml_dtypes(scale):
    """The fp8 vector code used where no F16C instruction serves, on every code (NaN ones included)."""
    codes = np.arange(256, dtype=np.uint8)
    out = BACKEND.dequantize_kernels().fp8_e4m3_by_bits(codes, np.float32(scale), poisoned(256, np.float32))
    with np.errstate(invalid="ignore"):
        expected = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(scale)
    assert_bit_equal(out, expected)


def test_every_float16_scale_field_converts_exactly():
    """All 65,536 float16 bit patterns as Q8_0 scales of the value 1 (signalling NaNs quieted by the product, as in the reference)."""
    blocks = np.ones((65536, 34), np.uint8)
    blocks[:, :2] = np.arange(65536, dtype="<u2").view(np.uint8).reshape(-1, 2)
    table = QuantizedTable(blocks.reshape(2048, 32 * 34), "q8_0", 1024)
    ids = np.arange(2048)
    for dtype in OUTPUT_DTYPES:
        assert_bit_equal(BACKEND.dequantize(table, ids, None, dtype), reference(table, ids, dtype))


@pytest.mark.parametrize("offset", [0, 2])
def test_every_q8_0_product_rounds_to_float16_as_the_reference(kernel_path, offset):
    """Every float16 scale times every int8 quant, into float16: the rounding of each product (ties, subnormals,
    overflow, NaN payloads), whether the CPU computes it in float32 or, with AVX512-FP16, in float16; on every kernel
    path, into an output at an odd offset too (staged through an aligned buffer)."""
    quants = np.arange(-128, 128, dtype=np.int8).view(np.uint8).reshape(8, 32)  # one row: 8 blocks, 256 quants
    blocks = np.empty((65536, 8, 34), np.uint8)
    blocks[:, :, 2:] = quants
    blocks[:, :, :2] = np.arange(65536, dtype="<u2").view(np.uint8).reshape(-1, 1, 2)
    table = QuantizedTable(blocks.reshape(65536, 8 * 34), "q8_0", 256)
    ids = np.random.default_rng(offset).permutation(65536)
    buffer = np.empty(ids.size * 256 * 2 + 2, np.uint8)
    out = buffer[offset : offset + ids.size * 256 * 2].view(np.float16).reshape(ids.size, 256)
    assert_bit_equal(BACKEND.dequantize(table, ids, out, np.dtype(np.float16)), reference(table, ids, np.float16))


def float32_patterns() -> np.ndarray:
    """Every high half of a float32 with low halves at the rounding boundaries of float16 and bfloat16."""
    low = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xE000, 0xFFFF], np.uint32)
    return (np.arange(65536, dtype=np.uint32)[:, None] << 16 | low).reshape(-1)


@pytest.mark.parametrize("stream", [False, True])
def test_the_roundings_to_float16_and_bfloat16_are_numpys_and_ml_dtypes(stream):
    """The kernels' conversion code on float32 far beyond what dequantizing makes, eight lanes and scalar tails."""
    kernels = BACKEND.dequantize_kernels()
    bits = float32_patterns()
    values = bits.view(np.float32)[: bits.size - (0 if stream else 5)]  # a tail of 3 values without streaming
    quiet = ~((bits[: values.size] & 0x7FC00000) == 0x7F800000) | ((bits[: values.size] & 0x7FFFFF) == 0)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = {kernels.FLOAT16: values.astype(np.float16).view(np.uint16),
                    kernels.FLOAT16_BITS: values.astype(np.float16).view(np.uint16),
                    kernels.BFLOAT16: values.astype(ml_dtypes.bfloat16).view(np.uint16)}
    for mode, want in expected.items():
        out = poisoned(values.shape, np.uint16)
        kernels.round_to_halves(values, out, mode, stream)
        # the F16C instruction quiets signalling NaNs, which no dequantized value is
        keep = quiet if mode == kernels.FLOAT16 and kernels.HARDWARE_FLOAT16 else slice(None)
        assert_bit_equal(out[keep], want[keep])


def test_the_scalar_conversions_agree_with_numpy_and_ml_dtypes():
    """The scalar functions (the last values of rows) on a sample of the patterns above."""
    kernels = BACKEND.dequantize_kernels()
    bits = float32_patterns()[::7]
    values = bits[(bits & 0x7F800000 != 0x7F800000) | (bits & 0x400000 != 0)].view(np.float32)  # no signalling NaN:
    with np.errstate(over="ignore", invalid="ignore"):  # Python's float would quiet it on the way in
        halves, brains = values.astype(np.float16).view(np.uint16), values.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert [kernels.float16_bits(v) for v in values] == halves.tolist()
    assert [kernels.bfloat16_bits(v) for v in values] == brains.tolist()


def test_every_float16_field_widens_exactly_by_bit_operations():
    """The integer conversion of float16 fields (where no F16C instruction serves) keeps even NaN payloads."""
    halves = np.arange(65536, dtype=np.uint16)
    widened = BACKEND.dequantize_kernels().widen_halves(halves, poisoned(65536, np.float32))
    assert_bit_equal(widened, halves.view(np.float16).astype(np.float32))


@pytest.mark.parametrize("bad_id", [-1, 300, 2**40])
def test_out_of_range_ids_on_every_path_leave_out_untouched(kernel_path, bad_id):
    table = random_quantized_table("q4_k", 300, 256, seed=1)
    ids = np.arange(200) % 300
    ids[150] = bad_id
    ids[170] = bad_id
    for dtype in OUTPUT_DTYPES:
        out = poisoned((200, 256), dtype)
        before = out.copy()
        with pytest.raises(IndexError, match=f"id {bad_id} at position 150 is out of range for a table of 300 rows"):
            BACKEND.dequantize(table, ids, out, dtype)
        assert_bit_equal(out, before)


@pytest.mark.parametrize("line_offset", [None, 0, 16, 32, 48])
def test_a_row_whose_id_changed_after_the_scan_is_skipped_never_read(line_offset):
    """The per-row check: what another thread's write of an id after the scan gives (the kernels' status -2).

    Also streamed into an output at each place in a cache line, where the
    rows around a skipped one end and start inside a line (at one place, or,
    with 80-byte rows, at places that differ from row to row): nothing of
    the skipped row is written, nor anything outside the output, in every
    output mode.
    """
    kernels = BACKEND.dequantize_kernels()
    stream = line_offset is not None
    if stream and not numba_backend._STREAMING_CPU:
        pytest.skip("streamed stores are x86-64's")
    cases = [("q8_0", 64, np.uint16, kernels.FLOAT16), ("q8_0", 96, np.uint16, kernels.FLOAT16),
             ("q8_0", 64, np.float32, kernels.FLOAT16), ("q8_0", 64, np.uint16, kernels.BFLOAT16),
             ("q8_0", 64, np.uint16, kernels.FLOAT16_BITS), ("fp8_e4m3", 40, np.uint16, kernels.FLOAT16),
             ("fp8_e4m3", 160, np.uint16, kernels.FLOAT16_BITS)]
    for name, dim, word, mode in cases:
        table = random_quantized_table(name, 50, dim)
        ids = numba_backend._int64_ids(np.array([3, -7, 49, 50, 2**40, 7, 8]))
        nbytes = ids.size * dim * np.dtype(word).itemsize
        buffer = np.full(nbytes + 128, 0xA5, np.uint8)
        start = ((line_offset or 0) - buffer.ctypes.data) % 64
        out = buffer[start:start + nbytes].view(word).reshape(ids.size, dim)
        data = numba_backend._read_only(table.data)
        scales = numba_backend._read_only(numba_backend._NO_SCALES if table.scales is None
                                          else table.scales.view(np.uint8))
        skipped = kernels.dequantize_range(kernels.FORMAT_CODES[name], data, scales, ids, out, 0, ids.size, mode,
                                           stream, 4, 4)
        assert skipped == 3
        written = [0, 2, 5, 6]
        dtype = np.float32 if word is np.float32 else ml_dtypes.bfloat16 if mode == kernels.BFLOAT16 else np.float16
        assert_bit_equal(out[written].view(dtype), reference(table, ids[written], dtype))
        assert (out[[1, 3, 4]].view(np.uint8) == 0xA5).all()
        assert (buffer[:start] == 0xA5).all() and (buffer[start + out.nbytes:] == 0xA5).all()


def test_int32_ids_straight_into_the_kernel():
    """The kernels take int32 ids too (the backend widens them to int64: one compiled signature fewer)."""
    kernels = BACKEND.dequantize_kernels()
    table = random_quantized_table("q6_k", 30, 512)
    ids = np.array([29, 0, 7], np.int32)
    out = poisoned((3, 512), np.float16).view(np.uint16)
    data, scales = numba_backend._read_only(table.data), numba_backend._read_only(numba_backend._NO_SCALES)
    assert kernels.dequantize_serial(kernels.FORMAT_CODES["q6_k"], data, scales, ids, out, kernels.FLOAT16, False, 4, 4) == -1
    assert_bit_equal(out.view(np.float16), reference(table, ids, np.float16))
    assert kernels.dequantize_serial(kernels.FORMAT_CODES["q6_k"], data, scales, ids - 8, out, kernels.FLOAT16, False, 4, 4) == 1


@pytest.mark.parametrize("offset", [1, 3])
def test_unaligned_data_scales_and_out(kernel_path, offset, tmp_path):
    """Rows, row scales and outputs at odd addresses (a file mapped at an odd offset), and a read-only mapped table."""
    source = random_quantized_table("fp8_e4m3", 64, 40, seed=offset)
    buffer = np.zeros(source.data.nbytes + source.scales.nbytes + 16, np.uint8)
    data = buffer[offset : offset + source.data.nbytes].reshape(source.data.shape)
    data[...] = source.data
    scales = buffer[offset + data.nbytes : offset + data.nbytes + source.scales.nbytes].view(np.float32)
    scales[...] = source.scales
    assert not scales.flags.aligned
    np.save(tmp_path / "rows.npy", source.data)
    mapped = np.load(tmp_path / "rows.npy", mmap_mode="r")
    ids = np.random.default_rng(offset).integers(0, 64, 100)
    for table in (QuantizedTable(data, "fp8_e4m3", 40, scales), QuantizedTable(mapped, "fp8_e4m3", 40, source.scales)):
        for dtype in OUTPUT_DTYPES:
            out_buffer = np.full(100 * 40 * dtype.itemsize + 16, 0xA5, np.uint8)
            out = out_buffer[offset : offset + 100 * 40 * dtype.itemsize].view(dtype).reshape(100, 40)
            assert BACKEND.dequantize(table, ids, out, dtype) is out
            assert_bit_equal(out, reference(source, ids, dtype))
            assert (out_buffer[:offset] == 0xA5).all() and (out_buffer[offset + out.nbytes :] == 0xA5).all()


@pytest.mark.parametrize("line_offset", [0, 16, 32, 48])
def test_streamed_rows_starting_inside_a_cache_line_are_exact(monkeypatch, line_offset):
    """An out= 0, 16, 32 or 48 bytes into a cache line, streamed: each block's stores then straddle two lines;
    rows of a partial last chunk and of many chunks, fp8_e4m3 rows looked up and decoded in one call, every output
    dtype, nothing written outside out."""
    if not numba_backend._STREAMING_CPU:
        pytest.skip("streamed stores are x86-64's")
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "STREAM_MIN_OUT_BYTES", 0)
    streaming_every_output(monkeypatch)
    gather_kernels = BACKEND.kernels()
    streamed, can_stream = [], gather_kernels.can_stream

    def recording(rows):
        streamed.append(can_stream(rows))
        return streamed[-1]

    monkeypatch.setattr(gather_kernels, "can_stream", recording)
    rng = np.random.default_rng(line_offset)
    for name, dim in (("q8_0", 96), ("q4_k", 256), ("q6_k", 4352), ("fp8_e4m3", 4104), ("q4_0", 2080),
                      ("fp8_e4m3", 4096)):
        table = random_quantized_table(name, 40, dim, seed=dim)
        if dim == 4096:  # rows of a non-finite scale are decoded, the others looked up: both kinds in one call
            table = QuantizedTable(table.data, name, dim, np.where(np.arange(40) % 3 == 0, np.inf, table.scales).astype(np.float32))
        ids = rng.integers(0, 40, 23)
        for dtype in OUTPUT_DTYPES:
            nbytes = ids.size * dim * dtype.itemsize
            buffer = np.full(nbytes + 128, 0xA5, np.uint8)
            start = (line_offset - buffer.ctypes.data) % 64
            out = buffer[start : start + nbytes].view(dtype).reshape(ids.size, dim)
            assert out.ctypes.data % 64 == line_offset and can_stream(out)
            assert BACKEND.dequantize(table, ids, out, dtype) is out
            assert_bit_equal(out, reference(table, ids, dtype))
            assert (buffer[:start] == 0xA5).all() and (buffer[start + nbytes :] == 0xA5).all()
    assert streamed and all(streamed) and not BACKEND._compiles.failed  # the kernels served, streaming


def test_lookup_serves_quantized_tables_through_the_numba_backend():
    assert set(FORMATS) <= BACKEND.capabilities.formats
    table = random_quantized_table("q4_0", 100, 64)
    ids = np.array([[1, 99], [50, 0]])
    assert_bit_equal(fastembed.lookup(table, ids, dtype=np.float16, backend="numba"), reference(table, ids, np.float16))
    facts = BACKEND.describe()
    assert "q6_k" in facts["dequantize_formats"] and facts["float16_conversion"] and facts["to_16_bits"]
    assert ("a whole line per store" in facts["dequantize_streamed_stores"]) == (
        numba_backend._STREAMING_CPU and BACKEND.dequantize_kernels().LINES_BY_PERMUTE)


@pytest.mark.parametrize("registers", [16, 32])
def test_bfloat16_outputs_stream_only_with_32_vector_registers(monkeypatch, registers):
    """With 16 vector registers most decoders into bfloat16 spill to the row loop's stack once per block, and
    streamed stores made those row loops 2-3 times slower in some processes: they take cached stores."""
    monkeypatch.setattr(dequant_cpu, "VECTOR_REGISTERS", registers)
    assert dequant_cpu.streams_well(dequant_cpu.FLOAT16)  # float16 and float32 outputs
    assert dequant_cpu.streams_well(dequant_cpu.BFLOAT16) == (registers == 32)


@pytest.mark.skipif(not numba_backend._STREAMING_CPU, reason="streamed stores are x86-64's")
def test_the_backend_streams_a_quantized_lookup_only_where_its_kernels_stream_well(monkeypatch):
    """The stream flag the kernels get, for outputs big enough to stream, is :func:`streams_well`'s answer: with 16
    vector registers (set here, whatever this CPU has), no streamed stores into bfloat16."""
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "STREAM_MIN_OUT_BYTES", 0)
    kernels = BACKEND.dequantize_kernels()
    monkeypatch.setattr(kernels, "VECTOR_REGISTERS", 16)
    tables = {name: random_quantized_table(name, 50, 256, seed=3) for name in ("q8_0", "q4_k")}
    ids = np.arange(8) * 6
    for table in tables.values():  # compiled first: a compile calls the kernels without rows
        for dtype in OUTPUT_DTYPES:
            fastembed.lookup(table, ids, dtype=dtype, backend="numba")
    flags: set[bool] = set()

    def recording(kernel, stream_at):
        def run(*args):
            flags.add(bool(args[stream_at]))
            return kernel(*args)

        return run

    monkeypatch.setattr(kernels, "dequantize_range", recording(kernels.dequantize_range, 8))
    monkeypatch.setattr(kernels, "dequantize_serial", recording(kernels.dequantize_serial, 6))
    for name, table in tables.items():
        for dtype in OUTPUT_DTYPES:
            flags.clear()
            assert_bit_equal(fastembed.lookup(table, ids, dtype=dtype, backend="numba"), reference(table, ids, dtype))
            mode = kernels.BFLOAT16 if dtype == np.dtype(ml_dtypes.bfloat16) else kernels.FLOAT16
            assert flags == {mode != kernels.BFLOAT16}, (name, dtype)
    with BACKEND._parallel_lock:  # the serial kernel, as while another thread's lookup holds the lock
        flags.clear()
        fastembed.lookup(tables["q8_0"], ids, dtype=ml_dtypes.bfloat16, backend="numba")
    assert flags == {False}


def test_concurrent_threads_get_exact_rows(monkeypatch):
    """Threads dequantizing at once (one takes the parallel kernel, the others the serial one): every row exact."""
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 64 * 1024)
    tables = {name: random_quantized_table(name, 500, 256, seed=1) for name in ("q8_0", "q4_k", "fp8_e4m3")}
    errors: list[str] = []
    stop_at = time.monotonic() + 2.0

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        while time.monotonic() < stop_at and not errors:
            name = list(tables)[int(rng.integers(0, 3))]
            ids = rng.integers(0, 500, int(rng.choice([1, 7, 300])))
            dtype = OUTPUT_DTYPES[int(rng.integers(0, 3))]
            result = BACKEND.dequantize(tables[name], ids, None, dtype)
            if not np.array_equal(result.view(np.uint8), reference(tables[name], ids, dtype).view(np.uint8)):
                errors.append(f"thread {index}: wrong rows of {name}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []


def _child_dequantize(seed: int) -> tuple[bool, bool]:
    """Whether the rows are exact, and whether fastembed's workers run in this process afterwards."""
    table = random_quantized_table("q8_0", 2000, 1024, seed=1)
    ids = np.random.default_rng(seed).integers(0, 2000, 1500)  # 3 MB of float16: parallel
    exact = np.array_equal(BACKEND.dequantize(table, ids, None, np.float16).view(np.uint16),
                           reference(table, ids, np.float16).view(np.uint16))
    return bool(exact), any(thread.name.startswith("fastembed-worker") for thread in threading.enumerate())


def test_a_child_forked_after_a_parallel_dequantize_dequantizes_in_parallel_on_workers_of_its_own():
    expected = (True, numba_backend.thread_count() > 1)
    assert _child_dequantize(0) == expected
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map_async(_child_dequantize, range(2)).get(timeout=120) == [expected] * 2
    assert _child_dequantize(1) == expected


def test_numpy_serves_while_the_kernels_compile_in_the_background(monkeypatch):
    """No compile on the caller's thread: the numpy reference serves, exactly, until the background compile is done."""
    numba_backend.background_compile.forget()
    BACKEND.reset()
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", True)
    served = []
    reference_into = numba_backend.numpy_backend.dequantize_into
    monkeypatch.setattr(numba_backend.numpy_backend, "dequantize_into",
                        lambda table, ids, out: served.append(ids.size) or reference_into(table, ids, out))
    release = threading.Event()
    compile_now = BACKEND._compile_dequantize_now
    monkeypatch.setattr(BACKEND, "_compile_dequantize_now", lambda *arguments: release.wait(30) and compile_now(*arguments))
    table = random_quantized_table("q5_1", 100, 96)
    ids = np.arange(100)[::-1].copy()
    for _ in range(2):
        assert_bit_equal(BACKEND.dequantize(table, ids, None, np.float16), reference(table, ids, np.float16))
    assert served == [100, 100]
    release.set()
    fastembed.wait_for_compiles()
    assert_bit_equal(BACKEND.dequantize(table, ids, None, np.float16), reference(table, ids, np.float16))
    assert served == [100, 100]


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "fp8_e4m3"])
def test_the_background_compile_of_a_format_calls_the_kernels_as_its_lookups_do(monkeypatch, name):
    """The background compile of a format and an output dtype calls each kernel with the format, the mode and the
    argument types that format's lookups pass, serial and parallel, streamed or not, so no lookup compiles on the
    caller's thread."""
    from numba import typeof

    numba_backend.background_compile.forget()
    BACKEND.reset()
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", True)
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "STREAM_MIN_OUT_BYTES", 2**20)
    kernels = BACKEND.dequantize_kernels()
    calls: dict[str, set] = {"compile": set(), "lookup": set()}
    phase = ["compile"]
    for kernel_name, mode_at in (("dequantize_serial", 5), ("dequantize_range", 7)):
        kernel = getattr(kernels, kernel_name)

        def spy(*args, kernel=kernel, kernel_name=kernel_name, mode_at=mode_at):
            calls[phase[0]].add((kernel_name, args[0], args[mode_at], tuple(typeof(arg) for arg in args)))
            return kernel(*args)

        monkeypatch.setattr(kernels, kernel_name, spy)
    table = random_quantized_table(name, 300, 2048)
    for dtype in OUTPUT_DTYPES:
        BACKEND.dequantize(table, np.arange(2), None, dtype)  # the numpy reference serves while they compile
    fastembed.wait_for_compiles()
    phase[0] = "lookup"
    ids = np.random.default_rng(0).integers(0, 300, 256)  # 1-2 MiB of output: streamed
    for dtype in OUTPUT_DTYPES:
        for chosen in (ids[:3], ids):
            assert_bit_equal(BACKEND.dequantize(table, chosen, None, dtype), reference(table, chosen, dtype))
            with BACKEND._parallel_lock:  # the serial kernel
                assert_bit_equal(BACKEND.dequantize(table, chosen, None, dtype), reference(table, chosen, dtype))
    assert {call[0] for call in calls["lookup"]} == {"dequantize_serial", "dequantize_range"}
    assert calls["lookup"] <= calls["compile"], calls["lookup"] - calls["compile"]


@pytest.mark.parametrize("output", ["float16", "bfloat16", "float32"])
def test_streamed_stores_stay_non_temporal_after_a_conversion(output):
    """32 float32 values converted (or not) and stored with the streaming hint compile to 16-byte non-temporal stores.

    LLVM emits ordinary stores for a converted vector unless the store
    helper keeps the conversion and the store apart; the output would then
    be read into the cache before it is written, as the hint exists to avoid.
    """
    from numba import njit, types
    from numba.extending import intrinsic

    from fastembed.kernels import dequant_ir

    put, dtype = _streamed_put(output)

    @intrinsic
    def streamed(typingctx, destination, source):
        def codegen(context, builder, signature, args):
            values = dequant_ir._load(builder, args[1], dequant_ir._vector(dequant_ir._F32, 32))
            put(builder, args[0], 0, values)  # what a block does with its values
            return context.get_dummy_value()

        return types.void(types.intp, types.intp), codegen

    @njit(cache=False)
    def convert(destination, source):
        streamed(destination, source)

    values = np.linspace(-3, 3, 32).astype(np.float32)
    out = np.zeros(32 + 16 // dtype.itemsize, dtype)
    at = -(out.ctypes.data // dtype.itemsize) % (16 // dtype.itemsize)  # 16-byte aligned
    convert(out[at:].ctypes.data, values.ctypes.data)
    assert_bit_equal(out[at:at + 32], values.astype(dtype))
    assembly = next(iter(convert.inspect_asm().values())).lower().splitlines()
    stores = sum(bool(re.search(r"\bv?movnt(dq|ps)\b", line)) for line in assembly)
    assert stores == 32 * dtype.itemsize // 16  # every byte, 16 at a time
    _assert_converted_in_registers(output, assembly)


@pytest.mark.parametrize("output", ["float16", "bfloat16", "float32"])
def test_streamed_puts_go_out_a_whole_cache_line_per_store(output):
    """Through a line buffer, streamed values go out in 64-byte non-temporal stores of whole cache lines, the
    values of a put that straddles two lines held until the next put completes the line: exact wherever the
    destination starts in its line, one put after another, and nothing written outside them."""
    from numba import njit, types
    from numba.extending import intrinsic

    from fastembed.kernels import dequant_ir

    if not dequant_ir.LINES_BY_PERMUTE:
        pytest.skip("whole-line stores need AVX-512F")
    put, dtype = _streamed_put(output, lined=True)

    @intrinsic
    def streamed(typingctx, lines, destination, source):
        def codegen(context, builder, signature, args):
            values = dequant_ir._load(builder, args[2], dequant_ir._vector(dequant_ir._F32, 32))
            put.through(args[0])(builder, args[1], 0, values)
            return context.get_dummy_value()

        return types.void(types.intp, types.intp, types.intp), codegen

    line_buffer, stack_floats, open_lines, close_lines, put_bytes = (
        dequant_ir.LINE_BUFFER_FLOATS, dequant_ir._stack_floats, dequant_ir.open_lines, dequant_ir.close_lines,
        32 * dtype.itemsize)

    @njit(cache=False)
    def convert(destination, source, n_puts):
        lines = stack_floats(line_buffer)
        open_lines(lines)
        for k in range(n_puts):
            streamed(lines, destination + k * put_bytes, source + k * 128)
        close_lines(lines)

    @njit(cache=False)
    def one_put(destination, source):
        lines = stack_floats(line_buffer)
        open_lines(lines)
        streamed(lines, destination, source)
        close_lines(lines)

    values = np.random.default_rng(1).standard_normal(32 * 5).astype(np.float32)
    for offset in (0, 16, 32, 48):
        for n_puts in (1, 2, 5):
            buffer = np.full(5 * 32 * dtype.itemsize + 128, 0xA5, np.uint8)
            start = (offset - buffer.ctypes.data) % 64
            nbytes = n_puts * 32 * dtype.itemsize
            out = buffer[start:start + nbytes].view(dtype)
            convert(out.ctypes.data, values.ctypes.data, n_puts)
            assert_bit_equal(out, values[:32 * n_puts].astype(dtype))
            assert (buffer[:start] == 0xA5).all() and (buffer[start + nbytes:] == 0xA5).all()
    one_put(out.ctypes.data, values.ctypes.data)
    assembly = next(iter(one_put.inspect_asm().values())).lower().splitlines()
    whole_lines = [line for line in assembly if re.search(r"\bv?movnt(dq|ps)\s+%zmm", line)]
    # A store of a register zeroed just before is the line buffer's zeroing (one 512-bit store on Zen 5, two 256-bit
    # ones elsewhere), not values.
    cached_zmm = [line for before, line in zip(["", *assembly], assembly, strict=False)
                  if re.search(r"\bvmov\w*\s+%zmm\d+, .*\(", line) and "movnt" not in line
                  and not _zeroes_the_register_stored(before, line)]
    assert len(whole_lines) == 32 * dtype.itemsize // 64  # a line per store
    assert len(cached_zmm) == 1, cached_zmm  # the held values, into the line buffer
    _assert_converted_in_registers(output, assembly)


def _zeroes_the_register_stored(before: str, store: str) -> bool:
    """Whether the instruction `before` zeroes (an xor of a register with itself) the register that `store` stores."""
    stored = re.search(r"%zmm(\d+),", store)
    zeroed = re.search(r"\bv?p?xor\w*\s+%[xyz]mm(\d+), %[xyz]mm\1, %[xyz]mm\1", before)
    return bool(stored and zeroed and stored.group(1) == zeroed.group(1))


def _streamed_put(output, lined=False):
    import platform

    import ml_dtypes

    from fastembed.kernels import dequant_ir

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("non-temporal stores are an x86 path")
    codes = ({"float16": dequant_ir._TO_LINED_HALVES, "bfloat16": dequant_ir._TO_LINED_BFLOAT16,
              "float32": dequant_ir._TO_LINED_FLOATS} if lined else
             {"float16": dequant_ir._TO_STREAMED_HALVES, "bfloat16": dequant_ir._TO_STREAMED_BFLOAT16,
              "float32": dequant_ir._TO_STREAMED_FLOATS})
    put = dequant_ir._PUTS[codes[output]]
    return put, np.dtype(ml_dtypes.bfloat16) if output == "bfloat16" else np.dtype(output)


def _assert_converted_in_registers(output, assembly):
    from fastembed.kernels import dequant_ir

    if output == "float16" and dequant_ir.HARDWARE_FLOAT16:
        conversions = [line for line in assembly if "cvtps2ph" in line]
        assert conversions and not any(line.rstrip().endswith(")") for line in conversions)  # none into memory


_OTHER_CPU_CHECK = """
import numpy as np
from fastembed.backends import numba_backend, numpy_backend
from fastembed.backends.numba_backend import BACKEND
from fastembed.kernels import dequant_cpu
numba_backend.COMPILE_IN_BACKGROUND = False  # the kernels serve the first call...


def refused(*args):
    raise AssertionError("the numpy reference served: the kernels did not compile")


numpy_backend.dequantize_into = refused  # ... and never the numpy reference, which serves when they cannot compile
from fastembed.formats import dequantize_rows
from fastembed.tables import random_quantized_table
print(dequant_cpu.NIBBLE_TABLE_LOOKUP, dequant_cpu.NIBBLE_WORD_PERMUTE, dequant_cpu.FP8_TABLE_LOOKUP,
      dequant_cpu.Q8_0_FLOAT16_ARITHMETIC)
ids = np.random.default_rng(0).integers(0, 64, 50)
for name in ("q4_0", "q4_k", "fp8_e4m3", "q8_0"):  # each path that depends on a feature (q4_1 looks up as q4_0)
    table = random_quantized_table(name, 64, 512, seed=5)
    scales = None if table.scales is None else table.scales[ids]
    expected = dequantize_rows(table.data[ids], scales, table.format, table.dim).astype(np.float16)
    for out in (None, np.full(expected.shape, 7, np.float16)):
        got = BACKEND.dequantize(table, ids, out, np.dtype(np.float16))
        assert got.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes(), name
"""


def _children(scripts: dict, timeout: float) -> dict:
    """Run child processes at once (each compiles on a core of its own) and wait: {key: (argv, env)} to {key: done}."""
    started = {key: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for key, (argv, env) in scripts.items()}
    finished = {}
    try:
        for key, child in started.items():
            stdout, stderr = child.communicate(timeout=timeout)
            finished[key] = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    finally:
        for child in started.values():
            child.kill()  # none is left behind by a timeout (a finished one ignores it)
            child.wait()
    return finished


def test_the_paths_of_cpus_without_avx512_or_avx2_are_the_reference_bit_for_bit(tmp_path):
    """The table lookups by byte shuffles (AVX2) and by lane-by-lane code (no AVX2), and q8_0 into float16 without
    float16 arithmetic (no AVX512-FP16), compiled here by hiding features, in two child processes at once. float16
    outputs take every path that depends on a feature (a bfloat16 output differs only in its integer rounding, and
    each output compiles for seconds)."""
    from numba.core import codegen

    cases = {"avx512": "True False False False"} if dequant_cpu.FP8_TABLE_LOOKUP else {}
    if dequant_cpu.NIBBLE_TABLE_LOOKUP:
        cases["avx"] = "False False False False"
    if not cases:
        pytest.skip("the CPU has no AVX2: the tests above ran the paths without it")
    children = {}
    for hidden in cases:
        features = ",".join("-" + feature[1:] if feature.startswith("+" + hidden) else feature
                            for feature in codegen.get_host_cpu_features().split(","))
        # Last, so that no feature named before it and implying it (f16c implies avx) turns it on again.
        features += ",-avx512f" if hidden == "avx512" else ",-avx"
        env = dict(os.environ, NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=str(tmp_path / hidden))
        children[hidden] = ([sys.executable, "-c", _OTHER_CPU_CHECK], env)
    for hidden, done in _children(children, timeout=900).items():
        assert done.returncode == 0, (hidden, done.stderr[-3000:])
        assert done.stdout.split("\n")[0] == cases[hidden], hidden


_COMPILED_PUTS_CHECK = """
import sys
import numpy as np
from numba.core import types
from numba.core.registry import CPUDispatcher
from fastembed.kernels import dequant_cpu, dequant_ir, dequant_lookups
block_tables = []
words_looked_up = dequant_lookups._words_looked_up
dequant_lookups._words_looked_up = lambda *args: block_tables.append(1) or words_looked_up(*args)
word, mode = np.dtype(sys.argv[1]), getattr(dequant_cpu, sys.argv[2])
data, no_scales, no_row = np.zeros((1, 34), np.uint8), np.zeros(0, np.uint8), np.full(1, -1, np.int64)
data.flags.writeable = no_scales.flags.writeable = no_row.flags.writeable = False  # as the backend passes them
rows = np.zeros((1, 32), word)
q8_0 = dequant_cpu.FORMAT_CODES["q8_0"]
dequant_cpu.dequantize_serial(q8_0, data, no_scales, no_row, rows, mode, False, 0, 0)
dequant_cpu.dequantize_range(q8_0, data, no_scales, no_row, rows, 0, 0, mode, False, 0, 0)
if sys.argv[3:] == ["loaded"]:
    sys.exit()
chunks = dequant_cpu._CHUNK_OF_FORMAT
others = [code for code, chunk in chunks.items() if code != q8_0 and chunk.signatures]
assert not others, f"only q8_0's decoder compiles for q8_0 rows, not {others}"
assert not block_tables, "no 4-bit format's block tables in q8_0's kernels"
assert not dequant_lookups._fill_fp8_e4m3_table.signatures and not dequant_lookups._fp8_e4m3_by_table.signatures
assert not dequant_cpu._put_by_stores.signatures, "inlined into the row loop, never compiled as a call per chunk"
entered_once = {"_dequantize_rows", "_dequantize_serial", "readable_rows",
                *(kernel.__name__ for kernel in (*dequant_cpu._ROWS_OF_MODE.values(), *dequant_cpu._SERIAL_OF_MODE.values()))}
for module in (dequant_cpu, dequant_lookups, dequant_ir):
    for name, function in vars(module).items():
        if isinstance(function, CPUDispatcher) and function.__module__ == module.__name__ and name not in entered_once:
            for signature in function.signatures:  # an array argument costs a reference count, an atomic, per call
                assert not any(isinstance(arg, types.Array) for arg in signature), (name, signature)
puts = {getattr(signature[4], "literal_value", None) for signature in chunks[q8_0].signatures}
names = {getattr(dequant_ir, name): name for name in dir(dequant_ir) if name.startswith("_TO_")}
print(len(dequant_cpu._dequantize_rows.signatures), " ".join(sorted(names[put] for put in puts)))
"""


def test_a_kernel_compiles_the_decoder_of_its_format_and_the_puts_of_its_output_alone(tmp_path):
    """The kernels for a format and an output compile that format's decoder with that output's puts and no other
    format's decoder, table or fill, nor another output's puts; nothing called per row or chunk takes an array; the
    serial kernel calls the very row loop the backend calls in parallel (compiled once), from an empty cache; and a
    second process loads them from the cache, writing nothing. Float32 and float16 outputs, in child processes at
    once (bfloat16 and FLOAT16_BITS take the same choice by the mode's value, and each compile costs seconds)."""
    puts = {"float32": "_TO_FLOATS _TO_LINED_FLOATS _TO_STREAMED_FLOATS",
            "uint16": "_TO_HALVES _TO_LINED_HALVES _TO_STREAMED_HALVES"}
    envs = {word: dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / word)) for word in puts}
    compiled = _children({word: ([sys.executable, "-c", _COMPILED_PUTS_CHECK, word, "FLOAT16"], envs[word])
                          for word in puts}, timeout=600)
    for word, done in compiled.items():
        assert done.returncode == 0, (word, done.stderr[-3000:])
        assert done.stdout.split("\n")[0] == f"1 {puts[word]}", word
    cached = sorted(tmp_path.rglob("*"))
    loaded = _children({word: ([sys.executable, "-c", _COMPILED_PUTS_CHECK, word, "FLOAT16", "loaded"], envs[word])
                        for word in puts}, timeout=600)
    for word, done in loaded.items():
        assert done.returncode == 0, (word, done.stderr[-3000:])
    assert sorted(tmp_path.rglob("*")) == cached, "a second process loads the kernels and writes nothing new"


_MARKER_NAMES = """
import sys
import numba
import numpy as np
from numba.core import itanium_mangler
for k in range(int(sys.argv[1])):  # record types typed first take the numbers a process counts
    numba.typeof(np.empty(0, np.dtype([(f"field{k}", np.uint8)])))
from fastembed.kernels import dequant_cpu
for code, marker in sorted(dequant_cpu.FORMAT_MARKERS.items()):
    print(code, itanium_mangler.mangle_type_or_value(numba.typeof(marker)))
"""


def test_each_formats_kernels_have_names_of_their_own_in_every_process():
    """A kernel loaded from numba's cache links each function it calls to one of the same name the process already
    holds: the format's part of those names (its marker's type) is the same in every process and differs between
    formats, so a cached kernel never runs another format's row loop."""
    runs = [subprocess.run([sys.executable, "-c", _MARKER_NAMES, str(typed_before)], capture_output=True, text=True,
                           timeout=120) for typed_before in (0, 3)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    names = [run.stdout.split("\n") for run in runs]
    assert names[0] == names[1]
    assert len({line.split()[1] for line in names[0] if line}) == len(FORMATS)  # each format's own


_STACK_STORES_CODE = """
import re
import numpy as np
import fastembed
from fastembed.kernels import dequant_cpu, dequant_ir
from fastembed.tables import random_quantized_table


def stack_stores(dispatcher):
    for signature, assembly in dispatcher.inspect_asm().items():
        code = assembly.split("_ZN7cpython")[0]  # the function, without numba's wrapper for Python
        yield signature, len(re.findall(r"^\\s+v?mov\\w*\\s+%\\w+, -?\\w*[(]%rsp[)]", code, re.M))


table = random_quantized_table("q4_k", 16, 512, 0)
for dtype in (np.float32, np.float16):
    fastembed.lookup(table, np.zeros(2048, np.int64), out=np.empty((2048, 512), dtype), dtype=np.dtype(dtype))
fastembed.wait_for_compiles()
for signature, count in stack_stores(dequant_cpu._dequantize_rows):
    print("rows", signature[4].dtype, count)
source = np.random.default_rng(0).integers(0, 256, 512, np.uint8)
destination = np.zeros(2048, np.uint8)
at = destination.ctypes.data + (-destination.ctypes.data % 64)
for name in dequant_cpu.FORMAT_CODES:
    chunk = getattr(dequant_cpu, "_" + name)
    for put in (dequant_ir._TO_STREAMED_FLOATS, dequant_ir._TO_STREAMED_HALVES):
        chunk(source.ctypes.data, 32, np.float32(1), at, put, 0)  # one block (fp8_e4m3: 32 values)
    for signature, count in stack_stores(chunk):
        print("chunk", name, count)
"""


@pytest.mark.skipif(not dequant_cpu.NIBBLE_TABLE_LOOKUP, reason="the kernels' x86-64 vector code needs AVX2")
def test_no_streamed_decoder_spills_registers_to_its_stack(tmp_path):
    """Compiled for 16 vector registers (AVX-512 hidden from numba): every block decoder putting float32 or float16
    values with streamed stores keeps them in registers, and q4_k's row loop into float16 by table stores to its
    stack no more often than its row loop into float32. Streamed stores behind spills made a row loop 2-3 times
    slower in some processes (a block's eight q4_k tables made at once spilled so). From an empty cache, so that
    numba keeps the assembly."""
    from numba.core import codegen

    # GFNI hidden too: with it the compiler may shift q6_k's bytes by an affine transform whose constant it keeps on
    # the stack (Zen 5's tuning does), a store per block call, not a spill of the decoded values this test is about.
    features = ",".join(feature for feature in codegen.get_host_cpu_features().split(",")
                        if not feature.startswith("+avx512") and feature != "+gfni") + ",-avx512f,-gfni"
    run = subprocess.run([sys.executable, "-c", _STACK_STORES_CODE], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_CPU_FEATURES=features))
    assert run.returncode == 0, run.stderr[-3000:]
    rows: dict[str, list[int]] = {}
    chunks: dict[str, list[int]] = {}
    for line in run.stdout.strip().split("\n"):
        kind, name, count = line.split()
        (rows if kind == "rows" else chunks).setdefault(name, []).append(int(count))
    assert rows["float32"] and min(rows["float32"]) > 0, rows  # the pattern finds the row loop's own stores
    assert max(rows["uint16"]) <= min(rows["float32"]), rows
    assert set(chunks) == set(dequant_cpu.FORMAT_CODES), chunks
    assert all(count == 0 for counts in chunks.values() for count in counts), chunks
