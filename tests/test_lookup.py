"""lookup() and Embedding against table[ids] and the one-hot oracle, on every CPU backend."""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fastembed
from helpers import REFERENCE_IDS, assert_bit_equal, poisoned, random_table

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "complex64"]
WIDTHS = [1, 3, 4, 7, 8, 33, 4095, 4096]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_matches_numpy_for_every_dtype_and_width(backend, dtype, width):
    table = random_table(257, width, dtype)
    ids = np.random.default_rng(width).integers(0, 257, 100)
    out = poisoned((100, width), table.dtype)
    result = fastembed.lookup(table, ids, out=out, backend=backend)
    assert result is out
    assert_bit_equal(out, table[ids])
    assert_bit_equal(fastembed.lookup(table, ids, backend=backend), table[ids])


class _Subclass(np.ndarray):
    """A numpy subclass of no special meaning."""


@pytest.mark.parametrize("make", ["memmap", "subclass"])
def test_numpy_subclass_tables_give_plain_numpy_rows_from_their_memory(backend, make, tmp_path):
    """np.memmap (every mapped checkpoint) and other subclasses: the rows of their memory, as a plain ndarray."""
    values = random_table(120, 6)
    if make == "memmap":
        np.save(tmp_path / "t.npy", values)
        table = np.load(tmp_path / "t.npy", mmap_mode="r")
    else:
        table = values.view(_Subclass)
    ids = np.random.default_rng(3).integers(0, 120, (2, 5))
    for result in (fastembed.lookup(table, ids, backend=backend), fastembed.Embedding(table)(ids, backend=backend)):
        assert type(result) is np.ndarray and result.shape == (2, 5, 6)
        assert_bit_equal(result, values[ids])
    out = poisoned((2, 5, 6), values.dtype)
    assert fastembed.lookup(table, ids, out=out, backend=backend) is out
    assert_bit_equal(out, values[ids])


