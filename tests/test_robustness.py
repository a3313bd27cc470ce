"""What other threads, forks, interrupts and odd settings do to a lookup: never a crash, a hang or a wrong row.

Races and forks run in child processes, so that a crash or a hang is seen as
an exit status or a timeout instead of taking the test run down with it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import fastembed
from fastembed.backends import cuda_backend, numba_backend
from helpers import CPU_BACKENDS, assert_bit_equal, poisoned, random_table

NUMBA_AVAILABLE = not numba_backend.BACKEND.unavailable_reasons()
CUPY_DOUBLE = Path(__file__).parent / "cupy_double"  # a folder whose `cupy` is the CuPy test double
needs_numba = pytest.mark.skipif(not NUMBA_AVAILABLE, reason="the numba backend is unavailable here")
RACE_SECONDS = float(os.environ.get("FASTEMBED_RACE_SECONDS", "4"))  # longer hunts: set it higher


def cuda_available() -> bool:
    return not cuda_backend.BACKEND.unavailable_reasons()


def run_child(code: str, timeout: float, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter, with `env`'s variables set (None: removed); a hang fails the test with what
    the child printed."""
    environment = dict(os.environ, **(env or {}))
    environment = {name: value for name, value in environment.items() if value is not None}
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=timeout, env=environment)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the child hung for {timeout} s; it printed: {expired.stdout!r} {expired.stderr!r}")


def assert_child_ok(result: subprocess.CompletedProcess, expected_last_line: str = "ok") -> None:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stdout[-2000:]} {result.stderr[-4000:]}"
    assert result.stdout.strip().splitlines()[-1] == expected_last_line, result.stdout[-2000:]


# -- another thread reshapes the table ------------------------------------------------------------

RESHAPE_RACE = """
import sys, threading, time, numpy as np, fastembed
from fastembed.backends import numba_backend
numba_backend.PARALLEL_MIN_BYTES = 0   # the kernels serve these small tables too
numba_backend.SERIAL_MIN_BYTES = 0
numba_backend.TOUCHED_ROW_MIN_BYTES = 0
sys.setswitchinterval(1e-6)   # switch threads as often as possible: every window between two reads is tried
backend, seconds = {backend!r}, {seconds}
table = np.arange(64 * 16, dtype=np.float64).reshape(64, 16)
if backend == "cuda":   # on the CuPy test double (or a real GPU), the same race on a device table
    import cupy
    table = cupy.asarray(table)
    asnumpy, empty, full = cupy.asnumpy, cupy.empty, cupy.full
else:
    asnumpy, empty, full = np.asarray, np.empty, np.full
stop = time.monotonic() + seconds
def reshape_forever():
    while time.monotonic() < stop:
        table.shape = (32, 32)
        time.sleep(0)   # let the other thread run while the table has each shape
        table.shape = (64, 16)
        time.sleep(0)
threading.Thread(target=reshape_forever, daemon=True).start()
cases = [(ids_shape, with_out) for ids_shape in ((40,), (5, 8)) for with_out in (False, True)]
counts = {{"lookups": 0, "refused": 0}}
while time.monotonic() < stop:
    for ids_shape, with_out in cases:
        ids = (np.arange(40) % 32).reshape(ids_shape)
        buffer = full(40 * 16 + 1024, -123.0)
        out = buffer[:640].reshape(ids_shape + (16,)) if with_out else None
        exact = empty(ids_shape + (16,)) if with_out else None  # an exact-size buffer: corruption aborts
        try:
            result = fastembed.lookup(table, ids, out=out, backend=backend)
            fastembed.lookup(table, ids, out=exact, backend=backend)
            counts["lookups"] += 1
        except ValueError:
            counts["refused"] += 1  # the shape changed between two of the caller's own reads: a clean refusal
            continue
        assert (asnumpy(buffer)[640:] == -123.0).all(), "a write past the end of out"
        result = asnumpy(result)
        rows = result.reshape(-1, result.shape[-1])
        width = rows.shape[1]
        assert width in (16, 32), width
        # every row is a row of the table as it was shaped at some moment: consecutive values
        assert (np.diff(rows, axis=1) == 1).all() and (rows[:, 0] % width == 0).all(), "a wrong row"
print(counts)
print("ok")
"""


