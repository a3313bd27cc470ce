"""Vocabulary-parallel embedding lookup on torch.distributed: each rank holds a contiguous slice of the rows.

Every rank of a process group builds ``VocabParallelEmbedding(source)``
together (it is a collective, like the calls). Each rank keeps only its own
rows: from a checkpoint path it memory-maps just its rows' bytes of the
file, so its memory grows by its shard, not by the table. Quantized tables
(:class:`~fastembed.formats.QuantizedTable`, a GGUF block type, a quantized
safetensors file fastembed saved) are split the same way, by rows of bytes
(and row scales), and dequantized by the local gather into ``dtype=``.

``emb(ids)``, called by every rank with the same ids, returns every rank the
full rows ``table[ids]``; ``emb(ids, mode="scatter")`` returns each rank its
contiguous slice of the positions, for sequence-parallel callers.

A call runs four steps on every rank:

1. *prepare*: the ids are checked as :func:`fastembed.lookup` checks them
   (against the real vocabulary), copied once as int64 and fingerprinted
   (shape, mode, a 64-bit hash of the values);
2. *gather*: the rank's own positions are gathered from its shard by
   fastembed (ids shifted by the shard's first row); every other position's
   row is written as zeros;
3. *agree*: one small all-gather of each rank's status and fingerprint. A
   rank's bad ids, or ids that differ between ranks, raise the same error on
   every rank here, before any data collective; the group stays usable;
4. *communicate*: an integer SUM all-reduce of the rows seen as integers, in
   place (``scatter`` then keeps this rank's positions). Each row has one owner and every other rank
   contributes zeros, so each sum is ``x + 0 + ... + 0``: the owner's bits,
   exact for every dtype, -0.0 and NaN payloads included.

Every collective is waited for at most ``timeout`` seconds: a rank that dies
or stops calling makes the others raise :class:`CommunicationError`.

How rows and positions are split: :func:`row_range` and :func:`position_range`.
Importing this module does not import torch; building a
:class:`VocabParallelEmbedding` does (ImportError naming the extra without it).
docs/distributed.md has the usage, the failure behaviour and a cost model.
"""
from __future__ import annotations

import datetime
import hashlib
import math
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import validate
from .api import Embedding
from .arrays import device_of, result_like
from .formats import QuantizedTable

MODES = ("full", "scatter")
#: Bytes of an error message or description one rank shares with the others (longer ones are cut).
MESSAGE_BYTES = 2048
TORCH_NEEDED = "fastembed.distributed needs torch 2.13 or later (the release it is tested with): pip install 'fastembed-gather[distributed]'"
#: Integer views for the SUM collectives, widest first. No int16: neither gloo nor NCCL sums it.
_WORDS = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8))
#: Exception types a rank's local step shares with the others by their index (+1); any other becomes a RuntimeError.
_SHARED = (IndexError, ValueError, TypeError, FileNotFoundError, PermissionError, OSError, MemoryError, ImportError)
_NOT_ON_HOST = (
    "VocabParallelEmbedding serves host tables (numpy, np.memmap, torch CPU tensors) over a group that carries CPU "
    "tensors (gloo); a table on {device} is not served: the GPU path (NCCL) is not built, as this class has not "
    "been run on GPUs (docs/distributed.md, 'GPUs'); fastembed.lookup serves GPU tables in one process"
)


class CommunicationError(RuntimeError):
    """A collective of :class:`VocabParallelEmbedding` failed or timed out.

    Another rank died, hung, or stopped calling. The process group is unusable
    afterwards (a collective may still be pending in it): destroy it and end
    the process; a launcher (torchrun) then stops or restarts the job. Every
    later call of the same layer raises this error again at once.
    """


