"""The CUDA dequantizing gather (fastembed/kernels/dequant.cu), verified without a GPU and unchanged on one.

(a) nvcc compiles every instantiation for sm_90 with the backend's options:
    no fused multiply-add, hardware float16/bfloat16 rounding, 16-byte loads
    and stores, no barriers or shared memory, no spills.
(b) The cuda backend on the CuPy double (tests/cupy_double: the same source
    through the host emulation, blocks shuffled, every read outside the
    data, scales and ids refused) or on a real GPU: every format into
    float32, float16 and bfloat16 bit for bit against
    fastembed.formats.dequantize_rows (NaNs compared as NaNs: a GPU returns
    its canonical NaN), int32/int64 and n-D ids, bad ids, unaligned arrays,
    to_device and lookup end to end.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import fastembed
from cupy_double import is_double
from fastembed.backends import cuda_backend
from fastembed.backends.base import DequantizingBackend
from fastembed.formats import FORMATS, QuantizedTable, dequantize_rows
from helpers import POISON_BYTE, poisoned, random_quantized

try:
    import ml_dtypes
except ImportError:  # a GPU machine may lack it; the bfloat16 and fp8 references need it
    ml_dtypes = None

BACKEND = cuda_backend.BACKEND
DTYPES = ("float32", "float16", "bfloat16")
#: The output dtypes whose reference can be computed here.
CHECKABLE = DTYPES if ml_dtypes is not None else ("float32", "float16")
#: Byte offsets of the float16 scale fields in one block of each format.
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2),
              "q5_k": (0, 2), "q6_k": (208,), "fp8_e4m3": ()}
#: float16 bits: infinities, NaN, subnormals, the largest finite, zeros, and ordinary values.
SPECIAL_HALVES = np.array([0x7C00, 0xFC00, 0x7E00, 0x0001, 0x83FF, 0x7BFF, 0xFBFF, 0x0000, 0x8000, 0x3C00, 0x5BFF,
                           0x0400], np.uint16)
#: float32 row scales: infinities, NaN, subnormals, the edge of overflow, zeros, ordinary values.
SPECIAL_SCALES = np.array([np.inf, -np.inf, np.nan, 1e-40, -1e-45, 3e38, 0.0, -0.0, 1.0, 1e-3, 65504.0], np.float32)


@pytest.fixture
def cp(cupy_or_double):
    return cupy_or_double


def require_reference(name: str | None = None, dtype: str | None = None) -> None:
    """Skip when the reference of `name` into `dtype` needs ml_dtypes and it is missing."""
    if ml_dtypes is None and (dtype == "bfloat16" or (name is not None and FORMATS[name].row_scale)):
        pytest.skip("ml_dtypes is not installed: the bfloat16 and fp8 references need it")


def dim_for(name: str) -> int:
    return 512 if FORMATS[name].block_values > 1 else 72


def reference(table: QuantizedTable, ids: np.ndarray, dtype: str) -> np.ndarray:
    """dequantize_rows of the host table's rows at `ids`, shaped ids.shape + (dim,), rounded to `dtype`."""
    flat = ids.reshape(-1)
    scales = None if table.scales is None else table.scales[flat]
    with np.errstate(over="ignore", invalid="ignore"):  # the special values overflow and make NaNs on purpose
        rows = dequantize_rows(table.data[flat], scales, table.format, table.dim).reshape(ids.shape + (table.dim,))
        return rows if dtype == "float32" else rows.astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)


def assert_dequantized(cp, result, expected: np.ndarray) -> None:
    """Same bits as `expected` (bfloat16 results are uint16 words), except that a NaN only has to be a NaN."""
    host = cp.asnumpy(result)
    assert host.shape == expected.shape
    assert host.dtype.itemsize == expected.dtype.itemsize
    words = f"u{expected.dtype.itemsize}"
    nan = np.isnan(expected.astype(np.float32))
    actual_nan = np.isnan(host.view(expected.dtype).astype(np.float32))
    np.testing.assert_array_equal(actual_nan, nan)
    np.testing.assert_array_equal(host.view(words)[~nan], np.ascontiguousarray(expected).view(words)[~nan])


