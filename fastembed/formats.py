"""What a table's rows are: a dense dtype, or a block format.

A dense table is an ordinary 2-D array; its rows are ``dim`` values of its
dtype. A quantized table is a :class:`QuantizedTable`: each row is a run of
fixed-size blocks (:class:`BlockFormat`), each block holding a few scales and
``block_values`` small integers, and a row dequantizes to ``dim`` float32
values. Bytes read per row come from here (:func:`row_bytes`), for the
kernels, the hidden-copy audit and the benchmark alike.

The numpy functions in this module are the readable reference of every
layout: the numpy backend gathers with them, and the compiled kernels are
tested bit for bit against them (and they against ``gguf.quants``, which
is llama.cpp's own reference). Arithmetic is float32 in the order ggml
writes it, without fused multiply-adds, so every backend agrees bit for bit.

Example:
    >>> import numpy as np
    >>> from fastembed.formats import FORMATS, quantize_rows, dequantize_rows
    >>> rows = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    >>> data, scales = quantize_rows(rows, FORMATS["q8_0"])
    >>> data.shape, scales
    ((1, 68), None)
    >>> float(abs(dequantize_rows(data, scales, FORMATS["q8_0"], 64) - rows).max()) < 0.01
    True
"""
from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["BlockFormat", "FORMATS", "OUTPUT_DTYPES", "QUANTIZERS", "QuantizedTable", "block_format", "dequantize_rows",
           "is_fastembeds_own", "quantize_rows", "row_bytes"]

_F16 = np.dtype("<f2")
_F32 = np.dtype(np.float32)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes (n, 2) to float32 (n, 1)."""
    return np.ascontiguousarray(raw).view(_F16).astype(_F32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes (..., k) to their low nibbles then their high nibbles (..., 2k), as uint8."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    # d: f16 | 32 x int8
    return blocks[:, 2:].view(np.int8).astype(_F32) * _f16(blocks[:, :2])


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    # d: f16 | 16 bytes: values j and j + 16 in the low and high nibble of byte j
    q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return _f16(blocks[:, :2]) * q.astype(_F32)


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    # d: f16 | m: f16 | 16 bytes of nibbles as Q4_0, unsigned
    return _f16(blocks[:, :2]) * _nibbles(blocks[:, 4:]).astype(_F32) + _f16(blocks[:, 2:4])


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Four bytes (n, 4), a little-endian uint32, to its 32 bits (n, 32) as uint8 (bit j for value j)."""
    bits = np.ascontiguousarray(qh).view("<u4") >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    # d: f16 | qh: 4 bytes, bit j the fifth bit of value j | 16 bytes of nibbles as Q4_0
    q = (_nibbles(blocks[:, 6:]) | (_fifth_bits(blocks[:, 2:6]) << 4)).astype(np.int8) - np.int8(16)
    return _f16(blocks[:, :2]) * q.astype(_F32)


def _dequant_q5_1(blocks: np.ndarray) -> np.ndarray:
    # d: f16 | m: f16 | qh: 4 bytes | 16 bytes of nibbles, unsigned
    q = (_nibbles(blocks[:, 8:]) | (_fifth_bits(blocks[:, 4:8]) << 4)).astype(_F32)
    return _f16(blocks[:, :2]) * q + _f16(blocks[:, 2:4])


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K/Q5_K block to 8 six-bit scales and 8 six-bit mins, as float32."""
    low, high, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=1)
    return scales.astype(_F32), mins.astype(_F32)


def _k_sub_blocks(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """(d * scale) * q - (dmin * min) over the 8 sub-blocks of 32 values of Q4_K/Q5_K blocks."""
    scales, mins = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks[:, :2]) * scales)[:, :, None]
    dm = (_f16(blocks[:, 2:4]) * mins)[:, :, None]
    return (d * q.reshape(-1, 8, 32).astype(_F32) - dm).reshape(-1, 256)


def _q4_k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes to 256 nibbles: each 32 bytes give 32 low then 32 high nibbles."""
    return _nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 256)


def _dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    # d: f16 | dmin: f16 | 12 bytes of six-bit scales and mins | 128 bytes of nibbles
    return _k_sub_blocks(blocks, _q4_k_nibbles(blocks[:, 16:144]))


