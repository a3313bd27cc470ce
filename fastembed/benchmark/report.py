"""Presenting results: a rich terminal table, JSON with every sample, a PNG plot."""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import shlex
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

import fastembed


def machine_facts() -> dict[str, Any]:
    from fastembed.info import report

    facts = report()
    versions = {"numpy": np.__version__}
    for name in ("numba", "torch", "cupy"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - not installed, or failing to load (a bad NUMBA_NUM_THREADS, say)
            pass
    threads: Any = None
    try:
        from fastembed.backends.numba_backend import thread_count

        threads = thread_count()  # the threads of a parallel lookup, as info says it; starts no threading layer
    except ImportError:
        pass
    except Exception as error:  # noqa: BLE001 - a bad NUMBA_NUM_THREADS: said, as info says it
        threads = f"unavailable: {type(error).__name__}: {error}"
    return {
        "fastembed": fastembed.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "cpu": facts["cpu"], "cpu_count": os.cpu_count(), "numba_threads": threads, "versions": versions,
        "backends": facts["backends"],
    }


def physical_memory() -> int:
    """Bytes of memory of this machine (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def run_facts(argv: list[str] | None) -> dict[str, Any]:
    """When and how a run was made, and on what: the head of every JSON file a run writes.

    Args:
        argv: the command's arguments (None: this process's own).
    """
    arguments = sys.argv[1:] if argv is None else argv
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": shlex.join(["fastembed-bench", *arguments]),
            "machine": machine_facts()}


def table_title(table: dict[str, Any] | None) -> str:
    """The measured table in words: "129280 x 4096 float16 table (random)"."""
    if not table:
        return "table"
    kind = table.get("format") or table["dtype"]
    return f"{' x '.join(map(str, table['shape']))} {kind} table ({table['source']})"


#: Terminal columns: (key, header, justify). Headers of two lines keep columns narrow.
_COLUMNS: list[tuple[str, str, Literal["left", "right"]]] = [
    ("device", "device", "left"), ("batch", "batch", "right"), ("ids", "ids", "left"),
    ("contender", "contender", "left"), ("median", "median", "right"), ("gbps", "GB/s", "right"),
    ("limit", "of its\nlimit", "right"), ("read", "of\nread", "right"), ("fancy", "vs\nfancy", "right"),
    ("alloc", "alloc\n/call", "right"), ("memory", "mem +", "right"),
]
#: Dropped in this order while the table is wider than the terminal.
_DROP_ORDER = ("memory", "alloc", "device", "read", "gbps")

#: What the ratio columns mean, per column key (the caption lists those shown).
_EXPLAINED = {
    "limit": "of its limit: the fastest way measured to produce the same output (usually a contiguous copy of as "
             "many rows; np.empty + copy for contenders that allocate) / this time, so at most 1",
    "read": "of read: the scattered read of the same rows (nothing written) / this time",
    "fancy": "vs fancy: numpy (cpu) or cupy (cuda) table[ids] / this time",
    "gbps": "GB/s: 2 x rows x row bytes / time for every row, limits included",
}


def print_table(rows: list[dict[str, Any]], console: Any, table: dict[str, Any] | None = None) -> None:
    """The results as a rich table fitted to the console's width: columns dropped (least useful first) until it fits."""
    from rich.markup import escape
    from rich.table import Table

    keys = [key for key, _, _ in _COLUMNS]
    droppable = list(_DROP_ORDER)
    if len({row["device"] for row in rows}) == 1:
        keys.remove("device")  # one device: said in the title
    else:
        droppable.remove("device")  # rows of several devices: each row says which
    cells = [_cells(row) for row in rows]
    devices = ", ".join(dict.fromkeys(row["device"] for row in rows))
    title = f"fastembed-bench on {devices}: {table_title(table)}, median per call (interleaved, fresh ids)"
    for drop in (None, *droppable):
        if drop in keys:
            keys.remove(drop)
        caption = "; ".join(text for key, text in _EXPLAINED.items() if key in keys)
        result = Table(title=escape(title), caption=escape(caption), caption_justify="left", show_lines=False)
        for key, header, justify in _COLUMNS:
            if key in keys:
                result.add_column(header, justify=justify, no_wrap=key != "contender")
        previous = None
        for row, cell in zip(rows, cells, strict=True):
            case = (row["device"], row["batch"], row["distribution"])
            if previous is not None and case != previous:
                result.add_section()
            previous = case
            style = "bold" if row["kind"] == "fastembed" else "dim" if row["kind"] == "limit" else ""
            result.add_row(*(escape(cell[key]) for key in keys), style=style)
        natural = console.measure(result, options=console.options.update(max_width=10**6)).maximum
        if natural <= console.width:
            break
    print_readable(result, console)


