"""``fastembed-bench``: the benchmark (the project's main job) and the CI gate.

With no arguments: builds the default 129,280 x 4,096 float16 table, measures
every fastembed backend against numpy, torch (if installed) and the best
contiguous copy at 1, 6, 64, 1,024, 8,192 and 65,536 ids, uniform and Zipf;
where cupy sees a GPU, the same on a copy of the table on the GPU (cuda
backend against cupy, torch CUDA and a device-to-device copy, CUDA events);
prints a table and writes JSON and PNG plots into --out. ``--table PATH``
measures the same on a real table instead, memory-mapped from a .npy or
safetensors file.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

BATCHES = (1, 6, 64, 1024, 8192, 65536)
QUICK_BATCHES = (1, 6, 1024, 8192)
DEFAULT_THRESHOLDS = Path("bench/gate.toml")


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fastembed-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and repetitions (< 60 s on 2 cores)")
    parser.add_argument("--backend", help="comma-separated fastembed backends to measure (default: all available)")
    parser.add_argument("--batch", help=f"comma-separated batch sizes (default: {','.join(map(str, BATCHES))})")
    parser.add_argument("--dist", help="comma-separated id distributions: uniform, zipf (default: both)")
    parser.add_argument("--reps", type=_positive_int, help="timed repetitions per case (default 15, quick 5)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")
    parser.add_argument("--vocab-size", type=_positive_int, default=129280)
    parser.add_argument("--dim", type=_positive_int, default=4096)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--table", type=Path,
                        help="measure this table instead of a random one: a .npy or safetensors file, memory-mapped "
                             "read-only (--vocab-size, --dim and --dtype are then ignored)")
    parser.add_argument("--tensor", help="--table: the tensor's name in a safetensors file (default: the one named "
                                         "like a token embedding)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: the host, plus the GPU where one is usable (default); cpu or cuda: only that")
    parser.add_argument("--gate", action="store_true",
                        help="run the CI performance gate on the host (its cases come from --thresholds, not --batch "
                             "or --dist); exit 1 on any FAIL")
    parser.add_argument("--thresholds", type=Path, default=DEFAULT_THRESHOLDS, help="gate thresholds (TOML)")
    arguments = parser.parse_args(argv)
    if arguments.tensor is not None and (arguments.table is None or arguments.table.suffix == ".npy"):
        parser.error("--tensor names a tensor of a safetensors file given with --table")
    if arguments.gate and arguments.device == "cuda":
        # The gate judges host rows only (gate.judge): a GPU gate would silently measure the CPU.
        parser.error("--gate checks the host only; --device cuda has no gate thresholds (run without --gate)")
    return arguments


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _csv(value: str | None, default: tuple, cast=str) -> list:
    return [cast(part) for part in value.split(",")] if value else list(default)


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
    console.print(f"table: {table.shape[0]} x {table.shape[1]} {table.dtype}, {table.nbytes / 2**30:.2f} GiB")
    return table


def load_table(path: Path, tensor: str | None, console: Any) -> Any:
    """A table memory-mapped read-only from a .npy or safetensors file, its pages read once.

    Reading one byte per page brings the file into the page cache, so that
    no contender is timed reading the disk.
    """
    import numpy as np

    from fastembed import Embedding

    try:
        embedding = Embedding.from_npy(path) if path.suffix == ".npy" else Embedding.from_safetensors(path, tensor)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"--table {path}: {error}") from error
    table = embedding.table
    if 0 in table.shape:
        raise ValueError(f"--table {path}: shape {tuple(table.shape)} is empty: nothing to gather")
    np.asarray(table).reshape(-1).view(np.uint8)[::4096].max()
    console.print(f"table: {path}, {table.shape[0]} x {table.shape[1]} {table.dtype}, {table.nbytes / 2**30:.2f} GiB, "
                  "memory-mapped")
    return table


def describe_table(arguments: argparse.Namespace, table: Any) -> dict[str, Any]:
    """Where the measured table came from, its shape and dtype (for the JSON report)."""
    source = str(arguments.table) if arguments.table is not None else "random"
    return {"source": source, "shape": list(table.shape), "dtype": str(table.dtype)}


def run(arguments: argparse.Namespace, console: Any, host_table: Any, cases: list[tuple[int, str]],
        repetitions: int, contender_names: set[str] | None = None, device: str = "cpu") -> list[dict[str, Any]]:
    """Measure every case on the host and/or the GPU; one summary row per (device, case, contender)."""
    from .contenders import host_contenders
    from .measure import HOST, measure_case, summarise

    plans = []
    if device in ("auto", "cpu"):
        plans.append((HOST, host_table, host_contenders(_csv(arguments.backend, ()) or None)))
    if device == "cuda" or (device == "auto" and gpu_usable()):
        from fastembed import Embedding

        from .gpu import GPU, device_name, gpu_contenders

        gpu_table = Embedding(host_table).to_device().table  # the one explicit copy to the GPU
        console.print(f"GPU: {device_name()}, table copied to the device")
        plans.append((GPU, gpu_table, gpu_contenders()))
    results = []
    for platform, table, contenders in plans:
        if contender_names:
            contenders = [c for c in contenders if c.name in contender_names or c.kind == "limit"]
        for batch, distribution in cases:
            console.print(f"[dim]measuring {batch} {distribution} ids on {platform.device} ...[/dim]")
            results += measure_case(table, contenders, batch, distribution, repetitions, platform=platform)
    return summarise(results)


def gpu_usable() -> bool:
    from fastembed.backends import cuda_backend

    return not cuda_backend.unavailable_reasons()


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    try:
        from rich.console import Console
    except ImportError:
        print("fastembed-bench needs the bench extra: pip install 'fastembed-gather[bench]'", file=sys.stderr)
        return 2
    console = Console(width=max(Console().width, 132))
    if arguments.device == "cuda" and not gpu_usable() and not arguments.gate:
        from fastembed.backends import cuda_backend

        print(f"--device cuda: no usable GPU: {'; '.join(cuda_backend.unavailable_reasons())}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        table = build_table(arguments, console)
    except ValueError as error:
        print(f"fastembed-bench: {error}", file=sys.stderr)
        return 2
    if arguments.gate:
        return gate(arguments, console, table)
    from . import report

    batches = _csv(arguments.batch, QUICK_BATCHES if arguments.quick else BATCHES, int)
    distributions = _csv(arguments.dist, ("uniform",) if arguments.quick else ("uniform", "zipf"))
    repetitions = arguments.reps or (5 if arguments.quick else 15)
    cases = [(b, d) for d in distributions for b in batches]
    rows = run(arguments, console, table, cases, repetitions, device=arguments.device)
    report.print_table(rows, console)
    arguments.out.mkdir(parents=True, exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(["fastembed-bench", *(argv or sys.argv[1:])]),
               "machine": report.machine_facts(), "table": describe_table(arguments, table), "repetitions": repetitions,
               "results": rows}
    report.write_json(arguments.out / "results.json", payload)
    report.write_markdown(arguments.out / "results.md", rows)
    plots = report.write_plots(arguments.out, rows)
    plotted = ", ".join(str(p) for p in plots) if plots else "no plot (matplotlib is not installed)"
    console.print(f"wrote {arguments.out / 'results.json'}, results.md and {plotted} "
                  f"in {time.perf_counter() - started:.0f} s")
    return 0


def gate(arguments: argparse.Namespace, console: Any, table: Any) -> int:
    from rich.markup import escape
    from rich.table import Table

    from .gate import judge, load_checks

    checks, repetitions = load_checks(arguments.thresholds)
    cases = list(dict.fromkeys((check.batch, check.distribution) for check in checks))
    names = {check.contender for check in checks} | {check.versus for check in checks if check.versus} | {"numpy table[ids]"}
    rows = run(arguments, console, table, cases, arguments.reps or repetitions, names)
    verdicts = judge(checks, rows)
    table = Table(title=f"fastembed-bench --gate ({arguments.thresholds})")
    for column in ("check", "metric", "measured", "threshold", "result"):
        table.add_column(column, justify="left" if column in ("check", "metric") else "right")
    for verdict in verdicts:
        measured = "missing" if verdict.measured is None else f"{verdict.measured:.3f}"
        result = "[green]PASS[/green]" if verdict.passed else "[red]FAIL[/red]"
        table.add_row(escape(verdict.check.name), verdict.check.metric, measured, f">= {verdict.check.min}", result)
    console.print(table)
    arguments.out.mkdir(parents=True, exist_ok=True)
    from . import report

    report.write_json(arguments.out / "gate.json", {
        "machine": report.machine_facts(),
        "verdicts": [{"check": v.check.__dict__, "measured": v.measured, "passed": v.passed} for v in verdicts],
        "results": rows,
    })
    failed = [v for v in verdicts if not v.passed]
    console.print(f"gate: {len(verdicts) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
