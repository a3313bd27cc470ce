"""The numba backend: every kernel path exact, unaligned data, threads and fork."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import numpy as np
import pytest

import fastembed
from helpers import Producer, assert_bit_equal, interrupted_runs, poisoned, random_quantized, random_table, run_script

numba_backend = pytest.importorskip("fastembed.backends.numba_backend")
BACKEND = numba_backend.BACKEND
if BACKEND.unavailable_reasons():
    pytest.skip(f"numba backend unavailable: {BACKEND.unavailable_reasons()}", allow_module_level=True)

THREAD_SECONDS = float(os.environ.get("FASTEMBED_RACE_SECONDS", "4"))


@pytest.fixture(params=["serial", "serial below the parallel size", "parallel", "stream", "stream on 7 threads",
                        "parallel in small blocks", "stream in small blocks"])
def kernel_path(request, monkeypatch):
    """Force each kernel path on small data by moving the thresholds (compiling in the foreground)."""
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 2**62 if request.param.startswith("serial below") else 0)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "STREAM_MIN_OUT_BYTES", 2**62 if request.param.startswith("parallel") else 0)
    # two threads whatever this machine has; seven: more blocks than cores, claimed in turn
    monkeypatch.setattr(numba_backend, "thread_count", lambda: 7 if request.param == "stream on 7 threads" else 2)
    if request.param.endswith("small blocks"):  # blocks of 4 KiB: many more blocks than threads, claimed in turn
        monkeypatch.setattr(numba_backend, "MAX_BLOCK_BYTES", 4096)
    if request.param != "serial":
        yield request.param
        return
    with BACKEND._parallel_lock:  # as while another thread's lookup runs in parallel: the serial kernel, whatever the batch
        yield request.param


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
@pytest.mark.parametrize("width", [1, 3, 8, 4095, 4096])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_every_kernel_path_is_exact(kernel_path, dtype, width, id_dtype):
    table = random_table(300, width, dtype, seed=width)
    ids = np.random.default_rng(width).integers(0, 300, 257).astype(id_dtype)
    out = poisoned((257, width), table.dtype)
    fastembed.lookup(table, ids, out=out, backend="numba")
    assert_bit_equal(out, table[ids])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8", "S3"])
@pytest.mark.parametrize("width", [1, 3, 4095])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("offset", [0, 1])
def test_the_allocating_serial_gather_is_exact(monkeypatch, dtype, width, id_dtype, offset):
    """The serial kernel into a new output, for tables of every dtype at any address (one compile: they are bytes to
    it), ids of any shape."""
    from fastembed import validate

    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    rows = random_table(300, width, dtype, seed=width) if dtype != "S3" else np.random.default_rng(width).integers(
        0, 256, (300, width * 3), dtype=np.uint8).view("S3")
    buffer = np.empty(rows.nbytes + 1, np.uint8)
    table = buffer[offset : offset + rows.nbytes].view(rows.dtype).reshape(rows.shape)
    table[...] = rows
    ids = np.random.default_rng(width).integers(0, 300, (3, 19)).astype(id_dtype)
    snapshot = validate.ids_snapshot(ids, table)
    BACKEND.gather(table, snapshot, None)  # compiles, if this signature never ran
    assert ("gather", np.dtype(id_dtype), True) in BACKEND._compiles.done
    served = BACKEND.gather(table, snapshot, None)
    assert served.shape == (3, 19, width) and served.dtype == table.dtype and served.flags.c_contiguous
    assert_bit_equal(served, rows[ids])


@pytest.mark.parametrize("prefetch_rows_ahead", [0, 1, 4, 10**6])
@pytest.mark.parametrize("touch_pages_rows_ahead", [0, 1, 16, 10**6])
@pytest.mark.parametrize("n_blocks", [1, 3, 64])
def test_streaming_kernel_prefetch_options_are_exact(prefetch_rows_ahead, touch_pages_rows_ahead, n_blocks):
    """Every prefetch setting, with blocks shorter and longer than the distance ahead, copies exactly."""
    kernels = BACKEND.kernels()
    table = random_table(500, 4104, seed=n_blocks).view(np.uint64)  # 8,208-byte rows: 3 pages, a partial one
    ids = np.random.default_rng(touch_pages_rows_ahead).integers(0, 500, 37)
    out = poisoned((37, table.shape[1]), np.uint64)
    assert kernels.can_stream(out)
    options = (prefetch_rows_ahead, touch_pages_rows_ahead, numba_backend.ALIAS_WINDOW)
    assert _streamed_in_blocks(table, ids, out, n_blocks, *options) == 0
    assert_bit_equal(out, table[ids])


@pytest.mark.parametrize("touch_pages_rows_ahead", [0, 1, 16, 10**6])
@pytest.mark.parametrize("row_bytes", [4104, 8, 28, 6, 5])
@pytest.mark.parametrize("rows", [(0, 37), (5, 9), (36, 37), (7, 7)])
def test_the_cached_copy_copies_exactly_its_rows(row_bytes, rows, touch_pages_rows_ahead):
    """Rows of any size, as the read-only bytes the backend passes (one memcpy each): exactly rows [start, stop) are
    written, bit for bit."""
    kernels = BACKEND.kernels()
    table = np.random.default_rng(row_bytes).integers(0, 256, (500, row_bytes), dtype=np.uint8)
    table.flags.writeable = False
    ids = np.random.default_rng(rows[0]).integers(0, 500, 37)
    out = poisoned((37, row_bytes), np.uint8)
    untouched = out.copy()
    start, stop = rows
    assert kernels.copy_rows(table, ids, out, start, stop, touch_pages_rows_ahead) == 0
    assert_bit_equal(out[start:stop], table[ids[start:stop]])
    assert_bit_equal(out[:start], untouched[:start])
    assert_bit_equal(out[stop:], untouched[stop:])
    ids[11] = 500  # out of range, as if another thread changed it after the scan: skipped, counted, never read
    ids[12] = -2**40  # a row whose pages are touched far outside the table: a hint, never read
    assert kernels.copy_rows(table, ids, out, 0, 37, touch_pages_rows_ahead) == 2
    assert kernels.gather_serial(table, ids, out, touch_pages_rows_ahead) == 11


def test_the_row_loops_call_nothing_per_row_that_counts_references(tmp_path):
    """numba's reference counting of an array passed to a function called per row is an atomic instruction,
    which keeps the next rows' reads from starting early (a serial gather of 128-byte rows took 2.7x as long).

    Compiled afresh in a child process (the listing of a cached kernel is not available): only the row loops
    themselves, entered once per block, may count references; every function they call per row must not.
    """
    script = textwrap.dedent("""
        import platform, re, numba.core.dispatcher, numpy as np
        numba.core.dispatcher.Dispatcher.enable_caching = lambda self: None
        from numba.core.registry import CPUDispatcher
        from fastembed.kernels import gather_cpu as k
        from fastembed.benchmark import copy_kernels as c
        table, ids, out = np.zeros((9, 128), np.uint8), np.zeros(3, np.int64), np.zeros((3, 128), np.uint8)
        table.flags.writeable = False  # the types the backend passes: read-only bytes
        k.gather_serial(table, ids, out, 16); k.copy_rows(table, ids, out, 0, 3, 16)
        k.place_rows(table, ids, out, np.arange(3), 0, 3, False, 1, 16, 32)
        if platform.machine().lower() in ("x86_64", "amd64"):  # non-temporal stores: x86-64 only
            k.stream_rows(table, ids, out, 0, 3, 1, 16, 32)
            k.place_rows(table, ids, out, np.arange(3), 0, 3, True, 1, 16, 32)
        c.read_scattered_serial(np.zeros((9, 16), np.uint64), ids)  # the benchmark's kernels read words
        entered_once = {"gather_serial", "copy_rows", "stream_rows", "place_rows", "_xor_rows", "first_bad_position"}
        for module in (k, c):
            for name, function in vars(module).items():
                if isinstance(function, CPUDispatcher) and function.__module__ == module.__name__:
                    for signature in function.signatures:
                        body = function.inspect_asm(signature).split(".Lfunc_end0")[0]
                        # the call, or its atomic add if ever inlined (a lock prefix on x86-64)
                        counted = body.count("NRT_incref") + len(re.findall(r"\\block\\b", body))
                        print(name, name in entered_once, counted)
    """)
    listing = run_script(tmp_path, script)
    assert listing.returncode == 0, listing.stderr
    counts = [line.split() for line in listing.stdout.splitlines()]
    assert {"copy_rows", "place_rows", "_xor_rows", "first_bad_position"} <= {name for name, _, _ in counts}
    per_row = [(name, int(count)) for name, entered_once, count in counts if entered_once == "False"]
    assert per_row and all(count == 0 for _, count in per_row), per_row


def _streamed_in_blocks(table, ids, out, n_blocks, *options) -> int:
    """The streaming kernel on `n_blocks` blocks of rows over fastembed's workers; the rows it skipped."""
    stream_rows = BACKEND.kernels().stream_rows
    return numba_backend.WORKERS.run(lambda start, stop: stream_rows(table, ids, out, start, stop, *options), len(ids),
                                     n_blocks)


