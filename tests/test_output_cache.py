"""The cache of output buffers behind large allocating lookups: reuse only when nothing can reach a buffer."""
from __future__ import annotations

import copy
import gc
import pickle
import re
import threading

import numpy as np
import pytest

import fastembed
from fastembed.backends import numba_backend, output_cache
from helpers import assert_bit_equal, interrupted_runs, random_table, run_script

SHAPE = (600, 4096)  # 4.7 MiB of float16: above output_cache.MIN_BYTES


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(output_cache, "_limit", 64 * 2**20)
    monkeypatch.setattr(numba_backend, "COMPILE_IN_BACKGROUND", False)
    output_cache.empty()
    yield
    output_cache.empty()


def address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


def test_a_dropped_output_is_reused():
    first = output_cache.new_output(SHAPE, np.float16)
    where = address(first)
    del first
    assert output_cache.cached_bytes() >= np.prod(SHAPE) * 2
    second = output_cache.new_output(SHAPE, np.float16)
    assert address(second) == where
    assert output_cache.cached_bytes() == 0


def _in_the_cache(code) -> bool:
    return code.co_filename == output_cache.__file__


def _cache_round() -> None:
    """Take, drop, take again, empty: every path of the cache's code."""
    first, second = output_cache.new_output(SHAPE, np.float16), output_cache.new_output(SHAPE, np.float16)
    del first
    third = output_cache.new_output(SHAPE, np.float16)
    del second, third
    fastembed.empty_cache()
    fourth = output_cache.new_output(SHAPE, np.float16)
    del fourth


def _assert_the_cache_works() -> None:
    assert output_cache.cached_bytes() <= output_cache.limit()
    fastembed.empty_cache()
    assert output_cache.cached_bytes() == 0 and not output_cache._free
    first = output_cache.new_output(SHAPE, np.float16)
    where = address(first)
    del first
    second = output_cache.new_output(SHAPE, np.float16)
    assert address(second) == where  # served from the cache again
    del second
    fastembed.empty_cache()
    assert output_cache.cached_bytes() == 0 and not output_cache._free


def test_a_signal_handlers_lookups_inside_the_caches_code_never_share_a_buffer():
    """A handler runs on the thread it interrupts, which holds the (re-entrant) lock, maybe mid-way through a loop:
    here, before every instruction of the cache's code in turn, it takes and keeps an output, drops another and
    empties the cache."""
    held = []

    def handler():
        taken = output_cache.new_output(SHAPE, np.float16)
        held.append(taken)
        dropped = output_cache.new_output(SHAPE, np.float16)
        del dropped
        fastembed.empty_cache()

    def action():
        outputs = [output_cache.new_output(SHAPE, np.float16) for _ in range(3)]
        del outputs[0]
        outputs.append(output_cache.new_output(SHAPE, np.float16))
        held.extend(outputs)

    for _ in interrupted_runs(_in_the_cache, action, handler):
        addresses = [address(output) for output in held]
        assert len(set(addresses)) == len(addresses)  # no two live outputs share a buffer
        held.clear()
        _assert_the_cache_works()


def test_an_interrupt_anywhere_in_the_caches_code_leaves_it_bounded_and_working(monkeypatch):
    """Ctrl-C between any two instructions of the cache (a finalizer's included): the cache used to stay marked as
    busy for good when it struck on entering the code that left it, then kept every returning buffer beyond the
    limit, served none and freed none on empty_cache()."""
    monkeypatch.setattr("sys.unraisablehook", lambda unraisable: None)  # a finalizer's interrupt is not raised
    monkeypatch.setattr(output_cache.interrupts, "interrupt_again", lambda: None)  # nor raised again later, in the test's code
    fastembed.set_output_cache_limit(12 * 2**20)  # room for two of the round's four buffers: the limit is tested
    runs = 0
    for _ in interrupted_runs(_in_the_cache, _cache_round):
        runs += 1
        _assert_the_cache_works()
    assert runs > 50


