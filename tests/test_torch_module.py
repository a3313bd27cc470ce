"""fastembed.torch.Embedding: a drop-in for torch.nn.Embedding, forward through fastembed."""
from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastembed  # noqa: E402
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
    monkeypatch.setattr(fastembed_torch, "_REASONS_SAID", set())


@pytest.fixture(autouse=True)
def fastembed_serves_every_size(request, monkeypatch):
    """The tests' small tables would all be torch's small batches: fastembed's path is what most of them check."""
    if "small_batches" not in request.keywords:
        monkeypatch.setattr(fastembed_torch, "_calling_thread_bytes", lambda: 0)


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


def test_tools_that_read_the_constructors_parameters_see_torchs():
    layer = torch.nn.utils.skip_init(fastembed.torch.Embedding, 10, 4)  # looks for a `device` parameter
    assert type(layer) is fastembed.torch.Embedding and layer.weight.shape == (10, 4)
    assert inspect.signature(fastembed.torch.Embedding) == inspect.signature(torch.nn.Embedding)


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


def test_a_non_contiguous_weight_gives_torchs_result_through_torch_without_a_copy():
    """from_pretrained(w.T) once raised "table must be C-contiguous" where torch.nn.Embedding works."""
    source = torch.randn(4, 10)
    layer = Embedding.from_pretrained(source.T)
    assert layer.weight.data_ptr() == source.data_ptr() and not layer.weight.is_contiguous()  # no copy was made
    ids = torch.tensor([[1, 9], [0, 1]])
    with pytest.warns(UserWarning, match="the weight is not C-contiguous.*never from a copy"):
        rows = layer(ids)
    assert torch.equal(rows, torch.nn.Embedding.from_pretrained(source.T)(ids))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(layer(torch.tensor([3])), source.T[[3]])  # said once
    with pytest.warns(UserWarning, match="autograd needs"):  # another reason is said too, once
        Embedding(5, 2)(torch.tensor([1]))


def test_a_weight_of_a_dtype_fastembed_cannot_view_gives_torchs_result():
    weight = torch.randn(6, 3, dtype=torch.complex64).to(torch.complex32)
    layer = Embedding.from_pretrained(weight)
    with pytest.warns(UserWarning, match="cannot see the torch.complex32 weight as a table without a copy"):
        rows = layer(torch.tensor([5, 0]))
    assert rows.dtype == torch.complex32 and torch.equal(rows.view(torch.int32), weight[[5, 0]].view(torch.int32))
    conjugate = torch.randn(6, 3, dtype=torch.complex64).conj()  # a lazy conjugate: the bit, not the values
    assert torch.equal(Embedding.from_pretrained(conjugate)(torch.tensor([2])), conjugate[[2]])


def test_torch_compile_runs_torchs_embedding_in_the_graph():
    """It once failed inside Dynamo: from_dlpack on a FakeTensor."""
    weight = torch.randn(10, 4)
    compiled = torch.compile(Embedding.from_pretrained(weight), backend="eager", fullgraph=True)  # no graph break
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fastembed")  # compiling is not a fallback to warn about
        assert torch.equal(compiled(torch.tensor([1, 2])), weight[[1, 2]])
        ids = torch.tensor([[9], [0]])
        assert torch.equal(compiled(ids), weight[ids])
    torch.compiler.reset()


def test_traced_graphs_hold_torchs_operation_not_a_constant():
    weight = torch.randn(10, 4)
    model = TinyModel(Embedding.from_pretrained(torch.randn(10, 16))).eval()
    with torch.no_grad():
        traced = torch.jit.trace(model, (torch.tensor([1, 2]),))
        assert torch.equal(traced(torch.tensor([7, 3])), model(torch.tensor([7, 3])))  # a constant would give [1, 2]'s
    symbolic = torch.fx.symbolic_trace(Embedding.from_pretrained(weight))
    assert torch.equal(symbolic(torch.tensor([4])), weight[[4]])
    exported = torch.export.export(Embedding.from_pretrained(weight), (torch.tensor([1, 2]),))
    assert torch.equal(exported.module()(torch.tensor([8, 0])), weight[[8, 0]])