def test_rows_whose_source_sits_just_below_the_destination_modulo_4k_are_copied_backward():
    """The direction rule itself."""
    copies_backward = BACKEND.kernels().copies_backward
    window = numba_backend.ALIAS_WINDOW
    destination = 10 * 4096 + 512
    for source_minus_destination in (-16, -window, -1, 4096 - 16, -4096 - 16):
        assert copies_backward(destination, destination + source_minus_destination, window)
    for source_minus_destination in (0, 16, -window - 16, 2048, 4096, -4096):
        assert not copies_backward(destination, destination + source_minus_destination, window)
    assert not copies_backward(destination, destination - 16, 0)
    assert copies_backward(destination, destination + 16, 4096)


def test_a_numpy_tables_rows_into_the_output_caches_buffers_are_copied_backward():
    """numpy's buffers from their own mappings start 16 bytes into a page and the output cache's 64: a table's rows sat
    48 bytes below an allocating lookup's output modulo 4 KiB, outside a window of 32, and were copied forward,
    waiting on their own stores."""
    from fastembed.backends import output_cache

    copies_backward = BACKEND.kernels().copies_backward
    page = 10 * 4096
    table_row, output_row = page + 16, page + output_cache.ALIGNMENT
    assert copies_backward(output_row, table_row, numba_backend.ALIAS_WINDOW)
    assert copies_backward(output_row + 3 * 8192, table_row + 57 * 8192, numba_backend.ALIAS_WINDOW)  # rows of 8 KiB


@pytest.mark.parametrize("alias_window", [0, numba_backend.ALIAS_WINDOW, 4096])
@pytest.mark.parametrize("row_bytes", [16, 48, 80, 8192, 8208, 8240])
@pytest.mark.parametrize("distance", [0, 16, 4064, 4080])
@pytest.mark.parametrize("table_line_offset", [0, 16])
def test_streaming_kernels_copy_rows_forward_and_backward_exactly(alias_window, row_bytes, distance,
                                                                   table_line_offset):
    """Rows copied forward, backward or either by their distance modulo 4 KiB: exact, nothing written outside out.

    Window 0 copies every row forward, 4096 every row backward. With the
    shipped window, 8 KiB rows all take the direction of `distance`; rows of
    other sizes each have their own distance, and both directions occur.
    The table starts `table_line_offset` bytes into a cache line, so out
    starts at each of the four 16-byte places in a line (the rows are cut at
    its line boundaries).
    """
    kernels = BACKEND.kernels()
    n = 300
    rows = random_table(n, row_bytes // 2, seed=row_bytes).view(np.uint8)
    table_buffer = np.empty(rows.nbytes + 128, np.uint8)
    start = (table_line_offset - table_buffer.ctypes.data) % 64
    table = table_buffer[start : start + rows.nbytes].reshape(rows.shape)
    table[:] = rows
    ids = np.random.default_rng(distance).permutation(n)
    out_buffer = np.full(n * row_bytes + 8192, 0xA5, np.uint8)
    shift = (table.ctypes.data - distance - out_buffer.ctypes.data) % 4096
    out = out_buffer[shift : shift + n * row_bytes].reshape(n, row_bytes)
    assert out.ctypes.data % 64 == (table_line_offset - distance) % 64
    assert kernels.can_stream(out)
    row_distances = (table.ctypes.data + ids * row_bytes - out.ctypes.data - np.arange(n) * row_bytes) % 4096
    backward = row_distances >= 4096 - alias_window
    if alias_window == numba_backend.ALIAS_WINDOW and row_bytes % 4096:
        assert 0 < backward.sum() < n  # the test covers both directions in one call
    prefetches = (numba_backend.PREFETCH_ROWS_AHEAD, numba_backend.TOUCH_PAGES_ROWS_AHEAD)
    assert _streamed_in_blocks(table, ids, out, 3, *prefetches, alias_window) == 0
    assert_bit_equal(out, table[ids])
    assert (out_buffer[:shift] == 0xA5).all() and (out_buffer[shift + out.nbytes :] == 0xA5).all()


def test_bad_ids_on_every_kernel_path_leave_out_untouched(kernel_path):
    table = random_table(100, 64)
    ids = np.arange(200) % 100
    ids[150] = 100
    out = poisoned((200, 64), table.dtype)
    before = out.copy()
    with pytest.raises(IndexError, match="id 100 at position 150"):
        fastembed.lookup(table, ids, out=out, backend="numba")
    assert_bit_equal(out, before)


@pytest.mark.parametrize("offset", [1, 2, 4, 8])
def test_unaligned_table_and_out(kernel_path, offset):
    """Views at odd byte offsets (as an np.memmap of a file can be) are gathered exactly."""
    rows, width = 64, 40  # 80-byte rows of float16
    table_buffer = np.zeros(rows * width * 2 + 64, np.uint8)
    table = table_buffer[offset : offset + rows * width * 2].view(np.float16).reshape(rows, width)
    table[...] = random_table(rows, width)
    out_buffer = np.full(100 * width * 2 + 64, 0xA5, np.uint8)
    out = out_buffer[offset : offset + 100 * width * 2].view(np.float16).reshape(100, width)
    ids = np.random.default_rng(offset).integers(0, rows, 100)
    fastembed.lookup(table, ids, out=out, backend="numba")
    assert_bit_equal(out, table[ids])
    assert (out_buffer[:offset] == 0xA5).all() and (out_buffer[offset + out.nbytes :] == 0xA5).all()


@pytest.mark.parametrize(("dtype", "dim"), [(np.float16, 4096), (np.float16, 4095), (np.float32, 3), (np.uint8, 7),
                                          ("S3", 5)])
def test_kernels_take_rows_as_bytes(dtype, dim):
    table = np.zeros((3, dim), dtype)
    table_bytes, _, out_bytes, signature = numba_backend.kernel_views("gather", table, np.arange(2), table[:2], 2)
    row_bytes = dim * np.dtype(dtype).itemsize
    assert table_bytes.dtype == np.uint8 and table_bytes.shape == (3, row_bytes)
    assert out_bytes.dtype == np.uint8 and out_bytes.shape == (2, row_bytes)
    assert not table_bytes.flags.writeable


def test_tables_of_every_dtype_and_alignment_share_one_kernel_signature():
    """The kernels copy bytes by address: a table's dtype, width and alignment compile nothing new."""
    ids = np.arange(2)
    unaligned = np.zeros(3 * 5 * 4 + 1, np.uint8)[1:].view(np.float32).reshape(3, 5)
    tables = [np.zeros((3, 4096), np.float16), np.zeros((3, 7), np.uint8), np.zeros((3, 5), "S3"), unaligned]
    assert not unaligned.flags.aligned
    assert len({numba_backend.kernel_views("gather", t, ids, None, 2)[3] for t in tables}) == 1


def test_concurrent_threads_get_exact_results():
    """8 Python threads call lookup at once for THREAD_SECONDS: no crash, every result exact."""
    table = random_table(5000, 256)
    errors: list[str] = []
    calls = [0] * 8
    stop_at = time.monotonic() + THREAD_SECONDS

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        while time.monotonic() < stop_at:
            n = int(rng.choice([1, 6, 64, 700, 5000]))  # 5,000 rows of 512 bytes: parallel
            ids = rng.integers(0, 5000, n).astype(rng.choice([np.int32, np.int64]))
            result = fastembed.lookup(table, ids, backend="numba")
            if not np.array_equal(result.view(np.uint16), table[ids].view(np.uint16)):
                errors.append(f"thread {index}: wrong rows for {n} ids")
                return
            calls[index] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_SECONDS + 60)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    assert errors == []
    assert all(count > 0 for count in calls)


def _child_lookup(seed: int) -> tuple[bool, int]:
    """Whether the rows are exact, and how many of fastembed's workers run in this process afterwards."""
    table = random_table(2000, 128, seed=1)
    ids = np.random.default_rng(seed).integers(0, 2000, 10000)
    exact = np.array_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
    return bool(exact), sum(thread.name.startswith("fastembed-worker") for thread in threading.enumerate())


def test_a_fork_pool_after_the_parent_gathered_in_parallel_gathers_in_parallel_too():
    table = random_table(2000, 128, seed=1)
    ids = np.random.default_rng(0).integers(0, 2000, 10000)  # 2.4 MiB of rows: parallel
    fastembed.lookup(table, ids, backend="numba")
    fastembed.wait_for_compiles()
    assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])  # parallel in the parent
    context = multiprocessing.get_context("fork")
    with context.Pool(2) as pool:
        results = pool.map_async(_child_lookup, range(4)).get(timeout=120)
    assert results == [(True, numba_backend.thread_count() - 1)] * 4
    # and the parent still works afterwards
    assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])


def test_threads_alternating_tables_never_mix_them_up():
    """Threads switching tables must each get their own table's rows."""
    tables = [random_table(300, 64, seed=seed) for seed in range(4)]
    errors: list[int] = []
    stop_at = time.monotonic() + 3.0

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        while time.monotonic() < stop_at and not errors:
            table = tables[int(rng.integers(0, 4))]
            ids = rng.integers(0, 300, int(rng.choice([1, 6, 40])))
            if not np.array_equal(fastembed.lookup(table, ids, backend="numba").view(np.uint16), table[ids].view(np.uint16)):
                errors.append(index)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []


