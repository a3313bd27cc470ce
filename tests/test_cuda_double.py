"""The CuPy test double refuses what a real launch or a real GPU would not survive.

These check the checker: if the double were lenient, tests/test_cuda_gpu.py
could pass on it and fail on a GPU. Skipped where real cupy sees a device.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupy_double import is_double
from fastembed.backends import cuda_backend


@pytest.fixture
def double(cupy_or_double):
    if not is_double(cupy_or_double):
        pytest.skip("real cupy with a device: these tests check the double")
    return cupy_or_double


def kernel_and_arguments(double, id_type="long long", vec_type="uint4", vec=16):
    module = double.RawModule(code=cuda_backend.KERNEL_SOURCE.read_text(), options=cuda_backend.COMPILE_OPTIONS,
                              name_expressions=list(cuda_backend.KERNEL_NAMES))
    kernel = module.get_function(f"gather_rows<{id_type}, {vec_type}>")
    table = double.asarray(np.arange(10 * 32, dtype=np.uint8).reshape(10, 32))
    ids = double.asarray(np.array([1, 2, 3], np.int64 if id_type == "long long" else np.int32))
    out = double.empty((3, 32), double.uint8)
    flag = double.full(1, cuda_backend.NO_ERROR, dtype=double.uint64)
    return kernel, [table, ids, out, np.int64(3), np.int64(10), np.int64(32 // vec), flag]


def test_a_correct_launch_runs(double):
    kernel, args = kernel_and_arguments(double)
    kernel((2,), (32,), tuple(args))
    np.testing.assert_array_equal(args[2].get(), args[0].get()[[1, 2, 3]])
    assert int(args[6].get()[0]) == int(cuda_backend.NO_ERROR)


@pytest.mark.parametrize("index", [3, 4, 5])
def test_python_ints_and_narrow_scalars_are_refused(double, index):
    kernel, args = kernel_and_arguments(double)
    for wrong in (int(args[index]), np.int32(args[index])):
        args[index] = wrong
        with pytest.raises(TypeError, match="numpy.int64"):
            kernel((2,), (32,), tuple(args))


def test_pointers_must_be_device_arrays_of_the_right_kind(double):
    kernel, args = kernel_and_arguments(double)
    with pytest.raises(TypeError, match="cupy array"):
        kernel((2,), (32,), (args[0].get(), *args[1:]))
    with pytest.raises(TypeError, match="ids are int32"):
        kernel((2,), (32,), (args[0], args[1].astype(np.int32), *args[2:]))
    with pytest.raises(TypeError, match="grid"):
        kernel(2, (32,), tuple(args))
    with pytest.raises(double.CUDADriverError, match="INVALID_VALUE"):
        kernel((2,), (2048,), tuple(args))


def test_misaligned_vectors_are_refused(double):
    kernel, args = kernel_and_arguments(double)
    buffer = double.empty(8 + 10 * 32, double.uint8)
    args[0] = buffer[8:].reshape(10, 32)  # 8-byte aligned: not enough for uint4
    with pytest.raises(double.CUDADriverError, match="MISALIGNED"):
        kernel((2,), (32,), tuple(args))


def test_arrays_on_another_device_are_refused(double):
    kernel, args = kernel_and_arguments(double)
    with double.cuda.Device(1):
        args[2] = double.empty((3, 32), double.uint8)
    with pytest.raises(double.CUDADriverError, match="lives on cuda:1"):
        kernel((2,), (32,), tuple(args))


def test_a_read_outside_the_table_poisons_the_device_until_reinstalled(double):
    kernel, args = kernel_and_arguments(double)
    args[4] = np.int64(11)  # the kernel is told of a row the table does not have
    args[1] = double.asarray(np.array([1, 10, 3], np.int64))
    with pytest.raises(double.CUDADriverError, match="ILLEGAL_ADDRESS"):
        kernel((2,), (32,), tuple(args))
    with pytest.raises(double.CUDARuntimeError, match="sticky"):
        double.empty(4)
    double._reset_double()
    double.empty(4)


def test_an_output_too_small_is_refused(double):
    kernel, args = kernel_and_arguments(double)
    args[2] = double.empty((2, 32), double.uint8)
    with pytest.raises(double.CUDADriverError, match="out holds"):
        kernel((2,), (32,), tuple(args))


def test_no_implicit_host_conversion_and_unsupported_dtypes(double):
    array = double.arange(4)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(array)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with pytest.raises(ValueError, match="Unsupported dtype"):
        double.asarray(np.zeros(3, ml_dtypes.bfloat16))


def test_name_expressions_are_required_for_get_function(double):
    module = double.RawModule(code=cuda_backend.KERNEL_SOURCE.read_text(), options=cuda_backend.COMPILE_OPTIONS,
                              name_expressions=["gather_rows<int, uint2>"])
    module.get_function("gather_rows<int, uint2>")
    with pytest.raises(KeyError):
        module.get_function("gather_rows<int, uint4>")


def test_a_misaligned_vector_access_inside_the_kernel_aborts(tmp_path):
    """x86 may run a misaligned load that a GPU faults on, or crash silently: the emulation aborts and says why."""
    from pathlib import Path

    from helpers import run_script

    script = f"""
import ctypes, sys
import numpy as np
sys.path.insert(0, {str(Path(__file__).parent / "cupy_double")!r})
import cupy
from fastembed.backends import cuda_backend

library = cupy._library(cuda_backend.KERNEL_SOURCE.read_text(), cuda_backend.COMPILE_OPTIONS)
memory = np.zeros(4096, np.uint8)
start = -memory.ctypes.data % 16
table, out = memory[start + 1 : start + 1025], memory[start + 2048 : start + 3072]  # the table 1 byte past 16
ids, flag, fault = np.zeros(1, np.int32), np.full(1, np.iinfo(np.uint64).max, np.uint64), ctypes.c_void_p()
library.fe_emulated_gather(4, 16, 1, 32, None, table.ctypes.data, ids.ctypes.data, out.ctypes.data, 1, 1, 64,
                           flag.ctypes.data, None, 0, ctypes.byref(fault))
print("the launch ran")
"""
    completed = run_script(tmp_path, script)
    assert completed.returncode != 0 and "the launch ran" not in completed.stdout
    assert "misaligned address" in completed.stderr
