"""The command line of ``fastembed-bench``: its options, and every check of them made before any table is built.

Every argument (an option the chosen mode would not use is refused too),
--out and each result file already in it (they must be writable), the
settings FASTEMBED_BACKEND and FASTEMBED_OUTPUT_CACHE_BYTES, each host
backend's library (a numba that is installed but does not load) and, with
--gate, the thresholds file are checked before any table is built: a bad
one exits 2 at once.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from typing import Any, NoReturn

BATCHES = (1, 6, 64, 1024, 8192, 65536)
#: The random table's shape and dtype when not given: the default 129,280 x 4,096 float16 table.
RANDOM_TABLE = {"vocab_size": 129280, "dim": 4096, "dtype": "float16"}
QUICK_BATCHES = (1, 6, 1024, 8192)
#: Larger batches than this are refused: every contender holds its own output of that many rows.
MAX_BATCH = 2**20
#: Outputs of the largest batch that a run holds at once, an estimate for the memory check: one per contender
#: that writes into its own (fastembed's per backend and auto, numpy's take, torch's, the copies), the copies'
#: sources, and the new ones of allocating calls.
OUTPUTS_HELD = 12


class _OneLineErrors(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line: the options are one ``--help`` away."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line, every value checked before any work: a bad one exits 2 with a one-line error.

    That includes --out (created, a probe file written and removed in it, and
    each result file already there opened for writing), the host backends
    (each one's library loaded) and, with --gate, the thresholds file (read
    and checked).
    """
    import fastembed

    from .ids import DISTRIBUTIONS

    backends = [status.name for status in fastembed.backend_statuses() if status.name != "cuda"]
    from . import cli

    parser = _OneLineErrors(prog="fastembed-bench", description=(cli.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer batches and repetitions (the main run; --format: fewer repetitions; --ranks: fewer "
                             "repetitions and one round)")
    parser.add_argument("--backend", type=_choices(backends),
                        help=f"comma-separated fastembed backends to measure one by one: {', '.join(backends)} "
                             "(default: all available)")
    parser.add_argument("--batch", type=_batches,
                        help=f"comma-separated batch sizes, 1 to {MAX_BATCH} (default: {','.join(map(str, BATCHES))})")
    parser.add_argument("--dist", type=_choices(DISTRIBUTIONS),
                        help=f"comma-separated id distributions: {', '.join(DISTRIBUTIONS)} (default: both)")
    parser.add_argument("--reps", type=_repetitions,
                        help="timed repetitions per case (default 15, quick 5; --gate: the thresholds file's, "
                             "--processes: 100 per process, fewer for outputs over 8 MiB but at least 15, --ranks: 20, quick 5)")
    parser.add_argument("--cold", action="store_true",
                        help="time every call alone, right after the host's caches are evicted, as a decode step "
                             "meets the lookup after a forward pass (default: small batches are timed as warm loops of "
                             "calls; use many --reps, such as 200); the host only")
    parser.add_argument("--out", type=_path, default=Path("bench-results"),
                        help="folder for the results: JSON, a Markdown table and PNG plots (default: bench-results)")
    parser.add_argument("--vocab-size", type=_positive_int, help="rows of the random table (default: 129280)")
    parser.add_argument("--dim", type=_positive_int, help="width of the random table (default: 4096)")
    parser.add_argument("--dtype", type=_dtype, help="float16 (default), bfloat16, float32, ...")
    parser.add_argument("--table", type=_path,
                        help="measure this table instead of a random one: a .npy, safetensors or GGUF file (its format "
                             "told by its content) or a checkpoint folder, memory-mapped read-only (not with "
                             "--vocab-size, --dim or --dtype)")
    parser.add_argument("--tensor", help="--table: the tensor's name in a safetensors or GGUF file (default: the one "
                                         "named like a token embedding; token_embd.weight in GGUF)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: the host, plus the GPU where one is usable (default); cpu or cuda: only that")
    parser.add_argument("--gate", action="store_true",
                        help="run the CI performance gate on the host (its cases come from --thresholds, not --batch "
                             "or --dist; the packaged ones are set for the default table); exit 1 on any FAIL")
    parser.add_argument("--processes", type=_positive_int,
                        help="time the lookups in this many fresh interpreters, one after another, and report the "
                             "spread between them and each one's 99th percentile (batches: --batch, default "
                             "64,1024,4096,65536; uniform ids)")
    parser.add_argument("--load", action="store_true",
                        help="--processes: a CPU-bound process pinned to one CPU runs meanwhile")
    parser.add_argument("--ranks", type=_positive_int,
                        help="the vocabulary-parallel lookup (fastembed.distributed; needs torch) on this many ranks of "
                             f"this machine (at most {RANKS_PER_CORE} per usable core), each mapping its rows of the table, against "
                             "one process: time per lookup "
                             "split into local gather and communication, bytes per rank, RSS per rank (batches: "
                             "--batch, default 1,64,1024,8192; uniform ids)")
    parser.add_argument("--format", type=_choices(_format_names()),
                        help="quantized tables: comma-separated formats (" + ", ".join(_format_names()) + ") made from "
                             "the table (q8_0, fp8_e4m3 quantized by fastembed; the others random blocks of their "
                             "layout), each gathered into float16, float32 and bfloat16 against the dense float16 "
                             "gather and the numpy reference (batches: --batch, default 64,1024,8192,65536; uniform "
                             "ids). A quantized --table (a .gguf file) is measured this way by itself")
    parser.add_argument("--thresholds", type=_path,
                        help="gate thresholds (TOML; default: the thresholds.toml shipped with fastembed.benchmark)")
    arguments = parser.parse_args(argv)
    shaped = [flag for flag, value in (("--vocab-size", arguments.vocab_size), ("--dim", arguments.dim),
                                       ("--dtype", arguments.dtype)) if value is not None]
    if arguments.table is not None and shaped:
        parser.error(f"{shaped[0]} shapes the random table; --table measures the table in the file as it is")
    for name, default in RANDOM_TABLE.items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, default)
    if arguments.quick and arguments.reps and (arguments.batch or arguments.format) and not arguments.ranks:
        parser.error("--quick chooses fewer repetitions (and, in the main run, fewer batch sizes); with --reps "
                     "and those given it has no effect: leave --quick out")
    if arguments.tensor is not None and arguments.table is None:
        parser.error("--tensor names a tensor of a safetensors or GGUF file given with --table")
    if arguments.gate and arguments.backend:
        parser.error("--gate measures what its checks name (every backend it compares); --backend goes without --gate")
    if arguments.backend and arguments.device == "cuda":
        parser.error("--backend chooses the host's backends; --device cuda measures the GPU's alone (leave one out)")
    if arguments.gate and arguments.device == "cuda":
        # The gate judges host rows only (gate.judge): a GPU gate would silently measure the CPU.
        parser.error("--gate checks the host only; --device cuda has no gate thresholds (run without --gate)")
    if arguments.thresholds is not None and not arguments.gate:
        parser.error("--thresholds goes with --gate")
    if arguments.load and not arguments.processes:
        parser.error("--load goes with --processes")
    if arguments.processes and (arguments.gate or arguments.device == "cuda"):
        parser.error("--processes measures the host's lookups on their own: not with --gate or --device cuda")
    if arguments.ranks and (arguments.gate or arguments.processes or arguments.device == "cuda"):
        parser.error("--ranks measures the host's lookups on a gloo group: not with --gate, --processes or --device cuda")
    if arguments.format and (arguments.gate or arguments.processes or arguments.ranks or arguments.device == "cuda"):
        parser.error("--format measures the host's quantized lookups on their own: not with --gate, --processes, "
                     "--ranks or --device cuda")
    if arguments.cold and (arguments.gate or arguments.processes or arguments.ranks or arguments.format):
        parser.error("--cold times the main benchmark's calls one by one: not with --gate, --processes, --ranks or "
                     "--format")
    if arguments.cold and arguments.device == "cuda":
        parser.error("--cold evicts the host's caches before each call, not a GPU's: not with --device cuda "
                     "(with --device auto it measures the host alone)")
    problem = _ignored_option(arguments)
    if problem:
        parser.error(problem)
    if arguments.table is None:
        from fastembed.tables import resolve_dtype

        table_bytes = arguments.vocab_size * arguments.dim * resolve_dtype(arguments.dtype).itemsize
        if table_bytes > _physical_memory():
            parser.error(f"a {arguments.vocab_size} x {arguments.dim} {arguments.dtype} table takes "
                         f"{table_bytes / 2**30:.1f} GiB, more than this machine's memory")
        if arguments.format:
            problem = quantizing_problem(arguments.format, arguments.dim, resolve_dtype(arguments.dtype))
            if problem:
                parser.error(problem)
    problem = None if arguments.device == "cuda" else _unusable_backend(arguments.backend) or _setting_problem()
    if problem:
        parser.error(problem)
    if arguments.ranks and importlib.util.find_spec("torch") is None:
        parser.error("--ranks needs torch: pip install 'fastembed-gather[distributed]'")
    if arguments.ranks and arguments.ranks > max_ranks():
        parser.error(f"--ranks: at most {max_ranks()} here ({RANKS_PER_CORE} per core this process may use): the "
                     "ranks run at once, each an interpreter with torch and numba of its own")
    missing = [package for package in ("ml_dtypes", "gguf") if importlib.util.find_spec(package) is None]
    if arguments.format and missing:
        parser.error(f"--format needs {' and '.join(missing)} (bfloat16 outputs; the numpy reference is "
                     "gguf.quants.dequantize): pip install 'fastembed-gather[gguf]'")
    arguments.checks, arguments.gate_repetitions = None, None
    if arguments.gate:
        from .gate import load_checks

        try:
            arguments.checks, arguments.gate_repetitions = load_checks(arguments.thresholds)
        except ValueError as error:
            parser.error(str(error))
    if arguments.table is None:
        from fastembed.tables import resolve_dtype

        itemsize = resolve_dtype(arguments.dtype).itemsize
        problem = memory_problem(arguments, (arguments.vocab_size, arguments.dim), itemsize,
                                 arguments.vocab_size * arguments.dim * itemsize)
        if problem:
            parser.error(problem)
    problem = _unwritable(arguments.out, _result_files(arguments))
    if problem:
        parser.error(f"--out {arguments.out}: {problem}")
    return arguments


def memory_problem(arguments: argparse.Namespace, shape: tuple[int, int], itemsize: int,
                   table_bytes: int) -> str | None:
    """Why the host's run on a table of `shape` would not fit in this machine's memory (None: it would, or the GPU runs).

    Counted: the table (`table_bytes`: 0 for a mapped one, whose pages the
    system can drop), the outputs of the largest batch that the contenders
    hold (:data:`OUTPUTS_HELD`), and each batch's id sets
    (:func:`.measure.id_pool_bytes`); for --format, what :func:`.quantized.held_bytes` counts.
    """
    if arguments.device == "cuda":
        return None  # a GPU run holds its outputs on the device
    row_bytes = shape[1] * itemsize
    if arguments.format:
        return formats_problem(arguments, list(arguments.format), shape, table_bytes)
    if arguments.processes or arguments.ranks:
        return _few_outputs_problem(arguments, row_bytes, table_bytes)
    from .contenders import known_host_contender_ids
    from .measure import id_pool_bytes

    if arguments.gate:
        batches = [check.batch for check in arguments.checks or []] or [1]
        repetitions = arguments.reps or arguments.gate_repetitions or 1  # as the gate runs them
    else:
        batches = arguments.batch or list(QUICK_BATCHES if arguments.quick else BATCHES)
        repetitions = arguments.reps or (5 if arguments.quick else 15)
    contenders = len(known_host_contender_ids())  # every contender a host run may measure: at most what it draws
    needs = {batch: (OUTPUTS_HELD * batch * row_bytes, id_pool_bytes(batch, row_bytes, repetitions, shape[0], contenders))
             for batch in batches}
    batch = max(needs, key=lambda size: sum(needs[size]))
    outputs, ids = needs[batch]
    if table_bytes + outputs + ids <= _physical_memory():
        return None
    return (f"{batch} rows of {row_bytes} bytes: the contenders' outputs ({outputs / 2**30:.1f} GiB) and the id sets "
            f"of {repetitions} repetitions ({ids / 2**30:.1f} GiB) beside the table ({table_bytes / 2**30:.1f} GiB) "
            "take more than this machine's memory: ask for fewer --batch rows or --reps")


def formats_problem(arguments: argparse.Namespace, names: list[str], shape: tuple[int, int],
                    dense_bytes: int) -> str | None:
    """Why the --format run would not fit in memory: the dense table in memory (`dense_bytes`: 0 when mapped), the
    tables of formats `names` made from it, and the outputs of the largest batch (:func:`.quantized.held_bytes`)."""
    from .quantized import BATCHES as FORMAT_BATCHES
    from .quantized import held_bytes

    largest = max(arguments.batch or FORMAT_BATCHES)
    held = held_bytes(names, shape, largest)
    if dense_bytes + held <= _physical_memory():
        return None
    made = f"the {', '.join(names)} tables and " if names else ""
    return (f"{largest} ids of {shape[1]} values: {made}the outputs ({held / 2**30:.1f} GiB) beside the dense table "
            f"({dense_bytes / 2**30:.1f} GiB) take more than this machine's memory: ask for fewer --batch rows"
            f"{' or formats' if len(names) > 1 else ''}")


def _few_outputs_problem(arguments: argparse.Namespace, row_bytes: int, table_bytes: int) -> str | None:
    """Why the outputs of --batch that --processes or --ranks hold at the least would not fit beside the table.

    Those modes hold a few outputs at a time (their default batches fit any
    machine that holds the table): at the least one of the largest batch,
    and one per rank and one for the single process for --ranks.
    """
    if not arguments.batch:
        return None
    largest = max(arguments.batch)
    count = arguments.ranks + 1 if arguments.ranks else 1
    outputs = count * largest * row_bytes
    if table_bytes + outputs <= _physical_memory():
        return None
    return (f"{largest} rows of {row_bytes} bytes: {'the outputs' if count > 1 else 'one output'} of that batch "
            f"({outputs / 2**30:.1f} GiB) beside the table ({table_bytes / 2**30:.1f} GiB) take more than this "
            "machine's memory: ask for fewer --batch rows")


def dense_twin_bytes(shape: tuple[int, ...]) -> int:
    """The bytes of the dense float16 table of `shape` that a quantized --table is compared with."""
    return shape[0] * shape[1] * 2


def dense_twin_problem(shape: tuple[int, ...]) -> str | None:
    """Why the dense float16 table a quantized --table is compared with would not fit in memory (None: it would)."""
    dense_bytes = dense_twin_bytes(shape)
    if dense_bytes <= _physical_memory():
        return None
    return (f"the dense float16 table of {shape[0]} x {shape[1]} that a quantized table is compared with takes "
            f"{dense_bytes / 2**30:.1f} GiB, more than this machine's memory")


#: The options each measuring mode honours beside --out and the table's; the main run honours them all.
_MODE_OPTIONS = {"--gate": ("--reps",), "--processes": ("--batch", "--reps", "--load"),
                 "--ranks": ("--batch", "--reps", "--quick"), "--format": ("--batch", "--reps", "--quick")}


def _ignored_option(arguments: argparse.Namespace) -> str | None:
    """An option the chosen mode would ignore (--dist with --processes, say), so that no run reports a choice it
    did not make; None when every option given is used."""
    modes = {"--gate": arguments.gate, "--processes": arguments.processes, "--ranks": arguments.ranks,
             "--format": arguments.format}
    mode = next((flag for flag, chosen in modes.items() if chosen), None)
    if mode is None:
        return None
    given = {"--backend": arguments.backend, "--dist": arguments.dist, "--batch": arguments.batch,
             "--quick": arguments.quick}
    ignored = [flag for flag, value in given.items() if value and flag not in _MODE_OPTIONS[mode]]
    if ignored:
        return f"{ignored[0]} has no effect with {mode}, which takes only {', '.join(_MODE_OPTIONS[mode])}: leave {ignored[0]} out"
    return None


def _path(text: str) -> Path:
    """A path argument; an empty one (an unset shell variable, say) is refused rather than read as the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _repetitions(text: str) -> int:
    from .measure import MAX_REPS

    value = _positive_int(text)
    if value > MAX_REPS:
        raise argparse.ArgumentTypeError(f"at most {MAX_REPS} repetitions, got {value}")
    return value


def _batches(text: str) -> list[int]:
    values = [_positive_int(part.strip()) for part in text.split(",")]
    too_large = [value for value in values if value > MAX_BATCH]
    if too_large:
        raise argparse.ArgumentTypeError(f"{too_large[0]} is more than {MAX_BATCH} ids")
    return _once_each(values)


def _once_each(values: list[Any]) -> list[Any]:
    """`values`, refusing one given twice: the report pairs each case's samples by its values."""
    repeated = next((value for index, value in enumerate(values) if value in values[:index]), None)
    if repeated is not None:
        raise argparse.ArgumentTypeError(f"{repeated} is given twice")
    return values


def _choices(known: tuple[str, ...] | list[str]):
    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",")]
        unknown = [value for value in values if value not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r}; choose from {', '.join(known)}")
        return _once_each(values)

    return parse