def print_readable(table: Any, console: Any) -> None:
    """Print a rich `table` fitted to the console if that keeps every character of it, else whole and wider.

    Fitting a table into fewer columns, rich wraps cells, which keeps them,
    but it also shortens cells to an ellipsis and can squeeze a column to
    nothing, and then the rows no longer say what they are: the table is
    printed at its natural width instead, its lines running past the console's edge.
    """
    from rich.segment import Segments

    natural = console.measure(table, options=console.options.update(max_width=10**6)).maximum
    if natural <= console.width:
        console.print(table)
        return
    fitted = console.render_lines(table, console.options, new_lines=True)
    whole = console.render_lines(table, console.options.update_width(natural), new_lines=True)
    lines = fitted if _characters_shown(fitted) == _characters_shown(whole) else whole
    console.print(Segments([segment for line in lines for segment in line]), end="", crop=False, soft_wrap=True)


def _characters_shown(lines: list[list[Any]]) -> int:
    """How many characters of a rendered table's text its lines show: neither spaces nor box drawing nor ellipses."""
    return sum(not (character.isspace() or "\u2500" <= character <= "\u257f" or character == "\u2026")
               for line in lines for segment in line for character in segment.text)


def _cells(row: dict[str, Any]) -> dict[str, str]:
    speedup = row["speedup_vs_numpy"] if row["device"] == "cpu" else row.get("speedup_vs_cupy")
    return {
        "device": row["device"], "batch": str(row["batch"]), "ids": row["distribution"], "contender": row["contender"],
        "median": _time(row["median_us"]), "gbps": f"{row['gbps']:.1f}", "limit": _ratio(row["fraction_of_limit"]),
        "read": _ratio(row.get("fraction_of_scattered_read")), "fancy": _ratio(speedup, "x"),
        "alloc": _bytes(row["allocated_per_call"]), "memory": _bytes(row["memory_growth"]),
    }


def _time(us: float) -> str:
    return f"{us:.1f} us" if us < 1000 else f"{us / 1000:.2f} ms"


