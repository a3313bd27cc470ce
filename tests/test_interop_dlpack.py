"""Arrays of other libraries through DLPack (fastembed/arrays/dlpack_adapter.py, docs/interop.md).

``Producer`` stands for a library fastembed has no adapter for: it exports a
numpy array's memory through ``__dlpack__``/``__dlpack_device__`` and is
nothing else (no ``__array__``, no buffer protocol), so whatever fastembed
reads of it, it reads through DLPack.
"""
from __future__ import annotations

import numpy as np
import pytest

import fastembed
from fastembed import validate
from fastembed.arrays import adapter_of, dlpack_adapter
from helpers import Producer, assert_bit_equal, poisoned, random_table


class LegacyProducer(Producer):
    """A producer from before DLPack 1.0: ``__dlpack__`` takes no max_version."""

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()


class DeviceProducer:
    """An array on a device (DLPack device type, index); there is no such device here."""

    def __init__(self, device_type: int, index: int):
        self.device = (device_type, index)

    def __dlpack__(self, **kwargs):
        raise AssertionError("fastembed must not export an array that is not in host memory")

    def __dlpack_device__(self):
        return self.device


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


@pytest.mark.parametrize("kind", [Producer, LegacyProducer])
def test_a_producer_table_is_gathered_zero_copy_into_a_numpy_result(backend, kind):
    table = random_table(50, 8)
    source = kind(table)
    assert adapter_of(source) is dlpack_adapter.ADAPTER
    assert address(validate.table_snapshot(source)) == address(table)  # the snapshot is the table's memory
    ids = np.array([[3, 49], [0, 3]])
    rows = fastembed.lookup(source, ids, backend=backend)
    assert type(rows) is np.ndarray
    assert_bit_equal(rows, table[ids])
    emb = fastembed.Embedding(source)
    assert emb.table is source and (emb.vocab_size, emb.dim, emb.device) == (50, 8, "cpu")
    table[3] = 1  # the layer reads the producer's memory: a copy would not see this
    assert_bit_equal(emb([3], backend=backend), table[[3]])


def test_producer_ids_are_read_through_dlpack_into_the_calls_own_copy(backend):
    table = random_table(50, 8)
    ids = np.array([[7, 0, 49]], dtype=np.int32)
    snapshot = validate.ids_snapshot(Producer(ids), table)
    assert snapshot.dtype == ids.dtype and address(snapshot) != address(ids)
    assert_bit_equal(snapshot, ids)
    assert_bit_equal(fastembed.lookup(table, Producer(ids), backend=backend), table[ids])
    assert_bit_equal(fastembed.Embedding(table)(Producer(np.array([5], np.uint16)), backend=backend), table[[5]])


def test_a_producer_out_is_written_in_place_and_returned(backend):
    table = random_table(50, 8)
    out = poisoned((3, 8), table.dtype)
    given = Producer(out)
    assert address(validate.out_snapshot(given, np.array([1, 2, 3]), table, table, [1, 2, 3])) == address(out)
    assert fastembed.lookup(table, [1, 2, 3], out=given, backend=backend) is given
    assert_bit_equal(out, table[[1, 2, 3]])
    out[:] = 0
    assert fastembed.Embedding(Producer(table))([4, 0, 4], out=given, backend=backend) is given
    assert_bit_equal(out, table[[4, 0, 4]])


def test_a_read_only_export_is_refused_as_out_and_served_as_a_table():
    table = random_table(50, 8)
    table.setflags(write=False)
    assert not validate.table_snapshot(Producer(table)).flags.writeable  # DLPack's read-only flag is kept
    assert_bit_equal(fastembed.lookup(Producer(table), [2]), table[[2]])
    out = np.zeros((1, 8), table.dtype)
    out.setflags(write=False)
    with pytest.raises(ValueError, match="out is read-only"):
        fastembed.lookup(table, [2], out=Producer(out))
    assert not out.any()


def test_a_legacy_export_as_out_is_refused_saying_why():
    table = random_table(50, 8)
    out = np.zeros((1, 8), table.dtype)
    with pytest.raises(ValueError, match=r"out is read-only memory.*predates DLPack 1.0"):
        fastembed.lookup(table, [2], out=LegacyProducer(out))
    assert not out.any()


class CopyingProducer(Producer):
    """A producer that can export only a copy of its memory: it raises when asked for none (copy=False)."""

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy is False:
            raise BufferError("this array can only be exported as a copy")
        return self.array.copy().__dlpack__(max_version=max_version)


class TypeErrorCopyingProducer(CopyingProducer):
    """A DLPack 1.0 producer that refuses copy=False with a TypeError instead of a BufferError."""

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy is False:
            raise TypeError("this array can only be exported as a copy")
        return super().__dlpack__(max_version=max_version)