@pytest.mark.parametrize("convert", ["half", "to_bfloat16", "to_float64"])
def test_a_dtype_changed_after_construction_is_gathered(convert):
    reference = torch.nn.Embedding(30, 8, padding_idx=2)
    layer = Embedding(30, 8, padding_idx=2)
    layer.load_state_dict(reference.state_dict())
    dtype = {"half": torch.float16, "to_bfloat16": torch.bfloat16, "to_float64": torch.float64}[convert]
    for module in (reference, layer):
        module.requires_grad_(False)
        module.half() if convert == "half" else module.to(dtype)
    assert layer.weight.dtype == dtype and isinstance(layer.weight, torch.nn.Parameter)
    ids = torch.tensor([[2, 29, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # served by fastembed, not torch
        rows = layer(ids)
    assert rows.dtype == dtype and torch.equal(rows, reference(ids))


def test_constructor_attributes_and_repr_match_torchs():
    for args, kwargs in [((10, 4), {}), ((10, 4), {"padding_idx": -1}), ((7, 3), {"padding_idx": 0, "dtype": torch.float16})]:
        ours, theirs = Embedding(*args, **kwargs), torch.nn.Embedding(*args, **kwargs)
        assert repr(ours) == repr(theirs)
        assert (ours.num_embeddings, ours.embedding_dim, ours.padding_idx) == (theirs.num_embeddings, theirs.embedding_dim,
                                                                               theirs.padding_idx)
        assert isinstance(ours.weight, torch.nn.Parameter) and ours.weight.shape == theirs.weight.shape
        assert isinstance(ours, torch.nn.Embedding)
    assert Embedding(10, 4, padding_idx=-1).padding_idx == 9


def test_a_negative_padding_idx_zeroes_that_row_and_is_served():
    layer = Embedding(10, 4, padding_idx=-2)
    assert layer.padding_idx == 8 and not layer.weight[8].any()
    layer.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = layer(torch.tensor([8, 1]))
    assert not rows[0].any() and torch.equal(rows[1], layer.weight[1])


def test_weight_and_freeze_constructor_arguments():
    weight = torch.randn(12, 5)
    layer = Embedding(12, 5, _weight=weight, _freeze=True)
    assert isinstance(layer.weight, torch.nn.Parameter) and not layer.weight.requires_grad
    assert layer.weight.data_ptr() == weight.data_ptr()  # torch keeps the tensor it is given
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # frozen: fastembed serves with grad mode on
        assert torch.equal(layer(torch.tensor([11, 0])), weight[[11, 0]])
    trainable = Embedding(12, 5, _weight=weight.clone())
    assert trainable.weight.requires_grad
    with pytest.warns(UserWarning, match="autograd"):
        trainable(torch.tensor([1])).sum().backward()
    assert trainable.weight.grad is not None and trainable.weight.grad[1].eq(1).all()


def test_inference_mode_and_int32_ids_are_served_by_fastembed():
    weight = torch.randn(40, 6)
    layer = Embedding.from_pretrained(weight, freeze=False)  # requires grad: only inference mode lets fastembed serve
    assert layer.weight.requires_grad
    ids = torch.tensor([[39, 0], [5, 5]], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode():
            rows = layer(ids)
    assert rows.dtype == torch.float32 and not rows.requires_grad
    assert torch.equal(rows, torch.nn.functional.embedding(ids, weight))
    with torch.no_grad():
        assert torch.equal(layer(ids.to(torch.int64)), rows)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func's own imports
def test_forward_mode_ad_and_torch_func_transforms_give_torchs_results():
    """A frozen weight given a tangent, vmap and jvp: torch's operation carries them (fastembed cannot)."""
    from torch.autograd import forward_ad
    from torch.func import functional_call, jvp, vmap

    weight, tangent, ids = torch.randn(10, 4), torch.randn(10, 4), torch.tensor([1, 3, 1])
    for cls in (torch.nn.Embedding, Embedding):
        layer = cls.from_pretrained(weight)
        with forward_ad.dual_level():
            rows = functional_call(layer, {"weight": forward_ad.make_dual(weight, tangent)}, (ids,))
            assert torch.equal(forward_ad.unpack_dual(rows).tangent, tangent[ids])
        batched = torch.tensor([[1, 2], [3, 4]])
        assert torch.equal(vmap(layer)(batched), weight[batched])
        _, pushed = jvp(lambda w: functional_call(layer, {"weight": w}, (ids,)), (weight,), (tangent,))  # noqa: B023
        assert torch.equal(pushed, tangent[ids])


def test_a_lazily_negated_weight_gives_torchs_values():
    """torch's negation bit (conj().imag, _neg_view): the memory holds the other sign, so torch's embedding serves."""
    base = torch.arange(12.0).reshape(4, 3)
    negated = base._neg_view()
    assert negated.is_neg()
    with pytest.warns(UserWarning, match="lazy conjugate or negation"):
        assert torch.equal(Embedding.from_pretrained(negated)(torch.tensor([1])), -base[[1]])


def test_lazily_negated_ids_give_torchs_rows_through_fastembed():
    weight = torch.arange(12.0).reshape(4, 3)
    ids = torch.tensor([-1, -3])._neg_view()  # holds [1, 3]
    assert ids.is_neg()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # served by fastembed: no fallback said
        assert torch.equal(Embedding.from_pretrained(weight)(ids), torch.nn.Embedding.from_pretrained(weight)(ids))


class _Wrapped(torch.Tensor):
    """A wrapper subclass (as DTensor and torchao's tensors are): its own memory does not hold its values."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, _Wrapped) else x  # noqa: E731
        result = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return _Wrapped(result) if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) else result


class _ProjectParameter(torch.nn.Parameter):
    """A parameter subclass defined outside torch, over real memory."""


def test_tensor_subclasses_get_torchs_own_result():
    weight = torch.randn(10, 4)
    ids = torch.tensor([1, 7])
    wrapped = Embedding.from_pretrained(_Wrapped(weight.clone()))
    assert torch.equal(torch.as_tensor(wrapped(ids)), weight[ids])
    layer = Embedding(10, 4)
    layer.weight = _ProjectParameter(weight.clone(), requires_grad=False)
    result = layer(ids)
    assert type(result) is torch.Tensor and torch.equal(result, weight[ids])


def test_lookup_refuses_a_tensor_dispatched_in_python_and_reads_other_subclasses_as_tensors():
    weight = torch.randn(10, 4)
    with pytest.raises(TypeError, match="dispatches to Python"):
        fastembed.lookup(_Wrapped(weight.clone()), [1])
    result = fastembed.lookup(_ProjectParameter(weight.clone(), requires_grad=False), [1, 7])
    assert type(result) is torch.Tensor and torch.equal(result, weight[[1, 7]])


def _zero_tensor(shape, dtype=torch.float32):
    return torch._efficientzerotensor(shape, dtype=dtype)


def _functional(tensor):
    return torch._to_functional_tensor(tensor)


@pytest.mark.parametrize("make", [_zero_tensor, lambda shape: _functional(torch.randn(shape))],
                         ids=["zero tensor", "functionalization wrapper"])
def test_tensors_whose_memory_is_not_their_values_get_torchs_result_and_lookup_refuses_them(make):
    """A ZeroTensor's storage says it holds bytes it does not; a functionalization wrapper's values live in the
    tensor it wraps: fastembed read garbage, or zeros, from them."""
    weight = make((256, 1024))
    ids = torch.randint(0, 256, (1100,))  # above the small-gather bytes: fastembed's own gather
    with torch.no_grad():
        expected = torch.nn.Embedding.from_pretrained(weight)(ids)
        assert torch.equal(Embedding.from_pretrained(weight)(ids), expected)
    with pytest.raises(TypeError, match="ZeroTensor|functionalization"):
        fastembed.lookup(weight, ids)


def test_zero_tensor_ids_get_torchs_result_and_lookup_refuses_them():
    weight = torch.randn(256, 1024)
    ids = _zero_tensor((1100,), torch.long)
    with torch.no_grad():
        assert torch.equal(Embedding.from_pretrained(weight)(ids), weight[torch.zeros(1100, dtype=torch.long)])
    with pytest.raises(TypeError, match="ZeroTensor"):
        fastembed.lookup(weight, ids)


def test_a_weight_that_is_not_2d_gets_torchs_error():
    layer = Embedding(256, 4).requires_grad_(False)  # an inference layer: fastembed's path, not training's
    layer.weight.data = torch.randn(256 * 4)
    with pytest.raises(RuntimeError, match="2-D"):
        layer(torch.tensor([1, 2]))


def test_under_a_fake_tensor_mode_the_result_is_torchs():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = Embedding(1000, 64).requires_grad_(False)
        result = layer(torch.tensor([3, 5]))
    assert isinstance(result, FakeTensor) and tuple(result.shape) == (2, 64)


@pytest.mark.parametrize("ids", [torch.tensor([1], dtype=torch.uint8), torch.tensor([1], dtype=torch.int16), [1]],
                         ids=["uint8", "int16", "list"])
def test_ids_torch_refuses_are_refused_alike_in_training_and_inference(ids):
    layer = Embedding(10, 4)
    errors = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises((RuntimeError, TypeError)) as caught:
            layer(ids)
        errors.append(type(caught.value))
    assert errors[0] is errors[1]


def test_max_norm_set_after_construction_renormalizes_as_torch_does(fallback_not_said_yet):
    weight = torch.randn(10, 4) * 10
    ids = torch.tensor([1, 2])
    ours, theirs = Embedding.from_pretrained(weight.clone()), torch.nn.Embedding.from_pretrained(weight.clone())
    ours.max_norm = theirs.max_norm = 1.0
    with torch.no_grad(), pytest.warns(UserWarning, match="max_norm is 1.0") as said:
        assert torch.equal(ours(ids), theirs(ids))
    assert said[0].filename == __file__  # the warning names the caller's line
    assert torch.equal(ours.weight, theirs.weight)
    swapped = torch.nn.Embedding.from_pretrained(weight.clone(), max_norm=1.0)
    swapped.__class__ = Embedding
    with torch.no_grad():
        assert torch.equal(swapped(ids), theirs(ids))


def test_the_layer_scripts_with_torchscript():
    layer = Embedding.from_pretrained(torch.randn(10, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(layer)
    ids = torch.tensor([[1, 9]])
    assert torch.equal(scripted(ids), layer(ids))


def test_nested_and_sparse_ids_give_torchs_result_or_error():
    weight = torch.randn(30, 8)
    nested = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    for cls in (torch.nn.Embedding, Embedding):
        rows = cls.from_pretrained(weight)(nested)
        assert rows.is_nested and all(torch.equal(part, weight[ids]) for part, ids in zip(rows.unbind(), nested.unbind(), strict=True))
    sparse = torch.tensor([[0, 1]]).to_sparse()
    with pytest.raises(RuntimeError) as expected:
        torch.nn.Embedding.from_pretrained(weight)(sparse)
    with pytest.raises(RuntimeError, match=str(expected.value)):
        Embedding.from_pretrained(weight)(sparse)


@pytest.mark.small_batches
def test_batches_below_the_small_gather_size_are_torchs_own_embedding(monkeypatch):
    """Below it fastembed would gather on the calling thread alone, where torch's embedding is at least as fast."""
    from fastembed import dispatch

    calls = []
    monkeypatch.setattr(fastembed_torch, "lookup", lambda *args: calls.append(args) or fastembed.lookup(*args))
    below = fastembed_torch._calling_thread_bytes()
    assert below == dispatch.small_gather_for_ndarray(np.empty((1, 1), np.float16))[3] > 0
    weight = torch.randn(4096, 64)  # 256-byte rows
    layer = Embedding.from_pretrained(weight)
    with torch.inference_mode():
        small = torch.randint(0, 4096, (max(1, below // 256 - 1),))
        assert torch.equal(layer(small), weight[small]) and not calls
        for wrong in (torch.tensor([4096]), torch.tensor([-1])):
            with pytest.raises(IndexError, match="index out of range in self"):  # torch's own error, as nn.Embedding's
                layer(wrong)
        if below < 4096 * 256 * 4:  # the numpy backend's take serves every size: torch's embedding does too
            large = torch.randint(0, 4096, (below // 256 + 1,))
            assert torch.equal(layer(large), weight[large]) and len(calls) == 1


@pytest.mark.small_batches
def test_a_backend_setting_fastembed_cannot_use_leaves_the_calls_torch_serves_alone(monkeypatch):
    """Training, and every other call torch serves, never asks the dispatcher; fastembed's own calls raise its error."""
    from fastembed import dispatch

    monkeypatch.setenv("FASTEMBED_BACKEND", "bogus")
    dispatch.read_environment()
    try:
        layer = Embedding(10, 4)
        with pytest.warns(UserWarning, match="autograd"):
            layer(torch.tensor([1, 2])).sum().backward()
        assert layer.weight.grad is not None
        with torch.inference_mode(), pytest.raises(ValueError, match="unknown backend in FASTEMBED_BACKEND='bogus'"):
            layer(torch.tensor([1, 2]))
    finally:
        monkeypatch.delenv("FASTEMBED_BACKEND")
        dispatch.read_environment()


@pytest.mark.small_batches
@pytest.mark.parametrize("n_ids", [3, 600])
def test_a_backend_setting_that_cannot_serve_a_cpu_weight_leaves_the_layer_to_torch_and_says_so(monkeypatch, n_ids):
    """FASTEMBED_BACKEND=cuda, set for a model's GPU tables (here without cupy, or on a CPU weight with it):
    a decode step and a batch fastembed would serve alike get torch's result, with one warning naming the setting."""
    from fastembed import dispatch

    monkeypatch.setenv("FASTEMBED_BACKEND", "cuda")
    monkeypatch.setattr(dispatch.BACKENDS["cuda"], "unavailable_reasons", lambda: ["no GPU in this test"])
    dispatch.refresh()
    try:
        layer, reference = Embedding(1000, 1024).requires_grad_(False), torch.nn.Embedding(1000, 1024)
        reference.weight.data = layer.weight.data
        ids = torch.randint(0, 1000, (n_ids,))
        with torch.inference_mode(), pytest.warns(UserWarning, match=r"FASTEMBED_BACKEND names a backend that cannot "
                                                                     r"serve a CPU weight \(backend 'cuda' cannot serve"):
            assert torch.equal(layer(ids), reference(ids))
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            assert torch.equal(layer(ids), reference(ids))
    finally:
        monkeypatch.undo()
        dispatch.refresh()


@pytest.mark.parametrize("ndim", [63, 64, 65])
def test_ids_of_as_many_dimensions_as_torch_takes_get_torchs_result(ndim):
    layer, reference = Embedding(1000, 1024).requires_grad_(False), torch.nn.Embedding(1000, 1024)
    reference.weight.data = layer.weight.data
    ids = torch.randint(0, 1000, (1,) * (ndim - 1) + (600,))
    with torch.inference_mode():
        rows = layer(ids)
        assert rows.dim() == ndim + 1 and torch.equal(rows, reference(ids))
    if ndim > 63:
        with pytest.raises(ValueError, match=f"ids have {ndim} dimensions; at most 63"):
            fastembed.lookup(layer.weight.detach(), ids)


def test_a_weight_swapped_for_one_fastembed_cannot_read_during_forward_gets_a_result_not_an_error():
    """The forward checked the live weight and then looked up rows of it again: a `.data =` of a column-major
    weight in between (another thread's, or a loader's) raised ValueError. Every moment of the call is tried."""
    from helpers import in_fastembed, interrupted_runs

    values = torch.randn(2000, 64)
    ids = torch.randint(0, 2000, (600,))
    run: dict = {}

    def prepare():
        run.update(layer=Embedding.from_pretrained(values.clone(), freeze=True), column_major=values.t().contiguous().t())

    def forward():
        run["rows"] = run["layer"](ids)

    def another_thread():
        run["layer"].weight.data = run["column_major"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own embedding serving the column-major weight, said
        prepare()
        for n in interrupted_runs(in_fastembed, forward, another_thread):
            assert torch.equal(run["rows"], values[ids]), f"moment {n}"
            prepare()
        assert torch.equal(run["rows"], values[ids])


def test_a_weight_swapped_by_another_thread_during_forward_frees_nothing_the_gather_reads(tmp_path):
    """``weight.data = other`` frees the old storage once nothing holds it: the lookup's view must hold it."""
    from helpers import run_script

    script = '''
import threading, time
import numpy as np, torch, fastembed, fastembed.torch
V, D = 2048, 512
ids = torch.from_numpy(np.random.default_rng(0).integers(0, V, 8192))
layer = fastembed.torch.Embedding(V, D).requires_grad_(False)
def table(k):  # row r holds r + 10000 k
    return (torch.arange(V, dtype=torch.float32)[:, None] + k * 10000).repeat(1, D)
layer.weight.data = table(0)
layer(ids)
fastembed.wait_for_compiles(60)
stop, wrong, calls = threading.Event(), [0], [0]
def forward_in_a_loop():
    while not stop.is_set():
        rows = layer(ids)
        calls[0] += 1
        wrong[0] += not bool((((rows - ids[:, None].float()) % 10000) == 0).all())
thread = threading.Thread(target=forward_in_a_loop)
thread.start()
deadline, give_up, k = time.monotonic() + 2, time.monotonic() + 120, 0
while (time.monotonic() < deadline or calls[0] <= 10) and time.monotonic() < give_up:  # 2 s and 10 calls at least
    k += 1
    layer.weight.data = table(k % 50)
    time.sleep(0.0005)
stop.set()
thread.join()
print(calls[0], wrong[0])
'''
    completed = run_script(tmp_path, script)
    assert completed.returncode == 0, completed.stderr[-2000:]
    calls, wrong = map(int, completed.stdout.split())
    assert calls > 10 and wrong == 0


def test_a_first_call_inside_a_torch_func_transform_does_not_turn_fastembed_off_for_the_dtype(monkeypatch):
    """The dtype probe ran in the caller's transform, failed there, and marked float32 as never viewable: every later
    call of every layer went to torch's gather."""
    monkeypatch.setattr(fastembed_torch, "_VIEWABLE", {})
    layer = Embedding.from_pretrained(torch.randn(100, 16))
    head = torch.nn.Linear(16, 1)
    ids = torch.randint(0, 100, (4, 8))
    torch.func.grad(lambda params: torch.func.functional_call(head, params, (layer(ids),)).sum())(
        dict(head.named_parameters()))
    assert fastembed_torch._VIEWABLE == {torch.float32: True}  # probed outside the transform
    served = []
    monkeypatch.setattr(fastembed_torch, "lookup", lambda *args: served.append(1) or fastembed.lookup(*args))
    with torch.inference_mode():
        assert torch.equal(layer(ids), layer.weight[ids])
    assert served == [1]


def test_a_probe_that_fails_for_a_reason_not_the_dtypes_is_asked_again(monkeypatch):
    """A RecursionError near the stack's limit was read as 'this dtype cannot be viewed', for good."""
    from fastembed.arrays import torch_adapter

    monkeypatch.setattr(fastembed_torch, "_VIEWABLE", {})
    real = torch_adapter._numpy_view
    monkeypatch.setattr(torch_adapter, "_numpy_view", lambda *args: (_ for _ in ()).throw(RecursionError("deep")))
    with pytest.raises(RecursionError):
        torch_adapter.ADAPTER.snapshot(torch.zeros(2, 2))  # the caller's stack, not the dtype: not a TypeError
    layer = Embedding.from_pretrained(torch.randn(10, 4))
    assert torch.equal(layer(torch.tensor([3])), layer.weight[[3]])  # torch served, the probe having failed
    monkeypatch.setattr(torch_adapter, "_numpy_view", real)
    served = []
    monkeypatch.setattr(fastembed_torch, "lookup", lambda *args: served.append(1) or fastembed.lookup(*args))
    assert torch.equal(layer(torch.tensor([3])), layer.weight[[3]]) and served == [1]


def test_a_padding_idx_the_weight_no_longer_has_is_refused_as_torch_refuses_it():
    layer = Embedding(10, 4, padding_idx=8).requires_grad_(False)
    layer.weight = torch.nn.Parameter(torch.randn(5, 4), requires_grad=False)  # a smaller table, the old padding_idx
    with pytest.raises(AssertionError, match="Padding_idx must be within num_embeddings"):
        layer(torch.tensor([1, 2]))


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_a_sparse_weight_is_torchs_to_serve_or_refuse(layout):
    dense = torch.randn(10, 4)
    weight = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    reference = torch.nn.Embedding.from_pretrained(weight)
    layer = Embedding.from_pretrained(weight)
    ids = torch.tensor([1, 7])
    try:
        expected = reference(ids)
    except Exception as error:  # noqa: BLE001 - whatever torch raises, the drop-in raises too
        with pytest.raises(type(error)):
            layer(ids)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no advice to make a sparse weight contiguous
            assert torch.equal(layer(ids).to_dense(), expected.to_dense())


def test_a_fallback_warning_a_filter_raises_is_raised_on_every_call():
    """Under -W error the first training call raised and the second passed: the warning counted as said."""
    layer = Embedding(10, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with pytest.raises(UserWarning, match="autograd"):
                layer(torch.tensor([1]))


@pytest.mark.parametrize("weight_state", ["no rows", "storage freed"])
def test_a_weight_torch_refuses_whatever_the_ids_gets_torchs_error_at_every_batch_size(weight_state):
    """fastembed's IndexError or ValueError came for the calls fastembed served, torch's RuntimeError for the others."""
    def layer_of(kind):
        layer = kind.from_pretrained(torch.randn(0 if weight_state == "no rows" else 100, 16))
        if weight_state == "storage freed":
            layer.weight.untyped_storage().resize_(0)  # as FSDP frees parameters
        return layer

    ids = torch.zeros(64, dtype=torch.int64)
    with pytest.raises(Exception) as torchs:  # noqa: PT011 - whatever torch raises
        layer_of(torch.nn.Embedding)(ids)
    with pytest.raises(type(torchs.value)):
        layer_of(Embedding)(ids)


def test_a_weight_whose_storage_was_shrunk_part_of_the_way_is_refused_not_read_past():
    """torch reads past the end of such a storage; handing it to torch returned freed memory."""
    layer = Embedding.from_pretrained(torch.randn(1000, 16))
    layer.weight.untyped_storage().resize_(500 * 16 * 4)  # half the rows' bytes
    with pytest.raises(ValueError, match="storage was shrunk or freed"):
        layer(torch.tensor([999, 5]))