@pytest.mark.parametrize("backend", [*CPU_BACKENDS, "cuda"])
def test_table_reshaped_by_another_thread_never_writes_outside_out(backend):
    env = {}
    if backend == "cuda" and not cuda_available():
        env["PYTHONPATH"] = os.pathsep.join([str(CUPY_DOUBLE), os.environ.get("PYTHONPATH", "")])
    result = run_child(RESHAPE_RACE.format(backend=backend, seconds=RACE_SECONDS), timeout=RACE_SECONDS + 120, env=env)
    assert_child_ok(result)


IDS_RACE = """
import re, sys, threading, time, numpy as np, fastembed
from fastembed.backends import numba_backend
numba_backend.PARALLEL_MIN_BYTES = 0   # the kernels serve these small tables too
numba_backend.SERIAL_MIN_BYTES = 0
numba_backend.TOUCHED_ROW_MIN_BYTES = 0
sys.setswitchinterval(1e-6)
backend, seconds = {backend!r}, {seconds}
vocab, width = 300, 64
guarded = np.full((vocab + 2, width), -7.0, np.float32)   # a poisoned row on each side of the table
table = guarded[1:-1]
table[...] = np.arange(vocab * width, dtype=np.float32).reshape(vocab, width)
ids = np.random.default_rng(0).integers(0, vocab, 5000)
stop = time.monotonic() + seconds
def scribble():
    rng = np.random.default_rng(1)
    while time.monotonic() < stop:
        position = int(rng.integers(0, ids.size))
        ids[position] = rng.choice([-1, vocab, 2**40])
        ids[position] = rng.integers(0, vocab)
threading.Thread(target=scribble, daemon=True).start()
outcomes = {{}}
while time.monotonic() < stop:
    for with_out in (False, True):
        out = np.full((ids.size, width), -5.0, np.float32)
        try:
            rows = fastembed.lookup(table, ids, out=out if with_out else None, backend=backend)
            outcome = "ok"
            assert not (rows == -7.0).all(axis=1).any(), "a row read from outside the table"
            # every row is a whole row of the table (the ids as the call copied them, whatever came later)
            assert (np.diff(rows, axis=1) == 1).all() and (rows[:, 0] % width == 0).all(), "a wrong row"
        except IndexError as error:  # the call's copy of the ids held a bad one: named, and out left alone
            outcome = "IndexError"
            value = int(re.match(r"id (-?[0-9]+) at position", str(error)).group(1))
            assert not 0 <= value < vocab, f"a valid id named as the bad one: {{error}}"
            assert (out == -5.0).all(), "out was written before the IndexError"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
print(outcomes)
print("ok")
"""


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ids_changed_by_another_thread_give_whole_rows_or_a_clean_index_error(backend):
    seconds = min(RACE_SECONDS, 5.0)
    assert_child_ok(run_child(IDS_RACE.format(backend=backend, seconds=seconds), timeout=seconds + 120))