def test_an_interrupt_while_a_buffer_comes_back_never_keeps_more_than_the_limit_and_is_delivered_again(monkeypatch):
    """A Ctrl-C in a lease's finalizer, at any point of it: the cache stays within its limit (the buffer is kept
    only once there is room) and the KeyboardInterrupt, which Python would only print, is raised again (but on
    entering the finalizer, before any of its code runs)."""
    delivered, printed = [], []
    monkeypatch.setattr(output_cache.interrupts, "interrupt_again", lambda: delivered.append(True))
    monkeypatch.setattr("sys.unraisablehook", lambda unraisable: printed.append(unraisable.exc_type))
    fastembed.set_output_cache_limit(12 * 2**20)  # room for two buffers
    armed = []

    def three_drops_of_two_kept() -> None:
        first, second, third = (output_cache.new_output(SHAPE, np.float16) for _ in range(3))
        del first, second
        assert output_cache.cached_bytes() == output_cache.limit()
        armed.append(True)
        del third  # its finalizer is the one interrupted
        armed.clear()

    runs = 0  # those delivered again
    for _ in interrupted_runs(lambda code: bool(armed) and code is output_cache._give_back.__code__,
                              three_drops_of_two_kept):
        armed.clear()
        assert output_cache.cached_bytes() <= output_cache.limit()
        assert delivered + printed in ([True], [KeyboardInterrupt])
        runs += bool(delivered)
        delivered.clear(), printed.clear()
        fastembed.empty_cache()
    assert runs > 3


INTERRUPTED_FINALIZER = """
import sys, threading, numpy as np
from fastembed.backends import output_cache
printed = []
sys.unraisablehook = lambda unraisable: printed.append(unraisable.exc_type)
lease = output_cache.new_output((600, 4096), np.float16)
def ctrl_c():
    raise KeyboardInterrupt  # as a Ctrl-C landing in the finalizer's code
output_cache.cached_bytes = ctrl_c
try:
    del lease  # its finalizer runs on the main thread, and returns
    after_the_finalizer = True
    threading.Event().wait()  # for ever, unless interrupted as by a Ctrl-C: run_script's timeout ends it
    print("not raised again")
except KeyboardInterrupt:
    print("raised again", after_the_finalizer, printed)
"""


def test_a_ctrl_c_caught_in_a_finalizer_on_the_main_thread_is_raised_again_after_it_returns(tmp_path):
    """A request from within the finalizer would be served before it returns, and Python would only print it; and
    the interrupt wakes a blocking wait, as a Ctrl-C does."""
    finished = run_script(tmp_path, INTERRUPTED_FINALIZER)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.stdout.split()[:3] == ["raised", "again", "True"], finished.stdout + finished.stderr[-2000:]
    assert finished.stdout.rstrip().endswith("[]"), finished.stdout  # nothing printed as unraisable


class _Keeper:
    """In a reference cycle, brings back to life, from its ``__del__``, the object it holds."""

    brought_back: list[object] = []

    def __del__(self):
        _Keeper.brought_back.append(self.held)


def test_a_lease_brought_back_to_life_after_its_finalizer_ran_keeps_its_buffer():
    """The collector runs a lease's finalizer before any ``__del__`` of its cycle, which may keep the lease after all:
    its buffer must not be handed out while that lease still exposes it."""
    import gc

    out = output_cache.new_output(SHAPE, np.float16)
    out[...] = 1.5
    keeper = _Keeper()
    keeper.held, keeper.cycle = out.base.base, keeper
    del out, keeper
    gc.collect()
    lease = _Keeper.brought_back.pop()
    alive = np.asarray(lease)[: np.prod(SHAPE) * 2].view(np.float16)
    other = output_cache.new_output(SHAPE, np.float16)
    other[...] = 0
    assert not np.shares_memory(alive, other) and (alive == 1.5).all()


