"""Levers of the streaming gather that were measured and not adopted (docs/backends.md).

    python bench/rejected_levers.py [--reps 15] [--batches 8192,65536]

Default 129,280 x 4,096 float16 table, uniform ids. Every variant below runs
once per repetition on fresh ids (in an order rotated each repetition, the
caches settled before each), interleaved with the kernel fastembed uses and
with the best copy (parallel, non-temporal stores); medians reported as
GB/s = 2 x rows x row bytes / time and as a fraction of that copy. The last
rows compare an allocating lookup with cached and with non-temporal stores.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

import fastembed
from fastembed.backends import numba_backend
from fastembed.benchmark.measure import settle_host_caches
from fastembed.kernels.cpu_intrinsics import prefetch, store_fence, stream_store_16
from fastembed.kernels.gather_cpu import _stream_row

#: The streaming kernel's options (prefetches, alias window) as the numba backend ships them.
SHIPPED = (numba_backend.PREFETCH_ROWS_AHEAD, numba_backend.TOUCH_PAGES_ROWS_AHEAD, numba_backend.ALIAS_WINDOW)
ALIAS_WINDOW = numba_backend.ALIAS_WINDOW


_I32 = ir.IntType(32)


def _prefetch_with_hint(locality: int):
    """A read prefetch with LLVM's locality hint: 3 PREFETCHT0 (fastembed's), 2 T1, 1 T2, 0 NTA."""
    @intrinsic
    def prefetch_hinted(typingctx, address):
        def codegen(context, builder, signature, args):
            byte_pointer = ir.IntType(8).as_pointer()
            llvm_prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, _I32, _I32, _I32]), "llvm.prefetch.p0")
            builder.call(llvm_prefetch, [builder.inttoptr(args[0], byte_pointer), _I32(0), _I32(locality), _I32(1)])
            return context.get_dummy_value()

        return types.void(types.uintp), codegen

    return prefetch_hinted


#: PREFETCHNTA: a line for one use, kept out of the outer caches where the CPU can.
prefetch_non_temporal = _prefetch_with_hint(0)
#: PREFETCHT2 and PREFETCHT1: into the outer caches only (on AMD Zen both fill L2, not L1).
prefetch_t2 = _prefetch_with_hint(1)
prefetch_t1 = _prefetch_with_hint(2)


@intrinsic
def stream_store_32(typingctx, dst, src):
    """A 32-byte non-temporal store (AVX2 VMOVNTDQ); dst 32-byte aligned."""
    def codegen(context, builder, signature, args):
        pointer = ir.VectorType(ir.IntType(64), 4).as_pointer()
        value = builder.load(builder.inttoptr(args[1], pointer), align=1)
        store = builder.store(value, builder.inttoptr(args[0], pointer), align=32)
        store.set_metadata("nontemporal", builder.module.add_metadata([_I32(1)]))
        return context.get_dummy_value()

    return types.void(types.uintp, types.uintp), codegen


@njit(nogil=True)
def _copy_line(destination, source):
    stream_store_16(destination, source)
    stream_store_16(destination + 16, source + 16)
    stream_store_16(destination + 32, source + 32)
    stream_store_16(destination + 48, source + 48)


@njit(nogil=True, inline="always")
def _row_addresses(table, ids, out, i, ahead, row_bytes):
    """Addresses of row ids[i] and row ids[ahead] in the table, and of row i in out."""
    return (table.ctypes.data + np.uintp(ids[i]) * row_bytes, table.ctypes.data + np.uintp(ids[ahead]) * row_bytes,
            out.ctypes.data + np.uintp(i) * row_bytes)


@njit(parallel=True, nogil=True)
def prefetch_rows_ahead(table, ids, out, n_blocks, distance, touch_pages_rows_ahead):
    """fastembed's kernel, prefetching row i + distance instead of i + 1 (pages touched as in stream_rows)."""
    row_bytes, n = table.shape[1] * table.itemsize, ids.size
    for block in prange(n_blocks):
        start, stop = block * n // n_blocks, (block + 1) * n // n_blocks
        for i in range(start, stop):
            if touch_pages_rows_ahead > 0:
                far = table.ctypes.data + np.uintp(ids[min(i + touch_pages_rows_ahead, stop - 1)]) * row_bytes
                for page in range(0, row_bytes, 4096):
                    prefetch(far + page)
            source, ahead, destination = _row_addresses(table, ids, out, i, min(i + distance, stop - 1), row_bytes)
            _stream_row(destination, source, row_bytes, True, ahead, ALIAS_WINDOW)
        store_fence()
    return -1