IDS_DTYPE_RACE = """
import sys, numpy as np, fastembed
from fastembed.backends import numba_backend
numba_backend.PARALLEL_MIN_BYTES = 0   # the kernels serve these small tables too
numba_backend.SERIAL_MIN_BYTES = 0
numba_backend.TOUCHED_ROW_MIN_BYTES = 0
backend = {backend!r}
vocab, width, n = 300, 64, 512
table = np.arange(vocab * width, dtype=np.float32).reshape(vocab, width)
base = np.random.default_rng(0).integers(0, vocab // 2, n).astype(np.int64)  # its int32 view is in range too
cycle = [np.uint64, np.int64, np.int32, np.int64]
for dtype in (np.int64, np.int32):  # both kernel signatures compiled before the race
    fastembed.lookup(table, base.view(dtype), backend=backend)
fastembed.wait_for_compiles()
emb = fastembed.Embedding(table)
outcomes = {{}}
for phase in range(len(cycle)):
    for with_out in (False, True):
        for hook_every in (1, 2, 3):
            for call in (lambda ids, out: fastembed.lookup(table, ids, out=out, backend=backend),
                         lambda ids, out: emb(ids, out, backend)):
                ids = base.copy()
                ids.dtype = cycle[phase]
                arena = np.full((2 * n, width), -1.0, np.float32)
                out = arena[:n] if with_out else None
                state = {{"step": phase, "calls": 0}}
                def reassign(frame, event, arg):  # what another thread may do between any two calls
                    if event == "call" and frame.f_globals.get("__name__", "").startswith("fastembed"):
                        state["calls"] += 1
                        if state["calls"] % hook_every == 0:
                            state["step"] += 1
                            ids.dtype = cycle[state["step"] % len(cycle)]
                sys.setprofile(reassign)
                try:
                    rows = call(ids, out)
                    outcome = "ok"
                except (ValueError, TypeError, IndexError) as error:
                    rows, outcome = None, type(error).__name__
                finally:
                    sys.setprofile(None)
                assert (arena[n:] == -1.0).all(), f"a write past the end of out (phase {{phase}}, every {{hook_every}})"
                if rows is not None:
                    flat = rows.reshape(-1, width)
                    views = {{dtype: base.view(dtype) for dtype in (np.int64, np.int32)}}
                    assert any(flat.shape[0] == v.size and (flat == table[v]).all() for v in views.values()), "a wrong row"
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
print(outcomes)
print("ok")
"""


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ids_whose_dtype_another_thread_reassigns_never_make_a_lookup_write_outside_out(backend):
    """The reassignments come between the calls inside the lookup, at every call, every second or every third
    (a profile function stands in for the other thread, so that each of them lands for certain)."""
    assert_child_ok(run_child(IDS_DTYPE_RACE.format(backend=backend), timeout=180))


def test_embedding_keeps_its_own_view_of_the_table(backend):
    table = random_table(80, 16)
    copy = table.copy()
    emb = fastembed.Embedding(table)
    table.shape = (40, 32)
    ids = np.array([3, 79, 0])
    assert (emb.vocab_size, emb.dim) == (80, 16)
    assert_bit_equal(emb(ids, backend=backend), copy[ids])
    table.shape = (1280,)
    assert_bit_equal(emb(ids, backend=backend), copy[ids])


# -- forks and interrupts during the first lookup --------------------------------------------------

FORK_DURING_FIRST_LOOKUP = """
import os, threading, time, numpy as np, fastembed
from fastembed.backends import numba_backend
numba_backend.PARALLEL_MIN_BYTES = 0   # the kernels (and their compile) serve these small tables too
numba_backend.SERIAL_MIN_BYTES = 0
numba_backend.TOUCHED_ROW_MIN_BYTES = 0
table = fastembed.Embedding.random(500, 16, "float32").table
ids = np.arange(40) % 500
expected = table[ids]
def first_lookup():
    fastembed.lookup(table, ids, out=np.empty((40, 16), np.float32))
threading.Thread(target=first_lookup).start()
time.sleep({delay})
pid = os.fork()
if pid == 0:
    ok = np.array_equal(fastembed.lookup(table, ids, out=np.empty((40, 16), np.float32)), expected)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
print("ok" if os.waitstatus_to_exitcode(status) == 0 else "child failed")
"""


FORK_MOMENTS = [("warm", delay) for delay in (0.0, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5)] + [
    ("cold", delay) for delay in (0.0, 0.1, 0.3, 0.5)  # an empty numba cache: import and compile take longer
]


@needs_numba
@pytest.mark.parametrize("cache, delay", FORK_MOMENTS)
def test_a_fork_during_the_first_lookup_never_hangs_the_child(cache, delay, tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path)} if cache == "cold" else {}
    assert_child_ok(run_child(FORK_DURING_FIRST_LOOKUP.format(delay=delay), timeout=120, env=env))