def _format_names() -> list[str]:
    from fastembed.formats import FORMATS

    return list(FORMATS)


def measures_the_default_table(arguments: argparse.Namespace) -> bool:
    """Whether the run measures the default random table (its dtype in any spelling numpy reads)."""
    from fastembed.tables import resolve_dtype

    return (arguments.table is None and arguments.vocab_size == RANDOM_TABLE["vocab_size"]
            and arguments.dim == RANDOM_TABLE["dim"]
            and resolve_dtype(arguments.dtype) == resolve_dtype(RANDOM_TABLE["dtype"]))


def _dtype(text: str) -> str:
    from fastembed.tables import resolve_dtype

    try:
        dtype = resolve_dtype(text)
    except TypeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    problem = dtype_problem(dtype)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


#: ml_dtypes' dtypes the benchmark measures: torch has each by the same name (the torch contenders take them as words).
ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


#: Ranks per usable core that --ranks starts at most: beyond that the ranks only time-share the cores.
RANKS_PER_CORE = 4


def max_ranks() -> int:
    """The most ranks --ranks starts on this machine."""
    from .contenders import usable_cores

    return RANKS_PER_CORE * usable_cores()


def dtype_problem(dtype: Any) -> str | None:
    """Why the benchmark cannot measure a dense table of `dtype`, or None when it can."""
    from fastembed.tables import is_ml_dtype

    if is_ml_dtype(dtype):
        return None if dtype.name in ML_DTYPES else f"{dtype.name}: of ml_dtypes' dtypes only {', '.join(ML_DTYPES)} are measured"
    if dtype.kind not in "biufc" or dtype.char in "gG":  # g, G: long double, which torch and cupy lack
        return (f"{dtype}: the benchmark measures tables of bool, integers, floats up to float64, complex up to "
                f"complex128 and {', '.join(ML_DTYPES)}")
    if not dtype.isnative:
        return f"{dtype.str}: not this machine's byte order, which the other contenders need"
    return None


