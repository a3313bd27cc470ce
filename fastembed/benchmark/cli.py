"""``fastembed-bench``: the benchmark (the project's main job) and the CI gate.

With no arguments: builds the default 129,280 x 4,096 float16 table, measures
every fastembed backend against numpy, torch (if installed) and two physical
limits (the best contiguous copy of as many rows, and a read of the same
scattered rows) at 1, 6, 64, 1,024, 8,192 and 65,536 ids, uniform and Zipf;
where cupy sees a GPU, the same on a copy of the table on the GPU (cuda
backend against cupy, torch CUDA and a device-to-device copy, CUDA events);
prints a table fitted to the terminal (wider, never cut, where it cannot
fit) and writes JSON, Markdown and PNG plots (a panel per id distribution)
into --out. ``--table PATH`` measures the same on a real table instead,
memory-mapped from a .npy, safetensors or GGUF file or a checkpoint folder.

Every argument is checked before any table is built, and a bad one exits 2
at once (:mod:`fastembed.benchmark.arguments`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..backends import interrupts
from .arguments import (
    BATCHES,
    QUICK_BATCHES,
    RANDOM_TABLE,
    dense_twin_bytes,
    dense_twin_problem,
    dtype_problem,
    formats_problem,
    measures_the_default_table,
    memory_problem,
    parse_arguments,
    quantizing_problem,
)
from .report import ResultFileError


def build_table(arguments: argparse.Namespace, console: Any) -> Any:
    """The table to measure: --table memory-mapped, or a random one of --vocab-size x --dim --dtype.

    Raises ValueError naming the file when --table cannot be read as a table.
    """
    if arguments.table is not None:
        return load_table(arguments.table, arguments.tensor, console)
    from rich.progress import Progress

    from fastembed.tables import random_table

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"building {arguments.vocab_size} x {arguments.dim} {arguments.dtype} table", total=1.0)
        table = random_table(arguments.vocab_size, arguments.dim, arguments.dtype,
                             progress=lambda fraction: progress.update(task, completed=fraction))
    console.print(f"table: {table.shape[0]} x {table.shape[1]} {table.dtype}, {table.nbytes / 2**30:.2f} GiB",
                  soft_wrap=True)
    return table


def load_table(path: Path, tensor: str | None, console: Any) -> Any:
    """A table memory-mapped read-only from a .npy, safetensors or GGUF file (or a checkpoint directory), its pages
    not read yet (:func:`read_pages`, once the run is known to fit in memory)."""
    from fastembed import Embedding
    from fastembed.formats import QuantizedTable

    try:
        embedding = Embedding.from_pretrained(path, tensor)
    except (OSError, ValueError, TypeError) as error:
        # The loaders speak to Python callers, who choose a tensor with name=; the command line has --tensor.
        message = str(error).replace("pass name=", "pass --tensor").replace("name= must be None", "leave --tensor out")
        raise ValueError(f"--table {path}: {message}") from error
    table = embedding.table
    if 0 in table.shape:
        raise ValueError(f"--table {path}: shape {tuple(table.shape)} is empty: nothing to gather")
    problem = None if isinstance(table, QuantizedTable) else dtype_problem(table.dtype)
    if problem:
        raise ValueError(f"--table {path}: {problem}")
    console.print(f"table: {path}, {table.shape[0]} x {table.shape[1]} {embedding.format if embedding.format != 'dense' else table.dtype}, "
                  f"{table.nbytes / 2**30:.2f} GiB, memory-mapped", soft_wrap=True, markup=False)
    return table


def read_pages(table: Any) -> None:
    """Read one byte per page of a mapped table, so that the page cache holds it and no contender is timed reading the
    disk."""
    import numpy as np

    from fastembed.formats import QuantizedTable

    rows = table.data if isinstance(table, QuantizedTable) else table
    np.asarray(rows).reshape(-1).view(np.uint8)[::4096].max()


def describe_table(arguments: argparse.Namespace, table: Any) -> dict[str, Any]:
    """Where the measured table came from, its shape and dtype (for the JSON report)."""
    from fastembed.formats import QuantizedTable

    source = str(arguments.table) if arguments.table is not None else "random"
    if isinstance(table, QuantizedTable):
        return {"source": source, "shape": list(table.shape), "format": table.format.name}
    return {"source": source, "shape": list(table.shape), "dtype": str(table.dtype)}


def _unusable_host_backends() -> list[tuple[str, list[str]]]:
    """The host backends that cannot run here (numba with NUMBA_NUM_THREADS=0, say), with their reasons."""
    import fastembed

    from .contenders import host_backends

    served = host_backends()
    return [(status.name, status.reasons) for status in fastembed.backend_statuses()
            if not status.available and status.name in served]


def run(arguments: argparse.Namespace, console: Any, host_table: Any, cases: list[tuple[int, str]],
        repetitions: int, contender_ids: set[str] | None = None, device: str = "cpu") -> list[dict[str, Any]]:
    """Measure every case on the host and/or the GPU; one summary row per (device, case, contender).

    ``contender_ids``: measure only these (and the limits); default: all.
    """
    from .contenders import TORCH_HINT, host_contenders, torch_installed
    from .measure import HOST, measure_case, summarise

    plans = []
    if device in ("auto", "cpu"):
        plans.append((HOST, host_table, host_contenders(arguments.backend)))
        if not torch_installed() and not contender_ids:
            console.print(TORCH_HINT, style="yellow", soft_wrap=True)
        if not arguments.backend and not contender_ids:
            for name, reasons in _unusable_host_backends():
                console.print(f"the {name} backend is not measured: {'; '.join(reasons)}", style="yellow",
                              soft_wrap=True, markup=False)
    if device == "cuda" or (device == "auto" and not arguments.cold and gpu_usable()):  # --cold: the host's caches
        from fastembed import Embedding

        from .gpu import GPU, device_name, gpu_contenders

        gpu_table = Embedding(host_table).to_device().table  # the one explicit copy to the GPU
        console.print(f"GPU: {device_name()}, table copied to the device")
        plans.append((GPU, gpu_table, gpu_contenders()))
    results = []
    for platform, table, contenders in plans:
        if contender_ids:
            contenders = [c for c in contenders if c.id in contender_ids or c.kind == "limit"]
        for batch, distribution in cases:
            console.print(f"[dim]measuring {batch} {distribution} ids on {platform.device} ...[/dim]")
            results += measure_case(table, contenders, batch, distribution, repetitions, platform=platform,
                                    cold=arguments.cold)
    return summarise(results)


def gpu_usable() -> bool:
    from fastembed.backends import cuda_backend

    return not cuda_backend.BACKEND.unavailable_reasons()


class OutputError(Exception):
    """Writing to the standard output failed (a full disk, say): the run stops with one line on stderr."""


class _GuardedOutput:
    """The standard output as the console writes it: a reader that left (a closed pipe) silences it and the run
    goes on to write its result files; any other write error stops the run as an :class:`OutputError`."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        from fastembed.info import printable

        # A path given on the command line may hold bytes that are no text in the stream's encoding.
        shown = printable(text, self._stream)
        return self._guarded(lambda: self._stream.write(shown), len(text))

    def flush(self) -> None:
        self._guarded(self._stream.flush, None)

    def _guarded(self, action: Any, silenced: Any) -> Any:
        try:
            return action()
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
            return silenced
        except OSError as error:
            raise OutputError(f"cannot write to the standard output: {error.strerror or error}") from error

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the stream's own
        return getattr(self._stream, name)


