"""Helpers the tests share: random tables (never zeros), poisoned outputs, bit-exact comparison."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from collections.abc import Callable

import numpy as np

import fastembed

REFERENCE_IDS = [5237, 23872, 301, 16652, 19602, 1148]
#: The CPU backends that can run here, by name, in priority order.
CPU_BACKENDS = [status.name for status in fastembed.backend_statuses() if status.available and status.name != "cuda"]
POISON_BYTE = 0xA5


def random_table(vocab_size: int, dim: int, dtype="float16", seed: int = 0) -> np.ndarray:
    """A table of random values (never zeros for floats)."""
    return fastembed.Embedding.random(vocab_size, dim, dtype, seed).table


def poisoned(shape, dtype) -> np.ndarray:
    """An output buffer whose bytes are garbage, so an unwritten row cannot pass."""
    out = np.empty(shape, dtype=dtype)
    out.view(np.uint8).reshape(-1)[:] = POISON_BYTE
    return out


def assert_bit_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same shape, dtype and bytes."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(actual.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))



def random_quantized(fmt_name: str, vocab_size: int, dim: int, seed: int = 0):
    """A QuantizedTable of random blocks with finite scales (fastembed.tables.random_quantized_table)."""
    from fastembed.tables import random_quantized_table

    return random_quantized_table(fmt_name, vocab_size, dim, seed)


def run_script(folder, source: str) -> subprocess.CompletedProcess:
    """Run `source` as a Python script file in a fresh interpreter (exit-time behaviour needs a real exit)."""
    script = folder / "script.py"
    script.write_text(source)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)


class Producer:
    """Another library's host array: DLPack only."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def in_fastembed(code: types.CodeType) -> bool:
    """Whether `code` is fastembed's own: for :func:`interrupted_runs` whose handler is another thread's change."""
    return code.co_filename.startswith(_FASTEMBED_FOLDER)


_FASTEMBED_FOLDER = os.path.dirname(fastembed.__file__) + os.sep


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


def interrupted_runs(traced: Callable[[types.CodeType], bool], action: Callable[[], object],
                     handler: Callable[[], object] = _raise_keyboard_interrupt, limit: int = 20000):
    """Run `action` once per point where a signal handler could run in the code that `traced` accepts, calling
    `handler` at the n-th such point in run n (by default it raises KeyboardInterrupt, as Ctrl-C does); yield n
    after each such run, stop after the first run that ends before its n-th point.

    The points are most of those where CPython 3.11 runs pending handlers: on entering a function (the traced
    code's, and any Python function it calls) and on the return of each call it makes into C code, an exception
    there coming out of that call. Loop back edges, where CPython also runs them, are not among them; a
    generator's resumption, where it does not, is. Only this thread is watched, and not the handler. Each yield is
    the place to check that nothing broke.
    """
    for n in range(1, limit):
        reached = 0

        def watch(frame, event, arg, n=n):
            nonlocal reached
            if event == "call":
                caller = frame.f_back
                at_a_point = traced(frame.f_code) or (caller is not None and traced(caller.f_code))
            else:
                at_a_point = event == "c_return" and traced(frame.f_code)
            if at_a_point:
                reached += 1
                if reached == n:
                    handler()

        sys.setprofile(watch)
        try:
            action()
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        if reached < n:
            return
        yield n
    raise AssertionError(f"the action still reached {limit} points")


def dequantized(table, ids, dtype=np.float32) -> np.ndarray:
    """The rows `ids` of a quantized table by fastembed.formats' reference (checked against gguf's own), cast by
    numpy (or ml_dtypes, rounding to nearest even): what every backend must give, bit for bit."""
    from fastembed.formats import dequantize_rows

    flat = np.asarray(ids).reshape(-1)
    scales = None if table.scales is None else np.asarray(table.scales)[flat]
    with np.errstate(over="ignore", invalid="ignore"):  # the special-value tests make infinities and NaN on purpose
        rows = dequantize_rows(np.asarray(table.data)[flat], scales, table.format, table.dim)
        return rows.astype(dtype).reshape(np.shape(ids) + (table.dim,))


def past_a_file_time_tick(folder, since_ns: int) -> None:
    """Return once a file changed now in `folder` gets a change time after `since_ns` (file times tick every few
    ms on most filesystems, every second on some)."""
    probe = folder / "tick-probe"
    deadline = time.monotonic() + 10
    while True:
        probe.write_bytes(b"")
        if os.stat(probe).st_ctime_ns > since_ns:
            probe.unlink()
            return
        assert time.monotonic() < deadline, "the filesystem's file times did not move in 10 s"
        time.sleep(0.01)
