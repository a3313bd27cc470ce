"""The cost of the first lookup in a fresh process (docs/backends.md, "Compile cost").

    python bench/first_call.py [--batches 6,8192,65536] [--runs 3]

Each measurement is a new Python process on the default 129,280 x 4,096
float16 table, with numba's cache directory (NUMBA_CACHE_DIR) either empty,
as right after an install, or filled by the previous process. The output
buffer is written once before the timed call, so the time is fastembed's
(imports, compiles, the gather), not the operating system's first touch of
a fresh buffer, which numpy's own ``table[ids]`` pays just the same.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
started = time.perf_counter()
import fastembed
import_s = time.perf_counter() - started
numba_imported_by_import = "numba" in sys.modules
import numpy as np
n = int(sys.argv[1])
table = fastembed.Embedding.random().table
ids = np.random.default_rng(0).integers(0, table.shape[0], n)
out = np.ones((n, table.shape[1]), table.dtype)
started = time.perf_counter()
fastembed.lookup(table, ids, out=out)
first_s = time.perf_counter() - started
assert np.array_equal(out, table[ids])
started = time.perf_counter()
fastembed.lookup(table, ids, out=out)
second_s = time.perf_counter() - started
fastembed.wait_for_compiles()
print(json.dumps({"import_s": import_s, "numba_imported_by_import": numba_imported_by_import,
                  "first_s": first_s, "second_s": second_s}))
"""


def first_call(batch: int, cache_dir: str) -> dict:
    environment = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    environment.pop("FASTEMBED_BACKEND", None)
    completed = subprocess.run([sys.executable, "-c", CHILD, str(batch)], env=environment,
                               capture_output=True, text=True, check=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="6,8192,65536", help="comma-separated id counts")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per cell")
    arguments = parser.parse_args()
    print("| ids | numba cache | import fastembed | first call | second call |")
    print("| --- | --- | --- | --- | --- |")
    for batch in (int(b) for b in arguments.batches.split(",")):
        cells: dict[str, list[dict]] = {"empty": [], "filled": []}
        for _ in range(arguments.runs):
            with tempfile.TemporaryDirectory() as cache_dir:
                cells["empty"].append(first_call(batch, cache_dir))
                cells["filled"].append(first_call(batch, cache_dir))
        for state, runs in cells.items():
            assert not any(run["numba_imported_by_import"] for run in runs), "import fastembed imported numba"
            print(f"| {batch} | {state} | {_span(runs, 'import_s')} | {_span(runs, 'first_s')} | {_span(runs, 'second_s')} |")


def _span(runs: list[dict], key: str) -> str:
    values = sorted(run[key] for run in runs)
    low, high = values[0], values[-1]
    if high < 0.1:
        return f"{low * 1e3:.1f}-{high * 1e3:.1f} ms"
    return f"{low:.2f}-{high:.2f} s"


if __name__ == "__main__":
    main()
