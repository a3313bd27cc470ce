"""The typed backend interface: a backend is one object that declares what it serves; adding one is one registration."""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import fastembed
from fastembed import dispatch, validate
from fastembed.backends import base
from helpers import assert_bit_equal, poisoned, random_table


class RowLoopBackend:
    """A deliberately plain backend: one Python-level row copy per id (the exercise of adding a backend)."""

    name = "rowloop"
    capabilities = base.Capabilities(array_libraries=frozenset({"numpy"}), devices=frozenset({"cpu"}))

    def __init__(self) -> None:
        self.calls = 0

    def unavailable_reasons(self) -> list[str]:
        return []

    def gather(self, table: np.ndarray, ids: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        validate.check_ids_in_range(ids, table.shape[0])
        if out is None:
            out = np.empty(validate.output_shape(ids, table), table.dtype)
        rows = out.reshape(-1, table.shape[1])
        for position, row in enumerate(ids.reshape(-1).tolist()):
            rows[position] = table[row]
        self.calls += 1
        return out

    def describe(self) -> dict[str, Any]:
        return {"rows": "one Python copy per id"}

    def reset(self) -> None:
        self.calls = 0


@pytest.fixture
def rowloop():
    backend = RowLoopBackend()
    dispatch.register_backend(backend, before="numpy")
    yield backend
    dispatch.unregister_backend(backend.name)


def test_only_an_added_backend_can_be_removed(rowloop):
    for name in ("numba", "numpy", "cuda", "nope"):
        with pytest.raises(ValueError, match=f"no backend named '{name}' was added with register_backend "
                                             r"\(added: rowloop; the built-in cuda, numba, numpy stay\)"):
            dispatch.unregister_backend(name)
    assert list(dispatch.BACKENDS) == ["cuda", "numba", "rowloop", "numpy"]


def test_every_registered_backend_implements_the_protocol():
    for backend in dispatch.BACKENDS.values():
        assert isinstance(backend, base.Backend), backend
        assert backend.capabilities.array_libraries and backend.capabilities.devices


def test_a_new_backend_is_one_object_and_one_registration(rowloop):
    table = random_table(50, 7, "bfloat16")
    ids = np.random.default_rng(0).integers(0, 50, (3, 4)).astype(np.int32)
    assert [status.name for status in fastembed.backend_statuses()][-2:] == ["rowloop", "numpy"]
    assert_bit_equal(fastembed.lookup(table, ids, backend="rowloop"), table[ids])
    out = poisoned((3, 4, 7), table.dtype)
    assert fastembed.lookup(table, ids, out=out, backend="rowloop") is out
    assert_bit_equal(out, table[ids])
    assert rowloop.calls == 2
    with pytest.raises(IndexError, match="id 50 at position 1"):
        fastembed.lookup(table, [0, 50], backend="rowloop")


def test_reasons_are_derived_from_declared_capabilities(rowloop):
    reasons = base.not_supported_reasons(rowloop, "cupy", "cuda:0")
    assert reasons == ["the table is a cupy array on cuda:0; the rowloop backend gathers numpy arrays"]
    cuda_like = base.Capabilities(array_libraries=frozenset({"cupy"}), devices=frozenset({"cuda"}))
    rowloop.capabilities = cuda_like
    try:
        dispatch.refresh()
        with pytest.raises(fastembed.BackendUnavailableError, match="rowloop.*numpy array on cpu.*gathers cupy arrays"):
            fastembed.lookup(random_table(5, 2), [1], backend="rowloop")
    finally:
        del rowloop.capabilities
        dispatch.refresh()


def test_registration_refuses_duplicates_and_non_backends(rowloop):
    with pytest.raises(ValueError, match="already registered"):
        dispatch.register_backend(RowLoopBackend())
    with pytest.raises(TypeError, match="does not implement"):
        dispatch.register_backend(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        other = RowLoopBackend()
        other.name = "other"
        dispatch.register_backend(other, before="tpu")
    named_auto = RowLoopBackend()
    named_auto.name = "auto"
    with pytest.raises(ValueError, match="'auto' names the automatic choice"):
        dispatch.register_backend(named_auto)


def test_a_backend_whose_small_gather_names_no_gather_into_serves_outs_through_gather():
    """A SmallGather of three fields, as backends built it before gather_into: its gather serves lookups into an out."""

    class ThreeFields(RowLoopBackend):
        name = "threefields"

        def small_gather(self) -> base.SmallGather:
            return base.SmallGather(sys.maxsize, lambda table, ids: self.gather(table, ids, None), sys.maxsize)

    backend = ThreeFields()
    dispatch.register_backend(backend, before=next(iter(dispatch.BACKENDS)))  # first: auto picks it
    try:
        table = random_table(50, 7)
        out = np.full((2, 7), np.nan, table.dtype)
        assert fastembed.lookup(table, [4, 5], out=out) is out
        assert_bit_equal(out, table[[4, 5]])
        assert_bit_equal(fastembed.Embedding(table)([6], np.empty((1, 7), table.dtype)), table[[6]])
        assert_bit_equal(fastembed.lookup(table, [3]), table[[3]])
        assert backend.calls == 3
    finally:
        dispatch.unregister_backend(backend.name)
        dispatch.refresh()


def test_a_backend_without_small_gather_serves_small_lookups_through_gather():
    """auto picking a backend with no small gather: the API never calls past it, however few the ids."""
    backend = RowLoopBackend()
    dispatch.register_backend(backend, before=next(iter(dispatch.BACKENDS)))  # first: auto picks it
    try:
        table = random_table(50, 7)
        emb = fastembed.Embedding(table)
        assert_bit_equal(emb([3]), table[[3]])
        assert_bit_equal(fastembed.lookup(table, [[4, 5]]), table[[[4, 5]]])
        assert backend.calls == 2
        reversed_row = table[::-1][:1]  # one row, a negative stride: the output size test must not matter
        assert_bit_equal(fastembed.lookup(reversed_row, [0]), table[[49]])
        assert backend.calls == 3
    finally:
        dispatch.unregister_backend(backend.name)
        dispatch.refresh()


@pytest.mark.parametrize("name", ["numba", "numpy"])
def test_a_host_backends_small_gathers_are_its_gather_below_its_size(name):
    """SmallGather's contract: below_bytes of output, gather_new(table, ids) is gather(table, ids, None) and
    gather_into(table, ids, out) is gather(table, ids, out), bit for bit, and out is left as it was on a bad id."""
    backend = dispatch.BACKENDS[name]
    if backend.unavailable_reasons():
        pytest.skip(f"{name} is not available here")
    assert isinstance(backend, base.SmallGatherBackend)
    below, gather_new, calling_thread_below, gather_into = backend.small_gather()
    assert calling_thread_below >= below
    table = random_table(3000, 1000, "float16")
    rows = min(below // table.strides[0], 2000) if below < 2**40 else 2000
    for ids in (np.array([7]), np.random.default_rng(1).integers(0, 3000, (2, rows // 2)), np.zeros(0, np.int64)):
        snapshot = validate.ids_snapshot(ids, table)
        assert snapshot.size * table.strides[0] < below
        assert_bit_equal(gather_new(table, snapshot), backend.gather(table, snapshot, None))
        assert_bit_equal(gather_new(table, snapshot), table[ids])
        out, out_by_gather = (np.full(ids.shape + (1000,), np.nan, table.dtype) for _ in range(2))
        assert gather_into(table, snapshot, out) is out
        backend.gather(table, snapshot, out_by_gather)
        assert_bit_equal(out, out_by_gather)
        assert_bit_equal(out, table[ids])
    with pytest.raises(IndexError, match="id -1 at position 0"):
        gather_new(table, np.array([-1, 4]))
    for bad in ([-1, 4], [4, 3000]):
        out = np.full((2, 1000), np.nan, table.dtype)
        with pytest.raises(IndexError, match=f"id {bad[0] if bad[0] < 0 else bad[1]} at position {0 if bad[0] < 0 else 1}"):
            gather_into(table, np.array(bad), out)
        assert np.isnan(out).all()


def test_lookups_on_other_threads_never_fail_while_backends_are_registered_and_removed():
    """A registration reorders the registry by single moves, and the dispatcher reads it through snapshots."""
    from fastembed.backends import numpy_backend

    class Extra(numpy_backend.NumpyBackend):
        name = "extra"

    table, failures, stop = np.ones((64, 8), np.float32), [], threading.Event()

    def look_up():
        while not stop.is_set():
            for backend in ("numpy", "auto"):
                try:
                    fastembed.lookup(table, [1, 2], backend=backend)
                except Exception as error:  # noqa: BLE001 - every failure is collected and shown
                    failures.append(f"{backend}: {type(error).__name__}: {error}")

    workers = [threading.Thread(target=look_up) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            dispatch.register_backend(Extra(), before="numba")
            assert list(dispatch.BACKENDS) == ["cuda", "extra", "numba", "numpy"]
            dispatch.unregister_backend("extra")
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert not failures, failures[:3]


def test_registering_a_backend_never_changes_the_order_of_those_already_registered(monkeypatch):
    """Every order a concurrent reader could see keeps cuda, numba and numpy in their order."""
    from fastembed.backends import numpy_backend

    class Extra(numpy_backend.NumpyBackend):
        name = "extra"

    seen = []

    class Watched(type(dispatch.BACKENDS)):
        def move_to_end(self, key, last=True):
            super().move_to_end(key, last)
            seen.append([name for name in self if name != "extra"])

    watched = Watched(dispatch.BACKENDS)
    monkeypatch.setattr(dispatch, "BACKENDS", watched)
    try:
        for before in ("cuda", "numba", "numpy"):
            dispatch.register_backend(Extra(), before=before)
            names = list(watched)
            assert names.index("extra") == names.index(before) - 1
            dispatch.unregister_backend("extra")
    finally:
        monkeypatch.undo()
        dispatch.refresh()
    assert seen and all(order == ["cuda", "numba", "numpy"] for order in seen)