@pytest.mark.parametrize("shape", [(), (1,), (1, 1, 1)])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("with_out", [False, True])
def test_one_id_row_copy_is_exact(shape, id_dtype, with_out, tmp_path):
    """One id takes the slice-copy path, for plain and memory-mapped tables alike."""
    table = random_table(70, 13, seed=3)
    np.save(tmp_path / "table.npy", table)
    mapped = np.load(tmp_path / "table.npy", mmap_mode="r")
    ids = np.full(shape, 69, id_dtype)
    for source in (table, mapped):
        out = poisoned(shape + (13,), table.dtype) if with_out else None
        result = fastembed.lookup(source, ids, out=out, backend="numba")
        assert type(result) is np.ndarray and (result is out or out is None)
        assert_bit_equal(result, table[ids.reshape(-1)].reshape(shape + (13,)))


@pytest.mark.parametrize("serial_min_rows", [1, 8, 32])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(0,), (2,), (31,), (32,), (4, 4), (2, 1, 3), (0, 3)])
def test_few_ids_without_out_are_exact(monkeypatch, serial_min_rows, dtype, id_dtype, shape, tmp_path):
    """Below SERIAL_MIN_BYTES, lookups without out go through numpy's take, above through the serial kernel
    (below PARALLEL_MIN_BYTES); plain and mapped tables."""
    table = random_table(90, 21, dtype, seed=len(shape))
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", serial_min_rows * 21 * table.dtype.itemsize)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)  # narrow rows reach the serial kernel too
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 16 * 21 * table.dtype.itemsize)
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    np.save(tmp_path / "table.npy", table)
    ids = np.random.default_rng(7).integers(0, 90, shape).astype(id_dtype)
    mapped = np.load(tmp_path / "table.npy", mmap_mode="r").view(table.dtype)  # .npy stores bfloat16 as void
    for source in (table, mapped):
        result = fastembed.lookup(source, ids, backend="numba")
        assert type(result) is np.ndarray and result.shape == shape + (21,)
        assert_bit_equal(result, table[ids.reshape(-1)].reshape(shape + (21,)))


