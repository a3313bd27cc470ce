"""GGUF files: every readable type mapped zero-copy and dequantized as gguf.quants does; hostile files give ValueError."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastembed
from fastembed import io
from fastembed.formats import FORMATS, QuantizedTable, dequantize_rows
from fastembed.io import gguf as gguf_module
from helpers import run_script

gguf = pytest.importorskip("gguf")
ml_dtypes = pytest.importorskip("ml_dtypes")
Q = gguf.GGMLQuantizationType

VOCAB = 12
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
#: Where each K-quant block keeps its float16 scales (byte offsets).
K_SCALE_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def values(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def tensor_for(type_name: str, rows: int, seed: int = 0) -> tuple[np.ndarray, object, np.ndarray]:
    """(what GGUFWriter.add_tensor takes, its raw_dtype, the rows' raw bytes (rows, row_bytes))."""
    qtype = Q[type_name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    dim = 2 * block_values
    if type_name in ("F32", "F16"):
        array = values(rows, dim, seed).astype(type_name.lower().replace("f", "float"))
        return array, None, array.view(np.uint8)
    if type_name == "BF16":
        raw = values(rows, dim, seed).astype(ml_dtypes.bfloat16).view(np.uint8)
        return raw, qtype, raw
    if type_name in K_SCALE_FIELDS:
        raw = np.random.default_rng(seed).integers(0, 256, (rows * 2, block_bytes), dtype=np.uint8)
        for start in K_SCALE_FIELDS[type_name]:  # small finite float16 scales
            raw[:, start:start + 2] = (np.random.default_rng(seed + 1).uniform(-0.05, 0.05, (rows * 2, 1))
                                       .astype("<f2").view(np.uint8))
        raw = raw.reshape(rows, 2 * block_bytes)
        return raw, qtype, raw
    raw = gguf.quants.quantize(values(rows, dim, seed), qtype)
    return raw, qtype, raw


def write_gguf(path, tensors, alignment: int | None = None, version: int = 3) -> None:
    """A GGUF file written by the gguf package, with a tokenizer-like metadata section before the tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("general.name", "caf\u00e9 test")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "hello", "w\u00f6rld", ""] * 5)
    writer.add_array("tokenizer.ggml.scores", [0.0, 1.5, -2.0, 3.0])
    writer.add_uint64("llama.context_length", 4096)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    for name, array, raw_dtype in tensors:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if version != 3:
        with open(path, "r+b") as handle:  # versions 2 and 3 share the layout
            handle.seek(4)
            handle.write(struct.pack("<I", version))


def assert_maps_the_file(array: np.memmap, path) -> None:
    """A read-only np.memmap of `path` whose data lie inside the mapping (no copy)."""
    assert isinstance(array, np.memmap) and not array.flags.writeable
    assert os.path.samefile(array.filename, path)
    mapping = np.frombuffer(array.base, np.uint8)
    start = mapping.ctypes.data
    assert start <= array.ctypes.data and array.ctypes.data + array.nbytes <= start + mapping.nbytes


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("type_name", TYPES)
def test_every_type_maps_zero_copy_and_dequantizes_as_gguf_does(tmp_path, type_name, version):
    array, raw_dtype, raw = tensor_for(type_name, VOCAB)
    other, other_dtype, _ = tensor_for("Q8_0", 3, seed=5)
    alignment = [None, 1, 8, 64, 4096][TYPES.index(type_name) % 5]
    path = tmp_path / "model.gguf"
    write_gguf(path, [("output_norm.weight", values(1, 64)[0], None), ("output.weight", other, other_dtype),
                      ("token_embd.weight", array, raw_dtype)], alignment, version)
    table = io.map_gguf(path)
    qtype = Q[type_name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    dim = raw.shape[1] // block_bytes * block_values
    if type_name in ("F32", "F16", "BF16"):
        expected_dtype = np.dtype(ml_dtypes.bfloat16) if type_name == "BF16" else array.dtype
        assert table.dtype == expected_dtype and table.shape == (VOCAB, dim)
        np.testing.assert_array_equal(np.asarray(table).view(np.uint8), raw)
        assert_maps_the_file(table, path)
        return
    assert isinstance(table, QuantizedTable) and table.format.ggml_type == int(qtype)
    assert table.shape == (VOCAB, dim) and table.scales is None
    np.testing.assert_array_equal(np.asarray(table.data), raw)
    assert_maps_the_file(table.data, path)
    ours = dequantize_rows(np.asarray(table.data), None, table.format, dim)
    reference = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(reference).all()
    np.testing.assert_array_equal(ours.view(np.uint32), reference.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("alignment", [1, 2, 8, 64, 4096])
def test_alignments_place_every_tensor_where_the_reference_reader_does(tmp_path, alignment):
    tensors = [(f"blk.{i}.ffn.weight", *tensor_for("Q4_0", 3 + i, seed=i)[:2]) for i in range(3)]
    embedding, raw_dtype, _ = tensor_for("F16", VOCAB)
    path = tmp_path / "aligned.gguf"
    write_gguf(path, [*tensors, ("token_embd.weight", embedding, raw_dtype)], alignment)
    reference = {tensor.name: tensor for tensor in gguf.GGUFReader(str(path)).tensors}
    for name in reference:
        found = io.scan_gguf(path, name)
        assert found.offset == reference[name].data_offset and found.offset % alignment == 0
        assert list(found.dims) == [int(d) for d in reference[name].shape]
    np.testing.assert_array_equal(np.asarray(io.map_gguf(path)), embedding)


def test_a_named_tensor_and_a_missing_one(tmp_path):
    path = tmp_path / "many.gguf"
    tensors = [(f"blk.{i}.attn_q.weight", values(2, 32, i), None) for i in range(30)]
    write_gguf(path, [*tensors, ("token_embd.weight", values(4, 32), None), ("token_embd_norm.weight", values(4, 32), None)])
    assert io.map_gguf(path, "blk.7.attn_q.weight").shape == (2, 32)
    with pytest.raises(ValueError) as caught:
        io.map_gguf(path, "token_embed.weight")
    message = str(caught.value)
    assert str(path) in message and "no tensor named 'token_embed.weight'" in message
    assert "'token_embd.weight', 'token_embd_norm.weight'" in message and "... and 20 more" in message
    assert len(message) < 1000


def test_open_table_routes_gguf_files(tmp_path):
    array, raw_dtype, raw = tensor_for("Q8_0", VOCAB)
    path = tmp_path / "model.gguf"
    write_gguf(path, [("token_embd.weight", array, raw_dtype), ("output.weight", values(VOCAB, 16), None)])
    table = io.open_table(path)
    assert isinstance(table, QuantizedTable) and np.array_equal(np.asarray(table.data), raw)
    assert io.open_table(path, name="output.weight").shape == (VOCAB, 16)
    no_suffix = tmp_path / "model-q8"
    no_suffix.write_bytes(path.read_bytes())
    assert isinstance(io.open_table(no_suffix), QuantizedTable)
    watch = io.FileWatch.for_table(table)
    assert watch.needed_bytes == table.data.offset + table.data.nbytes
    watch.check()
    watch.close()


def test_a_dense_gguf_table_looks_up_through_from_pretrained(tmp_path, backend):
    array = values(VOCAB, 64).astype(np.float16)
    path = tmp_path / "model.gguf"
    write_gguf(path, [("token_embd.weight", array, None)])
    emb = fastembed.Embedding.from_pretrained(path)
    np.testing.assert_array_equal(emb([3, 0, 11], backend=backend), array[[3, 0, 11]])
    emb.check_file()


def test_the_other_loaders_point_to_from_gguf_and_back(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, [("token_embd.weight", values(VOCAB, 32), None)])
    with pytest.raises(ValueError, match=r"is a GGUF file \(llama\.cpp\); open it with fastembed\.Embedding\.from_gguf"):
        io.map_safetensors(path)
    np.save(tmp_path / "table.npy", values(2, 2))
    with pytest.raises(ValueError, match=r"not a GGUF file: it is a \.npy file; open it with fastembed\.Embedding\.from_npy"):
        io.map_gguf(tmp_path / "table.npy")
    with pytest.raises(FileNotFoundError):
        io.map_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="is a directory"):
        io.map_gguf(tmp_path)


def test_a_sparse_8_gib_table_opens_without_reading_its_data(tmp_path):
    vocab, dim = 1_048_576, 4096
    head = raw_gguf([("token_embd.weight", [dim, vocab], 1, 0)])
    path = tmp_path / "huge.gguf"
    with open(path, "wb") as handle:
        handle.write(head)
        try:
            handle.truncate(len(head) + vocab * dim * 2)
        except OSError as error:
            pytest.skip(f"this filesystem cannot hold a sparse 8 GiB file: {error}")
    table = io.map_gguf(path)
    assert table.shape == (vocab, dim) and table.offset == len(head) and not table[vocab - 1].any()


# Hand-built files: every field can be set to anything.


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def raw_gguf(tensors, kv=(), version: int = 3, alignment: int = 32, data: bytes = b"",
             counts: tuple[int | None, int | None] = (None, None)) -> bytes:
    """A GGUF file from parts: tensors (name, dims, type, offset), kv (key, value type, value bytes)."""
    tensor_count = len(tensors) if counts[0] is None else counts[0]
    kv_count = len(kv) if counts[1] is None else counts[1]
    head = b"GGUF" + struct.pack("<IQQ", version, tensor_count, kv_count)
    for key, value_type, value in kv:
        head += gguf_string(key) + struct.pack("<I", value_type) + value
    for name, dims, ggml_type, offset in tensors:
        head += gguf_string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", ggml_type, offset)
    return head + b"\0" * (-len(head) % alignment) + data


F16_TABLE = ("token_embd.weight", [4, 3], 1, 0)
DATA = np.arange(12, dtype=np.float16).tobytes()
U32 = 4


@pytest.mark.parametrize(
    "content, words",
    [
        (b"", "not a GGUF file"),
        (b"GGU", "not a GGUF file"),
        (b"GGUF\x03\x00", "truncated GGUF file: the version"),
        (b"GGML" + b"\0" * 40, "no 'GGUF' magic"),
        (raw_gguf([F16_TABLE], version=1, data=DATA), "GGUF version 1 .*32 bits.*versions 2 and 3"),
        (raw_gguf([F16_TABLE], version=4, data=DATA), "GGUF version 4 is not supported"),
        (raw_gguf([F16_TABLE], version=3 << 24, data=DATA), "big-endian GGUF file"),
        (raw_gguf([F16_TABLE], data=DATA, counts=(2**63, None)), "lists 9223372036854775808 tensors"),
        (raw_gguf([F16_TABLE], data=DATA, counts=(None, 2**64 - 1)), "metadata entries, over fastembed's limit"),
        (raw_gguf([F16_TABLE], data=DATA, counts=(5000, None)), "5000 tensors, more than the file's"),
        (raw_gguf([F16_TABLE], data=DATA, counts=(300_000, 0)), "over fastembed's limit of 262144"),
        (raw_gguf([F16_TABLE], data=DATA, counts=(None, 1000)), "1000 metadata entries, more than the file"),
        (raw_gguf([F16_TABLE], [("general.name", 8, struct.pack("<Q", 2**64 - 1))], data=DATA), "truncated GGUF file: the value of 'general.name'"),
        (raw_gguf([F16_TABLE], [("k", 9, struct.pack("<IQ", 8, 2**62))], data=DATA), "truncated GGUF file: the 4611686018427387904 items of 'k'"),
        (raw_gguf([F16_TABLE], [("k", 9, struct.pack("<IQ", 10, 2**61))], data=DATA), "items of 'k'"),
        (raw_gguf([F16_TABLE], [("k", 9, struct.pack("<IQ", 9, 1))], data=DATA), "array of arrays"),
        (raw_gguf([F16_TABLE], [("k", 9, struct.pack("<IQ", 77, 1))], data=DATA), "array of unknown value type 77"),
        (raw_gguf([F16_TABLE], [("k", 13, b"\0" * 8)], data=DATA), "'k' has unknown value type 13"),
        (raw_gguf([F16_TABLE], [("general.alignment", U32, struct.pack("<I", 0))], data=DATA), "alignment 0 is not a power of two"),
        (raw_gguf([F16_TABLE], [("general.alignment", U32, struct.pack("<I", 24))], data=DATA), "alignment 24 is not a power of two"),
        (raw_gguf([F16_TABLE], [("general.alignment", 10, struct.pack("<Q", 32))], data=DATA), "must be a uint32"),
        (raw_gguf([F16_TABLE], [("general.alignment", U32, struct.pack("<I", 32))] * 2, data=DATA), "given twice"),
        (raw_gguf([F16_TABLE], [(b"\xff" * 2**16, 0, b"\0")], data=DATA), None),
        (raw_gguf([("token_embd.weight", [4, 3], 1, 64)], data=DATA), "go beyond the file"),
        (raw_gguf([("token_embd.weight", [4, 3], 1, 2**64 - 32)], data=DATA), "go beyond the file"),
        (raw_gguf([("token_embd.weight", [4, 3], 1, 8)], data=DATA), "offset 8, not a multiple of the alignment 32"),
        (raw_gguf([("token_embd.weight", [4, 3000], 1, 0)], data=DATA), "go beyond the file"),
        (raw_gguf([("token_embd.weight", [2**40, 2**40], 1, 0)], data=DATA), "product overflows 64 bits"),
        (raw_gguf([("token_embd.weight", [2**63, 1], 1, 0)], data=DATA), "product overflows 64 bits"),
        (raw_gguf([("token_embd.weight", [4, 3, 1, 1, 1], 1, 0)], data=DATA), "5 dimensions; ggml tensors have at most 4"),
        (raw_gguf([("token_embd.weight", [12], 1, 0)], data=DATA), "1 dimensions \\[12\\]; an embedding table is 2-D"),
        (raw_gguf([("token_embd.weight", [4, 3, 1], 1, 0)], data=DATA), "3 dimensions"),
        (raw_gguf([("token_embd.weight", [4, 0], 1, 0)], data=DATA), "is empty"),
        (raw_gguf([("token_embd.weight", [4, 3], 99, 0)], data=DATA), "has type code 99, which fastembed does not read"),
        (raw_gguf([("token_embd.weight", [256, 3], 17, 0)], data=DATA), "type IQ2_XS, which fastembed does not read; it reads F32, F16, BF16, Q8_0"),
        (raw_gguf([("token_embd.weight", [3, 4], 28, 0)], data=DATA), "type F64"),
        (raw_gguf([("token_embd.weight", [48, 1], 8, 0)], data=b"\0" * 64), "multiple of 32 values, not 48"),
        (raw_gguf([F16_TABLE, F16_TABLE], data=DATA), "listed twice"),
        (raw_gguf([("x" * 5000, [4, 3], 1, 0)], data=DATA), "5000 bytes long"),
        (raw_gguf([("blk.0.weight", [4, 3], 1, 0)], data=DATA), "no tensor named 'token_embd.weight'.*'blk.0.weight'"),
    ],
)
def test_hostile_files_give_value_errors_naming_the_problem(tmp_path, content, words):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    if words is None:  # a long, invalid UTF-8 key is skipped unread
        assert io.map_gguf(path).shape == (3, 4)
        return
    with pytest.raises(ValueError, match=words) as caught:
        io.map_gguf(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_a_table_sharing_bytes_with_another_tensor_is_refused(tmp_path):
    """The file's checks stopped at the table's own bytes: a table whose rows ran into another tensor's data (or
    lay inside it) was mapped, and its rows were that tensor's bytes. llama.cpp refuses such a file."""
    data = bytes(range(256)) * 2
    path = tmp_path / "shared.gguf"
    table = ("token_embd.weight", [32, 3], 1, 64)  # 3 rows of 32 float16: bytes 64-256 of the data
    sharing = {"another at the same place": [table, ("twin", [4], 1, 64)],
               "another starting inside it": [table, ("next", [4], 1, 128)],
               "one of a type ggml does not define starting inside it": [("odd", [1], 99, 96), table],
               "one of a type ggml does not define starting where it starts": [("odd", [1], 99, 64), table],
               "it inside another": [("big", [256], 0, 0), table],
               "it starting inside another": [("first", [24], 0, 0), table]}
    for tensors in sharing.values():
        path.write_bytes(raw_gguf(tensors, data=data))
        with pytest.raises(ValueError, match="tensor 'token_embd.weight' \\(bytes 64 to 256 of the data\\) shares "
                                             "bytes with tensor '.*' \\(bytes .*\\): a GGUF file's tensors lie one after"):
            io.map_gguf(path)
    apart = [("empty", [0, 4], 1, 64), table, ("odd", [8], 99, 256), ("last", [4], 1, 256), ("first", [16], 0, 0)]
    path.write_bytes(raw_gguf(apart, data=data))  # an empty tensor where it starts; others before and after it
    assert np.asarray(io.map_gguf(path)).tobytes() == data[64:256]


def test_a_header_over_the_limit_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    write_gguf(path, [("token_embd.weight", values(4, 32), None)])
    assert io.map_gguf(path).shape == (4, 32)
    monkeypatch.setattr(gguf_module, "MAX_GGUF_HEADER_BYTES", 256)
    with pytest.raises(ValueError, match="runs past fastembed's limit of 256 bytes"):
        io.map_gguf(path)


def test_every_truncation_of_a_real_file_is_a_value_error(tmp_path):
    array, raw_dtype, _ = tensor_for("Q4_K", 3)
    path = tmp_path / "model.gguf"
    write_gguf(path, [("output.weight", values(2, 32), None), ("token_embd.weight", array, raw_dtype)], alignment=64)
    content = path.read_bytes()
    table = io.map_gguf(path)
    cut = tmp_path / "cut.gguf"
    for end in range(0, table.data.offset + table.data.nbytes, 7):
        cut.write_bytes(content[:end])
        with pytest.raises(ValueError, match="(truncated GGUF file|go beyond the file|not a GGUF file|bytes can hold)"):
            io.map_gguf(cut)


def _fuzzed_file_ok(path, size: int) -> None:
    """map_gguf either refuses the file with a ValueError or maps a consistent table inside it."""
    try:
        table = io.map_gguf(path)
    except ValueError:
        return
    data = table.data if isinstance(table, QuantizedTable) else table
    assert data.ndim == 2 and data.offset + data.nbytes <= size
    np.asarray(data[-1]).copy()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 2000)))
