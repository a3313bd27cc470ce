"""torch CPU tensors in and out of lookup and Embedding, zero-copy (fastembed/arrays/torch_adapter.py, docs/interop.md)."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI installs its CPU build: .ci/run)")

import fastembed  # noqa: E402
from fastembed.arrays import torch_adapter  # noqa: E402
from fastembed.formats import QuantizedTable  # noqa: E402
from helpers import CPU_BACKENDS  # noqa: E402

VOCAB, DIM = 97, 24
TABLE_DTYPES = ["float16", "float32", "bfloat16", "int8"]
#: The integer dtype of the same width, for bit-exact comparisons.
BITS = {torch.float16: torch.int16, torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int8: torch.int8}


def torch_table(dtype: str, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == "int8":
        return torch.randint(-128, 128, (VOCAB, DIM), dtype=torch.int8, generator=generator)
    values = torch.randn((VOCAB, DIM), generator=generator) + 0.5  # never all zeros
    return values.to(getattr(torch, dtype))


def poisoned_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A nonzero byte pattern, so that an unwritten element cannot pass."""
    out = torch.empty(shape, dtype=dtype)
    out.view(torch.uint8).fill_(0xA5)
    return out


def expected_rows(table: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
    return table[torch.from_numpy(np.asarray(ids, np.int64))]


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert isinstance(actual, torch.Tensor), type(actual)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, actual.shape)
    assert torch.equal(actual.view(BITS[actual.dtype]), expected.view(BITS[expected.dtype]))


def numpy_address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


@pytest.mark.parametrize("dtype", TABLE_DTYPES)
@pytest.mark.parametrize("ids_kind", ["numpy", "torch"])
@pytest.mark.parametrize("ids_dtype", ["int32", "int64", "int16"])
@pytest.mark.parametrize("ids_shape", [(6,), (2, 3)])
@pytest.mark.parametrize("with_out", [False, True])
def test_torch_table_gathers_bit_exact(backend, dtype, ids_kind, ids_dtype, ids_shape, with_out):
    table = torch_table(dtype)
    host_ids = np.array([5, 96, 0, 41, 41, 17], dtype=ids_dtype).reshape(ids_shape)
    ids = host_ids if ids_kind == "numpy" else torch.from_numpy(host_ids)
    expected = expected_rows(table, host_ids)
    if with_out:
        out = poisoned_tensor(ids_shape + (DIM,), table.dtype)
        address = out.data_ptr()
        result = fastembed.lookup(table, ids, out=out, backend=backend)
        assert result is out and out.data_ptr() == address  # the caller's tensor, written in place
    else:
        result = fastembed.lookup(table, ids, backend=backend)
    assert_bit_equal(result, expected)


@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_embedding_over_a_torch_table(backend, dtype):
    table = torch_table(dtype)
    emb = fastembed.Embedding(table)
    assert emb.table is table
    assert (emb.vocab_size, emb.dim, emb.device) == (VOCAB, DIM, "cpu")
    assert emb.dtype.name == dtype
    ids = torch.tensor([[3, 1], [96, 3]], dtype=torch.int32)
    assert_bit_equal(emb(ids, backend=backend), expected_rows(table, ids.numpy()))
    out = poisoned_tensor((2, 2, DIM), table.dtype)
    assert emb(ids, out=out, backend=backend) is out
    assert_bit_equal(out, expected_rows(table, ids.numpy()))


