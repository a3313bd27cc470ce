"""Every bad input gets its exception with the stated content, and out stays untouched."""
from __future__ import annotations

import mmap
import os
import sys
import tempfile
import warnings

import numpy as np
import pytest

import fastembed
from fastembed import dispatch
from helpers import CPU_BACKENDS, assert_bit_equal, poisoned, random_table


class FakeGpuArray:
    """Looks like a GPU array to fastembed (it exposes __cuda_array_interface__)."""

    def __init__(self, shape=(4,), dtype=np.int64):
        self.shape, self.dtype, self.ndim = shape, np.dtype(dtype), len(shape)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": self.dtype.str, "data": (0, False), "version": 3}


@pytest.fixture
def table():
    return random_table(100, 8)


@pytest.mark.parametrize(
    "ids, words",
    [
        (np.array([1.0, 2.0]), "floating"),
        (np.array([True, False]), "bool"),
        (True, "bool"),
        (np.array([1 + 0j]), "complex"),
        (np.array(["1"]), "string"),
        (np.array([1, 2], dtype=object), "object"),
        ([1.5], "floating"),
    ],
)
def test_non_integer_ids_raise_type_error(table, backend, ids, words):
    with pytest.raises(TypeError, match=words):
        fastembed.lookup(table, ids, backend=backend)


