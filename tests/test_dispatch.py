"""The dispatcher: priority, data stays where it lives, named choices never fall back."""
from __future__ import annotations

import numpy as np
import pytest

import fastembed
from fastembed import dispatch
from fastembed.backends import base, cuda_backend, numba_backend, numpy_backend
from helpers import assert_bit_equal, random_table

NUMBA_AVAILABLE = not numba_backend.BACKEND.unavailable_reasons()


@pytest.fixture
def declare_unavailable(monkeypatch):
    """Make a backend report reasons (as on a machine without its package), then restore it."""

    def declare(backend, reasons):
        monkeypatch.setattr(backend, "unavailable_reasons", lambda: list(reasons))
        dispatch.refresh()

    yield declare
    monkeypatch.undo()
    dispatch.refresh()


@pytest.fixture
def environment(monkeypatch):
    """Set FASTEMBED_BACKEND as if at import; restored afterwards."""

    def set_choice(value):
        monkeypatch.setenv(dispatch.ENVIRONMENT_VARIABLE, value)
        dispatch.read_environment()

    yield set_choice
    monkeypatch.undo()
    dispatch.read_environment()


def test_backends_report_every_backend_with_reasons():
    statuses = {status.name: status for status in fastembed.backend_statuses()}
    assert list(statuses) == ["cuda", "numba", "numpy"]
    assert statuses["numpy"].available and statuses["numpy"].reasons == []
    for status in statuses.values():
        assert status.available == (not status.reasons)


def test_the_backends_package_is_importable_by_its_dotted_name():
    import sys

    import fastembed.backends.base as base  # a name exported by the package must not hide the subpackage

    assert fastembed.backends is sys.modules["fastembed.backends"]
    assert base.Backend is sys.modules["fastembed.backends.base"].Backend


def test_cuda_reports_why_it_is_unavailable_without_a_gpu():
    try:
        import cupy

        has_device = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        has_device = False
    if has_device:
        pytest.skip("a CUDA device is present")
    cuda = next(status for status in fastembed.backend_statuses() if status.name == "cuda")
    assert not cuda.available
    assert any("cupy" in reason for reason in cuda.reasons)


def test_auto_picks_numba_for_host_tables_when_available():
    table = random_table(10, 4)
    selection = fastembed.select_backend(table, [1, 2])
    expected = "numba" if any(s.name == "numba" and s.available for s in fastembed.backend_statuses()) else "numpy"
    assert selection.backend == expected
    assert set(selection.skipped) == {"cuda", "numba", "numpy"} - {expected}
    assert all(selection.skipped.values())
    assert "selected:" in str(selection)


def test_a_named_backend_skips_the_others_as_not_requested(environment):
    """Named by the argument or by FASTEMBED_BACKEND, the others are not requested, whatever their priority."""
    table = random_table(10, 4)
    selection = fastembed.select_backend(table, [1], backend="numpy")
    assert selection.skipped == {"cuda": ["not requested (backend='numpy')"], "numba": ["not requested (backend='numpy')"]}
    environment("numpy")
    selection = fastembed.select_backend(table, [1])
    assert selection.backend == "numpy"
    assert selection.skipped["numba"] == ["not requested (FASTEMBED_BACKEND='numpy')"]
    with pytest.raises(TypeError, match="backend must be a string"):
        fastembed.select_backend(table, [1], backend=["numpy"])


def test_a_host_table_never_goes_to_the_gpu(declare_unavailable):
    declare_unavailable(cuda_backend.BACKEND, [])
    selection = fastembed.select_backend(random_table(10, 4), [1])
    assert selection.backend != "cuda"
    reasons = " ".join(selection.skipped["cuda"])
    assert "numpy array on cpu" in reasons and "gathers cupy arrays" in reasons and "to_device" in reasons


def test_named_backend_that_cannot_serve_raises_with_reasons():
    with pytest.raises(fastembed.BackendUnavailableError, match="'cuda' cannot serve"):
        fastembed.lookup(random_table(10, 4), [1], backend="cuda")


