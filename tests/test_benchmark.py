"""The benchmark runner and the gate: they run, they report, and the gate can fail."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from fastembed.benchmark import cli, gate
from fastembed.benchmark.ids import REFERENCE_IDS, _rank_map, id_sets
from helpers import poisoned, random_table

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--vocab-size", "2000", "--dim", "64"]


def bench(*arguments: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "fastembed.benchmark.cli", *arguments]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)


def test_id_sets_are_fresh_and_in_range():
    sets = id_sets("zipf", 1000, 5000, 3)
    assert all(s.min() >= 0 and s.max() < 5000 for s in sets)
    assert not (sets[0] == sets[1]).all()
    assert (id_sets("uniform", 6, 129280, 2)[0] == REFERENCE_IDS).all()
    with pytest.raises(ValueError, match="unknown distribution"):
        id_sets("normal", 5, 10, 1)


@pytest.mark.parametrize("vocab_size", [3, 1000, 129280])
def test_zipf_ids_follow_zipf_truncated_to_the_vocabulary(vocab_size):
    """Draws beyond the vocabulary wrapped around it, spreading the tail's mass (47% at 1,000 ranks) over every row:
    the mass of ranks 1, 2-10, 11-100 and beyond was off by 0.16-0.31."""
    step, shift = _rank_map(np.random.default_rng(0), vocab_size)  # as id_sets draws it first from its seed
    rows_by_rank = (step * np.arange(vocab_size) + shift) % vocab_size
    assert np.array_equal(np.sort(rows_by_rank), np.arange(vocab_size))  # a bijection
    rank_of_row = np.argsort(rows_by_rank)
    ids = np.concatenate(id_sets("zipf", 50_000, vocab_size, 4))
    seen = np.bincount(rank_of_row[ids], minlength=vocab_size) / ids.size
    expected = np.arange(1, vocab_size + 1, dtype=np.float64) ** -1.1
    expected /= expected.sum()
    edges = [edge for edge in (0, 1, 10, 100) if edge < vocab_size] + [vocab_size]
    for start, end in zip(edges, edges[1:], strict=False):  # sampling noise of 200,000 draws: about 0.002
        assert abs(seen[start:end].sum() - expected[start:end].sum()) < 0.01, (start, end)
    with pytest.raises(ValueError, match="a vocabulary of 1 row or more"):
        id_sets("zipf", 4, 0, 1)


@pytest.mark.parametrize("vocab_size", [1, 2, 2_000_000_000, 2**62])
def test_zipf_ids_of_a_tall_vocabulary_take_no_memory_of_its_size(vocab_size):
    """A permutation of the rows took 8 bytes per row: 16 GB for 2,000,000,000 rows, which ended the run out of memory."""
    tracemalloc.start()
    try:
        (ids,) = id_sets("zipf", 1000, vocab_size, 1, seed=vocab_size % 97)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < vocab_size
    assert peak < 2**20
    if vocab_size > 2:
        assert len(np.unique(ids)) > 1


def test_runner_writes_table_json_and_plot(tmp_path):
    result = bench(*SMALL, "--batch", "6,512", "--dist", "uniform,zipf", "--reps", "3", "--out", str(tmp_path),
                   env=dict(os.environ, COLUMNS="200"))
    assert result.returncode == 0, result.stderr
    assert "fastembed auto out=" in result.stdout and "numpy table[ids]" in result.stdout
    assert "alloc" in result.stdout.split("┡")[0] and "mem +" in result.stdout  # wide enough for the memory columns
    assert "scattered read" in result.stdout
    payload = json.loads((tmp_path / "results.json").read_text())
    rows = payload["results"]
    assert {(r["batch"], r["distribution"]) for r in rows} == {(6, "uniform"), (512, "uniform"), (6, "zipf"), (512, "zipf")}
    assert all(len(r["samples_us"]) == 3 and r["gbps"] > 0 for r in rows)
    assert payload["machine"]["cpu_count"] >= 1
    assert (tmp_path / "throughput.png").stat().st_size > 10_000
    markdown = (tmp_path / "results.md").read_text().splitlines()
    assert len(markdown) == 6 + len(rows) and "| cpu | 512 | zipf | fastembed auto out= |" in "\n".join(markdown)
    assert markdown[0].startswith(payload["date"]) and markdown[0].endswith("`" + payload["command"] + "`")
    assert markdown[2].endswith("3 repetitions") and markdown[4].endswith("| alloc/call | mem + |")
    read = next(row for row in rows if row["id"] == "read-scattered")
    assert read["kind"] == "limit" and read["gbps"] > 0 and read["contender"] == "scattered read"
    assert all(row["fraction_of_scattered_read"] > 0 for row in rows)


def test_plots_are_skipped_without_matplotlib(tmp_path, monkeypatch):
    from fastembed.benchmark import report

    rows = [{"device": "cpu", "distribution": "uniform", "contender": "numpy table[ids]", "kind": "peer",
             "batch": 6, "gbps": 1.0}]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert report.write_plots(tmp_path, rows) == []
    assert list(tmp_path.iterdir()) == []


def test_gate_thresholds_ship_with_the_package_and_load_outside_a_checkout(tmp_path):
    """The gate's loader reads the packaged thresholds from any working directory (not bench/ of a checkout)."""
    code = ("from fastembed.benchmark import gate; checks, reps = gate.load_checks(); "
            "print(len(checks), reps, sorted({c.metric for c in checks}))")
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env=environment, timeout=120)
    assert result.returncode == 0, result.stderr
    count, repetitions, metrics = result.stdout.split(" ", 2)
    assert int(count) >= 5 and int(repetitions) >= 5 and "served_by" in metrics
    checks, _ = gate.load_checks()
    assert {check.metric for check in checks} <= set(gate.METRICS)
    assert all(" " not in check.contender for check in checks)  # ids, not display names


def test_a_fraction_of_limit_check_has_the_gate_measure_every_candidate_of_its_limit():
    """The limit is the fastest contender of a class measured: measuring only those the checks named made a check's
    value move when an unrelated check was added to the file."""
    speed = gate.Check("s", "fastembed-auto-out", "speedup_vs_numpy", 64, "uniform", 1.0)
    fraction = gate.Check("f", "fastembed-auto-alloc", "fraction_of_limit", 1, "uniform", 0.5)
    assert gate.contender_ids([speed]) == {"fastembed-auto-out", "numpy-fancy"}
    assert gate.contender_ids([speed, fraction]) is None  # every contender


