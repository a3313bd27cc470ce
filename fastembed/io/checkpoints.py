"""Hugging Face checkpoints: find the token embedding by name, map only the shard that holds it.

A checkpoint directory holds either one ``model.safetensors`` or shards
``model-0000N-of-0000M.safetensors`` with ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {tensor name: shard file}}``),
and usually a ``config.json`` whose ``vocab_size`` and ``hidden_size``
(``d_model`` for T5, ``n_embd`` for GPT-2) give the token embedding's shape.
"""
from __future__ import annotations

import errno
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..formats import QuantizedTable
from ._files import (
    NAMES_SHOWN,
    PICKLE_SUFFIXES,
    check_file,
    check_tensor_name,
    convert_pickle,
    describe,
    looks_like_safetensors,
    path_text,
    read_head,
    shorten,
)
from .gguf import map_gguf
from .npy import map_npy_rows
from .safetensors import SCALES_SUFFIX, TENSOR_KEY, SafetensorsHeader, TensorEntry, map_entry, scan_safetensors_header

#: Tensor-name endings that mark a token embedding, best first (endings of equal rank together), with the families
#: that use them.
#: A name matches an ending when it equals it or ends with "." followed by it, so
#: ``position_embeddings.weight`` or ``wpe.weight`` never match.
TOKEN_EMBEDDING_ENDINGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("shared.weight",), "T5, BART (shared.weight; encoder/decoder embed_tokens are tied to it)"),
    (("embed_tokens.weight",), "LLaMA, Qwen, Mistral, DeepSeek, OPT (model.embed_tokens.weight)"),
    (("word_embeddings.weight",), "BERT, RoBERTa (embeddings.word_embeddings.weight), BLOOM, Falcon"),
    (("wte.weight",), "GPT-2, GPT-J (transformer.wte.weight)"),
    (("embed_in.weight",), "GPT-NeoX, Pythia (gpt_neox.embed_in.weight)"),
    (("tok_embeddings.weight",), "Meta's original LLaMA layout, InternLM2"),
    # One rank: a checkpoint holding both (a text and a vision encoder) names its table only by name=.
    (("token_embedding.weight", "token_embeddings.weight"), "CLIP text encoders, others"),
)
#: The endings as an error message lists them.
_ENDINGS_TEXT = ", ".join(ending for endings, _ in TOKEN_EMBEDDING_ENDINGS for ending in endings)
#: Last resort: any "...embedding(s).weight" that is not a position or token-type embedding.
_GENERIC_ENDINGS = ("embeddings.weight", "embedding.weight")
_NOT_TOKEN_WORDS = ("position", "token_type", "segment", "pos_emb", "patch", "rotary", "relative")
#: A name nested under a numbered layer (``model.layers.61.embed_tokens.weight``, ``transformer.h.3....``):
#: a per-layer copy, such as the multi-token-prediction layer of DeepSeek-V3 and GLM-4.5, never the token table
#: itself when a candidate outside the numbered layers exists.
_NUMBERED_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|blocks|h)\.\d+\.")
#: The most candidate tensors a selection looks at (real checkpoints have one to three).
MAX_CANDIDATES = 64
#: The largest index JSON read (DeepSeek-V3's index is about 9 MB).
MAX_JSON_BYTES = 64 * 2**20
#: The largest config.json read: real ones are a few KiB (a classifier's label names make some a few hundred), and
#: parsing JSON can take some 30 times its length in memory.
MAX_CONFIG_BYTES = 4 * 2**20
#: config.json keys of the token embedding's width, first found wins: ALBERT and ELECTRA
#: (embedding_size) and OPT-350m (word_embed_proj_dim) embed narrower than hidden_size.
_DIM_KEYS = ("embedding_size", "word_embed_proj_dim", "hidden_size", "d_model", "n_embd")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def embedding_rank(name: str) -> int | None:
    """How strongly a tensor's name marks it as the token embedding: 0 is best, None is not at all.

    Example:
        >>> from fastembed.io import embedding_rank
        >>> embedding_rank("model.embed_tokens.weight")
        1
        >>> embedding_rank("model.norm.weight") is None
        True
    """
    for rank, (endings, _) in enumerate(TOKEN_EMBEDDING_ENDINGS):
        if any(name == ending or name.endswith("." + ending) for ending in endings):
            return rank
    lowered = name.lower()
    if lowered.endswith(_GENERIC_ENDINGS) and not any(word in lowered for word in _NOT_TOKEN_WORDS):
        return len(TOKEN_EMBEDDING_ENDINGS)
    return None


