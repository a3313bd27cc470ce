"""save_table: dense and quantized tables to .gguf and .safetensors, mapped back byte for byte, zero-copy."""
from __future__ import annotations

import json
import os
import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastembed
from fastembed import io
from fastembed.formats import FORMATS, QuantizedTable, quantize_rows
from helpers import in_fastembed, interrupted_runs, run_script
from test_io_gguf import assert_maps_the_file, tensor_for, write_gguf

gguf = pytest.importorskip("gguf")
ml_dtypes = pytest.importorskip("ml_dtypes")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

VOCAB, DIM = 40, 64


def rows(dtype="float32", seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((VOCAB, DIM)).astype(np.float32).astype(dtype)


def quantized(name: str) -> QuantizedTable:
    data, scales = quantize_rows(rows(), FORMATS[name])
    return QuantizedTable(data, name, DIM, scales)


def same_bytes(actual, expected) -> None:
    np.testing.assert_array_equal(np.asarray(actual).view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))


@pytest.mark.parametrize("suffix", [".gguf", ".safetensors"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_dense_table_round_trips(tmp_path, suffix, dtype):
    table = rows(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    path = tmp_path / f"table{suffix}"
    io.save_table(path, table)
    loaded = io.open_table(path)
    assert loaded.dtype == table.dtype and loaded.shape == table.shape
    same_bytes(loaded, table)
    assert_maps_the_file(loaded, path)
    if suffix == ".gguf":
        reader = gguf.GGUFReader(str(path))  # the reference reader agrees
        assert reader.get_field("general.quantization_version") is None  # a dense tensor has no quantization
        (reference,) = reader.tensors
        assert reference.name == "token_embd.weight" and reference.tensor_type.name == {"float32": "F32", "float16": "F16"}.get(dtype, "BF16")
        same_bytes(np.asarray(reference.data), table)
        assert os.path.getsize(path) % 32 == 0
    else:
        assert set(safetensors_numpy.load_file(str(path))) == {"weight"}


def test_q8_0_round_trips_through_gguf_and_safetensors(tmp_path):
    table = quantized("q8_0")
    for path in (tmp_path / "q8.gguf", tmp_path / "q8.safetensors"):
        io.save_table(path, table)
        loaded = io.open_table(path)
        assert isinstance(loaded, QuantizedTable) and loaded.format.name == "q8_0" and loaded.shape == (VOCAB, DIM)
        assert loaded.scales is None
        same_bytes(loaded.data, table.data)
        assert_maps_the_file(loaded.data, path)
    reader = gguf.GGUFReader(str(tmp_path / "q8.gguf"))
    version = reader.get_field("general.quantization_version")  # the GGUF specification requires it for quantized tensors
    assert version is not None and version.contents() == 2
    (reference,) = reader.tensors
    np.testing.assert_array_equal(gguf.quants.dequantize(np.asarray(reference.data), reference.tensor_type),
                                  gguf.quants.dequantize(table.data, gguf.GGMLQuantizationType.Q8_0))


def test_fp8_e4m3_round_trips_through_safetensors_with_its_scales_mapped(tmp_path):
    table = quantized("fp8_e4m3")
    path = tmp_path / "fp8.safetensors"
    io.save_table(path, table, name="model.embed_tokens.weight")
    loaded = io.map_safetensors(path)
    assert isinstance(loaded, QuantizedTable) and loaded.format.name == "fp8_e4m3" and loaded.dim == DIM
    same_bytes(loaded.data, table.data)
    same_bytes(loaded.scales, table.scales)
    assert loaded.scales.dtype == np.float32
    assert_maps_the_file(loaded.data, path)
    assert_maps_the_file(loaded.scales, path)
    header = json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    assert header["__metadata__"] == {"fastembed.tensor": "model.embed_tokens.weight", "fastembed.format": "fp8_e4m3",
                                      "fastembed.dim": str(DIM)}
    assert header["model.embed_tokens.weight.scales"]["dtype"] == "F32"
    assert isinstance(io.map_safetensors(path, "model.embed_tokens.weight"), QuantizedTable)
    with io.FileWatch.for_table(loaded) as watch:
        assert watch.needed_bytes == max(a.offset + a.nbytes for a in (loaded.data, loaded.scales))
        assert watch.needed_bytes == os.path.getsize(path)
        watch.check()
    with pytest.raises(ValueError, match="GGUF has no type for fp8_e4m3 tables; save it as .safetensors"):
        io.save_table(tmp_path / "fp8.gguf", table)
    assert not os.path.exists(tmp_path / "fp8.gguf")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_every_gguf_format_saves_back_to_the_same_bytes(tmp_path, type_name):
    array, raw_dtype, raw = tensor_for(type_name, 5)
    write_gguf(tmp_path / "source.gguf", [("token_embd.weight", array, raw_dtype)])
    table = io.map_gguf(tmp_path / "source.gguf")
    for suffix in (".gguf", ".safetensors"):
        io.save_table(tmp_path / f"copy{suffix}", table)
        copy = io.open_table(tmp_path / f"copy{suffix}")
        assert copy.format is table.format and copy.dim == table.dim
        same_bytes(copy.data, raw)


def test_names_and_selection(tmp_path):
    table = rows("float16")
    io.save_table(tmp_path / "named.gguf", table, name="output.weight")
    assert io.map_gguf(tmp_path / "named.gguf", "output.weight").shape == (VOCAB, DIM)
    with pytest.raises(ValueError, match="no tensor named 'token_embd.weight'.*'output.weight'"):
        io.map_gguf(tmp_path / "named.gguf")
    io.save_table(tmp_path / "named.safetensors", table, name="anything")  # found by its metadata, not its name
    same_bytes(io.open_table(tmp_path / "named.safetensors"), table)
    same_bytes(fastembed.Embedding.from_safetensors(tmp_path / "named.safetensors").table, table)


def test_saving_over_a_mapped_file_leaves_the_mapped_table_as_it_was(tmp_path):
    path = tmp_path / "table.gguf"
    first, second = rows("float16", 1), rows("float16", 2)
    io.save_table(path, first)
    mapped = io.map_gguf(path)
    io.save_table(path, second)
    same_bytes(mapped, first)
    same_bytes(io.map_gguf(path), second)
    assert sorted(os.listdir(tmp_path)) == ["table.gguf"]


@pytest.mark.parametrize("suffix", [".gguf", ".safetensors"])
def test_a_table_reshaped_or_retyped_by_another_thread_while_it_is_saved_is_written_as_it_was(tmp_path, suffix):
    """The writers read the caller's array after the checks: a shape or dtype reassigned meanwhile made a file that
    loads as another table, or one longer than its header says. Every moment of the save is tried."""
    rows = (np.arange(3 * 2**20 // 4, dtype=np.float32).reshape(-1, 64) % 1000)  # 3 MiB: written in chunks
    path = tmp_path / f"table{suffix}"
    for change in ({"shape": (rows.shape[0], 32, 2)}, {"dtype": np.float16}):
        run: dict = {}

        def save(run=run):
            run.update(table=rows.copy(), refused=False)
            try:
                io.save_table(path, run["table"])
            except ValueError:
                run["refused"] = True

        def another_thread(run=run, change=change):
            for name, value in change.items():
                setattr(run["table"], name, value)
            run["changed"] = True

        def check(run=run, change=change):
            if run["refused"]:
                assert run.get("changed")  # the table as it is after the change: refused (3-D), nothing written
                return
            saved = np.asarray(io.open_table(path))
            table = run["table"]
            before, after = rows, table if table.ndim == 2 else None
            assert any(saved.dtype == t.dtype and np.array_equal(saved, t) for t in (before, after) if t is not None), \
                f"{change}: a file of neither table"

        for _ in interrupted_runs(in_fastembed, save, another_thread):
            check()
            run["changed"] = False
        check()


def test_strided_and_big_endian_tables_are_written_as_they_read(tmp_path):
    wide = rows("float32")
    io.save_table(tmp_path / "strided.gguf", wide[:, ::2])
    same_bytes(io.map_gguf(tmp_path / "strided.gguf"), np.ascontiguousarray(wide[:, ::2]))
    big = wide.astype(">f4")
    for suffix in (".gguf", ".safetensors"):
        io.save_table(tmp_path / f"big{suffix}", big)
        loaded = io.open_table(tmp_path / f"big{suffix}")
        np.testing.assert_array_equal(loaded, wide)


def test_a_new_file_gets_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ("t.gguf", "t.safetensors"):
        io.save_table(tmp_path / name, rows())
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~umask


def test_a_umask_that_leaves_the_owner_no_write_permission_still_lets_a_file_be_written(tmp_path):
    """With a umask of 0o277 a new file is created read-only for its owner: the file being written is kept
    writable and readable by its owner meanwhile (as root, which writes anyway, that is what can be seen), then
    gets the usual permissions (0o666 less the umask), or a replaced file's own."""
    script = f"""
import os, stat, numpy as np
from fastembed import io
from fastembed.io import save
folder = {str(tmp_path)!r}
modes = []
check_readable = save._check_readable
def recording(path, temporary, *rest):
    modes.append(stat.S_IMODE(os.stat(temporary).st_mode))
    return check_readable(path, temporary, *rest)
save._check_readable = recording
open(os.path.join(folder, "old.gguf"), "wb").close()
os.chmod(os.path.join(folder, "old.gguf"), 0o644)
os.umask(0o277)
for name in ("new.gguf", "new.safetensors", "old.gguf"):
    io.save_table(os.path.join(folder, name), np.ones((2, 32), np.float32))
    print(name, oct(modes[-1] & 0o600), oct(stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode)))
"""
    result = run_script(tmp_path, script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["new.gguf", "0o600", "0o400", "new.safetensors", "0o600", "0o400",
                                     "old.gguf", "0o600", "0o644"]
    assert sorted(os.listdir(tmp_path)) == ["new.gguf", "new.safetensors", "old.gguf", "script.py"]


@pytest.mark.parametrize("suffix", [".gguf", ".safetensors"])
def test_an_interrupted_save_leaves_no_temporary_file_and_the_old_table_or_the_new_one(tmp_path, suffix):
    """A Ctrl-C at any point of a save (creating the temporary file included): nothing of it is left beside the
    path, which holds the old file or the new one, whole."""
    path, written = tmp_path / "folder" / f"t{suffix}", tmp_path / f"new{suffix}"
    path.parent.mkdir()
    io.save_table(path, rows(seed=1))
    io.save_table(written, rows(seed=2))
    old, new = path.read_bytes(), written.read_bytes()
    for _ in interrupted_runs(in_fastembed, lambda: io.save_table(path, rows(seed=2))):
        assert os.listdir(path.parent) == [path.name]
        assert path.read_bytes() in (old, new)
    assert path.read_bytes() == new


def test_a_safetensors_tensor_cannot_be_named_as_the_headers_metadata(tmp_path):
    """The safetensors header keeps its metadata under "__metadata__": refused before anything is written."""
    with pytest.raises(ValueError, match="cannot be named '__metadata__'"):
        io.save_table(tmp_path / "t.safetensors", rows(), name="__metadata__")
    assert os.listdir(tmp_path) == []


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    for mode in (0o600, 0o640, 0o444):
        for name in ("t.gguf", "t.safetensors"):
            path = tmp_path / name
            io.save_table(path, rows())
            os.chmod(path, mode)
            io.save_table(path, rows(seed=1))
            assert os.stat(path).st_mode & 0o777 == mode
            same_bytes(io.open_table(path), rows(seed=1))
            os.chmod(path, 0o600)
            path.unlink()


def test_the_new_contents_of_a_replaced_file_are_never_open_to_more_users_than_its_old_ones(tmp_path, monkeypatch):
    """A descriptor opened while the temporary file is readable keeps reading it after its chmod and rename."""
    from fastembed.io import save

    modes = []
    real_check = save._check_readable

    def check_after_the_rows_are_written(path, temporary, *args):
        modes.append(os.stat(temporary).st_mode & 0o777)
        return real_check(path, temporary, *args)

    monkeypatch.setattr(save, "_check_readable", check_after_the_rows_are_written)
    for name in ("t.gguf", "t.safetensors"):
        path = tmp_path / name
        io.save_table(path, rows())
        os.chmod(path, 0o600)
        io.save_table(path, rows(seed=1))
        assert modes[-1] == 0o600 and os.stat(path).st_mode & 0o777 == 0o600


def test_a_symbolic_link_is_replaced_and_its_target_left_as_it_was(tmp_path):
    target = tmp_path / "blob.safetensors"
    io.save_table(target, rows())
    link = tmp_path / "model.safetensors"
    link.symlink_to(target)
    io.save_table(link, rows(seed=1))
    assert not link.is_symlink()
    same_bytes(io.open_table(link), rows(seed=1))
    same_bytes(io.open_table(target), rows())


@pytest.mark.parametrize("where", ["missing/t.gguf", "folder.gguf"])
def test_a_path_that_cannot_be_written_is_named_in_the_error(tmp_path, where):
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(OSError) as caught:
        io.save_table(tmp_path / where, rows())
    assert caught.value.filename == str(tmp_path / where)
    assert ".tmp" not in str(caught.value)
    assert sorted(os.listdir(tmp_path)) == ["folder.gguf"]


def test_host_torch_tables_are_saved_as_embedding_save_saves_them(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    dense = torch.from_numpy(rows()).to(torch.bfloat16)
    io.save_table(tmp_path / "t.safetensors", dense)
    same_bytes(io.open_table(tmp_path / "t.safetensors"), dense.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    table = quantized("fp8_e4m3")
    on_torch = QuantizedTable(torch.from_numpy(table.data), table.format, table.dim, torch.from_numpy(table.scales))
    io.save_table(tmp_path / "q.safetensors", on_torch)
    back = io.open_table(tmp_path / "q.safetensors")
    same_bytes(back.data, table.data)
    same_bytes(back.scales, table.scales)


class _DeviceArray:
    """Stands in for a GPU array, which numpy refuses to convert implicitly."""

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")


@pytest.mark.parametrize(
    "file_name, table, error, words",
    [
        ("t.npy", rows(), ValueError, "writes .gguf and .safetensors files, not '.npy'"),
        ("table", rows(), ValueError, "not 'a file without a suffix'"),
        ("t.gguf", rows("int8"), ValueError, "GGUF holds float32, float16 and bfloat16 tables, not int8"),
        ("t.gguf", rows()[0], ValueError, "non-empty 2-D array, got shape \\(64,\\)"),
        ("t.safetensors", rows()[:0], ValueError, "non-empty 2-D array"),
        ("t.gguf", _DeviceArray(), TypeError, "writes host tables"),
        ("t.gguf", [[1.0, 2.0]], TypeError, "writes host tables .*, not a builtins.list"),
        ("t.safetensors", None, TypeError, "writes host tables .*, not a builtins.NoneType"),
    ],
)
def test_tables_a_file_cannot_hold_are_refused(tmp_path, file_name, table, error, words):
    with pytest.raises(error, match=words) as caught:
        io.save_table(tmp_path / file_name, table)
    assert str(tmp_path / file_name) in str(caught.value)
    assert os.listdir(tmp_path) == []


def test_int8_goes_to_safetensors(tmp_path):
    table = rows("int8")
    io.save_table(tmp_path / "t.safetensors", table)
    same_bytes(io.map_safetensors(tmp_path / "t.safetensors"), table)


def test_safetensors_files_need_no_package_to_write_and_the_package_reads_them(tmp_path, monkeypatch):
    dense, fp8 = rows("float16", seed=3), quantized("fp8_e4m3")
    with monkeypatch.context() as without:
        without.setitem(sys.modules, "safetensors", None)
        without.setitem(sys.modules, "safetensors.numpy", None)
        io.save_table(tmp_path / "dense.safetensors", dense, name="model.embed_tokens.weight")
        io.save_table(tmp_path / "fp8.safetensors", fp8)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "dense.safetensors"), "np") as reader:
        assert reader.metadata() == {"fastembed.tensor": "model.embed_tokens.weight"}
        same_bytes(reader.get_tensor("model.embed_tokens.weight"), dense)
    with safe_open(str(tmp_path / "fp8.safetensors"), "np") as reader:
        assert reader.metadata() == {"fastembed.tensor": "weight", "fastembed.format": "fp8_e4m3", "fastembed.dim": str(DIM)}
        same_bytes(reader.get_tensor("weight"), fp8.data)
        same_bytes(reader.get_tensor("weight.scales"), fp8.scales)
    # Laid out as the package lays them out (the float32 scales first, aligned): the same header and data bytes
    # (the package writes metadata keys in no set order).
    def layout(path):
        raw = path.read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        return json.loads(raw[8: 8 + length]), length, raw[8 + length:]

    for file_name, tensors, metadata in (
        ("dense.safetensors", {"model.embed_tokens.weight": dense}, {"fastembed.tensor": "model.embed_tokens.weight"}),
        ("fp8.safetensors", {"weight": fp8.data, "weight.scales": fp8.scales},
         {"fastembed.tensor": "weight", "fastembed.format": "fp8_e4m3", "fastembed.dim": str(DIM)}),
    ):
        safetensors_numpy.save_file(tensors, str(tmp_path / "reference"), metadata=metadata)
        assert layout(tmp_path / file_name) == layout(tmp_path / "reference"), file_name
    assert io.map_safetensors(tmp_path / "fp8.safetensors").scales.flags.aligned


@pytest.mark.parametrize("suffix", [".gguf", ".safetensors"])
def test_a_name_that_is_not_unicode_text_is_refused_and_nothing_is_written(tmp_path, suffix):
    with pytest.raises(ValueError, match="is not valid Unicode text"):
        io.save_table(tmp_path / f"t{suffix}", rows(), name="w\udc80")
    assert os.listdir(tmp_path) == []
    io.save_table(tmp_path / f"t{suffix}", rows())
    for opening in (io.map_gguf if suffix == ".gguf" else io.map_safetensors, fastembed.Embedding.from_pretrained):
        with pytest.raises(ValueError, match=r"tensor name 'w\\udc80' is not valid Unicode text"):
            opening(tmp_path / f"t{suffix}", "w\udc80")


@pytest.mark.parametrize("suffix", [".gguf", ".safetensors"])
def test_big_endian_and_column_major_tables_are_converted_chunk_by_chunk(tmp_path, suffix):
    import tracemalloc

    from fastembed.io import save

    values = np.random.default_rng(4).standard_normal((4096, 1024)).astype(np.float32)  # 16 MiB
    for kind, table in (("big", values.astype(">f4")), ("fortran", np.asfortranarray(values))):
        tracemalloc.start()
        try:
            io.save_table(tmp_path / f"{kind}{suffix}", table)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert table.nbytes > 2 * save._CHUNK_BYTES and peak < 1.5 * save._CHUNK_BYTES, (kind, peak)  # a chunk at a time
        same_bytes(io.open_table(tmp_path / f"{kind}{suffix}"), values)


def write_tagged(path, tensors: dict, metadata: dict) -> None:
    safetensors_numpy.save_file(tensors, str(path), metadata=metadata)


FP8 = quantized("fp8_e4m3")
TAG = {"fastembed.tensor": "w", "fastembed.format": "fp8_e4m3", "fastembed.dim": str(DIM)}


@pytest.mark.parametrize(
    "tensors, metadata, words",
    [
        ({"w": FP8.data}, TAG, "keeps its row scales as F32 \\[40\\] in 'w.scales', found missing"),
        ({"w": FP8.data, "w.scales": FP8.scales.astype(np.float16)}, TAG, "found F16 \\[40\\]"),
        ({"w": FP8.data, "w.scales": FP8.scales[:5]}, TAG, "found F32 \\[5\\]"),
        ({"w": FP8.data, "w.scales": FP8.scales}, {**TAG, "fastembed.format": "q9"}, "unknown quantized format 'q9'"),
        ({"w": FP8.data, "w.scales": FP8.scales}, {**TAG, "fastembed.dim": "sixty"}, "do not describe a quantized table"),
        ({"w": FP8.data, "w.scales": FP8.scales}, {**TAG, "fastembed.dim": "65"}, "not U8 \\[40, 64\\]"),
        ({"w": FP8.data, "w.scales": FP8.scales}, {**TAG, "fastembed.dim": "6_4"}, "in decimal digits, not '6_4'"),
        ({"w": FP8.data, "w.scales": FP8.scales}, {**TAG, "fastembed.dim": " +64"}, "in decimal digits"),
        ({"w": FP8.data, "w.scales": FP8.scales}, {**TAG, "fastembed.dim": "\u0666\u0664"}, "in decimal digits"),
        ({"w": FP8.data.view(np.int8), "w.scales": FP8.scales}, TAG, "stored as U8 rows of shape \\(vocab_size, 64\\), not I8"),
        ({"w": FP8.data}, {**TAG, "fastembed.format": "q8_0", "fastembed.dim": "32"}, "a q8_0 table of dim 32"),
        ({"w": FP8.data}, {"fastembed.tensor": "v"}, "names tensor 'v', which the header does not hold"),
    ],
)
def test_fastembed_metadata_that_does_not_fit_is_a_value_error(tmp_path, tensors, metadata, words):
    path = tmp_path / "tagged.safetensors"
    write_tagged(path, tensors, metadata)
    with pytest.raises(ValueError, match=words) as caught:
        io.open_table(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_a_huge_metadata_value_is_not_echoed_whole(tmp_path):
    path = tmp_path / "tagged.safetensors"
    write_tagged(path, {"w": FP8.data, "w.scales": FP8.scales}, {**TAG, "fastembed.dim": "9" * 4000})
    with pytest.raises(ValueError, match="do not describe a quantized table") as caught:
        io.open_table(path)
    assert len(str(caught.value)) < len(str(path)) + 600


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(metadata=st.dictionaries(st.sampled_from(["fastembed.tensor", "fastembed.format", "fastembed.dim", "fastembed.x", "other"]),
                                st.one_of(st.sampled_from(["w", "w.scales", "fp8_e4m3", "q8_0", "q6_k", "64", "2", "0", "-64"]),
                                          st.text(max_size=6)), max_size=4))
def test_fuzzed_fastembed_metadata_only_gives_value_errors(tmp_path, metadata):
    path = tmp_path / "fuzz.safetensors"
    write_tagged(path, {"w": FP8.data, "w.scales": FP8.scales, "model.embed_tokens.weight": rows("float16")}, metadata)
    try:
        table = io.open_table(path)
    except ValueError:
        return
    data = table.data if isinstance(table, QuantizedTable) else table
    assert data.ndim == 2 and data.offset + data.nbytes <= os.path.getsize(path)


@pytest.mark.parametrize("regex", [True, False])
def test_metadata_among_many_strings_is_found_exactly(tmp_path, monkeypatch, regex):
    """Only the fastembed keys are kept, whatever else the metadata holds (and a lookalike inside a string is no key)."""
    if not regex:  # Python 3.10 checks the metadata string by string
        monkeypatch.setattr(io.safetensors, "_STRING_OBJECT", None)
    path = tmp_path / "meta.safetensors"
    noise = {f"k{i}": "fastembed.tensor" for i in range(500)}
    write_tagged(path, {"w": FP8.data, "w.scales": FP8.scales}, {**noise, 'x"fastembed.format': "q8_0", **TAG})
    header = io.scan_safetensors_header(path)
    assert dict(header.metadata) == TAG
    assert isinstance(io.map_safetensors(path), QuantizedTable)


def test_metadata_keys_spelled_with_escapes_are_found(tmp_path):
    """JSON may spell a key with \\u escapes; the header means the same key."""
    data = FP8.data.tobytes() + FP8.scales.tobytes()
    header = ('{"__metadata__":{"\\u0066astembed.tensor":"w","fastembed\\u002eformat":"fp8_e4m3","fastembed.dim":"64"},'
              f'"w":{{"dtype":"U8","shape":[{VOCAB},{DIM}],"data_offsets":[0,{FP8.data.nbytes}]}},'
              f'"w.scales":{{"dtype":"F32","shape":[{VOCAB}],"data_offsets":[{FP8.data.nbytes},{len(data)}]}}}}').encode()
    path = tmp_path / "escaped.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    table = io.map_safetensors(path)
    assert isinstance(table, QuantizedTable) and table.format.name == "fp8_e4m3"
    same_bytes(table.scales, FP8.scales)


def test_a_long_fastembed_metadata_value_is_refused(tmp_path):
    path = tmp_path / "long.safetensors"
    write_tagged(path, {"w": FP8.data}, {"fastembed.tensor": "w" * 5000})
    with pytest.raises(ValueError, match="fastembed.tensor is 5000 characters long"):
        io.map_safetensors(path)


@pytest.mark.parametrize("ggml_type", [8, None])
@pytest.mark.parametrize("suffix", [".gguf", ".safetensors"])
def test_a_format_of_the_callers_own_is_refused_before_anything_is_written(tmp_path, suffix, ggml_type):
    """The loaders know fastembed's formats only: a format of the caller's own (one claiming q8_0's type code
    too) would reload as another, or not at all."""
    from fastembed.formats import BlockFormat, QuantizedTable

    mine = BlockFormat("mine", 32, 40, ggml_type, lambda blocks: blocks[:, :32].astype(np.float32))
    table = QuantizedTable(np.arange(800, dtype=np.uint8).reshape(10, 80) % 200, mine, 64)
    target = tmp_path / f"t{suffix}"
    target.write_bytes(b"kept")
    with pytest.raises(ValueError, match="hold fastembed's block formats .*, not the caller's format 'mine'"):
        fastembed.Embedding(table).save(target)
    assert target.read_bytes() == b"kept" and [p.name for p in tmp_path.iterdir()] == [target.name]


def test_a_copy_of_a_builtin_format_is_still_written_to_gguf(tmp_path):
    """A table that crossed a process boundary (pickled) or was deep-copied keeps fastembed's own layout."""
    import copy
    import pickle

    table = fastembed.Embedding.random(40, 64, "float32").quantize("q8_0").table
    for twin in (pickle.loads(pickle.dumps(table)), copy.deepcopy(table)):
        assert twin.format is not FORMATS["q8_0"]
        fastembed.Embedding(twin).save(tmp_path / "t.gguf")
        back = fastembed.Embedding.from_gguf(tmp_path / "t.gguf")
        assert back.format == "q8_0" and np.array_equal(np.asarray(back.table.data), table.data)


def test_save_takes_bytes_paths_as_the_loaders_do(tmp_path):
    table = np.arange(32, dtype=np.float16).reshape(4, 8)
    path = os.fsencode(tmp_path / "table.gguf")
    fastembed.Embedding(table).save(path)
    assert np.array_equal(fastembed.Embedding.from_pretrained(path)(np.arange(4)), table)


def test_a_path_that_is_no_path_or_holds_a_nul_is_named_and_nothing_is_written(tmp_path):
    with pytest.raises(TypeError, match=r"save_table: the path must be a str, bytes or os.PathLike, got builtins.int"):
        fastembed.Embedding(rows()).save(3)  # an int would be a file descriptor
    with pytest.raises(ValueError, match=r"the path '.*a\\x00.gguf' holds a NUL character"):
        io.save_table(str(tmp_path / "a\0.gguf"), rows())
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("file_name", [".gguf", ".SAFETENSORS"])
def test_a_file_named_by_its_suffix_alone_is_written_in_that_format(tmp_path, file_name):
    io.save_table(tmp_path / file_name, rows())
    assert os.listdir(tmp_path) == [file_name]
    assert np.array_equal(fastembed.Embedding.from_pretrained(tmp_path / file_name)(np.arange(4)), rows()[:4])


def test_a_link_to_a_directory_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "folder.gguf").mkdir()
    link = tmp_path / "model.gguf"
    link.symlink_to(tmp_path / "folder.gguf")
    for destination in (link, tmp_path / "folder.gguf"):
        with pytest.raises(IsADirectoryError) as caught:
            io.save_table(destination, rows())
        assert caught.value.filename == str(destination)
    assert link.is_symlink() and (tmp_path / "folder.gguf").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["folder.gguf", "model.gguf"] and not os.listdir(tmp_path / "folder.gguf")


def test_a_directory_without_a_suffix_is_refused_as_a_directory(tmp_path):
    (tmp_path / "folder").mkdir()
    for destination in (str(tmp_path / "folder"), str(tmp_path / "folder") + os.sep, str(tmp_path / "new") + os.sep):
        with pytest.raises(IsADirectoryError):
            io.save_table(destination, rows())
    assert sorted(os.listdir(tmp_path)) == ["folder"] and not os.listdir(tmp_path / "folder")


def test_a_link_to_a_device_is_replaced_by_a_file_with_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    link = tmp_path / "t.gguf"
    link.symlink_to("/dev/null")
    io.save_table(link, rows())
    assert not link.is_symlink() and os.stat(link).st_mode & 0o777 == 0o666 & ~umask
    same_bytes(io.map_gguf(link), rows())


@pytest.mark.parametrize("stem", ["a" * 245, "\u00e9" * 122, "\u20ac" * 80])
def test_a_name_near_the_systems_limit_is_written(tmp_path, stem):
    path = tmp_path / (stem + ".gguf")  # 250, 249 and 245 bytes (the limit is 255); a 3-byte character at the cut
    io.save_table(path, rows())
    same_bytes(io.map_gguf(path), rows())
    assert os.listdir(tmp_path) == [path.name]


def test_a_name_over_the_systems_limit_is_refused_before_the_table_is_written(tmp_path, monkeypatch):
    path = tmp_path / ("a" * 300 + ".gguf")
    written = []
    monkeypatch.setattr(io.save, "_write_rows", lambda handle, rows: written.append(rows))
    with pytest.raises(OSError, match="too long") as caught:
        io.save_table(path, rows())
    assert caught.value.filename == str(path) and not written and os.listdir(tmp_path) == []


def test_the_new_file_is_on_disk_before_it_replaces_the_old_one_and_the_rename_after(tmp_path, monkeypatch):
    """After a crash the path holds the old table or the new one, whole: never a renamed but unwritten file."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda handle: (events.append(("fsync", os.readlink(f"/proc/self/fd/{handle}"))),
                                                     real_fsync(handle))[1])
    monkeypatch.setattr(os, "replace", lambda source, target: (events.append(("replace", str(target))),
                                                               real_replace(source, target))[1])
    for name in ("t.gguf", "t.safetensors"):
        events.clear()
        io.save_table(tmp_path / name, rows())
        (_, flushed), (_, replaced), (_, folder) = events
        assert flushed.startswith(str(tmp_path / f".{name}.")) and flushed.endswith(".tmp")
        assert replaced == str(tmp_path / name) and folder == str(tmp_path)


def test_a_folder_that_cannot_be_synced_does_not_fail_a_save_already_in_place(tmp_path, monkeypatch):
    """Its sync only makes the rename durable sooner: the new table is at the path by then."""
    real_open = os.open

    def folder_refused(path, flags, *args):
        if flags & getattr(os, "O_DIRECTORY", 0):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", folder_refused)
    io.save_table(tmp_path / "t.safetensors", rows(seed=3))
    monkeypatch.undo()
    same_bytes(io.open_table(tmp_path / "t.safetensors"), rows(seed=3))


def test_a_folder_is_found_as_the_system_finds_it_a_link_then_dot_dot(tmp_path, monkeypatch):
    """``link/../t.gguf`` is the link target's parent's file, not the file beside the link: the new file is
    written and flushed in the folder the rename lands in (on another file system, a rename from the folder
    beside the link would fail)."""
    beside_link, target_side = tmp_path / "here", tmp_path / "there"
    (target_side / "inner").mkdir(parents=True)
    beside_link.mkdir()
    (beside_link / "link").symlink_to(target_side / "inner")
    flushed, flush = [], io.save._flush_to_disk
    monkeypatch.setattr(io.save, "_flush_to_disk", lambda path, folder=False: flushed.append(path) or flush(path, folder))
    table = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float16)
    io.save_table(str(beside_link / "link" / ".." / "t.gguf"), table)
    assert os.path.samefile(os.path.dirname(flushed[0]), target_side) and os.path.samefile(flushed[1], target_side)
    assert sorted(p.name for p in target_side.iterdir()) == ["inner", "t.gguf"]
    assert sorted(p.name for p in beside_link.iterdir()) == ["link"]
    same_bytes(io.map_gguf(target_side / "t.gguf"), table)


@pytest.mark.parametrize("spelling", ["missing/../t.gguf", "file.gguf/", "file.gguf/t.gguf", "new.gguf/"])
def test_a_path_the_system_cannot_resolve_is_refused_before_the_table_is_written(tmp_path, monkeypatch, spelling):
    (tmp_path / "file.gguf").write_bytes(b"kept")
    monkeypatch.chdir(tmp_path)
    written = []
    monkeypatch.setattr(io.save, "_write_rows", lambda handle, rows: written.append(rows))
    with pytest.raises(OSError) as raised:
        io.save_table(spelling, np.ones((4, 8), np.float16))
    assert spelling in str(raised.value) and not written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.gguf"] and (tmp_path / "file.gguf").read_bytes() == b"kept"


def test_a_looping_link_at_the_destination_is_replaced_like_any_link(tmp_path):
    (tmp_path / "t.gguf").symlink_to(tmp_path / "t.gguf")
    io.save_table(tmp_path / "t.gguf", np.ones((4, 8), np.float16))
    assert not (tmp_path / "t.gguf").is_symlink() and io.map_gguf(tmp_path / "t.gguf").shape == (4, 8)


def test_a_relative_path_is_written_in_a_folder_deeper_than_the_systems_path_limit(tmp_path, monkeypatch):
    """Where open() takes a relative name, so does save: the folder's absolute path may be longer than a path
    the system takes."""
    monkeypatch.chdir(tmp_path)
    limit, depth = os.pathconf(tmp_path, "PC_PATH_MAX"), len(os.fsencode(str(tmp_path)))
    while depth <= limit:
        os.mkdir("d" * 200)
        os.chdir("d" * 200)
        depth += 201
    table = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float16)
    io.save_table("t.gguf", table)
    same_bytes(io.map_gguf("t.gguf"), table)
    assert sorted(os.listdir(os.curdir)) == ["t.gguf"]


def test_a_relative_path_is_saved_where_it_named_when_the_save_began_whatever_chdir_does_meanwhile(tmp_path,
                                                                                                 monkeypatch):
    """Another thread's os.chdir between the writing and the rename moves neither the file nor its cleanup."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    flush = io.save._flush_to_disk

    def flush_then_chdir(path, folder=False):
        flush(path, folder)
        if not folder:
            os.chdir(tmp_path / "b")

    monkeypatch.setattr(io.save, "_flush_to_disk", flush_then_chdir)
    table = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float16)
    io.save_table("t.gguf", table)
    assert sorted(os.listdir(tmp_path / "a")) == ["t.gguf"] and os.listdir(tmp_path / "b") == []
    same_bytes(io.map_gguf(tmp_path / "a" / "t.gguf"), table)
