// fastembed: the CUDA dequantizing gather. out[i, :] = dequantize(data[ids[i], :]).
//
// Rows of a quantized table are runs of ggml blocks (q8_0 ... q6_k) or fp8
// bytes with one float32 scale per row; they dequantize into float32, or
// into float16/bfloat16 rounded to nearest even. Results are bit for bit
// those of fastembed.formats.dequantize_rows (a NaN as the device's one NaN,
// without the reference's sign and payload): float32 arithmetic in the
// reference's order, every product and sum rounded on its own (__fmul_rn,
// __fadd_rn, __fsub_rn are never contracted into a fused multiply-add; the
// module is also compiled with --fmad=false).
//
// Compiled lazily by cupy.RawModule (NVRTC), one module per format, with one
// instantiation per (output type, id type). The source is also compiled for
// the CPU by the tests (tests/cuda_emulation/), so it uses only the
// built-ins and the helpers below, no shared memory, no warp intrinsics and
// no __syncthreads: every thread is independent, which makes sequential
// emulation exact.
//
// Work: one block per row (grid-stride over rows); a row's blocks are cut
// into units of 8, 16 or 32 values, one unit per thread at a time, so the
// threads of a warp read neighbouring bytes and write runs of 8 values
// (16-byte stores where the output allows).

#ifndef FE_HOST_EMULATION
#define FE_UNROLL _Pragma("unroll")
#define FE_LOAD_READONLY(pointer) __ldg(pointer)
#define FE_ATOMIC_MIN(address, value) atomicMin(address, value)
// A 16-byte store (st.global.v4: a plain assignment through a cast pointer is split into four).
#define FE_STORE16(pointer, value) __stwb(pointer, value)

// IEEE binary16 bits to float32 (exact).
__device__ __forceinline__ float FE_HALF_TO_FLOAT(unsigned short bits)
{
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}

// float32 to binary16 bits, rounded to nearest even (no flush of subnormals).
__device__ __forceinline__ unsigned short FE_FLOAT_TO_HALF(float value)
{
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
}