def test_embedding_sees_later_writes_to_the_torch_table(backend):
    """No copy was taken: the layer reads the caller's tensor memory."""
    table = torch_table("float32")
    emb = fastembed.Embedding(table)
    table[7] = 42.0
    assert torch.equal(emb([7], backend=backend), torch.full((1, DIM), 42.0))
    bf16 = torch_table("bfloat16")
    emb16 = fastembed.Embedding(bf16)
    bf16[3] = -2.5
    assert torch.equal(emb16([3], backend=backend), torch.full((1, DIM), -2.5, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", TABLE_DTYPES)
def test_snapshots_and_results_share_memory(dtype):
    table = torch_table(dtype)
    view = torch_adapter.ADAPTER.snapshot(table)
    assert isinstance(view, np.ndarray) and view.shape == (VOCAB, DIM)
    assert numpy_address(view) == table.data_ptr()
    back = torch_adapter.ADAPTER.wrap(view)
    assert back.dtype == table.dtype and back.data_ptr() == table.data_ptr()


def test_a_snapshot_for_reading_is_read_only_and_keeps_the_tensor_alive_and_one_for_writing_writes_it():
    import gc

    table = torch_table("bfloat16")
    expected = table.view(torch.int16).clone()
    view = torch_adapter.ADAPTER.snapshot(table)
    assert not view.flags.writeable
    del table
    gc.collect()
    torch.ones(VOCAB, DIM, dtype=torch.bfloat16)  # memory freed too early would likely be reused here
    assert np.array_equal(view.view(np.int16), expected.numpy())
    out = torch.zeros(2, DIM, dtype=torch.bfloat16)
    writable = torch_adapter.ADAPTER.writable_snapshot(out)
    writable[...] = view[:2]
    assert torch.equal(out.view(torch.int16), expected[:2])


def test_result_is_a_tensor_over_the_gathered_memory():
    table = torch_table("bfloat16")
    result = fastembed.lookup(table, [1, 2])
    assert result.dtype == torch.bfloat16 and result.is_contiguous()
    assert numpy_address(torch_adapter.ADAPTER.snapshot(result)) == result.data_ptr()


def test_numpy_table_with_torch_ids_returns_numpy(backend):
    table = torch_table("float32").numpy()
    ids = torch.tensor([[4, 0], [2, 96]], dtype=torch.int64)
    result = fastembed.lookup(table, ids, backend=backend)
    assert type(result) is np.ndarray
    np.testing.assert_array_equal(result, table[ids.numpy()])
    assert type(fastembed.Embedding(table)(torch.tensor([1], dtype=torch.int16))) is np.ndarray


def test_out_of_the_other_cpu_kind_is_written_and_returned(backend):
    table = torch_table("float16")
    out = np.full((2, DIM), 7, np.float16)
    assert fastembed.lookup(table, [9, 8], out=out, backend=backend) is out
    np.testing.assert_array_equal(out, table.numpy()[[9, 8]])
    host = table.numpy()
    tensor_out = poisoned_tensor((2, DIM), torch.float16)
    assert fastembed.lookup(host, [9, 8], out=tensor_out, backend=backend) is tensor_out
    assert_bit_equal(tensor_out, expected_rows(table, np.array([9, 8])))


def test_requires_grad_table_is_gathered_without_autograd(backend):
    table = torch_table("float32").requires_grad_()
    result = fastembed.lookup(table, [1, 5], backend=backend)
    assert not result.requires_grad
    assert_bit_equal(result, expected_rows(table.detach(), np.array([1, 5])))
    parameter = torch.nn.Parameter(torch_table("float16"))
    emb = fastembed.Embedding(parameter)
    assert_bit_equal(emb([0, 2], backend=backend), expected_rows(parameter.detach(), np.array([0, 2])))
    with torch.no_grad():
        parameter[2] = 1.0
    assert torch.equal(emb([2], backend=backend), torch.ones((1, DIM), dtype=torch.float16))


def test_out_that_requires_grad_is_refused():
    table = torch_table("float32")
    out = torch.zeros((1, DIM), requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        fastembed.lookup(table, [1], out=out)
    assert not out.detach().any()


def test_ids_in_a_list_holding_tensors_numpy_cannot_read_are_a_type_error():
    """numpy converts a list by asking each tensor for its array: torch's RuntimeError went through unexplained."""
    table = np.ones((10, DIM), np.float32)
    for element in (torch.tensor(3.0, requires_grad=True), torch.tensor(-3)._neg_view()):
        with pytest.raises(TypeError, match="ids must be integers numpy can read: .*numpy\\(\\)"):
            fastembed.lookup(table, [element])


def test_non_contiguous_torch_table_is_refused_but_strided_ids_are_fine(backend):
    table = torch_table("float32")
    with pytest.raises(ValueError, match="C-contiguous.*contiguous\\(\\)"):
        fastembed.lookup(table.t(), [0])
    with pytest.raises(ValueError, match="C-contiguous"):
        fastembed.Embedding(table[:, ::2])
    ids = torch.arange(20, dtype=torch.int64)[::3]
    assert not ids.is_contiguous()
    assert_bit_equal(fastembed.lookup(table, ids, backend=backend), expected_rows(table, ids.numpy()))


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32, torch.int16])
def test_bad_torch_ids_raise_index_error_with_position_and_value(backend, ids_dtype):
    table = torch_table("float16")
    out = poisoned_tensor((2, 2, DIM), torch.float16)
    before = out.clone()
    ids = torch.tensor([[1, 2], [VOCAB, 3]], dtype=ids_dtype)
    with pytest.raises(IndexError, match=rf"id {VOCAB} at position \(1, 0\) is out of range"):
        fastembed.lookup(table, ids, out=out, backend=backend)
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))  # untouched on a host error
    with pytest.raises(IndexError, match=r"id -1 at position 1 is out of range"):
        fastembed.lookup(table, torch.tensor([0, -1], dtype=ids_dtype), backend=backend)


def test_non_integer_torch_ids_are_refused():
    table = torch_table("float32")
    with pytest.raises(TypeError, match="ids must be integers, got floating"):
        fastembed.lookup(table, torch.tensor([1.0]))
    with pytest.raises(TypeError, match="ids must be integers, got bool"):
        fastembed.lookup(table, torch.tensor([True]))