def _dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    # d | dmin | 12 scale bytes | qh: 32 bytes, bit k of byte l is the fifth bit of value 32k + l | 128 bytes of nibbles
    fifth = (blocks[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1
    q = _q4_k_nibbles(blocks[:, 48:176]) | (fifth.transpose(0, 2, 1).reshape(-1, 256) << 4)
    return _k_sub_blocks(blocks, q)


def _dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    # ql: 128 bytes of low nibbles | qh: 64 bytes of 2-bit high parts | 16 int8 scales | d: f16
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3)
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    d = (_f16(blocks[:, 208:210]) * blocks[:, 192:208].view(np.int8).astype(_F32))[:, :, None]
    return (d * q.reshape(n, 16, 16).astype(_F32)).reshape(n, 256)


def _dequant_fp8_e4m3(blocks: np.ndarray) -> np.ndarray:
    # One float8_e4m3fn value per block; the row's float32 scale is applied by dequantize_rows.
    import ml_dtypes

    return blocks.view(ml_dtypes.float8_e4m3fn).astype(_F32)


@dataclass(frozen=True)
class BlockFormat:
    """A quantized row layout: each row is ``dim / block_values`` blocks of ``block_bytes``.

    Attributes:
        name: the format's name (``"q8_0"``).
        block_values: values per block; a row's ``dim`` is a multiple of it.
        block_bytes: bytes per block.
        ggml_type: the GGUF tensor type code, or None where GGUF has none.
        row_scale: each row has one float32 scale stored beside the rows
            (``QuantizedTable.scales``); the value is ``scale * dequant(block)``.
        dequantize_blocks: the reference: ``(n, block_bytes)`` uint8 blocks
            to ``(n, block_values)`` float32.

    Raises:
        TypeError: a name that is no non-empty string, sizes or a type code
            that are not integers, a reference that is not callable.
        ValueError: a block of no values or no bytes.
    """

    name: str
    block_values: int
    block_bytes: int
    ggml_type: int | None
    dequantize_blocks: Callable[[np.ndarray], np.ndarray] = field(repr=False, compare=False)
    row_scale: bool = False

    def __post_init__(self) -> None:
        """Raise TypeError or ValueError for fields no layout can have (a block of no values, say)."""
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"a BlockFormat's name must be a non-empty string, got {self.name!r}")
        if type(self.name) is not str:  # its characters as a plain str: a subclass's methods (lower, ==) could lie
            object.__setattr__(self, "name", str.__str__(self.name))
        for field_name in ("block_values", "block_bytes"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"BlockFormat {self.name!r}: {field_name} must be an integer, got {value!r}")
            if value <= 0:
                raise ValueError(f"BlockFormat {self.name!r}: {field_name} must be 1 or more, got {value}")
        if self.ggml_type is not None and (isinstance(self.ggml_type, bool)
                                           or not isinstance(self.ggml_type, (int, np.integer))):
            raise TypeError(f"BlockFormat {self.name!r}: ggml_type must be an integer or None, got {self.ggml_type!r}")
        if not callable(self.dequantize_blocks):
            raise TypeError(f"BlockFormat {self.name!r}: dequantize_blocks must be callable, got {self.dequantize_blocks!r}")

    def row_bytes(self, dim: int) -> int:
        """Bytes of one row of `dim` values; raises ValueError when `dim` is not a whole number of blocks,
        TypeError when it is no integer.

        Example:
            >>> from fastembed.formats import FORMATS
            >>> FORMATS["q8_0"].row_bytes(64), FORMATS["q4_k"].row_bytes(4096)
            (68, 2304)
        """
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise TypeError(f"a row's values are counted by an integer, got {type(dim).__module__}.{type(dim).__qualname__}")
        dim = int(dim)
        if dim <= 0 or dim % self.block_values:
            needed = "1 value or more" if self.block_values == 1 else f"a positive multiple of {self.block_values} values"
            raise ValueError(f"a {self.name} row holds {needed}, not {dim}")
        return dim // self.block_values * self.block_bytes