def is_embedding_candidate(name: str) -> bool:
    """Whether a tensor's name looks like a token embedding (see :data:`TOKEN_EMBEDDING_ENDINGS`)."""
    return embedding_rank(name) is not None


def in_numbered_layer(name: str) -> bool:
    """Whether a tensor sits inside a numbered layer (``...layers.<N>.``, ``...h.<N>.``): a per-layer copy."""
    return _NUMBERED_LAYER.search(name) is not None


def outside_numbered_layers(names: list[str]) -> list[str]:
    """The candidates outside numbered layers when there are any, else all of them.

    A checkpoint with a multi-token-prediction layer (DeepSeek-V3, GLM-4.5) holds
    ``model.layers.61.embed_tokens.weight`` beside ``model.embed_tokens.weight``, of the same
    shape: the layer's copy never competes with the top-level table.
    """
    top = [name for name in names if not in_numbered_layer(name)]
    return top or names


def token_embedding_name(shapes: Mapping[str, tuple[int, ...]], where: Any = "",
                         expected: tuple[int | None, int | None] | None = None, two_d: str | None = None) -> str:
    """The token embedding among the given tensors.

    Args:
        shapes: tensor name -> shape (other tensors may be included; they are ignored).
        where: the file or checkpoint, for messages.
        expected: (vocab_size, dim) from config.json (either may be None), when known.
        two_d: the 2-D tensors to list when there is no candidate (default: those in `shapes`).

    Returns:
        The name of the single best 2-D candidate: the one whose name ending ranks first in
        :data:`TOKEN_EMBEDDING_ENDINGS`, among those of the expected shape when it is known.
        Candidates nested under a numbered layer (``model.layers.61.embed_tokens.weight``)
        are per-layer copies and are dropped first when any candidate lies outside the
        numbered layers (:func:`outside_numbered_layers`).

    Raises:
        ValueError: no tensor is named like a token embedding, or one is but is not 2-D;
            none has the shape the config gives; or several rank equally (each message
            lists the candidates).

    Example:
        >>> from fastembed.io import token_embedding_name
        >>> token_embedding_name({"model.embed_tokens.weight": (10, 8), "model.norm.weight": (8,)})
        'model.embed_tokens.weight'
    """
    candidates = {name: tuple(shape) for name, shape in shapes.items() if len(shape) == 2 and is_embedding_candidate(name)}
    if not candidates:
        other_rank = next(((name, shape) for name, shape in shapes.items() if is_embedding_candidate(name)), None)
        if other_rank is not None:
            raise ValueError(f"{where}: {shorten([other_rank[0]])} is named like a token embedding but has shape "
                             f"{list(other_rank[1])}; a token embedding is 2-D (vocab_size, dim): pass name= for another tensor")
        if two_d is None:
            two_d = shorten(name for name, shape in shapes.items() if len(shape) == 2)
        raise ValueError(f"{where}: no tensor is named like a token embedding "
                         f"({_ENDINGS_TEXT}); pass name=; "
                         f"2-D tensors: {two_d}")
    kept = outside_numbered_layers(list(candidates))
    candidates = {name: candidates[name] for name in kept}
    if expected is not None and any(expected):
        fitting = {name: shape for name, shape in candidates.items() if _fits(expected, shape)}
        if not fitting:
            raise ValueError(f"{where}: config.json gives the token embedding shape {_shape_text(expected)} but no tensor "
                             f"named like one has it; pass name= one of {_with_shapes(candidates)}")
        candidates = fitting
    ranks = {name: embedding_rank(name) for name in candidates}
    best = min(rank for rank in ranks.values() if rank is not None)
    top = [name for name, rank in ranks.items() if rank == best]
    if len(top) == 1:
        return top[0]
    raise ValueError(f"{where}: several tensors look like token embeddings, pass name= one of {_with_shapes({n: candidates[n] for n in top})}")


