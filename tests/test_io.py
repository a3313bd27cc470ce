"""Memory-mapped safetensors and .npy tables: zero-copy, every dtype, hostile files, RSS."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastembed
from fastembed import io
from helpers import REFERENCE_IDS, assert_bit_equal, random_table

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file written by the reference implementation (bf16 via its numpy API)."""
    safetensors_numpy.save_file(tensors, str(path))


def raw_safetensors(header: dict, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "uint16"])
def test_safetensors_round_trip_every_dtype(tmp_path, backend, dtype):
    table = random_table(500, 33, dtype)
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"model.embed_tokens.weight": table, "lm_head.weight": random_table(7, 33, dtype, 1)})
    emb = fastembed.Embedding.from_safetensors(path)
    assert isinstance(emb.table, np.memmap) and not emb.table.flags.writeable
    assert emb.dtype == table.dtype and (emb.vocab_size, emb.dim) == (500, 33)
    ids = np.random.default_rng(0).integers(0, 500, (3, 4))
    assert_bit_equal(emb(ids, backend=backend), table[ids])


def test_tensors_of_every_safetensors_dtype_sit_beside_a_table_and_whole_byte_ones_are_tables(tmp_path, backend):
    """A checkpoint's other tensors (complex RoPE buffers, MX scales, packed FP4 values) do not stop its table opening."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not hasattr(ml_dtypes, "float8_e8m0fnu"):
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no float8_e8m0fnu (0.5 added it)")
    table = random_table(50, 16, "float16")
    others = {"rope.freqs": random_table(4, 8, "complex64"), "mx.scales": random_table(4, 8, "float8_e8m0fnu")}
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"model.embed_tokens.weight": table, **others})
    emb = fastembed.Embedding.from_safetensors(path, name="model.embed_tokens.weight")
    assert_bit_equal(emb([3, 9], backend=backend), table[[3, 9]])
    for name, other in others.items():  # whole-byte dtypes are tables themselves
        assert_bit_equal(fastembed.Embedding.from_safetensors(path, name=name)([1, 3], backend=backend), other[[1, 3]])
    for code, dtype in (("F8_E4M3FNUZ", ml_dtypes.float8_e4m3fnuz), ("F8_E5M2FNUZ", ml_dtypes.float8_e5m2fnuz)):
        rows = random_table(6, 5, np.dtype(dtype).name)
        raw = tmp_path / f"{code}.safetensors"
        raw.write_bytes(raw_safetensors({"weight": {"dtype": code, "shape": [6, 5], "data_offsets": [0, 30]}},
                                        rows.tobytes()))
        assert_bit_equal(fastembed.Embedding.from_safetensors(raw, name="weight")([5, 0], backend=backend), rows[[5, 0]])
    packed = tmp_path / "packed.safetensors"  # 16 FP4 values in 8 bytes, beside 2 float16 rows
    packed.write_bytes(raw_safetensors({
        "mx.blocks": {"dtype": "F4", "shape": [2, 8], "data_offsets": [0, 8]},
        "model.embed_tokens.weight": {"dtype": "F16", "shape": [2, 4], "data_offsets": [8, 24]},
    }, bytes(range(8)) + table[:2, :4].tobytes()))
    assert_bit_equal(fastembed.Embedding.from_safetensors(packed)([1]), table[[1], :4])
    with pytest.raises(ValueError, match="'mx.blocks' is F4, which packs 4-bit values"):
        fastembed.Embedding.from_safetensors(packed, name="mx.blocks")
    odd = tmp_path / "odd.safetensors"  # 3 FP6 values: 18 bits, no whole number of bytes
    odd.write_bytes(raw_safetensors({"v": {"dtype": "F6_E2M3", "shape": [3], "data_offsets": [0, 2]},
                                     "w": {"dtype": "F16", "shape": [1, 1], "data_offsets": [2, 4]}}, b"\0" * 4))
    with pytest.raises(ValueError, match=r"is 18 bits \(no whole number of bytes\) but data_offsets span 2"):
        fastembed.Embedding.from_safetensors(odd, name="w")
    complex_table = random_table(8, 3, "complex64")
    saved = tmp_path / "saved.safetensors"
    fastembed.Embedding(complex_table).save(saved)
    assert_bit_equal(fastembed.Embedding.from_pretrained(saved)([7]), complex_table[[7]])


def test_safetensors_name_selection(tmp_path):
    path = tmp_path / "two.safetensors"
    tensors = {"encoder.embed_tokens.weight": random_table(10, 4), "decoder.embed_tokens.weight": random_table(12, 4),
               "norm": random_table(1, 4)}
    write_safetensors(path, tensors)
    with pytest.raises(ValueError, match="several tensors.*decoder.embed_tokens.weight.*encoder.embed_tokens.weight"):
        fastembed.Embedding.from_safetensors(path)
    assert fastembed.Embedding.from_safetensors(path, name="decoder.embed_tokens.weight").vocab_size == 12
    with pytest.raises(ValueError, match="no tensor named 'missing'.*embed_tokens.weight"):
        fastembed.Embedding.from_safetensors(path, name="missing")
    plain = tmp_path / "plain.safetensors"
    write_safetensors(plain, {"weights": random_table(3, 3)})
    with pytest.raises(ValueError, match="no tensor is named like a token embedding.*weights"):
        fastembed.Embedding.from_safetensors(plain)


def test_npy_is_memory_mapped(tmp_path, backend):
    table = random_table(300, 20, "float32")
    path = tmp_path / "table.npy"
    np.save(path, table)
    emb = fastembed.Embedding.from_npy(path)
    assert isinstance(emb.table, np.memmap)
    assert_bit_equal(emb([1, 299, 0], backend=backend), table[[1, 299, 0]])


def test_npy_bad_files(tmp_path):
    np.save(tmp_path / "three_d.npy", np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="2-D"):
        fastembed.Embedding.from_npy(tmp_path / "three_d.npy")
    (tmp_path / "garbage.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ValueError, match="not a readable .npy"):
        fastembed.Embedding.from_npy(tmp_path / "garbage.npy")
    np.save(tmp_path / "objects.npy", np.array([[1, "a"]], dtype=object))
    with pytest.raises(ValueError, match="not a readable .npy"):
        fastembed.Embedding.from_npy(tmp_path / "objects.npy")


F16_ENTRY = {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "content, words",
    [
        (b"", "shorter than the 8-byte"),
        (b"\x01\x02", "shorter than the 8-byte"),
        (struct.pack("<Q", 1000) + b"{}", "header length 1000 goes beyond"),
        (struct.pack("<Q", 2**63) + b"{}", "goes beyond"),
        (struct.pack("<Q", 4) + b"{not", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "JSON object"),
        (raw_safetensors({"w.embed_tokens.weight": {**F16_ENTRY, "data_offsets": [-8, 0]}}, b"\0" * 8), "outside the data"),
        (raw_safetensors({"w.embed_tokens.weight": {**F16_ENTRY, "data_offsets": [0, 9000]}}, b"\0" * 8), "outside the data"),
        (raw_safetensors({"w.embed_tokens.weight": {**F16_ENTRY, "data_offsets": [0, 6]}}, b"\0" * 8), "is 8 bytes but data_offsets span 6"),
        (raw_safetensors({"w.embed_tokens.weight": {**F16_ENTRY, "dtype": "Q7"}}, b"\0" * 8), "unknown dtype 'Q7'"),
        (raw_safetensors({"w.embed_tokens.weight": {**F16_ENTRY, "shape": [2, -2]}}, b"\0" * 8), "non-negative"),
        (raw_safetensors({"w.embed_tokens.weight": F16_ENTRY, "x": {**F16_ENTRY, "data_offsets": [4, 12]}}, b"\0" * 12), "overlap"),
        (raw_safetensors({"w.embed_tokens.weight": {"dtype": "F16", "shape": [8], "data_offsets": [0, 16]}}, b"\0" * 16), "is named like a token embedding but has shape \\[8\\]"),
        (raw_safetensors({"w.embed_tokens.weight": "nope"}, b""), "must be an object"),
        (struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000, "JSON object"),
        (struct.pack("<Q", 200_000) + b"{\"a\":" + b"[" * 99_997 + b"]" * 99_997 + b"}", "entry must be an object"),
    ],
)
def test_hostile_safetensors_give_clear_value_errors(tmp_path, content, words):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=words):
        fastembed.Embedding.from_safetensors(path)


def test_non_2d_named_tensor(tmp_path):
    path = tmp_path / "vec.safetensors"
    path.write_bytes(raw_safetensors({"v": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8))
    with pytest.raises(ValueError, match="an embedding table is 2-D"):
        fastembed.Embedding.from_safetensors(path, name="v")


def test_bf16_without_ml_dtypes_names_the_package(tmp_path, monkeypatch):
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(raw_safetensors({"wte.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}, b"\1" * 8))
    import sys

    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    monkeypatch.setattr(np, "dtype", _numpy_dtype_without_bfloat16(np.dtype))
    with pytest.raises(TypeError, match="ml_dtypes"):
        fastembed.Embedding.from_safetensors(path)


def _numpy_dtype_without_bfloat16(real_dtype):
    def dtype(value, *args, **kwargs):
        if value == "bfloat16":
            raise TypeError("data type 'bfloat16' not understood")
        return real_dtype(value, *args, **kwargs)

    return dtype


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)


def _valid_file_bytes(replacements: dict | None = None) -> bytes:
    """A valid file; `replacements` swaps fields of the table's entry (or "entry"/"metadata" whole) for other JSON."""
    table = np.arange(24, dtype=np.float16).reshape(6, 4)
    entry = {"dtype": "F16", "shape": [6, 4], "data_offsets": [0, 48]}
    metadata = {"format": "pt"}
    for field, value in (replacements or {}).items():
        if field == "entry":
            entry = value
        elif field == "metadata":
            metadata = value
        elif isinstance(entry, dict):
            entry[field] = value
    header = {"__metadata__": metadata, "model.embed_tokens.weight": entry,
              "norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [48, 64]}}
    return raw_safetensors(header, table.tobytes() + np.ones(4, np.float32).tobytes())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    replacements=st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "metadata"]), JSON_VALUES, max_size=3),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 400)),
)
def test_fuzzed_headers_only_give_clean_errors(tmp_path, replacements, flips, cut):
    """Fields replaced by JSON of every type (a list as dtype raised TypeError), then byte flips and cuts."""
    content = bytearray(_valid_file_bytes(replacements))
    for position, value in flips:
        content[position % len(content)] = value
    if cut is not None:
        content = content[:cut]
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(bytes(content))
    try:
        emb = fastembed.Embedding.from_safetensors(path)
    except ValueError:
        return
    # Whatever still parses must be a consistent table inside the file.
    assert emb.table.ndim == 2 and emb.table.nbytes <= len(content)
    fastembed.lookup(emb.table, [0])


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
@pytest.mark.parametrize("value", [["F16"], {"F16": 1}, None, 2.5, True, "F16", [2, 2.0], {"a": [1]}, [[0, 8]], "nan"])
def test_every_json_type_in_an_entry_field_is_a_value_error(tmp_path, field, value):
    """A list or object as dtype used to raise TypeError: unhashable type."""
    entry = {**F16_ENTRY, field: value}
    path = tmp_path / "odd.safetensors"
    path.write_bytes(raw_safetensors({"w.embed_tokens.weight": entry}, b"\0" * 8))
    if field == "dtype" and value == "F16":
        assert fastembed.Embedding.from_safetensors(path).vocab_size == 2
        return
    with pytest.raises(ValueError, match=field if field != "dtype" else "unknown dtype"):
        fastembed.Embedding.from_safetensors(path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    values=st.fixed_dictionaries({}, optional={"dtype": JSON_VALUES, "shape": JSON_VALUES, "data_offsets": JSON_VALUES,
                                               "extra": JSON_VALUES}),
    metadata=st.one_of(st.none(), JSON_VALUES),
    other=st.one_of(st.none(), JSON_VALUES),
)
def test_fuzzed_entry_values_of_every_json_type_only_give_clean_errors(tmp_path, values, metadata, other):
    """dtype, shape, data_offsets, __metadata__ and a whole entry replaced by JSON of any type."""
    entry = {**F16_ENTRY, **values}
    header = {"model.embed_tokens.weight": entry}
    if metadata is not None:
        header["__metadata__"] = metadata
    if other is not None:
        header["other"] = other
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(raw_safetensors(header, np.arange(4, dtype=np.float16).tobytes()))
    try:
        emb = fastembed.Embedding.from_safetensors(path)
    except ValueError:
        return
    assert emb.table.shape == (2, 2) and emb.table.nbytes <= path.stat().st_size


