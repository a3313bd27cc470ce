"""Compile kernels on a background thread while calls are served another way.

A compile takes long enough to stall a caller, so the numba backend serves
a call whose kernels are not compiled yet with the numpy backend and
compiles them here, once per key, off the caller's thread; later calls
find them compiled.

Compiles run one at a time (numba's own lock would serialise them anyway),
each on its own thread.

Fork-safety: numba compiles under one process-wide lock, and Python imports
under per-module locks. A process forked while another thread holds one
would inherit it held by a thread that does not exist in the child, and the
child's first lookup would hang. So a fork first waits for every compile
started here to finish, and for every :func:`foreground` section (the
kernel import, a first call that compiles on the caller's thread) that
another thread is in. A compile lasts seconds, so a fork is delayed by
that; a fork from inside such a section does not wait for itself. A
compile (or a section) that makes the fork wait :data:`FORK_WAIT_S` by
itself (it cannot finish: an import lock that an interrupted import
elsewhere left held, say) is waited for no longer, by this fork or any
later one: the process forks, and the child never compiles.
A Ctrl-C meanwhile does not cut the wait short: it is raised again in the
parent once the fork is done. Should another exception from a signal
handler end the wait (Python forks anyway), the child never compiles: its
calls stay served another way. A lookup made by a signal handler of the
forking thread while it waits starts no compile.

Interpreter exit: while it joins the non-daemon threads that outlive the
main thread (a server's), their lookups compile as before: the join waits
for compile threads started meanwhile too. Once it has joined them, no
compile starts (the key's calls stay served another way: lookups in
``atexit`` handlers, in daemon threads, in the final garbage collection)
and none of those waiting for their turn runs: a thread started then would
outlive that join, and exit could hang on numba inside LLVM.
"""
from __future__ import annotations

import atexit
import contextlib
import logging  # noqa: F401 - imported here so that its fork hooks are never registered mid-fork (numba imports it)
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from . import interrupts

# Re-entrant, for _is_owned(): a fork hook must release what it took, and an exception (Ctrl-C) just after an
# acquire() returns would keep a record of it from being made.
_guard = threading.RLock()
_started: dict[Hashable, threading.Thread] = {}  # the thread made for each key
_ready: set[Hashable] = set()
_threads: list[threading.Thread] = []
_foreground_lock = threading.RLock()  # taken by with statements (the condition's own __exit__ is Python code)
_foreground_done = threading.Condition(_foreground_lock)
# Thread ident -> one token per foreground section it is in. A section adds and removes its own token, each in one
# call, so an exception (Ctrl-C) at any point of foreground() leaves no section marked open that is not.
_foreground_threads: dict[int, list[object]] = {}
_held_for_fork: dict[int, list[Any]] = {}  # forking thread -> the locks its _wait_before_fork took
_ctrl_c_held: set[int] = set()  # forking threads whose wait held back a KeyboardInterrupt
_one_at_a_time = threading.Lock()  # held by the compile under way
_exiting = False
_forking_threads: set[int] = set()  # the threads inside _wait_before_fork, up to their fork
_waiting_to_fork: set[int] = set()  # threads whose wait before a fork has not reached its end (yet, or ever)
_no_compiles = False  # in a child forked after such a wait: numba's locks may be held by a thread it lacks
# What a fork waited FORK_WAIT_S for, which no later fork waits for: compile threads, and sections (their tokens).
_given_up: set[threading.Thread] = set()
_given_up_sections: set[object] = set()  # their tokens (held here, no other object can take a token's identity)
#: Seconds a fork waits for one compile (compiles run one after another), and for the foreground sections, at most.
FORK_WAIT_S = 60.0


@contextlib.contextmanager
def foreground() -> Iterator[None]:
    """Mark a section where this thread may import numba or compile: a fork waits until it ends."""
    ident, token = threading.get_ident(), object()
    try:
        _foreground_threads.setdefault(ident, []).append(token)
        yield
    finally:
        try:
            _foreground_threads[ident].remove(token)  # one call: no signal handler runs before it
        except (KeyError, ValueError):
            pass  # an exception came before the token was added
        with _foreground_lock:
            _foreground_done.notify_all()  # a fork waits on it (checking every tenth of a second: this may not run)


def is_ready(key: Hashable) -> bool:
    """Whether the compile started for `key` has finished (successfully or not)."""
    return key in _ready


