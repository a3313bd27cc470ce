"""The compiled CPU dequantizing gathers (Numba): rows of a block format to float32, float16 or bfloat16.

Importing this module imports numba; only the numba backend does so, lazily.

Contract shared by the two kernels, :func:`dequantize_serial` and
:func:`dequantize_parallel` (as the gather kernels of :mod:`.gather_cpu`):

- ``fmt`` is the format's code, :data:`FORMAT_CODES` (a run-time argument:
  one compile serves every format);
- ``data`` is the table's rows as ``(vocab_size, row_bytes)`` uint8, C-contiguous;
- ``scales`` is the bytes of the ``(vocab_size,)`` float32 row scales of a
  ``row_scale`` format (fp8_e4m3) as ``(4 * vocab_size,)`` uint8, at any
  address (a file may place them at an odd byte), else an empty uint8 array;
- ``ids`` is 1-D int32 or int64;
- ``out`` is ``(ids.size, dim)``, C-contiguous: float32, or uint16 holding
  the bits of float16 or bfloat16 values as ``mode`` says (:data:`FLOAT16`,
  :data:`BFLOAT16`, :data:`FLOAT16_BITS`); Numba has no float16 on the CPU;
- the values are bit for bit :func:`fastembed.formats.dequantize_rows`:
  float32 arithmetic in the reference's order, never fused (no fast-math),
  then rounded to the nearest float16 or bfloat16, ties to even, as numpy
  and ml_dtypes round (subnormals, overflow to infinity, NaN);
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
multiple of 16 bytes: :func:`.gather_cpu.can_stream`). float16
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
"""
from __future__ import annotations

import platform
from typing import Any

import numpy as np
from llvmlite import ir
from numba import literally, njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from .cpu_intrinsics import prefetch, store_fence
from .gather_cpu import CHANGED_DURING_COPY, first_bad_position

_JIT: dict[str, Any] = dict(cache=True, nogil=True, boundscheck=False)

