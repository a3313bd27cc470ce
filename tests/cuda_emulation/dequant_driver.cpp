// Exposes every instantiation of dequant_rows and check_ids to Python (ctypes)
// through the host emulation (cuda_host.h). Built by tests/test_cuda_dequant.py
// and by the CuPy test double (tests/cupy_double/), which launches the kernel
// source cupy.RawModule was given through these entry points.
#include "cuda_host.h"
#include "dequant.cu"

namespace {

struct Launch {
    unsigned grid, block;
    const unsigned* order;
    const void *data, *scales, *ids;
    void* out;
    long long n_ids, vocab_size, row_bytes, dim;
    unsigned long long* error;
};

template <typename F, typename O, typename Id>
int run(const Launch& l)
{
    fe_launch(l.grid, l.block, l.order, dequant_rows<F, O, Id>, static_cast<const unsigned char*>(l.data),
              static_cast<const float*>(l.scales), static_cast<const Id*>(l.ids),
              static_cast<typename O::type*>(l.out), l.n_ids, l.vocab_size, l.row_bytes, l.dim, l.error);
    return 0;
}

template <typename F, typename O>
int run_ids(int id_bytes, const Launch& l)
{
    if (id_bytes == 4) return run<F, O, int>(l);
    if (id_bytes == 8) return run<F, O, long long>(l);
    return 1;
}

template <typename F>
int run_output(int output, int id_bytes, const Launch& l)
{
    switch (output) {
    case 0: return run_ids<F, F32>(id_bytes, l);
    case 1: return run_ids<F, F16>(id_bytes, l);
    case 2: return run_ids<F, BF16>(id_bytes, l);
    }
    return 1;
}

const char* const FORMAT_NAMES[] = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "FP8_E4M3"};
const char* const OUTPUT_NAMES[] = {"F32", "F16", "BF16"};

}  // namespace

// The C++ name of format `index` (its position in the switch below), or null past the last.
extern "C" const char* fe_dequant_format_name(int index)
{
    return index >= 0 && index < 9 ? FORMAT_NAMES[index] : nullptr;
}

// The C++ name of output type `index` (0 F32, 1 F16, 2 BF16), or null past the last.
extern "C" const char* fe_dequant_output_name(int index)
{
    return index >= 0 && index < 3 ? OUTPUT_NAMES[index] : nullptr;
}

// Returns 0 after the launch, 1 for an unknown (format, output, id bytes), 2 when the kernel read outside
// every readable range (*fault: the address). readable: n_readable pairs of (start, end) byte addresses.
// block_order: a permutation of 0..grid-1, or null for the natural order.
extern "C" int fe_emulated_dequant(int format, int output, int id_bytes, unsigned grid, unsigned block,
                                   const unsigned* block_order, const void* data, const void* scales, const void* ids,
                                   void* out, long long n_ids, long long vocab_size, long long row_bytes, long long dim,
                                   unsigned long long* error, const void* const* readable, int n_readable,
                                   const void** fault)
{
    if (!fe_begin_reads(readable, n_readable)) return 1;
    const Launch l{grid, block, block_order, data, scales, ids, out, n_ids, vocab_size, row_bytes, dim, error};
    int status = 1;
    switch (format) {
    case 0: status = run_output<Q8_0>(output, id_bytes, l); break;
    case 1: status = run_output<Q4_0>(output, id_bytes, l); break;
    case 2: status = run_output<Q4_1>(output, id_bytes, l); break;
    case 3: status = run_output<Q5_0>(output, id_bytes, l); break;
    case 4: status = run_output<Q5_1>(output, id_bytes, l); break;
    case 5: status = run_output<Q4_K>(output, id_bytes, l); break;
    case 6: status = run_output<Q5_K>(output, id_bytes, l); break;
    case 7: status = run_output<Q6_K>(output, id_bytes, l); break;
    case 8: status = run_output<FP8_E4M3>(output, id_bytes, l); break;
    }
    return fe_end_reads(status, fault);
}

// check_ids<int or long long> over the ids; same status codes.
extern "C" int fe_emulated_check_ids(int id_bytes, unsigned grid, unsigned block, const unsigned* block_order,
                                     const void* ids, long long n_ids, long long vocab_size, unsigned long long* error,
                                     const void* const* readable, int n_readable, const void** fault)
{
    if (!fe_begin_reads(readable, n_readable)) return 1;
    int status = 1;
    if (id_bytes == 4) {
        fe_launch(grid, block, block_order, check_ids<int>, static_cast<const int*>(ids), n_ids, vocab_size, error);
        status = 0;
    } else if (id_bytes == 8) {
        fe_launch(grid, block, block_order, check_ids<long long>, static_cast<const long long*>(ids), n_ids,
                  vocab_size, error);
        status = 0;
    }
    return fe_end_reads(status, fault);
}
