"""torch CUDA tensors served by the cuda backend, zero-copy, on torch's current stream.

Every test takes the ``tc`` fixture: real torch CUDA tensors and the real cupy
where both see a GPU; otherwise the CuPy test double (tests/cupy_double) with
the torch CUDA double over its device memory (tests/torch_cuda_double.py).
fastembed's code is the same either way; the doubles stand in for the CUDA
runtimes. Tests that only a GPU can answer skip here, saying why.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI installs its CPU build: .ci/run)")

import fastembed  # noqa: E402
from cupy_double import is_double  # noqa: E402
from fastembed.arrays import torch_adapter  # noqa: E402
from fastembed.backends import cuda_backend  # noqa: E402
from fastembed.formats import QuantizedTable  # noqa: E402
from fastembed.tables import random_quantized_table  # noqa: E402
from helpers import in_fastembed, interrupted_runs  # noqa: E402
from torch_cuda_double import TorchCuda, installed, real_torch_cuda  # noqa: E402

VOCAB, DIM = 97, 24
BITS = {torch.float16: torch.int16, torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int8: torch.int8,
        torch.float8_e4m3fn: torch.uint8}


@pytest.fixture
def tc(cupy_or_double):
    if not is_double(cupy_or_double):
        if not real_torch_cuda():
            pytest.skip("cupy sees a GPU but this torch is a CPU build")
        yield TorchCuda(cupy_or_double, False)
        return
    if real_torch_cuda():
        pytest.skip("torch sees a GPU but cupy does not: install cupy to run these on the device")
    with installed(cupy_or_double) as cuda:
        yield cuda


def host_table(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 128, (VOCAB, DIM), dtype=torch.int8, generator=generator)
    return (torch.randn((VOCAB, DIM), generator=generator) + 0.5).to(dtype)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, tc: TorchCuda) -> None:
    assert isinstance(actual, torch.Tensor) and actual.is_cuda, type(actual)
    host = tc.to_host(actual)
    assert host.dtype == expected.dtype and host.shape == expected.shape, (host.dtype, host.shape)
    assert torch.equal(host.view(BITS[host.dtype]), expected.view(BITS[expected.dtype]))


@pytest.fixture
def gathers(monkeypatch):
    """Every cuda backend call: its result's pointer, cupy's current stream and device meanwhile, the ids."""
    calls: list[dict] = []
    backend = cuda_backend.BACKEND

    def spy(method):
        def call(table, ids, out, *args):
            import cupy

            result = method(table, ids, out, *args)
            calls.append({"result_ptr": result.data.ptr, "out": out, "ids": ids, "device": cupy.cuda.Device().id,
                          "stream": cupy.cuda.get_current_stream().ptr, "table_ptr": getattr(table, "data", None)})
            return result

        return call

    monkeypatch.setattr(backend, "gather", spy(backend.gather))
    monkeypatch.setattr(backend, "dequantize", spy(backend.dequantize))
    return calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ids_shape", [(6,), (2, 3)])
def test_a_torch_cuda_table_gathers_bit_exact_into_a_torch_cuda_tensor(tc, gathers, dtype, ids_dtype, ids_shape):
    host = host_table(dtype)
    table = tc.to_cuda(host)
    host_ids = torch.tensor([5, 96, 0, 41, 41, 17], dtype=ids_dtype).reshape(ids_shape)
    result = fastembed.lookup(table, tc.to_cuda(host_ids))
    assert result.device == table.device and result.dtype == dtype and result.shape == ids_shape + (DIM,)
    assert_bit_equal(result, host[host_ids.long()], tc)
    assert result.data_ptr() == gathers[-1]["result_ptr"]  # the cupy output itself, not a copy
    assert gathers[-1]["device"] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_out_is_written_in_place_and_returned(tc, gathers, dtype):
    host = host_table(dtype, seed=1)
    table, ids = tc.to_cuda(host), tc.to_cuda(torch.tensor([[3, 1], [96, 3]]))
    out = tc.empty((2, 2, DIM), dtype)
    address = out.data_ptr()
    assert fastembed.lookup(table, ids, out=out) is out
    assert out.data_ptr() == address == gathers[-1]["result_ptr"]
    assert_bit_equal(out, host[torch.tensor([[3, 1], [96, 3]])], tc)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_snapshots_share_the_tensor_memory(tc, dtype):
    table = tc.to_cuda(host_table(torch.float32).to(dtype))
    view = torch_adapter.ADAPTER.snapshot(table)
    assert type(view).__module__.partition(".")[0] == "cupy"
    assert view.data.ptr == table.data_ptr() and view.shape == (VOCAB, DIM) and view.device.id == 0
    assert view.dtype == {torch.float16: np.float16, torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8}[dtype]
    result = fastembed.lookup(table, tc.to_cuda(torch.tensor([4, 2])))
    assert result.dtype == dtype
    assert_bit_equal(result, host_table(torch.float32).to(dtype)[[4, 2]], tc)


def test_the_gather_runs_on_torchs_current_stream(tc, gathers):
    table, ids = tc.to_cuda(host_table(torch.float16)), tc.to_cuda(torch.tensor([1, 2, 3]))
    fastembed.lookup(table, ids)
    assert gathers[-1]["stream"] == torch.cuda.current_stream(0).cuda_stream
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        result = fastembed.lookup(table, ids)
        rows = fastembed.Embedding(table)(ids)
        out = tc.empty((3, DIM), torch.float16)
        fastembed.lookup(table, ids, out=out)
    assert side.cuda_stream != 0
    assert [call["stream"] for call in gathers[-3:]] == [side.cuda_stream] * 3
    if tc.is_double:
        import torch_cuda_double

        assert tc.launch_streams()[-3:] == [side.cuda_stream] * 3  # the kernel launches themselves
        assert not torch_cuda_double.stream_waits and not tc.cupy.stream_waits  # no cross-stream event added
    torch.cuda.current_stream(0).wait_stream(side) if not tc.is_double else None
    for gathered in (result, rows, out):
        assert_bit_equal(gathered, host_table(torch.float16)[[1, 2, 3]], tc)
    assert tc.cupy.cuda.get_current_stream().ptr == 0  # cupy's own current stream is back


def test_host_ids_are_copied_to_the_tables_device(tc, gathers):
    host = host_table(torch.float32)
    table = tc.to_cuda(host)
    for ids in ([7, 0, 96], np.array([[7, 0], [96, 1]], np.int32), torch.tensor([7, 0, 96], dtype=torch.int16)):
        result = fastembed.lookup(table, ids)
        assert_bit_equal(result, host[torch.as_tensor(np.asarray(ids)).long()], tc)
        copied = gathers[-1]["ids"]
        assert type(copied).__module__.partition(".")[0] == "cupy" and copied.device.id == 0
    ids16 = tc.to_cuda(torch.tensor([[5, 6]], dtype=torch.int16))  # device ids of another dtype: converted there
    assert_bit_equal(fastembed.lookup(table, ids16), host[torch.tensor([[5, 6]])], tc)


def test_devices_are_never_mixed(tc):
    host = host_table(torch.float32)
    table = tc.to_cuda(host)
    with pytest.raises(TypeError, match="out lives on cpu but the table lives on cuda:0"):
        fastembed.lookup(table, [1], out=torch.empty((1, DIM)))
    with pytest.raises(TypeError, match="ids live on cuda:0 but the table lives on cpu"):
        fastembed.lookup(host, tc.to_cuda(torch.tensor([1])))
    with pytest.raises(TypeError, match="out lives on cuda:0 but the table lives on cpu"):
        fastembed.lookup(host, [1], out=tc.empty((1, DIM), torch.float32))
    if torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device only")
    with pytest.raises(TypeError, match="ids live on cuda:1 but the table lives on cuda:0"):
        fastembed.lookup(table, tc.to_cuda(torch.tensor([1]), 1))
    with pytest.raises(TypeError, match="out lives on cuda:1 but the table lives on cuda:0"):
        fastembed.lookup(table, [1], out=tc.empty((1, DIM), torch.float32, 1))


def test_a_table_on_a_second_device_is_served_there(tc, gathers):
    if torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device only")
    host = host_table(torch.float16)
    table = tc.to_cuda(host, 1)
    side = torch.cuda.Stream(1)
    with torch.cuda.stream(side), torch.cuda.device(0):  # torch's current device is not the table's
        result = fastembed.lookup(table, tc.to_cuda(torch.tensor([3, 9]), 1))
    assert result.device == torch.device("cuda", 1)
    assert gathers[-1]["device"] == 1 and gathers[-1]["stream"] == side.cuda_stream
    assert_bit_equal(result, host[[3, 9]], tc)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_bad_ids_raise_and_the_device_stays_usable(tc, ids_dtype):
    host = host_table(torch.float16)
    table = tc.to_cuda(host)
    with pytest.raises(IndexError, match=rf"id {VOCAB} at position \(1, 0\) is out of range"):
        fastembed.lookup(table, tc.to_cuda(torch.tensor([[1, 2], [VOCAB, 3]], dtype=ids_dtype)))
    with pytest.raises(IndexError, match="id -1 at position 1"):
        fastembed.lookup(table, [0, -1])
    assert_bit_equal(fastembed.lookup(table, tc.to_cuda(torch.tensor([4], dtype=ids_dtype))), host[[4]], tc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16])
def test_float_ids_are_refused_on_the_device_as_on_the_host(tc, dtype):
    """bfloat16 and float8 tensors travel as unsigned words: their own dtype, not their snapshot's, says they are no ids."""
    table = tc.to_cuda(host_table(torch.float32))
    ids = torch.tensor([0.015625, 1.0], dtype=torch.float32).to(dtype)
    for given in (ids, tc.to_cuda(ids)):
        with pytest.raises(TypeError, match=f"ids must be integers, got (non-integer|floating) dtype {str(dtype).removeprefix('torch.')}$"):
            fastembed.lookup(table, given)
    with pytest.raises(TypeError, match=r"data must be a uint8 array .*got torch\.\w+ of dtype float8_e4m3fn"):
        QuantizedTable(tc.to_cuda(torch.zeros((4, 34), dtype=torch.uint8).view(torch.float8_e4m3fn)), "q8_0", 32)