@njit(parallel=True, nogil=True)
def two_prefetches_per_line(table, ids, out, n_blocks):
    """The next row requested twice as fast: two prefetches per line over the first half of each row."""
    row_bytes, n = table.shape[1] * table.itemsize, ids.size
    half = row_bytes // 2
    for block in prange(n_blocks):
        start, stop = block * n // n_blocks, (block + 1) * n // n_blocks
        for i in range(start, stop):
            source, following, destination = _row_addresses(table, ids, out, i, min(i + 1, stop - 1), row_bytes)
            for offset in range(0, half, 64):
                prefetch(following + 2 * offset)
                prefetch(following + 2 * offset + 64)
                _copy_line(destination + offset, source + offset)
            for offset in range(half, row_bytes, 64):
                _copy_line(destination + offset, source + offset)
        store_fence()
    return -1


@njit(parallel=True, nogil=True)
def two_rows_interleaved(table, ids, out, n_blocks):
    """Two rows copied line by line in turn: two read streams, and two write streams, per thread."""
    row_bytes, n = table.shape[1] * table.itemsize, ids.size
    for block in prange(n_blocks):
        start, stop = block * n // n_blocks, (block + 1) * n // n_blocks
        for i in range(start, stop, 2):
            first = table.ctypes.data + np.uintp(ids[i]) * row_bytes
            second = table.ctypes.data + np.uintp(ids[min(i + 1, stop - 1)]) * row_bytes
            destination = out.ctypes.data + np.uintp(i) * row_bytes
            pair = i + 1 < stop
            for offset in range(0, row_bytes, 64):
                _copy_line(destination + offset, first + offset)
                if pair:
                    _copy_line(destination + row_bytes + offset, second + offset)
        store_fence()
    return -1


@njit(parallel=True, nogil=True)
def prefetch_variants(table, ids, out, n_blocks, every_nth_line, hint, wide_stores):
    """fastembed's kernel with the prefetch thinned to every n-th line, or another hint, or 32-byte stores.

    ``hint``: the prefetch's locality, as in :func:`_prefetch_with_hint` (3 is fastembed's).
    """
    row_bytes, n = table.shape[1] * table.itemsize, ids.size
    for block in prange(n_blocks):
        start, stop = block * n // n_blocks, (block + 1) * n // n_blocks
        for i in range(start, stop):
            source, following, destination = _row_addresses(table, ids, out, i, min(i + 1, stop - 1), row_bytes)
            for offset in range(0, row_bytes, 64):
                if offset % (64 * every_nth_line) == 0:
                    if hint == 0:
                        prefetch_non_temporal(following + offset)
                    elif hint == 1:
                        prefetch_t2(following + offset)
                    elif hint == 2:
                        prefetch_t1(following + offset)
                    else:
                        prefetch(following + offset)
                if wide_stores:
                    stream_store_32(destination + offset, source + offset)
                    stream_store_32(destination + offset + 32, source + offset + 32)
                else:
                    _copy_line(destination + offset, source + offset)
        store_fence()
    return -1


@njit(parallel=True, nogil=True)
def page_heads_at_row_start(table, ids, out, n_blocks, lines_per_page):
    """At the start of each row, prefetch the first lines of each 4 KiB page of the next (the hardware follows on)."""
    row_bytes, n = table.shape[1] * table.itemsize, ids.size
    for block in prange(n_blocks):
        start, stop = block * n // n_blocks, (block + 1) * n // n_blocks
        for i in range(start, stop):
            following = table.ctypes.data + np.uintp(ids[min(i + 1, stop - 1)]) * row_bytes
            for page in range(0, row_bytes, 4096):
                for line in range(lines_per_page):
                    prefetch(following + page + 64 * line)
            _stream_row(out.ctypes.data + np.uintp(i) * row_bytes, table.ctypes.data + np.uintp(ids[i]) * row_bytes,
                        row_bytes, False, 0, ALIAS_WINDOW)
        store_fence()
    return -1


def _chunked(call: Callable[[], object]) -> None:
    """Run `call` with numba's dynamic scheduling (chunks of one block handed out as threads free up)."""
    with numba.parallel_chunksize(1):
        call()