def output_dtype(dtype: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def device_out(cp, shape: tuple, dtype: str):
    """A poisoned device output of the words the kernel writes for `dtype`."""
    return cp.asarray(poisoned(shape, cuda_backend.DEQUANT_OUTPUTS[dtype][1]))


def special_table(name: str, vocab: int, dim: int, seed: int) -> QuantizedTable:
    """Random bytes (fp8 NaN codes included), scale fields drawn from SPECIAL_HALVES or SPECIAL_SCALES."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (vocab, fmt.row_bytes(dim)), dtype=np.uint8)
    blocks = data.reshape(-1, fmt.block_bytes)
    for offset in F16_FIELDS[name]:
        blocks[:, offset : offset + 2] = rng.choice(SPECIAL_HALVES, blocks.shape[0]).astype("<u2").view(np.uint8).reshape(-1, 2)
    scales = rng.choice(SPECIAL_SCALES, vocab).astype(np.float32) if fmt.row_scale else None
    return QuantizedTable(data, fmt, dim, scales)


# -- every format into every dtype, bit for bit -----------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_and_dtype_matches_the_reference(cp, name, dtype):
    require_reference(name, dtype)
    host = random_quantized(name, 60, dim_for(name), seed=len(name))
    table = cuda_backend.to_device(host, 0)
    ids = np.random.default_rng(7).integers(0, 60, 70)  # more rows than the double's 64 resident blocks
    expected = reference(host, ids, dtype)
    for id_dtype in (np.int64, np.int32):
        device_ids = cp.asarray(ids.astype(id_dtype))
        assert_dequantized(cp, BACKEND.dequantize(table, device_ids, None, output_dtype(dtype)), expected)
        out = device_out(cp, ids.shape + (host.dim,), dtype)
        assert BACKEND.dequantize(table, device_ids, out, output_dtype(dtype)) is out
        assert_dequantized(cp, out, expected)  # every poisoned byte overwritten


@pytest.mark.parametrize("name", list(FORMATS))
def test_infinities_nans_subnormals_and_overflow(cp, name):
    require_reference(name)
    host = special_table(name, 40, dim_for(name), seed=3)
    table = cuda_backend.to_device(host, 0)
    ids = np.arange(40)
    for dtype in CHECKABLE:
        assert_dequantized(cp, BACKEND.dequantize(table, cp.asarray(ids), None, output_dtype(dtype)),
                           reference(host, ids, dtype))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (1,), (2, 3, 4)])
def test_empty_scalar_and_multidimensional_ids(cp, shape):
    host = random_quantized("q4_k", 30, 256, seed=2)
    table = cuda_backend.to_device(host, 0)
    ids = np.random.default_rng(1).integers(0, 30, shape)
    for id_dtype in (np.int32, np.int64):
        result = BACKEND.dequantize(table, cp.asarray(ids.astype(id_dtype)), None, output_dtype("float16"))
        assert result.shape == shape + (256,)
        assert_dequantized(cp, result, reference(host, ids, "float16"))


def test_strided_ids_are_compacted(cp):
    host = random_quantized("q8_0", 50, 64, seed=4)
    table = cuda_backend.to_device(host, 0)
    ids = np.arange(0, 50, 3)
    strided = cp.asarray(ids)[::-2]
    assert not strided.flags.c_contiguous
    assert_dequantized(cp, BACKEND.dequantize(table, strided, None, output_dtype("float32")),
                       reference(host, ids[::-2], "float32"))


@pytest.mark.parametrize("name", ["q8_0", "q4_1", "q5_1", "q4_k", "q6_k", "fp8_e4m3"])
def test_unaligned_data_and_outputs(cp, name):
    """Data at an odd address (read byte by byte) and outputs off 16 bytes (stored value by value)."""
    require_reference(name)
    host = random_quantized(name, 20, dim_for(name), seed=5)
    n_bytes = host.data.nbytes
    buffer = cp.zeros(n_bytes + 64, cp.uint8)
    buffer[1 : 1 + n_bytes] = cp.asarray(host.data.reshape(-1))
    scales = None if host.scales is None else cp.asarray(host.scales)
    table = QuantizedTable(buffer[1 : 1 + n_bytes].reshape(host.data.shape), name, host.dim, scales)
    ids = np.random.default_rng(6).integers(0, 20, 9)
    for dtype in CHECKABLE:
        words = cuda_backend.DEQUANT_OUTPUTS[dtype][1]
        size = ids.size * host.dim
        out_buffer = cp.asarray(poisoned(size + 2, words))
        out = out_buffer[1 : 1 + size].reshape(ids.shape + (host.dim,))
        assert out.data.ptr % 16
        BACKEND.dequantize(table, cp.asarray(ids), out, output_dtype(dtype))
        assert_dequantized(cp, out, reference(host, ids, dtype))
        around = cp.asnumpy(out_buffer).view(np.uint8)
        assert (around[: words.itemsize] == POISON_BYTE).all() and (around[-words.itemsize :] == POISON_BYTE).all()


@pytest.mark.parametrize("dim", [1, 12, 13, 16, 4099])
def test_fp8_rows_of_any_width(cp, dim):
    require_reference("fp8_e4m3")
    host = random_quantized("fp8_e4m3", 25, dim, seed=dim)
    table = cuda_backend.to_device(host, 0)
    ids = np.random.default_rng(dim).integers(0, 25, 11)
    for dtype in CHECKABLE:
        assert_dequantized(cp, BACKEND.dequantize(table, cp.asarray(ids), None, output_dtype(dtype)),
                           reference(host, ids, dtype))


@pytest.mark.parametrize(("output", "dtype"), [("F32", "float32"), ("F16", "float16")])
def test_the_fp8_kernel_writes_no_value_past_dim_of_rows_with_more_bytes(cp, output, dtype):
    """Rows 8-byte aligned but of fewer values (row_bytes 16, dim 12): the last unit of each row wrote 8 values, the
    next row's first 4 (and past the end of out for the last row)."""
    dim, row_bytes = 12, 16
    data = np.zeros((4, row_bytes), np.uint8)
    data[:, :dim] = 0x38  # 1.0
    kernel = dequant_module(cp, "fp8_e4m3").get_function(f"dequant_rows<FP8_E4M3, {output}, long long>")
    out = cp.full(2 * dim + 8, -7.0, dtype)  # 8 values beyond the two rows
    flag = cp.full(1, cuda_backend.NO_ERROR, dtype=cp.uint64)
    kernel((2,), (32,), (cp.asarray(data), cp.ones(4, cp.float32), cp.asarray(np.array([1, 2])), out, np.int64(2),
                         np.int64(4), np.int64(row_bytes), np.int64(dim), flag))
    assert (cp.asnumpy(out)[: 2 * dim] == 1.0).all() and (cp.asnumpy(out)[2 * dim :] == -7.0).all()


# -- bad ids ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_bad_ids_raise_before_anything_is_written(cp, id_dtype):
    host = random_quantized("q6_k", 40, 256, seed=8)
    table = cuda_backend.to_device(host, 0)
    cases = (([1, 2, 40, -5], 2), ([-1], 0), ([5, 39, 7, -2147483648], 3))
    for bad, position in cases:
        ids = cp.asarray(np.array(bad, id_dtype))
        out = device_out(cp, (len(bad), 256), "float16")
        with pytest.raises(IndexError, match=rf"^id {bad[position]} at position {position} is out of range for a "
                                             r"table of 40 rows \(valid ids are 0\.\.39\)$"):
            BACKEND.dequantize(table, ids, out, output_dtype("float16"))
        assert (cp.asnumpy(out).view(np.uint8) == POISON_BYTE).all(), "out was written before the error"
        good = np.array([5, 6], id_dtype)
        assert_dequantized(cp, BACKEND.dequantize(table, cp.asarray(good), None, output_dtype("float16")),
                           reference(host, good, "float16"))
    ids = np.array([[1, 2], [3, 1000]], id_dtype)
    with pytest.raises(IndexError, match=r"id 1000 at position \(1, 1\)"):
        BACKEND.dequantize(table, cp.asarray(ids), None, output_dtype("float32"))


def test_first_bad_position_wins_whatever_the_block_order(cp):
    host = random_quantized("q4_0", 100, 32, seed=9)
    table = cuda_backend.to_device(host, 0)
    ids = np.random.default_rng(3).integers(0, 100, 3000)
    ids[[2913, 1250, 2731]] = [100, 10**9, -1]
    for _ in range(3):  # the double shuffles blocks differently on every launch
        with pytest.raises(IndexError, match="id 1000000000 at position 1250"):
            BACKEND.dequantize(table, cp.asarray(ids), None, output_dtype("float32"))


def test_deferred_checks_write_zero_rows_and_report_later(cp):
    host = random_quantized("q5_k", 30, 256, seed=10)
    table = cuda_backend.to_device(host, 0)
    ids = np.array([1, 30, 3, -4])
    fastembed.raise_deferred_id_errors(0)
    with fastembed.deferred_id_checks():
        result = BACKEND.dequantize(table, cp.asarray(ids), None, output_dtype("float16"))
    written = cp.asnumpy(result)
    assert not written[[1, 3]].any()
    assert_dequantized(cp, result[::2], reference(host, ids[::2], "float16"))
    with pytest.raises(IndexError, match="deferred CUDA lookup on device 0 .* flattened position 1"):
        fastembed.raise_deferred_id_errors(0)
    # An immediate lookup after them neither sees nor leaves an error.
    assert_dequantized(cp, BACKEND.dequantize(table, cp.asarray([2]), None, output_dtype("float32")),
                       reference(host, np.array([2]), "float32"))
    fastembed.raise_deferred_id_errors(0)


# -- the kernels as launched --------------------------------------------------------------------------------

def test_a_lookup_launches_the_id_check_then_the_format_kernel(cp):
    if not is_double(cp):
        pytest.skip("the launch log is the double's")
    table = cuda_backend.to_device(random_quantized("q4_k", 10, 512, seed=1), 0)
    BACKEND.dequantize(table, cp.asarray(np.array([1, 2], np.int32)), None, output_dtype("float16"))
    assert [launch[0] for launch in list(cp.launches)[-2:]] == ["check_ids<int>", "dequant_rows<Q4_K, F16, int>"]
    with pytest.raises(IndexError):
        BACKEND.dequantize(table, cp.asarray(np.array([11])), None, output_dtype("float16"))
    assert cp.launches[-1][0] == "check_ids<long long>"  # nothing written: the dequantizing kernel never ran
    before = len(cp.launches)
    with fastembed.deferred_id_checks():  # no id check: the format kernel alone
        BACKEND.dequantize(table, cp.asarray(np.array([3])), None, output_dtype("float32"))
    assert [launch[0] for launch in list(cp.launches)[before:]] == ["dequant_rows<Q4_K, F32, long long>"]


def dequant_module(cp, name: str, options=cuda_backend.DEQUANT_COMPILE_OPTIONS):
    return cp.RawModule(code=cuda_backend.DEQUANT_SOURCE.read_text(), options=options,
                        name_expressions=list(cuda_backend.dequant_kernel_names(name)))


def test_the_double_refuses_a_module_that_may_fuse_multiply_adds(cp):
    if not is_double(cp):
        pytest.skip("checks the double")
    with pytest.raises(cp.CompileException, match="--fmad=false"):
        dequant_module(cp, "q4_1", options=("-std=c++17",))
    with pytest.raises(cp.CompileException, match="use_fast_math"):
        dequant_module(cp, "q4_1", options=(*cuda_backend.DEQUANT_COMPILE_OPTIONS, "--use_fast_math"))


def test_a_read_outside_the_data_is_caught(cp):
    """The check behind every emulated launch: a kernel told of more rows than the data has faults."""
    if not is_double(cp):
        pytest.skip("checks the double")
    host = random_quantized("q8_0", 10, 64, seed=1)
    data = cp.asarray(host.data)
    kernel = dequant_module(cp, "q8_0").get_function("dequant_rows<Q8_0, F32, long long>")
    out = cp.empty((2, 64), cp.float32)
    flag = cp.full(1, cuda_backend.NO_ERROR, dtype=cp.uint64)
    args = (data, cp.zeros(1, cp.float32), cp.asarray(np.array([1, 12])), out, np.int64(2), np.int64(20),
            np.int64(68), np.int64(64), flag)
    with pytest.raises(cp.CUDADriverError, match="ILLEGAL_ADDRESS"):
        kernel((2,), (32,), args)
    cp._reset_double()


def test_the_double_checks_dequant_arguments(cp):
    if not is_double(cp):
        pytest.skip("checks the double")
    kernel = dequant_module(cp, "q8_0").get_function("dequant_rows<Q8_0, F16, int>")
    data = cp.asarray(random_quantized("q8_0", 4, 32, seed=1).data)
    ids = cp.asarray(np.array([1], np.int32))
    flag = cp.full(1, cuda_backend.NO_ERROR, dtype=cp.uint64)
    sizes = (np.int64(1), np.int64(4), np.int64(34), np.int64(32))
    with pytest.raises(TypeError, match="2-byte values"):
        kernel((1,), (32,), (data, cp.zeros(1, cp.float32), ids, cp.empty((1, 32), cp.float32), *sizes, flag))
    with pytest.raises(TypeError, match="numpy.int64"):
        kernel((1,), (32,), (data, cp.zeros(1, cp.float32), ids, cp.empty((1, 32), cp.float16), 1, *sizes[1:], flag))
    with pytest.raises(cp.CUDADriverError, match="out holds"):
        kernel((1,), (32,), (data, cp.zeros(1, cp.float32), ids, cp.empty((1, 16), cp.float16), *sizes, flag))


# -- the backend, dispatch, to_device and lookup ----------------------------------------------------------

def test_the_backend_declares_every_format():
    assert isinstance(BACKEND, DequantizingBackend)
    assert BACKEND.capabilities.formats == frozenset({"dense", *FORMATS})
    assert set(cuda_backend.DEQUANT_FORMATS) == set(FORMATS)
    for name, (_, values) in cuda_backend.DEQUANT_FORMATS.items():
        assert values % 8 == 0 and (FORMATS[name].block_values == 1 or FORMATS[name].block_values % values == 0)


def test_to_device_moves_data_and_scales(cp):
    for name in ("q4_k", "fp8_e4m3") if ml_dtypes is not None else ("q4_k",):
        host = random_quantized(name, 12, 256, seed=3)
        device = cuda_backend.to_device(host, 0)
        assert isinstance(device, QuantizedTable) and device.format is host.format and device.dim == 256
        assert isinstance(device.data, cp.ndarray)
        np.testing.assert_array_equal(cp.asnumpy(device.data), host.data)
        if host.scales is None:
            assert device.scales is None
        else:
            np.testing.assert_array_equal(cp.asnumpy(device.scales), host.scales)
        emb = fastembed.Embedding(host).to_device()
        assert emb.device == "cuda:0" and isinstance(emb.table.data, cp.ndarray)
        ids = np.array([[3, 0], [11, 7]])
        assert_dequantized(cp, emb(ids), reference(host, ids, "float32"))
        for dtype in CHECKABLE:
            assert_dequantized(cp, emb(ids, dtype=dtype), reference(host, ids, dtype))


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_k", "q6_k", "fp8_e4m3"])
def test_lookup_end_to_end(cp, name):
    require_reference(name)
    host = random_quantized(name, 50, dim_for(name), seed=11)
    table = cuda_backend.to_device(host, 0)
    ids = np.random.default_rng(12).integers(0, 50, (3, 5))
    assert fastembed.select_backend(table, ids).backend == "cuda"
    for dtype in CHECKABLE:
        result = fastembed.lookup(table, ids, dtype=dtype)
        assert isinstance(result, cp.ndarray)
        assert_dequantized(cp, result, reference(host, ids, dtype))
    assert_dequantized(cp, fastembed.lookup(table, cp.asarray(ids.astype(np.int32))), reference(host, ids, "float32"))
    for dtype in CHECKABLE:
        out = device_out(cp, ids.shape + (host.dim,), dtype)
        assert fastembed.lookup(table, ids, out=out, dtype=dtype) is out
        assert_dequantized(cp, out, reference(host, ids, dtype))
    out = device_out(cp, (2, host.dim), "float16")
    with pytest.raises(IndexError, match="id 50 at position 1"):
        fastembed.lookup(table, [3, 50], out=out, dtype="float16")
    assert (cp.asnumpy(out).view(np.uint8) == POISON_BYTE).all()


def test_host_quantized_tables_are_never_moved(cp):
    host = random_quantized("q8_0", 10, 32, seed=1)
    selection = fastembed.select_backend(host, [1])
    assert selection.backend != "cuda"
    assert any("never moves a table implicitly" in reason for reason in selection.skipped["cuda"])


def test_reset_forgets_the_dequantizing_modules(cp):
    table = cuda_backend.to_device(random_quantized("q5_0", 10, 64, seed=1), 0)
    BACKEND.dequantize(table, cp.asarray([1]), None, output_dtype("float32"))
    assert BACKEND._dequant_modules
    BACKEND.reset()
    assert not BACKEND._dequant_modules and not BACKEND._kernels
    assert_dequantized(cp, BACKEND.dequantize(table, cp.asarray([1, 9]), None, output_dtype("float32")),
                       reference(random_quantized("q5_0", 10, 64, seed=1), np.array([1, 9]), "float32"))


def test_real_gpu_modules_compile_with_nvrtc_and_do_not_spill(cp):
    if is_double(cp):
        pytest.skip("needs a CUDA device: the double compiles with g++, not NVRTC, and has no register counts")
    for name in FORMATS:
        module = dequant_module(cp, name)
        for kernel_name in cuda_backend.dequant_kernel_names(name):
            attributes = module.get_function(kernel_name).attributes
            assert attributes["local_size_bytes"] == 0, (kernel_name, attributes)


# -- (a) nvcc ---------------------------------------------------------------------------------------------

def instantiations() -> str:
    lines = ['#include "dequant.cu"']
    for name in FORMATS:
        for output, (_, words) in cuda_backend.DEQUANT_OUTPUTS.items():
            value = "float" if words == np.float32 else "unsigned short"
            for id_type in cuda_backend.ID_TYPES.values():
                kernel = cuda_backend.dequant_kernel_name(name, output, id_type)
                lines.append(f"template __global__ void {kernel}(const unsigned char*, const float*, const {id_type}*, "
                             f"{value}*, long long, long long, long long, long long, unsigned long long*);")
    for id_type in cuda_backend.ID_TYPES.values():
        lines.append(f"template __global__ void {cuda_backend.check_kernel_name(id_type)}(const {id_type}*, long long, "
                     "long long, unsigned long long*);")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def nvcc_build(tmp_path_factory):
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)
    ptxas = (shutil.which("ptxas") or str(Path(nvcc).with_name("ptxas"))) if nvcc else None
    if nvcc is None or ptxas is None or not Path(ptxas).exists():
        pytest.skip("nvcc and ptxas are not installed: the CUDA compile checks need them")
    folder = tmp_path_factory.mktemp("nvcc_dequant")
    source = folder / "instantiate.cu"
    source.write_text(instantiations())
    ptx = folder / "dequant.ptx"
    subprocess.run([nvcc, "-arch=sm_90", *cuda_backend.DEQUANT_COMPILE_OPTIONS, f"-I{cuda_backend.DEQUANT_SOURCE.parent}",
                    str(source), "-ptx", "-o", str(ptx)], check=True, capture_output=True, text=True)
    report = subprocess.run([ptxas, "-arch=sm_90", "-v", str(ptx), "-o", str(folder / "dequant.cubin")],
                            check=True, capture_output=True, text=True)
    return ptx.read_text(), report.stderr + report.stdout