def test_zero_size_tensors(tc):
    host = host_table(torch.float16)
    table = tc.to_cuda(host)
    for shape, dtype in (((0,), torch.int64), ((0, 3), torch.int32), ((2, 0), torch.int16)):
        result = fastembed.lookup(table, tc.to_cuda(torch.empty(shape, dtype=dtype)))
        assert result.is_cuda and result.dtype == torch.float16 and tuple(result.shape) == shape + (DIM,)
    out = tc.empty((0, DIM), torch.float16)
    assert fastembed.lookup(table, [], out=out) is out
    empty = tc.to_cuda(torch.empty((0, 4), dtype=torch.bfloat16))
    assert tuple(fastembed.lookup(empty, tc.to_cuda(torch.empty(0, dtype=torch.int64))).shape) == (0, 4)
    with pytest.raises(IndexError, match="id 0 at position 0 is out of range for a table of 0 rows"):
        fastembed.lookup(empty, [0])
    no_columns = fastembed.lookup(tc.to_cuda(torch.empty((5, 0), dtype=torch.float32)), [4, 0])
    assert tuple(no_columns.shape) == (2, 0) and no_columns.dtype == torch.float32


def test_embedding_over_a_torch_cuda_table(tc):
    host = host_table(torch.bfloat16)
    parameter = torch.nn.Parameter(tc.to_cuda(host))  # requires grad: gathered through detach(), no autograd
    emb = fastembed.Embedding(parameter)
    assert emb.table is parameter and (emb.vocab_size, emb.dim, emb.device) == (VOCAB, DIM, "cuda:0")
    ids = tc.to_cuda(torch.tensor([[3, 1], [96, 3]], dtype=torch.int32))
    result = emb(ids)
    assert not result.requires_grad
    assert_bit_equal(result, host[torch.tensor([[3, 1], [96, 3]])], tc)
    out = tc.empty((2, 2, DIM), torch.bfloat16)
    assert emb(ids, out=out) is out
    assert_bit_equal(out, host[torch.tensor([[3, 1], [96, 3]])], tc)
    assert_bit_equal(fastembed.lookup(parameter, ids), host[torch.tensor([[3, 1], [96, 3]])], tc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.int8])
