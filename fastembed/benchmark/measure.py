"""Interleaved timing of contenders: warm-up, fresh ids per repetition, paired ratios.

Method (docs/benchmarks.md): within one process, every repetition runs every
contender once (A B C A B C ...), each on a fresh id set, so drift of a
shared machine hits all contenders alike and the table is read from memory,
not cache. Before each timed sample the platform settles the caches (on the
host: a read of twice the last-level cache, where the samples write enough
for it to matter), so no contender pays for the dirty lines its predecessor
left. Small batches time a loop of calls over a
rotating pool of id sets (a single call is too short for the clock), after
one untimed call (the loop is timed warm), unless the caller asks for cold
calls (``cold=True``: one call per sample, right after the settling read, as
a decode step meets the lookup after a forward pass has evicted its code and
data); the pool spans at least
POOL_MIN_BYTES of rows (twice the platform's cache where that is more; four
times the table at most) and
each contender draws its own sets from it, so no
contender reads rows that another one has just brought into the cache. The
6-id uniform case is the exception by design: the reference sentence, the
same six rows every call (see ids.py).

Ratios between contenders are medians of per-repetition ratios (see
:func:`summarise`).

Python's cyclic garbage collector is paused while a sample is timed
(:func:`collector_paused`), as ``timeit`` does: a collection runs inside
whichever call allocates when its threshold is crossed, and a full one
takes tens of milliseconds once numba and its compiled kernels are loaded,
so a contender that allocates a few Python objects per call would host
every collection the loop triggers while numpy's indexing, which allocates
none that the collector tracks, hosts none. The collector runs between
samples instead; the multi-process run reports what a full collection costs.

What differs between the host and a GPU (the clock, where ids live, how
memory is counted) is a :class:`Platform`; the loop is the same.
"""
from __future__ import annotations

import functools
import gc
import glob
import os
import re
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastembed.arrays import adapter_of

from .contenders import SCATTERED_READ, Contender, slug
from .ids import id_sets

#: Timed repetitions of a case at most (--reps, a thresholds file's repetitions): a median of more says nothing new,
#: and each repetition keeps its own set of ids.
MAX_REPS = 100_000
#: The "what users write" baseline per platform (contender ids), and the key its speedup is reported under.
BASELINES = {"speedup_vs_numpy": "numpy-fancy", "speedup_vs_cupy": slug("cupy table[ids]")}
#: The allocating limit's display name (np.empty / cupy.empty + the copy).
ALLOCATING_LIMIT = "copy alloc"


@dataclass
class Result:
    contender: str
    kind: str
    batch: int
    distribution: str
    samples_s: list[float]
    bytes_moved: int  # 2 * rows * row_bytes, for every contender (the scattered read, too: see gbps)
    allocates_output: bool = False
    allocated_per_call: int | None = None  # bytes a call allocates (host: tracemalloc; GPU: device pools)
    memory_growth: int | None = None  # host RSS or device memory added by preparing and warming up
    device: str = "cpu"
    id: str = ""  # the contender's stable id (default: derived from its name)
    served_by: str | None = None  # fastembed contenders: the backend that serves the calls

    def __post_init__(self) -> None:
        if not self.id:
            self.id = slug(self.contender)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def gbps(self) -> float:
        """2 x rows x row bytes / median time, for every contender alike.

        A gather reads each row once and writes it once; a copy of as many
        rows moves the same bytes. The scattered read reads the rows and
        writes nothing, yet is counted the same way, so that its line reads
        as the fastest a gather could go if reading the rows were all it did.
        """
        return self.bytes_moved / self.median_s / 1e9


@dataclass(frozen=True)
class Platform:
    """Where a measurement runs: how ids get there, the clock, and memory accounting."""

    device: str
    ids_to_device: Callable[[np.ndarray], Any]
    seconds_per_call: Callable[[Callable[[Any], Any], list[Any]], float]
    memory_in_use: Callable[[], int]
    allocated_by_one_call: Callable[[Callable[[Any], Any], Any], int | None]
    #: Run before every timed sample, with the bytes that sample writes (None: a cold
    #: call, which must find caches evicted): leaves the caches as no contender left them.
    settle: Callable[[int | None], None] = lambda written_bytes: None
    #: The cache an id pool must outgrow so that its rows come from memory (0: none to outgrow).
    cache_bytes: Callable[[], int] = lambda: 0


#: Distinct rows an id pool spans at least (and twice the platform's cache where
#: that is more), so that small batches, too, read rows from memory.
POOL_MIN_BYTES = 256 * 2**20


