"""fastembed's own CPU worker threads: every row once, no waiting on a late worker, errors, interrupts, fork."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

from fastembed.backends import cpu_workers
from fastembed.backends.cpu_workers import Workers
from helpers import interrupted_runs


def _counting(visits: np.ndarray):
    """A task that counts each row's visits and returns the rows of its block."""
    def task(start: int, stop: int) -> int:
        visits[start:stop] += 1
        return stop - start
    return task


def _summing(table: np.ndarray):
    return lambda start, stop: int(table[start:stop].sum())


@pytest.mark.parametrize("n_threads", [1, 2, 3, 8])
@pytest.mark.parametrize("n_rows", [0, 1, 2, 5, 1000])
def test_every_row_is_visited_exactly_once(n_rows, n_threads):
    workers = Workers()
    visits = np.zeros(n_rows, np.int64)
    assert workers.run(_counting(visits), n_rows, n_threads) == n_rows
    assert (visits == 1).all()


@pytest.mark.parametrize("n_blocks", [0, 1, 2, 3, 16, 10**6])
def test_more_blocks_than_threads_cover_every_row_once_and_wake_no_more_workers(n_blocks):
    workers = Workers()
    blocks: list[tuple[int, int]] = []
    lock = threading.Lock()

    def task(start: int, stop: int) -> int:
        with lock:
            blocks.append((start, stop))
        return stop - start

    assert workers.run(task, 1000, 2, n_blocks) == 1000
    expected = min(1000, max(2, n_blocks))
    assert sorted(blocks) == [(1000 * k // expected, 1000 * (k + 1) // expected) for k in range(expected)]
    assert len(workers._threads) == 1  # the caller and one worker, however many blocks


def test_blocks_run_on_the_workers_as_well_as_the_caller():
    workers = Workers()
    seen: set[str] = set()
    both = threading.Barrier(2, timeout=30)  # each block waits for the other: only two threads at once can pass

    def task(start: int, stop: int) -> int:
        seen.add(threading.current_thread().name)
        both.wait()
        return 0

    workers.run(task, 2, 2)
    assert seen == {threading.current_thread().name, "fastembed-worker-1"}


def _within(seconds: float, action):
    """action()'s result, failing the test (instead of hanging it) if it takes longer than `seconds`."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(action()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return results[0]


def test_a_worker_that_never_comes_leaves_the_caller_to_claim_every_block():
    """A worker descheduled, or sharing the caller's CPU, must not hold the call up: nobody waits for its block."""
    workers = Workers()
    workers.start = lambda n_workers: n_workers  # type: ignore[method-assign] # workers said to exist, none running
    visits = np.zeros(100, np.int64)
    assert _within(30, lambda: workers.run(_counting(visits), 100, 4)) == 100
    assert (visits == 1).all()
    assert workers._regions.qsize() == 3  # handed out, never taken


def _held_worker(fail_in: str = "", pause_s: float = 0.3):
    """A task whose worker block takes `pause_s` and whose caller block ends first, once the worker is inside its
    own; `fail_in` ("worker" or "caller") makes that block raise ValueError. Returns it and the list of the worker
    blocks finished."""
    inside, finished = threading.Event(), []

    def task(start: int, stop: int) -> int:
        if threading.current_thread().name.startswith("fastembed-worker"):
            inside.set()
            time.sleep(pause_s)
            finished.append(start)
            if fail_in == "worker":
                raise ValueError("the worker's block failed")
            return 1
        assert inside.wait(30)  # both blocks are claimed now
        if fail_in == "caller":
            raise ValueError("the caller's block failed")
        return 1

    return task, finished


def test_a_call_returns_only_once_the_workers_block_is_done():
    task, finished = _held_worker()
    assert Workers().run(task, 2, 2) == 2
    assert finished == [1] or finished == [0]


@pytest.mark.parametrize("fail_in", ["worker", "caller"])
def test_an_error_in_either_block_is_raised_once_the_workers_block_is_done(fail_in):
    task, finished = _held_worker(fail_in)
    with pytest.raises(ValueError, match=f"the {fail_in}'s block failed"):
        Workers().run(task, 2, 2)
    assert len(finished) == 1


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
@pytest.mark.parametrize("raised", [KeyboardInterrupt, TimeoutError])
@pytest.mark.parametrize("fail_in", ["", "caller"])
def test_a_signal_handlers_exception_while_the_caller_waits_is_raised_after_the_workers_block(fail_in, raised,
                                                                                            monkeypatch):
    """A Ctrl-C, or a timeout's handler, raises while the caller waits for the worker's block: the call must wait on,
    then raise it, even when its own block had raised."""
    task, finished = _held_worker(fail_in, pause_s=0.5)
    close, landed = cpu_workers._Region.close, []

    def close_then_interrupt(region) -> None:  # the caller's blocks are done; the worker is inside its own
        if not landed:
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            landed.append("armed")
        close(region)

    def interrupt(signum, frame):
        landed.append("while closing" if _inside(frame, "close") else frame.f_code.co_name)
        raise raised

    monkeypatch.setattr(cpu_workers._Region, "close", close_then_interrupt)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(raised):
            Workers().run(task, 2, 2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert landed == ["armed", "while closing"] and len(finished) == 1


def _inside(frame, function: str) -> bool:
    """Whether `frame` or a frame that called it runs cpu_workers' `function`."""
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename == cpu_workers.__file__:
            return True
        frame = frame.f_back
    return False


def test_a_ctrl_c_inside_a_workers_start_leaves_no_running_thread_uncounted(monkeypatch):
    workers = Workers()
    start = threading.Thread.start

    def start_then_interrupt(thread):
        start(thread)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        workers.run(lambda first, stop: 0, 2, 2)
    monkeypatch.undo()
    assert len(workers._threads) == 1 and workers._threads[0].is_alive()
    visits = np.zeros(2, np.int64)
    assert workers.run(_counting(visits), 2, 2) == 2 and (visits == 1).all()
    assert len(workers._threads) == 1


def test_a_region_waiting_for_a_late_worker_keeps_no_array_alive():
    workers = Workers()
    workers.start = lambda n_workers: n_workers  # type: ignore[method-assign]
    table = np.ones(1000)
    gone = weakref.ref(table)
    workers.run(_summing(table), 1000, 2)
    del table
    gc.collect()
    assert gone() is None


def test_the_workers_serve_on_after_a_block_raised():
    workers = Workers()
    for _ in range(3):
        task, _ = _held_worker("worker", pause_s=0.01)
        with pytest.raises(ValueError, match="the worker's block failed"):
            workers.run(task, 2, 2)
    visits = np.zeros(8, np.int64)
    assert workers.run(_counting(visits), 8, 2) == 8 and (visits == 1).all()
    assert len(workers._threads) == 1 and workers._threads[0].is_alive()


def test_no_thread_that_can_start_still_leaves_a_working_region():
    workers = Workers()

    class NoThreads(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    real = threading.Thread
    threading.Thread = NoThreads  # type: ignore[misc]
    try:
        visits = np.zeros(50, np.int64)
        assert workers.run(_counting(visits), 50, 4) == 50
    finally:
        threading.Thread = real  # type: ignore[misc]
    assert (visits == 1).all() and workers._regions.qsize() == 0


def test_an_interrupt_anywhere_leaves_no_worker_inside_a_region():
    """A Ctrl-C at any point of the caller's part: when run() ends, no block is running and none can start, so no
    row is written into an output after its call ended."""
    workers = Workers()
    workers.start(1)
    regions = []
    region_init = cpu_workers._Region.__init__

    def recorded(region, *arguments):
        region_init(region, *arguments)
        regions.append(region)

    ours = {function.__code__ for function in (Workers.run, Workers._hand_out, Workers.start, cpu_workers._Region.claim,
                                              cpu_workers._Region.run_block, cpu_workers._Region.close)}
    started: list[int] = []
    finished: list[int] = []

    def task(start: int, stop: int) -> int:  # a worker's block outlasts the caller's
        started.append(start)
        if threading.current_thread().name.startswith("fastembed-worker"):
            time.sleep(0.005)
        finished.append(start)
        return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_workers._Region, "__init__", recorded)
        runs = 0
        for _ in interrupted_runs(lambda code: code in ours, lambda: workers.run(task, 64, 2)):
            runs += 1
            assert sorted(started) == sorted(finished)  # no block still running once the call has ended
            assert len(started) == len(set(started))  # no block run twice
            assert all(region.closed and region.busy == 0 and region.task is None for region in regions)
            started.clear()
            finished.clear()
    assert runs >= 8
    fresh = np.zeros(64, np.int64)
    assert workers.run(_counting(fresh), 64, 2) == 64 and (fresh == 1).all()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_workers_of_its_own():
    cpu_workers.WORKERS.run(lambda start, stop: 0, 2, 2)  # the parent's workers run
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        seen: set[str] = set()
        both = threading.Barrier(2, timeout=30)

        def task(start: int, stop: int) -> int:
            seen.add(threading.current_thread().name)
            both.wait()
            return 1

        try:
            ok = cpu_workers.WORKERS.run(task, 2, 2) == 2 and len(seen) == 2
        except BaseException:  # noqa: BLE001 - reported as a failure
            ok = False
        os.write(write, b"ok" if ok else b"no")
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 2) == b"ok" and os.waitstatus_to_exitcode(status) == 0
    os.close(read)


def _child_exit_code(pid: int, timeout_s: float = 30) -> int | None:
    """The exit code of the forked child `pid`, or None where it has not ended within `timeout_s` (it is killed)."""
    deadline = time.monotonic() + timeout_s
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.01)
    return os.waitstatus_to_exitcode(ended[1])


class _QuietForkingOnceWaited:
    """A region's `quiet` lock whose caller forks right after its wait ends, as a signal handler run at the next
    bytecode would."""

    def __init__(self, lock, fork, waiting: threading.Event) -> None:
        self._lock, self._fork, self._waiting = lock, fork, waiting

    def acquire(self, *arguments) -> bool:
        self._waiting.set()
        acquired = self._lock.acquire(*arguments)
        self._fork()
        return acquired

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "pthread_kill"), reason="needs fork, pthread_kill")
@pytest.mark.parametrize("fork_while", ["claiming", "waiting", "waited"])
def test_a_fork_on_the_thread_inside_a_region_finishes_the_region_in_the_child(fork_while, monkeypatch):
    """A signal handler or finalizer that forks while its thread runs a region: the child waited for ever for the
    parent's workers, and their blocks were never run there. The caller forks inside its own block ("claiming"),
    from a signal handler while it waits for the worker's ("waiting"), or just as that wait ends ("waited")."""
    workers = cpu_workers.WORKERS  # the one a fork resets
    caller = threading.get_ident()
    worker_inside, forked, caller_waiting = threading.Event(), threading.Event(), threading.Event()
    visits = np.zeros(2, np.int64)
    pids: list[int] = []

    def fork() -> None:
        if not pids and threading.get_ident() == caller:
            pids.append(os.fork())
            if pids[0]:
                forked.set()

    def task(start: int, stop: int) -> int:
        if threading.get_ident() != caller:  # the parent's worker: inside its block at the fork, but when "waited"
            worker_inside.set()
            (caller_waiting if fork_while == "waited" else forked).wait(30)
        else:
            assert worker_inside.wait(30)  # both blocks are claimed now
            if fork_while == "claiming":
                fork()
        visits[start:stop] += 1
        return stop - start

    landed: list[bool] = []
    timers: list[threading.Timer] = []
    if fork_while == "waiting":
        close = cpu_workers._Region.close

        def close_with_a_signal(region) -> None:  # the caller's block is done; the worker is inside its own
            timer = threading.Timer(0.05, signal.pthread_kill, (caller, signal.SIGALRM))
            timers.append(timer)
            timer.start()
            close(region)

        def fork_in_handler(signum, frame) -> None:
            landed.append(_inside(frame, "close"))
            fork()

        monkeypatch.setattr(cpu_workers._Region, "close", close_with_a_signal)
        previous = signal.signal(signal.SIGALRM, fork_in_handler)
    if fork_while == "waited":
        region_init = cpu_workers._Region.__init__

        def forking_once_waited(region, *arguments) -> None:
            region_init(region, *arguments)
            region.quiet = _QuietForkingOnceWaited(region.quiet, fork, caller_waiting)

        monkeypatch.setattr(cpu_workers._Region, "__init__", forking_once_waited)
    try:
        total = workers.run(task, 2, 2)
    except BaseException:
        if pids and pids[0] == 0:  # pragma: no cover - the child must not go on with the parent's tests
            os._exit(2)
        raise
    finally:
        if fork_while == "waiting":
            for timer in timers:
                timer.join()  # before the handler goes: a later signal would end the process
            signal.signal(signal.SIGALRM, previous)
    if pids[0] == 0:  # pragma: no cover - the child reports by its exit status
        os._exit(0 if total == 2 and (visits == 1).all() else 1)
    exit_code = _child_exit_code(pids[0])
    assert exit_code is not None, "the child hung in the region"
    assert exit_code != 2, "the region raised in the child"
    assert exit_code == 0, "the child's region left a block unrun"
    assert total == 2 and (visits == 1).all()
    assert landed == ([True] if fork_while == "waiting" else [])


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "pthread_kill"), reason="needs fork, pthread_kill")
def test_a_fork_while_the_caller_waits_for_the_region_lock_a_worker_holds_leaves_the_child_able_to_take_it(monkeypatch):
    """The child's copy of the lock stayed held by the worker it lacks, and the caller waited on it for ever."""
    caller = threading.get_ident()
    regions: list = []
    region_init = cpu_workers._Region.__init__
    monkeypatch.setattr(cpu_workers._Region, "__init__",
                        lambda region, *arguments: (region_init(region, *arguments), regions.append(region))[0])
    worker_has_lock = threading.Event()
    pids: list[int] = []
    timers: list[threading.Timer] = []

    def task(start: int, stop: int) -> int:
        if threading.get_ident() != caller:
            with regions[0].lock:  # as a worker holding it when the GIL went to the caller
                worker_has_lock.set()
                time.sleep(0.5)
        elif not pids:  # the caller's first block: the signal lands while it waits for that lock to claim the next
            assert worker_has_lock.wait(30)
            timer = threading.Timer(0.1, signal.pthread_kill, (caller, signal.SIGALRM))
            timers.append(timer)
            timer.start()
        return stop - start

    previous = signal.signal(signal.SIGALRM, lambda *_: pids.append(os.fork()) if not pids else None)
    try:
        total = cpu_workers.WORKERS.run(task, 3, 2, 3)
    except BaseException:
        if pids and pids[0] == 0:  # pragma: no cover - the child must not go on with the parent's tests
            os._exit(2)
        raise
    finally:
        for timer in timers:
            timer.join()  # before the handler goes: a later signal would end the process
        signal.signal(signal.SIGALRM, previous)
    if pids[0] == 0:  # pragma: no cover - the child reports by its exit status
        os._exit(0 if total == 3 else 1)
    exit_code = _child_exit_code(pids[0])
    assert exit_code is not None, "the child hung on the region's lock"
    assert exit_code == 0 and total == 3


