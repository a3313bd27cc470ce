"""The compiled CPU dequantizing gathers (Numba): rows of a block format to float32, float16 or bfloat16.

Importing this module imports numba; only the numba backend does so, lazily.

Contract of :func:`dequantize_serial` (as the gather kernels of
:mod:`.gather_cpu`; :func:`dequantize_range` is its row loop, which the
numba backend runs on one block of rows per thread, after its own scan of
the ids against :func:`readable_rows`):

- ``fmt`` is the format's code, :data:`FORMAT_CODES`; each format compiles
  kernels of its own, with its decoder alone (its marker:
  :data:`FORMAT_MARKERS`);
- ``data`` is the table's rows as ``(vocab_size, row_bytes)`` uint8, C-contiguous;
- ``scales`` is the bytes of the ``(vocab_size,)`` float32 row scales of a
  ``row_scale`` format (fp8_e4m3) as ``(4 * vocab_size,)`` uint8, at any
  address (a file may place them at an odd byte), else an empty uint8 array;
- ``ids`` is 1-D int32 or int64;
- ``out`` is ``(ids.size, dim)``, C-contiguous: float32, or uint16 holding
  the bits of float16 or bfloat16 values as ``mode`` says (:data:`FLOAT16`,
  :data:`BFLOAT16`, :data:`FLOAT16_BITS`); Numba has no float16 on the CPU;
  each ``mode`` compiles a kernel of its own (float32 outputs ignore it);
- the values are bit for bit :func:`fastembed.formats.dequantize_rows`:
  float32 arithmetic in the reference's order, never fused (no fast-math),
  then rounded to the nearest float16 or bfloat16, ties to even, as numpy
  and ml_dtypes round (subnormals, overflow to infinity, NaN); q8_0 into
  float16 with AVX512-FP16 is a float16 multiply of d and q, which rounds
  their exact product once, as the reference does
  (:data:`Q8_0_FLOAT16_ARITHMETIC`);
- the return value is -1 on success, else the position of the first id
  outside ``[0, vocab_size)``, with nothing written to ``out`` (the ids are
  scanned first, in the same compiled call); a row whose id another thread
  changed to one out of range after the scan is skipped, never read, and
  the return value is :data:`CHANGED_DURING_COPY`.

Each row is dequantized :data:`CHUNK` values at a time, each block by one
piece of vector IR (an intrinsic) that stores its values into the output
row itself (float32, or float16 or bfloat16 rounded in the same
registers); the test-only mode :data:`FLOAT16_BITS` (float16 by bit
operations on any CPU) goes through a float32 buffer on the stack and is
rounded and stored eight values at a time, also as vector IR: numba runs no SLP vectorizer, and fixed-size loops
over a block would stay scalar. Inside a row everything
is addressed by plain integers (the rows, the buffer, the output), so no
array is passed, or reference-counted, per chunk. With
``stream``, the stores are non-temporal (``out`` 16-byte aligned, rows a
multiple of 16 bytes: :func:`.gather_cpu.can_stream`); with AVX-512F the
blocks' values go out a whole cache line per store, through a line buffer
on each thread's stack, where the rows start inside a line
(:data:`LINES_BY_PERMUTE`). float16
conversions use the CPU's instructions where numba compiles for them
(x86-64 with F16C: :data:`HARDWARE_FLOAT16`), else integer bit operations;
both round alike. Values bound for 16-bit outputs are looked up instead
where a table is small and the CPU can index it in registers: each
fp8_e4m3 row of 128 values or more gets its 128 magnitudes times its scale
(AVX-512BW: :data:`FP8_TABLE_LOOKUP`), each q4_0 and q4_1 block and each
q4_k sub-block its 16 possible values (AVX2 byte shuffles, AVX-512BW word
permutes: :data:`NIBBLE_TABLE_LOOKUP`, :data:`NIBBLE_WORD_PERMUTE`; q4_k
into float16 not with AVX-512F alone: :data:`Q4_K_FLOAT16_BY_TABLE`),
computed by the decode's own float32 operations and rounded once into a
table, and every value is its code's entry (an fp8_e4m3 value with its sign
applied). Elsewhere the same lookups compile to lane-by-lane code, which
only the tests run. Multi-byte fields are read little-endian, as numba's
CPU targets are.

Where the pieces live: :mod:`.dequant_ir` (the codes, the CPU features,
loads, stores, vectors and roundings as LLVM IR), :mod:`.dequant_blocks`
(each block format's values), :mod:`.dequant_lookups` (16-bit outputs by
table lookup); this module puts them together into chunks, rows and the
two kernels. Each chunk's decoder and puts are chosen by the format, the
output's type and the mode while numba types a kernel (:func:`_put_chunk`;
the kernels compile once per format, output type and ``mode``): numba
compiles every function a kernel calls, reached or not, so a kernel for
q4_k rows into float32 outputs compiles only q4_k's decoder and the
float32 puts. numba's
on-disk cache stamps a compiled kernel with this file only: after an edit
of one of the pieces, clear the cache (the ``.nbi`` and ``.nbc`` files in
``__pycache__``, or ``NUMBA_CACHE_DIR``), or the old machine code keeps
serving (the test suite keys its own cache by the sources of every kernel
module).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import literally, njit
from numba.core import types
from numba.extending import intrinsic, overload

from .cpu_intrinsics import prefetch, store_fence
from .dequant_blocks import (
    FP8_E4M3_FACTOR_OF_SCALE,
    _fp8_e4m3_32,
    _fp8_e4m3_32_bits,
    _q4_0_block,
    _q4_1_block,
    _q4_k_block,
    _q5_0_block,
    _q5_1_block,
    _q5_k_block,
    _q6_k_block,
    _q8_0_block,
)
from .dequant_ir import (
    _JIT,
    _TO_BFLOAT16,
    _TO_FLOATS,
    _TO_HALVES,
    _TO_LINED_BFLOAT16,
    _TO_LINED_FLOATS,
    _TO_LINED_HALVES,
    _TO_STREAMED_BFLOAT16,
    _TO_STREAMED_FLOATS,
    _TO_STREAMED_HALVES,
    _X86,
    BFLOAT16,
    FLOAT16,
    FLOAT16_BITS,
    FLOAT16_CONVERSION,
    FORMAT_CODES,
    FP8_E4M3,
    FP8_TABLE_LOOKUP,
    HARDWARE_FLOAT16,
    LINE_BUFFER_FLOATS,
    LINES_BY_PERMUTE,
    NIBBLE_TABLE_LOOKUP,
    NIBBLE_WORD_PERMUTE,
    Q4_0,
    Q4_1,
    Q4_K,
    Q4_K_FLOAT16_BY_TABLE,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_0_FLOAT16_ARITHMETIC,
    TO_16_BITS,
    VECTOR_REGISTERS,
    _byte,
    _float16_fast,
    _load_f32,
    _load_f32_anywhere,
    _stack_floats,
    _store_bfloat16,
    _store_f32,
    _store_float16,
    _store_float16_bits,
    _store_u16,
    _stream_bfloat16,
    _stream_float16,
    _stream_float16_bits,
    _word,
    bfloat16_bits,
    close_lines,
    float16_bits,
    fp8_e4m3_value,
    half_at,
    open_lines,
)
from .dequant_lookups import (
    NIBBLES_LOOKED_UP,
    _fill_fp8_e4m3_table,
    _fp8_e4m3_by_table,
    _fp8_e4m3_fill_table,
    _nibbles_by_table,
)
from .gather_cpu import CHANGED_DURING_COPY, first_bad_position

#: What callers read from this module: the kernels, the codes they take, the facts of how they were compiled,
#: and the conversions the tests check on their own.
__all__ = [
    "BFLOAT16", "CHANGED_DURING_COPY", "CHUNK", "FLOAT16", "FLOAT16_BITS", "FLOAT16_CONVERSION", "FORMAT_CODES",
    "FORMAT_MARKERS", "FP8_TABLE_LOOKUP", "HARDWARE_FLOAT16", "LINES_BY_PERMUTE", "NIBBLE_TABLE_LOOKUP",
    "NIBBLE_WORD_PERMUTE", "Q4_K_FLOAT16_BY_TABLE", "Q8_0_FLOAT16_ARITHMETIC",
    "TO_16_BITS", "VECTOR_REGISTERS", "bfloat16_bits", "dequantize_range", "readable_rows", "dequantize_serial",
    "float16_bits", "streams_well",
    "fp8_e4m3_by_bits", "fp8_e4m3_value", "looked_up", "round_to_halves", "widen_halves",
]

#: Values dequantized per step: one K-quant block, eight 32-value blocks.
CHUNK = 256

# -- the format, as a type ----------------------------------------------------------------------------------
# A format passed as a value compiles every decoder into each kernel (numba compiles what a kernel calls, reached or
# not), and as a literal is typed anew on every call from Python; as the type of a marker, one kernel per format.
# The marker's scalar dtype names the format, not a record type: numba names a record type in compiled code by a
# number each process counts anew, and a kernel loaded from numba's cache links each function it calls to one of
# the same name the process already holds, so it could run another format's row loop.

#: The dtype of each format's marker, by format code.
_MARKER_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float32")
#: Each format code's marker: an empty array of the format's dtype.
FORMAT_MARKERS = {code: np.empty(0, np.dtype(_MARKER_DTYPES[code])) for code in FORMAT_CODES.values()}


def _marked_code(marker: Any) -> int:
    """The format code a marker's numba type names (while numba types a kernel)."""
    return _MARKER_DTYPES.index(str(marker.dtype))