def test_gate_thresholds_name_contenders_that_exist():
    from fastembed.benchmark.contenders import host_contenders

    ids = {contender.id for contender in host_contenders()} | {"fastembed-numpy-out", "fastembed-numba-out"}
    checks, _ = gate.load_checks()
    assert gate.contender_ids(checks) <= ids


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("repetitions = [", "not valid TOML"),
    ("repetitions = " + "[" * 5000 + "]" * 5000 + "\n", "values nested too deep to read"),
    ("repetitions = 3\n", "no [[check]] tables"),
    ('[[check]]\nname = "x"\ncontender = "a"\nmetric = "speed"\nbatch = 8\ndistribution = "uniform"\nmin = 1\n',
     "unknown metric"),
    ('[[check]]\nname = "x"\ncontender = "a"\nmetric = "served_by"\nbatch = 8\ndistribution = "uniform"\n',
     "'expect_backend' goes with served_by"),
    ('[[check]]\nname = "x"\ncontender = "a"\nmetric = "speedup_vs_numpy"\nbatch = 8\ndistribution = "uniform"\n'
     'color = 1\nmin = 1\n', "unexpected keyword argument 'color'"),
])
def test_gate_refuses_a_bad_thresholds_file_before_building_the_table(tmp_path, content, message):
    """Exit 2 at once: the default 1 GiB table is never built (the run would take many seconds)."""
    path = tmp_path / "thresholds.toml"
    if content is not None:
        path.write_text(content)
    result = bench("--gate", "--thresholds", str(path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "building" not in result.stdout and "table:" not in result.stdout


def test_a_bad_argument_is_one_line_and_exit_2():
    """argparse put its usage lines before the error: eight lines where the README promises one."""
    result = bench("--batch", "0")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["fastembed-bench: error: argument --batch: must be 1 or more, got 0 "
                                          "(fastembed-bench --help lists the options)"]


def test_the_format_table_shows_a_ratio_under_one_as_measured():
    """A ratio of 0.16 to the numpy reference was printed as 0x."""
    from rich.console import Console

    from fastembed.benchmark import quantized

    row = {"format": "fp8_e4m3", "dtype": "float16", "batch": 1, "served_by": "numba", "median_us": 3.0,
           "rows_per_s": 3e5, "gbps_moved": 1.0, "vs_dense_float16": 0.5, "vs_numpy_reference": 0.16, "table_mib": 1.0}
    console = Console(record=True, width=200)
    quantized.print_report([row], [], console, "title")
    assert " 0.16x " in console.export_text()


def test_a_directory_as_thresholds_is_named_with_the_reason():
    """The error's own text named the descriptor it was read through, not the path."""
    with pytest.raises(ValueError) as caught:
        gate.load_checks(Path(tempfile.gettempdir()))
    assert str(caught.value) == f"--thresholds {tempfile.gettempdir()}: cannot read it: Is a directory"


_CHECK = 'name = "x"\ncontender = "fastembed-out"\nmetric = "speedup_vs_numpy"\nmin = 1\n'


@pytest.mark.parametrize("content, message", [
    ("check = [1, 2]\n", "check 1 is 1, not a [[check]] table"),
    (f'[[check]]\n{_CHECK}batch = 8\ndistribution = "foo"\n', "unknown distribution 'foo'"),
    (f'[[check]]\n{_CHECK}batch = 1000000000000\ndistribution = "uniform"\n', "batch must be an integer from 1 to"),
    (f'[[check]]\n{_CHECK}batch = 8\ndistribution = "uniform"\n'.replace('name = "x"', "name = 5"),
     "a check's name must be a string, got 5"),
    (f'[[check]]\n{_CHECK}batch = true\ndistribution = "uniform"\n', "batch must be an integer from 1 to"),
    (f'[[check]]\n{_CHECK}batch = 8\ndistribution = "uniform"\n'.replace("min = 1", "min = nan"), "a finite number 'min'"),
    (f'[[check]]\n{_CHECK}batch = 8\ndistribution = "uniform"\n'.replace("min = 1", "min = true"), "a finite number 'min'"),
    ('[[check]]\nname = "x"\ncontender = "fastembed-auto-outt"\nmetric = "speedup_vs_numpy"\nmin = 1\nbatch = 8\n'
     'distribution = "uniform"\n', "contender 'fastembed-auto-outt' is no contender"),
    ('[[check]]\nname = "x"\ncontender = "fastembed-auto-out"\nmetric = "speedup_vs_contender"\nversus = "numpy-fancyy"\n'
     'min = 1\nbatch = 8\ndistribution = "uniform"\n', "versus 'numpy-fancyy' is no contender"),
    ('[[check]]\nname = "x"\ncontender = "fastembed-auto-out"\nmetric = "served_by"\nexpect_backend = "numbaa"\n'
     'batch = 8\ndistribution = "uniform"\n', "expect_backend 'numbaa' is no backend"),
    ('[[check]]\nname = "x"\ncontender = "fastembed-auto-out"\nmetric = "served_by"\nexpect_backend = "cuda"\n'
     'batch = 8\ndistribution = "uniform"\n', "'cuda' is no backend that serves the host tables the gate measures"),
    ('[[check]]\nname = "x"\ncontender = ["a"]\nmetric = "speedup_vs_numpy"\nmin = 1\nbatch = 8\n'
     'distribution = "uniform"\n', "contender must be a string, got ['a']"),
    ('[[check]]\nname = "x"\ncontender = "fastembed-auto-out"\nmetric = "speedup_vs_contender"\nversus = {a = 1}\n'
     'min = 1\nbatch = 8\ndistribution = "uniform"\n', "versus must be a string, got {'a': 1}"),
    ('[[check]]\nname = "x"\ncontender = "fastembed-auto-out"\nmetric = "served_by"\nexpect_backend = ["numba"]\n'
     'batch = 8\ndistribution = "uniform"\n', "expect_backend must be a string, got ['numba']"),
    ("repetitions = true\n[[check]]\nname = 'x'\ncontender = 'fastembed-auto-out'\nmetric = 'speedup_vs_numpy'\n"
     "min = 1\nbatch = 8\ndistribution = 'uniform'\n", "repetitions must be an integer from 1 to 100000"),
    ("repetitons = 3\n[[check]]\nname = 'x'\ncontender = 'fastembed-auto-out'\nmetric = 'speedup_vs_numpy'\n"
     "min = 1\nbatch = 8\ndistribution = 'uniform'\n", "unknown key 'repetitons'; a thresholds file holds check and "
                                                        "repetitions"),
])
def test_gate_thresholds_are_checked_whole(tmp_path, content, message):
    path = tmp_path / "thresholds.toml"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        gate.load_checks(path)


def test_judge_passes_and_fails_on_ratios():
    check = gate.Check("c", "x", "speedup_vs_numpy", 8, "uniform", 1.5)
    rows = [{"id": "x", "batch": 8, "distribution": "uniform", "speedup_vs_numpy": 2.0}]
    assert gate.judge([check], rows)[0].passed
    rows[0]["speedup_vs_numpy"] = 1.2
    assert not gate.judge([check], rows)[0].passed
    assert not gate.judge([check], [])[0].passed  # a missing measurement fails


def test_judge_checks_the_serving_backend_exactly():
    check = gate.Check("c", "x", "served_by", 8, "uniform", expect_backend="numba")
    rows = [{"id": "x", "contender": "renamed label", "batch": 8, "distribution": "uniform", "served_by": "numba"}]
    assert gate.judge([check], rows)[0].passed  # keyed on the id: the label does not matter
    rows[0]["served_by"] = "numpy"
    verdict = gate.judge([check], rows)[0]
    assert not verdict.passed and verdict.measured == "numpy"


def _measure(table, contenders, batch, repetitions=3):
    from fastembed.benchmark.measure import measure_case, summarise

    return summarise(measure_case(table, contenders, batch, "uniform", repetitions))


def test_cold_samples_time_one_call_each_right_after_the_settling_read():
    """cold=True: every sample is one call, with no untimed call between the settling read and it."""
    from fastembed.benchmark.contenders import Contender
    from fastembed.benchmark.measure import HOST, measure_case
    from fastembed.tables import random_table

    events = []
    platform = dataclasses.replace(HOST, settle=lambda written_bytes: events.append("settle"))

    def prepare(table, n):
        return lambda ids: events.append("call")

    contender = Contender("counting", "limit", False, prepare, id="counting")  # not a lookup: no rows to check
    table = random_table(2000, 64, "float16")
    for cold in (True, False):
        events.clear()
        result = measure_case(table, [contender], 6, "uniform", 3, warmup=1, platform=platform, cold=cold)[0]
        assert len(result.samples_s) == 3
        first_sample = events.index("settle")  # before it: the untimed calls that prepare the contender
        samples = "".join("s" if event == "settle" else "c" for event in events[first_sample:])
        if cold:
            assert samples == "sc" * 4  # warm-up and timed samples alike: settle, then exactly one call
        else:
            assert all(len(run) > 2 for run in samples.split("s")[1:])  # a warm loop: an untimed call, then many


def test_timed_calls_run_with_the_garbage_collector_paused_and_it_runs_again_between_samples():
    """A collection triggered inside a timed call would be charged to whichever contender allocates: none is."""
    import gc

    from fastembed.benchmark.contenders import Contender
    from fastembed.benchmark.measure import HOST, measure_case
    from fastembed.tables import random_table

    collector_on = []
    platform = dataclasses.replace(HOST, settle=lambda written_bytes: collector_on.append(("settle", gc.isenabled())))

    def prepare(table, n):
        return lambda ids: collector_on.append(("call", gc.isenabled()))

    contender = Contender("watching", "limit", False, prepare, id="watching")
    measure_case(random_table(2000, 64, "float16"), [contender], 6, "uniform", 3, warmup=1, platform=platform,
                 cold=True)
    timed = [on for event, on in collector_on[collector_on.index(("settle", True)):] if event == "call"]
    assert timed and not any(timed)
    assert all(on for event, on in collector_on if event == "settle") and gc.isenabled()


def test_collector_paused_restores_the_callers_setting_even_on_error():
    import gc

    from fastembed.benchmark.measure import collector_paused

    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller who turned it off keeps it off
    finally:
        gc.enable()


def test_each_fastembed_row_records_the_backend_that_served_it():
    """served_by is what fastembed.select_backend reports for the prepared call: a fact, not a timing."""
    import fastembed
    from fastembed.benchmark.contenders import host_contenders
    from fastembed.tables import random_table

    table = random_table(2000, 64, "float16")
    wanted = {"fastembed-auto-out", "fastembed-auto-alloc", "fastembed-numpy-out", "numpy-fancy"}
    rows = _measure(table, [c for c in host_contenders() if c.id in wanted], 512, repetitions=1)
    served = {row["id"]: row["served_by"] for row in rows}
    out = np.empty((512, 64), np.float16)
    assert served["fastembed-auto-out"] == fastembed.select_backend(table, np.zeros(512, np.int64), out).backend
    assert served["fastembed-auto-alloc"] == fastembed.select_backend(table, np.zeros(512, np.int64)).backend
    assert served["fastembed-numpy-out"] == "numpy"
    assert served["numpy-fancy"] is None


def test_gate_fails_when_auto_does_not_pick_numba(tmp_path):
    """FASTEMBED_BACKEND=numpy: the served_by check fails, exactly, whatever the timings."""
    if not any(s.name == "numba" and s.available for s in __import__("fastembed").backend_statuses()):
        pytest.skip("numba is not available here")
    thresholds = tmp_path / "served.toml"
    thresholds.write_text('repetitions = 1\n[[check]]\nname = "auto picks numba"\ncontender = "fastembed-auto-out"\n'
                          'metric = "served_by"\nexpect_backend = "numba"\nbatch = 64\ndistribution = "uniform"\n')
    arguments = ("--gate", "--thresholds", str(thresholds), "--vocab-size", "2000", "--dim", "64")
    passed = bench(*arguments, "--out", str(tmp_path / "numba"))
    assert passed.returncode == 0, passed.stdout + passed.stderr
    failed = bench(*arguments, "--out", str(tmp_path / "numpy"), env=dict(os.environ, FASTEMBED_BACKEND="numpy"))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    written = json.loads((tmp_path / "numpy" / "gate.json").read_text())
    verdict = written["verdicts"][0]
    assert verdict["measured"] == "numpy" and not verdict["passed"]
    assert written["command"].startswith("fastembed-bench --gate --thresholds") and written["date"]
    assert written["repetitions"] == 1 and written["colocated_calls_per_contender"] > 0


#: How long a slowed contender sleeps after its lookups: hundreds of times a lookup of the test
#: table, and far longer than a descheduled thread of a busy machine stalls a call.
SLOW_CALL_S = 0.2
#: How many times a slowed contender does its real lookup per call: a slowdown that a competing
#: load (a test running beside this one) stretches as much as the lookups it is compared with.
SLOW_REPEATS = 50


def _slowed(contender, new_id=None):
    """`contender` whose every call does its real lookup SLOW_REPEATS times, then sleeps SLOW_CALL_S: a kernel slowed
    fifty times or more, on an idle machine or a busy one."""
    from dataclasses import replace

    def prepare(table, n):
        call = contender.prepare(table, n)

        def slow(ids):
            for _ in range(SLOW_REPEATS - 1):
                call(ids)
            result = call(ids)
            time.sleep(SLOW_CALL_S)
            return result

        return slow

    return replace(contender, prepare=prepare, id=new_id or contender.id, name=f"{contender.name} (slowed)")


def test_gate_ratio_checks_fail_a_slowed_kernel():
    """The packaged ratio checks of the auto contender, against a fastembed slowed fifty times or more.

    It takes the real contender's id, so the gate's own checks judge it. The
    margins are enormous: its ratios come out at a few hundredths where the
    thresholds ask for 0.5 to 2 (against the scattered read of its rows,
    numpy's backend and numpy's indexing). A second slowed copy shows that the same
    check passes when both sides do the same (a ratio of 1 give or take a
    stall of a few milliseconds in 200 or more).
    """
    from fastembed.benchmark.contenders import host_contenders
    from fastembed.tables import random_table

    table = random_table(2000, 256, "float16")
    by_id = {c.id: c for c in host_contenders()}
    limits = [c for c in by_id.values() if c.kind == "limit"]
    contenders = [_slowed(by_id["fastembed-auto-out"]), by_id["fastembed-numpy-out"], by_id["numpy-fancy"], *limits]
    checks = [c for c in gate.load_checks()[0] if c.contender == "fastembed-auto-out" and c.metric != "served_by"]
    assert {c.metric for c in checks} == {"speedup_vs_contender", "speedup_vs_numpy"}
    assert {c.versus for c in checks} >= {"read-scattered", "fastembed-numpy-out"}
    assert min(c.batch for c in checks) * 512 >= 4 * 2**20  # one call per sample: a few sleeps in all
    for batch in sorted({c.batch for c in checks}):
        rows = _measure(table, contenders, batch)
        for verdict in gate.judge([c for c in checks if c.batch == batch], rows):
            assert not verdict.passed, (verdict.check.name, verdict.measured)
            assert verdict.measured < verdict.check.min / 4, (verdict.check.name, verdict.measured)

    twins = [_slowed(by_id["fastembed-numpy-out"]), _slowed(by_id["fastembed-numpy-out"], "twin"), *limits]
    # 8192 rows of 512 bytes: one call per sample (measure.calls_per_sample), so a few sleeps in all.
    same = gate.Check("same code", "fastembed-numpy-out", "speedup_vs_contender", 8192, "uniform", 0.5, versus="twin")
    assert gate.judge([same], _measure(table, twins, 8192))[0].passed


def test_summary_groups_by_device_and_uses_each_device_baseline():
    from fastembed.benchmark.measure import Result, summarise

    def result(name, kind, seconds, device, allocates=False):
        ids = {"numpy table[ids]": "numpy-fancy"}  # the others' ids: derived from their names
        return Result(name, kind, 8, "uniform", [seconds] * 3, 1000, allocates, device=device, id=ids.get(name, ""))

    rows = summarise([
        result("fastembed auto out=", "fastembed", 2.0, "cpu"), result("numpy table[ids]", "peer", 4.0, "cpu", True),
        result("copy numba", "limit", 1.0, "cpu"), result("copy alloc", "limit", 3.0, "cpu", True),
        result("fastembed[cuda] out=", "fastembed", 0.5, "cuda"), result("cupy table[ids]", "peer", 1.5, "cuda", True),
        result("copy device-to-device", "limit", 0.25, "cuda"), result("copy alloc", "limit", 0.75, "cuda", True),
    ])
    by_name = {(r["device"], r["contender"]): r for r in rows}
    cpu, gpu = by_name[("cpu", "fastembed auto out=")], by_name[("cuda", "fastembed[cuda] out=")]
    assert cpu["fraction_of_limit"] == 0.5 and cpu["speedup_vs_numpy"] == 2.0 and cpu["speedup_vs_cupy"] is None
    assert gpu["fraction_of_limit"] == 0.5 and gpu["speedup_vs_cupy"] == 3.0 and gpu["speedup_vs_numpy"] is None
    assert by_name[("cuda", "cupy table[ids]")]["fraction_of_limit"] == 0.5  # allocating: against copy alloc
    assert gpu["best_copy"] == "copy-device-to-device"


@pytest.mark.parametrize("reps", ["0", "-1"])
def test_bench_refuses_fewer_than_one_repetition(reps):
    result = bench("--reps", reps, *SMALL)
    assert result.returncode == 2 and "--reps: must be 1 or more" in result.stderr


def test_bench_refuses_more_ranks_than_the_machine_can_run_at_once():
    """Every rank is an interpreter of its own, all at once: a huge count used to start them until the machine hung."""
    pytest.importorskip("torch")
    from fastembed.benchmark.arguments import max_ranks

    result = bench("--ranks", str(max_ranks() + 1), *SMALL)
    assert result.returncode == 2 and f"--ranks: at most {max_ranks()} here" in result.stderr, result.stderr


@pytest.mark.parametrize("option", ["--vocab-size", "--dim"])
def test_bench_refuses_an_empty_random_table(option):
    """A table without rows or columns has nothing to gather (it used to crash, or loop building id sets)."""
    result = bench(option, "0", "--batch", "6", "--reps", "1")
    assert result.returncode == 2 and f"{option}: must be 1 or more" in result.stderr


@pytest.mark.parametrize("file_format", ["npy", "NPY", "safetensors"])
def test_bench_measures_a_table_memory_mapped_from_a_file(tmp_path, file_format):
    """--table: the user's own table, memory-mapped; every contender runs on it and the JSON says which table (a
    file's ending in capitals too: it used to send a .NPY file to the safetensors loader)."""
    from fastembed.tables import random_table

    table = random_table(3000, 264, "float16", seed=3)
    path = tmp_path / f"model.{file_format}"
    if file_format.lower() == "npy":
        with open(path, "wb") as file:  # np.save would add ".npy" to a name ending ".NPY"
            np.save(file, table)
    else:
        safetensors_numpy = pytest.importorskip("safetensors.numpy")
        safetensors_numpy.save_file({"model.embed_tokens.weight": table, "lm_head.bias": np.ones(3000, np.float16)},
                                    str(path))
    result = bench("--table", str(path), "--batch", "6,512", "--dist", "uniform", "--reps", "2", "--device", "cpu",
                   "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert f"table: {path}, 3000 x 264 float16" in result.stdout
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert payload["table"] == {"source": str(path), "shape": [3000, 264], "dtype": "float16"}
    names = {row["contender"] for row in payload["results"]}
    assert {"fastembed auto out=", "numpy table[ids]", "copy numpy"} <= names
    assert all(row["gbps"] > 0 for row in payload["results"])


@pytest.mark.parametrize("kind", ["npy", "gguf"])
def test_a_table_file_is_opened_by_its_content_whatever_its_name(tmp_path, kind, capsys):
    """A .npy or GGUF file under another name was refused with advice to call a Python function."""
    from fastembed import Embedding
    from fastembed.benchmark import cli

    path = tmp_path / "table.bin"
    emb = Embedding.random(300, 64, "float16")
    if kind == "npy":
        with open(path, "wb") as file:
            np.save(file, emb.table)
        arguments = ["--batch", "6", "--dist", "uniform", "--backend", "numpy"]
    else:
        pytest.importorskip("gguf")
        emb.quantize("q8_0").save(tmp_path / "table.gguf")
        (tmp_path / "table.gguf").rename(path)
        arguments = ["--batch", "64"]
    assert cli.main(["--table", str(path), *arguments, "--reps", "1", "--out", str(tmp_path / "out")]) == 0, \
        capsys.readouterr().err
    assert f"table: {path}, 300 x 64 {'float16' if kind == 'npy' else 'q8_0'}" in capsys.readouterr().out


def test_bench_refuses_a_table_file_it_cannot_map(tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"not a safetensors file")
    result = bench("--table", str(path), "--batch", "6", "--reps", "1")
    assert result.returncode == 2
    assert f"--table {path}" in result.stderr and "Traceback" not in result.stderr
    missing = bench("--table", str(tmp_path / "missing.npy"), "--batch", "6", "--reps", "1")
    assert missing.returncode == 2 and "missing.npy" in missing.stderr and "Traceback" not in missing.stderr
    np.save(tmp_path / "empty.npy", np.zeros((0, 16), np.float16))
    empty = bench("--table", str(tmp_path / "empty.npy"), "--batch", "6", "--reps", "1", "--device", "cpu")
    assert empty.returncode == 2 and "empty" in empty.stderr and "Traceback" not in empty.stderr
    misplaced = bench("--tensor", "wte.weight", "--batch", "6", "--reps", "1")
    assert misplaced.returncode == 2 and "--tensor names a tensor of a safetensors or GGUF file" in misplaced.stderr
    np.save(tmp_path / "table.npy", np.ones((4, 8), np.float16))  # a .npy file holds one array, whatever its name
    misplaced = bench("--table", str(tmp_path / "table.npy"), "--tensor", "wte.weight", "--batch", "6", "--reps", "1")
    assert misplaced.returncode == 2 and "leave --tensor out" in misplaced.stderr, misplaced.stderr


def test_gate_refuses_the_gpu_it_does_not_judge(capsys, tmp_path):
    """The gate judges host rows only: --gate --device cuda must not quietly gate the CPU."""
    from fastembed.benchmark.arguments import parse_arguments

    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(["--gate", "--device", "cuda", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--gate checks the host only" in capsys.readouterr().err
    arguments = parse_arguments(["--gate", "--device", "cpu", "--out", str(tmp_path)])
    assert arguments.gate and arguments.checks  # the thresholds are loaded while parsing


def test_ratios_pair_samples_of_the_same_repetition():
    """A slow phase of the machine shifts medians; ratios taken within each repetition stay put."""
    from fastembed.benchmark.measure import Result, summarise

    # Everybody runs 1.8x slower in repetitions 0-2; the slow phase reaches the
    # contender in repetition 3 as well. Its median is then a slow sample while
    # numpy's is a fast one (a ratio of medians would say 1.11x), yet in six of
    # seven repetitions it was exactly 2x faster than numpy.
    numpy_times = [7.2, 7.2, 7.2, 4.0, 4.0, 4.0, 4.0]
    fastembed_times = [3.6, 3.6, 3.6, 3.6, 2.0, 2.0, 2.0]
    copy_times = [1.8, 1.8, 1.8, 1.0, 1.0, 1.0, 1.0]
    rows = summarise([
        Result("fastembed auto out=", "fastembed", 8, "uniform", fastembed_times, 1000, False),
        Result("numpy table[ids]", "peer", 8, "uniform", numpy_times, 1000, True, id="numpy-fancy"),
        Result("copy numba", "limit", 8, "uniform", copy_times, 1000, False),
    ])
    row = next(r for r in rows if r["contender"] == "fastembed auto out=")
    assert row["speedup_vs_numpy"] == 2.0 and row["fraction_of_limit"] == 0.5


def test_gpu_module_imports_without_cupy_and_device_cuda_refuses_cleanly():
    import importlib.util

    from fastembed.benchmark import gpu  # noqa: F401  (cupy is imported only when measuring)

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed")
    result = bench("--device", "cuda", *SMALL)
    assert result.returncode == 2 and result.stderr.startswith("fastembed-bench: --device cuda: no usable GPU")


@pytest.mark.parametrize("arguments, message", [
    (["--batch", "0"], "--batch: must be 1 or more, got 0"),
    (["--batch", "-5"], "--batch: must be 1 or more, got -5"),
    (["--batch", "abc"], "--batch: not an integer: 'abc'"),
    (["--batch", "6,"], "--batch: not an integer: ''"),
    (["--batch", str(2**40)], "--batch: 1099511627776 is more than"),
    (["--dist", "bogus"], "--dist: unknown 'bogus'; choose from uniform, zipf"),
    (["--dtype", "bogus"], "--dtype:"),
    (["--dtype", "object"], "--dtype: object: the benchmark measures tables of bool, integers"),
    (["--backend", "bogus"], "--backend: unknown 'bogus'; choose from"),
    (["--reps", "x"], "--reps: not an integer: 'x'"),
    (["--out", ""], "--out: an empty path"),
    (["--thresholds", "gate.toml"], "--thresholds goes with --gate"),
    (["--batch", "64,1024,64"], "--batch: 64 is given twice"),
    (["--dist", "zipf,zipf"], "--dist: zipf is given twice"),
    (["--gate", "--backend", "numba"], "--backend goes without --gate"),
    (["--gate", "--dist", "zipf"], "--dist has no effect with --gate"),
    (["--gate", "--batch", "8"], "--batch has no effect with --gate"),
    (["--processes", "2", "--quick"], "--quick has no effect with --processes"),
    (["--processes", "2", "--backend", "numpy"], "--backend has no effect with --processes"),
    (["--ranks", "2", "--dist", "zipf"], "--dist has no effect with --ranks"),
    (["--format", "q8_0", "--backend", "numpy"], "--backend has no effect with --format"),
    (["--table", "t.npy", "--dim", "8"], "--dim shapes the random table; --table measures the table in the file"),
    (["--table", "t.npy", "--dtype", "float32"], "--dtype shapes the random table"),
    (["--quick", "--batch", "8", "--reps", "3"], "--quick chooses fewer repetitions"),
    (["--format", "q8_0", "--quick", "--reps", "3"], "--quick chooses fewer repetitions"),
])
def test_bench_refuses_bad_arguments_at_once(arguments, message):
    """One line, exit 2, before any table is built (they used to crash late, or grow memory without bound)."""
    result = bench(*arguments)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("fastembed-bench: error:")
    assert "table:" not in result.stdout


@pytest.mark.parametrize("setting, words", [("bogus", "unknown backend in FASTEMBED_BACKEND='bogus'"),
                                            ("cuda", "cuda")])
def test_a_backend_setting_that_cannot_serve_the_host_is_refused_at_once(tmp_path, setting, words):
    """Exit 2 before the table is built, not a failure inside the first measurement (exit 1, like a FAIL)."""
    for arguments in ((), ("--gate",)):
        result = bench(*arguments, *SMALL, "--out", str(tmp_path), env=dict(os.environ, FASTEMBED_BACKEND=setting))
        assert result.returncode == 2, result.stdout + result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr and "table:" not in result.stdout


def test_bench_refuses_an_unwritable_out_before_measuring(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = bench("--out", str(blocker / "results"))
    assert result.returncode == 2 and f"--out {blocker / 'results'}: cannot write results there" in result.stderr
    assert "Traceback" not in result.stderr and "table:" not in result.stdout
    result = bench("--out", str(blocker))
    assert result.returncode == 2 and f"--out {blocker}: is a file, not a folder" in result.stderr
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0 and os.path.isdir("/proc/self"):  # root writes into any folder on a disk, no one into /proc's
        locked = Path("/proc/self")
    result = bench("--out", str(locked))
    assert result.returncode == 2 and "cannot write results there" in result.stderr, result.stderr


@pytest.mark.parametrize("name", ["results.json", "results.md", "throughput.png"])
def test_bench_refuses_a_result_file_it_cannot_write_before_measuring(tmp_path, name):
    """A link to a missing folder by a result's name (or a file the user cannot write) used to end the run with a
    traceback after every measurement; the check opens the file without creating or truncating it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(tmp_path / "missing" / name)
    result = bench(*SMALL, "--out", str(out))
    assert result.returncode == 2 and f"cannot write {out / name}" in result.stderr, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "table:" not in result.stdout
    assert not (tmp_path / "missing").exists()


def test_bench_refuses_a_fifo_by_a_result_name_without_waiting_for_a_reader(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "results.md")
    result = bench(*SMALL, "--out", str(out))
    assert result.returncode == 2 and f"cannot write {out / 'results.md'}" in result.stderr, result.stderr


def test_bench_leaves_a_writable_result_file_as_it_was_until_it_writes_it(tmp_path):
    from fastembed.benchmark import arguments as command_line

    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("kept")
    assert command_line._unwritable(out) is None
    assert (out / "results.json").read_text() == "kept"


def test_a_result_file_that_cannot_be_written_stops_the_run_in_one_line_and_leaves_the_earlier_one(
        tmp_path, monkeypatch, capsys):
    """A full disk after the measuring ended in a traceback, and the earlier results.json was truncated first."""
    import errno

    from fastembed.benchmark import cli

    (tmp_path / "results.json").write_text("earlier")
    real_write_text = Path.write_text

    def full_disk(self, text, *args, **kwargs):
        if self.name.startswith(".results.json."):
            real_write_text(self, text[:10], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert cli.main([*SMALL, "--batch", "1", "--dist", "uniform", "--reps", "1", "--backend", "numpy",
                     "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"fastembed-bench: cannot write {tmp_path / 'results.json'}: No space left on device\n"
    assert (tmp_path / "results.json").read_text() == "earlier"
    assert [path.name for path in tmp_path.iterdir()] == ["results.json"]  # no partial file beside it


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_result_file_linked_to_what_is_no_regular_file_is_written_in_place(tmp_path):
    """A device or a pipe by a result's name is written to, never replaced by a file of the run's."""
    import threading

    from fastembed.benchmark import report

    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "results.json").symlink_to(tmp_path / "pipe")
    received = []
    reader = threading.Thread(target=lambda: received.append((tmp_path / "pipe").read_text()))
    reader.start()
    report.write_json(tmp_path / "results.json", {"a": 1})
    reader.join(timeout=30)
    assert received == ['{\n "a": 1\n}']
    assert not (tmp_path / "pipe").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["pipe", "results.json"]


def test_a_result_file_replaced_keeps_its_permissions_and_a_failed_write_leaves_no_partial_file(tmp_path):
    from fastembed.benchmark import report

    path = tmp_path / "results.md"
    path.write_text("earlier")
    path.chmod(0o640)
    report.write_result(path, lambda where: where.write_text("new"))
    assert path.read_text() == "new" and (path.stat().st_mode & 0o777) == 0o640

    def interrupted(where):
        where.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        report.write_result(path, interrupted)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["results.md"]


def test_a_link_to_a_result_file_not_made_yet_is_fine_where_its_folder_can_be_written(tmp_path):
    from fastembed.benchmark import arguments as command_line

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "results.json").symlink_to(tmp_path / "elsewhere" / "results.json")
    assert command_line._unwritable(tmp_path) is None
    assert not (tmp_path / "elsewhere" / "results.json").exists()


def test_only_the_files_a_mode_writes_are_checked(tmp_path):
    """A stale gate.json nobody can write does not stop a main run, which never writes it."""
    from fastembed.benchmark import arguments as command_line

    os.mkfifo(tmp_path / "gate.json")  # opening it to write would fail (no reader), as a read-only file would
    main = command_line.parse_arguments([*SMALL, "--out", str(tmp_path)])
    assert "gate.json" not in command_line._result_files(main) and command_line._unwritable(tmp_path, command_line._result_files(main)) is None
    gate = command_line.parse_arguments(["--gate", "--out", str(tmp_path / "other")])
    assert command_line._result_files(gate) == ("gate.json",)
    assert "cannot write" in command_line._unwritable(tmp_path, command_line._result_files(gate))


def test_the_gpu_plot_is_checked_like_the_other_result_files(tmp_path):
    """A folder by the GPU plot's name used to pass the check and end a --device cuda run in a traceback."""
    from fastembed.benchmark import arguments as command_line

    (tmp_path / "throughput-cuda.png").mkdir()
    assert f"{tmp_path / 'throughput-cuda.png'} is a directory" in command_line._unwritable(tmp_path)


def test_an_output_cache_setting_that_is_no_byte_count_is_refused_at_once(tmp_path):
    """It used to pass, measure the small batches, then end in a traceback at the first large allocating lookup."""
    result = bench(*SMALL, "--out", str(tmp_path), env=dict(os.environ, FASTEMBED_OUTPUT_CACHE_BYTES="abc"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FASTEMBED_OUTPUT_CACHE_BYTES='abc' is not a whole number of bytes" in result.stderr
    assert "Traceback" not in result.stderr and "table:" not in result.stdout


def test_a_numba_that_is_installed_but_does_not_load_is_found_before_measuring(tmp_path):
    """Asked for by name: exit 2 naming the failure; otherwise the run measures without it (no numba contender)."""
    shadow = tmp_path / "shadow" / "numba"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("this numba is broken")\n')
    environment = dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"))
    tiny = ["--vocab-size", "100", "--dim", "16", "--batch", "1", "--dist", "uniform", "--reps", "2"]
    result = bench(*tiny, "--backend", "numba", "--out", str(tmp_path / "a"), env=environment)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--backend numba cannot run here: numba failed to load: ImportError: this numba is broken" in result.stderr
    result = bench(*tiny, "--out", str(tmp_path / "b"), env=dict(environment, FASTEMBED_BACKEND="numba"))
    assert result.returncode == 2 and "numba failed to load" in result.stderr, result.stdout + result.stderr
    result = bench(*tiny, "--out", str(tmp_path / "c"), env=environment)
    assert result.returncode == 0, result.stdout + result.stderr
    measured = {row["id"] for row in json.loads((tmp_path / "c" / "results.json").read_text())["results"]}
    assert "fastembed-numpy-out" in measured and not any("numba" in name for name in measured)


def test_output_fits_a_narrow_terminal_names_the_table_and_plots_both_distributions(tmp_path):
    environment = dict(os.environ, COLUMNS="80")
    result = bench(*SMALL, "--batch", "6,64", "--dist", "uniform,zipf", "--reps", "1", "--out", str(tmp_path),
                   env=environment)
    assert result.returncode == 0, result.stderr
    table_lines = [line for line in result.stdout.splitlines() if line[:1] in "┏┃┡│├└"]
    assert table_lines and max(len(line) for line in table_lines) <= 80
    assert "2000 x 64 float16 table (random)" in result.stdout
    assert "of its" in result.stdout
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        assert "pip install torch" in result.stdout
    assert "alloc" not in result.stdout.split("┡")[0]  # narrow: the memory columns are dropped (wide: the runner test)


def test_plot_draws_a_panel_per_distribution(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from fastembed.benchmark import report

    rows = [{"device": "cpu", "distribution": d, "id": i, "contender": i, "kind": k, "batch": b, "gbps": 1.0 + b,
             "allocates_output": False}
            for d in ("uniform", "zipf") for b in (1, 8) for i, k in
            (("fastembed-auto-out", "fastembed"), ("copy-numpy", "limit"), ("read-scattered", "limit"))]
    titles = []
    original = matplotlib.figure.Figure.savefig

    def spy(figure, *arguments, **keywords):
        titles.extend(axes.get_title() for axes in figure.axes)
        titles.append(figure._suptitle.get_text())
        labels = [line.get_label() for axes in figure.axes for line in axes.get_lines()]
        assert labels.count("limit: scattered read of the same rows") == 2
        return original(figure, *arguments, **keywords)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    table = {"source": "random", "shape": [10, 4], "dtype": "float16"}
    assert report.write_plots(tmp_path, rows, table) == [tmp_path / "throughput.png"]
    assert titles == ["uniform ids", "zipf ids", "fastembed-bench on cpu: 10 x 4 float16 table (random)"]


def test_fraction_of_limit_never_exceeds_one_and_names_the_limit():
    """Allocating rows are held to the allocating copy; anything faster than the copies becomes the limit."""
    from fastembed.benchmark.measure import Result, summarise

    rows = summarise([
        Result("fastembed auto out=", "fastembed", 8, "uniform", [2.0, 2.0, 2.0], 1000, False, id="fastembed-auto-out"),
        Result("copy numba", "limit", 8, "uniform", [1.0, 1.0, 1.0], 1000, False, id="copy-numba"),
        Result("numpy table[ids]", "peer", 8, "uniform", [1.0, 1.0, 1.0], 1000, True, id="numpy-fancy"),
        Result("fastembed auto alloc", "fastembed", 8, "uniform", [4.0, 4.0, 4.0], 1000, True, id="fastembed-auto-alloc"),
        Result("copy alloc", "limit", 8, "uniform", [2.0, 2.0, 2.0], 1000, True, id="copy-alloc"),
        Result("scattered read", "limit", 8, "uniform", [0.5, 0.5, 0.5], 1000, False, id="read-scattered"),
    ])
    by_id = {row["id"]: row for row in rows}
    assert by_id["fastembed-auto-out"]["fraction_of_limit"] == 0.5
    assert by_id["fastembed-auto-out"]["limit"] == "copy-numba"
    assert by_id["fastembed-auto-alloc"]["fraction_of_limit"] == 0.25  # numpy's fancy indexing beat the copy
    assert by_id["fastembed-auto-alloc"]["limit"] == "numpy-fancy"
    assert by_id["numpy-fancy"]["fraction_of_limit"] == 1.0
    assert by_id["copy-alloc"]["fraction_of_limit"] == 0.5
    assert all(row["fraction_of_limit"] is None or row["fraction_of_limit"] <= 1 for row in rows)
    assert by_id["read-scattered"]["fraction_of_limit"] is None
    assert by_id["fastembed-auto-out"]["fraction_of_scattered_read"] == 0.25


def test_numpy_indexes_a_mapped_table_as_the_array_it_is(tmp_path, monkeypatch):
    """On a --table, numpy table[ids] went through np.memmap's indexing, twice as slow at 1 and 6 ids as on the
    array: a baseline that fresh processes and the co-located check do not use, and the latency checks judged by."""
    from fastembed.benchmark.contenders import host_contenders

    np.save(tmp_path / "t.npy", np.arange(40, dtype=np.float32).reshape(10, 4))
    mapped = np.load(tmp_path / "t.npy", mmap_mode="r")
    fancy = next(contender for contender in host_contenders(["numpy"]) if contender.id == "numpy-fancy")
    call = fancy.prepare(mapped, 2)

    def refused(*args):
        raise AssertionError("indexed through np.memmap")

    monkeypatch.setattr(np.memmap, "__getitem__", refused)
    monkeypatch.setattr(np.memmap, "__array_wrap__", refused)
    assert np.array_equal(call(np.array([3, 1])), np.asarray(mapped)[[3, 1]])


def test_contender_ids_are_stable_and_unique():
    from fastembed.benchmark.contenders import Contender, host_contenders

    contenders = host_contenders()
    ids = [c.id for c in contenders]
    assert len(set(ids)) == len(ids)
    assert {"fastembed-auto-out", "fastembed-auto-alloc", "numpy-fancy", "copy-numpy", "copy-alloc"} <= set(ids)
    assert Contender("cupy table[ids]", "peer", True, lambda t, n: None).id == "cupy-table-ids"


def test_copy_kernels_copy_and_read_exactly():
    """The benchmark's own limit kernels: exact copies, and a scattered read that depends on every word read."""
    pytest.importorskip("numba")
    from fastembed.benchmark import copy_kernels

    rng = np.random.default_rng(1)
    source = copy_kernels.word_view(rng.integers(0, 2**16, (300, 40), dtype=np.uint16).view(np.float16))
    destination = np.zeros_like(source)
    copy_kernels.copy_parallel(source, destination)
    assert (destination == source).all()
    if copy_kernels.can_stream(destination) and __import__("platform").machine().lower() in ("x86_64", "amd64"):
        destination[:] = 0
        copy_kernels.copy_parallel_stream(source, destination, copy_kernels.ALIAS_WINDOW)
        assert (destination == source).all()
    ids = rng.integers(0, 300, 1000)
    expected = np.bitwise_xor.reduce(source[ids].reshape(-1))
    assert copy_kernels.read_scattered(source, ids) == expected
    assert copy_kernels.read_scattered(source, ids[:0]) == 0
    assert copy_kernels.read_scattered_serial(source, ids) == expected
    assert copy_kernels.read_scattered_serial(source, ids[:0]) == 0
    assert copy_kernels.word_view(np.zeros((2, 3), np.float16)).dtype == np.uint16  # 6-byte rows: 2-byte words


def test_contenders_use_no_private_backend_internals():
    source = (ROOT / "fastembed" / "benchmark" / "contenders.py").read_text()
    assert "numba_backend" not in source and "gather_cpu" not in source


def test_processes_mode_reports_spread_tails_and_goals(tmp_path):
    """--processes runs fresh interpreters and writes their samples; the numbers themselves are not judged here."""
    from fastembed.benchmark import cli

    assert cli.main(["--processes", "2", "--vocab-size", "3000", "--dim", "64", "--batch", "64,700",
                     "--reps", "5", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "processes.json").read_text())
    assert len(payload["samples"]) == 2
    collections = payload["collections"]
    assert len(collections["full_collection_ms"]) == len(collections["tracked_objects"]) == 2
    assert all(ms > 0 for ms in collections["full_collection_ms"]) and min(collections["tracked_objects"]) > 1000
    assert {(row["batch"], row["contender"]) for row in payload["results"]} == {
        (batch, name) for batch in (64, 700) for name in ("fastembed-out", "fastembed-alloc", "numpy-fancy")}
    for row in payload["results"]:
        assert len(row["median_us"]) == 2 and row["spread"] >= 1.0 and row["worst_p99_over_median"] >= 1.0
        assert row["samples_per_process"] == payload["reps_per_batch"][str(row["batch"])] == 5
    assert payload["goals"] and all(set(goal) == {"goal", "met"} for goal in payload["goals"])


def test_processes_json_says_how_many_samples_each_batch_took(tmp_path):
    """Outputs above 8 MiB take at least 15 samples whatever --reps says: the file says so, not only --reps."""
    from fastembed.benchmark import cli

    assert cli.main(["--processes", "1", "--vocab-size", "3000", "--dim", "1024", "--batch", "5000",
                     "--reps", "5", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "processes.json").read_text())
    assert payload["reps"] == 5 and payload["reps_per_batch"] == {"5000": 15}
    assert {row["samples_per_process"] for row in payload["results"]} == {15}
    assert all(len(times) == 15 for times in payload["samples"][0]["5000"].values())


def test_the_colocated_gate_check_runs_in_a_fresh_process_on_one_cpu(tmp_path):
    """The co-located check: measured in a worker whose threads were moved onto one CPU; the ratio is not judged here."""
    thresholds = tmp_path / "colocated.toml"
    thresholds.write_text('repetitions = 1\n[[check]]\nname = "co-located"\ncontender = "fastembed-out"\n'
                          'metric = "colocated_speedup_vs_numpy"\nbatch = 700\ndistribution = "uniform"\nmin = 0\n')
    result = bench("--gate", "--thresholds", str(thresholds), "--vocab-size", "3000", "--dim", "1024",
                   "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    verdict = json.loads((tmp_path / "out" / "gate.json").read_text())["verdicts"][0]
    assert verdict["passed"] and verdict["measured"] > 0


def test_a_worker_moves_every_thread_onto_one_cpu():
    """After the move, the caller and every other thread (fastembed's workers) may run on one CPU only, the same one."""
    code = textwrap.dedent("""
        import os, threading
        from fastembed.benchmark import processes
        started = threading.Event()
        threading.Thread(target=lambda: started.wait(), daemon=True).start()
        processes._move_threads_to_one_cpu()
        allowed = {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
        started.set()
        print(len(allowed), len(next(iter(allowed))))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"]


def test_a_colocated_check_must_name_a_processes_contender(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[[check]]\nname = "x"\ncontender = "fastembed-auto-out"\nmetric = "colocated_speedup_vs_numpy"\n'
                    'batch = 8\ndistribution = "uniform"\nmin = 1\n')
    with pytest.raises(ValueError, match="colocated_speedup_vs_numpy measures fastembed-out, fastembed-alloc"):
        gate.load_checks(path)


@pytest.mark.parametrize("arguments, words", [
    (["--load"], "--load goes with --processes"),
    (["--cold", "--processes", "2"], "--cold times the main benchmark's calls one by one"),
    (["--cold", "--gate"], "--cold times the main benchmark's calls one by one"),
    (["--processes", "2", "--gate"], "not with --gate"),
    (["--processes", "0"], "must be 1 or more"),
])
def test_processes_arguments_are_checked_first(arguments, words, capsys):
    from fastembed.benchmark import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(arguments)
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_the_pytest_benchmark_suite_runs():
    """bench/ holds the pytest-benchmark suite; here each of its cases runs once (--benchmark-disable)."""
    suite = Path(__file__).resolve().parent.parent / "bench"
    result = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider",
                             "--benchmark-disable", "-x"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_format_mode_measures_each_format_against_the_dense_gather_and_the_reference(tmp_path):
    """--format writes a row per (batch, format, output dtype) plus the dense baseline and the write limit; the
    numbers are not judged here."""
    from fastembed.benchmark import cli, quantized

    assert cli.main(["--format", "q8_0,q4_k,fp8_e4m3", "--vocab-size", "3000", "--dim", "256", "--batch", "16,300",
                     "--reps", "2", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "quantized.json").read_text())
    assert {(row["batch"], row["format"], row["dtype"]) for row in payload["results"]} == {
        (batch, name, dtype) for batch in (16, 300) for name in ("q8_0", "q4_k", "fp8_e4m3")
        for dtype in ("float16", "float32", "bfloat16")} | {
        (batch, name, "float16") for batch in (16, 300) for name in ("dense", "writes")}
    sources = {row["format"]: row["source"] for row in payload["results"]}
    assert sources["q8_0"] == sources["fp8_e4m3"] == "quantized by fastembed" and sources["q4_k"] == "random blocks"
    assert sources["writes"] == f"the first {quantized.cached_rows(np.empty((3000, 256), np.float16))} rows of the " \
                                "measured table, in the cache"
    for row in payload["results"]:
        assert row["rows_per_s"] > 0 and row["gbps_moved"] > 0 and row["served_by"] in ("numba", "numpy")
        assert (row["vs_numpy_reference"] is None) == (row["format"] in ("dense", "writes"))
        if row["vs_numpy_reference"] is not None:  # the reference's figure can be recomputed from the file
            rate = row["reference_batch"] / (statistics.median(row["reference_samples_us"]) * 1e-6)
            assert row["vs_numpy_reference"] == pytest.approx(row["rows_per_s"] / rate)
    q4_k = next(row for row in payload["results"] if row["format"] == "q4_k")
    assert q4_k["table_mib"] == pytest.approx(3000 * 144 / 2**20)


def test_a_quantized_gguf_table_is_measured_by_itself(tmp_path):
    from fastembed import Embedding
    from fastembed.benchmark import cli

    Embedding.random(2000, 64, "float32").quantize("q8_0").save(tmp_path / "model.gguf")
    assert cli.main(["--table", str(tmp_path / "model.gguf"), "--batch", "8", "--reps", "2", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "quantized.json").read_text())
    assert payload["table"]["format"] == "q8_0"
    assert {row["format"] for row in payload["results"]} == {"dense", "writes", "q8_0"}
    # The dense gather and the write limit read a random twin of the table, not the file: the rows say so.
    sources = {row["format"]: row["source"] for row in payload["results"]}
    assert sources["dense"] == "a random float16 table of its shape", sources
    assert sources["writes"].endswith("rows of a random float16 table of its shape, in the cache"), sources


def test_the_write_limit_gathers_rows_that_fit_half_a_cores_cache_into_the_shared_output(monkeypatch):
    """The limit writes what a float16 lookup writes, from the dense table's first rows, into the float16 output."""
    from fastembed.benchmark import quantized

    monkeypatch.setattr(quantized, "core_cache_bytes", lambda: 64 * 1024)
    dense = random_table(1000, 1024, np.float16)  # 2 KiB rows: 16 of them fill half of 64 KiB
    assert quantized.cached_rows(dense) == 16
    assert quantized.cached_rows(dense[:5]) == 5
    monkeypatch.setattr(quantized, "core_cache_bytes", lambda: 1024)
    assert quantized.cached_rows(dense) == 1  # a row wider than the cache: one row
    monkeypatch.setattr(quantized, "core_cache_bytes", lambda: 64 * 1024)
    outputs = {"float16": poisoned((300, 1024), np.float16)}
    call = quantized._writes_alone(outputs)(dense, 300)
    call(np.arange(300))  # the ids it is handed are not the ones it gathers
    written = outputs["float16"]
    rows = {row.tobytes(): index for index, row in enumerate(dense[:16])}
    assert all(row.tobytes() in rows for row in written)
    assert len({row.tobytes() for row in written}) > 8  # many of the cached rows, not one


def test_the_goal_lines_give_the_write_limit_where_the_rows_have_one():
    from fastembed.benchmark import quantized

    def row(name, batch, ratio):
        return {"format": name, "dtype": "float16", "batch": batch, "vs_dense_float16": ratio, "vs_numpy_reference":
                None if name in ("dense", "writes") else 20.0}

    rows = [row("dense", 8192, 1.0), row("writes", 8192, 1.45), row("q4_k", 8192, 1.41), row("q4_k", 65536, 1.3)]
    verdicts = dict(quantized.goals(rows))
    assert verdicts["q4_k at 8192 ids: >= 1.4x the dense float16 rows/s (measured 1.41x; writing float16 rows alone: "
                    "1.45x)"] is True
    assert verdicts["q4_k at 65536 ids: >= 1.4x the dense float16 rows/s (measured 1.30x)"] is False  # no limit row
    assert not any(goal.startswith(("dense", "writes")) for goal in verdicts)


def test_cache_sizes_come_from_sysfs_by_level_without_instruction_caches(tmp_path, monkeypatch):
    from fastembed.benchmark import measure

    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "4096K"), (2, "Unified", "2048K"),
                                                 (3, "Unified", "96M"), (2, "Unified", "oops"), (2, "Unified", "12KK"),
                                                 (2, "Unified", b"\xff8M"), (None, "Unified", "128M")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        if level is not None:  # a cache whose level cannot be read still counts for the last level
            (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_bytes(size if isinstance(size, bytes) else f"{size}\n".encode())
    monkeypatch.setattr(measure.glob, "glob", lambda pattern: sorted(str(p) for p in tmp_path.glob("index*")))
    measure._cache_sizes.cache_clear()
    try:
        assert measure._cache_sizes() == {0: 128 * 2**20, 1: 48 * 2**10, 2: 2 * 2**20, 3: 96 * 2**20}
        assert measure.core_cache_bytes() == 2 * 2**20 and measure.last_level_cache_bytes() == 128 * 2**20
        (tmp_path / "index7" / "size").write_text("8M\n")
        (tmp_path / "index7" / "level").write_text("3\n")
        measure._cache_sizes.cache_clear()
        assert measure._cache_sizes() == {1: 48 * 2**10, 2: 2 * 2**20, 3: 96 * 2**20}
        assert measure.core_cache_bytes() == 2 * 2**20 and measure.last_level_cache_bytes() == 96 * 2**20
        monkeypatch.setattr(measure.glob, "glob", lambda pattern: [])
        measure._cache_sizes.cache_clear()
        assert measure.core_cache_bytes() == 256 * 2**10 and measure.last_level_cache_bytes() == 32 * 2**20
    finally:
        measure._cache_sizes.cache_clear()


@pytest.mark.parametrize("arguments, words", [
    (["--format", "q9_9"], "--format: unknown 'q9_9'"),
    (["--format", "q8_0", "--gate"], "not with --gate"),
    (["--format", "q8_0", "--processes", "2"], "not with --gate, --processes"),
    (["--format", "q4_k", "--dim", "64"], "--format q4_k: a row of 64 values is not a whole number of its 256-value"),
    (["--format", "q8_0", "--dim", "64", "--dtype", "int8"], "--format quantizes a float table, not int8"),
    (["--format", "q8_0", "--dim", "64", "--dtype", "float32"], "the dense float16 gather, and the table is float32"),
    (["--dtype", "float8_e4m3b11fnuz"], "of ml_dtypes' dtypes only bfloat16"),
    (["--dtype", ">f2"], "not this machine's byte order"),
    (["--dtype", "longdouble"], "floats up to float64"),
    (["--vocab-size", str(10**12)], "more than this machine's memory"),
])
def test_format_arguments_are_checked_first(arguments, words, capsys):
    from fastembed.benchmark import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(arguments)
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("options, words", [(["--gate"], "not with --gate"), (["--processes", "1"], "not with --gate"),
                                            (["--cold"], "not with --gate"), (["--format", "q4_0"], "in its own format"),
                                            (["--dist", "zipf"], "--backend or --dist"),
                                            (["--backend", "numpy"], "--backend or --dist"),
                                            (["--quick", "--reps", "3"], "leave --quick out")])
def test_a_quantized_gguf_table_refuses_the_modes_that_measure_dense_tables(tmp_path, options, words, capsys):
    from fastembed import Embedding
    from fastembed.benchmark import cli

    Embedding.random(2000, 64, "float32").quantize("q8_0").save(tmp_path / "model.gguf")
    assert cli.main(["--table", str(tmp_path / "model.gguf"), *options, "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "is a quantized (q8_0) table" in error and words in error


def test_a_host_backend_that_cannot_run_is_named_with_its_reason(tmp_path):
    environment = dict(os.environ, NUMBA_NUM_THREADS="0")  # numba refuses to load
    result = bench("--vocab-size", "100", "--dim", "8", "--batch", "4", "--dist", "uniform", "--reps", "2",
                   "--out", str(tmp_path), env=environment)
    assert result.returncode == 0, result.stderr
    assert "the numba backend is not measured: numba failed to load" in result.stdout


def test_a_quantized_table_whose_dense_twin_would_not_fit_is_refused_before_it_is_built(tmp_path, monkeypatch, capsys):
    from fastembed import Embedding
    from fastembed.benchmark import arguments, cli

    Embedding.random(2000, 64, "float32").quantize("q8_0").save(tmp_path / "model.gguf")
    monkeypatch.setattr(arguments, "_physical_memory", lambda: 2000 * 64 * 2 - 1)  # one byte short of the float16 twin
    assert cli.main(["--table", str(tmp_path / "model.gguf"), "--batch", "4", "--out", str(tmp_path)]) == 2
    assert "the dense float16 table of 2000 x 64" in capsys.readouterr().err
    monkeypatch.setattr(arguments, "_physical_memory", lambda: 2000 * 64 * 2 + 2**20)  # the twin, not the outputs
    assert cli.main(["--table", str(tmp_path / "model.gguf"), "--batch", "4096", "--out", str(tmp_path)]) == 2
    assert "4096 ids of 64 values: the outputs" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_the_table_the_worker_processes_map_has_the_tables_dtype_and_bytes(dtype):
    """numpy writes float8_e5m2 into a .npy header it cannot read back: the worker processes failed on such tables."""
    from fastembed.benchmark import processes
    from fastembed.tables import random_table as table_of

    table = table_of(10, 4, dtype)
    with processes.saved_table(table) as path:
        mapped = processes.mapped_table(str(path))
        assert mapped.dtype == table.dtype and mapped.tobytes() == table.tobytes()
        del mapped


def test_a_table_path_with_markup_and_bytes_that_are_no_utf8_is_reported_as_it_is(tmp_path, capsys):
    """A path's $...$ broke the plot (matplotlib's math), its [/b] the quantized report (rich markup), a byte that
    is no UTF-8 the Markdown file: after all the measuring."""
    from fastembed import Embedding
    from fastembed.benchmark import cli

    folder = tmp_path / "[" / "b] $x^$"  # the path holds "[/b] $x^$"
    folder.mkdir(parents=True)
    np.save(folder / "t.npy", random_table(300, 16))
    out = Path(os.fsdecode(bytes(tmp_path) + b"/out\xff"))
    assert cli.main(["--table", str(folder / "t.npy"), "--batch", "4", "--dist", "uniform", "--reps", "2",
                     "--backend", "numpy", "--out", str(out)]) == 0
    assert {"results.json", "results.md", "throughput.png"} <= {path.name for path in out.iterdir()}
    markdown = (out / "results.md").read_text()
    assert "[/b] $x^$" in markdown and "out\\udcff" in markdown  # the byte as Python holds it, escaped
    Embedding.random(300, 64, "float32").quantize("q8_0").save(folder / "q.gguf")
    assert cli.main(["--table", str(folder / "q.gguf"), "--batch", "4", "--reps", "2", "--out", str(out)]) == 0
    assert "[/b]" in capsys.readouterr().out and (out / "quantized.json").exists()


@pytest.mark.parametrize("dtype", [">f2", "U2"])
def test_a_table_file_of_a_dtype_the_contenders_cannot_take_is_refused(tmp_path, dtype, capsys):
    from fastembed.benchmark import cli

    np.save(tmp_path / "table.npy", np.zeros((100, 8), dtype))
    assert cli.main(["--table", str(tmp_path / "table.npy"), "--quick", "--out", str(tmp_path / "out")]) == 2
    assert f"--table {tmp_path / 'table.npy'}: " in capsys.readouterr().err


def test_float8_tables_are_measured_against_torch_too(tmp_path):
    pytest.importorskip("torch")
    from fastembed.benchmark import cli

    assert cli.main(["--dtype", "float8_e4m3fn", "--vocab-size", "2000", "--dim", "64", "--batch", "6", "--dist",
                     "uniform", "--reps", "2", "--out", str(tmp_path)]) == 0
    contenders = {row["id"] for row in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert any(name.startswith("torch") for name in contenders)


def test_a_result_file_name_taken_by_a_directory_is_refused_before_measuring(tmp_path, capsys):
    from fastembed.benchmark import cli

    (tmp_path / "results.json").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--quick", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "results.json is a directory" in capsys.readouterr().err


def test_caches_are_settled_where_a_sample_writes_a_quarter_of_the_cache_or_a_call_is_cold(monkeypatch):
    """The settling read runs for cold calls and for samples that write at least a quarter of the cache."""
    from fastembed.benchmark import measure

    monkeypatch.setattr(measure, "last_level_cache_bytes", lambda: 32 * 2**20)
    monkeypatch.setattr(measure, "_scrub_buffer", None)
    measure.settle_host_caches(8 * 2**20 - 1)
    assert measure._scrub_buffer is None
    for written_bytes in (8 * 2**20, None):
        monkeypatch.setattr(measure, "_scrub_buffer", None)
        measure.settle_host_caches(written_bytes)
        assert measure._scrub_buffer is not None and measure._scrub_buffer.nbytes == 64 * 2**20


def test_id_pools_span_a_few_times_a_small_table_and_more_than_the_cache_of_a_large_one():
    from fastembed.benchmark.measure import POOL_MIN_BYTES, pool_size

    many = 10**6  # calls enough that the span alone counts
    assert pool_size(1, 128, 1, 3, 2, table_rows=2000, contenders=many) == 4 * 2000  # not millions for a 256 KiB table
    assert pool_size(1, 8192, 1, 3, 2, table_rows=129280, contenders=many) == POOL_MIN_BYTES // 8192
    assert pool_size(4096, 8192, 1, 3, 2, table_rows=129280, contenders=many) == 13  # at least one set per sample
    assert pool_size(1, 8192, 1, 3, 2, table_rows=129280, cache_bytes=480 * 2**20,
                     contenders=many) == 2 * 480 * 2**20 // 8192


def test_an_id_pool_holds_no_more_sets_than_the_case_reads():
    """Narrow rows at small batches drew millions of sets that no call read (a 1 MiB table: 4.2 million, 1.7 GiB)."""
    from fastembed.benchmark.measure import pool_size

    inner, repetitions, warmup, contenders = 200, 15, 2, 12
    calls = (warmup + repetitions) * contenders * inner
    assert pool_size(1, 1, inner, repetitions, warmup, table_rows=2**20, contenders=contenders) == calls
    assert pool_size(1, 1, 1, 3, 2, table_rows=2**20, contenders=1) == 8 + 3 + 2  # still one set per sample


def test_a_case_draws_one_id_set_per_call_it_makes(monkeypatch):
    """Every set the pool holds is read: a pool of one set per call, each contender's, in every repetition."""
    from fastembed.benchmark import measure
    from fastembed.benchmark.contenders import Contender

    drawn, read = [], []
    real_id_sets = measure.id_sets

    def recording_id_sets(*args, **kwargs):
        drawn.extend(real_id_sets(*args, **kwargs))
        return drawn

    def prepare(table, batch):
        return lambda ids: read.append(ids.tobytes()) or table[ids]

    monkeypatch.setattr(measure, "id_sets", recording_id_sets)
    table = np.arange(2**16, dtype=np.uint8).reshape(-1, 1)  # one-byte rows: a sample is 200 calls
    contenders = [Contender(f"c{index}", "peer", True, prepare, id=f"c{index}", id_dtype="int64") for index in range(3)]
    measure.measure_case(table, contenders, 1, "uniform", repetitions=4, warmup=1)
    assert len(drawn) == (1 + 4) * 3 * 200  # one per timed or warm-up call
    assert set(read) == {ids.tobytes() for ids in drawn}  # each read


def test_the_settling_read_is_told_what_a_sample_writes_or_that_the_call_is_cold():
    from fastembed.benchmark.contenders import Contender
    from fastembed.benchmark.measure import HOST, calls_per_sample, measure_case
    from fastembed.tables import random_table

    received = []
    platform = dataclasses.replace(HOST, settle=received.append)
    contender = Contender("nothing", "limit", False, lambda table, n: (lambda ids: None), id="nothing")  # no rows
    table = random_table(2000, 64, "float16")
    measure_case(table, [contender], 6, "uniform", 2, warmup=1, platform=platform)
    assert received == [calls_per_sample(6, 128) * 6 * 128] * 3
    received.clear()
    measure_case(table, [contender], 6, "uniform", 2, warmup=1, platform=platform, written_row_bytes=256)
    assert received == [calls_per_sample(6, 128) * 6 * 256] * 3
    received.clear()
    measure_case(table, [contender], 6, "uniform", 2, warmup=1, platform=platform, cold=True)
    assert received == [None] * 3


def test_rank_report_sizes_and_times_never_use_exponents():
    from fastembed.benchmark import ranks

    assert ranks._bytes(1010 * 2**10) == "1010 KiB" and ranks._bytes(5.5 * 2**20) == "5.5 MiB"
    assert ranks._time(1_234_567) == "1.23 s" and ranks._time(999_000) == "999 ms" and ranks._time(12) == "12 us"
    assert ranks._time(999_600) == "1 s" and ranks._bytes(999.7 * 2**20) == "1000 MiB" and ranks._time(999.7) == "1 ms"


def test_a_table_file_without_an_embedding_name_asks_for_tensor_not_name(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    safetensors_numpy.save_file({"w": np.ones((50, 8), np.float16)}, str(tmp_path / "one.safetensors"))
    result = bench("--table", str(tmp_path / "one.safetensors"), "--batch", "6", "--reps", "1", "--out", str(tmp_path))
    assert result.returncode == 2 and "pass --tensor" in result.stderr and "name=" not in result.stderr, result.stderr


@pytest.mark.parametrize("missing", [("gguf",), ("ml_dtypes", "gguf")])
def test_format_without_its_packages_is_refused_at_once(capsys, tmp_path, monkeypatch, missing):
    """--format needs ml_dtypes and gguf: one line naming them and the extra, not a traceback mid-run."""
    pytest.importorskip("gguf", reason="the last check parses --format with both packages there")
    pytest.importorskip("ml_dtypes", reason="the last check parses --format with both packages there")
    from fastembed.benchmark.arguments import parse_arguments

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name in missing else find_spec(name, *rest))
    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(["--format", "q8_0", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"--format needs {' and '.join(missing)}" in capsys.readouterr().err
    monkeypatch.undo()
    assert parse_arguments(["--format", "q8_0", "--out", str(tmp_path)]).format == ["q8_0"]


@pytest.mark.parametrize("kind", ["fastembed", "peer"])
def test_a_lookup_contender_that_returns_other_rows_is_refused_before_it_is_timed(kind):
    from fastembed.benchmark.contenders import Contender
    from fastembed.benchmark.measure import measure_case
    from fastembed.tables import random_table

    table = random_table(2000, 64, "float16")
    untouched = np.zeros((6, 64), np.float16)
    wrong = Contender("untouched buffer", kind, False, lambda t, n: (lambda ids: untouched), id="untouched")
    right = Contender("fancy", kind, True, lambda t, n: (lambda ids: t[ids]), id="fancy")
    assert measure_case(table, [right], 6, "uniform", 2, warmup=1)[0].samples_s
    with pytest.raises(RuntimeError, match="untouched buffer gave other rows than table.ids. for 6 ids"):
        measure_case(table, [right, wrong], 6, "uniform", 2, warmup=1)
    checked = dataclasses.replace(wrong, expected=lambda t, ids: untouched)  # a reference of its own
    assert measure_case(table, [checked], 6, "uniform", 2, warmup=1)[0].samples_s


def test_the_untimed_call_before_a_loop_reads_no_set_that_a_timed_call_reads_later():
    """Else the next contender's first timed call would find its rows cached."""
    from fastembed.benchmark.contenders import Contender
    from fastembed.benchmark.measure import HOST, measure_case
    from fastembed.tables import random_table

    events, timing = [], [False]

    def timed(call, id_list):
        timing[0] = True
        try:
            return HOST.seconds_per_call(call, id_list)
        finally:
            timing[0] = False

    def prepare(t, n):
        return lambda ids: events.append((timing[0], ids.tobytes())) or t[ids]

    table = random_table(4000, 64, "float16")
    contenders = [Contender(name, "peer", False, prepare, id=name) for name in ("a", "b", "c")]
    measure_case(table, contenders, 6, "uniform", 3, warmup=1, platform=dataclasses.replace(HOST, seconds_per_call=timed))
    first_sample = next(index for index, (was_timed, _) in enumerate(events) if was_timed)  # the preparing calls before
    for index, (was_timed, ids) in enumerate(events[first_sample:], first_sample):
        if not was_timed:
            assert not any(later_timed and later == ids for later_timed, later in events[index + 1 :])


def test_the_scattered_read_of_a_few_rows_runs_on_the_calling_thread_as_the_gather_does(monkeypatch):
    """Waking the workers for one row would make the read ceiling a measure of thread wake-up."""
    pytest.importorskip("numba")
    from fastembed.benchmark import contenders, copy_kernels
    from fastembed.tables import random_table

    used = []
    monkeypatch.setattr(copy_kernels, "read_scattered_serial", lambda *args: used.append("serial"))
    monkeypatch.setattr(copy_kernels, "read_scattered", lambda *args: used.append("threads"))
    table = random_table(4000, 512, "float16")  # 1 KiB rows: 2 MiB from 2,048 ids on
    for n in (1, 6, 2047, 2048):
        contenders._read_scattered(table, n)(np.arange(n))
    assert used == ["serial", "serial", "serial", "threads"]


def test_allocations_that_tracemalloc_cannot_see_are_not_reported_as_measured():
    torch = pytest.importorskip("torch")
    from fastembed.benchmark.measure import HOST

    assert HOST.allocated_by_one_call(lambda ids: torch.empty(1 << 20), None) is None
    assert HOST.allocated_by_one_call(lambda ids: np.empty(1 << 20), None) >= 1 << 20


def test_the_checked_output_is_dropped_before_a_calls_allocations_are_measured():
    """Held, the first output could not go back to the output cache, and every call would seem to allocate one."""
    pytest.importorskip("numba")
    from fastembed.benchmark import contenders
    from fastembed.benchmark.contenders import Contender
    from fastembed.benchmark.measure import measure_case
    from fastembed.tables import random_table

    table = random_table(4000, 1024, "float16")  # 2 KiB rows: 4,096 ids make an 8 MiB output
    alloc = Contender("fastembed auto alloc", "fastembed", True, contenders._fastembed_alloc, id="alloc")
    result = measure_case(table, [alloc], 4096, "uniform", 1, warmup=0)[0]
    assert result.allocated_per_call < 2**20


# -- the command line under hostile settings and outputs ------------------------------------------------------


TINY_RUN = ("--vocab-size", "3000", "--dim", "64", "--reps", "3", "--batch", "1", "--dist", "uniform")


@pytest.mark.parametrize("setting", [{"NUMBA_NUM_THREADS": "0"}], ids=["no threads"])
def test_a_bad_numba_setting_still_runs_and_writes_the_results(tmp_path, setting):
    """It used to end, after every measurement, in a traceback from the machine's facts or the numba limits."""
    result = bench(*TINY_RUN, "--out", str(tmp_path), env={**os.environ, **setting})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert (tmp_path / "results.json").exists()


@pytest.mark.parametrize("arguments, words", [
    (["--reps", "100001"], "at most 100000 repetitions"),
    (["--vocab-size", "16", "--dim", "65536", "--dtype", "float64", "--batch", "1048576"],
     "more than this machine's memory: ask for fewer --batch rows"),
    (["--out", "x" * 300], "cannot write results there"),
    (["--device", "cuda", "--backend", "numba"], "--backend chooses the host's backends"),
])
def test_a_run_that_cannot_work_is_refused_before_it_starts(tmp_path, arguments, words):
    if "--out" in arguments:  # a name too long for the file system, in the test's own folder
        arguments = ["--out", str(tmp_path / arguments[1] / "results")]
    result = bench(*(["--out", str(tmp_path)] if "--out" not in arguments else []), *arguments)
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("kind", ["fifo", "device", "repetitions"])
def test_a_thresholds_file_that_is_no_file_or_asks_too_much_is_refused(tmp_path, kind):
    """A FIFO used to hang the run, /dev/zero to read until memory ran out, a huge repetition count to fill memory."""
    path = tmp_path / "thresholds.toml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path(os.devnull)
    else:
        path.write_text('repetitions = 9223372036854775807\n[[check]]\nname = "x"\ncontender = "fastembed-auto-out"\n'
                        'metric = "speedup_vs_numpy"\nbatch = 8\ndistribution = "uniform"\nmin = 0\n')
    result = bench("--vocab-size", "3000", "--dim", "64", "--gate", "--thresholds", str(path), "--out",
                   str(tmp_path / "out"))
    words = "repetitions must be an integer from 1 to 100000" if kind == "repetitions" else "not a regular file"
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_full_standard_output_is_one_clear_line_and_a_closed_one_still_gets_the_results_written(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "fastembed.benchmark.cli", *TINY_RUN, "--out", str(tmp_path / "a")],
                                cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=600)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "fastembed-bench: cannot write to the standard output: No space left on device")
    reader = subprocess.Popen([sys.executable, "-m", "fastembed.benchmark.cli", *TINY_RUN, "--out", str(tmp_path / "b")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert reader.stdout is not None
    reader.stdout.readline()
    reader.stdout.close()  # the reader leaves, as `| head -1` does
    reader.wait(timeout=600)
    assert reader.returncode == 0 and (tmp_path / "b" / "results.json").exists()
    # No standard output at all (closed by the shell, `>&-`): Python's sys.stdout is None, and the run crashed.
    result = subprocess.run([sys.executable, "-m", "fastembed.benchmark.cli", *TINY_RUN, "--out", str(tmp_path / "c")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600,
                            preexec_fn=lambda: os.close(1))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert (tmp_path / "c" / "results.json").exists()


def test_a_terminal_width_of_zero_columns_still_prints_the_table(tmp_path):
    """rich prints nothing at all in 0 columns: a COLUMNS under 40 is not taken."""
    result = bench(*TINY_RUN, "--out", str(tmp_path), env={**os.environ, "COLUMNS": "0"})
    assert result.returncode == 0 and "median per call" in result.stdout, result.stdout + result.stderr


def _printed(table, width: int) -> str:
    import io

    from rich.console import Console

    from fastembed.benchmark import report

    console = Console(file=io.StringIO(), width=width)
    report.print_readable(table, console)
    return console.file.getvalue()


def test_a_table_too_wide_for_the_terminal_is_printed_whole_not_cut():
    """rich fitted tables into narrow terminals by cutting cells to an ellipsis and squeezing the one column that
    may wrap (the contender) to nothing: the rows no longer said which contender or exchange they were."""
    pytest.importorskip("rich")
    from rich.table import Table

    names = ["fastembed[numba] out=", "fastembed Embedding alloc", "numpy table[ids]"]
    for width in (40, 48, 80):
        table = Table(title="one contender per row")
        for column in ("batch", "ids", "contender", "median", "limit", "fancy", "exchange", "lowest-highest"):
            table.add_column(column, no_wrap=column != "contender")
        for name in names:
            table.add_row("1", "uniform", name.replace("[", "\\["), "9.3 us", "0.30", "0.32x", "shared_memory",
                          "58.50-58.51")
        printed = _printed(table, width)
        assert "\u2026" not in printed and printed.count("shared_memory") == 3 and printed.count("58.50-58.51") == 3
        assert all(all(word in printed for word in name.split()) for name in names), printed


def test_a_table_whose_cells_wrap_whole_keeps_to_the_terminal():
    pytest.importorskip("rich")
    from rich.table import Table

    table = Table(title="fresh processes")
    for column in ("ids", "contender", "median per process (min-max)", "worst p99/median", "samples per process"):
        table.add_column(column)
    table.add_row("64", "fastembed out=", "26 us - 26 us", "1.09", "2")
    printed = _printed(table, 60)
    assert max(len(line) for line in printed.splitlines()) <= 60 and "\u2026" not in printed
    assert all(word in printed for word in ("fastembed", "out=", "26", "(min-max)", "p99/median", "process"))


def test_the_recorded_command_can_be_run_again_as_it_reads(tmp_path):
    """The command was recorded as its arguments joined by spaces: a path holding a space came back as two."""
    import shlex

    out = tmp_path / "out with space"
    assert cli.main([*TINY_RUN, "--out", str(out)]) == 0
    command = json.loads((out / "results.json").read_text())["command"]
    assert shlex.split(command) == ["fastembed-bench", *TINY_RUN, "--out", str(out)]


def test_an_allocation_the_system_refuses_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Beyond what the arguments' memory check foresees (another mode's outputs, a fuller machine), the system's
    refusal was a traceback."""
    def refused(*args, **kwargs):
        raise MemoryError("Unable to allocate 32.0 GiB for an array")

    monkeypatch.setattr(cli, "run", refused)
    assert cli.main([*TINY_RUN, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("fastembed-bench: out of memory (Unable to allocate 32.0 GiB for an "
                                               "array): ask for fewer --batch rows or --reps, or a smaller table")


def test_format_on_a_table_no_format_can_hold_is_one_line_and_exit_2(tmp_path, capsys):
    table = random_table(100, 64, np.float16)
    table[3, 5] = np.nan
    np.save(tmp_path / "nan.npy", table)
    assert cli.main(["--format", "q8_0", "--table", str(tmp_path / "nan.npy"), "--batch", "8", "--reps", "2",
                     "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"fastembed-bench: --table {tmp_path / 'nan.npy'}: cannot quantize a table holding NaN or infinite values")


def test_cold_calls_are_the_hosts(tmp_path):
    result = bench("--cold", "--device", "cuda", "--out", str(tmp_path))
    assert result.returncode == 2 and "--cold evicts the host's caches before each call, not a GPU's" in result.stderr


def test_the_memory_check_counts_the_batches_and_repetitions_the_mode_runs(monkeypatch):
    """The main run's default batches reach 65,536 ids, --quick's 8,192; a gate's repetitions each keep id sets."""
    import argparse

    from fastembed.benchmark import arguments as command_line

    monkeypatch.setattr(command_line, "_physical_memory", lambda: 4 * 2**30)
    wide = (131072, 4096)  # rows of 8 KiB in float16
    run = argparse.Namespace(processes=None, ranks=None, format=None, device="cpu", gate=False, batch=None, quick=True,
                             reps=None, checks=None, gate_repetitions=None)
    assert command_line.memory_problem(run, wide, 2, 2**30) is None  # 12 outputs of 8,192 rows of 8 KiB beside 1 GiB
    run.quick = False
    assert "more than this machine's memory" in command_line.memory_problem(run, wide, 2, 2**30)  # 12 x 512 MiB
    run.device = "cuda"
    assert command_line.memory_problem(run, wide, 2, 2**30) is None  # a GPU run's outputs are on the device
    run.device, run.processes = "cpu", 20
    assert command_line.memory_problem(run, wide, 2, 2**30) is None  # that mode holds a few outputs at a time
    # ... but at the least one of the largest --batch (one per rank and the single process's for --ranks): a batch
    # whose single output cannot fit was a traceback
    for mode, value, held in (("processes", 20, 1), ("ranks", 3, 4)):
        few = argparse.Namespace(**{**vars(run), "processes": None, mode: value, "batch": [64, 2**20]})
        fits = (4 * 2**30 - 2**30) // (held * 2**20)  # the row bytes that just fit beside the 1 GiB table
        assert command_line.memory_problem(few, (1000, fits), 1, 2**30) is None, mode
        problem = command_line.memory_problem(few, (1000, fits + 64), 1, 2**30)
        assert problem.startswith(f"1048576 rows of {fits + 64} bytes"), problem
        assert problem.endswith("take more than this machine's memory: ask for fewer --batch rows"), problem
        few.batch = None
        assert command_line.memory_problem(few, (1000, fits + 64), 1, 2**30) is None  # the mode's own batches fit
    narrow = (129280, 128)
    gate_run = argparse.Namespace(processes=None, ranks=None, format=None, device="cpu", gate=True, batch=None,
                                  quick=False,
                                  reps=None, checks=[gate.Check("x", "fastembed-auto-out", "speedup_vs_numpy", 4096,
                                                                "uniform", 0.0)], gate_repetitions=100_000)
    assert "id sets of 100000 repetitions" in command_line.memory_problem(gate_run, narrow, 1, 0)  # 100,010 sets
    gate_run.gate_repetitions = 11
    assert command_line.memory_problem(gate_run, narrow, 1, 0) is None
    gate_run.reps = 100_000  # --reps sets the gate's repetitions
    assert "id sets of 100000 repetitions" in command_line.memory_problem(gate_run, narrow, 1, 0)


def test_the_memory_check_counts_the_id_sets_of_narrow_rows_at_small_batches(monkeypatch):
    """A table of one-byte rows at 1 or 1,024 ids passed the check and drew more id sets than the machine holds."""
    import argparse

    from fastembed.benchmark import arguments as command_line
    from fastembed.benchmark.contenders import known_host_contender_ids
    from fastembed.benchmark.measure import id_pool_bytes

    run = argparse.Namespace(processes=None, ranks=None, format=None, device="cpu", gate=False, batch=[1, 1024],
                             quick=False, reps=None, checks=None, gate_repetitions=None)
    pool = id_pool_bytes(1024, 1, 15, 2**26, len(known_host_contender_ids()))
    assert pool > 10**9  # 17 rounds of 200 calls per contender, 1,024 int64 ids each, and their copies
    monkeypatch.setattr(command_line, "_physical_memory", lambda: pool + 1024 * 12 + 2**26 - 1)
    problem = command_line.memory_problem(run, (2**26, 1), 1, 2**26)
    assert problem.startswith("1024 rows of 1 bytes") and "the id sets of 15 repetitions" in problem, problem
    monkeypatch.setattr(command_line, "_physical_memory", lambda: pool + 1024 * 12 + 2**26)
    assert command_line.memory_problem(run, (2**26, 1), 1, 2**26) is None


def test_the_format_memory_check_counts_every_output_dtype_and_the_tables_it_makes(monkeypatch):
    """--format holds float16, float32 and bfloat16 outputs and the float32 rows it checks them against, beside the
    tables it quantizes; one float32 output was counted, and a quantized --table's outputs not at all."""
    import argparse

    from fastembed.benchmark import arguments as command_line
    from fastembed.formats import FORMATS

    shape, batch = (2000, 4096), 2**20
    q8_0 = shape[0] * FORMATS["q8_0"].row_bytes(shape[1])
    needed = q8_0 + batch * shape[1] * (2 + 4 + 2 + 3 * 4)  # the outputs, and the reference's float32 copies
    run = argparse.Namespace(processes=None, ranks=None, format=["q8_0"], device="cpu", gate=False, batch=[64, batch],
                             quick=False, reps=None, checks=None, gate_repetitions=None)
    monkeypatch.setattr(command_line, "_physical_memory", lambda: needed - 1)
    problem = command_line.memory_problem(run, shape, 2, 0)
    assert problem.startswith(f"{batch} ids of 4096 values: the q8_0 tables and the outputs"), problem
    assert problem.endswith("ask for fewer --batch rows"), problem
    monkeypatch.setattr(command_line, "_physical_memory", lambda: needed)
    assert command_line.memory_problem(run, shape, 2, 0) is None
    run.format = None  # a quantized --table: its float16 twin in memory, the outputs beside it, no table made
    twin = shape[0] * shape[1] * 2
    monkeypatch.setattr(command_line, "_physical_memory", lambda: twin + needed - q8_0 - 1)
    problem = command_line.formats_problem(run, [], shape, twin)
    assert problem.startswith(f"{batch} ids of 4096 values: the outputs"), problem


def test_fresh_processes_time_fewer_repetitions_for_large_outputs_but_at_least_15():
    from fastembed.benchmark import processes

    assert [processes.reps_for(batch, 8192, 5) for batch in (64, 1024, 4096, 65536)] == [5, 5, 15, 15]
    assert processes.reps_for(65536, 8192, 100) == 15  # 512 MiB outputs: the floor
    assert processes.reps_for(4096, 8192, 100) == 25  # 32 MiB outputs: 8 MiB of output per repetition
    assert processes.reps_for(1024, 8192, 100) == 100


def test_fresh_processes_interleave_their_contenders_in_a_new_order_each_round(tmp_path, monkeypatch):
    """A call that follows another contender's pays for what that one left behind: no contender always follows the
    same one, and each still gets its repetitions."""
    from fastembed.benchmark import processes

    path = tmp_path / "table.npy"
    np.save(path, random_table(300, 8, np.float32))
    made: list[str] = []

    def recording_calls(fastembed, table, out):
        def call_of(name):
            def call(ids):
                made.append(name)
                return np.asarray(table)[ids]
            return call
        return {name: call_of(name) for name in processes.CONTENDERS}

    monkeypatch.setattr(processes, "_calls", recording_calls)
    reps = 30
    run = processes.worker(str(path), [16], reps, seed=3)
    assert all(len(times) == reps for times in run["samples"]["16"].values())
    timed = made[-reps * len(processes.CONTENDERS):]
    rounds = [tuple(timed[k : k + 3]) for k in range(0, len(timed), 3)]
    assert all(sorted(order) == sorted(processes.CONTENDERS) for order in rounds)
    assert len(set(rounds)) > 1


def test_ranks_accept_quick_with_reps_and_batch(tmp_path):
    from fastembed.benchmark import arguments as command_line

    arguments = command_line.parse_arguments(["--ranks", "2", "--quick", "--reps", "3", "--batch", "64", "--out", str(tmp_path)])
    assert (arguments.ranks, arguments.quick, arguments.reps, arguments.batch) == (2, True, 3, [64])


@pytest.mark.parametrize(("arguments", "default"), [
    ([], True), (["--dtype", "half"], True), (["--dtype", "<f2"], True), (["--dim", "64"], False),
    (["--dtype", "float32"], False), (["--table", "t.npy"], False),
])
def test_the_default_table_is_recognised_in_any_spelling_of_its_dtype(arguments, default):
    from fastembed.benchmark import arguments as command_line

    parsed = command_line.parse_arguments(["--gate", *arguments])
    assert command_line.measures_the_default_table(parsed) == default


@pytest.mark.parametrize(("arguments", "warned"), [
    (["--vocab-size", "2000", "--dim", "64"], True),
    (["--vocab-size", "2000", "--dim", "64", "--thresholds", "OWN"], False),
])
def test_the_gate_says_when_its_packaged_thresholds_meet_another_table(tmp_path, monkeypatch, capsys, arguments, warned):
    """Its ratios are set for the default table: a small table fails them by no fault of the kernels."""
    from fastembed.benchmark import cli, processes

    own = tmp_path / "own.toml"
    own.write_text('repetitions = 1\n[[check]]\nname = "auto picks numba"\ncontender = "fastembed-auto-out"\n'
                   'metric = "served_by"\nexpect_backend = "numba"\nbatch = 64\ndistribution = "uniform"\n')
    monkeypatch.setattr(cli, "run", lambda *args: [])  # the verdicts do not matter here, only what is said first
    monkeypatch.setattr(processes, "can_move_threads", lambda: False)
    cli.main(["--gate", *[str(own) if a == "OWN" else a for a in arguments], "--out", str(tmp_path / "out")])
    said = " ".join(capsys.readouterr().out.split())
    assert ("the packaged thresholds are set for the default table" in said) == warned


def test_ranks_throughput_counts_each_call_once_where_the_slowest_rank_counts_its_wait():
    """Ranks in lockstep, each ahead in turn: the one ahead waits inside its call. Throughput averages each call
    over the ranks (the loop's time per call); the slowest rank's median counts every wait."""
    from fastembed.benchmark import ranks

    keys = [f"8/{mode}" for mode in ranks.MODES]
    ahead = [0.004, 0.002] * 5  # rank 0 waits 2 ms in every other call, rank 1 in the others
    behind = [0.002, 0.004] * 5

    def samples(totals):
        return {key: {name: list(totals) for name in ("total_s", *ranks.PHASES)} for key in keys}

    def rank(totals):
        return {"samples": samples(totals), "exchanges": dict.fromkeys(keys, ["shared_memory"]),
                "payload_bytes": dict.fromkeys(keys, 0)}

    round_ = {"ranks": [rank(ahead), rank(behind)], "single": {"samples": samples([0.0015] * 10)}}
    rows = ranks.summarise([round_, round_, round_], [8])
    row = next(row for row in rows if row["mode"] == "full")
    assert row["ranks_over_single"] == pytest.approx(0.004 / 0.0015)  # every call's slowest rank waited 2 ms
    assert row["throughput_vs_single"] == pytest.approx(0.0015 / 0.003)  # 3 ms per call, the loop's pace
    assert row["throughput_vs_single_range"] == pytest.approx([0.5, 0.5])



def test_the_copy_limits_of_a_batch_larger_than_the_table_share_one_source():
    """Each copy limit built its own source of n rows: five where the memory check counts one."""
    from fastembed.benchmark import contenders

    table = random_table(300, 64, np.float16)
    ids = np.zeros(1, np.int64)
    first, second = contenders._copy_sources(table, 1000)(ids), contenders._copy_sources(table, 1000)(ids)
    assert first is second and first.shape == (1000, 64) and (first[300:600] == table).all()
    other = contenders._copy_sources(table, 2000)(ids)  # the next case's source replaces it
    assert other.shape == (2000, 64) and contenders._repeated_rows[1] is other
