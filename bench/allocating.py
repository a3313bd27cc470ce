"""Allocating lookups: who faults the new output's pages in (docs/backends.md).

    python bench/allocating.py [--reps 41] [--batches 8192,65536]

Default 129,280 x 4,096 float16 table, uniform fresh ids, caches settled
before each call, variants interleaved. Compares numpy ``table[ids]`` with
``fastembed.lookup(table, ids)`` as it is (the new output faulted in on the
calling thread first) and with the parallel kernel's threads taking the page
faults themselves. Reports the median, the mean and the calls that took more
than twice the median ("stalls"): the mean and the stalls are what a caller
feels, and what the faulting-in is for.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np

import fastembed
from fastembed.backends import numba_backend
from fastembed.benchmark.measure import settle_host_caches


def threads_fault(table: np.ndarray) -> Callable[[np.ndarray], Any]:
    def call(ids: np.ndarray) -> Any:
        fault_in = numba_backend._fault_in
        numba_backend._fault_in = lambda out: None
        try:
            return fastembed.lookup(table, ids)
        finally:
            numba_backend._fault_in = fault_in

    return call


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
        "fastembed.lookup, threads take the faults": threads_fault(table),
    }
    print("| ids | call | median | vs numpy | mean | vs numpy | stalls | slowest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
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
            stalls = sum(value > 2 * median for value in values)
            print(f"| {n} | {name} | {median * 1e3:.1f} ms | {numpy_median / median:.2f}x | {mean * 1e3:.1f} ms "
                  f"| {numpy_mean / mean:.2f}x | {stalls}/{len(values)} | {max(values) * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
