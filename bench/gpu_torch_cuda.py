"""A torch CUDA table through lookup: bit for bit torch.index_select, no copy, on torch's current (side) stream.

Run by bench/gpu_check.sh: ``python bench/gpu_torch_cuda.py``; its lines go to OUTDIR/torch-cuda.txt.
"""
try:
    import torch
except ImportError:
    print("torch cuda: skipped (torch is not installed)")
    raise SystemExit(0) from None

import fastembed
from fastembed.backends import cuda_backend

if not torch.cuda.is_available():
    print("torch cuda: skipped (this torch sees no CUDA device)")
    raise SystemExit(0)
import cupy

calls = []
gather = cuda_backend.BACKEND.gather


def spy(table, ids, out):
    result = gather(table, ids, out)
    calls.append({"stream": cupy.cuda.get_current_stream().ptr, "table": table.data.ptr, "ids": ids.data.ptr,
                  "result": result.data.ptr})
    return result


cuda_backend.BACKEND.gather = spy
table = torch.randn((16384, 4096), device="cuda").to(torch.bfloat16)
ids = torch.randint(0, table.shape[0], (8192,), device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    result = fastembed.lookup(table, ids)
    out = torch.empty_like(result)
    returned = fastembed.lookup(table, ids, out=out)
    try:
        fastembed.lookup(table, torch.tensor([0, table.shape[0]], device="cuda"))
        bad_id = False
    except IndexError:
        bad_id = True
    after_error = fastembed.lookup(table, ids[:4])
torch.cuda.synchronize()
expected = torch.index_select(table, 0, ids)
checks = {
    "bit for bit index_select (allocating and out=)": torch.equal(result.view(torch.int16), expected.view(torch.int16))
    and torch.equal(out.view(torch.int16), expected.view(torch.int16)),
    "result is a torch bfloat16 CUDA tensor on the table's device": result.dtype == torch.bfloat16
    and result.device == table.device,
    "out= returns out": returned is out,
    "zero-copy: table and ids pointers": all(c["table"] == table.data_ptr() for c in calls) and calls[0]["ids"] == ids.data_ptr(),
    "zero-copy: result and out pointers": calls[0]["result"] == result.data_ptr() and calls[1]["result"] == out.data_ptr(),
    "on torch's current stream (a side stream)": side.cuda_stream != 0 and all(c["stream"] == side.cuda_stream for c in calls),
    "bad id: IndexError, then the next lookup works": bad_id and torch.equal(after_error.view(torch.int16), expected[:4].view(torch.int16)),
}
for name, ok in checks.items():
    print(f"torch cuda: {'PASS' if ok else 'FAIL'} {name}")
raise SystemExit(0 if all(checks.values()) else 1)
