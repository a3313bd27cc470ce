"""The cuda backend end to end: on a real GPU where cupy sees one, else on the CuPy test double.

Every test takes the ``cupy_or_double`` fixture (tests/conftest.py): the
real cupy when it imports and sees a device, otherwise the double of
tests/cupy_double, which runs the very kernel source through the host
emulation (blocks shuffled, reads outside the table refused). The same
tests therefore run in CI without a GPU and unchanged on one
(bench/gpu_check.sh).
"""
from __future__ import annotations

import contextlib
import re
import threading

import numpy as np
import pytest

import fastembed
from cupy_double import is_double
from fastembed import dispatch
from fastembed.backends import cuda_backend
from helpers import interrupted_runs, poisoned, random_quantized, random_table

POISON = 0xA5


@pytest.fixture
def cp(cupy_or_double):
    return cupy_or_double


def device_poisoned(cp, shape, dtype):
    """A device output whose bytes are garbage, so an unwritten row cannot pass."""
    return cp.asarray(poisoned(shape, dtype))


def assert_rows(result, expected: np.ndarray, cp) -> None:
    host = cp.asnumpy(result)
    assert host.shape == expected.shape and host.dtype == expected.dtype
    np.testing.assert_array_equal(host.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))


def last_kernel(cp) -> str | None:
    """The instantiation the double launched last (None on a real GPU)."""
    return cp.launches[-1][0] if is_double(cp) and cp.launches else None


# -- lookups on device tables -----------------------------------------------------------------------------

@pytest.mark.parametrize("width", [4096, 4095, 8, 1])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", ["float16", "float32", "int8", "float64"])
def test_lookup_matches_numpy(cp, width, id_dtype, dtype):
    host = random_table(300, width, dtype, seed=width)
    emb = fastembed.Embedding(host).to_device()
    assert emb.device == "cuda:0" and emb.dtype == host.dtype
    ids = np.random.default_rng(width).integers(0, 300, (7, 9)).astype(id_dtype)
    for given in (ids, cp.asarray(ids)):
        result = emb(given)
        assert isinstance(result, cp.ndarray) and result.shape == (7, 9, width)
        assert_rows(result, host[ids], cp)
    out = device_poisoned(cp, (7, 9, width), host.dtype)
    assert emb(cp.asarray(ids), out=out) is out
    assert_rows(out, host[ids], cp)
    assert fastembed.select_backend(emb.table, ids).backend == "cuda"


def test_a_cast_of_a_dense_device_table_is_refused_alike_by_select_backend_and_lookup(cp):
    table = cp.asarray(random_table(50, 8, np.float32))
    out = device_poisoned(cp, (2, 8), np.float16)
    for call in (lambda: fastembed.select_backend(table, [1, 2], dtype="float16"),
                 lambda: fastembed.lookup(table, [1, 2], dtype="float16"),
                 lambda: fastembed.lookup(table, [1, 2], out=out, dtype="float16"),
                 lambda: fastembed.Embedding(table)([1, 2], dtype="float16")):
        with pytest.raises(TypeError, match="dtype= casts host tables only; gather this cupy table in its own dtype"):
            call()
    assert (cp.asnumpy(out).view(np.uint8) == POISON).all()


