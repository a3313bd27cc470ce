"""fastembed's own CPU worker threads: parallel regions for kernels that release the GIL.

The parallel gathers cut their rows into blocks and run a serial, nogil
kernel on each block, on the calling thread and on these workers. They are
plain Python threads, not numba's threading layer: that layer runs on an
OpenMP runtime, which may be another library's (torch puts its GNU OpenMP
in the process's global symbol scope, and numba's layer then uses it) with
workers that spin for milliseconds after each region and hold off the
caller sharing their CPU; and an OpenMP pool cannot run in a forked child.

How a region runs (:meth:`Workers.run`):

- the rows are cut into contiguous blocks, one per thread or as many more
  as the caller asks for, and the caller and the workers *claim* blocks
  one at a time; the caller claims too, so a worker that wakes late
  (descheduled, or sharing the caller's CPU) finds its block done by the
  others and nobody waits for it, and a thread that runs slower than the
  others claims fewer blocks;
- idle workers sleep on a lock: no spinning, no setting shared with other
  libraries;
- the call returns (or raises) once every block it handed out is done, and
  no worker can start one afterwards, whatever happens meanwhile: an
  exception a signal handler raises on the calling thread (Ctrl-C's
  KeyboardInterrupt, a timeout's) is held back until the workers are out
  of the region, so no row is written into an output after its call has
  ended (unless a second one lands in the few instructions between the
  wait's retries, docs/backends.md);
- regions from several threads at once queue up for the workers, first in,
  first out; each caller claims blocks of its own region meanwhile;
- a worker, when it starts, adds the CPUs of the process's main thread
  (what ``taskset`` sets for a process) to those it inherited from the
  thread that started it: on Linux a new thread inherits its starter's
  only, and a lookup from a thread the application pinned to one CPU
  would pin the workers with it;
- a forked child starts workers of its own on its first region (a fork
  copies none of the parent's threads); a region whose caller forked (in
  a signal handler, or a finalizer run on its thread) goes on in the
  child, where the caller runs the blocks the parent's workers had claimed.

Example:
    >>> import numpy as np
    >>> from fastembed.backends.cpu_workers import WORKERS
    >>> out = np.zeros(10, np.int64)
    >>> def fill(start, stop):
    ...     out[start:stop] = np.arange(start, stop)
    ...     return stop - start
    >>> WORKERS.run(fill, 10, 3)
    10
    >>> out.tolist()
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
"""
from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: A block's task: ``task(start, stop)`` processes rows [start, stop) and returns a count the region sums.
Task = Callable[[int, int], int]


