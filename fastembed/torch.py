"""A drop-in for ``torch.nn.Embedding`` whose forward gathers through fastembed.

Importing this module imports torch (``import fastembed`` does not).

``fastembed.torch.Embedding`` is a ``torch.nn.Embedding``: the same
constructor, ``from_pretrained``, parameters and ``state_dict`` keys, so a
model swaps its layer in one line. Its forward runs ``fastembed.lookup`` on
the weight (zero-copy, see docs/interop.md) when no gradient is needed: in
inference, or when the weight is frozen. It gives torch's result in every
other case by using torch's own embedding (never a copy of the weight):

* while torch compiles or traces the model (``torch.compile``,
  ``torch.export``, ``torch.jit.trace``, ``torch.fx`` symbolic tracing), so
  the graph holds torch's operation, which runs on fake and traced tensors;
  this is not warned about;
* under forward-mode AD (a weight with a tangent) and inside ``torch.func``
  transforms (``vmap``, ``jvp``, ``grad``), which pass tensors of their own
  that torch's operation knows how to carry; not warned about either;
* when autograd needs a gradient (the weight requires grad and grad mode is
  on), so training keeps working;
* when the weight or the ids are not on the CPU;
* when fastembed cannot gather from the weight as it lies in memory: a
  weight that is not C-contiguous (``from_pretrained(w.T)``), or of a dtype
  fastembed cannot view (``complex32``, say), which fastembed would refuse
  rather than copy.

Each of the last three is said once per process (a ``UserWarning`` naming the reason).

Options that change the forward pass or the weight's gradient layout and
that the gather does not implement (``max_norm``, ``sparse``,
``scale_grad_by_freq``) are refused with a ValueError naming the option.

Example:
    >>> import torch, fastembed.torch
    >>> layer = fastembed.torch.Embedding.from_pretrained(torch.arange(12.0).reshape(4, 3))
    >>> layer(torch.tensor([[3, 0]]))
    tensor([[[ 9., 10., 11.],
             [ 0.,  1.,  2.]]])
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.autograd import forward_ad

from .api import lookup

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

        Raises:
            IndexError, TypeError: fastembed's errors for bad ids where fastembed serves; torch's where torch does.
        """
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or isinstance(input, torch.fx.Proxy):
            return super().forward(input)  # the graph must hold torch's operation, not a gather done now
        weight = self.weight
        if _transformed(weight, input):
            return super().forward(input)  # forward-mode AD or a torch.func transform: torch's operation carries them
        if (weight.requires_grad and torch.is_grad_enabled()) or weight.device.type != "cpu" or (
            isinstance(input, torch.Tensor) and input.device.type != "cpu"
        ) or not weight.is_contiguous() or not _viewable(weight):
            _say_fallback_once(weight, input)
            return super().forward(input)
        if isinstance(input, torch.Tensor) and input.is_neg():
            input = input.resolve_neg()  # a lazy negation view of ids; fastembed copies the ids anyway
        return lookup(weight, input)


def _transformed(weight: torch.Tensor, input: Any) -> bool:
    """Whether the weight carries a forward-mode tangent, or either tensor is wrapped by a torch.func transform (vmap, jvp, grad)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if wrapped(weight) or (isinstance(input, torch.Tensor) and wrapped(input)):
        return True
    return forward_ad._current_level >= 0 and forward_ad.unpack_dual(weight).tangent is not None


def _viewable(weight: torch.Tensor) -> bool:
    """Whether fastembed sees a C-contiguous CPU weight as a numpy array without a copy (its dtype, no lazy bits)."""
    viewable = _VIEWABLE.get(weight.dtype)
    if viewable is None:
        from .arrays import torch_adapter

        try:
            torch_adapter.ADAPTER.snapshot(torch.zeros((1, 1), dtype=weight.dtype))
            viewable = True
        except (TypeError, RuntimeError):
            viewable = False
        _VIEWABLE[weight.dtype] = viewable
    return viewable and not (weight.is_conj() or weight.is_neg())


def _say_fallback_once(weight: torch.Tensor, input: Any) -> None:
    """Warn, once per process for each reason, that torch's own embedding serves this call, and why."""
    if weight.requires_grad and torch.is_grad_enabled():
        kind, reason = "autograd", "autograd needs the weight's gradient (it requires grad and grad mode is on)"
    elif weight.device.type != "cpu" or (isinstance(input, torch.Tensor) and input.device.type != "cpu"):
        kind, reason = "device", "the weight or the ids are not on the CPU"
    elif not weight.is_contiguous():
        kind, reason = "layout", ("the weight is not C-contiguous, and fastembed gathers from a table as it lies in "
                                  "memory, never from a copy (weight.data = weight.contiguous() copies it once)")
    else:
        kind, reason = "dtype", (f"fastembed cannot see the {weight.dtype} weight as a table without a copy "
                                 "(a dtype numpy lacks, or a lazy conjugate or negation)")
    if kind in _REASONS_SAID:
        return
    _REASONS_SAID.add(kind)
    warnings.warn(f"fastembed.torch.Embedding uses torch's own embedding while {reason}; this is said once",
                  UserWarning, stacklevel=3)