@pytest.mark.parametrize(("row_bytes", "table_offset", "out_offset", "vector"), [
    (64, 0, 0, 16), (48, 0, 0, 16), (40, 0, 0, 8), (64, 8, 0, 8), (64, 0, 24, 8), (36, 0, 0, 4), (64, 4, 0, 4),
    (64, 0, 12, 4), (18, 0, 0, 2), (64, 2, 6, 2), (21, 0, 0, 1), (64, 1, 0, 1), (64, 0, 3, 1), (7, 5, 9, 1),
])
def test_every_vector_width_on_odd_widths_and_unaligned_rows(cp, row_bytes, table_offset, out_offset, vector):
    """Tables and outputs at any byte offset (views into larger buffers): 16, 8, 4, 2 and 1-byte vectors."""
    vocab, n = 50, 77  # more ids than the double's 64 resident blocks: grid-stride
    host = random_table(vocab, row_bytes, "uint8", seed=row_bytes + table_offset)
    table_buffer = cp.zeros(table_offset + vocab * row_bytes + 64, cp.uint8)
    table_buffer[table_offset : table_offset + vocab * row_bytes] = cp.asarray(host.reshape(-1))
    table = table_buffer[table_offset : table_offset + vocab * row_bytes].reshape(vocab, row_bytes)
    out_buffer = cp.asarray(np.full(out_offset + n * row_bytes + 32, POISON, np.uint8))
    out = out_buffer[out_offset : out_offset + n * row_bytes].reshape(n, row_bytes)
    assert cuda_backend.vector_bytes(row_bytes, table.data.ptr, out.data.ptr)[0] == vector
    ids = np.random.default_rng(vector).integers(0, vocab, n)
    fastembed.lookup(table, ids, out=out)
    assert_rows(out, host[ids], cp)
    around = cp.asnumpy(out_buffer)
    assert (around[:out_offset] == POISON).all() and (around[out_offset + n * row_bytes :] == POISON).all()
    if is_double(cp):
        assert last_kernel(cp).endswith(f"{dict(cuda_backend.VECTOR_TYPES)[vector]}>")


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4), (), (1,), (2, 3, 4), (70,)])
def test_empty_scalar_and_multidimensional_ids(cp, shape):
    host = random_table(40, 24)
    table = cuda_backend.to_device(host, 0)
    ids = np.random.default_rng(1).integers(0, 40, shape)
    for given in (ids, cp.asarray(ids), ids.astype(np.int32)):
        result = fastembed.lookup(table, given)
        assert result.shape == shape + (24,)
        assert_rows(result, host[ids], cp)
        out = device_poisoned(cp, shape + (24,), host.dtype)
        fastembed.lookup(table, given, out=out)
        assert_rows(out, host[ids], cp)


def test_python_lists_strided_and_other_integer_ids(cp):
    host = random_table(100, 16)
    table = cuda_backend.to_device(host, 0)
    assert_rows(fastembed.lookup(table, [3, 1, 4]), host[[3, 1, 4]], cp)
    assert fastembed.lookup(table, []).shape == (0, 16)
    ids = np.arange(0, 100, 3)
    strided = cp.asarray(ids)[::2]  # not contiguous: the backend compacts it
    assert not strided.flags.c_contiguous
    assert_rows(fastembed.lookup(table, strided), host[ids[::2]], cp)
    reversed_ids = cp.asarray(ids)[::-1]
    assert_rows(fastembed.lookup(table, reversed_ids), host[ids[::-1]], cp)
    for dtype in (np.uint8, np.int16, np.uint32, np.uint64):
        assert_rows(fastembed.lookup(table, cp.asarray(ids.astype(dtype))), host[ids], cp)


def test_gpu_ids_of_a_library_without_an_adapter_are_a_type_error_naming_them(cp):
    """An object with only ``__cuda_array_interface__`` (a numba.cuda array, say) passed validation and failed in the
    backend with an AttributeError; its device was guessed as cuda:0."""
    class ForeignDeviceArray:
        def __init__(self, array):
            self.__cuda_array_interface__ = array.__cuda_array_interface__
            self.shape, self.dtype, self.ndim, self.size = array.shape, array.dtype, array.ndim, array.size

    backing = cp.asarray(np.array([1, 2, 3], np.int64))
    with pytest.raises(TypeError, match="ids are a .*ForeignDeviceArray on a GPU, of a library fastembed has no "
                                        "adapter for: pass them as a cupy array"):
        fastembed.lookup(cuda_backend.to_device(random_table(10, 4), 0), ForeignDeviceArray(backing))


