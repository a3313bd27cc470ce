"""The facts behind ``python -m fastembed info``: versions, backends, hardware."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import Any

from . import __version__, dispatch
from .backends import output_cache
from .dispatch import BACKENDS, backend_statuses

DISTRIBUTION = "fastembed-gather"
#: Optional packages whose versions the report lists, read from their metadata, never imported.
OPTIONAL_PACKAGES = ("numpy", "numba", "llvmlite", "ml_dtypes", "safetensors", "gguf", "torch", "jax")


def fastembed_version() -> tuple[str, str]:
    """This library's version and where it was read.

    Returns:
        (version, source): from the installed ``fastembed-gather`` distribution's metadata,
        which stays right when Qdrant's ``fastembed`` distribution installed an import package
        of the same name; else ``fastembed.__version__`` (a source checkout, not installed, or
        metadata that gives no readable version).
    """
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return __version__, "fastembed.__version__ (not installed as a distribution)"
    except UnicodeDecodeError:
        return __version__, f"fastembed.__version__ (the {DISTRIBUTION} distribution's METADATA is no UTF-8)"
    if not version:  # a METADATA without a version, or none readable
        return __version__, f"fastembed.__version__ (the {DISTRIBUTION} distribution's METADATA gives no version)"
    return version, f"distribution {DISTRIBUTION}"


def package_versions() -> dict[str, str | None]:
    """Installed versions of :data:`OPTIONAL_PACKAGES` and of every cupy distribution, without importing them.

    Returns:
        Distribution name -> version, or None when it is not installed. cupy is listed under
        each installed ``cupy*`` distribution (cupy-cuda12x, ...), or as "cupy": None.
    """
    versions: dict[str, str | None] = {}
    for name in OPTIONAL_PACKAGES:
        versions[name] = _version(name)
    cupys = sorted({name for name, _ in map(_name_and_version, importlib.metadata.distributions())
                    if name.lower().startswith("cupy")})
    for name in cupys:
        versions[name] = _version(name)  # the one that imports, where two are installed
    if not cupys:
        versions["cupy"] = None
    return versions


def _version(name: str) -> str | None:
    """The installed version of distribution `name`; None where it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    except UnicodeDecodeError:
        return UNREADABLE_METADATA


#: The version shown for an installed distribution whose metadata is no UTF-8 (pip cannot read it either).
UNREADABLE_METADATA = "unknown (its METADATA is no UTF-8)"


def _name_and_version(distribution: importlib.metadata.Distribution) -> tuple[str, str]:
    """`distribution`'s name and version; ("", UNREADABLE_METADATA) where its METADATA is no UTF-8."""
    try:
        metadata = distribution.metadata  # read and parsed on every access: once here
        return metadata["Name"] or "", metadata["Version"] or ""
    except UnicodeDecodeError:
        return "", UNREADABLE_METADATA


def backend_environment() -> dict[str, Any]:
    """FASTEMBED_BACKEND as set now, and whether it names a backend.

    Returns:
        {"value": the variable or None, "valid": bool, "valid_names": ["auto", *registered backends]}.
        An unset or empty variable means "auto" and is valid.
    """
    value = os.environ.get(dispatch.ENVIRONMENT_VARIABLE)
    valid_names = [dispatch.AUTO, *BACKENDS]
    return {"value": value, "valid": not value or value in valid_names, "valid_names": valid_names}


def other_fastembed_distributions() -> list[str]:
    """Installed distributions other than ours that also provide the ``fastembed`` package.

    Qdrant's text-embedding library is published as "fastembed" (and
    "fastembed-gpu") and installs an import package of the same name.
    """
    others = []
    for distribution in importlib.metadata.distributions():
        name, version = _name_and_version(distribution)
        if name.lower().replace("_", "-") == DISTRIBUTION:
            continue
        top_level = (_read_text(distribution, "top_level.txt") or "").split()
        # RECORD as text: parsing every installed path (distribution.files) was most of info's time.
        record = _read_text(distribution, "RECORD")
        if record is None:  # an egg-info install lists its files elsewhere
            record = "\n".join(str(path) for path in (distribution.files or []))
        if "fastembed" in top_level or any(line.lstrip('"').startswith("fastembed/") for line in record.splitlines()):
            if version == UNREADABLE_METADATA:
                others.append("a distribution whose METADATA is no UTF-8")
            else:
                others.append(f"{name or 'a distribution without a name'} {version}".strip())
    return sorted(set(others))


def printable(text: str, stream: Any) -> str:
    """`text` with what `stream`'s encoding cannot hold escaped (``\\xe4``), so that writing it cannot fail on a
    value of the user's (an environment variable, a path) in an ASCII or Latin-1 console."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return text.encode(encoding, "backslashreplace").decode(encoding)


def _read_text(distribution: importlib.metadata.Distribution, name: str) -> str | None:
    """A metadata file of `distribution` as text; None where it has none, "" where it is no UTF-8 (pip lists those too)."""
    try:
        return distribution.read_text(name)
    except UnicodeDecodeError:
        return ""


def report() -> dict[str, Any]:
    """Every fact ``python -m fastembed info`` prints, as JSON-serialisable values."""
    facts_by_name = {status.name: BACKENDS[status.name].describe() for status in backend_statuses() if status.available}
    backends = []
    for status in backend_statuses():  # again: describing loads a backend's library, which may find it unusable
        entry: dict[str, Any] = {"name": status.name, "available": status.available, "reasons": status.reasons}
        if status.available:
            entry.update(facts_by_name.get(status.name, {}))
        backends.append(entry)
    version, version_source = fastembed_version()
    return {
        "fastembed": version,
        "version_source": version_source,
        "distribution": DISTRIBUTION,
        "location": os.path.dirname(os.path.abspath(__file__)),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "backends": backends,
        "backend_env": backend_environment(),
        "output_cache": output_cache.describe(),
        "packages": package_versions(),
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
    """The report as text: one fact per line, warnings last."""
    environment = facts["backend_env"]
    lines = [
        f"fastembed {facts['fastembed']} (version from {facts['version_source']}) at {facts['location']}",
        f"python {facts['python']} on {facts['platform']}",
        f"cpu: {facts['cpu']}, {facts['cpu_count']} logical cores",
        "packages: " + ", ".join(f"{name} {version or 'not installed'}" for name, version in facts["packages"].items()),
        f"FASTEMBED_BACKEND: {repr(environment['value']) if environment['value'] else '(unset: auto)'}",
        f"output_cache: {facts['output_cache']}",
    ]
    if not environment["valid"]:
        lines.append(
            f"ERROR: FASTEMBED_BACKEND={environment['value']!r} is unknown; valid names: "
            f"{', '.join(environment['valid_names'])}. Every lookup without backend= raises ValueError until it is fixed."
        )
    named = next((b for b in facts["backends"] if b["name"] == environment["value"]), None)
    if named is not None and not named["available"]:
        lines.append(
            f"ERROR: FASTEMBED_BACKEND={environment['value']!r} names a backend that cannot run here: "
            f"{'; '.join(named['reasons'])}. Every lookup without backend= raises BackendUnavailableError until it is fixed."
        )
    lines.append("backends (priority order):")
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