def test_embedding_dtype_is_the_torch_cuda_tables_own_not_its_snapshots_words(tc, dtype):
    """A snapshot holds bfloat16 and float8 as uint16 and uint8 words; the layer reports the table's own dtype."""
    pytest.importorskip("ml_dtypes")
    name = str(dtype).removeprefix("torch.")
    emb = fastembed.Embedding(tc.to_cuda(torch.zeros((VOCAB, DIM), dtype=dtype)))
    assert emb.dtype.name == name and f"dtype={name}," in repr(emb)


@pytest.mark.parametrize("built, swapped", [(torch.bfloat16, torch.float16), (torch.float32, torch.float16),
                                            (torch.float16, torch.bfloat16)])
def test_an_embedding_keeps_the_dtype_it_serves_after_the_tables_data_is_swapped(tc, built, swapped):
    """What module.half() does to a parameter: the layer keeps serving (and naming) the rows it was built on."""
    pytest.importorskip("ml_dtypes")
    host = host_table(built)
    parameter = torch.nn.Parameter(tc.to_cuda(host), requires_grad=False)
    emb = fastembed.Embedding(parameter)
    parameter.data = tc.to_cuda(host.to(swapped))
    assert emb.dtype.name == str(built).removeprefix("torch.")
    ids = tc.to_cuda(torch.tensor([3, 96], dtype=torch.int64))
    assert_bit_equal(emb(ids), host[torch.tensor([3, 96])], tc)
    with pytest.raises(TypeError, match=f"dtype {emb.dtype.name} can be gathered into its own dtype|casts host tables only"):
        emb(ids, dtype=swapped)  # a cast of a GPU table: refused, not skipped as though the rows were of the new dtype