#: Format codes, by name (fastembed.formats.FORMATS).
FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q5_0": 3, "q5_1": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7, "fp8_e4m3": 8}
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, FP8_E4M3 = range(9)
#: ``mode`` of a uint16 output: float16 (the fastest exact conversion here), bfloat16, float16 by bit operations.
FLOAT16, BFLOAT16, FLOAT16_BITS = 0, 1, 2
#: Values dequantized per step: one K-quant block, eight 32-value blocks.
CHUNK = 256

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
#: How values become 16-bit outputs, in words (for describe()).
TO_16_BITS = "; ".join([
    "fp8_e4m3: " + ("a table of each row's 128 values, AVX-512BW word permutes" if FP8_TABLE_LOOKUP else "decoded"),
    ("q4_0, q4_1, q4_k: a table of each block's 16 values, "
     + ("AVX-512BW word permutes" if NIBBLE_WORD_PERMUTE else "AVX2 byte shuffles")
     + ("" if Q4_K_FLOAT16_BY_TABLE else " (q4_k into float16: decoded)")) if NIBBLE_TABLE_LOOKUP else "q4_0, q4_1, q4_k: decoded",
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


# -- vector blocks ------------------------------------------------------------------------------------
# Each block decoder is one piece of vector IR whose loads come before its stores, so LLVM need not prove
# that the table and the buffer never overlap. Addresses are integers; the float arithmetic is plain
# fmul/fadd/fsub (no fast-math flags, so never fused) in the reference's order, and each integer value is
# exact before its conversion to float.


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


def _put_vector(builder, address, value, nontemporal, align):
    """Store `value` at `address`: with cached stores (`align` bytes aligned there) or, if `nontemporal`,
    streamed past the cache (16-byte aligned there).

    On x86 the streamed value goes out 16 bytes at a time, each piece through an empty inline-assembly
    statement: without it LLVM combines a conversion (float16, or bfloat16's truncation) with the store and
    emits ordinary stores, dropping the hint, so that every output line is read into the cache before it is
    written.
    """
    if not nontemporal:
        builder.store(value, builder.inttoptr(address, value.type.as_pointer()), align=align)
        return
    if _X86:
        bits = {ir.HalfType: 16, ir.FloatType: 32}.get(type(value.type.element)) or value.type.element.width
        assert value.type.count * bits % 128 == 0, "streamed vectors are whole 16-byte pieces"
        words = builder.bitcast(value, _vector(_I32, value.type.count * bits // 32))
        piece_type = _vector(_I32, 4)
        barrier = ir.FunctionType(piece_type, [piece_type])
        pieces = [(4 * k, builder.asm(barrier, "", "=x,0", [builder.shuffle_vector(
            words, words, _constant(_I32, 4, list(range(4 * k, 4 * k + 4))))], False))
                  for k in range(words.type.count // 4)]
    else:
        pieces = [(0, value)]
    for word, piece in pieces:
        piece_at = builder.add(address, address.type(4 * word))
        store = builder.store(piece, builder.inttoptr(piece_at, piece.type.as_pointer()), align=16)
        store.set_metadata("nontemporal", builder.module.add_metadata([_I32(1)]))


def _nibbles(builder, packed):
    """16 bytes to their 16 low nibbles then their 16 high nibbles (<32 x i8>)."""
    low = builder.and_(packed, _constant(_I8, 16, 0xF))
    high = builder.lshr(packed, _constant(_I8, 16, 4))
    return builder.shuffle_vector(low, high, _constant(_I32, 32, list(range(32))))


def _fifth_bit_lanes(builder, qh):
    """A uint32 to its 32 bits, bit j in lane j, shifted to 0x10 (<32 x i32>)."""
    bits = builder.lshr(_splat(builder, qh, 32), _constant(_I32, 32, list(range(32))))
    return builder.shl(builder.and_(bits, _constant(_I32, 32, 1)), _constant(_I32, 32, 4))


def _put(lanes, nontemporal):
    """Put values `first`... of a chunk (a vector) at `destination`: float32, or the 16-bit words `lanes` rounds
    them to (a function of the builder and the vector); stored non-temporally (16-byte aligned there) if
    `nontemporal`."""
    def put(builder, destination, first, value):
        data = value if lanes is None else lanes(builder, value)
        width = 4 if lanes is None else 2
        _put_vector(builder, builder.add(destination, destination.type(width * first)), data, nontemporal, width)

    return put


#: Where a block puts its values (a literal argument of the block intrinsics and the chunk functions).
#: (Lambdas: the lane functions are defined further down.)
_TO_FLOATS, _TO_STREAMED_FLOATS, _TO_HALVES, _TO_STREAMED_HALVES, _TO_BFLOAT16, _TO_STREAMED_BFLOAT16 = range(6)
_PUTS = {_TO_FLOATS: _put(None, False), _TO_STREAMED_FLOATS: _put(None, True),
         _TO_HALVES: _put(lambda builder, value: _FLOAT16_LANES(builder, value), False),
         _TO_STREAMED_HALVES: _put(lambda builder, value: _FLOAT16_LANES(builder, value), True),
         _TO_BFLOAT16: _put(lambda builder, value: _bfloat16_lanes(builder, value), False),
         _TO_STREAMED_BFLOAT16: _put(lambda builder, value: _bfloat16_lanes(builder, value), True)}


def _block(put, body, *scalars):
    """Signature and codegen of a block intrinsic ``(put, destination, source, *scalars)``.

    ``source`` is the address of the block's bytes the body reads first (its
    quants, or the whole block where the body also reads the scales);
    ``scalars`` are the addresses and words it needs besides.

    ``put`` is a literal: ``_TO_FLOATS`` and ``_TO_STREAMED_FLOATS`` store
    the values as float32 (into the output, or into the buffer that
    :func:`_emit` converts), ``_TO_HALVES`` and ``_TO_STREAMED_HALVES`` round
    them to float16 and store them into the output, ``_TO_BFLOAT16`` and
    ``_TO_STREAMED_BFLOAT16`` to bfloat16; streamed: 16-byte aligned there.
    """
    if not isinstance(put, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        body(builder, args[1:], _PUTS[put.literal_value])
        return context.get_dummy_value()

    return types.void(put, _ADDRESS, _ADDRESS, *scalars), codegen


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


def _q8_0_body(builder, args, put):
    # 32 x int8 at source; q * d
    destination, source, d_at = args
    q = builder.sitofp(_load(builder, source, _vector(_I8, 32)), _vector(_F32, 32))
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


def _fp8_e4m3_widened_values(builder, codes, scale):
    # as _fp8_e4m3_bit_values, through float16 and the F16C widening: the sign to bit 15 and the 7 magnitude bits
    # under float16's exponent (subnormals become float16 subnormals) give value / 2**8 exactly; NaN codes
    # become float16's quiet NaN of their sign, which widens to ml_dtypes' float32 NaN
    def c(value):
        return _constant(_I16, 32, value)

    b = builder.zext(codes, _vector(_I16, 32))
    shifted = builder.shl(b, c(7))
    bits = builder.add(shifted, builder.and_(shifted, c(0x4000)))  # the sign's carry: bit 14 to bit 15
    nan = builder.icmp_unsigned("==", builder.and_(b, c(0x7F)), c(0x7F))
    bits = builder.select(nan, builder.or_(builder.and_(bits, c(0x8000)), c(0x7E00)), bits)
    value = builder.fpext(builder.bitcast(bits, _vector(ir.HalfType(), 32)), _vector(_F32, 32))
    value = builder.fmul(value, _constant(_F32, 32, 256.0))  # exact: |value| <= 448, no subnormal float32 here
    return builder.fmul(value, _splat(builder, scale, 32))


#: 32 float8_e4m3fn values: through the F16C widening where numba compiles for it (fewer instructions).
_FP8_E4M3_VALUES = _fp8_e4m3_widened_values if HARDWARE_FLOAT16 else _fp8_e4m3_bit_values


def _fp8_e4m3_body(builder, args, put):
    # 32 float8_e4m3fn bytes at source; value * scale
    destination, source, scale = args
    put(builder, destination, 0, _FP8_E4M3_VALUES(builder, _load(builder, source, _vector(_I8, 32)), scale))


def _fp8_e4m3_bits_body(builder, args, put):
    destination, source, scale = args
    put(builder, destination, 0, _fp8_e4m3_bit_values(builder, _load(builder, source, _vector(_I8, 32)), scale))


_f32, _u32 = types.float32, types.uint32


@intrinsic(prefer_literal=True)
def _q8_0_block(typingctx, put, destination, source, d_at):
    return _block(put, _q8_0_body, _ADDRESS)


@intrinsic(prefer_literal=True)
def _q4_0_block(typingctx, put, destination, source, d_at):
    return _block(put, _q4_0_body, _ADDRESS)


@intrinsic(prefer_literal=True)
def _q4_1_block(typingctx, put, destination, source, d_at):
    return _block(put, _q4_1_body, _ADDRESS)


@intrinsic(prefer_literal=True)
def _q5_0_block(typingctx, put, destination, source, d_at, qh):
    return _block(put, _q5_0_body, _ADDRESS, _u32)


@intrinsic(prefer_literal=True)
def _q5_1_block(typingctx, put, destination, source, d_at, qh):
    return _block(put, _q5_1_body, _ADDRESS, _u32)


@intrinsic(prefer_literal=True)
def _q4_k_block(typingctx, put, destination, block):
    return _block(put, _q4_k_body)


@intrinsic(prefer_literal=True)
def _q5_k_block(typingctx, put, destination, block):
    return _block(put, _q5_k_body)


@intrinsic(prefer_literal=True)
def _q6_k_block(typingctx, put, destination, block):
    return _block(put, _q6_k_body)


@intrinsic(prefer_literal=True)
def _fp8_e4m3_32(typingctx, put, destination, source, scale):
    return _block(put, _fp8_e4m3_body, _f32)


@intrinsic(prefer_literal=True)
def _fp8_e4m3_32_bits(typingctx, put, destination, source, scale):
    return _block(put, _fp8_e4m3_bits_body, _f32)


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


@intrinsic(prefer_literal=True)
def _fp8_e4m3_looked_up(typingctx, nontemporal, destination, source, n_blocks, table):
    """Put the 32 * `n_blocks` float8_e4m3fn values at `source` as their entries of `table` at `destination`.

    `nontemporal` (a literal): stream the stores (`destination` 16-byte aligned).
    """
    if not isinstance(nontemporal, types.BooleanLiteral):
        return None

    def codegen(context, builder, signature, args):
        _, destination, source, n_blocks, table = args
        words = _vector(_I16, 32)

        def c(value):
            return _constant(_I16, 32, value)

        entries = [_load(builder, builder.add(table, table.type(64 * k)), words) for k in range(4)]
        with cgutils.for_range(builder, n_blocks) as loop:
            codes = builder.zext(_load(builder, builder.add(source, builder.mul(loop.index, source.type(32))),
                                       _vector(_I8, 32)), words)
            below_64 = _word_permute(builder, entries[0], codes, entries[1])
            from_64 = _word_permute(builder, entries[2], codes, entries[3])
            value = builder.select(builder.icmp_unsigned("!=", builder.and_(codes, c(0x40)), c(0)), from_64, below_64)
            value = builder.xor(value, builder.shl(builder.and_(codes, c(0x80)), c(8)))
            address = builder.add(destination, builder.mul(loop.index, destination.type(64)))
            _put_vector(builder, address, value, nontemporal.literal_value, 2)
        return context.get_dummy_value()

    return types.void(nontemporal, _ADDRESS, _ADDRESS, types.intp, _ADDRESS), codegen


@njit(**_JIT)
def _fill_fp8_e4m3_table(table, scale, mode):
    if mode == FLOAT16:
        _fp8_e4m3_fill_table(FLOAT16, table, scale)
    elif mode == BFLOAT16:
        _fp8_e4m3_fill_table(BFLOAT16, table, scale)
    else:
        _fp8_e4m3_fill_table(FLOAT16_BITS, table, scale)


@njit(**_JIT)
def _fp8_e4m3_by_table(source, count, table, destination, stream):
    """The `count` values at `source` as 16-bit entries of `table` at `destination` (streamed: 16-byte aligned)."""
    whole = count - count % 32
    if stream:
        _fp8_e4m3_looked_up(True, destination, source, whole // 32, table)
    else:
        _fp8_e4m3_looked_up(False, destination, source, whole // 32, table)
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
    # see _q4_k_body: sub-blocks 2g and 2g + 1 take the low and high nibbles of 32 bytes; their tables are made
    # together, entries 0-15 and 16-31 of one vector
    scales, mins = _k_scales(builder, block)
    lookups = []
    for group in range(4):
        pair = _constant(_I32, 32, [2 * group] * 16 + [2 * group + 1] * 16)
        scale, low = builder.shuffle_vector(scales, scales, pair), builder.shuffle_vector(mins, mins, pair)
        entries = lanes(builder, builder.fsub(builder.fmul(scale, _constant(_F32, 32, _NIBBLE_VALUES * 2)), low))
        packed = _load(builder, builder.add(block, block.type(16 + 32 * group)), _vector(_I8, 32))
        for half, nibbles in enumerate([builder.and_(packed, _constant(_I8, 32, 0xF)),
                                        builder.lshr(packed, _constant(_I8, 32, 4))]):
            table = builder.shuffle_vector(entries, entries, _constant(_I32, 16, list(range(16 * half, 16 * half + 16))))
            lookups.append((64 * group + 32 * half, table, nibbles))
    return lookups


def _nibbles_looked_up(lookups, block_bytes, block_values):
    """An intrinsic ``(mode, nontemporal, destination, source, n_blocks)`` putting blocks of a 4-bit format.

    The `n_blocks` blocks whose bytes start at `source` become 16-bit values
    at `destination`: float16 if `mode` is FLOAT16, else bfloat16; stored
    non-temporally (16-byte aligned there) if `nontemporal`. `lookups(builder,
    block, lanes)` gives, per 32 values of the block at address `block`,
    their first position, their table of 16 words and each value's index
    into it. `mode` and `nontemporal` are run-time values, so that one call
    site serves all: the code holds a loop for each pair.
    """
    def codegen(context, builder, signature, args):
        mode, nontemporal, destination, source, n_blocks = args
        half = builder.icmp_signed("==", mode, mode.type(FLOAT16))
        for code, output_is_mode in ((FLOAT16, half), (BFLOAT16, builder.not_(half))):
            for streamed, store_is_streamed in ((False, builder.not_(nontemporal)), (True, nontemporal)):
                chosen = builder.and_(output_is_mode, store_is_streamed)
                with builder.if_then(chosen), cgutils.for_range(builder, n_blocks) as loop:
                    block = builder.add(source, builder.mul(loop.index, source.type(block_bytes)))
                    row = builder.add(destination, builder.mul(loop.index, destination.type(2 * block_values)))
                    for first, table, index in lookups(builder, block, _LANES_OF_MODE[code]):
                        words = _words_looked_up(builder, table, index)
                        _put_vector(builder, builder.add(row, row.type(2 * first)), words, streamed, 2)
        return context.get_dummy_value()

    def typer(typingctx, mode, nontemporal, destination, source, n_blocks):
        return types.void(types.intp, types.boolean, _ADDRESS, _ADDRESS, types.intp), codegen

    return intrinsic(typer)


_q4_0_looked_up = _nibbles_looked_up(_q4_0_lookups, 18, 32)
_q4_1_looked_up = _nibbles_looked_up(_q4_1_lookups, 20, 32)
_q4_k_looked_up = _nibbles_looked_up(_q4_k_lookups, 144, 256)


@njit(inline="always", **_JIT)  # as a call per chunk it was slower (results/2026-12-02-direct-stores-ab.md)
def _nibbles_by_table(fmt, source, count, destination, mode, stream):
    """The `count` values of 4-bit format `fmt` at `source` as 16-bit `mode` values at `destination` (see above)."""
    if fmt == Q4_0:
        _q4_0_looked_up(mode, stream, destination, source, count // 32)
    elif fmt == Q4_1:
        _q4_1_looked_up(mode, stream, destination, source, count // 32)
    else:
        _q4_k_looked_up(mode, stream, destination, source, count // 256)


# -- one chunk of one row ----------------------------------------------------------------------------
# Each dequantizes the blocks (or `count` values) whose bytes start at address `source` and puts them at
# `destination` as `put` says (see _block): as float32 into the output row or the buffer there, or rounded
# to float16 into the output row there. `put` must be a literal (numba compiles a version per value).


@njit(**_JIT)
def _value_bytes(put):
    return 4 if put == _TO_FLOATS or put == _TO_STREAMED_FLOATS else 2


@njit(**_JIT)
def _q8_0(source, n_blocks, destination, put):
    # d: f16 | 32 x int8
    literally(put)
    for block in range(n_blocks):
        at = source + 34 * block
        _q8_0_block(put, destination + 32 * _value_bytes(put) * block, at + 2, at)


@njit(**_JIT)
def _q4_0(source, n_blocks, destination, put):
    # d: f16 | 16 bytes, values j and j + 16 in the low and high nibble of byte j
    literally(put)
    for block in range(n_blocks):
        at = source + 18 * block
        _q4_0_block(put, destination + 32 * _value_bytes(put) * block, at + 2, at)


@njit(**_JIT)
def _q4_1(source, n_blocks, destination, put):
    # d: f16 | m: f16 | 16 bytes of nibbles as Q4_0
    literally(put)
    for block in range(n_blocks):
        at = source + 20 * block
        _q4_1_block(put, destination + 32 * _value_bytes(put) * block, at + 4, at)


@njit(**_JIT)
def _q5_0(source, n_blocks, destination, put):
    # d: f16 | qh: 4 bytes, bit j the fifth bit of value j | 16 bytes of nibbles
    literally(put)
    for block in range(n_blocks):
        at = source + 22 * block
        _q5_0_block(put, destination + 32 * _value_bytes(put) * block, at + 6, at, _word(at + 2))


@njit(**_JIT)
def _q5_1(source, n_blocks, destination, put):
    # d: f16 | m: f16 | qh: 4 bytes | 16 bytes of nibbles
    literally(put)
    for block in range(n_blocks):
        at = source + 24 * block
        _q5_1_block(put, destination + 32 * _value_bytes(put) * block, at + 8, at, _word(at + 4))


@njit(**_JIT)
def _fp8_e4m3(source, count, scale, destination, put):
    # one float8_e4m3fn per value; value * the row's scale
    literally(put)
    whole = count - count % 32
    for j in range(0, whole, 32):
        _fp8_e4m3_32(put, destination + _value_bytes(put) * j, source + j, scale)
    for j in range(whole, count):
        value = fp8_e4m3_value(_byte(source + j)) * scale
        if _value_bytes(put) == 4:
            _store_f32(destination + 4 * j, value)
        elif put == _TO_BFLOAT16 or put == _TO_STREAMED_BFLOAT16:
            _store_u16(destination + 2 * j, bfloat16_bits(value))
        else:
            _store_u16(destination + 2 * j, _float16_fast(value))


@njit(**_JIT)
def _dequantize_chunk(fmt, source, count, scale, destination, put):
    """The `count` values of format `fmt` whose blocks start at address `source`, put at `destination` (see above)."""
    literally(put)
    if fmt == Q8_0:
        _q8_0(source, count // 32, destination, put)
    elif fmt == Q4_0:
        _q4_0(source, count // 32, destination, put)
    elif fmt == Q4_K:
        _q4_k_block(put, destination, source)  # one block of 256 values (see _q4_k_body)
    elif fmt == Q6_K:
        _q6_k_block(put, destination, source)
    elif fmt == FP8_E4M3:
        _fp8_e4m3(source, count, scale, destination, put)
    elif fmt == Q4_1:
        _q4_1(source, count // 32, destination, put)
    elif fmt == Q5_0:
        _q5_0(source, count // 32, destination, put)
    elif fmt == Q5_1:
        _q5_1(source, count // 32, destination, put)
    elif fmt == Q5_K:
        _q5_k_block(put, destination, source)


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
        _fp8_e4m3_32_bits(_TO_FLOATS, np.intp(out.ctypes.data) + 4 * j, np.intp(codes.ctypes.data) + j, scale)
    return out


@njit(**_JIT)
def looked_up(fmt, row, scale, out, mode, stream):
    """out = one row of format `fmt` (uint8 bytes) as 16-bit `mode` values by the table lookups, on any CPU, for tests.

    fp8_e4m3 (`scale` its row's, finite) or a 4-bit format (`scale`
    unused, `mode` FLOAT16 or BFLOAT16: the kernels decode FLOAT16_BITS);
    `out` uint16 of the row's size; with `stream`, 16-byte aligned.
    """
    source, destination = np.intp(row.ctypes.data), np.intp(out.ctypes.data)
    if fmt == FP8_E4M3:
        table = np.intp(_stack_floats(64))
        _fill_fp8_e4m3_table(table, scale, mode)
        _fp8_e4m3_by_table(source, out.size, table, destination, stream)
    else:
        _nibbles_by_table(fmt, source, out.size, destination, mode, stream)
    if stream:
        _fence()
    return out


@njit(**_JIT)
def widen_halves(halves, out):
    """out[j] = the float16 with bits halves[j] as float32 by :func:`half_at` (the bit operations), for tests."""
    for j in range(halves.size):
        out[j] = half_at(np.intp(halves.ctypes.data) + 2 * j)
    return out


# -- the kernels ----------------------------------------------------------------------------------------


@intrinsic
def _itemsize(typingctx, array):
    """The itemsize of an array's type, as a constant of the compiled code (so that LLVM drops the other types' paths)."""
    size = array.dtype.bitwidth // 8

    def codegen(context, builder, signature, args):
        return context.get_constant(types.intp, size)

    return types.intp(array), codegen


@njit(**_JIT)
def _vocab_size(fmt, data, scales):
    """Rows that may be read: of `data`, and of `scales` for a row-scale format."""
    return min(data.shape[0], scales.shape[0] // 4) if fmt == FP8_E4M3 else data.shape[0]


@njit(**_JIT)
def dequantize_range(fmt, data, scales, ids, out, start, stop, mode, stream, prefetch_rows_ahead,
                     touch_pages_rows_ahead):
    """Rows [start, stop) of the output; returns the rows skipped because their id was out of range.

    With ``prefetch_rows_ahead`` > 0, each chunk comes with prefetches of the
    same bytes of the row that many rows ahead (random rows defeat the
    hardware prefetcher); with ``touch_pages_rows_ahead`` > 0, each row starts
    with one prefetch per 4 KiB page of the row that many rows ahead, so that
    its page translations are under way early. An address out of range there
    is a hint, never read.
    """
    vocab_size = _vocab_size(fmt, data, scales)
    dim = out.shape[1]
    word: int = _itemsize(out)
    row_bytes = data.shape[1]
    rows = np.intp(data.ctypes.data)
    scale_bytes = np.intp(scales.ctypes.data)
    destination = np.intp(out.ctypes.data)
    buf = np.intp(_stack_floats(CHUNK))
    table = np.intp(_stack_floats(64))  # 128 16-bit entries
    # float16, bfloat16 and float32: the blocks write the output themselves
    halves, bfloats = word == 2 and mode == FLOAT16, word == 2 and mode == BFLOAT16
    # a table of 128 entries pays for itself on rows of at least as many values
    by_table = FP8_TABLE_LOOKUP and fmt == FP8_E4M3 and word == 2 and dim >= 128
    by_nibble_table = NIBBLE_TABLE_LOOKUP and word == 2 and mode != FLOAT16_BITS and (
        fmt == Q4_0 or fmt == Q4_1 or (fmt == Q4_K and (mode == BFLOAT16 or Q4_K_FLOAT16_BY_TABLE)))
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
        scale = _load_f32_anywhere(scale_bytes + 4 * np.intp(row)) if fmt == FP8_E4M3 else np.float32(1)
        row_by_table = by_table and scale - scale == 0  # finite
        if row_by_table:
            _fill_fp8_e4m3_table(table, scale, mode)
        for first in range(0, dim, CHUNK):
            count = min(CHUNK, dim - first)
            begin, end = first * row_bytes // dim, (first + count) * row_bytes // dim
            if prefetch_rows_ahead > 0:
                for byte in range(begin, end, 64):
                    prefetch(ahead + byte)
            position = destination + (np.intp(i) * dim + first) * word
            if row_by_table:
                _fp8_e4m3_by_table(source + begin, count, table, position, stream)
            elif by_nibble_table:
                _nibbles_by_table(fmt, source + begin, count, position, mode, stream)
            elif halves and stream:
                _dequantize_chunk(fmt, source + begin, count, scale, position, _TO_STREAMED_HALVES)
            elif halves:
                _dequantize_chunk(fmt, source + begin, count, scale, position, _TO_HALVES)
            elif bfloats and stream:
                _dequantize_chunk(fmt, source + begin, count, scale, position, _TO_STREAMED_BFLOAT16)
            elif bfloats:
                _dequantize_chunk(fmt, source + begin, count, scale, position, _TO_BFLOAT16)
            elif word == 4 and stream:
                _dequantize_chunk(fmt, source + begin, count, scale, position, _TO_STREAMED_FLOATS)
            elif word == 4:
                _dequantize_chunk(fmt, source + begin, count, scale, position, _TO_FLOATS)
            else:
                _dequantize_chunk(fmt, source + begin, count, scale, buf, _TO_FLOATS)
                _emit(buf, position, count, mode, stream)
    if stream:
        _fence()
    return skipped


@njit(**_JIT)
def dequantize_serial(fmt, data, scales, ids, out, mode, stream, prefetch_rows_ahead, touch_pages_rows_ahead):
    """Dequantize on the calling thread."""
    bad = first_bad_position(ids, _vocab_size(fmt, data, scales))
    if bad >= 0:
        return bad
    if dequantize_range(fmt, data, scales, ids, out, 0, ids.size, mode, stream, prefetch_rows_ahead,
                        touch_pages_rows_ahead):
        return CHANGED_DURING_COPY
    return -1


@njit(parallel=True, **_JIT)
def dequantize_parallel(fmt, data, scales, ids, out, mode, stream, prefetch_rows_ahead, touch_pages_rows_ahead,
                        n_blocks):
    """Dequantize in ``n_blocks`` contiguous blocks of rows spread over threads (each thread's writes sequential)."""
    bad = first_bad_position(ids, _vocab_size(fmt, data, scales))
    if bad >= 0:
        return bad
    skipped = 0
    for block in prange(n_blocks):
        start, stop = block * ids.size // n_blocks, (block + 1) * ids.size // n_blocks
        skipped += dequantize_range(fmt, data, scales, ids, out, start, stop, mode, stream, prefetch_rows_ahead,
                                    touch_pages_rows_ahead)
    return CHANGED_DURING_COPY if skipped else -1