@pytest.mark.parametrize(
    "keep",
    [
        lambda out: out[10:20],
        lambda out: out.reshape(-1),
        lambda out: out.view(np.uint8),
        lambda out: memoryview(out),
        lambda out: np.frombuffer(out, np.uint8),
        lambda out: out.T,
        lambda out: [out],
        lambda out: np.asarray(out),
    ],
    ids=["slice", "reshape", "view", "memoryview", "frombuffer", "transpose", "container", "asarray"],
)
def test_no_buffer_is_handed_out_while_anything_reaches_it(keep):
    out = output_cache.new_output(SHAPE, np.float16)
    out[...] = 1.5
    kept = keep(out)
    span = (address(out), address(out) + out.nbytes)
    del out
    other = output_cache.new_output(SHAPE, np.float16)
    assert not span[0] <= address(other) < span[1]
    other[...] = 0
    held = np.asarray(kept[0] if isinstance(kept, list) else kept).reshape(-1).view(np.uint8)
    assert (held.view(np.float16) == 1.5).all()


def test_a_torch_tensor_over_the_output_keeps_it():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    out = output_cache.new_output(SHAPE, np.float32)
    out[...] = 2.0
    tensor = torch.from_numpy(out)
    where = address(out)
    del out
    assert address(output_cache.new_output(SHAPE, np.float32)) != where
    assert bool((tensor == 2.0).all())


def test_allocating_lookups_reuse_outputs_and_stay_exact():
    table = random_table(5000, 4096, seed=3)
    rng = np.random.default_rng(3)
    results = []
    for round_ in range(4):
        ids = rng.integers(0, 5000, 600)
        result = fastembed.lookup(table, ids, backend="numba")
        assert_bit_equal(result, table[ids])
        if round_ % 2:
            results.append((ids, result))  # half are kept: their buffers must not be reused
    for ids, result in results:
        assert_bit_equal(result, table[ids])
    assert address(results[0][1]) != address(results[1][1])


def test_threads_never_share_a_live_output():
    table = random_table(3000, 4096, seed=4)
    failures = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(20):
            ids = rng.integers(0, 3000, 600)
            result = fastembed.lookup(table, ids, backend="numba")
            if not np.array_equal(result.view(np.uint16), table[ids].view(np.uint16)):
                failures.append(seed)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_the_limit_bounds_what_is_kept_and_empty_cache_frees_it():
    fastembed.set_output_cache_limit(6 * 2**20)
    outputs = [output_cache.new_output(SHAPE, np.float16) for _ in range(3)]
    del outputs
    assert 0 < output_cache.cached_bytes() <= 6 * 2**20
    fastembed.empty_cache()
    assert output_cache.cached_bytes() == 0
    fastembed.set_output_cache_limit(0)
    out = output_cache.new_output(SHAPE, np.float16)
    assert out.flags.owndata  # plain numpy memory when the cache is off
    del out
    assert output_cache.cached_bytes() == 0


@pytest.mark.parametrize(("text", "message"), [("lots", "not a whole number"), ("-3", "negative")])
def test_a_bad_environment_setting_is_named_by_large_lookups_and_info(monkeypatch, text, message):
    from fastembed.info import format_report, report

    monkeypatch.setenv(output_cache.ENVIRONMENT_VARIABLE, text)
    monkeypatch.setattr(output_cache, "_limit", None)
    expected = f"FASTEMBED_OUTPUT_CACHE_BYTES={text!r}.*{message}"
    with pytest.raises(ValueError, match=expected):
        fastembed.lookup(random_table(700, 4096), np.arange(600), backend="numba")
    assert fastembed.lookup(random_table(700, 64), np.arange(6), backend="numba").shape == (6, 64)
    assert "ERROR: FASTEMBED_OUTPUT_CACHE_BYTES" in format_report(report())
    fastembed.set_output_cache_limit(2**20)  # an explicit limit replaces the setting
    assert fastembed.lookup(random_table(700, 4096), np.arange(600), backend="numba").shape == (600, 4096)