@pytest.mark.parametrize("target", ["float16", "float32", "bfloat16"])
def test_a_quantized_table_over_torch_cuda_tensors(tc, target):
    pytest.importorskip("ml_dtypes")
    host = random_quantized_table("fp8_e4m3", 64, 32, seed=2)
    table = QuantizedTable(tc.to_cuda(torch.from_numpy(host.data)), host.format, host.dim,
                           tc.to_cuda(torch.from_numpy(host.scales)))
    ids = [5, 63, 0]
    result = fastembed.lookup(table, tc.to_cuda(torch.tensor(ids)), dtype=target)
    assert isinstance(result, torch.Tensor) and result.is_cuda and result.dtype == getattr(torch, target)
    expected = fastembed.lookup(host, ids, dtype=target)
    assert tc.to_host(result).view(torch.uint8).numpy().tobytes() == expected.view(np.uint8).tobytes()


def test_out_must_have_the_results_torch_dtype_not_only_its_width(tc):
    """A snapshot holds bfloat16 and float8 as unsigned words; other dtypes of that width are still refused."""
    cases = [(torch.bfloat16, torch.uint16), (torch.uint16, torch.bfloat16), (torch.float8_e4m3fn, torch.float8_e5m2),
             (torch.float8_e4m3fn, torch.uint8)]
    for dtype, wrong in cases:
        table = tc.to_cuda(host_table(torch.float32).to(dtype) if dtype.is_floating_point else
                           torch.zeros((VOCAB, DIM), dtype=dtype))
        out = tc.empty((1, DIM), wrong)
        with pytest.raises(TypeError, match=f"out has dtype {str(wrong)[6:]}, expected {str(dtype)[6:]}"):
            fastembed.lookup(table, [1], out=out)
    host = random_quantized_table("fp8_e4m3", 64, 32, seed=2)
    table = QuantizedTable(tc.to_cuda(torch.from_numpy(host.data)), host.format, host.dim,
                           tc.to_cuda(torch.from_numpy(host.scales)))
    with pytest.raises(TypeError, match="out has dtype uint16, expected bfloat16"):
        fastembed.lookup(table, [1], dtype="bfloat16", out=tc.empty((1, 32), torch.uint16))
    out = tc.empty((1, 32), torch.bfloat16)  # the dequantized bfloat16 rows into a bfloat16 tensor
    assert fastembed.lookup(table, [5], dtype="bfloat16", out=out) is out
    expected = fastembed.lookup(host, [5], dtype="bfloat16")
    assert tc.to_host(out).view(torch.uint16).numpy().tobytes() == expected.view(np.uint16).tobytes()


