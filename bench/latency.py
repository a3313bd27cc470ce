"""Small-batch latency, layer by layer (docs/backends.md, "Small batches").

    python bench/latency.py [--batches 1,6] [--reps 21] [--same-ids | --cold]

Default 129,280 x 4,096 float16 table. Every variant runs a block of calls
over a rotating pool of 2,000 fresh id sets, interleaved with the others,
repeated --reps times; medians per call and the ratio to numpy ``table[ids]``.
With --cold, every call is timed alone after the caches were emptied (as
after a model's forward pass between two lookups), --reps times.
The rows below the end-to-end calls isolate what the numba backend's paths
for few ids cost: the compiled serial kernel with the word views it needs,
numpy's take (2 to PARALLEL_MIN_ROWS - 1 ids without out) and the slice copy (1 id).
``--batches 2,4,6,8,12,16,20,24,31`` compares the first two.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np

import fastembed
from fastembed.backends import numba_backend, numpy_backend
from fastembed.benchmark.ids import REFERENCE_IDS
from fastembed.benchmark.measure import settle_host_caches

POOL = 2000


def variants(table: np.ndarray, n: int) -> dict[str, Callable[[np.ndarray], Any]]:
    embedding = fastembed.Embedding(table)
    out = np.empty((n, table.shape[1]), table.dtype)
    kernels = numba_backend.kernels()
    word = numba_backend.word_dtype(table.shape[1] * table.dtype.itemsize)
    table_words = table.view(word)

    def compiled_serial(ids: np.ndarray) -> np.ndarray:
        fresh = np.empty((len(ids), table.shape[1]), table.dtype)
        kernels.gather_serial(table_words, ids, fresh.view(word))
        return fresh

    found = {
        "numpy table[ids]": lambda ids: table[ids],
        "fastembed.lookup(table, ids)": lambda ids: fastembed.lookup(table, ids),
        "Embedding(table)(ids)": embedding,
        "fastembed.lookup(table, ids, out=out)": lambda ids: fastembed.lookup(table, ids, out=out),
        "numba backend alone": lambda ids: numba_backend.gather(table, ids),
        "np.empty + word views + compiled serial kernel": compiled_serial,
        "numpy take + negative-id check (the numba backend's path for 2-31 ids)": lambda ids: (
            numpy_backend.take_new(table, ids)),
    }
    if n == 1:
        found["slice copy of the row (the numba backend's one-id path)"] = lambda ids: table[ids[0] : ids[0] + 1].copy()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,6")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--same-ids", action="store_true",
                        help="every call gathers the same rows (cached; for 6 ids: the reference sentence)")
    parser.add_argument("--cold", action="store_true",
                        help="time each call alone, after reading twice the last-level cache")
    arguments = parser.parse_args()
    table = fastembed.Embedding.random().table
    rng = np.random.default_rng(0)
    print("| ids | call | median per call | vs numpy table[ids] |\n| --- | --- | --- | --- |")
    for n in (int(b) for b in arguments.batches.split(",")):
        if arguments.same_ids:
            same = REFERENCE_IDS.copy() if n == len(REFERENCE_IDS) else rng.integers(0, table.shape[0], n)
            pool = [same] * POOL
        else:
            pool = [rng.integers(0, table.shape[0], n) for _ in range(POOL)]
        calls = variants(table, n)
        for call in calls.values():  # warm-up: compiles, caches
            _seconds_per_call(call, pool[:50])
        fastembed.wait_for_compiles()
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for repetition in range(arguments.reps):
            for name, call in calls.items():
                if arguments.cold:
                    settle_host_caches()
                    samples[name].append(_seconds_per_call(call, pool[repetition : repetition + 1]))
                else:
                    samples[name].append(_seconds_per_call(call, pool))
        baseline = statistics.median(samples["numpy table[ids]"])
        for name, values in samples.items():
            median = statistics.median(values)
            print(f"| {n} | {name} | {median * 1e6:.2f} us | {median / baseline:.2f}x |")


def _seconds_per_call(call: Callable[[np.ndarray], Any], pool: list[np.ndarray]) -> float:
    started = time.perf_counter()
    for ids in pool:
        call(ids)
    return (time.perf_counter() - started) / len(pool)


if __name__ == "__main__":
    main()