def test_named_backend_is_used(monkeypatch):
    table = random_table(10, 4)
    used = []
    original = numpy_backend.BACKEND.gather
    monkeypatch.setattr(numpy_backend.BACKEND, "gather", lambda *a: (used.append(1), original(*a))[1])
    assert_bit_equal(fastembed.lookup(table, [3], backend="numpy"), table[[3]])
    assert used == [1]


def test_environment_variable_sets_the_default(environment):
    table = random_table(10, 4)
    environment("numpy")
    assert fastembed.select_backend(table, [1]).backend == "numpy"
    environment("cuda")
    with pytest.raises(fastembed.BackendUnavailableError):
        fastembed.lookup(table, [1])
    # an explicit argument wins over the environment
    assert_bit_equal(fastembed.lookup(table, [1], backend="numpy"), table[[1]])


def test_numba_missing_falls_back_to_numpy_with_reason(declare_unavailable):
    declare_unavailable(numba_backend.BACKEND, ["numba is not installed"])
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
    dispatch.read_environment()  # the current process' value again
    assert dispatch.requested_choice(dispatch.AUTO) == (os.environ.get("FASTEMBED_BACKEND") or "auto")


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="needs numba: auto picks it over numpy")
def test_remembered_choices_follow_the_request_and_refresh(declare_unavailable):
    """select() remembers its answer per requested backend and table type, never across them."""
    table = random_table(10, 4)
    for _ in range(2):  # the second round comes from the memory
        assert dispatch.select(table, "numpy").name == "numpy"
        assert dispatch.select(table, "numba").name == "numba"
        assert dispatch.select(table).name == "numba"
    declare_unavailable(numba_backend.BACKEND, ["numba is not installed"])
    assert dispatch.select(table).name == "numpy"
    with pytest.raises(fastembed.BackendUnavailableError, match="numba is not installed"):
        dispatch.select(table, "numba")


def _record_serving(monkeypatch, served):
    """Make every backend append (its name, "gather", "small" or "small into") to `served` when it serves a lookup."""
    for backend in (numpy_backend.BACKEND, numba_backend.BACKEND, cuda_backend.BACKEND):
        original = backend.gather
        monkeypatch.setattr(backend, "gather", lambda *a, name=backend.name, gather=original: (
            served.append((name, "gather")), gather(*a))[1])
        if hasattr(backend, "small_gather"):
            below, gather_new, calling_thread_below, gather_into = backend.small_gather()
            def recording(*arguments, name=backend.name, gather=gather_new, kind="small"):
                served.append((name, kind))
                return gather(*arguments)

            def recording_into(*arguments, name=backend.name, gather=gather_into):
                return recording(*arguments, name=name, gather=gather, kind="small into")

            monkeypatch.setattr(backend, "small_gather", lambda below=below, recording=recording,
                                recording_into=recording_into, calling_thread_below=calling_thread_below:
                                base.SmallGather(below, recording, calling_thread_below, recording_into))
    dispatch.refresh()  # the API's remembered small gather is made again, from the recording backends