#: Every block format, by name.
FORMATS: dict[str, BlockFormat] = {
    fmt.name: fmt
    for fmt in (
        BlockFormat("q8_0", 32, 34, 8, _dequant_q8_0),
        BlockFormat("q4_0", 32, 18, 2, _dequant_q4_0),
        BlockFormat("q4_1", 32, 20, 3, _dequant_q4_1),
        BlockFormat("q5_0", 32, 22, 6, _dequant_q5_0),
        BlockFormat("q5_1", 32, 24, 7, _dequant_q5_1),
        BlockFormat("q4_k", 256, 144, 12, _dequant_q4_k),
        BlockFormat("q5_k", 256, 176, 13, _dequant_q5_k),
        BlockFormat("q6_k", 256, 210, 14, _dequant_q6_k),
        BlockFormat("fp8_e4m3", 1, 1, None, _dequant_fp8_e4m3, row_scale=True),
    )
}

#: The dtypes a quantized table dequantizes into; float32 is the default.
OUTPUT_DTYPES = ("float32", "float16", "bfloat16")
#: The formats :func:`quantize_rows` (and so :meth:`fastembed.Embedding.quantize`) produces.
QUANTIZERS = ("q8_0", "fp8_e4m3")


def is_fastembeds_own(fmt: BlockFormat) -> bool:
    """Whether `fmt` is one of :data:`FORMATS`, or a copy of one (pickled, say) with its layout and its decoder.

    Example:
        >>> import copy
        >>> from fastembed.formats import FORMATS, is_fastembeds_own
        >>> is_fastembeds_own(copy.deepcopy(FORMATS["q8_0"]))
        True
    """
    known = FORMATS.get(fmt.name)
    return known is not None and (fmt is known or (fmt == known and fmt.dequantize_blocks is known.dequantize_blocks))


def block_format(name: str | BlockFormat) -> BlockFormat:
    """The format called `name` (case-insensitive), or `name` itself when it is a format.

    Args:
        name: a format's name (``"q8_0"``, ``"Q4_K"``) or a :class:`BlockFormat`.

    Returns:
        The :class:`BlockFormat`.

    Raises:
        ValueError: no format of that name (the message lists the known ones).

    Example:
        >>> from fastembed.formats import block_format
        >>> block_format("Q8_0").name, block_format("q4_k").block_values
        ('q8_0', 256)
    """
    if isinstance(name, BlockFormat):
        return name
    fmt = FORMATS.get(str(name).lower())
    if fmt is None:
        raise ValueError(f"unknown quantized format {name!r}; known: {', '.join(FORMATS)}")
    return fmt


