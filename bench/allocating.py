"""Allocating lookups: who faults the new output's pages in (docs/backends.md).

    python bench/allocating.py [--reps 41] [--batches 8192,65536]

Default 129,280 x 4,096 float16 table, uniform fresh ids, caches settled
before each call, variants interleaved. Compares numpy ``table[ids]`` with
``fastembed.lookup(table, ids)`` as it is (the new output faulted in on the
calling thread first), with the parallel kernel's threads taking the page
faults as they write, and with numba's threads faulting the output in, in a
pass of their own, before the gather. Reports the median, the mean, the 95th
percentile and the calls that took more than twice numpy's median ("stalls",
one yardstick for every variant): the mean and the stalls are what a caller
feels, and what the faulting-in is for.
"""
from __future__ import annotations

import argparse
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=41)
    parser.add_argument("--batches", default="8192,65536")
    arguments = parser.parse_args()
    table = fastembed.Embedding.random().table
    rng = np.random.default_rng(0)
    calls: dict[str, Callable[[np.ndarray], Any]] = {
        "numpy table[ids]": lambda ids: table[ids],
        "fastembed.lookup (output faulted in first)": lambda ids: fastembed.lookup(table, ids),
        "fastembed.lookup, threads take the faults": with_fault_in(table, lambda out: None),
        "fastembed.lookup, numba's threads fault in first": with_fault_in(table, pool_fault_in),
    }
    print("| ids | call | median | vs numpy | mean | vs numpy | 95th percentile | stalls | slowest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in (int(b) for b in arguments.batches.split(",")):
        for call in calls.values():
            call(rng.integers(0, table.shape[0], n))
        fastembed.wait_for_compiles()
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(arguments.reps):
            for name, call in calls.items():
                ids = rng.integers(0, table.shape[0], n)
                settle_host_caches()
                started = time.perf_counter()
                result = call(ids)
                samples[name].append(time.perf_counter() - started)
                del result  # freed outside the next call's timing
        numpy_median = statistics.median(samples["numpy table[ids]"])
        numpy_mean = statistics.mean(samples["numpy table[ids]"])
        for name, values in samples.items():
            median, mean = statistics.median(values), statistics.mean(values)
            p95 = statistics.quantiles(values, n=20)[-1]
            stalls = sum(value > 2 * numpy_median for value in values)
            print(f"| {n} | {name} | {median * 1e3:.1f} ms | {numpy_median / median:.2f}x | {mean * 1e3:.1f} ms "
                  f"| {numpy_mean / mean:.2f}x | {p95 * 1e3:.1f} ms | {stalls}/{len(values)} | {max(values) * 1e3:.0f} ms |")

if __name__ == "__main__":
    main()
