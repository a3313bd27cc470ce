"""A Ctrl-C raised again, for code where Python would only print it (a finalizer, a fork hook).

Python discards an exception that leaves a finalizer or an ``os.register_at_fork``
hook, and a signal handler run inside one would raise it there. Code that
catches or holds back a KeyboardInterrupt in such a place calls
:func:`interrupt_again`, which makes it arrive once that code has returned.
"""
from __future__ import annotations

import _thread
import contextlib
import signal
import threading

#: Seconds after which a Ctrl-C caught on the main thread is raised again: the finalizer or hook has returned by
#: then, and a person does not notice the delay.
INTERRUPT_AGAIN_AFTER_S = 0.05


def interrupt_again(signum: int = signal.SIGINT) -> None:
    """Interrupt the main thread again, as the signal `signum` that was caught did (a Ctrl-C: SIGINT), once the code
    that caught it has returned.

    From another thread it is done at once. On the main thread a request would be served before that code
    returns (and only printed), so a timer thread makes it :data:`INTERRUPT_AGAIN_AFTER_S` later; at interpreter
    shutdown no thread can start, and nothing is left to interrupt.
    """
    if threading.current_thread() is not threading.main_thread():
        _interrupt_main(signum)
        return
    timer = threading.Timer(INTERRUPT_AGAIN_AFTER_S, _interrupt_main, (signum,))
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        pass


def _interrupt_main(signum: int) -> None:
    """`signum` to the main thread where Python handles it, which also wakes a blocking call as a Ctrl-C does;
    ``_thread.interrupt_main()`` (which does not wake one) where threads cannot be signalled."""
    main = threading.main_thread().ident
    if hasattr(signal, "pthread_kill") and main is not None and callable(signal.getsignal(signum)):
        with contextlib.suppress(OSError):  # the main thread has ended meanwhile: nothing is left to interrupt
            signal.pthread_kill(main, signum)
    else:
        _thread.interrupt_main(signal.Signals(signum))