FORK_AFTER_THE_APPLICATION_STARTED_NUMBAS_POOL = """
import os, threading, numba, numpy as np, fastembed
from fastembed.backends import numba_backend
@numba.njit(parallel=True)
def applications_own_code(a):
    total = 0.0
    for i in numba.prange(a.size):
        total += a[i]
    return total
applications_own_code(np.ones(1000))   # numba's thread pool starts here, not in fastembed
table = fastembed.Embedding.random(3000, 1024).table
ids = np.random.default_rng(0).integers(0, 3000, 2048)   # 4 MiB of output: the parallel kernel's size
pid = os.fork()
if pid == 0:
    fastembed.lookup(table, ids); fastembed.wait_for_compiles()
    ok = np.array_equal(fastembed.lookup(table, ids), table[ids])
    workers = [thread for thread in threading.enumerate() if thread.name.startswith("fastembed-worker")]
    os._exit(0 if ok and len(workers) == numba_backend.thread_count() - 1 else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
print("ok" if os.waitstatus_to_exitcode(status) == 0 else "child failed")
"""


@needs_numba
def test_a_child_forked_after_the_application_started_numbas_pool_gathers_exactly_in_parallel():
    assert_child_ok(run_child(FORK_AFTER_THE_APPLICATION_STARTED_NUMBAS_POOL, timeout=120))


def fork_while_held(setup: str, lock: str, why: str) -> str:
    """A script: `setup` (a table, its ids, one lookup), then a fork while another thread holds `lock` (`why`: as
    what); the child's lookup must give ``table[ids]``, and prints "ok" where it does."""
    return setup + f"""
held, release = threading.Event(), threading.Event()
def hold():   # {why}
    with {lock}:
        held.set()
        release.wait()
holder = threading.Thread(target=hold)
holder.start()
held.wait()
pid = os.fork()
if pid == 0:
    os._exit(0 if np.array_equal(fastembed.lookup(table, ids), table[ids]) else 3)
release.set()
holder.join()
_, status = os.waitpid(pid, 0)
print("ok" if os.waitstatus_to_exitcode(status) == 0 else f"child failed: {{os.waitstatus_to_exitcode(status)}}")
"""


FORK_WHILE_NUMBAS_LAYER_LOCK_IS_HELD = fork_while_held("""
import os, threading, numba, numpy as np, fastembed
from numba.np.ufunc import parallel
numba.set_num_threads(2)   # the application starts numba's own layer: fastembed then reads its thread count
table = fastembed.Embedding.random(3000, 1024).table
ids = np.random.default_rng(0).integers(0, 3000, 2048)   # 4 MiB of output: in parallel
fastembed.lookup(table, ids); fastembed.wait_for_compiles()
""", "parallel._backend_init_thread_lock", "as a thread inside numba.get_num_threads() at the moment of the fork")


@needs_numba
def test_a_child_forked_while_another_thread_held_numbas_layer_lock_never_hangs():
    """The thread count is read without numba's locks, which the child would wait on forever."""
    assert_child_ok(run_child(FORK_WHILE_NUMBAS_LAYER_LOCK_IS_HELD, timeout=60))


FORK_AFTER_TORCH_STARTED_ITS_OPENMP_THREADS = """
import os, threading, torch, numpy as np, fastembed   # torch first: its GNU OpenMP is in the global scope
from fastembed.backends import numba_backend
float((torch.ones(500, 500) @ torch.ones(500, 500)).sum())   # torch's OpenMP threads start here
table = fastembed.Embedding.random(3000, 1024).table
ids = np.random.default_rng(0).integers(0, 3000, 2048)   # 4 MiB of output: the parallel kernel's size
pid = os.fork()
if pid == 0:
    fastembed.lookup(table, ids); fastembed.wait_for_compiles()
    ok = np.array_equal(fastembed.lookup(table, ids), table[ids])
    workers = [thread for thread in threading.enumerate() if thread.name.startswith("fastembed-worker")]
    ok = ok and len(workers) == numba_backend.thread_count() - 1
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("ok" if os.waitstatus_to_exitcode(status) == 0 else f"child failed: {os.waitstatus_to_exitcode(status)}")
"""


@needs_numba
def test_a_child_forked_after_torch_started_its_openmp_threads_gathers_in_parallel_and_never_hangs():
    """A parallel region on torch's OpenMP runtime (numba's omp layer binds to it) would wait, in a child, for threads
    the fork did not copy; fastembed's own workers start again in the child."""
    pytest.importorskip("torch")
    assert_child_ok(run_child(FORK_AFTER_TORCH_STARTED_ITS_OPENMP_THREADS, timeout=60))