def test_a_parallel_lookup_in_a_finalizer_at_interpreter_exit_is_served_and_the_process_exits():
    """The final garbage collection ran a __del__ whose lookup asked for workers; the old ones read as dead by then,
    and Python 3.11's Thread.start() blocks for good at exit (3.12 raises): the process never ended."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import numpy as np, fastembed
        table = np.random.default_rng(0).standard_normal((20000, 256)).astype(np.float32)
        ids = np.arange(30000) % 20000  # a 30 MiB output: the parallel gather
        fastembed.lookup(table, ids, backend="numba")
        fastembed.wait_for_compiles()

        class Holder:
            def __init__(self):
                self.me = self  # a cycle: only the final collection frees it
            def __del__(self):
                print("served", bool((fastembed.lookup(table, ids, backend="numba") == table[ids]).all()), flush=True)

        Holder()
    """)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as error:  # the exit hang: a generous bound, tens of times a normal run
        raise AssertionError(f"the process did not exit: {error.stdout!r}") from None
    assert done.returncode == 0 and done.stdout.strip() == "served True", done.stdout + done.stderr


_NEEDS_THREAD_AFFINITY_AND_TWO_CPUS = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a system that sets a thread's CPUs (Linux) and two CPUs or more")


def _in_a_thread_pinned_to_one_cpu(body):
    """Run `body` on a new thread pinned to the lowest of the main thread's CPUs; return what it returns."""
    result = []

    def pinned():
        os.sched_setaffinity(0, {min(os.sched_getaffinity(os.getpid()))})
        result.append(body())

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    return result[0]


