"""The wrong file given to a loader: missing, a directory, another format; short name lists."""
from __future__ import annotations

import json
import pickle
import struct
import zipfile

import numpy as np
import pytest

import fastembed
from fastembed import io

safetensors_numpy = pytest.importorskip("safetensors.numpy")

LOADERS = {
    "safetensors": fastembed.Embedding.from_safetensors,
    "npy": fastembed.Embedding.from_npy,
    "open_table": io.open_table,
}


@pytest.mark.parametrize("loader", LOADERS)
def test_a_missing_file_is_file_not_found_for_every_loader(tmp_path, loader):
    missing = tmp_path / "nowhere" / "model.safetensors"
    with pytest.raises(FileNotFoundError) as caught:
        LOADERS[loader](missing)
    assert str(missing) in str(caught.value)
    with pytest.raises(FileNotFoundError):
        LOADERS[loader](tmp_path / "table.npy")


@pytest.mark.parametrize("loader", ["safetensors", "npy"])
def test_a_directory_is_a_clear_value_error(tmp_path, loader):
    with pytest.raises(ValueError, match="is a directory.*opens one file.*open_table"):
        LOADERS[loader](tmp_path)


def _torch_zip(path) -> None:
    """The layout torch.save writes: a zip archive with archive/data.pkl and archive/data/0."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"weight": 1}, protocol=2))
        archive.writestr("archive/data/0", b"\0" * 64)
        archive.writestr("archive/version", b"3\n")


def _legacy_torch_pickle(path) -> None:
    """The legacy torch.save format: a pickle stream (protocol 2) starting with a magic number."""
    path.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps({"weight": 1}, protocol=2))


def _gguf(path) -> None:
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + b"\0" * 64)


def _index(path) -> None:
    path.write_text(json.dumps({"metadata": {"total_size": 16}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}, indent=2))


def _text(path) -> None:
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 133466304\n")


def _npz(path) -> None:
    np.savez(path, table=np.ones((2, 2), np.float32))


def _hdf5(path) -> None:
    """What h5py writes first: the HDF5 signature, then the superblock."""
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes([0, 0, 0, 0, 0, 8, 8, 0, 4, 0, 16, 0]) + b"\0" * 200)


def _flax_msgpack(path) -> None:
    """flax.serialization.to_bytes: a msgpack map of the parameters (no magic number)."""
    path.write_bytes(b"\x81\xa6params\x81\xa5embed\x81\xa9embedding\xc7\x20\x01" + bytes(range(1, 64)) * 4)


def _onnx(path) -> None:
    """An ONNX ModelProto: a protobuf starting with ir_version and producer_name (no magic number)."""
    path.write_bytes(b"\x08\x08\x12\x07pytorch\x1a\x052.1.0:\x95\x01\n\x1e" + bytes(range(1, 200)))


def _random(path) -> None:
    path.write_bytes(np.random.default_rng(0).integers(1, 256, 4096, dtype=np.uint8).tobytes())


def _control_bytes(path) -> None:
    path.write_bytes(b"\x1c\x1d\x1e\x1f" * 16)  # valid UTF-8, but separators no text file holds


def _high_bytes(path) -> None:
    path.write_bytes(b"\xff" * 64)  # no UTF-8 text: every byte is at least 0x80


def _text_in_many_scripts(path) -> None:
    path.write_text("\ufeffversion \u00e9t\u00e9 \u65e5\u672c\u8a9e \u0440\u0443\u0441 " * 8, encoding="utf-8")  # cut mid-character at 64 bytes


def _junk_bin(path) -> None:
    path.write_bytes(b"\x01\x02\x03\x04" * 64)


OTHER_FORMATS = [
    (_hdf5, "tf_model.h5", r"HDF5 file.*from_safetensors.*from_npy.*from_gguf.*h5py"),
    (_flax_msgpack, "flax_model.msgpack", r"Flax checkpoint.*from_safetensors.*safetensors\.numpy import save_file"),
    (_onnx, "model.onnx", r"ONNX model.*from_safetensors.*onnx\.load"),
    (_junk_bin, "pytorch_model.bin", r"named like a PyTorch checkpoint \(\.bin\).*neither a torch\.save zip archive nor a pickle"),
]
#: ... and PyTorch checkpoints, text and .npz archives: what every loader names the same way.
NOT_TENSOR_FILES = [
    *OTHER_FORMATS,
    (_torch_zip, "pytorch_model.bin", r"PyTorch checkpoint.*never unpickles.*safetensors\.torch import save_file"),
    (_legacy_torch_pickle, "model.pt", r"pickle.*PyTorch.*safetensors\.torch import save_file"),
    (_text, "model.safetensors", "text file"),
    (_npz, "table.npz", r"\.npz archive.*'table\.npy'"),
]


@pytest.mark.parametrize(
    "writer, file_name, words",
    [
        *NOT_TENSOR_FILES,
        (_gguf, "model.gguf", "GGUF file"),
        (_index, "model.safetensors.index.json", "sharded checkpoint's index.*open_table"),
    ],
)
@pytest.mark.parametrize("loader", ["safetensors", "npy"])
def test_other_formats_are_named(tmp_path, writer, file_name, words, loader):
    path = tmp_path / file_name
    writer(path)
    with pytest.raises(ValueError, match=words) as caught:
        LOADERS[loader](path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize(
    "writer, file_name, words",
    [
        *NOT_TENSOR_FILES,
        (_text, "notes.txt", "text file"),
        (_random, "model.safetensors", r"not a safetensors file: its first 8 bytes \(([0-9a-f]{2} ){7}[0-9a-f]{2}\) "
                                      r"are not a header length.*beyond the file's 4096 bytes.*from_npy"),
        (_random, "weights.dat", r"its first 8 bytes .* are not a header length"),
        (_high_bytes, "model.safetensors", r"its first 8 bytes \(ff ff ff ff ff ff ff ff\) are not a header length"),
        (_control_bytes, "model.safetensors", r"its first 8 bytes \((1c 1d 1e 1f ?){2}\) are not a header length"),
        (_text_in_many_scripts, "notes.txt", "text file"),
    ],
)
@pytest.mark.parametrize("opener", ["open_table", "from_pretrained", "from_safetensors"])
def test_other_formats_given_as_a_checkpoint_say_what_they_are(tmp_path, writer, file_name, words, opener):
    """Once "header length 727905341903489161 goes beyond the file" for an .h5, a .msgpack, an .onnx or random bytes."""
    path = tmp_path / file_name
    writer(path)
    call = {"open_table": io.open_table, "from_pretrained": fastembed.Embedding.from_pretrained,
            "from_safetensors": fastembed.Embedding.from_safetensors}[opener]
    with pytest.raises(ValueError, match=words) as caught:
        call(path)
    message = str(caught.value)
    assert str(path) in message and "goes beyond the file" not in message and len(message) < 1200


def test_a_npy_file_given_to_the_safetensors_loader_names_from_npy(tmp_path):
    np.save(tmp_path / "table.npy", np.ones((4, 4), np.float16))
    with pytest.raises(ValueError, match=r"is a \.npy file; open it with fastembed\.Embedding\.from_npy"):
        fastembed.Embedding.from_safetensors(tmp_path / "table.npy")


def test_a_safetensors_file_given_to_the_npy_loader_names_from_safetensors(tmp_path):
    safetensors_numpy.save_file({"wte.weight": np.ones((4, 4), np.float16)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=r"is a safetensors file; open it with fastembed\.Embedding\.from_safetensors"):
        fastembed.Embedding.from_npy(tmp_path / "m.safetensors")


def test_a_wrong_name_lists_a_readable_number_of_tensors(tmp_path):
    tensors = {f"model.layers.{i}.mlp.down_proj.weight": np.ones((2, 2), np.float16) for i in range(200)}
    tensors["model.embed_tokens.weight"] = np.ones((8, 2), np.float16)
    path = tmp_path / "many.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    with pytest.raises(ValueError) as caught:
        fastembed.Embedding.from_safetensors(path, name="model.embed_token.weight")
    message = str(caught.value)
    assert "no tensor named 'model.embed_token.weight'" in message
    assert "'model.embed_tokens.weight'" in message  # the near miss is shown first
    assert "... and 189 more" in message
    assert len(message) < 1200


def test_no_candidate_lists_a_readable_number_of_2d_tensors(tmp_path):
    tensors = {f"layer{i}.weight": np.ones((2, 2), np.float16) for i in range(300)}
    path = tmp_path / "plain.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"no tensor is named like a token embedding.*\.\.\. and 288 more") as caught:
        fastembed.Embedding.from_safetensors(path)
    assert len(str(caught.value)) < 1000


def test_shorten():
    assert io._files.shorten([]) == "(none)"
    assert io._files.shorten(["a", "b"]) == "'a', 'b'"
    assert io._files.shorten(map(str, range(200)), limit=2) == "'0', '1' ... and 198 more"
    assert io._files.shorten(["x", "y"], total=50, limit=2) == "'x', 'y' ... and 48 more"