@pytest.mark.parametrize(
    "ids, position, value",
    [
        ([1, 2, 100], "position 2", "id 100"),
        ([-1], "position 0", "id -1"),
        ([[0, 1], [5, 1000]], r"position \(1, 1\)", "id 1000"),
        (np.array([[3, 4, 5], [-7, 200, 0]], dtype=np.int32), r"position \(1, 0\)", "id -7"),
        (np.array([2**63 + 5], dtype=np.uint64), "position 0", f"id {2**63 + 5}"),
        (np.int64(100), r"position \(\)", "id 100"),
    ],
)
@pytest.mark.parametrize("with_out", [True, False])
def test_out_of_range_ids_name_position_value_and_range(table, backend, ids, position, value, with_out):
    out = poisoned(np.shape(ids) + (8,), table.dtype) if with_out else None
    before = out.copy() if with_out else None
    with pytest.raises(IndexError, match=f"{value} at {position}.*100 rows.*0..99"):
        fastembed.lookup(table, ids, out=out, backend=backend)
    if with_out:
        np.testing.assert_array_equal(out.view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("with_out", [True, False])
def test_first_bad_id_is_reported_in_a_huge_batch(table, backend, with_out):
    ids = np.random.default_rng(0).integers(0, 100, 200_000)
    ids[123_456], ids[150_000] = 100, -3
    out = poisoned((200_000, 8), table.dtype) if with_out else None
    before = out.copy() if with_out else None
    with pytest.raises(IndexError, match="id 100 at position 123456"):
        fastembed.lookup(table, ids, out=out, backend=backend)
    if with_out:
        assert np.array_equal(out.view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize(
    "bad_table, error, words",
    [
        (np.zeros(10, np.float16) + 1, ValueError, "2-D.*1-D"),
        (np.ones((2, 3, 4), np.float16), ValueError, "2-D.*3-D"),
        (np.ones((10, 8), np.float16)[:, ::2], ValueError, "C-contiguous"),
        (np.ones((10, 8), np.float16).T, ValueError, "C-contiguous"),
        (np.empty((3, 3), dtype=object), TypeError, "object"),
        (np.zeros((3, 3), dtype=[("row", np.float32), ("tag", object)]), TypeError, "object"),
        (np.zeros((3, 0), dtype="V0"), TypeError, "fixed-size"),
        ([[1.0, 2.0]], TypeError, "numpy array"),
    ],
)
@pytest.mark.parametrize("ids", [[0], np.array([0]), np.array([0], np.int32)], ids=["list", "int64", "int32"])
def test_bad_tables(bad_table, error, words, ids):
    with pytest.raises(error, match=words):
        fastembed.lookup(bad_table, ids)
    with pytest.raises(error, match=words):
        fastembed.Embedding(bad_table)


def test_bad_out(table, backend):
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    cases = [
        (np.empty((2, 3, 9), np.float16), ValueError, r"shape \(2, 3, 9\), expected \(2, 3, 8\)"),
        (np.empty((6, 8), np.float16), ValueError, r"shape \(6, 8\), expected \(2, 3, 8\)"),
        (np.empty((2, 3, 8), np.float32), TypeError, "dtype float32, expected.*float16"),
        (np.empty((2, 3, 16), np.float16)[..., ::2], ValueError, "C-contiguous"),
        ([[0.0]], TypeError, "out must be an array"),
    ]
    readonly = poisoned((2, 3, 8), np.float16)
    readonly.flags.writeable = False
    cases.append((readonly, ValueError, "read-only"))
    for out, error, words in cases:
        snapshot = np.array(out, copy=True)
        with pytest.raises(error, match=words):
            fastembed.lookup(table, ids, out=out, backend=backend)
        np.testing.assert_array_equal(np.asarray(out), snapshot)


def test_out_overlapping_table_or_ids(backend):
    table = random_table(100, 8)
    with pytest.raises(ValueError, match="overlaps the table"):
        fastembed.lookup(table, [1, 2], out=table[10:12], backend=backend)
    ids_and_out = np.zeros(16, np.int64)
    ids = ids_and_out[:2]
    out = ids_and_out.view(np.float16)[4 : 4 + 16].reshape(2, 8)  # bytes 8..40 overlap ids[1]
    with pytest.raises(ValueError, match="overlaps the ids"):
        fastembed.lookup(table, ids, out=out, backend=backend)
    # An out that owns its buffer, with the table a view of it or the same array: still found.
    out = poisoned((2, 8), np.float16)
    for table in (out[:], out):
        for ids in ([0, 1], np.array([0, 1])):  # ids a list, or an array owning its memory
            with pytest.raises(ValueError, match="overlaps the table"):
                fastembed.lookup(table, ids, out=out, backend=backend)


def test_out_mapping_the_tables_own_file_is_refused_and_the_file_untouched(backend, tmp_path):
    """A second np.memmap of the table's file has other addresses than the table: the address test let it through,
    and the gather read rows it had just overwritten."""
    path = tmp_path / "rows.bin"
    random_table(10, 4, "float32").tofile(path)
    before = path.read_bytes()
    table = np.memmap(path, np.float32, "r+", shape=(10, 4))
    overlapping = [np.memmap(path, np.float32, "r+", offset=16, shape=(3, 4)),  # file rows 1-3
                   np.memmap(path, np.float32, "r+", shape=(10, 4))[7:10],  # a view of another mapping: rows 7-9
                   np.memmap(path, np.float32, "r+", offset=6 * 16 + 12, shape=(3, 4)),  # starts inside row 6
                   np.memmap(path, np.float32, "r+", offset=16, shape=(3, 4)).view(np.ndarray),  # a plain view
                   # numpy's stride tricks put a holder of their own between a view and the np.memmap
                   np.lib.stride_tricks.as_strided(np.memmap(path, np.float32, "r+", offset=16, shape=(3, 4))),
                   np.lib.stride_tricks.sliding_window_view(np.memmap(path, np.float32, "r+", offset=16, shape=(12,)),
                                                            4, writeable=True)[::4]]
    for out in overlapping:
        with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
            fastembed.lookup(table, [0, 1, 2], out=out, backend=backend)
    assert path.read_bytes() == before
    first_rows = np.memmap(path, np.float32, "r", shape=(5, 4))  # bytes 0-80
    with pytest.raises(ValueError, match="out maps bytes of the table's own file"):  # from the table's last row on
        fastembed.lookup(first_rows, [0, 1, 2], out=np.memmap(path, np.float32, "r+", offset=4 * 16 + 4, shape=(3, 4)),
                         backend=backend)
    assert path.read_bytes() == before
    private = np.memmap(path, np.float32, "c", offset=16, shape=(3, 4))  # copy-on-write: never writes the file
    assert_bit_equal(fastembed.lookup(table, [0, 1, 2], out=private, backend=backend), np.array(table[[0, 1, 2]]))
    assert path.read_bytes() == before
    apart = np.memmap(path, np.float32, "r+", offset=5 * 16, shape=(3, 4))  # rows 5-7, past the table's rows 0-4
    expected = np.array(first_rows[[0, 1, 2]])
    assert_bit_equal(fastembed.lookup(first_rows, [0, 1, 2], out=apart, backend=backend), expected)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs the kernel's list of mappings (Linux)")
def test_the_files_compared_are_those_mapped_whatever_their_names_now(backend, tmp_path):
    """The file was looked up by name at lookup time: once renamed or removed, an out over the table's rows passed
    and read back rows it had just overwritten; a new file under the old name was taken for the table's."""
    odd = tmp_path / "a\rb 0-ffffffffffffffff r--s 00000000 00:01 5 c"  # a name that reads like a line of the list
    odd.write_bytes(bytes(4096))
    mapped_first = np.memmap(odd, np.uint8, "r")
    path = tmp_path / "rows.bin"
    table_rows = random_table(16, 4, "float32")
    for move in (lambda: path.rename(tmp_path / "moved.bin"), path.unlink):
        table_rows.tofile(path)
        table = np.memmap(path, np.float32, "r", shape=(16, 4))
        out = np.memmap(path, np.float32, "r+", shape=(16, 4))[8:12]
        move()
        with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
            fastembed.lookup(table, [7, 8, 9, 10], out=out, backend=backend)
        assert_bit_equal(np.array(table), table_rows)
    table_rows.tofile(path)
    table = np.memmap(path, np.float32, "r", shape=(16, 4))
    replacement = tmp_path / "new.bin"
    random_table(16, 4, "float32").tofile(replacement)
    os.replace(replacement, path)  # the name now leads to another file, which the table does not map
    out = np.memmap(path, np.float32, "r+", shape=(16, 4))[8:12]
    assert_bit_equal(fastembed.lookup(table, [7, 8, 9, 10], out=out, backend=backend), table_rows[[7, 8, 9, 10]])
    del mapped_first
    with tempfile.TemporaryFile() as nameless:  # a file without a name: the mappings alone can tell
        table_rows.tofile(nameless)
        nameless.flush()
        table = np.memmap(nameless, np.float32, "r", shape=(16, 4))
        out = np.memmap(nameless, np.float32, "r+", shape=(16, 4))[8:12]
        with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
            fastembed.lookup(table, [7, 8, 9, 10], out=out, backend=backend)
        assert_bit_equal(np.array(table), table_rows)
        del table, out


def test_the_file_check_measures_the_calls_snapshots_not_the_callers_arrays(backend, tmp_path):
    """The check measured the bytes of the caller's table and out as they were at its time: a table restrided
    to one item after a layer was built (or while a lookup ran), or a quantized table's data swapped for an
    in-memory copy, let an out over the table's own file through, and the gather overwrote rows it had to read."""
    path = tmp_path / "rows.bin"
    rows = random_table(16, 4, "float32")
    rows.tofile(path)
    before = path.read_bytes()
    table = np.memmap(path, np.float32, "r", shape=(16, 4))
    emb = fastembed.Embedding(table)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2.4 deprecates setting strides, and allows it
        table.strides = (0, 0)
    out = np.memmap(path, np.float32, "r+", offset=16, shape=(3, 4))
    with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
        emb([0, 1, 2], out, backend)
    assert path.read_bytes() == before
    quantized = fastembed.Embedding(random_table(64, 32, "float32")).quantize("q8_0").table
    quantized.data.tofile(path)
    data = np.memmap(path, np.uint8, "r", shape=quantized.data.shape)
    caller_table = fastembed.formats.QuantizedTable(data, "q8_0", 32)

    def another_thread(frame, event, arg):  # swaps the caller's data for a copy after the call's snapshot
        if event == "call" and frame.f_code.co_name == "out_snapshot":
            caller_table.data = np.array(data)

    sys.setprofile(another_thread)
    try:
        with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
            fastembed.lookup(caller_table, [0, 1], out=np.memmap(path, np.float32, "r+", shape=(2, 32)), backend=backend)
    finally:
        sys.setprofile(None)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs the kernel's list of mappings (Linux)")
def test_the_file_check_reads_what_each_mapping_maps_from_the_kernel_not_from_the_memmaps_attributes(backend, tmp_path):
    """The check read an np.memmap's ``mode``, ``offset`` and ``_mmap``, which any thread may reassign: an out over
    the table's own file whose mode read "c", whose offset pointed elsewhere, or whose ``_mmap`` was another map
    passed, and so did a map of the file that is no np.memmap (np.frombuffer of an mmap)."""
    path = tmp_path / "rows.bin"
    random_table(16, 4, "float32").tofile(path)
    before = path.read_bytes()
    table = np.memmap(path, np.float32, "r", shape=(16, 4))
    reassignments = {"mode": lambda memmap: setattr(memmap, "mode", "c"),
                     "offset": lambda memmap: setattr(memmap, "offset", 10**9),
                     "_mmap": lambda memmap: setattr(memmap, "_mmap", mmap.mmap(-1, 4096)),
                     "_mmap None": lambda memmap: setattr(memmap, "_mmap", None)}
    for what, reassign in reassignments.items():
        out = np.memmap(path, np.float32, "r+", shape=(16, 4))
        reassign(out)
        for view in (out[8:12], out[8:12].view(np.ndarray)):
            with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
                fastembed.lookup(table, [7, 8, 9, 10], out=view, backend=backend)
            assert path.read_bytes() == before, what
    with open(path, "r+b") as handle:
        mapped = mmap.mmap(handle.fileno(), 0)
    out = np.frombuffer(mapped, np.float32).reshape(16, 4)[8:12]
    with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
        fastembed.lookup(table, [7, 8, 9, 10], out=out, backend=backend)
    assert path.read_bytes() == before
    with open(path, "rb") as handle:  # a copy-on-write map of the file: its writes never reach the file
        private = np.frombuffer(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY), np.float32)
    expected = np.array(table[[7, 8, 9, 10]])
    assert_bit_equal(fastembed.lookup(table, [7, 8, 9, 10], out=private.reshape(16, 4)[8:12], backend=backend),
                     expected)
    assert path.read_bytes() == before
    del out


def test_without_the_kernels_list_of_mappings_the_file_check_reads_the_memmaps(backend, tmp_path, monkeypatch):
    """Where there is no /proc/self/maps, an np.memmap's offset, mode and file name tell what it maps."""
    from fastembed.arrays import numpy_adapter

    monkeypatch.setattr(numpy_adapter, "_listed_mapping", lambda address: numpy_adapter._UNLISTED)
    monkeypatch.setattr(numpy_adapter, "_FACTS_OF_MAPPING", numpy_adapter.weakref.WeakKeyDictionary())
    path = tmp_path / "rows.bin"
    rows = random_table(16, 4, "float32")
    rows.tofile(path)
    before = path.read_bytes()
    table = np.memmap(path, np.float32, "r", shape=(8, 4))  # file rows 0-7
    with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
        fastembed.lookup(table, [1, 2], out=np.memmap(path, np.float32, "r+", offset=6 * 16, shape=(2, 4)),
                         backend=backend)
    assert path.read_bytes() == before
    for out in (np.memmap(path, np.float32, "r+", offset=8 * 16, shape=(2, 4)),  # file rows 8-9: apart
                np.memmap(path, np.float32, "c", offset=16, shape=(2, 4))):  # copy-on-write
        assert_bit_equal(fastembed.lookup(table, [1, 2], out=out, backend=backend), rows[[1, 2]])


def test_out_mapping_the_file_of_a_copy_on_write_table_is_refused(backend, tmp_path):
    """A copy-on-write table reads the file's own pages (it never writes them): a shared map's writes reach it."""
    path = tmp_path / "table.npy"
    np.save(path, random_table(10, 4, "float32"))
    before = path.read_bytes()
    table = np.load(path, mmap_mode="c")
    out = np.memmap(path, np.float32, "r+", offset=128, shape=(10, 4))[1:3]  # the .npy header is 128 bytes
    with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
        fastembed.lookup(table, [2, 1], out=out, backend=backend)
    assert path.read_bytes() == before


def test_a_layer_over_a_quantized_file_refuses_an_out_over_its_scales(backend, tmp_path):
    """The layer checked an out against the file of the table's data only, and the scales' bytes were overwritten
    before the rows that needed them were dequantized."""
    path = tmp_path / "table.safetensors"
    fastembed.Embedding(random_table(1000, 64, "float32")).quantize("fp8_e4m3").save(path)
    before = path.read_bytes()
    emb = fastembed.Embedding.from_safetensors(path)
    scales = emb.table.scales
    out = np.memmap(path, np.float32, "r+", offset=scales.offset, shape=(2, 64))  # inside the 4,000 bytes of row scales
    for call in (lambda: emb([5, 10], out=out, backend=backend),
                 lambda: fastembed.lookup(emb.table, [5, 10], out=out, backend=backend)):
        with pytest.raises(ValueError, match="out maps bytes of the table's own file"):
            call()
    assert path.read_bytes() == before


def test_out_beside_a_mapped_table_or_viewed_ids_passes_the_overlap_checks(backend, tmp_path):
    """Arrays that own no buffer (a memory-mapped table, ids and out that are views) but lie apart are accepted."""
    np.save(tmp_path / "table.npy", random_table(100, 8))
    table = np.load(tmp_path / "table.npy", mmap_mode="r")
    ids_and_out = np.zeros(64, np.int64)
    ids = ids_and_out[:2]
    ids[:] = [3, 99]
    out = ids_and_out[8:].view(np.float16)[:16].reshape(2, 8)  # the same buffer as the ids, after them
    out[...] = np.float16(np.nan)
    assert not (table.flags.owndata or ids.flags.owndata or out.flags.owndata)
    assert fastembed.lookup(table, ids, out=out, backend=backend) is out
    assert_bit_equal(out, np.asarray(table)[[3, 99]])


def test_out_owning_its_buffer_passes_the_overlap_checks(backend):
    """Two arrays that each own their buffer cannot overlap: the cheap path accepts them."""
    table, ids = random_table(100, 8), np.array([3, 99])
    out = poisoned((2, 8), table.dtype)
    assert out.flags.owndata and table.flags.owndata and ids.flags.owndata
    assert_bit_equal(fastembed.lookup(table, ids, out=out, backend=backend), table[ids])


@pytest.mark.parametrize("ids", [np.array([3, 99]), [3, 99], (3, 99)], ids=["array", "list", "tuple"])
def test_out_owning_its_buffer_beside_a_memory_mapped_table_takes_the_cheap_path(backend, tmp_path, monkeypatch, ids):
    """An out owning its memory apart from a memory-mapped table, and ids of their own or given as a list: one
    address-range test (out and the table), no walk down the arrays' bases and no array library asked."""
    np.save(tmp_path / "table.npy", random_table(100, 8))
    table = np.load(tmp_path / "table.npy", mmap_mode="r")
    out = poisoned((2, 8), table.dtype)
    tested = []
    may_share_memory = np.may_share_memory

    def refuse(*arrays, **options):
        raise AssertionError("the slower checks ran")

    def counted(*arrays, **options):
        tested.append(arrays)
        return may_share_memory(*arrays, **options)

    monkeypatch.setattr(np, "may_share_memory", counted)
    monkeypatch.setattr(fastembed.validate, "adapter_of", refuse)
    monkeypatch.setattr(fastembed.validate.write_probe, "lent", refuse)
    assert fastembed.lookup(table, ids, out=out, backend=backend) is out
    monkeypatch.undo()
    assert len(tested) == 1
    assert_bit_equal(out, np.asarray(table)[[3, 99]])


def test_a_memory_map_whose_mapping_was_closed_is_tested_by_address():
    """np.memmap keeps its mmap object, not its mapping: once the mmap is closed (or resized, which moves it) numpy
    may hand out the same addresses, so an owning out is still tested against the table's address range."""
    mapping = mmap.mmap(-1, 4096)
    table = np.ndarray.__new__(np.memmap, (2, 8), np.float16, buffer=mapping)
    mapping.close()  # numpy released the buffer it took: the close succeeds under the table
    assert type(table.base) is mmap.mmap and table.base.closed
    out, ids = poisoned((2, 8), np.float16), np.array([0, 1])
    # Where numpy's allocator reuses the freed addresses for out, the call's snapshot of the table is over out's memory.
    table_snapshot_over_out = out.view()
    with pytest.raises(ValueError, match="out overlaps the table"):
        fastembed.validate.out_snapshot(out, ids.copy(), table_snapshot_over_out, table, ids)


@pytest.mark.parametrize("ids", [[3, 99], (3, 99), [[3], [99]], 7], ids=["list", "tuple", "nested", "number"])
def test_ids_given_as_python_numbers_for_a_numpy_table_are_converted_without_asking_array_libraries(
        backend, monkeypatch, ids):
    """A list, tuple or number is numpy's to convert: no array library is asked about it (each asks costs a decode
    step microseconds), and the result is numpy's conversion."""
    table = random_table(100, 8)
    expected = table[np.asarray(ids)]
    out = poisoned(expected.shape, table.dtype)

    def refuse(*arrays):
        raise AssertionError(f"an array library was asked about {[type(array).__name__ for array in arrays]}")

    monkeypatch.setattr(fastembed.validate, "adapter_of", refuse)
    monkeypatch.setattr(np, "may_share_memory", refuse)
    got = fastembed.lookup(table, ids, backend=backend)
    assert fastembed.lookup(table, ids, out=out, backend=backend) is out
    monkeypatch.undo()
    assert_bit_equal(got, expected)
    assert_bit_equal(out, expected)


def test_a_list_of_ids_resized_between_numpys_two_readings_gives_the_rows_of_one_reading(backend, monkeypatch):
    """Ids numpy stores as floats (np.uint64 beside int) are read twice; another thread shrinking the list in between
    must not make the first reading's shape repeat the second's values."""
    table = random_table(100, 8)
    ids = [np.uint64(5), 1, 2]
    asarray = np.asarray

    def shrink_after_reading(array, *options, **named):
        converted = asarray(array, *options, **named)
        if array is ids:
            ids[:] = [7]  # another thread, right after numpy's first reading
        return converted

    monkeypatch.setattr(np, "asarray", shrink_after_reading)
    got = fastembed.lookup(table, ids, backend=backend)
    monkeypatch.undo()
    assert_bit_equal(got, table[[7]])  # the second reading's rows, not [7, 7, 7]


def test_a_memmap_typed_view_of_out_is_still_refused_as_the_table(backend):
    """Only a memory map over its own mapping is told apart cheaply; one over another array's memory is tested."""
    out = poisoned((2, 8), np.float16)
    table = np.ndarray.__new__(np.memmap, (2, 8), np.float16, buffer=out)
    assert type(table) is np.memmap and table.base is out
    with pytest.raises(ValueError, match="out overlaps the table"):
        fastembed.lookup(table, np.array([0, 1]), out=out, backend=backend)


def test_device_mismatch_names_both_devices(table):
    with pytest.raises(TypeError, match="ids live on cuda:0 but the table lives on cpu"):
        fastembed.lookup(table, FakeGpuArray())


def test_unknown_backend_lists_known_ones(table, monkeypatch):
    with pytest.raises(ValueError, match="auto, cuda, numba, numpy"):
        fastembed.lookup(table, [1], backend="tpu")
    monkeypatch.setenv(dispatch.ENVIRONMENT_VARIABLE, "nope")
    dispatch.read_environment()
    try:
        with pytest.raises(ValueError, match="FASTEMBED_BACKEND='nope'.*auto, cuda, numba, numpy"):
            fastembed.lookup(table, [1])
    finally:
        monkeypatch.undo()
        dispatch.read_environment()


def test_uint64_ids_beyond_int64_are_reported_not_wrapped(table):
    with pytest.raises(IndexError, match=f"id {2**64 - 1} at position 1"):
        fastembed.lookup(table, np.array([0, 2**64 - 1], dtype=np.uint64))


def test_a_list_of_int64_and_uint64_numbers_is_gathered_as_integers(table):
    ids = [np.int64(1), np.uint64(3), 7]  # numpy stores this list as float64
    assert_bit_equal(fastembed.lookup(table, ids), table[[1, 3, 7]])
    with pytest.raises(IndexError, match="position 1"):
        fastembed.lookup(table, [np.int64(1), np.uint64(2**64 - 1)])


def test_ragged_nested_lists_of_ids_are_a_value_error_saying_what_ids_must_be(table):
    for ragged in ([[1, 2], [3]], [[1], [2, [3]]]):
        with pytest.raises(ValueError, match="ids must form a rectangular array of integers: .*inhomogeneous"):
            fastembed.lookup(table, ragged)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16])