@pytest.mark.parametrize("layout", [{"separators": (",", ":")}, {"indent": 2}, {"indent": "\t", "sort_keys": True}, {}])
def test_every_json_layout_of_a_header_opens_the_same(tmp_path, layout):
    """Writers lay the header out differently; the fast path and the JSON path must agree."""
    table = np.arange(12, dtype=np.float32).reshape(3, 4)
    header = {"__metadata__": {"format": "pt", "note": "caf\u00e9 \"x\""},
              "model.embed_tokens.weight": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
              "model.norm.weight": {"data_offsets": [48, 64], "shape": [4], "dtype": "F32"}}
    encoded = json.dumps(header, **layout).encode() + b"   "
    path = tmp_path / "layout.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + table.tobytes() + np.ones(4, np.float32).tobytes())
    assert_bit_equal(np.asarray(io.map_safetensors(path)), table)
    assert io.read_safetensors_header(path)[0]["model.norm.weight"] == io.TensorEntry("F32", (4,), 48, 64)


@pytest.mark.parametrize("metadata, opens", [
    ({"format": "pt", "note": "caf\u00e9 \\ \"x\" \n"}, True), ({}, True), ({"a": 1}, False), ({"a": ["b"]}, False),
    ({"a": {"b": "c"}}, False), ([], False), ("pt", False), (None, False),
])
@pytest.mark.parametrize("regex", [True, False])
def test_metadata_must_be_strings_with_and_without_the_regex(tmp_path, monkeypatch, metadata, opens, regex):
    """Python 3.10 has no possessive quantifiers: a string-by-string scan replaces the regex there."""
    from fastembed.io import safetensors as module

    if not regex:
        monkeypatch.setattr(module, "_STRING_OBJECT", None)
    path = tmp_path / "meta.safetensors"
    path.write_bytes(raw_safetensors({"__metadata__": metadata, "wte.weight": F16_ENTRY}, b"\0" * 8))
    if opens:
        assert io.map_safetensors(path).shape == (2, 2)
    else:
        with pytest.raises(ValueError, match="__metadata__ must be an object of strings"):
            io.map_safetensors(path)


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