def _ratio(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    if abs(value) < 1024:
        return f"{value} B"
    scaled = float(value)
    for unit in ("KiB", "MiB", "GiB"):
        scaled /= 1024
        if abs(scaled) < 1024 or unit == "GiB":
            break
    return f"{scaled:.1f} {unit}"


def write_markdown(path: Path, rows: list[dict[str, Any]], facts: dict[str, Any]) -> None:
    """The same table as the terminal's, every column and the limit's name, as Markdown (docs/benchmarks.md pastes it),
    under the run's facts: date, command, machine, table, repetitions and whether calls were timed cold."""
    machine = facts["machine"]
    lines = [f"{facts['date']}: `{facts['command']}`", "",
             f"{machine['cpu']}, {machine['cpu_count']} CPUs; {table_title(facts['table'])}; "
             f"{facts['repetitions']} repetitions{'; cold calls' if facts['cold'] else ''}", "",
             "| device | batch | ids | contender | median | GB/s | of its limit | limit | of read | vs fancy | alloc/call "
             "| mem + |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        cell = _cells(row)
        lines.append(
            f"| {row['device']} | {row['batch']} | {row['distribution']} | {row['contender']} | {cell['median']} "
            f"| {cell['gbps']} | {cell['limit']} | {row.get('limit') or '-'} | {cell['read']} | {cell['fancy']} "
            f"| {cell['alloc']} | {cell['memory']} |"
        )
    # A path given on the command line may hold bytes that are no UTF-8 (Python keeps them as lone surrogates).
    text = "\n".join(lines) + "\n"
    write_result(path, lambda where: where.write_text(text, encoding="utf-8", errors="backslashreplace"))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, indent=1)
    write_result(path, lambda where: where.write_text(text))


class ResultFileError(Exception):
    """A result file could not be written (a full disk, say): the run stops with one line on stderr."""


def write_result(path: Path, write: Callable[[Path], object]) -> None:
    """`write` the result file at `path` whole or not at all: into a new file beside it, then moved over it.

    A result that is a link is written to its target, keeping the earlier
    file's permissions. A target that is no regular file (a device, say) is
    written in place.

    Raises:
        ResultFileError: the file could not be written, with the system's reason;
            the earlier file stays as it was.
    """
    target = path.resolve()
    try:
        mode = target.stat().st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        temporary = target
    else:
        temporary = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        write(temporary)
        if temporary != target:
            if mode is not None:
                os.chmod(temporary, stat.S_IMODE(mode))
            os.replace(temporary, target)
    except BaseException as error:
        if temporary != target:
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise ResultFileError(f"cannot write {path}: {error.strerror or error}") from error
        raise


def write_plots(folder: Path, rows: list[dict[str, Any]], table: dict[str, Any] | None = None) -> list[Path]:
    """One throughput figure per device (throughput.png, throughput-cuda.png), a panel per id distribution.

    Returns the paths written: none where matplotlib is not installed (a GPU
    machine may lack it; the JSON and Markdown reports carry every figure).
    """
    if importlib.util.find_spec("matplotlib") is None:
        return []
    paths = []
    for device in dict.fromkeys(r["device"] for r in rows):
        path = folder / ("throughput.png" if device == "cpu" else f"throughput-{device}.png")
        write_plot(path, [r for r in rows if r["device"] == device],
                   title=f"fastembed-bench on {device}: {table_title(table)}")
        paths.append(path)
    return paths


def write_plot(path: Path, rows: list[dict[str, Any]], title: str = "fastembed-bench") -> None:
    """Throughput against batch size per contender, one panel per id distribution.

    The limits are drawn as lines: the best contiguous copy (dashed) and the
    scattered read of the same rows (dotted), both in GB/s as
    2 x rows x row bytes / time like every contender.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .contenders import SCATTERED_READ

    distributions = list(dict.fromkeys(r["distribution"] for r in rows))
    figure, panels = plt.subplots(1, len(distributions), figsize=(7.5 * len(distributions), 5.5), sharey=True,
                                  squeeze=False)
    for axes, distribution in zip(panels[0], distributions, strict=True):
        selected = [r for r in rows if r["distribution"] == distribution]
        for name in dict.fromkeys(r["contender"] for r in selected if r["kind"] != "limit"):
            points = sorted((r["batch"], r["gbps"]) for r in selected if r["contender"] == name)
            axes.plot(*zip(*points, strict=True), marker="o", label=name, linewidth=2.2 if name.startswith("fastembed") else 1.2)
        copy: dict[int, float] = {}
        read: dict[int, float] = {}
        for r in selected:
            if r["kind"] == "limit" and r["id"] == SCATTERED_READ:
                read[r["batch"]] = r["gbps"]
            elif r["kind"] == "limit" and not r.get("allocates_output"):
                copy[r["batch"]] = max(copy.get(r["batch"], 0.0), r["gbps"])
        if copy:
            axes.plot(*zip(*sorted(copy.items()), strict=True), color="black", linestyle="--", label="limit: best contiguous copy")
        if read:
            axes.plot(*zip(*sorted(read.items()), strict=True), color="dimgray", linestyle=":", linewidth=2,
                      label="limit: scattered read of the same rows")
        axes.set_xscale("log", base=2)
        axes.set_xlabel("ids per lookup")
        axes.set_title(f"{distribution} ids")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7)
    panels[0][0].set_ylabel("GB/s  (2 x rows x row bytes / time)")
    figure.suptitle(title.replace("$", r"\$"))  # a table's path may hold $...$, which matplotlib reads as math
    figure.tight_layout()
    try:
        write_result(path, lambda where: figure.savefig(where, dpi=110, format="png"))
    finally:
        plt.close(figure)
