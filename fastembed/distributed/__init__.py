"""Vocabulary-parallel embedding lookup on torch.distributed: each rank holds a contiguous slice of the rows.

Every rank of a process group builds ``VocabParallelEmbedding(source)``
together (it is a collective, like the calls). Each rank keeps only its own
rows: from a checkpoint path it memory-maps just its rows' bytes of the
file, so its memory grows by its shard, not by the table. Quantized tables
(:class:`~fastembed.formats.QuantizedTable`, a GGUF block type, a quantized
safetensors file fastembed saved) are split the same way, by rows of bytes
(and row scales), and dequantized by the local gather into ``dtype=``.

A torch CUDA tensor, or a checkpoint path with ``device="cuda:N"``, gives
each rank a *GPU shard*: its rows on its GPU, gathered there by fastembed's
cuda backend, combined by the all-reduce (NCCL's reduce-scatter for
``"scatter"`` on a group whose GPU backend is NCCL), returned as torch CUDA
tensors on the shard's device. The ids are still checked and fingerprinted
on the host (ids on the GPU are copied there first).

``emb(ids)``, called by every rank with the same ids, returns every rank the
full rows ``table[ids]``; ``emb(ids, mode="scatter")`` returns each rank its
contiguous slice of the positions, for sequence-parallel callers.

A call runs five steps on every rank (:class:`LookupTimings` times each):

1. *prepare*: the ids are checked as :func:`fastembed.lookup` checks them
   (against the real vocabulary), copied once as int64 and fingerprinted
   (shape, mode, a 64-bit hash of the values);
2. *gather*: the rank's own positions are gathered from its shard by
   fastembed (ids shifted by the shard's first row), into the exchange's
   buffer (below);
3. *agree*: every rank shares its status and fingerprint with the others:
   through a board in shared memory where every rank runs on one x86-64
   Linux host and the group carries CPU tensors (one board per group, shared
   by its layers: :attr:`VocabParallelEmbedding.agreement`), else by one
   small all-gather over the group. A rank's bad ids, or ids that differ
   between ranks, raise the same error on every rank here, before any data
   collective; the group stays usable;
4. *communicate*, by one of two exchanges (``exchange=``, chosen when the
   layer is built):

   - ``"shared_memory"``, when every rank runs on one host with a host
     table (the default there): step 2 wrote each rank's rows into a buffer of a shared-memory
     segment all ranks map, and the agreement doubles as the barrier after
     those writes, so nothing is sent (unless the segment is too small for
     the batch: the ranks then grow it together and write their rows into
     it after the agreement, followed by a second barrier);
   - ``"all_reduce"``, otherwise: step 2 wrote zeros at every position the
     rank does not own, and an integer SUM all-reduce of the rows seen as
     integers combines them in place. Each sum is ``x + 0 + ... + 0``: the
     owner's bits.

   Both are exact for every dtype, -0.0 and NaN payloads included: no float
   arithmetic touches a row;
5. *copy out*: with shared memory, the rows this rank returns are gathered
   out of the segment's buffer into a new array; with the all-reduce,
   ``"full"`` returns the reduced buffer itself and ``"scatter"`` copies
   this rank's positions out of it.

Every collective and every agreement is waited for at most ``timeout``
seconds: a rank that dies or stops calling makes the others raise
:class:`CommunicationError` (on a board, a rank whose process ended is seen
at once). The
agreements carry CPU tensors where the group has a CPU backend (gloo), and
tensors on the shard's GPU on a group of NCCL alone; a GPU shard's rows
always travel as CUDA tensors of its device.

How rows and positions are split: :func:`row_range` and :func:`position_range`.
Importing this module does not import torch; building a
:class:`VocabParallelEmbedding` does (ImportError naming the extra without it).
docs/distributed.md has the usage, the failure behaviour and a cost model.
"""
from __future__ import annotations

from .agreement import CommunicationError
from .layer import EXCHANGES, MODES, LookupTimings, VocabParallelEmbedding
from .layout import padded_vocab_size, position_range, row_range, split_range

__all__ = ["EXCHANGES", "MODES", "CommunicationError", "LookupTimings", "VocabParallelEmbedding", "padded_vocab_size",
           "position_range", "row_range", "split_range"]

for _public in (CommunicationError, LookupTimings, VocabParallelEmbedding, padded_vocab_size, position_range, row_range,
                split_range):
    _public.__module__ = __name__  # their public home, for help(), reprs, pickling and the docs' examples
del _public