def test_embedding_on_a_device_table(cp):
    host = random_table(64, 32, "float32")
    emb = fastembed.Embedding(cp.asarray(host))
    assert (emb.vocab_size, emb.dim, emb.device) == (64, 32, "cuda:0")
    assert_rows(emb([[1, 2], [3, 63]]), host[[[1, 2], [3, 63]]], cp)
    assert "cuda:0" in repr(emb)


# -- to_device ------------------------------------------------------------------------------------------

def test_to_device_dense_and_bfloat16(cp):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dtype in ("float32", ml_dtypes.bfloat16):
        host = random_table(50, 12, dtype)
        emb = fastembed.Embedding(host).to_device()
        assert emb.device == "cuda:0"
        ids = [0, 49, 7]
        result = emb(ids)
        if host.dtype == np.float32:
            assert emb.dtype == np.float32
            assert_rows(result, host[ids], cp)
        else:  # CuPy has no bfloat16: the device table holds the same 16-bit words
            assert emb.dtype == np.uint16
            np.testing.assert_array_equal(cp.asnumpy(result).view(ml_dtypes.bfloat16).view(np.uint16),
                                          host[ids].view(np.uint16))


def test_to_device_refuses_an_item_size_cupy_cannot_carry(cp):
    host = np.zeros((4, 2), "V3")
    with pytest.raises(TypeError, match="cupy has no dtype of 3 bytes"):
        fastembed.Embedding(host).to_device()
    for dtype in ("U2", "S4", "M8[s]", "m8[ns]", ">f4", ">i8", "g", "G"):
        with pytest.raises(TypeError, match=re.escape(f"dtype {np.dtype(dtype)} to the GPU: cupy arrays hold booleans and numbers")):
            fastembed.Embedding(np.zeros((4, 2), dtype)).to_device()


@pytest.mark.parametrize("device, error, words", [
    ("cuda:0", TypeError, "a CUDA device is given by its index"), (99, ValueError, "no CUDA device 99"),
    (-1, ValueError, "no CUDA device -1"),
])
def test_to_device_refuses_a_device_that_names_none(cp, device, error, words):
    with pytest.raises(error, match=words):
        fastembed.Embedding(random_table(10, 4)).to_device(device)


def test_to_device_of_a_table_already_on_a_gpu_says_so(cp):
    on_gpu = fastembed.Embedding(random_table(10, 4)).to_device()
    with pytest.raises(TypeError, match="copies a host table, and this one lives on cuda:0"):
        on_gpu.to_device(0)


def test_to_device_on_a_second_device(cp):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one CUDA device only")
    host = random_table(30, 20)
    emb = fastembed.Embedding(host).to_device(1)
    assert emb.device == "cuda:1" and emb.table.device.id == 1
    with cp.cuda.Device(0):  # the current device is not the table's: the backend switches for the launch
        result = emb(np.array([4, 29]))
        assert result.device.id == 1
        assert_rows(result, host[[4, 29]], cp)
        with pytest.raises(IndexError, match="id 30 at position 1"):
            emb(np.array([4, 30]))
        out = cp.empty((2, 20), host.dtype)  # on device 0: refused
        with pytest.raises(TypeError, match="same device"):
            emb(np.array([1, 2]), out=out)
    assert_rows(emb(np.array([3])), host[[3]], cp)


# -- bad ids --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_bad_ids_raise_with_position_and_value_and_the_next_call_works(cp, id_dtype):
    host = random_table(100, 64)
    table = fastembed.Embedding(host).to_device().table
    for bad, position in (([1, 2, 100, -5], 2), ([-1], 0), ([5, 99, 7, -2147483648], 3)):
        with pytest.raises(IndexError, match=rf"id {bad[position]} at position {position} is out of range"):
            fastembed.lookup(table, cp.asarray(np.array(bad, id_dtype)))
        assert_rows(fastembed.lookup(table, cp.asarray(np.array([5, 6], id_dtype))), host[[5, 6]], cp)
    ids = np.array([[1, 2], [3, 2**40]], np.int64) if id_dtype == np.int64 else np.array([[1, 2], [3, 1000]], np.int32)
    with pytest.raises(IndexError, match=rf"id {ids[1, 1]} at position \(1, 1\)"):
        fastembed.lookup(table, cp.asarray(ids))


