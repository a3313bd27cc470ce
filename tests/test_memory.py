"""Hidden-copy audit: bytes allocated per lookup <= output + ids + 64 KiB, on every public path.

tracemalloc sees numpy's allocations (numpy reports them to it), so a hidden
copy of the table, of the output or of a large temporary would show up.
What is copied, and why (docs/loading.md): every call copies its ids into a
C-contiguous array of its own; ids of the other byte order are swapped in that
copy; uint64 ids are converted to int64 in it, narrower dtypes into int64
beside it; the numpy backend's np.take converts int32 ids to intp. Nothing else.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import fastembed
from helpers import dequantized, random_table

SLACK = 64 * 1024
N = 4096


def allocated(function) -> int:
    function()  # warm-up: compile, caches
    fastembed.wait_for_compiles()  # a compile thread's allocations would count too
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        result = function()
        _, peak = tracemalloc.get_traced_memory()
        del result
    finally:
        tracemalloc.stop()
    return peak - base


@pytest.fixture(scope="module")
def table():
    return random_table(20000, 512)


@pytest.fixture(scope="module")
def mapped_table(tmp_path_factory, table):
    path = tmp_path_factory.mktemp("npy") / "table.npy"
    np.save(path, table)
    return np.load(path, mmap_mode="r")


IDS_CASES = {
    "int64": lambda: np.random.default_rng(0).integers(0, 20000, N),
    "int32": lambda: np.random.default_rng(0).integers(0, 20000, N).astype(np.int32),
    "2-d": lambda: np.random.default_rng(0).integers(0, 20000, (64, N // 64)),
    "non-contiguous": lambda: np.random.default_rng(0).integers(0, 20000, (N // 32, 64))[:, ::2],
    # Converted ids, four times as many, so that a second copy of them would pass the slack.
    "uint64": lambda: np.random.default_rng(0).integers(0, 20000, 4 * N).astype(np.uint64),
    "big-endian int64": lambda: np.random.default_rng(0).integers(0, 20000, 4 * N).astype(">i8"),
    "big-endian int32": lambda: np.random.default_rng(0).integers(0, 20000, 4 * N).astype(">i4"),
    "big-endian uint64": lambda: np.random.default_rng(0).integers(0, 20000, 4 * N).astype(">u8"),
    "int16": lambda: np.random.default_rng(0).integers(0, 20000, 4 * N).astype(np.int16),
    "uint32": lambda: np.random.default_rng(0).integers(0, 20000, 4 * N).astype(np.uint32),
}


@pytest.mark.parametrize("case", list(IDS_CASES))
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("path", ["lookup", "Embedding", "lookup on np.memmap"])
def test_no_hidden_copies(table, mapped_table, backend, case, with_out, path):
    ids = IDS_CASES[case]()
    source = mapped_table if path == "lookup on np.memmap" else table
    out_bytes = ids.size * source.shape[1] * source.dtype.itemsize
    out = np.empty(ids.shape + (source.shape[1],), source.dtype) if with_out else None
    if path == "Embedding":
        emb = fastembed.Embedding(source)
        call = lambda: emb(ids, out=out, backend=backend)  # noqa: E731
    else:
        call = lambda: fastembed.lookup(source, ids, out=out, backend=backend)  # noqa: E731
    if ids.dtype.newbyteorder("=") in (np.int32, np.int64):  # the call's copy, in the machine's byte order
        ids_bytes = ids.nbytes + (ids.size * 8 if backend == "numpy" and ids.itemsize == 4 else 0)  # np.take: intp
    else:  # the call's copy, converted where it is (uint64) or into int64 beside it
        ids_bytes = ids.size * 8 + (ids.nbytes if ids.itemsize < 8 else 0)
    bound = (0 if with_out else out_bytes) + ids_bytes + SLACK
    measured = allocated(call)
    assert measured <= bound, f"{path} {case} allocated {measured} bytes, bound {bound}"


def test_the_audit_can_fail(table):
    """A deliberate copy of the ids' rows twice over is caught by the same measurement."""
    ids = IDS_CASES["int64"]()
    wasteful = lambda: np.concatenate([table[ids], table[ids]])  # noqa: E731
    assert allocated(wasteful) > ids.size * 512 * 2 + ids.nbytes + SLACK


@pytest.mark.parametrize("n_ids", [1, 6, 100])
@pytest.mark.parametrize("kind", ["array", "np.memmap"])
def test_a_dropped_table_is_freed(tmp_path, backend, n_ids, kind):
    """No backend keeps a table alive after its caller dropped it (a 1 GiB table held on would be a leak)."""
    import gc
    import weakref

    table = random_table(300, 64)
    if kind == "np.memmap":
        np.save(tmp_path / "table.npy", table)
        table = np.load(tmp_path / "table.npy", mmap_mode="r")
    ids = np.random.default_rng(0).integers(0, 300, n_ids)
    fastembed.lookup(table, ids, backend=backend)
    fastembed.lookup(table, ids, out=np.empty((n_ids, 64), table.dtype), backend=backend)
    fastembed.wait_for_compiles()  # a background compile holds its arguments until it is done
    alive = weakref.ref(table)
    del table
    gc.collect()
    assert alive() is None