def test_a_torch_out_of_the_wrong_dtype_for_a_cupy_table_is_named_by_its_torch_dtype(tc):
    """The snapshot of a bfloat16 tensor holds uint16 words; the message names what the caller passed."""
    table = fastembed.Embedding(np.ones((VOCAB, DIM), np.float16)).to_device().table
    with pytest.raises(TypeError, match="out has dtype bfloat16, expected float16"):
        fastembed.lookup(table, [1], out=tc.empty((1, DIM), torch.bfloat16))


def test_dtype_naming_the_tables_own_torch_dtype_is_no_cast(tc):
    host = host_table(torch.bfloat16)
    table = tc.to_cuda(host)
    assert_bit_equal(fastembed.lookup(table, [3, 1], dtype="bfloat16"), host[[3, 1]], tc)
    assert_bit_equal(fastembed.Embedding(table)([3, 1], dtype="bfloat16"), host[[3, 1]], tc)
    with pytest.raises(TypeError, match="casts host tables only; gather this torch table in its own dtype \\(bfloat16\\)"):
        fastembed.lookup(table, [1], dtype="float32")


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", ["complex32", "float8_e8m0fnu", "float8_e4m3fnuz", "bits16"])
def test_torch_dtypes_cupy_has_not_are_a_type_error(tc, name):
    if not hasattr(torch, name):
        pytest.skip(f"this torch has no {name}")
    words = torch.zeros((VOCAB, DIM), dtype=torch.uint8 if torch.empty(0, dtype=getattr(torch, name)).element_size() == 1
                        else torch.int16)
    tensor = tc.to_cuda(words.view(getattr(torch, name)))
    message = f"torch dtype torch.{name} cannot be seen as a cupy array"
    with pytest.raises(TypeError, match=message):
        fastembed.lookup(tensor, [1])
    with pytest.raises(TypeError, match=message):
        fastembed.lookup(tc.to_cuda(host_table(torch.float16)), tensor[0])


def test_without_cupy_a_torch_cuda_table_names_the_extra(tc, monkeypatch):
    table = tc.to_cuda(host_table(torch.float32))
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(TypeError, match=r"needs cupy: pip install 'fastembed-gather\[cuda12\]'"):
        fastembed.lookup(table, [1])


# -- the torch CUDA double refuses what torch refuses ------------------------------------------------------------