def test_bad_rows_are_zero_in_out_and_good_rows_written(cp):
    host = random_table(100, 40)
    table = cuda_backend.to_device(host, 0)
    ids = np.array([3, 100, 4, -7, 5])
    out = device_poisoned(cp, (5, 40), host.dtype)
    with pytest.raises(IndexError, match="id 100 at position 1"):
        fastembed.lookup(table, ids, out=out)
    written = cp.asnumpy(out)
    assert not written[[1, 3]].view(np.uint16).any()
    np.testing.assert_array_equal(written[[0, 2, 4]], host[[3, 4, 5]])


def test_first_bad_position_wins_whatever_the_block_order(cp):
    host = random_table(500, 8)
    table = cuda_backend.to_device(host, 0)
    ids = np.random.default_rng(3).integers(0, 500, 1000)
    ids[[913, 250, 731]] = [500, 10**9, -1]
    for _ in range(5):  # the double shuffles blocks differently on every launch
        with pytest.raises(IndexError, match="id 1000000000 at position 250"):
            fastembed.lookup(table, cp.asarray(ids))


def test_deferred_checks_report_later_and_immediate_ones_stay_clean(cp):
    host = random_table(100, 64)
    table = fastembed.Embedding(host).to_device().table
    fastembed.raise_deferred_id_errors(0)  # nothing deferred yet
    with fastembed.deferred_id_checks():
        result = fastembed.lookup(table, cp.asarray([1, 100, 3]))
        fastembed.lookup(table, cp.asarray([7, 8, 9, 10, -1]))
    assert not cp.asnumpy(result[1]).any()
    assert_rows(result[::2], host[[1, 3]], cp)
    # An immediate lookup does not report what a deferred one saw.
    assert_rows(fastembed.lookup(table, [2]), host[[2]], cp)
    with pytest.raises(IndexError, match="deferred CUDA lookup on device 0 .* flattened position 1"):
        fastembed.raise_deferred_id_errors(0)
    fastembed.raise_deferred_id_errors(0)  # cleared
    assert cuda_backend.deferred_id_checks is fastembed.deferred_id_checks


def test_device_ids_of_other_integer_dtypes_are_checked_as_they_are_converted_even_when_checks_are_deferred(cp):
    """Device ids that are not int32 or int64 are range-checked before their conversion to int64 (uint64 values
    above 2**63 would wrap to negative ids): a bad one raises at once, inside deferred_id_checks() too, and leaves
    nothing for raise_deferred_id_errors(); good ones gather exactly."""
    host = random_table(100, 64)
    table = fastembed.Embedding(host).to_device().table
    fastembed.raise_deferred_id_errors(0)
    with fastembed.deferred_id_checks():
        for dtype in (np.int16, np.uint8, np.uint64):
            assert_rows(fastembed.lookup(table, cp.asarray(np.array([1, 99, 3], dtype))), host[[1, 99, 3]], cp)
            with pytest.raises(IndexError, match="id 100 at position 1 is out of range"):
                fastembed.lookup(table, cp.asarray(np.array([1, 100, 3], dtype)))
    fastembed.raise_deferred_id_errors(0)  # nothing was deferred


