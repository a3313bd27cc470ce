"""Quantized tables, dtype=, saving and loading given careless or hostile input: a clear exception, never a wrong answer."""
from __future__ import annotations

import numpy as np
import pytest

import fastembed
from fastembed import distributed
from fastembed.formats import FORMATS, QuantizedTable, quantize_rows
from fastembed.io import map_gguf, save_table
from helpers import CPU_BACKENDS, poisoned


@pytest.fixture(autouse=True)
def _compile_in_the_foreground(monkeypatch):
    try:
        import importlib

        numba_backend = importlib.import_module("fastembed.backends.numba_backend")
    except ImportError:
        return
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)


def q8_table(vocab_size: int = 10, dim: int = 64) -> tuple[QuantizedTable, np.ndarray]:
    rows = np.random.default_rng(0).standard_normal((vocab_size, dim)).astype(np.float32)
    data, _ = quantize_rows(rows, FORMATS["q8_0"])
    return QuantizedTable(data, "q8_0", dim), rows


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [">f4", ">f2", np.dtype(np.float32).newbyteorder(">")], ids=str)
def test_a_byte_swapped_output_dtype_is_refused_for_a_quantized_table(backend, dtype):
    table, _ = q8_table()
    with pytest.raises(TypeError, match="byte order"):
        fastembed.lookup(table, [1, 2], dtype=dtype, backend=backend)
    out = poisoned((2, 64), np.dtype(dtype))
    before = out.copy()
    with pytest.raises(TypeError, match="byte order"):
        fastembed.lookup(table, [1, 2], out=out, dtype=dtype, backend=backend)
    assert out.tobytes() == before.tobytes()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_torch_rows_with_torch_scales_dequantize(backend):
    torch = pytest.importorskip("torch")
    rows = np.random.default_rng(1).standard_normal((6, 40)).astype(np.float32)
    data, scales = quantize_rows(rows, FORMATS["fp8_e4m3"])
    expected = fastembed.lookup(QuantizedTable(data, "fp8_e4m3", 40, scales), [5, 0], backend=backend)
    table = QuantizedTable(torch.from_numpy(data), "fp8_e4m3", 40, torch.from_numpy(scales))
    result = fastembed.lookup(table, [5, 0], backend=backend)
    assert isinstance(result, torch.Tensor)
    np.testing.assert_array_equal(result.numpy(), expected)
    with pytest.raises(TypeError, match="float32 scales"):
        QuantizedTable(torch.from_numpy(data), "fp8_e4m3", 40, torch.from_numpy(scales).double())


@pytest.mark.parametrize("dim", [64.5, 64.0, "64", None, True, [64]], ids=repr)
def test_dim_must_be_an_integer(dim):
    data = np.zeros((3, 68), np.uint8)
    with pytest.raises(TypeError, match="dim must be an integer"):
        QuantizedTable(data, "q8_0", dim)


def test_numpy_integer_dims_are_accepted():
    table = QuantizedTable(np.zeros((3, 68), np.uint8), "q8_0", np.int64(64))
    assert type(table.dim) is int and table.shape == (3, 64)


def test_a_dim_rebound_to_a_float_is_refused_at_the_next_lookup():
    table, _ = q8_table()
    table.dim = 64.0
    with pytest.raises(TypeError, match="dim must be an integer"):
        fastembed.lookup(table, [1])


def _reshape_rows(table):
    table.data.shape = (table.data.shape[0] * 2, table.data.shape[1] // 2)


def _transpose_rows(table):
    table.data = table.data.T


def _retype_rows(table):
    table.data = table.data.view(np.int8)


def _reshape_scales(table):
    table.scales.shape = (1, table.scales.shape[0])


def _retype_scales(table):
    table.scales = table.scales.astype(np.float64)


def _stride_scales(table):
    table.scales = np.repeat(table.scales, 2)[::2]


def _drop_scales(table):
    table.scales = None


def _add_scales(table):
    table.scales = np.ones(table.data.shape[0], np.float32)


def _uneven_dim(table):
    table.dim = table.dim + 1


def _numpy_dim_of_a_wrong_width(table):
    table.dim = np.int64(2 * table.dim)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("name", "change"), [
    ("q8_0", _reshape_rows), ("q4_k", _transpose_rows), ("q8_0", _retype_rows), ("fp8_e4m3", _reshape_scales),
    ("fp8_e4m3", _retype_scales), ("fp8_e4m3", _stride_scales), ("fp8_e4m3", _drop_scales), ("q8_0", _add_scales),
    ("q6_k", _uneven_dim), ("q8_0", _numpy_dim_of_a_wrong_width),
], ids=lambda value: getattr(value, "__name__", value))
def test_a_table_changed_after_it_was_made_is_refused_at_each_lookup_as_the_constructor_refuses_it(backend, name, change):
    """Every lookup checks a quantized table's arrays again, with the constructor's own exception and message."""
    import re

    from fastembed.tables import random_quantized_table

    table = random_quantized_table(name, 6, 256)
    change(table)
    with pytest.raises((TypeError, ValueError)) as refused:
        QuantizedTable(table.data, table.format, table.dim, table.scales)
    out = poisoned((2, 256), np.float16)
    before = out.copy()
    for call in (lambda: fastembed.lookup(table, [1, 2], backend=backend),
                 lambda: fastembed.lookup(table, [1, 2], out=out, dtype=np.float16, backend=backend)):
        with pytest.raises(refused.type, match=re.escape(str(refused.value))):
            call()
    assert out.tobytes() == before.tobytes()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["q8_0", "fp8_e4m3"])