class LookupTimings(NamedTuple):
    """Where one call's time went on this rank, in seconds, and the bytes it handed to the data collective."""

    prepare_s: float
    gather_s: float
    agree_s: float
    communicate_s: float
    payload_bytes: int


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of `total` items split into `parts` contiguous parts: the first ``total % parts`` get one more.

    Returns:
        ``(start, stop)``, a half-open range.

    Raises:
        ValueError: a negative total, fewer than one part, or an index outside ``[0, parts)``.

    Example:
        >>> from fastembed.distributed import split_range
        >>> [split_range(10, 4, index) for index in range(4)]
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    if total < 0 or parts < 1 or not 0 <= index < parts:
        raise ValueError(f"cannot take part {index} of {total} items split into {parts} parts")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def padded_vocab_size(vocab_size: int, pad_to_multiple: int = 1) -> int:
    """`vocab_size` rounded up to a multiple of `pad_to_multiple` (Megatron pads to 128 x the ranks).

    Example:
        >>> from fastembed.distributed import padded_vocab_size
        >>> padded_vocab_size(129280, 128 * 8)
        130048
    """
    return -(-vocab_size // pad_to_multiple) * pad_to_multiple


def row_range(vocab_size: int, world_size: int, rank: int, pad_to_multiple: int = 1) -> tuple[int, int]:
    """The rows rank `rank` owns: its contiguous part of the padded vocabulary.

    The vocabulary is padded to a multiple of `pad_to_multiple`, then split by
    :func:`split_range` (the first ``padded % world_size`` ranks get one row
    more; none do when `pad_to_multiple` is a multiple of `world_size`, as in
    Megatron). Padded rows do not exist: a rank stores rows ``[start,
    min(stop, vocab_size))``, and ids from `vocab_size` up are out of range.

    Returns:
        ``(start, stop)`` in the padded vocabulary.

    Raises:
        ValueError: a vocabulary or `pad_to_multiple` below 1, or `rank` outside ``[0, world_size)``.

    Example:
        >>> from fastembed.distributed import row_range
        >>> [row_range(10, 3, rank) for rank in range(3)]
        [(0, 4), (4, 7), (7, 10)]
        >>> [row_range(10, 4, rank, pad_to_multiple=8) for rank in range(4)]  # rank 2 stores 8, 9; rank 3 none
        [(0, 4), (4, 8), (8, 12), (12, 16)]
    """
    if vocab_size < 1 or pad_to_multiple < 1:
        raise ValueError(f"vocab_size and pad_to_multiple must be 1 or more, got {vocab_size} and {pad_to_multiple}")
    return split_range(padded_vocab_size(vocab_size, pad_to_multiple), world_size, rank)


def position_range(count: int, world_size: int, rank: int) -> tuple[int, int]:
    """The positions ``mode="scatter"`` returns to rank `rank`, of `count` along the ids' first dimension.

    The same rule as rows (:func:`split_range`): the first ``count % world_size``
    ranks get one position more; ranks past `count` get none.

    Example:
        >>> from fastembed.distributed import position_range
        >>> [position_range(5, 3, rank) for rank in range(3)]
        [(0, 2), (2, 4), (4, 5)]
    """
    return split_range(count, world_size, rank)


class _Shard(NamedTuple):
    """One rank's rows: the numpy view (or QuantizedTable of numpy views) gathered from, the caller's kind, the watch."""

    rows: Any  # np.ndarray, or a QuantizedTable of this rank's rows (and row scales)
    like: Any  # None for numpy tables; else the rows in the caller's library, so results follow the table's kind
    watch: Any  # a FileWatch over the mapped rows for a path source, else None
    vocab_size: int


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
            row scales), or a host table (numpy array, np.memmap, torch CPU
            tensor, or a :class:`~fastembed.formats.QuantizedTable` of them:
            each rank keeps a view of its rows; the array stays as big as the
            caller keeps it).
        group: the process group (default: the default group). Its backend
            must carry CPU tensors: gloo, or ``"cpu:gloo,cuda:nccl"``.
        name: the tensor in a checkpoint (None: the token embedding, by name).
        pad_to_multiple: pad the vocabulary to a multiple of this before
            splitting (:func:`row_range`); padded rows do not exist.
        timeout: seconds each collective may take before this rank raises
            :class:`CommunicationError`; None waits as long as the group's own
            timeout (``init_process_group(timeout=...)``, which also bounds the
            gloo transfer itself).

    Raises:
        ImportError: torch is not installed.
        RuntimeError: no process group is initialised.
        ValueError: this process is not in `group`; a group without CPU
            transport (NCCL alone); ranks that opened different tables;
            ``pad_to_multiple`` or ``timeout`` not positive; `name` with an array.
        TypeError: a table not on the host (torch CUDA tensors, cupy arrays).
        FileNotFoundError, ValueError, TypeError: as the loaders, for a path
            source (raised on every rank when any rank's open failed).
        CommunicationError: a rank died or did not build it within `timeout`.

    Shape:
        ``emb(ids)``: ``ids.shape + (dim,)``; ``emb(ids, mode="scatter")``:
        ``(stop - start,) + ids.shape[1:] + (dim,)`` with ``(start, stop) =
        position_range(ids.shape[0], world_size, rank)``. The table's dtype, or
        ``dtype=`` (a quantized table: float32 unless ``dtype=`` says otherwise).

    Example (run by every rank, after ``torch.distributed.init_process_group("gloo")``;
    docs/distributed.md has complete scripts)::

        emb = VocabParallelEmbedding("path/to/checkpoint", timeout=60)
        rows = emb(torch.tensor([[5, 9, 2]]))              # (1, 3, dim) on every rank
        mine = emb(torch.arange(8), mode="scatter")        # (8 // world_size, dim) here
    """

    def __init__(self, source: Any, *, group: Any = None, name: str | None = None, pad_to_multiple: int = 1,
                 timeout: float | None = None) -> None:
        torch, dist = _torch_distributed()
        if not dist.is_initialized():
            raise RuntimeError("VocabParallelEmbedding needs a process group: call "
                               "torch.distributed.init_process_group('gloo', ...) first (docs/distributed.md)")
        self._torch, self._dist, self._group = torch, dist, group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of `group`")
        backend = str(dist.get_backend(group))
        if backend == "nccl":
            raise ValueError("VocabParallelEmbedding gathers host tables and communicates CPU tensors, which NCCL cannot "
                             "carry: use a gloo group, or init_process_group(backend='cpu:gloo,cuda:nccl')")
        self._broken: str | None = None
        self._timeout: float | None = None
        self._mine = torch.zeros(2, dtype=torch.int64)
        self._theirs = torch.zeros((self.world_size, 2), dtype=torch.int64)
        self._theirs_list = list(self._theirs.unbind(0))
        self.last_timings: LookupTimings | None = None
        shard, error = None, None
        try:
            timeout = _checked_timeout(timeout)
            pad = _checked_pad(pad_to_multiple)
            shard = _open_shard(source, name, pad, self.rank, self.world_size)
            self._timeout = timeout
        except Exception as caught:
            error = caught
        described = "" if shard is None else (
            f"a {shard.vocab_size} x {shard.rows.shape[1]} {_kind(shard.rows)} table, pad_to_multiple={pad_to_multiple}")
        self._agree(error, _digest(described.encode()), lambda: described, "the table",
                    "every rank must open a table of the same shape and dtype, with the same pad_to_multiple")
        assert shard is not None  # _agree raised otherwise
        self._shard = shard
        self.vocab_size: int = shard.vocab_size
        self.padded_vocab_size: int = padded_vocab_size(shard.vocab_size, pad_to_multiple)
        self.vocab_start, self.vocab_end = row_range(shard.vocab_size, self.world_size, self.rank, pad_to_multiple)
        rows = shard.rows
        self._stored = int(rows.shape[0])
        self._dim = int(rows.shape[1])
        self._quantized = isinstance(rows, QuantizedTable)
        self._dtype = validate.output_dtype(rows, None)  # results without dtype=: float32 for a quantized table
        local = rows if self._quantized else rows.view(np.ndarray)
        self._local = Embedding(local) if self._stored else None
        self._phantom = np.empty((self.vocab_size, 0), np.uint8)  # ids are checked against the whole vocabulary

    @property
    def shard(self) -> Any:
        """This rank's stored rows ``table[vocab_start:min(vocab_end, vocab_size)]``.

        A torch tensor for a torch table; a :class:`~fastembed.formats.QuantizedTable`
        of this rank's rows (and row scales) for a quantized table.
        """
        return self._shard.rows if self._shard.like is None or self._quantized else self._shard.like

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
        """The dtype of results without ``dtype=``: the table's, float32 for a quantized table (bfloat16 via ml_dtypes)."""
        return np.dtype(self._dtype)

    def check_file(self) -> None:
        """Raise if the file behind this rank's mapped rows shrank or was modified in place since it was opened.

        Local to this rank (no collective); see :meth:`fastembed.Embedding.check_file`.

        Raises:
            fastembed.io.FileChangedError: the file changed.
            ValueError: the table was not opened from a path.
        """
        if self._shard.watch is None:
            raise ValueError("this table was not memory-mapped from a file by fastembed: there is no file to check")
        self._shard.watch.check()

    def __repr__(self) -> str:
        kind = f"format={self.format!r}" if self._quantized else f"dtype={self._dtype}"
        return (f"VocabParallelEmbedding(vocab_size={self.vocab_size}, dim={self._dim}, {kind}, "
                f"rank={self.rank}, world_size={self.world_size}, rows={self.vocab_start}..{self.vocab_end})")

    def __call__(self, ids: Any, mode: str = "full", *, dtype: Any = None) -> Any:
        """``table[ids]`` on every rank (``mode="full"``), or this rank's slice of the positions (``"scatter"``).

        Every rank must call with the same ids (same shape and values; their
        integer dtype may differ), the same mode and the same dtype.

        Args:
            ids: integers of any dtype and shape, as for :func:`fastembed.lookup`.
            mode: ``"full"`` (every position) or ``"scatter"`` (this rank's part of
                the ids' first dimension, split by :func:`position_range`).
            dtype: the result's dtype, as for :func:`fastembed.lookup`: None is the
                table's dtype (float32 for a quantized table); a quantized table
                dequantizes into float32, float16 or bfloat16, a dense float table
                casts into those or float64 (rounding to nearest even).

        Returns:
            A new array of the table's kind (numpy, or torch for a torch table or
            a quantized table whose rows are a torch tensor).

        Raises:
            IndexError: an id outside ``[0, vocab_size)`` (padded rows included), with
                its position and value, raised on every rank.
            ValueError: ids, modes or dtypes that differ between ranks (naming each
                rank's), a bad mode, scalar ids with ``"scatter"``; raised on every rank.
            TypeError: ids that are not integers, a dtype the table cannot give
                (int8 from a quantized table); raised on every rank.
            CommunicationError: a rank died or did not call within `timeout`.
        """
        if self._broken is not None:
            raise CommunicationError(self._broken)
        started = time.perf_counter()
        error: Exception | None = None
        call: _Call | None = None
        try:
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
        self._agree(error, call.digest if call is not None else 0, lambda: description, "the ids",
                    "every rank must pass the same ids (same shape and values) with the same mode and dtype")
        assert call is not None  # _agree raised otherwise
        agreed = time.perf_counter()
        result = self._communicate(call)
        self.last_timings = LookupTimings(prepared - started, gathered - prepared, agreed - gathered,
                                          time.perf_counter() - agreed, int(call.words.nbytes))
        return result

    # -- the steps of a call ---------------------------------------------------------------------------------

    def _prepare(self, ids: Any, mode: str, dtype: Any) -> _Call:
        """Check the ids and dtype, copy the ids once as int64, allocate the buffer."""
        if mode not in MODES:
            raise ValueError(f"mode must be 'full' or 'scatter', got {mode!r}")
        target = validate.output_dtype(self._shard.rows, dtype)
        view = validate.ids_snapshot(ids, self._phantom)
        shape = tuple(int(size) for size in view.shape)
        if mode == "scatter" and not shape:
            raise ValueError("mode='scatter' splits the ids' first dimension, and scalar ids have none")
        flat = np.array(view, dtype=np.int64).reshape(-1)  # one copy: no other thread can change it under us
        validate.check_ids_in_range(flat.reshape(shape), self.vocab_size)
        digest = _digest(mode.encode(), target.str.encode(), repr(shape).encode(), flat.data)
        description = (f"ids of shape {shape}, mode {mode!r}, dtype {target}, "
                       f"values hashed to {digest & (2**64 - 1):016x}")
        row_bytes = self._dim * target.itemsize
        word = next(word for word in _WORDS if row_bytes % word.itemsize == 0)
        words = np.empty((flat.size, row_bytes // word.itemsize), word)
        return _Call(mode, shape, flat, target, words, digest, description)

    def _gather(self, call: _Call) -> None:
        """Fill the buffer: this rank's rows at the positions it owns, zeros everywhere else."""
        local, words = call.ids, call.words
        if not local.size:
            return
        np.subtract(local, self.vocab_start, out=local)  # local is this call's own copy
        outside = local.view(np.uint64) >= self._stored  # below the shard start wraps to huge: one comparison
        if self._local is None or outside.all():
            words.fill(0)
            return
        local[outside] = 0
        cast = call.dtype if self._quantized or call.dtype != self._dtype else None
        self._local(local, out=words.view(call.dtype), dtype=cast)
        words[outside] = 0

    def _communicate(self, call: _Call) -> Any:
        """The integer SUM all-reduce over the buffer, in place, and the result in the table's kind.

        ``scatter`` copies this rank's positions out of the reduced buffer. It is
        an all-reduce rather than a reduce-scatter because gloo's reduce-scatter
        clones its input and all-reduces the clone: the same traffic plus a copy
        of the whole buffer.
        """
        words = call.words
        if words.size:
            tensor = self._torch.from_numpy(words)
            self._collective(lambda: self._dist.all_reduce(tensor, group=self._group, async_op=True),
                             "the all-reduce of the rows")
        shape = call.shape
        if call.mode == "scatter":
            start, stop = position_range(shape[0], self.world_size, self.rank)
            rest = math.prod(shape[1:])  # ids per position along the first dimension
            shape = (stop - start, *shape[1:])
            words = words[start * rest: stop * rest].copy()  # a result of its own size; the buffer is freed
        values = words.view(call.dtype).reshape(shape + (self._dim,))
        return values if self._shard.like is None else result_like(values, self._shard.like)

    # -- collectives -----------------------------------------------------------------------------------------

    def _agree(self, error: Exception | None, digest: int, describe: Callable[[], str], what: str,
               requirement: str) -> None:
        """All-gather every rank's (status, digest); raise the same error on every rank unless all are fine and equal.

        A rank's error is raised on every rank (its type and message; "(on rank r
        of n)" added unless every rank raised it); otherwise differing digests
        raise a ValueError listing each rank's description.
        """
        self._mine[0] = 0 if error is None else _error_code(error)
        self._mine[1] = digest
        self._collective(lambda: self._dist.all_gather(self._theirs_list, self._mine, group=self._group,
                                                       async_op=True), f"the agreement on {what}")
        codes, digests = self._theirs[:, 0].tolist(), self._theirs[:, 1].tolist()
        if not any(codes) and len(set(digests)) == 1:
            return
        texts = self._gather_texts(str(error) if error is not None else describe())
        raise _shared_error(codes, texts, what, requirement) from error

    def _gather_texts(self, text: str) -> list[str]:
        """Every rank's `text` (cut to MESSAGE_BYTES), on every rank: only on the error path."""
        torch = self._torch
        encoded = text.encode("utf-8", "replace")[:MESSAGE_BYTES]
        buffer = np.zeros(MESSAGE_BYTES, np.uint8)
        buffer[: len(encoded)] = np.frombuffer(encoded, np.uint8)
        mine = torch.from_numpy(buffer)
        theirs = [torch.zeros(MESSAGE_BYTES, dtype=torch.uint8) for _ in range(self.world_size)]
        self._collective(lambda: self._dist.all_gather(theirs, mine, group=self._group, async_op=True),
                         "the exchange of error messages")
        return [bytes(tensor.numpy()).rstrip(b"\0").decode("utf-8", "replace") for tensor in theirs]

    def _collective(self, start: Callable[[], Any], what: str) -> None:
        """Start a collective and wait for it, at most `timeout` seconds; any failure is a CommunicationError."""
        try:
            work = start()
            if work is not None:  # None on a rank outside the group, which cannot happen here
                if self._timeout is None:
                    work.wait()
                else:
                    work.wait(timeout=datetime.timedelta(seconds=self._timeout))
        except RuntimeError as error:  # torch's DistBackendError, "Operation timed out!", gloo's lost connections
            limit = "the group's timeout" if self._timeout is None else f"timeout={self._timeout:g} s"
            self._broken = (
                f"VocabParallelEmbedding: {what} failed on rank {self.rank} of {self.world_size}: another rank died, "
                f"hung or stopped calling ({limit}). This process group is unusable now: destroy it and end the "
                f"process. torch.distributed said: {str(error).strip()}")
            raise CommunicationError(self._broken) from error
        except BaseException:
            self._broken = f"VocabParallelEmbedding: {what} was interrupted on rank {self.rank}; the group's state is unknown"
            raise


class _Call(NamedTuple):
    """One call's prepared state: the ids, the output dtype, the buffer, the fingerprint."""

    mode: str
    shape: tuple[int, ...]
    ids: np.ndarray  # the ids as int64, flat: this call's own copy, shifted by _gather
    dtype: np.dtype  # the result's dtype
    words: np.ndarray  # (ids, row_words): the rows seen as integers, handed to the collective
    digest: int
    description: str


def _open_shard(source: Any, name: str | None, pad: int, rank: int, world_size: int) -> _Shard:
    """This rank's rows of `source`: a map of only their bytes for a path, a view for an array."""
    if isinstance(source, (str, os.PathLike)):
        return _map_shard(source, name, pad, rank, world_size)
    if name is not None:
        raise ValueError("name= picks a tensor of a checkpoint; it does not apply to an array source")
    device = device_of(validate.storage(source))
    if device != "cpu":
        raise TypeError(_NOT_ON_HOST.format(device=device))
    view = validate.table_snapshot(source)
    vocab_size = int(view.shape[0])
    start, stop = _stored_range(vocab_size, pad, rank, world_size)
    rows = validate.storage(source)  # what results follow: the table, or a quantized table's data
    like = None
    if not isinstance(rows, np.ndarray):
        like = rows.detach()[start:stop] if hasattr(rows, "detach") else rows  # torch: a view of the rows
    if isinstance(view, QuantizedTable):
        scales = None if view.scales is None else view.scales[start:stop]
        return _Shard(QuantizedTable(view.data[start:stop], view.format, view.dim, scales), like, None, vocab_size)
    return _Shard(view[start:stop], like, None, vocab_size)


def _map_shard(path: str | os.PathLike, name: str | None, pad: int, rank: int, world_size: int) -> _Shard:
    """Map only this rank's rows of the checkpoint's table; the loaders' map of the whole tensor is dropped unread."""
    from .io import FileWatch, open_table

    whole = open_table(path, name)
    arrays: list[Any] = [whole.data, whole.scales] if isinstance(whole, QuantizedTable) else [whole]
    if not all(array is None or isinstance(array, np.memmap) for array in arrays):
        raise TypeError(f"{path}: VocabParallelEmbedding maps plain tables; this one opens as {type(whole).__name__}")
    validate.table_snapshot(whole)  # 2-D and C-contiguous, as Embedding requires
    vocab_size = int(whole.shape[0])
    start, stop = _stored_range(vocab_size, pad, rank, world_size)
    maps = [None if array is None else _map_rows(array, start, stop) for array in arrays]
    needed = max(int(array.offset) + int(array.itemsize) * stop * math.prod(array.shape[1:])
                 for array in arrays if array is not None)
    watch = FileWatch(str(arrays[0].filename), needed)
    rows: Any = QuantizedTable(maps[0], whole.format, whole.dim, maps[1]) if isinstance(whole, QuantizedTable) else maps[0]
    del whole, arrays  # the loaders' maps of the whole tensor, never read
    return _Shard(rows, None, watch, vocab_size)


def _map_rows(whole: np.memmap, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of a mapped array (a table's rows, or its row scales), mapping only their bytes."""
    shape = (stop - start, *whole.shape[1:])
    if stop == start:
        return np.empty(shape, whole.dtype)
    row_bytes = whole.itemsize * math.prod(whole.shape[1:])
    return np.memmap(str(whole.filename), dtype=whole.dtype, mode="r", offset=int(whole.offset) + start * row_bytes,
                     shape=shape)


def _kind(rows: Any) -> str:
    """A table's rows in words for the agreement: its dtype, or its format."""
    return str(rows.format.name) if isinstance(rows, QuantizedTable) else str(rows.dtype)


def _stored_range(vocab_size: int, pad: int, rank: int, world_size: int) -> tuple[int, int]:
    start, stop = row_range(vocab_size, world_size, rank, pad)
    return min(start, vocab_size), min(stop, vocab_size)


def _checked_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def _checked_pad(pad_to_multiple: Any) -> int:
    if isinstance(pad_to_multiple, bool) or not isinstance(pad_to_multiple, (int, np.integer)) or pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be an integer of 1 or more, got {pad_to_multiple!r}")
    return int(pad_to_multiple)


def _digest(*parts: Any) -> int:
    """A 64-bit hash of the parts' bytes, as a signed int64 (a tensor element)."""
    hasher = hashlib.blake2b(digest_size=8)
    for part in parts:
        hasher.update(part)
    return int.from_bytes(hasher.digest(), "little", signed=True)


def _error_code(error: BaseException) -> int:
    for index, kind in enumerate(_SHARED):
        if isinstance(error, kind):
            return index + 1
    return len(_SHARED) + 1


def _shared_error(codes: list[int], texts: list[str], what: str, requirement: str) -> Exception:
    """The one error every rank raises, from every rank's status code and text."""
    world_size = len(codes)
    failed = [rank for rank, code in enumerate(codes) if code]
    if not failed:
        listed = "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(texts))
        return ValueError(f"VocabParallelEmbedding: the ranks disagree on {what}: {requirement} ({listed})")
    first = failed[0]
    kind = _SHARED[codes[first] - 1] if codes[first] <= len(_SHARED) else RuntimeError
    same = [rank for rank in failed if codes[rank] == codes[first] and texts[rank] == texts[first]]
    if len(same) == world_size:
        return kind(texts[first])
    ranks = f"rank {same[0]}" if len(same) == 1 else f"ranks {', '.join(map(str, same))}"
    return kind(f"{texts[first]} (on {ranks} of {world_size})")


def _torch_distributed() -> tuple[Any, Any]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as error:
        raise ImportError(TORCH_NEEDED) from error
    if not dist.is_available():
        raise ImportError(f"this torch build has no torch.distributed; {TORCH_NEEDED}")
    return torch, dist
