// Host emulation of the few CUDA built-ins that fastembed/kernels/gather.cu
// uses, so that the kernel source compiles with g++ and every thread of a
// launch runs sequentially on the CPU (exact, since the kernel uses neither
// shared memory nor barriers).
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
