"""Building blocks of the dequantizing kernels (:mod:`.dequant_cpu`): their argument codes, the CPU features
they compile for, and LLVM IR for loads and stores at addresses, vectors, and float16 and bfloat16 roundings.

Everything here is addressed by plain integers. The float arithmetic the
kernels build from these pieces is plain fmul/fadd/fsub (no fast-math
flags, so never fused); the roundings are the ones numpy and ml_dtypes
make, ties to even, lane by lane.
"""
from __future__ import annotations

import platform
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from .jit_options import JIT as _JIT

#: Format codes, by name (fastembed.formats.FORMATS).
FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q5_0": 3, "q5_1": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7, "fp8_e4m3": 8}
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, FP8_E4M3 = range(9)
#: ``mode`` of a uint16 output: float16 (the fastest exact conversion here), bfloat16, float16 by bit operations.
FLOAT16, BFLOAT16, FLOAT16_BITS = 0, 1, 2

_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _target_features() -> set[str]:
    """The CPU features numba's JIT compiles for (cached kernels included), as LLVM names them: ``+f16c``..."""
    from numba.core import codegen, config

    features = getattr(config, "CPU_FEATURES", None)
    if features is None:
        features = codegen.get_host_cpu_features()
    return set(str(features).split(",")) if _X86 else set()


_FEATURES = _target_features()
#: float16 conversions use the CPU's instructions (else the bit operations of :func:`float16_bits`).
HARDWARE_FLOAT16 = "+f16c" in _FEATURES and "+avx" in _FEATURES
#: How float16 outputs are rounded, in words (for describe()).
FLOAT16_CONVERSION = "F16C instructions" if HARDWARE_FLOAT16 else "integer bit operations"
#: fp8_e4m3 rows going to 16-bit outputs are looked up in a table of their row's 128 magnitudes, by AVX-512BW
#: word permutes (else decoded value by value).
FP8_TABLE_LOOKUP = "+avx512bw" in _FEATURES and "+avx512f" in _FEATURES
#: q4_0, q4_1 and q4_k values going to 16-bit outputs are looked up in a table of the 16 values of their block or
#: sub-block, by AVX2 byte shuffles (else decoded value by value).
NIBBLE_TABLE_LOOKUP = "+avx2" in _FEATURES
#: ... 32 values at a time by one AVX-512BW word permute, instead of two byte shuffles and an interleave.
NIBBLE_WORD_PERMUTE = NIBBLE_TABLE_LOOKUP and FP8_TABLE_LOOKUP
#: ... q4_k's float16 outputs too, except with AVX-512F but no word permute: there the decode (16 float32 lanes
#: per instruction, rounded by F16C straight into the output) is the faster.
Q4_K_FLOAT16_BY_TABLE = NIBBLE_TABLE_LOOKUP and ("+avx512f" not in _FEATURES or NIBBLE_WORD_PERMUTE)
#: q8_0 values going to float16 are computed in float16 (AVX512-FP16: 32 lanes per instruction), the same values:
#: an int8 quant is exact in float16, and d * q needs at most 18 significant bits, so the reference's float32 product
#: is exact and its rounding to float16 is the one rounding of the float16 multiply (a NaN d keeps its sign and
#: payload either way; float16 instructions ignore MXCSR's flush-to-zero and denormals-are-zero, as the conversions do).
Q8_0_FLOAT16_ARITHMETIC = "+avx512fp16" in _FEATURES and HARDWARE_FLOAT16
#: How values become 16-bit outputs, in words (for describe()).
TO_16_BITS = "; ".join([
    "fp8_e4m3: " + ("a table of each row's 128 values, AVX-512BW word permutes" if FP8_TABLE_LOOKUP else "decoded"),
    ("q4_0, q4_1, q4_k: a table of each block's 16 values, "
     + ("AVX-512BW word permutes" if NIBBLE_WORD_PERMUTE else "AVX2 byte shuffles")
     + ("" if Q4_K_FLOAT16_BY_TABLE else " (q4_k into float16: decoded)")) if NIBBLE_TABLE_LOOKUP else "q4_0, q4_1, q4_k: decoded",
    "q8_0 into float16: " + ("float16 arithmetic (AVX512-FP16)" if Q8_0_FLOAT16_ARITHMETIC else "decoded"),
    "others: decoded"])

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_ADDRESS = types.intp