def test_out_checks_apply_to_torch_out():
    table = torch_table("float32")
    with pytest.raises(TypeError, match="out has dtype float16"):
        fastembed.lookup(table, [1], out=torch.empty((1, DIM), dtype=torch.float16))
    with pytest.raises(ValueError, match="out has shape"):
        fastembed.lookup(table, [1], out=torch.empty((2, DIM)))
    with pytest.raises(ValueError, match="C-contiguous"):
        fastembed.lookup(table, [1, 2], out=torch.empty((DIM, 2)).t())
    with pytest.raises(ValueError, match="overlaps the table"):
        fastembed.lookup(table, [5, 6], out=table[:2])


def test_scalar_and_empty_ids():
    table = torch_table("bfloat16")
    scalar = fastembed.lookup(table, torch.tensor(4))
    assert scalar.shape == (DIM,) and torch.equal(scalar.view(torch.int16), table[4].view(torch.int16))
    empty = fastembed.lookup(table, torch.empty((0,), dtype=torch.int64))
    assert isinstance(empty, torch.Tensor) and empty.shape == (0, DIM) and empty.dtype == torch.bfloat16
    # torch's strides, as torch's own lookup gives, so that views into other dtypes work as on its results
    empty = fastembed.lookup(table, np.zeros((0, 3), np.int64))
    expected = torch.nn.functional.embedding(torch.zeros((0, 3), dtype=torch.int64), table)
    assert empty.stride() == expected.stride() and empty.view(torch.uint8).shape == (0, 3, 2 * DIM)
    with torch.device("meta"):  # torch's default device for new tensors: a host result stays on the host
        assert fastembed.lookup(table, np.zeros((0,), np.int64)).device == torch.device("cpu")


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])  # ml_dtypes' e5m2 is kind f, e4m3fn kind V
def test_float8_tables_travel_through_ml_dtypes(name):
    table = torch_table("float32").to(getattr(torch, name))
    expected = table[[3, 0]].view(torch.uint8)
    result = fastembed.lookup(table, [3, 0])
    assert result.dtype == table.dtype and torch.equal(result.view(torch.uint8), expected)
    assert torch.equal(fastembed.Embedding(table)([3, 0]).view(torch.uint8), expected)
    out = torch.empty((2, DIM), dtype=table.dtype)
    assert fastembed.lookup(table, [3, 0], out=out) is out and torch.equal(out.view(torch.uint8), expected)


def test_bfloat16_without_ml_dtypes_is_a_clear_type_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes raises ImportError
    with pytest.raises(TypeError, match=r"torch bfloat16 tensors need ml_dtypes.*fastembed-gather\[bfloat16\]"):
        fastembed.lookup(torch_table("bfloat16"), [1])


def test_dispatch_still_picks_a_cpu_backend_for_torch_inputs():
    table = torch_table("float16")
    selection = fastembed.select_backend(table, torch.tensor([1, 2]), out=torch.empty((2, DIM), dtype=torch.float16))
    assert selection.backend == CPU_BACKENDS[0]
    assert fastembed.select_backend(table, [1], backend="numpy").backend == "numpy"


def fake_cuda_tensor(index: int = 1):
    """Something torch_adapter takes for a torch CUDA tensor (there is no GPU here)."""
    fake = types.new_class("Tensor")
    fake.__module__ = "torch"
    fake.__dlpack__ = lambda self: None
    fake.device = types.SimpleNamespace(type="cuda", index=index)
    fake.requires_grad = False
    return fake()


def test_cuda_ids_or_out_of_a_cpu_table_are_refused_naming_where_each_lives():
    """torch CUDA tables themselves: tests/test_interop_torch_cuda.py."""
    table = torch_table("float32")
    assert torch_adapter.ADAPTER.device(fake_cuda_tensor(1)) == "cuda:1"
    with pytest.raises(TypeError, match="ids live on cuda:1 but the table lives on cpu"):
        fastembed.lookup(table, fake_cuda_tensor())
    with pytest.raises(TypeError, match="out lives on cuda:1 but the table lives on cpu"):
        fastembed.lookup(table, [1], out=fake_cuda_tensor())
    with pytest.raises(TypeError, match="torch tensors on meta:0 are not supported"):
        fastembed.lookup(torch.empty((4, 3), device="meta"), [1])


def test_torch_objects_that_are_not_tensors_are_not_arrays():
    with pytest.raises(TypeError, match="table must be a numpy array, np.memmap, cupy array, torch CPU or CUDA tensor"):
        fastembed.lookup(torch.UntypedStorage(16), [0])