def _fits(expected: tuple[int | None, int | None], shape: tuple[int, ...]) -> bool:
    """Whether a 2-D `shape` is config.json's `expected` (vocab_size, width), where either may be unknown (None)."""
    return all(want is None or want == have for want, have in zip(expected, shape, strict=True))


def _shape_text(expected: tuple[int | None, int | None]) -> str:
    return "(" + ", ".join("?" if value is None else str(value) for value in expected) + ")"


def _with_shapes(candidates: Mapping[str, tuple[int, ...]]) -> str:
    return shorten(f"{name} {list(shape)}" for name, shape in candidates.items()).replace("'", "")


def read_config_shape(directory: str | os.PathLike) -> tuple[int | None, int | None] | None:
    """(vocab_size, hidden size) from a checkpoint's config.json, or None when there is none.

    The width is ``embedding_size`` (ALBERT, ELECTRA), ``word_embed_proj_dim`` (OPT-350m),
    ``hidden_size``, ``d_model`` (T5, BART) or ``n_embd`` (GPT-2), the first present;
    a multimodal config's ``text_config`` is read when the top level lacks them.

    Args:
        directory: a checkpoint directory.

    Returns:
        ``(vocab_size, width)``, each None where the config does not give it;
        None where the directory has no config.json.

    Raises:
        ValueError: config.json exists but is not a regular file holding a JSON object (a pipe, a device, a
            directory, a loop of symbolic links).
        FileNotFoundError: config.json is a symbolic link that leads nowhere.

    Example:
        >>> import json, os, shutil, tempfile
        >>> from fastembed.io import read_config_shape
        >>> folder = tempfile.mkdtemp()
        >>> with open(os.path.join(folder, "config.json"), "w") as config:
        ...     _ = config.write(json.dumps({"vocab_size": 10, "hidden_size": 8}))
        >>> read_config_shape(folder)
        (10, 8)
        >>> shutil.rmtree(folder)
    """
    path = Path(directory) / "config.json"
    if not os.path.lexists(path):
        return None
    config = _read_json(path, "config.json", MAX_CONFIG_BYTES)
    for level in (config, config.get("text_config")):
        if not isinstance(level, dict):
            continue
        _refuse_repeated(path, "config.json", level, ("vocab_size", "text_config", *_DIM_KEYS))
        vocab = level.get("vocab_size")
        dim = next((level[key] for key in _DIM_KEYS if key in level), None)
        vocab = vocab if type(vocab) is int and vocab > 0 else None
        dim = dim if type(dim) is int and dim > 0 else None
        if vocab or dim:
            return vocab, dim
    return None


class _Fields(dict):
    """A JSON object's fields (the last value of a name given twice, as json keeps it), and the names given twice."""

    repeated: frozenset[str] = frozenset()


