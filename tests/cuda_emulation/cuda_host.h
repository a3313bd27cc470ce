// Host emulation of the few CUDA built-ins that fastembed/kernels/gather.cu
// uses, so that the kernel source compiles with g++ and every thread of a
// launch runs sequentially on the CPU (exact, since the kernel uses neither
// shared memory nor barriers).
#pragma once
#include <cstring>

#define FE_HOST_EMULATION 1
#define __global__
#define __restrict__ __restrict

struct fe_dim3 { unsigned int x = 1, y = 1, z = 1; };
static fe_dim3 threadIdx, blockIdx, blockDim, gridDim;

struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };

template <typename T> static inline T FE_LOAD_READONLY(const T* pointer) { return *pointer; }
static inline unsigned long long FE_ATOMIC_MIN(unsigned long long* address, unsigned long long value)
{
    unsigned long long old = *address;
    if (value < old) *address = value;
    return old;
}

// Run kernel(args...) for every block and thread of a 1-D launch.
template <typename Kernel, typename... Args>
static void fe_launch(unsigned int grid, unsigned int block, Kernel kernel, Args... args)
{
    gridDim.x = grid;
    blockDim.x = block;
    for (blockIdx.x = 0; blockIdx.x < grid; ++blockIdx.x)
        for (threadIdx.x = 0; threadIdx.x < block; ++threadIdx.x)
            kernel(args...);
}