@pytest.mark.slow
def test_one_gib_file_lookup_grows_rss_by_less_than_32_mib(tmp_path_factory, backend):
    pytest.importorskip("psutil")
    path = tmp_path_factory.getbasetemp() / "big.safetensors"
    vocab_size, dim = 129280, 4096
    if not path.exists():
        header = json.dumps({"model.embed_tokens.weight": {"dtype": "F16", "shape": [vocab_size, dim],
                                                           "data_offsets": [0, vocab_size * dim * 2]}}).encode()
        header += b" " * (-len(header) % 8)
        with open(path, "wb") as handle:
            handle.write(struct.pack("<Q", len(header)) + header)
            rows = random_table(4096, dim)  # 32 MiB written again and again: the file is 1 GiB
            handle.writelines(rows[: min(4096, vocab_size - start)].tobytes() for start in range(0, vocab_size, 4096))
    before = rss()
    emb = fastembed.Embedding.from_safetensors(path)
    result = emb(REFERENCE_IDS, backend=backend)
    growth = rss() - before
    assert emb.nbytes == 1_059_061_760
    assert growth < 32 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB"
    assert result.shape == (6, 4096)


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
def test_a_field_given_twice_in_an_entry_is_refused(tmp_path, field):
    data = random_table(8, 6, "float32").tobytes()
    fields = {"dtype": '"F32"', "shape": "[8, 6]", "data_offsets": f"[0, {len(data)}]"}
    text = ", ".join([f'"{name}": {value}' for name, value in fields.items()] + [f'"{field}": {fields[field]}'])
    header = ('{"wte.weight": {' + text + "}}").encode()
    path = tmp_path / "twice.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    with pytest.raises(ValueError, match=f"tensor 'wte.weight'.*field '{field}' is given twice"):
        io.map_safetensors(path)
