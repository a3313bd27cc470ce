"""Gathers into chosen rows of an output (``place``): every host backend and kernel path against numpy."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import fastembed
from fastembed import dispatch, validate
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
    monkeypatch.setattr(numba_backend, "PLACE_SERIAL_MIN_BYTES", 0)
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


def place(backend, table, ids, out, positions):
    """A backend's place, on the arguments as validate.place_arguments checks and copies them."""
    ids, positions = validate.place_arguments(table, ids, out, positions)
    backend.place(table, ids, out, positions)


def test_every_host_backend_places_rows():
    assert isinstance(numpy_backend.BACKEND, base.PlacingBackend)
    if "numba" in CPU_BACKENDS:
        assert isinstance(numba_backend.BACKEND, base.PlacingBackend)
        assert dispatch.placing_backend(random_table(3, 4)) is numba_backend.BACKEND


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8", "S3"])
@pytest.mark.parametrize("width", [1, 3, 4095, 4096])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64, np.uint16, np.uint32])
def test_rows_land_at_their_positions_and_no_other_row_is_written(placing, dtype, width, id_dtype):
    rng = np.random.default_rng(width)
    if dtype == "S3":  # an item size no machine word divides
        table = rng.integers(1, 256, (300, 3 * width), dtype=np.uint8).view("S3")
    else:
        table = random_table(300, width, dtype, seed=width)
    ids = rng.integers(0, 300, 157).astype(id_dtype)
    positions = rng.permutation(257)[:157].astype(id_dtype)
    out = poisoned((257, table.shape[1]), table.dtype)
    expected = placed(table, ids, out, positions)
    place(placing, table, ids, out, positions)
    assert_bit_equal(out, expected)


@pytest.mark.parametrize("count", [0, 1, 2])
def test_few_or_no_rows(placing, count):
    table = random_table(50, 40)
    ids = np.arange(count) + 7
    positions = np.arange(count)[::-1] + 3
    out = poisoned((6, 40), table.dtype)
    expected = placed(table, ids, out, positions)
    place(placing, table, ids, out, positions)
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
    place(placing, table, ids, out, positions)
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
        place(placing, table, ids, out, np.arange(200) + 10)
    assert_bit_equal(out, before)


@pytest.mark.parametrize(("positions", "kind", "message"), [
    (np.arange(199), ValueError, r"one position per id; got shapes \(200,\) and \(199,\)"),
    (np.arange(200).reshape(10, 20), ValueError, "must be 1-D, one position per id"),
    (np.arange(200.0), TypeError, "positions must be integers, got float64"),
    (np.ones(200, bool), TypeError, "positions must be integers, got bool"),
    (np.arange(200) - 1, ValueError, r"positions must lie in \[0, 220\), the rows of out; got -1 to 198"),
    (np.arange(200) + 21, ValueError, r"positions must lie in \[0, 220\), the rows of out; got 21 to 220"),
    (np.r_[np.arange(199), 57], ValueError, "positions must be distinct, got 57 more than once"),
])
def test_bad_positions_are_refused_before_anything_is_written(placing, positions, kind, message):
    table = random_table(100, 64)
    out = poisoned((220, 64), table.dtype)
    before = out.copy()
    with pytest.raises(kind, match=message):
        place(placing, table, np.arange(200) % 100, out, positions)
    assert_bit_equal(out, before)


def _outs():
    """Outputs place refuses, each with the error it gets: not C-contiguous, narrower rows, another dtype, read-only."""
    wide = poisoned((200, 128), np.float16)
    read_only = poisoned((200, 64), np.float16)
    read_only.flags.writeable = False
    return [(wide[:, :64], ValueError, "2-D, C-contiguous"), (wide[::2, :64], ValueError, "2-D, C-contiguous"),
            (poisoned((200, 64), np.float16)[::-1], ValueError, "2-D, C-contiguous"),
            (poisoned((200, 32), np.float16), ValueError, "rows of 64 values, got shape \\(200, 32\\)"),
            (poisoned((200, 64), np.int16), TypeError, "the table's dtype float16, got int16"),
            (read_only, ValueError, "read-only"), (poisoned((200, 64, 1), np.float16), ValueError, "2-D")]