def _on_threads(threads: int, call: Callable[[], object]) -> None:
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        call()
    finally:
        numba.set_num_threads(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--batches", default="8192,65536", help="comma-separated id counts")
    arguments = parser.parse_args()
    table = fastembed.Embedding.random().table
    words = table.view(np.uint64)
    kernels, threads = numba_backend.kernels(), numba_backend.thread_count()
    blocks = 4 * threads
    rng = np.random.default_rng(0)
    batches = [int(b) for b in arguments.batches.split(",")]
    rows: dict[str, list[str]] = {}
    for n in batches:
        out = np.empty((n, words.shape[1]), np.uint64)
        padded = np.empty(n * words.shape[1] + 8, np.uint64)
        skip = (-padded.ctypes.data % 64) // 8
        aligned_out = padded[skip : skip + n * words.shape[1]].reshape(n, words.shape[1])
        def fresh() -> np.ndarray:
            return np.empty((n, words.shape[1]), np.uint64)

        def prefetch_variant(every_nth_line: int, hint: int, wide_stores: bool) -> tuple[Callable, Callable]:
            """A :func:`prefetch_variants` entry; 32-byte stores need the 64-byte aligned output."""
            output = aligned_out if wide_stores else out
            return (lambda i, o: prefetch_variants(words, i, o, blocks, every_nth_line, hint, wide_stores),
                    lambda: output)

        # name -> (kernel call taking ids and an output, the output it writes)
        gathers: dict[str, tuple[Callable[[np.ndarray, np.ndarray], object], Callable[[], np.ndarray]]] = {
            "fastembed: row 4 ahead line by line + pages of row 16 ahead": (
                lambda i, o: kernels.gather_parallel_stream(words, i, o, blocks, *SHIPPED), lambda: out),
            "next row line by line only (this script)": (
                lambda i, o: prefetch_rows_ahead(words, i, o, blocks, 1, 0), lambda: out),
            "prefetch 2 rows ahead": (lambda i, o: prefetch_rows_ahead(words, i, o, blocks, 2, 0), lambda: out),
            "prefetch 4 rows ahead": (lambda i, o: prefetch_rows_ahead(words, i, o, blocks, 4, 0), lambda: out),
            "next row line by line + pages of row 8 ahead (fastembed until commit 48b417e)": (
                lambda i, o: prefetch_rows_ahead(words, i, o, blocks, 1, 8), lambda: out),
            "two prefetches per line, first half of the row": (
                lambda i, o: two_prefetches_per_line(words, i, o, blocks), lambda: out),
            "two rows interleaved": (lambda i, o: two_rows_interleaved(words, i, o, blocks), lambda: out),
            "prefetch on every 2nd line only": prefetch_variant(2, 3, False),
            "prefetch on every 4th line only": prefetch_variant(4, 3, False),
            "PREFETCHNTA instead of PREFETCHT0": prefetch_variant(1, 0, False),
            "PREFETCHT1 instead of PREFETCHT0": prefetch_variant(1, 2, False),
            "PREFETCHT2 instead of PREFETCHT0": prefetch_variant(1, 1, False),
            "32-byte non-temporal stores (AVX2; 64-byte aligned output)": prefetch_variant(1, 3, True),
            "first 4 lines of each 4 KiB page of the next row, at row start": (
                lambda i, o: page_heads_at_row_start(words, i, o, blocks, 4), lambda: out),
            "dynamic scheduling, 16 blocks per thread": (
                lambda i, o: _chunked(lambda: kernels.gather_parallel_stream(words, i, o, 4 * blocks, *SHIPPED)), lambda: out),
            "output aligned to 64 bytes (numpy's: 16)": (
                lambda i, o: kernels.gather_parallel_stream(words, i, o, blocks, *SHIPPED), lambda: aligned_out),
            "fastembed's kernel on one thread": (
                lambda i, o: _on_threads(1, lambda: kernels.gather_parallel_stream(words, i, o, 4, *SHIPPED)), lambda: out),
            "allocating lookup, non-temporal stores": (
                lambda i, o: kernels.gather_parallel_stream(words, i, o, blocks, *SHIPPED), fresh),
            "allocating lookup, cached stores": (lambda i, o: kernels.gather_parallel(words, i, o, blocks), fresh),
        }
        copies: dict[str, Callable[[np.ndarray], object]] = {
            "copy: numba, non-temporal stores (the limit)": lambda s: kernels.copy_parallel_stream(
                s, out, blocks, ALIAS_WINDOW),
            "copy: numba, non-temporal stores, one thread": lambda s: _on_threads(
                1, lambda: kernels.copy_parallel_stream(s, out, 4, ALIAS_WINDOW)),
        }
        samples: dict[str, list[float]] = {name: [] for name in [*gathers, *copies]}
        for repetition in range(arguments.reps + 2):
            # Rotated each repetition: no variant always runs right after the copies.
            order = list(gathers.items())
            order = order[repetition % len(order):] + order[: repetition % len(order)]
            for name, (gather, output) in order:
                ids = rng.integers(0, words.shape[0], n)
                settle_host_caches()  # the previous variant's dirty lines are written back before timing
                started = time.perf_counter()
                written = output()  # a fresh np.empty for the allocating rows, timed with the gather
                gather(ids, written)
                if repetition >= 2:
                    samples[name].append(time.perf_counter() - started)
                elif repetition == 0:
                    assert np.array_equal(written, words[ids]), name
                del written  # a fresh output is freed here, not inside the next variant's timing
            for name, copy in copies.items():
                start = int(rng.integers(0, words.shape[0] - n))
                settle_host_caches()
                started = time.perf_counter()
                copy(words[start : start + n])
                if repetition >= 2:
                    samples[name].append(time.perf_counter() - started)
        limit = statistics.median(samples["copy: numba, non-temporal stores (the limit)"])
        for name, values in samples.items():
            median = statistics.median(values)
            rows.setdefault(name, []).append(f"{2 * n * words.shape[1] * 8 / median / 1e9:.1f} GB/s ({limit / median:.2f})")
    print(f"| variant | {' | '.join(f'{n} ids' for n in batches)} |\n| --- |{' --- |' * len(batches)}")
    for name, cells in rows.items():
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
