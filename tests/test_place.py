"""Gathers into chosen rows of an output (``place``): every host backend and kernel path against numpy."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from fastembed import dispatch
from fastembed.backends import base, numpy_backend
from helpers import CPU_BACKENDS, assert_bit_equal, poisoned, random_table

numba_backend = pytest.importorskip("fastembed.backends.numba_backend")


@pytest.fixture(params=[*(f"numba {path}" for path in ("serial", "parallel", "stream", "stream on 7 threads",
                                                        "stream in small blocks", "numpy while compiling")),
                        "numpy"])
def placing(request, monkeypatch):
    """Each backend's place, and each path of the numba one forced on small data by moving its thresholds."""
    if request.param == "numpy":
        return numpy_backend.BACKEND
    if "numba" not in CPU_BACKENDS:
        pytest.skip("numba backend unavailable")
    path = request.param.removeprefix("numba ")
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", path == "numpy while compiling")
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 2**62 if path == "serial" else 0)
    monkeypatch.setattr(numba_backend, "STREAM_MIN_OUT_BYTES", 0 if path.startswith("stream") else 2**62)
    monkeypatch.setattr(numba_backend, "thread_count", lambda: 7 if path == "stream on 7 threads" else 2)
    if path.endswith("small blocks"):
        monkeypatch.setattr(numba_backend, "MAX_BLOCK_BYTES", 4096)
    if path == "numpy while compiling":  # a fresh record: every place signature is new, so numpy serves it
        monkeypatch.setattr(numba_backend.BACKEND, "_compiles", numba_backend._Compiles())
        monkeypatch.setattr(numba_backend.background_compile, "start", lambda key, compile_now: None)
    return numba_backend.BACKEND


def placed(table, ids, out, positions):
    """The reference: a copy of `out` with ``table[ids[i]]`` at row ``positions[i]``."""
    expected = out.copy()
    expected[positions] = table[ids]
    return expected


def test_every_host_backend_places_rows():
    assert isinstance(numpy_backend.BACKEND, base.PlacingBackend)
    if "numba" in CPU_BACKENDS:
        assert isinstance(numba_backend.BACKEND, base.PlacingBackend)
        assert dispatch.placing_backend(random_table(3, 4)) is numba_backend.BACKEND


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8", "S3"])
@pytest.mark.parametrize("width", [1, 3, 4095, 4096])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_rows_land_at_their_positions_and_no_other_row_is_written(placing, dtype, width, id_dtype):
    rng = np.random.default_rng(width)
    if dtype == "S3":  # an item size no machine word divides
        table = rng.integers(1, 256, (300, 3 * width), dtype=np.uint8).view("S3")
    else:
        table = random_table(300, width, dtype, seed=width)
    ids = rng.integers(0, 300, 157).astype(id_dtype)
    positions = rng.permutation(257)[:157]
    out = poisoned((257, table.shape[1]), table.dtype)
    expected = placed(table, ids, out, positions)
    placing.place(table, ids, out, positions)
    assert_bit_equal(out, expected)


@pytest.mark.parametrize("count", [0, 1, 2])
def test_few_or_no_rows(placing, count):
    table = random_table(50, 40)
    ids = np.arange(count) + 7
    positions = np.arange(count)[::-1] + 3
    out = poisoned((6, 40), table.dtype)
    expected = placed(table, ids, out, positions)
    placing.place(table, ids, out, positions)
    assert_bit_equal(out, expected)


@pytest.mark.parametrize("offset", [1, 2, 4])
def test_unaligned_table_and_out(placing, offset):
    rows, width = 64, 40
    table_buffer = np.zeros(rows * width * 2 + 64, np.uint8)
    table = table_buffer[offset: offset + rows * width * 2].view(np.float16).reshape(rows, width)
    table[...] = random_table(rows, width)
    out_buffer = np.full(120 * width * 2 + 64, 0xA5, np.uint8)
    out = out_buffer[offset: offset + 120 * width * 2].view(np.float16).reshape(120, width)
    rng = np.random.default_rng(offset)
    ids, positions = rng.integers(0, rows, 100), rng.permutation(120)[:100]
    expected = placed(table, ids, out, positions)
    placing.place(table, ids, out, positions)
    assert_bit_equal(out, expected)
    assert (out_buffer[:offset] == 0xA5).all() and (out_buffer[offset + out.nbytes:] == 0xA5).all()


@pytest.mark.parametrize("bad", [-1, 100, 2**40])
def test_a_bad_id_names_itself_and_writes_nothing(placing, bad):
    table = random_table(100, 64)
    ids = np.arange(200) % 100
    ids[150] = bad
    out = poisoned((220, 64), table.dtype)
    before = out.copy()
    with pytest.raises(IndexError, match=f"id {bad} at position 150"):
        placing.place(table, ids, out, np.arange(200) + 10)
    assert_bit_equal(out, before)


@pytest.mark.parametrize(("positions", "message"), [
    (np.arange(199), "positions must be 200 integers, one per id"),
    (np.arange(200).reshape(10, 20), "positions must be 200 integers"),
    (np.arange(200.0), "positions must be 200 integers"),
    (np.arange(200) - 1, r"positions must lie in \[0, 220\), the rows of out; got -1 to 198"),
    (np.arange(200) + 21, r"positions must lie in \[0, 220\), the rows of out; got 21 to 220"),
])
def test_bad_positions_are_refused_before_anything_is_written(placing, positions, message):
    table = random_table(100, 64)
    out = poisoned((220, 64), table.dtype)
    before = out.copy()
    with pytest.raises(ValueError, match=message):
        placing.place(table, np.arange(200) % 100, out, positions)
    assert_bit_equal(out, before)


def test_ids_changed_by_another_thread_are_never_read_outside_the_table(monkeypatch):
    """Ids poisoned while they are placed: each row is either placed from the table or skipped and reported."""
    if "numba" not in CPU_BACKENDS:
        pytest.skip("numba backend unavailable")
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    table = random_table(1000, 256)
    ids = np.random.default_rng(0).integers(0, 1000, 20000)
    positions = np.arange(20000)
    out = np.empty((20000, 256), table.dtype)
    stop = threading.Event()

    def poison():
        while not stop.is_set():
            ids[::97] = 10**12
            ids[::97] = 5

    thread = threading.Thread(target=poison)
    thread.start()
    changed = 0
    try:
        for _ in range(200):
            try:
                numba_backend.BACKEND.place(table, ids, out, positions)
            except (RuntimeError, IndexError):
                changed += 1
    finally:
        stop.set()
        thread.join()
    ids[::97] = 5
    numba_backend.BACKEND.place(table, ids, out, positions)
    assert_bit_equal(out, table[ids])