@pytest.mark.parametrize("case", range(len(_outs())))
def test_an_out_the_kernels_cannot_write_safely_is_refused(placing, case):
    """A strided, narrower, differently typed or read-only out: a clear error before any write (the kernels
    address rows by their byte size from out's start)."""
    table = random_table(100, 64)
    out, kind, message = _outs()[case]
    before = np.array(out, copy=True)
    with pytest.raises(kind, match=message):
        place(placing, table, np.arange(50), out, np.arange(50))
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("table_view", ["every other row", "reversed rows", "3-D", "ids 2-D", "float ids"])
def test_a_table_or_ids_the_kernels_cannot_read_safely_are_refused(placing, table_view):
    table = random_table(100, 64)
    ids = np.arange(50)
    if table_view == "every other row":
        table = table[::2]
    elif table_view == "reversed rows":
        table = table[::-1]
    elif table_view == "3-D":
        table = table.reshape(100, 64, 1)
    elif table_view == "ids 2-D":
        ids = ids.reshape(5, 10)
    else:
        ids = ids.astype(np.float32)
    with pytest.raises((ValueError, TypeError)):
        place(placing, table, ids, poisoned((50, 64), np.float16), np.arange(50))


def test_every_byte_is_placed_padding_included(placing):
    """A structured dtype with padding: its rows are placed byte for byte, as fastembed.lookup copies them."""
    padded = np.dtype({"names": ["a", "b"], "formats": ["u1", "<u4"], "offsets": [0, 4], "itemsize": 8})
    table = np.random.default_rng(3).integers(1, 256, (90, 8 * 33), dtype=np.uint8).view(padded)
    ids, positions = np.arange(80) % 90, np.arange(80)[::-1].copy()
    out = poisoned((80, 33), padded)
    place(placing, table, ids, out, positions)
    assert_bit_equal(out.view(np.uint8)[positions], fastembed.lookup(table, ids).view(np.uint8))


@pytest.mark.parametrize("changed", ["ids", "positions"])
def test_ids_or_positions_changed_by_another_thread_are_never_used_unchecked(placing, changed):
    """Another thread poisons the caller's ids or positions meanwhile: each call places exactly what was checked,
    or raises, and never reads outside the table or writes outside out."""
    table = random_table(1000, 256)
    ids = np.random.default_rng(0).integers(0, 1000, 5000)
    positions = np.arange(5000)
    target = ids if changed == "ids" else positions
    good = target.copy()
    frame = poisoned((5200, 256), table.dtype)
    out = frame[100:5100]
    stop = threading.Event()

    def poison():
        while not stop.is_set():
            target[::97] = 10**12
            target[::97] = good[::97]

    thread = threading.Thread(target=poison)
    # The poisoning loop holds the GIL between its writes: without a short switch interval each of the
    # parallel place's block claims could wait the default 5 ms for it, and the test's time would be luck.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    thread.start()
    try:
        for _ in range(100):
            try:
                place(placing, table, ids, out, positions)
            except (IndexError, ValueError):
                pass
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert (frame[:100].view(np.uint8) == 0xA5).all() and (frame[5100:].view(np.uint8) == 0xA5).all()
    target[:] = good
    place(placing, table, ids, out, positions)
    assert_bit_equal(out, table[ids])


def _refused_arguments():
    """(label, arguments as table, ids, out, positions, error, message) that place_arguments refuses."""
    table = random_table(100, 64)
    ids, positions, out = np.arange(50), np.arange(50), poisoned((60, 64), np.float16)
    objects = np.empty((100, 64), object)
    return [
        ("a list table", (table.tolist(), ids, out, positions), TypeError, "table must be a numpy.ndarray"),
        ("a masked positions", (table, ids, out, np.ma.array(positions, mask=positions == 3)), TypeError,
         "positions must be a numpy.ndarray \\(not a subclass\\), got MaskedArray"),
        ("a memmap out", (table, ids, out.view(np.memmap), positions), TypeError, "out must be a numpy.ndarray"),
        ("objects", (objects, ids, np.empty((60, 64), object), positions), TypeError, "no Python objects"),
        ("uint64 ids past int64", (table, np.full(50, 2**64 - 1, np.uint64), out, positions), IndexError,
         "ids must fit a 64-bit integer"),
        ("out overlapping the table", (table, ids, table[20:80], positions), ValueError, "out overlaps the table"),
    ]


@pytest.mark.parametrize("case", range(len(_refused_arguments())), ids=[case[0] for case in _refused_arguments()])
def test_arguments_a_backend_must_not_see_are_refused(case):
    _, arguments, kind, message = _refused_arguments()[case]
    with pytest.raises(kind, match=message):
        validate.place_arguments(*arguments)
