// Exposes every instantiation of gather_rows to Python (ctypes) through the
// host emulation (cuda_host.h). Built by tests/test_cuda_kernel_compiled.py
// and by the CuPy test double (tests/cupy_double/), which launches the
// kernel source cupy.RawModule was given through this entry point.
#include "cuda_host.h"
#include "gather.cu"

template <typename Id, typename Vec>
static void run(unsigned grid, unsigned block, const unsigned* order, const void* table, const void* ids, void* out,
                long long n_ids, long long vocab_size, long long vecs_per_row, unsigned long long* error)
{
    fe_launch(grid, block, order, gather_rows<Id, Vec>, (const Vec*)table, (const Id*)ids, (Vec*)out,
              n_ids, vocab_size, vecs_per_row, error);
}

// Returns 0 after the launch, 1 for an unknown (id bytes, vector bytes) pair,
// 2 when the kernel read outside every readable range (*fault: the address).
// readable: n_readable pairs of (start, end) byte addresses; 0 pairs: no check.
// block_order: a permutation of 0..grid-1, or null for the natural order.
extern "C" int fe_emulated_gather(int id_bytes, int vec_bytes, unsigned grid, unsigned block, const unsigned* block_order,
                                  const void* table, const void* ids, void* out, long long n_ids,
                                  long long vocab_size, long long vecs_per_row, unsigned long long* error,
                                  const void* const* readable, int n_readable, const void** fault)
{
    if (n_readable < 0 || n_readable > FE_MAX_RANGES) return 1;
    fe_read_ranges = n_readable;
    for (int r = 0; r < n_readable; ++r) {
        fe_read_start[r] = static_cast<const char*>(readable[2 * r]);
        fe_read_end[r] = static_cast<const char*>(readable[2 * r + 1]);
    }
    fe_fault_address = nullptr;
    int status = 1;
#define FE_CASE(ID, VEC)                                                                             \
    run<ID, VEC>(grid, block, block_order, table, ids, out, n_ids, vocab_size, vecs_per_row, error); \
    status = 0;                                                                                      \
    break;
    if (id_bytes == 4) {
        switch (vec_bytes) {
        case 16: FE_CASE(int, uint4) case 8: FE_CASE(int, uint2) case 4: FE_CASE(int, unsigned int)
        case 2: FE_CASE(int, unsigned short) case 1: FE_CASE(int, unsigned char)
        }
    } else if (id_bytes == 8) {
        switch (vec_bytes) {
        case 16: FE_CASE(long long, uint4) case 8: FE_CASE(long long, uint2) case 4: FE_CASE(long long, unsigned int)
        case 2: FE_CASE(long long, unsigned short) case 1: FE_CASE(long long, unsigned char)
        }
    }
#undef FE_CASE
    if (status == 0 && fe_fault_address != nullptr) {
        if (fault) *fault = fe_fault_address;
        status = 2;
    }
    fe_read_ranges = 0;
    return status;
}