def test_the_double_refuses_what_torch_refuses(tc):
    if not tc.is_double:
        pytest.skip("real torch CUDA tensors: these tests check the double")
    table = tc.to_cuda(host_table(torch.bfloat16))
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        table.numpy()
    with pytest.raises(TypeError, match="can't convert cuda:0"):
        np.asarray(table)
    with pytest.raises(RuntimeError, match="same device"):
        table + torch.ones((VOCAB, DIM), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Unsupported dtype bfloat16"):
        tc.cupy.from_dlpack(table)  # cupy has no bfloat16: the adapter hands over int16 words
    with pytest.raises(BufferError, match="require gradient"):
        tc.cupy.from_dlpack(tc.to_cuda(torch.ones(3)).requires_grad_())
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.current_stream(7)
    if torch.cuda.device_count() > 1:
        with pytest.raises(BufferError, match="different CUDA device"):
            tc.to_cuda(torch.ones(3), 1).__dlpack__(stream=1)  # torch's current device is 0
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        tc.cupy.from_dlpack(tc.to_cuda(torch.ones(3)))  # cupy on its null stream, torch on `side`
    import torch_cuda_double

    assert list(torch_cuda_double.stream_waits) == [(0, side.cuda_stream)]  # torch made the consumer wait


def test_on_a_gpu_torchs_stream_orders_the_gather_after_queued_work(tc):
    """Only a device can show it: a table written on a busy side stream is read after the write."""
    if tc.is_double:
        pytest.skip("needs a CUDA device: the doubles run every launch at once, so there is no order to observe")
    host = host_table(torch.float16)
    table = tc.to_cuda(host)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy
        table.fill_(3.0)
        result = fastembed.lookup(table, torch.arange(VOCAB, device="cuda"))
    side.synchronize()
    assert bool((result == 3.0).all())


@pytest.mark.parametrize("call, built, swapped_to", [
    ("lookup", torch.float16, torch.bfloat16), ("lookup", torch.bfloat16, torch.float16),
    ("lookup", torch.float8_e4m3fn, torch.float8_e5m2), ("lookup out", torch.float8_e4m3fn, torch.float8_e5m2),
    ("lookup out", torch.bfloat16, torch.float16), ("lookup quantized", None, None)])
def test_a_lookup_reads_a_torch_cuda_table_once_whatever_another_thread_swaps_meanwhile(tc, call, built, swapped_to):
    """lookup() took its snapshot of the caller's tensor and then read the tensor again for the output dtype, the
    device and the result's kind: a ``.data =`` between the two (``module.half()`` in another thread) made it read
    the snapshot's float8_e4m3fn bytes as float8_e5m2. Each run swaps the table at another point of the call; the
    result is the rows of one table or the other, each in its own dtype, or (an out of the old dtype) a TypeError."""
    pytest.importorskip("ml_dtypes")
    ids = [3, 96, 0]
    if call == "lookup quantized":
        quantized = random_quantized_table("q8_0", VOCAB, 32, seed=3)
        swapped = QuantizedTable(np.ascontiguousarray(quantized.data[::-1]), "q8_0", 32)
        table = QuantizedTable(tc.to_cuda(torch.from_numpy(quantized.data)), "q8_0", 32)
        other = tc.to_cuda(torch.from_numpy(swapped.data))
        allowed = [(torch.float16, fastembed.lookup(host, ids, dtype="float16").view(np.uint8).tobytes())
                   for host in (quantized, swapped)]
    else:
        host = host_table(built)
        table = torch.nn.Parameter(tc.to_cuda(host), requires_grad=False)
        swapped = host.to(swapped_to).flip(0).contiguous()
        other = tc.to_cuda(swapped)
        allowed = [(rows.dtype, rows[torch.tensor(ids)].view(torch.uint8).numpy().tobytes()) for rows in (host, swapped)]

    def lookup() -> object:
        on_device = tc.to_cuda(torch.tensor(ids))
        if call == "lookup out":
            try:
                return fastembed.lookup(table, on_device, out=tc.empty((3, DIM), built))
            except TypeError as error:  # the out of the old dtype checked against the new table
                assert f"out has dtype {str(built)[6:]}, expected {str(swapped_to)[6:]}" in str(error)
                return None
        return fastembed.lookup(table, on_device, dtype="float16" if call == "lookup quantized" else None)

    def swap() -> None:
        table.data = other

    original = table.data
    results: list = []
    for _ in interrupted_runs(in_fastembed, lambda: results.append(lookup()), handler=swap):
        result = results.pop()
        table.data = original
        if result is not None:
            assert (result.dtype, tc.to_host(result).view(torch.uint8).numpy().tobytes()) in allowed


def test_a_gpu_lookup_that_finds_a_bad_id_still_counts_its_writes_into_a_torch_out(tc):
    """A dense GPU gather writes the rows it can before it reports a bad id (docs/gpu.md), and the out's version was
    bumped only on success: a backward through a graph that had saved the out used the new values silently."""
    table = tc.to_cuda(host_table(torch.float32))
    for call in (lambda out: fastembed.lookup(table, [3, VOCAB], out=out),
                 lambda out: fastembed.Embedding(table)([3, VOCAB], out=out)):
        out = tc.empty((2, DIM), torch.float32)
        version = out._version  # what autograd compares with the version it saved
        with pytest.raises(IndexError, match=f"id {VOCAB}"):
            call(out)
        assert out._version > version


@pytest.mark.parametrize("dtype, asked", [(torch.bfloat16, "uint16"), (torch.float8_e4m3fn, "uint8"),
                                          (torch.bfloat16, "float32")])
def test_a_torch_cuda_table_held_as_words_is_gathered_in_its_own_dtype_only(tc, dtype, asked):
    """Its snapshot holds bfloat16 as uint16 words: dtype="uint16" was taken for the table's own dtype and returned
    bfloat16 rows, and a cast was offered as though a GPU table could be cast."""
    pytest.importorskip("ml_dtypes")
    table = tc.to_cuda(host_table(dtype))
    name = str(dtype).removeprefix("torch.")
    for call in (lambda: fastembed.lookup(table, [1], dtype=asked),
                 lambda: fastembed.select_backend(table, [1], dtype=asked)):
        with pytest.raises(TypeError, match=f"dtype= casts host tables only; gather this torch table in its own "
                                            f"dtype \\({name}\\)"):
            call()
