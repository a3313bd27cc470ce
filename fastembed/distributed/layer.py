"""The vocabulary-parallel layer: :class:`VocabParallelEmbedding` and the steps of its calls (see the package)."""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import dispatch, validate
from ..api import Embedding, lookup
from ..arrays import result_like, torch_adapter
from ..backends import output_cache
from ..backends.cuda_backend import deferred_id_checks
from ..formats import QuantizedTable
from . import board, segments
from .agreement import CommunicationError, fingerprint
from .collectives import FORKED, Collectives, board_of
from .layout import checked_pad, padded_vocab_size, position_range, row_range
from .segments import SHM_FOLDER, SharedBuffers
from .shards import carrier, check_transport, open_shard, shard_device, table_kind

MODES = ("full", "scatter")
#: What ``exchange=`` takes: ``"auto"`` is shared memory when every rank runs on this host, else the all-reduce.
EXCHANGES = ("auto", "shared_memory", "all_reduce")
#: The range of ``timeout=`` in seconds: torch waits whole milliseconds (0 means no limit), and a year is plenty.
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.001, 365 * 24 * 3600.0
TORCH_NEEDED = "fastembed.distributed needs torch 2.13 or later (the release it is tested with): pip install 'fastembed-gather[distributed]'"
_TWO_THREADS = ("layers of one process group were called or built from two threads of one rank at once; their calls "
                "are collectives, one at a time in the same order on every rank")
#: Each process group's lock on this rank (weakly: it goes with the group), shared by the group's layers.
_GROUP_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
#: Integer views for the SUM collectives, widest first. No int16: neither gloo nor NCCL sums it.
_WORDS = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8))


class LookupTimings(NamedTuple):
    """Where one call's time went on this rank, in seconds, the bytes it put into the exchange, and which exchange.

    ``gather_s``: this rank's rows, into the exchange's buffer. ``agree_s``: the
    agreement, including the wait for the slowest rank (with shared memory it
    is also the barrier after every rank's writes). ``communicate_s``: the data
    collective (the all-reduce; with shared memory, only a call that had to
    grow the segment spends time here). ``copy_s``: copying the rows this rank
    returns out of the exchanged buffer (all-reduce ``full``: none, the buffer
    is the result). ``payload_bytes``: the whole buffer for the all-reduce;
    for shared memory, the rows this rank writes into the segment (its own
    rows; in ``scatter`` of a dense table, only those other ranks return).
    ``gather_s`` of such a ``scatter`` includes placing this rank's rows into
    its own result, and ``copy_s`` copies out only the rows other ranks own.
    On a GPU shard the seconds are the host's: kernels and NCCL collectives
    run asynchronously, so a step's device time shows in the first later
    step that waits for it.
    """

    prepare_s: float
    gather_s: float
    agree_s: float
    communicate_s: float
    payload_bytes: int
    copy_s: float
    exchange: str