FORK_WHILE_THE_OUTPUT_CACHE_IS_LOCKED = fork_while_held("""
import os, threading, numpy as np, fastembed
from fastembed.backends import output_cache
table = fastembed.Embedding.random(4000, 1024).table
ids = np.arange(3000) % 4000   # 6 MiB of output: from the output cache
fastembed.lookup(table, ids); fastembed.wait_for_compiles()
""", "output_cache._lock", "as a thread inside empty_cache() or a lookup's _take at the moment of the fork")


@needs_numba
def test_a_fork_while_another_thread_holds_the_output_cache_never_hangs_the_child():
    assert_child_ok(run_child(FORK_WHILE_THE_OUTPUT_CACHE_IS_LOCKED, timeout=120))


FORK_POOL_DURING_WARM_UP = """
import multiprocessing, threading, numpy as np, fastembed
from fastembed.backends import numba_backend
numba_backend.PARALLEL_MIN_BYTES = 0   # the kernels (and their compile) serve these small tables too
numba_backend.SERIAL_MIN_BYTES = 0
numba_backend.TOUCHED_ROW_MIN_BYTES = 0
table = fastembed.Embedding.random(2000, 64).table
def lookup(seed):
    ids = np.random.default_rng(seed).integers(0, 2000, 3000)
    return bool(np.array_equal(fastembed.lookup(table, ids), table[ids]))
warm_up = threading.Thread(target=lookup, args=(0,))
warm_up.start()
with multiprocessing.get_context("fork").Pool(2) as pool:
    results = pool.map_async(lookup, range(1, 7)).get(timeout=100)
warm_up.join()
print(results)
print("ok" if all(results) and lookup(9) else "wrong rows")
"""


@needs_numba
def test_a_fork_pool_created_during_warm_up_returns():
    assert_child_ok(run_child(FORK_POOL_DURING_WARM_UP, timeout=150))


INTERRUPTED_FIRST_LOOKUP = """
import signal, numpy as np, fastembed
from fastembed.backends import numba_backend
numba_backend.PARALLEL_MIN_BYTES = 0   # the kernels (and their compile) serve these small tables too
numba_backend.SERIAL_MIN_BYTES = 0
numba_backend.TOUCHED_ROW_MIN_BYTES = 0
table = fastembed.Embedding.random(500, 16).table
ids = np.arange(100) % 500
signal.setitimer(signal.ITIMER_REAL, {delay})
signal.signal(signal.SIGALRM, signal.default_int_handler)   # the alarm raises KeyboardInterrupt, as Ctrl-C does
try:
    fastembed.lookup(table, ids)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
signal.setitimer(signal.ITIMER_REAL, 0)
for _ in range(3):
    assert np.array_equal(fastembed.lookup(table, ids), table[ids])
    assert np.array_equal(fastembed.lookup(table, ids, out=np.empty((100, 16), np.float16)), table[ids])
fastembed.wait_for_compiles()
assert np.array_equal(fastembed.lookup(table, ids), table[ids])
print("ok")
"""


@needs_numba
@pytest.mark.parametrize("delay", [0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8])
def test_an_interrupted_first_lookup_leaves_later_lookups_working(delay):
    assert_child_ok(run_child(INTERRUPTED_FIRST_LOOKUP.format(delay=delay), timeout=120))


# -- settings that disable parts of numba ----------------------------------------------------------

SETTINGS_CHECK = """
import threading, numpy as np, fastembed
from fastembed.backends import cuda_backend, numba_backend
for dim in (64, 1024):   # 2,000 rows of 2 KiB: 4 MiB, in parallel where numba serves
    table = fastembed.Embedding.random(3000, dim).table
    for n in (1, 6, 40, 2000, 2000, 2000):
        ids = np.random.default_rng(n).integers(0, 3000, n)
        assert np.array_equal(fastembed.lookup(table, ids), table[ids]), n
        out = np.empty((n, dim), table.dtype)
        assert np.array_equal(fastembed.lookup(table, ids, out=out), table[ids]), n
        fastembed.wait_for_compiles()
print(fastembed.select_backend(table, np.arange(100)).backend)
print(numba_backend.BACKEND.unavailable_reasons())
print(sum(thread.name.startswith("fastembed-worker") for thread in threading.enumerate()))
print("ok")
"""


