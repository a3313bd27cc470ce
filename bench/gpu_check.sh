#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU where cupy, torch and numba are
# already installed: installs nothing, needs no network. pytest and rich come
# from the machine or, where it lacks them, from .gpu-deps/ (made beforehand
# by bench/gpu_deps.sh and carried along); without matplotlib the plot is skipped.
#
#   OUT=/some/folder bash bench/gpu_check.sh
#
# Runs the CUDA tests (kernel compile checks and real-GPU tests), then the GPU
# benchmark (fastembed-bench --device cuda: 1 to 65,536 ids, uniform and Zipf,
# against a device-to-device copy, cupy and torch, CUDA events), writes
# everything under $OUT and prints a short table last.
set -uo pipefail
out=${OUT:-gpu-check-results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# python -m MODULE ARGS..., with .gpu-deps/ at the END of sys.path: the
# machine's own packages win, the carried ones only fill the gaps.
run_module() {
    python -c 'import runpy, sys; sys.path.append(sys.argv.pop(1)); del sys.argv[0]; runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)' \
        "$PWD/.gpu-deps" "$@"
}

python -m fastembed info --json > "$out/info.json"
python -m fastembed info
run_module pytest -q -p no:cacheprovider tests/test_cuda_gpu.py tests/test_cuda_kernel_compiled.py 2>&1 | tee "$out/gpu-tests.txt"
tests_status=${PIPESTATUS[0]}
run_module fastembed.benchmark.cli --device cuda --reps "${REPS:-15}" --out "$out" > "$out/bench.txt" 2>&1
bench_status=$?
tail -n 5 "$out/bench.txt"
[ -f "$out/results.json" ] && python - "$out/results.json" <<'PY'
"""The short table: fastembed's cuda backend against the limit and its peers."""
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r["device"] == "cuda"]
def median(name, batch, dist):
    return next((r["median_us"] for r in rows if r["contender"] == name and r["batch"] == batch and r["distribution"] == dist), None)
print(f"{'ids':>6} {'dist':>7} {'fastembed us':>12} {'GB/s':>7} {'of copy':>8} {'vs torch64':>10} {'vs torch32':>10} {'vs cupy.take':>12}")
for r in rows:
    if r["contender"] != "fastembed[cuda] out= deferred":
        continue
    b, d, t = r["batch"], r["distribution"], r["median_us"]
    ratio = lambda other: "-" if median(other, b, d) is None else f"{median(other, b, d) / t:.2f}"
    print(f"{b:>6} {d:>7} {t:>12.1f} {r['gbps']:>7.0f} {r['fraction_of_limit']:>8.2f} "
          f"{ratio('torch F.embedding int64'):>10} {ratio('torch F.embedding int32'):>10} {ratio('cupy.take(out=)'):>12}")
PY
echo "gpu tests exit status: $tests_status; benchmark exit status: $bench_status"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