def test_lookups_follow_the_environment_and_refresh(environment, monkeypatch):
    """lookup and Embedding serve with the backend select() names now: after FASTEMBED_BACKEND is re-read or refresh()."""
    served = []
    _record_serving(monkeypatch, served)
    table = random_table(10, 4)
    emb = fastembed.Embedding(table)
    expected = fastembed.select_backend(table, [1]).backend
    for _ in range(2):
        assert_bit_equal(emb([1]), table[[1]])
        assert_bit_equal(fastembed.lookup(table, [2], backend="numpy"), table[[2]])
        assert_bit_equal(fastembed.lookup(table, [3]), table[[3]])
    assert served == [(expected, "small"), ("numpy", "gather"), (expected, "small")] * 2
    environment("numpy")
    served.clear()
    assert_bit_equal(emb([3]), table[[3]])
    assert_bit_equal(fastembed.lookup(table, [3]), table[[3]])
    assert served == [("numpy", "small")] * 2
    environment("cuda")
    for call in (lambda: emb([1]), lambda: fastembed.lookup(table, [1])):
        with pytest.raises(fastembed.BackendUnavailableError):
            call()
    with pytest.raises(TypeError, match="backend must be a string"):
        emb([1], backend=["numba"])
    monkeypatch.setenv(dispatch.ENVIRONMENT_VARIABLE, "numpy")
    dispatch.refresh()
    served.clear()
    assert_bit_equal(emb([4], out=np.empty((1, 4), table.dtype)), table[[4]])
    assert_bit_equal(fastembed.lookup(table, [4], out=np.empty((1, 4), table.dtype)), table[[4]])
    assert served == [("numpy", "small into")] * 2
    served.clear()
    assert_bit_equal(emb([4], out=np.empty((1, 4), table.dtype), backend="numpy"), table[[4]])
    assert served == [("numpy", "gather")]


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="needs numba: its small gather stops at SERIAL_MIN_BYTES")
def test_small_lookups_call_the_backends_small_gathers_and_larger_ones_its_gather(monkeypatch):
    """Below the backend's size the API calls its small gathers directly (allocating, or into an out); from it on,
    and with any other request, the backend's gather; the rows are the same either way."""
    served = []
    _record_serving(monkeypatch, served)
    table = random_table(600, 1024)  # 2 KiB rows
    rows = numba_backend.SERIAL_MIN_BYTES // (1024 * table.dtype.itemsize)
    emb = fastembed.Embedding(table)
    ids = np.random.default_rng(0).integers(0, 600, rows)
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)  # no numpy stand-in while the kernels compile
    for call in (emb, lambda i: fastembed.lookup(table, i)):
        served.clear()
        assert_bit_equal(call(ids[: rows - 1]), table[ids[: rows - 1]])
        assert_bit_equal(call(ids), table[ids])
        assert served == [("numba", "small"), ("numba", "gather")]
    for call in (lambda i, out: emb(i, out), lambda i, out: fastembed.lookup(table, i, out=out)):
        served.clear()
        for n in (rows - 1, rows):
            out = np.full((n, 1024), np.nan, table.dtype)
            assert call(ids[:n], out) is out
            assert_bit_equal(out, table[ids[:n]])
        assert served == [("numba", "small into"), ("numba", "gather")]
    served.clear()
    backend_auto = "".join(["au", "to"])  # equal to "auto" but another object: the general path
    assert_bit_equal(emb(ids[:3], backend=backend_auto), table[ids[:3]])
    assert_bit_equal(fastembed.lookup(table, ids[:3], backend="numba"), table[ids[:3]])
    assert_bit_equal(fastembed.lookup(table, np.asarray(ids[:3], np.int16)), table[ids[:3]])  # converted ids
    assert served == [("numba", "gather"), ("numba", "gather"), ("numba", "small")]
    with pytest.raises(IndexError, match="position 1"):
        emb(np.array([3, 600]))
    with pytest.raises(IndexError, match="position 0"):
        fastembed.lookup(table, np.array([-1, 2]))


@pytest.mark.parametrize("backend", [["numba"], {"name": "numba"}, None, 1, b"numba", ("numba",)])
def test_a_backend_that_is_not_a_string_is_named_in_the_error(backend):
    """Whether it can be hashed or not: a TypeError, as for every argument of the wrong type."""
    for call in (lambda: fastembed.lookup(random_table(10, 4), [1], backend=backend),
                 lambda: fastembed.select_backend(random_table(10, 4), [1], backend=backend),
                 lambda: fastembed.Embedding(random_table(10, 4))(np.arange(40) % 10, backend=backend)):
        with pytest.raises(TypeError, match="backend must be a string, one of auto, cuda, numba, numpy; got"):
            call()


def test_select_backend_takes_an_out_and_a_dtype_for_a_quantized_table():
    """As lookup: a quantized table gathers into float32 by default, or into the dtype asked for."""
    from fastembed.tables import random_quantized_table

    table = random_quantized_table("q8_0", 20, 64, seed=3)
    ids = np.array([1, 5])
    expected = fastembed.select_backend(table, ids).backend
    assert fastembed.select_backend(table, ids, np.empty((2, 64), np.float32)).backend == expected
    assert fastembed.select_backend(table, ids, np.empty((2, 64), np.float16), dtype="float16").backend == expected
    for out, dtype in [(np.empty((2, 64), np.float16), None), (np.empty((2, 64), np.float32), "float16")]:
        with pytest.raises(TypeError):
            fastembed.lookup(table, ids, out=out, dtype=dtype)
        with pytest.raises(TypeError):
            fastembed.select_backend(table, ids, out, dtype=dtype)
    with pytest.raises(TypeError, match="dequantizes into"):
        fastembed.select_backend(table, ids, dtype="int8")


