"""``fastembed-bench --ranks N``: the vocabulary-parallel lookup on N ranks of this machine, against one process.

Every process opens the table's file (``--table``, or the random table saved
as a temporary .npy file). N ranks (torch.multiprocessing, a gloo group over
a file:// rendezvous) each build
``fastembed.distributed.VocabParallelEmbedding(path)``, which maps only that
rank's rows; the ranks share this host, so the layer picks its shared-memory
exchange (``exchange="auto"``), and the report says which one each call used.
Each rank runs fastembed's parallel kernels on its share of the cores
(``NUMBA_NUM_THREADS``, unless set: cores // N); the single process on all. Then one fresh process maps the whole file with
``Embedding.from_pretrained`` and makes the same lookups. Every process draws
the same uniform ids from the same seed; per batch it makes one call per
mode, waits for background compiles, makes :data:`WARMUP_ROUNDS` more
rounds untimed, then times ``reps`` calls per mode, the modes interleaved
(Python's garbage collector paused while a call is timed, as everywhere in the benchmark).

The ranks and the single process cannot share a process, and calls of one
interleaved with calls of the other slow both (each evicts the other's
caches and wakes the other's threads), so the comparison is interleaved by
rounds: :data:`ROUNDS` times the ranks, then the single process, all fresh
processes; the ratio is the median over rounds of each round's ranks'
median over its single process's, and the report gives its range.

Per batch and mode the report gives:

- the exchange the calls used (``shared_memory`` or ``all_reduce``);
- the time per lookup on the ranks (per repetition the slowest rank's, then
  the median) and its parts, each the same statistic: *prepare* (checking,
  copying and hashing the ids), *gather* (this rank's rows into the
  exchange's buffer: the shared segment, or the all-reduce's buffer with
  zeros elsewhere), *agree* (the exchange of fingerprints, through the
  agreement board where the ranks share a host, else an all-gather; it
  includes waiting for the slowest rank, and with shared memory it is also
  the barrier after every rank's writes), *communicate* (the data collective: the
  all-reduce in both modes; with shared memory none, unless a call grew
  the segment) and *copy out* (the rows a rank returns, out of the shared
  segment, or scatter's positions out of the all-reduced buffer);
- the bytes each rank puts into the exchange (the all-reduce: the whole
  buffer; shared memory: its own rows) and the bytes it sends for them (a
  ring all-reduce sends 2(N-1)/N of its buffer; shared memory writes its
  rows once, where the others read them);
- one process's median time for the same ids (the median over rounds),
  and the ratio (the median over rounds of each round's ratio of medians,
  with their lowest and highest).

Below the tables, each process's memory. Memory is the first round's. The baseline is taken after torch
is imported and (on a rank) the process group exists, just before the table
is opened: what the layer and its lookups add, not what torch and gloo cost.
The growth to after the lookups is shown beside the bytes of the rows the
process holds (a rank's shard; the single process's table), and split, from
``/proc/self/status`` and ``/proc/self/smaps``, into the table file's
resident pages (at most the rows held), other files' pages (shared
libraries: numba's llvmlite is loaded by the first large lookup),
anonymous memory (numba's compiler and compiled kernels, Python objects,
buffers not yet returned) and shared memory (the exchange's segment: two
buffers of the largest batch, mapped by every rank and counted in each
rank's RSS, though the host holds them once). The peak (VmHWM, reset at the baseline) also
counts each call's buffers, which are freed before the next.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np

from fastembed.distributed import MODES, LookupTimings

from .contenders import usable_cores
from .measure import collector_paused
from .report import print_readable

#: Batch sizes of the run: a decode step, mid-size batches, a prefill chunk.
BATCHES = (1, 64, 1024, 8192)
#: Where a call's time went: the seconds fields of a call's timings.
PHASES = tuple(field for field in LookupTimings._fields if field.endswith("_s"))
#: Timed calls per mode and batch in each process.
REPS = 20
#: Untimed rounds of calls per batch after the first ones and the compile wait.
WARMUP_ROUNDS = 3
#: Rounds of (the ranks, then one process), each in fresh processes.
ROUNDS = 3
#: Seconds a rank waits for one collective: a rank that dies fails the run instead of hanging it.
TIMEOUT_S = 300.0


def run(table_path: Path, ranks: int, batches: list[int], reps: int, seed: int = 0,
        name: str | None = None, rounds: int = ROUNDS) -> list[dict[str, Any]]:
    """`rounds` times: the ranks, then the single process, on the table at `table_path` (tensor `name`).

    Returns:
        One ``{"ranks": [one dict per rank], "single": dict}`` per round; each
        holds ``samples`` (``"batch/mode"`` -> lists of seconds per phase and
        ``total_s``), the bytes handed to the collective per case, its memory
        before and after its lookups and the bytes of the rows it holds.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a process failed (its traceback included).
    """
    import torch.multiprocessing as mp

    measured = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="fastembed-ranks-") as folder:
            init = f"file://{Path(folder) / 'rendezvous'}"
            _spawned(mp, rank_worker, (ranks, init, str(table_path), name, batches, reps, seed, folder), ranks)
            _spawned(mp, single_worker, (str(table_path), name, batches, reps, seed, folder), 1)
            per_rank = [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(ranks)]
            single = json.loads(Path(folder, "single.json").read_text())
        measured.append({"ranks": per_rank, "single": single})
    return measured


def _spawned(mp: Any, function: Any, args: tuple[Any, ...], processes: int) -> None:
    """Run `function` in `processes` spawned processes and wait for them; any exception here (a signal that stops the
    run, say) ends them first, so that no rank outlives the run.

    The processes start with SIGINT blocked (`function` unblocks it first:
    :func:`_started`), so that a Ctrl-C while they import interrupts this
    process alone, which ends them, and no traceback of theirs is printed;
    a signal that comes while they start is held until all of them have
    (:func:`_signals_held`), so that each is known here to be ended.
    The files in which torch has a failed process write its traceback are
    removed once every process has ended (torch reads them, never removes them).
    """
    before = set(mp.active_children())
    context = None
    try:
        with _signals_held():
            context = mp.start_processes(function, args=args, nprocs=processes, join=False, start_method="spawn")
        while not context.join():
            pass
    except BaseException:
        # The children started here, including those of a start the exception cut short.
        for process in set(mp.active_children()) - before:
            process.kill()
            process.join()
        raise
    finally:
        for path in context.error_files if context is not None else ():
            with suppress(OSError):
                os.unlink(path)


#: The signals that stop a run, held while processes start (:func:`_signals_held`).
_HELD_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@contextmanager
def _signals_held() -> Iterator[None]:
    """Inside the block, SIGINT blocked in the calling thread (a process started meanwhile inherits the mask) and,
    on the main thread, every signal of :data:`_HELD_SIGNALS` that is not ignored held back; one that came meanwhile
    is delivered as the block ends, to the handler it had before.

    Blocking alone is not enough: a signal sent to the process goes to any
    thread that does not block it (a thread of torch's, say), and Python
    then raises it on the main thread wherever that is, which can cut a
    start short after the process exists and before it is recorded, so that
    nothing ends it and it fails reading its arguments.
    """
    held: list[int] = []
    previous_handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for name in _HELD_SIGNALS:
            number = getattr(signal, name, None)
            # An ignored signal stays ignored (the processes inherit that), and None is a handler Python cannot restore.
            if number is not None and signal.getsignal(number) not in (None, signal.SIG_IGN):
                previous_handlers[number] = signal.signal(number, lambda signum, _frame: held.append(signum))
    try:
        if not hasattr(signal, "pthread_sigmask"):  # Windows
            yield
            return
        from multiprocessing import resource_tracker

        # Its first start unblocks SIGINT in the calling thread as it ends: it must not happen inside the block.
        resource_tracker.ensure_running()
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)  # a SIGINT blocked meanwhile is held now
    finally:
        for number, handler in previous_handlers.items():
            signal.signal(number, handler)
        for number in dict.fromkeys(held):
            signal.raise_signal(number)


def _started() -> None:
    """What a process :func:`_spawned` started does first: unblock SIGINT (a Ctrl-C that came during its start is
    delivered now), and end when the benchmark does.

    torch asks for a parent-death signal (SIGINT) only once the process has
    imported torch, and that signal does nothing where SIGINT is ignored (a
    benchmark started in the background by a shell) or on systems without
    one: a thread that waits for the parent's end covers every case.
    """
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def end_with_the_benchmark() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)  # the benchmark is gone: nothing waits for this process's results

    threading.Thread(target=end_with_the_benchmark, name="fastembed-bench: end with the benchmark", daemon=True).start()


def rank_worker(rank: int, world: int, init: str, table_path: str, name: str | None, batches: list[int], reps: int,
                seed: int, folder: str) -> None:
    """One rank (run by torch.multiprocessing): its samples into ``folder/rank{rank}.json``."""
    _started()
    # The ranks share this machine's cores: each runs its parallel lookups on its share (unless told otherwise),
    # since a kernel whose threads outnumber the cores waits a scheduler time slice for the one descheduled.
    os.environ.setdefault("NUMBA_NUM_THREADS", str(rank_threads(world)))
    import torch.distributed as dist

    import fastembed
    from fastembed.distributed import VocabParallelEmbedding

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        before = memory(table_path)
        emb = VocabParallelEmbedding(table_path, name=name, timeout=TIMEOUT_S)
        samples, payloads, exchanges = _measure(lambda ids, mode: emb(ids, mode=mode), emb.vocab_size, batches, reps,
                                                seed, fastembed.wait_for_compiles, lambda: emb.last_timings)
        report = {"rank": rank, "layer": repr(emb), "exchange": emb.exchange, "agreement": emb.agreement,
                  "exchanges": exchanges,
                  "numba_threads": os.environ["NUMBA_NUM_THREADS"],
                  "rows": [emb.vocab_start, emb.vocab_end], "held_bytes": int(emb.shard.nbytes),
                  "rss_before_bytes": before["rss"], "rss_bytes": _rss_bytes(), "memory_before": before,
                  "memory_after": memory(table_path), "samples": samples, "payload_bytes": payloads}
        Path(folder, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def rank_threads(world: int) -> int:
    """Threads for one of `world` ranks on this machine: its share of the cores this process may run on."""
    return max(1, usable_cores() // world)


def single_worker(_index: int, table_path: str, name: str | None, batches: list[int], reps: int, seed: int,
                  folder: str) -> None:
    """The single process (run by torch.multiprocessing): the whole table, the same ids, into ``single.json``."""
    _started()
    import fastembed

    before = memory(table_path)
    emb = fastembed.Embedding.from_pretrained(table_path, name)
    samples, _, _ = _measure(lambda ids, mode: emb(ids), emb.vocab_size, batches, reps, seed,
                             fastembed.wait_for_compiles, lambda: None)
    report = {"held_bytes": emb.nbytes, "rss_before_bytes": before["rss"], "rss_bytes": _rss_bytes(),
              "memory_before": before, "memory_after": memory(table_path), "samples": samples}
    Path(folder, "single.json").write_text(json.dumps(report))


def _measure(call: Any, vocab_size: int, batches: list[int], reps: int, seed: int, wait: Any,
             timings: Any) -> tuple[dict[str, dict[str, list[float]]], dict[str, int], dict[str, list[str]]]:
    """Samples per "batch/mode": total seconds per call and, where `timings()` gives them, each phase's.

    Returns:
        The samples, the payload bytes of the last call per case, and the exchanges the timed calls used per case.
    """
    rng = np.random.default_rng(seed)  # every process draws the same ids in the same order
    samples: dict[str, dict[str, list[float]]] = {}
    payloads: dict[str, int] = {}
    exchanges: dict[str, list[str]] = {}
    for batch in batches:
        for mode in MODES:
            call(rng.integers(0, vocab_size, batch), mode)
        wait()
        for _ in range(WARMUP_ROUNDS):
            for mode in MODES:
                call(rng.integers(0, vocab_size, batch), mode)
        for mode in MODES:
            samples[f"{batch}/{mode}"] = {name: [] for name in ("total_s", *PHASES)}
        for _ in range(reps):
            for mode in MODES:
                ids = rng.integers(0, vocab_size, batch)
                with collector_paused():
                    started = time.perf_counter()
                    call(ids, mode)
                    elapsed = time.perf_counter() - started
                case = samples[f"{batch}/{mode}"]
                case["total_s"].append(elapsed)
                parts = timings()
                if parts is not None:
                    for name in PHASES:
                        case[name].append(getattr(parts, name))
                    payloads[f"{batch}/{mode}"] = int(parts.payload_bytes)
                    used = exchanges.setdefault(f"{batch}/{mode}", [])
                    if parts.exchange not in used:
                        used.append(parts.exchange)
    return samples, payloads, exchanges


def _rss_bytes() -> int:
    from .measure import rss_bytes

    return rss_bytes()


def memory(table_path: str | os.PathLike, reset_peak: bool = True) -> dict[str, int]:
    """This process's memory, in bytes: RSS, its anonymous and file parts, the peak, the table file's resident pages.

    Args:
        table_path: the table's file; ``table_file`` is the resident bytes of this process's maps of it.
        reset_peak: afterwards, reset the peak (VmHWM) to the current RSS, so that the next reading's
            ``peak`` is the highest RSS since this one.

    Returns:
        ``{"rss", "rss_anon", "rss_file", "rss_shmem", "peak", "table_file"}``; every value 0 where ``/proc``
        lacks it. ``rss_shmem`` is the shared-memory exchange's segment, as far as this process touched it.
    """
    fields = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem", "VmHWM": "peak"}
    found = dict.fromkeys([*fields.values(), "table_file"], 0)
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in fields:
                    found[fields[key]] = int(value.split()[0]) * 1024
        target, current = os.path.realpath(table_path), None
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                if line.startswith("Rss:"):
                    found["table_file"] += int(line.split()[1]) * 1024 if current == target else 0
                elif not line[:1].isupper():  # a mapping's first line: addresses, perms, offset, dev, inode, path
                    parts = line.split(maxsplit=5)
                    current = parts[5].strip() if len(parts) > 5 else None
        if reset_peak:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
    except OSError:
        pass
    return found


def summarise(measured: list[dict[str, Any]], batches: list[int]) -> list[dict[str, Any]]:
    """One row per (batch, mode): the exchange, the slowest rank's time and phases, bytes, one process's time, and
    two ratios; each time the median over rounds of a round's median, each ratio the median over rounds of theirs.

    ``ranks_over_single``: the slowest rank's median time per call over one
    process's (a call's latency). ``throughput_vs_single``: the ranks'
    throughput as a fraction of one process's, that is one process's mean
    time per call over the ranks' mean, each call's time averaged over the
    ranks. The ranks call in lockstep, and the rank that is ahead waits
    inside its next call, so every rank's calls add up to the loop's time;
    the slowest rank of each call is the one that waited, and its times add
    up to more.
    """
    world = len(measured[0]["ranks"])
    rows = []
    for batch in batches:
        for mode in MODES:
            key = f"{batch}/{mode}"
            row: dict[str, Any] = {"batch": batch, "mode": mode, "ranks": world, "rounds": len(measured)}
            for name in ("total_s", *PHASES):
                row[name.replace("_s", "_us")] = statistics.median(
                    _slowest_median(round_["ranks"], key, name) for round_ in measured) * 1e6
            ratios = [_slowest_median(round_["ranks"], key, "total_s")
                      / statistics.median(round_["single"]["samples"][key]["total_s"]) for round_ in measured]
            used = sorted({exchange for round_ in measured for rank in round_["ranks"]
                           for exchange in rank["exchanges"][key]})
            row["exchange"] = "+".join(used)
            payload = max(rank["payload_bytes"][key] for round_ in measured for rank in round_["ranks"])
            row["payload_bytes"] = payload
            # shared memory: a rank writes its rows once, where the others read them; a ring all-reduce 2(N-1)/N
            row["sent_bytes"] = payload if used == ["shared_memory"] else int(payload * 2 * (world - 1) / world)
            row["single_us"] = statistics.median(
                statistics.median(round_["single"]["samples"][key]["total_s"]) for round_ in measured) * 1e6
            row["ranks_over_single"] = statistics.median(ratios)
            row["ranks_over_single_range"] = [min(ratios), max(ratios)]
            throughputs = [statistics.mean(round_["single"]["samples"][key]["total_s"])
                           / _mean_over_ranks(round_["ranks"], key) for round_ in measured]
            row["throughput_vs_single"] = statistics.median(throughputs)
            row["throughput_vs_single_range"] = [min(throughputs), max(throughputs)]
            rows.append(row)
    return rows


def _mean_over_ranks(ranks: list[dict[str, Any]], key: str) -> float:
    """One round's mean seconds per call, each call's seconds averaged over the ranks."""
    return statistics.mean(statistics.mean(values) for values in zip(*(rank["samples"][key]["total_s"]
                                                                        for rank in ranks), strict=True))


def _slowest_median(ranks: list[dict[str, Any]], key: str, name: str) -> float:
    """The median, over one round's repetitions, of the slowest rank's seconds for phase `name`."""
    return statistics.median(max(values) for values in zip(*(rank["samples"][key][name] for rank in ranks), strict=True))


@contextmanager
def table_file(table: Any, given: Path | None) -> Iterator[Path]:
    """A file every process can map: `given` (--table) as it is, else the table saved as a temporary .npy file."""
    if given is not None:
        yield given
        return
    from .processes import saved_table

    with saved_table(table) as path:
        yield path


def print_report(rows: list[dict[str, Any]], measured: list[dict[str, Any]], console: Any, title: str) -> None:
    """Two tables (the times against one process; the parts and bytes) and each process's memory, with rich."""
    world = len(measured[0]["ranks"])
    print_readable(_table(title, ("ids", "mode", "exchange", "1 process", f"{world} ranks", f"{world} ranks / 1",
                                  "lowest-highest", "through-\nput / 1"), [
        (row["batch"], row["mode"], row["exchange"], _time(row["single_us"]), _time(row["total_us"]),
         f"{row['ranks_over_single']:.2f}", "{:.2f}-{:.2f}".format(*row["ranks_over_single_range"]),
         f"{row['throughput_vs_single']:.2f}")
        for row in rows]), console)
    print_readable(_table(f"the {world} ranks' time per lookup in parts (the slowest rank's), and bytes per rank",
                          ("ids", "mode", "prepare", "gather", "agree", "commu-\nnicate", "copy\nout", "payload",
                           "sent"), [
        (row["batch"], row["mode"], _time(row["prepare_us"]), _time(row["gather_us"]), _time(row["agree_us"]),
         _time(row["communicate_us"]), _time(row["copy_us"]), _bytes(row["payload_bytes"]), _bytes(row["sent_bytes"]))
        for row in rows]), console)
    first = measured[0]
    for rank in first["ranks"]:
        console.print(f"rank {rank['rank']}: {rank['layer']}, NUMBA_NUM_THREADS={rank['numba_threads']}",
                      markup=False)
    console.print(f"times: the median over {len(measured)} rounds (the ranks, then 1 process, fresh processes each) "
                  f"of the slowest rank's median per call; throughput: one process's mean time per call over the "
                  f"ranks' (each call averaged over the ranks), the median over the rounds (ranks.json has its range); "
                  f"memory: the first round's",
                  markup=False)
    for rank in first["ranks"]:
        console.print(f"rank {rank['rank']}: rows {rank['rows'][0]}..{rank['rows'][1]}, holds "
                      f"{_bytes(rank['held_bytes'])}; {_rss(rank)}", markup=False)
    single = first["single"]
    console.print(f"1 process: holds {_bytes(single['held_bytes'])}; {_rss(single)}", markup=False)
    console.print("(growth from after torch and the process group, before the table, to after the lookups; RSS "
                  "counts a mapped row once a lookup has touched its page; peak: the highest RSS in between)",
                  markup=False)