def _fields(pairs: list[tuple[str, Any]]) -> _Fields:
    fields = _Fields(pairs)
    if len(fields) != len(pairs):
        fields.repeated = frozenset(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
    return fields


def _read_json(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The JSON object in the file at `path` (`what` names it in errors), at most `limit` bytes long.

    Raises:
        ValueError: the file is longer, has grown since its size was checked, is not UTF-8 JSON, or not an object.
    """
    size = check_file(path, "fastembed.io.open_table")
    if size > limit:
        raise ValueError(f"{path}: {what} is {size} bytes, over the {limit}-byte limit")
    text = read_head(path, size + 1)  # one byte more than checked, which tells a file that has grown since
    if len(text) > size:
        raise ValueError(f"{path}: {what} grew while it was read (it was {size} bytes when checked); read it again "
                         "once it is written")
    try:
        value = json.loads(text.decode("utf-8"), object_pairs_hook=_fields)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ValueError(f"{path}: {what} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {what} must be a JSON object, got {type(value).__name__}")  # noqa: TRY004 - a bad file
    return value


def _refuse_repeated(path: Path, what: str, fields: Any, names: Iterable[str] | None = None) -> None:
    """Raise ValueError when one of `names` (None: any name) is given twice in the JSON object `fields`: which value
    counts would be a guess."""
    repeated: frozenset[str] = getattr(fields, "repeated", frozenset())
    if names is not None:
        repeated = repeated & set(names)
    if repeated:
        raise ValueError(f"{path}: {what} gives {shorten(sorted(repeated))} more than once")


def open_table(source: str | os.PathLike, name: str | None = None) -> np.memmap | QuantizedTable:
    """Memory-map a checkpoint's token embedding (or the tensor `name`) read-only, zero-copy.

    Args:
        source: a checkpoint directory (``model.safetensors``, or shards with
            ``model.safetensors.index.json``), an index file, one ``.safetensors``
            file, a ``.gguf`` file (:func:`~fastembed.io.map_gguf`), or a ``.npy`` file.
        name: the tensor to open; None picks the token embedding by name
            (:data:`TOKEN_EMBEDDING_ENDINGS`; ``token_embd.weight`` in a GGUF file),
            confirmed against the ``vocab_size`` and width in the config.json beside a
            checkpoint directory's or an index's files (:func:`read_config_shape`); a
            single file given alone is chosen by name only (a file fastembed saved names
            its table in its metadata). Must be None for a .npy file.

    Returns:
        A read-only np.memmap of the 2-D table, or a
        :class:`~fastembed.formats.QuantizedTable` of memory-mapped rows (GGUF's
        quantized types, a quantized table fastembed saved). For shards only the index
        and the headers of the shards holding candidate tensors are read; only one shard
        is mapped.

    Raises:
        FileNotFoundError: nothing at `source`.
        OSError: a path the system refuses to read (PermissionError, a name too long for it).
        ValueError: a directory without a checkpoint (naming the files there fastembed
            opens; for PyTorch pickles, how to convert them); a checkpoint sharded as
            PyTorch pickles (how to convert the shard holding the table); an unreadable
            index or config; a shard named outside the directory, or that is a directory or the index itself; no such
            tensor; no, or several equal, token-embedding candidates (listed); any error of the file loaders; a
            `source` holding a NUL character.
        TypeError: BF16/F8 need ml_dtypes and it is missing; `name` is not a string; `source` is no str, bytes or
            os.PathLike.

    Example:
        >>> import numpy as np, os, shutil, tempfile
        >>> from fastembed.io import save_table
        >>> folder = tempfile.mkdtemp()
        >>> path = os.path.join(folder, "model.safetensors")
        >>> save_table(path, np.ones((4, 8), np.float16))
        >>> from fastembed.io import open_table
        >>> open_table(folder).shape  # the checkpoint directory
        (4, 8)
        >>> shutil.rmtree(folder)
    """
    check_tensor_name(source, name)
    text = path_text(source, "fastembed.io.open_table", kinds=(str, bytes, os.PathLike))  # __fspath__ may give bytes
    # Checked as given: Path("") is ".", and Path drops a trailing "/" or "/." that a file's name cannot carry.
    try:
        os.lstat(text)  # a link that leads nowhere or loops is named as such by check_file below
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", str(source)) from None
    path = Path(text)
    if path.is_dir():
        # Present as any entry (a dangling link, a directory): opening it raises what is wrong with it.
        if os.path.lexists(path / INDEX_NAME):
            return _open_sharded(path / INDEX_NAME, name)
        if os.path.lexists(path / SINGLE_NAME):
            if os.path.isdir(path / SINGLE_NAME):
                raise ValueError(f"{path / SINGLE_NAME}: is a directory, where a checkpoint directory holds its "
                                 f"{SINGLE_NAME} file")
            return _open_single(path / SINGLE_NAME, name, read_config_shape(path))
        raise ValueError(_no_checkpoint_message(path))
    check_file(path, "fastembed.io.open_table")
    head = read_head(path)
    if head.startswith(b"\x93NUMPY"):
        if name is not None:
            raise ValueError(f"{path}: a .npy file holds one array; name= must be None")
        return map_npy_rows(path)
    # By content first; the name decides only for bytes of neither format (a damaged GGUF file gets GGUF's message).
    if head.startswith(b"GGUF") or (path.suffix.lower() == ".gguf" and not looks_like_safetensors(head)):
        return map_gguf(path, name)
    if path.name.endswith(".index.json") or (describe(path, head) or "").startswith("is a sharded checkpoint's index"):
        return _open_sharded(path, name)
    return _open_single(path, name, None)


#: File names fastembed opens, by their endings (a shard index: ``*.safetensors.index.json``).
_OPENED_ENDINGS = (".safetensors", ".safetensors.index.json", ".gguf", ".npy")


def _no_checkpoint_message(path: Path) -> str:
    try:
        files = sorted(entry.name for entry in path.iterdir())
    except OSError:
        files = []
    hint = ""
    pickle_index = next((file for file in files if file.endswith(".bin.index.json")), None)
    if pickle_index is not None:
        hint = " " + _pickle_shards_hint(path / pickle_index)
    elif any(file.endswith(PICKLE_SUFFIXES) for file in files):
        pickle = next(file for file in files if file.endswith(PICKLE_SUFFIXES))
        hint = (f" It holds PyTorch pickles ({shorten(f for f in files if f.endswith(PICKLE_SUFFIXES))}), which fastembed "
                f"never unpickles; {_convert_then(path / pickle, path / SINGLE_NAME, 'this directory')}")
    others = [file for file in files if file.endswith(_OPENED_ENDINGS)]
    if others:
        hint += f" Files fastembed opens here (pass one instead): {shorten(others)}."
    return (f"{path}: no checkpoint in this directory: expected {SINGLE_NAME} or {INDEX_NAME}; "
            f"it holds {shorten(files)}.{hint}")


def _convert_then(pickle: Path, target: Path, what: str) -> str:
    return f"{convert_pickle(pickle, target)}; then pass {what} to fastembed.Embedding.from_pretrained."


def _pickle_shards_hint(index_path: Path, weight_map: Mapping[str, Any] | None = None, wanted: str | None = None) -> str:
    """How to use a checkpoint sharded as PyTorch pickles (``pytorch_model-0000N-of-0000M.bin`` and their index).

    Names the shard that the index puts the tensor `wanted` (None: the token embedding) in,
    where it can tell, and how to convert that one shard into a safetensors file fastembed
    then opens.
    """
    if weight_map is None:
        try:
            weight_map = _read_json(index_path, "the index").get("weight_map")
        except (OSError, ValueError):
            weight_map = None
    start = (f"{index_path.name} indexes a checkpoint sharded as PyTorch pickles, which fastembed never unpickles; "
             "fastembed opens safetensors shards (model.safetensors.index.json)")
    if isinstance(weight_map, Mapping):
        names = outside_numbered_layers([n for n, shard in weight_map.items()
                                         if is_embedding_candidate(n) and isinstance(shard, str)])
        best = min(names, key=lambda n: (embedding_rank(n) or 0, n), default=None)  # candidates: never None
        if wanted is not None:
            best = wanted if isinstance(weight_map.get(wanted), str) else None
        if best is not None:
            shard = str(weight_map[best])
            if shard and "/" not in shard and "\\" not in shard and shard not in (".", ".."):
                source = index_path.parent / shard
                target = source.with_suffix(".safetensors")
                return f"{start}. The index puts {best!r} in {shard}; " + _convert_then(source, target, repr(str(target)))
    return (f"{start}. Convert each shard with the safetensors package (safetensors.torch.save_file of "
            "torch.load(shard, map_location='cpu', weights_only=True)) and pass the file holding the token embedding.")


def _open_single(path: Path, name: str | None,
                 expected: tuple[int | None, int | None] | None) -> np.memmap | QuantizedTable:
    from .safetensors import map_safetensors

    if name is not None:
        return map_safetensors(path, name)
    chosen, header = select_in_file(path, expected)
    return _confirmed(map_entry(path, header, chosen), expected, path, chosen)


def _confirmed(table: np.memmap | QuantizedTable, expected: tuple[int | None, int | None] | None, where: Any,
               name: str) -> np.memmap | QuantizedTable:
    """`table`, once its shape agrees with config.json's (`expected`, either value may be unknown).

    Candidates chosen by name were narrowed by that shape already; this
    catches the table a file's ``fastembed.tensor`` metadata names.
    """
    if expected is not None and not _fits(expected, table.shape):
        raise ValueError(f"{where}: config.json gives the token embedding shape {_shape_text(expected)}, but the "
                         f"table {name!r} has shape {tuple(table.shape)} (a config.json of another model?)")
    return table


def select_in_file(path: str | os.PathLike, expected: tuple[int | None, int | None] | None = None) -> tuple[str, Any]:
    """The token embedding of one safetensors file, chosen as :func:`token_embedding_name` does.

    A file fastembed saved names its table in its ``fastembed.tensor`` metadata, which
    wins (the caller confirms its shape against `expected`). Keeps at most :data:`MAX_CANDIDATES` candidate entries of
    each kind (top-level, inside numbered layers) in memory, whatever the header holds;
    more competing candidates than that is a ValueError asking for ``name=``, as for a
    sharded checkpoint.

    Returns:
        (name, the :class:`~fastembed.io.safetensors.SafetensorsHeader` holding its entry).

    Raises:
        FileNotFoundError, ValueError: as :func:`~fastembed.io.safetensors.scan_safetensors_header`
            and :func:`token_embedding_name`.
    """
    two_d: list[str] = []
    # Candidates inside numbered layers never compete with top-level ones (outside_numbered_layers): counted apart.
    counts = {"two_d": 0, "top": 0, "layer": 0}

    not_2d: list[tuple[str, tuple[int, ...]]] = []  # the first candidate names of another rank, for the message

    def keep(name: str, entry: TensorEntry) -> bool:
        if len(entry.shape) != 2:
            if not not_2d and is_embedding_candidate(name):
                not_2d.append((name, entry.shape))
            return False
        counts["two_d"] += 1
        if len(two_d) < NAMES_SHOWN:
            two_d.append(name)
        if not is_embedding_candidate(name):
            return False
        kind = "layer" if in_numbered_layer(name) else "top"
        counts[kind] += 1
        return counts[kind] <= MAX_CANDIDATES

    header = scan_safetensors_header(path, keep=keep)
    tagged = header.metadata.get(TENSOR_KEY)
    if tagged is not None:
        header = scan_safetensors_header(path, keep=_named({tagged, tagged + SCALES_SUFFIX}))
        if tagged not in header.entries:
            raise ValueError(f"{path}: the metadata {TENSOR_KEY} names tensor {tagged!r}, which the header does not hold")
        return tagged, header
    competing = counts["top"] or counts["layer"]
    if competing > MAX_CANDIDATES:
        names = [n for n in header.entries if in_numbered_layer(n) == (counts["top"] == 0)]
        raise ValueError(f"{path}: {competing} tensors are named like token embeddings; pass name= one of {shorten(names, competing)}")
    shapes = {**dict(not_2d), **{n: e.shape for n, e in header.entries.items()}}
    return token_embedding_name(shapes, path, expected, shorten(two_d, counts["two_d"])), header


def _open_sharded(index_path: Path, name: str | None) -> np.memmap | QuantizedTable:
    directory = index_path.parent
    index = _read_json(index_path, "the index")
    _refuse_repeated(index_path, "the index", index, ("weight_map",))
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: the index's weight_map must be an object of tensor name -> shard file name")
    _refuse_repeated(index_path, "the index's weight_map", weight_map)
    if weight_map and all(shard.endswith(PICKLE_SUFFIXES) for shard in weight_map.values()):
        raise ValueError(f"{index_path}: {_pickle_shards_hint(index_path, weight_map, name)}")
    if name is not None:
        if name not in weight_map:
            near = [n for n in weight_map if is_embedding_candidate(n)]
            raise ValueError(f"{index_path}: no tensor named {name!r} in weight_map; tensors named like a token "
                             f"embedding: {shorten(near)}; first tensors: {shorten(weight_map, len(weight_map))}")
        names = [name]
    else:
        names = [n for n in weight_map if is_embedding_candidate(n)]
        names = outside_numbered_layers(names)  # so that an MTP layer's shard is not even read
        if not names:
            raise ValueError(f"{index_path}: no tensor is named like a token embedding "
                             f"({_ENDINGS_TEXT}); pass name=; "
                             f"tensors: {shorten(weight_map, len(weight_map))}")
        if len(names) > MAX_CANDIDATES:
            raise ValueError(f"{index_path}: {len(names)} tensors are named like token embeddings; pass name= one of {shorten(names)}")
    by_shard: dict[str, list[str]] = {}
    for tensor in names:
        by_shard.setdefault(_shard_path(index_path, weight_map[tensor]), []).append(tensor)
    found: dict[str, tuple[str, SafetensorsHeader]] = {}
    tagged: list[str] = []  # tables a shard's fastembed metadata names (a quantized table fastembed saved)
    for shard, tensors in by_shard.items():
        if os.path.islink(shard) and not os.path.exists(shard):
            check_file(shard, "fastembed.io.open_table")  # raises: a link leading nowhere, with its target, or a loop
        if not os.path.exists(shard):
            raise FileNotFoundError(errno.ENOENT, f"{index_path.name} puts {tensors[0]!r} in a shard that is "
                                       "missing (an incomplete download?)", shard)
        if not os.path.isfile(shard):
            raise ValueError(f"{index_path}: the index puts {tensors[0]!r} in {Path(shard).name}, which is "
                             f"{'a directory' if os.path.isdir(shard) else 'not a regular file'}, not a safetensors shard")
        if os.path.samefile(shard, index_path):
            raise ValueError(f"{index_path}: the index puts {tensors[0]!r} in {Path(shard).name}, which is the index "
                             "itself, not a safetensors shard")
        # A quantized table's row scales sit beside it in the same file.
        header = scan_safetensors_header(shard, keep=_named({*tensors, *(t + SCALES_SUFFIX for t in tensors)}))
        for tensor in tensors:
            if tensor not in header.entries:
                raise ValueError(f"{index_path}: the index puts tensor {tensor!r} in {Path(shard).name}, which does not hold it")
            found[tensor] = (shard, header)
        if header.metadata.get(TENSOR_KEY) in tensors:
            tagged.append(header.metadata[TENSOR_KEY])
    if name is not None:
        shard, header = found[name]
        return map_entry(shard, header, name)
    # A table fastembed saved is named in its file's metadata, which wins, as in a single file.
    expected = read_config_shape(directory)
    name = tagged[0] if len(tagged) == 1 else token_embedding_name(
        {n: header.entries[n].shape for n, (_, header) in found.items()}, index_path, expected)
    shard, header = found[name]
    return _confirmed(map_entry(shard, header, name), expected, index_path, name)


def _shard_path(index_path: Path, shard: str) -> str:
    """The shard file named by an index, which must be a plain file name in the index's directory."""
    if not shard or shard in (".", "..") or "/" in shard or "\\" in shard or "\0" in shard:
        raise ValueError(f"{index_path}: the index names shard {shard[:200]!r}; a shard must be a file name in the index's directory")
    return str(index_path.parent / shard)


def _named(names: set[str]) -> Callable[[str, Any], bool]:
    """A header filter that keeps the entries of these tensor names."""
    return lambda name, entry: name in names
