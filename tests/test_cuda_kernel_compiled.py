"""The CUDA kernel, verified without a GPU.

(a) nvcc compiles fastembed/kernels/gather.cu for sm_90: the PTX uses 16-byte
    read-only vector loads (ld.global.nc.v4) and 16-byte stores, and ptxas
    reports zero spill bytes for every instantiation.
(b) g++ compiles the same source with tests/cuda_emulation/cuda_host.h, which
    runs every thread of a launch sequentially, blocks in a shuffled order,
    and refuses every read outside the table and the ids; results are
    compared with numpy for widths 4096, 4095, 8 and 1, int32 and int64 ids,
    and bad ids. The host side's vector-width and geometry choices drive the
    emulated launches, so both halves of the backend are exercised. (The
    CuPy double, tests/cupy_double/, runs the whole backend on the same
    emulation: tests/test_cuda_gpu.py.)
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fastembed.backends import cuda_backend
from helpers import poisoned, random_table

KERNEL = cuda_backend.KERNEL_SOURCE
EMULATION = Path(__file__).parent / "cuda_emulation"
NO_ERROR = int(cuda_backend.NO_ERROR)


def instantiations() -> str:
    lines = ['#include "gather.cu"']
    for id_type in cuda_backend.ID_TYPES.values():
        for _, vec in cuda_backend.VECTOR_TYPES:
            lines.append(
                f"template __global__ void gather_rows<{id_type}, {vec}>(const {vec}*, const {id_type}*, {vec}*, "
                "long long, long long, long long, unsigned long long*);"
            )
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def nvcc_build(tmp_path_factory):
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)
    if nvcc is None:
        pytest.skip("nvcc is not installed: the CUDA compile checks need it")
    folder = tmp_path_factory.mktemp("nvcc")
    source = folder / "instantiate.cu"
    source.write_text(instantiations())
    common = [nvcc, "-arch=sm_90", "-std=c++17", f"-I{KERNEL.parent}", str(source)]
    subprocess.run([*common, "-ptx", "-o", str(folder / "gather.ptx")], check=True, capture_output=True, text=True)
    report = subprocess.run([*common, "-cubin", "-Xptxas", "-v", "-o", str(folder / "gather.cubin")],
                            check=True, capture_output=True, text=True)
    return (folder / "gather.ptx").read_text(), report.stderr + report.stdout


def test_ptx_uses_16_byte_read_only_vector_loads_and_stores(nvcc_build):
    ptx, _ = nvcc_build
    assert re.search(r"ld\.global\.nc\.v4\.u32", ptx), "no 16-byte read-only vector load"
    assert re.search(r"st\.global\.v4\.u32", ptx), "no 16-byte vector store"
    assert "bar.sync" not in ptx and ".shared" not in ptx, "the kernel must use neither barriers nor shared memory"


def test_no_register_spills(nvcc_build):
    _, report = nvcc_build
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == 2 * len(cuda_backend.VECTOR_TYPES)
    assert all(stores == "0" and loads == "0" for stores, loads in spills), report


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed: the host emulation of the CUDA kernel needs it")
    library = tmp_path_factory.mktemp("emulation") / "gather_emulated.so"
    subprocess.run([compiler, "-O1", "-std=c++17", "-Wall", "-Werror", "-shared", "-fPIC", "-fsanitize=alignment",
                    "-fno-sanitize-recover=all", f"-I{EMULATION}",
                    f"-I{KERNEL.parent}", str(EMULATION / "driver.cpp"), "-o", str(library)], check=True)
    handle = ctypes.CDLL(str(library))
    handle.fe_emulated_gather.restype = ctypes.c_int
    handle.fe_emulated_gather.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong,
                                          ctypes.c_longlong, ctypes.c_longlong, ctypes.POINTER(ctypes.c_ulonglong),
                                          ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    return handle


def emulated_gather(handle, table: np.ndarray, ids: np.ndarray, out: np.ndarray, sm_count: int = 2,
                    vocab_size: int | None = None, expected_status: int = 0, seed: int = 0) -> int:
    """One launch, with the vector width and geometry the cuda backend would choose, blocks shuffled.

    Only the table's and the ids' bytes are readable; `vocab_size` (default:
    the table's rows) is what the kernel is told.
    """
    row_bytes = table.shape[1] * table.dtype.itemsize
    vec_bytes, _ = cuda_backend.vector_bytes(row_bytes, table.ctypes.data, out.ctypes.data)
    vecs_per_row = row_bytes // vec_bytes
    blocks, threads = cuda_backend.launch_geometry(ids.size, vecs_per_row, sm_count)
    order = np.random.default_rng(seed).permutation(blocks).astype(np.uint32)
    readable = (ctypes.c_void_p * 4)(table.ctypes.data, table.ctypes.data + table.nbytes, ids.ctypes.data,
                                     ids.ctypes.data + ids.nbytes)
    error, fault = ctypes.c_ulonglong(NO_ERROR), ctypes.c_void_p(0)
    status = handle.fe_emulated_gather(ids.dtype.itemsize, vec_bytes, blocks, threads, order.ctypes.data,
                                       table.ctypes.data, ids.ctypes.data, out.ctypes.data, ids.size,
                                       table.shape[0] if vocab_size is None else vocab_size, vecs_per_row,
                                       ctypes.byref(error), readable, 2, ctypes.byref(fault))
    assert status == expected_status
    return error.value


@pytest.mark.parametrize("width", [4096, 4095, 8, 1])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", ["float16", "float32", "int8", "float64"])
def test_emulated_kernel_matches_numpy(emulated, width, id_dtype, dtype):
    table = random_table(97, width, dtype, seed=width)
    ids = np.random.default_rng(width).integers(0, 97, 37).astype(id_dtype)
    out = poisoned((37, width), table.dtype)
    assert emulated_gather(emulated, table, ids, out) == NO_ERROR
    np.testing.assert_array_equal(out.view(np.uint8), table[ids].view(np.uint8))


@pytest.mark.parametrize("n_ids", [1, 6, 300])
def test_emulated_grid_stride_covers_every_row(emulated, n_ids):
    table = random_table(50, 64)
    ids = np.random.default_rng(n_ids).integers(0, 50, n_ids)
    out = poisoned((n_ids, 64), table.dtype)
    emulated_gather(emulated, table, ids, out, sm_count=1)  # fewer blocks than rows: grid-stride
    np.testing.assert_array_equal(out, table[ids])


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_emulated_bad_ids_record_first_position_and_zero_their_rows(emulated, id_dtype):
    table = random_table(40, 4095)
    ids = np.array([3, 40, 7, -1, 39, 1000], dtype=id_dtype)
    out = poisoned((6, 4095), table.dtype)
    assert emulated_gather(emulated, table, ids, out) == 1
    for position, row in enumerate(ids):
        expected = table[row] if 0 <= row < 40 else np.zeros(4095, table.dtype)
        np.testing.assert_array_equal(out[position].view(np.uint16), expected.view(np.uint16))


def test_emulation_refuses_reads_outside_the_table(emulated):
    """The check behind every emulated launch works: a kernel told of more rows than the table has faults."""
    table = random_table(10, 64)
    out = poisoned((2, 64), table.dtype)
    emulated_gather(emulated, table, np.array([1, 12]), out, vocab_size=20, expected_status=2)


@pytest.mark.parametrize("seed", range(4))
def test_emulated_first_bad_position_whatever_the_block_order(emulated, seed):
    table = random_table(30, 16)
    ids = np.array([0] * 70 + [31] + [1] * 50 + [-3], dtype=np.int64)  # 122 rows over 64 blocks: grid-stride
    out = poisoned((ids.size, 16), table.dtype)
    assert emulated_gather(emulated, table, ids, out, seed=seed) == 70


def test_vector_width_follows_row_size_and_alignment():
    assert cuda_backend.vector_bytes(8192, 0, 256) == (16, "uint4")
    assert cuda_backend.vector_bytes(8192, 8, 256) == (8, "uint2")
    assert cuda_backend.vector_bytes(8190, 0, 0) == (2, "unsigned short")
    assert cuda_backend.vector_bytes(4095, 0, 0) == (1, "unsigned char")


def test_launch_geometry_serves_one_id_and_many():
    assert cuda_backend.launch_geometry(1, 512, 132) == (1, 128)
    blocks, threads = cuda_backend.launch_geometry(65536, 512, 132)
    assert blocks == 132 * cuda_backend.BLOCKS_PER_SM and threads == 128
    assert cuda_backend.launch_geometry(6, 1, 132) == (6, 32)
