"""Allocating lookups: who faults the new output's pages in (docs/backends.md).

    python bench/allocating.py [--reps 41] [--batches 8192,65536]
    python bench/allocating.py --idle-memory [--reps 5]
    python bench/allocating.py --fault-in-only [--reps 1000]
    python bench/allocating.py --loops [--rounds 2] [--reps 400] [--batches 8192]

Default 129,280 x 4,096 float16 table, uniform fresh ids, caches settled
before each call, variants interleaved in an order that rotates. Compares
numpy ``table[ids]`` with ``fastembed.lookup(table, ids)`` as it is (the new
output faulted in on the calling thread first), with the parallel kernel's
threads taking the page faults as they write, with numba's threads
faulting the output in, in a pass of their own, before the gather, and
with 4 MiB of output faulted in and then gathered into, in turn, and with
the calling thread faulting in 2 MiB steps while a helper thread gathers
behind it (:class:`FaultAheadGather`). Reports
the median, the mean, the 95th percentile and the calls that took more than twice numpy's median ("stalls",
one yardstick for every variant): the mean and the stalls are what a caller
feels, and what the faulting-in is for. ``--loops`` runs each variant alone
in a process of its own, many calls in a row, as an inference loop would;
the processes alternate.
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import numpy as np
from numba import njit, prange

import fastembed
from fastembed.backends import numba_backend
from fastembed.benchmark.measure import settle_host_caches


@njit(parallel=True, nogil=True)
def touch_pages(flat_bytes, stride, n_blocks):
    """Write the first byte of every `stride`-th byte block of `flat_bytes`, over numba's threads."""
    pages = (flat_bytes.size + stride - 1) // stride
    for block in prange(n_blocks):
        for page in range(block * pages // n_blocks, (block + 1) * pages // n_blocks):
            flat_bytes[page * stride] = 0


def with_fault_in(table: np.ndarray, fault_in: Callable[[np.ndarray], None]) -> Callable[[np.ndarray], Any]:
    """fastembed.lookup with the backend's fault-in step replaced by `fault_in`."""
    def call(ids: np.ndarray) -> Any:
        shipped = numba_backend._fault_in
        numba_backend._fault_in = fault_in
        try:
            return fastembed.lookup(table, ids)
        finally:
            numba_backend._fault_in = shipped

    return call


def pool_fault_in(out: np.ndarray) -> None:
    flat_bytes = out.reshape(-1).view(np.uint8)
    touch_pages(flat_bytes, 2 * 2**20, numba_backend._blocks_per_call())  # huge pages: outputs here are >= 64 MiB
    flat_bytes[-1:] = 0


#: Output bytes faulted in, then gathered into, per step of :func:`fault_in_and_gather_in_steps`.
STEP_BYTES = 4 * 2**20


def fault_in_and_gather_in_steps(table: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """An allocating lookup that faults in STEP_BYTES of output, then gathers into it with cached stores.

    The OS zeroes each new page through the cache. Gathering into the pages
    while their zeros are still cached (4 MiB at a time, well inside the
    last-level cache) would spare writing those zeros to memory, as numpy's
    own table[ids] does by writing each page right after its fault.
    """
    kernels, row_bytes = numba_backend.kernels(), table.shape[1] * table.itemsize
    words = table.view(numba_backend.word_dtype(row_bytes))
    rows_per_step = max(1, STEP_BYTES // row_bytes)

    def call(ids: np.ndarray) -> np.ndarray:
        out = np.empty((ids.size, table.shape[1]), table.dtype)
        out_words = out.view(words.dtype)
        for start in range(0, ids.size, rows_per_step):
            stop = min(ids.size, start + rows_per_step)
            numba_backend._fault_in(out[start:stop])
            kernels.gather_parallel(words, ids[start:stop], out_words[start:stop], numba_backend._blocks_per_call())
        return out

    return call


@njit(nogil=True)
def touch_range(flat_bytes, start, stop):
    """Write one byte per 2 MiB of flat_bytes[start:stop] and its last byte: every huge page it spans."""
    for offset in range(start, stop, 2 * 2**20):
        flat_bytes[offset] = 0
    flat_bytes[stop - 1] = 0


class FaultAheadGather:
    """An allocating lookup in which the calling thread faults the output in, 2 MiB at a time,
    while a helper thread gathers (non-temporal stores) into the part already faulted in;
    the calling thread joins the gather once every page is in.

    Only one thread ever faults (two faulting at once stall on the development VM),
    and zeroing overlaps gathering. A prototype: one caller at a time, no fork handling.
    """

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.words = table.view(numba_backend.word_dtype(table.shape[1] * table.itemsize))
        self.rows_per_step = max(1, 2 * 2**20 // (table.shape[1] * table.itemsize))
        self.kernels = numba_backend.kernels()
        self.ready = threading.Condition()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._helper, daemon=True).start()

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((ids.size, self.table.shape[1]), self.table.dtype)
        if self.kernels.first_bad_position(ids, self.table.shape[0]) >= 0:
            raise IndexError("an id is out of range")
        flat_bytes, out_words = out.reshape(-1).view(np.uint8), out.view(self.words.dtype)
        step_bytes = self.rows_per_step * out_words.shape[1] * out_words.itemsize
        self.steps, self.faulted, self.claimed, self.helper_busy = -(-ids.size // self.rows_per_step), 0, 0, True
        self.jobs.put((ids, out_words))
        for step in range(self.steps):
            touch_range(flat_bytes, step * step_bytes, min(flat_bytes.size, (step + 1) * step_bytes))
            with self.ready:
                self.faulted = step + 1
                self.ready.notify_all()
        self._gather_claimed(ids, out_words)
        with self.ready:
            self.ready.wait_for(lambda: not self.helper_busy)
        return out

    def _helper(self) -> None:
        while True:
            ids, out_words = self.jobs.get()
            self._gather_claimed(ids, out_words)
            with self.ready:
                self.helper_busy = False
                self.ready.notify_all()

    def _gather_claimed(self, ids: np.ndarray, out_words: np.ndarray) -> None:
        """Gather steps already faulted in, one at a time, until every step is claimed."""
        while True:
            with self.ready:
                self.ready.wait_for(lambda: self.claimed >= self.steps or self.claimed < self.faulted)
                if self.claimed >= self.steps:
                    return
                step = self.claimed
                self.claimed += 1
            start = step * self.rows_per_step
            stop = min(ids.size, start + self.rows_per_step)
            self.kernels.stream_rows(self.words, ids, out_words, start, stop, numba_backend.PREFETCH_ROWS_AHEAD,
                                     numba_backend.TOUCH_PAGES_ROWS_AHEAD, numba_backend.ALIAS_WINDOW)


def idle_memory(gaps_s: list[float], repetitions: int) -> None:
    """Fault in 512 MiB just freed after sleeping each gap: on the calling thread, then on numba's threads.

    A guest whose virtio balloon reports free pages to the host (Linux free
    page reporting, 2 MiB blocks free for about 2 s) gets those pages back
    from the host on first touch, at a cost the guest cannot see.
    """
    for fault_in in (numba_backend._fault_in, pool_fault_in):  # compile, and settle the pool
        _fault_in_new(fault_in, 2**20)
    print("| gap | fault-in of 512 MiB on | median | slowest |\n| --- | --- | --- | --- |")
    for gap in gaps_s:
        for name, fault_in in (("the calling thread", numba_backend._fault_in), ("numba's threads", pool_fault_in)):
            samples = []
            for _ in range(repetitions):
                _fault_in_new(fault_in, 512 * 2**20)  # memory just freed: what the next one reuses
                time.sleep(gap)
                samples.append(_fault_in_new(fault_in, 512 * 2**20))
            print(f"| {gap:g} s | {name} | {statistics.median(samples) * 1e3:.0f} ms | {max(samples) * 1e3:.0f} ms |")


def fault_in_only(nbytes: int, repetitions: int) -> None:
    """Fault in a fresh `nbytes` output, on the calling thread and on numba's threads, in turn.

    No gather and no settling, and the allocation and the free are not
    timed: only the faults, so that a stall can be blamed on faulting in,
    and on who does it.
    """
    variants = {"the calling thread": numba_backend._fault_in, "numba's threads": pool_fault_in}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fault_in in variants.values():  # compile, and settle the pool
        _fault_in_new(fault_in, nbytes)
    for repetition in range(repetitions):
        for name in list(variants)[repetition % 2:] + list(variants)[: repetition % 2]:
            out = np.empty(nbytes, np.uint8)
            started = time.perf_counter()
            variants[name](out)
            samples[name].append(time.perf_counter() - started)
            del out
    yardstick = statistics.median(samples["the calling thread"])
    print(f"| fault-in of {nbytes >> 20} MiB on | median | mean | 99th percentile | over 2x the calling thread's median | slowest |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, values in samples.items():
        p99 = statistics.quantiles(values, n=100)[-1]
        slow = sum(value > 2 * yardstick for value in values)
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} ms | {statistics.mean(values) * 1e3:.2f} ms "
              f"| {p99 * 1e3:.1f} ms | {slow}/{len(values)} | {max(values) * 1e3:.0f} ms |")


def _fault_in_new(fault_in: Callable[[np.ndarray], None], nbytes: int) -> float:
    started = time.perf_counter()
    fault_in(np.empty(nbytes, np.uint8))
    return time.perf_counter() - started


#: Every allocating lookup compared: name -> a factory that takes the table. numpy's first (the yardstick).
VARIANTS: dict[str, Callable[[np.ndarray], Callable[[np.ndarray], Any]]] = {
    "numpy table[ids]": lambda table: lambda ids: table[ids],
    "fastembed.lookup (output faulted in first)": lambda table: lambda ids: fastembed.lookup(table, ids),
    "fastembed.lookup, threads take the faults": lambda table: with_fault_in(table, lambda out: None),
    "fastembed.lookup, numba's threads fault in first": lambda table: with_fault_in(table, pool_fault_in),
    "4 MiB faulted in, then gathered with cached stores, in turn": fault_in_and_gather_in_steps,
    "calling thread faults 2 MiB steps, a helper thread gathers behind it": FaultAheadGather,
}


def timed_calls(calls: dict[str, Callable[[np.ndarray], Any]], table: np.ndarray, n: int,
                repetitions: int, rng: np.random.Generator) -> dict[str, list[float]]:
    """Seconds per call of each of `calls` on n fresh uniform ids, in an order that rotates."""
    for name, call in calls.items():  # warm-up (compiles), and each variant's result checked once
        ids = rng.integers(0, table.shape[0], n)
        assert np.array_equal(call(ids), table[ids]), name
    fastembed.wait_for_compiles()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for repetition in range(repetitions):
        # The order rotates: a variant's memory comes from the one before it, and
        # the guest may have handed freed pages back to the host (docs/backends.md).
        for name in names[repetition % len(names):] + names[: repetition % len(names)]:
            ids = rng.integers(0, table.shape[0], n)
            settle_host_caches()
            started = time.perf_counter()
            result = calls[name](ids)
            samples[name].append(time.perf_counter() - started)
            del result  # freed outside the next call's timing
    return samples


def print_rows(label: str, samples: dict[str, list[float]], numpy_samples: list[float]) -> None:
    """One table row per variant; ratios and stalls against numpy's samples."""
    numpy_median, numpy_mean = statistics.median(numpy_samples), statistics.mean(numpy_samples)
    for name, values in samples.items():
        median, mean = statistics.median(values), statistics.mean(values)
        p95 = statistics.quantiles(values, n=20)[-1]
        stalls = sum(value > 2 * numpy_median for value in values)
        print(f"| {label} | {name} | {median * 1e3:.1f} ms | {numpy_median / median:.2f}x | {mean * 1e3:.1f} ms "
              f"| {numpy_mean / mean:.2f}x | {p95 * 1e3:.1f} ms | {stalls}/{len(values)} | {max(values) * 1e3:.0f} ms |")


def loops(batches: list[int], rounds: int, repetitions: int) -> None:
    """Each variant alone in a fresh process, `repetitions` calls in a row; the processes alternate.

    No ratios between variants: they ran in different processes, and this
    machine's speed moves from one process to the next. A stall here is a
    call slower than twice its own process's median.
    """
    names = list(VARIANTS)
    print("| ids, round | call | median | mean | 95th percentile | 99th percentile | over 2x its median | slowest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in batches:
        for round_number in range(1, rounds + 1):
            for name in names:
                command = [sys.executable, __file__, "--loop-of", name, "--batches", str(n), "--reps", str(repetitions)]
                finished = subprocess.run(command, capture_output=True, text=True, check=True)
                values = json.loads(finished.stdout.splitlines()[-1])
                median = statistics.median(values)
                p95, p99 = (statistics.quantiles(values, n=100)[k] for k in (94, 98))
                stalls = sum(value > 2 * median for value in values)
                print(f"| {n}, {round_number} | {name} | {median * 1e3:.1f} ms | {statistics.mean(values) * 1e3:.1f} ms "
                      f"| {p95 * 1e3:.1f} ms | {p99 * 1e3:.1f} ms | {stalls}/{len(values)} | {max(values) * 1e3:.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=41)
    parser.add_argument("--batches", default="8192,65536")
    parser.add_argument("--idle-memory", action="store_true",
                        help="fault-in of freed memory after 0, 0.5 and 5 s idle (--reps 5 is plenty)")
    parser.add_argument("--fault-in-only", action="store_true",
                        help="fault-ins of a fresh 64 MiB output alone, by who faults (--reps 1000)")
    parser.add_argument("--loops", action="store_true",
                        help="each variant alone in its own process, --reps calls in a row (--batches 8192 --reps 400)")
    parser.add_argument("--rounds", type=int, default=2, help="with --loops: processes per variant")
    parser.add_argument("--loop-of", choices=list(VARIANTS), help=argparse.SUPPRESS)  # one variant's loop, in a child of --loops
    arguments = parser.parse_args()
    if arguments.reps < 2:
        parser.error("--reps must be at least 2 (medians and percentiles)")
    if arguments.rounds < 1:
        parser.error("--rounds must be at least 1")
    batches = [int(b) for b in arguments.batches.split(",")]
    if arguments.idle_memory:
        idle_memory([0.0, 0.5, 5.0], arguments.reps)
        return
    if arguments.fault_in_only:
        fault_in_only(64 * 2**20, arguments.reps)
        return
    if arguments.loops:
        loops(batches, arguments.rounds, arguments.reps)
        return
    table = fastembed.Embedding.random().table
    rng = np.random.default_rng(0)
    calls = {name: make(table) for name, make in VARIANTS.items()}
    if arguments.loop_of is not None:
        samples = timed_calls({arguments.loop_of: calls[arguments.loop_of]}, table, batches[0], arguments.reps, rng)
        print(json.dumps(samples[arguments.loop_of]))
        return
    print("| ids | call | median | vs numpy | mean | vs numpy | 95th percentile | stalls | slowest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in batches:
        samples = timed_calls(calls, table, n, arguments.reps, rng)
        print_rows(str(n), samples, samples["numpy table[ids]"])


if __name__ == "__main__":
    main()