@pytest.mark.parametrize("backend_name", ["auto", *CPU_BACKENDS])
def test_ids_with_no_room_for_the_result_dimension_are_a_value_error_naming_it(table, dtype, backend_name):
    deepest = np.zeros((1,) * fastembed.validate.MAX_IDS_NDIM, dtype)
    assert fastembed.lookup(table, deepest, backend=backend_name).shape == deepest.shape + (8,)
    out = poisoned((1, 8), table.dtype)
    untouched = out.copy()
    for kwargs in ({}, {"dtype": np.float32}, {"out": out.reshape((1,) * fastembed.validate.MAX_IDS_NDIM + (8,))}):
        with pytest.raises(ValueError, match=f"ids have {deepest.ndim + 1} dimensions; at most {deepest.ndim}"):
            fastembed.lookup(table, deepest[..., np.newaxis], backend=backend_name, **kwargs)
    with pytest.raises(ValueError, match=f"ids have {deepest.ndim + 1} dimensions"):
        fastembed.Embedding(table)(deepest[..., np.newaxis], backend=backend_name)
    assert_bit_equal(out, untouched)


class _NoDtype:
    """An object whose ``dtype`` attribute is no dtype, as a torch tensor's is to numpy."""

    dtype = 5


@pytest.mark.parametrize("not_a_dtype", [_NoDtype(), np.array([1.0]), object(), 3])
def test_a_dtype_argument_that_is_no_dtype_is_a_type_error(table, not_a_dtype):
    out = poisoned((1, 8), np.float32)
    untouched = out.copy()
    for kwargs in ({}, {"out": out}):
        with pytest.raises(TypeError, match="is not a dtype"):
            fastembed.lookup(table, [1], dtype=not_a_dtype, **kwargs)
    assert_bit_equal(out, untouched)


