// Exposes every instantiation of gather_rows to Python (ctypes) through the
// host emulation. Built by tests/test_cuda_kernel_emulated.py.
#include "cuda_host.h"
#include "gather.cu"

template <typename Id, typename Vec>
static void run(unsigned grid, unsigned block, const void* table, const void* ids, void* out,
                long long n_ids, long long vocab_size, long long vecs_per_row, unsigned long long* error)
{
    fe_launch(grid, block, gather_rows<Id, Vec>, (const Vec*)table, (const Id*)ids, (Vec*)out,
              n_ids, vocab_size, vecs_per_row, error);
}

extern "C" int fe_emulated_gather(int id_bytes, int vec_bytes, unsigned grid, unsigned block,
                                  const void* table, const void* ids, void* out, long long n_ids,
                                  long long vocab_size, long long vecs_per_row, unsigned long long* error)
{
#define FE_CASE(ID, VEC)                                                                  \
    run<ID, VEC>(grid, block, table, ids, out, n_ids, vocab_size, vecs_per_row, error); \
    return 0;
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
    return 1;
}