@pytest.mark.parametrize("producer", [CopyingProducer, TypeErrorCopyingProducer])
def test_a_producer_that_can_only_export_a_copy_is_refused(producer):
    if not dlpack_adapter._NUMPY_ASKS_FOR_NO_COPY:
        pytest.skip("numpy before 2.1 cannot ask a DLPack producer not to copy")
    table = random_table(50, 8)
    out = np.zeros((2, 8), table.dtype)
    with pytest.raises(TypeError, match="can only be exported as a copy"):
        fastembed.lookup(table, [1, 2], out=producer(out))
    assert not out.any()
    with pytest.raises(TypeError, match="can only be exported as a copy"):
        fastembed.Embedding(producer(table))


def test_a_copy_only_producer_is_refused_after_an_old_producer_behind_the_same_wrapper_type():
    """One wrapper type (as in docs/interop.md) may hold producers of both protocols: each is asked on its own."""
    if not dlpack_adapter._NUMPY_ASKS_FOR_NO_COPY:
        pytest.skip("numpy before 2.1 cannot ask a DLPack producer not to copy")
    table = random_table(50, 8)
    assert_bit_equal(fastembed.lookup(Producer(LegacyProducer(table)), [3]), table[[3]])
    out = np.zeros((2, 8), table.dtype)
    with pytest.raises(TypeError, match="can only be exported as a copy"):
        fastembed.lookup(table, [1, 2], out=Producer(TypeErrorCopyingProducer(out)))
    assert not out.any()


@pytest.mark.parametrize("device_type, index, name", [(2, 1, "cuda:1"), (10, 0, "rocm:0"), (8, 0, "metal:0"),
                                                      (99, 3, "dlpack device type 99:3")])
def test_a_producer_off_the_host_is_a_type_error_naming_its_device(device_type, index, name):
    table = random_table(10, 4)
    with pytest.raises(TypeError, match=f"array on {name} is not supported: fastembed reads DLPack arrays of other "
                                        "libraries in host memory"):
        fastembed.lookup(DeviceProducer(device_type, index), [1])
    with pytest.raises(TypeError, match=f"ids live on {name} but the table lives on cpu"):
        fastembed.lookup(table, DeviceProducer(device_type, index))
    with pytest.raises(TypeError, match=f"out lives on {name} but the table lives on cpu"):
        fastembed.lookup(table, [1], out=DeviceProducer(device_type, index))


def test_pinned_host_memory_counts_as_the_host():
    assert dlpack_adapter.ADAPTER.device(DeviceProducer(3, 0)) == "cpu"  # kDLCUDAHost


def test_what_numpy_cannot_take_is_a_type_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="cannot be seen as a numpy array through DLPack"):
        fastembed.lookup(Producer(torch.ones((4, 2), dtype=torch.bfloat16)), [1])

    class BadDevice(Producer):
        def __dlpack_device__(self):
            return "cpu"

    class RaisingDevice(Producer):
        def __dlpack_device__(self):
            raise RuntimeError("the producer failed")

    with pytest.raises(TypeError, match=r"__dlpack_device__\(\) must return \(device type, device index\)"):
        fastembed.lookup(BadDevice(np.ones((4, 2))), [1])
    with pytest.raises(TypeError, match=r"__dlpack_device__\(\) failed: the producer failed"):
        fastembed.lookup(RaisingDevice(np.ones((4, 2))), [1])


@pytest.mark.parametrize("raised", [AttributeError("no buffer"), KeyError("stream"), OSError("device lost")])
def test_an_error_inside_the_producers_export_is_a_type_error(raised):
    class Failing(Producer):
        def __dlpack__(self, **kwargs):
            raise raised

    for place in ("table", "ids", "out"):
        arrays = {"table": np.ones((4, 2)), "ids": np.array([1]), "out": np.empty((1, 2))}
        arrays[place] = Failing(arrays[place])
        with pytest.raises(TypeError, match="cannot be seen as a numpy array through DLPack"):
            fastembed.lookup(arrays["table"], arrays["ids"], out=arrays["out"])


def test_classes_and_half_producers_are_not_arrays():
    for thing in (np.ndarray, Producer, type("OnlyDlpack", (), {"__dlpack__": lambda self: None})()):
        with pytest.raises(TypeError, match="table must be a numpy array.*exporting DLPack"):
            fastembed.lookup(thing, [0])


def test_adapters_are_remembered_per_type_only_where_the_type_decides_and_within_a_bound():
    from fastembed import arrays

    class MaybeExporter:
        def __init__(self, exports):
            if exports:
                self.__dlpack__ = np.arange(3).__dlpack__
                self.__dlpack_device__ = lambda: (1, 0)

    assert arrays.adapter_of(MaybeExporter(True)).name == "dlpack"
    assert arrays.adapter_of(MaybeExporter(False)) is None
    for index in range(3 * arrays._MAX_TYPES_REMEMBERED):
        subclass = type(f"Array{index}", (np.ndarray,), {})
        assert arrays.adapter_of(np.zeros(2).view(subclass)).name == "numpy"
    assert len(arrays._ADAPTER_OF_TYPE) <= arrays._MAX_TYPES_REMEMBERED
