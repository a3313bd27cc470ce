"""`python -m fastembed info` and the cheap import."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import fastembed
from fastembed import info


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_import_is_cheap_and_loads_neither_numba_nor_cupy_nor_jax():
    loaded = run_python(
        "import sys, fastembed; print(sorted(m for m in ('numba', 'cupy', 'llvmlite', 'jax', 'jaxlib') if m in sys.modules))"
    )
    assert loaded.strip() == "[]"


def test_decode_step_lookups_without_out_import_no_numba():
    """Outputs below SERIAL_MIN_BYTES without out go through numpy's take: nothing to compile."""
    from fastembed.backends.numba_backend import BACKEND, SERIAL_MIN_BYTES

    if BACKEND.unavailable_reasons():
        pytest.skip(f"the numba backend cannot serve here: {BACKEND.unavailable_reasons()}")
    largest_serial = (SERIAL_MIN_BYTES - 1) // (256 * 2)  # ids whose float16 rows of 256 stay below it
    code = (
        "import sys, numpy as np, fastembed\n"
        "t = fastembed.Embedding.random(100, 256).table\n"
        "rows = [fastembed.lookup(t, [7]), fastembed.lookup(t, np.arange(6)),\n"
        f"        fastembed.Embedding(t)(np.arange({largest_serial}) % 100)]\n"
        "print(fastembed.select_backend(t, [1]).backend, 'numba' in sys.modules)"
    )
    backend, numba_loaded = run_python(code).split()
    assert backend == "numba" and numba_loaded == "False"  # picked, yet not imported


def test_works_with_numba_and_cupy_missing():
    code = (
        "import sys; sys.modules['numba'] = None; sys.modules['cupy'] = None\n"
        "import importlib.util as u; real = u.find_spec\n"
        "u.find_spec = lambda name, *a: None if name in ('numba', 'cupy') else real(name, *a)\n"
        "import fastembed, numpy as np\n"
        "t = fastembed.Embedding.random(20, 6).table\n"
        "print(fastembed.select_backend(t, [1]).backend, np.array_equal(fastembed.lookup(t, [3, 4]), t[[3, 4]]))\n"
        "print([(s.name, s.reasons) for s in fastembed.backend_statuses()])"
    )
    lines = run_python(code).splitlines()
    assert lines[0] == "numpy True"
    assert "numba is not installed" in lines[1] and "cupy is not installed" in lines[1]


def test_info_tells_the_truth_about_each_backend():
    text = subprocess.run([sys.executable, "-m", "fastembed", "info"], check=True, capture_output=True, text=True).stdout
    for status in fastembed.backend_statuses():
        assert status.name in text
        for reason in status.reasons:
            assert reason in text
    assert "workers" in text or "numba" not in {s.name for s in fastembed.backend_statuses() if s.available}
    facts = json.loads(subprocess.run([sys.executable, "-m", "fastembed", "info", "--json"], check=True, capture_output=True, text=True).stdout)
    assert facts["fastembed"] == info.fastembed_version()[0]
    assert [b["name"] for b in facts["backends"]] == ["cuda", "numba", "numpy"]


def test_info_warns_about_qdrant_fastembed(monkeypatch):
    monkeypatch.setattr(info, "other_fastembed_distributions", lambda: ["fastembed 0.9.1"])
    text = info.format_report(info.report())
    assert "WARNING: fastembed 0.9.1 also installs an import package named 'fastembed'" in text


@pytest.mark.parametrize("listing", ["RECORD", "quoted RECORD", "SOURCES.txt", "top_level.txt"])
def test_another_distribution_installing_fastembed_is_found_however_it_lists_its_files(tmp_path, monkeypatch, listing):
    metadata = "METADATA"
    if listing == "SOURCES.txt":  # an egg-info install: no RECORD
        folder, metadata = tmp_path / "fastembed-0.9.1-py3.11.egg-info", "PKG-INFO"
        content = "setup.py\nfastembed/__init__.py\n"
    else:
        folder = tmp_path / "fastembed-0.9.1.dist-info"
        content = {"RECORD": "qdrant_helpers.py,,\nfastembed/__init__.py,sha256=x,10\n",
                   "quoted RECORD": '"qdrant_helpers.py","",""\r\n"fastembed/__init__.py","sha256=x","10"\r\n',
                   "top_level.txt": "fastembed\n"}[listing]
        listing = listing.removeprefix("quoted ")
    folder.mkdir()
    (folder / metadata).write_text("Metadata-Version: 2.1\nName: fastembed\nVersion: 0.9.1\n")
    (folder / listing).write_text(content)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "fastembed 0.9.1" in info.other_fastembed_distributions()


