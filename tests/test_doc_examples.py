"""The Python examples of README.md and the user guides run as a user would copy them.

Each block runs in a fresh namespace, in a folder holding the files the
examples name (checkpoints, a ``table.npy``, GGUF files written by the gguf
package), with a stand-in for ``model``, "your loaded model" (a torch module
whose input embedding is a ``torch.nn.Embedding``). A block right after a
``<!-- continues -->`` line runs after the blocks before it, in order, from
the nearest one without that line, in one namespace. cupy examples, and
``to_device``, run on the CuPy double; examples that need a CUDA device skip.

The distributed examples run as the page says: a script named in its first
line under the torchrun command that follows the block, a script with a
``__main__`` block as ``python script.py``, and a fragment that builds a layer
on an existing group in a group of one rank.
"""
from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/loading.md", "docs/quantized.md", "docs/interop.md", "docs/distributed.md")
CONTINUES = "<!-- continues -->"
#: Words in a block that mark it as needing a CUDA device, which the CuPy double cannot stand in for.
NEEDS_CUDA = "a torch CUDA tensor"


def python_blocks(page: str) -> list[tuple[int, str, bool]]:
    """The ```python blocks of `page`: (the line of the fence, the code, whether it continues the one before)."""
    text = (ROOT / page).read_text()
    found = []
    for match in re.finditer(rf"^({re.escape(CONTINUES)}\n)?```python\n(.*?)^```", text, re.S | re.M):
        fence = match.start() + len(match.group(1) or "")
        found.append((text.count("\n", 0, fence) + 1, match.group(2), match.group(1) is not None))
    return found


EXAMPLES = [(page, line) for page in PAGES for line, _, _ in python_blocks(page)]


def test_the_pages_have_the_examples_these_tests_expect():
    counts = {page: len(python_blocks(page)) for page in PAGES}
    assert counts == {"README.md": 1, "docs/loading.md": 12, "docs/quantized.md": 3, "docs/interop.md": 6,
                      "docs/distributed.md": 4}, counts
    for page in PAGES:
        assert not python_blocks(page)[0][2], f"{page}: its first example continues nothing"