@pytest.mark.parametrize("text", ["1_000", "\u0665", "0x10", "1e3", "5 6", "-", "+"])
def test_only_decimal_digits_make_a_setting(monkeypatch, text):
    """int() would read "1_000" and an Arabic-Indic five as numbers; a setting is plain digits."""
    monkeypatch.setenv(output_cache.ENVIRONMENT_VARIABLE, text)
    with pytest.raises(ValueError, match="is not a whole number of bytes"):
        output_cache._read_limit()


def test_a_setting_may_have_spaces_around_it_and_a_long_one_is_shown_shortened(monkeypatch):
    monkeypatch.setenv(output_cache.ENVIRONMENT_VARIABLE, " 4096 \n")
    assert output_cache._read_limit() == 4096
    monkeypatch.setenv(output_cache.ENVIRONMENT_VARIABLE, "9" * 5000)
    with pytest.raises(ValueError, match="is above 2\\*\\*64 bytes") as error:
        output_cache._read_limit()
    assert len(str(error.value)) < 200
    for text, refused in ((str(2**64), False), (str(2**64 + 1), True), ("0" * 30 + str(2**64), False)):
        monkeypatch.setenv(output_cache.ENVIRONMENT_VARIABLE, text)  # the bound of set_output_cache_limit too
        if refused:
            with pytest.raises(ValueError, match="is above 2\\*\\*64 bytes"):
                output_cache._read_limit()
        else:
            assert output_cache._read_limit() == 2**64


@pytest.mark.parametrize(("text", "limit"), [("0" * 5000, 0), ("0" * 40 + "12", 12)])
def test_leading_zeros_do_not_count_as_digits(monkeypatch, text, limit):
    monkeypatch.setenv(output_cache.ENVIRONMENT_VARIABLE, text)
    assert output_cache._read_limit() == limit


@pytest.mark.parametrize(("text", "reason"), [("-0", "is signed"), ("-00", "is signed"), ("+4", "is signed"),
                                              ("-1", "is negative"), ("-007", "is negative")])
def test_a_signed_setting_is_refused_for_its_sign(monkeypatch, text, reason):
    """int() would read "+4" and "-0"; a setting is plain digits, and only a number below zero is called negative."""
    monkeypatch.setenv(output_cache.ENVIRONMENT_VARIABLE, text)
    with pytest.raises(ValueError, match=f"{re.escape(repr(text))} {reason}"):
        output_cache._read_limit()


def test_a_lease_shows_no_way_to_its_buffer_but_through_itself():
    """An array made from the buffer itself would keep the memory without the lease: the next lookup could be given it."""
    result = output_cache.new_output(SHAPE, np.float16)
    lease = result.base.base
    assert type(lease).__name__ == "_Lease"
    assert not any(isinstance(value, np.ndarray) for value in lease.__array_interface__.values())
    assert not [name for name in dir(lease) if not name.startswith("_")]


def test_a_bad_environment_setting_is_named_even_while_numpy_serves_during_a_compile(monkeypatch):
    """A server warming up while the kernels compile must not pass start-up and fail its first large request later."""
    from fastembed.backends import numba_backend

    if numba_backend.BACKEND.unavailable_reasons():
        pytest.skip("the numba backend is unavailable here")
    monkeypatch.setenv(output_cache.ENVIRONMENT_VARIABLE, "lots")
    monkeypatch.setattr(output_cache, "_limit", None)
    kernel_views = numba_backend.kernel_views
    monkeypatch.setattr(numba_backend, "kernel_views",
                        lambda *arguments: (*kernel_views(*arguments)[:3], "a signature still compiling"))
    monkeypatch.setattr(numba_backend.BACKEND, "_compile", lambda *arguments: False)  # numpy serves meanwhile
    table = random_table(700, 4096)
    with pytest.raises(ValueError, match="FASTEMBED_OUTPUT_CACHE_BYTES='lots'"):
        fastembed.lookup(table, np.arange(600), backend="numba")
    out = np.empty((600, 4096), table.dtype)
    assert fastembed.lookup(table, np.arange(600), out=out, backend="numba") is out  # no output to allocate
    # A one-row table's row stride can be anything: the output's size (128 bytes here), not the stride, decides.
    one_row = np.lib.stride_tricks.as_strided(np.zeros(4, np.float32), shape=(1, 4), strides=(2**30, 4))
    assert fastembed.lookup(one_row, np.zeros(8, np.int64), backend="numba").shape == (8, 4)


