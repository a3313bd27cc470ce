"""Each block format's values as one piece of vector IR (an intrinsic per format), for :mod:`.dequant_cpu`.

Each block decoder's loads come before its stores, so LLVM need not prove
that the table and the output never overlap; its values go where `put`
says (:func:`.dequant_ir._block`): float32, or float16 or bfloat16 rounded
in the same registers, into the output row. The float arithmetic is plain
fmul/fadd/fsub (no fast-math flags, so never fused) in the reference's
order, and each integer value is exact before its conversion to float;
q8_0 computes float16 outputs in float16 where the put allows it (the
same values: ``dequant_ir.Q8_0_FLOAT16_ARITHMETIC``).
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .dequant_ir import (
    _ADDRESS,
    _F32,
    _I8,
    _I16,
    _I32,
    HARDWARE_FLOAT16,
    _block,
    _constant,
    _fifth_bit_lanes,
    _load,
    _nibbles,
    _splat,
    _splat_half,
    _vector,
)


def _q8_0_body(builder, args, put):
    # 32 x int8 at source; q * d
    destination, source, d_at = args
    quants = _load(builder, source, _vector(_I8, 32))
    if put.float16_arithmetic:  # d * q in float16, the same values (dequant_ir.Q8_0_FLOAT16_ARITHMETIC)
        d = builder.load(builder.inttoptr(d_at, ir.HalfType().as_pointer()), align=1)
        q = builder.sitofp(quants, _vector(ir.HalfType(), 32))
        put(builder, destination, 0, builder.fmul(_splat(builder, d, 32), q))
        return
    q = builder.sitofp(quants, _vector(_F32, 32))
    put(builder, destination, 0, builder.fmul(q, _splat_half(builder, d_at, 32)))


def _q4_0_body(builder, args, put):
    # 16 bytes of nibbles at source; d * (q - 8)
    destination, source, d_at = args
    q = builder.sub(_nibbles(builder, _load(builder, source, _vector(_I8, 16))), _constant(_I8, 32, 8))
    put(builder, destination, 0, builder.fmul(_splat_half(builder, d_at, 32), builder.sitofp(q, _vector(_F32, 32))))


def _q4_1_body(builder, args, put):
    # 16 bytes of nibbles at source; d * q + m
    destination, source, d_at = args
    d, m = _splat_half(builder, d_at, 32), _splat_half(builder, builder.add(d_at, d_at.type(2)), 32)
    q = builder.uitofp(_nibbles(builder, _load(builder, source, _vector(_I8, 16))), _vector(_F32, 32))
    put(builder, destination, 0, builder.fadd(builder.fmul(d, q), m))


def _five_bit_values(builder, source, qh):
    nibbles = builder.zext(_nibbles(builder, _load(builder, source, _vector(_I8, 16))), _vector(_I32, 32))
    return builder.or_(nibbles, _fifth_bit_lanes(builder, qh))


def _q5_0_body(builder, args, put):
    # 16 bytes of nibbles at source, fifth bits in qh; d * (q - 16)
    destination, source, d_at, qh = args
    q = builder.sub(_five_bit_values(builder, source, qh), _constant(_I32, 32, 16))
    put(builder, destination, 0, builder.fmul(_splat_half(builder, d_at, 32), builder.sitofp(q, _vector(_F32, 32))))


def _q5_1_body(builder, args, put):
    # 16 bytes of nibbles at source, fifth bits in qh; d * q + m
    destination, source, d_at, qh = args
    d, m = _splat_half(builder, d_at, 32), _splat_half(builder, builder.add(d_at, d_at.type(2)), 32)
    q = builder.uitofp(_five_bit_values(builder, source, qh), _vector(_F32, 32))
    put(builder, destination, 0, builder.fadd(builder.fmul(d, q), m))


def _k_scales(builder, block):
    """(d * scale, dmin * min) of the 8 sub-blocks of the Q4_K/Q5_K block at address `block`, as two <8 x float>.

    The 6-bit scales and mins of the 12 packed bytes at ``block + 4``
    (ggml's get_scale_min_k4), decoded for all 8 sub-blocks at once.
    """
    packed = _load(builder, builder.add(block, block.type(4)), _vector(_I8, 16))  # 12 bytes used, 4 of qs/qh after

    def lanes(indices):
        return builder.zext(builder.shuffle_vector(packed, packed, _constant(_I32, 8, indices)), _vector(_I32, 8))

    def c(value):
        return _constant(_I32, 8, value)

    first, second = lanes([0, 1, 2, 3, 8, 9, 10, 11]), lanes([4, 5, 6, 7, 8, 9, 10, 11])
    top_of_first, top_of_second = lanes([0, 1, 2, 3, 0, 1, 2, 3]), lanes([4, 5, 6, 7, 4, 5, 6, 7])
    low_four = ir.Constant(_vector(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])
    scale = builder.select(low_four, builder.and_(first, c(63)), builder.or_(
        builder.and_(first, c(0xF)), builder.shl(builder.lshr(top_of_first, c(6)), c(4))))
    low = builder.select(low_four, builder.and_(second, c(63)), builder.or_(
        builder.lshr(second, c(4)), builder.shl(builder.lshr(top_of_second, c(6)), c(4))))
    d, dmin = _splat_half(builder, block, 8), _splat_half(builder, builder.add(block, block.type(2)), 8)
    return (builder.fmul(d, builder.sitofp(scale, _vector(_F32, 8))),
            builder.fmul(dmin, builder.sitofp(low, _vector(_F32, 8))))


def _k_block(builder, put, destination, block, sub_blocks):
    """Put the 256 values of a Q4_K/Q5_K block: sub-block k is (d * scale_k) * q - (dmin * min_k).

    `sub_blocks(g)` gives the 6 or 5-bit values of sub-blocks 2g and 2g + 1 (<32 x i8> each).
    """
    scales, mins = _k_scales(builder, block)
    for group in range(4):
        for half, q in enumerate(sub_blocks(group)):
            k = 2 * group + half
            scale = builder.shuffle_vector(scales, scales, _constant(_I32, 32, k))
            low = builder.shuffle_vector(mins, mins, _constant(_I32, 32, k))
            value = builder.fsub(builder.fmul(scale, builder.uitofp(q, _vector(_F32, 32))), low)
            put(builder, destination, 32 * k, value)


def _q4_k_body(builder, args, put):
    # d | dmin | 12 bytes of scales and mins | 128 bytes: each 32 give 32 low then 32 high nibbles
    destination, block = args

    def sub_blocks(group):
        packed = _load(builder, builder.add(block, block.type(16 + 32 * group)), _vector(_I8, 32))
        return builder.and_(packed, _constant(_I8, 32, 0xF)), builder.lshr(packed, _constant(_I8, 32, 4))

    _k_block(builder, put, destination, block, sub_blocks)


def _q5_k_body(builder, args, put):
    # as Q4_K, after 32 qh bytes: bit k of byte j is the fifth bit of value 32k + j
    destination, block = args
    qh = _load(builder, builder.add(block, block.type(16)), _vector(_I8, 32))

    def sub_blocks(group):
        packed = _load(builder, builder.add(block, block.type(48 + 32 * group)), _vector(_I8, 32))
        bits = builder.lshr(qh, _constant(_I8, 32, 2 * group))
        return (builder.or_(builder.and_(packed, _constant(_I8, 32, 0xF)),
                            builder.shl(builder.and_(bits, _constant(_I8, 32, 1)), _constant(_I8, 32, 4))),
                builder.or_(builder.lshr(packed, _constant(_I8, 32, 4)),
                            builder.shl(builder.and_(bits, _constant(_I8, 32, 2)), _constant(_I8, 32, 3))))

    _k_block(builder, put, destination, block, sub_blocks)


def _q6_k_body(builder, args, put):
    # ql: 128 bytes of low nibbles | qh: 64 bytes of 2-bit high parts | 16 int8 scales | d: f16;
    # value 128h + 32k + j = (d * scale[8h + 2k + j // 16]) * (q - 32)
    destination, block = args
    i8x32 = _vector(_I8, 32)
    raw_scales = builder.sitofp(_load(builder, builder.add(block, block.type(192)), _vector(_I8, 16)), _vector(_F32, 16))
    scales = builder.fmul(_splat_half(builder, builder.add(block, block.type(208)), 16), raw_scales)

    def mask(value, bits):
        return builder.and_(value, _constant(_I8, 32, bits))

    def shift(op, value, by):
        return op(value, _constant(_I8, 32, by))

    for h in range(2):
        a = _load(builder, builder.add(block, block.type(64 * h)), i8x32)
        b = _load(builder, builder.add(block, block.type(64 * h + 32)), i8x32)
        c = _load(builder, builder.add(block, block.type(128 + 32 * h)), i8x32)
        quarters = (
            builder.or_(mask(a, 0xF), shift(builder.shl, mask(c, 0x03), 4)),
            builder.or_(mask(b, 0xF), shift(builder.shl, mask(c, 0x0C), 2)),
            builder.or_(shift(builder.lshr, a, 4), mask(c, 0x30)),
            builder.or_(shift(builder.lshr, b, 4), shift(builder.lshr, mask(c, 0xC0), 2)),
        )
        for k, q in enumerate(quarters):
            values = builder.sitofp(builder.sub(q, _constant(_I8, 32, 32)), _vector(_F32, 32))
            first = 8 * h + 2 * k
            scale = builder.shuffle_vector(scales, scales, _constant(_I32, 32, [first] * 16 + [first + 1] * 16))
            put(builder, destination, 128 * h + 32 * k, builder.fmul(scale, values))


def _fp8_e4m3_bit_values(builder, codes, scale):
    # 32 float8_e4m3fn bytes (<32 x i8>) to value * scale (see fp8_e4m3_value), by integer bit operations
    i32x32 = _vector(_I32, 32)
    b = builder.zext(codes, i32x32)
    sign = builder.shl(builder.and_(b, _constant(_I32, 32, 0x80)), _constant(_I32, 32, 24))
    magnitude = builder.and_(b, _constant(_I32, 32, 0x7F))
    normal = builder.add(builder.shl(magnitude, _constant(_I32, 32, 20)), _constant(_I32, 32, 120 << 23))
    small = builder.fmul(builder.uitofp(magnitude, _vector(_F32, 32)), _constant(_F32, 32, 2.0**-9))
    bits = builder.select(builder.icmp_unsigned(">=", magnitude, _constant(_I32, 32, 8)), normal,
                          builder.bitcast(small, i32x32))
    bits = builder.select(builder.icmp_unsigned("==", magnitude, _constant(_I32, 32, 0x7F)),
                          _constant(_I32, 32, 0x7FC00000), bits)
    value = builder.bitcast(builder.or_(bits, sign), _vector(_F32, 32))
    return builder.fmul(value, _splat(builder, scale, 32))


def _fp8_e4m3_widened(builder, codes):
    # 32 float8_e4m3fn bytes (<32 x i8>) to value / 2**8 as float32, exactly, through float16 and the F16C widening:
    # the sign to bit 15 and the 7 magnitude bits under float16's exponent (subnormals become float16 subnormals);
    # NaN codes become float16's quiet NaN of their sign, which widens to ml_dtypes' float32 NaN
    def c(value):
        return _constant(_I16, 32, value)

    b = builder.zext(codes, _vector(_I16, 32))
    shifted = builder.shl(b, c(7))
    bits = builder.add(shifted, builder.and_(shifted, c(0x4000)))  # the sign's carry: bit 14 to bit 15
    # NaN codes are rare: one test of the 32 bytes (a byte mask), and their lanes patched only where there are some
    nan = builder.icmp_unsigned("==", builder.and_(codes, _constant(_I8, 32, 0x7F)), _constant(_I8, 32, 0x7F))
    any_nan = builder.icmp_unsigned("!=", builder.bitcast(nan, ir.IntType(32)), ir.Constant(ir.IntType(32), 0))
    decoded = builder.block
    with builder.if_then(any_nan, likely=False):
        patched = builder.select(nan, builder.or_(builder.and_(bits, c(0x8000)), c(0x7E00)), bits)
        patched_in = builder.block
    merged = builder.phi(bits.type)
    merged.add_incoming(bits, decoded)
    merged.add_incoming(patched, patched_in)
    return builder.fpext(builder.bitcast(merged, _vector(ir.HalfType(), 32)), _vector(_F32, 32))


def _fp8_e4m3_widened_values(builder, codes, scale):
    # as _fp8_e4m3_bit_values, through the F16C widening
    value = builder.fmul(_fp8_e4m3_widened(builder, codes), _constant(_F32, 32, 256.0))  # exact: |value| <= 448
    return builder.fmul(value, _splat(builder, scale, 32))


#: 32 float8_e4m3fn values: through the F16C widening where numba compiles for it (fewer instructions).
_FP8_E4M3_VALUES = _fp8_e4m3_widened_values if HARDWARE_FLOAT16 else _fp8_e4m3_bit_values

#: :func:`_fp8_e4m3_32` multiplies its codes' values divided by this by its factor: with F16C it widens value / 2**8,
#: and a row's factor of 2**8 times its scale saves a multiply per value (the same product, rounded once).
FP8_E4M3_FACTOR_OF_SCALE = 256.0 if HARDWARE_FLOAT16 else 1.0


def _fp8_e4m3_body(builder, args, put):
    # 32 float8_e4m3fn bytes at source; value / FP8_E4M3_FACTOR_OF_SCALE * factor
    destination, source, factor = args
    codes = _load(builder, source, _vector(_I8, 32))
    if HARDWARE_FLOAT16:
        values = builder.fmul(_fp8_e4m3_widened(builder, codes), _splat(builder, factor, 32))
    else:
        values = _fp8_e4m3_bit_values(builder, codes, factor)
    put(builder, destination, 0, values)


def _fp8_e4m3_bits_body(builder, args, put):
    destination, source, scale = args
    put(builder, destination, 0, _fp8_e4m3_bit_values(builder, _load(builder, source, _vector(_I8, 32)), scale))


_f32, _u32 = types.float32, types.uint32


@intrinsic(prefer_literal=True)
def _q8_0_block(typingctx, put, lines, destination, source, d_at):
    return _block(put, _q8_0_body, _ADDRESS)


@intrinsic(prefer_literal=True)
def _q4_0_block(typingctx, put, lines, destination, source, d_at):
    return _block(put, _q4_0_body, _ADDRESS)


@intrinsic(prefer_literal=True)
def _q4_1_block(typingctx, put, lines, destination, source, d_at):
    return _block(put, _q4_1_body, _ADDRESS)


@intrinsic(prefer_literal=True)
def _q5_0_block(typingctx, put, lines, destination, source, d_at, qh):
    return _block(put, _q5_0_body, _ADDRESS, _u32)


@intrinsic(prefer_literal=True)
def _q5_1_block(typingctx, put, lines, destination, source, d_at, qh):
    return _block(put, _q5_1_body, _ADDRESS, _u32)


@intrinsic(prefer_literal=True)
def _q4_k_block(typingctx, put, lines, destination, block):
    return _block(put, _q4_k_body)


@intrinsic(prefer_literal=True)
def _q5_k_block(typingctx, put, lines, destination, block):
    return _block(put, _q5_k_body)


@intrinsic(prefer_literal=True)
def _q6_k_block(typingctx, put, lines, destination, block):
    return _block(put, _q6_k_body)


@intrinsic(prefer_literal=True)
def _fp8_e4m3_32(typingctx, put, lines, destination, source, factor):
    return _block(put, _fp8_e4m3_body, _f32)


@intrinsic(prefer_literal=True)
def _fp8_e4m3_32_bits(typingctx, put, lines, destination, source, scale):
    return _block(put, _fp8_e4m3_bits_body, _f32)


