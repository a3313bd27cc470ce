"""``fastembed-bench --format``: quantized tables against the dense float16 gather and the numpy reference.

Each format's table is the measured dense table quantized by fastembed
(``q8_0``, ``fp8_e4m3``), or, for the formats only llama.cpp writes (the
K-quants, Q4_0 ...), random blocks of that layout with finite scales: the
bytes a gather moves, and so its speed, do not depend on the values. A
``--table model.gguf`` is measured as it is, against a random float16 table
of its shape.

Contenders run interleaved in one process (:func:`.measure.measure_case`),
all writing with ``out=`` into one shared output per dtype: the dense float16
gather, and per format the dequantizing gather into float16, float32 and
bfloat16, and the float16 write limit: the dense float16 gather of a few
rows that stay in a core's cache (:func:`_writes_alone`), the time the
kernels' stores take here to write a float16 output, whatever is read; a
format writing with the same stores gains at most that row's ratio over the
dense gather. ``numpy reference`` is ``gguf.quants.dequantize`` of the
gathered blocks (fastembed's own reference for fp8), timed apart on at most
:data:`REFERENCE_MAX_IDS` ids with fewer repetitions (it is tens of times
slower) and compared in rows per second. Bytes moved count what a call
really reads and writes: the quantized rows (and their scales) plus the
output.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

import fastembed
from fastembed import dispatch
from fastembed.formats import FORMATS, QUANTIZERS, QuantizedTable, dequantize_rows, row_bytes
from fastembed.formats import OUTPUT_DTYPES as DEQUANTIZED_DTYPES
from fastembed.tables import random_quantized_table

from .contenders import Contender
from .measure import HOST, Result, core_cache_bytes, measure_case
from .report import print_readable

DEFAULT_FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k", "fp8_e4m3")
BATCHES = (64, 1024, 8192, 65536)
#: The output dtypes measured, the goals' float16 first.
OUTPUT_DTYPES = ("float16", *(dtype for dtype in DEQUANTIZED_DTYPES if dtype != "float16"))
#: The numpy reference is timed on at most this many ids (its rows per second do not depend on the batch).
REFERENCE_MAX_IDS = 8192
REFERENCE_REPETITIONS = 3
#: Goals: rows per second over the dense float16 gather, float16 output with out=, at 8,192 and 65,536 ids.
GOALS = {"q8_0": 1.25, "q4_0": 1.4, "q4_k": 1.4, "q6_k": 1.2, "fp8_e4m3": 1.3}
#: Goal: every format at least this many times the numpy reference's rows per second.
REFERENCE_GOAL = 10.0
#: The format name of the float16 write limit's rows.
WRITE_LIMIT = "writes"


def quantized_tables(dense: np.ndarray, names: list[str], seed: int = 0) -> dict[str, tuple[QuantizedTable, str]]:
    """Per format name: the table to measure and where it came from ("quantized by fastembed" or "random blocks")."""
    tables = {}
    for name in names:
        if name in QUANTIZERS and dense.dtype.kind == "f":
            tables[name] = (fastembed.Embedding(dense).quantize(name).table, "quantized by fastembed")
        else:
            tables[name] = (random_quantized_table(name, dense.shape[0], dense.shape[1], seed), "random blocks")
    return tables


def _into(table: Any, out_by_dtype: dict[str, np.ndarray], dtype: str) -> Callable[[Any, int], Callable]:
    def prepare(_dense: np.ndarray, n: int) -> Callable:
        out = out_by_dtype[dtype][:n]
        fastembed.lookup(table, np.zeros(n, np.int64), out=out, dtype=dtype)
        fastembed.wait_for_compiles()
        call = lambda ids: fastembed.lookup(table, ids, out=out, dtype=dtype)  # noqa: E731
        call.served_by = dispatch.explain(_storage_view(table)).backend  # type: ignore[attr-defined]
        return call

    return prepare


def cached_rows(dense: np.ndarray) -> int:
    """How many rows of `dense` the write limit gathers: as many as fill half a core's cache, at least one."""
    return max(1, min(dense.shape[0], core_cache_bytes() // 2 // (dense.shape[1] * dense.dtype.itemsize)))


def _writes_alone(out_by_dtype: dict[str, np.ndarray]) -> Callable[[Any, int], Callable]:
    """The write limit: the dense float16 gather of the table's first :func:`cached_rows` rows, which stay in the
    cache, into the same output as every float16 contender.

    Its ids are drawn once (rows in the cache cost the same whichever they
    are), so the timed call does nothing but the gather; the runner's cache
    settling before a sample makes its first reads of those rows come from
    memory, a small part of a batch of thousands of rows.
    """
    def prepare(dense: np.ndarray, n: int) -> Callable:
        source = np.ascontiguousarray(dense[:cached_rows(dense)])
        ids = np.random.default_rng(0).integers(0, source.shape[0], n)
        out = out_by_dtype["float16"][:n]
        fastembed.lookup(source, ids, out=out, dtype="float16")
        fastembed.wait_for_compiles()
        # dtype= as the dense contender passes it: both take the same steps before the gather.
        call = lambda _ids: fastembed.lookup(source, ids, out=out, dtype="float16")  # noqa: E731
        call.served_by = dispatch.explain(source).backend  # type: ignore[attr-defined]
        return call

    return prepare


def _storage_view(table: Any) -> Any:
    from fastembed import validate

    return validate.table_snapshot(table)


def _reference(table: QuantizedTable) -> Callable[[Any, int], Callable]:
    def prepare(_dense: np.ndarray, n: int) -> Callable:
        if table.format.ggml_type is None:
            return lambda ids: dequantize_rows(table.data[ids], table.scales[ids], table.format, table.dim)
        import gguf.quants
        from gguf.constants import GGMLQuantizationType

        kind = GGMLQuantizationType(table.format.ggml_type)
        return lambda ids: gguf.quants.dequantize(table.data[ids], kind)

    return prepare


def expected_rows(table: QuantizedTable, dtype: str) -> Callable[[Any, np.ndarray], np.ndarray]:
    """What a lookup of `table` into `dtype` must return: fastembed's reference rows, rounded to nearest even."""
    def expected(_dense: Any, ids: np.ndarray) -> np.ndarray:
        scales = None if table.scales is None else table.scales[ids]
        rows = dequantize_rows(table.data[ids], scales, table.format, table.dim)
        return rows.astype(fastembed.tables.resolve_dtype(dtype))

    return expected


#: float32 copies of a batch's rows that the reference dequantization holds at once while a lookup is checked (the
#: blocks' values, their product with the row scales, and the rounded copy).
REFERENCE_COPIES = 3


def held_bytes(names: list[str], shape: tuple[int, int], batch: int) -> int:
    """The memory a run of `batch` ids holds beside the dense table: the tables it quantizes (formats `names`) and
    :func:`run`'s outputs (one per output dtype, and the reference rows each lookup is checked against)."""
    rows, dim = shape
    tables = sum(rows * (FORMATS[name].row_bytes(dim) + 4 * FORMATS[name].row_scale) for name in names)
    itemsizes = [np.dtype(fastembed.tables.resolve_dtype(dtype)).itemsize for dtype in OUTPUT_DTYPES]
    return tables + batch * dim * (sum(itemsizes) + REFERENCE_COPIES * 4)


def moved_bytes(table: Any, dtype: str) -> int:
    """Bytes one row's lookup reads and writes: the stored row (and its scale) plus the output row."""
    out_bytes = table.shape[1] * np.dtype(fastembed.tables.resolve_dtype(dtype)).itemsize
    scale_bytes = 4 if isinstance(table, QuantizedTable) and table.scales is not None else 0
    return row_bytes(table) + scale_bytes + out_bytes


def run(dense: np.ndarray, tables: dict[str, tuple[QuantizedTable, str]], batches: list[int], repetitions: int,
        progress: Callable[[str], None] = lambda message: None,
        dense_source: str = "the measured table") -> list[dict[str, Any]]:
    """Measure every format at every batch; one row per (batch, format, output dtype), plus the dense baseline.

    `dense_source` says where the dense float16 table came from, for the baseline's and the write limit's rows.
    """
    largest = max(batches)
    out_by_dtype = {dtype: np.empty((largest, dense.shape[1]), fastembed.tables.resolve_dtype(dtype))
                    for dtype in OUTPUT_DTYPES}
    contenders = [Contender("dense float16 out=", "fastembed", False, _into(dense, out_by_dtype, "float16"),
                            id="dense-float16"),
                  Contender(WRITE_LIMIT, "limit", False, _writes_alone(out_by_dtype), id="float16-writes")]
    for name, (table, _source) in tables.items():
        contenders += [Contender(f"{name} -> {dtype} out=", "fastembed", False, _into(table, out_by_dtype, dtype),
                                 id=f"{name}-{dtype}", expected=expected_rows(table, dtype)) for dtype in OUTPUT_DTYPES]
    # The reference is what the others are checked against: nothing to check it against.
    references = [Contender(f"{name} numpy reference", "peer", True, _reference(table), id=f"{name}-reference",
                            expected=lambda _dense, ids: None)
                  for name, (table, _source) in tables.items()]
    # What the widest output row takes (float32: the fastembed contenders' widest and the references' rows).
    widest_row_bytes = dense.shape[1] * max(np.dtype(fastembed.tables.resolve_dtype(d)).itemsize for d in OUTPUT_DTYPES)
    rows = []
    for batch in batches:
        progress(f"measuring {batch} uniform ids ...")
        results = {r.id: r for r in measure_case(dense, contenders, batch, "uniform", repetitions, platform=HOST,
                                                 written_row_bytes=widest_row_bytes)}
        reference_batch = min(batch, REFERENCE_MAX_IDS)
        progress(f"measuring the numpy reference on {reference_batch} ids ...")
        reference = {r.id: r for r in measure_case(dense, references, reference_batch, "uniform",
                                                   REFERENCE_REPETITIONS, warmup=1, platform=HOST,
                                                   written_row_bytes=widest_row_bytes)}
        rows += _rows(results, reference, dense, tables, batch, reference_batch, dense_source)
    return rows


def _reference_facts(ref: Result, reference_batch: int) -> dict[str, Any]:
    """How the numpy reference was timed, with its samples: its figure can be checked from the JSON alone."""
    return {"reference_batch": reference_batch, "reference_samples_us": [s * 1e6 for s in ref.samples_s]}


def _rows(results: dict[str, Result], reference: dict[str, Result], dense: np.ndarray,
          tables: dict[str, tuple[QuantizedTable, str]], batch: int, reference_batch: int,
          dense_source: str) -> list[dict[str, Any]]:
    baseline = results["dense-float16"]
    rows = [_row("dense", "float16", baseline, baseline, None, dense, batch, dense_source)]
    cached = cached_rows(dense)
    rows.append({**_row(WRITE_LIMIT, "float16", results["float16-writes"], baseline, None, dense, batch,
                        f"the first {cached} rows of {dense_source}, in the cache"),
                 # The bytes it writes: its reads come from the cache.
                 "gbps_moved": batch * dense.shape[1] * 2 / results["float16-writes"].median_s / 1e9,
                 "table_mib": cached * dense.shape[1] * dense.dtype.itemsize / 2**20})
    for name, (table, source) in tables.items():
        ref = reference[f"{name}-reference"]
        ref_rows_per_s = reference_batch / ref.median_s
        for dtype in OUTPUT_DTYPES:
            rows.append({**_row(name, dtype, results[f"{name}-{dtype}"], baseline, ref_rows_per_s, table, batch,
                                source), **_reference_facts(ref, reference_batch)})
    return rows


def _row(name: str, dtype: str, result: Result, baseline: Result, reference_rows_per_s: float | None, table: Any,
         batch: int, source: str) -> dict[str, Any]:
    ratios = [b / r for b, r in zip(baseline.samples_s, result.samples_s, strict=True)]
    rows_per_s = batch / result.median_s
    return {
        "format": name, "dtype": dtype, "batch": batch, "source": source, "served_by": result.served_by,
        "median_us": result.median_s * 1e6, "rows_per_s": rows_per_s,
        "gbps_moved": batch * moved_bytes(table, dtype) / result.median_s / 1e9,
        "vs_dense_float16": statistics.median(ratios),
        "vs_numpy_reference": None if reference_rows_per_s is None else rows_per_s / reference_rows_per_s,
        "table_mib": _table_bytes(table) / 2**20, "samples_us": [s * 1e6 for s in result.samples_s],
    }


def _table_bytes(table: Any) -> int:
    return int(table.nbytes)


def goals(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """Each goal (float16 output, out=, at 8,192 and 65,536 ids) and whether the rows meet it."""
    verdicts = []
    limits = {row["batch"]: row["vs_dense_float16"] for row in rows if row["format"] == WRITE_LIMIT}  # none in older files
    for row in rows:
        if row["format"] in ("dense", WRITE_LIMIT) or row["dtype"] != "float16" or row["batch"] not in (8192, 65536):
            continue
        if row["format"] in GOALS:
            goal = GOALS[row["format"]]
            verdicts.append((f"{row['format']} at {row['batch']} ids: >= {goal}x the dense float16 rows/s "
                             f"(measured {row['vs_dense_float16']:.2f}x"
                             + (f"; writing float16 rows alone: {limits[row['batch']]:.2f}x)" if row["batch"] in limits
                                else ")"), row["vs_dense_float16"] >= goal))
        verdicts.append((f"{row['format']} at {row['batch']} ids: >= {REFERENCE_GOAL:.0f}x the numpy reference "
                         f"(measured {row['vs_numpy_reference']:.1f}x)", row["vs_numpy_reference"] >= REFERENCE_GOAL))
    return verdicts


_SHORT = {"float16": "f16", "float32": "f32", "bfloat16": "bf16"}


def _times(ratio: float | None) -> str:
    """A ratio for the table: two decimals below 10x, whole numbers above (1234x, not 1.23e+03x)."""
    if ratio is None:
        return ""
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.0f}x"


def print_report(rows: list[dict[str, Any]], verdicts: list[tuple[str, bool]], console: Any, title: str) -> None:
    """The rows as a rich table (narrow enough for 80 columns), then the goals with MET/MISS."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title), caption="us: median per lookup; GB/s: bytes read and written (writes: written); vs f16: the median over "
                                       "repetitions of the dense float16 gather's time over this one's (paired); vs "
                                       "ref: rows/s over the numpy reference's median rows/s (timed apart, on at most "
                                       f"{REFERENCE_MAX_IDS} ids, {REFERENCE_REPETITIONS} repetitions); writes: the dense "
                                       "float16 gather of rows in the cache (writing the output alone)")
    for column in ("format", "out", "ids", "by", "us", "Mrows/s", "GB/s", "vs f16", "vs ref", "MiB"):
        table.add_column(column, justify="left" if column in ("format", "out", "by") else "right", min_width=len(column))
    for row in rows:
        reference = row["vs_numpy_reference"]
        table.add_row(row["format"], _SHORT[row["dtype"]], str(row["batch"]), str(row["served_by"]),
                      f"{row['median_us']:.0f}", f"{row['rows_per_s'] / 1e6:.2f}", f"{row['gbps_moved']:.1f}",
                      f"{row['vs_dense_float16']:.2f}x", _times(reference),
                      f"{row['table_mib']:.0f}" if row["table_mib"] >= 10 else f"{row['table_mib']:.1f}")
    print_readable(table, console)
    for goal, met in verdicts:
        console.print(("[green]MET[/green]  " if met else "[red]MISS[/red] ") + goal, soft_wrap=True)