@intrinsic
def _format_code(typingctx, marker):
    """The code of the format `marker` names, as a constant of the compiled code (LLVM drops the others' paths)."""
    code = _marked_code(marker)

    def codegen(context, builder, signature, args):
        return context.get_constant(types.intp, code)

    return types.intp(marker), codegen


# -- one chunk of one row ----------------------------------------------------------------------------
# Each dequantizes the blocks (or `count` values) whose bytes start at address `source` and puts them at
# `destination` as `put` says (see dequant_ir._block): as float32 into the output row or the buffer there, or rounded
# to float16 into the output row there. `put` must be a literal (numba compiles a version per value).


@njit(**_JIT)
def _value_bytes(put):
    return 4 if put == _TO_FLOATS or put == _TO_STREAMED_FLOATS or put == _TO_LINED_FLOATS else 2


@njit(**_JIT)
def _q8_0(source, count, scale, destination, put, lines):
    # d: f16 | 32 x int8
    literally(put)
    for block in range(count // 32):
        at = source + 34 * block
        _q8_0_block(put, lines, destination + 32 * _value_bytes(put) * block, at + 2, at)


@njit(**_JIT)
def _q4_0(source, count, scale, destination, put, lines):
    # d: f16 | 16 bytes, values j and j + 16 in the low and high nibble of byte j
    literally(put)
    for block in range(count // 32):
        at = source + 18 * block
        _q4_0_block(put, lines, destination + 32 * _value_bytes(put) * block, at + 2, at)


@njit(**_JIT)
def _q4_1(source, count, scale, destination, put, lines):
    # d: f16 | m: f16 | 16 bytes of nibbles as Q4_0
    literally(put)
    for block in range(count // 32):
        at = source + 20 * block
        _q4_1_block(put, lines, destination + 32 * _value_bytes(put) * block, at + 4, at)


@njit(**_JIT)
def _q5_0(source, count, scale, destination, put, lines):
    # d: f16 | qh: 4 bytes, bit j the fifth bit of value j | 16 bytes of nibbles
    literally(put)
    for block in range(count // 32):
        at = source + 22 * block
        _q5_0_block(put, lines, destination + 32 * _value_bytes(put) * block, at + 6, at, _word(at + 2))


@njit(**_JIT)
def _q5_1(source, count, scale, destination, put, lines):
    # d: f16 | m: f16 | qh: 4 bytes | 16 bytes of nibbles
    literally(put)
    for block in range(count // 32):
        at = source + 24 * block
        _q5_1_block(put, lines, destination + 32 * _value_bytes(put) * block, at + 8, at, _word(at + 4))


@njit(**_JIT)
def _fp8_e4m3(source, count, scale, destination, put, lines):
    # one float8_e4m3fn per value; value * the row's scale
    literally(put)
    whole = count - count % 32
    factor = scale * np.float32(FP8_E4M3_FACTOR_OF_SCALE)
    if math.isinf(factor) and math.isfinite(scale):
        whole = 0  # a scale within 2**8 of float32's largest: the factor overflows, so every value goes one by one
    for j in range(0, whole, 32):
        _fp8_e4m3_32(put, lines, destination + _value_bytes(put) * j, source + j, factor)
    for j in range(whole, count):
        value = fp8_e4m3_value(_byte(source + j)) * scale
        if _value_bytes(put) == 4:
            _store_f32(destination + 4 * j, value)
        elif put == _TO_BFLOAT16 or put == _TO_STREAMED_BFLOAT16 or put == _TO_LINED_BFLOAT16:
            _store_u16(destination + 2 * j, bfloat16_bits(value))
        else:
            _store_u16(destination + 2 * j, _float16_fast(value))


@njit(**_JIT)
def _q4_k(source, count, scale, destination, put, lines):
    literally(put)
    _q4_k_block(put, lines, destination, source)  # one block of 256 values (see dequant_blocks._q4_k_body)


@njit(**_JIT)
def _q5_k(source, count, scale, destination, put, lines):
    literally(put)
    _q5_k_block(put, lines, destination, source)


@njit(**_JIT)
def _q6_k(source, count, scale, destination, put, lines):
    literally(put)
    _q6_k_block(put, lines, destination, source)


#: Each format's chunk: the functions above, by format code. A kernel calls its format's alone (:func:`_put_chunk`).
#: The K-quant chunks decode one block of 256 values: :data:`CHUNK` values.
_CHUNK_OF_FORMAT = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q4_K: _q4_k, Q5_K: _q5_k,
                    Q6_K: _q6_k, FP8_E4M3: _fp8_e4m3}


# -- float32 values to the output ---------------------------------------------------------------------


@njit(**_JIT)
def _emit(buf, destination, count, mode, stream):
    """Store the `count` float32 at address `buf` at address `destination` as the 16-bit values `mode` says.

    Streaming needs a 16-byte aligned `destination` and a multiple of 16 bytes.
    """
    whole = count - count % 8
    if stream:
        if mode == FLOAT16:
            for k in range(0, whole, 8):
                _stream_float16(destination + 2 * k, buf + 4 * k)
        elif mode == BFLOAT16:
            for k in range(0, whole, 8):
                _stream_bfloat16(destination + 2 * k, buf + 4 * k)
        else:
            for k in range(0, whole, 8):
                _stream_float16_bits(destination + 2 * k, buf + 4 * k)
    elif mode == FLOAT16:
        for k in range(0, whole, 8):
            _store_float16(destination + 2 * k, buf + 4 * k)
    elif mode == BFLOAT16:
        for k in range(0, whole, 8):
            _store_bfloat16(destination + 2 * k, buf + 4 * k)
    else:
        for k in range(0, whole, 8):
            _store_float16_bits(destination + 2 * k, buf + 4 * k)
    for j in range(whole, count):  # the last values of a row whose dim is not a multiple of 8 (fp8_e4m3 only)
        value = np.float32(_load_f32(buf + 4 * j))
        if mode == FLOAT16:
            bits = _float16_fast(value)
        elif mode == BFLOAT16:
            bits = bfloat16_bits(value)
        else:
            bits = float16_bits(value)
        _store_u16(destination + 2 * j, bits)


@njit(**_JIT)
def _no_fence():
    pass


_fence = store_fence if _X86 else _no_fence  # SFENCE is an x86 instruction; other CPUs never stream here

# -- the conversions alone, for tests ------------------------------------------------------------------


@njit(**_JIT)
def round_to_halves(values, out, mode, stream):
    """out[j] = the bits of float32 values[j] as float16 or bfloat16 (`mode`), by the kernels' own conversion code.

    `values` float32 and `out` uint16, 1-D, of one size; with `stream`,
    `out` 16-byte aligned and its size a multiple of 8.
    """
    buf = np.intp(_stack_floats(CHUNK))
    for first in range(0, values.size, CHUNK):
        count = min(CHUNK, values.size - first)
        for j in range(count):
            _store_f32(buf + 4 * j, values[first + j])
        _emit(buf, np.intp(out.ctypes.data) + 2 * first, count, mode, stream)
    if stream:
        _fence()
    return out


@njit(**_JIT)
def fp8_e4m3_by_bits(codes, scale, out):
    """out[j] = float8_e4m3fn codes[j] (uint8, a multiple of 32) times scale by the integer-bit vector code, for tests."""
    for j in range(0, codes.size, 32):
        _fp8_e4m3_32_bits(_TO_FLOATS, 0, np.intp(out.ctypes.data) + 4 * j, np.intp(codes.ctypes.data) + j, scale)
    return out


@njit(**_JIT)
def looked_up(fmt, row, scale, out, mode, stream):
    """out = one row of format `fmt` (uint8 bytes) as 16-bit `mode` values by the table lookups, on any CPU, for tests.

    fp8_e4m3 (`scale` its row's, finite) or a 4-bit format (`scale`
    unused, `mode` FLOAT16 or BFLOAT16: the kernels decode FLOAT16_BITS);
    `out` uint16 of the row's size; with `stream`, 16-byte aligned.
    """
    source, destination = np.intp(row.ctypes.data), np.intp(out.ctypes.data)
    lined = stream and LINES_BY_PERMUTE
    lines = np.intp(_stack_floats(LINE_BUFFER_FLOATS)) if lined else np.intp(0)
    if lined:
        open_lines(lines)
    if fmt == FP8_E4M3:
        table = np.intp(_stack_floats(64))
        _fill_fp8_e4m3_table(table, scale, mode)
        _fp8_e4m3_by_table(source, out.size, table, destination, stream, lines)
    else:
        _nibbles_by_table(fmt, source, out.size, destination, mode, stream, lines)
    if lined:
        close_lines(lines)
    if stream:
        _fence()
    return out


@njit(**_JIT)
def widen_halves(halves, out):
    """out[j] = the float16 with bits halves[j] as float32 by :func:`half_at` (the bit operations), for tests."""
    for j in range(halves.size):
        out[j] = half_at(np.intp(halves.ctypes.data) + 2 * j)
    return out


# -- one chunk into an output row, by the output's type and mode ------------------------------------------


def _put_chunk(out, marker, source, count, scale, position, mode, stream, lines, buf, table, row_by_table,
               by_nibble_table):
    """Typed inside the kernels only (the overload below); Python never calls it."""
    raise TypeError("_put_chunk runs inside the compiled kernels only")


@njit(inline="always", **_JIT)
def _put_by_stores(chunk, source, count, scale, position, stream, lines, plain, streamed, lined):
    """The chunk's values at `position`, decoded by `chunk` (a format's, above) with the put of the row's stores:
    `lined` (a line buffer at `lines`), `streamed` or `plain` (each a literal)."""
    if lines != 0:
        chunk(source, count, scale, position, lined, lines)
    elif stream:
        chunk(source, count, scale, position, streamed, lines)
    else:
        chunk(source, count, scale, position, plain, lines)


def _chunk_puts(code: int, plain: int, streamed: int, lined: int, looked_up: bool) -> Any:
    """The implementation of :func:`_put_chunk` for format `code` that decodes with that format's chunk and puts
    with `plain`, `streamed` or `lined` (the stores the row takes), after the format's 16-bit table lookups where
    `looked_up` and the row or block allows them (fp8_e4m3: the row's table; the 4-bit formats: each block's).

    The format's chunk is called by itself, not through a function that takes the format's marker: an array
    argument costs a reference count per call, an atomic instruction, which waits for the streamed stores.
    """
    chunk = _CHUNK_OF_FORMAT[code]
    if looked_up and code == FP8_E4M3:
        def with_row_table(out, marker, source, count, scale, position, mode, stream, lines, buf, table, row_by_table,
                           by_nibble_table):
            if row_by_table:
                _fp8_e4m3_by_table(source, count, table, position, stream, lines)
            else:
                _put_by_stores(chunk, source, count, scale, position, stream, lines, plain, streamed, lined)

        return with_row_table
    if looked_up and code in NIBBLES_LOOKED_UP:
        nibbles_looked_up, block_values = NIBBLES_LOOKED_UP[code]

        def with_block_tables(out, marker, source, count, scale, position, mode, stream, lines, buf, table,
                              row_by_table, by_nibble_table):
            if by_nibble_table:
                nibbles_looked_up(mode, stream, lines, position, source, count // block_values)
            else:
                _put_by_stores(chunk, source, count, scale, position, stream, lines, plain, streamed, lined)

        return with_block_tables

    def by_stores(out, marker, source, count, scale, position, mode, stream, lines, buf, table, row_by_table,
                  by_nibble_table):
        _put_by_stores(chunk, source, count, scale, position, stream, lines, plain, streamed, lined)

    return by_stores


#: _put_chunk's implementations hold compiled functions, which numba's cache would key anew in each process, so
#: they are not cached by themselves (the kernels they are inlined into are).
_JIT_NOT_CACHED: Any = {**_JIT, "cache": False}


# Inlined into the row loop: a call of its own per chunk slowed the formats whose blocks decode fastest.
@overload(_put_chunk, inline="always", prefer_literal=True, jit_options=_JIT_NOT_CACHED)
def _put_chunk_for_output(out, marker, source, count, scale, position, mode, stream, lines, buf, table, row_by_table,
                          by_nibble_table):
    """The chunk's `count` values at address `source` into the row at address `position` of `out`: float32 puts
    for a float32 `out`; for a uint16 `out`, the table lookups of the format `marker` names where the row allows them,
    else the puts of `mode` (float16, bfloat16, or FLOAT16_BITS through the float32 buffer at address `buf`).

    Chosen by `out`'s type, the format and `mode`'s value while numba types the kernel: numba compiles every
    function a kernel calls, whether or not a call can run, so one body for every output would compile each
    format's puts for all.
    """
    code = _marked_code(marker)
    if out.dtype.bitwidth == 32:
        return _chunk_puts(code, _TO_FLOATS, _TO_STREAMED_FLOATS, _TO_LINED_FLOATS, looked_up=False)
    mode_value = getattr(mode, "literal_value", None)  # None: not a literal, which no kernel passes
    if mode_value == FLOAT16:
        return _chunk_puts(code, _TO_HALVES, _TO_STREAMED_HALVES, _TO_LINED_HALVES, looked_up=True)
    if mode_value == BFLOAT16:
        return _chunk_puts(code, _TO_BFLOAT16, _TO_STREAMED_BFLOAT16, _TO_LINED_BFLOAT16, looked_up=True)
    chunk = _CHUNK_OF_FORMAT[code]
    if mode_value == FLOAT16_BITS and code == FP8_E4M3:
        def by_bits_or_row_table(out, marker, source, count, scale, position, mode, stream, lines, buf, table,
                                 row_by_table, by_nibble_table):
            if row_by_table:
                _fp8_e4m3_by_table(source, count, table, position, stream, lines)
            else:
                chunk(source, count, scale, buf, _TO_FLOATS, lines)
                _emit(buf, position, count, mode, stream)

        return by_bits_or_row_table
    if mode_value == FLOAT16_BITS:
        def by_bits(out, marker, source, count, scale, position, mode, stream, lines, buf, table, row_by_table,
                    by_nibble_table):
            chunk(source, count, scale, buf, _TO_FLOATS, lines)
            _emit(buf, position, count, mode, stream)

        return by_bits
    return None  # numba reports a typing error: no put for this mode


def _fill_row_table(marker, table, scale, mode):
    """Typed inside the kernels only (the overload below); Python never calls it."""
    raise TypeError("_fill_row_table runs inside the compiled kernels only")


@overload(_fill_row_table, inline="always", prefer_literal=True, jit_options=_JIT)  # type: ignore[arg-type]  # numba's stubs list neither cache nor boundscheck
def _fill_row_table_of_format(marker, table, scale, mode):
    """fp8_e4m3: the row's table at address `table`, its 128 magnitudes times `scale` as `mode` values (`mode` a
    literal: that mode's fill alone); the other formats have none (compiled into their kernels as nothing)."""
    if _marked_code(marker) != FP8_E4M3:
        def no_table(marker, table, scale, mode):
            pass

        return no_table

    def fill(marker, table, scale, mode):
        _fp8_e4m3_fill_table(mode, table, scale)

    return fill


# -- the kernels ----------------------------------------------------------------------------------------


@intrinsic
def _itemsize(typingctx, array):
    """The itemsize of an array's type, as a constant of the compiled code (so that LLVM drops the other types' paths)."""
    size = array.dtype.bitwidth // 8

    def codegen(context, builder, signature, args):
        return context.get_constant(types.intp, size)

    return types.intp(array), codegen


@njit(**_JIT)
def readable_rows(fmt, data, scales):
    """Rows that may be read: of `data`, and of `scales` for a row-scale format."""
    return min(data.shape[0], scales.shape[0] // 4) if fmt == FP8_E4M3 else data.shape[0]


@njit(**_JIT)
def _dequantize_rows(marker, data, scales, ids, out, start, stop, mode, stream, prefetch_rows_ahead,
                     touch_pages_rows_ahead):
    """:func:`dequantize_range`, for `marker` a format's marker and `mode` a literal (its compile has that format's decoder
    and that mode's puts only)."""
    literally(mode)  # a compile per mode, each with its own puts only (_put_chunk)
    code: int = _format_code(marker)
    vocab_size = readable_rows(code, data, scales)
    dim = out.shape[1]
    word: int = _itemsize(out)
    row_bytes = data.shape[1]
    rows = np.intp(data.ctypes.data)
    scale_bytes = np.intp(scales.ctypes.data)
    destination = np.intp(out.ctypes.data)
    buf = np.intp(_stack_floats(CHUNK))
    table = np.intp(_stack_floats(64))  # 128 16-bit entries
    # Streamed rows that start inside a cache line go out a line at a time through a line buffer (dequant_ir); a
    # separate compiled path, so that line-aligned rows run the plain one. `lines` 0: none.
    lined = stream and LINES_BY_PERMUTE and (destination % 64 != 0 or (dim * word) % 64 != 0)
    lines = np.intp(_stack_floats(LINE_BUFFER_FLOATS)) if lined else np.intp(0)
    if lined:
        open_lines(lines)
    # a table of 128 entries pays for itself on rows of at least as many values
    by_table = FP8_TABLE_LOOKUP and code == FP8_E4M3 and word == 2 and dim >= 128
    by_nibble_table = NIBBLE_TABLE_LOOKUP and word == 2 and mode != FLOAT16_BITS and (
        code == Q4_0 or code == Q4_1 or (code == Q4_K and (mode == BFLOAT16 or Q4_K_FLOAT16_BY_TABLE)))
    # A chunk's bytes: CHUNK values are whole blocks of every format, so each chunk starts where the last ended
    # (no division per chunk).
    chunk_bytes = CHUNK * row_bytes // dim if dim else 0
    skipped = 0
    for i in range(start, stop):
        if touch_pages_rows_ahead > 0:
            far = rows + np.intp(ids[min(i + touch_pages_rows_ahead, stop - 1)]) * row_bytes
            for page in range(0, row_bytes + 4095, 4096):  # the row's last byte's page too
                prefetch(far + min(page, row_bytes - 1))
        row = ids[i]
        if row < 0 or row >= vocab_size:
            skipped += 1
            continue
        source = rows + np.intp(row) * row_bytes
        ahead = rows + np.intp(ids[min(i + prefetch_rows_ahead, stop - 1)]) * row_bytes
        scale = _load_f32_anywhere(scale_bytes + 4 * np.intp(row)) if code == FP8_E4M3 else np.float32(1)
        row_by_table = by_table and scale - scale == 0  # finite
        if row_by_table:
            _fill_row_table(marker, table, scale, mode)
        begin = 0
        for first in range(0, dim, CHUNK):
            count = min(CHUNK, dim - first)
            end = min(begin + chunk_bytes, row_bytes)
            if prefetch_rows_ahead > 0:
                for byte in range(begin, end, 64):
                    prefetch(ahead + byte)
            position = destination + (np.intp(i) * dim + first) * word
            _put_chunk(out, marker, source + begin, count, scale, position, mode, stream, lines, buf, table,
                       row_by_table, by_nibble_table)
            begin = end
    if lined:
        close_lines(lines)
    if stream:
        _fence()
    return skipped


@njit(**_JIT)
def _dequantize_serial(marker, data, scales, ids, out, mode, stream, prefetch_rows_ahead, touch_pages_rows_ahead):
    """Dequantize on the calling thread."""
    literally(mode)
    bad = first_bad_position(ids, readable_rows(_format_code(marker), data, scales))
    if bad >= 0:
        return bad
    # np.intp(0): a literal 0 would type, and compile, a second row loop beside the one the backend calls
    if _dequantize_rows(marker, data, scales, ids, out, np.intp(0), ids.size, mode, stream, prefetch_rows_ahead,
                        touch_pages_rows_ahead):
        return CHANGED_DURING_COPY
    return -1


# -- the kernels of each mode ---------------------------------------------------------------------------------
# Python calls these: a kernel that takes the mode as a literal would be typed anew, at compile cost, on every call
# from Python, where each of these passes its mode as a constant of its own compiled code. float32 outputs take the
# float16 ones (the backend passes FLOAT16 for them). Each compiles once per format: `marker` is the format's.


@njit(**_JIT)
def _rows_float16(marker, data, scales, ids, out, start, stop, stream, prefetch_rows_ahead, touch_pages_rows_ahead):
    return _dequantize_rows(marker, data, scales, ids, out, start, stop, FLOAT16, stream, prefetch_rows_ahead,
                            touch_pages_rows_ahead)


@njit(**_JIT)
def _rows_bfloat16(marker, data, scales, ids, out, start, stop, stream, prefetch_rows_ahead, touch_pages_rows_ahead):
    return _dequantize_rows(marker, data, scales, ids, out, start, stop, BFLOAT16, stream, prefetch_rows_ahead,
                            touch_pages_rows_ahead)


@njit(**_JIT)
def _rows_float16_bits(marker, data, scales, ids, out, start, stop, stream, prefetch_rows_ahead,
                       touch_pages_rows_ahead):
    return _dequantize_rows(marker, data, scales, ids, out, start, stop, FLOAT16_BITS, stream, prefetch_rows_ahead,
                            touch_pages_rows_ahead)


@njit(**_JIT)
def _serial_float16(marker, data, scales, ids, out, stream, prefetch_rows_ahead, touch_pages_rows_ahead):
    return _dequantize_serial(marker, data, scales, ids, out, FLOAT16, stream, prefetch_rows_ahead, touch_pages_rows_ahead)


@njit(**_JIT)
def _serial_bfloat16(marker, data, scales, ids, out, stream, prefetch_rows_ahead, touch_pages_rows_ahead):
    return _dequantize_serial(marker, data, scales, ids, out, BFLOAT16, stream, prefetch_rows_ahead,
                              touch_pages_rows_ahead)


@njit(**_JIT)
def _serial_float16_bits(marker, data, scales, ids, out, stream, prefetch_rows_ahead, touch_pages_rows_ahead):
    return _dequantize_serial(marker, data, scales, ids, out, FLOAT16_BITS, stream, prefetch_rows_ahead,
                              touch_pages_rows_ahead)


_ROWS_OF_MODE = {FLOAT16: _rows_float16, BFLOAT16: _rows_bfloat16, FLOAT16_BITS: _rows_float16_bits}
_SERIAL_OF_MODE = {FLOAT16: _serial_float16, BFLOAT16: _serial_bfloat16, FLOAT16_BITS: _serial_float16_bits}


def dequantize_range(fmt, data, scales, ids, out, start, stop, mode, stream, prefetch_rows_ahead,
                     touch_pages_rows_ahead):
    """Rows [start, stop) of the output; returns the rows skipped because their id was out of range.

    The compiled row loop of `fmt`'s format and `mode` (each format's and
    each mode's compiles apart; float32 outputs ignore the mode). With ``prefetch_rows_ahead`` > 0, each chunk
    comes with prefetches of the same bytes of the row that many rows ahead
    (random rows defeat the hardware prefetcher); with
    ``touch_pages_rows_ahead`` > 0, each row starts with one prefetch per
    4 KiB page of the row that many rows ahead, so that its page
    translations are under way early. An address out of range there is a
    hint, never read.
    """
    return _ROWS_OF_MODE[mode](FORMAT_MARKERS[fmt], data, scales, ids, out, start, stop, stream,
                               prefetch_rows_ahead, touch_pages_rows_ahead)


def dequantize_serial(fmt, data, scales, ids, out, mode, stream, prefetch_rows_ahead, touch_pages_rows_ahead):
    """Dequantize on the calling thread, with the compiled kernel of `fmt` and `mode` (see :func:`dequantize_range`)."""
    return _SERIAL_OF_MODE[mode](FORMAT_MARKERS[fmt], data, scales, ids, out, stream, prefetch_rows_ahead,
                                 touch_pages_rows_ahead)


def streams_well(mode):
    """Whether the dequantizing kernels into outputs of `mode` (float32 outputs: FLOAT16's) should stream.

    Not into bfloat16 with 16 vector registers (:data:`VECTOR_REGISTERS`):
    there most decoders spill registers to their row loop's stack once per
    block (the rounding's constants on top of the decoder's). A load whose
    address matches an older queued store's in the low 12 bits waits for
    it, and streamed stores hold the stores behind them in the queue: in
    the processes where the decoder's constants and its spills meet in
    those bits, each block waits on the last one's spills. The measurements
    are in docs/backends.md ("Cached stores for the dequantizing row loops
    that spill"), made on one CPU with 16 registers (AMD Zen 3) and applied
    to all of them.
    Only x86-64 streams at all (the backend checks that first).

    Returns:
        False for bfloat16 outputs with 16 vector registers, else True.
    """
    return VECTOR_REGISTERS > 16 or mode != BFLOAT16