def _rss(process: dict[str, Any]) -> str:
    before, after = process["memory_before"], process["memory_after"]
    grown = after["rss"] - before["rss"]
    table = after["table_file"] - before["table_file"]
    other_files = after["rss_file"] - before["rss_file"] - table
    return (f"RSS {_bytes(after['rss'])} after its lookups, {_signed(grown)} (table file pages {_signed(table)}, "
            f"other files {_signed(other_files)}, anonymous {_signed(after['rss_anon'] - before['rss_anon'])}, "
            f"shared memory {_signed(after['rss_shmem'] - before['rss_shmem'])}); "
            f"peak {_signed(after['peak'] - before['rss'])}")


def _signed(count: float) -> str:
    return ("-" if count < 0 else "+") + _bytes(abs(count))


def _table(title: str, columns: tuple[str, ...], values: list[tuple[Any, ...]]) -> Any:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title), box=box.SIMPLE_HEAD)
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in values:
        table.add_row(*(escape(str(value)) for value in row))
    return table


def _time(us: float) -> str:
    if us < 999.5:
        return f"{us:.0f} us"
    return f"{_digits(us / 1000)} ms" if us < 999.5e3 else f"{_digits(us / 1e6)} s"


def _bytes(count: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{_digits(count / size)} {unit}"
    return f"{count:.0f} B"


def _digits(value: float) -> str:
    """Three significant digits, never in exponent notation (1,010 stays 1010, not 1.01e+03)."""
    return f"{value:.3g}" if abs(value) < 999.5 else f"{value:.0f}"


def main(arguments: Any, console: Any, table: Any, described: dict[str, Any], argv: list[str] | None) -> int:
    """``fastembed-bench --ranks N``: measure, print, write ranks.json into --out; 0 when done."""
    from . import report

    batches = arguments.batch or list(BATCHES)
    reps = arguments.reps or (5 if arguments.quick else REPS)
    rounds = 1 if arguments.quick else ROUNDS
    console.print(f"[dim]{rounds} x ({arguments.ranks} ranks, then 1 process): {len(batches)} batches x {len(MODES)} "
                  f"modes x {reps} calls ...[/dim]")
    with table_file(table, arguments.table) as path:
        measured = run(path, arguments.ranks, batches, reps, name=arguments.tensor, rounds=rounds)
    rows = summarise(measured, batches)
    exchange, agreement = (measured[0]["ranks"][0][fact] for fact in ("exchange", "agreement"))
    print_report(rows, measured, console, f"{arguments.ranks} ranks (gloo, {exchange} exchange, agreement through "
                                          f"{agreement.replace('_', ' ')}, this machine) against 1 process: "
                                          f"{report.table_title(described)}")
    report.write_json(arguments.out / "ranks.json", {
        **report.run_facts(argv), "table": described, "ranks": arguments.ranks, "reps": reps,
        "cpus": os.cpu_count(), "exchange": exchange, "agreement": agreement, "rounds": len(measured), "results": rows,
        "processes": measured,
    })
    console.print(f"wrote {arguments.out / 'ranks.json'}", soft_wrap=True, markup=False)
    return 0
