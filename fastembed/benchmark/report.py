"""Presenting results: a rich terminal table, JSON with every sample, a PNG plot."""
from __future__ import annotations

import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

import fastembed


def machine_facts() -> dict[str, Any]:
    from fastembed.info import report

    facts = report()
    versions = {"numpy": np.__version__}
    for name in ("numba", "torch", "cupy"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    threads = None
    try:
        import numba

        threads = numba.get_num_threads()
    except ImportError:
        pass
    return {
        "fastembed": fastembed.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "cpu": facts["cpu"], "cpu_count": os.cpu_count(), "numba_threads": threads, "versions": versions,
        "backends": facts["backends"], "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


def print_table(rows: list[dict[str, Any]], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="fastembed-bench: median per call (interleaved, fresh ids); "
                        "vs fancy = numpy (cpu) or cupy (cuda) table[ids]", show_lines=False)
    for column in ("device", "batch", "ids", "contender", "median", "GB/s", "of limit", "vs fancy", "alloc/call", "mem +"):
        table.add_column(column, justify="left" if column in ("device", "contender", "ids") else "right")
    previous = None
    for row in rows:
        case = (row["device"], row["batch"], row["distribution"])
        if previous is not None and case != previous:
            table.add_section()
        previous = case
        style = "bold" if row["kind"] == "fastembed" else "dim" if row["kind"] == "limit" else ""
        table.add_row(
            row["device"], str(row["batch"]), row["distribution"], escape(row["contender"]), _time(row["median_us"]),
            f"{row['gbps']:.1f}", _ratio(row["fraction_of_limit"]),
            _ratio(row["speedup_vs_numpy"] if row["device"] == "cpu" else row["speedup_vs_cupy"], "x"),
            _bytes(row["allocated_per_call"]), _bytes(row["memory_growth"]), style=style,
        )
    console.print(table)


def _time(us: float) -> str:
    return f"{us:.1f} us" if us < 1000 else f"{us / 1000:.2f} ms"


def _ratio(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    if abs(value) < 1024:
        return f"{value} B"
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def write_markdown(path: Path, rows: list[dict[str, Any]]) -> None:
    """The same table as the terminal's, as Markdown (docs/benchmarks.md pastes it)."""
    lines = ["| device | batch | ids | contender | median | GB/s | of limit | vs fancy | alloc/call |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        speedup = row["speedup_vs_numpy"] if row["device"] == "cpu" else row["speedup_vs_cupy"]
        lines.append(
            f"| {row['device']} | {row['batch']} | {row['distribution']} | {row['contender']} | {_time(row['median_us'])} "
            f"| {row['gbps']:.1f} | {_ratio(row['fraction_of_limit'])} | {_ratio(speedup, 'x')} "
            f"| {_bytes(row['allocated_per_call'])} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=1))


def write_plots(folder: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """One throughput plot per device (uniform ids): throughput.png, throughput-cuda.png.

    Returns the paths written: none where matplotlib is not installed (a GPU
    machine may lack it; the JSON and Markdown reports carry every figure).
    """
    if importlib.util.find_spec("matplotlib") is None:
        return []
    paths = []
    for device in dict.fromkeys(r["device"] for r in rows):
        path = folder / ("throughput.png" if device == "cpu" else f"throughput-{device}.png")
        write_plot(path, [r for r in rows if r["device"] == device], title=f"fastembed-bench on {device}")
        paths.append(path)
    return paths


def write_plot(path: Path, rows: list[dict[str, Any]], distribution: str = "uniform", title: str = "fastembed-bench") -> None:
    """Throughput against batch size per contender; the best copy drawn as the limit line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    selected = [r for r in rows if r["distribution"] == distribution]
    if not selected:
        selected, distribution = rows, rows[0]["distribution"]
    figure, axes = plt.subplots(figsize=(9, 5.5))
    for name in dict.fromkeys(r["contender"] for r in selected if r["kind"] != "limit"):
        points = sorted((r["batch"], r["gbps"]) for r in selected if r["contender"] == name)
        axes.plot(*zip(*points), marker="o", label=name, linewidth=2.2 if name.startswith("fastembed") else 1.2)
    limit: dict[int, float] = {}
    for r in selected:
        if r["kind"] == "limit" and r["contender"] != "copy alloc":
            limit[r["batch"]] = max(limit.get(r["batch"], 0.0), r["gbps"])
    if limit:
        axes.plot(*zip(*sorted(limit.items())), color="black", linestyle="--", label="limit: best contiguous copy")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("ids per lookup")
    axes.set_ylabel("GB/s  (2 x rows x row bytes / time)")
    axes.set_title(f"{title}, {distribution} ids")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
