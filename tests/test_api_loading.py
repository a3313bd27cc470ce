"""Embedding's loaders: from_pretrained over every source, and the check of a mapped file."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import fastembed
from fastembed.io import FileChangedError
from helpers import assert_bit_equal, random_table

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def test_from_pretrained_opens_a_sharded_checkpoint_directory_zero_copy(tmp_path):
    table = random_table(300, 16)
    safetensors_numpy.save_file({"model.embed_tokens.weight": table}, str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors_numpy.save_file({"lm_head.weight": random_table(300, 16, seed=1)},
                                str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": 2 * table.nbytes},
             "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    emb = fastembed.Embedding.from_pretrained(tmp_path)
    assert isinstance(emb.table, np.memmap) and not emb.table.flags.writeable
    ids = np.array([[0, 299], [7, 7]])
    assert_bit_equal(emb(ids), table[ids])
    emb.check_file()  # unchanged: no error


def test_from_pretrained_opens_a_single_safetensors_file_by_name(tmp_path):
    table = random_table(300, 16)
    path = tmp_path / "weights.safetensors"
    safetensors_numpy.save_file({"model.embed_tokens.weight": table, "lm_head.weight": random_table(300, 16, seed=1)}, str(path))
    emb = fastembed.Embedding.from_pretrained(path)
    assert isinstance(emb.table, np.memmap) and str(emb.table.filename) == str(path) and not emb.table.flags.writeable
    assert_bit_equal(emb([299, 0, 5]), table[[299, 0, 5]])
    assert_bit_equal(np.asarray(fastembed.Embedding.from_pretrained(str(path), name="lm_head.weight").table),
                     random_table(300, 16, seed=1))
    emb.check_file()


def test_from_pretrained_opens_an_index_file(tmp_path):
    table = random_table(300, 16)
    safetensors_numpy.save_file({"model.embed_tokens.weight": table}, str(tmp_path / "model-00001-of-00001.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}))
    emb = fastembed.Embedding.from_pretrained(index)
    assert str(emb.table.filename) == str(tmp_path / "model-00001-of-00001.safetensors")
    assert_bit_equal(emb([[1, 2]]), table[[[1, 2]]])


def test_from_pretrained_opens_a_npy_file(tmp_path):
    table = random_table(40, 8, "float32")
    np.save(tmp_path / "table.npy", table)
    emb = fastembed.Embedding.from_pretrained(tmp_path / "table.npy")
    assert isinstance(emb.table, np.memmap) and not emb.table.flags.writeable
    assert_bit_equal(emb([39, 3]), table[[39, 3]])
    with pytest.raises(ValueError, match="name= must be None"):
        fastembed.Embedding.from_pretrained(tmp_path / "table.npy", name="weight")


def test_from_pretrained_opens_a_gguf_file(tmp_path):
    table = random_table(40, 32, "float16")
    fastembed.Embedding(table).save(tmp_path / "table.gguf")
    emb = fastembed.Embedding.from_pretrained(tmp_path / "table.gguf")
    assert_bit_equal(emb([0, 39]), table[[0, 39]])


def test_from_pretrained_takes_a_torch_tensor_as_it_is():
    torch = pytest.importorskip("torch")
    weight = torch.arange(40.0).reshape(10, 4)
    emb = fastembed.Embedding.from_pretrained(weight)
    assert emb.table is weight
    rows = emb([9, 0])
    assert isinstance(rows, torch.Tensor) and torch.equal(rows, weight[[9, 0]])
    weight[9] = -1  # the layer reads the tensor's memory: a copy would not see this
    assert torch.equal(emb([9]), weight[[9]])


def test_from_pretrained_takes_an_array_as_it_is():
    table = random_table(20, 4)
    emb = fastembed.Embedding.from_pretrained(table)
    assert emb.table is table
    with pytest.raises(ValueError, match="this layer watches no file: only the layers Embedding.from_pretrained"):
        emb.check_file()
    with pytest.raises(ValueError, match="name='x' picks a tensor of a checkpoint, but the source is an array"):
        fastembed.Embedding.from_pretrained(table, name="x")


def test_check_file_notices_a_truncated_file(tmp_path):
    path = tmp_path / "table.npy"
    np.save(path, random_table(1000, 64))
    emb = fastembed.Embedding.from_npy(path)
    with open(path, "r+b") as handle:
        handle.truncate(4096)
    with pytest.raises(FileChangedError):
        emb.check_file()


def test_from_pretrained_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        fastembed.Embedding.from_pretrained(tmp_path / "nowhere")


class _PathLike:
    """An os.PathLike that is not a pathlib.Path (numpy's memmap calls .resolve() on those it knows)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __fspath__(self) -> str:
        return self._path


@pytest.mark.parametrize("suffix, opener", [(".npy", "from_npy"), (".safetensors", "from_safetensors"),
                                            (".gguf", "from_gguf"), (".npy", "from_pretrained")])
def test_every_loader_takes_any_os_pathlike(tmp_path, suffix, opener):
    table = random_table(12, 32, "float32")
    path = str(tmp_path / f"table{suffix}")
    if suffix == ".npy":
        np.save(path, table)
    else:
        fastembed.Embedding(table).save(path)
    assert_bit_equal(getattr(fastembed.Embedding, opener)(_PathLike(path))([3, 11]), table[[3, 11]])


@pytest.mark.parametrize("opener", ["from_npy", "from_safetensors", "from_gguf", "from_pretrained"])
def test_every_loader_names_a_path_holding_a_nul(tmp_path, opener):
    with pytest.raises(ValueError, match=r"the path '.*table\\x00.npy' holds a NUL character"):
        getattr(fastembed.Embedding, opener)(str(tmp_path / "table\0.npy"))


def test_from_pretrained_takes_a_bytes_path(tmp_path):
    table = random_table(12, 32, "float32")
    np.save(tmp_path / "table.npy", table)
    assert_bit_equal(fastembed.Embedding.from_pretrained(os.fsencode(tmp_path / "table.npy"))([3]), table[[3]])
    assert_bit_equal(fastembed.io.open_table(os.fsencode(tmp_path / "table.npy"))[[3]], table[[3]])


def test_scan_gguf_takes_none_for_the_token_table(tmp_path):
    from fastembed.io.gguf import scan_gguf

    fastembed.Embedding(random_table(12, 32, "float32")).save(tmp_path / "t.gguf")
    assert scan_gguf(tmp_path / "t.gguf", None).name == scan_gguf(tmp_path / "t.gguf").name == "token_embd.weight"