@pytest.mark.parametrize("device_id, error, words", [
    ("cuda:0", TypeError, "a CUDA device is given by its index"),
    (0.0, TypeError, "a CUDA device is given by its index"),
    (True, TypeError, "a CUDA device is given by its index"),
    (-1, ValueError, "no CUDA device -1"),
    (99, ValueError, "no CUDA device 99"),
])
def test_a_device_id_that_names_no_device_is_refused_not_silently_clean(cp, device_id, error, words):
    table = fastembed.Embedding(random_table(10, 4)).to_device().table
    with fastembed.deferred_id_checks():
        fastembed.lookup(table, np.array([0, 99]))
    with pytest.raises(error, match=words):
        fastembed.raise_deferred_id_errors(device_id)
    with pytest.raises(IndexError, match="flattened position 1"):  # still pending, then reported
        fastembed.raise_deferred_id_errors(np.int64(0))


@pytest.mark.parametrize("ids_dtype", [np.int8, np.int32])  # int8: the ids are converted (copied) on the device
def test_an_out_overlapping_the_callers_device_ids_is_refused_whether_or_not_they_are_copied(cp, ids_dtype):
    table = cp.asarray(random_table(50, 8, "float32"))
    buffer = cp.zeros(96, cp.int8)
    ids = buffer.view(ids_dtype)[:3]
    ids[...] = cp.asarray(np.array([5, 6, 7], ids_dtype))
    out = buffer.view(cp.float32)[:24].reshape(3, 8)
    with pytest.raises(ValueError, match="out overlaps the ids"):
        fastembed.lookup(table, ids, out=out)
    assert (cp.asnumpy(ids) == [5, 6, 7]).all()


@pytest.mark.parametrize("ids_slice, out_slice", [(slice(10, 0, -1), slice(0, 10)),  # reversed: data.ptr is the end
                                                    (slice(0, 20, 4), slice(7, 12))])  # strided: wider than nbytes
def test_an_out_overlapping_strided_or_reversed_device_ids_is_refused(cp, ids_slice, out_slice):
    table = cp.asarray(np.arange(10, dtype=np.int64).reshape(10, 1))
    buffer = cp.asarray(np.arange(40, dtype=np.int64) % 10)
    ids, out = buffer[ids_slice], buffer[out_slice].reshape(-1, 1)
    before = cp.asnumpy(buffer)
    with pytest.raises(ValueError, match="out overlaps the ids"):
        fastembed.lookup(table, ids, out=out)
    assert (cp.asnumpy(buffer) == before).all()
    apart = cp.asarray(np.arange(40, dtype=np.int64) % 10)
    assert_rows(fastembed.lookup(table, apart[0:20:4], out=apart[21:26].reshape(5, 1)),
                np.arange(10, dtype=np.int64).reshape(10, 1)[[0, 4, 8, 2, 6]], cp)  # disjoint spans: served