def pool_size(batch: int, row_bytes: int, inner: int, repetitions: int, warmup: int, table_rows: int,
              cache_bytes: int = 0, contenders: int = 1) -> int:
    """How many id sets a case draws: one per call it makes (every contender's, in every repetition), or fewer where
    rows of POOL_MIN_BYTES or twice `cache_bytes` take fewer sets; never fewer than a sample's calls.

    A table smaller than that caps the span at four times the table: more sets
    would only visit the same rows again. Sets beyond the calls would never be
    read (narrow rows and small batches would draw millions).
    """
    span_bytes = min(max(POOL_MIN_BYTES, 2 * cache_bytes), 4 * table_rows * row_bytes)
    spanning = -(-span_bytes // max(1, batch * row_bytes))
    calls = (warmup + repetitions) * contenders * inner
    return max(max(inner, 8) + repetitions + warmup, min(spanning, calls))


def id_pool_bytes(batch: int, row_bytes: int, repetitions: int, table_rows: int, contenders: int,
                  warmup: int = 2) -> int:
    """The memory a case's id sets take (:func:`pool_size` of them, as :func:`measure_case` draws them on the host):
    int64 ids and their copies per contender id dtype, and the arrays' own objects."""
    sets = pool_size(batch, row_bytes, calls_per_sample(batch, row_bytes), repetitions, warmup, table_rows,
                     HOST.cache_bytes(), contenders)
    return sets * (batch * ID_BYTES + ID_SET_OBJECT_BYTES)


#: Bytes an id takes in a case's id sets: the int64 ids, and their copies as int64 and int32 for the contenders.
ID_BYTES = 20
#: Bytes of the array objects of one id set and its copies (numpy's array header, three times, and the lists' slots).
ID_SET_OBJECT_BYTES = 400


def calls_per_sample(batch: int, row_bytes: int) -> int:
    """Enough calls that one sample lasts about a millisecond or more."""
    return max(1, min(200, (4 * 2**20) // max(1, batch * row_bytes)))


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block (on again after it, if it was on): see the module's method."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _host_seconds_per_call(call: Callable[[Any], Any], id_list: list[Any]) -> float:
    started = time.perf_counter()
    for ids in id_list:
        call(ids)
    return (time.perf_counter() - started) / len(id_list)


def _host_allocated_by_one_call(call: Callable[[Any], Any], ids: Any) -> int | None:
    """Bytes one call allocates, as tracemalloc sees them; None for a torch result (torch allocates apart from it)."""
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = call(ids)
        _, peak = tracemalloc.get_traced_memory()
        unseen = _library(result) == "torch"
        del result
        return None if unseen else max(0, peak - before)
    finally:
        tracemalloc.stop()


@functools.cache
def _cache_sizes() -> dict[int, int]:
    """cpu0's data and unified caches per Linux sysfs: level -> bytes (empty where sysfs does not say).

    A cache whose level or type cannot be read counts at level 0, for
    :func:`last_level_cache_bytes` alone; a size this reader does not know
    (anything but digits and an optional K, M or G) is skipped.
    """
    sizes: dict[int, int] = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        size = _sysfs_text(f"{index}/size")
        match = re.fullmatch(r"(\d+)([KMG]?)", size or "")
        if match is None:
            continue
        level_text, kind = _sysfs_text(f"{index}/level"), _sysfs_text(f"{index}/type")
        if kind == "Instruction":  # holds no rows
            continue
        level = int(level_text) if level_text is not None and level_text.isdigit() else 0
        size_bytes = int(match[1]) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match[2]]
        sizes[level] = max(sizes.get(level, 0), size_bytes)
    return sizes


def _sysfs_text(path: str) -> str | None:
    """The stripped text of a sysfs file, or None where it cannot be read as text."""
    try:
        with open(path, encoding="ascii") as text:
            return text.read().strip()
    except (OSError, ValueError):  # missing, unreadable, or not ASCII (UnicodeDecodeError is a ValueError)
        return None


def last_level_cache_bytes() -> int:
    """The largest CPU cache of cpu0 per Linux sysfs; 32 MiB where sysfs does not say."""
    return max(_cache_sizes().values(), default=32 * 2**20)


def core_cache_bytes() -> int:
    """cpu0's level-2 cache per Linux sysfs (a core's own on current CPUs); 256 KiB where sysfs does not say."""
    return _cache_sizes().get(2, 256 * 2**10)


_scrub_buffer: np.ndarray | None = None


def settle_host_caches(written_bytes: int | None = None) -> None:
    """Read a buffer of twice the last-level cache (at least 64 MiB), before a cold call or a large sample.

    A contender that wrote its output with ordinary stores leaves those lines
    dirty in the cache, and whoever runs next may pay for writing them back;
    reading this buffer evicts them outside the timed region. The read is
    made where a sample writes at least a quarter of the cache, and before
    every cold call (``None``), which must find the caches evicted. Below
    that it is skipped, a trade-off: on a machine whose last-level cache
    holds hundreds of MiB the read takes longer than the samples it would
    precede, and the write-backs it would spare, of outputs of a few MiB,
    fall on whichever samples evict them, the contenders' alike.

    Args:
        written_bytes: the most one sample writes; None (a cold call) always reads.
    """
    global _scrub_buffer
    if written_bytes is not None and 4 * written_bytes < last_level_cache_bytes():
        return
    if _scrub_buffer is None:
        _scrub_buffer = np.ones(max(2 * last_level_cache_bytes(), 64 * 2**20) // 8, np.uint64)
    _scrub_buffer.sum()


HOST = Platform("cpu", lambda ids: ids, _host_seconds_per_call, rss_bytes, _host_allocated_by_one_call, settle_host_caches,
                last_level_cache_bytes)


def measure_case(
    table: Any,
    contenders: list[Contender],
    batch: int,
    distribution: str,
    repetitions: int,
    warmup: int = 2,
    seed: int = 0,
    platform: Platform = HOST,
    cold: bool = False,
    written_row_bytes: int | None = None,
) -> list[Result]:
    """Time every contender on `batch` ids of `distribution`, interleaved (see the module's method).

    ``written_row_bytes``: the most any contender writes per row (default: a
    row of `table`), for the platform's settling.
    """
    row_bytes = table.shape[1] * table.dtype.itemsize
    written_row_bytes = row_bytes if written_row_bytes is None else written_row_bytes
    inner = 1 if cold else calls_per_sample(batch, row_bytes)
    sets = pool_size(batch, row_bytes, inner, repetitions, warmup, table.shape[0], platform.cache_bytes(),
                     len(contenders))
    host_pool = id_sets(distribution, batch, table.shape[0], sets, seed)
    pools = {
        dtype: [platform.ids_to_device(ids.astype(dtype)) for ids in host_pool]
        for dtype in {contender.id_dtype for contender in contenders}
    }
    prepared: dict[str, tuple[Callable, list]] = {}
    results: dict[str, Result] = {}
    for contender in contenders:
        if contender.id in prepared:
            raise ValueError(f"two contenders have the id {contender.id!r}")
        pool = pools[contender.id_dtype]
        memory_before = platform.memory_in_use()
        call = contender.prepare(table, batch)
        output = call(pool[0])
        if contender.kind != "limit":  # a lookup that gives wrong rows is not timed
            # pool[0]: the ids where the platform put them, so a device table gathers on its device.
            expected = contender.expected(table, host_pool[0]) if contender.expected else table[pool[0]]
            if expected is not None and not same_bytes(output, expected):
                raise RuntimeError(f"{contender.name} gave other rows than {'its reference' if contender.expected else 'table[ids]'} "
                                   f"for {batch} ids: it is not timed")
            del expected
        del output  # dropped before its allocations and memory are measured: a held output is not recycled
        prepared[contender.id] = (call, pool)
        results[contender.id] = Result(
            contender.name, contender.kind, batch, distribution, [], 2 * batch * row_bytes, contender.allocates,
            allocated_per_call=platform.allocated_by_one_call(call, pool[1]),
            memory_growth=platform.memory_in_use() - memory_before,
            device=platform.device, id=contender.id, served_by=getattr(call, "served_by", None),
        )
    for repetition in range(warmup + repetitions):
        for index, (name, (call, pool)) in enumerate(prepared.items()):
            # Each contender gets its own id sets: none reads rows another has just cached.
            first = (repetition * len(prepared) + index) * inner
            id_list = [pool[(first + k) % len(pool)] for k in range(inner)]
            platform.settle(None if cold else inner * batch * written_row_bytes)
            if inner > 1:
                # A loop of small calls is timed warm: the first call after the
                # settling read would otherwise add its cold Python layers
                # (tens of us) to every call's average; cold=True times that call.
                # Its ids are the previous contender's last set, which no timed call reads next.
                call(pool[(first - 1) % len(pool)])
            with collector_paused():
                elapsed = platform.seconds_per_call(call, id_list)
            if repetition >= warmup:
                results[name].samples_s.append(elapsed)
    return list(results.values())


def same_bytes(result: Any, expected: Any) -> bool:
    """Whether two arrays (numpy, cupy or torch, on any device) have the same shape and bytes."""
    return tuple(result.shape) == tuple(expected.shape) and np.array_equal(_host_bytes(result), _host_bytes(expected))


def _library(array: Any) -> str:
    """The name of `array`'s adapter (``"numpy"``, ``"torch"``, ``"cupy"``, ...), numpy for what no adapter owns."""
    adapter = adapter_of(array)
    return "numpy" if adapter is None else adapter.name


def _host_bytes(array: Any) -> np.ndarray:
    """The bytes of `array` (numpy, cupy, or torch, whose bfloat16 and float8 numpy cannot hold), in host memory."""
    library = _library(array)
    if library == "torch":
        import torch

        return torch.flatten(array.detach().cpu().contiguous()).view(torch.uint8).numpy()
    if library == "cupy":
        import cupy

        array = cupy.asnumpy(array)
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def summarise(results: list[Result]) -> list[dict[str, Any]]:
    """Per result: median us, GB/s, the fraction of its limit, speedups over fancy indexing.

    Ratios are medians of per-repetition ratios: every repetition measures
    all contenders back to back, so a slow phase of a shared machine (it
    comes and goes over seconds) slows both sides of a ratio alike, where a
    ratio of two medians could pick one from a slow phase and the other
    from a fast one.

    ``fraction_of_limit`` (≤ 1): a row's limit is the fastest way measured to
    produce the same output, repetition by repetition: the copy limits of its
    class (writing into a given output: the contiguous copies; allocating its
    output: the allocating copies) and every contender of that class, so a
    contender that beats the copies (a few ids: the copies' own Python
    overhead) reads 1, never more. ``limit`` names the contender that was
    that limit in most repetitions (usually a copy). The scattered read is
    a limit of its own: ``fraction_of_scattered_read`` is its time / the
    row's (it can exceed 1 where a gather reads faster than that kernel).
    ``best_copy`` is the writing copy with the lowest median.
    """
    rows = []
    for (device, batch, distribution), group in _group(results).items():
        copies = [r for r in group if r.kind == "limit" and r.id != SCATTERED_READ]
        best_copy = min((r for r in copies if not r.allocates_output), key=lambda r: r.median_s, default=None)
        scattered_read = next((r for r in group if r.id == SCATTERED_READ), None)
        baselines = {key: next((r for r in group if r.id == base), None) for key, base in BASELINES.items()}
        for r in group:
            fraction, limit = None, None
            if r.id != SCATTERED_READ:
                own_copies = [c for c in copies if c.allocates_output == r.allocates_output]
                if own_copies:
                    candidates = own_copies + [c for c in group if c.kind != "limit"
                                               and c.allocates_output == r.allocates_output]
                    fraction, limit = _fraction_of_fastest(candidates, r)
            row = {
                "device": device, "id": r.id, "contender": r.contender, "kind": r.kind, "batch": batch,
                "distribution": distribution, "median_us": r.median_s * 1e6, "gbps": r.gbps,
                "fraction_of_limit": fraction, "limit": limit,
                "fraction_of_scattered_read": paired_ratio(scattered_read, r) if scattered_read else None,
                "served_by": r.served_by, "allocates_output": r.allocates_output,
                "allocated_per_call": r.allocated_per_call, "memory_growth": r.memory_growth,
                "best_copy": best_copy.id if best_copy else None,
                "samples_us": [s * 1e6 for s in r.samples_s],
            }
            row.update({key: (paired_ratio(base, r) if base else None) for key, base in baselines.items()})
            rows.append(row)
    return rows


def _fraction_of_fastest(candidates: list[Result], result: Result) -> tuple[float, str]:
    """Median over repetitions of (fastest candidate's time / result's time), and the most often fastest one's id."""
    if not any(c is result for c in candidates):
        candidates = candidates + [result]
    if any(len(c.samples_s) != len(result.samples_s) for c in candidates):
        raise ValueError("paired samples differ in number between contenders of one case")
    fastest = [min(candidates, key=lambda c: c.samples_s[k]) for k in range(len(result.samples_s))]
    ratios = [f.samples_s[k] / result.samples_s[k] for k, f in enumerate(fastest)]
    counts: dict[str, int] = {}
    for f in fastest:
        counts[f.id] = counts.get(f.id, 0) + 1
    return statistics.median(ratios), max(counts, key=lambda name: counts[name])


def paired_ratio(reference: Result, contender: Result) -> float:
    """Median over repetitions of reference time / contender time, both from the same repetition."""
    return paired_ratio_of_samples(reference.samples_s, contender.samples_s)


def paired_ratio_of_samples(reference: list[float], contender: list[float]) -> float:
    if len(reference) != len(contender) or not reference:
        raise ValueError(f"paired samples differ in number: {len(reference)} vs {len(contender)}")
    return statistics.median(a / b for a, b in zip(reference, contender, strict=True))


def _group(results: list[Result]) -> dict[tuple[str, int, str], list[Result]]:
    groups: dict[tuple[str, int, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.device, r.batch, r.distribution), []).append(r)
    return groups