def test_fuzzed_bytes_of_a_real_file_only_give_value_errors(tmp_path, flips, cut):
    path = tmp_path / "fuzz.gguf"
    if not (tmp_path / "valid.gguf").exists():
        array, raw_dtype, _ = tensor_for("Q8_0", 4)
        write_gguf(tmp_path / "valid.gguf", [("output.weight", values(2, 32), None), ("token_embd.weight", array, raw_dtype)])
    content = bytearray((tmp_path / "valid.gguf").read_bytes())
    header_end = io.scan_gguf(tmp_path / "valid.gguf", "output.weight").offset
    for position, value in flips:
        content[position % header_end] = value
    if cut is not None:
        content = content[:cut]
    path.write_bytes(bytes(content))
    _fuzzed_file_ok(path, len(content))


INTERESTING = st.one_of(st.integers(0, 70), st.sampled_from([2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]))
KV = st.tuples(st.one_of(st.text(max_size=20), st.just("general.alignment")), st.integers(0, 14),
               st.binary(max_size=24))
TENSOR = st.tuples(st.one_of(st.just("token_embd.weight"), st.text(max_size=8)),
                   st.lists(INTERESTING, max_size=6), st.one_of(st.integers(0, 45), st.sampled_from([2**32 - 1])),
                   st.one_of(st.sampled_from([0, 32, 64]), INTERESTING))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(tensors=st.lists(TENSOR, max_size=4), kv=st.lists(KV, max_size=4), version=st.sampled_from([1, 2, 3, 4, 3 << 24]),
       counts=st.tuples(st.one_of(st.none(), INTERESTING), st.one_of(st.none(), INTERESTING)),
       data=st.binary(max_size=600))
