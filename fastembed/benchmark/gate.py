"""The CI performance gate: ratios measured in one run against reviewed thresholds."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .measure import paired_ratio_of_samples

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

METRICS = ("fraction_of_limit", "speedup_vs_numpy", "speedup_vs_contender")


@dataclass(frozen=True)
class Check:
    name: str
    contender: str
    metric: str
    batch: int
    distribution: str
    min: float
    versus: str | None = None  # for speedup_vs_contender


@dataclass(frozen=True)
class Verdict:
    check: Check
    measured: float | None

    @property
    def passed(self) -> bool:
        return self.measured is not None and self.measured >= self.check.min


def load_checks(path: Path) -> tuple[list[Check], int]:
    """The checks and the repetition count from a thresholds file (bench/gate.toml)."""
    with open(path, "rb") as handle:
        document = tomllib.load(handle)
    checks = [Check(**entry) for entry in document["check"]]
    for check in checks:
        if check.metric not in METRICS:
            raise ValueError(f"{path}: check {check.name!r} has unknown metric {check.metric!r}; known: {METRICS}")
        if (check.metric == "speedup_vs_contender") != (check.versus is not None):
            raise ValueError(f"{path}: check {check.name!r}: 'versus' goes with speedup_vs_contender, and only there")
    return checks, int(document.get("repetitions", 11))


def judge(checks: list[Check], summary_rows: list[dict[str, Any]]) -> list[Verdict]:
    """Each check's measured ratio (None when a needed measurement is missing, which fails)."""
    return [Verdict(check, measured_ratio(check, summary_rows)) for check in checks]


def measured_ratio(check: Check, rows: list[dict[str, Any]]) -> float | None:
    def median_row(contender: str | None) -> dict[str, Any] | None:
        return next((r for r in rows if r["contender"] == contender and r["batch"] == check.batch
                     and r["distribution"] == check.distribution and r.get("device", "cpu") == "cpu"), None)

    row = median_row(check.contender)
    if row is None:
        return None
    if check.metric == "speedup_vs_contender":
        versus = median_row(check.versus)
        return None if versus is None else paired_ratio_of_samples(versus["samples_us"], row["samples_us"])
    return row[check.metric]