def dequantize_rows(data: np.ndarray, scales: np.ndarray | None, fmt: BlockFormat, dim: int) -> np.ndarray:
    """The reference dequantization: rows of `fmt` (``(n, row_bytes)`` uint8) to ``(n, dim)`` float32.

    Args:
        data: the rows' bytes, C-contiguous.
        scales: ``(n,)`` float32 row scales for a ``row_scale`` format, else None.
        fmt: the rows' format.
        dim: values per row.

    Returns:
        A new ``(n, dim)`` float32 array (``gguf.quants.dequantize`` of those
        rows for the GGUF formats, bit for bit).

    Example:
        >>> import numpy as np
        >>> from fastembed.formats import FORMATS, dequantize_rows, quantize_rows
        >>> rows = np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64)
        >>> data, scales = quantize_rows(rows, FORMATS["q8_0"])
        >>> values = dequantize_rows(data, scales, FORMATS["q8_0"], 64)
        >>> values.dtype, bool(abs(values - rows).max() < 0.01)
        (dtype('float32'), True)
    """
    n = data.shape[0]
    values = fmt.dequantize_blocks(np.ascontiguousarray(data).reshape(-1, fmt.block_bytes)).reshape(n, dim)
    if fmt.row_scale:
        values = values * np.asarray(scales, dtype=_F32).reshape(n, 1)
    return values


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf, which ggml's quantizers use (numpy's round is half to even)."""
    magnitude = np.abs(x)
    whole = np.floor(magnitude)
    # The fraction is exact; floor(|x| + 0.5) would round 0.49999997 + 0.5 up to 1 in float32.
    return np.copysign(whole + (magnitude - whole >= np.float32(0.5)), x)


def quantize_rows(rows: np.ndarray, fmt: str | BlockFormat) -> tuple[np.ndarray, np.ndarray | None]:
    """Quantize real rows ``(n, dim)`` into `fmt` (a format or its name): ``(data (n, row_bytes) uint8, scales or None)``.

    Formats: ``q8_0`` (ggml's quantizer, byte for byte: per block of 32,
    ``d = absmax / 127`` stored as float16, ``q = roundf(x * (1 / d))`` in
    float32; 0 where ``1 / d`` overflows, which ggml leaves undefined) and
    ``fp8_e4m3`` (per row, ``scale = absmax / 448`` as float32, at least
    float32's smallest normal 2**-126 for a row that is not all zeros, and
    ``x / scale`` rounded to the nearest float8_e4m3fn). The result does not
    depend on ``np.seterr``. All the rows are converted at once, through
    float32 temporaries several times their size: a whole table is quantized
    a few MiB of rows at a time by :meth:`fastembed.Embedding.quantize`.

    Args:
        rows: a 2-D array of real numbers, ``(n, dim)``; for q8_0, `dim` a
            multiple of 32.
        fmt: the format, or its name.

    Returns:
        ``(data, scales)``: ``data`` a new ``(n, row_bytes)`` uint8 array of the
        rows' blocks; ``scales`` a new ``(n,)`` float32 array for a format with
        row scales (fp8_e4m3), else None.

    Raises:
        TypeError: rows of complex numbers or of a dtype that is not a number.
        ValueError: rows that are not 2-D, a format that cannot be produced
            here, a q8_0 row whose length is not a multiple of 32, non-finite
            values, values beyond float32's range, or (q8_0) a block whose
            scale rounds to infinity in float16 (a largest magnitude that
            rounds to 65520 x 127 = 8,321,040 or more in float32).

    Example:
        >>> import numpy as np
        >>> from fastembed.formats import FORMATS, quantize_rows
        >>> data, scales = quantize_rows(np.ones((3, 64), np.float32), FORMATS["q8_0"])
        >>> data.shape, data.dtype, scales is None
        ((3, 68), dtype('uint8'), True)
    """
    fmt = block_format(fmt)
    if not is_fastembeds_own(fmt):
        raise ValueError(f"fastembed quantizes into its own {' and '.join(QUANTIZERS)} formats, not {fmt!r}")
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ValueError(f"rows to quantize must be 2-D (n, dim), got shape {rows.shape}")
    from .validate import is_real_number_dtype  # validate imports this module

    if not is_real_number_dtype(rows.dtype):
        raise TypeError(f"cannot quantize {rows.dtype} rows: they must hold real numbers")
    with np.errstate(all="ignore"):  # underflow to subnormals and zeros is part of quantizing, whatever np.seterr says
        return _quantize_checked(rows, fmt)


#: The smallest block magnitude whose q8_0 scale (absmax / 127) rounds to infinity in float16 (65504 + half a step).
_Q8_0_OVERFLOW = 65520 * 127


def _quantize_checked(rows: np.ndarray, fmt: BlockFormat) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`quantize_rows` once the arguments are known good, under errstate(all="ignore")."""
    if fmt.name not in QUANTIZERS:  # before the row's width: a width would not make it one
        raise ValueError(f"fastembed quantizes into {' and '.join(QUANTIZERS)}; {fmt.name} tables come from GGUF files")
    values = rows.astype(_F32)
    if not np.isfinite(values).all():
        if np.isfinite(rows).all():
            raise ValueError(f"cannot quantize {rows.dtype} values beyond float32's range (|x| > {float(np.finfo(_F32).max):.4g})")
        raise ValueError("cannot quantize a table holding NaN or infinite values")
    n, dim = values.shape
    fmt.row_bytes(dim)
    if fmt.name == "q8_0":
        blocks = values.reshape(-1, 32)
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
        if not np.isfinite(d.astype(_F16)).all():
            largest = float(np.abs(rows.astype(np.float64)).max())  # an integer's abs would wrap at its minimum
            raise ValueError(f"q8_0 stores each block's scale absmax / 127 as float16, so it holds magnitudes that "
                             f"round to float32 below 65520 x 127 = {_Q8_0_OVERFLOW:,}, not {largest:.10g}; use "
                             "fp8_e4m3 (a float32 scale per row)")
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
        scaled = blocks * inverse
        # 1 / d overflows for d below about 2.9e-39, where C's conversion of roundf(inf) is undefined: q = 0 there
        # (such a d rounds to 0 in float16, so every value of the block dequantizes to 0 either way).
        q = _round_half_away(np.where(np.isfinite(scaled), scaled, np.float32(0))).astype(np.int8)
        data = np.concatenate([d.astype(_F16).view(np.uint8), q.view(np.uint8)], axis=1)
        return data.reshape(n, fmt.row_bytes(dim)), None
    import ml_dtypes  # fp8_e4m3, the other format fastembed quantizes into

    absmax = np.abs(values).max(axis=1)
    # Below float32's smallest normal a scale loses bits, and x / scale could pass 448 (NaN in float8_e4m3fn).
    floor = np.maximum(absmax / np.float32(448), np.finfo(_F32).tiny)
    scales = np.where(absmax == 0, np.float32(0), floor).astype(_F32)
    scaled = np.where(scales[:, None] == 0, np.float32(0), values / scales[:, None])
    return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scales


