"""Embedding's loaders: from_pretrained over every source, and the check of a mapped file."""
from __future__ import annotations

import json

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


def test_from_pretrained_takes_an_array_as_it_is():
    table = random_table(20, 4)
    emb = fastembed.Embedding.from_pretrained(table)
    assert emb.table is table
    with pytest.raises(ValueError, match="not memory-mapped from a file"):
        emb.check_file()


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
