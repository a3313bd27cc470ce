"""Compile kernels on a background thread while calls are served another way.

Numba compiles a parallel kernel in 1-2 s on the development machine; a
serial kernel in a fraction of that. The numba backend therefore
serves a batch whose parallel kernel is not compiled yet with the serial
kernel, and compiles the parallel one here, once per key, off the caller's
thread. Later calls find the key ready and run in parallel.

Fork-safety: numba compiles under one process-wide lock. A process forked
while a compile thread holds it would inherit the lock held by a thread that
does not exist in the child, and its first compile would hang. So a fork
first waits for every compile started here to finish.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Hashable

_guard = threading.Lock()
_started: set[Hashable] = set()
_ready: set[Hashable] = set()
_threads: list[threading.Thread] = []


def is_ready(key: Hashable) -> bool:
    """Whether the compile started for `key` has finished (successfully or not)."""
    return key in _ready


def start(key: Hashable, first_call: Callable[[], Any]) -> None:
    """Run `first_call` (a call that makes numba compile) on a new thread, once per key."""
    with _guard:
        if key in _started:
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


def wait() -> None:
    """Block until every compile started so far has finished (benchmarks, tests, fork)."""
    with _guard:
        threads = list(_threads)
    for thread in threads:
        thread.join()
    with _guard:
        _threads[:] = [thread for thread in _threads if thread.is_alive()]


def forget() -> None:
    """Wait for running compiles, then forget every key (tests)."""
    wait()
    with _guard:
        _started.clear()
        _ready.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=wait)