@pytest.mark.parametrize("dtype, bad", [("int64", 20), ("int64", -1), ("int32", 20), ("int32", -1), ("uint16", 20)])
def test_select_backend_refuses_an_id_out_of_range_as_lookup_does(dtype, bad):
    """int32/int64 ids are checked by the kernels as they gather, so select_backend checks them itself."""
    from fastembed.tables import random_quantized_table

    ids = np.array([3, bad], dtype)
    for table in (random_table(20, 4), random_quantized_table("q8_0", 20, 64)):
        with pytest.raises(IndexError, match=f"id {bad} at position 1") as from_lookup:
            fastembed.lookup(table, ids)
        with pytest.raises(IndexError) as from_select:
            fastembed.select_backend(table, ids)
        assert str(from_select.value) == str(from_lookup.value)
    table = random_table(20, 4)  # with another error in the same call, the same one of the two comes first
    for arguments in [{"dtype": "int8"}, {"out": np.empty((3, 4), table.dtype)}, {"backend": "tpu"}]:
        with pytest.raises((TypeError, ValueError, IndexError)) as from_lookup:
            fastembed.lookup(table, ids, **arguments)
        with pytest.raises((TypeError, ValueError, IndexError)) as from_select:
            fastembed.select_backend(table, ids, **arguments)
        assert (from_select.type, str(from_select.value)) == (from_lookup.type, str(from_lookup.value))


def test_a_choice_made_while_the_choices_are_forgotten_is_not_remembered(monkeypatch):
    """A backend that finds out meanwhile that it cannot run has the choices forgotten: a choice made before must not stay."""
    original = dispatch._choose

    def choose_then_forget(*arguments):
        chosen = original(*arguments)
        dispatch._forget_choices()  # what a backend's failure on another thread does at this moment
        return chosen

    monkeypatch.setattr(dispatch, "_choose", choose_then_forget)
    table = random_table(10, 4)
    dispatch._forget_choices()
    dispatch.select(table)
    assert dispatch._selected == {}


def test_select_backend_leaves_a_gpu_tables_ids_to_the_lookup(cupy_or_double):
    """On the device the lookup checks ids (or defers the check): select_backend neither syncs nor raises for them."""
    from fastembed.backends import cuda_backend

    table = cuda_backend.to_device(random_table(20, 64), 0)
    for ids in ([3, 20], cupy_or_double.asarray(np.array([3, 20]))):
        assert fastembed.select_backend(table, ids).backend == "cuda"
        with fastembed.deferred_id_checks():
            assert fastembed.lookup(table, ids).shape == (2, 64)
        with pytest.raises(IndexError):
            fastembed.raise_deferred_id_errors()


def test_a_finder_refusing_numba_or_a_stub_cupy_module_leaves_auto_on_numpy_and_info_saying_why(tmp_path):
    """Asking whether numba or cupy could be found raised out of every lookup, and out of info."""
    from helpers import run_script

    finished = run_script(tmp_path, """
import importlib.abc, subprocess, sys, types
import numpy as np

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("numba", "llvmlite"):
            raise ImportError(name + " is not allowed here")

sys.meta_path.insert(0, Refuse())
sys.modules["cupy"] = types.ModuleType("cupy")  # a stub without a spec
import fastembed
from fastembed import info
table = np.arange(40, dtype=np.float32).reshape(10, 4)
assert np.array_equal(fastembed.lookup(table, [3, 1]), table[[3, 1]])
assert fastembed.select_backend(table, np.arange(3)).backend == "numpy"
text = str(info.report())
assert "numba cannot be imported here (ImportError: numba is not allowed here)" in text, text
assert "cupy cannot be imported here (ValueError" in text, text
print("served")
""")
    assert "served" in finished.stdout, finished.stdout + finished.stderr