@pytest.mark.parametrize("name", ["finfo", "__name__", "iinfo"])
def test_a_dtype_name_that_is_no_scalar_type_of_ml_dtypes_is_unknown(table, name):
    with pytest.raises(TypeError, match=f"unknown dtype '{name}': neither numpy nor ml_dtypes [0-9.]+ has it"):
        fastembed.lookup(table, [1], dtype=name)


def test_ids_of_a_converted_dtype_are_checked_and_converted_from_one_reading(table, monkeypatch):
    ids = np.array([5, 9], np.uint64)
    checked = fastembed.validate.check_ids_in_range

    def check_then_write_the_callers_ids(snapshot, vocab_size):  # another thread writing right after the check
        checked(snapshot, vocab_size)
        ids[0] = np.uint64(2**64 - 1)

    monkeypatch.setattr(fastembed.validate, "check_ids_in_range", check_then_write_the_callers_ids)
    assert_bit_equal(fastembed.lookup(table, ids, backend="numpy"), table[[5, 9]])


def test_out_overlapping_ids_given_as_a_memoryview_is_refused(table):
    memory = np.zeros(64, np.int64)
    memory[:2] = [3, 7]
    out = memory.view(np.float16)[:16].reshape(2, 8)
    with pytest.raises(ValueError, match="overlaps the ids"):
        fastembed.lookup(table, memoryview(memory[:2]), out=out)
    assert memory[:2].tolist() == [3, 7]


