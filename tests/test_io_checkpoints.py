"""open_table on Hugging Face checkpoints: each family's real tensor names (reduced shapes), single and sharded."""
from __future__ import annotations

import json

import numpy as np
import pytest

import fastembed
from fastembed import io
from helpers import assert_bit_equal, random_table

safetensors_numpy = pytest.importorskip("safetensors.numpy")

VOCAB, DIM = 96, 16


def _t(rows: int, cols: int | None = None, seed: int = 1) -> np.ndarray:
    if cols is None:
        return random_table(1, rows, "float16", seed)[0]
    return random_table(rows, cols, "float16", seed)


# Each family: its tensors (real names, reduced shapes), the token embedding, and its config.json keys.
FAMILIES = {
    "bert-all-MiniLM-L6-v2": (
        {"embeddings.word_embeddings.weight": _t(VOCAB, DIM, 2), "embeddings.position_embeddings.weight": _t(64, DIM),
         "embeddings.token_type_embeddings.weight": _t(2, DIM), "embeddings.LayerNorm.weight": _t(DIM),
         "encoder.layer.0.attention.self.query.weight": _t(DIM, DIM), "pooler.dense.weight": _t(DIM, DIM)},
        "embeddings.word_embeddings.weight", {"vocab_size": VOCAB, "hidden_size": DIM, "model_type": "bert"}),
    "bert-base-uncased": (
        {"bert.embeddings.word_embeddings.weight": _t(VOCAB, DIM, 2), "bert.embeddings.position_embeddings.weight": _t(64, DIM),
         "bert.embeddings.token_type_embeddings.weight": _t(2, DIM), "cls.predictions.transform.dense.weight": _t(DIM, DIM)},
        "bert.embeddings.word_embeddings.weight", {"vocab_size": VOCAB, "hidden_size": DIM}),
    "roberta": (
        {"roberta.embeddings.word_embeddings.weight": _t(VOCAB, DIM, 2), "roberta.embeddings.position_embeddings.weight": _t(VOCAB + 2, DIM),
         "roberta.embeddings.token_type_embeddings.weight": _t(1, DIM), "lm_head.dense.weight": _t(DIM, DIM)},
        "roberta.embeddings.word_embeddings.weight", {"vocab_size": VOCAB, "hidden_size": DIM}),
    "albert": (
        {"albert.embeddings.word_embeddings.weight": _t(VOCAB, DIM // 2, 2), "albert.embeddings.position_embeddings.weight": _t(64, DIM // 2),
         "albert.encoder.embedding_hidden_mapping_in.weight": _t(DIM, DIM // 2)},
        "albert.embeddings.word_embeddings.weight", {"vocab_size": VOCAB, "embedding_size": DIM // 2, "hidden_size": DIM}),
    "gpt2": (
        {"wte.weight": _t(VOCAB, DIM, 2), "wpe.weight": _t(128, DIM), "h.0.attn.c_attn.weight": _t(DIM, 3 * DIM), "ln_f.weight": _t(DIM)},
        "wte.weight", {"vocab_size": VOCAB, "n_embd": DIM}),
    "gpt2-prefixed": (
        {"transformer.wte.weight": _t(VOCAB, DIM, 2), "transformer.wpe.weight": _t(VOCAB, DIM), "lm_head.weight": _t(VOCAB, DIM)},
        "transformer.wte.weight", None),
    "llama": (
        {"model.embed_tokens.weight": _t(VOCAB, DIM, 2), "lm_head.weight": _t(VOCAB, DIM), "model.norm.weight": _t(DIM),
         "model.layers.0.self_attn.q_proj.weight": _t(DIM, DIM), "model.layers.0.mlp.down_proj.weight": _t(DIM, 2 * DIM)},
        "model.embed_tokens.weight", {"vocab_size": VOCAB, "hidden_size": DIM, "model_type": "llama"}),
    "qwen2": (
        {"model.embed_tokens.weight": _t(VOCAB, DIM, 2), "model.layers.0.self_attn.q_proj.bias": _t(DIM),
         "model.layers.0.self_attn.k_proj.weight": _t(DIM // 2, DIM)},
        "model.embed_tokens.weight", {"vocab_size": VOCAB, "hidden_size": DIM}),
    "t5": (
        {"shared.weight": _t(VOCAB, DIM, 2), "encoder.embed_tokens.weight": _t(VOCAB, DIM, 2), "decoder.embed_tokens.weight": _t(VOCAB, DIM, 2),
         "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": _t(32, 4), "lm_head.weight": _t(VOCAB, DIM)},
        "shared.weight", {"vocab_size": VOCAB, "d_model": DIM, "model_type": "t5"}),
    "gpt-neox": (
        {"gpt_neox.embed_in.weight": _t(VOCAB, DIM, 2), "embed_out.weight": _t(VOCAB, DIM),
         "gpt_neox.layers.0.attention.query_key_value.weight": _t(3 * DIM, DIM)},
        "gpt_neox.embed_in.weight", {"vocab_size": VOCAB, "hidden_size": DIM}),
    "bloom": (
        {"word_embeddings.weight": _t(VOCAB, DIM, 2), "word_embeddings_layernorm.weight": _t(DIM),
         "word_embeddings_layernorm.bias": _t(DIM), "h.0.self_attention.query_key_value.weight": _t(3 * DIM, DIM)},
        "word_embeddings.weight", {"vocab_size": VOCAB, "hidden_size": DIM}),
    "bloom-prefixed": (
        {"transformer.word_embeddings.weight": _t(VOCAB, DIM, 2), "transformer.word_embeddings_layernorm.weight": _t(DIM),
         "transformer.word_embeddings_layernorm.bias": _t(DIM), "transformer.h.0.self_attention.query_key_value.weight": _t(3 * DIM, DIM),
         "lm_head.weight": _t(VOCAB, DIM)},
        "transformer.word_embeddings.weight", {"vocab_size": VOCAB, "hidden_size": DIM, "model_type": "bloom"}),
    "mistral": (
        {"model.embed_tokens.weight": _t(VOCAB, DIM, 2), "lm_head.weight": _t(VOCAB, DIM),
         "model.layers.0.self_attn.k_proj.weight": _t(DIM // 4, DIM), "model.layers.0.mlp.gate_proj.weight": _t(2 * DIM, DIM)},
        "model.embed_tokens.weight", {"vocab_size": VOCAB, "hidden_size": DIM, "model_type": "mistral"}),
    "mixtral": (
        {"model.embed_tokens.weight": _t(VOCAB, DIM, 2), "lm_head.weight": _t(VOCAB, DIM),
         "model.layers.0.block_sparse_moe.gate.weight": _t(8, DIM),
         **{f"model.layers.0.block_sparse_moe.experts.{e}.w{w}.weight": _t(2 * DIM, DIM) for e in range(4) for w in (1, 3)},
         "model.layers.1.block_sparse_moe.experts.0.w2.weight": _t(DIM, 2 * DIM)},
        "model.embed_tokens.weight", {"vocab_size": VOCAB, "hidden_size": DIM, "model_type": "mixtral"}),
    # The multi-token-prediction layer (layer 61 of DeepSeek-V3, 46 of GLM-4.5-Air) holds its own embed_tokens of the
    # table's shape: a per-layer copy, which never competes with model.embed_tokens.weight.
    "deepseek-v3": (
        {"model.embed_tokens.weight": _t(VOCAB, DIM, 2), "lm_head.weight": _t(VOCAB, DIM, 3),
         "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": _t(DIM, DIM),
         "model.layers.3.mlp.experts.0.down_proj.weight": _t(DIM, 2 * DIM),
         "model.layers.3.mlp.experts.0.down_proj.weight_scale_inv": _t(1, 1),
         "model.layers.61.embed_tokens.weight": _t(VOCAB, DIM, 4), "model.layers.61.shared_head.head.weight": _t(VOCAB, DIM, 5),
         "model.layers.61.eh_proj.weight": _t(DIM, 2 * DIM), "model.layers.61.enorm.weight": _t(DIM)},
        "model.embed_tokens.weight",
        {"vocab_size": VOCAB, "hidden_size": DIM, "model_type": "deepseek_v3", "num_nextn_predict_layers": 1}),
    "glm-4.5-air": (
        {"model.embed_tokens.weight": _t(VOCAB, DIM, 2), "lm_head.weight": _t(VOCAB, DIM, 3),
         "model.layers.1.mlp.experts.7.up_proj.weight": _t(2 * DIM, DIM),
         "model.layers.46.embed_tokens.weight": _t(VOCAB, DIM, 4), "model.layers.46.shared_head.head.weight": _t(VOCAB, DIM, 5),
         "model.layers.46.eh_proj.weight": _t(DIM, 2 * DIM)},
        "model.embed_tokens.weight", {"vocab_size": VOCAB, "hidden_size": DIM, "model_type": "glm4_moe"}),
    "falcon": (
        {"transformer.word_embeddings.weight": _t(VOCAB, DIM, 2), "lm_head.weight": _t(VOCAB, DIM),
         "transformer.h.0.self_attention.dense.weight": _t(DIM, DIM)},
        "transformer.word_embeddings.weight", {"vocab_size": VOCAB, "hidden_size": DIM}),
}


def write_checkpoint(directory, tensors: dict[str, np.ndarray], config: dict | None, shards: int = 1) -> None:
    """A checkpoint as transformers writes it: model.safetensors, or shards with their index."""
    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        safetensors_numpy.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map, total = {}, 0
    for shard in range(shards):
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::shards]}
        safetensors_numpy.save_file(part, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in part})
        total += sum(array.nbytes for array in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def assert_zero_copy_table(table, expected: np.ndarray) -> None:
    assert isinstance(table, np.memmap) and not table.flags.writeable
    assert_bit_equal(np.asarray(table), expected)
    ids = [0, VOCAB - 1, 7, 7]
    assert_bit_equal(fastembed.lookup(table, ids), expected[ids])


@pytest.mark.parametrize("with_config", [True, False])
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_opens_its_token_embedding(tmp_path, family, shards, with_config):
    tensors, embedding, config = FAMILIES[family]
    write_checkpoint(tmp_path / family, tensors, config if with_config else None, shards)
    table = io.open_table(tmp_path / family)
    assert_zero_copy_table(table, tensors[embedding])
    if shards > 1:
        index = json.loads((tmp_path / family / "model.safetensors.index.json").read_text())
        assert table.filename.endswith(index["weight_map"][embedding])
        assert_zero_copy_table(io.open_table(tmp_path / family / "model.safetensors.index.json"), tensors[embedding])
    else:
        assert_zero_copy_table(io.open_table(tmp_path / family / "model.safetensors"), tensors[embedding])


@pytest.mark.parametrize("family", FAMILIES)
def test_from_safetensors_picks_the_same_tensor_without_config(tmp_path, family):
    """name=None used to fail on all-MiniLM-L6-v2: position and token-type embeddings looked like candidates."""
    tensors, embedding, _ = FAMILIES[family]
    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    assert_zero_copy_table(fastembed.Embedding.from_safetensors(tmp_path / "model.safetensors").table, tensors[embedding])


def test_only_the_shard_holding_the_table_is_read(tmp_path):
    """A DeepSeek-like checkpoint: the other shards are never opened (here they are not even safetensors)."""
    tensors = {"model.embed_tokens.weight": random_table(VOCAB, DIM, "bfloat16", 3)}
    tensors.update({f"model.layers.{i}.mlp.experts.{e}.down_proj.weight": _t(DIM, 4) for i in range(3) for e in range(4)})
    write_checkpoint(tmp_path, tensors, {"vocab_size": VOCAB, "hidden_size": DIM, "model_type": "deepseek_v3"}, shards=4)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    holder = index["weight_map"]["model.embed_tokens.weight"]
    for shard in set(index["weight_map"].values()) - {holder}:
        (tmp_path / shard).write_bytes(b"not read")
    table = io.open_table(tmp_path)
    assert table.filename.endswith(holder)
    assert_zero_copy_table(table, tensors["model.embed_tokens.weight"])
    layer = "model.layers.2.mlp.experts.3.down_proj.weight"
    if index["weight_map"][layer] == holder:
        assert_bit_equal(np.asarray(io.open_table(tmp_path, name=layer)), tensors[layer])


def test_the_mtp_layer_loses_to_the_top_level_table_and_its_shard_is_not_read(tmp_path):
    """DeepSeek-V3's layout: the MTP layer (model.layers.61) in the last shard, which is never opened."""
    tensors, embedding, config = FAMILIES["deepseek-v3"]
    write_checkpoint(tmp_path, tensors, config, shards=1)
    assert_zero_copy_table(fastembed.Embedding.from_pretrained(tmp_path).table, tensors[embedding])
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(config))
    layer_61 = {name: array for name, array in tensors.items() if ".layers.61." in name}
    safetensors_numpy.save_file({n: a for n, a in tensors.items() if n not in layer_61}, str(sharded / "model-00001-of-00002.safetensors"))
    (sharded / "model-00002-of-00002.safetensors").write_bytes(b"not read")
    weight_map = {name: "model-00002-of-00002.safetensors" if name in layer_61 else "model-00001-of-00002.safetensors"
                  for name in tensors}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    table = fastembed.Embedding.from_pretrained(sharded).table
    assert table.filename.endswith("model-00001-of-00002.safetensors")
    assert_zero_copy_table(table, tensors[embedding])


def test_a_per_layer_copy_is_still_found_when_it_is_the_only_candidate(tmp_path):
    tensors = {"model.layers.0.embed_tokens.weight": _t(VOCAB, DIM, 4), "model.layers.0.mlp.weight": _t(DIM, DIM)}
    write_checkpoint(tmp_path, tensors, None)
    assert_zero_copy_table(io.open_table(tmp_path), tensors["model.layers.0.embed_tokens.weight"])
    assert not io.checkpoints.in_numbered_layer("model.embed_tokens.weight")
    assert io.checkpoints.in_numbered_layer("transformer.h.11.word_embeddings.weight")
    assert not io.checkpoints.in_numbered_layer("model.layers_norm.embed_tokens.weight")


def test_name_selects_in_a_sharded_checkpoint(tmp_path):
    tensors, _, config = FAMILIES["llama"]
    write_checkpoint(tmp_path, tensors, config, shards=3)
    assert_bit_equal(np.asarray(io.open_table(tmp_path, name="lm_head.weight")), tensors["lm_head.weight"])
    with pytest.raises(ValueError, match="no tensor named 'embed_tokens'.*model.embed_tokens.weight"):
        io.open_table(tmp_path, name="embed_tokens")
    with pytest.raises(ValueError, match="2-D"):
        io.open_table(tmp_path, name="model.norm.weight")


def test_config_confirms_the_shape(tmp_path):
    tensors, _, config = FAMILIES["llama"]
    write_checkpoint(tmp_path, tensors, {**config, "vocab_size": VOCAB + 1}, shards=1)
    with pytest.raises(ValueError, match=r"config.json gives the token embedding shape \(97, 16\).*model.embed_tokens.weight \[96, 16\]"):
        io.open_table(tmp_path)


@pytest.mark.parametrize("kind", ["pipe", "device", "loop", "dangling", "directory"])
def test_a_config_json_that_is_no_regular_file_is_reported_not_skipped(tmp_path, kind):
    """A config.json that was a pipe, a link to a device, a loop of links, a link to nothing or a directory counted
    as no config.json: the table loaded without the shape check the config gives, and nothing said so."""
    import os

    tensors, _, config = FAMILIES["llama"]
    write_checkpoint(tmp_path, tensors, None, shards=1)
    path = tmp_path / "config.json"
    make = {"pipe": lambda: os.mkfifo(path), "device": lambda: path.symlink_to("/dev/zero"),
            "loop": lambda: path.symlink_to(path), "dangling": lambda: path.symlink_to(tmp_path / "missing.json"),
            "directory": path.mkdir}
    make[kind]()
    refused = FileNotFoundError if kind == "dangling" else ValueError
    with pytest.raises(refused, match="config.json"):
        fastembed.Embedding.from_pretrained(tmp_path)


def test_config_chooses_among_equal_names(tmp_path):
    """An encoder-decoder without a shared embedding: config.json's shape picks the right one."""
    tensors = {"encoder.embed_tokens.weight": _t(VOCAB, DIM, 4), "decoder.embed_tokens.weight": _t(VOCAB + 8, DIM, 5)}
    write_checkpoint(tmp_path / "with", tensors, {"vocab_size": VOCAB, "d_model": DIM})
    assert_zero_copy_table(io.open_table(tmp_path / "with"), tensors["encoder.embed_tokens.weight"])
    write_checkpoint(tmp_path / "without", tensors, None)
    with pytest.raises(ValueError, match=r"several tensors look like token embeddings.*decoder.embed_tokens.weight \[104, 16\]"):
        io.open_table(tmp_path / "without")


def test_the_endings_of_one_rank_are_equal_candidates(tmp_path):
    """token_embedding and token_embeddings rank alike: a checkpoint with both (a text and a vision encoder) is a
    choice for name=, not the first ending's silently."""
    tensors = {"text.token_embedding.weight": _t(VOCAB, DIM, 7), "vision.token_embeddings.weight": _t(VOCAB, DIM, 8)}
    write_checkpoint(tmp_path, tensors, None)
    assert io.embedding_rank("text.token_embedding.weight") == io.embedding_rank("vision.token_embeddings.weight")
    with pytest.raises(ValueError, match=r"several tensors look like token embeddings.*vision.token_embeddings.weight"):
        io.open_table(tmp_path)
    assert_zero_copy_table(io.open_table(tmp_path, "vision.token_embeddings.weight"),
                           tensors["vision.token_embeddings.weight"])


def test_multimodal_config_reads_text_config(tmp_path):
    tensors = {"language_model.model.embed_tokens.weight": _t(VOCAB, DIM, 6), "vision_tower.patch_embedding.weight": _t(DIM, 12)}
    write_checkpoint(tmp_path, tensors, {"text_config": {"vocab_size": VOCAB, "hidden_size": DIM}, "model_type": "llava"})
    assert io.read_config_shape(tmp_path) == (VOCAB, DIM)
    assert_zero_copy_table(io.open_table(tmp_path), tensors["language_model.model.embed_tokens.weight"])


def test_too_many_candidates_are_listed_briefly(tmp_path):
    tensors = {f"tower{i}.embed_tokens.weight": _t(4, 4) for i in range(40)}
    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"several tensors.*\.\.\. and 28 more") as caught:
        io.open_table(tmp_path)
    assert len(str(caught.value)) < 1000


@pytest.mark.parametrize("shards", [1, 3])
def test_more_candidates_than_are_kept_ask_for_a_name_instead_of_choosing_among_some(tmp_path, shards):
    tensors = {f"a{i}.embeddings.weight": _t(4, 4) for i in range(63)}
    tensors |= {"transformer.wte.weight": _t(4, 4), "model.embed_tokens.weight": _t(4, 4)}
    write_checkpoint(tmp_path, tensors, None, shards=shards)
    with pytest.raises(ValueError, match="65 tensors are named like token embeddings; pass name="):
        io.open_table(tmp_path)
    assert_bit_equal(np.asarray(io.open_table(tmp_path, "model.embed_tokens.weight")), tensors["model.embed_tokens.weight"])


def test_a_tensor_listed_twice_is_refused_even_when_one_listing_is_not_a_candidate(tmp_path):
    header = (b'{"model.embed_tokens.weight":{"dtype":"F32","shape":[4,4],"data_offsets":[32,96]},'
              b'"model.embed_tokens.weight":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}')
    path = tmp_path / "twice.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(96))
    for name in (None, "model.embed_tokens.weight"):
        with pytest.raises(ValueError, match="'model.embed_tokens.weight' is listed twice in the header"):
            io.map_safetensors(path, name)


@pytest.mark.parametrize("spelling", ["", b"", "FILE/", "FILE/.", "FILE//"])
def test_a_path_is_opened_as_given(tmp_path, monkeypatch, spelling):
    """An empty path is no path (not the current directory), and a file's name ends in no "/" or "/.",
    as every loader of one file holds."""
    io.save_table(tmp_path / "model.safetensors", _t(4, 8))
    monkeypatch.chdir(tmp_path)
    if not isinstance(spelling, bytes):
        spelling = spelling.replace("FILE", str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError):
        fastembed.Embedding.from_pretrained(spelling)
    with pytest.raises(FileNotFoundError):
        io.open_table(spelling)


def test_open_table_sources_and_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        io.open_table(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("hi")
    with pytest.raises(ValueError, match=r"no checkpoint in this directory.*model.safetensors.*'README.md'"):
        io.open_table(tmp_path / "empty")
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="PyTorch pickles.*safetensors package"):
        io.open_table(tmp_path / "empty")
    table = _t(VOCAB, DIM, 8)
    np.save(tmp_path / "table.npy", table)
    assert_zero_copy_table(io.open_table(tmp_path / "table.npy"), table)
    with pytest.raises(ValueError, match="name= must be None"):
        io.open_table(tmp_path / "table.npy", name="x")


def _run_the_hint(message: str) -> None:
    """Run the conversion a message gives (the code between "the safetensors package: " and "; then pass")."""
    code = message.split("with the safetensors package: ", 1)[1].split("; then pass", 1)[0]
    exec(code, {})  # noqa: S102 - fastembed's own message, on files this test wrote


def test_a_directory_of_pickle_shards_names_the_shard_to_convert_and_the_hint_works(tmp_path):
    """The hint once said "Pass one of these files instead: 'pytorch_model.bin.index.json'", which then failed."""
    torch = pytest.importorskip("torch")
    table = torch.from_numpy(_t(VOCAB, DIM, 2))
    shards = {"pytorch_model-00001-of-00002.bin": {"lm_head.weight": torch.zeros(VOCAB, DIM, dtype=torch.float16)},
              "pytorch_model-00002-of-00002.bin": {"model.embed_tokens.weight": table, "model.norm.weight": torch.ones(DIM)}}
    for file_name, tensors in shards.items():
        torch.save(tensors, tmp_path / file_name)
    weight_map = {name: file_name for file_name, tensors in shards.items() for name in tensors}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "hidden_size": DIM}))
    for source in (tmp_path, tmp_path / "pytorch_model.bin.index.json"):
        with pytest.raises(ValueError, match=r"sharded as PyTorch pickles, which fastembed never unpickles.*"
                                             r"'model.embed_tokens.weight' in pytorch_model-00002-of-00002.bin") as caught:
            fastembed.Embedding.from_pretrained(source)
        message = str(caught.value)
        assert "Pass one of these" not in message and "opens here" not in message  # no file here that fastembed opens
    with pytest.raises(ValueError, match="'lm_head.weight' in pytorch_model-00001-of-00002.bin"):
        io.open_table(tmp_path / "pytorch_model.bin.index.json", name="lm_head.weight")
    _run_the_hint(message)
    converted = tmp_path / "pytorch_model-00002-of-00002.safetensors"
    assert f"then pass {str(converted)!r} to fastembed.Embedding.from_pretrained" in message
    assert_zero_copy_table(fastembed.Embedding.from_pretrained(converted).table, table.numpy())


def test_a_directory_with_one_pickle_says_how_to_convert_it_in_place(tmp_path):
    torch = pytest.importorskip("torch")
    table = torch.from_numpy(_t(VOCAB, DIM, 2))
    torch.save({"model.embed_tokens.weight": table, "lm_head.weight": table.clone()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"PyTorch pickles \('pytorch_model.bin'\).*safetensors package.*"
                                         r"then pass this directory") as caught:
        fastembed.Embedding.from_pretrained(tmp_path)
    _run_the_hint(str(caught.value))
    assert_zero_copy_table(fastembed.Embedding.from_pretrained(tmp_path).table, table.numpy())


def test_the_hint_lists_only_files_fastembed_opens(tmp_path):
    for file_name in ("pytorch_model.bin.index.json", "tokenizer.json", "table.gguf", "extra.safetensors",
                      "adapter.safetensors.index.json", "table.npy", "tf_model.h5", "flax_model.msgpack"):
        (tmp_path / file_name).write_bytes(b"x")
    with pytest.raises(ValueError, match="no checkpoint in this directory") as caught:
        io.open_table(tmp_path)
    listed = str(caught.value).split("Files fastembed opens here (pass one instead): ", 1)[1]
    assert listed == "'adapter.safetensors.index.json', 'extra.safetensors', 'table.gguf', 'table.npy'."


@pytest.mark.parametrize(
    "index, words",
    [
        ({"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}, "a shard must be a file name"),
        ({"weight_map": {"model.embed_tokens.weight": "/etc/passwd"}}, "a shard must be a file name"),
        ({"weight_map": {"model.embed_tokens.weight": 3}}, "weight_map must be an object"),
        ({"weight_map": []}, "weight_map must be an object"),
        ([], "must be a JSON object"),
        ({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}, "does not hold it"),
        ({"weight_map": {"model.embed_tokens.weight": "absent.safetensors"}}, "a shard that is missing"),
        ({"weight_map": {"model.embed_tokens.weight": "folder.safetensors"}},
         "puts 'model.embed_tokens.weight' in folder.safetensors, which is a directory, not a safetensors shard"),
    ],
)
def test_hostile_or_wrong_indexes(tmp_path, index, words):
    safetensors_numpy.save_file({"other.weight": _t(4, 4)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "folder.safetensors").mkdir()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises((ValueError, FileNotFoundError), match=words):
        io.open_table(tmp_path)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "q8_0"])
def test_a_quantized_table_fastembed_saved_opens_quantized_through_an_index(tmp_path, kind):
    quantized = fastembed.Embedding(random_table(40, 64, "float32")).quantize(kind)
    quantized.save(tmp_path / "model-00001-of-00001.safetensors", name="model.embed_tokens.weight")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for source in (tmp_path, tmp_path / "model.safetensors.index.json"):
        for name in (None, "model.embed_tokens.weight"):
            opened = fastembed.Embedding.from_pretrained(source, name)
            assert opened.format == kind
            assert_bit_equal(opened([0, 39, 7]), quantized([0, 39, 7]))


@pytest.mark.parametrize("sharded", [False, True])
def test_the_only_candidate_of_another_rank_is_named_in_the_error(tmp_path, sharded):
    file_name = "model-00001-of-00001.safetensors" if sharded else "model.safetensors"
    safetensors_numpy.save_file({"model.embed_tokens.weight": np.zeros(40, np.float32), "other": _t(4, 4)},
                                str(tmp_path / file_name))
    if sharded:
        weight_map = {"model.embed_tokens.weight": file_name, "other": file_name}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' is named like a token embedding but has shape \[40\]"):
        io.open_table(tmp_path)


def test_a_model_safetensors_that_is_a_directory_is_named_as_such(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"model.safetensors: is a directory, where a checkpoint directory holds its "
                                         r"model.safetensors file$"):
        fastembed.Embedding.from_pretrained(tmp_path)


def test_a_dangling_link_or_a_directory_where_the_checkpoint_should_be_is_named(tmp_path):
    import os

    linked = tmp_path / "copied_snapshot"
    linked.mkdir()
    os.symlink("../../blobs/0123abcd", linked / "model.safetensors")  # a Hugging Face snapshot copied without its blobs
    with pytest.raises(FileNotFoundError, match=r"symbolic link to '../../blobs/0123abcd', which does not exist"):
        io.open_table(linked)
    nested = tmp_path / "nested"
    (nested / "model.safetensors.index.json").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: is a directory"):
        io.open_table(nested)


def test_a_shard_that_is_a_dangling_link_or_a_loop_is_named_as_such(tmp_path):
    import os

    tensors, _, config = FAMILIES["llama"]
    write_checkpoint(tmp_path, tensors, config, shards=2)
    shard = tmp_path / json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"][
        "model.embed_tokens.weight"]
    shard.unlink()
    os.symlink("../../blobs/0123abcd", shard)  # a snapshot copied without its blobs
    with pytest.raises(FileNotFoundError, match=r"symbolic link to '../../blobs/0123abcd', which does not exist"):
        io.open_table(tmp_path)
    shard.unlink()
    os.symlink(shard.name, shard)  # a link to itself
    with pytest.raises(ValueError, match="a loop of symbolic links"):
        io.open_table(tmp_path)


@pytest.mark.parametrize("kind", ["float16", "q8_0"])
@pytest.mark.parametrize("sharded", [False, True])
def test_the_config_confirms_the_shape_of_a_table_fastembed_saved(tmp_path, kind, sharded):
    """A file's fastembed metadata picks the table; config.json's shape must still fit it, as for any checkpoint."""
    emb = fastembed.Embedding(random_table(40, 64, "float32"))
    emb = emb.quantize(kind) if kind != "float16" else fastembed.Embedding(random_table(40, 64))
    shard = "model-00001-of-00001.safetensors" if sharded else "model.safetensors"
    emb.save(tmp_path / shard, name="model.embed_tokens.weight")
    if sharded:
        index = {"weight_map": {"model.embed_tokens.weight": shard}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 40, "hidden_size": 32}))
    with pytest.raises(ValueError, match=r"config.json gives the token embedding shape \(40, 32\), but the table "
                                         r"'model.embed_tokens.weight' has shape \(40, 64\)"):
        fastembed.Embedding.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 40, "hidden_size": 64}))
    assert_bit_equal(fastembed.Embedding.from_pretrained(tmp_path)([3, 0]), emb([3, 0]))
