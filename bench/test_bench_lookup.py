"""pytest-benchmark suites: `pytest bench/ --benchmark-only` (add --benchmark-autosave /
--benchmark-compare for local history). One group per batch size; extra_info carries
GB/s (2 x rows x row bytes / median time) and the bytes moved. These give history on
one machine; the CI gate (fastembed-bench --gate) compares ratios within one run instead.
"""
from __future__ import annotations

import numpy as np
import pytest

import fastembed

BATCHES = [1, 6, 64, 1024, 8192]
pytest.importorskip("pytest_benchmark")


@pytest.fixture(scope="module")
def table(request):
    if request.config.getoption("benchmark_disable"):  # a smoke run times nothing: a small table runs every case
        return fastembed.Embedding.random(20_000, 512).table
    return fastembed.Embedding.random().table


def _contenders(table, n):
    out = np.empty((n, table.shape[1]), table.dtype)
    yield "fastembed auto out=", lambda ids: fastembed.lookup(table, ids, out=out)
    yield "fastembed auto alloc", lambda ids: fastembed.lookup(table, ids)
    yield "numpy table[ids]", lambda ids: table[ids]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("contender", ["fastembed auto out=", "fastembed auto alloc", "numpy table[ids]"])
def test_lookup(benchmark, table, batch, contender):
    call = dict(_contenders(table, batch))[contender]
    rng = np.random.default_rng(batch)
    pool = [rng.integers(0, table.shape[0], batch) for _ in range(64)]
    call(pool[0])
    fastembed.wait_for_compiles()  # time the parallel kernel, not the serial stand-in of its compile
    state = {"i": 0}

    def one_call():
        state["i"] = (state["i"] + 1) % len(pool)  # fresh ids each round: the table is read from memory
        return call(pool[state["i"]])

    benchmark.group = f"batch {batch}"
    benchmark.pedantic(one_call, rounds=30 if batch >= 1024 else 300, warmup_rounds=3)
    if benchmark.disabled:  # --benchmark-disable: each call ran once, as a smoke test; nothing was timed
        return
    moved = 2 * batch * table.shape[1] * table.dtype.itemsize
    benchmark.extra_info["bytes_moved"] = moved
    benchmark.extra_info["gbps"] = moved / benchmark.stats.stats.median / 1e9