def test_ids_converted_by_their_own_array_method_are_converted_once_with_out(table):
    class LazyIds:
        calls = 0

        def __array__(self, dtype=None, copy=None):
            LazyIds.calls += 1
            return np.array([1, 2])

    out = poisoned((2, 8), np.float16)
    fastembed.lookup(table, LazyIds(), out=out)
    assert LazyIds.calls == 1
    assert_bit_equal(out, table[[1, 2]])


def test_an_integer_beyond_every_float_is_a_number_of_seconds_too():
    assert fastembed.wait_for_compiles(10**400) is True  # no limit, as float("inf")
    with pytest.raises(ValueError, match="timeout must be None or a number of seconds >= 0"):
        fastembed.wait_for_compiles(-(10**400))


def test_out_overlapping_ids_given_by_an_array_method_is_refused_and_they_are_converted_once(table):
    """The overlap check compared out with fastembed's copy of such ids, and the gather overwrote the caller's."""
    memory = np.zeros(64, np.int64)
    memory[:2] = [3, 7]
    out = memory.view(np.float16)[4:20].reshape(2, 8)  # over the second id

    class ArrayLike:
        calls = 0

        def __array__(self, dtype=None, copy=None):
            ArrayLike.calls += 1
            return memory[:2]

    held_before = dict(fastembed.validate._CONVERTED_FROM)
    for backend in ("numpy", "numba", "auto"):
        with pytest.raises(ValueError, match="overlaps the ids"):
            fastembed.lookup(table, ArrayLike(), out=out, backend=backend)
        assert memory[:2].tolist() == [3, 7]
    assert ArrayLike.calls == 3
    assert fastembed.validate._CONVERTED_FROM == held_before  # nothing held past the calls


def test_scalar_and_list_ids_keep_no_record_of_their_conversion(table, monkeypatch):
    """Only an array-like's conversion can be the caller's memory; a numpy scalar's or a list's is always new."""
    remembered = []
    monkeypatch.setattr(fastembed.validate, "_remember_converted", lambda *args: remembered.append(args))
    fastembed.lookup(table, np.int64(3))
    fastembed.lookup(table, [1, 2])
    assert remembered == []
    fastembed.lookup(table, memoryview(np.array([1, 2])))
    assert len(remembered) == 1
