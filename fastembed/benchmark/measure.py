"""Interleaved timing of contenders: warm-up, fresh ids per repetition, medians.

Method (docs/benchmarks.md): within one process, every repetition runs every
contender once (A B C A B C ...), each on a fresh id set, so drift of a
shared machine hits all contenders alike and the table is read from memory,
not cache. Small batches time a loop of calls over a rotating pool of id sets
(a single call is too short for the clock).
"""
from __future__ import annotations

import os
import statistics
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .contenders import Contender
from .ids import id_sets


@dataclass
class Result:
    contender: str
    kind: str
    batch: int
    distribution: str
    samples_s: list[float]
    bytes_moved: int  # 2 * rows * row_bytes
    allocates_output: bool = False
    allocated_per_call: int | None = None  # tracemalloc peak of one call (numpy allocations)
    rss_growth: int | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.median_s / 1e9


def calls_per_sample(batch: int, row_bytes: int) -> int:
    """Enough calls that one sample lasts about a millisecond or more."""
    return max(1, min(200, (4 * 2**20) // max(1, batch * row_bytes)))


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def allocated_by_one_call(call: Callable[[np.ndarray], Any], ids: np.ndarray) -> int:
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = call(ids)
        _, peak = tracemalloc.get_traced_memory()
        del result
        return max(0, peak - before)
    finally:
        tracemalloc.stop()


def measure_case(
    table: np.ndarray,
    contenders: list[Contender],
    batch: int,
    distribution: str,
    repetitions: int,
    warmup: int = 2,
    seed: int = 0,
) -> list[Result]:
    row_bytes = table.shape[1] * table.dtype.itemsize
    inner = calls_per_sample(batch, row_bytes)
    pool = id_sets(distribution, batch, table.shape[0], max(inner, 8) + repetitions + warmup, seed)
    prepared: dict[str, Callable] = {}
    results: dict[str, Result] = {}
    for contender in contenders:
        rss_before = rss_bytes()
        call = contender.prepare(table, batch)
        call(pool[0])
        prepared[contender.name] = call
        results[contender.name] = Result(
            contender.name, contender.kind, batch, distribution, [], 2 * batch * row_bytes, contender.allocates,
            allocated_per_call=allocated_by_one_call(call, pool[1]),
            rss_growth=rss_bytes() - rss_before,
        )
    for repetition in range(warmup + repetitions):
        for name, call in prepared.items():
            ids_for_sample = [pool[(repetition * inner + k) % len(pool)] for k in range(inner)]
            started = time.perf_counter()
            for ids in ids_for_sample:
                call(ids)
            elapsed = (time.perf_counter() - started) / inner
            if repetition >= warmup:
                results[name].samples_s.append(elapsed)
    return list(results.values())


def summarise(results: list[Result]) -> list[dict[str, Any]]:
    """Per result: median us, GB/s, fraction of the best copy (the limit), speedup over numpy fancy."""
    rows = []
    for (batch, distribution), group in _group(results).items():
        limit = min((r.median_s for r in group if r.kind == "limit" and r.contender != "copy alloc"), default=None)
        alloc_limit = next((r.median_s for r in group if r.contender == "copy alloc"), None)
        fancy = next((r.median_s for r in group if r.contender == "numpy table[ids]"), None)
        best_copy = min((r for r in group if r.kind == "limit" and r.contender != "copy alloc"), key=lambda r: r.median_s, default=None)
        for r in group:
            reference = alloc_limit if r.allocates_output else limit
            rows.append({
                "contender": r.contender, "kind": r.kind, "batch": batch, "distribution": distribution,
                "median_us": r.median_s * 1e6, "gbps": r.gbps,
                "fraction_of_limit": (reference / r.median_s) if reference else None,
                "speedup_vs_numpy": (fancy / r.median_s) if fancy else None,
                "allocated_per_call": r.allocated_per_call, "rss_growth": r.rss_growth,
                "best_copy": best_copy.contender if best_copy else None,
                "samples_us": [s * 1e6 for s in r.samples_s],
            })
    return rows


def _group(results: list[Result]) -> dict[tuple[int, str], list[Result]]:
    groups: dict[tuple[int, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.batch, r.distribution), []).append(r)
    return groups
