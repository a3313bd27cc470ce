"""The CI performance gate: ratios measured in one run against reviewed thresholds."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

METRICS = ("fraction_of_limit", "speedup_vs_numpy")


@dataclass(frozen=True)
class Check:
    name: str
    contender: str
    metric: str
    batch: int
    distribution: str
    min: float


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
    return checks, int(document.get("repetitions", 11))


def judge(checks: list[Check], summary_rows: list[dict[str, Any]]) -> list[Verdict]:
    verdicts = []
    for check in checks:
        row = next(
            (r for r in summary_rows if r["contender"] == check.contender and r["batch"] == check.batch
             and r["distribution"] == check.distribution),
            None,
        )
        verdicts.append(Verdict(check, None if row is None else row[check.metric]))
    return verdicts