@pytest.mark.parametrize("id_dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">i4"])
def test_every_integer_id_dtype(backend, id_dtype):
    table = random_table(200, 12)
    ids = np.random.default_rng(1).integers(0, 127, (4, 5)).astype(id_dtype)
    assert_bit_equal(fastembed.lookup(table, ids, backend=backend), table[ids.astype(np.int64)])


@pytest.mark.parametrize("shape", [(), (0,), (1,), (6,), (2, 3), (2, 0, 3), (2, 3, 4)])
def test_any_ids_shape(backend, shape):
    table = random_table(50, 9)
    ids = np.random.default_rng(2).integers(0, 50, shape)
    result = fastembed.lookup(table, ids, backend=backend)
    assert result.shape == shape + (9,)
    assert_bit_equal(result, table[ids.reshape(-1)].reshape(shape + (9,)))


def test_array_likes_and_scalars(backend):
    table = random_table(40, 5)
    assert_bit_equal(fastembed.lookup(table, [3, 1, 3], backend=backend), table[[3, 1, 3]])
    assert_bit_equal(fastembed.lookup(table, [[1, 2], [3, 4]], backend=backend), table[[[1, 2], [3, 4]]])
    assert_bit_equal(fastembed.lookup(table, (7,), backend=backend), table[[7]])
    assert_bit_equal(fastembed.lookup(table, 7, backend=backend), table[7])
    assert_bit_equal(fastembed.lookup(table, np.int32(7), backend=backend), table[7])
    assert fastembed.lookup(table, [], backend=backend).shape == (0, 5)


def test_non_contiguous_ids(backend):
    table = random_table(90, 16)
    ids = np.random.default_rng(3).integers(0, 90, (10, 8)).T[::2]
    assert not ids.flags.c_contiguous
    assert_bit_equal(fastembed.lookup(table, ids, backend=backend), table[ids])


def test_host_ids_are_the_calls_own_copy_in_their_dtype():
    """Another thread writing the caller's ids cannot change what the checks saw: the call gathers from its copy."""
    table = random_table(30, 8)
    for dtype in (np.int32, np.int64):
        for ids in (np.arange(6, dtype=dtype), np.arange(12, dtype=dtype)[::-2]):
            snapshot = fastembed.validate.ids_snapshot(ids, table)
            assert snapshot.dtype == dtype and snapshot.flags.c_contiguous and not np.shares_memory(snapshot, ids)
            assert_bit_equal(snapshot, ids)


@pytest.mark.parametrize("name", ["int4", "uint4", "int2", "uint2"])
def test_ml_dtypes_integer_ids_gather_as_their_values(backend, name):
    """ml_dtypes' small integers are integers (numpy sees them as void): gathered by value, checked for range."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dtype = np.dtype(getattr(ml_dtypes, name))
    table = random_table(30, 8)
    ids = np.array([[1, 0], [1, 1]], dtype=dtype)
    out = poisoned((2, 2, 8), table.dtype)
    assert_bit_equal(fastembed.lookup(table, ids, out=out, backend=backend), table[ids.astype(np.int64)])
    assert_bit_equal(fastembed.Embedding(table)(ids, backend=backend), table[ids.astype(np.int64)])
    low = int(ml_dtypes.iinfo(dtype).min)
    if low < 0:
        with pytest.raises(IndexError, match=f"id {low} at position"):
            fastembed.lookup(table, np.array([0, low], dtype=dtype), backend=backend)


def test_large_batch_with_repeats(backend):
    table = random_table(1000, 64)
    ids = np.random.default_rng(4).integers(0, 1000, 100_000).astype(np.int32)
    out = poisoned((100_000, 64), table.dtype)
    fastembed.lookup(table, ids, out=out, backend=backend)
    assert_bit_equal(out, table[ids])


def test_one_hot_oracle(backend):
    """one_hot(ids) @ table == table[ids]: a dense lookup is a one-hot product."""
    vocab_size, dim = 300, 24
    table = random_table(vocab_size, dim, "float32")
    ids = np.random.default_rng(5).integers(0, vocab_size, 17)
    one_hot = np.zeros((ids.size, vocab_size), dtype=np.float32)
    one_hot[np.arange(ids.size), ids] = 1.0
    np.testing.assert_array_equal(fastembed.lookup(table, ids, backend=backend), one_hot @ table)


def test_embedding_object(backend):
    table = random_table(64, 10, "bfloat16")
    emb = fastembed.Embedding(table)
    assert (emb.vocab_size, emb.dim, emb.dtype, emb.nbytes, emb.device) == (64, 10, table.dtype, table.nbytes, "cpu")
    assert emb.table is table
    ids = np.array([[1, 63], [0, 5]])
    assert_bit_equal(emb(ids, backend=backend), table[ids])
    out = poisoned((2, 2, 10), table.dtype)
    assert emb(ids, out=out, backend=backend) is out
    assert_bit_equal(out, table[ids])
    assert "vocab_size=64" in repr(emb)


def test_embedding_does_not_revalidate_the_table(monkeypatch):
    emb = fastembed.Embedding(random_table(10, 4))
    calls = []
    monkeypatch.setattr(fastembed.validate, "table_snapshot", lambda table: calls.append(table))
    emb([1, 2])
    assert calls == []


def test_random_table_is_random_and_never_zero():
    table = fastembed.Embedding.random(1000, 64, "float16", seed=3).table
    assert table.shape == (1000, 64) and table.dtype == np.float16
    assert np.all(table != 0) and np.all(np.isfinite(table))
    assert len(np.unique(table)) > 1000
    assert not np.array_equal(table, fastembed.Embedding.random(1000, 64, "float16", seed=4).table)


@pytest.mark.parametrize(("dtype", "signed", "smallest"), [
    ("float8_e4m3fn", True, 1 / 64), ("float8_e5m2", True, 1 / 64), ("longdouble", True, 1 / 64),
    ("complex64", True, 1 / 64), (">f2", True, 1 / 64), (">f8", True, 1 / 64),
    ("float8_e8m0fnu", False, 1 / 64),  # no sign bit: a negative value would cast to NaN
    ("float4_e2m1fn", True, 0.5),  # [1/64, 1/32) would round to zero: the smallest positive value instead
])
def test_random_tables_of_other_float_dtypes_are_finite_nonzero_and_signed_where_they_can_be(dtype, signed, smallest):
    table = fastembed.Embedding.random(200, 64, dtype, seed=5).table
    assert table.dtype == fastembed.tables.resolve_dtype(dtype)
    values = table.astype(np.complex128)
    for part in (values.real, values.imag) if np.iscomplexobj(table) else (values.real,):
        assert np.all(np.isfinite(part)) and np.all(part != 0)
        assert (0.4 < (part < 0).mean() < 0.6) if signed else not (part < 0).any()
        assert np.all((np.abs(part) >= smallest - 1e-3) & (np.abs(part) <= max(smallest, 1 / 32) + 1e-3))


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"vocab_size": -1}, ValueError, "vocab_size must be an integer >= 0, got -1"),
    ({"dim": 2.0}, TypeError, "dim must be an integer >= 0, got 2.0"),
    ({"vocab_size": True}, TypeError, "vocab_size must be an integer"),
    ({"seed": -1}, ValueError, "seed must be an integer >= 0, got -1"),
    ({"dtype": object}, TypeError, "fixed size and no Python objects, got object"),
    ({"dtype": "V0"}, TypeError, "fixed size and no Python objects"),
    ({"dtype": np.dtype((np.float32, 3))}, TypeError, "rows of scalars, not sub-arrays"),
    ({"dtype": None}, TypeError, "dtype must be given"),
    ({"dtype": "no such dtype"}, TypeError, "unknown dtype"),
])
def test_random_table_arguments_are_named_when_wrong(arguments, error, message):
    with pytest.raises(error, match=re.escape(message)):
        fastembed.Embedding.random(**{"vocab_size": 4, "dim": 4, **arguments})


def test_reference_sentence_on_the_full_table(full_table, backend):
    result = fastembed.lookup(full_table, REFERENCE_IDS, backend=backend)
    assert result.shape == (6, 4096) and result.dtype == np.float16
    assert_bit_equal(result, np.stack([full_table[i] for i in REFERENCE_IDS]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    vocab_size=st.integers(1, 64),
    dim=st.integers(1, 40),
    dtype=st.sampled_from(["float16", "float32", "int8", "uint8", "float64", "bfloat16"]),
    id_dtype=st.sampled_from([np.int32, np.int64, np.uint16]),
    ids_shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    backend=st.sampled_from([name for name in ("numba", "numpy") if name in {s.name for s in fastembed.backend_statuses() if s.available}]),
)
def test_property_lookup_equals_numpy(data, vocab_size, dim, dtype, id_dtype, ids_shape, backend):
    table = random_table(vocab_size, dim, dtype, seed=dim)
    ids = data.draw(hnp.arrays(id_dtype, ids_shape, elements=st.integers(0, vocab_size - 1)))
    out = poisoned(ids.shape + (dim,), table.dtype)
    fastembed.lookup(table, ids, out=out, backend=backend)
    assert_bit_equal(out, table[ids.astype(np.int64)])


def test_zero_width_table(backend):
    table = np.empty((5, 0), np.float16)
    assert fastembed.lookup(table, [1, 4], backend=backend).shape == (2, 0)
    with pytest.raises(IndexError, match="id 5 at position 1"):
        fastembed.lookup(table, [0, 5], backend=backend)
    for ids, shape in (([[1, 4], [0, 2]], (2, 2, 0)), ([], (0, 0))):  # cast too: no row size to divide by
        assert fastembed.lookup(table, ids, dtype="float32", backend=backend).shape == shape


def test_a_table_without_rows_says_no_id_is_valid(backend):
    table = np.empty((0, 4), np.float16)
    assert fastembed.lookup(table, np.empty(0, np.int64), backend=backend).shape == (0, 4)
    with pytest.raises(IndexError, match=r"id 0 at position 0 .* 0 rows \(it has no rows, so no id is valid\)"):
        fastembed.lookup(table, [0], backend=backend)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_ndarray_subclass_ids(backend):
    table = random_table(20, 3)
    ids = np.matrix([[1, 2], [3, 19]])
    assert_bit_equal(fastembed.lookup(table, ids, backend=backend), table[np.asarray(ids)])


def test_random_table_of_raw_bytes():
    table = fastembed.Embedding.random(30, 2, "V8").table
    assert table.dtype == np.dtype("V8") and len(set(table.tobytes()[i : i + 8] for i in range(0, 480, 8))) > 50


def _layer_follows_its_own_table(layer, ids):
    """Whether `layer` gathers from `layer.table` as it is now (the view and the table are one memory)."""
    layer.table[ids[0]] = layer.table[ids[0]] + 1
    return bool((np.asarray(layer(ids)) == np.asarray(layer.table[ids])).all())


@pytest.mark.parametrize("kind", ["numpy", "torch", "quantized"])
def test_a_copied_or_unpickled_layer_gathers_from_the_table_it_carries(kind):
    import copy
    import pickle

    table = random_table(64, 32, "float32")
    if kind == "torch":
        torch = pytest.importorskip("torch")
        table = torch.from_numpy(table)
    layer = fastembed.Embedding(table)
    if kind == "quantized":
        layer = layer.quantize("q8_0")
    expected = np.asarray(layer([3, 7]))
    blob = pickle.dumps(layer)
    raw = layer.table.data if kind == "quantized" else layer.table
    assert len(blob) < 1.25 * np.asarray(raw).nbytes + 4096  # the table travels once
    for twin in (pickle.loads(blob), copy.deepcopy(layer)):
        assert_bit_equal(np.asarray(twin([3, 7])), expected)
        assert not np.shares_memory(np.asarray(twin.table if kind != "quantized" else twin.table.data),
                                    np.asarray(raw))
        if kind != "quantized":
            assert _layer_follows_its_own_table(twin, np.array([3, 7]))
        else:
            twin.table.data[3] ^= 1  # a changed byte of row 3's block is a changed value
            assert not np.array_equal(np.asarray(twin([3])), expected[:1])
    shallow = copy.copy(layer)
    assert shallow.table is layer.table
    assert_bit_equal(np.asarray(layer([3, 7])), expected)  # the original is untouched by its copies


def test_a_torch_layer_saves_and_loads_with_torch():
    torch = pytest.importorskip("torch")
    import copy
    import io

    layer = fastembed.Embedding(torch.from_numpy(random_table(32, 8, "float16")))
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    twin = torch.load(buffer, weights_only=False)
    assert torch.equal(twin(torch.tensor([5, 1])), layer(torch.tensor([5, 1])))
    weight = torch.nn.Parameter(torch.from_numpy(random_table(32, 8, "float32")), requires_grad=False)
    layer = fastembed.Embedding(weight)
    weight.data = weight.data.half()  # after the layer read it: the layer, and so its copies, keep float32
    assert copy.deepcopy(layer)([1]).dtype == torch.float32 == layer([1]).dtype


def test_a_deep_copy_of_a_mapped_layer_shares_its_read_only_mapping(tmp_path):
    import copy

    path = tmp_path / "table.npy"
    np.save(path, random_table(32, 8, "float16"))
    layer = fastembed.Embedding.from_npy(path)
    twin = copy.deepcopy(layer)
    assert np.shares_memory(twin.table, layer.table) and not twin.table.flags.writeable
    twin.check_file()
    assert_bit_equal(twin([4, 2]), np.load(path)[[4, 2]])


class Tagged(fastembed.Embedding):
    """A subclass whose constructor takes more than the table (pickle finds it by its module-level name)."""

    def __init__(self, table, tag):
        super().__init__(table)
        self.tag = tag


def test_copies_follow_the_table_as_the_layer_read_it_and_keep_a_subclass_and_its_attributes():
    import copy
    import pickle

    from fastembed.api import _FROM_THE_TABLE

    table = random_table(16, 8, "float32")
    layer = Tagged(table, "decoder")
    assert set(layer.__dict__) == _FROM_THE_TABLE | {"tag"}  # what __init__ derives is listed, and nothing else
    table.shape = (32, 4)  # reassigned after the layer read it
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(twin) is Tagged and twin.tag == "decoder" and (twin.vocab_size, twin.dim) == (16, 8)
        assert_bit_equal(twin([3]), layer([3]))


def test_pickling_a_mapped_layer_is_refused_before_any_row_is_written(tmp_path):
    import io as bytes_io
    import pickle

    path = tmp_path / "table.npy"
    np.save(path, random_table(2048, 256, "float32"))  # 2 MiB of rows
    stream = bytes_io.BytesIO()
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dump(fastembed.Embedding.from_npy(path), stream)
    assert stream.tell() < 4096


def test_a_lookup_with_dtype_in_a_finalizer_at_interpreter_exit_works(tmp_path):
    """A cast's first lookup imported a module, and read ``dtype.name`` (which numpy computes with an import), both
    refused while the interpreter exits: a finalizer that looked up rows with ``dtype=`` then raised ImportError."""
    from helpers import run_script

    finished = run_script(tmp_path, """
import numpy as np, fastembed
from fastembed.tables import random_quantized_table
table = np.arange(12, dtype=np.float32).reshape(4, 3)
quantized = random_quantized_table("q8_0", 4, 32, 0)
expected = fastembed.lookup(quantized, [1]).astype(np.float16).tobytes()

class Holder:
    def __del__(self):
        print(fastembed.lookup(table, [1], dtype=np.float16).tolist(), fastembed.lookup(table, [2], dtype="float64").tolist())
        print(fastembed.lookup(quantized, [1], dtype=np.float16).tobytes() == expected)

keep = Holder()
""")
    assert finished.returncode == 0 and not finished.stderr, finished.stderr
    assert finished.stdout.split("\n") == ["[[3.0, 4.0, 5.0]] [[6.0, 7.0, 8.0]]", "True", ""]