#: A child's environment without a thread count of the caller's: numba's default, the CPUs it may run on.
DEFAULT_THREADS: dict[str, str | None] = {"NUMBA_NUM_THREADS": None}


@needs_numba
def test_a_threading_layer_that_cannot_load_changes_nothing():
    """fastembed never starts numba's threading layer: a setting that would make it fail to load does not matter."""
    import importlib.util

    if importlib.util.find_spec("tbb") is not None:
        pytest.skip("tbb is installed: the layer loads")
    result = run_child(SETTINGS_CHECK, timeout=120, env={"NUMBA_THREADING_LAYER": "tbb", **DEFAULT_THREADS})
    assert_child_ok(result)
    backend, reasons, workers = result.stdout.strip().splitlines()[-4:-1]
    assert backend == "numba" and reasons == "[]"
    assert int(workers) == len(os.sched_getaffinity(0)) - 1


THREADS_CHECK = """
import sys, threading, numpy as np
{first}
import fastembed
from fastembed.backends import numba_backend
table = fastembed.Embedding.random(3000, 1024).table
quantized = fastembed.Embedding(table).quantize("q8_0")
ids = np.random.default_rng(0).integers(0, 3000, 2048)   # 4 MiB of float16: in parallel
for _ in range(2):
    assert np.array_equal(fastembed.lookup(table, ids), table[ids])
    assert np.array_equal(quantized(ids, dtype=np.float16), quantized(ids, dtype=np.float16, backend="numpy"))
    fastembed.wait_for_compiles()
parallel = sys.modules["numba.np.ufunc.parallel"]
print(sum(thread.name.startswith("fastembed-worker") for thread in threading.enumerate()), numba_backend.thread_count(),
      parallel._is_initialized)
print("ok")
"""


@needs_numba
@pytest.mark.parametrize("first", ["", "import torch; float((torch.ones(300, 300) @ torch.ones(300, 300)).sum())"],
                         ids=["numpy only", "torch first, its OpenMP threads started"])
def test_lookups_run_on_fastembeds_workers_and_never_start_numbas_threading_layer(first):
    """No OpenMP runtime, numba's or one another library put in the process (torch's), runs a lookup."""
    if first:
        pytest.importorskip("torch")
    result = run_child(THREADS_CHECK.format(first=first), timeout=120, env=DEFAULT_THREADS)
    assert_child_ok(result)
    workers, threads, layer_started = result.stdout.strip().splitlines()[-2].split()
    assert int(workers) == int(threads) - 1 == len(os.sched_getaffinity(0)) - 1
    assert layer_started == "False"


@needs_numba
@pytest.mark.parametrize("setting, first", [
    ({"NUMBA_NUM_THREADS": "1"}, ""),
    ({}, "import numba; numba.set_num_threads(1)"),  # the application's own setting, in the calling thread
], ids=["NUMBA_NUM_THREADS", "numba.set_num_threads"])
def test_the_users_thread_count_is_respected(setting, first):
    result = run_child(THREADS_CHECK.format(first=first), timeout=120, env=setting)
    assert_child_ok(result)
    workers, threads, _ = result.stdout.strip().splitlines()[-2].split()
    assert (int(workers), int(threads)) == (0, 1)


@needs_numba
def test_numba_disable_jit_makes_auto_serve_through_numpy():
    result = run_child(SETTINGS_CHECK, timeout=120, env={"NUMBA_DISABLE_JIT": "1"})
    assert_child_ok(result)
    backend, reasons, _ = result.stdout.strip().splitlines()[-4:-1]
    assert backend == "numpy" and "NUMBA_DISABLE_JIT" in reasons
    info = subprocess.run([sys.executable, "-m", "fastembed", "info"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, NUMBA_DISABLE_JIT="1"))
    assert "NUMBA_DISABLE_JIT" in info.stdout