@_NEEDS_THREAD_AFFINITY_AND_TWO_CPUS
def test_adding_the_main_threads_cpus_widens_a_pinned_thread():
    main_cpus = os.sched_getaffinity(0)

    def add():
        before = os.sched_getaffinity(0)
        cpu_workers.add_the_main_threads_cpus()
        return before, os.sched_getaffinity(0)

    assert _in_a_thread_pinned_to_one_cpu(add) == ({min(main_cpus)}, main_cpus)


@_NEEDS_THREAD_AFFINITY_AND_TWO_CPUS
def test_the_main_threads_cpus_are_added_for_a_while_and_the_threads_own_given_back():
    main_cpus = os.sched_getaffinity(0)

    def borrow():
        with cpu_workers.main_threads_cpus_added():
            inside = os.sched_getaffinity(0)
        return inside, os.sched_getaffinity(0)

    assert _in_a_thread_pinned_to_one_cpu(borrow) == (main_cpus, {min(main_cpus)})


_PINNED_SCRIPT = """
import os, sys, threading
import numpy as np
import fastembed
from fastembed.backends import numba_backend
from fastembed.backends.cpu_workers import WORKERS
os.environ.pop("NUMBA_NUM_THREADS", None)
table = np.random.default_rng(0).standard_normal((3000, 4096), dtype=np.float32).astype(np.float16)
ids = np.random.default_rng(1).integers(0, 3000, 4096)
process_cpus = os.sched_getaffinity(0)
one_cpu = {min(process_cpus)}
def first_calls():
    if sys.argv[1] == "describe":
        assert numba_backend.BACKEND.describe()["threads"] == len(process_cpus)
    fastembed.lookup(table, ids)
    fastembed.wait_for_compiles()
    assert np.array_equal(fastembed.lookup(table, ids), table[ids])
    return numba_backend.thread_count()
def on_another_thread(pin_it):
    counts = []
    def run():
        os.sched_setaffinity(0, one_cpu if pin_it else process_cpus)
        counts.append(first_calls())
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return counts[0]
if sys.argv[1] == "main-pinned":
    os.sched_setaffinity(0, one_cpu)
    count = on_another_thread(pin_it=False)
else:
    count = on_another_thread(pin_it=True)
assert np.array_equal(fastembed.lookup(table, ids), table[ids])
assert count == numba_backend.thread_count() == len(process_cpus), (count, numba_backend.thread_count(), process_cpus)
workers = [os.sched_getaffinity(worker.native_id) for worker in WORKERS._threads]
assert workers and all(cpus == process_cpus for cpus in workers), (workers, process_cpus)
print("ok")
"""


@_NEEDS_THREAD_AFFINITY_AND_TWO_CPUS
@pytest.mark.parametrize("first", ["lookup", "describe", "main-pinned"])
def test_a_pinned_thread_leaves_the_thread_count_and_the_workers_cpus_to_the_process(tmp_path, first):
    """numba counts its default threads from the CPUs of the thread importing it, and a worker inherits its
    starter's: the first lookup (or report) from a pinned thread, or lookups beside a pinned main thread,
    still count and run on every CPU of the process."""
    script = tmp_path / "script.py"
    script.write_text(_PINNED_SCRIPT)
    result = subprocess.run([sys.executable, str(script), first], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
