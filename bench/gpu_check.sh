#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU where cupy, torch and numba are
# already installed: installs nothing, needs no network. pytest and rich come
# from the machine or, where it lacks them, from .gpu-deps/ (made beforehand
# by bench/gpu_deps.sh and carried along); without matplotlib the plot is skipped.
#
#   bash bench/gpu_check.sh OUTDIR          (or: OUT=OUTDIR bash bench/gpu_check.sh)
#
# Runs, writing everything under OUTDIR:
# - the CUDA tests against the real cupy: kernel compile checks, and the
#   end-to-end tests of tests/test_cuda_gpu.py, tests/test_cuda_dequant.py
#   and, with a CUDA torch, tests/test_interop_torch_cuda.py and the
#   GPU-shard tests of tests/test_distributed.py (2 ranks over gloo sharing
#   the GPU, and a one-rank NCCL group, as NCCL needs a GPU per rank);
# - the GPU benchmark (fastembed-bench --device cuda: 1 to 65,536 ids,
#   uniform and Zipf, float16 tables of width 4,096 and 7,168, fastembed's
#   cuda backend against cupy.take, torch index_select(out=) and F.embedding
#   and a device-to-device copy of the same bytes, CUDA events; results per
#   width in OUTDIR/w4096 and OUTDIR/w7168 with their PNG plots);
# - the dequantizing gather (bench/gpu_dequant.py: every block format of a
#   129,280 x 4,096 table into float16, float32 and bfloat16, checked bit for
#   bit against the reference on 64 ids, then timed against the dense float16
#   gather: OUTDIR/dequant.json);
# - a torch CUDA table (bench/gpu_torch_cuda.py: bit for bit against
#   index_select, zero-copy, on a side stream made current: OUTDIR/torch-cuda.txt);
# - a short table and the verdicts last (bench/gpu_summary.py: OUTDIR/gpu-check.json).
#
# Environment: PYTHON (default python), REPS (default 15), and
# FASTEMBED_GPU_CHECK_DRY_RUN=1: a dry run on the CuPy test double of
# tests/cupy_double (first on PYTHONPATH), tiny tables and few repetitions;
# every code path runs, no number means anything (tests/test_cuda_benchmark.py).
set -uo pipefail
out=${1:-${OUT:-gpu-check-results}}
python=${PYTHON:-python}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "${FASTEMBED_GPU_CHECK_DRY_RUN:-}" ]; then
    export PYTHONPATH="$PWD/tests/cupy_double:$PYTHONPATH"  # `import cupy` is the test double
    tests=(tests/test_cuda_gpu.py::test_lookup_matches_numpy)  # the suite runs the rest on the double already
    widths=(56)  # one odd width: the loop and every path; production measures two
    bench_args=(--vocab-size 2000 --batch 1,6,64 --reps 2)
else
    tests=(tests/test_cuda_gpu.py tests/test_interop_torch_cuda.py tests/test_cuda_dequant.py tests/test_cuda_kernel_compiled.py
           "tests/test_distributed.py::test_a_one_rank_nccl_group_on_a_gpu"
           "tests/test_distributed.py::test_gpu_shards_are_bit_exact_torch_cuda_tensors_on_the_tables_device"
           "tests/test_distributed.py::test_gpu_shards_raise_the_same_error_on_every_rank_before_any_data_collective"
           "tests/test_distributed.py::test_gpu_shards_communicate_over_the_groups_gpu_transport")
    widths=(4096 7168)
    bench_args=(--reps "${REPS:-15}")
fi

# python -c CODE ARGS..., with .gpu-deps/ at the END of sys.path: the
# machine's own packages win, the carried ones only fill the gaps.
with_deps() {
    local code=$1
    shift
    "$python" -c "import sys; sys.path.append(sys.argv.pop(1)); $code" "$PWD/.gpu-deps" "$@"
}

"$python" -m fastembed info --json > "$out/info.json"
"$python" -m fastembed info
with_deps 'import pytest; raise SystemExit(pytest.main(sys.argv[1:]))' -q -p no:cacheprovider "${tests[@]}" 2>&1 \
    | tee "$out/gpu-tests.txt"
tests_status=${PIPESTATUS[0]}

bench_status=0
for width in "${widths[@]}"; do
    with_deps 'from fastembed.benchmark import cli; raise SystemExit(cli.main(sys.argv[1:]))' --device cuda --dim "$width" --dist uniform,zipf "${bench_args[@]}" \
        --out "$out/w$width" > "$out/bench-w$width.txt" 2>&1
    status=$?
    [ "$status" -ne 0 ] && bench_status=$status
    tail -n 3 "$out/bench-w$width.txt"
    for plot in "$out/w$width"/throughput-cuda*.png; do
        [ -f "$plot" ] && cp "$plot" "$out/$(basename "${plot%.png}")-w$width.png"
    done
done

"$python" bench/gpu_dequant.py "$out" 2>&1 | tee "$out/dequant.txt"
dequant_status=${PIPESTATUS[0]}

"$python" bench/gpu_torch_cuda.py 2>&1 | tee "$out/torch-cuda.txt"
torch_status=${PIPESTATUS[0]}

echo "gpu tests exit status: $tests_status; benchmark exit status: $bench_status; dequant exit status: $dequant_status; torch cuda exit status: $torch_status"
"$python" bench/gpu_summary.py "$out" "${widths[@]}"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ] && [ "$dequant_status" -eq 0 ] && [ "$torch_status" -eq 0 ]
