"""Opening a file that changes meanwhile, lies twice, loops, or is damaged in ways the format readers refuse oddly."""
from __future__ import annotations

import io as bytes_io
import json
import os
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import fastembed
from fastembed import distributed, io
from fastembed.formats import QuantizedTable
from fastembed.io import _files, checkpoints
from helpers import past_a_file_time_tick, random_quantized, random_table

safetensors_numpy = pytest.importorskip("safetensors.numpy")
pytest.importorskip("gguf")

TABLE = random_table(100, 64, "float16")
OTHER = random_table(100, 64, "float32", seed=1)  # same tensor name, other dtype and offsets


def _save(path, table) -> None:
    io.save_table(path, table)


@pytest.mark.parametrize("suffix", [".safetensors", ".gguf", ".npy"])
def test_a_file_renamed_over_the_path_between_the_header_and_the_map_is_refused(tmp_path, monkeypatch, suffix):
    """The map used to take the new file's bytes under the old header's dtype and offsets: a table of neither file."""
    path, newer = tmp_path / f"model{suffix}", tmp_path / f"incoming{suffix}"
    save = np.save if suffix == ".npy" else _save
    save(path, TABLE)
    save(newer, OTHER)
    real_open = _files._open_for_reading
    opened = []

    def racing_open(name):
        opened.append(sys._getframe(1).f_code.co_name)
        if opened[-1] == "map_file":  # the map's opening, after the header's
            os.replace(newer, path)  # the download lands between the header's read and the map
        return real_open(name)

    monkeypatch.setattr(_files, "_open_for_reading", racing_open)
    with pytest.raises(ValueError, match="changed while it was being opened"):
        fastembed.Embedding.from_pretrained(path)
    assert opened[-1] == "map_file"  # the race landed where the map opens the file
    monkeypatch.undo()
    assert fastembed.Embedding.from_pretrained(path).table.dtype == np.float32  # the new file, opened again


@pytest.mark.parametrize("suffix", [".safetensors", ".gguf", ".npy"])
def test_a_rewrite_in_place_between_the_header_and_the_map_that_puts_the_modification_time_back_is_refused(
        tmp_path, monkeypatch, suffix):
    """The map compared the file with its header's by size and modification time: it took the rewritten bytes
    under the header read before (rows of the new header's text, say)."""
    path = tmp_path / f"model{suffix}"
    (np.save if suffix == ".npy" else _save)(path, TABLE)
    size = os.path.getsize(path)
    real_open = _files._open_for_reading
    opened = []

    def racing_open(name):
        opened.append(sys._getframe(1).f_code.co_name)
        if opened[-1] == "map_file":  # the map's opening, after the header's: another program rewrites the file
            before = os.stat(path)
            past_a_file_time_tick(tmp_path, before.st_ctime_ns)
            with open(path, "r+b") as handle:
                handle.write(bytes(reversed(path.read_bytes())))
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as rsync --inplace -t leaves it
            assert os.path.getsize(path) == size
        return real_open(name)

    monkeypatch.setattr(_files, "_open_for_reading", racing_open)
    with pytest.raises(ValueError, match="changed while it was being opened"):
        fastembed.Embedding.from_pretrained(path)
    assert opened[-1] == "map_file"  # the race landed where the map opens the file


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_put_at_the_path_after_its_check_is_refused_without_waiting_for_a_writer(tmp_path):
    """open_table read a file's first bytes (and a checkpoint's JSON) by its path, opened to wait for a writer."""
    np.save(tmp_path / "table.npy", TABLE)
    _checkpoint(tmp_path / "checkpoint", '{"vocab_size": 100, "hidden_size": 64}')
    script = f"""
import os
from fastembed.io import _files, checkpoints, open_table
real_check = _files.check_file
def check_then_fifo(path, opener):  # another program puts a FIFO at the path once it is checked
    size = real_check(path, opener)
    os.unlink(path)
    os.mkfifo(path)
    return size
checkpoints.check_file = check_then_fifo
for source in ({str(tmp_path / "table.npy")!r}, {str(tmp_path / "checkpoint")!r}):
    try:
        open_table(source)
    except ValueError as error:
        print("refused:", error)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.count("refused:") == 2, result.stdout + result.stderr[-2000:]


def test_a_file_replaced_between_the_check_and_the_open_is_refused(tmp_path, monkeypatch):
    path, newer = tmp_path / "model.safetensors", tmp_path / "incoming.safetensors"
    _save(path, TABLE)
    _save(newer, OTHER)
    real_status = _files._status

    def status_then_replace(*args):
        status = real_status(*args)
        if newer.exists():
            os.replace(newer, path)
        return status

    monkeypatch.setattr(_files, "_status", status_then_replace)
    with pytest.raises(ValueError, match="changed while it was being opened"):
        fastembed.Embedding.from_safetensors(path)


def test_a_rank_maps_its_rows_from_the_file_the_header_was_read_from(tmp_path):
    path = tmp_path / "model.safetensors"
    _save(path, TABLE)
    whole = io.open_table(path)
    assert np.array_equal(distributed.shards._map_rows(whole, 10, 20), TABLE[10:20])
    _save(tmp_path / "incoming.safetensors", OTHER)
    os.replace(tmp_path / "incoming.safetensors", path)
    with pytest.raises(ValueError, match="changed while it was being opened"):
        distributed.shards._map_rows(whole, 10, 20)


def test_a_quantized_tables_rows_and_scales_come_from_one_file(tmp_path):
    path = tmp_path / "model.safetensors"
    fastembed.Embedding(random_quantized("fp8_e4m3", 50, 64)).save(path)
    table = io.open_table(path)
    assert isinstance(table, QuantizedTable)
    assert _files.mapped_identity(table.data) == _files.mapped_identity(table.scales) is not None
    assert _files.mapped_identity(np.zeros(3)) is None and _files.mapped_identity(table.data[5:]) is not None


@pytest.mark.parametrize("opener", ["from_pretrained directory", "open_table directory", "from_safetensors", "open_table"])
def test_a_loop_of_symbolic_links_is_a_value_error_naming_it(tmp_path, opener):
    """os.stat's ELOOP came out raw; open_table said of a file that loops that it did not exist."""
    (tmp_path / "model.safetensors").symlink_to("model.safetensors")
    (tmp_path / "t.safetensors").symlink_to("t.safetensors")
    call, target = {
        "from_pretrained directory": (fastembed.Embedding.from_pretrained, tmp_path),
        "open_table directory": (io.open_table, tmp_path),
        "from_safetensors": (fastembed.Embedding.from_safetensors, tmp_path / "t.safetensors"),
        "open_table": (io.open_table, tmp_path / "t.safetensors"),
    }[opener]
    with pytest.raises(ValueError, match="a loop of symbolic links") as raised:
        call(target)
    assert "from_safetensors" not in str(raised.value)  # a call the caller may not have made