# -- scalars: loads and stores at an address, bit casts ------------------------------------------------


def _pointer(builder, address, element):
    return builder.inttoptr(address, element.as_pointer())


@intrinsic
def _byte(typingctx, address):
    """The byte at `address`, as uint32."""
    def codegen(context, builder, signature, args):
        return builder.zext(builder.load(_pointer(builder, args[0], _I8)), _I32)

    return types.uint32(_ADDRESS), codegen


@intrinsic
def _u16_at(typingctx, address):
    """The uint16 at `address` (2-byte aligned), as uint32."""
    def codegen(context, builder, signature, args):
        return builder.zext(builder.load(_pointer(builder, args[0], _I16), align=2), _I32)

    return types.uint32(_ADDRESS), codegen


@intrinsic
def _word(typingctx, address):
    """The little-endian uint32 at `address` (any alignment)."""
    def codegen(context, builder, signature, args):
        return builder.load(_pointer(builder, args[0], _I32), align=1)

    return types.uint32(_ADDRESS), codegen


@intrinsic
def _load_f32(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.load(_pointer(builder, args[0], _F32), align=4)

    return types.float32(_ADDRESS), codegen


@intrinsic
def _load_f32_anywhere(typingctx, address):
    """The float32 at `address`, at any alignment."""
    def codegen(context, builder, signature, args):
        return builder.load(_pointer(builder, args[0], _F32), align=1)

    return types.float32(_ADDRESS), codegen


@intrinsic
def _store_f32(typingctx, address, value):
    def codegen(context, builder, signature, args):
        builder.store(args[1], _pointer(builder, args[0], _F32), align=4)
        return context.get_dummy_value()

    return types.void(_ADDRESS, types.float32), codegen


@intrinsic
def _store_u16(typingctx, address, value):
    def codegen(context, builder, signature, args):
        builder.store(args[1], _pointer(builder, args[0], _I16), align=2)
        return context.get_dummy_value()

    return types.void(_ADDRESS, types.uint16), codegen


@intrinsic
def _stack_floats(typingctx, count):
    """The address of `count` (a literal) float32 on the calling function's stack, 32-byte aligned, for its whole call."""
    if not isinstance(count, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        buffer = cgutils.alloca_once(builder, ir.ArrayType(_F32, count.literal_value))
        buffer.align = 32
        return builder.ptrtoint(buffer, context.get_value_type(_ADDRESS))

    return _ADDRESS(count), codegen


@intrinsic
def f32_bits(typingctx, value):
    """The bits of a float32 as a uint32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)

    return types.uint32(types.float32), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bits are a uint32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _F32)

    return types.float32(types.uint32), codegen


@intrinsic
def _float16_bits_hardware(typingctx, value):
    # fptrunc rounds to nearest even: one conversion instruction where the target has one (F16C)
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)

    return types.uint16(types.float32), codegen


def _half_bits_codegen(context, builder, signature, args):
    # exact, NaN payloads kept: subnormals (exponent 0) are mantissa * 2**-24; infinity and NaN keep their mantissa
    h = builder.zext(builder.load(_pointer(builder, args[0], _I16), align=1), _I32)
    sign = builder.shl(builder.and_(h, _I32(0x8000)), _I32(16))
    magnitude = builder.and_(h, _I32(0x7FFF))
    shifted = builder.shl(magnitude, _I32(13))
    normal = builder.add(shifted, _I32(112 << 23))
    special = builder.or_(shifted, _I32(0x7F800000))
    small = builder.bitcast(builder.fmul(builder.uitofp(magnitude, _F32), _F32(2.0**-24)), _I32)
    bits = builder.select(builder.icmp_unsigned(">=", magnitude, _I32(0x400)), normal, small)
    bits = builder.select(builder.icmp_unsigned(">=", magnitude, _I32(0x7C00)), special, bits)
    return builder.bitcast(builder.or_(bits, sign), _F32)


@intrinsic
def half_at(typingctx, address):
    """The little-endian float16 at `address` as float32, exactly, by integer bit operations."""
    return types.float32(_ADDRESS), _half_bits_codegen


# -- scalar conversions (the last values of a row whose length is not a multiple of eight) -------------


@njit(**_JIT)
def float16_bits(value):
    """float32 to the bits of the nearest float16, ties to even, exactly as numpy's ``astype(np.float16)``.

    Integer bit operations: values from 65,520 up overflow to infinity, NaN
    keeps the top of its payload (never becoming infinity), and subnormal
    results are rounded by a float32 addition whose last place is float16's
    smallest subnormal. :func:`_float16_bits_lanes` is the same, in vectors.
    """
    u = np.uint32(f32_bits(value))
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):  # 65,536 and above, infinity, NaN
        h = np.uint32(0x7C00)
        if a > np.uint32(0x7F800000):
            payload = (a >> np.uint32(13)) & np.uint32(0x3FF)
            h = np.uint32(0x7C00) | (payload if payload else np.uint32(1))
    elif a >= np.uint32(0x38800000):  # a normal float16: rebias the exponent, round the dropped 13 bits
        h = (a - np.uint32(0x38000000) + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    else:
        h = f32_bits(f32_from_bits(a) + np.float32(0.5)) - np.uint32(0x3F000000)
    return np.uint16(sign | h)


@njit(**_JIT)
def bfloat16_bits(value):
    """float32 to the bits of the nearest bfloat16, ties to even, as ml_dtypes does (NaN: the quiet NaN of its sign)."""
    u = np.uint32(f32_bits(value))
    if value != value:
        return np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


_float16_fast = _float16_bits_hardware if HARDWARE_FLOAT16 else float16_bits


@njit(**_JIT)
def fp8_e4m3_value(byte):
    """A float8_e4m3fn byte as float32, exactly as ml_dtypes converts it (0x7F and 0xFF: the quiet NaN of their sign)."""
    b = np.uint32(byte)
    sign = (b & np.uint32(0x80)) << np.uint32(24)
    magnitude = b & np.uint32(0x7F)
    small = np.uint32(f32_bits(np.float32(np.int32(magnitude)) * np.float32(2.0**-9)))  # exponent 0: magnitude * 2**-9
    bits = (magnitude << np.uint32(20)) + np.uint32(120 << 23) if magnitude >= np.uint32(8) else small
    if magnitude == np.uint32(0x7F):
        bits = np.uint32(0x7FC00000)
    return f32_from_bits(bits | sign)


# -- vectors: constants, loads, stores, nibbles ------------------------------------------------------


def _vector(element, n):
    return ir.VectorType(element, n)


def _constant(element, n, value):
    """A vector of `n` times `value`, or of the values of a list."""
    values = value if isinstance(value, list) else [value] * n
    return ir.Constant(_vector(element, n), [element(v) for v in values])


def _splat(builder, scalar, n):
    vector = builder.insert_element(ir.Constant(_vector(scalar.type, 1), None), scalar, _I32(0))
    return builder.shuffle_vector(vector, vector, _constant(_I32, n, 0))


def _load(builder, address, vector_type):
    return builder.load(builder.inttoptr(address, vector_type.as_pointer()), align=1)


def _store(builder, address, value):
    builder.store(value, builder.inttoptr(address, value.type.as_pointer()), align=4)


def _put_vector(builder, address, value, nontemporal, align, lines=None):
    """Store `value` at `address`: with cached stores (`align` bytes aligned there) or, if `nontemporal`,
    streamed past the cache (16-byte aligned there); a cache line at a time through the line buffer at address
    `lines` where given and the CPU can (:data:`LINES_BY_PERMUTE`; `value` a multiple of 64 bytes).

    Otherwise on x86 the streamed value goes out 16 bytes at a time, each piece through an empty
    inline-assembly statement: without it LLVM combines a conversion (float16, or bfloat16's truncation) with
    the store and emits ordinary stores, dropping the hint, so that every output line is read into the cache
    before it is written.
    """
    if not nontemporal:
        builder.store(value, builder.inttoptr(address, value.type.as_pointer()), align=align)
        return
    if not _X86:  # the kernels stream on x86 only; this keeps the IR valid elsewhere
        _stream(builder, address, value)
        return
    bits = {ir.HalfType: 16, ir.FloatType: 32}.get(type(value.type.element)) or value.type.element.width
    assert value.type.count * bits % 128 == 0, "streamed vectors are whole 16-byte pieces"
    words = builder.bitcast(value, _vector(_I32, value.type.count * bits // 32))
    if lines is None or not LINES_BY_PERMUTE:
        _stream_pieces(builder, address, words)
    else:
        _stream_lines(builder, lines, address, words)


def _stream_pieces(builder, address, words):
    for k in range(words.type.count // 4):
        _stream(builder, builder.add(address, address.type(16 * k)), _kept(builder, _lanes(builder, words, 4 * k, 4)))


def _kept(builder, value):
    """`value` through an empty inline-assembly statement, which LLVM cannot fold into the store that follows."""
    return builder.asm(ir.FunctionType(value.type, [value.type]), "", "=x,0" if value.type.count == 4 else "=v,0",
                       [value], False)


def _lanes(builder, vector, first, count):
    return builder.shuffle_vector(vector, vector, _constant(_I32, count, list(range(first, first + count))))


def _stream(builder, address, value, align=16):
    store = builder.store(value, builder.inttoptr(address, value.type.as_pointer()), align=align)
    store.set_metadata("nontemporal", builder.module.add_metadata([_I32(1)]))


# -- streamed stores, a cache line at a time ---------------------------------------------------------
# Streamed stores fill a write-combining buffer per cache line, which goes to memory whole once its line is
# complete. An output row that starts 16, 32 or 48 bytes into a line (numpy's large arrays start 16 bytes into a
# page) puts each 64 bytes of values across two lines: a line's first pieces come from one block and its last
# from the next, with the next block's loads and arithmetic in between, and the buffer may go to memory half
# full, a partial-line write. So each put's values are held in a line buffer on the kernel's stack, and each
# line is stored whole, in one 64-byte store, from the held values and the next put's, shifted together by one
# AVX-512 permute: the line buffer holds the last 64 bytes put and the address where they end. A put that does
# not continue them first stores the held pieces of their last line alone, then its own pieces before its first
# line boundary alone; so do the kernels (:func:`close_lines`) after their last put. Only the lined puts do this,
# which the kernels choose for rows that start inside a line: line-aligned rows keep the plain stores, whose
# shorter code ran faster there.

#: Streamed 64-byte values go out a whole cache line at a time (AVX-512F: a two-register permute by a place
#: known at run time); elsewhere 16 bytes at a time, as put.
LINES_BY_PERMUTE = "+avx512f" in _FEATURES
#: x86-64 vector registers the kernels compile for: 32 with AVX-512F, else 16 (YMM or XMM); what decides how many
#: values a decoder can hold without spilling them to its stack.
VECTOR_REGISTERS = 32 if "+avx512f" in _FEATURES else 16
#: float32 slots of a line buffer: the last 64 bytes put, then the address where they end (0: none held).
LINE_BUFFER_FLOATS = 18
_HELD_END = 64


def _held_end(builder, lines):
    return builder.inttoptr(builder.add(lines, lines.type(_HELD_END)), lines.type.as_pointer())


def _place(builder, address):
    """How many 16-byte pieces `address` is into its cache line."""
    return builder.and_(builder.lshr(address, address.type(4)), address.type(3))


def _flush_held(builder, lines, end):
    """Stream alone the pieces of the held values that lie in the line of `end`, before it (none if `end` is 0)."""
    place = _place(builder, end)
    for k in range(3):
        with builder.if_then(builder.icmp_unsigned("<", place.type(k), place)):  # 0, nothing held: place 0
            first = builder.sub(lines.type(4), place)  # the held piece that lies at the line's start
            held = builder.add(lines, builder.mul(builder.add(first, lines.type(k)), lines.type(16)))
            piece = builder.load(builder.inttoptr(held, _vector(_I32, 4).as_pointer()), align=16)
            at = builder.add(builder.sub(end, builder.mul(place, end.type(16))), end.type(16 * k))
            _stream(builder, at, piece)


def _stream_lines(builder, lines, address, words):
    """Stream `words` (<16n x i32>) to `address` onwards, a whole cache line per store (see above)."""
    assert words.type.count % 16 == 0, "lined puts are whole 64-byte vectors"
    vectors = [_lanes(builder, words, first, 16) for first in range(0, words.type.count, 16)]
    end_at = _held_end(builder, lines)
    held_end = builder.load(end_at, align=8)
    held = builder.load(builder.inttoptr(lines, vectors[0].type.as_pointer()), align=32)
    place = _place(builder, address)
    # line k's words: the last 4 * place words of the vector before, then the first ones of vector k
    shift = builder.trunc(builder.sub(address.type(16), builder.mul(place, address.type(4))), _I32)
    index = builder.add(_constant(_I32, 16, list(range(16))), _splat(builder, shift, 16))
    permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        vectors[0].type, [vectors[0].type] * 3), "llvm.x86.avx512.vpermi2var.d.512")
    line = builder.sub(address, builder.mul(place, address.type(16)))
    fresh = builder.icmp_unsigned("!=", held_end, address)
    with builder.if_then(fresh, likely=False):
        _flush_held(builder, lines, held_end)
    with builder.if_else(builder.and_(fresh, builder.icmp_unsigned("!=", place, place.type(0)))) as (head, whole):
        with head:  # the line before the first boundary is partly another row's: its pieces alone
            for k in range(3):
                with builder.if_then(builder.icmp_unsigned("<", place.type(k), builder.sub(place.type(4), place))):
                    _stream(builder, builder.add(address, address.type(16 * k)),
                            _kept(builder, _lanes(builder, vectors[0], 4 * k, 4)))
        with whole:
            _stream(builder, line, _kept(builder, builder.call(permute, [held, index, vectors[0]])), 64)
    for k in range(1, len(vectors)):
        at = builder.add(line, line.type(64 * k))
        _stream(builder, at, _kept(builder, builder.call(permute, [vectors[k - 1], index, vectors[k]])), 64)
    builder.store(vectors[-1], builder.inttoptr(lines, vectors[-1].type.as_pointer()), align=32)
    builder.store(builder.add(address, address.type(4 * words.type.count)), end_at, align=8)


@intrinsic
def open_lines(typingctx, lines):
    """Make the line buffer at address `lines` (LINE_BUFFER_FLOATS float32, 32-byte aligned) hold nothing."""
    def codegen(context, builder, signature, args):
        builder.store(args[0].type(0), _held_end(builder, args[0]), align=8)
        return context.get_dummy_value()

    return types.void(_ADDRESS), codegen


@intrinsic
def close_lines(typingctx, lines):
    """Stream alone the held pieces of the line buffer at address `lines` that no put completed; it then holds
    nothing."""
    def codegen(context, builder, signature, args):
        end_at = _held_end(builder, args[0])
        _flush_held(builder, args[0], builder.load(end_at, align=8))
        builder.store(args[0].type(0), end_at, align=8)
        return context.get_dummy_value()

    return types.void(_ADDRESS), codegen


def _nibbles(builder, packed):
    """16 bytes to their 16 low nibbles then their 16 high nibbles (<32 x i8>)."""
    low = builder.and_(packed, _constant(_I8, 16, 0xF))
    high = builder.lshr(packed, _constant(_I8, 16, 4))
    return builder.shuffle_vector(low, high, _constant(_I32, 32, list(range(32))))


def _fifth_bit_lanes(builder, qh):
    """A uint32 to its 32 bits, bit j in lane j, shifted to 0x10 (<32 x i32>)."""
    bits = builder.lshr(_splat(builder, qh, 32), _constant(_I32, 32, list(range(32))))
    return builder.shl(builder.and_(bits, _constant(_I32, 32, 1)), _constant(_I32, 32, 4))


# -- float32 vectors to float16 or bfloat16 -----------------------------------------------------------
# The same roundings as float16_bits and bfloat16_bits (and the F16C conversion), lane by lane.


def _float16_hardware_lanes(builder, value):
    n = value.type.count
    return builder.bitcast(builder.fptrunc(value, _vector(ir.HalfType(), n)), _vector(_I16, n))


def _float16_bits_lanes(builder, value):
    n = value.type.count

    def c(v):
        return _constant(_I32, n, v)

    u = builder.bitcast(value, _vector(_I32, n))
    sign = builder.and_(builder.lshr(u, c(16)), c(0x8000))
    a = builder.and_(u, c(0x7FFFFFFF))
    odd = builder.and_(builder.lshr(a, c(13)), c(1))
    normal = builder.lshr(builder.add(builder.add(builder.sub(a, c(0x38000000)), c(0xFFF)), odd), c(13))
    magnitude = builder.bitcast(a, _vector(_F32, n))
    small = builder.sub(builder.bitcast(builder.fadd(magnitude, _constant(_F32, n, 0.5)), _vector(_I32, n)),
                        c(0x3F000000))
    payload = builder.and_(builder.lshr(a, c(13)), c(0x3FF))
    nan = builder.or_(c(0x7C00), builder.select(builder.icmp_unsigned("==", payload, c(0)), c(1), payload))
    h = builder.select(builder.icmp_unsigned(">=", a, c(0x38800000)), normal, small)
    h = builder.select(builder.icmp_unsigned(">=", a, c(0x47800000)), c(0x7C00), h)
    h = builder.select(builder.icmp_unsigned(">", a, c(0x7F800000)), nan, h)
    return builder.trunc(builder.or_(sign, h), _vector(_I16, n))


def _bfloat16_lanes(builder, value):
    n = value.type.count

    def c(v):
        return _constant(_I32, n, v)

    u = builder.bitcast(value, _vector(_I32, n))
    high = builder.lshr(u, c(16))
    rounded = builder.lshr(builder.add(builder.add(u, c(0x7FFF)), builder.and_(high, c(1))), c(16))
    nan = builder.or_(builder.and_(high, c(0x8000)), c(0x7FC0))
    bits = builder.select(builder.fcmp_unordered("uno", value, value), nan, rounded)
    return builder.trunc(bits, _vector(_I16, n))


def _eight_halves(lanes, nontemporal):
    """An intrinsic ``(destination, source)``: 8 float32 at `source` converted by `lanes`, stored at `destination`.

    Non-temporal stores need a 16-byte aligned destination.
    """
    def codegen(context, builder, signature, args):
        destination, source = args
        _put_vector(builder, destination, lanes(builder, _load(builder, source, _vector(_F32, 8))), nontemporal, 2)
        return context.get_dummy_value()

    def typer(typingctx, destination, source):
        return types.void(_ADDRESS, _ADDRESS), codegen

    return intrinsic(typer)


# The F16C conversion only where numba compiles for it: elsewhere LLVM would call a runtime routine.
_FLOAT16_LANES: Any = _float16_hardware_lanes if HARDWARE_FLOAT16 else _float16_bits_lanes
_store_float16 = _eight_halves(_FLOAT16_LANES, False)
_stream_float16 = _eight_halves(_FLOAT16_LANES, True)
_store_bfloat16 = _eight_halves(_bfloat16_lanes, False)
_stream_bfloat16 = _eight_halves(_bfloat16_lanes, True)
_store_float16_bits = _eight_halves(_float16_bits_lanes, False)
_stream_float16_bits = _eight_halves(_float16_bits_lanes, True)



# -- where a block puts its values -------------------------------------------------------------------


class _Put:
    """Put values `first`... of a chunk (a vector) at `destination`: float32, or the 16-bit words `lanes` rounds
    them to (a function of the builder and the vector); stored non-temporally (16-byte aligned there) if
    `nontemporal`, a cache line at a time through the line buffer at address `lines` if `lined`
    (:func:`_stream_lines`). A vector of float16 (values a block computed in float16, where
    :attr:`float16_arithmetic` allows) is stored as it is."""

    def __init__(self, lanes: Any, nontemporal: bool, lined: bool = False, lines: Any = None) -> None:
        self.lanes, self.nontemporal, self.lined, self.lines = lanes, nontemporal, lined, lines
        #: Whether this put stores float16 rounded by the CPU's conversion on a CPU with float16 arithmetic: a block
        #: whose products are exact in float32 (q8_0) may then hand it values computed in float16
        #: (:data:`Q8_0_FLOAT16_ARITHMETIC`).
        self.float16_arithmetic = Q8_0_FLOAT16_ARITHMETIC and lanes is _float16_hardware_lanes

    def through(self, lines: Any) -> _Put:
        """This put, with the line buffer at address `lines` (an LLVM value) if it is lined."""
        return _Put(self.lanes, self.nontemporal, self.lined, lines)

    def __call__(self, builder: Any, destination: Any, first: int, value: Any) -> None:
        computed_in_float16 = isinstance(value.type.element, ir.HalfType)
        assert self.float16_arithmetic or not computed_in_float16, "float16 values for a put that does not store them"
        data = value if self.lanes is None or computed_in_float16 else self.lanes(builder, value)
        width = 4 if self.lanes is None else 2
        _put_vector(builder, builder.add(destination, destination.type(width * first)), data, self.nontemporal, width,
                    self.lines if self.lined else None)


#: Where a block puts its values (a literal argument of the block intrinsics and the chunk functions).
_TO_FLOATS, _TO_STREAMED_FLOATS, _TO_HALVES, _TO_STREAMED_HALVES, _TO_BFLOAT16, _TO_STREAMED_BFLOAT16 = range(6)
#: ... streamed a cache line at a time (into rows that start inside a line).
_TO_LINED_FLOATS, _TO_LINED_HALVES, _TO_LINED_BFLOAT16 = range(6, 9)
_PUTS = {_TO_FLOATS: _Put(None, False), _TO_STREAMED_FLOATS: _Put(None, True),
         _TO_HALVES: _Put(_FLOAT16_LANES, False),
         _TO_STREAMED_HALVES: _Put(_FLOAT16_LANES, True),
         _TO_BFLOAT16: _Put(_bfloat16_lanes, False),
         _TO_STREAMED_BFLOAT16: _Put(_bfloat16_lanes, True),
         _TO_LINED_FLOATS: _Put(None, True, True),
         _TO_LINED_HALVES: _Put(_FLOAT16_LANES, True, True),
         _TO_LINED_BFLOAT16: _Put(_bfloat16_lanes, True, True)}


def _block(put, body, *scalars):
    """Signature and codegen of a block intrinsic ``(put, lines, destination, source, *scalars)``.

    ``source`` is the address of the block's bytes the body reads first (its
    quants, or the whole block where the body also reads the scales);
    ``scalars`` are the addresses and words it needs besides.

    ``put`` is a literal: ``_TO_FLOATS`` and ``_TO_STREAMED_FLOATS`` store
    the values as float32 (into the output, or into the buffer that
    :func:`.dequant_cpu._emit` converts), ``_TO_HALVES`` and ``_TO_STREAMED_HALVES`` round
    them to float16 and store them into the output, ``_TO_BFLOAT16`` and
    ``_TO_STREAMED_BFLOAT16`` to bfloat16; streamed: 16-byte aligned there.
    ``_TO_LINED_FLOATS``, ``_TO_LINED_HALVES`` and ``_TO_LINED_BFLOAT16``
    stream a cache line at a time through the line buffer at address
    ``lines`` (unused by the other puts).
    """
    if not isinstance(put, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        body(builder, args[2:], _PUTS[put.literal_value].through(args[1]))
        return context.get_dummy_value()

    return types.void(put, _ADDRESS, _ADDRESS, _ADDRESS, *scalars), codegen


def _splat_half(builder, address, n):
    """The float16 at `address` as `n` float32 lanes: a block's scale.

    A broadcast load writes a whole register; the scalar conversion would
    merge into one the previous block's result may hold, chaining every
    block to the one before it. The widening is exact; it quiets a
    signalling NaN, which every use then multiplies, as the reference does.
    """
    if not HARDWARE_FLOAT16:
        return _splat(builder, _half_bits_codegen(None, builder, None, [address]), n)
    half = builder.load(builder.inttoptr(address, ir.HalfType().as_pointer()), align=1)
    return builder.fpext(_splat(builder, half, n), _vector(_F32, n))