// float32 to bfloat16 bits, rounded to nearest even.
__device__ __forceinline__ unsigned short FE_FLOAT_TO_BFLOAT16(float value)
{
#if __CUDA_ARCH__ >= 800
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
#else
    const unsigned int word = __float_as_uint(value);
    if ((word & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    return (unsigned short)((word + 0x7FFFu + ((word >> 16) & 1u)) >> 16);
#endif
}
#endif

// -- loads: little-endian words at an address aligned to A bytes -----------------------------------

template <int A>
__device__ __forceinline__ unsigned int fe_u16(const unsigned char* p)
{
    if constexpr (A >= 2) {
        return FE_LOAD_READONLY(reinterpret_cast<const unsigned short*>(p));
    } else {
        return (unsigned int)FE_LOAD_READONLY(p) | ((unsigned int)FE_LOAD_READONLY(p + 1) << 8);
    }
}

template <int A>
__device__ __forceinline__ unsigned int fe_u32(const unsigned char* p)
{
    if constexpr (A >= 4) {
        return FE_LOAD_READONLY(reinterpret_cast<const unsigned int*>(p));
    } else {
        return fe_u16<A>(p) | (fe_u16<A>(p + 2) << 16);
    }
}

template <int A>
__device__ __forceinline__ uint2 fe_u64(const unsigned char* p)
{
    if constexpr (A >= 8) {
        return FE_LOAD_READONLY(reinterpret_cast<const uint2*>(p));
    } else {
        uint2 words;
        words.x = fe_u32<A>(p);
        words.y = fe_u32<A>(p + 4);
        return words;
    }
}

template <int A>
__device__ __forceinline__ uint4 fe_u128(const unsigned char* p)
{
    if constexpr (A >= 16) {
        return FE_LOAD_READONLY(reinterpret_cast<const uint4*>(p));
    } else {
        const uint2 low = fe_u64<A>(p), high = fe_u64<A>(p + 8);
        uint4 words;
        words.x = low.x;
        words.y = low.y;
        words.z = high.x;
        words.w = high.y;
        return words;
    }
}

// Byte k (0..7) of 8 little-endian bytes.
__device__ __forceinline__ unsigned int fe_byte(uint2 words, int k)
{
    return ((k < 4 ? words.x : words.y) >> (8 * (k & 3))) & 0xFFu;
}

// Byte k (0..15) of 16 little-endian bytes.
__device__ __forceinline__ unsigned int fe_byte16(uint4 words, int k)
{
    const unsigned int word = k < 4 ? words.x : k < 8 ? words.y : k < 12 ? words.z : words.w;
    return (word >> (8 * (k & 3))) & 0xFFu;
}

__device__ __forceinline__ float fe_half(unsigned int bits)
{
    return FE_HALF_TO_FLOAT((unsigned short)bits);
}

// -- formats ---------------------------------------------------------------------------------------
//
// Each format cuts a block into UNITS units of RUNS runs of 8 consecutive
// values; decode<A>(block, unit, v) writes run r of the unit into v[8r..8r+8),
// whose first value is at run_offset(unit, r) in the block. ALIGN: the
// alignment of every block when the rows' base address has it (block sizes
// are multiples of it); a table whose base lacks it is read byte by byte.

// d: f16 | 32 x int8. Unit u: values 8u..8u+8 and 16+8u..24+8u.
struct Q8_0 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 34, UNITS = 2, RUNS = 2, ALIGN = 2;

    static __device__ __forceinline__ int run_offset(int unit, int run) { return 8 * unit + 16 * run; }

    template <int A>
    static __device__ __forceinline__ void decode(const unsigned char* block, int unit, float* v)
    {
        const float d = fe_half(fe_u16<A>(block));
        FE_UNROLL
        for (int run = 0; run < RUNS; ++run) {
            const uint2 q = fe_u64<A>(block + 2 + run_offset(unit, run));
            FE_UNROLL
            for (int k = 0; k < 8; ++k) {
                v[8 * run + k] = __fmul_rn((float)(signed char)fe_byte(q, k), d);
            }
        }
    }
};

// Q4_0, Q4_1, Q5_0, Q5_1: 16 bytes of nibbles, value j in the low nibble of
// byte j and value j + 16 in its high nibble. Unit u: bytes 8u..8u+8, giving
// values 8u.. (low nibbles, run 0) and 16+8u.. (high nibbles, run 1).
struct NibbleBlock {
    static constexpr int BLOCK_VALUES = 32, UNITS = 2, RUNS = 2;

    static __device__ __forceinline__ int run_offset(int unit, int run) { return 8 * unit + 16 * run; }

    static __device__ __forceinline__ unsigned int nibble(uint2 q, int run, int k)
    {
        return (fe_byte(q, k) >> (4 * run)) & 0xFu;
    }

    // The fifth bit of the value at run_offset(unit, run) + k, from qh (bit j for value j).
    static __device__ __forceinline__ unsigned int fifth(unsigned int qh, int unit, int run, int k)
    {
        return ((qh >> (run_offset(unit, run) + k)) & 1u) << 4;
    }
};

// d: f16 | 16 bytes of nibbles; value = d * (q - 8).
struct Q4_0 : NibbleBlock {
    static constexpr int BLOCK_BYTES = 18, ALIGN = 2;

    template <int A>
    static __device__ __forceinline__ void decode(const unsigned char* block, int unit, float* v)
    {
        const float d = fe_half(fe_u16<A>(block));
        const uint2 q = fe_u64<A>(block + 2 + 8 * unit);
        FE_UNROLL
        for (int run = 0; run < RUNS; ++run) {
            FE_UNROLL
            for (int k = 0; k < 8; ++k) {
                v[8 * run + k] = __fmul_rn(d, (float)((int)nibble(q, run, k) - 8));
            }
        }
    }
};

// d: f16 | m: f16 | 16 bytes of nibbles; value = d * q + m.
struct Q4_1 : NibbleBlock {
    static constexpr int BLOCK_BYTES = 20, ALIGN = 4;

    template <int A>
    static __device__ __forceinline__ void decode(const unsigned char* block, int unit, float* v)
    {
        const unsigned int dm = fe_u32<A>(block);
        const float d = fe_half(dm & 0xFFFFu), m = fe_half(dm >> 16);
        const uint2 q = fe_u64<A>(block + 4 + 8 * unit);
        FE_UNROLL
        for (int run = 0; run < RUNS; ++run) {
            FE_UNROLL
            for (int k = 0; k < 8; ++k) {
                v[8 * run + k] = __fadd_rn(__fmul_rn(d, (float)nibble(q, run, k)), m);
            }
        }
    }
};

// d: f16 | qh: 4 bytes, bit j the fifth bit of value j | 16 bytes of nibbles; value = d * (q - 16).
struct Q5_0 : NibbleBlock {
    static constexpr int BLOCK_BYTES = 22, ALIGN = 2;

    template <int A>
    static __device__ __forceinline__ void decode(const unsigned char* block, int unit, float* v)
    {
        const float d = fe_half(fe_u16<A>(block));
        const unsigned int qh = fe_u32<A>(block + 2);
        const uint2 q = fe_u64<A>(block + 6 + 8 * unit);
        FE_UNROLL
        for (int run = 0; run < RUNS; ++run) {
            FE_UNROLL
            for (int k = 0; k < 8; ++k) {
                const int value = (int)(nibble(q, run, k) | fifth(qh, unit, run, k)) - 16;
                v[8 * run + k] = __fmul_rn(d, (float)value);
            }
        }
    }
};

// d: f16 | m: f16 | qh: 4 bytes | 16 bytes of nibbles; value = d * q + m.
struct Q5_1 : NibbleBlock {
    static constexpr int BLOCK_BYTES = 24, ALIGN = 8;

    template <int A>
    static __device__ __forceinline__ void decode(const unsigned char* block, int unit, float* v)
    {
        const uint2 header = fe_u64<A>(block);
        const float d = fe_half(header.x & 0xFFFFu), m = fe_half(header.x >> 16);
        const uint2 q = fe_u64<A>(block + 8 + 8 * unit);
        FE_UNROLL
        for (int run = 0; run < RUNS; ++run) {
            FE_UNROLL
            for (int k = 0; k < 8; ++k) {
                const unsigned int value = nibble(q, run, k) | fifth(header.y, unit, run, k);
                v[8 * run + k] = __fadd_rn(__fmul_rn(d, (float)value), m);
            }
        }
    }
};

// Q4_K and Q5_K: d: f16 | dmin: f16 | 12 bytes of six-bit scales and mins |
// ...; 8 sub-blocks of 32 values, value = (d * scale) * q - (dmin * min).
// Value 64i + l (l < 32) is the low nibble of qs[32i + l], value 64i + 32 + l
// its high nibble. Unit u = 4i + k: qs bytes 32i + 8k.. (8 of them), giving
// values 64i + 8k.. (sub-block 2i, run 0) and 64i + 32 + 8k.. (2i + 1, run 1).
struct KBlock {
    static constexpr int BLOCK_VALUES = 256, UNITS = 16, RUNS = 2, ALIGN = 16;

    static __device__ __forceinline__ int run_offset(int unit, int run)
    {
        return 64 * (unit >> 2) + 32 * run + 8 * (unit & 3);
    }

    // Six-bit scale (mins = false) or min (mins = true) of sub-block s, from the 16-byte header.
    static __device__ __forceinline__ unsigned int six_bits(uint4 header, int s, bool mins)
    {
        // Of the 12 packed bytes (header bytes 4..15), 0..3 are "low", 4..7 "high", 8..11 "mixed".
        const int low = 4 + (mins ? 4 : 0);
        if (s < 4) {
            return fe_byte16(header, low + s) & 0x3Fu;
        }
        const unsigned int mixed = fe_byte16(header, 12 + s - 4);
        const unsigned int top = (fe_byte16(header, low + s - 4) >> 2) & 0x30u;
        return (mins ? mixed >> 4 : mixed & 0x0Fu) | top;
    }

    // Writes (d * scale) * q - (dmin * min) for the unit's two runs, q[0..16) the unit's quants.
    static __device__ __forceinline__ void scale(uint4 header, int unit, const unsigned int* q, float* v)
    {
        const float d = fe_half(header.x & 0xFFFFu), dmin = fe_half(header.x >> 16);
        FE_UNROLL
        for (int run = 0; run < RUNS; ++run) {
            const int s = 2 * (unit >> 2) + run;
            const float ds = __fmul_rn(d, (float)six_bits(header, s, false));
            const float dm = __fmul_rn(dmin, (float)six_bits(header, s, true));
            FE_UNROLL
            for (int k = 0; k < 8; ++k) {
                v[8 * run + k] = __fsub_rn(__fmul_rn(ds, (float)q[8 * run + k]), dm);
            }
        }
    }
};

// Header (16 bytes) | 128 bytes of nibbles.
struct Q4_K : KBlock {
    static constexpr int BLOCK_BYTES = 144;

    template <int A>
    static __device__ __forceinline__ void decode(const unsigned char* block, int unit, float* v)
    {
        const uint4 header = fe_u128<A>(block);
        const uint2 qs = fe_u64<A>(block + 16 + 32 * (unit >> 2) + 8 * (unit & 3));
        unsigned int q[16];
        FE_UNROLL
        for (int k = 0; k < 8; ++k) {
            q[k] = fe_byte(qs, k) & 0xFu;
            q[8 + k] = fe_byte(qs, k) >> 4;
        }
        scale(header, unit, q, v);
    }
};

// Header (16 bytes) | qh: 32 bytes, bit b of byte l the fifth bit of value 32b + l | 128 bytes of nibbles.
struct Q5_K : KBlock {
    static constexpr int BLOCK_BYTES = 176;

    template <int A>
    static __device__ __forceinline__ void decode(const unsigned char* block, int unit, float* v)
    {
        const uint4 header = fe_u128<A>(block);
        const int i = unit >> 2, k8 = 8 * (unit & 3);
        const uint2 qh = fe_u64<A>(block + 16 + k8);
        const uint2 qs = fe_u64<A>(block + 48 + 32 * i + k8);
        unsigned int q[16];
        FE_UNROLL
        for (int k = 0; k < 8; ++k) {
            const unsigned int high = fe_byte(qh, k) >> (2 * i);
            q[k] = (fe_byte(qs, k) & 0xFu) | ((high & 1u) << 4);
            q[8 + k] = (fe_byte(qs, k) >> 4) | ((high & 2u) << 3);
        }
        scale(header, unit, q, v);
    }
};

// ql: 128 bytes of low nibbles | qh: 64 bytes of 2-bit high parts | 16 int8
// scales | d: f16. Value 128h + 32r + l (l < 32): low four bits from
// ql[64h + l] (r = 0), ql[64h + 32 + l] (r = 1) or their high nibbles (r = 2,
// 3), high two bits (qh[32h + l] >> 2r) & 3; value = (d * scales[v / 16]) * (q - 32).
// Unit u = 4h + k: l = 8k.., all four r (32 values).
struct Q6_K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 210, UNITS = 8, RUNS = 4, ALIGN = 2;

    static __device__ __forceinline__ int run_offset(int unit, int run)
    {
        return 128 * (unit >> 2) + 32 * run + 8 * (unit & 3);
    }

    template <int A>
    static __device__ __forceinline__ void decode(const unsigned char* block, int unit, float* v)
    {
        const int h = unit >> 2, k = unit & 3;
        const uint2 ql_low = fe_u64<A>(block + 64 * h + 8 * k);
        const uint2 ql_high = fe_u64<A>(block + 64 * h + 32 + 8 * k);
        const uint2 qh = fe_u64<A>(block + 128 + 32 * h + 8 * k);
        const uint2 scales = fe_u64<A>(block + 192 + 8 * h);
        const float d = fe_half(fe_u16<A>(block + 208));
        FE_UNROLL
        for (int run = 0; run < RUNS; ++run) {
            const uint2 ql = (run & 1) ? ql_high : ql_low;
            const float ds = __fmul_rn(d, (float)(signed char)fe_byte(scales, 2 * run + (k >> 1)));
            FE_UNROLL
            for (int j = 0; j < 8; ++j) {
                const unsigned int low = (fe_byte(ql, j) >> (4 * (run >> 1))) & 0xFu;
                const unsigned int high = (fe_byte(qh, j) >> (2 * run)) & 3u;
                v[8 * run + j] = __fmul_rn(ds, (float)((int)(low | (high << 4)) - 32));
            }
        }
    }
};