@pytest.fixture(scope="module")
def unaligned_table(table):
    """The same rows, starting one byte past an aligned address: numpy flags it unaligned."""
    buffer = np.empty(table.nbytes + 1, np.uint8)
    view = buffer[1:].view(table.dtype).reshape(table.shape)
    view[...] = table
    assert not view.flags.aligned
    return view


@pytest.mark.parametrize("n_ids", [1, 6, 31, 40, 4096])
@pytest.mark.parametrize("with_out", [False, True])
def test_an_unaligned_table_is_never_copied(unaligned_table, table, backend, n_ids, with_out):
    """numpy's take copies a whole table it finds unaligned; every path here reads its rows in place."""
    ids = np.random.default_rng(n_ids).integers(0, table.shape[0], n_ids)
    out = np.empty((n_ids, table.shape[1]), table.dtype) if with_out else None
    call = lambda: fastembed.lookup(unaligned_table, ids, out=out, backend=backend)  # noqa: E731
    result = call()
    np.testing.assert_array_equal(result.view(np.uint16), table[ids].view(np.uint16))
    output = 0 if with_out else n_ids * table.shape[1] * table.dtype.itemsize
    assert allocated(call) <= output + ids.nbytes + SLACK


@pytest.mark.parametrize("backend", ["numba", "numpy"])
@pytest.mark.parametrize("n_ids", [2, 300])
def test_unaligned_row_scales_are_never_copied(backend, n_ids):
    """fp8 row scales at an odd byte (a file may place them so): read in place, not aligned by a copy of them all."""
    from fastembed.formats import QuantizedTable
    from fastembed.tables import random_quantized_table

    source = random_quantized_table("fp8_e4m3", 200_000, 32)
    buffer = np.empty(source.scales.nbytes + 1, np.uint8)
    scales = buffer[1:].view(np.float32)
    scales[...] = source.scales
    assert not scales.flags.aligned
    table = QuantizedTable(source.data, "fp8_e4m3", 32, scales)
    ids = np.random.default_rng(n_ids).integers(0, 200_000, n_ids)
    fastembed.lookup(table, ids, backend=backend)
    fastembed.wait_for_compiles()
    call = lambda: fastembed.lookup(table, ids, backend=backend)  # noqa: E731
    np.testing.assert_array_equal(call(), dequantized(source, ids))
    assert allocated(call) < scales.nbytes // 2  # the result and the reference's per-step temporaries, no copy


def _unaligned_out(shape, dtype) -> np.ndarray:
    """A C-contiguous output starting one byte past an aligned address, poisoned."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buffer = np.full(size + 1, 0xA5, np.uint8)
    out = buffer[1:].view(dtype).reshape(shape)
    assert not out.flags.aligned
    return out


@pytest.mark.parametrize("n_ids", [1, 6, 1000, 4096])
@pytest.mark.parametrize("kind", ["float16", "q8_0 into float32", "fp8_e4m3 into bfloat16"])
def test_an_unaligned_out_is_filled_in_place(table, backend, n_ids, kind):
    """An out= at an odd byte is written without a temporary of its size: numpy's take would buffer all of it,
    and the dequantizing kernels go through a small aligned buffer, a few rows at a time."""
    from fastembed.tables import random_quantized_table

    ids = np.random.default_rng(n_ids).integers(0, 2000, n_ids)
    if kind == "float16":
        source, dtype = table, None
    else:
        source, dtype = random_quantized_table(kind.split()[0], 2000, 512), kind.split()[-1]
    out_dtype = table.dtype if dtype is None else fastembed.lookup(source, ids[:1], dtype=dtype).dtype
    out = _unaligned_out((n_ids, 512), out_dtype)
    call = lambda: fastembed.lookup(source, ids, out=out, dtype=dtype, backend=backend)  # noqa: E731
    expected = source[ids] if dtype is None else dequantized(source, ids, out_dtype)
    measured = allocated(call)
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))
    if kind == "float16" or backend != "numpy":  # the numpy reference dequantizes through float32 rows, by design
        assert measured <= 8 * n_ids + SLACK, measured
    before, bad = out.copy(), ids.copy()
    bad[-1] = source.shape[0]
    with pytest.raises(IndexError, match="position"):
        fastembed.lookup(source, bad, out=out, dtype=dtype, backend=backend)
    np.testing.assert_array_equal(out.view(np.uint8), before.view(np.uint8))  # a bad id leaves out untouched
