"""Making tables: dtype names (bfloat16 through ml_dtypes), random tables, random quantized tables."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: For IEEE-like floats: (unsigned view, bits kept from the random word
#: (sign and mantissa), exponent bits that put every magnitude in [1/64, 1/32)).
#: Finite, never zero, random sign and mantissa: an embedding's scale.
_FLOAT_BITS = {
    "float16": ("u2", 0x83FF, 9 << 10),
    "bfloat16": ("u2", 0x807F, 121 << 7),
    "float32": ("u4", 0x807FFFFF, 121 << 23),
    "float64": ("u8", 0x800FFFFFFFFFFFFF, 1017 << 52),
}
#: Random 64-bit words generated per chunk (bounds the temporary: 64 MiB).
_CHUNK_WORDS = 8 * 2**20


def is_ml_dtype(dtype: np.dtype) -> bool:
    """A dtype of ml_dtypes (bfloat16, float8, int4, ...), which numpy sees as void (kind V) and other libraries lack."""
    return dtype.type.__module__ == "ml_dtypes"


def is_float_dtype(dtype: np.dtype) -> bool:
    """numpy floats and the ml_dtypes floats (bfloat16, float8): what casts to another float."""
    return dtype.kind == "f" or (is_ml_dtype(dtype) and "float" in dtype.name)


def _float_info(dtype: np.dtype) -> Any:
    """finfo of a numpy or ml_dtypes float dtype (of a complex dtype: of its parts)."""
    if is_ml_dtype(dtype):
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def is_integer_dtype(dtype: np.dtype) -> bool:
    """numpy integers and the ml_dtypes integers (int4, uint4, int2, ...)."""
    return dtype.kind in "iu" or (is_ml_dtype(dtype) and "int" in dtype.name)


def resolve_dtype(dtype: Any) -> np.dtype:
    """np.dtype(dtype), with "bfloat16" (and other ml_dtypes names) through ml_dtypes.

    Raises TypeError for anything that is not a dtype, naming the missing
    package when ml_dtypes is needed but absent.
    """
    try:
        return np.dtype(dtype)
    except (TypeError, ValueError) as error:  # numpy raises ValueError for some objects with a .dtype (a torch tensor)
        if not isinstance(dtype, str):
            raise TypeError(f"{dtype!r} is not a dtype: {error}") from None
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"dtype {dtype!r} needs the ml_dtypes package (pip install ml_dtypes)") from None
    scalar_type = getattr(ml_dtypes, dtype, None)
    if not (isinstance(scalar_type, type) and issubclass(scalar_type, np.generic)):  # not finfo, __name__, ...
        raise TypeError(f"unknown dtype {dtype!r}: neither numpy nor ml_dtypes {ml_dtypes.__version__} has it "
                        "(ml_dtypes adds dtypes in newer versions: pip install -U ml_dtypes)")
    return np.dtype(scalar_type)


def random_table(
    vocab_size: int, dim: int, dtype: Any = "float16", seed: int = 0, progress: Callable[[float], None] | None = None
) -> np.ndarray:
    """A (vocab_size, dim) C-contiguous table of random values of `dtype`.

    float16/bfloat16/float32/float64: random sign and mantissa, magnitudes in
    [1/64, 1/32) (finite, never zero); other floats (float8, float6, float4,
    long double) and both parts of complex values: float32 values in that
    range (raised to the dtype's smallest positive value where that is
    larger), of random sign where the dtype has negative values, cast; other
    dtypes: uniformly random bytes (integers uniform over their range). A
    dtype in the other byte order holds the same values as the machine's.
    ``progress(fraction)`` is called as the random bytes are generated.
    """
    dtype = resolve_dtype(dtype)
    if not dtype.isnative:  # the bit patterns below are in the machine's order
        return random_table(vocab_size, dim, dtype.newbyteorder("="), seed, progress).byteswap(inplace=True).view(dtype)
    table = np.empty((vocab_size, dim), dtype=dtype)
    _fill_random_bytes(table.reshape(-1).view(np.uint8), np.random.default_rng(seed), progress)
    if dtype.name in _FLOAT_BITS:
        view, keep, exponent = _FLOAT_BITS[dtype.name]
        bits = table.view(view)
        bits &= np.array(keep, dtype=view)
        bits |= np.array(exponent, dtype=view)
    elif dtype.kind == "c" or is_float_dtype(dtype):
        # Other floats (ml_dtypes float8/6/4, long double, complex): cast from float32 in [1/64, 1/32).
        info = _float_info(dtype)
        signs = np.array([-1.0, 1.0]) if float(info.min) < 0 else np.array([1.0])  # float8_e8m0fnu has no sign
        smallest = float(info.smallest_subnormal)  # float4 and float6 round that range to zero
        flat = table.reshape(-1)
        parts = 2 if dtype.kind == "c" else 1
        for start in range(0, flat.size, _CHUNK_WORDS):
            rng = np.random.default_rng([seed, start])
            shape = (flat[start : start + _CHUNK_WORDS].size, parts)
            magnitudes = np.maximum(rng.uniform(1 / 64, 1 / 32, shape), smallest)
            values = (magnitudes * rng.choice(signs, shape)).astype(np.float32)
            flat[start : start + _CHUNK_WORDS] = values[:, 0] if parts == 1 else values[:, 0] + 1j * values[:, 1]
    return table


def _fill_random_bytes(flat_bytes: np.ndarray, rng: np.random.Generator, progress: Callable[[float], None] | None) -> None:
    words = flat_bytes.size // 8
    for start in range(0, words, _CHUNK_WORDS):
        count = min(_CHUNK_WORDS, words - start)
        chunk = rng.integers(0, 2**64 - 1, count, dtype=np.uint64, endpoint=True)
        flat_bytes[8 * start : 8 * (start + count)] = chunk.view(np.uint8)
        if progress:
            progress((start + count) / words)
    tail = flat_bytes.size - 8 * words
    if tail:
        flat_bytes[8 * words :] = rng.integers(0, 256, tail, dtype=np.uint8)


#: Byte offsets of the float16 scale fields in a block of each GGUF layout.
_SCALE_FIELDS = {
    "q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
}


def random_quantized_table(fmt_name: str, vocab_size: int, dim: int, seed: int = 0) -> Any:
    """A :class:`fastembed.formats.QuantizedTable` of random blocks of `fmt_name`'s layout.

    Every byte is random except the float16 scale fields (finite: random sign
    and mantissa, magnitudes 2**-10 to 2**-3) and float8 NaN codes (zeroed);
    row scales are uniform in [1e-4, 1e-2). What a gather moves, and so its
    speed, does not depend on the values: benchmarks of the formats only
    llama.cpp writes use these, and tests use them as varied inputs.
    """
    from .formats import QuantizedTable, block_format

    fmt = block_format(fmt_name)
    rng = np.random.default_rng(seed)
    data = np.empty((vocab_size, fmt.row_bytes(dim)), dtype=np.uint8)
    _fill_random_bytes(data.reshape(-1), rng, None)
    blocks = data.reshape(-1, fmt.block_bytes)
    for offset in _SCALE_FIELDS.get(fmt.name, ()):
        bits = blocks[:, offset : offset + 2].view("<u2")
        bits &= np.uint16(0x83FF)  # sign and mantissa kept
        bits |= (rng.integers(5, 12, bits.shape, dtype=np.uint16) << 10).astype("<u2")
    scales = None
    if fmt.row_scale:
        data[(data & 0x7F) == 0x7F] = 0
        scales = rng.uniform(1e-4, 1e-2, vocab_size).astype(np.float32)
    return QuantizedTable(data, fmt, dim, scales)