// One float8_e4m3fn byte per value, times the row's float32 scale. Units of
// 8 values; the row is dim bytes, so rows are read 8 bytes at a time only
// when dim and the base address allow it.
struct FP8_E4M3 {
    static constexpr int BLOCK_VALUES = 1, BLOCK_BYTES = 1, ALIGN = 8;

    // float8_e4m3fn (no infinities; S.1111.111 is NaN) to float32, exactly.
    static __device__ __forceinline__ float to_float(unsigned int byte)
    {
        const unsigned int magnitude = byte & 0x7Fu;
        // The bits placed as a float32 with exponent bias 127 are the value times 2^-120: scaling by
        // 2^120 is exact and turns the e4m3 subnormals (exponent 0) into float32 normals.
        float value = __fmul_rn(__uint_as_float(magnitude << 20), 0x1p120f);
        if (magnitude == 0x7Fu) {
            value = __uint_as_float(0x7FFFFFFFu);
        }
        return __uint_as_float(__float_as_uint(value) | ((byte & 0x80u) << 24));
    }
};

// -- output types ----------------------------------------------------------------------------------

struct F32 {
    typedef float type;
    static __device__ __forceinline__ float convert(float value) { return value; }
};

struct F16 {
    typedef unsigned short type;  // binary16 bits
    static __device__ __forceinline__ unsigned short convert(float value) { return FE_FLOAT_TO_HALF(value); }
};

