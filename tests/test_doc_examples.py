"""The Python examples of README.md, docs/quantized.md and docs/interop.md run as a user would copy them.

Each block runs in a fresh namespace, in a folder holding the files the
examples name (a GGUF ``model.gguf`` written by the gguf package), with a
stand-in for ``model``, "your loaded model" (a torch module whose input
embedding is a ``torch.nn.Embedding``). A block without an import continues
the example at the top of its page: it runs in that example's namespace.
cupy examples run on the CuPy double; examples that need a CUDA device skip.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/quantized.md", "docs/interop.md")
#: Words in a block that mark it as needing a CUDA device, which the CuPy double cannot stand in for.
NEEDS_CUDA = "a torch CUDA tensor"
#: The vocabulary of the stand-in model.gguf: the examples look up ids up to 128,000 (a Llama 3 vocabulary).
GGUF_VOCAB, GGUF_DIM = 128_256, 64


def python_blocks(page: str) -> list[tuple[int, str]]:
    """The ```python blocks of `page`: (the line of the fence, the code)."""
    text = (ROOT / page).read_text()
    found = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        found.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return found


def imports(code: str) -> bool:
    return re.search(r"^(import|from) ", code, re.M) is not None


EXAMPLES = [(page, line) for page in PAGES for line, _ in python_blocks(page)]


def test_the_pages_have_the_examples_these_tests_expect():
    counts = {page: len(python_blocks(page)) for page in PAGES}
    assert counts["README.md"] >= 1 and counts["docs/quantized.md"] >= 3 and counts["docs/interop.md"] >= 6, counts
    for page in PAGES:
        first = python_blocks(page)[0][1]
        assert imports(first), f"{page}: its first example imports nothing, so the blocks after it have nothing to continue"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The user's working folder, with the files the examples name."""
    gguf = pytest.importorskip("gguf")
    rows = np.random.default_rng(0).standard_normal((GGUF_VOCAB, GGUF_DIM)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.chdir(tmp_path)
    return tmp_path


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


def run_example(code: str, namespace: dict, request) -> dict:
    if NEEDS_CUDA in code:
        pytest.skip("needs a CUDA device: torch CUDA tensors have no stand-in here")
    if re.search(r"^import cupy|^import .*\bcupy\b", code, re.M):
        namespace["cupy"] = request.getfixturevalue("cupy_or_double")
        code = re.sub(r"\bcupy, ", "", code, count=1)  # the double stands in for the import
    if re.search(r"\b(torch|model)\b", code):
        pytest.importorskip("torch")
        namespace.setdefault("model", stand_in_model())
    if re.search(r"\bjax\b", code):
        pytest.importorskip("jax")
    exec(compile(code, "<example>", "exec"), namespace)  # noqa: S102 - the documentation's own code
    return namespace


@pytest.mark.parametrize("page, line", EXAMPLES, ids=[f"{page}:{line}" for page, line in EXAMPLES])
def test_the_example_runs(page, line, folder, request):
    blocks = dict(python_blocks(page))
    code = blocks[line]
    namespace: dict = {}
    if not imports(code):  # a continuation of the page's first example
        first_line, first = python_blocks(page)[0]
        run_example(first, namespace, request)
    run_example(code, namespace, request)