def start(key: Hashable, first_call: Callable[[], Any]) -> None:
    """Run `first_call` (a call that makes numba compile) on a new thread, once per key."""
    if threading.get_ident() in _forking_threads or _no_compiles:
        return  # a signal handler of the thread waiting before a fork holds _guard; or a child that must not compile
    with _guard:
        earlier = _started.get(key)
        # A thread whose start() an exception (Ctrl-C) cut short never ran and never will: this call replaces it.
        if (earlier is not None and (earlier.is_alive() or key in _ready)) or _exiting:
            return
        # Not a daemon: a daemon thread killed inside LLVM at interpreter exit can crash it.
        thread = threading.Thread(target=_compile, args=(key, first_call), name="fastembed-compile")
        _started[key] = thread
        _threads.append(thread)
        try:
            thread.start()
        except RuntimeError as error:
            # threading's own locks are not safe against a Ctrl-C: one that cuts start() short can surface as
            # "release unlocked lock"; the caller gets the Ctrl-C.
            if isinstance(error.__context__, KeyboardInterrupt):
                raise error.__context__ from None
            # No thread to be had (Python 3.12.0-3.12.2 start none while exit joins threads; none left): the key's
            # calls stay served another way, and a later call tries again.


def _compile(key: Hashable, first_call: Callable[[], Any]) -> None:
    try:
        with _one_at_a_time:
            if not _exiting:
                first_call()
    except Exception:  # noqa: BLE001 - the foreground call then compiles again and raises to its caller
        pass
    finally:
        _ready.add(key)


def wait(timeout: float | None = None) -> bool:
    """Block until every compile started so far has finished, or `timeout` seconds have passed; True if all finished."""
    if timeout is not None and timeout > threading.TIMEOUT_MAX:
        timeout = None  # a join cannot wait longer, and would raise OverflowError
    if threading.get_ident() in _forking_threads:
        return False  # a signal handler of the thread waiting before a fork: that wait holds _guard
    deadline = None if timeout is None else time.monotonic() + timeout
    with _guard:
        threads = list(_threads)
    for thread in threads:
        _join(thread, deadline)
    with _guard:
        _drop_ended_threads()
        return not any(thread is not threading.current_thread() for thread in _threads)


def _wait_before_fork() -> None:
    """Hold off new compiles and foreground sections, then wait for the running ones; released after the fork.

    A KeyboardInterrupt meanwhile is held back until the fork is done (see
    :func:`_after_fork_in_parent`). Python ignores any other exception here
    and forks anyway: only the locks actually taken are released afterwards,
    and the child is told not to compile.
    """
    ident = threading.get_ident()
    _forking_threads.add(ident)
    _waiting_to_fork.add(ident)
    held = _held_for_fork.setdefault(ident, [])
    held.append(_guard)  # recorded first: only the locks this thread owns are released after the fork
    # Held by a thread inside start() while its compile thread starts, or by another thread's wait before a fork.
    interrupted = _acquire_uninterrupted(_guard)
    interrupted |= _uninterrupted(lambda: _forget_ended(ident))
    interrupted |= _uninterrupted(_join_compiles)
    interrupted |= _uninterrupted(_drop_ended_threads)
    held.append(_foreground_lock)
    interrupted |= _acquire_uninterrupted(_foreground_lock)
    deadline = time.monotonic() + FORK_WAIT_S
    interrupted |= _uninterrupted(lambda: _wait_for_foreground_sections(ident, deadline))
    if _in_foreground_sections(ident):
        _given_up_sections.update(_open_sections(but=ident))
    if interrupted:
        _ctrl_c_held.add(ident)
    if not _threads_still_running(ident):
        _waiting_to_fork.discard(ident)  # else the child is told not to compile


def _forget_ended(ident: int) -> None:
    """Drop from what earlier forks gave up on the compile threads that have ended and the sections now closed."""
    _given_up.difference_update([thread for thread in list(_given_up) if not thread.is_alive()])
    _given_up_sections.intersection_update(_open_sections(but=ident))


def _drop_ended_threads() -> None:
    _threads[:] = [thread for thread in _threads if thread.is_alive()]


def _wait_for_foreground_sections(but: int, deadline: float) -> None:
    """Wait (holding the condition's lock) until no thread other than `but` is in a foreground section, or `deadline`."""
    while _in_foreground_sections(but) and time.monotonic() < deadline:
        _foreground_done.wait(0.1)


def _in_foreground_sections(but: int) -> bool:
    """Whether a thread other than `but` is in a foreground section that no fork gave up on."""
    return not _given_up_sections.issuperset(_open_sections(but))


def _open_sections(but: int) -> set[object]:
    """The token of each foreground section a thread other than `but` is in."""
    return {token for ident, tokens in list(_foreground_threads.items()) if ident != but for token in list(tokens)}


def _threads_still_running(but: int) -> bool:
    """Whether a compile, or a foreground section of a thread other than `but`, is still under way (a fork's wait
    for them given up included)."""
    return any(thread.is_alive() and thread is not threading.current_thread() for thread in _threads) or any(
        tokens for ident, tokens in list(_foreground_threads.items()) if ident != but)


