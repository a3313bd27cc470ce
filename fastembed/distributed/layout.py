"""How a vocabulary is split: contiguous, even row ranges per rank (padded on request) and position ranges."""

from __future__ import annotations

import math
from typing import Any

from .. import validate

#: The largest ``pad_to_multiple=``: a padded vocabulary then still counts its rows in 64 bits.
MAX_PAD_TO_MULTIPLE = 2**62


def _as_ints(**values: Any) -> list[int]:
    """`values` as Python ints (numpy integers too); TypeError naming the first that is no integer (a bool is none)."""
    return [validate.checked_integer(value, f"{name} must be an integer", -math.inf, math.inf)
            for name, value in values.items()]


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of `total` items split into `parts` contiguous parts: the first ``total % parts`` get one more.

    Returns:
        ``(start, stop)``, a half-open range.

    Raises:
        TypeError: an argument that is not an integer.
        ValueError: a negative total, fewer than one part, or an index outside ``[0, parts)``.

    Example:
        >>> from fastembed.distributed import split_range
        >>> [split_range(10, 4, index) for index in range(4)]
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    total, parts, index = _as_ints(total=total, parts=parts, index=index)
    if total < 0 or parts < 1 or not 0 <= index < parts:
        raise ValueError(f"cannot take part {index} of {total} items split into {parts} parts")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def padded_vocab_size(vocab_size: int, pad_to_multiple: int = 1) -> int:
    """`vocab_size` rounded up to a multiple of `pad_to_multiple` (Megatron pads to 128 x the ranks).

    Raises:
        TypeError: an argument that is not an integer.
        ValueError: a negative `vocab_size`; a `pad_to_multiple` outside 1 to 2**62.

    Example:
        >>> from fastembed.distributed import padded_vocab_size
        >>> padded_vocab_size(129280, 128 * 8)
        130048
    """
    pad_to_multiple = checked_pad(pad_to_multiple)
    (vocab_size,) = _as_ints(vocab_size=vocab_size)
    if vocab_size < 0:
        raise ValueError(f"vocab_size must be 0 or more, got {vocab_size}")
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
        TypeError: an argument that is not an integer.
        ValueError: a vocabulary below 1, a `pad_to_multiple` outside 1 to
            2**62, or `rank` outside ``[0, world_size)``.

    Example:
        >>> from fastembed.distributed import row_range
        >>> [row_range(10, 3, rank) for rank in range(3)]
        [(0, 4), (4, 7), (7, 10)]
        >>> [row_range(10, 4, rank, pad_to_multiple=8) for rank in range(4)]  # rank 2 stores 8, 9; rank 3 none
        [(0, 4), (4, 8), (8, 12), (12, 16)]
    """
    vocab_size, world_size, rank = _as_ints(vocab_size=vocab_size, world_size=world_size, rank=rank)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be 1 or more, got {vocab_size}")
    return split_range(padded_vocab_size(vocab_size, pad_to_multiple), world_size, rank)


def position_range(count: int, world_size: int, rank: int) -> tuple[int, int]:
    """The positions ``mode="scatter"`` returns to rank `rank`, of `count` along the ids' first dimension.

    The same rule as rows (:func:`split_range`): the first ``count % world_size``
    ranks get one position more; ranks past `count` get none.

    Returns:
        ``(start, stop)``, a half-open range of positions.

    Raises:
        TypeError: an argument that is not an integer.
        ValueError: a negative `count`, a `world_size` below 1, or `rank`
            outside ``[0, world_size)``.

    Example:
        >>> from fastembed.distributed import position_range
        >>> [position_range(5, 3, rank) for rank in range(3)]
        [(0, 2), (2, 4), (4, 5)]
    """
    count, world_size, rank = _as_ints(count=count, world_size=world_size, rank=rank)
    return split_range(count, world_size, rank)


def stored_range(vocab_size: int, pad: int, rank: int, world_size: int) -> tuple[int, int]:
    start, stop = row_range(vocab_size, world_size, rank, pad)
    return min(start, vocab_size), min(stop, vocab_size)


def checked_pad(pad_to_multiple: Any) -> int:
    """``pad_to_multiple`` as a Python int from 1 to :data:`MAX_PAD_TO_MULTIPLE`, else TypeError or ValueError."""
    return validate.checked_integer(pad_to_multiple, "pad_to_multiple must be an integer from 1 to "
                                                     f"2**{MAX_PAD_TO_MULTIPLE.bit_length() - 1}", 1, MAX_PAD_TO_MULTIPLE)
