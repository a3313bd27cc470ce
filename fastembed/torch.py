"""A drop-in for ``torch.nn.Embedding`` whose forward gathers through fastembed.

Importing this module imports torch (``import fastembed`` does not).

``fastembed.torch.Embedding`` is a ``torch.nn.Embedding``: the same
constructor, ``from_pretrained``, parameters and ``state_dict`` keys, so a
model swaps its layer in one line. Its forward runs ``fastembed.lookup`` on
the weight (zero-copy, see docs/interop.md) when no gradient is needed: in
inference, or when the weight is frozen. It gives torch's result in every
other case by using torch's own embedding (never a copy of the weight):

* for small batches: an output below the size under which fastembed's
  backend would gather on the calling thread alone
  (:func:`fastembed.dispatch.small_gather_for_ndarray`), where torch's
  embedding is at least as fast, without the conversions between;
* while torch compiles, traces or scripts the model (``torch.compile``,
  ``torch.export``, ``torch.jit.trace``, ``torch.jit.script``, ``torch.fx``
  symbolic tracing), so the graph holds torch's operation, which runs on
  fake and traced tensors; this is not warned about;
* under forward-mode AD (a weight with a tangent), inside ``torch.func``
  transforms (``vmap``, ``jvp``, ``grad``), under an active torch function
  or dispatch mode (``FakeTensorMode``, ``with torch.device(...)``,
  ``torch.set_default_device``), and when the weight or the
  ids are a subclass of ``torch.Tensor`` other than ``nn.Parameter``
  (DTensor, FakeTensor, a wrapper subclass: their memory need not hold
  their values), which torch's operation knows how to carry; not warned
  about either;
* when the ids are not a dense int32 or int64 tensor (nested, sparse), or
  have more dimensions than fastembed's results leave room for
  (:data:`fastembed.validate.MAX_IDS_NDIM`): torch's embedding then accepts
  or refuses them, as it would in training, so a model behaves alike in both;
* when autograd needs a gradient (the weight requires grad and grad mode is
  on), so training keeps working;
* when the weight or the ids are not on the CPU;
* when fastembed cannot gather from the weight as it lies in memory: a
  weight that is not C-contiguous (``from_pretrained(w.T)``), or of a dtype
  fastembed cannot view (``complex32``, say), which fastembed would refuse
  rather than copy;
* when ``max_norm`` is set after construction (or the layer's class was
  swapped in on a ``torch.nn.Embedding`` that has it): torch renormalizes
  the weight's rows in place, which the gather does not;
* when ``FASTEMBED_BACKEND`` names a backend that cannot serve a CPU weight
  (``cuda``, set for a model's GPU tables, or ``numba`` where numba cannot
  load), where ``lookup`` would raise BackendUnavailableError.

Each of the last five is said once per process (a ``UserWarning`` naming
the reason, pointing at the caller's line).

Options that change the forward pass or the weight's gradient layout and
that the gather does not implement (``max_norm``, ``sparse``,
``scale_grad_by_freq``) are refused with a ValueError naming the option
when the layer is made.

Example:
    >>> import torch, fastembed.torch
    >>> layer = fastembed.torch.Embedding.from_pretrained(torch.arange(12.0).reshape(4, 3))
    >>> layer(torch.tensor([[3, 0]]))
    tensor([[[ 9., 10., 11.],
             [ 0.,  1.,  2.]]])
"""
from __future__ import annotations

import inspect
import os
import sys
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

from . import dispatch, validate
from .api import lookup
from .arrays.torch_adapter import ADAPTER as _TORCH_ADAPTER
from .arrays.torch_adapter import stands_for_other_memory

__all__ = ["Embedding"]

#: The reasons for using torch's embedding already warned about (each is said once per process).
_REASONS_SAID: set[str] = set()
#: torch dtype -> whether fastembed views a weight of it without a copy (learned on first use).
_VIEWABLE: dict[Any, bool] = {}


class Embedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` with a fastembed forward (see the module docstring).

    Args:
        As ``torch.nn.Embedding``.

    Raises:
        ValueError: ``max_norm``, ``sparse=True`` or ``scale_grad_by_freq=True``.

    Shape:
        input ``(*)`` integer ids; output ``(*, embedding_dim)``, the weight's dtype.

    Example:
        >>> import torch, fastembed.torch
        >>> layer = fastembed.torch.Embedding(1000, 64, dtype=torch.float16).requires_grad_(False)  # inference
        >>> layer(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 64])
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for option, default in (("max_norm", None), ("sparse", False), ("scale_grad_by_freq", False)):
            if getattr(self, option) != default:
                raise ValueError(
                    f"fastembed.torch.Embedding does not support {option}={getattr(self, option)!r}; "
                    "use torch.nn.Embedding for it"
                )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``weight[input]``, as torch.nn.Embedding gives it: gathered by fastembed, or by torch where the module docstring says.

        Args:
            input: integer ids (a tensor of any shape).

        Returns:
            The rows of ``weight``, shaped ``input.shape + (embedding_dim,)``.

        Raises:
            IndexError: fastembed's error for an id out of range where fastembed serves; torch's where torch does.
            RuntimeError: torch's, for a weight it refuses whenever it reads rows (no rows, a storage emptied
                under it).
            ValueError: fastembed's, for a weight whose storage was shrunk part of the way under it.
            AssertionError: torch's, for a ``padding_idx`` the weight's rows no longer hold.

        Example:
            >>> import torch, fastembed.torch
            >>> layer = fastembed.torch.Embedding(10, 4).requires_grad_(False)
            >>> torch.equal(layer(torch.tensor([7])), layer.weight[7:8])
            True
        """
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone
            return F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                               self.scale_grad_by_freq, self.sparse)
        return self._forward_eagerly(input)

    @torch.jit.unused
    def _forward_eagerly(self, input: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` outside TorchScript."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or isinstance(input, torch.fx.Proxy):
            return super().forward(input)  # the graph must hold torch's operation, not a gather done now
        weight = self.weight
        if _carried_by_torch(weight, input) or weight.dim() != 2 or input.dim() > validate.MAX_IDS_NDIM:
            return super().forward(input)  # AD, transforms, modes, subclasses, other ids, a bad weight: torch serves
        if (weight.requires_grad and torch.is_grad_enabled()) or not (weight.is_cpu and input.is_cpu) or (
            not weight.is_contiguous()
        ) or not _viewable(weight) or self.max_norm is not None:
            _say_fallback_once(self, input)
            return super().forward(input)
        try:
            calling_thread_bytes = _calling_thread_bytes()
        except dispatch.BackendUnavailableError as refusal:
            _say_fallback_once(self, input, refusal)
            return super().forward(input)
        if input.numel() * weight.shape[1] * weight.element_size() < calling_thread_bytes:
            # A gather fastembed would do on this thread alone: torch's embedding is at least as fast there.
            return F.embedding(input, weight, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq,
                               self.sparse)
        if stands_for_other_memory(weight) or stands_for_other_memory(input):
            return super().forward(input)  # a ZeroTensor, a functionalization wrapper (checked here: small calls are torch's)
        # The weight as read now (an alias; no autograd is recorded here), checked again: another thread's
        # `.data =` since the checks above changes the parameter, not this alias.
        table = _TORCH_ADAPTER.alias(weight)
        if table.dim() != 2 or not table.is_cpu or not table.is_contiguous() or not _viewable(table) or (
            _padding_outside(self.padding_idx, table.shape[0]) or _refused_by_torch(table)
        ):
            return super().forward(input)  # torch serves, or raises its own error
        if input.is_neg():
            input = input.resolve_neg()  # a lazy negation view of ids; fastembed copies the ids anyway
        return lookup(table, input)


# Tools that read the constructor's parameters (torch.nn.utils.skip_init looks for `device`) see torch's, which it takes.
Embedding.__init__.__signature__ = inspect.signature(torch.nn.Embedding.__init__)  # type: ignore[attr-defined]

#: The tensor types fastembed reads as memory (any other subclass of torch.Tensor is torch's to handle).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: The id dtypes torch's embedding takes, and so the drop-in's gather too.
_ID_DTYPES = (torch.int64, torch.int32)


def _carried_by_torch(weight: torch.Tensor, input: Any) -> bool:
    """Whether torch's own operation must serve, silently: ids other than a dense int32/int64 tensor, a weight that
    is not strided (sparse, mkldnn), a tensor subclass, an active torch function or dispatch mode, a forward-mode
    tangent, or a torch.func wrapper."""
    if type(input) not in _PLAIN or input.dtype not in _ID_DTYPES or type(weight) not in _PLAIN:
        return True
    if input.layout is not torch.strided or input.is_nested or weight.layout is not torch.strided:
        return True  # sparse, nested or mkldnn tensors: torch's embedding takes them or says why not
    if torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if wrapped(weight) or wrapped(input):
        return True
    return forward_ad._current_level >= 0 and forward_ad.unpack_dual(weight).tangent is not None


