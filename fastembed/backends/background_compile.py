"""Compile kernels on a background thread while calls are served another way.

A compile takes long enough to stall a caller, so the numba backend serves
a call whose kernels are not compiled yet with the numpy backend and
compiles them here, once per key, off the caller's thread; later calls
find them compiled.

Fork-safety: numba compiles under one process-wide lock, and Python imports
under per-module locks. A process forked while another thread holds one
would inherit it held by a thread that does not exist in the child, and the
child's first lookup would hang. So a fork first waits for every compile
started here to finish, and for every :func:`foreground` section (the
kernel import, a first call that compiles on the caller's thread) that
another thread is in. A compile lasts seconds at most, so a fork is delayed
by that at most; a fork from inside such a section does not wait for itself.

Interpreter exit: once it has begun, no compile starts (the key's calls stay
served another way): a thread started then, from an ``atexit`` handler say,
would outlive the join of threads that exit performs, and exit could hang on
numba inside LLVM.
"""
from __future__ import annotations

import contextlib
import logging  # noqa: F401 - imported here so that its fork hooks are never registered mid-fork (numba imports it)
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

_guard = threading.Lock()
_started: set[Hashable] = set()
_ready: set[Hashable] = set()
_threads: list[threading.Thread] = []
_foreground_done = threading.Condition(threading.Lock())
_foreground_threads: dict[int, int] = {}  # thread ident -> nesting depth
_held_for_fork: dict[int, list[Any]] = {}  # forking thread -> the locks its _wait_before_fork took
_exiting = False


@contextlib.contextmanager
def foreground() -> Iterator[None]:
    """Mark a section where this thread may import numba or compile: a fork waits until it ends."""
    ident = threading.get_ident()
    with _foreground_done:
        _foreground_threads[ident] = _foreground_threads.get(ident, 0) + 1
    try:
        yield
    finally:
        with _foreground_done:
            depth = _foreground_threads.pop(ident) - 1
            if depth:
                _foreground_threads[ident] = depth
            else:
                _foreground_done.notify_all()


def is_ready(key: Hashable) -> bool:
    """Whether the compile started for `key` has finished (successfully or not)."""
    return key in _ready


def start(key: Hashable, first_call: Callable[[], Any]) -> None:
    """Run `first_call` (a call that makes numba compile) on a new thread, once per key."""
    with _guard:
        if key in _started or _exiting:
            return
        _started.add(key)
        # Not a daemon: a daemon thread killed inside LLVM at interpreter exit can crash it.
        thread = threading.Thread(target=_compile, args=(key, first_call), name="fastembed-compile")
        _threads.append(thread)
        thread.start()


def _compile(key: Hashable, first_call: Callable[[], Any]) -> None:
    try:
        first_call()
    except Exception:  # noqa: BLE001 - the foreground call then compiles again and raises to its caller
        pass
    finally:
        _ready.add(key)


def wait(timeout: float | None = None) -> bool:
    """Block until every compile started so far has finished, or `timeout` seconds have passed; True if all finished."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _guard:
        threads = list(_threads)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    with _guard:
        _threads[:] = [thread for thread in _threads if thread.is_alive()]
        return not any(thread is not threading.current_thread() for thread in _threads)


def _wait_before_fork() -> None:
    """Hold off new compiles and foreground sections, then wait for the running ones; released after the fork.

    Python ignores an exception here (an interrupt during a join) and forks
    anyway: only the locks actually taken are released afterwards.
    """
    ident = threading.get_ident()
    held = _held_for_fork.setdefault(ident, [])
    _guard.acquire()  # a thread inside start() holds it while its compile thread starts
    held.append(_guard)
    for thread in list(_threads):
        if thread is not threading.current_thread():
            thread.join()
    _threads[:] = [thread for thread in _threads if thread.is_alive()]
    _foreground_done.acquire()
    held.append(_foreground_done)
    _foreground_done.wait_for(lambda: not (set(_foreground_threads) - {ident}))


def _after_fork() -> None:
    for lock in reversed(_held_for_fork.pop(threading.get_ident(), [])):
        lock.release()


def _stop_new_compiles() -> None:
    """Called when interpreter exit begins, before it joins the running threads."""
    global _exiting
    with _guard:
        _exiting = True


def forget() -> None:
    """Wait for running compiles, then forget every key (tests)."""
    wait()
    with _guard:
        _started.clear()
        _ready.clear()


# The hook that concurrent.futures uses to act before exit joins threads; atexit handlers run after that join.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_stop_new_compiles)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_wait_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)
