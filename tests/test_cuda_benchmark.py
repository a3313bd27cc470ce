"""The GPU benchmark's code paths on the CuPy test double (real cupy where a GPU exists).

Numbers measured here mean nothing; what is checked is that
``fastembed-bench --device cuda`` and ``bench/gpu_check.sh`` run end to end
through the real cuda backend and write their reports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_gpu_check_dry_run_on_the_double(tmp_path):
    pytest.importorskip("rich")
    environment = dict(os.environ, FASTEMBED_GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable)
    environment.pop("OUT", None)
    run = subprocess.run(["bash", "bench/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, env=environment,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "out"
    for name in ("info.json", "gpu-tests.txt", "gpu-check.json", "w56/results.json"):
        assert (out / name).exists(), name
    assert "passed" in (out / "gpu-tests.txt").read_text()
    verdicts = json.loads((out / "gpu-check.json").read_text())
    assert {row["width"] for row in verdicts["rows"]} == {56} and len(verdicts["goals"]) == 4
    results = json.loads((out / "w56" / "results.json").read_text())["results"]  # fastembed-bench --device cuda
    names = {row["contender"] for row in results}
    assert {"fastembed[cuda] out=", "fastembed[cuda] out= deferred", "fastembed[cuda] alloc", "cupy.take(out=)",
            "copy device-to-device"} <= names
    assert all(row["device"] == "cuda" for row in results)
    assert {row["served_by"] for row in results if row["kind"] == "fastembed"} == {"cuda"}
    assert all(row["median_us"] > 0 for row in results)
    last = run.stdout.strip().splitlines()
    assert last[-1].startswith("goal: ") and any(line.startswith("width    ids") for line in last[-20:])


def test_gpu_check_takes_out_from_the_environment_too(tmp_path):
    """OUT= still names the folder when no argument is given (checked without running anything heavy)."""
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert 'out=${1:-${OUT:-gpu-check-results}}' in script
