"""The dequantizing gather on the device: each format bit for bit on 64 ids, then timed against the dense float16 gather.

Contenders per format, interleaved with the dense float16 gather (lookup
out=, bad-id check deferred) in every repetition: the format into float16,
float32 and bfloat16 (deferred), and into float16 with the synchronising
check. "vs dense" is the paired median of dense time / format time: rows per
second against the dense gather.

Run by bench/gpu_check.sh: ``python bench/gpu_dequant.py OUTDIR`` (writes OUTDIR/dequant.json); with
FASTEMBED_GPU_CHECK_DRY_RUN set, on the CuPy test double, tiny tables and two formats.
"""
import json
import os
import statistics
import sys
from pathlib import Path

import cupy
import numpy as np

import fastembed
from fastembed.backends import cuda_backend
from fastembed.benchmark import gpu, measure
from fastembed.benchmark.contenders import Contender
from fastembed.benchmark.quantized import GOALS, expected_rows, moved_bytes
from fastembed.formats import FORMATS, dequantize_rows
from fastembed.tables import random_quantized_table

out_dir = Path(sys.argv[1])
dry = bool(os.environ.get("FASTEMBED_GPU_CHECK_DRY_RUN"))
if dry:  # every code path, two formats (a block format and fp8), few calls: numbers mean nothing
    measure.calls_per_sample = lambda batch, row_bytes: 2
vocab, dim = (2000, 512) if dry else (129280, 4096)
formats = ["q4_k", "fp8_e4m3"] if dry else list(FORMATS)
batches = [1, 64] if dry else [64, 8192, 65536]
repetitions = 2 if dry else int(os.environ.get("REPS", "15"))
try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None
DTYPES = ("float16", "float32", "bfloat16") if ml_dtypes is not None else ("float16", "float32")
BACKEND = cuda_backend.BACKEND
dense = cuda_backend.to_device(fastembed.Embedding.random(vocab, dim, "float16").table, 0)
outs = {dtype: cupy.empty((max(batches), dim), cuda_backend.DEQUANT_OUTPUTS[dtype][1]) for dtype in DTYPES}
dense_out = cupy.empty((max(batches), dim), cupy.float16)


def numpy_dtype(dtype):
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def bit_exact(host, table, dtype):
    """The device result on 64 ids against dequantize_rows (None: not checkable without ml_dtypes)."""
    if ml_dtypes is None and (dtype == "bfloat16" or host.format.row_scale):
        return None
    ids = np.random.default_rng(1).integers(0, vocab, 64)
    result = cupy.asnumpy(BACKEND.dequantize(table, cupy.asarray(ids), None, numpy_dtype(dtype)))
    scales = None if host.scales is None else host.scales[ids]
    expected = dequantize_rows(host.data[ids], scales, host.format, dim).astype(numpy_dtype(dtype))
    return bool((result.view(np.uint8) == expected.view(np.uint8)).all())


def dequantizing(table, dtype, deferred):
    def prepare(_dense, n):
        out, target = outs[dtype][:n], numpy_dtype(dtype)

        def call(ids):  # the backend's method: lookup(out=) takes no cupy bfloat16 out (cupy has no bfloat16)
            if not deferred:
                return BACKEND.dequantize(table, ids, out, target)
            with fastembed.deferred_id_checks():
                return BACKEND.dequantize(table, ids, out, target)

        call.served_by = "cuda"
        return call

    return prepare


def dense_gather(_dense, n):
    out = dense_out[:n]

    def call(ids):
        with fastembed.deferred_id_checks():
            return fastembed.lookup(dense, ids, out=out)

    call.served_by = "cuda"
    return call


rows, failures = [], []
print(f"{'format':>9} {'output':>8} {'check':>8} {'ids':>6} {'us':>9} {'GB/s':>6} {'vs dense':>8} exact")
for name in formats:
    host = random_quantized_table(name, vocab, dim, seed=1)
    table = cuda_backend.to_device(host, 0)
    exact = {dtype: bit_exact(host, table, dtype) for dtype in DTYPES}
    failures += [f"{name} -> {dtype}" for dtype, ok in exact.items() if ok is False]
    contenders = [Contender("dense float16", "fastembed", False, dense_gather, id="dense")]
    # Each contender's first rows are checked against the reference before it is timed (not without ml_dtypes for fp8).
    checkable = ml_dtypes is not None or not host.format.row_scale
    expected = {dtype: expected_rows(host, dtype) if checkable else (lambda _dense, ids: None) for dtype in DTYPES}
    contenders += [Contender(f"{name} {dtype}", "fastembed", False, dequantizing(table, dtype, True), id=dtype,
                             expected=expected[dtype]) for dtype in DTYPES]
    contenders.append(Contender(f"{name} float16 checked", "fastembed", False, dequantizing(table, "float16", False),
                                id="checked", expected=expected["float16"]))
    for batch in batches:
        results = {r.id: r for r in measure.measure_case(dense, contenders, batch, "uniform", repetitions,
                                                         platform=gpu.GPU)}
        baseline = results["dense"]
        for key, dtype, check in [(d, d, "deferred") for d in DTYPES] + [("checked", "float16", "sync")]:
            result = results[key]
            vs_dense = statistics.median(b / r for b, r in zip(baseline.samples_s, result.samples_s, strict=True))
            gbps = batch * moved_bytes(host, dtype) / result.median_s / 1e9
            rows.append({"format": name, "dtype": dtype, "check": check, "batch": batch,
                         "median_us": result.median_s * 1e6, "gbps_moved": gbps, "vs_dense_float16": vs_dense,
                         "dense_median_us": baseline.median_s * 1e6, "bit_exact": exact[dtype]})
            print(f"{name:>9} {dtype:>8} {check:>8} {batch:>6} {result.median_s * 1e6:>9.1f} {gbps:>6.0f} "
                  f"{vs_dense:>8.2f} {exact[dtype]}")
    del table

goals = []
for row in rows:
    if row["format"] in GOALS and row["dtype"] == "float16" and row["check"] == "deferred" and row["batch"] >= 8192:
        goal = GOALS[row["format"]]
        goals.append({"goal": f"{row['format']} -> float16 at {row['batch']} ids >= {goal}x the dense float16 rows/s",
                      "measured": row["vs_dense_float16"],
                      "result": "PASS" if row["vs_dense_float16"] >= goal else "FAIL"})
(out_dir / "dequant.json").write_text(json.dumps({"rows": rows, "goals": goals, "not_bit_exact": failures}, indent=2))
print("(deferred: bad-id check deferred; sync: checked before the kernel; GB/s: rows read + output written)")
for g in goals:
    print(f"dequant goal: {g['goal']}: {g['result']} ({g['measured']:.2f}x)")
print(f"dequant bit-exact on the device: {'every format and output' if not failures else 'FAIL: ' + ', '.join(failures)}")
raise SystemExit(1 if failures else 0)
