"""Host side of the Numba CPU gather: kernel choice, byte views, threads and fork guards.

The kernels (:mod:`fastembed.kernels.gather_cpu`) take rows as bytes
(numba has no float16), so this module views any table as its bytes.
Rows are copied as their bytes, bit-exact for every dtype (float16,
bfloat16, float32, int8, S3, packed structs, ...).

Which kernel runs (docs/backends.md gives each constant's evidence):

- an output smaller than ``SERIAL_MIN_BYTES`` (256 KiB), or smaller than
  ``PARALLEL_MIN_BYTES`` with rows narrower than ``TOUCHED_ROW_MIN_BYTES``:
  numpy's ``take`` on the calling thread (the numpy backend), so a decode
  step pays no thread wake-up, no compiled call and no compile;
- any other output below ``PARALLEL_MIN_BYTES``: the serial kernel on the
  calling thread, each row one ``memcpy`` of the C library after a touch of
  the pages of the rows ahead;
- an output of at least ``STREAM_MIN_OUT_BYTES`` on x86-64 whose rows are
  16-byte aligned: the rows in parallel with non-temporal stores;
- otherwise the rows in parallel with ordinary (cached) stores.

In parallel means one block of rows per thread (blocks of at most
``MAX_BLOCK_BYTES`` for the gather's larger outputs, claimed in turn), on the calling thread and
fastembed's own workers (:mod:`.cpu_workers`, which says why not numba's
threading layer, never started here); how many threads: :func:`thread_count`.

No lookup compiles on the caller's thread: numba is imported, and the
kernels compiled for each new argument signature (the ids' dtype and
alignment), on a background thread, while the numpy
backend serves those calls (:mod:`.background_compile`). Ids are made 1-D,
C-contiguous and writeable first (a copy only when they are not), so that
strided ids need no signature of their own.

Safety:

- one parallel gather at a time per process (a lock). A thread that finds
  the lock taken runs the serial kernel instead of waiting: the other call
  already keeps every core busy;
- a forked child starts workers of its own, and its lock is a new one (a
  thread the child lacks may have held the parent's);
- a fork waits until no thread is importing numba or compiling a kernel
  for this backend (:mod:`.background_compile`): a child would otherwise
  inherit the import or compile lock held by a thread it does not have;
- an import of numba that is interrupted is undone, so the next one starts afresh;
- numba failing to load (or its JIT off) on the background thread makes the
  dispatcher choose again; kernels that fail to compile leave numpy serving
  their signature, reported by ``describe()``.

Rows gathered into chosen rows of an output (:meth:`NumbaBackend.place`,
which the distributed layer's shared-memory exchange uses) take the same
paths by the bytes placed: numpy below ``PLACE_SERIAL_MIN_BYTES`` or while the
kernel compiles, else the place kernel on the calling thread, or in
parallel from ``PARALLEL_MIN_BYTES``, with non-temporal stores from
``STREAM_MIN_OUT_BYTES``.

Quantized tables (:meth:`NumbaBackend.dequantize`, every block format of
:mod:`fastembed.formats`) go through :mod:`fastembed.kernels.dequant_cpu`:
the serial kernel below ``PARALLEL_MIN_BYTES`` of output (no numpy ``take``
can dequantize), its rows in parallel above, non-temporal stores from
``STREAM_MIN_OUT_BYTES`` (not into bfloat16 on CPUs with 16 vector registers:
``streams_well`` of that module), with the same guards, and the numpy reference
(:func:`.numpy_backend.dequantize_into`) while the kernels compile. The
table and ids reach them in one type (read-only bytes, int64 ids), so one
compile per format and output dtype (float32, float16 or bfloat16; each
compiling only that format's decoder and that output's puts) serves every
table of that format.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import os
import platform
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import validate
from ..arrays.numpy_adapter import data_address
from ..formats import FORMATS, QuantizedTable
from . import background_compile, base, cpu_workers, numpy_backend, output_cache
from .base import DENSE, Capabilities, SmallGather
from .cpu_workers import WORKERS
from .numpy_backend import take_into, take_new

#: Outputs smaller than this are gathered on the calling thread: waking a sleeping worker costs tens of
#: microseconds, more than it saves on a copy of a few rows. In bytes: a copy's time is in proportion to them.
PARALLEL_MIN_BYTES = 2 * 2**20
#: Outputs smaller than this are gathered by numpy's take on the calling thread, larger ones (below
#: PARALLEL_MIN_BYTES) by the serial kernel, whose page touch saves more than its call costs beyond take's.
#: The API reads it through :meth:`NumbaBackend.small_gather` once per dispatch generation: a change
#: reaches it after :func:`fastembed.dispatch.read_environment` or ``refresh()``.
SERIAL_MIN_BYTES = 256 * 2**10
#: Rows of at least this many bytes are copied with cached stores (the serial kernel, and the parallel copy of rows
#: that cannot stream) after a touch of their pages (TOUCH_PAGES_ROWS_AHEAD); narrower ones without it, where the
#: touch costs more than it saves, and below PARALLEL_MIN_BYTES of output by numpy's take, which copies them faster.
TOUCHED_ROW_MIN_BYTES = 1024
#: Placements of fewer bytes than this are numpy's (fancy assignment, through a temporary); larger ones go to
#: the place kernel, which writes each row once.
PLACE_SERIAL_MIN_BYTES = 512 * 2**10
#: From this output size on, non-temporal stores win over cached stores, even
#: counting the caller's read of the output that cached stores leave in the cache.
STREAM_MIN_OUT_BYTES = 2 * 2**20
#: The streaming and dequantizing kernels prefetch the row this many rows ahead, line by
#: line, as they copy this one (0: off): random rows defeat the hardware prefetcher.
PREFETCH_ROWS_AHEAD = 1
#: ... and touches each 4 KiB page of the row this many rows ahead (0: off),
#: so that its page translation is under way before the copy needs it.
TOUCH_PAGES_ROWS_AHEAD = 16
#: The dequantizing kernels' page touch distance (0: off); shorter than the copy's, since a
#: dequantized row takes longer than a copied one.
DEQUANTIZE_TOUCH_PAGES_ROWS_AHEAD = 4
#: ... and copies a row backward when its source sits 1 to this many bytes
#: below its destination modulo 4 KiB, where a forward copy's loads wait on
#: its own stores (4K aliasing).
ALIAS_WINDOW = 48
#: A parallel gather cuts its output into equal blocks, one per this many bytes begun (each at most this
#: size plus a row), and at least one per thread: under a competing load a thread sharing its CPU claims
#: fewer of them, where with one block per thread the others would wait for its half (docs/backends.md).
#: The dequantizing gather keeps one block per thread: it gained nothing from smaller ones.
MAX_BLOCK_BYTES = 32 * 2**20
#: Import numba and compile each new signature on a background thread while
#: the numpy backend serves (see background_compile); False does both in the
#: caller's thread.
COMPILE_IN_BACKGROUND = True
#: An out= whose address is no multiple of its items' size is dequantized through an aligned buffer of
#: at most this many bytes (one row at least), a few rows at a time: no lookup allocates an
#: output-sized temporary.
STAGE_BYTES = 32 * 2**10

_STREAMING_CPU = platform.machine().lower() in ("x86_64", "amd64")
_BYTE = np.dtype(np.uint8)
#: A kernel's return value when a row's id was found out of range while copying
#: (only possible when another thread changed the ids after they were checked).
_CHANGED_DURING_COPY = -2


_epochs = itertools.count()


@dataclass
class _Compiles:
    """What the backend knows of its kernels' compiles between two resets."""

    epoch: int = field(default_factory=lambda: next(_epochs))  # in each background key: a reset compiles anew
    done: set[tuple] = field(default_factory=set)  # signatures whose kernels are compiled
    failed: dict[tuple, str] = field(default_factory=dict)  # signature -> why its kernels failed to compile