def _affinity_calls() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The system's calls that read and set a thread's CPUs (Linux); None where there are none."""
    get, set_ = getattr(os, "sched_getaffinity", None), getattr(os, "sched_setaffinity", None)
    return None if get is None or set_ is None else (get, set_)


def add_the_main_threads_cpus() -> frozenset[int] | None:
    """Let the calling thread run on the CPUs of the process's main thread as well as on its own.

    For fastembed's own threads, the workers: a new thread inherits the CPUs of the thread that
    started it, which may be one the application pinned. A mask the system refuses (a CPU set
    changed meanwhile) leaves the thread's own as it is.

    Returns:
        The thread's CPUs before, where they changed; None where they did not.
    """
    calls = _affinity_calls()
    if calls is None:
        return None
    get, set_ = calls
    try:
        own = frozenset(get(0))
        wider = own | get(os.getpid())  # on Linux the main thread's id is the process's
        if wider == own:
            return None
        set_(0, wider)
    except OSError:
        return None
    return own


@contextlib.contextmanager
def main_threads_cpus_added() -> Iterator[None]:
    """Run the body with the calling thread on the main thread's CPUs as well as its own, then on its own again.

    numba counts its default threads from the CPUs of the thread that imports it: fastembed imports it
    under this, so a first lookup from a thread the application pinned does not set the count for the process.
    """
    before = add_the_main_threads_cpus()
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, before)


class _Region:
    """One call of :meth:`Workers.run`: its task, the blocks not yet claimed, and who is still inside.

    Workers enter and leave under ``lock``; the caller never waits on it
    while a worker runs a block, so the caller's wait is on ``quiet`` alone.
    Each block's claimer is recorded, and the block marked done after its
    task returns: a forked child, whose workers are gone, runs again the
    blocks they had claimed and not finished (:meth:`after_fork_in_child`).
    """

    def __init__(self, task: Task, n_rows: int, n_blocks: int) -> None:
        self.task: Task | None = task  # dropped when the region closes: a region still queued keeps no array alive
        self.n_rows, self.n_blocks = n_rows, n_blocks
        self.next_block = 0
        self.lock = threading.Lock()
        self.closed = False
        self.busy = 0  # workers inside the region
        self.quiet = threading.Lock()  # released by the last worker to leave a closed region
        self.quiet.acquire()
        self.counts = [0] * n_blocks
        self.by_worker = bytearray(n_blocks)  # 1 where a worker claimed the block (0: the caller, or unclaimed)
        self.done = bytearray(n_blocks)
        self.orphans: list[int] = []  # blocks a fork took the workers of, for the caller to run in the child
        self.errors: list[BaseException] = []

    def claim(self, by_worker: bool = False) -> int | None:
        """The next unclaimed block, or None when every block is claimed."""
        with self.lock:
            block = self.next_block
            if block >= self.n_blocks:
                return None
            self.by_worker[block] = by_worker
            self.next_block = block + 1  # the last step: a fork before it leaves the block unclaimed in the child
        return block

    def run_block(self, task: Task, block: int) -> None:
        """Run `task` on the rows of `block` and record its count."""
        self.counts[block] = task(block * self.n_rows // self.n_blocks, (block + 1) * self.n_rows // self.n_blocks)
        self.done[block] = 1

    def serve(self) -> None:
        """A worker's part: claim and run blocks until none is left (a closed region is left at once)."""
        with self.lock:
            if self.closed:
                return
            self.busy += 1
            task = self.task
        try:
            while task is not None and (block := self.claim(by_worker=True)) is not None:
                self.run_block(task, block)
        except BaseException as error:  # noqa: BLE001 - handed to the caller, which raises it
            self.errors.append(error)
        finally:
            with self.lock:
                self.busy -= 1
                if self.closed and self.busy == 0:
                    self.quiet.release()

    def close(self) -> None:
        """Claim what is left, so that no worker starts a block, then wait for those inside. Safe to repeat."""
        # Read before the region's lock: the caller calls nothing while it holds that lock, so no signal handler
        # (which may fork) runs on the caller's thread then.
        waited_before = self.quiet.locked()
        with self.lock:
            self.next_block = self.n_blocks
            if not self.closed:
                self.closed = True
                inside = self.busy
            else:
                inside = 1 if waited_before and self.busy else 0
        if inside:
            self.quiet.acquire()
            if self.quiet.locked():  # a fork's child may have released it meanwhile (after_fork_in_child)
                self.quiet.release()  # a repeated close() after an interrupted one finds it free
        task = self.task
        while task is not None and self.orphans:
            block = self.orphans.pop()
            try:
                self.run_block(task, block)
            except Exception as error:  # noqa: BLE001 - as a worker's error: run() raises it once the region is closed
                self.errors.append(error)
        self.task = None

    def after_fork_in_child(self) -> None:
        """In a forked child, where no worker is: the blocks they had claimed and not finished go to the caller."""
        if self.lock.locked():  # held by a worker, which the child lacks (the caller calls nothing while holding it)
            self.lock.release()
        self.busy = 0
        self.orphans = [block for block in range(self.next_block) if self.by_worker[block] and not self.done[block]]
        if self.closed and self.quiet.locked():
            self.quiet.release()  # the caller waits on it in close(), which then runs the orphans