def test_wide_rows_take_the_touched_serial_kernel_from_its_size_and_narrow_ones_numpys_take(monkeypatch):
    """From SERIAL_MIN_BYTES to below PARALLEL_MIN_BYTES of output, rows of TOUCHED_ROW_MIN_BYTES or more are the
    serial kernel's, which touches their pages; narrower rows are numpy's take, with or without out. The parallel
    copy of rows that cannot stream touches the pages of the wide rows only."""
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    kernels = BACKEND.kernels()
    served = []
    for name in ("gather_serial", "copy_rows"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *args, kernel=kernel, name=name: served.append((name, args[-1]))
                            or kernel(*args))
    for name in ("take_new", "take_into"):
        take = getattr(numba_backend, name)
        monkeypatch.setattr(numba_backend, name, lambda *args, take=take, name=name: served.append((name, None))
                            or take(*args))
    touch = numba_backend.TOUCH_PAGES_ROWS_AHEAD
    wide, narrow = numba_backend.TOUCHED_ROW_MIN_BYTES, numba_backend.TOUCHED_ROW_MIN_BYTES // 2
    serial_ids = {row_bytes: numba_backend.SERIAL_MIN_BYTES // row_bytes for row_bytes in (wide, narrow)}
    odd_wide, odd_narrow = wide + 6, narrow + 6  # rows that cannot stream
    parallel_ids = {row_bytes: -(-numba_backend.PARALLEL_MIN_BYTES // row_bytes)
                    for row_bytes in (odd_wide, odd_narrow)}
    cases = [(wide, serial_ids[wide] - 1, "take"), (wide, serial_ids[wide], ("gather_serial", touch)),
             (narrow, serial_ids[narrow], "take"), (narrow, 2 * serial_ids[narrow], "take"),
             (odd_wide, parallel_ids[odd_wide], ("copy_rows", touch)),
             (odd_narrow, parallel_ids[odd_narrow], ("copy_rows", 0))]
    for row_bytes, n, expected in cases:
        table = np.random.default_rng(row_bytes).integers(0, 256, (3 * n, row_bytes), dtype=np.uint8)
        ids = np.random.default_rng(n).integers(0, 3 * n, n)
        fastembed.lookup(table, ids, backend="numba")  # compiles the kernels of the signature (with calls of no row)
        for out in (None, poisoned((n, row_bytes), np.uint8)):
            served.clear()
            assert_bit_equal(fastembed.lookup(table, ids, out=out, backend="numba"), table[ids])
            if expected == "take":
                assert served == [("take_new" if out is None else "take_into", None)], (row_bytes, n)
            else:
                assert set(served) == {expected}, (row_bytes, n, served)


def test_placements_with_cached_stores_touch_the_pages_of_wide_rows_only(monkeypatch):
    """Placed rows that do not stream touch the pages ahead as the gather's do: from TOUCHED_ROW_MIN_BYTES."""
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    kernels = BACKEND.kernels()
    touches = []
    place_rows = kernels.place_rows
    monkeypatch.setattr(kernels, "place_rows", lambda *args: touches.append(args[-2]) or place_rows(*args))
    wide = numba_backend.TOUCHED_ROW_MIN_BYTES
    for row_bytes, expected in ((wide, numba_backend.TOUCH_PAGES_ROWS_AHEAD), (wide // 2 + 8, 0)):
        n = -(-numba_backend.PLACE_SERIAL_MIN_BYTES // row_bytes)  # placed bytes well below the streaming size
        table = np.random.default_rng(row_bytes).integers(0, 256, (3 * n, row_bytes), dtype=np.uint8)
        ids, positions = np.random.default_rng(n).integers(0, 3 * n, n), np.random.default_rng(1).permutation(2 * n)[:n]
        out = poisoned((2 * n, row_bytes), np.uint8)
        expected_out = out.copy()
        expected_out[positions] = table[ids]
        BACKEND.place(table, ids, out.copy(), positions)  # compiles the kernel of the signature (with a call of no row)
        touches.clear()
        BACKEND.place(table, ids, out, positions)
        assert_bit_equal(out, expected_out)
        assert touches and set(touches) == {expected}, (row_bytes, touches)


@pytest.mark.parametrize("bad_id", [-1, -(2**31), 90, 2**31 - 1])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_few_bad_ids_without_out_name_the_first(bad_id, id_dtype):
    """numpy's take would count a negative id from the end: the take path must refuse it like any other."""
    table = random_table(90, 21)
    ids = np.array([[3, 89, 0], [bad_id, 5, bad_id]], id_dtype)
    with pytest.raises(IndexError, match=rf"id {bad_id} at position \(1, 0\) is out of range"):
        fastembed.lookup(table, ids, backend="numba")


@pytest.mark.parametrize("bad_id", [-1, 70, 2**40])
def test_one_bad_id_leaves_out_untouched(bad_id):
    table = random_table(70, 13)
    out = poisoned((1, 13), table.dtype)
    before = out.copy()
    with pytest.raises(IndexError, match=f"id {bad_id} at position 0 is out of range"):
        fastembed.lookup(table, np.array([bad_id]), out=out, backend="numba")
    assert_bit_equal(out, before)


def test_table_reshaped_in_place_is_not_gathered_with_a_stale_view():
    """numpy lets a caller assign table.shape; each call's byte view must follow."""
    table = random_table(64, 32)
    ids = np.arange(40) % 32
    assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
    table.shape = (128, 16)
    out = poisoned((40, 16), table.dtype)
    fastembed.lookup(table, ids, out=out, backend="numba")
    assert_bit_equal(out, table[ids])


def test_table_dtype_reassigned_in_place_gives_outputs_of_the_new_dtype():
    """numpy lets a caller assign table.dtype (same item size, same shape): the output follows it."""
    table = random_table(64, 32)
    ids = np.arange(40) % 64
    fastembed.lookup(table, ids, backend="numba")
    table.dtype = np.int16
    result = fastembed.lookup(table, ids, backend="numba")
    assert result.dtype == np.int16
    assert_bit_equal(result, table[ids])


class _Spy:
    """Wraps a callable and records the batch size of every call."""

    def __init__(self, function):
        self.function, self.batches = function, []

    def __call__(self, table, ids, *rest):
        self.batches.append(ids.size)
        return self.function(table, ids, *rest)


class _RegionSpy:
    """Records the rows of each parallel region the numba backend runs (on fastembed's workers)."""

    def __init__(self, monkeypatch):
        self.batches: list[int] = []
        self.run = numba_backend.WORKERS.run
        monkeypatch.setattr(numba_backend.WORKERS, "run", self)

    def __call__(self, task, n_rows, n_threads, *rest):
        self.batches.append(n_rows)
        return self.run(task, n_rows, n_threads, *rest)


def test_the_shipped_sizes_choose_take_the_serial_kernel_the_workers_and_the_place_kernel(monkeypatch):
    """At the shipped sizes, for rows of 8 KiB (as the default table's): take serves every gather below
    SERIAL_MIN_BYTES, the serial kernel from there to below PARALLEL_MIN_BYTES, the workers from there; placements
    of PLACE_SERIAL_MIN_BYTES or more go to the place kernel, fewer to numpy."""
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    table = random_table(400, 1024, "float64")  # 8 KiB rows, as the default table's
    row_bytes = 1024 * 8
    below_parallel = numba_backend.PARALLEL_MIN_BYTES // row_bytes - 1
    rng = np.random.default_rng(11)
    # The signatures' compiles, which call the kernels.
    BACKEND.gather(table, rng.integers(0, 400, below_parallel + 1), None)
    BACKEND.place(table, np.arange(64), np.empty((64, 1024)), np.arange(64))
    kernels = BACKEND.kernels()
    serial, place_rows = _Spy(kernels.gather_serial), _Spy(kernels.place_rows)
    monkeypatch.setattr(kernels, "gather_serial", serial)
    monkeypatch.setattr(kernels, "place_rows", place_rows)
    take_new, take_into = _Spy(numba_backend.take_new), _Spy(numba_backend.take_into)
    monkeypatch.setattr(numba_backend, "take_new", take_new)
    monkeypatch.setattr(numba_backend, "take_into", take_into)
    numpy_place = _Spy(numba_backend.numpy_backend.BACKEND.place)
    monkeypatch.setattr(numba_backend.numpy_backend.BACKEND, "place", numpy_place)
    parallel = _RegionSpy(monkeypatch)
    serial_rows = numba_backend.SERIAL_MIN_BYTES // row_bytes
    for n in (1, serial_rows - 1, serial_rows, below_parallel):
        ids = rng.integers(0, 400, n)
        assert_bit_equal(BACKEND.gather(table, ids, None), table[ids])
        assert_bit_equal(BACKEND.gather(table, ids, poisoned((n, 1024), table.dtype)), table[ids])
    assert take_new.batches == take_into.batches == [1, serial_rows - 1]
    assert serial.batches == [serial_rows, serial_rows, below_parallel, below_parallel] and parallel.batches == []
    serial.batches.clear()
    ids = rng.integers(0, 400, below_parallel + 1)
    assert_bit_equal(BACKEND.gather(table, ids, None), table[ids])
    assert parallel.batches == [below_parallel + 1] and serial.batches == []
    place_min_rows = numba_backend.PLACE_SERIAL_MIN_BYTES // row_bytes
    for n in (place_min_rows - 1, place_min_rows):
        ids, positions = rng.integers(0, 400, n), rng.permutation(2 * n)[:n]
        out = poisoned((2 * n, 1024), table.dtype)
        expected = out.copy()
        expected[positions] = table[ids]
        BACKEND.place(table, ids, out, positions)
        assert_bit_equal(out, expected)
    assert numpy_place.batches == [place_min_rows - 1] and place_rows.batches == [place_min_rows]


def test_large_outputs_are_cut_into_blocks_of_at_most_max_block_bytes(monkeypatch):
    """Up to MAX_BLOCK_BYTES per thread, one block per thread; above, a block per MAX_BLOCK_BYTES begun."""
    assert numba_backend.blocks_for(0) == 0
    assert numba_backend.blocks_for(1) == 1
    assert numba_backend.blocks_for(2 * numba_backend.MAX_BLOCK_BYTES) == 2
    assert numba_backend.blocks_for(2 * numba_backend.MAX_BLOCK_BYTES + 1) == 3
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "MAX_BLOCK_BYTES", 10 * 64 * 8)  # ten 64-wide float64 rows
    cut: list[int] = []
    run = numba_backend.WORKERS.run

    def counting(task, n_rows, n_threads, n_blocks=1):
        cut.append(n_blocks)
        return run(lambda start, stop: (cut.append((start, stop)), task(start, stop))[1], n_rows, n_threads, n_blocks)

    monkeypatch.setattr(numba_backend.WORKERS, "run", counting)
    table = random_table(500, 64, "float64")
    ids = np.random.default_rng(3).integers(0, 500, 95)
    assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
    assert cut[0] == 10 and sorted(cut[1:]) == [(95 * k // 10, 95 * (k + 1) // 10) for k in range(10)]


def test_batches_are_served_by_numpy_while_their_kernels_compile(monkeypatch):
    """A new argument signature compiles on a background thread; numpy serves, exactly, until it is ready."""
    numba_backend.background_compile.forget()
    BACKEND.reset()
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    parallel, fallback = _RegionSpy(monkeypatch), _Spy(numba_backend.numpy_backend.BACKEND.gather)
    monkeypatch.setattr(numba_backend.numpy_backend.BACKEND, "gather", fallback)
    release = threading.Event()
    original_compile = BACKEND._compile_now

    def held_compile(*arguments):
        release.wait(30)  # the compile "takes" until the test releases it
        original_compile(*arguments)

    monkeypatch.setattr(BACKEND, "_compile_now", held_compile)
    table = random_table(500, 64)
    ids = np.random.default_rng(5).integers(0, 500, 300).astype(np.int32)  # a signature no other test compiled
    for _ in range(3):
        out = poisoned((300, 64), table.dtype)
        assert_bit_equal(fastembed.lookup(table, ids, out=out, backend="numba"), table[ids])
    assert fallback.batches == [300] * 3 and parallel.batches == []
    release.set()
    fastembed.wait_for_compiles()
    assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
    assert fallback.batches == [300] * 3 and parallel.batches == [300]


def test_fork_waits_for_a_background_compile():
    """A child forked mid-compile would inherit numba's compile lock held: fork waits instead."""
    background_compile = numba_backend.background_compile
    background_compile.forget()
    key = ("test", "slow compile")
    forking, armed = threading.Event(), [True]
    # Hooks registered later run first before a fork: this one lets the compile end only once the fork has begun.
    os.register_at_fork(before=lambda: armed[0] and forking.set())

    def compile_until_a_fork_begins() -> None:
        forking.wait(60)
        time.sleep(0.2)

    try:
        background_compile.start(key, compile_until_a_fork_begins)
        context = multiprocessing.get_context("fork")
        with context.Pool(1) as pool:
            ready_in_child = pool.apply_async(background_compile.is_ready, (key,)).get(timeout=60)
    finally:
        armed[0] = False
        forking.set()
    assert ready_in_child
    background_compile.forget()


def test_signatures_compile_again_after_a_refresh(monkeypatch):
    """A refresh forgets the compiled kernels, and the keys of their compiles with them: numba serves again."""
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    table, ids = random_table(200, 48), np.arange(0, 200, 3, dtype=np.int64)
    parallel_calls = []
    for _ in range(2):
        fastembed.lookup(table, ids, backend="numba")
        fastembed.wait_for_compiles()
        spy = _RegionSpy(monkeypatch)
        assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
        parallel_calls.append(spy.batches)
        monkeypatch.undo()
        monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
        monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
        fastembed.dispatch.refresh()
    assert parallel_calls == [[ids.size], [ids.size]]


def test_a_refresh_during_a_lookup_leaves_the_lookup_exact(monkeypatch):
    """reset() between the check for compiled kernels and their use: the lookup is served by numpy, exactly."""
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    table, ids = random_table(200, 48), np.arange(0, 200, 3, dtype=np.int64)
    fastembed.lookup(table, ids, backend="numba")
    fastembed.wait_for_compiles()
    original = numba_backend.kernel_views

    def views_then_reset(*arguments):
        views = original(*arguments)
        monkeypatch.setattr(BACKEND, "_kernels", None)  # what reset() on another thread does at this moment
        return views

    monkeypatch.setattr(numba_backend, "kernel_views", views_then_reset)
    assert_bit_equal(BACKEND.gather(table, ids, None), table[ids])


@pytest.fixture
def fresh_backend():
    """The backend's state forgotten before and after the test (a failure it provokes does not outlive it)."""
    fastembed.dispatch.refresh()
    yield BACKEND
    fastembed.dispatch.refresh()


def test_a_numba_that_fails_to_load_is_refused_by_name_and_skipped_by_auto(monkeypatch, fresh_backend):
    """The failure shows on the background thread, after the call chose numba: the next choice knows it."""
    original = numba_backend._import_or_undo

    def broken_import(name, *rest):
        if name == "fastembed.kernels.gather_cpu":
            raise ImportError("llvmlite is broken")
        return original(name, *rest)

    monkeypatch.setattr(numba_backend, "_import_or_undo", broken_import)
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    table, ids = random_table(200, 48), np.arange(0, 200, 3, dtype=np.int64)
    assert fastembed.select_backend(table, ids).backend == "numba"
    assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])  # numpy, while numba loads
    fastembed.wait_for_compiles()
    with pytest.raises(fastembed.BackendUnavailableError, match="numba failed to load: ImportError: llvmlite is broken"):
        fastembed.lookup(table, ids, backend="numba")
    selection = fastembed.select_backend(table, ids)
    assert selection.backend == "numpy" and "llvmlite is broken" in selection.skipped["numba"][0]
    assert_bit_equal(fastembed.lookup(table, ids), table[ids])


def test_a_jit_disabled_in_numbas_configuration_makes_the_backend_unavailable(monkeypatch, fresh_backend):
    """numba.config.DISABLE_JIT also comes from a .numba_config.yaml, which only numba reads."""
    import numba

    monkeypatch.setattr(numba.config, "DISABLE_JIT", 1)
    with pytest.raises(ImportError, match="JIT is disabled"):
        BACKEND.kernels()
    assert any("JIT is disabled" in reason for reason in BACKEND.unavailable_reasons())
    table, ids = random_table(20, 8), np.array([3, 1])
    assert fastembed.select_backend(table, ids).backend == "numpy"


@pytest.mark.parametrize(("value", "disabled"), [("1", True), ("2", True), ("0", False), ("", False),
                                                 ("true", False), ("0.0", False), (" 1 ", True)])
def test_numba_disable_jit_is_read_as_numba_reads_it(monkeypatch, value, disabled):
    """numba takes an integer and ignores anything else (with a warning): so does the availability check."""
    monkeypatch.setenv("NUMBA_DISABLE_JIT", value)
    assert numba_backend._jit_disabled_by_environment() is disabled


@pytest.mark.parametrize("in_background", [True, False])
def test_a_signature_that_fails_to_compile_is_served_by_numpy_with_the_reason(monkeypatch, fresh_backend, in_background):
    """A corrupt on-disk cache makes numba raise while loading a kernel: numpy serves, describe() tells why."""
    import pickle

    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", in_background)
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    kernels = BACKEND.kernels()

    def corrupt_cache(*arguments):
        raise pickle.UnpicklingError("invalid load key, 'x'")

    monkeypatch.setattr(kernels, "gather_serial", corrupt_cache)
    table, ids = random_table(200, 48), np.arange(0, 200, 3, dtype=np.int64)
    for _ in range(2):
        assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
        fastembed.wait_for_compiles()
    failures = BACKEND.describe()["compile_failures"]
    assert "UnpicklingError: invalid load key" in failures and "numpy serves" in failures


def test_a_compile_that_fails_after_a_refresh_leaves_the_new_record_clean(monkeypatch, fresh_backend):
    """The failure belongs to the record from before the refresh: the signature compiles again afterwards."""
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    kernels = BACKEND.kernels()
    release = threading.Event()
    serial = kernels.gather_serial

    def held_then_broken(*arguments):
        release.wait(30)
        raise RuntimeError("stale compile failed")

    monkeypatch.setattr(kernels, "gather_serial", held_then_broken)
    table, ids = random_table(200, 48), np.arange(0, 200, 3, dtype=np.int64)
    assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])  # numpy; the compile waits
    fastembed.dispatch.refresh()
    release.set()
    fastembed.wait_for_compiles(timeout=60)
    monkeypatch.setattr(kernels, "gather_serial", serial)
    assert "compile_failures" not in BACKEND.describe()
    fastembed.lookup(table, ids, backend="numba")
    fastembed.wait_for_compiles(timeout=60)
    parallel = _RegionSpy(monkeypatch)
    assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
    assert parallel.batches == [ids.size]


def test_wait_for_compiles_returns_at_its_timeout_and_says_so():
    background_compile = numba_backend.background_compile
    release = threading.Event()
    background_compile.start(("test", "held compile"), lambda: release.wait(30))
    try:
        assert fastembed.wait_for_compiles(timeout=0.05) is False
        assert not background_compile.is_ready(("test", "held compile"))
    finally:
        release.set()
    assert fastembed.wait_for_compiles(timeout=30) is True
    assert background_compile.is_ready(("test", "held compile"))
    background_compile.forget()


def test_a_refresh_takes_no_lock_of_the_background_compiles():
    """A fork hook registered before fastembed's runs while fastembed's holds them; a refresh there must go on."""
    background_compile = numba_backend.background_compile
    refreshed = threading.Event()

    def refresh_holding_the_guard():
        with background_compile._guard:
            fastembed.dispatch.refresh()
            refreshed.set()

    thread = threading.Thread(target=refresh_holding_the_guard, daemon=True)
    thread.start()
    thread.join(30)
    assert refreshed.is_set()


def test_each_forking_thread_releases_only_its_own_locks():
    """Two threads forking at once: one thread's after-fork hook must leave the other's locks held."""
    background_compile = numba_backend.background_compile
    background_compile._wait_before_fork()
    other = threading.Thread(target=background_compile._after_fork_in_parent)  # a thread that took nothing
    other.start()
    other.join(30)
    assert not _free_for_another_thread(background_compile._guard)
    background_compile._after_fork_in_parent()
    assert _free_for_another_thread(background_compile._guard)


def test_a_listener_that_refreshes_on_a_load_failure_does_not_deadlock(monkeypatch, fresh_backend):
    from fastembed.backends import base

    def broken_import(name, *rest):
        raise ImportError("llvmlite is broken")

    monkeypatch.setattr(numba_backend, "_import_or_undo", broken_import)
    monkeypatch.setattr(numba_backend, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "SERIAL_MIN_BYTES", 0)
    monkeypatch.setattr(numba_backend, "TOUCHED_ROW_MIN_BYTES", 0)
    monkeypatch.setattr(base, "_availability_listeners", [*base._availability_listeners, fastembed.dispatch.refresh])
    table = random_table(200, 48)
    for ids in (np.arange(0, 200, 3, dtype=np.int64), np.arange(0, 200, 3, dtype=np.int32)):
        assert_bit_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
    assert fastembed.wait_for_compiles(timeout=60)


@pytest.mark.parametrize(("timeout", "error"), [("5", TypeError), (True, TypeError), (-1, ValueError),
                                              (float("nan"), ValueError)])
def test_wait_for_compiles_refuses_a_timeout_that_is_no_duration(timeout, error):
    with pytest.raises(error, match="timeout"):
        fastembed.wait_for_compiles(timeout=timeout)


class _InterruptedJoin:
    """A compile thread whose join is interrupted once by `error` (Ctrl-C, or a signal handler's exception, while a
    fork waits for it)."""

    ident = 1  # started

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    def join(self, timeout=None):
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def is_alive(self):
        return self.error is not None  # running until the interrupted join


def test_a_ctrl_c_while_a_fork_waits_is_held_back_until_the_fork_is_done(monkeypatch):
    background_compile = numba_backend.background_compile
    monkeypatch.setattr(background_compile, "_threads", [_InterruptedJoin(KeyboardInterrupt())])
    background_compile._wait_before_fork()  # the wait goes on to its end
    assert not _free_for_another_thread(background_compile._guard)
    # Raised again as SIGINT, which Python's own handler turns into the KeyboardInterrupt, once the locks are released.
    # Recorded instead of raised: whether a signal reaches this thread's handler is the process's business (a library
    # may hold its own handler), and the check is about when fastembed raises it.
    raised: list[tuple] = []
    monkeypatch.setattr(background_compile.interrupts, "interrupt_again", lambda: raised.append(
        (_free_for_another_thread(background_compile._guard),
         _free_for_another_thread(background_compile._foreground_lock))))
    background_compile._after_fork_in_parent()
    assert raised == [(True, True)]


def test_a_ctrl_c_while_a_fork_waits_reaches_the_program_after_the_fork(tmp_path):
    """Raised again inside the after-fork hook, the KeyboardInterrupt was dropped by Python, and the program went on."""
    from helpers import run_script

    finished = run_script(tmp_path, """
import os, signal, threading, time
from fastembed.backends import background_compile
inside, release = threading.Event(), threading.Event()

def section():  # a compile on another thread, as the fork sees it
    with background_compile.foreground():
        inside.set()
        release.wait(60)

def ctrl_c():
    while threading.main_thread().ident not in background_compile._waiting_to_fork:  # the fork's wait has begun
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)
    release.set()

threading.Thread(target=section).start()
inside.wait()
threading.Thread(target=ctrl_c).start()
try:
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    time.sleep(20)
    print("the Ctrl-C was dropped")
except KeyboardInterrupt:
    print("interrupted after the fork", not release.is_set() or "released")
""")
    assert "interrupted after the fork released" in finished.stdout, finished.stdout + finished.stderr


def test_a_fork_whose_wait_another_error_cut_short_leaves_a_child_that_never_uses_numba(monkeypatch, fresh_backend):
    """Python forks even when the before-fork hook raises: no lock stays held, and the child never compiles."""
    background_compile = numba_backend.background_compile
    monkeypatch.setattr(background_compile, "_threads", [_InterruptedJoin(RuntimeError("a signal handler raised"))])
    monkeypatch.setattr(background_compile, "_no_compiles", False)
    with pytest.raises(RuntimeError):
        background_compile._wait_before_fork()
    background_compile._after_fork_in_child()  # what Python runs in the child
    try:
        assert _free_for_another_thread(background_compile._guard) and background_compile.compiles_disabled()
        started: list[int] = []
        background_compile.start(("never compiled",), lambda: started.append(1))
        assert started == [] and ("never compiled",) not in background_compile._started
        BACKEND.after_fork_in_child()
        assert any("forked while numba loaded or compiled" in reason for reason in BACKEND.unavailable_reasons())
        table = random_table(300, 2048)  # outputs of 2 MiB and more: the numba backend's own size
        assert fastembed.select_backend(table, np.arange(300)).backend == "numpy"
        with pytest.raises(fastembed.BackendUnavailableError, match="forked while numba"):
            fastembed.lookup(table, np.arange(300), backend="numba")
    finally:
        monkeypatch.setattr(background_compile, "_no_compiles", False)
        fastembed.dispatch.refresh()
    assert not BACKEND.unavailable_reasons()


def test_a_fork_waits_no_longer_than_its_bound_for_a_compile_that_cannot_finish(monkeypatch, fresh_backend):
    """A compile stuck for good (an import lock another thread's interrupted import left held): the fork goes on,
    and the child never compiles."""
    background_compile = numba_backend.background_compile
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, args=(60,))
    stuck.start()
    monkeypatch.setattr(background_compile, "_threads", [stuck])
    monkeypatch.setattr(background_compile, "FORK_WAIT_S", 0.3)
    monkeypatch.setattr(background_compile, "_no_compiles", False)
    started = time.monotonic()
    background_compile._wait_before_fork()
    try:
        assert time.monotonic() - started < 30  # the stuck compile would hold it 60 s
        background_compile._after_fork_in_child()  # what Python runs in the child
        assert background_compile.compiles_disabled() and _free_for_another_thread(background_compile._guard)
    finally:
        release.set()
        stuck.join()
        monkeypatch.setattr(background_compile, "_no_compiles", False)


def test_a_compile_a_fork_gave_up_on_is_waited_for_once_and_its_section_not_again_nor_in_the_child(monkeypatch,
                                                                                                      fresh_backend):
    """A stuck compile inside a foreground section made a fork wait FORK_WAIT_S twice (joined, then as a section),
    every later fork again, and the child kept its section and waited FORK_WAIT_S on each fork of its own. Only
    that section is given up: a later section of the same thread is waited for."""
    background_compile = numba_backend.background_compile
    inside, release, again, release_again = (threading.Event() for _ in range(4))

    def stuck_compile() -> None:
        with background_compile.foreground():
            inside.set()
            release.wait(60)
        with background_compile.foreground():
            again.set()
            release_again.wait(60)

    stuck = threading.Thread(target=stuck_compile)
    stuck.start()
    inside.wait()
    monkeypatch.setattr(background_compile, "_threads", [stuck])
    monkeypatch.setattr(background_compile, "FORK_WAIT_S", 0.3)
    monkeypatch.setattr(background_compile, "_no_compiles", False)
    monkeypatch.setattr(background_compile, "_given_up", set())
    monkeypatch.setattr(background_compile, "_given_up_sections", set())
    section_waits: list[float] = []
    real_condition = background_compile._foreground_done

    class CountedCondition:
        def wait(self, timeout: float) -> bool:
            section_waits.append(timeout)
            return real_condition.wait(timeout)

        def __getattr__(self, name: str):
            return getattr(real_condition, name)

    monkeypatch.setattr(background_compile, "_foreground_done", CountedCondition())
    joined: list[threading.Thread] = []
    real_join = background_compile._join
    monkeypatch.setattr(background_compile, "_join", lambda thread, deadline: (joined.append(thread),
                                                                               real_join(thread, deadline)))
    sections = dict(background_compile._foreground_threads)
    try:
        background_compile._wait_before_fork()
        background_compile._after_fork_in_parent()
        assert joined == [stuck] and section_waits == [] and stuck in background_compile._given_up
        background_compile._wait_before_fork()  # a later fork
        background_compile._after_fork_in_parent()
        assert joined == [stuck] and section_waits == []
        release.set()
        again.wait()
        background_compile._wait_before_fork()  # the thread's next section is waited for
        background_compile._after_fork_in_parent()
        assert section_waits
        background_compile._wait_before_fork()
        background_compile._after_fork_in_child()  # what Python runs in the child
        assert background_compile.compiles_disabled()
        assert stuck.ident not in background_compile._foreground_threads and not background_compile._given_up
    finally:
        background_compile._foreground_threads.update(sections)  # the section's own exit removes its token
        release.set()
        release_again.set()
        stuck.join()
        monkeypatch.setattr(background_compile, "_no_compiles", False)


def test_a_ctrl_c_that_cuts_a_compile_threads_start_short_reaches_the_caller_as_itself(monkeypatch):
    """threading's locks are not safe against a Ctrl-C: start() may end in "release unlocked lock" instead."""
    background_compile = numba_backend.background_compile
    real_start = threading.Thread.start

    def start_cut_short(thread):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("release unlocked lock")  # noqa: B904 - chained implicitly, as threading does

    monkeypatch.setattr(threading.Thread, "start", start_cut_short)
    ran: list[int] = []
    key = ("cut short", time.monotonic())
    with pytest.raises(KeyboardInterrupt):
        background_compile.start(key, lambda: ran.append(1))
    monkeypatch.setattr(threading.Thread, "start", real_start)
    background_compile.start(key, lambda: ran.append(1))  # the thread that never started is replaced
    assert fastembed.wait_for_compiles(30) and ran == [1]


def test_a_compile_thread_python_refuses_to_start_leaves_the_call_served_and_a_later_call_tries_again(monkeypatch):
    """Python 3.12.0-3.12.2 start no thread while exit joins threads: the RuntimeError came out of the lookup."""
    background_compile = numba_backend.background_compile
    real_start = threading.Thread.start

    def refused(thread):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    ran: list[int] = []
    key = ("refused", time.monotonic())
    background_compile.start(key, lambda: ran.append(1))
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert ran == [] and not background_compile.is_ready(key)
    background_compile.start(key, lambda: ran.append(1))
    assert fastembed.wait_for_compiles(30) and ran == [1]


def test_a_signal_handlers_lookup_while_its_thread_waits_before_a_fork_starts_no_compile(monkeypatch):
    background_compile = numba_backend.background_compile
    started: list[int] = []
    monkeypatch.setattr(background_compile, "_threads", [])
    background_compile._wait_before_fork()  # holds _guard, as while a fork waits
    try:
        background_compile.start(("in a handler",), lambda: started.append(1))  # returns instead of deadlocking
        assert background_compile.wait(timeout=1) is False
    finally:
        background_compile._after_fork_in_parent()
    assert started == [] and _free_for_another_thread(background_compile._guard)


def test_wait_for_compiles_takes_timeouts_longer_than_a_join_can(monkeypatch):
    background_compile = numba_backend.background_compile
    for timeout in (float("inf"), 1e12):
        running = threading.Thread(target=time.sleep, args=(0.2,))  # stands for a compile under way
        running.start()
        monkeypatch.setattr(background_compile, "_threads", [running])
        assert fastembed.wait_for_compiles(timeout) and not running.is_alive()


def test_a_failed_numba_import_drops_only_its_own_modules(monkeypatch):
    sys.modules.pop("fastembed_test_bystander", None)

    def import_and_fail(name):
        sys.modules["numba_fake_part"] = types.ModuleType("numba_fake_part")
        sys.modules["numba.fake_part"] = types.ModuleType("numba.fake_part")
        sys.modules["llvmlite.fake_part"] = types.ModuleType("llvmlite.fake_part")
        sys.modules["fastembed_test_bystander"] = types.ModuleType("fastembed_test_bystander")  # another thread's
        raise ImportError("numba cannot load")

    monkeypatch.setattr(numba_backend.importlib, "import_module", import_and_fail)
    try:
        with pytest.raises(ImportError):
            numba_backend._import_or_undo("fastembed.kernels.gather_cpu")
        assert "numba.fake_part" not in sys.modules and "llvmlite.fake_part" not in sys.modules
        assert "fastembed_test_bystander" in sys.modules and "numba_fake_part" in sys.modules
    finally:
        for name in ("numba_fake_part", "fastembed_test_bystander"):
            sys.modules.pop(name, None)


def test_an_interrupted_import_drops_the_submodules_a_failed_package_left_so_the_next_import_works(tmp_path,
                                                                                                    monkeypatch):
    """A Ctrl-C while numba imports another package for the first time (yaml, say): Python drops that package and
    keeps the submodules it had loaded, which its next import would not attach to it (numba then fails to load
    for good). Those orphans go with the failed import; the next import finds the package whole."""
    package = tmp_path / "fastembed_test_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from . import error\nimport fastembed_test_interrupt\n")
    (package / "error.py").write_text("VALUE = 7\n")
    (tmp_path / "fastembed_test_interrupt.py").write_text("raise KeyboardInterrupt\n")
    (tmp_path / "fastembed_test_user.py").write_text(
        "import fastembed_test_pkg\nVALUE = fastembed_test_pkg.error.VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ("fastembed_test_pkg", "fastembed_test_pkg.error", "fastembed_test_interrupt", "fastembed_test_user")
    try:
        with pytest.raises(KeyboardInterrupt):
            numba_backend._import_or_undo("fastembed_test_user")
        assert not any(name in sys.modules for name in names)
        (tmp_path / "fastembed_test_interrupt.py").write_text("")
        assert numba_backend._import_or_undo("fastembed_test_user").VALUE == 7
    finally:
        for name in names:
            sys.modules.pop(name, None)


FORK_WHILE_ANOTHER_FORK_WAITS = """
import os, signal, threading, time
import fastembed
from fastembed.backends import background_compile

def interrupt(*_):
    raise {exception}

signal.signal(signal.SIGALRM, interrupt)
running = threading.Thread(target=time.sleep, args=(1.0,))  # stands for a compile under way
running.start()
background_compile._threads.append(running)

def other_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

other = threading.Thread(target=other_fork)
other.start()
time.sleep(0.2)  # the other thread waits for the compile in its fork hook, holding the hook's guard
signal.setitimer(signal.ITIMER_REAL, 0.2)  # a Ctrl-C while this thread's fork waits for that guard
interrupted, pid = False, 0
try:
    pid = os.fork()
    if pid == 0:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(10)  # a child that hangs is ended
        os._exit(0 if fastembed.wait_for_compiles(timeout=5) else 3)
    time.sleep(2.0)  # the Ctrl-C held back is raised here, after the fork
except {exception}:
    interrupted = True
_, status = os.waitpid(pid, 0)
other.join()
print(interrupted, os.waitstatus_to_exitcode(status), not running.is_alive())
"""


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "setitimer"), reason="needs fork and setitimer")
@pytest.mark.parametrize("exception", ["KeyboardInterrupt", "RuntimeError"])
def test_a_signal_while_a_fork_waits_for_another_threads_fork_leaves_the_child_the_hooks_locks_free(tmp_path,
                                                                                                   exception):
    """A Ctrl-C does not cut the wait for the other thread's fork (which waits for a compile) short: it comes after
    the fork. Another exception from a signal handler does (Python forks anyway and prints it): the child, which
    lacks the thread that holds the hook's guard, gets a new one. Either way the child never hangs."""
    result = run_script(tmp_path, FORK_WHILE_ANOTHER_FORK_WAITS.replace("{exception}", exception))
    assert result.returncode == 0, result.stderr
    expected_in_the_parent = "True" if exception == "KeyboardInterrupt" else "False"
    assert result.stdout.split() == [expected_in_the_parent, "0", "True"], (result.stdout, result.stderr)


