"""fastembed.distributed.VocabParallelEmbedding on gloo: exact results, errors agreed on every rank, no hangs.

Each group of ranks is started with torch.multiprocessing and a file://
rendezvous in tmp_path; several checks run in one group (start-up is slow).
Every rank writes its outcome to a file and leaves with ``os._exit``; the
parent joins with a hard deadline and kills ranks still running, so a hang
fails the test instead of CI. ``FASTEMBED_DIST_KILL_REPEATS`` sets how many
times the rank-killing test runs (default 4: each way to fail once); its
groups start from a forkserver that has imported torch once, so that many
runs stay cheap.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import mmap
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI installs its CPU build: .ci/run)")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch build has no gloo backend", allow_module_level=True)

import fastembed  # noqa: E402
from fastembed import distributed  # noqa: E402
from fastembed.arrays import torch_adapter  # noqa: E402
from fastembed.backends import numba_backend  # noqa: E402
from fastembed.distributed import CommunicationError, VocabParallelEmbedding  # noqa: E402
from fastembed.formats import FORMATS, QuantizedTable, quantize_rows  # noqa: E402
from fastembed.tables import random_quantized_table, random_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VOCAB = 41  # prime: no world size divides it
SEED = 7
#: (dtype, dim): each integer word the collective uses (row bytes divisible by 8, by 4, neither) and every kind of dtype.
#: Records of 3, 5, 6 and 7 bytes whose rows are a whole number of wider words (the exchange's word), and one
#: whose rows are not.
TABLES = [("float16", 6), ("float16", 7), ("bfloat16", 4), ("float32", 8), ("float64", 3), ("int8", 5),
          ("uint8", 9), ("int32", 4), ("V3", 5), ("V3", 4), ("S3", 8), ("V5", 8), ("V6", 4), ("V7", 8)]
TORCH_KINDS = ("float16", "bfloat16", "float32", "int8")
#: (format, dim) of the quantized tables: ggml's q8_0 and fp8 with row scales (quantized here), a random q4_k.
QUANTIZED = [("q8_0", 64), ("fp8_e4m3", 48), ("q4_k", 256)]
#: What a quantized table dequantizes into (None: float32).
OUTPUT_DTYPES = (None, "float16", "bfloat16", "float32")
#: Bit patterns that an arithmetic combine would not preserve: -0.0, NaNs with payloads (quiet, signalling,
#: negative), infinity; written into rows 1 to 5.
SPECIAL_BITS = {
    "float16": [0x8000, 0x7E01, 0x7C01, 0xFE3F, 0xFC00],
    "bfloat16": [0x8000, 0x7FC1, 0x7F81, 0xFFA5, 0xFF80],
    "float32": [0x80000000, 0x7FC00001, 0x7F800001, 0xFFA00005, 0xFF800000],
    "float64": [0x8000000000000000, 0x7FF8000000000001, 0x7FF0000000000001, 0xFFF4000000000005, 0xFFF0000000000000],
}
#: The exchanges every check runs on (ranks of one host: "auto" is shared memory).
EXCHANGES = ("shared_memory", "all_reduce")
#: Ids whose float16 rows of 64 (2.4 MiB) outgrow a segment's first buffer (one 2 MiB granule).
LARGE_IDS = 20000
#: Where kill_task's victim dies while the survivors grow the shared-memory segment: rank 0 right after creating
#: the file (only the survivors can remove it), the last rank before mapping it.
GROWING_STAGES = {"after making the segment": 0, "before mapping the segment": -1}
KILL_REPEATS = int(os.environ.get("FASTEMBED_DIST_KILL_REPEATS", "4"))
KILL_TIMEOUT_S = 2.0
#: A group that has not finished by then has hung: its ranks are killed and the test fails. Generous: on a
#: 2-core machine the 3-rank group of every check shares the cores with another test worker's group, and each
#: compiles its kernels where the cache is empty.
GROUP_DEADLINE_S = 400.0


# -- running a group of ranks ----------------------------------------------------------------------------------


def run_ranks(folder: Path, world: int, task, *args, deadline_s: float = GROUP_DEADLINE_S,
              start_method: str = "spawn", backend: str = "gloo") -> list[dict]:
    """Run ``task(rank, world, *args)`` on `world` ranks of a fresh group of `backend`; each rank's outcome, by rank.

    An outcome is ``{"result": ...}``, ``{"error": type name, "message": ..., "traceback": ...}``, or
    ``{"died": exit code}`` for a rank that left without writing one. Ranks still running at the deadline
    are killed and the test fails: a hang never outlives the test.
    """
    run = folder / f"group-{uuid.uuid4().hex[:8]}"
    run.mkdir()
    init = f"file://{run / 'rendezvous'}"
    arguments = (world, init, str(run), task, args, backend)
    if start_method == "spawn":
        context = torch.multiprocessing.spawn(_rank_main, args=arguments, nprocs=world, join=False)
    else:
        context = torch.multiprocessing.start_processes(_rank_main, args=arguments, nprocs=world, join=False,
                                                        start_method=start_method)
    deadline = time.monotonic() + deadline_s
    for process in context.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
    for rank in hung:
        context.processes[rank].kill()
        context.processes[rank].join(10)
    assert not hung, f"ranks {hung} of {world} were still running after {deadline_s:.0f} s: a hang"
    outcomes = []
    for rank, process in enumerate(context.processes):
        path = run / f"rank{rank}.pickle"
        outcomes.append(pickle.loads(path.read_bytes()) if path.exists() else {"died": process.exitcode})
    return outcomes


#: In a rank: the folder its group's outcomes are written to.
_RUN_FOLDER: Path | None = None


def _rank_main(rank: int, world: int, init: str, folder: str, task, args, backend: str) -> None:
    global _RUN_FOLDER
    _RUN_FOLDER = Path(folder)
    try:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        outcome = {"result": task(rank, world, *args)}
    except BaseException as error:  # reported to the parent, which asserts on it
        outcome = {"error": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    Path(folder, f"rank{rank}.pickle").write_bytes(pickle.dumps(outcome))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # never wait on a group that may still hold a collective of a dead rank


def results(outcomes: list[dict]) -> list:
    for rank, outcome in enumerate(outcomes):
        assert "result" in outcome, f"rank {rank}: {outcome.get('traceback') or outcome}"
    return [outcome["result"] for outcome in outcomes]


# -- tables and comparisons (every rank builds the same ones) -----------------------------------------------------


def make_table(dtype: str, dim: int, vocab: int = VOCAB) -> np.ndarray:
    table = random_table(vocab, dim, dtype, SEED)
    if dtype in SPECIAL_BITS:
        unsigned = table.view(f"u{table.dtype.itemsize}")
        for row, bits in enumerate(SPECIAL_BITS[dtype], start=1):
            unsigned[row, :] = bits
    return table


def as_torch(table: np.ndarray):
    if table.dtype.type.__module__ == "ml_dtypes":  # bfloat16, float8: numpy has no such dtype to share
        return torch.from_numpy(table.view(f"u{table.dtype.itemsize}")).view(getattr(torch, table.dtype.name))
    return torch.from_numpy(table)


def host_bytes(array) -> np.ndarray:
    """The bytes of a numpy array or torch CPU tensor, for bit-exact comparison."""
    if isinstance(array, torch.Tensor):
        array = torch_adapter.ADAPTER.snapshot(array)
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def same_bits(label: str, actual, expected, kind: type) -> list[str]:
    """Failures (none when `actual` is `expected`'s kind, shape, dtype and bytes)."""
    if not isinstance(actual, kind):
        return [f"{label}: got a {type(actual).__name__}, expected a {kind.__name__}"]
    if tuple(actual.shape) != tuple(expected.shape) or str(actual.dtype) != str(expected.dtype):
        return [f"{label}: got {tuple(actual.shape)} {actual.dtype}, expected {tuple(expected.shape)} {expected.dtype}"]
    if not np.array_equal(host_bytes(actual), host_bytes(expected)):
        return [f"{label}: the bytes differ"]
    return []


def id_sets() -> list[tuple[str, object]]:
    rng = np.random.default_rng(SEED)
    return [
        ("specials and repeats", np.array([0, VOCAB - 1, 1, 2, 3, 4, 5, 20, 20, 40], np.int64)),
        ("7 int32", rng.integers(0, VOCAB, 7).astype(np.int32)),
        ("2-D 3x5", rng.integers(0, VOCAB, (3, 5))),
        ("2-D 2x3 int16", rng.integers(0, VOCAB, (2, 3)).astype(np.int16)),
        ("one", np.array([VOCAB - 1])),
        ("empty", np.array([], np.int64)),
        ("empty 0x4", np.empty((0, 4), np.int64)),
        ("list", [3, 1, 4, 1, 5]),
        ("torch", torch.tensor([[9, 2], [40, 0], [7, 7]], dtype=torch.int64)),
        ("scalar", np.int64(5)),
    ]


def check_lookups(emb: VocabParallelEmbedding, table, world: int, rank: int, label: str, dtype=None) -> list[str]:
    """Every id set, both modes, against a single-process fastembed.lookup(table, ids, dtype=dtype) on the whole table."""
    failures = []
    rows = table.data if isinstance(table, QuantizedTable) else table
    kind = torch.Tensor if isinstance(rows, torch.Tensor) else np.ndarray
    for name, ids in id_sets():
        expected = fastembed.lookup(table, ids, dtype=dtype)
        failures += same_bits(f"{label} {name} full", emb(ids, dtype=dtype), expected, kind)
        if np.ndim(ids) == 0:
            continue
        start, stop = distributed.position_range(np.shape(ids)[0], world, rank)
        failures += same_bits(f"{label} {name} scatter", emb(ids, mode="scatter", dtype=dtype), expected[start:stop],
                              kind)
    return failures


def make_quantized(fmt: str, dim: int, vocab: int = VOCAB) -> QuantizedTable:
    """q8_0 and fp8_e4m3 quantized from random rows (as fastembed writes them); other formats random blocks."""
    if fmt not in ("q8_0", "fp8_e4m3"):
        return random_quantized_table(fmt, vocab, dim, SEED)
    data, scales = quantize_rows(random_table(vocab, dim, "float32", SEED), FORMATS[fmt])
    return QuantizedTable(data, fmt, dim, scales)


# -- the tasks the ranks run ------------------------------------------------------------------------------------


def exactness_task(rank: int, world: int, exchange: str) -> dict:
    """Every dtype, numpy and torch tables, padded vocabularies: failures (none expected) and row ranges."""
    build = functools.partial(VocabParallelEmbedding, exchange=exchange)
    failures: list[str] = []
    for dtype, dim in TABLES:
        table = make_table(dtype, dim)
        failures += check_lookups(build(table, timeout=30), table, world, rank, f"{dtype} x{dim}")
        if dtype in TORCH_KINDS:
            tensor = as_torch(table)
            failures += check_lookups(build(tensor, timeout=30), tensor, world, rank,
                                      f"torch {dtype} x{dim}")
    table = make_table("float16", 6)
    ranges = {}
    for pad in (8, 64):
        emb = build(table, pad_to_multiple=pad, timeout=30)
        failures += check_lookups(emb, table, world, rank, f"pad {pad}")
        ranges[pad] = (emb.vocab_start, emb.vocab_end, emb.padded_vocab_size, int(emb.shard.shape[0]))
    # Rows of 4 KiB, 4,096 ids: each rank places hundreds of rows, which the numba backend's kernel serves.
    wide = make_table("float16", 2048)
    emb = build(wide, timeout=30)
    ids = np.random.default_rng(SEED).integers(0, VOCAB, 4096)
    start, stop = distributed.position_range(ids.size, world, rank)
    emb(ids, mode="scatter")
    fastembed.wait_for_compiles()  # the first call was served by numpy while the place kernel compiled
    failures += same_bits("wide scatter", emb(ids, mode="scatter"), fastembed.lookup(wide, ids)[start:stop], np.ndarray)
    numba_placed = any(signature[0] == "place" for signature in numba_backend.BACKEND._compiles.done)
    plain = build(table)
    ranges[1] = (plain.vocab_start, plain.vocab_end, plain.padded_vocab_size, int(plain.shard.shape[0]))
    shard_is_view = bool(np.shares_memory(plain.shard, table))
    try:  # a JAX table's shard is a numpy view of this rank's rows, not the whole table
        import jax.numpy as jnp
    except ImportError:
        pass
    else:
        shown = build(jnp.asarray(table)).shard
        if not (type(shown) is np.ndarray and shown.tobytes() == table[plain.vocab_start:plain.vocab_end].tobytes()):
            failures.append(f"jax shard: {type(shown).__name__} of shape {getattr(shown, 'shape', None)}")
    plain([1, 2, 3])
    return {"failures": failures, "ranges": ranges, "shard_is_view": shard_is_view, "numba_placed": numba_placed,
            "timings": plain.last_timings._asdict(), "exchange": plain.exchange, "repr": repr(plain)}


def quantized_task(rank: int, world: int, files: dict, exchange: str) -> dict:
    """Quantized tables as arrays (numpy, torch data) and files: lookups, dtypes, errors, the file's maps."""
    build = functools.partial(VocabParallelEmbedding, exchange=exchange)
    failures: list[str] = []
    for fmt, dim in QUANTIZED:
        table = make_quantized(fmt, dim)
        emb = build(table, timeout=30)
        for dtype in OUTPUT_DTYPES if fmt != "q4_k" else (None, "bfloat16"):
            failures += check_lookups(emb, table, world, rank, f"{fmt} into {dtype}", dtype)
    table = make_quantized("q8_0", 64)
    torch_table = QuantizedTable(torch.from_numpy(table.data), "q8_0", 64)
    failures += check_lookups(build(torch_table, timeout=30), torch_table, world, rank,
                              "torch q8_0 into float16", "float16")
    dense = make_table("float16", 6)  # dtype= on a dense float table casts, as fastembed.lookup does
    failures += check_lookups(build(dense, timeout=30), dense, world, rank, "float16 into float32",
                              "float32")
    layer = build(table, timeout=30)
    shard = layer.shard
    facts = {"format": layer.format, "dtype": str(layer.dtype), "shard": (type(shard).__name__, shard.format.name,
                                                                         int(shard.data.shape[0])),
             "shard is a writeable view": (bool(np.shares_memory(shard.data, table.data)), shard.data.flags.writeable)}
    cases = {
        "int8 everywhere": lambda: layer([1, 2], dtype="int8"),
        "int8 on one rank": lambda: layer([1, 2], dtype="int8" if rank == world - 1 else "float16"),
        "dtypes differ": lambda: layer([1, 2], dtype="float16" if rank == 0 else "bfloat16"),
        "bad id everywhere": lambda: layer(np.array([[1, 2], [VOCAB, 3]]), mode="scatter", dtype="float16"),
    }
    outcomes = {case: _outcome(call) for case, call in cases.items()}
    messages = {"int8": _message(lambda: fastembed.lookup(table, [1, 2], dtype="int8")),
                "bad id": _message(lambda: fastembed.lookup(table, np.array([[1, 2], [VOCAB, 3]]), dtype="float16"))}
    failures += same_bits("after the errors", layer([7, 8], dtype="bfloat16"),
                          fastembed.lookup(table, [7, 8], dtype="bfloat16"), np.ndarray)
    maps = {}
    for label, (path, fmt, dim, vocab) in files.items():
        if fmt not in FORMATS:
            continue
        emb = build(path, timeout=30)
        emb.check_file()
        spans = mapped_spans(path)
        maps[label] = {"spans": spans, "rows_offset": int(emb.shard.data.offset) if emb.shard.data.size else -1,
                       "rows_bytes": int(emb.shard.data.nbytes), "shard_bytes": int(emb.shard.nbytes),
                       "table_bytes": vocab * FORMATS[fmt].row_bytes(dim), "format": emb.format}
        table = make_quantized(fmt, dim, vocab)
        ids = np.random.default_rng(SEED).integers(0, vocab, (6, 5))
        start, stop = distributed.position_range(6, world, rank)
        for dtype in ("float16", "bfloat16"):
            expected = fastembed.lookup(table, ids, dtype=dtype)
            failures += same_bits(f"{label} {dtype} full", emb(ids, dtype=dtype), expected, np.ndarray)
            failures += same_bits(f"{label} {dtype} scatter", emb(ids, mode="scatter", dtype=dtype),
                                  expected[start:stop], np.ndarray)
        del emb
    return {"failures": failures, "facts": facts, "outcomes": outcomes, "messages": messages, "maps": maps}


def _outcome(call) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        call()
    except Exception as error:
        return (type(error).__name__, str(error), time.monotonic() - started)
    return ("no error", "", time.monotonic() - started)


def errors_task(rank: int, world: int, file_path: str, exchange: str) -> dict:
    """Each mistake, made on every rank or on one: (error type, message, seconds) per case, then a good call."""
    build = functools.partial(VocabParallelEmbedding, exchange=exchange)
    table = make_table("float16", 6)
    emb = build(table, timeout=30)
    padded = build(table, pad_to_multiple=64, timeout=30)
    other = build(table, timeout=30)
    torch_table = as_torch(make_table("float32", 6)).clone()  # storage of its own: resizable
    on_torch = build(torch_table, timeout=30)
    last = world - 1

    def pad_of(layer: VocabParallelEmbedding) -> None:
        padded_size, bounds = layer.padded_vocab_size, layer._bounds
        assert type(padded_size) is int and padded_size == 48 and bounds.tolist() == [
            distributed.row_range(VOCAB, world, r, 8)[0] for r in range(1, world)], (padded_size, bounds)

    def while_another_thread_calls():
        with emb._calling:  # as a second thread of this rank finds it
            emb([1])

    def while_another_thread_calls_another_layer():
        with other._calling:  # the group's lock: the agreements of two layers would pair up across the ranks
            emb([1])

    def while_another_thread_builds():
        with emb._calling:
            build(table, timeout=30)

    class OddIds:  # ids whose conversion raises an OSError whose errno is no number
        def __array__(self, dtype=None, copy=None):
            raise OSError("not a number", "the ids' source went away")

    def after_a_resize_on_the_last_rank():
        if rank == last:
            torch_table.untyped_storage().resize_(0)
        on_torch([1])

    cases = {
        "values differ": lambda: emb(np.array([1, 2, rank])),
        "shapes differ": lambda: emb(np.arange(rank + 1)),
        "modes differ": lambda: emb([1, 2], mode="full" if rank == 0 else "scatter"),
        "bad id on one rank": lambda: emb([1, VOCAB + 5 if rank == last else 2, 3]),
        "bad id everywhere": lambda: emb(np.array([[1, 2], [VOCAB, 3]])),
        "negative id everywhere": lambda: emb([0, -1], mode="scatter"),
        "float ids on one rank": lambda: emb([1.5] if rank == last else [1]),
        "bad mode": lambda: emb([1], mode="gather"),
        "scalar scatter": lambda: emb(np.int64(3), mode="scatter"),
        "padded id": lambda: padded([VOCAB + 1]),
        "int dtypes differ": lambda: emb(np.array([4, 5], np.int32 if rank == 0 else np.int64)),
        "different pad": lambda: build(table, pad_to_multiple=1 + rank, timeout=30),
        "pad as a numpy integer on one rank": lambda: pad_of(build(table, timeout=30, pad_to_multiple=(
            np.uint64(8) if rank == last else 8))),
        "pad beyond 64 bits on one rank": lambda: build(table, pad_to_multiple=2**64 if rank == last else 8),
        "checkpoint path as bytes": lambda: build(os.fsencode(file_path), timeout=30),
        "different names": lambda: build(file_path, name="model.embed_tokens.weight" if rank == 0 else None,
                                         timeout=30),
        "different tables": lambda: build(make_table("float16", 6 + (rank == last))),
        "file missing on one rank": lambda: build(file_path + ("-missing" if rank == last else "")),
        "bad timeout on one rank": lambda: build(table, timeout=-1 if rank == last else 30),
        "name with an array": lambda: build(table, name="wte.weight"),
        "different layers": lambda: (emb if rank == 0 else other)([1, 2]),
        "timeout under a millisecond": lambda: build(table, timeout=1e-4),
        "timeout over a year": lambda: build(table, timeout=1e14),
        "two threads at once": while_another_thread_calls,
        "two threads, two layers of the group": while_another_thread_calls_another_layer,
        "two threads, a build beside a call": while_another_thread_builds,
        "an OSError without a numeric errno on one rank": lambda: emb(OddIds() if rank == last else [1]),
        "storage resized on one rank": after_a_resize_on_the_last_rank,
        "out= on one rank": lambda: emb([1], **({"out": np.empty((1, 6), np.float16)} if rank == last else {})),
        "dtype positionally on one rank": lambda: emb([1], "full", *(["float32"] if rank == last else [])),
    }
    outcomes = {}
    for case, call in cases.items():
        started = time.monotonic()
        try:
            call()
            outcomes[case] = ("no error", "", time.monotonic() - started)
        except Exception as error:
            outcomes[case] = (type(error).__name__, str(error), time.monotonic() - started)
    expected = fastembed.lookup(table, [7, 8, 9])
    after = same_bits("after the errors", emb([7, 8, 9]), expected, np.ndarray)
    after += same_bits("the other layer after the errors", other([7, 8, 9]), expected, np.ndarray)
    return {"outcomes": outcomes, "after": after,
            "lookup message": _message(lambda: fastembed.lookup(table, np.array([[1, 2], [VOCAB, 3]])))}


def cycles_task(rank: int, world: int, exchange: str) -> dict:
    """After a build or a call that raised (on the last rank's account), what the frames held is freed at once.

    The error's traceback held the frame that held the error: a reference cycle, which kept the caller's ids,
    the call's buffers and, from a failed build, the process group alive until a garbage collection (and a
    group still alive at exit could crash gloo's threads).
    """
    import gc
    import weakref

    gc.disable()
    try:
        table = make_table("float32", 8)
        source = table.copy()
        held = weakref.ref(source)
        with contextlib.suppress(ValueError):  # the last rank's own error, shared with every rank
            VocabParallelEmbedding(source, timeout=60, exchange=exchange, pad_to_multiple=0 if rank == world - 1 else 1)
        del source
        build_freed = held() is None
        emb = VocabParallelEmbedding(table, timeout=60, exchange=exchange)
        ids = np.arange(6) if rank < world - 1 else np.array([1, 2, 3, 4, 5, VOCAB])
        held = weakref.ref(ids)
        with contextlib.suppress(IndexError):
            emb(ids)
        del ids
        import copy

        copies = [_outcome(lambda: copy.copy(emb))[:2], _outcome(lambda: copy.deepcopy(emb))[:2],
                  _outcome(lambda: pickle.dumps(emb))[:2]]
        return {"build freed": build_freed, "call freed": held() is None, "copies": copies}
    finally:
        gc.enable()


def shared_memory_task(rank: int, world: int) -> dict:
    """How the exchange is chosen, refused and given up, and where its segments go: per case, its outcome."""
    table = make_table("float16", 64, vocab=4099)
    rng = np.random.default_rng(SEED)
    small, large = rng.integers(0, 4099, 100), rng.integers(0, 4099, LARGE_IDS)
    last = world - 1
    layers: list[VocabParallelEmbedding] = []
    failures: list[str] = []

    def outcome(call) -> tuple[str, str]:
        return _outcome(call)[:2]  # not the seconds: every rank's must be equal

    def build(**options) -> VocabParallelEmbedding:
        layers.append(VocabParallelEmbedding(table, timeout=30, **options))
        return layers[-1]

    def used(emb: VocabParallelEmbedding, ids, mode: str = "full") -> str:
        """The exchange one exact call used."""
        expected = fastembed.lookup(table, ids)
        if mode == "scatter":
            start, stop = distributed.position_range(len(ids), world, rank)
            expected = expected[start:stop]
        failures.extend(same_bits(f"{emb.exchange} {len(ids)} {mode}", emb(ids, mode=mode), expected, np.ndarray))
        return emb.last_timings.exchange

    real_identity, real_create, real_open = (distributed.segments.host_identity, distributed.segments.create_mapping,
                                             distributed.segments.open_mapping)

    def elsewhere():
        return (12345, True) if rank == last else real_identity()

    def without_shm():
        return (real_identity()[0], rank != last)

    def small_shm(path, size):  # a /dev/shm that holds one small segment (rank 0 makes them)
        if size > 4 * 2**20:
            raise OSError(28, "No space left on device")
        return real_create(path, size)

    made: list = []

    def room_for_one(path, size):  # a /dev/shm with room for one segment at a time, whatever its size
        if any(not mapping.closed for mapping in made):  # its pages count until its last mapping goes
            raise OSError(28, "No space left on device (the old segment is still mapped)")
        made.append(real_create(path, size))
        return made[-1]

    def other_shm(path, size):  # the last rank sees another /dev/shm
        if rank == last:
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_open(path, size)

    def auto_sequence():
        emb = build()
        return [emb.exchange, used(emb, small), used(emb, large), used(emb, large, "scatter"), used(emb, small),
                len(emb._shared.names())]

    def with_patch(name, replacement, call):
        original = getattr(distributed.segments, name)
        setattr(distributed.segments, name, replacement)
        try:
            fastembed.wait_for_compiles()  # a compile thread's own catch_warnings would swap out this one's record
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = call()
            # Each warning with the file it points at: the line that called the layer.
            return value, [f"{warning.message} (at {os.path.basename(warning.filename)})" for warning in caught]
        finally:
            setattr(distributed.segments, name, original)

    def explicit_refused():
        emb = build(exchange="shared_memory")
        before = outcome(lambda: used(emb, small))
        refused = outcome(lambda: emb(large))
        return before[0], refused, outcome(lambda: used(emb, small))[0], emb.exchange

    def warning_as_error():
        emb = build()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            raised = outcome(lambda: emb(large))
        return raised[0], emb.exchange

    def warning_as_error_on_rank_0():
        """Rank 0's warning, raised as an error, ended its call before the others' all-reduce: out of step for good."""
        emb = build()
        with warnings.catch_warnings():
            warnings.simplefilter("error" if rank == 0 else "ignore", RuntimeWarning)
            raised = outcome(lambda: emb(large))[0]
        return raised == ("RuntimeWarning" if rank == 0 else "no error"), used(emb, small), used(emb, large)

    def refused_errno():
        emb = build(exchange="shared_memory")
        try:
            emb(large)
        except OSError as error:
            return error.errno
        return None

    cases = {
        "auto": lambda: auto_sequence(),
        "all_reduce": lambda: (lambda emb: [emb.exchange, used(emb, large), len(emb._shared.names())])(
            build(exchange="all_reduce")),
        "hosts differ, shared_memory": lambda: with_patch("host_identity", elsewhere,
                                                          lambda: outcome(lambda: build(exchange="shared_memory"))),
        "hosts differ, auto": lambda: with_patch("host_identity", elsewhere, lambda: build().exchange),
        "no shm on one rank, shared_memory": lambda: with_patch(
            "host_identity", without_shm, lambda: outcome(lambda: build(exchange="shared_memory"))),
        "no shm on one rank, auto": lambda: with_patch("host_identity", without_shm, lambda: build().exchange),
        "exchanges differ": lambda: outcome(lambda: build(exchange="auto" if rank == 0 else "all_reduce")),
        "bad exchange": lambda: outcome(lambda: build(exchange="gloo")),
        "small shm, auto": lambda: with_patch("create_mapping", small_shm, auto_sequence),
        "small shm, shared_memory": lambda: with_patch("create_mapping", small_shm, explicit_refused),
        "small shm, errno": lambda: with_patch("create_mapping", small_shm, refused_errno),
        "small shm, warning as error on rank 0": lambda: with_patch("create_mapping", small_shm,
                                                                    warning_as_error_on_rank_0),
        "growing in a shm with room for one segment": lambda: with_patch(
            "create_mapping", room_for_one,
            lambda: (lambda emb: [used(emb, small), outcome(lambda: used(emb, large))[0], emb.last_timings.exchange])(
                build(exchange="shared_memory"))),
        "other shm, auto": lambda: with_patch("open_mapping", other_shm, auto_sequence),
        "other shm, shared_memory": lambda: with_patch("open_mapping", other_shm, explicit_refused),
        "other shm, auto, warnings as errors": lambda: with_patch("open_mapping", other_shm, warning_as_error),
    }
    outcomes = {case: call() for case, call in cases.items()}
    names = [name for emb in layers for name in emb._shared.names()]
    left = [name for name in names if os.path.exists(os.path.join(distributed.segments.SHM_FOLDER, name))]
    return {"outcomes": outcomes, "failures": failures, "names": names, "left": left, "repr": repr(layers[0])}


def _message(call) -> str:
    try:
        call()
    except Exception as error:
        return str(error)
    return ""


def checkpoint_task(rank: int, world: int, files: dict, exchange: str) -> dict:
    """Tables from files: the mapping covers only this rank's rows; lookups are exact."""
    build = functools.partial(VocabParallelEmbedding, exchange=exchange)
    report: dict = {"failures": [], "maps": {}}
    for label, (path, dtype, dim, vocab) in files.items():
        emb = build(path, timeout=30)
        shard = emb.shard
        spans = mapped_spans(path)
        report["maps"][label] = {"spans": spans, "shard_offset": int(getattr(shard, "offset", -1)),
                                 "shard_bytes": int(shard.nbytes), "table_bytes": vocab * dim * np.dtype(
                                     "u2" if dtype == "bfloat16" else dtype).itemsize}
        emb.check_file()
        table = make_table(dtype, dim, vocab)
        ids = np.random.default_rng(SEED).integers(0, vocab, (6, 5))
        report["failures"] += same_bits(f"{label} full", emb(ids), fastembed.lookup(table, ids), np.ndarray)
        start, stop = distributed.position_range(6, world, rank)
        report["failures"] += same_bits(f"{label} scatter", emb(ids, mode="scatter"),
                                        fastembed.lookup(table, ids)[start:stop], np.ndarray)
        del emb, shard
    return report


def mapped_spans(path: str) -> list[tuple[int, int]]:
    """(file offset, length) of every mapping of `path` in this process (Linux; empty elsewhere)."""
    spans = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    target = os.path.realpath(path)
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            low, high = (int(value, 16) for value in fields[0].split("-"))
            spans.append((int(fields[2], 16), high - low))
    return spans


def kill_task(rank: int, world: int, victim: int, stage: str, exchange: str) -> dict:
    """The victim leaves with os._exit at `stage` of a lookup; the others call until they raise."""
    table = make_table("float16", 64, vocab=4099)
    emb = VocabParallelEmbedding(table, timeout=KILL_TIMEOUT_S, exchange=exchange)
    ids = np.random.default_rng(SEED).integers(0, 4099, 2048)
    emb(ids)
    if stage in GROWING_STAGES:
        ids = np.random.default_rng(SEED).integers(0, 4099, LARGE_IDS)  # the next call grows the segment
    if rank == victim:
        if stage == "after making the segment":
            make = distributed.segments.create_mapping
            distributed.segments.create_mapping = lambda path, size: (make(path, size), os._exit(17))
        elif stage == "before mapping the segment":
            distributed.segments.open_mapping = lambda path, size: os._exit(17)
        elif stage == "before the agreement":
            emb._gather = lambda call: os._exit(17)
        elif stage == "before the data collective":
            emb._communicate = lambda call: os._exit(17)
        elif stage == "at a random moment":
            threading.Timer(0.003, os._exit, (17,)).start()
        else:  # stops calling, alive: the others see only their timeout; it leaves once they have reported
            others = [_RUN_FOLDER / f"rank{other}.pickle" for other in range(world) if other != rank]
            deadline = time.monotonic() + 30
            while not all(path.exists() for path in others) and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(17)
    calls = 0
    while True:  # the survivors must raise, within the timeout of the victim's death
        started = time.monotonic()
        try:
            emb(ids, mode="scatter" if calls % 2 else "full")
        except CommunicationError as error:
            again = _message(lambda: emb(ids))
            return {"error": str(error), "seconds": time.monotonic() - started, "calls": calls, "again": again,
                    "segments": emb._shared.names()}
        calls += 1
        if calls > 10000:
            return {"error": None, "calls": calls}


# -- the tests --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def group(request, tmp_path_factory):
    """One group per world size runs every exactness, error and file check; the tests read its outcomes."""
    world = request.param
    folder = tmp_path_factory.mktemp(f"ranks{world}")
    files = write_checkpoints(folder)
    outcomes = run_ranks(folder, world, combined_task, files)
    return world, results(outcomes)


#: The names of the boards the layers of this rank's process tried to make (:func:`combined_task` records them).
_BOARDS_TRIED: list[str] = []


def _recording_boards() -> None:
    """Make every board of this process through a wrapper that records its name first."""
    open_board = distributed.board.open_board

    def recorded(name, *args, **kwargs):
        _BOARDS_TRIED.append(name)
        return open_board(name, *args, **kwargs)

    distributed.board.open_board = recorded


def combined_task(rank: int, world: int, files: dict) -> dict:
    """The checks in one group (start-up is the slow part), on each exchange."""
    _recording_boards()
    dense = {label: file for label, file in files.items() if file[1] not in FORMATS}
    checks = {exchange: {"exact": exactness_task(rank, world, exchange),
                         "errors": errors_task(rank, world, files["float16 safetensors"][0], exchange),
                         "checkpoint": checkpoint_task(rank, world, dense, exchange),
                         "quantized": quantized_task(rank, world, files, exchange),
                         "cycles": cycles_task(rank, world, exchange)}
              for exchange in EXCHANGES}
    return {**checks, "shared memory": shared_memory_task(rank, world), "board": board_task(rank, world)}


def _in_a_forked_child(call) -> tuple[str, str]:
    """(error type, message) of `call` in a forked child of this rank, which leaves at once."""
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.write(writing, json.dumps(_outcome(call)[:2]).encode())
        finally:
            os._exit(0)
    os.close(writing)
    os.waitpid(child, 0)
    with os.fdopen(reading, "rb") as said:
        return tuple(json.loads(said.read()))


def board_task(rank: int, world: int) -> dict:
    """The agreement board: one per group, shared by its layers, given up alike on every rank when it cannot be made."""
    table = make_table("float16", 6)
    expected = fastembed.lookup(table, [3, 1, 4])
    failures: list[str] = []
    report: dict = {}
    on_world = VocabParallelEmbedding(table, timeout=30, exchange="all_reduce")
    report["default group, all_reduce"] = on_world.agreement
    subgroup = dist.new_group(list(range(world)))
    real_mkfifo = os.mkfifo

    def refused(path, mode=0o777):
        raise OSError(28, "No space left on device", path)

    os.mkfifo = refused if rank == world - 1 else real_mkfifo  # one rank cannot make its pipes
    try:
        first = VocabParallelEmbedding(table, group=subgroup, timeout=30)
    finally:
        os.mkfifo = real_mkfifo
    report["given up"] = (first.agreement, first.exchange)
    failures += same_bits("through the group", first([3, 1, 4]), expected, np.ndarray)
    second = VocabParallelEmbedding(table, group=subgroup, timeout=30)  # tries again, for both layers
    held = first._collectives.held_board()
    report["made by the next layer"] = (first.agreement, second.agreement, held is second._collectives.held_board(),
                                        held is on_world._collectives.held_board())
    failures += same_bits("the first layer on the board", first([3, 1, 4]), expected, np.ndarray)
    failures += same_bits("the second layer on the board", second([3, 1, 4], mode="scatter"),
                          expected[slice(*distributed.position_range(3, world, rank))], np.ndarray)
    report["different layers"] = _outcome(lambda: (first if rank == 0 else second)([1, 2]))[:2]
    report["forked child"] = _in_a_forked_child(lambda: first([5, 6]))
    report["build in a forked child"] = _in_a_forked_child(lambda: VocabParallelEmbedding(table, group=subgroup))
    failures += same_bits("after the mismatch", second([3, 1, 4]), expected, np.ndarray)
    # Rank 0's board as an interrupted agreement of another layer leaves it: every layer of the group refuses.
    out_of_step = dist.new_group(list(range(world)))
    third = VocabParallelEmbedding(table, group=out_of_step, timeout=1)
    if rank == 0:
        third._collectives.held_board()._failed = "an earlier agreement was interrupted on rank 0 (KeyboardInterrupt)"
    report["out of step"] = _outcome(lambda: third([1]))[:2]
    boards = set(_BOARDS_TRIED)  # every board this rank's layers tried to make, not other groups' on this host
    left = [name for name in os.listdir(distributed.segments.SHM_FOLDER)
            if name in boards or name.rpartition("-")[0].rpartition("-")[0] in boards]  # a board, or its pipes
    return {"report": report, "failures": failures, "pipes left": left, "boards tried": len(boards)}


def write_checkpoints(folder: Path) -> dict:
    """Tables as files: label -> (path, dtype or format, dim, vocab).

    Dense: safetensors float16 and bfloat16, .npy float32. Quantized, written by Embedding.save: q8_0 as GGUF,
    fp8_e4m3 as safetensors (rows and row scales).
    """
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as save_torch_file

    files = {}
    vocab, dim = 3001, 64  # about 375 KiB of float16: many pages, so that a whole-table map would show
    table = make_table("float16", dim, vocab)
    path = folder / "model.safetensors"
    save_file({"lm_head.weight": np.zeros((2, 2), np.float16), "model.embed_tokens.weight": table}, str(path))
    files["float16 safetensors"] = (str(path), "float16", dim, vocab)
    bf16 = make_table("bfloat16", 48, 1037)
    path = folder / "bf16.safetensors"
    save_torch_file({"transformer.wte.weight": as_torch(bf16).contiguous()}, str(path))
    files["bfloat16 safetensors"] = (str(path), "bfloat16", 48, 1037)
    path = folder / "table.npy"
    np.save(path, make_table("float32", 20, 997))
    files["float32 npy"] = (str(path), "float32", 20, 997)
    for fmt, suffix, dim in (("q8_0", "gguf", 64), ("fp8_e4m3", "safetensors", 32)):
        path = folder / f"{fmt}.{suffix}"
        fastembed.Embedding(make_quantized(fmt, dim, vocab)).save(path)
        files[f"{fmt} {suffix}"] = (str(path), fmt, dim, vocab)
    return files


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_lookups_are_bit_exact_for_every_dtype_mode_and_ids(group, exchange):
    world, ranks = group
    for rank, result in enumerate(ranks):
        assert result[exchange]["exact"]["failures"] == [], f"rank {rank} of {world}"
        if exchange == "shared_memory" and not numba_backend.BACKEND.unavailable_reasons():  # scatter's rows placed by the kernel, not numpy
            assert result[exchange]["exact"]["numba_placed"], f"rank {rank} of {world}"


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_rows_split_evenly_with_padding(group, exchange):
    world, ranks = group
    for pad, padded in ((1, VOCAB), (8, 48), (64, 64)):
        spans = [result[exchange]["exact"]["ranges"][pad] for result in ranks]
        assert [span[:2] for span in spans] == [distributed.row_range(VOCAB, world, r, pad) for r in range(world)]
        assert spans[0][0] == 0 and spans[-1][1] == padded and {span[2] for span in spans} == {padded}
        for start, stop, _, stored in spans:
            assert stored == max(0, min(stop, VOCAB) - min(start, VOCAB))  # padded rows are not stored
        sizes = [stop - start for start, stop, _, _ in spans]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert all(result[exchange]["exact"]["shard_is_view"] for result in ranks)
    for rank, result in enumerate(ranks):
        report = result[exchange]["exact"]
        timings = report["timings"]
        assert report["exchange"] == timings["exchange"] == exchange
        assert report["repr"].endswith(f"exchange={exchange!r})")
        assert all(timings[name] >= 0 for name in ("prepare_s", "gather_s", "agree_s", "communicate_s", "copy_s"))
        # 3 rows of 6 float16: the all-reduce hands every position to the collective, shared memory a rank's own rows
        ids = np.array([1, 2, 3])
        start, stop = distributed.row_range(VOCAB, world, rank)
        mine = int(((ids >= start) & (ids < stop)).sum())
        assert timings["payload_bytes"] == (3 if exchange == "all_reduce" else mine) * 6 * 2, timings


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_a_failed_build_or_call_frees_what_it_held_at_once_and_a_layer_is_never_copied(group, exchange):
    _, ranks = group
    for result in ranks:
        outcome = result[exchange]["cycles"]
        assert (outcome["build freed"], outcome["call freed"]) == (True, True), outcome
        # a copy would fall out of step with the other ranks (a copy's call wrote a buffer another rank still read)
        assert [kind for kind, _ in outcome["copies"]] == ["TypeError"] * 3, outcome["copies"]
        assert all("cannot be copied or pickled" in message for _, message in outcome["copies"])


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_every_rank_raises_the_same_error_before_any_data_collective(group, exchange):
    world, ranks = group
    outcomes = [result[exchange]["errors"]["outcomes"] for result in ranks]
    expected_types = {
        "values differ": "ValueError", "shapes differ": "ValueError", "modes differ": "ValueError",
        "bad id on one rank": "IndexError", "bad id everywhere": "IndexError", "negative id everywhere": "IndexError",
        "float ids on one rank": "TypeError", "bad mode": "ValueError", "scalar scatter": "ValueError",
        "padded id": "IndexError", "int dtypes differ": "no error", "different pad": "ValueError",
        "pad as a numpy integer on one rank": "no error", "pad beyond 64 bits on one rank": "ValueError",
        "checkpoint path as bytes": "no error", "different names": "ValueError",
        "different tables": "ValueError", "file missing on one rank": "FileNotFoundError",
        "bad timeout on one rank": "ValueError", "name with an array": "ValueError",
        "different layers": "ValueError", "timeout under a millisecond": "ValueError",
        "timeout over a year": "ValueError", "two threads at once": "RuntimeError",
        "two threads, two layers of the group": "RuntimeError", "two threads, a build beside a call": "RuntimeError",
        "storage resized on one rank": "ValueError", "an OSError without a numeric errno on one rank": "OSError",
        "out= on one rank": "TypeError", "dtype positionally on one rank": "TypeError",
    }
    for case, kind in expected_types.items():
        seen = {(outcome[case][0], outcome[case][1]) for outcome in outcomes}
        assert len(seen) == 1, f"{case}: the ranks raised differently: {seen}"
        assert outcomes[0][case][0] == kind, f"{case}: {outcomes[0][case]}"
        assert max(outcome[case][2] for outcome in outcomes) < 10, f"{case}: took too long"
    message = {case: outcomes[0][case][1] for case in expected_types}
    assert message["bad id everywhere"] == ranks[0][exchange]["errors"]["lookup message"]  # fastembed.lookup's own words
    assert message["bad id everywhere"].startswith(f"id {VOCAB} at position (1, 0) is out of range")
    assert message["bad id on one rank"] == (f"id {VOCAB + 5} at position 1 is out of range for a table of {VOCAB} "
                                             f"rows (valid ids are 0..{VOCAB - 1}) (on rank {world - 1} of {world})")
    assert message["padded id"].startswith(f"id {VOCAB + 1} at position 0 is out of range for a table of {VOCAB} rows")
    assert "the ranks disagree on the ids" in message["values differ"]
    assert all(f"rank {rank}: ids of shape (3,)" in message["values differ"] for rank in range(world))
    assert "ids of shape (1,)" in message["shapes differ"] and "ids of shape (2,)" in message["shapes differ"]
    assert "mode 'full'" in message["modes differ"] and "mode 'scatter'" in message["modes differ"]
    assert "ids must be integers" in message["float ids on one rank"]
    assert f"(on rank {world - 1} of {world})" in message["float ids on one rank"]
    assert "the ranks disagree on the table" in message["different pad"]
    assert "the ranks disagree on the table" in message["different tables"]
    assert all(f"name={name!r}" in message["different names"] for name in ("model.embed_tokens.weight", None))
    assert message["pad beyond 64 bits on one rank"].startswith(
        f"pad_to_multiple must be an integer from 1 to 2**62, got {2**64} (on rank {world - 1} of {world})")
    assert "-missing" in message["file missing on one rank"]
    assert "timeout must be None or a number of seconds from 0.001" in message["bad timeout on one rank"]
    assert "timeout must be None" in message["timeout under a millisecond"]
    assert "timeout must be None" in message["timeout over a year"]
    assert "to layer" in message["different layers"] and "same layer" in message["different layers"]
    for case in ("two threads at once", "two threads, two layers of the group", "two threads, a build beside a call"):
        assert "called or built from two threads of one rank at once" in message[case], message[case]
    assert "storage was resized in place" in message["storage resized on one rank"]
    assert f"(on rank {world - 1} of {world})" in message["storage resized on one rank"]
    assert f"the ids' source went away (on rank {world - 1} of {world})" in message[
        "an OSError without a numeric errno on one rank"]
    assert "unexpected keyword argument(s) 'out': the layer allocates its result" in message["out= on one rank"]
    assert f"(3 were given); dtype is a keyword (on rank {world - 1} of {world})" in message[
        "dtype positionally on one rank"]
    for rank, result in enumerate(ranks):
        assert result[exchange]["errors"]["after"] == [], f"rank {rank}: the group was not usable after the errors"


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_a_checkpoint_rank_maps_only_its_rows(group, exchange):
    world, ranks = group
    page = mmap.ALLOCATIONGRANULARITY
    for rank, result in enumerate(ranks):
        report = result[exchange]["checkpoint"]
        assert report["failures"] == [], f"rank {rank}"
        for label, maps in report["maps"].items():
            if not maps["spans"]:
                pytest.skip("no /proc/self/maps here")
            mapped = sum(length for _, length in maps["spans"])
            # the map starts on a page boundary at or before the shard and ends on one after it
            assert maps["shard_bytes"] <= mapped <= maps["shard_bytes"] + 2 * page, (label, rank, maps)
            assert mapped < maps["table_bytes"], (label, rank, maps)  # never the whole table
            first = min(offset for offset, _ in maps["spans"])
            assert maps["shard_offset"] - page < first <= maps["shard_offset"], (label, rank, maps)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_quantized_tables_are_bit_exact_into_every_output_dtype(group, exchange):
    world, ranks = group
    for rank, result in enumerate(ranks):
        report = result[exchange]["quantized"]
        assert report["failures"] == [], f"rank {rank} of {world}"
        start, stop = distributed.row_range(VOCAB, world, rank)
        assert report["facts"] == {"format": "q8_0", "dtype": "float32", "shard": ("QuantizedTable", "q8_0",
                                                                                   stop - start),
                                   "shard is a writeable view": (True, True)}


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_quantized_errors_are_raised_on_every_rank_before_the_data_collective(group, exchange):
    world, ranks = group
    outcomes = [result[exchange]["quantized"]["outcomes"] for result in ranks]
    messages = ranks[0][exchange]["quantized"]["messages"]
    expected = {"int8 everywhere": ("TypeError", messages["int8"]),
                "int8 on one rank": ("TypeError", f"{messages['int8']} (on rank {world - 1} of {world})"),
                "bad id everywhere": ("IndexError", messages["bad id"])}
    for case, (kind, message) in expected.items():
        assert {outcome[case][:2] for outcome in outcomes} == {(kind, message)}, case
    assert "dequantizes into float32, float16, bfloat16, not int8" in messages["int8"]
    disagree = {outcome["dtypes differ"][:2] for outcome in outcomes}
    assert len(disagree) == 1 and next(iter(disagree))[0] == "ValueError", disagree
    message = next(iter(disagree))[1]
    assert "the ranks disagree on the ids" in message and "dtype float16" in message and "dtype bfloat16" in message
    assert all(outcome[case][2] < 10 for outcome in outcomes for case in outcome)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_a_quantized_file_rank_maps_only_its_rows(group, exchange):
    world, ranks = group
    page = mmap.ALLOCATIONGRANULARITY
    for rank, result in enumerate(ranks):
        maps = result[exchange]["quantized"]["maps"]
        assert set(maps) == {"q8_0 gguf", "fp8_e4m3 safetensors"}
        for label, report in maps.items():
            if not report["spans"]:
                pytest.skip("no /proc/self/maps here")
            pieces = 2 if label.startswith("fp8") else 1  # fp8: the rows and the row scales, each mapped on its own
            mapped = sum(length for _, length in report["spans"])
            assert len(report["spans"]) == pieces, (label, rank, report)
            assert report["shard_bytes"] <= mapped <= report["shard_bytes"] + 2 * pieces * page, (label, rank, report)
            assert mapped < report["table_bytes"], (label, rank, report)
            first = max(offset for offset, _ in report["spans"] if offset <= report["rows_offset"])  # the rows' map
            assert report["rows_offset"] - page < first <= report["rows_offset"], (label, rank, report)


def kill_a_rank(tmp_path: Path, victim: int, stage: str, exchange: str) -> None:
    """Three ranks; `victim` dies at `stage`: the others raise within the timeout, and no segment is left."""
    world = 3
    multiprocessing.get_context("forkserver").set_forkserver_preload(["numpy", "torch", "torch.distributed",
                                                                      "fastembed.distributed"])
    outcomes = run_ranks(tmp_path, world, kill_task, victim, stage, exchange, deadline_s=150,
                         start_method="forkserver")
    assert outcomes[victim] == {"died": 17}, outcomes[victim]
    for rank, result in enumerate(results([o for r, o in enumerate(outcomes) if r != victim])):
        assert result["error"] is not None, f"rank {rank} never noticed the dead rank"
        assert "another rank died, hung or stopped calling" in result["error"]
        assert result["seconds"] < KILL_TIMEOUT_S + 20, result  # far below the group's own timeout, slack for load
        assert result["again"] == result["error"]  # later calls fail at once, with the same message
        if stage == "stops calling":
            assert result["seconds"] >= KILL_TIMEOUT_S * 0.9, result  # the timeout was what ended the wait
        assert len(result["segments"]) == (0 if exchange == "all_reduce" else 2 if stage in GROWING_STAGES else 1)
        left = [name for name in result["segments"] if os.path.exists(os.path.join(distributed.segments.SHM_FOLDER, name))]
        assert left == [], f"segments left in {distributed.segments.SHM_FOLDER}: {left}"


def test_shared_memory_is_chosen_refused_and_given_up_alike_on_every_rank(group):
    world, ranks = group
    reports = [result["shared memory"] for result in ranks]
    for rank, report in enumerate(reports):
        assert report["failures"] == [], f"rank {rank}"
        assert report["repr"].endswith("exchange='shared_memory')")
    outcomes = [report["outcomes"] for report in reports]
    for case in outcomes[0]:
        assert all(outcome[case] == outcomes[0][case] for outcome in outcomes), (case, [o[case] for o in outcomes])
    seen = outcomes[0]
    shm, reduce = "shared_memory", "all_reduce"
    # one segment for the small calls, one grown for the large ones, shared by every later call
    assert seen["auto"] == [shm, shm, shm, shm, shm, 2]
    assert seen["all_reduce"] == [reduce, reduce, 0]
    kind, message = seen["hosts differ, shared_memory"][0]
    assert kind == "ValueError" and f"rank(s) {world - 1} run on another host than rank 0" in message, message
    assert seen["hosts differ, auto"][0] == reduce
    kind, message = seen["no shm on one rank, shared_memory"][0]
    assert kind == "ValueError" and f"rank(s) {world - 1} have no usable /dev/shm" in message, message
    assert seen["no shm on one rank, auto"][0] == reduce
    assert seen["exchanges differ"][0] == "ValueError" and "the ranks disagree on the table" in seen["exchanges differ"][1]
    assert seen["bad exchange"] == ("ValueError", "exchange must be 'auto', 'shared_memory' or 'all_reduce', "
                                                      "got 'gloo'")
    # a /dev/shm too small for the large calls: those use the all-reduce (tried once, with a warning), small ones not
    # (in a segment made again: the small one was given up before the large one was tried)
    (sequence, warned) = seen["small shm, auto"]
    assert sequence == [shm, shm, reduce, reduce, shm, 3], sequence
    assert len(warned) == 1 and "No space left on device" in warned[0] and "use the all-reduce" in warned[0], warned
    assert warned[0].endswith("(at test_distributed.py)") and "calls of more than 2097152 bytes" in warned[0], warned
    (before, refused, after, exchange), _ = seen["small shm, shared_memory"]
    assert (before, after, exchange) == ("no error", "no error", shm)
    assert refused[0] == "OSError" and "No space left on device" in refused[1] and f"(on rank 0 of {world})" in refused[1]
    assert seen["small shm, errno"] == (28, [])  # rank 0's ENOSPC, on every rank
    # a warning raised as an error on one rank ends its call there, after the call's collectives: still in step
    assert seen["small shm, warning as error on rank 0"] == ((True, shm, reduce), []), seen["small shm, warning as error on rank 0"]
    # the old segment is unmapped on every rank before a larger one is made
    assert seen["growing in a shm with room for one segment"] == ([shm, "no error", shm], [])
    # a rank that cannot open rank 0's file: the layer gives shared memory up
    (sequence, warned) = seen["other shm, auto"]
    assert sequence == [shm, reduce, reduce, reduce, reduce, 1] and len(warned) == 1, (sequence, warned)
    assert warned[0].endswith("(at test_distributed.py)"), warned
    (before, refused, after, exchange), _ = seen["other shm, shared_memory"]
    assert (before, refused[0], after, exchange) == ("FileNotFoundError", "FileNotFoundError", "FileNotFoundError", shm)
    assert f"(on rank {world - 1} of {world})" in refused[1]
    # the warning raised as an error still leaves the layer on the all-reduce
    assert seen["other shm, auto, warnings as errors"][0] == ("RuntimeWarning", reduce)
    for rank, report in enumerate(reports):
        assert report["left"] == [], f"rank {rank}: segments still in /dev/shm while it ran: {report['left']}"
        assert len(report["names"]) == len(set(report["names"])) >= 6
        assert all(name.startswith(distributed.segments.SEGMENT_PREFIX) for name in report["names"])
        left = [name for name in report["names"] if os.path.exists(os.path.join(distributed.segments.SHM_FOLDER, name))]
        assert left == [], f"segments in /dev/shm after the ranks left: {left}"
    assert reports[0]["names"] == reports[-1]["names"]  # every rank named the same segments


def test_the_ranks_of_one_host_agree_through_one_board_per_group_or_through_the_group(group):
    world, ranks = group
    for rank, result in enumerate(ranks):
        board = result["board"]
        assert board["failures"] == [], f"rank {rank}: {board['failures']}"
        report = board["report"]
        assert report["default group, all_reduce"] == "shared_memory"
        assert report["given up"] == ("group", "shared_memory"), rank
        assert report["made by the next layer"] == ("shared_memory", "shared_memory", True, False), rank
        kind, message = report["different layers"]
        assert kind == "ValueError" and "the ranks disagree on the ids" in message, message
        kind, message = report["out of step"]
        assert kind == "CommunicationError", report["out of step"]
        if rank == 0:
            assert "cannot run on rank 0" in message and "the ranks are out of step" in message, message
        else:
            assert "another rank died, hung or stopped calling (timeout=1 s)" in message, message
        for case in ("forked child", "build in a forked child"):  # before a byte lands in the parent's shared memory
            assert report[case] == ("RuntimeError", distributed.collectives.FORKED), (case, report[case])
        assert board["boards tried"] >= 3, board  # the world's board, and the subgroup's twice (given up, then made)
        assert board["pipes left"] == [], f"rank {rank}: pipes left in /dev/shm: {board['pipes left']}"


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("repeat", range(KILL_REPEATS))
def test_a_rank_that_dies_makes_the_others_raise_within_the_timeout(repeat, exchange, tmp_path):
    stages = ("before the agreement", "before the data collective", "at a random moment", "stops calling")
    kill_a_rank(tmp_path, repeat % 3, stages[repeat % len(stages)], exchange)


@pytest.mark.parametrize("stage", GROWING_STAGES)
def test_a_rank_that_dies_while_the_segment_grows_leaves_nothing_in_dev_shm(stage, tmp_path):
    kill_a_rank(tmp_path, GROWING_STAGES[stage] % 3, stage, "shared_memory")


@pytest.mark.skipif(not distributed.segments.host_identity()[1], reason="no usable /dev/shm here")
def test_a_segment_gets_its_name_only_once_its_pages_are_reserved(monkeypatch):
    """A process killed while a segment's pages are reserved (the long part of making one) leaves no name in
    /dev/shm; a failed reservation leaves none either, and a name that exists is refused and left as it is."""
    segments = distributed.segments
    path = os.path.join(segments.SHM_FOLDER, f"{segments.SEGMENT_PREFIX}test-{uuid.uuid4().hex}")
    reserve = os.posix_fallocate
    seen = []

    def reserving(descriptor, offset, size):
        seen.append(os.path.exists(path))
        return reserve(descriptor, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", reserving)
    mapping = segments.create_mapping(path, 2 * 2**20)
    try:
        assert seen == [False] and os.stat(path).st_size == 2 * 2**20
        mapping[:5] = b"rows!"
        with segments.open_mapping(path, 2 * 2**20) as other:
            assert other[:5] == b"rows!"
        with pytest.raises(FileExistsError) as refused:
            segments.create_mapping(path, 4 * 2**20)
        assert refused.value.filename == path and os.stat(path).st_size == 2 * 2**20
    finally:
        mapping.close()
        segments.unlink_quietly(path)

    def full(descriptor, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left"):
        segments.create_mapping(path, 2 * 2**20)
    assert not os.path.exists(path)


def absent_peer_task(rank: int, world: int, missing: str) -> dict:
    """Rank 0's own build fails while the others never build: it still waits only `timeout`, not the group's."""
    if rank != 0:
        deadline = time.monotonic() + 30
        while not (_RUN_FOLDER / "rank0.pickle").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {}
    return {"outcome": _outcome(lambda: VocabParallelEmbedding(missing, timeout=2))}


def test_a_rank_whose_build_fails_waits_only_its_timeout_for_absent_peers(tmp_path):
    outcomes = results(run_ranks(tmp_path, 2, absent_peer_task, str(tmp_path / "no-such-checkpoint")))
    kind, message, seconds = outcomes[0]["outcome"]
    assert kind == "CommunicationError" and "timeout=2 s" in message, message
    assert seconds < 30  # the group's own timeout is 60 s


def destroyed_group_task(rank: int, world: int, init: str) -> dict:
    table = make_table("float16", 6)
    on_subgroup = VocabParallelEmbedding(table, group=dist.new_group(list(range(world))), timeout=30)
    on_default = VocabParallelEmbedding(table, timeout=30)
    on_subgroup([1, 2])
    on_default([1, 2])
    dist.destroy_process_group(on_subgroup._group)
    calls = {"subgroup": [_outcome(lambda: on_subgroup([1, 2]))[:2] for _ in range(2)]}
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)  # a new default group
    calls["default"] = [_outcome(lambda: on_default([1, 2]))[:2] for _ in range(2)]
    calls["new layer"] = [_outcome(lambda: VocabParallelEmbedding(table, timeout=30)([1, 2]))[:2]]
    return calls


def interrupted_call_task(rank: int, world: int) -> dict:
    from helpers import interrupted_runs

    table = make_table("float16", 6)
    layer = VocabParallelEmbedding(table, timeout=30)
    entry = VocabParallelEmbedding.__call__.__code__
    runs, left_taken = 0, 0
    for _ in interrupted_runs(lambda code: code is entry, lambda: layer([1, 2])):
        runs += 1
        left_taken += layer._calling.locked()
    return {"runs": runs, "left taken": left_taken, "rows": host_bytes(layer([1, 2])).tolist()}


def test_a_keyboard_interrupt_on_entering_a_call_leaves_the_layer_usable(tmp_path):
    """Ctrl-C just after the call's lock was taken, before the try that gives it back, used to keep it taken: every
    later call then raised that another thread was calling."""
    (outcome,) = results(run_ranks(tmp_path, 1, interrupted_call_task))
    assert outcome["runs"] >= 3 and outcome["left taken"] == 0
    assert outcome["rows"] == host_bytes(make_table("float16", 6)[[1, 2]]).tolist()


def interrupted_step_task(rank: int, world: int, step: str, exchange: str) -> list:
    """Four calls; rank 0's first is interrupted as it enters `step` (a Ctrl-C between collectives)."""
    table = make_table("float16", 6)
    layer = VocabParallelEmbedding(table, timeout=KILL_TIMEOUT_S, exchange=exchange)
    if rank == 0:
        real = getattr(layer, step)

        def interrupted(call):
            setattr(layer, step, real)
            raise KeyboardInterrupt

        setattr(layer, step, interrupted)
    outcomes = []
    for index in range(4):
        ids = np.random.default_rng(index).integers(0, VOCAB, 30)
        try:
            rows = layer(ids)
            outcomes.append(("rows", bool((host_bytes(rows) == host_bytes(table[ids])).all())))
        except BaseException as error:  # noqa: BLE001 - the outcome is the test's subject
            outcomes.append((type(error).__name__, str(error)))
    return outcomes


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("step", ["_gather", "_communicate"], ids=["before the agreement", "after the agreement"])
def test_a_call_interrupted_on_one_rank_makes_every_rank_fail_clearly_never_return_other_rows(tmp_path, step,
                                                                                             exchange):
    """An interrupt between collectives used to leave the ranks a collective apart: with shared memory, after the
    agreement, every later call returned other calls' rows without an error; before it, every later call raised
    that the ranks disagree on the ids (they did not)."""
    first, second = results(run_ranks(tmp_path, 2, interrupted_step_task, step, exchange))
    assert ("rows", False) not in first + second
    assert first[0] == ("KeyboardInterrupt", "")
    for kind, message in first[1:]:
        assert kind == "CommunicationError" and "was interrupted on rank 0 of 2 (KeyboardInterrupt)" in message
    assert second[0][0] in ("rows", "CommunicationError")
    assert all(kind == "CommunicationError" for kind, _ in second[1:]), second


def test_a_layer_whose_group_was_destroyed_says_so_on_every_later_call(tmp_path):
    init = f"file://{tmp_path / 'second-rendezvous'}"
    for outcome in results(run_ranks(tmp_path, 2, destroyed_group_task, init)):
        for group in ("subgroup", "default"):
            for kind, message in outcome[group]:
                assert kind == "CommunicationError" and "process group it was built on no longer exists" in message, (
                    group, message)
        assert outcome["new layer"] == [("no error", "")]


def test_the_helpers_split_as_documented():
    assert [distributed.split_range(7, 3, i) for i in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [distributed.split_range(2, 3, i) for i in range(3)] == [(0, 1), (1, 2), (2, 2)]
    assert distributed.padded_vocab_size(41, 8) == 48 and distributed.padded_vocab_size(48, 8) == 48
    for world in range(1, 9):
        for vocab in (1, 7, 41, 129280):
            spans = [distributed.row_range(vocab, world, rank) for rank in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == vocab
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    with pytest.raises(ValueError, match="part 3 of 10 items split into 3 parts"):
        distributed.split_range(10, 3, 3)


def test_the_helpers_refuse_arguments_that_are_not_integers_and_give_python_ints():
    assert distributed.split_range(np.int64(10), 4, 1) == (3, 6)
    assert type(distributed.split_range(np.uint64(10), 4, 1)[0]) is int
    for call, error, message in ((lambda: distributed.split_range(10.0, 4, 1), TypeError, "total must be an integer"),
                                 (lambda: distributed.row_range(10, 2.0, 0), TypeError, "world_size must be an integer"),
                                 (lambda: distributed.row_range("10", 2, 0), TypeError, "vocab_size must be an integer"),
                                 (lambda: distributed.position_range(5, 3, True), TypeError, "rank must be an integer"),
                                 (lambda: distributed.padded_vocab_size(-5, 4), ValueError, "vocab_size must be 0 or more")):
        with pytest.raises(error, match=message):
            call()
    for pad, error in ((0, ValueError), (True, TypeError), (2.0, TypeError), (2**64, ValueError)):
        with pytest.raises(error, match=r"pad_to_multiple must be an integer from 1 to 2\*\*62"):
            distributed.row_range(10, 2, 0, pad_to_multiple=pad)
        with pytest.raises(error, match=r"pad_to_multiple must be an integer from 1 to 2\*\*62"):
            distributed.padded_vocab_size(10, pad)
    with pytest.raises(ValueError, match="vocab_size must be 1 or more"):
        distributed.row_range(0, 2, 0)


def test_timeouts_and_pads_take_numpy_numbers_as_python_ones():
    for timeout in (np.float32(5), np.int64(5), 5, 5.0):
        assert type(distributed.layer._checked_timeout(timeout)) is float and distributed.layer._checked_timeout(timeout) == 5
    for pad in (np.uint64(8), np.int16(8), 8):
        assert type(distributed.layout.checked_pad(pad)) is int and distributed.layout.checked_pad(pad) == 8
    for bad_timeout, error in ((np.bool_(True), TypeError), (True, TypeError), (np.float64("nan"), ValueError),
                               (np.int64(0), ValueError), ("5", TypeError)):
        with pytest.raises(error, match="timeout must be None or a number of seconds"):
            distributed.layer._checked_timeout(bad_timeout)
    for bad_pad, error in ((np.uint64(0), ValueError), (2**62 + 1, ValueError), (np.float32(8), TypeError),
                           (True, TypeError)):
        with pytest.raises(error, match="pad_to_multiple must be an integer from 1 to 2"):
            distributed.layout.checked_pad(bad_pad)


def test_docstring_examples_run():
    import doctest

    failures, attempted = doctest.testmod(distributed, optionflags=doctest.ELLIPSIS)
    assert failures == 0 and attempted >= 5


def test_without_a_process_group_or_torch_the_errors_say_what_is_needed(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # whatever group another test left in this process
    with pytest.raises(RuntimeError, match="init_process_group"):
        VocabParallelEmbedding(np.ones((4, 2), np.float32))
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"fastembed-gather\[distributed\]"):
        VocabParallelEmbedding(np.ones((4, 2), np.float32))


def test_import_does_not_import_torch():
    code = "import sys, fastembed, fastembed.distributed\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_gpu_tables_other_than_torch_cuda_tensors_are_refused_clearly(cupy_or_double):
    with pytest.raises(TypeError, match=r"and torch CUDA tensors .*; a cupy array on cuda:0 is not served: "
                                        r"torch.from_dlpack\(table\)"):
        distributed.shards.shard_device(cupy_or_double.zeros((4, 2), cupy_or_double.float32), None)
    with pytest.raises(TypeError, match="a torch array on meta:0 is not served$"):
        distributed.shards.shard_device(torch.empty((4, 2), device="meta"), None)


def test_torchrun_launches_two_ranks(tmp_path):
    script = tmp_path / "lookup.py"
    script.write_text(TORCHRUN_SCRIPT)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(re.findall(r"rank \d of \d: \w+", result.stdout))
    assert lines == ["rank 0 of 2: exact", "rank 1 of 2: exact"], result.stdout + result.stderr[-3000:]


TORCHRUN_SCRIPT = """\
import os

import numpy as np
import torch.distributed as dist

from fastembed.distributed import VocabParallelEmbedding
from fastembed.tables import random_table

dist.init_process_group("gloo")
table = random_table(37, 8, "float16", seed=3)
emb = VocabParallelEmbedding(table, timeout=30)
ids = np.array([[0, 36], [5, 17]])
rows, mine = emb(ids), emb(ids, mode="scatter")
exact = rows.tobytes() == table[ids].tobytes() and mine.tobytes() == table[ids][emb.rank:emb.rank + 1].tobytes()
# one write per line: two ranks printing at once never interleave their lines
os.write(1, f"rank {emb.rank} of {emb.world_size}: {'exact' if exact else 'WRONG'}\\n".encode())
dist.destroy_process_group()
"""


def test_bench_ranks_smoke(tmp_path):
    """fastembed-bench --ranks 2 on a tiny table: every case measured on every rank and in the single process."""
    pytest.importorskip("rich")
    from fastembed.benchmark import cli

    code = cli.main(["--ranks", "2", "--vocab-size", "50", "--dim", "8", "--batch", "1,5", "--reps", "2",
                     "--out", str(tmp_path)])
    assert code == 0
    payload = json.loads((tmp_path / "ranks.json").read_text())
    rows = {(row["batch"], row["mode"]): row for row in payload["results"]}
    assert set(rows) == {(1, "full"), (1, "scatter"), (5, "full"), (5, "scatter")}
    row_bytes = 8 * 2
    assert payload["exchange"] == "shared_memory"  # the ranks share this host
    assert payload["agreement"] == ("shared_memory" if distributed.board.usable() else "group")
    for mode in ("full", "scatter"):  # a rank puts in only its own rows, the slowest 3 to 5 of 5, and sends them once
        assert 3 * row_bytes <= rows[5, mode]["payload_bytes"] == rows[5, mode]["sent_bytes"] <= 5 * row_bytes
    for row in rows.values():
        assert row["exchange"] == "shared_memory"
        assert row["total_us"] > 0 and row["single_us"] > 0 and row["copy_us"] > 0 and row["communicate_us"] == 0
    first = payload["processes"][0]
    assert all(rank["layer"].endswith("exchange='shared_memory')") for rank in first["ranks"])
    from fastembed.benchmark import ranks

    threads = os.environ.get("NUMBA_NUM_THREADS", str(ranks.rank_threads(2)))  # each rank its share of the cores
    assert payload["rounds"] == len(payload["processes"]) == ranks.ROUNDS  # rounds of fresh processes
    for round_ in payload["processes"]:
        assert [rank["numba_threads"] for rank in round_["ranks"]] == [threads, threads]
        assert all(len(case["total_s"]) == 2 for case in round_["single"]["samples"].values())
    for row in rows.values():
        low, high = row["ranks_over_single_range"]
        assert low <= row["ranks_over_single"] <= high
        low, high = row["throughput_vs_single_range"]
        assert 0 < low <= row["throughput_vs_single"] <= high
    assert [rank["rows"] for rank in first["ranks"]] == [[0, 25], [25, 50]]
    assert all(rank["held_bytes"] == 25 * row_bytes for rank in first["ranks"])
    for process in [*first["ranks"], first["single"]]:
        before, after = process["memory_before"], process["memory_after"]
        assert after["rss"] > 0 and after["peak"] >= after["rss"] and before["rss"] == process["rss_before_bytes"]
        assert 0 <= after["table_file"] <= 2 * mmap.ALLOCATIONGRANULARITY + 4096  # the tiny table's pages at most


@pytest.mark.parametrize("arguments, message", [
    (["--ranks", "0"], "must be 1 or more"),
    (["--ranks", "2", "--gate"], "--ranks measures the host's lookups"),
    (["--ranks", "2", "--processes", "3"], "--ranks measures the host's lookups"),
    (["--ranks", "2", "--device", "cuda"], "--ranks measures the host's lookups"),
])
def test_bench_ranks_arguments_are_checked_first(arguments, message, tmp_path, capsys):
    from fastembed.benchmark import arguments as command_line

    with pytest.raises(SystemExit) as exit_info:
        command_line.parse_arguments([*arguments, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# -- GPU shards: torch CUDA tables, on the doubles here and on a GPU where one is lent -----------------------------

#: (dtype, dim) of the GPU tables: each integer word (row bytes divisible by 8, by 4, neither: 6 x float16 = 12).
GPU_TABLES = [("float16", 6), ("bfloat16", 4), ("float32", 8), ("float8_e4m3fn", 5)]
#: The collectives a GPU group's ranks record: (name, device of the tensor sent).
DATA_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_single")


@contextlib.contextmanager
def torch_cuda_in_rank():
    """torch CUDA tensors in a rank: real ones where torch and cupy see a GPU, else the doubles (tests/conftest.py's)."""
    from cupy_double import gpu_cupy, is_double
    from torch_cuda_double import TorchCuda, installed

    with gpu_cupy() as cupy:
        if not is_double(cupy):
            yield TorchCuda(cupy, False)
            return
        with installed(cupy) as cuda:
            yield cuda


def record_collectives() -> list[tuple[str, str]]:
    """Record every collective this rank starts from now on, with the device of the tensor it sends."""
    seen: list[tuple[str, str]] = []

    def recording(name: str, original):
        def recorded(*args, **kwargs):
            sent = args[1] if name == "all_gather" else args[0]
            seen.append((name, str(sent.device)))
            return original(*args, **kwargs)

        return recorded

    for name in ("all_gather", *DATA_COLLECTIVES):
        setattr(dist, name, recording(name, getattr(dist, name)))
    return seen


def gpu_task(rank: int, world: int, nccl_alone: bool, checkpoint: str) -> dict:
    """GPU tables of every kind of row word, both modes, ids on the host and on the GPU, errors, a checkpoint copy.

    `nccl_alone`: the group says its backend is "nccl" (gloo still moves the bytes underneath), so the layer
    takes its NCCL path: agreements on CUDA tensors, and the reduce-scatter for ``"scatter"``.
    """
    if nccl_alone:
        dist.get_backend = lambda group=None: "nccl"
    seen = record_collectives()
    failures: list[str] = []
    outcomes: dict = {}
    with torch_cuda_in_rank() as cuda:
        index = rank % torch.cuda.device_count()
        device = f"cuda:{index}"
        for dtype, dim in GPU_TABLES:
            table = cuda.to_cuda(as_torch(make_table(dtype, dim)), index)  # rows 1-5: -0.0, NaN payloads, infinity
            emb = VocabParallelEmbedding(table, timeout=30)
            failures += check_gpu_lookups(emb, table, world, rank, cuda, f"{dtype} x{dim}")
            if emb.dtype.name != dtype or f"dtype={dtype}," not in repr(emb):
                failures.append(f"{dtype} x{dim}: dtype {emb.dtype}, {emb!r}")
        for fmt, dim in QUANTIZED[:2]:  # q8_0 keeps its scales in its blocks, fp8_e4m3 has a row scale
            host = make_quantized(fmt, dim)
            scales = None if host.scales is None else cuda.to_cuda(torch.from_numpy(host.scales), index)
            table = QuantizedTable(cuda.to_cuda(torch.from_numpy(host.data), index), fmt, dim, scales)
            emb = VocabParallelEmbedding(table, timeout=30)
            if emb.format != fmt or emb.dim != dim:
                failures.append(f"{fmt}: served as {emb!r}")
            for dtype in (None, "bfloat16"):
                failures += check_gpu_lookups(emb, table, world, rank, cuda, f"{fmt} into {dtype}", dtype)
        table = cuda.to_cuda(as_torch(make_table("float16", 6)), index)
        emb = VocabParallelEmbedding(table, timeout=30, pad_to_multiple=64)  # the last rank stores no rows
        failures += check_gpu_lookups(emb, table, world, rank, cuda, "padded")
        same_storage = emb.shard.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
        facts = {"device": device, "repr": repr(emb), "exchange": emb.exchange,
                 "shard": (str(emb.shard.device), int(emb.shard.shape[0])), "shard_is_view": same_storage}
        emb = VocabParallelEmbedding(table, timeout=30)
        last = world - 1
        other = (index + 1) % torch.cuda.device_count()  # this GPU on a machine of one GPU
        cases = {
            "bad id everywhere": lambda: emb(np.array([[1, 2], [VOCAB, 3]])),
            "bad id on one rank": lambda: emb([1, VOCAB + 5 if rank == last else 2, 3]),
            "bad device id everywhere": lambda: emb(cuda.to_cuda(torch.tensor([0, VOCAB]), index)),
            "negative id, scatter": lambda: emb([0, -1], mode="scatter"),
            "ids on another GPU on one rank": lambda: emb(cuda.to_cuda(torch.tensor([1]), other if rank == last else index)),
            "a cast the GPU cannot give": lambda: emb([1, 2], dtype="float32"),
            "values differ": lambda: emb(np.array([1, 2, rank])),
            "shared memory": lambda: VocabParallelEmbedding(table, timeout=30, exchange="shared_memory"),
            "a cupy table": lambda: VocabParallelEmbedding(cuda.cupy.zeros((VOCAB, 4), cuda.cupy.float32)),
            "device= with a table elsewhere": lambda: VocabParallelEmbedding(table, device=f"cuda:{other}"),
        }
        if other == index:
            del cases["ids on another GPU on one rank"], cases["device= with a table elsewhere"]
        for case, call in cases.items():
            before = sum(name in DATA_COLLECTIVES for name, _ in seen)
            outcomes[case] = (*_outcome(call)[:2], sum(name in DATA_COLLECTIVES for name, _ in seen) - before)
        expected = fastembed.lookup(table, [7, 8, 9])
        failures += gpu_same_bits("after the errors", emb([7, 8, 9]), expected, device)
        messages = {"bad id": _message(lambda: fastembed.lookup(table, np.array([[1, 2], [VOCAB, 3]]))),
                    "cast": _message(lambda: fastembed.lookup(table, [1, 2], dtype="float32"))}
        mapped = VocabParallelEmbedding(checkpoint, timeout=30, device=device)
        host = make_table("float16", 64, 3001)
        ids = np.random.default_rng(SEED).integers(0, 3001, (6, 5))
        failures += gpu_same_bits("checkpoint full", mapped(ids), cuda.to_cuda(torch.from_numpy(host[ids]), index), device)
        start, stop = distributed.position_range(6, world, rank)
        failures += gpu_same_bits("checkpoint scatter", mapped(ids, mode="scatter"),
                                  cuda.to_cuda(torch.from_numpy(host[ids][start:stop]), index), device)
        facts["checkpoint shard"] = (isinstance(mapped.shard, torch.Tensor), str(mapped.shard.device),
                                     int(mapped.shard.shape[0]))
        facts["check_file"] = _message(mapped.check_file)
        for name, ids in (("even", [[1, 2], [3, 4], [5, 6]]), ("uneven", [[1, 2], [3, 4]])):  # 3 or 2 positions
            calls = len(seen)
            emb(ids, mode="scatter")
            facts[f"{name} scatter collectives"] = seen[calls:]
        # Last: on a group of NCCL alone the old code left the GPU ranks waiting out the timeout in the agreement.
        source = make_table("float16", 6) if rank == last else table
        outcomes["a host table on one rank"] = _outcome(lambda: VocabParallelEmbedding(source, timeout=5))
        if nccl_alone:
            # Last too: the old code allocated the reduce-scatter's output after the agreement, so the ranks whose
            # allocation succeeded waited out the timeout in the reduce-scatter.
            short = VocabParallelEmbedding(table, timeout=5)
            with pytest.MonkeyPatch.context() as patch:
                if rank == last:
                    patch.setattr(type(short.shard), "new_empty", _out_of_gpu_memory)
                outcomes["out of GPU memory on one rank"] = _outcome(lambda: short([1, 2, 3], mode="scatter"))
            outcomes["a scatter after it"] = _outcome(lambda: short([1, 2, 3], mode="scatter"))
    return {"failures": failures, "outcomes": outcomes, "messages": messages, "facts": facts,
            "collectives": sorted(set(seen))}


def _out_of_gpu_memory(*args, **kwargs):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test's allocation)")


def gpu_same_bits(label: str, actual, expected, device: str) -> list[str]:
    """Failures (none when `actual` is a torch tensor on `device` with `expected`'s shape, dtype and bytes)."""
    if not isinstance(actual, torch.Tensor) or str(actual.device) != device:
        return [f"{label}: got a {type(actual).__name__} on {getattr(actual, 'device', '?')}, expected one on {device}"]
    return same_bits(label, actual.cpu(), expected.cpu(), torch.Tensor)


def check_gpu_lookups(emb: VocabParallelEmbedding, table, world: int, rank: int, cuda, label: str,
                      dtype=None) -> list[str]:
    """Every id set, and the same ids on the table's GPU, both modes, against fastembed.lookup on the whole table."""
    failures = []
    rows = table.data if isinstance(table, QuantizedTable) else table
    device = str(rows.device)
    index = rows.device.index
    sets = id_sets() + [(f"{name} on the GPU", cuda.to_cuda(torch.as_tensor(np.asarray(ids)), index))
                        for name, ids in id_sets() if name in ("7 int32", "2-D 3x5", "empty")]
    for name, ids in sets:
        expected = fastembed.lookup(table, ids, dtype=dtype)
        failures += gpu_same_bits(f"{label} {name} full", emb(ids, dtype=dtype), expected, device)
        if np.ndim(ids) == 0:
            continue
        start, stop = distributed.position_range(tuple(ids.shape)[0] if hasattr(ids, "shape") else len(ids), world, rank)
        failures += gpu_same_bits(f"{label} {name} scatter", emb(ids, mode="scatter", dtype=dtype),
                                  expected[start:stop], device)
    return failures


@pytest.fixture(scope="module", params=[("gloo", 2), ("nccl alone", 3)], ids=["gloo, 2 ranks", "nccl alone, 3 ranks"])
def gpu_group(request, tmp_path_factory):
    """One group of GPU-table ranks per transport; on the doubles unless torch and cupy see a GPU."""
    from cupy_double import real_cupy
    from torch_cuda_double import real_torch_cuda

    transport, world = request.param
    if real_torch_cuda() != (real_cupy() is not None):
        pytest.skip("torch and cupy disagree on whether there is a GPU: install both for the GPU, or neither")
    if transport == "nccl alone" and real_torch_cuda():
        pytest.skip("the 'nccl alone' group runs gloo under the name nccl, on the doubles only; "
                    "test_a_one_rank_nccl_group_on_a_gpu runs NCCL itself")
    folder = tmp_path_factory.mktemp(f"gpu-{world}")
    checkpoint = write_checkpoints(folder)["float16 safetensors"][0]
    return transport, world, results(run_ranks(folder, world, gpu_task, transport == "nccl alone", checkpoint))


def test_gpu_shards_are_bit_exact_torch_cuda_tensors_on_the_tables_device(gpu_group):
    transport, world, ranks = gpu_group
    for rank, result in enumerate(ranks):
        assert result["failures"] == [], f"rank {rank} of {world} ({transport})"
        facts = result["facts"]
        device = facts["device"]  # each rank's table on GPU rank % device count
        assert facts["exchange"] == "all_reduce"
        assert facts["repr"].endswith(f"device='{device}', exchange='all_reduce')"), facts["repr"]
        start, stop = distributed.row_range(VOCAB, world, rank, 64)
        assert facts["shard"] == (device, max(0, min(stop, VOCAB) - min(start, VOCAB))) and facts["shard_is_view"]
        start, stop = distributed.row_range(3001, world, rank)
        assert facts["checkpoint shard"] == (True, device, stop - start)  # only its rows, copied to its GPU
        assert "not memory-mapped from a file" in facts["check_file"]


def test_gpu_shards_raise_the_same_error_on_every_rank_before_any_data_collective(gpu_group):
    transport, world, ranks = gpu_group
    outcomes = [result["outcomes"] for result in ranks]
    expected = {"bad id everywhere": "IndexError", "bad id on one rank": "IndexError",
                "bad device id everywhere": "IndexError", "negative id, scatter": "IndexError",
                "ids on another GPU on one rank": "TypeError", "a cast the GPU cannot give": "TypeError",
                "values differ": "ValueError", "shared memory": "ValueError", "a cupy table": "TypeError",
                "device= with a table elsewhere": "ValueError"}
    if "device= with a table elsewhere" not in outcomes[0]:  # one GPU: no other device to put ids on
        for case in ("ids on another GPU on one rank", "device= with a table elsewhere"):
            del expected[case]
    for case, kind in expected.items():
        seen = {outcome[case][:2] for outcome in outcomes}
        assert len(seen) == 1, f"{case}: the ranks raised differently: {seen}"
        assert outcomes[0][case][0] == kind, (case, outcomes[0][case])
        assert all(outcome[case][2] == 0 for outcome in outcomes), f"{case}: a data collective ran"
    message = {case: outcomes[0][case][1] for case in outcomes[0]}
    messages = ranks[0]["messages"]
    assert message["bad id everywhere"] == messages["bad id"]  # fastembed.lookup's own words
    assert message["bad id on one rank"].endswith(f"(on rank {world - 1} of {world})")
    assert message["bad device id everywhere"].startswith(f"id {VOCAB} at position 1 is out of range")
    assert message["a cast the GPU cannot give"] == messages["cast"]
    assert "the ranks disagree on the ids" in message["values differ"]
    assert "a GPU table's ranks use the all-reduce" in message["shared memory"]
    assert "cupy array on cuda:0 is not served" in message["a cupy table"] and "torch.from_dlpack" in message["a cupy table"]
    host_table = {outcome["a host table on one rank"][:2] for outcome in outcomes}
    assert len(host_table) == 1 and all(outcome["a host table on one rank"][2] < 4 for outcome in outcomes), outcomes
    kind, text = host_table.pop()
    assert kind == "ValueError", text
    if transport == "gloo":
        assert "the ranks disagree on the table" in text and "on the host" in text and "on a GPU" in text
    else:
        assert text.endswith(f"which a 'nccl' group cannot carry: use a gloo group, or init_process_group("
                             f"backend='cpu:gloo,cuda:nccl') (on rank {world - 1} of {world})"), text
    if "device= with a table elsewhere" in expected:
        assert "ids live on cuda:" in message["ids on another GPU on one rank"]
        assert "move the table there first" in message["device= with a table elsewhere"]


def test_gpu_shards_communicate_over_the_groups_gpu_transport(gpu_group):
    transport, world, ranks = gpu_group
    for result in ranks:
        device = result["facts"]["device"]
        names = {name for name, _ in result["collectives"]}
        agreements = {where for name, where in result["collectives"] if name == "all_gather"}
        data = {where for name, where in result["collectives"] if name in DATA_COLLECTIVES}
        assert data == {device}, result["collectives"]
        even, uneven = ([name for name, _ in result["facts"][f"{split} scatter collectives"] if name in DATA_COLLECTIVES]
                        for split in ("even", "uneven"))
        if transport == "gloo":  # gloo: agreements on CPU tensors, scatter as an all-reduce
            assert agreements == {"cpu"} and names == {"all_gather", "all_reduce"}
            assert even == uneven == ["all_reduce"]
        else:  # NCCL alone: agreements on CUDA tensors (a build that failed before the table's device was known: torch's
            # current GPU's), scatter as NCCL's reduce-scatter: of one tensor when the positions split evenly
            assert device in agreements and all(where.startswith("cuda:") for where in agreements), agreements
            assert even == ["reduce_scatter_single"] and uneven == ["reduce_scatter"], result["facts"]


def test_an_allocation_that_fails_on_one_rank_is_raised_on_every_rank_without_a_timeout(gpu_group):
    transport, world, ranks = gpu_group
    if transport == "gloo":
        pytest.skip("gloo's scatter is an all-reduce, and its only later allocation comes after every collective")
    failed = [result["outcomes"]["out of GPU memory on one rank"] for result in ranks]
    expected = ("RuntimeError", f"CUDA out of memory (a test's allocation) (on rank {world - 1} of {world})")
    assert {outcome[:2] for outcome in failed} == {expected}, failed  # not CommunicationError, on any rank
    assert all(seconds < 4 for _, _, seconds in failed), failed  # no rank waited out timeout=5
    assert all(result["outcomes"]["a scatter after it"][0] == "no error" for result in ranks), ranks


def test_the_group_backend_decides_which_tables_it_serves():
    capability = dist.Backend.backend_capability
    carriers = {backend: {kind: distributed.shards.carrier(backend, kind, capability) for kind in ("cpu", "cuda")}
                for backend in ("gloo", "nccl", "cpu:gloo,cuda:nccl")}
    assert carriers == {"gloo": {"cpu": "gloo", "cuda": "gloo"}, "nccl": {"cpu": None, "cuda": "nccl"},
                        "cpu:gloo,cuda:nccl": {"cpu": "gloo", "cuda": "nccl"}}
    distributed.shards.check_transport("nccl", carriers["nccl"], "cuda:0")  # a GPU table over NCCL alone: accepted
    distributed.shards.check_transport("cpu:gloo,cuda:nccl", carriers["cpu:gloo,cuda:nccl"], "cpu")
    with pytest.raises(ValueError, match="a host table's rows as CPU tensors, which a 'nccl' group cannot carry"):
        distributed.shards.check_transport("nccl", carriers["nccl"], "cpu")


def test_a_host_table_on_a_group_of_nccl_alone_is_refused_before_any_collective(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective was started")

    for name, value in {"is_initialized": lambda: True, "get_rank": lambda group=None: 0,
                        "get_world_size": lambda group=None: 2, "get_backend": lambda group=None: "nccl",
                        "all_gather": no_collective, "all_reduce": no_collective}.items():
        monkeypatch.setattr(dist, name, value)
    with pytest.raises(ValueError, match="which a 'nccl' group cannot carry: use a gloo group, or "
                                         r"init_process_group\(backend='cpu:gloo,cuda:nccl'\)"):
        VocabParallelEmbedding(np.ones((4, 2), np.float32))


def test_device_must_be_the_host_or_a_visible_gpu():
    table = np.ones((4, 2), np.float32)
    assert distributed.shards.shard_device(table, None) == distributed.shards.shard_device(table, "cpu") == "cpu"
    assert distributed.shards.shard_device("model.safetensors", None) == "cpu"
    for device, message in (("gpu", "device must be None, 'cpu', 'cuda' or 'cuda:N'"),
                            (f"cuda:{torch.cuda.device_count()}", "torch sees")):
        with pytest.raises(ValueError, match=message):
            distributed.shards.shard_device("model.safetensors", device)


def nccl_task(rank: int, world: int, checkpoint: str) -> dict:
    """One rank of a real NCCL group on GPU 0: lookups, scatter, ids on the GPU, a bad id, a checkpoint copied there."""
    torch.cuda.set_device(0)
    failures = []
    host = as_torch(make_table("bfloat16", 64, 1000))
    table = host.to("cuda:0")
    emb = VocabParallelEmbedding(table, timeout=30)
    ids = torch.randint(0, 1000, (5, 7), device="cuda:0")
    expected = fastembed.lookup(table, ids)
    failures += gpu_same_bits("full", emb(ids), expected, "cuda:0")
    failures += gpu_same_bits("scatter", emb(ids, mode="scatter"), expected, "cuda:0")
    failures += gpu_same_bits("host ids", emb(ids.cpu().numpy()), expected, "cuda:0")
    bad = _outcome(lambda: emb(torch.tensor([0, 1000], device="cuda:0")))[:2]
    failures += gpu_same_bits("after a bad id", emb(ids), expected, "cuda:0")
    mapped = VocabParallelEmbedding(checkpoint, timeout=30, device="cuda")
    file_ids = np.random.default_rng(SEED).integers(0, 3001, (6, 5))
    failures += gpu_same_bits("checkpoint", mapped(file_ids),
                              torch.from_numpy(make_table("float16", 64, 3001)[file_ids]).to("cuda:0"), "cuda:0")
    return {"failures": failures, "bad": bad, "repr": repr(emb)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                    reason="needs a CUDA GPU and a torch with NCCL (a one-rank NCCL group runs on one GPU)")
def test_a_one_rank_nccl_group_on_a_gpu(tmp_path):
    checkpoint = write_checkpoints(tmp_path)["float16 safetensors"][0]
    (result,) = results(run_ranks(tmp_path, 1, nccl_task, checkpoint, backend="nccl"))
    assert result["failures"] == []
    assert result["bad"][0] == "IndexError" and "id 1000 at position 1 is out of range" in result["bad"][1]
    assert "device='cuda:0', exchange='all_reduce'" in result["repr"]