def test_an_out_over_the_rows_of_a_quantized_table_is_refused_and_they_stay_as_they_were(backend, name):
    from fastembed.tables import random_quantized_table

    table = random_quantized_table(name, 64, 256)
    before = table.data.copy()
    over_rows = table.data.reshape(-1)[256 * 2 * 2:][: 2 * 256 * 2].view(np.float16).reshape(2, 256)
    with pytest.raises(ValueError, match="overlaps the table"):
        fastembed.lookup(table, [1, 2], out=over_rows, dtype=np.float16, backend=backend)
    assert table.data.tobytes() == before.tobytes()


@pytest.mark.parametrize("magnitude", [1e7, 3.0e38])
def test_q8_0_refuses_values_its_float16_block_scale_cannot_hold(magnitude):
    rows = np.zeros((2, 64), np.float32)
    rows[1, 40] = -magnitude
    with pytest.raises(ValueError, match="float16"):
        fastembed.Embedding(rows).quantize("q8_0")
    fastembed.Embedding(rows).quantize("fp8_e4m3")  # one float32 scale per row holds it


def test_the_largest_q8_0_block_still_round_trips_finitely():
    rows = np.full((1, 32), 65504.0 * 127, np.float32)
    emb = fastembed.Embedding(rows).quantize("q8_0")
    assert np.isfinite(emb([0])).all()


def test_float64_values_beyond_float32_are_named_when_quantizing():
    with pytest.raises(ValueError, match="float32"):
        fastembed.Embedding(np.full((2, 32), 1e300)).quantize("q8_0")


@pytest.mark.parametrize("name", [5, b"token_embd.weight", 3.5])
def test_save_and_from_gguf_refuse_a_tensor_name_that_is_not_a_string(tmp_path, name):
    emb = fastembed.Embedding(q8_table()[0])
    with pytest.raises(TypeError, match="name must be a string"):
        emb.save(tmp_path / "t.gguf", name=name)
    with pytest.raises(TypeError, match="name must be a string"):
        emb.save(tmp_path / "t.safetensors", name=name)
    emb.save(tmp_path / "t.gguf")
    emb.save(tmp_path / "t.safetensors")
    for opener in (fastembed.Embedding.from_gguf, fastembed.Embedding.from_pretrained):
        with pytest.raises(TypeError, match="name must be a string"):
            opener(tmp_path / "t.gguf", name=name)
    for opener in (fastembed.Embedding.from_safetensors, fastembed.Embedding.from_pretrained):
        with pytest.raises(TypeError, match="name must be a string"):
            opener(tmp_path / "t.safetensors", name=name)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["t.gguf", "t.safetensors"]


def test_save_writes_no_file_its_loaders_would_refuse(tmp_path):
    """A name over the loaders' limit fits safetensors but not fastembed's loaders: ValueError, and nothing written."""
    dense = fastembed.Embedding(q8_table()[1])
    for emb in (dense, dense.quantize("q8_0")):
        with pytest.raises(ValueError, match="not written, fastembed's loaders would refuse the file: .*5000"):
            emb.save(tmp_path / "t.safetensors", name="x" * 5000)
        assert list(tmp_path.iterdir()) == []
        emb.save(tmp_path / "t.safetensors", name="x" * 100)
        assert fastembed.Embedding.from_pretrained(tmp_path / "t.safetensors", name="x" * 100).nbytes == emb.nbytes
        (tmp_path / "t.safetensors").unlink()