struct BF16 {
    typedef unsigned short type;  // bfloat16 bits
    static __device__ __forceinline__ unsigned short convert(float value) { return FE_FLOAT_TO_BFLOAT16(value); }
};

// Stores v[0..8) at p: 16-byte stores when `vector` (p is then 16-byte aligned), else one value at a time.
template <typename O>
__device__ __forceinline__ void fe_store8(typename O::type* p, const float* v, bool vector)
{
    if (vector) {
        if constexpr (sizeof(typename O::type) == 4) {
            uint4 first, second;
            first.x = __float_as_uint(v[0]);
            first.y = __float_as_uint(v[1]);
            first.z = __float_as_uint(v[2]);
            first.w = __float_as_uint(v[3]);
            second.x = __float_as_uint(v[4]);
            second.y = __float_as_uint(v[5]);
            second.z = __float_as_uint(v[6]);
            second.w = __float_as_uint(v[7]);
            FE_STORE16(reinterpret_cast<uint4*>(p), first);
            FE_STORE16(reinterpret_cast<uint4*>(p) + 1, second);
        } else {
            uint4 packed;
            packed.x = (unsigned int)O::convert(v[0]) | ((unsigned int)O::convert(v[1]) << 16);
            packed.y = (unsigned int)O::convert(v[2]) | ((unsigned int)O::convert(v[3]) << 16);
            packed.z = (unsigned int)O::convert(v[4]) | ((unsigned int)O::convert(v[5]) << 16);
            packed.w = (unsigned int)O::convert(v[6]) | ((unsigned int)O::convert(v[7]) << 16);
            FE_STORE16(reinterpret_cast<uint4*>(p), packed);
        }
    } else {
        FE_UNROLL
        for (int k = 0; k < 8; ++k) {
            p[k] = O::convert(v[k]);
        }
    }
}

