"""Measure each lever of the numba gather in one process (docs/backends.md, "The levers").

    python bench/levers.py [--reps 15] [--batches 8192,65536]
    python bench/levers.py --parallel-threshold [--gap-ms 2] [--batches 2,4,8,16,32,64,128,512]
    python bench/levers.py --stream-threshold [--batches 32,64,...,4096]
    python bench/levers.py --id-patterns [--batches 8192,65536]
    python bench/levers.py --alias-offsets [0,16,...,4080] [--batches 8192,65536]
    python bench/levers.py --placements 6 [--batches 8192]
    python bench/levers.py --read-rates [--batches 8192,65536]

Default 129,280 x 4,096 float16 table, uniform ids (8,192 and 65,536 by default) into
a preallocated output; every variant runs once per repetition on fresh ids
(interleaved, in an order rotated each repetition, the caches settled before
each: see fastembed.benchmark.measure.settle_host_caches), medians reported
as GB/s = 2 x rows x row bytes / time, and in brackets as the median
fraction of the non-temporal copy timed in the same repetition.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
from numba import njit, prange

import fastembed
from fastembed.backends import numba_backend
from fastembed.benchmark.measure import settle_host_caches
from fastembed.kernels.cpu_intrinsics import store_fence
from fastembed.kernels.gather_cpu import _stream_row

#: The streaming kernel's options (prefetches, alias window) as the numba backend ships them.
SHIPPED = (numba_backend.PREFETCH_ROWS_AHEAD, numba_backend.TOUCH_PAGES_ROWS_AHEAD, numba_backend.ALIAS_WINDOW)
ALIAS_WINDOW = numba_backend.ALIAS_WINDOW


@njit(parallel=True, nogil=True)
def gather_slice_assignment(table, ids, out, n_blocks):
    """The naive form: a slice assignment per row (what the word loop replaces)."""
    n = ids.size
    for block in prange(n_blocks):
        for i in range(block * n // n_blocks, (block + 1) * n // n_blocks):
            out[i, :] = table[ids[i], :]
    return -1


@njit(parallel=True, nogil=True)
def gather_in_sorted_order(table, ids, order, out, n_blocks):
    """The streaming kernel's copy, visiting rows in id order: out[order[k]] = table[ids[order[k]]].

    Repeated ids become neighbours (the second read hits the cache) and the
    table is read in address order; the writes scatter instead.
    """
    row_bytes = table.shape[1] * table.itemsize
    n = ids.size
    for block in prange(n_blocks):
        start, stop = block * n // n_blocks, (block + 1) * n // n_blocks
        for k in range(start, stop):
            i, following = order[k], order[k + 1 if k + 1 < stop else k]
            _stream_row(out.ctypes.data + np.uintp(i) * row_bytes, table.ctypes.data + np.uintp(ids[i]) * row_bytes,
                        row_bytes, True, table.ctypes.data + np.uintp(ids[following]) * row_bytes, ALIAS_WINDOW)
        store_fence()
    return -1


def variants(kernels, threads):
    one, four = threads, 4 * threads

    def stream(prefetch_rows_ahead: int, touch_pages_rows_ahead: int) -> Callable:
        return lambda t, i, o: kernels.gather_parallel_stream(
            t, i, o, four, prefetch_rows_ahead, touch_pages_rows_ahead, ALIAS_WINDOW)

    return {
        "slice assignment, 1 block/thread": lambda t, i, o: gather_slice_assignment(t, i, o, one),
        "word loop, 1 block/thread": lambda t, i, o: kernels.gather_parallel(t, i, o, one),
        "word loop, 4 blocks/thread": lambda t, i, o: kernels.gather_parallel(t, i, o, four),
        "+ non-temporal stores": stream(0, 0),
        "+ prefetch of the next row, line by line": stream(1, 0),
        "+ pages of the row 8 ahead touched": stream(1, 8),
        "+ pages of the row 16 ahead touched": stream(1, 16),
        "row 4 ahead prefetched instead, no pages touched": stream(4, 0),
        "row 4 ahead prefetched, pages of the row 8 ahead": stream(4, 8),
        "row 4 ahead prefetched, pages of the row 16 ahead (fastembed)": stream(4, 16),
        "rows in sorted id order (np.argsort timed too)": lambda t, i, o: gather_in_sorted_order(
            t, i, np.argsort(i, kind="stable"), o, four),
    }


def copies(kernels, threads):
    def numpy_copy(source, out):
        np.copyto(out, source)

    return {
        "copy: np.copyto": numpy_copy,
        "copy: numba, cached stores": lambda s, o: kernels.copy_parallel(s, o, 4 * threads),
        "copy: numba, non-temporal stores": lambda s, o: kernels.copy_parallel_stream(s, o, 4 * threads, ALIAS_WINDOW),
    }


def settled_seconds(call: Callable[[], object]) -> float:
    """Seconds `call()` takes, the caches settled first: no call pays for the dirty lines of the one before."""
    settle_host_caches()
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def parallel_threshold(table: np.ndarray, batches: list[int], repetitions: int, gap_s: float) -> None:
    """Serial vs parallel kernel per call: where the thread wake-up starts to pay.

    With a gap, each call is timed alone after sleeping `gap_s`, as between
    the decode steps of a model, when the pool's threads have gone to sleep.
    """
    kernels, blocks = numba_backend.kernels(), numba_backend.thread_count() * numba_backend.BLOCKS_PER_THREAD
    rng = np.random.default_rng(0)
    calls_per_sample = 20 if gap_s else 200
    print(f"gap between calls: {gap_s * 1e3:g} ms")
    print("| ids | serial | parallel | serial / parallel |\n| --- | --- | --- | --- |")
    for n in batches:
        out = np.empty((n, table.shape[1]), np.uint64)
        pool = [rng.integers(0, table.shape[0], n) for _ in range(4000)]
        calls = {
            "serial": lambda ids: kernels.gather_serial(table, ids, out),
            "parallel": lambda ids: kernels.gather_parallel(table, ids, out, min(n, blocks)),
        }
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for repetition in range(repetitions + 2):
            for index, (name, call) in enumerate(calls.items()):
                first = (repetition * len(calls) + index) * calls_per_sample % (len(pool) - calls_per_sample)
                elapsed = 0.0
                for ids in pool[first : first + calls_per_sample]:
                    if gap_s:
                        time.sleep(gap_s)
                    started = time.perf_counter()
                    call(ids)
                    elapsed += time.perf_counter() - started
                if repetition >= 2:
                    samples[name].append(elapsed / calls_per_sample)
        serial, parallel = (statistics.median(samples[name]) for name in calls)
        print(f"| {n} | {serial * 1e6:.1f} us | {parallel * 1e6:.1f} us | {serial / parallel:.2f} |")


def _memory_mapped(table: np.ndarray) -> np.ndarray:
    """The table written to a temporary .npy and memory-mapped read-only (then read once: page cache)."""
    import os
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "table.npy")
    np.save(path, table)
    mapped = np.load(path, mmap_mode="r")
    os.unlink(path)  # the mapping keeps the file alive until the process ends
    mapped.sum(axis=0, dtype=np.uint64)  # bring every page into the page cache
    return np.asarray(mapped)


def stream_threshold(table: np.ndarray, batches: list[int], repetitions: int) -> None:
    """Cached vs non-temporal stores, alone and with the caller's read of the output."""
    kernels, blocks = numba_backend.kernels(), numba_backend.thread_count() * numba_backend.BLOCKS_PER_THREAD
    rng = np.random.default_rng(0)
    print("| ids | output | cached | streaming | cached + read | streaming + read |\n| --- | --- | --- | --- | --- | --- |")
    for n in batches:
        out = np.empty((n, table.shape[1]), np.uint64)
        stores = {
            "cached": lambda ids: kernels.gather_parallel(table, ids, out, min(n, blocks)),
            "streaming": lambda ids: kernels.gather_parallel_stream(table, ids, out, min(n, blocks), *SHIPPED),
        }
        samples: dict[tuple[str, bool], list[float]] = {(name, read): [] for read in (False, True) for name in stores}
        for repetition in range(repetitions + 2):
            for (name, read), values in samples.items():
                ids = rng.integers(0, table.shape[0], n)

                def store_then_maybe_read() -> None:
                    stores[name](ids)
                    if read:
                        np.bitwise_xor.reduce(out, axis=None)

                seconds = settled_seconds(store_then_maybe_read)
                if repetition >= 2:
                    values.append(seconds)
        cells = [f"{statistics.median(samples[key]) * 1e3:.3f} ms" for key in samples]
        print(f"| {n} | {out.nbytes / 2**20:g} MiB | {' | '.join(cells)} |")


