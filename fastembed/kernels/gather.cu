// fastembed: the CUDA row gather. out[i, :] = table[ids[i], :].
//
// Compiled lazily by cupy.RawModule (NVRTC) with one instantiation per
// (id type, vector type); the host picks the widest vector type that divides
// the row size and both base addresses. The source is also compiled for the
// CPU by the tests (tests/cuda_emulation/), so it uses only the built-ins
// and the three helpers below, no shared memory and no __syncthreads: every
// thread is independent, which makes sequential emulation exact.

#ifndef FE_HOST_EMULATION
// Read-only data path (LDG.NC) for the table and the ids.
#define FE_LOAD_READONLY(pointer) __ldg(pointer)
#define FE_ATOMIC_MIN(address, value) atomicMin(address, value)
#endif

// error_position[0] holds the smallest position of an id outside
// [0, vocab_size); it must be initialised to ~0ull ("no error") by the host.
template <typename Id, typename Vec>
__global__ void gather_rows(const Vec* __restrict__ table,
                            const Id* __restrict__ ids,
                            Vec* __restrict__ out,
                            long long n_ids,
                            long long vocab_size,
                            long long vecs_per_row,
                            unsigned long long* __restrict__ error_position)
{
    // Rows are spread over blocks (grid-stride), vectors of a row over the
    // threads of a block: neighbouring threads touch neighbouring 16-byte
    // vectors, so every warp access is fully coalesced.
    for (long long i = blockIdx.x; i < n_ids; i += gridDim.x) {
        const long long row = (long long)FE_LOAD_READONLY(ids + i);
        Vec* destination = out + i * vecs_per_row;
        if (row < 0 || row >= vocab_size) {
            // Every thread that zeroes records it: each reads the id itself, and a writer may change it meanwhile.
            FE_ATOMIC_MIN(error_position, (unsigned long long)i);
            const Vec zero = Vec();  // value-initialised: all bytes zero
            for (long long v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
                destination[v] = zero;
            }
            continue;
        }
        const Vec* source = table + row * vecs_per_row;
        for (long long v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
            destination[v] = FE_LOAD_READONLY(source + v);
        }
    }
}