def test_ptx_rounds_every_operation_on_its_own(nvcc_build):
    ptx, _ = nvcc_build
    assert not re.search(r"\b(fma|mad)\.", ptx), "a fused multiply-add would change results"
    assert re.search(r"mul\.rn\.f32", ptx) and re.search(r"sub\.rn\.f32", ptx) and re.search(r"add\.rn\.f32", ptx)
    assert ".ftz" not in ptx, "subnormals must not be flushed"
    assert re.search(r"cvt\.rn\.f16\.f32", ptx) and re.search(r"cvt\.rn\.bf16\.f32", ptx)


def test_ptx_uses_wide_loads_and_16_byte_stores(nvcc_build):
    ptx, _ = nvcc_build
    assert re.search(r"ld\.global\.nc\.v4\.u32", ptx) and re.search(r"ld\.global\.nc\.v2\.u32", ptx)
    assert re.search(r"st\.global(\.wb)?\.v4\.u32", ptx), "no 16-byte store"
    assert "bar.sync" not in ptx and ".shared" not in ptx, "the kernels must use neither barriers nor shared memory"


def test_no_register_spills(nvcc_build):
    _, report = nvcc_build
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(FORMATS) * len(cuda_backend.DEQUANT_OUTPUTS) * 2 + 2
    assert all(stores == "0" and loads == "0" for stores, loads in spills), report