def test_small_outputs_come_from_numpy():
    out = output_cache.new_output((10, 64), np.float32)
    assert out.flags.owndata


@pytest.mark.parametrize("limit", [0, 64 * 2**20])
def test_streamed_allocating_outputs_start_on_a_cache_line(monkeypatch, limit):
    """From the streaming size on (below the cache's too, and with the cache off), the numba backend's allocating
    gathers and dequantizing lookups return outputs that start on a 64-byte line."""
    from fastembed.tables import random_quantized_table

    monkeypatch.setattr(output_cache, "_limit", limit)
    table = random_table(400, 4096)  # 8 KiB float16 rows
    quantized = random_quantized_table("q8_0", 400, 4096)
    rng = np.random.default_rng(limit)
    for rows in (numba_backend.STREAM_MIN_OUT_BYTES // 8192, 300, 600):  # 2 MiB, 2.3 MiB, 4.7 MiB
        ids = rng.integers(0, 400, rows)
        dense = numba_backend.BACKEND.gather(table, ids, None)
        dequantized = numba_backend.BACKEND.dequantize(quantized, ids, None, np.dtype(np.float16))
        assert address(dense) % 64 == 0 and address(dequantized) % 64 == 0
        assert_bit_equal(dense, table[ids])
        del dense, dequantized


def test_info_shows_the_cache():
    from fastembed.info import format_report, report

    assert "output_cache:" in format_report(report())


def test_a_result_alive_at_exit_keeps_its_buffer(tmp_path):
    """Pending finalizers run at exit; an atexit handler's lookup must not land on a result that is still alive."""
    finished = run_script(
        tmp_path,
        "import atexit, numpy as np\n"
        "from fastembed.backends import output_cache\n"
        "output_cache.set_limit(64 * 2**20)\n"
        "def at_exit():\n"
        "    later = output_cache.new_output((600, 4096), np.float16)\n"
        "    later[...] = 0\n"
        "    print(later.ctypes.data != result.ctypes.data, bool((result == 1.5).all()))\n"
        "atexit.register(at_exit)\n"
        "result = output_cache.new_output((600, 4096), np.float16)\n"
        "result[...] = 1.5\n",
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.split() == ["True", "True"]


def test_a_returning_buffer_makes_room_by_freeing_the_oldest():
    fastembed.set_output_cache_limit(20 * 2**20)
    large = [output_cache.new_output((1200, 4096), np.float16) for _ in range(2)]  # 2 x 10 MiB
    del large
    assert output_cache.cached_bytes() == 20 * 2**20
    small = [output_cache.new_output(SHAPE, np.float16) for _ in range(3)]  # too small for the 10 MiB buffers
    del small
    # The small buffers came back last and stay; the large ones made room, oldest first.
    assert output_cache.cached_bytes() <= 20 * 2**20
    sizes = sorted(buffer.size for buffer, _ in output_cache._free.values())
    assert sizes == [6 * 2**20] * 3
    again = output_cache.new_output(SHAPE, np.float16)
    assert output_cache.cached_bytes() == 2 * 6 * 2**20
    del again
    fastembed.set_output_cache_limit(4 * 2**20)
    too_large = output_cache.new_output(SHAPE, np.float16)
    del too_large  # a buffer larger than the limit is freed itself
    assert output_cache.cached_bytes() == 0


def test_a_limit_set_while_the_setting_is_read_takes_precedence(monkeypatch):
    monkeypatch.setattr(output_cache, "_limit", None)
    reading, release = threading.Event(), threading.Event()
    read = output_cache._read_limit

    def slow_read():
        reading.set()
        release.wait(10)
        return read()

    monkeypatch.setattr(output_cache, "_read_limit", slow_read)
    first_use = threading.Thread(target=output_cache.limit)
    first_use.start()
    reading.wait(10)
    setter = threading.Thread(target=fastembed.set_output_cache_limit, args=(0,))
    setter.start()
    release.set()
    first_use.join(10)
    setter.join(10)
    assert output_cache.limit() == 0


def test_a_lease_cannot_be_copied_or_pickled():
    out = output_cache.new_output(SHAPE, np.float16)
    lease = out.base.base
    assert type(lease).__name__ == "_Lease"
    for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            duplicate(lease)
    assert pickle.loads(pickle.dumps(out)).shape == SHAPE  # the array itself pickles as data


class _Cycle:
    """An object in a reference cycle: only the garbage collector frees what it holds."""


class _CollectingFree(dict):
    """The cache's free buffers, whose first removal runs a collection of the youngest objects: a collection that
    happens to start in the middle of the cache's own loop over them."""

    collected = False

    def _collect_once(self):
        if not self.collected:
            self.collected = True
            gc.collect(0)

    def pop(self, *args):
        self._collect_once()
        return super().pop(*args)

    def popitem(self):
        self._collect_once()
        return super().popitem()

    def __delitem__(self, key):
        self._collect_once()
        super().__delitem__(key)

    def clear(self):
        self._collect_once()
        super().clear()


@pytest.mark.parametrize("shrink", [fastembed.empty_cache, lambda: fastembed.set_output_cache_limit(12 * 2**20)])
def test_a_result_freed_by_a_collection_inside_the_cache_is_kept_on_the_way_out(shrink):
    """A lease's finalizer run by a garbage collection in the middle of a trim once made it index past the list."""
    table = random_table(4096, 1024, "float32")  # 4 KiB rows: 1,024 ids make 4 MiB
    fastembed.set_output_cache_limit(16 * 2**20)
    first, second, third, kept = (fastembed.lookup(table, np.arange(n), backend="numba") for n in (1024, 1024, 2048, 2048))
    kept_buffer = address(kept)
    original = output_cache._free
    gc.disable()  # the cycle below stays young, uncollected, until the trim's collection
    try:
        del first, second, third  # 4 + 4 + 8 MiB free in the cache
        cycle = _Cycle()
        cycle.self, cycle.result = cycle, kept
        del cycle, kept
        free = output_cache._free = _CollectingFree(original)
        shrink()
    finally:
        gc.enable()
        if output_cache._free is not original:  # the cache's own dict again, holding what the trim left
            original.clear()
            original.update(output_cache._free)
            output_cache._free = original
    assert free.collected
    assert output_cache.cached_bytes() <= output_cache.limit()
    assert output_cache.cached_bytes() == sum(buffer.size for buffer, _ in output_cache._free.values())
    assert kept_buffer in {address(buffer) for buffer, _ in output_cache._free.values()}  # kept, not lost
    assert type(output_cache._free) is dict


@pytest.mark.parametrize(("limit", "error"), [("1G", TypeError), (1.5, TypeError), (True, TypeError), (-1, ValueError),
                                             (2**64 + 1, ValueError), (10**400, ValueError),
                                             pytest.param(-10**5000, ValueError, id="-10**5000")])
def test_a_limit_that_is_no_byte_count_is_refused_by_kind(limit, error):
    """A limit of hundreds of digits was taken, and info's line of the cache then raised OverflowError."""
    with pytest.raises(error, match="the output cache limit is a number of bytes from 0 to 2\\*\\*64, got"):
        fastembed.set_output_cache_limit(limit)


def test_the_largest_limit_is_shown_in_whole_mib():
    from fastembed.backends import output_cache

    before = output_cache.limit()
    fastembed.set_output_cache_limit(2**64)
    try:
        assert f"limit {2**44} MiB" in output_cache.describe()
    finally:
        fastembed.set_output_cache_limit(before)