def quantizing_problem(formats: list[str], dim: int, dtype: Any) -> str | None:
    """Why --format cannot make its tables from a dense table of width `dim` and `dtype`, or None when it can."""
    import numpy as np

    from fastembed.formats import FORMATS
    from fastembed.tables import is_float_dtype

    if not is_float_dtype(dtype):
        return f"--format quantizes a float table, not {dtype}"
    if dtype != np.float16:
        # The dense row is the table's own gather: only a float16 table gives the baseline the goals name.
        return (f"--format compares each format with the dense float16 gather, and the table is {dtype}: "
                "use --dtype float16 (or a float16 --table)")
    misfits = [name for name in formats if dim % FORMATS[name].block_values]
    if misfits:
        block = FORMATS[misfits[0]].block_values
        return f"--format {misfits[0]}: a row of {dim} values is not a whole number of its {block}-value blocks"
    return None


def _setting_problem() -> str | None:
    """Why FASTEMBED_BACKEND (read when fastembed was imported) cannot serve the host's lookups, or
    FASTEMBED_OUTPUT_CACHE_BYTES is no byte count (the first large allocating lookup would raise); None when both can."""
    import numpy as np

    from fastembed import BackendUnavailableError, dispatch
    from fastembed.backends import output_cache

    try:
        dispatch.select(np.empty((1, 1), np.float16))
        output_cache.limit()
    except (ValueError, BackendUnavailableError) as error:
        return str(error)
    return None