def test_fuzzed_fields_only_give_value_errors(tmp_path, tensors, kv, version, counts, data):
    """Every count, length, dim, type and offset drawn from values that break naive parsers."""
    kv = [(key, value_type, value) for key, value_type, value in kv]
    content = raw_gguf(tensors, kv, version=version, data=data, counts=counts)
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(content)
    _fuzzed_file_ok(path, len(content))


def test_readable_types_are_the_formats_with_a_ggml_type():
    assert {code for code in gguf_module.QUANTIZED_TYPES} == {f.ggml_type for f in FORMATS.values() if f.ggml_type is not None}
    for code, (name, block_values, block_bytes) in gguf_module.GGML_TYPES.items():
        assert Q(code).name == name and gguf.GGML_QUANT_SIZES[Q(code)] == (block_values, block_bytes)
    for fmt in FORMATS.values():
        if fmt.ggml_type is not None:
            assert gguf_module.GGML_TYPES[fmt.ggml_type][1:] == (fmt.block_values, fmt.block_bytes)
    assert io.ggml_type_name(17) == "IQ2_XS" and io.ggml_type_name(1000) == "type code 1000"


def test_a_file_cut_short_while_its_header_is_scanned_is_a_value_error(tmp_path):
    """The header was scanned through a map of the file: a file truncated meanwhile killed the process (SIGBUS)."""
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"token {i}" for i in range(300_000)])  # a header of about 4 MiB
    writer.add_tensor("token_embd.weight", values(VOCAB, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_script(tmp_path, f"""
import os, fastembed
from fastembed.io import gguf
scan_metadata = gguf._read_metadata
def cut_then_scan(reader, kv_count):  # the file shrinks once its header is being read
    os.truncate({str(path)!r}, 4096)
    return scan_metadata(reader, kv_count)
gguf._read_metadata = cut_then_scan
try:
    fastembed.Embedding.from_gguf({str(path)!r})
except ValueError as error:
    print("ValueError:", error)
""")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "changed while it was being opened" in result.stdout