def test_no_compile_starts_once_interpreter_exit_has_begun(monkeypatch):
    background_compile = numba_backend.background_compile
    monkeypatch.setattr(background_compile, "_exiting", False)
    background_compile._stop_new_compiles()
    started = []
    background_compile.start(("test", "after exit began"), lambda: started.append(1))
    background_compile.wait()
    assert started == [] and not background_compile.is_ready(("test", "after exit began"))


def test_compiles_waiting_for_their_turn_when_exit_begins_never_run(monkeypatch):
    """Exit waits for the compile under way only."""
    background_compile = numba_backend.background_compile
    monkeypatch.setattr(background_compile, "_exiting", False)
    ran: list[str] = []
    background_compile._one_at_a_time.acquire()  # the compile under way
    try:
        background_compile.start(("test", "queued"), lambda: ran.append("queued"))
        background_compile._stop_new_compiles()
        background_compile.start(("test", "after the flag"), lambda: ran.append("after the flag"))
    finally:
        background_compile._one_at_a_time.release()
    background_compile.wait(timeout=30)
    assert ran == [] and background_compile.is_ready(("test", "queued"))


def test_a_server_thread_that_outlives_the_main_thread_compiles_and_exit_waits_for_it(tmp_path):
    """No compile started once the main thread had ended, and such a server was served by numpy for good."""
    done = run_script(tmp_path, f"""
import os, threading, time
os.environ["NUMBA_CACHE_DIR"] = {str(tmp_path / "cache")!r}  # a compile of its own
import numpy as np, fastembed
from fastembed.backends import background_compile
table = np.random.default_rng(0).standard_normal((4000, 1024)).astype(np.float32)

def serve():
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    ids = np.arange(0, 4000, 2, dtype=np.int64)
    assert np.array_equal(fastembed.lookup(table, ids), table[ids])
    assert fastembed.wait_for_compiles(300)
    started = list(background_compile._started)
    print("compiled:", len(started) > 0 and all(map(background_compile.is_ready, started)), flush=True)

threading.Thread(target=serve).start()
""")
    assert done.returncode == 0, done.stderr
    assert "compiled: True" in done.stdout, done.stdout + done.stderr


