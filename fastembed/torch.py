"""A drop-in for ``torch.nn.Embedding`` whose forward gathers through fastembed.

Importing this module imports torch (``import fastembed`` does not).

``fastembed.torch.Embedding`` is a ``torch.nn.Embedding``: the same
constructor, ``from_pretrained``, parameters and ``state_dict`` keys, so a
model swaps its layer in one line. Its forward runs ``fastembed.lookup`` on
the weight (zero-copy, see docs/interop.md) when no gradient is needed: in
inference, or when the weight is frozen. When autograd needs a gradient
(the weight requires grad and grad mode is on), or when the weight or the
ids are not on the CPU, it uses torch's own embedding, so training keeps
working; it says so once per process (a ``UserWarning``).

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

from .api import lookup

_FALLBACK_SAID = False


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
        weight = self.weight
        if (weight.requires_grad and torch.is_grad_enabled()) or weight.device.type != "cpu" or (
            isinstance(input, torch.Tensor) and input.device.type != "cpu"
        ):
            _say_fallback_once(weight, input)
            return super().forward(input)
        return lookup(weight, input)


def _say_fallback_once(weight: torch.Tensor, input: Any) -> None:
    global _FALLBACK_SAID
    if _FALLBACK_SAID:
        return
    _FALLBACK_SAID = True
    if weight.requires_grad and torch.is_grad_enabled():
        reason = "autograd needs the weight's gradient (it requires grad and grad mode is on)"
    else:
        reason = "the weight or the ids are not on the CPU"
    warnings.warn(f"fastembed.torch.Embedding uses torch's own embedding while {reason}; this is said once",
                  UserWarning, stacklevel=3)