class NumbaBackend:
    """The parallel CPU backend. All of its mutable state lives here (see :meth:`reset`)."""

    name = "numba"
    capabilities = Capabilities(
        array_libraries=frozenset({"numpy"}), devices=frozenset({"cpu"}), formats=frozenset({DENSE, *FORMATS})
    )

    def __init__(self) -> None:
        self._parallel_lock = threading.Lock()
        self._import_lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget availability, the kernel import's failure and what compiled.

        Each signature compiles again afterwards; a compile still running
        records its result in the state it started from, which the reset has
        replaced. Waits for nothing: it may run inside a fork hook, while the
        compiles' locks are held.
        """
        self._kernels: Any = None
        self._import_error: str | None = None
        self._dequantize_kernels: Any = None
        self._dequantize_error: str | None = None  # the dequantizing kernels cannot load: numpy serves
        self._unavailable: list[str] | None = None
        self._compiles = _Compiles()  # one object, swapped whole: a compile started before holds the old one

    # -- availability --------------------------------------------------------

    def unavailable_reasons(self) -> list[str]:
        if self._unavailable is None:
            self._unavailable = self._find_unavailable_reasons()
        return self._unavailable + ([self._import_error] if self._import_error else [])

    @staticmethod
    def _find_unavailable_reasons() -> list[str]:
        missing = base.missing_package("numba", "pip install numba")
        if missing is not None:
            return [missing]
        if _jit_disabled_by_environment():
            return [_JIT_DISABLED]
        if background_compile.compiles_disabled():
            return [_FORKED_MID_COMPILE]
        return []

    def kernels(self) -> Any:
        """The kernel module, imported (and numba with it) on first use.

        An import interrupted (Ctrl-C) or failing part-way would leave numba
        half-initialised in ``sys.modules``, breaking every later import; the
        modules it added are removed so that the next call imports afresh.

        Raises:
            ImportError: numba cannot be loaded or its JIT is off
                (NUMBA_DISABLE_JIT, a ``.numba_config.yaml``); the reason is
                kept, reported by :meth:`unavailable_reasons`, and the
                dispatcher told to choose again (``base.availability_changed``).
        """
        if self._kernels is not None:
            return self._kernels
        failure: Exception | None = None
        with background_compile.foreground(), self._import_lock:
            if self._kernels is None:
                try:
                    with cpu_workers.main_threads_cpus_added():  # where numba counts its default threads
                        kernels = _import_or_undo("fastembed.kernels.gather_cpu")
                except Exception as error:  # an interrupt propagates: the next call tries again
                    self._import_error = f"numba failed to load: {type(error).__name__}: {error}"
                    failure = error
                else:
                    import numba

                    if numba.config.DISABLE_JIT:  # type: ignore[attr-defined] # also set by a .numba_config.yaml
                        self._import_error = _JIT_DISABLED
                        failure = ImportError(_JIT_DISABLED)
                    else:
                        self._kernels = kernels
        if failure is not None:
            # The dispatcher may have chosen this backend before the reason was known; outside the lock, since a
            # listener may reset this backend.
            base.availability_changed()
            raise ImportError(self._import_error) from failure
        return self._kernels

    def dequantize_kernels(self) -> Any:
        """The dequantizing kernel module (:mod:`fastembed.kernels.dequant_cpu`), imported as :meth:`kernels` is.

        Raises:
            ImportError: numba or that module cannot be loaded (the reason is kept for ``describe()``).
        """
        if self._dequantize_kernels is not None:
            return self._dequantize_kernels
        self.kernels()
        with background_compile.foreground(), self._import_lock:
            if self._dequantize_kernels is None:
                try:
                    self._dequantize_kernels = _import_or_undo("fastembed.kernels.dequant_cpu")
                except Exception as error:
                    self._dequantize_error = f"failed to load: {_one_line(error)}"
                    raise ImportError(self._dequantize_error) from error
        return self._dequantize_kernels

    # -- the gather ----------------------------------------------------------

    def gather(self, table: np.ndarray, ids: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        n = ids.size
        # strides[0] is the row's bytes in a C-contiguous table (any value where there is one row or none).
        output_nbytes = n * table.strides[0]
        if (output_nbytes < SERIAL_MIN_BYTES or self._import_error is not None
                or (table.strides[0] < TOUCHED_ROW_MIN_BYTES and output_nbytes < PARALLEL_MIN_BYTES)):
            # A few rows, or narrow ones below the parallel size: numpy's take on this thread. Or numba failed to
            # load, which unavailable_reasons() reports.
            return take_new(table, ids) if out is None else take_into(table, ids, out)
        table_bytes, flat_ids, given_bytes, signature = kernel_views("gather", table, ids, out, n)
        if signature not in self._compiles.done and not self._compile(
                signature, lambda compiles: self._compile_now(signature, compiles)):
            if out is None and n * table.shape[1] * table.dtype.itemsize >= output_cache.MIN_BYTES:
                output_cache.limit()  # a bad setting raises now, as it will once the kernels serve
            return numpy_backend.BACKEND.gather(table, ids, out)  # compiling in the background meanwhile
        kernels = self._kernels
        if kernels is None:  # reset() by another thread since the check
            return numpy_backend.BACKEND.gather(table, ids, out)
        if output_nbytes < PARALLEL_MIN_BYTES:
            if out is None:
                # Allocated as the kernel's bytes and viewed as rows afterwards: fewer views on the way, and only
                # streamed stores want the output cache's line alignment, which costs a serial gather more than it saves.
                out_bytes = np.empty((n, table_bytes.shape[1]), _BYTE)
                out = out_bytes.view(table.dtype)
                if ids.ndim != 1:
                    out = out.reshape(ids.shape + table.shape[1:])
            else:
                out_bytes = given_bytes
            status = kernels.gather_serial(table_bytes, flat_ids, out_bytes, _touch_for(table_bytes))
        else:
            if out is None:
                out = output_cache.new_output(ids.shape + table.shape[1:], table.dtype, output_cache.ALIGNMENT)
            status = self._run_parallel(kernels, table_bytes, flat_ids,
                                        _row_bytes(out, n) if given_bytes is None else given_bytes)
        if status != -1:
            _raise_for_status(status, ids, table.shape[0])
        return out

    def small_gather(self) -> SmallGather:
        """Outputs below ``SERIAL_MIN_BYTES`` are numpy's take on the calling thread (:meth:`gather`);
        everything below ``PARALLEL_MIN_BYTES`` is gathered on that thread (by the serial kernel between the two,
        or by take for rows narrower than ``TOUCHED_ROW_MIN_BYTES``)."""
        return SmallGather(SERIAL_MIN_BYTES, take_new, PARALLEL_MIN_BYTES, take_into)

    def _compile(self, signature: tuple, compile_now: Callable[[_Compiles], None]) -> bool:
        """Make the kernels of `signature` ready (importing numba first if needed); True when they are ready now.

        `signature` starts with the kernels' kind ("gather", "place",
        "dequantize"); ``compile_now(compiles)`` compiles them and records the
        outcome in `compiles`. With COMPILE_IN_BACKGROUND, numba is imported
        and a new signature compiled on a background thread (the call is
        served by the numpy backend meanwhile), so no lookup ever imports
        numba or compiles on the caller's thread; otherwise here.
        """
        compiles = self._compiles
        if signature in compiles.failed:
            return False
        if COMPILE_IN_BACKGROUND:
            background_compile.start((signature[0], compiles.epoch, *signature[1:]), lambda: compile_now(compiles))
            return signature in compiles.done
        with background_compile.foreground(), contextlib.suppress(Exception):  # kept: describe() reports it
            compile_now(compiles)
        return signature in compiles.done

    def _compile_now(self, signature: tuple, compiles: _Compiles) -> None:
        """Compile every gather kernel for `signature` with calls that gather no row.

        The templates have the arguments' types but none of their memory,
        so a compile keeps no table alive. Kernels that fail to compile are remembered in `compiles`,
        the backend's record when the compile started: numpy serves their
        signature, and ``describe()`` says why.
        """
        templates = _templates(signature)

        def compile_gather(kernels: Any) -> None:
            table_bytes, no_ids, no_rows = templates  # no_ids holds one bad id: nothing is copied
            kernels.gather_serial(table_bytes, no_ids, no_rows, TOUCH_PAGES_ROWS_AHEAD)
            kernels.first_bad_position(no_ids, table_bytes.shape[0])
            kernels.copy_rows(table_bytes, no_ids, no_rows, 0, 0, TOUCH_PAGES_ROWS_AHEAD)
            if _STREAMING_CPU:
                kernels.stream_rows(table_bytes, no_ids, no_rows, 0, 0, PREFETCH_ROWS_AHEAD, TOUCH_PAGES_ROWS_AHEAD,
                                    ALIAS_WINDOW)

        self._compile_kernels(signature, compile_gather, compiles)

    def _compile_kernels(self, signature: tuple, compile_with: Callable[[Any], None], compiles: _Compiles,
                         load: Callable[[], Any] | None = None) -> None:
        """Run ``compile_with(kernels)`` (calls that copy nothing) and record in `compiles` whether it compiled.

        `load` imports the kernel module (default: :meth:`kernels`, the gather's).
        """
        try:
            kernels = (load or self.kernels)()
        except ImportError:
            return  # the reason is kept: unavailable_reasons() (numba) or describe() (dequantizing kernels) reports it
        try:
            try:
                compile_with(kernels)
            except OSError as error:
                from ..kernels import jit_options

                if not jit_options.is_a_cache_write_failure(error):
                    raise
                jit_options.stop_caching(error)  # a full disk: the kernels compiled are kept, the rest compile again
                compile_with(kernels)
        except Exception as error:  # a corrupt on-disk cache, say: numpy serves the signature, describe() says why
            compiles.failed[signature] = _one_line(error)
            raise
        compiles.done.add(signature)

    def _run_parallel(self, kernels: Any, table_bytes: np.ndarray, flat_ids: np.ndarray, out_bytes: np.ndarray) -> int:
        """Gather into `out_bytes` on the calling thread and the workers; the serial kernel while another does."""
        if self._parallel_lock.locked():
            return int(kernels.gather_serial(table_bytes, flat_ids, out_bytes, _touch_for(table_bytes)))
        with self._parallel_lock:  # not acquire() then try: an exception between the two would keep it taken for good
            bad = int(kernels.first_bad_position(flat_ids, table_bytes.shape[0]))
            if bad >= 0:
                return bad
            if out_bytes.nbytes >= STREAM_MIN_OUT_BYTES and _STREAMING_CPU and kernels.can_stream(out_bytes):
                def rows(start: int, stop: int) -> int:
                    return kernels.stream_rows(table_bytes, flat_ids, out_bytes, start, stop, PREFETCH_ROWS_AHEAD,
                                               TOUCH_PAGES_ROWS_AHEAD, ALIAS_WINDOW)
            else:
                touch = _touch_for(table_bytes)

                def rows(start: int, stop: int) -> int:
                    return kernels.copy_rows(table_bytes, flat_ids, out_bytes, start, stop, touch)
            return _CHANGED_DURING_COPY if WORKERS.run(rows, len(flat_ids), thread_count(),
                                                       blocks_for(out_bytes.nbytes)) else -1

    # -- the gather into chosen rows ---------------------------------------------

    def place(self, table: np.ndarray, ids: np.ndarray, out: np.ndarray, positions: np.ndarray) -> None:
        """``out[positions[i]] = table[ids[i]]``, as :meth:`fastembed.backends.base.PlacingBackend.place` says.

        Outputs below ``PLACE_SERIAL_MIN_BYTES`` of placed rows, and calls whose
        kernels are still compiling, go to the numpy backend; the rest run the
        place kernel serially or in parallel, with non-temporal stores, as
        the gather of as many rows would.
        """
        n = ids.size
        if n * table.shape[1] * table.dtype.itemsize < PLACE_SERIAL_MIN_BYTES or self._import_error is not None:
            numpy_backend.BACKEND.place(table, ids, out, positions)
            return
        table_bytes, _, out_bytes, signature = kernel_views("place", table, ids, out, out.shape[0])
        ready = signature in self._compiles.done or self._compile(
            signature, lambda compiles: self._compile_place_now(signature, compiles))
        kernels = self._kernels
        if not ready or kernels is None:  # compiling in the background meanwhile, or reset() by another thread
            numpy_backend.BACKEND.place(table, ids, out, positions)
            return
        bad = int(kernels.first_bad_position(ids, table_bytes.shape[0]))
        if bad >= 0:
            raise validate.out_of_range_error(ids, bad, table.shape[0])
        placed_bytes = n * table_bytes.shape[1]
        stream = placed_bytes >= STREAM_MIN_OUT_BYTES and _STREAMING_CPU and kernels.can_stream(out_bytes)

        touch = TOUCH_PAGES_ROWS_AHEAD if stream else _touch_for(table_bytes)  # as the gather's rows

        def rows(start: int, stop: int) -> int:
            return kernels.place_rows(table_bytes, ids, out_bytes, positions, start, stop, stream,
                                      PREFETCH_ROWS_AHEAD, touch, ALIAS_WINDOW)

        if placed_bytes < PARALLEL_MIN_BYTES or self._parallel_lock.locked():
            skipped = rows(0, n)
        else:
            with self._parallel_lock:
                skipped = WORKERS.run(rows, n, thread_count(), blocks_for(placed_bytes))
        assert not skipped  # the ids were checked, the positions too (validate.place_arguments), and both are private

    def _compile_place_now(self, signature: tuple, compiles: _Compiles) -> None:
        """Compile the place kernel for `signature` with a call that places no row."""
        table, no_ids, no_rows = _templates(signature)
        no_positions = np.zeros(1, np.int64)
        self._compile_kernels(signature, lambda kernels: kernels.place_rows(
            table, no_ids, no_rows, no_positions, 0, 0, False, 0, 0, 0), compiles)

    # -- the dequantizing gather ----------------------------------------------

    def dequantize(self, table: QuantizedTable, ids: np.ndarray, out: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
        """Write the rows ``table[ids]`` dequantized to `dtype` into `out` (or a new array); return it.

        Bit for bit :func:`.numpy_backend.dequantize_into`, which serves while
        the kernels compile and when they cannot load.
        """
        dtype = np.dtype(dtype)
        n = ids.size
        if out is None:
            # A streamed output on a cache line: each block's stores would straddle two lines otherwise.
            streamed = n * table.dim * dtype.itemsize >= STREAM_MIN_OUT_BYTES
            out = output_cache.new_output(ids.shape + (table.dim,), dtype, output_cache.ALIGNMENT if streamed else 0)
        if n == 0:
            return out
        word = _output_word(dtype)
        # The kernels compile for each format and output dtype (its word and its mode).
        signature = ("dequantize", dtype, table.format.name)
        if self._import_error is not None or self._dequantize_error is not None or (
            signature not in self._compiles.done
            and not self._compile(signature, lambda compiles: self._compile_dequantize_now(signature, compiles))
        ):
            return numpy_backend.dequantize_into(table, ids, out)  # the kernels are compiling (or cannot load)
        kernels, gather_kernels = self._dequantize_kernels, self._kernels
        if kernels is None or gather_kernels is None:  # reset() by another thread since the check
            return numpy_backend.dequantize_into(table, ids, out)
        rows = out.reshape(n, table.dim).view(word)
        flat_ids = _int64_ids(ids)
        if rows.flags.aligned:  # as numba types it: an unaligned array would compile kernels of its own
            status = self._run_dequantize(kernels, gather_kernels.can_stream, table, flat_ids, rows, dtype)
        else:
            numpy_backend.check_range(ids, table.shape[0])  # before any row is written: a bad id leaves out untouched
            status = self._dequantize_staged(kernels, gather_kernels.can_stream, table, flat_ids, rows, dtype)
        _raise_for_status(status, ids, table.shape[0])
        return out

    def _dequantize_staged(self, kernels: Any, can_stream: Any, table: QuantizedTable, flat_ids: np.ndarray,
                           rows: np.ndarray, dtype: np.dtype) -> int:
        """:meth:`_run_dequantize` into rows at an address that is no multiple of their word (an out= at an odd offset).

        numba compiles unaligned arrays apart, so the rows go through an
        aligned buffer of at most ``STAGE_BYTES`` (one row at least), a few
        rows at a time. The caller has checked every id.
        """
        step = max(1, STAGE_BYTES // max(1, rows.strides[0]))
        stage = np.empty((min(step, len(rows)), rows.shape[1]), rows.dtype)
        for start in range(0, len(rows), step):
            chunk = stage[: min(step, len(rows) - start)]
            status = self._run_dequantize(kernels, can_stream, table, flat_ids[start: start + len(chunk)], chunk,
                                          dtype)
            if status != -1:
                return _CHANGED_DURING_COPY  # the ids were in range a moment ago: another thread changed them
            rows[start: start + len(chunk)] = chunk
        return -1

    def _run_dequantize(self, kernels: Any, can_stream: Any, table: QuantizedTable, flat_ids: np.ndarray,
                        rows: np.ndarray, dtype: np.dtype) -> int:
        """Run the serial or parallel kernel into `rows` (aligned to their word); return its status."""
        fmt = table.format
        data = _read_only(table.data)
        scales = _read_only(table.scales.view(np.uint8) if fmt.row_scale else _NO_SCALES)  # bytes: any alignment
        mode = _output_mode(kernels, dtype)
        stream = (rows.nbytes >= STREAM_MIN_OUT_BYTES and _STREAMING_CPU and can_stream(rows)
                  and kernels.streams_well(mode))
        code = kernels.FORMAT_CODES[fmt.name]
        if rows.nbytes < PARALLEL_MIN_BYTES or self._parallel_lock.locked():
            return int(kernels.dequantize_serial(code, data, scales, flat_ids, rows, mode, stream, PREFETCH_ROWS_AHEAD,
                                                 DEQUANTIZE_TOUCH_PAGES_ROWS_AHEAD))
        with self._parallel_lock:  # as in _run_parallel
            bad = int(kernels.first_bad_position(flat_ids, kernels.readable_rows(code, data, scales)))
            if bad >= 0:
                return bad

            def dequantized(start: int, stop: int) -> int:
                return kernels.dequantize_range(code, data, scales, flat_ids, rows, start, stop, mode, stream,
                                                PREFETCH_ROWS_AHEAD, DEQUANTIZE_TOUCH_PAGES_ROWS_AHEAD)

            return _CHANGED_DURING_COPY if WORKERS.run(dequantized, len(flat_ids), thread_count()) else -1

    def _compile_dequantize_now(self, signature: tuple, compiles: _Compiles) -> None:
        """Compile the dequantizing kernels of a format and an output dtype by calls that dequantize no row."""
        def compile_dequantize(kernels: Any) -> None:
            _, dtype, name = signature
            fmt = FORMATS[name]
            code, data = kernels.FORMAT_CODES[name], _read_only(np.zeros((1, fmt.block_bytes), np.uint8))
            scales = _read_only(_NO_SCALES)
            no_row = _read_only(np.full(1, -1, np.int64))  # one bad id: the kernels return before writing anything
            rows = np.zeros((1, fmt.block_values), _output_word(dtype))
            mode = _output_mode(kernels, dtype)
            kernels.dequantize_serial(code, data, scales, no_row, rows, mode, False, 0, 0)
            kernels.first_bad_position(no_row, kernels.readable_rows(code, data, scales))
            kernels.dequantize_range(code, data, scales, no_row, rows, 0, 0, mode, False, 0, 0)

        self._compile_kernels(signature, compile_dequantize, compiles, self.dequantize_kernels)

    def after_fork_in_child(self) -> None:
        self._parallel_lock = threading.Lock()  # a thread the child lacks may have held the parent's
        if background_compile.compiles_disabled():
            self._unavailable = None  # found again: this process may never use numba
            base.availability_changed()

    # -- facts ---------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Versions, threads, the thresholds, and what failed to compile or load.

        Loads numba (never its threading layer, which no lookup uses).
        """
        if self.unavailable_reasons():
            return {}
        try:
            self.kernels()
        except ImportError as error:
            return {"error": str(error)}
        import numba

        from ..kernels import jit_options

        threads = thread_count()
        facts: dict[str, Any] = {
            "numba": numba.__version__,
            "threads": threads,
            "workers": (f"the calling thread and {threads - 1} fastembed worker thread(s) share a parallel lookup "
                        "(NUMBA_NUM_THREADS sets the count: by default the CPUs of the process's main thread and of "
                        "the thread that loaded numba; numba.set_num_threads in the calling thread sets it once "
                        "numba's own threading layer runs; OpenMP settings apply only where an OpenMP runtime binds "
                        "the main thread to CPUs)"),
            "serial_min_bytes": SERIAL_MIN_BYTES,
            "touched_row_min_bytes": TOUCHED_ROW_MIN_BYTES,
            "place_serial_min_bytes": PLACE_SERIAL_MIN_BYTES,
            "parallel_min_bytes": PARALLEL_MIN_BYTES,
            "max_block_bytes": MAX_BLOCK_BYTES,
            "stream_min_out_bytes": STREAM_MIN_OUT_BYTES,
            "streaming_stores": _STREAMING_CPU,
            "kernel_cache": _kernel_cache(jit_options),
        }
        failures = list(self._compiles.failed.values())
        if failures:
            facts["compile_failures"] = (f"the kernels of {len(failures)} argument signature(s) failed to compile, "
                                         f"numpy serves those lookups: {failures[0]}")
        facts["dequantize_formats"] = ", ".join(FORMATS)
        try:
            kernels = self.dequantize_kernels()
            facts["float16_conversion"] = kernels.FLOAT16_CONVERSION
            facts["to_16_bits"] = kernels.TO_16_BITS
            facts["dequantize_streamed_stores"] = _streamed_stores_fact(kernels)
        except ImportError:
            pass
        if self._dequantize_error is not None:
            facts["dequantize_kernels"] = f"unavailable, the numpy reference serves: {self._dequantize_error}"
        return facts


def _streamed_stores_fact(kernels: Any) -> str:
    """How the dequantizing kernels stream their outputs, in words (for describe())."""
    if not _STREAMING_CPU:
        return "none (streamed stores are x86-64's)"
    if kernels.LINES_BY_PERMUTE:
        return "16 bytes per store; into rows that start inside a cache line, a whole line per store (AVX-512F)"
    if kernels.streams_well(kernels.BFLOAT16):
        return "16 bytes per store"
    return (f"16 bytes per store; bfloat16 outputs take cached stores (their row loops spill registers to the stack "
            f"on {kernels.VECTOR_REGISTERS} vector registers)")


_JIT_DISABLED = "numba's JIT is disabled (NUMBA_DISABLE_JIT or disable_jit in .numba_config.yaml): numba would run the kernels as Python, slower than numpy"


def _jit_disabled_by_environment() -> bool:
    """NUMBA_DISABLE_JIT read as numba reads it: an integer, anything else ignored."""
    try:
        return int(os.environ.get("NUMBA_DISABLE_JIT", "")) != 0
    except ValueError:
        return False


_FORKED_MID_COMPILE = ("this process was forked while numba loaded or compiled on another thread, and the fork's "
                       "wait for it was cut short: numba's locks may be held by a thread this process lacks, so "
                       "numba is never used here")


def _import_or_undo(name: str) -> Any:
    """Import module `name`; if that fails or is interrupted, drop the modules of `name`, the kernel modules, numba
    and llvmlite it added.

    A half-initialised numba left in ``sys.modules`` would break every later
    import; without it, the next call imports afresh. Other modules added
    meanwhile stay (other threads may have imported them), but for those whose
    package is gone: Python drops a package whose import failed and keeps
    the submodules it had loaded, which the package's next import would not
    attach to it.
    """
    loaded_before = set(sys.modules)
    try:
        return importlib.import_module(name)
    except BaseException:
        for added in set(sys.modules) - loaded_before:
            # numba, and every kernel module it brought in (the kernels' pieces are their siblings)
            if (added.partition(".")[0] in ("numba", "llvmlite") or added == name or added.startswith(name + ".")
                    or added.startswith(_KERNELS_PACKAGE)):
                sys.modules.pop(added, None)
        for added in sorted(set(sys.modules) - loaded_before, key=len):  # packages before their submodules
            if "." in added and added.rpartition(".")[0] not in sys.modules:
                sys.modules.pop(added, None)
        raise


_KERNELS_PACKAGE = "fastembed.kernels."


def _raise_for_status(status: int, ids: np.ndarray, vocab_size: int) -> None:
    """Turn a kernel's status into the caller's error: -1 is success, -2 ids changed meanwhile, >= 0 a bad id's position."""
    if status == _CHANGED_DURING_COPY:
        validate.check_ids_in_range(ids, vocab_size)
        raise RuntimeError("the ids changed while they were being gathered (another thread wrote them)")
    if status >= 0:
        raise validate.out_of_range_error(ids, status, vocab_size)


def _one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def kernel_views(kind: str, table: np.ndarray, ids: np.ndarray, out: np.ndarray | None, out_rows: int) -> tuple:
    """The kernels' arguments for a gather from `table` (or a placement, `kind`) and what numba compiles them for.

    Args:
        kind: the kernels' kind, the signature's first item ("gather", "place").
        table: a C-contiguous 2-D snapshot.
        ids: the ids (any shape).
        out: the output, or None for a new one.
        out_rows: the rows of `out`.

    Returns:
        ``(table_bytes, flat_ids, out_bytes, signature)``:

        - the table as ``(vocab_size, row_bytes)`` bytes, read-only: numba
          compiles read-only and writeable arrays separately, and the
          kernels never write the table, so a writeable numpy table, a
          mapped file and a torch tensor share one compile; bytes are
          aligned wherever they start, so tables of every dtype and
          alignment share it too;
        - the ids 1-D, C-contiguous and writeable (a copy only when they are not);
        - `out` as ``(out_rows, row_bytes)`` bytes, or None;
        - the signature ``(kind, id dtype, ids aligned)``.

        All in one function: a lookup of a few hundred KiB pays for every
        Python call on its way.
    """
    table_bytes = table.view(_BYTE)
    if table_bytes.flags.writeable:  # setting the flag costs more than reading it, and a mapped table is read-only
        table_bytes.flags.writeable = False
    flat_ids = ids if ids.ndim == 1 else ids.reshape(-1)
    ids_flags = flat_ids.flags
    ids_aligned = ids_flags.aligned
    if not ids_flags.c_contiguous or not ids_flags.writeable:
        flat_ids, ids_aligned = flat_ids.copy(), True
    out_bytes = None if out is None else _row_bytes(out, out_rows)
    return table_bytes, flat_ids, out_bytes, (kind, flat_ids.dtype, ids_aligned)


#: The scales argument of a format without row scales.
_NO_SCALES = np.empty(0, np.uint8)
_NO_SCALES.flags.writeable = False


def _output_word(dtype: np.dtype) -> np.dtype:
    """The word the dequantizing kernels write an output of `dtype` in: float32, or uint16 (float16 and bfloat16)."""
    return np.dtype(np.float32) if dtype.itemsize == 4 else np.dtype(np.uint16)


def _output_mode(kernels: Any, dtype: np.dtype) -> int:
    """The dequantizing kernels' mode for an output of `dtype` (float32 outputs ignore it, and take FLOAT16)."""
    return kernels.BFLOAT16 if dtype.itemsize == 2 and dtype != np.float16 else kernels.FLOAT16


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only, aligned plain ndarray (one numba type whatever the caller's array): `array` if it is one, else a view
    (a copy if unaligned)."""
    flags = array.flags
    if type(array) is np.ndarray and not flags.writeable and flags.aligned:
        return array
    view = array.view(np.ndarray) if flags.aligned else np.array(array)
    view.flags.writeable = False
    return view


def _int64_ids(ids: np.ndarray) -> np.ndarray:
    """The ids as 1-D, C-contiguous, read-only int64 (a view when they already are int64): one kernel signature."""
    flat = ids.reshape(-1)
    return _read_only(flat if flat.dtype == np.int64 and flat.flags.c_contiguous else flat.astype(np.int64))


def _touch_for(table_bytes: np.ndarray) -> int:
    """The page touch distance of the cached-store copy for rows of `table_bytes` (its second axis): 0 below
    ``TOUCHED_ROW_MIN_BYTES``."""
    return TOUCH_PAGES_ROWS_AHEAD if table_bytes.shape[1] >= TOUCHED_ROW_MIN_BYTES else 0


def _row_bytes(out: np.ndarray, n: int) -> np.ndarray:
    """``out`` as ``(n, row_bytes)`` bytes (a view)."""
    out_bytes = out.view(_BYTE)
    return out_bytes.reshape(n, -1) if n else out_bytes.reshape(0, 0)


def _templates(signature: tuple) -> tuple:
    """Small arrays of the kernels' argument types for `signature`, sharing no memory with the real ones."""
    _, id_dtype, ids_aligned = signature
    table = np.zeros((1, 16), _BYTE)  # any row size: a kernel's types do not include its arrays' shapes
    table.flags.writeable = False
    # One id, out of range: every kernel returns from its scan of the ids before it copies anything.
    # (Arrays of one element, because numpy calls every empty array aligned.)
    bad_id = _shaped(id_dtype, (1,), ids_aligned)
    bad_id[0] = -1
    return table, bad_id, np.zeros((1, 16), _BYTE)


def _shaped(dtype: np.dtype, shape: tuple[int, ...], aligned: bool) -> np.ndarray:
    """A zeroed C-contiguous array, at an address aligned to its item size or deliberately not."""
    size = int(np.prod(shape)) * dtype.itemsize
    buffer = np.zeros(size + 2 * dtype.itemsize, np.uint8)
    start = (-data_address(buffer)) % dtype.itemsize + (0 if aligned or dtype.itemsize == 1 else 1)
    return buffer[start : start + size].view(dtype).reshape(shape)


def _kernel_cache(jit_options: Any) -> str:
    """Where compiled kernels are kept, for describe(): on disk, or why not."""
    if jit_options.CACHED:
        return "on disk"
    if jit_options.WRITE_FAILURE is not None:
        return f"off: a write to it failed ({jit_options.WRITE_FAILURE}), so this process compiles its kernels in memory"
    return ("off: numba finds no writable place to cache compiled kernels (NUMBA_CACHE_DIR names one), so each "
            "process compiles them again")


def blocks_for(out_bytes: int) -> int:
    """Blocks a parallel region writing `out_bytes` cuts its rows into, at least: one per MAX_BLOCK_BYTES begun."""
    return -(-out_bytes // MAX_BLOCK_BYTES)


def thread_count() -> int:
    """Threads a parallel lookup cuts its rows among, the calling thread's included: numba's setting.

    Returns:
        ``NUMBA_NUM_THREADS`` (by default the CPUs of this process's main
        thread and of the thread that loaded numba); once numba's own
        threading layer runs in this process (the application's parallel
        numba code started it), the calling
        thread's ``numba.set_num_threads``. Reading it never starts that layer.
        1 while the interpreter is finalizing.

    Raises:
        ImportError, ValueError: numba cannot be imported (a bad ``NUMBA_NUM_THREADS`` among the reasons).
    """
    if sys.is_finalizing():
        return 1  # no worker starts then, and teardown may have taken numba out of sys.modules already
    import numba

    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is not None and getattr(parallel, "_is_initialized", False):
        # The layer's own per-thread count, read without numba.get_num_threads()'s locks: a fork while another
        # thread held them would leave this child's lookups waiting on them forever.
        read = getattr(parallel, "_get_num_threads", None)
        return max(1, int(read() if callable(read) else numba.get_num_threads()))
    return max(1, int(numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]


BACKEND = NumbaBackend()
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=BACKEND.after_fork_in_child)