def _refused_by_torch(weight: torch.Tensor) -> bool:
    """Whether torch's embedding refuses `weight` whenever it reads rows (no rows; a storage emptied under it, as FSDP
    frees parameters): the drop-in hands such calls to torch, so that its error is torch's at every batch size.

    A storage shrunk only part of the way is not among them: torch would read
    past its end, and fastembed's lookup refuses it with a ValueError.
    """
    return weight.shape[0] == 0 or weight.untyped_storage().nbytes() == 0


def _padding_outside(padding_idx: int | None, rows: int) -> bool:
    """Whether torch's embedding refuses `padding_idx` for a weight of `rows` rows (one set before the weight was
    replaced by a smaller one): torch checks it on every call, so the drop-in hands such calls to torch."""
    if padding_idx is None:
        return False
    return padding_idx >= rows if padding_idx > 0 else padding_idx < -rows


def _calling_thread_bytes() -> int:
    """The output size below which fastembed's backend for host tables gathers on the calling thread alone
    (:func:`fastembed.dispatch.small_gather_for_ndarray`): torch's embedding serves such batches of torch tensors
    at least as fast, without the DLPack conversions in between (docs/interop.md)."""
    small = dispatch.ndarray_small_gather
    if small[0] != dispatch.generation:
        small = dispatch.small_gather_for_ndarray(_PROBE_TABLE)
    return small[3]


#: A numpy table to ask the dispatcher with: its choice for host tables depends only on the table's type.
_PROBE_TABLE = np.empty((1, 1), np.float16)


def _viewable(weight: torch.Tensor) -> bool:
    """Whether fastembed sees a C-contiguous CPU weight as a numpy array without a copy (its dtype, no lazy bits).

    The dtype is probed once, on a tensor of its own made outside any
    torch.func transform of the caller's; a probe cut short by the recursion
    limit is asked again next time.
    """
    viewable = _VIEWABLE.get(weight.dtype)
    if viewable is None:
        from .arrays import torch_adapter

        try:
            with torch._C._DisableFuncTorch():
                torch_adapter.ADAPTER.snapshot(torch.zeros((1, 1), dtype=weight.dtype))
            viewable = True
        except RecursionError:
            return False  # the caller's stack, not the dtype: asked again next time
        except (TypeError, RuntimeError):
            viewable = False
        _VIEWABLE[weight.dtype] = viewable
    return viewable and not (weight.is_conj() or weight.is_neg())


def _say_fallback_once(layer: Embedding, input: torch.Tensor, refusal: Exception | None = None) -> None:
    """Warn, once per process for each reason, that torch's own embedding serves this call, and why (`refusal`:
    the dispatcher's, when the backend FASTEMBED_BACKEND names cannot serve the weight)."""
    weight = layer.weight
    if refusal is not None:
        kind, reason = "backend", f"FASTEMBED_BACKEND names a backend that cannot serve a CPU weight ({refusal})"
    elif weight.requires_grad and torch.is_grad_enabled():
        kind, reason = "autograd", "autograd needs the weight's gradient (it requires grad and grad mode is on)"
    elif weight.device.type != "cpu" or input.device.type != "cpu":
        kind, reason = "device", "the weight or the ids are not on the CPU"
    elif layer.max_norm is not None:
        kind, reason = "max_norm", (f"max_norm is {layer.max_norm} (set after the layer was made), and torch "
                                    "renormalizes the weight's rows in place, which fastembed's gather does not")
    elif not weight.is_contiguous():
        kind, reason = "layout", ("the weight is not C-contiguous, and fastembed gathers from a table as it lies in "
                                  "memory, never from a copy (weight.data = weight.contiguous() copies it once)")
    else:
        kind, reason = "dtype", (f"fastembed cannot see the {weight.dtype} weight as a table without a copy "
                                 "(a dtype numpy lacks, or a lazy conjugate or negation)")
    if kind in _REASONS_SAID:
        return
    _REASONS_SAID.add(kind)  # before: two threads at once say it once
    try:
        warnings.warn(f"fastembed.torch.Embedding uses torch's own embedding while {reason}; this is said once",
                      UserWarning, stacklevel=_callers_level())
    except BaseException:
        _REASONS_SAID.discard(kind)  # not given: a warning filter that raises it raises it on every call
        raise


#: Frames in these folders are not the caller's: this package's, and torch's module-calling machinery.
_NOT_THE_CALLER = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.nn.modules.module.__file__) + os.sep)


def _callers_level() -> int:
    """The ``stacklevel`` for :func:`warnings.warn`, called from here, that names the first frame outside
    fastembed and torch's module calls: the line that called the layer."""
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_THE_CALLER):
        frame, level = frame.f_back, level + 1
    return level