def test_a_safetensors_file_named_gguf_opens_by_its_content(tmp_path):
    table = random_table(6, 4, "float16")
    path = tmp_path / "table.gguf"
    io.save_table(tmp_path / "t.safetensors", table)
    os.replace(tmp_path / "t.safetensors", path)
    assert np.array_equal(io.open_table(path), table)
    assert np.array_equal(fastembed.Embedding.from_pretrained(path)([5]), table[[5]])
    with pytest.raises(ValueError, match="not a GGUF file: it is a safetensors file"):
        fastembed.Embedding.from_gguf(path)
    damaged = tmp_path / "damaged.gguf"  # bytes of neither format: the name decides, and GGUF's message says why
    damaged.write_bytes(b"GGUX" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        io.open_table(damaged)


def test_an_index_naming_itself_as_a_shard_says_so(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": index.name}}))
    with pytest.raises(ValueError, match="in model.safetensors.index.json, which is the index itself"):
        fastembed.Embedding.from_pretrained(tmp_path)


@pytest.mark.parametrize("opener", [fastembed.Embedding.from_pretrained, fastembed.Embedding.from_safetensors,
                                    fastembed.Embedding.from_npy, fastembed.Embedding.from_gguf, io.open_table])
def test_a_path_the_system_cannot_take_is_its_oserror_not_a_missing_file(tmp_path, opener):
    with pytest.raises(OSError, match="too long") as raised:
        opener(tmp_path / ("a" * 300))
    assert not isinstance(raised.value, FileNotFoundError)


@pytest.mark.parametrize("suffix", [".safetensors", ".npy", ".gguf", ".pt", ".bin"])
def test_a_zip_archive_of_a_version_zipfile_lacks_is_described_without_its_error(tmp_path, suffix):
    """A central directory asking for a newer version to extract (zipfile raises NotImplementedError for it): the
    archive is named by its first member's local header all the same."""
    buffer = bytes_io.BytesIO()
    np.savez(buffer, a=np.ones(3))
    blob = bytearray(buffer.getvalue())
    blob[blob.find(b"PK\x01\x02") + 6] = 0xFF
    path = tmp_path / f"t{suffix}"
    path.write_bytes(bytes(blob))
    for call in (fastembed.Embedding.from_pretrained, io.open_table):
        with pytest.raises(ValueError, match=r"\.npz archive \(np\.savez\) whose first array is 'a\.npy'"):
            call(path)


def _with_metadata_twice(path, key: str, first: str, second: str) -> None:
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = raw[8 : 8 + length].rstrip(b" ")
    entry = f'"{key}":"{first}"'.encode()
    assert entry in header
    header = header.replace(entry, entry + f',"{key}":"{second}"'.encode())
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length :])


def test_fastembeds_own_metadata_given_twice_is_refused(tmp_path):
    """q4_0 and q4_k rows have one size: the second "fastembed.format" would have decoded the rows as the other."""
    path = tmp_path / "t.safetensors"
    fastembed.Embedding(random_quantized("q4_0", 3, 256)).save(path)
    _with_metadata_twice(path, "fastembed.format", "q4_0", "q4_k")
    with pytest.raises(ValueError, match="__metadata__ gives fastembed.format more than once"):
        fastembed.Embedding.from_pretrained(path)