// -- one row ---------------------------------------------------------------------------------------

// The threads of the block dequantize one row of a block format into `destination`.
template <typename F, int A, typename O>
__device__ __forceinline__ void fe_block_row(const unsigned char* source, typename O::type* destination,
                                             long long dim, bool vector)
{
    const long long units = dim / F::BLOCK_VALUES * F::UNITS;
    for (long long t = threadIdx.x; t < units; t += blockDim.x) {
        const long long block = t / F::UNITS;
        const int unit = (int)(t % F::UNITS);
        float v[8 * F::RUNS];
        F::template decode<A>(source + block * F::BLOCK_BYTES, unit, v);
        FE_UNROLL
        for (int run = 0; run < F::RUNS; ++run) {
            fe_store8<O>(destination + block * F::BLOCK_VALUES + F::run_offset(unit, run), v + 8 * run, vector);
        }
    }
}

// The threads of the block dequantize one fp8 row (dim values from its first byte, any dim) times `scale`; a
// row of more bytes than values (row_bytes > dim) has its last values written one by one, never past dim.
template <int A, typename O>
__device__ __forceinline__ void fe_fp8_row(const unsigned char* source, float scale, typename O::type* destination,
                                           long long dim, bool vector)
{
    const long long units = (dim + 7) / 8;
    for (long long t = threadIdx.x; t < units; t += blockDim.x) {
        const long long first = 8 * t;
        if (first + 8 <= dim) {
            const uint2 bytes = fe_u64<A>(source + first);
            float v[8];
            FE_UNROLL
            for (int k = 0; k < 8; ++k) {
                v[k] = __fmul_rn(FP8_E4M3::to_float(fe_byte(bytes, k)), scale);
            }
            fe_store8<O>(destination + first, v, vector);
        } else {
            for (long long j = first; j < dim; ++j) {
                destination[j] = O::convert(__fmul_rn(FP8_E4M3::to_float(FE_LOAD_READONLY(source + j)), scale));
            }
        }
    }
}

