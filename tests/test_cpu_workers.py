"""fastembed's own CPU worker threads: every row once, no waiting on a late worker, errors, interrupts, fork."""
from __future__ import annotations

import gc
import os
import threading
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


def test_a_worker_that_never_comes_leaves_the_caller_to_claim_every_block():
    """A worker descheduled, or sharing the caller's CPU, must not hold the call up: nobody waits for its block."""
    workers = Workers()
    workers.start = lambda n_workers: n_workers  # type: ignore[method-assign] # workers said to exist, none running
    visits = np.zeros(100, np.int64)
    assert workers.run(_counting(visits), 100, 4) == 100
    assert (visits == 1).all()
    assert workers._regions.qsize() == 3  # handed out, never taken


def test_a_region_waiting_for_a_late_worker_keeps_no_array_alive():
    workers = Workers()
    workers.start = lambda n_workers: n_workers  # type: ignore[method-assign]
    table = np.ones(1000)
    gone = weakref.ref(table)
    workers.run(_summing(table), 1000, 2)
    del table
    gc.collect()
    assert gone() is None


def test_a_workers_error_reaches_the_caller_after_every_block_handed_out_is_done():
    workers = Workers()
    done: list[int] = []

    def task(start: int, stop: int) -> int:
        if threading.current_thread().name.startswith("fastembed-worker"):
            raise ValueError("a block failed")
        done.append(start)
        return 0

    for _ in range(20):
        try:
            workers.run(task, 8, 2)
        except ValueError as error:
            assert str(error) == "a block failed"
    # the workers are still there and serve the next region
    visits = np.zeros(8, np.int64)
    assert workers.run(_counting(visits), 8, 2) == 8 and (visits == 1).all()


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
                                              cpu_workers._Region.close)}
    visits = np.zeros(64, np.int64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_workers._Region, "__init__", recorded)
        runs = 0
        for _ in interrupted_runs(lambda code: code in ours, lambda: workers.run(_counting(visits), 64, 2)):
            runs += 1
            assert all(region.closed and region.busy == 0 and region.task is None for region in regions)
    assert runs >= 8
    assert (visits <= runs + 1).all()  # every row visited at most once per run
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