def _checkpoint(folder, config: str | None = None) -> None:
    folder.mkdir(exist_ok=True)
    safetensors_numpy.save_file({"model.embed_tokens.weight": TABLE}, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(config)


def test_a_config_giving_a_shape_key_twice_is_refused_and_another_key_twice_is_not(tmp_path):
    _checkpoint(tmp_path / "a", '{"vocab_size": 100, "hidden_size": 64, "hidden_size": 64}')
    with pytest.raises(ValueError, match="config.json gives 'hidden_size' more than once"):
        io.open_table(tmp_path / "a")
    _checkpoint(tmp_path / "b", '{"vocab_size": 100, "hidden_size": 64, "architectures": [], "architectures": []}')
    assert io.open_table(tmp_path / "b").shape == (100, 64)


def test_an_index_naming_a_tensor_twice_is_refused(tmp_path):
    _checkpoint(tmp_path)
    name = "model.embed_tokens.weight"
    (tmp_path / "model.safetensors.index.json").write_text(
        f'{{"weight_map": {{"{name}": "model.safetensors", "{name}": "other.safetensors"}}}}')
    with pytest.raises(ValueError, match="weight_map gives .*model.embed_tokens.weight.* more than once"):
        io.open_table(tmp_path)


def test_a_config_json_is_read_only_up_to_a_few_mib(tmp_path):
    """Parsing JSON can take some 30 times its length in memory (a list of empty lists): 4 MiB is plenty."""
    _checkpoint(tmp_path, json.dumps({"vocab_size": 100, "hidden_size": 64, "pad": "x" * (5 * 2**20)}))
    with pytest.raises(ValueError, match="config.json is .* bytes, over the 4194304-byte limit"):
        io.open_table(tmp_path)


@pytest.mark.parametrize("pad", [5 * 2**20, 100])
def test_a_config_json_that_grows_after_its_check_is_read_no_further(tmp_path, monkeypatch, pad):
    """The file was read whole after its size was checked: one that grew meanwhile was read to its new end."""
    _checkpoint(tmp_path, json.dumps({"vocab_size": 100, "hidden_size": 64, "pad": "x" * pad}))
    monkeypatch.setattr(checkpoints, "check_file", lambda path, opener: 100)  # the size it had when checked
    with pytest.raises(ValueError, match=r"config.json grew while it was read \(it was 100 bytes when checked\)"):
        io.open_table(tmp_path)


def test_a_small_json_file_is_read_into_a_buffer_of_its_own_size(tmp_path):
    """A read of the limit's length allocated the whole limit (64 MiB for an index of a few hundred bytes)."""
    _checkpoint(tmp_path, '{"vocab_size": 100, "hidden_size": 64}')
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}')
    tracemalloc.start()
    try:
        io.open_table(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_a_watch_on_a_slice_covers_the_slice_where_it_lies_in_the_file(tmp_path):
    """A slice's offset is the whole map's: the watch used to need only its first bytes."""
    path = tmp_path / "t.npy"
    np.save(path, np.ones((1000, 64), np.float32))
    table = io.open_table(path)
    size = os.path.getsize(path)
    assert io.FileWatch.for_table(table[900:]).needed_bytes == size
    assert io.FileWatch.for_table(table[:10]).needed_bytes == size - 990 * 256
    assert io.FileWatch.for_table(table[::-1]).needed_bytes == size
    assert io.FileWatch.for_table(table[:, :3]).needed_bytes == size - 256 + 12
    view = table[900:]
    os.truncate(path, size - 4096)
    with pytest.raises(ValueError, match="shorter than"):
        io.FileWatch.for_table(view)


def test_the_scans_give_the_documented_tuples(tmp_path):
    """The file a header came from travels beside the tuples, not as a field: they unpack as before."""
    path = tmp_path / "model.gguf"
    fastembed.Embedding(random_quantized("q8_0", 10, 64)).save(path)
    name, dims, ggml_type, offset = io.scan_gguf(path)
    assert (name, dims) == ("token_embd.weight", (64, 10))
    _save(tmp_path / "t.safetensors", TABLE)
    entries, data_start, count, sample, metadata = io.scan_safetensors_header(tmp_path / "t.safetensors")
    assert count == 1 and len(io.scan_safetensors_header(tmp_path / "t.safetensors")) == 5


def test_a_fifo_put_at_the_path_before_the_map_is_refused_without_waiting_for_a_writer(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    _save(path, TABLE)
    real_open = _files._open_for_reading
    opened = []

    def racing_open(name):
        opened.append(sys._getframe(1).f_code.co_name)
        if opened[-1] == "map_file":
            os.unlink(path)
            os.mkfifo(path)  # opening it to read would wait for a writer for ever
        return real_open(name)

    monkeypatch.setattr(_files, "_open_for_reading", racing_open)
    with pytest.raises(ValueError, match="changed while it was being opened"):
        fastembed.Embedding.from_safetensors(path)
    assert opened[-1] == "map_file"  # the race landed where the map opens the file
