"""Helpers the tests share: random tables (never zeros), poisoned outputs, bit-exact comparison."""
from __future__ import annotations

import numpy as np

import fastembed

REFERENCE_IDS = [5237, 23872, 301, 16652, 19602, 1148]
#: The CPU backends that can run here, by name, in priority order.
CPU_BACKENDS = [status.name for status in fastembed.backends() if status.available and status.name != "cuda"]
POISON_BYTE = 0xA5


def random_table(vocab_size: int, dim: int, dtype="float16", seed: int = 0) -> np.ndarray:
    """A table of random values (never zeros for floats)."""
    return fastembed.Embedding.random(vocab_size, dim, dtype, seed).table


def poisoned(shape, dtype) -> np.ndarray:
    """An output buffer whose bytes are garbage, so an unwritten row cannot pass."""
    out = np.empty(shape, dtype=dtype)
    out.view(np.uint8).reshape(-1)[:] = POISON_BYTE
    return out


def assert_bit_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same shape, dtype and bytes."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(actual.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8))


#: Byte offsets of the float16 scale fields in each block format's block.
SCALE_FIELDS = {
    "q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
    "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "fp8_e4m3": (),
}


def random_quantized(fmt_name: str, vocab_size: int, dim: int, seed: int = 0):
    """A QuantizedTable of random bytes whose float16 scales are finite (magnitudes 2**-10..2**-3, random sign)."""
    from fastembed.formats import FORMATS, QuantizedTable

    fmt = FORMATS[fmt_name]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (vocab_size, fmt.row_bytes(dim)), dtype=np.uint8)
    blocks = data.reshape(-1, fmt.block_bytes)
    for offset in SCALE_FIELDS[fmt_name]:
        bits = (rng.integers(0, 2, blocks.shape[0]) << 15) | (rng.integers(5, 12, blocks.shape[0]) << 10)
        bits |= rng.integers(0, 1024, blocks.shape[0])
        blocks[:, offset : offset + 2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    scales = None
    if fmt.row_scale:
        data[(data & 0x7F) == 0x7F] = 0  # float8_e4m3fn NaNs
        scales = rng.uniform(1e-4, 1e-2, vocab_size).astype(np.float32)
    return QuantizedTable(data, fmt, dim, scales)
