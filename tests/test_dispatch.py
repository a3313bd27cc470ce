"""The dispatcher: priority, data stays where it lives, named choices never fall back."""
from __future__ import annotations

import numpy as np
import pytest

import fastembed
from fastembed import dispatch
from conftest import assert_bit_equal, random_table


def test_backends_report_every_backend_with_reasons():
    statuses = {status.name: status for status in fastembed.backends()}
    assert list(statuses) == ["cuda", "numba", "numpy"]
    assert statuses["numpy"].available and statuses["numpy"].reasons == []
    for status in statuses.values():
        assert status.available == (not status.reasons)


def test_cuda_reports_why_it_is_unavailable_without_a_gpu():
    try:
        import cupy

        has_device = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_device = False
    if has_device:
        pytest.skip("a CUDA device is present")
    cuda = next(status for status in fastembed.backends() if status.name == "cuda")
    assert not cuda.available
    assert any("cupy" in reason for reason in cuda.reasons)


def test_auto_picks_numba_for_host_tables_when_available():
    table = random_table(10, 4)
    selection = fastembed.select_backend(table, [1, 2])
    expected = "numba" if any(s.name == "numba" and s.available for s in fastembed.backends()) else "numpy"
    assert selection.backend == expected
    assert set(selection.skipped) == {"cuda", "numba", "numpy"} - {expected}
    assert all(selection.skipped.values())
    assert "selected:" in str(selection)


def test_a_host_table_never_goes_to_the_gpu(monkeypatch):
    monkeypatch.setattr(dispatch.cuda_backend, "unavailable_reasons", lambda: [])
    monkeypatch.setattr(dispatch, "_available", None)
    monkeypatch.setattr(dispatch, "_selected", {})
    selection = fastembed.select_backend(random_table(10, 4), [1])
    assert selection.backend != "cuda"
    assert "host array" in " ".join(selection.skipped["cuda"])


def test_named_backend_that_cannot_serve_raises_with_reasons():
    with pytest.raises(fastembed.BackendUnavailableError, match="'cuda' cannot serve"):
        fastembed.lookup(random_table(10, 4), [1], backend="cuda")


def test_named_backend_is_used(monkeypatch):
    table = random_table(10, 4)
    used = []
    original = dispatch.numpy_backend.gather
    monkeypatch.setattr(dispatch.numpy_backend, "gather", lambda *a: (used.append(1), original(*a))[1])
    assert_bit_equal(fastembed.lookup(table, [3], backend="numpy"), table[[3]])
    assert used == [1]


def test_environment_variable_sets_the_default(monkeypatch):
    table = random_table(10, 4)
    monkeypatch.setattr(dispatch, "_environment_choice", "numpy")
    assert dispatch.select(table, np.array([1]), None).NAME == "numpy"
    monkeypatch.setattr(dispatch, "_environment_choice", "cuda")
    with pytest.raises(fastembed.BackendUnavailableError):
        fastembed.lookup(table, [1])
    # an explicit argument wins over the environment
    assert_bit_equal(fastembed.lookup(table, [1], backend="numpy"), table[[1]])


def test_numba_missing_falls_back_to_numpy_with_reason(monkeypatch):
    monkeypatch.setattr(dispatch.numba_backend, "unavailable_reasons", lambda: ["numba is not installed"])
    monkeypatch.setattr(dispatch, "_available", None)
    monkeypatch.setattr(dispatch, "_selected", {})
    table = random_table(10, 4)
    selection = fastembed.select_backend(table, [1])
    assert selection.backend == "numpy"
    assert selection.skipped["numba"] == ["numba is not installed"]
    assert_bit_equal(fastembed.lookup(table, [1, 2]), table[[1, 2]])


def test_environment_variable_is_read_at_import():
    import os
    import subprocess
    import sys

    code = "import fastembed; t = fastembed.Embedding.random(5, 3).table; print(fastembed.select_backend(t, [1]).backend)"
    environment = dict(os.environ, FASTEMBED_BACKEND="numpy")
    output = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
    assert output.stdout.strip() == "numpy"
    monkey = dict(os.environ)
    dispatch.read_environment()  # the current process' value again
    assert dispatch._environment_choice == (monkey.get("FASTEMBED_BACKEND") or "auto")


def test_remembered_choices_follow_the_request_and_refresh(monkeypatch):
    """select() remembers its answer per requested backend and table type, never across them."""
    if dispatch.numba_backend.unavailable_reasons():
        pytest.skip("needs numba: auto picks it over numpy")
    table, ids = random_table(10, 4), np.array([1])
    for _ in range(2):  # the second round comes from the memory
        assert dispatch.select(table, ids, None, "numpy").NAME == "numpy"
        assert dispatch.select(table, ids, None, "numba").NAME == "numba"
        assert dispatch.select(table, ids, None).NAME == "numba"
    monkeypatch.setattr(dispatch.numba_backend, "unavailable_reasons", lambda: ["numba is not installed"])
    dispatch.refresh()
    try:
        assert dispatch.select(table, ids, None).NAME == "numpy"
        with pytest.raises(fastembed.BackendUnavailableError, match="numba is not installed"):
            dispatch.select(table, ids, None, "numba")
    finally:
        monkeypatch.undo()
        dispatch.refresh()
    assert dispatch.select(table, ids, None).NAME == "numba"


@pytest.mark.parametrize("backend", [["numba"], {"name": "numba"}])
def test_a_backend_that_is_not_a_string_is_named_in_the_error(backend):
    with pytest.raises(TypeError, match="backend must be a string, one of auto, cuda, numba, numpy; got"):
        fastembed.lookup(random_table(10, 4), [1], backend=backend)