NO_COMPILE_ON_THE_CALLERS_THREAD = """
import threading, numpy as np, fastembed
from numba.core import event
from fastembed.backends import numba_backend
numba_backend.SERIAL_MIN_BYTES = 20 * 64 * 2     # 20 ids and more run on the kernels, fewer on numpy's take
numba_backend.TOUCHED_ROW_MIN_BYTES = 0          # narrow rows too
numba_backend.PARALLEL_MIN_BYTES = 40 * 64 * 2   # 40 ids and more run in parallel, fewer serially

class CompileThreads(event.Listener):
    def __init__(self):
        self.threads = []
    def on_start(self, ev):
        self.threads.append(threading.get_ident())
    def on_end(self, ev):
        pass

listener = CompileThreads()
event.register("numba:compile", listener)
table = fastembed.Embedding.random(3000, 64).table
np.save({path!r}, table)
mapped = np.load({path!r}, mmap_mode="r")          # read-only, like every memory-mapped table
ids = np.random.default_rng(0).integers(0, 3000, 1000)
strided = np.repeat(ids, 2)[::2]                   # non-contiguous ids
frozen = ids.copy(); frozen.flags.writeable = False
for round in range(2):                             # the second round finds every kernel compiled
    for source in (table, mapped):
        for given in (ids, strided, frozen, ids.reshape(10, 100), ids.astype(np.int32)):
            for n in (10, 20, 40, 1000):
                part = given.reshape(-1)[:n]
                assert np.array_equal(fastembed.lookup(source, part), table[part])
                assert np.array_equal(fastembed.lookup(source, part, out=np.empty((n, 64), table.dtype)), table[part])
    fastembed.wait_for_compiles()
main = threading.get_ident()
print(len(listener.threads), "compiles,", listener.threads.count(main), "on the caller's thread")
print("ok" if listener.threads and main not in listener.threads else "compiled on the caller's thread")
"""


@needs_numba
def test_no_lookup_compiles_on_the_callers_thread(tmp_path):
    """New argument types (read-only tables, int32 ids) compile in the background; numpy serves meanwhile."""
    code = NO_COMPILE_ON_THE_CALLERS_THREAD.format(path=str(tmp_path / "table.npy"))
    # An empty cache: every kernel really compiles (numba reports no compile event for a cache hit).
    assert_child_ok(run_child(code, timeout=300, env={"NUMBA_CACHE_DIR": str(tmp_path / "cache")}))


# -- valid tables of every item size ---------------------------------------------------------------

ODD_DTYPES = ["S1", "S3", "S5", "V3", "V7", "S9", "V11", "S13", "V15", "S16", "u2", "V6", "V12",
              np.dtype([("a", "u1"), ("b", "<u2")]), np.dtype([("a", "<f4"), ("b", "u1")])]


@pytest.mark.parametrize("dtype", ODD_DTYPES, ids=str)
@pytest.mark.parametrize("width", [1, 2, 3, 8])
@pytest.mark.parametrize("n_ids", [1, 6, 40])
def test_every_item_size_gathers_bit_exact(backend, dtype, width, n_ids):
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(width).integers(0, 256, 97 * width * dtype.itemsize, dtype=np.uint8)
    table = raw.view(dtype).reshape(97, width)
    ids = np.random.default_rng(n_ids).integers(0, 97, n_ids)
    expected = table[ids]
    assert_bit_equal(fastembed.lookup(table, ids, backend=backend), expected)
    out = poisoned((n_ids, width), dtype)
    assert fastembed.lookup(table, ids, out=out, backend=backend) is out
    assert_bit_equal(out, expected)


def test_ids_beyond_64_bits_say_so(backend):
    table = random_table(10, 4)
    with pytest.raises(IndexError, match=r"id 9223372036854775808 at position 0 does not fit a 64-bit integer"):
        fastembed.lookup(table, [2**63, -1], backend=backend)
    with pytest.raises(IndexError, match=r"id 18446744073709551616 at position \(1, 0\) does not fit"):
        fastembed.lookup(table, [[1], [2**64]], backend=backend)
    with pytest.raises(TypeError, match="floating"):
        fastembed.lookup(table, [1.5, 2**63], backend=backend)
    for ids, first in (([-1, 2**64], r"id -1 at position 0"), ([[3], [10], [2**63]], r"id 10 at position \(1, 0\)")):
        with pytest.raises(IndexError, match=first + " is out of range for a table of 10 rows"):  # the first bad id
            fastembed.lookup(table, ids, backend=backend)
