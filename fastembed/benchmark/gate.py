"""The CI performance gate: facts and ratios measured in one run, against reviewed thresholds.

The thresholds ship with the package (``thresholds.toml`` next to this
module), so ``fastembed-bench --gate`` works wherever fastembed is installed;
``--thresholds FILE`` replaces them. Checks name contenders by their stable
id (see contenders.Contender), never by display name.
"""
from __future__ import annotations

import math
import os
import stat
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .measure import MAX_REPS, paired_ratio_of_samples

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Measured in a fresh interpreter whose threads share one CPU (processes.worker with one_cpu), not in this
#: run's process.
COLOCATED = "colocated_speedup_vs_numpy"
RATIO_METRICS = ("fraction_of_limit", "speedup_vs_numpy", "speedup_vs_contender", COLOCATED)
#: served_by: a fact, not a ratio: the backend that served the contender must be `expect_backend`.
METRICS = (*RATIO_METRICS, "served_by")
#: The thresholds shipped with the package.
PACKAGED_THRESHOLDS = "thresholds.toml"
#: A thresholds file larger than this is refused before it is read.
MAX_THRESHOLDS_BYTES = 2**20


@dataclass(frozen=True)
class Check:
    """One gate check. Ratio metrics pass when measured >= ``min``; served_by when it equals ``expect_backend``."""

    name: str
    contender: str  # a contender id
    metric: str
    batch: int
    distribution: str
    min: float | None = None  # ratio metrics
    versus: str | None = None  # a contender id, for speedup_vs_contender
    expect_backend: str | None = None  # for served_by

    @property
    def threshold(self) -> str:
        return f"== {self.expect_backend}" if self.metric == "served_by" else f">= {self.min}"


@dataclass(frozen=True)
class Verdict:
    check: Check
    measured: float | str | None  # a ratio, or the backend name for served_by; None: not measured

    @property
    def passed(self) -> bool:
        if self.check.metric == "served_by":
            return self.measured is not None and self.measured == self.check.expect_backend
        return isinstance(self.measured, (int, float)) and self.check.min is not None and self.measured >= self.check.min