def test_concurrent_threads_each_see_their_own_bad_id(cp):
    host = random_table(64, 16)
    table = cuda_backend.to_device(host, 0)
    failures: list[str] = []

    def work(worker: int) -> None:
        try:
            with cp.cuda.Device(0):
                for call in range(15):
                    ids = np.arange(20) % 64
                    if call % 2:
                        ids[worker] = 64 + worker
                        try:
                            fastembed.lookup(table, ids)
                            failures.append(f"worker {worker}: no error")
                        except IndexError as error:
                            if f"id {64 + worker} at position {worker} " not in str(error):
                                failures.append(f"worker {worker}: {error}")
                    else:
                        np.testing.assert_array_equal(cp.asnumpy(fastembed.lookup(table, ids)), host[ids])
        except Exception as error:  # noqa: BLE001 - reported below
            failures.append(f"worker {worker}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


# -- validation and the dispatcher --------------------------------------------------------------------

def test_out_is_validated_on_the_device(cp):
    host = random_table(20, 8)
    table = cuda_backend.to_device(host, 0)
    ids = cp.asarray([1, 2])
    with pytest.raises(TypeError, match="dtype"):
        fastembed.lookup(table, ids, out=cp.empty((2, 8), cp.float32))
    with pytest.raises(ValueError, match="shape"):
        fastembed.lookup(table, ids, out=cp.empty((3, 8), host.dtype))
    with pytest.raises(TypeError, match="same device"):
        fastembed.lookup(table, ids, out=np.empty((2, 8), host.dtype))
    with pytest.raises(ValueError, match="overlaps the table"):
        fastembed.lookup(table, ids, out=table[:2])


def test_dispatcher_chooses_cuda_for_device_tables_and_never_moves_host_ones(cp):
    host = random_table(10, 8)
    device_table = cuda_backend.to_device(host, 0)
    assert fastembed.select_backend(device_table, [1]).backend == "cuda"
    assert "cuda" in [status.name for status in fastembed.backend_statuses() if status.available]
    selection = fastembed.select_backend(host, [1])
    assert selection.backend != "cuda"
    assert any("never moves a table implicitly" in reason for reason in selection.skipped["cuda"])
    result = fastembed.lookup(host, [1, 2])
    assert isinstance(result, np.ndarray)  # auto served the host table on the host
    with pytest.raises(fastembed.BackendUnavailableError, match="cuda.*never moves a table implicitly"):
        fastembed.lookup(host, [1], backend="cuda")
    with pytest.raises(TypeError, match="ids live on cuda:0 but the table lives on cpu"):
        fastembed.lookup(host, cp.asarray([1]))
    with pytest.raises(fastembed.BackendUnavailableError, match="numpy"):
        fastembed.lookup(device_table, [1], backend="numpy")


def test_describe_and_reset(cp):
    backend = cuda_backend.BACKEND
    facts = backend.describe()
    assert facts["cupy"] == cp.__version__ and facts["devices"][0].startswith("cuda:0 ")
    table = cuda_backend.to_device(random_table(10, 8), 0)
    fastembed.lookup(table, [1])
    assert backend._modules and backend._kernels and backend._sm_counts
    backend.reset()
    assert not (backend._modules or backend._kernels or backend._sm_counts or backend._deferred_flags)
    assert backend._unavailable is None
    assert_rows(fastembed.lookup(table, [1, 9]), cp.asnumpy(table)[[1, 9]], cp)  # recompiled


def test_the_double_is_never_left_installed():
    """Outside the fixture the test double is gone and the backend forgot it."""
    from cupy_double import real_cupy

    if real_cupy() is not None:
        pytest.skip("real cupy with a device")
    reasons = cuda_backend.BACKEND.unavailable_reasons()
    assert reasons and "cupy" in reasons[0]
    with pytest.raises(fastembed.BackendUnavailableError, match="cupy"):
        fastembed.Embedding(random_table(4, 4)).to_device()
    assert dispatch.explain(random_table(4, 4)).backend != "cuda"


def test_tables_without_columns_or_rows(cp):
    no_columns = cp.empty((10, 0), cp.float32)
    assert fastembed.lookup(no_columns, [1, 2]).shape == (2, 0)
    with pytest.raises(IndexError, match="id 10 at position 1"):
        fastembed.lookup(no_columns, [1, 10])
    no_rows = cp.empty((0, 8), cp.float32)
    assert fastembed.lookup(no_rows, []).shape == (0, 8)
    with pytest.raises(IndexError, match="id 0 at position 0"):
        fastembed.lookup(no_rows, [0])
    assert fastembed.lookup(cp.asarray(random_table(5, 8)), [4]).shape == (1, 8)  # the device still works


def test_the_backend_object_implements_the_interface():
    from fastembed.backends.base import Backend

    backend = cuda_backend.BACKEND
    assert isinstance(backend, Backend) and backend.name == "cuda"
    assert backend.capabilities.array_libraries == frozenset({"cupy"})
    assert backend.capabilities.devices == frozenset({"cuda"})
    assert not hasattr(cuda_backend, "NAME") and not hasattr(cuda_backend, "not_supported_reasons")
    assert dispatch.BACKENDS["cuda"] is backend


def test_flags_shared_by_streams_are_waited_for_and_a_flag_with_an_error_is_dropped(cp, monkeypatch):
    """On a GPU a flag's fill, and deferred lookups on other streams (torch's), run asynchronously.

    A thread's flag is filled and used on one stream, so nothing waits for
    it but its read; the deferred flag is used on any stream, so its fill is
    waited for, and the check waits for every stream. The double runs every
    launch at once, so only the waits themselves can be checked here.
    """
    if not hasattr(cp, "_reset_double"):
        pytest.skip("real cupy: its Device and Stream are extension types, whose methods cannot be wrapped to count waits")
    waits = []
    real_device_wait, real_stream_wait = cp.cuda.Device.synchronize, cp.cuda.Stream.synchronize
    monkeypatch.setattr(cp.cuda.Device, "synchronize", lambda self: (waits.append("device"), real_device_wait(self)))
    monkeypatch.setattr(cp.cuda.Stream, "synchronize", lambda self: (waits.append("stream"), real_stream_wait(self)))
    host = random_table(100, 64)
    table = fastembed.Embedding(host).to_device().table
    fastembed.lookup(table, cp.asarray([1, 2]))
    flag = cuda_backend.BACKEND._thread_flags.flags[0]
    with pytest.raises(IndexError, match="position 1"):
        fastembed.lookup(table, cp.asarray([1, 100]))
    assert 0 not in cuda_backend.BACKEND._thread_flags.flags  # dropped with its error, not reset
    assert_rows(fastembed.lookup(table, cp.asarray([3])), host[[3]], cp)
    assert cuda_backend.BACKEND._thread_flags.flags[0] is not flag
    assert waits == []  # each lookup waits only for its flag's read
    with fastembed.deferred_id_checks():
        fastembed.lookup(table, cp.asarray([7, -1]))
    assert waits == ["stream"]  # the deferred flag's fill
    with pytest.raises(IndexError, match="flattened position 1"):
        fastembed.raise_deferred_id_errors(0)
    assert waits == ["stream", "device", "stream"]  # every stream's lookups counted, then the new flag's fill


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "q8_0"])
def test_a_ctrl_c_in_a_lookup_with_a_bad_id_leaves_no_error_for_the_next_lookup(cp, quantized, monkeypatch):
    """The thread's flag may hold the bad position when the Ctrl-C comes: the next good lookup must not read it."""
    monkeypatch.setattr("sys.unraisablehook", lambda unraisable: None)  # an interrupt in a finalizer is not raised
    host = random_quantized("q8_0", 10, 32) if quantized else random_table(10, 4)
    table = cuda_backend.to_device(host, 0) if quantized else cp.asarray(host)
    bad, good = cp.asarray(np.array([1, 2, 3, 4, 5, 6, 12], np.int32)), cp.asarray(np.arange(8, dtype=np.int32))
    backend = cuda_backend.BACKEND
    ours = {backend.gather.__code__, backend.dequantize.__code__, backend._launch_checked.__code__,
            backend._check_ids.__code__}

    def bad_lookup():
        with pytest.raises(IndexError, match="id 12 at position 6"):
            fastembed.lookup(table, bad)

    expected = fastembed.lookup(host, np.arange(8))
    for _ in interrupted_runs(lambda code: code in ours, bad_lookup):
        assert_rows(fastembed.lookup(table, good), expected, cp)


