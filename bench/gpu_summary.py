"""The short table and the goals: fastembed's cuda backend against the copy, torch and cupy.take.

Run by bench/gpu_check.sh after the benchmark: ``python bench/gpu_summary.py OUTDIR WIDTH...``, reading
OUTDIR/wWIDTH/results.json and writing OUTDIR/gpu-check.json.
"""
import json
import statistics
import sys
from pathlib import Path

out, widths = Path(sys.argv[1]), sys.argv[2:]
FASTEMBED, COPY, TAKE = "fastembed[cuda] out= deferred", "copy device-to-device", "cupy.take(out=)"
TORCH = ("torch index_select(out=) int64", "torch F.embedding int64", "torch F.embedding int32")
rows, verdict_rows = [], []
for width in widths:
    path = out / f"w{width}" / "results.json"
    if path.exists():
        rows += [dict(r, width=int(width)) for r in json.loads(path.read_text())["results"] if r["device"] == "cuda"]
by_key = {(r["width"], r["batch"], r["distribution"], r["contender"]): r for r in rows}


def ratio(other, mine):
    """Median over repetitions of other's time / mine (paired samples), None when other was not measured."""
    if other is None:
        return None
    return statistics.median(a / b for a, b in zip(other["samples_us"], mine["samples_us"], strict=True))


def cell(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


print(f"{'width':>5} {'ids':>6} {'dist':>7} {'fastembed us':>12} {'GB/s':>6} {'of copy':>7} "
      f"{'vs idx_sel':>10} {'vs F.emb':>8} {'vs F.emb32':>10} {'vs take':>7}")
for r in sorted((r for r in rows if r["contender"] == FASTEMBED), key=lambda r: (r["width"], r["distribution"], r["batch"])):
    key = (r["width"], r["batch"], r["distribution"])
    copy = ratio(by_key.get(key + (COPY,)), r)
    torch = [ratio(by_key.get(key + (name,)), r) for name in TORCH]
    take = ratio(by_key.get(key + (TAKE,)), r)
    measured_torch = [t for t in torch if t is not None]
    verdict_rows.append({"width": r["width"], "batch": r["batch"], "distribution": r["distribution"],
                         "median_us": r["median_us"], "of_copy": copy, "vs_torch": dict(zip(TORCH, torch, strict=True)),
                         "vs_best_torch": min(measured_torch) if measured_torch else None, "vs_cupy_take": take})
    print(f"{r['width']:>5} {r['batch']:>6} {r['distribution']:>7} {r['median_us']:>12.1f} {r['gbps']:>6.0f} "
          f"{cell(copy):>7} {cell(torch[0]):>10} {cell(torch[1]):>8} {cell(torch[2]):>10} {cell(take):>7}")


def goal(name, values, threshold):
    values = [v for v in values if v is not None]
    if not values:
        return {"goal": name, "result": "not measured"}
    return {"goal": name, "min": min(values), "threshold": threshold,
            "result": "PASS" if min(values) >= threshold else "FAIL"}


goals = [
    goal("at 65,536 ids >= 0.85 of the device-to-device copy", [v["of_copy"] for v in verdict_rows if v["batch"] == 65536], 0.85),
    goal(">= 1.0x the fastest torch at every batch size", [v["vs_best_torch"] for v in verdict_rows], 1.0),
    goal(">= 2.5x cupy.take(out=) at every batch size", [v["vs_cupy_take"] for v in verdict_rows], 2.5),
    goal(">= 2.5x cupy.take(out=) from 1,024 ids", [v["vs_cupy_take"] for v in verdict_rows if v["batch"] >= 1024], 2.5),
]
(out / "gpu-check.json").write_text(json.dumps({"rows": verdict_rows, "goals": goals}, indent=2))
print("(fastembed = its cuda backend, out=, bad-id check deferred; 'vs X' = X's time / fastembed's, paired medians)")
for g in goals:
    detail = f"min {g['min']:.2f} (>= {g['threshold']})" if "min" in g else ""
    print(f"goal: {g['goal']}: {g['result']} {detail}")