def _safetensors(path: Path, tensors: dict) -> None:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def _gguf(path: Path, vocab: int, dim: int) -> None:
    """A Q8_0 token table written by the gguf package, as llama.cpp's converters write one."""
    import gguf

    rows = np.random.default_rng(vocab).standard_normal((vocab, dim)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _sparse_safetensors(path: Path, name: str, shape: tuple[int, int]) -> None:
    """A bfloat16 tensor of `shape` whose bytes are a hole in the file: a full-size table that takes no disk."""
    size = shape[0] * shape[1] * 2
    header = json.dumps({name: {"dtype": "BF16", "shape": list(shape), "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(header)) + header)
        file.truncate(8 + len(header) + size)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The user's working folder, with the files the examples name (vocabularies big enough for their ids)."""
    pytest.importorskip("gguf")
    pytest.importorskip("safetensors")
    tmp_path = tmp_path_factory.mktemp("user")
    table = np.random.default_rng(0).standard_normal((30_000, 64)).astype(np.float16)
    config = json.dumps({"model_type": "llama", "vocab_size": 30_000, "hidden_size": 64})
    for checkpoint in (tmp_path / "path/to/checkpoint", tmp_path / "checkpoint"):
        _safetensors(checkpoint / "model.safetensors", {"model.embed_tokens.weight": table})
        (checkpoint / "config.json").write_text(config)
    shards = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
              "lm_head.weight": "model-00002-of-00002.safetensors"}
    for name, shard in shards.items():
        _safetensors(tmp_path / "path/to" / shard, {name: table})
    (tmp_path / "path/to/model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    _safetensors(tmp_path / "model.safetensors", {"model.embed_tokens.weight": table, "lm_head.weight": table})
    _safetensors(tmp_path / "model-00001-of-000163.safetensors", {"model.embed_tokens.weight": table})
    np.save(tmp_path / "table.npy", table)
    _gguf(tmp_path / "Qwen3-0.6B-Q8_0.gguf", 151_936, 64)
    _gguf(tmp_path / "model.gguf", 128_256, 64)  # a Llama 3 vocabulary: the examples look up id 128,000
    # DeepSeek-V3's token table at full size (the distributed example prints its rows' shape).
    deepseek = tmp_path / "checkpoints/DeepSeek-V3"
    _sparse_safetensors(deepseek / "model.safetensors", "model.embed_tokens.weight", (129_280, 7168))
    (deepseek / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": 129_280,
                                                       "hidden_size": 7168}))
    return tmp_path


@pytest.fixture
def folder(files, tmp_path, monkeypatch) -> Path:
    """The examples run in the folder of the files they name (those that write files write new names); the
    folders they make with ``tempfile.mkdtemp()`` go into the test's own."""
    monkeypatch.chdir(files)
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda suffix=None, prefix=None, dir=None: mkdtemp(suffix, prefix,
                                                                                                 dir or tmp_path))
    return files


def stand_in_model():
    """A loaded model as the interop examples expect one: ``get_input_embeddings()`` and ``embed_tokens``."""
    torch = pytest.importorskip("torch")

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(1000, 64)

        def get_input_embeddings(self):
            return self.embed_tokens

    return Model()


def run_example(code: str, where: str, namespace: dict, request) -> None:
    """Run one block (`where`: its page and line, as tracebacks name it) in `namespace`, with what it needs."""
    if "fastembed.distributed" in code:
        run_distributed_example(code, where, request)
        return
    if NEEDS_CUDA in code:
        pytest.skip("needs a CUDA device: torch CUDA tensors have no stand-in here")
    if re.search(r"\bcupy\b|\.to_device\(", code):
        namespace["cupy"] = request.getfixturevalue("cupy_or_double")  # installed as cupy while the test runs
    if re.search(r"\btorch\b", code):
        pytest.importorskip("torch")
    if re.search(r"\bmodel\.(get_input_embeddings|embed_tokens)\b", code):  # "your loaded model"
        namespace.setdefault("model", stand_in_model())
    if re.search(r"\bjax\b", code):
        pytest.importorskip("jax")
    exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the documentation's own code


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_distributed_example(code: str, where: str, request) -> None:
    """A distributed example as its page runs it: under torchrun, as a script, or on a group of one rank."""
    pytest.importorskip("torch")
    tmp_path = request.getfixturevalue("tmp_path")
    script = re.match(r"# (\w+\.py)\n", code)
    if script:
        _run_under_torchrun(code, where, script.group(1), tmp_path)
    elif '\nif __name__ == "__main__":' in code:
        _run_script(code, where, tmp_path / "example.py", [])
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "rendezvous"), rank=0, world_size=1)
        try:
            exec(compile(code, where, "exec"), {})  # noqa: S102 - the documentation's own code
        finally:
            dist.destroy_process_group()


def _run_under_torchrun(code: str, where: str, name: str, tmp_path: Path) -> None:
    """The script `name` under the torchrun command its page gives after it; it prints the shape its comment gives,
    once per rank."""
    after = (ROOT / where.split(":")[0]).read_text().split(code, 1)[1]
    options = re.search(rf"^\s+\S*torchrun (.*) {re.escape(name)}$", after, re.M)
    assert options, f"{where}: no torchrun command after the block"
    printed = _run_script(code, where, tmp_path / name, ["-m", "torch.distributed.run", *options.group(1).split()])
    shape = re.search(r"# (\(.*?\)) on every rank", code).group(1)
    ranks = int(re.search(r"--nproc-per-node (\d+)", options.group(1)).group(1))
    assert printed.count(shape) == ranks, printed


def _run_script(code: str, where: str, path: Path, launcher: list[str]) -> str:
    """`code` written to `path` and run by a fresh interpreter (through `launcher`'s options); what it printed."""
    # A TCP rendezvous on a port another process may hold: the same example on a port free now.
    path.write_text(re.sub(r"(tcp://127\.0\.0\.1:)\d+", lambda match: f"{match.group(1)}{_free_port()}", code))
    done = subprocess.run([sys.executable, *launcher, str(path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TMPDIR=str(path.parent)))  # its mkdtemp() goes into the test's folder
    assert done.returncode == 0, f"{where}: {done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.parametrize("page, line", EXAMPLES, ids=[f"{page}:{line}" for page, line in EXAMPLES])
def test_the_example_runs(page, line, folder, request):
    """The block, after the blocks it continues (from the nearest one that continues nothing), in order."""
    blocks = python_blocks(page)
    index = next(i for i, (at, _, _) in enumerate(blocks) if at == line)
    head = max(i for i in range(index + 1) if not blocks[i][2])
    namespace: dict = {}
    for at, code, _ in blocks[head:index + 1]:
        run_example(code, f"{page}:{at}", namespace, request)