def thresholds_text(path: Path | None = None) -> tuple[str, str]:
    """(where, TOML text) of the thresholds: `path`, or the file shipped in this package when None.

    Raises ValueError naming the file when it cannot be read.
    """
    if path is None:
        resource = resources.files(__package__).joinpath(PACKAGED_THRESHOLDS)
        where = f"packaged {PACKAGED_THRESHOLDS}"
        try:
            return where, resource.read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"{where} cannot be read ({error}): the package is incomplete; reinstall it") from error
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens at once instead of waiting for a writer
        with open(descriptor, "rb") as file:
            facts = os.fstat(file.fileno())
            if not stat.S_ISREG(facts.st_mode):
                raise ValueError(f"--thresholds {path}: not a regular file")
            if facts.st_size > MAX_THRESHOLDS_BYTES:
                raise ValueError(f"--thresholds {path}: {facts.st_size} bytes, more than a thresholds file takes "
                                 f"({MAX_THRESHOLDS_BYTES} at most)")
            return str(path), file.read(MAX_THRESHOLDS_BYTES + 1).decode("utf-8")
    except OSError as error:  # its own text would name the descriptor (a directory fails at its first read)
        raise ValueError(f"--thresholds {path}: cannot read it: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"--thresholds {path}: cannot read it: {error}") from error


#: The keys a thresholds file may hold at its top: the checks, and how many times each is measured.
_FILE_KEYS = {"check", "repetitions"}


def load_checks(path: Path | None = None) -> tuple[list[Check], int]:
    """The checks and the repetition count of a thresholds file (default: the packaged one).

    Raises ValueError naming the file and the check for anything it cannot
    use: unreadable, not TOML, no checks, unknown keys or metrics, missing
    ``min`` / ``versus`` / ``expect_backend`` where the metric needs them, a
    ``min`` that is not a finite number, a contender id no host run has, a
    backend that is not registered.
    """
    where, text = thresholds_text(path)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{where}: not valid TOML: {error}") from error
    except RecursionError:  # arrays or tables nested thousands deep
        raise ValueError(f"{where}: not a thresholds file: values nested too deep to read") from None
    unknown = sorted(set(document) - _FILE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; a thresholds file holds {' and '.join(sorted(_FILE_KEYS))}")
    entries = document.get("check")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: no [[check]] tables")
    checks = []
    for number, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: check {number} is {entry!r}, not a [[check]] table")
        try:
            check = Check(**entry)
        except TypeError as error:
            raise ValueError(f"{where}: check {number} ({entry.get('name', 'unnamed')!r}): {error}") from error
        _validate(check, where)
        checks.append(check)
    repetitions = document.get("repetitions", 11)
    if isinstance(repetitions, bool) or not isinstance(repetitions, int) or not 1 <= repetitions <= MAX_REPS:
        raise ValueError(f"{where}: repetitions must be an integer from 1 to {MAX_REPS}, got {repetitions!r}")
    return checks, repetitions


def _validate(check: Check, where: str) -> None:
    def fail(reason: str) -> None:
        raise ValueError(f"{where}: check {check.name!r}: {reason}")

    from .arguments import MAX_BATCH
    from .contenders import host_backends
    from .ids import DISTRIBUTIONS

    if not isinstance(check.name, str):
        raise ValueError(f"{where}: a check's name must be a string, got {check.name!r}")
    for key, optional in (("contender", False), ("metric", False), ("distribution", False), ("versus", True),
                          ("expect_backend", True)):
        value = getattr(check, key)
        if not isinstance(value, str) and not (optional and value is None):
            fail(f"{key} must be a string, got {value!r}")
    if check.metric not in METRICS:
        fail(f"unknown metric {check.metric!r}; known: {', '.join(METRICS)}")
    if (check.metric == "speedup_vs_contender") != (check.versus is not None):
        fail("'versus' goes with speedup_vs_contender, and only there")
    if (check.metric == "served_by") != (check.expect_backend is not None):
        fail("'expect_backend' goes with served_by, and only there")
    if (check.metric in RATIO_METRICS) != _is_number(check.min):
        fail("ratio metrics need a finite number 'min'; served_by takes none")
    served = host_backends()
    if check.metric == "served_by" and check.expect_backend not in served:
        fail(f"expect_backend {check.expect_backend!r} is no backend that serves the host tables the gate measures; "
             f"known: {', '.join(served)}")
    if isinstance(check.batch, bool) or not isinstance(check.batch, int) or not 1 <= check.batch <= MAX_BATCH:
        fail(f"batch must be an integer from 1 to {MAX_BATCH}, got {check.batch!r}")
    if check.distribution not in DISTRIBUTIONS:
        fail(f"unknown distribution {check.distribution!r}; known: {', '.join(DISTRIBUTIONS)}")
    if check.metric == COLOCATED:
        from .processes import CONTENDERS

        if check.contender not in CONTENDERS or check.contender == "numpy-fancy" or check.distribution != "uniform":
            fail(f"{COLOCATED} measures {', '.join(CONTENDERS[:2])} on uniform ids")
        return
    from .contenders import known_host_contender_ids

    known = known_host_contender_ids()  # one this machine cannot measure is a missing measurement: that check fails
    for role, contender in (("contender", check.contender), ("versus", check.versus)):
        if (role == "contender" or contender is not None) and contender not in known:
            fail(f"{role} {contender!r} is no contender; known: {', '.join(sorted(known))}")


def _is_number(value: Any) -> bool:
    """A finite int or float (TOML's booleans are Python bools, which are ints)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def judge(checks: list[Check], summary_rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each check's measurement (None when a needed measurement is missing, which fails)."""
    return [Verdict(check, measured(check, summary_rows)) for check in checks]


def measured(check: Check, rows: list[dict[str, Any]]) -> float | str | None:
    """What `check` compares with its threshold, from the summary rows of one run (host rows only)."""

    def row_of(contender: str | None) -> dict[str, Any] | None:
        return next((r for r in rows if r.get("id") == contender and r["batch"] == check.batch
                     and r["distribution"] == check.distribution and r.get("device", "cpu") == "cpu"), None)

    row = row_of(check.contender)
    if row is None:
        return None
    if check.metric == "served_by":
        return row.get("served_by")
    if check.metric == "speedup_vs_contender":
        versus = row_of(check.versus)
        return None if versus is None else paired_ratio_of_samples(versus["samples_us"], row["samples_us"])
    return row[check.metric]


def contender_ids(checks: list[Check]) -> set[str] | None:
    """The contenders this run's process measures for the checks: those they read, beside numpy ``table[ids]``, or
    every one (None) where a check reads ``fraction_of_limit``, whose limit is the fastest of its whole class."""
    checks = [check for check in checks if check.metric != COLOCATED]
    if any(check.metric == "fraction_of_limit" for check in checks):
        return None
    return {check.contender for check in checks} | {check.versus for check in checks if check.versus} | {"numpy-fancy"}


def colocated_rows(checks: list[Check], table_path: Any, repetitions: int) -> list[dict[str, Any]]:
    """Rows for the co-located checks: one fresh interpreter whose threads share one CPU (processes.worker).

    Each row holds, for one contender and batch, the median over repetitions
    of numpy ``table[ids]``'s time over the contender's, in the shape
    :func:`measured` reads. Empty when no check asks for it.
    """
    from . import processes

    batches = sorted({check.batch for check in checks if check.metric == COLOCATED})
    if not batches:
        return []
    runs = processes.run(table_path, 1, batches, repetitions, load=False, one_cpu=True)
    return [{"id": row["contender"], "batch": row["batch"], "distribution": "uniform", "device": "cpu",
             COLOCATED: row["lowest_speedup_vs_numpy"], "median_us": row["median_us"][0]}
            for row in processes.summarise(runs) if row["contender"] != "numpy-fancy"]