def _unusable_backend(requested: list[str] | None) -> str | None:
    """Why a host backend given with --backend cannot run, found by loading each one's library now.

    A backend whose package is installed but does not load (a broken numba)
    counts as available until its first large lookup loads it; loading here
    makes the contenders, and a FASTEMBED_BACKEND naming it, see the truth
    before anything is measured. None when every backend asked for runs.
    """
    from fastembed.dispatch import BACKENDS, backend_statuses

    from .contenders import host_backends

    served = host_backends()
    for status in backend_statuses():
        if status.available and status.name in served:
            BACKENDS[status.name].describe()  # a library that fails to load makes the dispatcher choose again
    reasons = {status.name: status.reasons for status in backend_statuses() if not status.available}
    refused = [name for name in requested or () if name in reasons]
    if refused:
        return f"--backend {refused[0]} cannot run here: {'; '.join(reasons[refused[0]])}"
    return None


def _physical_memory() -> int:
    from .report import physical_memory

    return physical_memory() or 2**62  # unknown: numpy's own MemoryError is the limit


#: The files a run writes into --out (a plot per device: throughput.png for the host, throughput-cuda.png).
RESULT_FILES = ("results.json", "results.md", "processes.json", "quantized.json", "ranks.json", "gate.json",
                "throughput.png", "throughput-cuda.png")