def test_lookups_in_a_del_that_the_clearing_of_modules_runs_are_served(tmp_path):
    """Python refuses imports then: ndarray.ctypes and numba's settings, read on the way, raised ImportError."""
    done = run_script(tmp_path, """
import os
import numpy as np, fastembed
table = np.random.default_rng(0).standard_normal((20000, 1024)).astype(np.float16)
quantized = fastembed.Embedding(table).quantize("q8_0")
for n in (10, 5000, 30000):
    fastembed.lookup(table, np.arange(n) % 20000); quantized(np.arange(n) % 20000)
fastembed.wait_for_compiles(300)

class AtTeardown:  # held by a module global: its __del__ runs while interpreter teardown clears the modules
    def __init__(self):
        self.lookup, self.write, self.array_equal, self.arange = fastembed.lookup, os.write, np.array_equal, np.arange
        self.table, self.quantized, self.empty = table, quantized, np.empty

    def __del__(self):
        for n in (10, 5000, 30000):
            ids = self.arange(n) % 20000
            expected = self.table[ids]
            assert self.array_equal(self.lookup(self.table, ids), expected)
            out = self.empty(expected.shape, expected.dtype)
            assert self.lookup(self.table, ids, out=out) is out and self.array_equal(out, expected)
            assert self.quantized(ids).shape == (n, 1024)
        self.write(1, b"served at teardown\\n")

at_teardown = AtTeardown()
""")
    assert "served at teardown" in done.stdout, done.stdout + done.stderr


