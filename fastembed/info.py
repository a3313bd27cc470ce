"""The facts behind ``python -m fastembed info``: versions, backends, hardware."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import Any

from . import __version__
from .dispatch import BACKENDS, backend_statuses

DISTRIBUTION = "fastembed-gather"


def other_fastembed_distributions() -> list[str]:
    """Installed distributions other than ours that also provide the ``fastembed`` package.

    Qdrant's text-embedding library is published as "fastembed" (and
    "fastembed-gpu") and installs an import package of the same name.
    """
    others = []
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"] or ""
        if name.lower().replace("_", "-") == DISTRIBUTION:
            continue
        top_level = (distribution.read_text("top_level.txt") or "").split()
        files = [str(path) for path in (distribution.files or [])]
        if "fastembed" in top_level or any(path.startswith("fastembed/") for path in files):
            others.append(f"{name} {distribution.version}")
    return sorted(set(others))


def report() -> dict[str, Any]:
    backends = []
    for status in backend_statuses():
        entry: dict[str, Any] = {"name": status.name, "available": status.available, "reasons": status.reasons}
        if status.available:
            entry.update(BACKENDS[status.name].describe())
        backends.append(entry)
    return {
        "fastembed": __version__,
        "distribution": DISTRIBUTION,
        "location": os.path.dirname(os.path.abspath(__file__)),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "backends": backends,
        "fastembed_backend_env": os.environ.get("FASTEMBED_BACKEND"),
        "conflicting_distributions": other_fastembed_distributions(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def format_report(facts: dict[str, Any]) -> str:
    lines = [
        f"fastembed {facts['fastembed']} (distribution {facts['distribution']}) at {facts['location']}",
        f"python {facts['python']} on {facts['platform']}",
        f"cpu: {facts['cpu']}, {facts['cpu_count']} logical cores",
        f"FASTEMBED_BACKEND: {facts['fastembed_backend_env'] or '(unset: auto)'}",
        "backends (priority order):",
    ]
    for backend in facts["backends"]:
        state = "available" if backend["available"] else "unavailable: " + "; ".join(backend["reasons"])
        lines.append(f"  {backend['name']:<6} {state}")
        for key, value in backend.items():
            if key not in ("name", "available", "reasons"):
                lines.append(f"         {key}: {value}")
    for other in facts["conflicting_distributions"]:
        lines.append(
            f"WARNING: {other} also installs an import package named 'fastembed' (Qdrant's text-embedding "
            "library); the two overwrite each other. Install them in separate environments."
        )
    return "\n".join(lines)
