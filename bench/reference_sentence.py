"""Look up the reference sentence on the default 129,280 x 4,096 float16 table.

Prints the result's shape, the backend that served it and the time per call.
"""
from __future__ import annotations

import time

import numpy as np

import fastembed

REFERENCE_IDS = [5237, 23872, 301, 16652, 19602, 1148]

started = time.perf_counter()
embedding = fastembed.Embedding.random()
print(f"built {embedding} in {time.perf_counter() - started:.1f} s")
ids = np.array(REFERENCE_IDS)
rows = embedding(ids)
calls = 1000
started = time.perf_counter()
for _ in range(calls):
    embedding(ids, out=rows)
elapsed = (time.perf_counter() - started) / calls
print(f"shape {rows.shape} {rows.dtype}, backend {fastembed.select_backend(embedding.table, ids).backend}, "
      f"{elapsed * 1e6:.1f} us per lookup")