class QuantizedTable:
    """A table of quantized rows: the bytes, their format, and per-row scales where the format has them.

    Args:
        data: ``(vocab_size, fmt.row_bytes(dim))`` uint8 rows, C-contiguous,
            on the host (numpy, np.memmap, a torch CPU tensor, a JAX CPU
            array) or a GPU (cupy, a torch CUDA tensor).
        fmt: a :class:`BlockFormat` or its name.
        dim: values per row.
        scales: ``(vocab_size,)`` float32 beside `data` for ``row_scale`` formats, else None.

    Shape:
        ``shape`` is ``(vocab_size, dim)``, what the rows dequantize to.

    Raises:
        TypeError: a `dim` that is not an integer; arrays of the wrong kind or
            dtype; a row-scale format without scales; a subclass of QuantizedTable
            (the API dispatches on this exact type).
        ValueError: shapes that do not fit the format (see fastembed.validate).

    Example:
        >>> import numpy as np
        >>> from fastembed.formats import QuantizedTable
        >>> QuantizedTable(np.zeros((10, 68), np.uint8), "q8_0", 64).shape
        (10, 64)
    """

    __slots__ = ("data", "format", "dim", "scales")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("QuantizedTable cannot be subclassed: fastembed recognises quantized tables by their exact "
                        "type; keep a QuantizedTable in an attribute of your class instead")

    def __init__(self, data: Any, fmt: BlockFormat | str, dim: int, scales: Any = None) -> None:
        from .validate import check_quantized, quantized_dim

        self.format = block_format(fmt)
        self.data = data
        self.dim = quantized_dim(dim)
        self.scales = scales
        check_quantized(self)

    @classmethod
    def _checked(cls, data: Any, fmt: BlockFormat, dim: int, scales: Any) -> QuantizedTable:
        """A QuantizedTable of arrays the caller has already checked as the constructor would (a call's snapshot)."""
        table = object.__new__(cls)
        table.data, table.format, table.dim, table.scales = data, fmt, dim, scales
        return table

    @property
    def shape(self) -> tuple[int, int]:
        """``(vocab_size, dim)``."""
        return (int(self.data.shape[0]), self.dim)

    @property
    def nbytes(self) -> int:
        """Bytes held: the rows plus the scales."""
        return int(self.data.nbytes) + (0 if self.scales is None else int(self.scales.nbytes))

    def __repr__(self) -> str:
        return f"QuantizedTable({self.format.name}, vocab_size={self.shape[0]}, dim={self.dim})"


def row_bytes(table: Any) -> int:
    """Bytes one row of `table` occupies in memory (the rows' bytes only, scales aside).

    Args:
        table: a 2-D array of any library with ``shape`` and ``dtype``, or a :class:`QuantizedTable`.

    Returns:
        ``dim x itemsize`` for a dense table, the row's block bytes for a quantized one.

    Example:
        >>> import numpy as np
        >>> from fastembed.formats import row_bytes
        >>> row_bytes(np.ones((4, 8), np.float16))
        16
    """
    if isinstance(table, QuantizedTable):
        return int(table.data.shape[1])
    return int(table.shape[1]) * int(table.dtype.itemsize)
