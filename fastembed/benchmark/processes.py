"""``fastembed-bench --processes N``: the same lookups in N fresh interpreters, one after another.

A speed a user can count on must hold in every process: thread placement,
page placement and compile caches differ from one interpreter to the next.
Each worker process maps the same table file read-only (the page cache
shares it) and reads it once where it takes at most a quarter of the
memory (so that its first lookups do not pay the mapping's page faults,
which later ones never meet); per batch size it
makes one lookup per contender, waits for background compiles, makes
:data:`WARMUP_ROUNDS` more rounds untimed, then times ``reps`` single calls
per contender, interleaved in a new random order each round (a call
that follows another contender's pays more than one that follows its own
kind, so no contender always follows the same one), each with fresh
uniform ids, with Python's garbage collector paused while a call is
timed (:func:`.measure.collector_paused`):

- ``fastembed out=``: ``lookup(table, ids, out=out)``;
- ``fastembed alloc``: ``lookup(table, ids)``;
- ``numpy table[ids]``: what users write instead (allocating).

At the end each process times one full collection of its objects
(numba, its compiled kernels and the process's own), the pause that its
collections cost wherever they run. The parent reports, per batch size and contender, the spread of the
per-process medians (slowest over fastest), each process's 99th percentile
over its median (with the samples per process it comes from: below 100,
the 99th percentile is close to the slowest sample), and fastembed's speed against numpy (the median, within
each process, of numpy's time over fastembed's in the same repetition; the
lowest process is reported). ``--load`` runs a CPU-bound process pinned to
one CPU meanwhile, as a competing job on a shared machine would.

The gate's co-located case (``one_cpu``) moves every thread of the worker,
the caller and fastembed's workers alike, onto one CPU once the workers
have started: that is where the scheduler sometimes puts them, and where a
lookup that waits for a descheduled worker, or for threads that spin after
each parallel region, stalls. Starting the process on one CPU would not
show it: an OpenMP runtime then sees one CPU and stops spinning by itself.
Where torch is installed, the process imports it first and runs one
operation, as a program that imported torch before fastembed does, so that
torch's OpenMP runtime and its threads are in it (docs/backends.md).
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .measure import collector_paused
from .report import print_readable

#: Batch sizes of the multi-process run: a decode step, mid-size batches, a prefill.
BATCHES = (64, 1024, 4096, 65536)
CONTENDERS = ("fastembed-out", "fastembed-alloc", "numpy-fancy")
LABELS = {"fastembed-out": "fastembed out=", "fastembed-alloc": "fastembed alloc", "numpy-fancy": "numpy table[ids]"}
#: Timed calls per contender and batch in each process (fewer for the largest batches).
REPS = 100
#: Untimed rounds of every contender after the first calls and the compile wait.
WARMUP_ROUNDS = 3


def reps_for(batch: int, row_bytes: int, reps: int) -> int:
    """Fewer repetitions for outputs of tens of MiB, so that a process takes seconds: `reps` scaled down to 8 MiB of
    output per repetition, but at least 15 whatever `reps` says, so that each process's spread and 99th percentile
    rest on enough samples (the run's JSON records the count per batch)."""
    if batch * row_bytes <= 8 * 2**20:
        return reps
    return max(15, min(reps, int(reps * (8 * 2**20) / (batch * row_bytes))))


def worker(table_path: str, batches: list[int], reps: int, seed: int, one_cpu: bool = False) -> dict[str, Any]:
    """One process's run (in a fresh interpreter): its samples and what a full collection costs in it.

    Returns:
        ``{"samples": {batch: {contender: [seconds per call, ...]}}, "collector": {"tracked_objects": count,
        "full_collection_s": seconds}}``.

    With `one_cpu`, torch (where installed) comes first and every thread of the process is moved onto one CPU after
    each warm-up (see the module docstring).
    """
    if one_cpu and importlib.util.find_spec("torch") is not None:
        import torch

        float((torch.ones(256, 256) @ torch.ones(256, 256)).sum())  # torch's CPU threads start
    import fastembed

    table = mapped_table(table_path)
    from .report import physical_memory

    if table.nbytes <= physical_memory() // 4:  # a larger one would evict itself, and the other workers' pages
        np.asarray(table).reshape(-1).view(np.uint8)[:: 4096].sum()  # a byte per page: the map's page faults, once
    rng = np.random.default_rng(seed)
    samples: dict[str, Any] = {}
    for batch in batches:
        calls = _calls(fastembed, table, np.empty((batch, table.shape[1]), table.dtype))
        for call in calls.values():
            call(rng.integers(0, table.shape[0], batch))
        fastembed.wait_for_compiles()
        if one_cpu:
            calls["fastembed-out"](rng.integers(0, table.shape[0], batch))  # the compiled kernel starts the workers
            _move_threads_to_one_cpu()
        for _ in range(WARMUP_ROUNDS):
            for call in calls.values():
                call(rng.integers(0, table.shape[0], batch))
        times: dict[str, list[float]] = {name: [] for name in calls}
        order = list(calls)
        for _ in range(reps_for(batch, table.shape[1] * table.dtype.itemsize, reps)):
            rng.shuffle(order)  # a new order each round: a call pays for what its predecessor left in the caches
            for name in order:
                call = calls[name]
                ids = rng.integers(0, table.shape[0], batch)
                with collector_paused():
                    started = time.perf_counter()
                    result = call(ids)
                    elapsed = time.perf_counter() - started
                times[name].append(elapsed)
                del result
        samples[str(batch)] = times
    tracked = len(gc.get_objects())
    started = time.perf_counter()
    gc.collect()
    return {"samples": samples, "collector": {"tracked_objects": tracked, "full_collection_s": time.perf_counter() - started}}


def _calls(fastembed: Any, table: np.ndarray, out: np.ndarray) -> dict[str, Any]:
    """One call per contender, each taking fresh ids."""
    plain = np.asarray(table)  # numpy users index the array, not np.memmap's slower subclass
    return {
        "fastembed-out": lambda ids: fastembed.lookup(table, ids, out=out),
        "fastembed-alloc": lambda ids: fastembed.lookup(table, ids),
        "numpy-fancy": lambda ids: plain[ids],
    }


def can_move_threads() -> bool:
    """Whether this system lets a process pin each of its threads (Linux: sched_setaffinity and /proc/self/task)."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def _move_threads_to_one_cpu() -> None:
    """Pin every thread of this process, fastembed's workers and torch's included, to the lowest CPU it may use."""
    cpu = min(os.sched_getaffinity(0))
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), {cpu})
        except ProcessLookupError:  # a thread that has just ended
            pass


#: Code that makes a child process end with its parent (Linux's parent-death signal), even one killed by SIGKILL.
_END_WITH_PARENT = (
    "import ctypes, signal\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "except Exception:  # not Linux, say: the parent's cleanup alone ends it\n"
    "    pass\n"
    "if os.getppid() != {parent}:  # the parent ended before the signal was asked for\n"
    "    raise SystemExit\n"
)


@contextmanager
def competing_load(enabled: bool) -> Iterator[None]:
    """A CPU-bound process pinned to the last CPU while the block runs (nothing when not enabled).

    Raises:
        RuntimeError: the load process ended before the block did, so what the block measured ran without it.
    """
    if not enabled:
        yield
        return
    pin = f"os.sched_setaffinity(0, {{{max(os.sched_getaffinity(0))}}})\n" if hasattr(os, "sched_setaffinity") else ""
    # It also looks for its parent every million iterations (tens of ms): where no parent-death signal exists, a
    # benchmark killed by SIGKILL leaves no load spinning.
    code = (f"import os\n{pin}{_END_WITH_PARENT.format(parent=os.getpid())}while os.getppid() == {os.getpid()}:\n"
            "    for _ in range(1_000_000):\n        pass\n")
    # A session of its own: a Ctrl-C at the terminal reaches the benchmark alone, which ends the load below.
    load = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        yield
        if load.poll() is not None:
            raise RuntimeError(f"the competing load ended by itself (exit status {load.returncode}): the lookups were "
                               "measured without it")
    finally:
        load.kill()
        load.wait()


def run(table_path: Path, processes: int, batches: list[int], reps: int, load: bool,
        progress: Any = None, one_cpu: bool = False) -> list[dict[str, Any]]:
    """The runs of `processes` fresh interpreters, one after another, each as :func:`worker` returns it (`one_cpu`: see there)."""
    runs = []
    with competing_load(load):
        for index in range(processes):
            code = ("import json, sys; from fastembed.benchmark.processes import worker; "
                    "print(json.dumps(worker(sys.argv[1], [int(b) for b in sys.argv[2].split(',')], "
                    "int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == '1')))")
            result = subprocess.run([sys.executable, "-c", code, str(table_path), ",".join(map(str, batches)),
                                     str(reps), str(index), "1" if one_cpu else "0"],
                                    capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"worker process {index} failed: {result.stderr.strip()[-2000:]}")
            runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
            if progress is not None:
                progress(index + 1)
    return runs


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch and contender: medians per process, their spread, 99th percentiles, speed against numpy."""
    rows = []
    for batch in runs[0]["samples"]:
        for name in CONTENDERS:
            medians, tails, versus_numpy = [], [], []
            for samples in (run["samples"] for run in runs):
                times = samples[batch][name]
                median = statistics.median(times)
                medians.append(median)
                tails.append(float(np.percentile(times, 99)) / median)
                numpy_times = samples[batch]["numpy-fancy"]
                versus_numpy.append(statistics.median(n / t for n, t in zip(numpy_times, times, strict=True)))
            rows.append({
                "batch": int(batch), "contender": name, "label": LABELS[name],
                "samples_per_process": len(runs[0]["samples"][batch][name]),
                "median_us": [m * 1e6 for m in medians],
                "spread": max(medians) / min(medians),
                "worst_p99_over_median": max(tails),
                "lowest_speedup_vs_numpy": min(versus_numpy),
                "median_speedup_vs_numpy": statistics.median(versus_numpy),
            })
    return rows


def collections(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The processes' full collections: each one's time (ms) and tracked objects, and their range."""
    times = [run["collector"]["full_collection_s"] * 1e3 for run in runs]
    objects = [run["collector"]["tracked_objects"] for run in runs]
    return {"full_collection_ms": times, "tracked_objects": objects,
            "summary": (f"a full garbage collection took {min(times):.1f}-{max(times):.1f} ms in these processes "
                        f"({min(objects):,}-{max(objects):,} tracked objects; the timed calls ran with it paused)")}


def goals(rows: list[dict[str, Any]], load: bool) -> list[tuple[str, bool]]:
    """The goals a user can count on, each with whether this run met it."""
    tail_limit = 3.0 if load else 2.0
    results = []
    for row in rows:
        if row["contender"] == "numpy-fancy":
            continue
        where = f"{row['label']} at {row['batch']} ids"
        if not load:
            results.append((f"{where}: slowest process median within 1.25x of the fastest", row["spread"] <= 1.25))
        results.append((f"{where}: every process's 99th percentile within {tail_limit:g}x of its median",
                        row["worst_p99_over_median"] <= tail_limit))
        if row["contender"] == "fastembed-alloc" or load:
            results.append((f"{where}: at least as fast as numpy table[ids] in every process",
                            row["lowest_speedup_vs_numpy"] >= 1.0))
    return results


@contextmanager
def saved_table(table: Any) -> Iterator[Path]:
    """The table as a file the workers can map (:func:`mapped_table`): the file itself when it is a .npy file, else a
    temporary copy, in .npy where numpy reads its dtype back (float8_e5m2 it does not) and else in safetensors."""
    filename = getattr(table, "filename", None)
    if filename and str(filename).endswith(".npy") and getattr(table, "offset", None) is not None:
        yield Path(filename)
        return
    with tempfile.TemporaryDirectory(prefix="fastembed-bench-") as folder:
        if _npy_reads_back(np.dtype(table.dtype)):
            path = Path(folder) / "table.npy"
            np.save(path, np.asarray(table))
        else:
            from fastembed.io import save_table

            path = Path(folder) / "table.safetensors"
            save_table(path, table)
        yield path


def _npy_reads_back(dtype: np.dtype) -> bool:
    """Whether numpy reads `dtype` back from a .npy header (ml_dtypes' float8_e5m2 is written as '<f1', which it
    does not)."""
    try:
        return bool(np.lib.format.descr_to_dtype(np.lib.format.dtype_to_descr(dtype)) == dtype)
    except (TypeError, ValueError):
        return False


def mapped_table(path: str) -> np.ndarray:
    """The table :func:`saved_table` wrote, memory-mapped read-only."""
    if str(path).endswith(".npy"):
        return np.load(path, mmap_mode="r")
    import fastembed

    return fastembed.Embedding.from_pretrained(path).table


def print_report(rows: list[dict[str, Any]], verdicts: list[tuple[str, bool]], console: Any, title: str) -> None:
    """The per-batch table and the goals, with rich."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title))
    for column in ("ids", "contender", "median per process (min-max)", "spread", "worst p99/median",
                   "samples per process", "vs numpy (lowest)"):
        table.add_column(column, justify="left" if column in ("contender",) else "right")
    for row in rows:
        low, high = min(row["median_us"]), max(row["median_us"])
        versus = "-" if row["contender"] == "numpy-fancy" else f"{row['lowest_speedup_vs_numpy']:.2f}x"
        table.add_row(str(row["batch"]), escape(row["label"]), f"{_time(low)} - {_time(high)}", f"{row['spread']:.2f}",
                      f"{row['worst_p99_over_median']:.2f}", str(row["samples_per_process"]), versus)
    print_readable(table, console)
    for goal, met in verdicts:
        console.print(f"{'[green]met[/green]' if met else '[red]missed[/red]'}  {escape(goal)}")


def _time(us: float) -> str:
    return f"{us:.0f} us" if us < 1000 else f"{us / 1000:.2f} ms"