def test_a_deferred_error_recorded_while_the_flag_is_checked_is_reported_by_the_next_check(cp, monkeypatch):
    """Another thread's deferred lookup that lands between a check's read and its clearing is not lost."""
    host = random_table(10, 4)
    table = cp.asarray(host)
    with fastembed.deferred_id_checks():
        fastembed.lookup(table, cp.asarray([1, 50]))
    flag = cuda_backend.BACKEND._deferred_flags[0]
    other = threading.Thread(target=lambda: _deferred_lookup(table, cp.asarray([0, 0, 0, 77])))
    real_get = flag.get

    def read_then_another_thread_looks_up(*args, **kwargs):
        value = real_get(*args, **kwargs)
        if other.ident is None:
            other.start()
        other.join(0.2)  # it may wait for the check to end
        return value

    monkeypatch.setattr(flag, "get", read_then_another_thread_looks_up, raising=False)
    with pytest.raises(IndexError, match="flattened position 1"):
        fastembed.raise_deferred_id_errors(0)
    other.join()
    with pytest.raises(IndexError, match="flattened position 3"):
        fastembed.raise_deferred_id_errors(0)
    fastembed.raise_deferred_id_errors(0)


def _deferred_lookup(table, ids):
    with fastembed.deferred_id_checks():
        fastembed.lookup(table, ids)