def id_patterns(table: np.ndarray, batches: list[int], repetitions: int) -> None:
    """fastembed's streaming kernel on ids that read the table in runs of 1, 2, 8 rows or all in order.

    Sequential ids make the gather a copy through the gather's own code; the
    shorter the runs, the more the memory system pays per scattered block.
    Random rows from a window of the table (8,192 rows: 64 MiB) instead of
    the whole table show what the spread of the addresses costs.
    Interleaved with the non-temporal copy, caches settled before each call.
    """
    kernels, blocks = numba_backend.kernels(), numba_backend.thread_count() * numba_backend.BLOCKS_PER_THREAD
    rng = np.random.default_rng(0)
    vocab_size = table.shape[0]

    def runs_of(length: int, n: int) -> np.ndarray:
        starts = rng.integers(0, vocab_size // length, n // length) * length
        return (starts[:, None] + np.arange(length)).reshape(-1)

    def from_window(n: int, window: int) -> np.ndarray:
        """n distinct rows in random order, from `window` consecutive rows somewhere in the table."""
        return int(rng.integers(0, vocab_size - window + 1)) + rng.permutation(window)[:n]

    patterns = {
        "sequential ids (a copy through the gather kernel)": lambda n: np.arange(start := int(rng.integers(0, vocab_size - n)), start + n),
        "random order within a window of n rows": lambda n: from_window(n, n),
        "n random rows of a window of 4n rows (or the table)": lambda n: from_window(n, min(4 * n, vocab_size)),
        "random runs of 8 rows (64 KiB)": lambda n: runs_of(8, n),
        "random runs of 2 rows (16 KiB)": lambda n: runs_of(2, n),
        "uniform random ids (8 KiB rows)": lambda n: rng.integers(0, vocab_size, n),
    }
    limit = "copy: numba, non-temporal stores"
    cells: dict[str, list[str]] = {}
    for n in batches:
        out = np.empty((n, table.shape[1]), np.uint64)
        samples: dict[str, list[float]] = {name: [] for name in [*patterns, limit]}
        for repetition in range(repetitions + 2):
            for name in samples:
                if name == limit:
                    start = int(rng.integers(0, vocab_size - n))
                    source = table[start : start + n]
                    call = lambda: kernels.copy_parallel_stream(source, out, blocks, ALIAS_WINDOW)  # noqa: E731
                else:
                    ids = patterns[name](n)
                    call = lambda: kernels.gather_parallel_stream(table, ids, out, blocks, *SHIPPED)  # noqa: E731
                seconds = settled_seconds(call)
                if repetition >= 2:
                    samples[name].append(seconds)
        copy_time = statistics.median(samples[limit])
        for name, values in samples.items():
            median = statistics.median(values)
            cells.setdefault(name, []).append(
                f"{2 * n * table.shape[1] * 8 / median / 1e9:.1f} GB/s ({copy_time / median:.2f})")
    print(f"| ids read as | {' | '.join(f'{n} ids' for n in batches)} |\n| --- |{' --- |' * len(batches)}")
    for name, row in cells.items():
        print(f"| {name} | {' | '.join(row)} |")


def placements(count: int, batches: list[int], repetitions: int) -> None:
    """fastembed's streaming kernel against the copy on `count` default tables allocated side by side.

    The tables hold the same kind of data and differ only in where the
    allocator (and, in a virtual machine, the host) placed them. Each
    repetition measures every table, gather then copy from that same table,
    so a slow phase of the machine hits all of them alike; a table whose
    fraction stands apart is paying for its placement.
    """
    kernels, blocks = numba_backend.kernels(), numba_backend.thread_count() * numba_backend.BLOCKS_PER_THREAD
    tables = [fastembed.Embedding.random(seed=seed).table.view(np.uint64) for seed in range(count)]
    rng = np.random.default_rng(0)
    print(f"| table | address mod 2 MiB | {' | '.join(f'{n} ids: gather, copy (fraction)' for n in batches)} |")
    print(f"| --- | --- |{' --- |' * len(batches)}")
    cells: dict[int, list[str]] = {index: [] for index in range(count)}
    for n in batches:
        out, copy_out = np.empty((n, tables[0].shape[1]), np.uint64), np.empty((n, tables[0].shape[1]), np.uint64)
        gathers: dict[int, list[float]] = {index: [] for index in range(count)}
        copies_s: dict[int, list[float]] = {index: [] for index in range(count)}
        for repetition in range(repetitions + 2):
            for index, table in enumerate(tables):
                ids, start = rng.integers(0, table.shape[0], n), int(rng.integers(0, table.shape[0] - n))
                for samples, call in (
                    (gathers[index], lambda: kernels.gather_parallel_stream(table, ids, out, blocks, *SHIPPED)),
                    (copies_s[index], lambda: kernels.copy_parallel_stream(
                        table[start : start + n], copy_out, blocks, ALIAS_WINDOW)),
                ):
                    seconds = settled_seconds(call)
                    if repetition >= 2:
                        samples.append(seconds)
        for index in range(count):
            gather_s, copy_s = statistics.median(gathers[index]), statistics.median(copies_s[index])
            fraction = statistics.median(c / g for c, g in zip(copies_s[index], gathers[index]))
            gbps = 2 * out.nbytes / 1e9
            cells[index].append(f"{gbps / gather_s:.1f}, {gbps / copy_s:.1f} GB/s ({fraction:.2f})")
    for index, table in enumerate(tables):
        print(f"| {index} | {table.ctypes.data % 2**21 // 1024} KiB | {' | '.join(cells[index])} |")


@njit(parallel=True, nogil=True)
def read_rows(table, ids, n_blocks):
    """Read every word of rows ids[i] (no writes, no software prefetch); their xor, so nothing is optimised away."""
    n = ids.size
    per_block = np.zeros(n_blocks, table.dtype)
    for block in prange(n_blocks):
        folded = table.dtype.type(0)
        for i in range(block * n // n_blocks, (block + 1) * n // n_blocks):
            row = ids[i]
            for w in range(table.shape[1]):
                folded ^= table[row, w]
        per_block[block] = folded
    return per_block


def read_rates(table: np.ndarray, batches: list[int], repetitions: int) -> None:
    """How fast this machine reads scattered rows at all: reads alone, against the gather's own read rate.

    A gather moves each byte twice (read, then write); its read rate is half
    its GB/s. Reads alone, of uniform random rows and of rows in order, show
    what the memory system gives scattered 8 KiB rows before any store.
    Interleaved, caches settled before each call, medians.
    """
    kernels, blocks = numba_backend.kernels(), numba_backend.thread_count() * numba_backend.BLOCKS_PER_THREAD
    rng = np.random.default_rng(0)
    vocab_size = table.shape[0]
    print(f"| read rate (GB/s of table rows read) | {' | '.join(f'{n} ids' for n in batches)} |")
    print(f"| --- |{' --- |' * len(batches)}")
    cells: dict[str, list[str]] = {}
    for n in batches:
        out, copy_out = np.empty((n, table.shape[1]), np.uint64), np.empty((n, table.shape[1]), np.uint64)

        def in_order() -> np.ndarray:
            start = int(rng.integers(0, vocab_size - n))
            return np.arange(start, start + n)

        def uniform() -> np.ndarray:
            return rng.integers(0, vocab_size, n)

        cases: dict[str, Callable[[], object]] = {
            "reads alone, uniform random rows": lambda: read_rows(table, uniform(), blocks),
            "reads alone, rows in order": lambda: read_rows(table, in_order(), blocks),
            "fastembed's gather, uniform random rows (reads)": lambda: kernels.gather_parallel_stream(
                table, uniform(), out, blocks, *SHIPPED),
            "copy: numba, non-temporal stores (reads)": lambda: kernels.copy_parallel_stream(
                table[(start := int(rng.integers(0, vocab_size - n))) : start + n], copy_out, blocks, ALIAS_WINDOW),
        }
        read_rows(table, uniform(), blocks)  # compile outside the timing
        samples: dict[str, list[float]] = {name: [] for name in cases}
        names = list(cases)
        for repetition in range(repetitions + 2):
            for name in names[repetition % len(names):] + names[: repetition % len(names)]:
                seconds = settled_seconds(cases[name])
                if repetition >= 2:
                    samples[name].append(seconds)
        for name, values in samples.items():
            cells.setdefault(name, []).append(f"{out.nbytes / statistics.median(values) / 1e9:.1f}")
    for name, row in cells.items():
        print(f"| {name} | {' | '.join(row)} |")


def alias_offsets(table: np.ndarray, batches: list[int], repetitions: int, distances: list[int]) -> None:
    """The streaming kernel at several distances between table and output modulo 4 KiB (4K aliasing).

    The output is one buffer, shifted so that (table address - output
    address) mod 4096 takes each distance; every row then has that distance,
    8 KiB rows being whole pages. Rows copied forward only (alias window 0),
    backward only (4096) and as fastembed ships them (ALIAS_WINDOW), against
    the non-temporal copy (into a fresh numpy array: distance 0), variants
    rotated each repetition.
    """
    kernels, blocks = numba_backend.kernels(), numba_backend.thread_count() * numba_backend.BLOCKS_PER_THREAD
    rng = np.random.default_rng(0)
    windows = {"forward": 0, "backward": 4096, f"fastembed (window {ALIAS_WINDOW})": ALIAS_WINDOW}
    limit = "copy: numba, non-temporal stores"
    cells: dict[str, list[str]] = {}
    for n in batches:
        copy_out = np.empty((n, table.shape[1]), np.uint64)
        buffer = np.empty(n * table.nbytes // len(table) + 4096, np.uint8)
        outs = {}
        for distance in distances:
            shift = (table.ctypes.data - distance - buffer.ctypes.data) % 4096
            outs[distance] = buffer[shift : shift + copy_out.nbytes].view(np.uint64).reshape(copy_out.shape)
            assert kernels.can_stream(outs[distance]), f"distance {distance}: the output must be 16-byte aligned"
        cases = [(name, distance) for distance in distances for name in windows] + [(limit, 0)]
        samples: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
        for repetition in range(repetitions + 2):
            for name, distance in cases[repetition % len(cases):] + cases[: repetition % len(cases)]:
                if name == limit:
                    start = int(rng.integers(0, table.shape[0] - n))
                    source = table[start : start + n]
                    call = lambda: kernels.copy_parallel_stream(source, copy_out, blocks, ALIAS_WINDOW)  # noqa: E731
                else:
                    ids, out = rng.integers(0, table.shape[0], n), outs[distance]
                    options = (*SHIPPED[:2], windows[name])
                    call = lambda: kernels.gather_parallel_stream(table, ids, out, blocks, *options)  # noqa: E731
                seconds = settled_seconds(call)
                if repetition >= 2:
                    samples[(name, distance)].append(seconds)
        copy_times = samples[(limit, 0)]
        for (name, distance), values in samples.items():
            fraction = statistics.median(c / v for c, v in zip(copy_times, values))
            gbps = 2 * n * table.shape[1] * 8 / statistics.median(values) / 1e9
            label = f"{name} | {distance if name != limit else '-'}"
            cells.setdefault(label, []).append(f"{gbps:.1f} GB/s ({fraction:.2f})")
    print(f"| rows copied | table - out mod 4096 | {' | '.join(f'{n} ids' for n in batches)} |")
    print(f"| --- | --- |{' --- |' * len(batches)}")
    for key, row in cells.items():
        print(f"| {key} | {' | '.join(row)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--batches", help="comma-separated id counts (default 8192,65536; 8,...,512 for --parallel-threshold)")
    parser.add_argument("--parallel-threshold", action="store_true", help="serial vs parallel kernel at small batches")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="--parallel-threshold: sleep between calls (ms)")
    parser.add_argument("--stream-threshold", action="store_true", help="cached vs non-temporal stores by output size")
    parser.add_argument("--id-patterns", action="store_true",
                        help="the streaming kernel on ids read in runs of 1, 2, 8 rows or in order, vs the copy")
    parser.add_argument("--alias-offsets", nargs="?", const="0,16,2048,4032,4048,4064,4080",
                        help="the streaming kernel at these (table - out) mod 4096 distances: forward, backward, shipped")
    parser.add_argument("--read-rates", action="store_true",
                        help="rows read alone (uniform, in order) against the gather's and the copy's read rates")
    parser.add_argument("--placements", type=int, metavar="N",
                        help="the streaming kernel vs the copy on N tables allocated side by side (N GiB)")
    parser.add_argument("--mmap", action="store_true",
                        help="gather from a memory-mapped .npy of the table (page cache, 4 KiB pages) instead")
    arguments = parser.parse_args()
    if arguments.placements is not None and arguments.placements < 1:
        parser.error(f"--placements needs at least one table, got {arguments.placements}")
    if arguments.read_rates:
        read_rates(fastembed.Embedding.random().table.view(np.uint64),
                   [int(b) for b in (arguments.batches or "8192,65536").split(",")], arguments.reps)
        return
    if arguments.placements:
        placements(arguments.placements, [int(b) for b in (arguments.batches or "8192").split(",")], arguments.reps)
        return
    table = fastembed.Embedding.random().table.view(np.uint64)
    if arguments.mmap:
        table = _memory_mapped(table)
    if arguments.stream_threshold:
        batches = arguments.batches or "32,64,128,256,512,1024,2048,4096"
        stream_threshold(table, [int(b) for b in batches.split(",")], arguments.reps)
        return
    if arguments.alias_offsets:
        distances = [int(d) for d in arguments.alias_offsets.split(",")]
        batches = [int(b) for b in (arguments.batches or "8192,65536").split(",")]
        alias_offsets(table, batches, arguments.reps, distances)
        return
    if arguments.id_patterns:
        id_patterns(table, [int(b) for b in (arguments.batches or "8192,65536").split(",")], arguments.reps)
        return
    if arguments.parallel_threshold:
        batches = arguments.batches or "2,4,8,16,32,64,128,512"
        parallel_threshold(table, [int(b) for b in batches.split(",")], arguments.reps, arguments.gap_ms / 1e3)
        return
    arguments.batches = arguments.batches or "8192,65536"
    kernels, threads = numba_backend.kernels(), numba_backend.thread_count()
    gathers, limits = variants(kernels, threads), copies(kernels, threads)
    rng = np.random.default_rng(0)
    batches = [int(b) for b in arguments.batches.split(",")]
    print(f"| variant | {' | '.join(f'{n} ids' for n in batches)} |\n| --- |{' --- |' * len(batches)}")
    results: dict[str, list[str]] = {}
    for n in batches:
        out = np.empty((n, table.shape[1]), np.uint64)
        assert kernels.can_stream(out), "the streaming variants need a 16-byte aligned output"
        samples: dict[str, list[float]] = {name: [] for name in [*gathers, *limits]}
        names = list(gathers)
        for repetition in range(arguments.reps + 2):
            # Rotated each repetition: no variant always runs right after the copies.
            for name in names[repetition % len(names):] + names[: repetition % len(names)]:
                gather = gathers[name]
                ids = rng.integers(0, table.shape[0], n)
                seconds = settled_seconds(lambda: gather(table, ids, out))
                if repetition >= 2:
                    samples[name].append(seconds)
                assert np.array_equal(out[:4], table[ids[:4]])
            for name, copy in limits.items():
                source = table[int(rng.integers(0, table.shape[0] - n)) :][:n]
                seconds = settled_seconds(lambda: copy(source, out))
                if repetition >= 2:
                    samples[name].append(seconds)
        copy_times = samples["copy: numba, non-temporal stores"]
        for name, values in samples.items():
            gbps = 2 * n * table.shape[1] * 8 / statistics.median(values) / 1e9
            fraction = statistics.median(c / v for c, v in zip(copy_times, values))  # of the same repetition's copy
            results.setdefault(name, []).append(f"{gbps:.1f} GB/s ({fraction:.2f})")
    for name, cells in results.items():
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
