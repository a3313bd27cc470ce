"""16-bit outputs looked up in small tables of a row's or a block's possible values, for :mod:`.dequant_cpu`.

Where the CPU can index a table in registers (AVX2 byte shuffles, AVX-512BW
word permutes), each fp8_e4m3 row's 128 magnitudes times its scale, and
each q4_0 or q4_1 block's or q4_k sub-block's 16 values, are computed by
the decode's own float32 operations and rounded once into a table; every
value is then its code's entry. Elsewhere the same lookups compile lane by
lane (only the tests run that code).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from .dequant_blocks import _FP8_E4M3_VALUES, _f32, _k_scales
from .dequant_ir import (
    _ADDRESS,
    _F32,
    _FLOAT16_LANES,
    _I8,
    _I16,
    _I32,
    _JIT,
    BFLOAT16,
    FLOAT16,
    FLOAT16_BITS,
    FP8_TABLE_LOOKUP,
    LINES_BY_PERMUTE,
    NIBBLE_TABLE_LOOKUP,
    NIBBLE_WORD_PERMUTE,
    Q4_0,
    Q4_1,
    Q4_K,
    _bfloat16_lanes,
    _byte,
    _constant,
    _float16_bits_lanes,
    _load,
    _nibbles,
    _put_vector,
    _splat_half,
    _store,
    _store_u16,
    _u16_at,
    _vector,
)

# -- fp8_e4m3 rows into 16-bit outputs, by table lookup -----------------------------------------------
# A row's 128 magnitudes times its scale, rounded once into a table of 16-bit outputs; each value is then
# its magnitude's entry with the sign bit flipped by the code's. Rounding is symmetric and, for a finite
# scale, (-v) * scale is -(v * scale) (a NaN code keeps its sign), so every entry is the value the decode
# would give. A non-finite scale breaks that symmetry (0 * inf is x86's negative NaN): such rows are decoded.

_LANES_OF_MODE = {FLOAT16: _FLOAT16_LANES, BFLOAT16: _bfloat16_lanes, FLOAT16_BITS: _float16_bits_lanes}


@intrinsic(prefer_literal=True)
def _fp8_e4m3_fill_table(typingctx, mode, table, scale):
    """Write at address `table` the 128 16-bit outputs (`mode`, a literal) of magnitudes 0-127 times `scale`."""
    if not isinstance(mode, types.IntegerLiteral):
        return None
    lanes = _LANES_OF_MODE[mode.literal_value]

    def codegen(context, builder, signature, args):
        _, table, scale = args
        for k in range(4):
            codes = _constant(_I8, 32, list(range(32 * k, 32 * k + 32)))
            _store(builder, builder.add(table, table.type(64 * k)), lanes(builder, _FP8_E4M3_VALUES(builder, codes, scale)))
        return context.get_dummy_value()

    return types.void(mode, _ADDRESS, _f32), codegen


def _lane_by_lane(builder, table, index):
    """Lane j: entry index[j] % len(table) of `table` (a vector), one lane at a time: any CPU compiles it."""
    n, result = table.type.count, ir.Constant(index.type, None)
    for j in range(index.type.count):
        at = builder.and_(builder.extract_element(index, _I32(j)), index.type.element(n - 1))
        result = builder.insert_element(result, builder.extract_element(table, at), _I32(j))
    return result


def _word_permute(builder, low, index, high):
    # lane j: entry index[j] % 64 of the 64 words of low then high (VPERMI2W)
    vector = _vector(_I16, 32)
    if not FP8_TABLE_LOOKUP:
        return _lane_by_lane(builder, builder.shuffle_vector(low, high, _constant(_I32, 64, list(range(64)))), index)
    permute = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vector, [vector] * 3), "llvm.x86.avx512.vpermi2var.hi.512")
    return builder.call(permute, [low, index, high])


def _line_buffer_choices(builder, nontemporal, lines):
    """The ways a lookup's loop may store, as (the line buffer to stream through or None, when): streamed stores
    go through the line buffer at address `lines` unless it is 0; other stores never do."""
    if not nontemporal or not LINES_BY_PERMUTE:  # no loop that could never run
        return [(None, ir.Constant(ir.IntType(1), 1))]
    lined = builder.icmp_unsigned("!=", lines, lines.type(0))
    return [(None, builder.not_(lined)), (lines, lined)]


@intrinsic(prefer_literal=True)
def _fp8_e4m3_looked_up(typingctx, nontemporal, lines, destination, source, n_blocks, table):
    """Put the 32 * `n_blocks` float8_e4m3fn values at `source` as their entries of `table` at `destination`.

    `nontemporal` (a literal): stream the stores (`destination` 16-byte
    aligned), a cache line at a time through the line buffer at address
    `lines` unless it is 0 (see :func:`.dequant_ir._stream_lines`).
    """
    if not isinstance(nontemporal, types.BooleanLiteral):
        return None

    def codegen(context, builder, signature, args):
        _, lines, destination, source, n_blocks, table = args
        words = _vector(_I16, 32)

        def c(value):
            return _constant(_I16, 32, value)

        entries = [_load(builder, builder.add(table, table.type(64 * k)), words) for k in range(4)]
        for through, chosen in _line_buffer_choices(builder, nontemporal.literal_value, lines):
            with builder.if_then(chosen), cgutils.for_range(builder, n_blocks) as loop:
                codes = builder.zext(_load(builder, builder.add(source, builder.mul(loop.index, source.type(32))),
                                           _vector(_I8, 32)), words)
                below_64 = _word_permute(builder, entries[0], codes, entries[1])
                from_64 = _word_permute(builder, entries[2], codes, entries[3])
                value = builder.select(builder.icmp_unsigned("!=", builder.and_(codes, c(0x40)), c(0)), from_64,
                                       below_64)
                value = builder.xor(value, builder.shl(builder.and_(codes, c(0x80)), c(8)))
                address = builder.add(destination, builder.mul(loop.index, destination.type(64)))
                _put_vector(builder, address, value, nontemporal.literal_value, 2, through)
        return context.get_dummy_value()

    return types.void(nontemporal, _ADDRESS, _ADDRESS, _ADDRESS, types.intp, _ADDRESS), codegen


@njit(**_JIT)
def _fill_fp8_e4m3_table(table, scale, mode):
    if mode == FLOAT16:
        _fp8_e4m3_fill_table(FLOAT16, table, scale)
    elif mode == BFLOAT16:
        _fp8_e4m3_fill_table(BFLOAT16, table, scale)
    else:
        _fp8_e4m3_fill_table(FLOAT16_BITS, table, scale)


@njit(**_JIT)
def _fp8_e4m3_by_table(source, count, table, destination, stream, lines):
    """The `count` values at `source` as 16-bit entries of `table` at `destination` (streamed: 16-byte aligned,
    through the line buffer at address `lines`)."""
    whole = count - count % 32
    if stream:
        _fp8_e4m3_looked_up(True, lines, destination, source, whole // 32, table)
    else:
        _fp8_e4m3_looked_up(False, lines, destination, source, whole // 32, table)
    for j in range(whole, count):
        code = _byte(source + j)
        entry = _u16_at(table + 2 * (code & np.uint32(0x7F)))
        _store_u16(destination + 2 * j, np.uint16(entry ^ ((code & np.uint32(0x80)) << np.uint32(8))))


# -- 4-bit formats into 16-bit outputs, by table lookup -----------------------------------------------
# A q4_0 or q4_1 block, or a q4_k sub-block, has 16 possible values: each is computed by the decode's own
# float32 operations, in its order, from the nibble as a float, and rounded once into a table of 16-bit
# outputs, so every value looked up by its nibble is bit for bit the value the decode would give.

_NIBBLE_VALUES = [float(n) for n in range(16)]


def _byte_shuffle(builder, table, index):
    # lane j: byte index[j] of the 16 bytes of table, for 32 indexes below 16 (VPSHUFB on both 16-byte halves)
    if not NIBBLE_TABLE_LOOKUP:
        return _lane_by_lane(builder, table, index)
    vector = _vector(_I8, 32)
    shuffle = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vector, [vector, vector]), "llvm.x86.avx2.pshuf.b")
    return builder.call(shuffle, [builder.shuffle_vector(table, table, _constant(_I32, 32, list(range(16)) * 2)), index])


def _words_looked_up(builder, entries, index):
    """Lane j: entry index[j] of 16 words (<16 x i16>), for 32 indexes below 16 (<32 x i8>): one word permute
    (AVX-512BW), else their low and high bytes looked up apart, then interleaved."""
    if NIBBLE_WORD_PERMUTE:
        words = _vector(_I16, 32)
        permute = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(words, [words, words]), "llvm.x86.avx512.permvar.hi.512")
        table = builder.shuffle_vector(entries, entries, _constant(_I32, 32, list(range(16)) * 2))
        return builder.call(permute, [table, builder.zext(index, words)])  # VPERMW: lane j is table[index[j] % 32]
    data = builder.bitcast(entries, _vector(_I8, 32))
    low = _byte_shuffle(builder, builder.shuffle_vector(data, data, _constant(_I32, 16, list(range(0, 32, 2)))), index)
    high = _byte_shuffle(builder, builder.shuffle_vector(data, data, _constant(_I32, 16, list(range(1, 32, 2)))), index)
    interleaved = builder.shuffle_vector(low, high, _constant(_I32, 64, [k + 32 * h for k in range(32) for h in (0, 1)]))
    return builder.bitcast(interleaved, _vector(_I16, 32))


def _q4_0_lookups(builder, block, lanes):
    # d: f16 | 16 bytes of nibbles; entry n is d * (n - 8)
    n = _constant(_F32, 16, [v - 8 for v in _NIBBLE_VALUES])
    entries = lanes(builder, builder.fmul(_splat_half(builder, block, 16), n))
    return [(0, entries, _nibbles(builder, _load(builder, builder.add(block, block.type(2)), _vector(_I8, 16))))]


def _q4_1_lookups(builder, block, lanes):
    # d: f16 | m: f16 | 16 bytes of nibbles; entry n is d * n + m
    d, m = _splat_half(builder, block, 16), _splat_half(builder, builder.add(block, block.type(2)), 16)
    entries = lanes(builder, builder.fadd(builder.fmul(d, _constant(_F32, 16, _NIBBLE_VALUES)), m))
    return [(0, entries, _nibbles(builder, _load(builder, builder.add(block, block.type(4)), _vector(_I8, 16))))]


def _q4_k_lookups(builder, block, lanes):
    # see dequant_blocks._q4_k_body: sub-blocks 2g and 2g + 1 take the low and high nibbles of 32 bytes; their tables are made
    # together, entries 0-15 and 16-31 of one vector
    scales, mins = _k_scales(builder, block)
    for group in range(4):
        pair = _constant(_I32, 32, [2 * group] * 16 + [2 * group + 1] * 16)
        scale, low = builder.shuffle_vector(scales, scales, pair), builder.shuffle_vector(mins, mins, pair)
        entries = lanes(builder, builder.fsub(builder.fmul(scale, _constant(_F32, 32, _NIBBLE_VALUES * 2)), low))
        packed = _load(builder, builder.add(block, block.type(16 + 32 * group)), _vector(_I8, 32))
        for half, nibbles in enumerate([builder.and_(packed, _constant(_I8, 32, 0xF)),
                                        builder.lshr(packed, _constant(_I8, 32, 4))]):
            table = builder.shuffle_vector(entries, entries, _constant(_I32, 16, list(range(16 * half, 16 * half + 16))))
            yield 64 * group + 32 * half, table, nibbles


def _nibbles_looked_up(lookups, block_bytes, block_values):
    """An intrinsic ``(mode, nontemporal, lines, destination, source, n_blocks)`` putting blocks of a 4-bit format.

    The `n_blocks` blocks whose bytes start at `source` become 16-bit values
    at `destination`: float16 if `mode` is FLOAT16, else bfloat16; stored
    non-temporally (16-byte aligned there; a cache line at a time through
    the line buffer at address `lines` unless it is 0) if `nontemporal`.
    `lookups(builder, block, lanes)` yields, per 32 values of the block at
    address `block`, their first position, their table of 16 words and
    each value's index into it, one at a time: each table is made just
    before its values are put, so a block's tables are never all live at
    once (q4_k's eight would spill registers to the stack on a CPU with 16
    of them). `mode`, `nontemporal` and `lines` are run-time
    values, so that one call site serves all: the code holds a loop for
    each way to store.
    """
    def codegen(context, builder, signature, args):
        mode, nontemporal, lines, destination, source, n_blocks = args
        half = builder.icmp_signed("==", mode, mode.type(FLOAT16))
        for code, output_is_mode in ((FLOAT16, half), (BFLOAT16, builder.not_(half))):
            for streamed, through, store_is_chosen in [(False, None, builder.not_(nontemporal))] + [
                    (True, through, builder.and_(nontemporal, chosen))
                    for through, chosen in _line_buffer_choices(builder, True, lines)]:
                chosen = builder.and_(output_is_mode, store_is_chosen)
                with builder.if_then(chosen), cgutils.for_range(builder, n_blocks) as loop:
                    block = builder.add(source, builder.mul(loop.index, source.type(block_bytes)))
                    row = builder.add(destination, builder.mul(loop.index, destination.type(2 * block_values)))
                    for first, table, index in lookups(builder, block, _LANES_OF_MODE[code]):
                        words = _words_looked_up(builder, table, index)
                        _put_vector(builder, builder.add(row, row.type(2 * first)), words, streamed, 2, through)
        return context.get_dummy_value()

    def typer(typingctx, mode, nontemporal, lines, destination, source, n_blocks):
        return types.void(types.intp, types.boolean, _ADDRESS, _ADDRESS, _ADDRESS, types.intp), codegen

    return intrinsic(typer)


_q4_0_looked_up = _nibbles_looked_up(_q4_0_lookups, 18, 32)
_q4_1_looked_up = _nibbles_looked_up(_q4_1_lookups, 20, 32)
_q4_k_looked_up = _nibbles_looked_up(_q4_k_lookups, 144, 256)
#: Each 4-bit format's lookups and its values per block, by format code.
NIBBLES_LOOKED_UP = {Q4_0: (_q4_0_looked_up, 32), Q4_1: (_q4_1_looked_up, 32), Q4_K: (_q4_k_looked_up, 256)}


@njit(inline="always", **_JIT)  # inlined: a call per chunk is slower (docs/results/2026-12-02-direct-stores-ab.md)
def _nibbles_by_table(fmt, source, count, destination, mode, stream, lines):
    """The `count` values of 4-bit format `fmt` at `source` as 16-bit `mode` values at `destination` (see above)."""
    if fmt == Q4_0:
        _q4_0_looked_up(mode, stream, lines, destination, source, count // 32)
    elif fmt == Q4_1:
        _q4_1_looked_up(mode, stream, lines, destination, source, count // 32)
    else:
        _q4_k_looked_up(mode, stream, lines, destination, source, count // 256)