def test_import_fastembed_does_not_import_torch():
    code = (
        "import sys, numpy as np, fastembed\n"
        "fastembed.lookup(np.ones((4, 3), np.float32), [1, 2])\n"
        "fastembed.Embedding(np.ones((4, 3), np.float32))(np.array([0]), out=np.empty((1, 3), np.float32))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


READ_ONLY_OUT = """
import sys
import numpy as np, torch, fastembed
sys.path.insert(0, {tests!r})
from helpers import Producer  # another library's DLPack export of the same memory
np.save({path!r}, np.arange(40, dtype=np.float32).reshape(10, 4))
tt = torch.from_dlpack(np.load({path!r}, mmap_mode="r"))  # torch drops the read-only flag
table = np.ones((10, 4), np.float32)
for attempt in (lambda: fastembed.lookup(table, [1], out=tt[:1]), lambda: fastembed.Embedding(table)([1, 2], out=tt[:2]),
                lambda: fastembed.lookup(torch.from_numpy(table), [9], out=tt[9:]),
                lambda: fastembed.lookup(table, [1, 2], out=tt.numpy()[:2]),  # numpy's view says writeable too
                lambda: fastembed.Embedding(table)([1, 2], out=tt[2:4].numpy()),
                lambda: fastembed.lookup(table, [1, 2], out=Producer(tt[:2]))):
    try:
        attempt()
        raise SystemExit("no error")
    except ValueError as error:
        assert str(error).startswith("out is read-only memory"), error
assert torch.equal(tt, torch.arange(40.0).reshape(10, 4))  # untouched
rows = fastembed.lookup(tt, [9, 0])  # the same tensor as a table is only read
assert torch.equal(rows, torch.tensor([[36.0, 37, 38, 39], [0, 1, 2, 3]]))
print("refused as out, served as a table")
"""


def test_a_tensor_over_read_only_memory_as_out_is_a_value_error_not_a_crash(tmp_path):
    """It once killed the process (SIGSEGV): torch marks no tensor read-only, so the numpy view said writeable
    (as numpy's own view of the tensor, and another library's DLPack export of it, still do)."""
    result = subprocess.run([sys.executable, "-c", READ_ONLY_OUT.format(path=str(tmp_path / "ro.npy"), tests=str(Path(__file__).parent))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.strip() == "refused as out, served as a table"


WRITE_PROBE = """
import ctypes, mmap, os, numpy as np
from fastembed.arrays import torch_adapter, write_probe
page = mmap.PAGESIZE
memory = mmap.mmap(-1, 2 * page)
view = np.frombuffer(memory, np.uint8)
view[:] = 7
libc = ctypes.CDLL(None, use_errno=True)
address = view.__array_interface__["data"][0]
assert torch_adapter.ADAPTER.writable(view)
assert libc.mprotect(ctypes.c_void_p(address + page), page, mmap.PROT_READ) == 0  # the last page read-only
assert not torch_adapter.ADAPTER.writable(view)  # the first byte is writable, the last not
assert torch_adapter.ADAPTER.writable(view[:page]) and not torch_adapter.ADAPTER.writable(view[page:])
assert (view == 7).all()  # the probes wrote nothing new
read_end = write_probe._probe_pipe[0]
try:
    os.read(read_end, 1)
    raise SystemExit("a failed probe left bytes in the pipe")
except BlockingIOError:
    pass
child = os.fork()
if child == 0:
    os._exit(0 if write_probe._probe_pipe is None and torch_adapter.ADAPTER.writable(view[:page]) else 1)
assert os.waitpid(child, 0)[1] == 0, "a forked child must make its own pipe"
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect and fork as Linux has them")
def test_the_write_probe_checks_both_ends_changes_nothing_and_leaves_the_pipe_empty():
    result = subprocess.run([sys.executable, "-c", WRITE_PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])


PROBE_AFTER_DAEMONIZING = """
import os, torch, fastembed
table = torch.arange(40, dtype=torch.float32).reshape(10, 4)
fastembed.lookup(table, [1, 2], out=torch.empty(2, 4))  # makes the probe's pipe
os.closerange(3, 4096)  # what a daemon does to every descriptor it inherited
files = [os.open(os.path.join({folder!r}, name), os.O_RDWR | os.O_CREAT) for name in ("a", "b", "c")]
out = torch.full((2, 4), 7.0)
assert fastembed.lookup(table, [3, 4], out=out) is out and torch.equal(out, table[[3, 4]])
assert all(os.fstat(fd).st_size == 0 for fd in files), "the probe wrote into the application's files"
print("ok")
"""


def test_the_write_probe_survives_a_daemon_closing_its_descriptors(tmp_path):
    """Its pipe's numbers, closed and given to the application's files, must be neither written nor trusted."""
    result = subprocess.run([sys.executable, "-c", PROBE_AFTER_DAEMONIZING.format(folder=str(tmp_path))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])


PROBE_IN_A_SIGNAL_HANDLER = """
import faulthandler, signal, time, torch, fastembed
faulthandler.dump_traceback_later(60, exit=True)  # a hang fails the test instead of stalling it
table = torch.arange(400, dtype=torch.float32).reshape(100, 4)
outer, inner, handled = torch.empty(3, 4), torch.empty(2, 4), []
def handler(signum, frame):
    assert torch.equal(fastembed.lookup(table, [1, 2], out=inner), table[[1, 2]])
    handled.append(1)
    signal.setitimer(signal.ITIMER_REAL, 0.0005)
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.0005)
started = time.time()
while time.time() - started < 3:
    assert torch.equal(fastembed.lookup(table, [5, 6, 7], out=outer), table[[5, 6, 7]])
signal.setitimer(signal.ITIMER_REAL, 0)
assert handled
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interval timers as Linux has them")
def test_a_lookup_into_a_torch_out_from_a_signal_handler_neither_hangs_nor_mixes_bytes():
    """A handler interrupting the probe found its lock held by its own thread and waited forever."""
    result = subprocess.run([sys.executable, "-c", PROBE_IN_A_SIGNAL_HANDLER], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])


def test_a_writable_torch_out_passes_the_probe(backend):
    table = torch_table("float32")
    out = poisoned_tensor((2, DIM), torch.float32)
    assert torch_adapter.ADAPTER.writable(np.from_dlpack(out))
    assert fastembed.lookup(table, [3, 4], out=out, backend=backend) is out
    assert_bit_equal(out, table[[3, 4]])


@pytest.mark.parametrize("role", ["table", "out"])
def test_a_lazily_negated_tensor_is_refused(role):
    """The neg bit (conj().imag): read as it lies, the memory would give the other sign, so it is a TypeError."""
    table = torch.arange(12.0).reshape(4, 3)
    negated = table._neg_view()
    assert torch.tensor([[1 + 2j]]).conj().imag.is_neg()
    out = torch.full((1, 3), -1.0)._neg_view()
    before = out.resolve_neg().clone()
    with pytest.raises(TypeError, match="lazy negation view"):
        if role == "table":
            fastembed.lookup(negated, torch.tensor([1]))
        else:
            fastembed.lookup(table, torch.tensor([1]), out=out)
    assert torch.equal(out.resolve_neg(), before)


def test_an_embedding_keeps_a_torch_tables_memory_and_notices_a_resize():
    """torch frees memory a DLPack view was taken of: a swapped .data keeps serving its rows, a resize_ is refused."""
    weight = torch.nn.Parameter(torch.randn(40_000, 256), requires_grad=False)  # 40 MB: returned to the OS when freed
    emb = fastembed.Embedding(weight)
    rows = weight.data[[39_999, 3]].clone()
    weight.data = torch.zeros(10, 256)  # the old storage's last owner is now the layer
    assert torch.equal(emb(torch.tensor([39_999, 3])), rows)
    for resize in (lambda t: t.resize_(80_000, 256), lambda t: t.untyped_storage().resize_(0)):
        table = torch.randn(40_000, 256)
        layer = fastembed.Embedding(table)
        resize(table)
        with pytest.raises(ValueError, match="storage was resized in place"):
            layer(torch.tensor([1]))
    table = torch.randn(100, 8)
    layer, rows = fastembed.Embedding(table), table[[99, 3]].clone()
    table.resize_(0)  # torch keeps the storage as it was: the layer keeps serving its rows, as after .data = other
    assert torch.equal(layer(torch.tensor([99, 3])), rows)


def test_an_embedding_keeps_the_dtype_it_serves_after_the_module_changes_its_weights_dtype():
    """module.half() and .bfloat16() swap each parameter's .data: the layer keeps serving the float32 rows it was
    built on, says so, and casts when asked for the new dtype (it once skipped the cast and reported the new one)."""
    weight = torch.nn.Parameter(torch.randn(100, 16), requires_grad=False)
    rows = weight.data[[7, 99]].clone()
    emb = fastembed.Embedding(weight)
    for swapped in (torch.float16, torch.bfloat16):
        weight.data = weight.data.to(swapped)
        assert emb.dtype == np.float32 and f"dtype={emb.dtype.name}," in repr(emb)
        assert torch.equal(emb(torch.tensor([7, 99])), rows)
        for asked in (swapped, str(swapped).removeprefix("torch.")):
            cast = emb(torch.tensor([7, 99]), dtype=asked)
            assert cast.dtype == swapped and torch.equal(cast, rows.to(swapped))


def test_a_layer_reads_the_callers_table_once_whatever_another_thread_swaps_while_it_is_built():
    """The layer took its view from one reading of the table and its storage guard from a second: a quantized
    table's data or a tensor's .data swapped between the two left the view's memory unguarded, so its later
    resize went unnoticed and the next call read freed memory. Every moment of construction is tried."""
    from helpers import in_fastembed, interrupted_runs

    ids = np.array([0, 4095])
    for kind in ("quantized", "dense"):
        run: dict = {}

        def prepare(run=run, kind=kind):
            first = torch.zeros((4096, 68 if kind == "quantized" else 16),
                                dtype=torch.uint8 if kind == "quantized" else torch.float32)
            second = torch.ones_like(first)
            table_of = (lambda rows: QuantizedTable(rows, "q8_0", 64)) if kind == "quantized" else torch.Tensor.detach
            run.update(first=first, second=second, table=table_of(first), swapped=False,
                       expected=fastembed.lookup(table_of(second), ids))

        def build(run=run):
            run["emb"] = fastembed.Embedding(run["table"])

        def another_thread(run=run):
            run["table"].data = run["second"]
            run["swapped"] = True

        def check(run=run, kind=kind):
            run["first"].resize_(8192, run["first"].shape[1])  # moves the first tensor's rows and frees their memory
            try:
                rows = run["emb"](ids, backend="numpy")
            except ValueError as error:  # the layer read the first tensor: its guard saw the resize
                assert "storage was resized in place" in str(error)
            else:  # the layer read the second tensor
                assert run["swapped"] and torch.equal(rows, run["expected"]), f"{kind}: unguarded rows"

        prepare()
        for _ in interrupted_runs(in_fastembed, build, another_thread):
            check()
            prepare()
        check()


def test_a_table_resized_while_a_layer_or_a_shard_is_built_is_never_read_after_its_memory_is_freed(tmp_path):
    """The guard recorded the storage's memory after the view was taken: a resize_ in between left a guard of the new
    memory beside a view of the freed one, and every later call read freed memory (unmapped here: a crash). Every
    moment of construction is tried, in a process of its own."""
    from helpers import run_script

    finished = run_script(tmp_path, f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import numpy as np, torch, fastembed
from fastembed.distributed import shards
from helpers import in_fastembed, interrupted_runs
vocab = 1 << 20  # 64 MiB: torch returns such storage to the system when it frees it
ids = np.arange(0, vocab, 997)
run = {{}}
def prepare():
    table = torch.arange(vocab * 16, dtype=torch.float32).reshape(vocab, 16)
    run.update(table=table, expected=table[ids].clone(), built=None, refused=None)
def build():
    try:
        run["built"] = run["build"](run["table"])
    except ValueError as error:  # resized while the snapshot was taken: refused at once
        run["refused"] = error
def another_thread():
    run["table"].resize_(2 * vocab, 16)  # moves the rows to new memory and frees the old
def check():
    if run["refused"] is not None:
        assert "storage was resized in place" in str(run["refused"]), run["refused"]
        return
    built = run["built"]
    try:
        if isinstance(built, fastembed.Embedding):
            rows = built(ids, backend="numpy")
        else:
            for guard in built.guards:
                guard.check()
            rows = torch.from_numpy(built.rows[ids])
    except ValueError as error:
        assert "storage was resized in place" in str(error), error
    else:
        assert torch.equal(rows, run["expected"])
for make in (fastembed.Embedding, lambda table: shards.open_shard(table, None, 1, 0, 1, "cpu")):
    run["build"] = make
    prepare()
    for _ in interrupted_runs(in_fastembed, build, another_thread):
        check()
        prepare()
    check()
print("ok")
""")
    assert finished.returncode == 0 and finished.stdout.strip().endswith("ok"), finished.stdout + finished.stderr


def _resized_layer(quantized: bool):
    """An Embedding over a torch table (dense float32, or q8_0 rows as a uint8 tensor) whose tensor was then
    resized in place: torch moved the rows and freed the memory the layer's view points at."""
    table = torch.randn(4_000, 256)
    if quantized:
        from fastembed.formats import QuantizedTable

        rows = torch.tensor(fastembed.Embedding(table.numpy()).quantize("q8_0").table.data)
        layer = fastembed.Embedding(QuantizedTable(rows, "q8_0", 256))
        rows.resize_(40_000, 272)
    else:
        layer = fastembed.Embedding(table)
        table.resize_(40_000, 256)
    return layer


@pytest.mark.parametrize("method", ["quantize", "save", "save quantized"])
def test_every_method_reading_the_rows_refuses_a_resized_torch_table(method, tmp_path):
    """Not only lookups: quantize and save would read the freed memory too (a crash, or a wrong file)."""
    layer = _resized_layer(quantized=method == "save quantized")
    act = {"quantize": lambda: layer.quantize("q8_0"), "save": lambda: layer.save(tmp_path / "t.safetensors"),
           "save quantized": lambda: layer.save(tmp_path / "t.gguf")}[method]
    with pytest.raises(ValueError, match="storage was resized in place"):
        act()
    assert not list(tmp_path.iterdir())


def test_to_device_refuses_a_resized_torch_table(cupy_or_double):
    for quantized in (False, True):
        with pytest.raises(ValueError, match="storage was resized in place"):
            _resized_layer(quantized).to_device(0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtype_may_be_a_torch_dtype(dtype):
    """dtype=torch.float16 means numpy's float16: the cast of a dense table and the output of a quantized one."""
    table = torch.randn(20, 64)
    ids = torch.tensor([3, 19, 0])
    assert torch.equal(fastembed.lookup(table, ids, dtype=dtype), table[ids].to(dtype))
    if dtype != torch.float64:
        quantized = fastembed.Embedding(table.numpy()).quantize("q8_0")
        expected = quantized(ids.numpy(), dtype=str(dtype).removeprefix("torch."))
        np.testing.assert_array_equal(quantized(ids.numpy(), dtype=dtype).view(np.uint8), expected.view(np.uint8))
    with pytest.raises(TypeError, match="not int8"):
        fastembed.lookup(table, ids, dtype=torch.int8)


def test_a_dtype_in_the_other_byte_order_is_refused_before_any_work_for_a_torch_table(monkeypatch):
    """torch has no such dtype: the result could not be made, so nothing is gathered first."""
    from fastembed import casting

    monkeypatch.setattr(casting, "gather_cast", lambda *args: pytest.fail("gathered before refusing"))
    other_order = np.dtype(np.float32).newbyteorder()
    for call in (lambda: fastembed.lookup(torch.randn(20, 8), [1], dtype=other_order),
                 lambda: fastembed.Embedding(torch.randn(20, 8))([1], dtype=other_order),
                 lambda: fastembed.select_backend(torch.randn(20, 8), [1], dtype=other_order)):
        with pytest.raises(TypeError, match="have no dtype .f4 .the machine's byte order is the other one"):
            call()


@pytest.mark.parametrize("role", ["table", "ids", "out"])
def test_a_tensor_reaching_past_its_shrunk_storage_is_a_value_error_before_any_access(role):
    table, ids, out = torch_table("float32"), torch.tensor([VOCAB - 1, 0]), torch.empty((2, DIM))
    shrunk = {"table": table, "ids": ids, "out": out}[role]
    shrunk.untyped_storage().resize_(shrunk.element_size())  # one element left: the shape reaches past it
    with pytest.raises(ValueError, match="storage was shrunk or freed"):
        fastembed.lookup(table, ids, out=out)
    if role == "table":
        with pytest.raises(ValueError, match="storage was shrunk or freed"):
            fastembed.Embedding(table)


@pytest.mark.parametrize("dtype", [None, "float16"])  # the plain gather, and the casting path
def test_a_torch_out_written_by_a_lookup_counts_as_an_in_place_write_for_autograd(dtype):
    weight = torch.randn(2, DIM, requires_grad=True)
    out = torch.zeros(2, DIM, dtype=torch.float16 if dtype else torch.float32)
    loss = (weight * out).sum()  # autograd saves out
    before = out._version
    fastembed.lookup(torch_table("float32"), [1, 2], out=out, dtype=dtype)
    assert out._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    emb_out = torch.zeros(2, DIM)
    version = emb_out._version
    fastembed.Embedding(torch_table("float32"))([1, 2], out=emb_out)
    assert emb_out._version > version


def test_an_out_overlapping_torch_ids_is_refused():
    table, buffer = torch_table("float32").numpy(), np.zeros((3, DIM), np.float32)
    ids = torch.from_numpy(buffer.view(np.int64)[:, 0])  # the ids live inside out's memory
    with pytest.raises(ValueError, match="out overlaps the ids"):
        fastembed.lookup(table, ids, out=buffer)


def test_torch_ids_and_a_torch_out_in_one_storage_are_refused_only_where_they_overlap():
    table = torch_table("float32")
    words = torch.zeros(2 + 2 * DIM // 2, dtype=torch.int64)  # an id, out's 2 rows of float32, an id
    out = words[1:-1].view(torch.float32).view(2, DIM)
    expected = table[[0, 0]].clone()
    around = words[:: words.numel() - 1]  # the first and last word: a span that covers out, elements outside it
    assert torch.equal(fastembed.lookup(table, around, out=out), expected)
    beside = words[-1:].expand(2)  # the word just past out
    assert torch.equal(fastembed.lookup(table, beside, out=out), expected)
    for inside in (words[1:3], words[-3:-1], words[-2:]):  # out's first words, its last ones, its last and the next
        out.zero_()  # ids 0 wherever they lie in out
        with pytest.raises(ValueError, match="out overlaps the ids"):
            fastembed.lookup(table, inside, out=out)
        assert not out.any()


@pytest.mark.parametrize("layout", ["to_sparse", "to_sparse_csr"])
def test_a_table_of_a_sparse_layout_is_a_type_error(layout):
    with pytest.raises(TypeError, match="layout"):
        fastembed.lookup(getattr(torch_table("float32"), layout)(), [1])


@pytest.mark.parametrize("kind", ["q8_0", "fp8_e4m3"])
def test_a_quantized_torch_table_keeps_torch_arrays_and_results(kind):
    table = torch.from_numpy(np.random.default_rng(4).standard_normal((50, 64)).astype(np.float32))
    quantized = fastembed.Embedding(table).quantize(kind)
    assert isinstance(quantized.table.data, torch.Tensor)
    assert quantized.table.scales is None or isinstance(quantized.table.scales, torch.Tensor)
    result = quantized([3, 1])
    assert isinstance(result, torch.Tensor)
    expected = fastembed.Embedding(table.numpy()).quantize(kind)([3, 1])
    np.testing.assert_array_equal(result.numpy().view(np.uint32), expected.view(np.uint32))


def test_an_inference_tensor_is_refused_as_out_outside_inference_mode():
    table = torch_table("float32")
    with torch.inference_mode():
        out = torch.zeros(2, DIM)
    with pytest.raises(ValueError, match="inference tensor"):
        fastembed.lookup(table, [1, 2], out=out)
    assert not out.any()
    with torch.inference_mode():
        assert torch.equal(fastembed.lookup(table, [1, 2], out=out), table[[1, 2]])


def test_a_table_moved_to_shared_memory_after_the_layer_was_made_is_named():
    table = torch_table("float32").clone()
    layer = fastembed.Embedding(table)
    table.share_memory_()
    with pytest.raises(ValueError, match="share_memory_"):
        layer([1])
    assert torch.equal(fastembed.Embedding(table)([1]), table[[1]])


def test_transforms_compilation_and_nested_tensors_are_type_errors_saying_why():
    table = torch_table("float32")
    ids = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(TypeError, match="torch.func transform's wrapper"):
        torch.func.vmap(lambda row_ids: fastembed.lookup(table, row_ids))(ids)
    with pytest.raises(TypeError, match="torch.func transform's wrapper"):
        torch.func.grad(lambda weight: fastembed.lookup(weight, torch.tensor([0, 1])).sum())(table)
    nested = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    with pytest.raises(TypeError, match="nested torch tensors are not supported"):
        fastembed.lookup(table, nested)
    compiled = torch.compile(lambda weight, row_ids: fastembed.lookup(weight, row_ids), backend="eager")
    with pytest.raises(TypeError, match="torch.compile cannot trace"):
        compiled(table, ids)
    assert torch.equal(fastembed.lookup(table, ids), table[ids])  # outside the transforms, as before


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_large_result_on_a_torch_table_keeps_its_memory_while_the_tensor_lives(dtype):
    table = torch.randn((2048, 1024)).to(getattr(torch, dtype)) + 1  # 4 MiB results: the output cache serves them
    emb = fastembed.Embedding(table)
    ids = np.arange(2048)[::-1].copy()
    first = emb(ids)
    expected = first.view(torch.int16).clone()
    for _ in range(3):  # later results of the same size must come from other memory
        later = emb(np.arange(2048))
        assert later.data_ptr() != first.data_ptr()
        del later
    assert torch.equal(first.view(torch.int16), expected)
    assert torch.equal(first.view(torch.int16), table[torch.from_numpy(ids)].view(torch.int16))


def test_a_host_copy_of_a_tensor_is_writeable():
    assert torch_adapter.ADAPTER.to_host(torch_table("float16")).flags.writeable


@pytest.mark.parametrize("name", ["int4", "uint3", "int1"])
def test_torch_sub_byte_dtypes_are_refused_not_relabelled(name):
    """torch exports its one-value-per-byte int1-int7 and uint1-uint7 as int8 or uint8: results would lose the dtype."""
    if not hasattr(torch, name):
        pytest.skip(f"this torch has no torch.{name}")
    shell = getattr(torch, name)
    stored = torch.uint8 if name.startswith("u") else torch.int8
    table = torch.randint(0, 2 if name == "int1" else 3, (16, 4), dtype=torch.uint8).view(shell)
    for call in (lambda: fastembed.lookup(table, [1, 2]), lambda: fastembed.Embedding(table),
                 lambda: fastembed.lookup(torch.zeros((16, 4), dtype=stored), [1],
                                          out=torch.zeros((1, 4), dtype=torch.uint8).view(shell))):
        with pytest.raises(TypeError, match=f"torch.{name} keeps one value per byte"):
            call()
    bytes_ = table.view(stored)
    assert torch.equal(fastembed.lookup(bytes_, [1, 2]), bytes_[[1, 2]])


def test_a_lookup_reads_a_torch_table_without_detach_which_lets_another_threads_data_swap_tear_it(monkeypatch):
    """``detach()`` lets the GIL go, and a ``.data =`` on another thread meanwhile gave it one tensor's dtype over the
    other's memory: rows neither old nor new (a race too rare to catch in a test). Every way in reads the table
    through ``.data``, which holds the GIL."""
    import fastembed.torch

    weight = torch.nn.Parameter(torch.randn(3000, 256), requires_grad=False)
    layer = fastembed.torch.Embedding.from_pretrained(torch.randn(3000, 256), freeze=True)
    calls = [
        lambda ids: fastembed.lookup(weight, ids),
        lambda ids: fastembed.lookup(weight, ids, dtype=torch.float32),
        lambda ids: fastembed.Embedding(weight)(ids),
        lambda ids: layer(ids),
    ]
    detached = []
    real_detach = torch.Tensor.detach
    monkeypatch.setattr(torch.Tensor, "detach", lambda self: detached.append(self) or real_detach(self))
    for call in calls:
        for size in (1, 3000):  # torch's own embedding serves the drop-in layer's small batches
            call(torch.arange(size))
    assert not detached