@pytest.mark.parametrize("name", ["x" * 64, "é" * 32, "x" * 5000, "tok\0en"], ids=["64-bytes", "32-two-byte-letters", "5000-bytes", "nul"])
def test_save_writes_no_gguf_name_llama_cpp_would_refuse_or_cut(tmp_path, monkeypatch, name):
    """ggml reads tensor names of up to 63 bytes and stops at a NUL: a name it would refuse or cut is refused
    before any row is written, and one of 63 bytes is written and read back by gguf-py."""
    gguf = pytest.importorskip("gguf")
    dense = fastembed.Embedding(q8_table()[1])
    written = []
    monkeypatch.setattr(fastembed.io.save, "_write_rows", lambda handle, rows: written.append(rows))
    for emb in (dense, dense.quantize("q8_0")):
        with pytest.raises(ValueError, match="at most 63 bytes of UTF-8 with no NUL"):
            emb.save(tmp_path / "t.gguf", name=name)
        assert list(tmp_path.iterdir()) == [] and written == []
    monkeypatch.undo()
    longest = "é" * 31 + "x"
    dense.save(tmp_path / "t.gguf", name=longest)
    assert [tensor.name for tensor in gguf.GGUFReader(tmp_path / "t.gguf").tensors] == [longest]


def test_a_format_of_its_own_under_a_builtin_name_is_refused():
    """The backends' kernels go by the format's name: a q6_k of other sizes would read and write past the arrays."""
    from fastembed.formats import BlockFormat

    fake = BlockFormat("q6_k", 256, 1, None, FORMATS["q6_k"].dequantize_blocks)
    with pytest.raises(ValueError, match="fastembed's own q6_k layout"):
        QuantizedTable(np.zeros((3, 1), np.uint8), fake, 256)
    other_reference = BlockFormat("q8_0", 32, 34, 8, lambda blocks: np.zeros((len(blocks), 32), np.float32))
    with pytest.raises(ValueError, match="fastembed's own q8_0 layout"):
        QuantizedTable(np.zeros((3, 34), np.uint8), other_reference, 32)
    upper_case = BlockFormat("Q8_0", 32, 34, None, lambda blocks: np.zeros((len(blocks), 32), np.float32))
    with pytest.raises(ValueError, match="'Q8_0' must be fastembed's own q8_0 layout"):  # a saved file would load as q8_0
        QuantizedTable(np.zeros((3, 34), np.uint8), upper_case, 32)
    table = QuantizedTable(np.zeros((3, 34), np.uint8), FORMATS["q8_0"], 32)
    table.format = fake
    with pytest.raises(ValueError, match="fastembed's own q6_k layout"):
        fastembed.lookup(table, [0])


def test_a_format_named_by_a_str_subclass_is_named_by_its_characters():
    """A name equal to "q8_0" whose lower() said otherwise passed as a format of the caller's own, and the numba
    backend, which goes by the name, read its rows as q8_0 blocks: wrong values, and reads past the table's end."""
    from fastembed.formats import BlockFormat

    class Name(str):
        def lower(self):
            return "mine"

    fmt = BlockFormat(Name("q8_0"), 1, 1, None, lambda blocks: blocks.astype(np.float32))
    assert type(fmt.name) is str and fmt.name == "q8_0"
    with pytest.raises(ValueError, match="fastembed's own q8_0 layout"):
        QuantizedTable(np.zeros((3, 64), np.uint8), fmt, 64)


@pytest.mark.parametrize("path", [3, None, 2.5], ids=repr)
def test_loaders_refuse_a_path_that_is_not_a_path(path):
    for opener in (fastembed.Embedding.from_gguf, fastembed.Embedding.from_npy, fastembed.Embedding.from_safetensors):
        with pytest.raises(TypeError, match="path must be"):
            opener(path)


@pytest.mark.parametrize("dtype", ["S4", "U2", "V3", [("a", "<f4"), ("b", "<i2")], "M8[s]", "c16"], ids=str)
def test_save_refuses_a_dtype_the_loaders_cannot_read_back(tmp_path, dtype):
    emb = fastembed.Embedding(np.zeros((4, 2), dtype))
    with pytest.raises(ValueError, match="safetensors"):
        emb.save(tmp_path / "t.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_save_map_round_trip_of_every_dtype_save_accepts(tmp_path):
    import ml_dtypes

    for dtype in ("float64", "float32", "float16", ml_dtypes.bfloat16, "int8", "uint8", "int64", "bool", "complex64"):
        table = np.arange(8).reshape(4, 2).astype(dtype)
        fastembed.Embedding(table).save(tmp_path / "t.safetensors")
        assert fastembed.Embedding.from_safetensors(tmp_path / "t.safetensors").table.tobytes() == table.tobytes()


def test_the_vocab_parallel_layer_keeps_a_view_of_a_quantized_tables_rows():
    pytest.importorskip("torch")
    table = q8_table()[0]
    shard = distributed.shards.open_shard(table, None, 1, 1, 2, "cpu")
    assert isinstance(shard.rows, QuantizedTable) and shard.rows.format.name == "q8_0"
    assert np.shares_memory(shard.rows.data, table.data) and shard.rows.data.shape == (5, table.data.shape[1])


def test_map_gguf_still_opens_by_default_name(tmp_path):
    table, _ = q8_table()
    save_table(tmp_path / "t.gguf", table)
    assert map_gguf(tmp_path / "t.gguf").shape == (10, 64)