#: Signals that end a run from outside (``timeout``, a cancelled CI job, a closed terminal).
_ENDING_SIGNALS = ("SIGTERM", "SIGHUP")


class Terminated(BaseException):
    """A signal of :data:`_ENDING_SIGNALS` arrived: raised in the main thread so that the run's cleanup (its child
    processes, its temporary table copy) happens before it exits with 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _ending_signals_raise() -> Iterator[None]:
    """While the block runs, the ending signals raise :class:`Terminated` where no handler of the caller's is set.

    A default handler would end the process at once, leaving a competing load
    spinning and a temporary copy of the table on disk. Where Python drops
    the exception (the handler ran inside a finalizer), the signal is sent
    again once that code has returned, or :class:`Terminated` raised as the
    block ends, whichever comes first.
    """
    dropped: list[int] = []  # the signal of a Terminated that Python dropped, until it is raised again

    def raise_terminated(signum: int, _frame: Any) -> None:
        for number in replaced:  # a second signal must not cut the cleanup short
            signal.signal(number, signal.SIG_IGN)
        dropped.clear()
        raise Terminated(signum)

    def unraisable(report: Any) -> None:
        if not isinstance(report.exc_value, Terminated):
            previous_hook(report)
            return
        dropped[:] = [report.exc_value.signum]
        for number in replaced:  # no cleanup has begun: the run goes on until the signal comes again
            signal.signal(number, raise_terminated)  # on the main thread, as the handler that raised it ran there
        interrupts.interrupt_again(report.exc_value.signum)

    replaced = {}
    with contextlib.suppress(ValueError):  # outside the main thread no handler can be set: the signals stay as they are
        for name in _ENDING_SIGNALS:
            number = getattr(signal, name, None)
            if number is not None and signal.getsignal(number) is signal.SIG_DFL:
                replaced[number] = signal.signal(number, raise_terminated)
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for number, previous in replaced.items():
            signal.signal(number, previous)
    if dropped:  # the block ended before the signal came again
        raise Terminated(dropped[0])


def main(argv: list[str] | None = None) -> int:
    """Run ``fastembed-bench`` with `argv` (default: the command line); returns the exit status.

    SIGTERM and SIGHUP stop the run cleanly: its child processes are ended and
    its temporary files removed, and the status is 128 + the signal's number;
    so does a Ctrl-C (SIGINT, 130), with one line and no traceback.
    """
    try:
        with _ending_signals_raise():
            return _main(argv)
    except Terminated as ended:
        print(f"fastembed-bench: stopped by {signal.Signals(ended.signum).name}", file=sys.stderr)
        return 128 + ended.signum
    except KeyboardInterrupt:  # the cleanup ran on its way up
        print("fastembed-bench: stopped by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT
    except (OutputError, ResultFileError) as error:
        print(f"fastembed-bench: {error}", file=sys.stderr)
        return 1
    except MemoryError as error:  # beyond what the arguments' check foresees: the system refused an allocation
        print(f"fastembed-bench: out of memory ({error or 'an allocation was refused'}): ask for fewer --batch rows "
              "or --reps, or a smaller table", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    arguments = parse_arguments(argv)
    try:
        from rich.console import Console
    except ImportError:
        print("fastembed-bench needs the bench extra: pip install 'fastembed-gather[bench]'", file=sys.stderr)
        return 2
    # No standard output at all (closed by the shell, as under a daemon): the run still writes its result files.
    stdout = sys.stdout if sys.stdout is not None else open(os.devnull, "w")  # noqa: SIM115 - lives as long as the run
    # rich sizes it to the terminal (80 columns when not a terminal and COLUMNS is unset; a COLUMNS under 40 is not
    # taken, as rich would print nothing in 0 columns)
    width = 80 if os.environ.get("COLUMNS", "").strip().isdigit() and int(os.environ["COLUMNS"]) < 40 else None
    console = Console(file=_GuardedOutput(stdout), width=width)  # type: ignore[arg-type] # a stream by duck typing
    if arguments.device == "cuda" and not gpu_usable() and not arguments.gate:
        from fastembed.backends import cuda_backend

        print(f"fastembed-bench: --device cuda: no usable GPU: {'; '.join(cuda_backend.BACKEND.unavailable_reasons())}",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        table = build_table(arguments, console)
    except ValueError as error:
        print(f"fastembed-bench: {error}", file=sys.stderr)
        return 2
    described = describe_table(arguments, table)
    problem = _table_problem(arguments, table, described)
    if problem is None and arguments.table is not None and not described.get("format"):
        problem = memory_problem(arguments, table.shape, table.dtype.itemsize, 0)
    if problem:
        print(f"fastembed-bench: {problem}", file=sys.stderr)
        return 2
    if arguments.table is not None:
        read_pages(table)
    if arguments.gate:
        return gate(arguments, console, table, described, argv)
    if arguments.processes:
        return processes(arguments, console, table, described, argv)
    if arguments.format or described.get("format"):
        return formats(arguments, console, table, described, argv)
    if arguments.ranks:
        from . import ranks

        return ranks.main(arguments, console, table, described, argv)
    from . import report

    batches = arguments.batch or list(QUICK_BATCHES if arguments.quick else BATCHES)
    distributions = arguments.dist or ["uniform", "zipf"]
    repetitions = arguments.reps or (5 if arguments.quick else 15)
    cases = [(b, d) for d in distributions for b in batches]
    rows = run(arguments, console, table, cases, repetitions, device=arguments.device)
    report.print_table(rows, console, described)
    payload = {**report.run_facts(argv), "table": described, "repetitions": repetitions,
               "cold": arguments.cold, "results": rows}
    report.write_json(arguments.out / "results.json", payload)
    report.write_markdown(arguments.out / "results.md", rows, payload)
    plots = report.write_plots(arguments.out, rows, described)
    plotted = ", ".join(str(p) for p in plots) if plots else "no plot (matplotlib is not installed)"
    console.print(f"wrote {arguments.out / 'results.json'}, results.md and {plotted} "
                  f"in {time.perf_counter() - started:.0f} s", soft_wrap=True, markup=False)
    return 0


def _table_problem(arguments: argparse.Namespace, table: Any, described: dict[str, Any]) -> str | None:
    """What the options ask that this --table cannot give (a quantized .gguf table, a width --format cannot use)."""
    if described.get("format"):
        if (arguments.gate or arguments.processes or arguments.ranks or arguments.device == "cuda" or arguments.cold
                or arguments.backend or arguments.dist):
            return (f"--table {arguments.table} is a quantized ({described['format']}) table, measured as --format "
                    "measures: not with --gate, --processes, --ranks, --device cuda, --cold, --backend or --dist")
        if arguments.format:
            return (f"--table {arguments.table} is a quantized ({described['format']}) table, measured in its own "
                    "format: --format makes formats from a dense float16 table")
        if arguments.quick and arguments.reps:
            return (f"--table {arguments.table} is a quantized ({described['format']}) table, measured as --format "
                    "measures, where --quick chooses fewer repetitions; with --reps it has no effect: leave --quick out")
        # Its dense float16 twin is made in memory.
        return dense_twin_problem(table.shape) or formats_problem(arguments, [], table.shape, dense_twin_bytes(table.shape))
    if arguments.format:
        return quantizing_problem(arguments.format, table.shape[1], table.dtype)
    return None


def processes(arguments: argparse.Namespace, console: Any, table: Any, described: dict[str, Any],
              argv: list[str] | None) -> int:
    """The multi-process run (see :mod:`.processes`): print the table and the goals, write processes.json."""
    from . import processes as multi
    from . import report

    batches = arguments.batch or list(multi.BATCHES)
    reps = arguments.reps or multi.REPS
    with multi.saved_table(table) as path:
        runs = multi.run(path, arguments.processes, batches, reps, arguments.load,
                         progress=lambda done: console.print(f"[dim]process {done}/{arguments.processes} done[/dim]"))
    rows = multi.summarise(runs)
    verdicts = multi.goals(rows, arguments.load)
    load = ", a CPU-bound process pinned to one CPU meanwhile" if arguments.load else ""
    multi.print_report(rows, verdicts, console,
                       f"{arguments.processes} fresh processes{load}: {report.table_title(described)}")
    collections = multi.collections(runs)
    console.print(collections["summary"], soft_wrap=True, markup=False)
    report.write_json(arguments.out / "processes.json", {
        **report.run_facts(argv), "table": described, "load": arguments.load, "reps": reps,
        "reps_per_batch": {str(batch): multi.reps_for(batch, table.shape[1] * table.dtype.itemsize, reps)
                           for batch in batches},
        "results": rows, "goals": [{"goal": goal, "met": met} for goal, met in verdicts],
        "collections": collections, "samples": [run["samples"] for run in runs],
    })
    console.print(f"wrote {arguments.out / 'processes.json'}", soft_wrap=True, markup=False)
    return 0


def formats(arguments: argparse.Namespace, console: Any, table: Any, described: dict[str, Any],
            argv: list[str] | None) -> int:
    """The quantized-table run (see :mod:`.quantized`): print the table and the goals, write quantized.json."""
    from fastembed.formats import QuantizedTable
    from fastembed.tables import random_table

    from . import quantized, report

    dense_source = "the measured table"
    if isinstance(table, QuantizedTable):
        tables = {table.format.name: (table, str(arguments.table))}
        dense = random_table(table.shape[0], table.shape[1], "float16")
        dense_source = "a random float16 table of its shape"
    else:
        names = arguments.format or list(quantized.DEFAULT_FORMATS)
        console.print(f"[dim]making the {', '.join(names)} tables ...[/dim]")
        try:
            tables, dense = quantized.quantized_tables(table, names), table
        except ValueError as error:  # rows no format can hold (NaN or infinite values)
            print(f"fastembed-bench: {f'--table {arguments.table}' if arguments.table else 'the table'}: {error}",
                  file=sys.stderr)
            return 2
    batches = arguments.batch or list(quantized.BATCHES)
    repetitions = arguments.reps or (5 if arguments.quick else 15)
    rows = quantized.run(dense, tables, batches, repetitions, progress=lambda message: console.print(f"[dim]{message}[/dim]"),
                         dense_source=dense_source)
    verdicts = quantized.goals(rows)
    quantized.print_report(rows, verdicts, console, f"quantized tables: {report.table_title(described)}")
    report.write_json(arguments.out / "quantized.json", {
        **report.run_facts(argv), "table": described, "repetitions": repetitions, "results": rows,
        "goals": [{"goal": goal, "met": met} for goal, met in verdicts],
    })
    console.print(f"wrote {arguments.out / 'quantized.json'}", soft_wrap=True, markup=False)
    return 0


def gate(arguments: argparse.Namespace, console: Any, table: Any, described: dict[str, Any],
         argv: list[str] | None = None) -> int:
    """Measure the checks' cases, print and write the verdicts; 1 when any check fails, else 0."""
    from rich.markup import escape
    from rich.table import Table

    from . import processes, report
    from .gate import COLOCATED, colocated_rows, contender_ids, judge

    checks = arguments.checks
    if arguments.thresholds is None and not measures_the_default_table(arguments):
        shape = RANDOM_TABLE
        console.print(f"[yellow]the packaged thresholds are set for the default table ({shape['vocab_size']:,} x "
                      f"{shape['dim']:,} {shape['dtype']}): on another table its checks may fail by no fault of "
                      "fastembed's; give --thresholds of your own[/yellow]")
    in_process = [check for check in checks if check.metric != COLOCATED]
    cases = list(dict.fromkeys((check.batch, check.distribution) for check in in_process))
    ids = contender_ids(checks)
    repetitions = arguments.reps or arguments.gate_repetitions
    rows = run(arguments, console, table, cases, repetitions, ids) if cases else []
    if len(in_process) < len(checks) and not processes.can_move_threads():
        console.print("[yellow]co-located checks need per-thread CPU affinity (Linux): not measured here[/yellow]")
    elif len(in_process) < len(checks):
        console.print("[dim]measuring in a fresh process whose threads share one CPU ...[/dim]")
        with processes.saved_table(table) as path:
            rows += colocated_rows(checks, path, processes.REPS)
    verdicts = judge(checks, rows)
    source = arguments.thresholds or "packaged thresholds"
    result_table = Table(title=escape(f"fastembed-bench --gate ({source}) on {report.table_title(described)}"))
    for column in ("check", "metric", "measured", "threshold", "result"):
        result_table.add_column(column, justify="left" if column in ("check", "metric") else "right")
    for verdict in verdicts:
        measured = verdict.measured
        shown = "missing" if measured is None else measured if isinstance(measured, str) else f"{measured:.3f}"
        result = "[green]PASS[/green]" if verdict.passed else "[red]FAIL[/red]"
        result_table.add_row(escape(verdict.check.name), verdict.check.metric, escape(shown),
                             escape(verdict.check.threshold), result)
    report.print_readable(result_table, console)
    report.write_json(arguments.out / "gate.json", {
        **report.run_facts(argv), "table": described, "thresholds": str(source),
        # The co-located checks time single calls in their own process, whatever --reps says.
        "repetitions": repetitions, "colocated_calls_per_contender": processes.REPS,
        "verdicts": [{"check": v.check.__dict__, "measured": v.measured, "passed": v.passed} for v in verdicts],
        "results": rows,
    })
    failed = [v for v in verdicts if not v.passed]
    console.print(f"gate: {len(verdicts) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