def _join_compiles() -> None:
    """Join each compile thread for FORK_WAIT_S at most, from when the wait for it begins (they run one at a time),
    but those an earlier wait gave up on."""
    for thread in list(_threads):
        if thread not in _given_up:
            _join(thread, time.monotonic() + FORK_WAIT_S)
            if thread.is_alive() and thread is not threading.current_thread():
                _given_up.add(thread)
                _given_up_sections.update(list(_foreground_threads.get(thread.ident or 0, [])))


def _join(thread: threading.Thread, deadline: float | None) -> None:
    """Wait for `thread` to end, until `deadline` (time.monotonic(); None: no limit); not for this thread.

    Threads are listed under ``_guard``, which start() holds until its thread runs: one that is not alive has
    ended, or never started (an exception cut its start() short; joining it would raise).
    """
    if thread is not threading.current_thread() and thread.is_alive():
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _uninterrupted(wait: Callable[[], Any]) -> bool:
    """Run `wait` to its end whatever KeyboardInterrupts arrive meanwhile; whether one arrived."""
    interrupted = False
    while True:
        try:
            wait()
            return interrupted
        except KeyboardInterrupt:
            interrupted = True


def _acquire_uninterrupted(lock: Any) -> bool:
    """Take the re-entrant `lock` whatever KeyboardInterrupts arrive meanwhile; whether one arrived.

    An interrupt can end the wait before the lock is taken, or come just after it is: which, its owner says.
    Python runs a signal handler after a call into C returns, so an interrupt raised at ``acquire()`` comes
    after it ran: where this thread held the lock already, after it counted once more.
    """
    owned_before: bool | None = None
    interrupted = False
    while True:
        try:
            if owned_before is None:
                owned_before = lock._is_owned()
            lock.acquire()
            return interrupted
        except KeyboardInterrupt:
            interrupted = True
            if owned_before is not None and (owned_before or lock._is_owned()):
                return True


def _release_fork_locks() -> None:
    _forking_threads.discard(threading.get_ident())
    for lock in reversed(_held_for_fork.pop(threading.get_ident(), [])):
        if lock._is_owned():  # else an exception ended the acquire before it took the lock
            lock.release()


def _after_fork_in_parent() -> None:
    ident = threading.get_ident()
    _waiting_to_fork.discard(ident)
    _release_fork_locks()
    if ident in _ctrl_c_held:
        _ctrl_c_held.discard(ident)
        interrupts.interrupt_again()  # the Ctrl-C held back while the fork waited (raised here, it would be dropped)


def _after_fork_in_child() -> None:
    global _no_compiles, _one_at_a_time, _guard, _foreground_lock, _foreground_done
    _no_compiles = _no_compiles or threading.get_ident() in _waiting_to_fork
    _waiting_to_fork.clear()
    _one_at_a_time = threading.Lock()  # held only if a compile thread the child lacks held it
    _ctrl_c_held.clear()
    _release_fork_locks()
    # Held by a thread the child lacks only where an exception other than a Ctrl-C ended the wait before the fork.
    if not _free_here(_guard):
        _guard = threading.RLock()
    if not _free_here(_foreground_lock):
        _foreground_lock = threading.RLock()
        _foreground_done = threading.Condition(_foreground_lock)
    _forking_threads.clear()  # other threads' entries: the child lacks them, and a new thread may get their ident
    _given_up.clear()
    _given_up_sections.clear()
    for ident in list(_foreground_threads):  # sections of threads the child lacks: only the forking thread is left
        if ident != threading.get_ident():
            del _foreground_threads[ident]


def _free_here(lock: Any) -> bool:
    """Whether this thread can take the re-entrant `lock` now (it is free, or this thread's)."""
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


def compiles_disabled() -> bool:
    """Whether this process was forked while a wait for compiles was cut short: it must never compile or import numba."""
    return _no_compiles


def _stop_new_compiles() -> None:
    """Called once interpreter exit has joined the threads it waits for, before any other atexit handler runs."""
    global _exiting
    with _guard:
        _exiting = True


def _on_thread_shutdown() -> None:
    """Called when the main thread has ended, before exit joins the other non-daemon threads.

    Those threads may still look up rows and start compiles, which the join waits for too (it joins threads
    started meanwhile); the atexit handlers run after it, and an atexit handler registered now runs first of them.
    """
    atexit.register(_stop_new_compiles)


def forget() -> None:
    """Wait for running compiles, then forget every key (tests)."""
    wait()
    with _guard:
        _started.clear()
        _ready.clear()


# The hook that concurrent.futures uses to act before exit joins threads; atexit handlers run after that join.
try:
    if hasattr(threading, "_register_atexit"):
        threading._register_atexit(_on_thread_shutdown)
    else:
        atexit.register(_stop_new_compiles)
except RuntimeError:  # imported once exit had begun (by a thread outliving the main one, or an atexit handler)
    _exiting = True
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_wait_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