def test_a_large_lookup_in_an_atexit_handler_exits(tmp_path):
    """The lookup is served by numpy, and no compile thread is left running into interpreter teardown."""
    done = run_script(
        tmp_path,
        "import atexit, threading, numpy as np, fastembed\n"
        "table = np.random.default_rng(0).standard_normal((4000, 1024)).astype(np.float32)\n"
        "def at_exit():\n"
        "    ids = np.arange(0, 4000, 2, dtype=np.int64)\n"
        "    assert np.array_equal(fastembed.lookup(table, ids), table[ids])\n"
        "    compiling = [t for t in threading.enumerate() if t.name == 'fastembed-compile']\n"
        "    print('looked up; compile threads started:', len(compiling), flush=True)\n"
        "atexit.register(at_exit)\n",
    )
    assert done.returncode == 0, done.stderr
    assert "looked up; compile threads started: 0" in done.stdout


def test_a_cache_that_cannot_be_written_keeps_the_compiled_kernels_and_turns_itself_off(tmp_path):
    """A full disk under the cache folder (a write that fails as numba saves a kernel): the kernels compiled are
    used, and info says the cache is off and why, rather than numpy serving the signature for good."""
    done = subprocess.run([sys.executable, "-c", """
import errno
import numpy as np
from numba.core import caching
def full_disk(self, signature, data):
    if self._enabled:  # as numba's own write checks first
        raise OSError(errno.ENOSPC, "No space left on device")
caching.Cache._save_overload = full_disk
import fastembed
from fastembed.backends import numba_backend
table = np.random.default_rng(0).standard_normal((3000, 1024)).astype(np.float32)
ids = np.random.default_rng(1).integers(0, 3000, 4096)
fastembed.lookup(table, ids)
fastembed.wait_for_compiles()
fastembed.Embedding(table).quantize("q8_0")(ids)
fastembed.wait_for_compiles()
assert np.array_equal(fastembed.lookup(table, ids), table[ids])
facts = numba_backend.BACKEND.describe()
print(facts.get("compile_failures"), len(numba_backend.BACKEND._compiles.done))
print(facts["kernel_cache"])
"""], capture_output=True, text=True, timeout=300, env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    failures, kernel_cache = done.stdout.splitlines()
    assert failures == "None 2"
    assert kernel_cache.startswith("off: a write to it failed (OSError: [Errno 28] No space left on device)")


@pytest.mark.parametrize("first_calls", ["warm", "cold"])
def test_the_packages_own_functions_work_in_a_finalizer_the_final_garbage_collection_runs(tmp_path, first_calls):
    """Python refuses every import then, even of a module already loaded: the functions import nothing, neither
    where they were called before nor where the finalizer makes their first calls (numpy's ndarray.min imports)."""
    script = tmp_path / "script.py"
    script.write_text("""
import os, sys
import numpy as np
import fastembed
table = np.random.default_rng(0).standard_normal((1000, 64)).astype(np.float32)
def calls():
    yield "select_backend", lambda: fastembed.select_backend(table, [1], backend="numpy").backend == "numpy"
    yield "wait_for_compiles", lambda: fastembed.wait_for_compiles() and fastembed.wait_for_compiles(timeout=5)
    yield "empty_cache", lambda: fastembed.empty_cache() is None
    yield "set_output_cache_limit", lambda: fastembed.set_output_cache_limit(2**20) is None
    # Compared by a ufunc: numpy's array_equal and ndarray.all import on first use.
    yield "lookup", lambda: bool(np.logical_and.reduce(fastembed.lookup(table, [1, 2]) == table[[1, 2]], axis=None))
if sys.argv[1] == "warm":
    for name, call in calls():
        assert call(), name
class InACycle:
    def __del__(self):
        for name, call in calls():
            try:
                os.write(1, f"{name}: {'ok' if call() else 'wrong'}\\n".encode())
            except BaseException as error:
                os.write(1, f"{name}: {type(error).__name__}: {error}\\n".encode())
cycle = InACycle()
cycle.itself = cycle
""")
    done = subprocess.run([sys.executable, str(script), first_calls], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert lines == [f"{name}: ok" for name in ("select_backend", "wait_for_compiles", "empty_cache",
                                                 "set_output_cache_limit", "lookup")], done.stdout + done.stderr


@pytest.mark.parametrize("where", ["a thread outliving the main one", "an atexit handler"])
def test_fastembed_first_imported_once_exit_has_begun_looks_up_and_starts_no_compile(tmp_path, where):
    """Python refuses exit hooks registered once its exit has begun: the import goes on and exit gets no compile."""
    done = run_script(tmp_path, f"""
import atexit, threading, time
import numpy as np
def first_use():
    import fastembed
    table = np.random.default_rng(0).standard_normal((4000, 1024)).astype(np.float32)
    ids = np.arange(0, 4000, 2, dtype=np.int64)
    assert np.array_equal(fastembed.lookup(table, ids), table[ids])
    compiling = [t for t in threading.enumerate() if t.name == "fastembed-compile"]
    print("looked up; compile threads started:", len(compiling), flush=True)
if {where!r} == "an atexit handler":
    atexit.register(first_use)
else:
    threading.Thread(target=lambda: (time.sleep(0.3), first_use())).start()
""")
    assert done.returncode == 0, done.stderr
    assert "looked up; compile threads started: 0" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("cache_bytes", [0, 2**30])
def test_large_allocating_lookup_is_exact_from_a_faulted_in_output(monkeypatch, cache_bytes):
    """A new output of about 8 MB comes faulted in (from the output cache, or from numpy when it is off), then gathered."""
    from fastembed.backends import output_cache

    monkeypatch.setattr(output_cache, "_limit", cache_bytes)
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    table = random_table(3000, 2048, seed=9)
    ids = np.random.default_rng(9).integers(0, 3000, (40, 50))
    for _ in range(2):  # the second lookup reuses the first one's buffer when the cache is on
        result = fastembed.lookup(table, ids, backend="numba")
        assert result.nbytes == 2000 * 2048 * 2
        assert_bit_equal(result, table[ids])
        del result
    output_cache.empty()


def test_writeable_and_read_only_tables_share_one_kernel_signature():
    from fastembed.backends import numba_backend

    table = random_table(8, 16)
    read_only = table.view()
    read_only.flags.writeable = False
    ids = np.arange(4)
    signatures = {numba_backend.kernel_views("gather", t, ids, None, 4)[3] for t in (table, read_only)}
    assert len(signatures) == 1
    assert table.flags.writeable  # the caller's table is left as it was


def test_an_interrupt_anywhere_in_a_parallel_lookup_leaves_the_parallel_lock_free(monkeypatch):
    """Ctrl-C just after the lock was taken, before the try that gives it back, used to keep it taken for good: every
    later lookup then ran serially, and the next compile (which waits for the lock) hung a fork and the exit."""
    table, quantized = random_table(4096, 1024, "float32"), random_quantized("q8_0", 4096, 1024)
    ids = np.random.default_rng(0).integers(0, 4096, 1024)  # 4 MiB out: the parallel kernels
    out, dequantized = poisoned((1024, 1024), np.float32), poisoned((1024, 1024), np.float16)
    fastembed.lookup(table, ids, out=out, backend="numba")
    fastembed.lookup(quantized, ids, out=dequantized, dtype=np.float16, backend="numba")
    fastembed.wait_for_compiles()
    from fastembed.backends import cpu_workers as workers

    monkeypatch.setattr(numba_backend, "thread_count", lambda: 2)  # regions, whatever this machine has
    ours = {numba_backend.NumbaBackend._run_parallel.__code__, numba_backend.NumbaBackend._run_dequantize.__code__,
            *(function.__code__ for function in (workers.Workers.run, workers.Workers._hand_out, workers.Workers.start,
                                                 workers._Region.claim, workers._Region.close))}
    regions = []
    region_init = workers._Region.__init__

    def recorded(region, *arguments):
        region_init(region, *arguments)
        regions.append(region)

    def action():
        fastembed.lookup(table, ids, out=out, backend="numba")
        fastembed.lookup(quantized, ids, out=dequantized, dtype=np.float16, backend="numba")

    runs = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workers._Region, "__init__", recorded)
        for _ in interrupted_runs(lambda code: code in ours, action):
            runs += 1
            assert not BACKEND._parallel_lock.locked()
            # no worker is inside a region, and none can start a block: nothing is written after the call ended
            assert all(region.closed and region.busy == 0 and region.task is None for region in regions)
    assert runs >= 10 and len(regions) >= runs
    action()
    assert_bit_equal(out, table[ids])
    assert_bit_equal(dequantized, fastembed.lookup(quantized, ids, dtype=np.float16, backend="numpy"))


def test_an_interrupt_anywhere_in_a_cold_lookup_leaves_compiles_locks_and_results_whole(monkeypatch):
    """Ctrl-C anywhere in fastembed's code while a lookup starts its background compile (and probes a DLPack `out`):
    a compile thread made but never started used to stay listed, so waiting for compiles, and every fork, raised
    "cannot join thread before it is started", and its kernels were never compiled."""
    # One caught in the output cache's finalizer would be raised again later, in this test's own code.
    monkeypatch.setattr(numba_backend.output_cache.interrupts, "interrupt_again", lambda: None)
    package = os.path.dirname(fastembed.__file__)
    table = random_table(4096, 1024, "float32")
    ids = np.random.default_rng(0).integers(0, 4096, 1024)  # 4 MiB: the parallel kernels
    out = np.empty((1024, 1024), np.float32)

    def action():
        fastembed.dispatch.refresh()  # the kernels are compiled (loaded from numba's cache) again
        fastembed.lookup(table, ids)
        fastembed.lookup(table, ids, out=Producer(out))
        fastembed.wait_for_compiles()

    runs = 0
    for _ in interrupted_runs(lambda code: code.co_filename.startswith(package), action):
        runs += 1
        assert fastembed.wait_for_compiles(timeout=60)
        assert not BACKEND._parallel_lock.locked()
        out[:] = 0
        fastembed.lookup(table, ids, out=out, backend="numba")
        assert_bit_equal(out, table[ids])
    assert runs > 100
    assert {status.name: status.available for status in fastembed.backend_statuses()}["numba"]


def test_an_interrupt_anywhere_in_a_foreground_section_leaves_no_section_open():
    """A fork waits for every thread's foreground section: one left marked open, or its lock left taken (by an
    interrupt on entering the condition's Python __exit__), would make every later fork wait for ever."""
    background_compile = numba_backend.background_compile

    def sections():
        with background_compile.foreground(), background_compile.foreground():
            pass

    runs = 0
    for _ in interrupted_runs(lambda code: code.co_filename == background_compile.__file__, sections):
        runs += 1
        assert _free_for_another_thread(background_compile._foreground_lock)
        assert not background_compile._foreground_threads.get(threading.get_ident())
    assert runs > 4


def test_an_interrupt_anywhere_in_the_wait_before_a_fork_leaves_no_lock_taken_after_it():
    """A Ctrl-C just after the fork hook took a lock, before it noted taking it, kept the lock for good: then
    waiting for compiles ignored its timeout and every compile start hung."""
    background_compile = numba_backend.background_compile
    hook = background_compile._wait_before_fork.__code__
    runs = 0

    def fork_hooks():
        try:
            background_compile._wait_before_fork()
        finally:
            background_compile._release_fork_locks()  # as os.fork does, whatever the hook before it raised

    for _ in interrupted_runs(lambda code: code is hook, fork_hooks):
        runs += 1
        background_compile._ctrl_c_held.clear()
        background_compile._waiting_to_fork.clear()
        assert _free_for_another_thread(background_compile._guard)
        assert _free_for_another_thread(background_compile._foreground_lock)
        assert background_compile.wait(timeout=1)
    assert runs > 4


def _free_for_another_thread(lock) -> bool:
    """Whether another thread can take `lock` within a second (this thread may own a re-entrant one)."""
    taken = []

    def take():
        if lock.acquire(timeout=1):
            taken.append(True)
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return bool(taken)


def test_a_failed_kernel_import_leaves_none_of_the_modules_it_brought_in(tmp_path):
    """The dequantizing kernels' pieces are sibling modules of the one imported: they go too, with numba, so that the
    next import does not mix them with a fresh numba."""
    code = (
        "import importlib, sys\n"
        "from fastembed.backends import numba_backend\n"
        "real_import = importlib.import_module\n"
        "def import_then_fail(name):\n"  # every module imported, then an interruption before the import returns
        "    real_import(name)\n"
        "    raise RuntimeError('interrupted')\n"
        "importlib.import_module = import_then_fail\n"
        "try:\n"
        "    numba_backend._import_or_undo('fastembed.kernels.dequant_cpu')\n"
        "except RuntimeError:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('fastembed.kernels.', 'numba', 'llvmlite'))))\n"
    )
    result = run_script(tmp_path, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_without_a_place_to_cache_kernels_numba_still_serves_and_info_says_so(tmp_path):
    """numba refuses to define a kernel that asks for caching when it has nowhere to write: the backend was lost."""
    done = run_script(tmp_path, """
import numba.core.caching

class NoPlace:  # as where the package is read-only and neither a home nor NUMBA_CACHE_DIR is writable
    @classmethod
    def from_function(cls, py_func, py_file):
        return None

caching = numba.core.caching
(getattr(caching, "CacheImpl", None) or caching._CacheImpl)._locator_classes = [NoPlace]  # the name before numba 0.60
import numpy as np, fastembed
from fastembed import info
from fastembed.backends import numba_backend
table = np.random.default_rng(0).standard_normal((4000, 1024)).astype(np.float32)
ids = np.arange(0, 4000, 2)
assert np.array_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
assert fastembed.wait_for_compiles(300) and not numba_backend.BACKEND.unavailable_reasons()
assert np.array_equal(fastembed.lookup(table, ids, backend="numba"), table[ids])
print(numba_backend.BACKEND.describe()["kernel_cache"])
""")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("off: numba finds no writable place"), done.stdout