def test_a_distribution_whose_file_list_is_no_utf8_is_passed_over(tmp_path, monkeypatch):
    """A RECORD or top_level.txt naming a file in Latin-1 made info a UnicodeDecodeError traceback; pip lists it."""
    for name, listing in (("latin", "RECORD"), ("latin-top", "top_level.txt")):
        folder = tmp_path / f"{name}-1.0.dist-info"
        folder.mkdir()
        (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (folder / listing).write_bytes(b"a/x.py,,\na/\xe9t\xe9.py,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not any(found.startswith("latin") for found in info.other_fastembed_distributions())


def run_info(*arguments: str, **environment: str) -> str:

    env = {**os.environ, **environment}
    return subprocess.run([sys.executable, "-m", "fastembed", "info", *arguments], check=True, capture_output=True,
                          text=True, env=env).stdout


def test_an_unknown_fastembed_backend_is_flagged_with_the_valid_names():
    from fastembed import dispatch

    text = run_info(FASTEMBED_BACKEND="bogus")
    valid = ", ".join(["auto", *dispatch.BACKENDS])
    assert f"ERROR: FASTEMBED_BACKEND='bogus' is unknown; valid names: {valid}." in text
    usable = ["auto", *(status.name for status in fastembed.backend_statuses() if status.available)]
    for good in usable:
        assert "ERROR" not in run_info(FASTEMBED_BACKEND=good)
    facts = json.loads(run_info("--json", FASTEMBED_BACKEND="bogus"))
    assert facts["backend_env"] == {"value": "bogus", "valid": False, "valid_names": ["auto", *dispatch.BACKENDS]}


@pytest.mark.parametrize("numba_off", ["0", "1"])
def test_the_output_cache_and_a_bad_setting_of_it_are_shown_whatever_backend_serves(numba_off):
    """The cache serves JAX tables' results on every backend: info shows it with numba off too."""
    environment = {"NUMBA_DISABLE_JIT": numba_off}
    assert "output_cache: 0 MiB of outputs kept for reuse, limit 1 MiB" in run_info(
        **environment, FASTEMBED_OUTPUT_CACHE_BYTES="1048576")
    text = run_info(**environment, FASTEMBED_OUTPUT_CACHE_BYTES="abc")
    assert "output_cache: ERROR: FASTEMBED_OUTPUT_CACHE_BYTES='abc' is not a whole number of bytes" in text
    assert json.loads(run_info("--json", **environment, FASTEMBED_OUTPUT_CACHE_BYTES="abc"))["output_cache"].startswith("ERROR")


def test_the_valid_names_follow_the_registry(monkeypatch):
    from fastembed import dispatch

    monkeypatch.setitem(dispatch.BACKENDS, "experimental", dispatch.BACKENDS["numpy"])
    monkeypatch.setenv("FASTEMBED_BACKEND", "experimental")
    assert info.backend_environment()["valid"]
    monkeypatch.setenv("FASTEMBED_BACKEND", "Numba")
    assert "valid names: auto, cuda, numba, numpy, experimental" in info.format_report(info.report())


def test_package_versions_are_listed_without_importing_them():
    code = (
        "import sys, json, fastembed.info as i\n"
        "facts = i.report()\n"
        "print(json.dumps([facts['packages'], sorted(m for m in ('ml_dtypes', 'safetensors', 'torch', 'cupy') if m in sys.modules)]))"
    )
    packages, imported = json.loads(run_python(code))
    assert imported == []
    import importlib.metadata

    for name in ("ml_dtypes", "safetensors", "torch"):
        try:
            assert packages[name] == importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            assert packages[name] is None
    assert any(name.lower().startswith("cupy") for name in packages)
    text = info.format_report(info.report())
    assert "torch " in text and "safetensors " in text and "ml_dtypes " in text


def test_the_version_comes_from_this_distribution_not_the_import_package(monkeypatch):
    """Qdrant's 'fastembed' distribution installs a package of the same name: __version__ may be its."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(fastembed.info, "__version__", "0.7.3")  # what Qdrant's package would say
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9" if name == "fastembed-gather" else real(name))
    assert info.fastembed_version() == ("9.9.9", "distribution fastembed-gather")
    assert info.report()["fastembed"] == "9.9.9"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert info.fastembed_version() == ("0.7.3", "fastembed.__version__ (not installed as a distribution)")

    def no_utf8(name):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(importlib.metadata, "version", no_utf8)  # it raised out of info and the benchmark's report
    assert info.fastembed_version() == (
        "0.7.3", "fastembed.__version__ (the fastembed-gather distribution's METADATA is no UTF-8)")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: None)  # no Version, or a METADATA not readable
    assert info.fastembed_version()[0] == "0.7.3" and info.report()["fastembed"] == "0.7.3"


def test_info_reports_a_backend_that_fails_while_it_is_described(monkeypatch):
    """Describing numba loads it; a failure found then shows as the backend's status, not beside "available"."""
    from fastembed.backends import numba_backend

    backend = numba_backend.BACKEND
    monkeypatch.setattr(backend, "_unavailable", [])
    monkeypatch.setattr(backend, "_import_error", None)

    def failing_describe():
        backend._import_error = "numba failed to load: ImportError: llvmlite is broken"
        fastembed.backends.base.availability_changed()
        return {"error": "numba failed to load: ImportError: llvmlite is broken"}

    monkeypatch.setattr(backend, "describe", failing_describe)
    entry = next(b for b in info.report()["backends"] if b["name"] == "numba")
    assert entry["available"] is False and entry["reasons"] == ["numba failed to load: ImportError: llvmlite is broken"]
    assert "error" not in entry
    monkeypatch.undo()
    fastembed.dispatch.refresh()


def test_info_flags_a_fastembed_backend_that_cannot_run(monkeypatch):
    cuda = next(status for status in fastembed.backend_statuses() if status.name == "cuda")
    if cuda.available:
        pytest.skip("the cuda backend can run here")
    monkeypatch.setenv("FASTEMBED_BACKEND", "cuda")
    text = info.format_report(info.report())
    assert "ERROR: FASTEMBED_BACKEND='cuda' names a backend that cannot run here" in text
    assert cuda.reasons[0] in text


def test_a_backend_setting_is_shown_quoted_on_its_own_line():
    """Printed raw, a value with a newline forged a line of the report (and one with surrogates could not print)."""
    lines = run_info(FASTEMBED_BACKEND="numpy\nFASTEMBED_BACKEND: numba").splitlines()
    assert "FASTEMBED_BACKEND: 'numpy\\nFASTEMBED_BACKEND: numba'" in lines
    assert "FASTEMBED_BACKEND: numba" not in lines


def test_a_full_standard_output_is_one_clear_line():

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "fastembed", "info"], stdout=full, stderr=subprocess.PIPE,
                                text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == "python -m fastembed: cannot write to the standard output: No space left on device"


def test_info_escapes_what_the_console_cannot_encode_instead_of_failing():
    """An environment value the console's encoding has no character for ended info in a UnicodeEncodeError, right
    where it should print the error about that value."""
    env = {**os.environ, "FASTEMBED_BACKEND": "numb\u00e4", "PYTHONIOENCODING": "ascii"}
    result = subprocess.run([sys.executable, "-m", "fastembed", "info"], capture_output=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert b"FASTEMBED_BACKEND='numb\\xe4' is unknown" in result.stdout


def test_info_reads_past_an_installed_distribution_whose_metadata_is_no_utf8(tmp_path):
    folder = tmp_path / "bad-1.0.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: bad\xff\xfe\nVersion: 1.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "fastembed", "info", "--json"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "numpy" in json.loads(result.stdout)["packages"]