template <typename F, int A, typename O>
__device__ __forceinline__ void fe_row(const unsigned char* source, const float* scales, long long row,
                                       typename O::type* destination, long long dim, bool vector)
{
    if constexpr (F::BLOCK_VALUES == 1) {
        fe_fp8_row<A, O>(source, FE_LOAD_READONLY(scales + row), destination, dim, vector);
    } else {
        fe_block_row<F, A, O>(source, destination, dim, vector);
    }
}

// -- kernels ---------------------------------------------------------------------------------------

// out[i, :] = dequantize(data[ids[i], :]) as O, for i < n_ids; rows are row_bytes apart, dim values each.
// scales: one float32 per row (fp8; ignored otherwise, but a valid pointer). A bad id is never read: its
// row is written as zeros and its position atomicMin'd into error_position (initialised to ~0ull).
template <typename F, typename O, typename Id>
__global__ void dequant_rows(const unsigned char* __restrict__ data,
                             const float* __restrict__ scales,
                             const Id* __restrict__ ids,
                             typename O::type* __restrict__ out,
                             long long n_ids,
                             long long vocab_size,
                             long long row_bytes,
                             long long dim,
                             unsigned long long* __restrict__ error_position)
{
    // Wide loads need every row's base aligned; 16-byte stores need every run of 8 outputs aligned.
    const bool aligned = (unsigned long long)data % F::ALIGN == 0 && row_bytes % F::ALIGN == 0;
    const bool vector = (unsigned long long)out % 16 == 0 && (dim * (long long)sizeof(typename O::type)) % 16 == 0;
    for (long long i = blockIdx.x; i < n_ids; i += gridDim.x) {
        const long long row = (long long)FE_LOAD_READONLY(ids + i);
        typename O::type* destination = out + i * dim;
        if (row < 0 || row >= vocab_size) {
            // Every thread that zeroes records it: each reads the id itself, and a writer may change it meanwhile.
            FE_ATOMIC_MIN(error_position, (unsigned long long)i);
            for (long long j = threadIdx.x; j < dim; j += blockDim.x) {
                destination[j] = O::convert(0.0f);
            }
            continue;
        }
        const unsigned char* source = data + row * row_bytes;
        if (aligned) {
            fe_row<F, F::ALIGN, O>(source, scales, row, destination, dim, vector);
        } else {
            fe_row<F, 1, O>(source, scales, row, destination, dim, vector);
        }
    }
}

// error_position[0] = min(itself, the smallest i with ids[i] outside [0, vocab_size)); nothing else is written.
template <typename Id>
__global__ void check_ids(const Id* __restrict__ ids,
                          long long n_ids,
                          long long vocab_size,
                          unsigned long long* __restrict__ error_position)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_ids; i += stride) {
        const long long row = (long long)FE_LOAD_READONLY(ids + i);
        if (row < 0 || row >= vocab_size) {
            FE_ATOMIC_MIN(error_position, (unsigned long long)i);
        }
    }
}
