// Host emulation of the few CUDA built-ins that fastembed/kernels/gather.cu
// and dequant.cu use, so that the kernel sources compile with g++ and every
// thread of a launch runs sequentially on the CPU (exact, since the kernels
// use neither shared memory nor barriers).
//
// Two checks a real launch would not make: blocks run in an order the caller
// gives (a permutation of the grid, so no result may depend on launch order),
// and every read through FE_LOAD_READONLY must lie inside a range the caller
// declared readable (the table's and the ids' bytes); a read outside them is
// not performed and is recorded as a fault instead. State is thread_local, so
// launches from several host threads at once do not interfere.
#pragma once
#include <cstddef>
#include <cstring>

#define FE_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define FE_UNROLL
#define __restrict__ __restrict

struct fe_dim3 { unsigned int x = 1, y = 1, z = 1; };
static thread_local fe_dim3 threadIdx, blockIdx, blockDim, gridDim;

struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };

// Readable byte ranges [start, end) of the current launch; none declared: no check.
static const int FE_MAX_RANGES = 8;
static thread_local const char* fe_read_start[FE_MAX_RANGES];
static thread_local const char* fe_read_end[FE_MAX_RANGES];
static thread_local int fe_read_ranges = 0;
static thread_local const void* fe_fault_address = nullptr;  // the first read outside every range

static inline bool fe_readable(const void* pointer, std::size_t size)
{
    if (fe_read_ranges == 0) return true;
    const char* start = static_cast<const char*>(pointer);
    for (int r = 0; r < fe_read_ranges; ++r)
        if (start >= fe_read_start[r] && start + size <= fe_read_end[r]) return true;
    return false;
}

template <typename T> static inline T FE_LOAD_READONLY(const T* pointer)
{
    if (!fe_readable(pointer, sizeof(T))) {
        if (fe_fault_address == nullptr) fe_fault_address = pointer;
        return T();
    }
    return *pointer;
}

static inline void FE_STORE16(uint4* pointer, uint4 value) { *pointer = value; }

static inline unsigned long long FE_ATOMIC_MIN(unsigned long long* address, unsigned long long value)
{
    unsigned long long old = *address;
    if (value < old) *address = value;
    return old;
}

// Run kernel(args...) for every block and thread of a 1-D launch; blocks in
// the order block_order[0..grid) (nullptr: 0, 1, ..., grid - 1).
template <typename Kernel, typename... Args>
static void fe_launch(unsigned int grid, unsigned int block, const unsigned int* block_order, Kernel kernel, Args... args)
{
    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned int k = 0; k < grid; ++k) {
        blockIdx.x = block_order ? block_order[k] : k;
        for (threadIdx.x = 0; threadIdx.x < block; ++threadIdx.x)
            kernel(args...);
    }
}

// -- float arithmetic and conversions (dequant.cu) ------------------------------------------------
// Each rounds once, to nearest even, like the device instructions; the
// emulation is built with -ffp-contract=off so that no product is fused into
// a sum. NaN results are the device's canonical ones only for the
// conversions to 16 bits (the tests compare NaNs as NaNs, not by payload).

static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }

static inline unsigned int __float_as_uint(float value)
{
    unsigned int bits;
    std::memcpy(&bits, &value, sizeof bits);
    return bits;
}

static inline float __uint_as_float(unsigned int bits)
{
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

// binary16 bits to float32, exactly (cvt.f32.f16).
static inline float FE_HALF_TO_FLOAT(unsigned short half)
{
    const unsigned int sign = (unsigned int)(half & 0x8000u) << 16;
    const unsigned int exponent = (half >> 10) & 0x1Fu, mantissa = half & 0x3FFu;
    if (exponent == 0x1F) return __uint_as_float(sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u));
    if (exponent != 0) return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    const float magnitude = (float)mantissa * 5.9604644775390625e-8f;  // subnormal: mantissa * 2^-24, exact
    return __uint_as_float(sign | __float_as_uint(magnitude));
}

// float32 to binary16 bits, rounded to nearest even, subnormals kept (cvt.rn.f16.f32).
static inline unsigned short FE_FLOAT_TO_HALF(float value)
{
    const unsigned int bits = __float_as_uint(value);
    const unsigned int sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) return 0x7FFF;
    if (magnitude >= 0x477FF000u) return (unsigned short)(sign | 0x7C00u);  // >= 65520: infinity
    if (magnitude >= 0x38800000u) {  // a binary16 normal: rebias the exponent, round off 13 bits
        const unsigned int rebiased = magnitude - 0x38000000u;
        return (unsigned short)(sign | ((rebiased + 0xFFFu + ((rebiased >> 13) & 1u)) >> 13));
    }
    const unsigned int exponent = magnitude >> 23;
    if (exponent < 102) return (unsigned short)sign;  // below half the smallest subnormal: zero
    const unsigned int significand = (magnitude & 0x7FFFFFu) | 0x800000u, shift = 126 - exponent;
    unsigned int result = significand >> shift;
    const unsigned int rest = significand & ((1u << shift) - 1u), half_unit = 1u << (shift - 1);
    if (rest > half_unit || (rest == half_unit && (result & 1u))) ++result;
    return (unsigned short)(sign | result);
}

// float32 to bfloat16 bits, rounded to nearest even (cvt.rn.bf16.f32).
static inline unsigned short FE_FLOAT_TO_BFLOAT16(float value)
{
    const unsigned int bits = __float_as_uint(value);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
    return (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// -- launch bookkeeping shared by the drivers -------------------------------------------------------

// Declares the readable ranges of the next launch: n pairs (start, end) of byte addresses.
static inline bool fe_begin_reads(const void* const* readable, int n)
{
    if (n < 0 || n > FE_MAX_RANGES) return false;
    fe_read_ranges = n;
    for (int r = 0; r < n; ++r) {
        fe_read_start[r] = static_cast<const char*>(readable[2 * r]);
        fe_read_end[r] = static_cast<const char*>(readable[2 * r + 1]);
    }
    fe_fault_address = nullptr;
    return true;
}

// Ends the launch: status 2 (and *fault) when a read fell outside every range, else `status`.
static inline int fe_end_reads(int status, const void** fault)
{
    if (status == 0 && fe_fault_address != nullptr) {
        if (fault) *fault = fe_fault_address;
        status = 2;
    }
    fe_read_ranges = 0;
    return status;
}