@pytest.mark.parametrize("id_dtype", ["uint16", "int8", "int64"])
def test_ids_of_a_table_on_another_device_than_the_current_one_are_converted_there(cp, id_dtype):
    """Converting uint16 ids to int64 allocates on the current device, as CuPy does: the lookup makes the table's current."""
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two devices")
    host = random_table(100, 64)
    with cp.cuda.Device(1):
        table = cp.asarray(host)
        ids = cp.asarray(np.array([[5, 99], [0, 7]], id_dtype))
    with cp.cuda.Device(0):
        rows = fastembed.lookup(table, ids)
        assert int(rows.device.id) == 1
        assert_rows(rows, host[[[5, 99], [0, 7]]], cp)
        with pytest.raises(IndexError, match="id 100 at position 1"):
            fastembed.lookup(table, on_device(cp, 1, np.array([5, 100], id_dtype)))


def test_select_backend_converts_device_ids_on_the_tables_device_as_lookup_does(cp, monkeypatch):
    """select_backend validated outside the table's call context: int8 ids on device 1 were converted on device 0."""
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two devices")
    from fastembed import validate

    table, ids = on_device(cp, 1, random_table(10, 4)), on_device(cp, 1, np.array([1, 2], np.int8))
    converted_on = []
    native_ids = validate._native_ids
    monkeypatch.setattr(validate, "_native_ids", lambda *args: converted_on.append(native_ids(*args).device.id))
    with cp.cuda.Device(0):
        with contextlib.suppress(Exception):  # the stand-in returns no ids: only where they were converted counts
            fastembed.select_backend(table, ids)
    assert converted_on == [1]


def on_device(cp, device, host):
    with cp.cuda.Device(device):
        return cp.asarray(host)


def test_misaligned_device_ids_scales_and_out_never_reach_the_kernels(cp):
    """cupy's view(dtype) of bytes at an odd offset: ids are copied aligned, scales and a dequantizing out refused."""
    from fastembed.formats import QuantizedTable
    from fastembed.tables import random_quantized_table

    host = random_table(100, 64)
    table = fastembed.Embedding(host).to_device().table
    raw = cp.zeros(8 * 3 + 4, cp.uint8)
    ids = raw[4:28].view(cp.int64)
    assert ids.data.ptr % 8 == 4
    ids[...] = cp.asarray(np.array([5, 99, 0]))
    assert_rows(fastembed.lookup(table, ids), host[[5, 99, 0]], cp)
    source = random_quantized_table("fp8_e4m3", 50, 32)
    buffer = cp.zeros(4 * 50 + 1, cp.uint8)
    scales = buffer[1:].view(cp.float32)
    with pytest.raises(ValueError, match="not a multiple of 4 bytes"):
        QuantizedTable(cp.asarray(source.data), "fp8_e4m3", 32, scales)
    quantized = QuantizedTable(cp.asarray(source.data), "fp8_e4m3", 32, cp.asarray(source.scales))
    out_bytes = cp.zeros(3 * 32 * 4 + 2, cp.uint8)
    out = out_bytes[2:].view(cp.float32).reshape(3, 32)
    with pytest.raises(ValueError, match="not a multiple of its 4-byte items"):
        fastembed.lookup(quantized, cp.asarray([1, 2, 3]), out=out)
    assert not cp.asnumpy(out_bytes).any()
