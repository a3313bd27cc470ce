"""fastembed.torch.Embedding: a drop-in for torch.nn.Embedding, forward through fastembed."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

import fastembed.torch as fastembed_torch  # noqa: E402  (needs torch)
from fastembed.torch import Embedding  # noqa: E402


class TinyModel(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.embed = layer
        self.proj = torch.nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids)).sum(-1)


@pytest.fixture(autouse=True)
def fallback_not_said_yet(monkeypatch):
    monkeypatch.setattr(fastembed_torch, "_FALLBACK_SAID", False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_swapped_layer_gives_bit_identical_outputs(dtype):
    torch.manual_seed(0)
    reference = TinyModel(torch.nn.Embedding(300, 16, padding_idx=0, dtype=dtype)).eval()
    swapped = TinyModel(Embedding(300, 16, padding_idx=0, dtype=dtype)).eval()
    swapped.load_state_dict(reference.state_dict())  # the same keys
    assert list(swapped.state_dict()) == list(reference.state_dict())
    swapped.proj.to(dtype), reference.proj.to(dtype)
    ids = torch.randint(0, 300, (3, 7))
    with torch.no_grad():
        rows, expected = swapped.embed(ids), reference.embed(ids)
        assert rows.dtype == dtype and rows.shape == (3, 7, 16)
        assert torch.equal(rows.view(torch.int8 if dtype != torch.float32 else torch.int32),
                           expected.view(torch.int8 if dtype != torch.float32 else torch.int32))
        assert torch.equal(swapped(ids), reference(ids))


def test_from_pretrained_frozen_gathers_through_fastembed_without_copying():
    weight = torch.randn(50, 8)
    layer = Embedding.from_pretrained(weight, freeze=True)
    assert not layer.weight.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: fastembed serves even with grad mode on
        rows = layer(torch.tensor([4, 49, 0]))
    assert torch.equal(rows, weight[[4, 49, 0]])
    layer.weight.data[4] += 1  # the layer reads the weight's memory: a copy would not see this
    assert torch.equal(layer(torch.tensor([4])), weight[[4]])


def test_training_falls_back_to_torch_and_says_so_once():
    layer = Embedding(20, 4)
    ids = torch.tensor([[1, 2], [3, 1]])
    with pytest.warns(UserWarning, match="autograd needs the weight's gradient"):
        out = layer(ids)
    out.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad[1].eq(2).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(ids)  # said once only
    with torch.no_grad():
        assert torch.equal(layer(ids), torch.nn.functional.embedding(ids, layer.weight))


@pytest.mark.parametrize("option", [{"max_norm": 1.0}, {"sparse": True}, {"scale_grad_by_freq": True}])
def test_unsupported_options_are_named(option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"does not support {name}="):
        Embedding(10, 4, **option)
    with pytest.raises(ValueError, match=f"does not support {name}="):
        Embedding.from_pretrained(torch.zeros(10, 4), **option)


def test_bad_ids_raise_the_fastembed_error():
    layer = Embedding.from_pretrained(torch.zeros(10, 4))
    with pytest.raises(IndexError, match="id 10 at position 1"):
        layer(torch.tensor([0, 10]))


def test_import_fastembed_does_not_import_torch():
    code = "import sys, fastembed; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_the_module_example_runs():
    import doctest

    failures, attempted = doctest.testmod(fastembed_torch, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert failures == 0 and attempted >= 2