class Workers:
    """Worker threads that serve :meth:`run`, started on first use (again in a forked child)."""

    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        self._regions: queue.SimpleQueue[_Region] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        self._running: set[_Region] = set()  # the regions whose run() has not ended, on any thread

    def run(self, task: Task, n_rows: int, n_threads: int, n_blocks: int = 1) -> int:
        """Run ``task(start, stop)`` over [0, n_rows) cut into blocks; sum its returns.

        Args:
            task: processes rows [start, stop) and returns a count; it must
                release the GIL for the blocks to run at once (a nogil numba
                kernel does); blocks never overlap.
            n_rows: rows in all.
            n_threads: threads to share the rows, the calling thread
                included; 1 runs ``task(0, n_rows)`` here.
            n_blocks: blocks to cut the rows into, when more than
                `n_threads` (at most `n_rows`); else one per thread.
                Ignored where one thread runs the whole task.

        Returns:
            The sum of the blocks' counts.

        Raises:
            BaseException: what a signal handler raised while the call
                waited for the workers (KeyboardInterrupt, say), once every
                block handed out is done.
            Exception: what the calling thread's own block raised, else
                the first a worker's block raised, once every block handed
                out is done.
        """
        n_threads = max(1, min(n_rows, n_threads))
        if n_threads == 1:
            return task(0, n_rows)
        region = _Region(task, n_rows, min(n_rows, max(n_threads, n_blocks)))
        held_back: BaseException | None = None
        try:
            self._running.add(region)
            self._hand_out(region, n_threads - 1)
            while (block := region.claim()) is not None:
                region.run_block(task, block)
        finally:
            while True:  # no row may be written after this call ends, whatever a signal handler raises meanwhile
                try:
                    region.close()
                    break
                except BaseException as caught:  # noqa: BLE001 - raised below, once the workers are out
                    held_back = held_back or caught
            self._running.discard(region)
            if held_back is not None:  # raised even where the caller's own block raised: it is never lost
                raise held_back
        errors, region.errors = region.errors, []  # a region still queued keeps no traceback (and its frames) alive
        if errors:
            raise errors[0]
        return sum(region.counts)

    def _hand_out(self, region: _Region, n_workers: int) -> None:
        for _ in range(min(n_workers, self.start(n_workers))):
            self._regions.put(region)

    def start(self, n_workers: int) -> int:
        """Start workers until `n_workers` are alive.

        Args:
            n_workers: the workers wanted, the calling thread not counted.

        Returns:
            The workers there are: fewer where no thread can start (at
            interpreter exit, or at the process's thread limit); the
            calling thread then claims their blocks.
        """
        threads = self._threads
        if len(threads) >= n_workers and all(thread.is_alive() for thread in threads):
            return len(threads)
        if sys.is_finalizing():  # Python 3.11 and before block for good in Thread.start() at exit (a __del__'s lookup)
            return 0
        with self._start_lock:
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            while len(self._threads) < n_workers:
                thread = threading.Thread(target=self._serve, args=(self._regions,), daemon=True,
                                          name=f"fastembed-worker-{len(self._threads) + 1}")
                self._threads.append(thread)  # before start(): a Ctrl-C inside it leaves no running thread uncounted
                try:
                    thread.start()
                except RuntimeError:  # "can't start new thread", or "... at interpreter shutdown"
                    self._threads.remove(thread)
                    break
        return len(self._threads)

    @staticmethod
    def _serve(regions: queue.SimpleQueue[_Region]) -> None:
        add_the_main_threads_cpus()
        while True:
            regions.get().serve()

    def after_fork_in_child(self) -> None:
        """Forget the parent's threads and queue: the child has neither; its first region starts new ones.

        A region under way on the thread that forked goes on in the child
        without workers: its caller runs the blocks they had claimed.
        """
        running = self._running
        self._forget()
        for region in running:
            region.after_fork_in_child()


WORKERS = Workers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WORKERS.after_fork_in_child)