class VocabParallelEmbedding:
    """An embedding table split by rows over the ranks of a torch.distributed process group.

    Building one is a collective: every rank of the group builds it, with the
    same table (shape, dtype) and `pad_to_multiple`; a rank that cannot open
    its source makes every rank raise that rank's error. Calls are collectives
    too: every rank calls with the same ids and mode, one call at a time, in
    the same order as the group's other collectives.

    Args:
        source: a checkpoint path, as for :meth:`fastembed.Embedding.from_pretrained`
            (each rank memory-maps only its rows' bytes, and a quantized table's
            row scales; with ``device="cuda:N"`` it then copies them to that GPU),
            or a table: a host table (numpy array, np.memmap, torch CPU tensor)
            or a torch CUDA tensor, or a :class:`~fastembed.formats.QuantizedTable`
            of them. Each rank keeps a view of its rows, on the table's device;
            the array stays as big as the caller keeps it. cupy arrays are not
            served: ``torch.from_dlpack(table)`` is a torch tensor over their memory.
        group: the process group (default: the default group). Its backend
            must carry the shard's tensors: gloo (host and GPU tables),
            ``"cpu:gloo,cuda:nccl"`` (both), or NCCL alone (GPU tables only).
        name: the tensor in a checkpoint (None: the token embedding, by name); the
            same on every rank (None and the name it picks count as different).
        pad_to_multiple: pad the vocabulary to a multiple of this before
            splitting (:func:`row_range`); padded rows do not exist.
        timeout: seconds (1 ms to a year) each collective may take before
            this rank raises :class:`CommunicationError`, building the layer
            included; None waits as long as the group's own timeout
            (``init_process_group(timeout=...)``, which also bounds the gloo
            transfer itself).
        exchange: how the ranks combine their rows. ``"shared_memory"``: each
            rank writes its rows into a segment in /dev/shm that every rank
            maps, and copies out what it returns; needs every rank on this
            host (same hostname, boot and user, one /dev/shm). ``"all_reduce"``:
            the integer all-reduce over the group. ``"auto"`` (default): shared
            memory when there are two ranks or more and all run on one host,
            else the all-reduce; where a segment cannot be made (a /dev/shm too
            small for a batch), those calls use the all-reduce, with a warning.
            :attr:`exchange` says which was chosen; docs/distributed.md, "Shared
            memory", has the memory it takes. GPU tables always use the
            all-reduce (``"auto"``), and refuse ``"shared_memory"``.
        device: where a checkpoint's rows go: None or ``"cpu"`` (mapped host
            memory), ``"cuda"`` (torch's current GPU) or ``"cuda:N"``: each rank
            maps its rows, then copies only them to that GPU (the one copy, to
            the device; nothing stays mapped). A table stays where it is: None,
            or its own device.

    Raises:
        ImportError: torch is not installed.
        RuntimeError: no process group is initialised; another thread of this rank
            is calling or building a layer of the same group (on this rank only,
            before any collective); this process is a forked child of a rank
            whose group agrees through a board.
        ValueError: this process is not in `group`; a host table on a group
            without CPU transport (NCCL alone: on every rank, through the agreement on
            torch's current GPU; on that rank only, before any collective, where torch
            sees no GPU); ranks that opened tables of different
            shapes or dtypes, on the host and on GPUs, or asked for different names or exchanges (the
            values themselves are not compared); ``pad_to_multiple`` not from 1 to 2**62,
            ``timeout`` outside 1 ms to a year; `name` with an array; ``exchange="shared_memory"``
            on ranks that do not all run on one host with a usable /dev/shm, or
            with a GPU table; a `device` that is not the host or a visible GPU,
            or, for a table, not its own.
        TypeError: a table on a GPU that is not a torch CUDA tensor (a cupy
            array), or on another kind of device; a torch CUDA table without cupy
            (fastembed's GPU gather); a ``pad_to_multiple`` that is not an
            integer, a ``timeout`` that is not a number.
        FileNotFoundError, ValueError, TypeError: as the loaders, for a path
            source (raised on every rank when any rank's open failed).
        CommunicationError: a rank died or did not build it within `timeout`.

    On a GPU shard the collectives carry CUDA tensors of its device over the
    group's GPU backend (on a group of NCCL alone the agreements do too), and
    `timeout` bounds them as ``Work.wait(timeout)`` does: it blocks this rank
    until the collective completes, and when it does not in time, torch aborts
    the communicator; the layer raises :class:`CommunicationError` as for gloo.

    Shape:
        ``emb(ids)``: ``ids.shape + (dim,)``; ``emb(ids, mode="scatter")``:
        ``(stop - start,) + ids.shape[1:] + (dim,)`` with ``(start, stop) =
        position_range(ids.shape[0], world_size, rank)``. The table's dtype, or
        ``dtype=`` (a quantized table: float32 unless ``dtype=`` says otherwise).

    Attributes:
        rank, world_size: this rank and the group's size.
        vocab_start, vocab_end: the rows this rank owns, ``[vocab_start, vocab_end)``
            in the padded vocabulary (:func:`row_range`).
        device: where this rank's rows are (``"cpu"`` or ``"cuda:N"``).
        exchange: ``"shared_memory"`` or ``"all_reduce"``, as chosen at construction.
        last_timings: the last call's :class:`LookupTimings` (None before the first call).

    Example (a group of one rank, so that it runs in one process):
        >>> import os, shutil, tempfile, numpy as np, torch.distributed as dist
        >>> from fastembed.distributed import VocabParallelEmbedding
        >>> folder = tempfile.mkdtemp()
        >>> rendezvous = "file://" + os.path.join(folder, "rendezvous")
        >>> dist.init_process_group("gloo", init_method=rendezvous, rank=0, world_size=1)
        >>> emb = VocabParallelEmbedding(np.arange(12, dtype=np.float32).reshape(4, 3))
        >>> emb([3, 0])
        array([[ 9., 10., 11.],
               [ 0.,  1.,  2.]], dtype=float32)
        >>> emb.vocab_start, emb.vocab_end, emb.exchange
        (0, 4, 'all_reduce')
        >>> dist.destroy_process_group()
        >>> shutil.rmtree(folder)

    Run by every rank of a group, after ``torch.distributed.init_process_group("gloo")``
    (docs/distributed.md has complete scripts)::

        emb = VocabParallelEmbedding("path/to/checkpoint", timeout=60)
        rows = emb(torch.tensor([[5, 9, 2]]))              # (1, 3, dim) on every rank
        mine = emb(torch.arange(8), mode="scatter")        # (stop - start, dim): position_range(8, world_size, rank)

    On GPUs, after ``init_process_group("nccl")`` and ``torch.cuda.set_device(local_rank)``::

        emb = VocabParallelEmbedding("path/to/checkpoint", device="cuda", timeout=60)
        rows = emb(torch.tensor([[5, 9, 2]], device="cuda"))  # a torch CUDA tensor on every rank's GPU
    """

    def __init__(self, source: Any, *, group: Any = None, name: str | None = None, pad_to_multiple: int = 1,
                 timeout: float | None = None, exchange: str = "auto", device: Any = None) -> None:
        torch, dist = _torch_distributed()
        if not dist.is_initialized():
            raise RuntimeError("VocabParallelEmbedding needs a process group: call "
                               "torch.distributed.init_process_group('gloo', ...) first (docs/distributed.md)")
        self._torch, self._dist, self._group = torch, dist, group
        # The default group weakly: destroyed meanwhile, it must be freed then, not at interpreter exit.
        self._built_on: Callable[[], Any] = (lambda: group) if group is not None else _weak_world(dist)
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of `group`")
        backend = str(dist.get_backend(group))
        carriers = {kind: carrier(backend, kind, dist.Backend.backend_capability) for kind in ("cpu", "cuda")}
        if not any(carriers.values()):
            raise ValueError(f"VocabParallelEmbedding needs a group that carries CPU or CUDA tensors, not {backend!r}")
        board_of(self._built_on())  # a forked child of a rank whose group has a board: RuntimeError, before anything else
        # One call or build of the group's layers at a time on this rank: their collectives pair up in order.
        self._calling = _group_lock(self._built_on())
        if self._calling.locked():
            raise RuntimeError(_TWO_THREADS)
        with self._calling:  # a with statement only: a KeyboardInterrupt cannot leave it taken
            self._build(source, name, pad_to_multiple, timeout, exchange, device, backend, carriers)

    def _build(self, source: Any, name: str | None, pad_to_multiple: int, timeout: float | None, exchange: str,
               device: Any, backend: str, carriers: dict[str, str | None]) -> None:
        """:meth:`__init__`'s collective part, under the group's lock."""
        self._pid = os.getpid()
        timeout_s: float | None = None
        self.last_timings: LookupTimings | None = None
        shard, error, placement, pad = None, None, None, 1
        try:
            timeout_s = _checked_timeout(timeout)  # first: it bounds the agreement below whatever fails next
            pad = checked_pad(pad_to_multiple)
            if exchange not in EXCHANGES:
                raise ValueError(f"exchange must be 'auto', 'shared_memory' or 'all_reduce', got {exchange!r}")
            placement = shard_device(source, device)
            check_transport(backend, carriers, placement)
            if placement != "cpu" and exchange == "shared_memory":
                raise ValueError("exchange='shared_memory' serves host tables; a GPU table's ranks use the all-reduce")
            shard = open_shard(source, name, pad, self.rank, self.world_size, placement)
        except Exception as caught:
            error = caught
        if carriers["cpu"] is not None:
            wire = "cpu"  # the agreements' small tensors
        elif placement not in (None, "cpu"):
            wire = str(placement)
        elif self._torch.cuda.device_count():  # a build that failed off the GPU still shares its error over NCCL
            wire = f"cuda:{self._torch.cuda.current_device()}"
        else:
            assert error is not None  # check_transport's: raised on this rank alone, as no agreement can run
            try:
                raise error
            finally:
                error = None  # else this frame and the error's traceback hold each other (see _call)
        self._collectives = Collectives(self._torch, self._dist, self._group, self._built_on, timeout_s, wire)
        where = "" if placement is None else " on the host" if placement == "cpu" else " on a GPU"
        described = "" if shard is None else (
            f"a {shard.vocab_size} x {shard.rows.shape[1]} {table_kind(shard.rows)} table{where}, "
            f"name={name!r}, pad_to_multiple={pad}, exchange={exchange!r}")
        try:
            self._collectives.agree(error, fingerprint(described.encode("utf-8", "backslashreplace")),
                                    lambda: described, "the table",
                                    "every rank must open a table of the same shape and dtype, with the same name, "
                                    "pad_to_multiple and exchange")
        finally:
            error = None  # see _call
        assert shard is not None  # the agreement raised otherwise
        self._shard = shard
        self.vocab_size: int = shard.vocab_size
        self.padded_vocab_size: int = padded_vocab_size(shard.vocab_size, pad)
        self.vocab_start, self.vocab_end = row_range(shard.vocab_size, self.world_size, self.rank, pad)
        rows = shard.rows
        #: Where this rank's rows live, and its results: ``"cpu"`` or ``"cuda:N"``.
        self.device: str = str(placement)
        self._on_device = self.device != "cpu"
        # NCCL reduces and scatters in one collective; gloo's reduce-scatter is an all-reduce of a copy.
        self._reduce_scatters = self._on_device and carriers["cuda"] == "nccl"
        self._stored = int(rows.shape[0])
        self._dim = int(rows.shape[1])
        self._quantized = isinstance(rows, QuantizedTable)
        self._view = validate.table_snapshot(rows)
        # What results without dtype= are gathered as: float32 for a quantized table, uint16 words for a GPU bfloat16.
        self._dtype = validate.output_dtype(self._view, None)
        # A dense host table's rows, which the shared-memory exchange also places straight into a scatter's result.
        self._host_rows = None if self._quantized or self._on_device else rows.view(np.ndarray)
        self._local = Embedding(rows if self._host_rows is None else self._host_rows) if self._stored else None
        self._phantom = np.empty((self.vocab_size, 0), np.uint8)  # ids are checked against the whole vocabulary
        # The first row of every rank but the first: searchsorted over them names each id's owner.
        self._bounds = np.array([row_range(self.vocab_size, self.world_size, rank, pad)[0]
                                 for rank in range(1, self.world_size)], np.int64)
        self.exchange: str = self._choose_exchange(exchange)
        self._shared = SharedBuffers(self._collectives, self._key, required=exchange == "shared_memory")

    @property
    def shard(self) -> Any:
        """This rank's stored rows ``table[vocab_start:min(vocab_end, vocab_size)]``.

        A torch tensor for a torch table (on its GPU for a GPU table, a view of
        the caller's tensor; for a checkpoint with ``device="cuda:N"``, the copy
        on that GPU); a :class:`~fastembed.formats.QuantizedTable` of this rank's
        rows (and row scales) for a quantized table; else a numpy view of the
        rows (a numpy or JAX table, another library's DLPack export, a checkpoint).
        """
        like = self._shard.like
        return like if like is not None and not self._quantized and torch_adapter.ADAPTER.owns(like) else self._shard.rows

    @property
    def agreement(self) -> str:
        """How the ranks agree at every call: ``"shared_memory"`` or ``"group"``.

        ``"shared_memory"``: a board in /dev/shm that every layer of the group
        shares, where two ranks or more run on one x86-64 Linux host and the
        group carries CPU tensors; ``"group"``: an all-gather over the process
        group (elsewhere, in a group of one rank, or where the board could not
        be made: the next layer built on the group tries again).
        """
        return "group" if self._collectives.held_board() is None else "shared_memory"

    @property
    def format(self) -> str:
        """``"dense"``, or the block format of a quantized table (``"q8_0"``), as :attr:`fastembed.Embedding.format`."""
        return self._shard.rows.format.name if self._quantized else "dense"

    @property
    def dim(self) -> int:
        """Values per row."""
        return self._dim

    @property
    def dtype(self) -> np.dtype:
        """The dtype of results without ``dtype=``: the table's (bfloat16 and float8 via ml_dtypes), float32 for a quantized table."""
        return validate.table_dtype(self._view, self._shard.like)

    def check_file(self) -> None:
        """Raise if the file behind this rank's mapped rows shrank or was modified in place since it was opened.

        Local to this rank (no collective); see :meth:`fastembed.Embedding.check_file`.

        Raises:
            fastembed.io.FileChangedError: the file changed.
            ValueError: this rank's rows are not memory-mapped from a file (an array
                source, or a checkpoint copied to a GPU).
        """
        if self._shard.watch is None:
            raise ValueError("this rank's rows are not memory-mapped from a file (an array source, or a checkpoint "
                             "copied to a GPU): there is no file to check")
        self._shard.watch.check()

    def __copy__(self) -> VocabParallelEmbedding:
        raise TypeError(_NOT_COPIED)

    def __deepcopy__(self, memo: dict) -> VocabParallelEmbedding:
        raise TypeError(_NOT_COPIED)

    def __reduce__(self) -> Any:
        raise TypeError(_NOT_COPIED)

    def __repr__(self) -> str:
        kind = f"format={self.format!r}" if self._quantized else f"dtype={self.dtype}"
        return (f"VocabParallelEmbedding(vocab_size={self.vocab_size}, dim={self._dim}, {kind}, "
                f"rank={self.rank}, world_size={self.world_size}, rows={self.vocab_start}..{self.vocab_end}, "
                f"device={self.device!r}, exchange={self.exchange!r})")

    def __call__(self, ids: Any, mode: str = "full", *unexpected: Any, dtype: Any = None, **unknown: Any) -> Any:
        """``table[ids]`` on every rank (``mode="full"``), or this rank's slice of the positions (``"scatter"``).

        Every rank must call with the same ids (same shape and values; their
        integer dtype may differ), the same mode and the same dtype.

        Args:
            ids: integers of any dtype and shape, as for :func:`fastembed.lookup`:
                on the host, or for a GPU shard on its device too (copied to the
                host, where every rank checks and fingerprints them).
            mode: ``"full"`` (every position) or ``"scatter"`` (this rank's part of
                the ids' first dimension, split by :func:`position_range`).
            dtype: the result's dtype, as for :func:`fastembed.lookup`: None is the
                table's dtype (float32 for a quantized table); a quantized table
                dequantizes into float32, float16 or bfloat16, a dense float table
                casts into those or float64 (rounding to nearest even).
            unexpected, unknown: none is taken; they are here so that a call with an
                argument the layer does not take (``out=``, say) raises its TypeError on
                every rank, as any other mistake of one rank's does.

        Returns:
            A new array of the table's kind (numpy, or torch for a torch table or
            a quantized table whose rows are a torch tensor); for a GPU shard, a
            torch tensor on its device, ordered on torch's current stream there.

        Raises:
            IndexError: an id outside ``[0, vocab_size)`` (padded rows included), with
                its position and value, raised on every rank.
            ValueError: ids, modes or dtypes that differ between ranks (naming each
                rank's), a bad mode, scalar ids with ``"scatter"``; raised on every rank.
            TypeError: ids that are not integers, or on another device than the
                table; a dtype the table cannot give (int8 from a quantized table,
                a cast of a dense GPU table); an argument the layer does not take
                (``out=``: the layer allocates its result); raised on every rank.
            CommunicationError: a rank died or did not call within `timeout`, or
                the layer's process group was destroyed since it was built
                (raised on this rank before any collective); or, in a group
                of more than one rank, an earlier call of this rank was
                interrupted (KeyboardInterrupt) once it had started, after
                which the ranks may be out of step (every later call raises
                it at once; the other ranks raise it within `timeout`).
            RuntimeError: another thread of this rank is calling or building a layer of
                the same process group (raised on this rank only, before any collective; a
                thread that comes in the very instant the other starts waits for its call
                instead); this process is a forked child of the rank that built the layer
                (raised before anything is written); on a GPU shard, a rank ran
                out of GPU memory for this call's buffers (raised on every rank, with
                torch's message).
            OSError, MemoryError: with ``exchange="shared_memory"``, the shared-memory
                segment a batch needs cannot be made or mapped (a full ``/dev/shm``, say);
                raised on every rank, and the group stays usable.
        """
        if os.getpid() != self._pid:
            raise RuntimeError(FORKED)
        collectives = self._collectives
        if collectives.broken is not None:
            raise CommunicationError(collectives.broken)
        if not collectives.group_exists():
            collectives.broken = (f"VocabParallelEmbedding: the process group it was built on no longer exists on "
                                  f"rank {self.rank} (destroy_process_group); build a new layer on a new group")
            raise CommunicationError(collectives.broken)
        if self._calling.locked():
            # Before any collective: the call already running keeps the ranks in step (two at once abort gloo).
            raise RuntimeError(_TWO_THREADS)
        # Taken by a with statement only, so that a KeyboardInterrupt cannot leave it taken; a thread that finds it
        # free in the instant another takes it waits for that call.
        with self._calling:
            try:
                return self._call(ids, mode, dtype, _refused(unexpected, unknown))
            except Exception:
                raise  # raised alike on every rank by an agreement, or after the last collective of the call
            except BaseException as interrupt:
                collectives.mark_interrupted(interrupt, "a call")
                raise

    def _call(self, ids: Any, mode: str, dtype: Any, refused: str | None) -> Any:
        """:meth:`__call__`, for the one thread calling; `refused` says why its arguments are refused, if they are."""
        started = time.perf_counter()
        error: Exception | None = None
        call: _Call | None = None
        try:
            if refused is not None:
                raise TypeError(refused)
            call = self._prepare(ids, mode, dtype)
        except Exception as caught:
            error = caught
        prepared = time.perf_counter()
        if call is not None:
            try:
                self._gather(call)
            except Exception as caught:
                error, call = caught, None
        gathered = time.perf_counter()
        description = "" if call is None else call.description
        try:
            self._collectives.agree(error, call.digest if call is not None else 0, lambda: description, "the ids",
                        "every rank must call the same layer with the same ids (same shape and values), mode and dtype")
        finally:
            # The error's traceback holds this frame, which would hold the error: a cycle that keeps the call's
            # buffers (and, while building, the process group) alive until a garbage collection.
            error = None
        assert call is not None  # the agreement raised otherwise
        agreed = time.perf_counter()
        result = self._communicate(call)
        self.last_timings = LookupTimings(prepared - started, gathered - prepared + call.late_gather_s,
                                          agreed - gathered, call.exchange_s, call.payload_bytes, call.copy_s,
                                          call.exchange)
        return result

    # -- the steps of a call ---------------------------------------------------------------------------------

    def _prepare(self, ids: Any, mode: str, dtype: Any) -> _Call:
        """Check the rows' memory, the ids and the dtype, copy the ids once as int64, fingerprint them."""
        for guard in self._shard.guards:
            guard.check()  # a torch table's storage resized in place since the layer was built: ValueError
        if mode not in MODES:
            raise ValueError(f"mode must be 'full' or 'scatter', got {mode!r}")
        target = validate.output_dtype(self._view, dtype, self._shard.like)
        view = validate.host_ids_snapshot(ids, self._phantom, self.device)
        shape = tuple(int(size) for size in view.shape)
        if mode == "scatter" and not shape:
            raise ValueError("mode='scatter' splits the ids' first dimension, and scalar ids have none")
        flat = np.asarray(view, dtype=np.int64).reshape(-1)  # the snapshot is this call's own copy
        validate.check_ids_in_range(flat.reshape(shape), self.vocab_size)
        # The layer's key (rank 0's, shared when the layer was built) tells ranks that call different layers apart.
        digest = fingerprint(self._key, mode.encode(), target.str.encode(), repr(shape).encode(), flat.data)
        description = (f"ids of shape {shape}, mode {mode!r}, dtype {target}, to layer {self._key.hex()}, "
                       f"values hashed to {digest & (2**64 - 1):016x}")
        row_bytes = self._dim * target.itemsize
        word = next(word for word in _WORDS if row_bytes % word.itemsize == 0)
        return _Call(mode, shape, flat, target, row_bytes, word, digest, description, self.exchange)

    def _gather(self, call: _Call) -> None:
        """This rank's rows into the exchange's buffer, before the agreement.

        Shared memory: into the buffer of this turn, when the segment is large
        enough (else after the agreement, once the ranks have grown it
        together). The all-reduce: a buffer of every position, zeros where
        another rank owns the row.
        """
        if call.exchange == "all_reduce":
            self._gather_masked(call)
            return
        buffer = self._shared.next_buffer(call.ids.size * call.row_bytes)
        if buffer is not None:
            # Two buffers make the agreement the only barrier a call needs: every rank reads this buffer after this
            # call's agreement, which no rank enters before its writes, and writes it again only after the next
            # call's agreement, which no rank enters before it has copied this call's rows out.
            # A failed agreement leaves this buffer half written, but no rank reads a buffer whose call failed, and
            # the next call that reads it has every one of its rows rewritten by their owners first.
            self._write_rows(call, buffer)

    def _gather_masked(self, call: _Call) -> None:
        """The all-reduce's buffer: this rank's rows at the positions it owns, zeros everywhere else."""
        local = call.ids
        call.payload_bytes = local.size * call.row_bytes
        np.subtract(local, self.vocab_start, out=local)  # local is this call's own copy
        outside = local.view(np.uint64) >= self._stored  # below the shard start wraps to huge: one comparison
        cast = call.dtype if self._quantized or call.dtype != self._dtype else None
        if self._on_device:
            self._gather_masked_on_device(call, local, outside, cast)
            return
        words = call.words = np.empty((local.size, call.row_bytes // call.word.itemsize), call.word)
        if not local.size:
            return
        if self._local is None or outside.all():
            words.fill(0)
            return
        local[outside] = 0
        self._local(local, out=_words_as(words, call.dtype), dtype=cast)
        words[outside] = 0

    def _gather_masked_on_device(self, call: _Call, local: np.ndarray, outside: np.ndarray, cast: Any) -> None:
        """:meth:`_gather_masked` on the shard's GPU: fastembed's gather of every position, then zeros where it must.

        The buffer is the gather's own result (a torch tensor, seen as integer
        words). A rank that stores rows gathers even when it owns none of the
        ids, so that a ``dtype=`` the GPU cannot give fails alike on every rank.
        For ``"scatter"`` over NCCL it also allocates the reduce-scatter's
        output, so that every allocation of the call (the one most likely to
        run out of GPU memory included) comes before the agreement, which
        shares its failure with every rank.
        """
        torch = self._torch
        word = getattr(torch, call.word.name)
        row_words = call.row_bytes // call.word.itemsize
        if self._local is None:  # a rank of padded rows only
            words = call.words = self._shard.like.new_zeros((local.size, row_words), dtype=word)
        else:
            local[outside] = 0
            with deferred_id_checks():  # the ids were checked on the host: skip the backend's synchronising re-check
                rows = self._local(local, dtype=cast)
            words = call.words = rows.view(word)
            if outside.any():
                words.index_fill_(0, torch_adapter.ADAPTER.from_host(np.flatnonzero(outside), self.device), 0)
        if call.mode == "scatter" and self._reduce_scatters:
            start, stop = position_range(call.shape[0], self.world_size, self.rank)
            call.scattered = words.new_empty(((stop - start) * math.prod(call.shape[1:]), row_words))

    def _write_rows(self, call: _Call, buffer: np.ndarray) -> None:
        """This rank's rows, gathered straight into `buffer`: the ranks' rows lie in rank order, each in position order.

        Every rank computes the same layout from the (agreed) ids, so each
        knows where every position's row lies (``call.slots``) and writes only
        its own rows, with one contiguous lookup.
        """
        owners = np.searchsorted(self._bounds, call.ids, side="right")
        counts = np.bincount(owners, minlength=self.world_size)
        keys = owners.astype(np.uint16) if self.world_size <= 2**16 else owners
        order = np.argsort(keys, kind="stable")  # 16-bit keys sort by radix: linear in the ids
        slots = np.empty(order.size, np.intp)
        slots[order] = np.arange(order.size)
        call.slots = slots
        first = int(counts[: self.rank].sum())
        count = int(counts[self.rank])
        mine = order[first: first + count]  # the positions whose rows this rank owns, in order
        if call.mode == "scatter" and self._host_rows is not None and call.dtype == self._dtype:
            call.owners = owners
            self._place_own_rows(call, buffer, mine)
            return
        call.payload_bytes = count * call.row_bytes
        if not count:
            return
        assert self._local is not None  # a rank owning an id stores rows
        region = buffer[first * call.row_bytes: (first + count) * call.row_bytes]
        cast = call.dtype if self._quantized or call.dtype != self._dtype else None
        self._local(call.ids[mine] - self.vocab_start, out=region.view(call.dtype).reshape(count, self._dim),
                    dtype=cast)

    def _place_own_rows(self, call: _Call, buffer: np.ndarray, mine: np.ndarray) -> None:
        """``scatter`` of a dense host table, without a cast: this rank's rows for its own positions straight into
        its result (allocated here), those for other ranks' positions into their slots of `buffer`.

        A row then passes through shared memory only when another rank returns
        it, and each rank copies out only the rows others own (:meth:`_copy_out`).
        """
        start, stop = self._scattered_rows(call)
        assert self._host_rows is not None and call.slots is not None
        result = call.result = output_cache.new_output((stop - start, self._dim), call.dtype)
        inside = (mine >= start) & (mine < stop)
        for_me, for_others = mine[inside], mine[~inside]
        call.payload_bytes = for_others.size * call.row_bytes
        _place(self._host_rows, call.ids[for_me] - self.vocab_start, result, for_me - start)
        _place(self._host_rows, call.ids[for_others] - self.vocab_start, self._shared_rows(call, buffer),
               call.slots[for_others])

    def _scattered_rows(self, call: _Call) -> tuple[int, int]:
        """The range of flat ids whose rows this rank returns in ``scatter``: its positions of the first dimension."""
        start, stop = position_range(call.shape[0], self.world_size, self.rank)
        rest = math.prod(call.shape[1:])  # ids per position along the first dimension
        return start * rest, stop * rest

    def _shared_rows(self, call: _Call, buffer: np.ndarray) -> np.ndarray:
        """The first rows of `buffer`, one per id of the call, as ``(ids, dim)`` of the call's dtype."""
        count = call.ids.size
        return buffer[: count * call.row_bytes].view(call.dtype).reshape(count, self._dim)

    def _communicate(self, call: _Call) -> Any:
        """After the agreement: combine the ranks' rows and return the result in the table's kind."""
        if call.exchange == "all_reduce":
            return self._all_reduce(call)
        shared = self._shared
        turn = shared.take_turn()
        needed = call.ids.size * call.row_bytes
        # No view of the old segment may live across its growth: it would keep the old pages mapped beside the new.
        if needed and not shared.holds(needed):
            started = time.perf_counter()
            try:
                grown_now = shared.grow(needed)  # every rank decides alike: from agreed sizes and shared outcomes
            finally:  # even when it raises
                if not shared.usable:
                    self.exchange = "all_reduce"
            if not grown_now:
                call.exchange = "all_reduce"
                call.exchange_s = time.perf_counter() - started
                try:
                    return self._late_all_reduce(call)
                finally:  # after the call's collectives: a warning raised as an error ends this rank's call alone
                    refusal, shared.refusal = shared.refusal, None
                    if refusal is not None:
                        # stacklevel: the caller's line, above the layer's __call__, _call and _communicate.
                        warnings.warn(refusal, RuntimeWarning, stacklevel=4)
            grown = time.perf_counter()
            buffer = fresh = shared.buffer(turn)
            assert fresh is not None
            # The agreement came before these writes, so a second, status-carrying barrier follows them.
            written = self._collectives.agreed_step(lambda: self._write_rows(call, fresh),
                                                    "writing the rows into shared memory")
            call.late_gather_s = written - grown
            call.exchange_s = time.perf_counter() - written + grown - started
        else:
            buffer = shared.buffer(turn)
        started = time.perf_counter()
        result = self._copy_out(call, buffer)
        call.copy_s = time.perf_counter() - started
        return result

    def _copy_out(self, call: _Call, buffer: np.ndarray | None) -> Any:
        """The rows this rank returns, gathered from the shared `buffer` into a new array of their own.

        A result that :meth:`_place_own_rows` began receives the rows other ranks own, from their slots.
        """
        if call.result is not None:
            assert buffer is not None and call.owners is not None and call.slots is not None
            start, stop = self._scattered_rows(call)
            theirs = start + np.flatnonzero(call.owners[start:stop] != self.rank)
            _place(self._shared_rows(call, buffer), call.slots[theirs], call.result, theirs - start)
            return self._finish(call.result.view(call.word), call.dtype, _scattered_shape(call.shape, self.world_size,
                                                                                          self.rank))
        count = call.ids.size
        rows = call.slots if call.slots is not None else np.empty(0, np.intp)
        shape = call.shape
        if call.mode == "scatter":
            start, stop = self._scattered_rows(call)
            shape = _scattered_shape(shape, self.world_size, self.rank)
            rows = rows[start:stop]
        row_words = call.row_bytes // call.word.itemsize
        if buffer is None or not rows.size:
            words = np.empty((rows.size, row_words), call.word)
        else:
            shared = buffer[: count * call.row_bytes].view(call.word).reshape(count, row_words)
            words = lookup(shared, rows)  # fastembed's gather of whole rows: a byte copy, any dtype
        return self._finish(words, call.dtype, shape)

    def _all_reduce(self, call: _Call) -> Any:
        """The integer SUM all-reduce over the buffer, in place, and the result in the table's kind.

        ``scatter`` copies this rank's positions out of the reduced buffer. It is
        an all-reduce rather than a reduce-scatter because gloo's reduce-scatter
        clones its input and all-reduces the clone: the same traffic plus a copy
        of the whole buffer. On a GPU shard over NCCL, ``scatter`` is NCCL's
        reduce-scatter instead (:meth:`_reduce_scatter`).
        """
        words = call.words
        assert words is not None
        started = time.perf_counter()
        shape = call.shape
        if call.mode == "scatter":
            start, stop = self._scattered_rows(call)
            shape = _scattered_shape(shape, self.world_size, self.rank)
            if self._reduce_scatters:
                words = self._reduce_scatter(words, call.scattered, call.shape[0], math.prod(shape[1:]))
                call.exchange_s += time.perf_counter() - started
                return self._finish(words, call.dtype, shape)
        if call.ids.size:
            tensor = words if self._on_device else self._torch.from_numpy(words)
            self._collectives.all_reduce(tensor, "the all-reduce of the rows")
        reduced = time.perf_counter()
        call.exchange_s += reduced - started
        if call.mode == "scatter":
            mine = words[start:stop]
            words = mine.clone() if self._on_device else mine.copy()  # a result of its own size; the buffer is freed
        result = self._finish(words, call.dtype, shape)
        call.copy_s = time.perf_counter() - reduced
        return result

    def _reduce_scatter(self, words: Any, mine: Any, count: int, rest: int) -> Any:
        """`mine`, filled with this rank's positions of the buffer summed over the ranks by one reduce-scatter.

        `words` holds `count` positions of `rest` ids each; `mine`, allocated
        before the agreement, has room for this rank's part of them.
        """
        if not words.shape[0]:
            return mine
        what = "the reduce-scatter of the rows"
        if count % self.world_size == 0:
            self._collectives.reduce_scatter(mine, words, what)
            return mine
        parts = [words[start * rest: stop * rest]
                 for start, stop in (position_range(count, self.world_size, rank) for rank in range(self.world_size))]
        # reduce_scatter_single needs parts of one size: only the list form takes uneven ones (NCCL runs one reduce per rank).
        self._collectives.reduce_scatter(mine, parts, what)
        return mine

    def _late_all_reduce(self, call: _Call) -> Any:
        """The all-reduce for a call that shared memory could not hold: gathered after the agreement."""
        started = time.perf_counter()
        gathered = self._collectives.agreed_step(lambda: self._gather_masked(call), "gathering the rows")
        call.late_gather_s = gathered - started
        call.exchange_s += time.perf_counter() - gathered
        return self._all_reduce(call)

    def _finish(self, words: Any, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        """The exchanged words as the result: numpy words seen as `dtype` in the table's kind, or a GPU shard's tensor."""
        if self._on_device:
            return words.view(self._torch_dtype(dtype)).view(shape + (self._dim,))
        values = _words_as(words, dtype).reshape(shape + (self._dim,))
        return values if self._shard.like is None else result_like(values, self._shard.like)

    def _torch_dtype(self, dtype: np.dtype) -> Any:
        """The torch dtype of a GPU shard's results of `dtype`: the table's own (bfloat16 is held as words), or torch's of that name."""
        return self._shard.like.dtype if dtype == self._dtype and not self._quantized else getattr(self._torch, dtype.name)

    # -- the choice of exchange ------------------------------------------------------------------------------

    def _choose_exchange(self, requested: str) -> str:
        """Agree on every rank's host and /dev/shm, and on the segments' key; the exchange this layer uses.

        Raises:
            ValueError: ``"shared_memory"`` on ranks of different hosts, or where
                a rank has no usable /dev/shm (on every rank: all see the same facts).
        """
        host, usable = segments.host_identity()
        secret = int.from_bytes(secrets.token_bytes(8), "little", signed=True)
        held = self._collectives.held_board()
        facts = self._collectives.all_gather_ints([host, int(usable), secret, 0 if held is None else held.identity],
                                                  "the agreement on the exchange")
        hosts, usables, secrets_, boards = zip(*facts, strict=True)
        self._key = int(secrets_[0]).to_bytes(8, "little", signed=True)  # rank 0's: names no one can guess
        one_host = len(set(hosts)) == 1 and all(usables)
        if one_host and self.world_size > 1 and self._collectives.wire == "cpu" and board.usable():
            self._collectives.ensure_board(self._key, boards)
        if requested == "all_reduce" or self._on_device or (requested == "auto" and self.world_size == 1):
            return "all_reduce"
        if one_host:
            return "shared_memory"
        if requested == "auto":
            return "all_reduce"
        others = [rank for rank, other in enumerate(hosts) if other != hosts[0]]
        unusable = [rank for rank, flag in enumerate(usables) if not flag]
        reasons = []
        if others:
            reasons.append(f"rank(s) {', '.join(map(str, others))} run on another host than rank 0 (or another "
                           "boot, user or /dev/shm)")
        if unusable:
            reasons.append(f"rank(s) {', '.join(map(str, unusable))} have no usable {SHM_FOLDER} (Linux, writable)")
        raise ValueError(f"VocabParallelEmbedding: exchange='shared_memory' needs every rank on one host with a "
                         f"shared {SHM_FOLDER}: {'; '.join(reasons)}; use exchange='auto' or 'all_reduce'")



class _Call:
    """One call's state: the ids, the output dtype, the fingerprint; then the buffers and the timings of the exchange."""

    __slots__ = ("mode", "shape", "ids", "dtype", "row_bytes", "word", "digest", "description", "exchange", "words",
                 "scattered", "slots", "owners", "result", "payload_bytes", "late_gather_s", "exchange_s", "copy_s")

    def __init__(self, mode: str, shape: tuple[int, ...], ids: np.ndarray, dtype: np.dtype, row_bytes: int,
                 word: np.dtype, digest: int, description: str, exchange: str) -> None:
        self.mode, self.shape, self.dtype, self.digest, self.description = mode, shape, dtype, digest, description
        self.ids = ids  # the ids as int64, flat: this call's own copy (the all-reduce's gather shifts it in place)
        self.row_bytes, self.word = row_bytes, word  # an output row's bytes; the widest integer word dividing them
        self.exchange = exchange  # the layer's, or "all_reduce" for a call shared memory could not hold
        self.words: Any = None  # the all-reduce's buffer: (ids, row words), numpy or a GPU shard's torch tensor
        self.scattered: Any = None  # NCCL's reduce-scatter's output: this rank's positions of `words`
        self.slots: np.ndarray | None = None  # shared memory: where each position's row lies in the buffer
        self.owners: np.ndarray | None = None  # shared memory, placed scatter: the rank owning each position's row
        self.result: np.ndarray | None = None  # shared memory, placed scatter: the result, this rank's rows placed
        self.payload_bytes = 0
        self.late_gather_s = self.exchange_s = self.copy_s = 0.0


#: Why a layer is never copied: its calls are collectives, in step with the other ranks' (which buffer of the
#: shared-memory segment a call writes, say), and a copy would fall out of step.
_NOT_COPIED = ("a VocabParallelEmbedding cannot be copied or pickled: it is this rank's part of one layer whose calls "
               "the ranks make in step, and a copy would fall out of step with the others; build another layer on "
               "every rank instead")


def _refused(unexpected: tuple[Any, ...], unknown: dict[str, Any]) -> str | None:
    """Why a call's extra positional arguments or unknown keywords are refused, in words like Python's, or None."""
    if unexpected:
        return (f"VocabParallelEmbedding.__call__() takes ids and mode positionally ({len(unexpected) + 2} were given); "
                "dtype is a keyword")
    if unknown:
        words = ", ".join(repr(name) for name in unknown)
        hint = ": the layer allocates its result" if "out" in unknown else ""
        return f"VocabParallelEmbedding.__call__() got unexpected keyword argument(s) {words}{hint}"
    return None


def _place(table: np.ndarray, ids: np.ndarray, out: np.ndarray, positions: np.ndarray) -> None:
    """``out[positions[i]] = table[ids[i]]``, checked, by the host backend ``"auto"`` picks for `table`."""
    ids, positions = validate.place_arguments(table, ids, out, positions)
    dispatch.placing_backend(table).place(table, ids, out, positions)


def _words_as(words: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Rows of exchange words seen as `dtype`, through their bytes: a record of 3, 5, 6 or 7 bytes divides no wider word."""
    return words.view(np.uint8).view(dtype)


def _scattered_shape(shape: tuple[int, ...], world_size: int, rank: int) -> tuple[int, ...]:
    """The shape of the ids whose rows `rank` returns in ``scatter``: its part of the first dimension."""
    start, stop = position_range(shape[0], world_size, rank)
    return (stop - start, *shape[1:])


def _group_lock(group: Any) -> threading.Lock:
    """The lock of `group`'s layers on this rank (made by the first; dict.setdefault is atomic); None: a lock of its own."""
    return threading.Lock() if group is None else _GROUP_LOCKS.setdefault(group, threading.Lock())


def _weak_world(dist: Any) -> Callable[[], Any]:
    """A weak reference to the default process group (None when there is none), held by no frame of the caller."""
    world = dist.group.WORLD
    return (lambda: None) if world is None else weakref.ref(world)


def _checked_timeout(timeout: Any) -> float | None:
    """`timeout` as seconds: None, or from 1 ms (torch counts whole milliseconds, and reads 0 as no limit) to a year."""
    if timeout is None:
        return None
    return validate.checked_seconds(timeout, f"timeout must be None or a number of seconds from {MIN_TIMEOUT_S:g} to "
                                             f"{MAX_TIMEOUT_S:g} (a year)", MIN_TIMEOUT_S, MAX_TIMEOUT_S)


def _torch_distributed() -> tuple[Any, Any]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as error:
        raise ImportError(TORCH_NEEDED) from error
    if not dist.is_available():
        raise ImportError(f"this torch build has no torch.distributed; {TORCH_NEEDED}")
    return torch, dist