def _result_files(arguments: argparse.Namespace) -> tuple[str, ...]:
    """The files the run `arguments` ask for writes into --out (a main run's --table may turn out quantized)."""
    for flag, name in (("gate", "gate.json"), ("processes", "processes.json"), ("ranks", "ranks.json"),
                       ("format", "quantized.json")):
        if getattr(arguments, flag):
            return (name,)
    return ("results.json", "results.md", "throughput.png", "throughput-cuda.png", "quantized.json")


def _unwritable(folder: Path, names: tuple[str, ...] = RESULT_FILES) -> str | None:
    """Why results cannot be written into `folder` (created if missing) as the files `names`, or None when they can.

    A result file already there (or a link by its name) must open for
    writing, and its folder (a link's target's) be writable, where its new
    version is made before it replaces the file: it is opened without being
    created or truncated, so the check changes nothing; a link to a file not
    made yet must lead into a folder that can be written.
    """
    try:
        if folder.exists() and not folder.is_dir():
            return "is a file, not a folder for the results"
        taken = [name for name in names if (folder / name).is_dir()]
    except OSError as error:  # a name too long, say
        return f"cannot write results there: {error.strerror or error}"
    if taken:
        return f"{folder / taken[0]} is a directory, where a result file goes"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".fastembed-bench-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return f"cannot write results there: {error.strerror or error}"
    for name in names:
        path = folder / name
        if not path.is_symlink() and not path.exists():
            continue
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))  # a FIFO without a reader: ENXIO, no wait
            target = path.resolve()
            if target.is_file() and not os.access(target.parent, os.W_OK | os.X_OK):
                return f"cannot write {path}: its folder {target.parent} cannot be written, where its new version is made"
        except FileNotFoundError:
            target = path.parent / os.readlink(path)  # a link to a file not made yet: writing makes it
            if not (target.parent.is_dir() and os.access(target.parent, os.W_OK)):
                return f"cannot write {path}: a link to {target}, whose folder is missing or cannot be written"
        except OSError as error:
            return f"cannot write {path}: {error.strerror or error}"
    return None
