"""How fast the filter's access pattern alone can stream a chunk of causal score rows (bench only).

One program per row, the same pipelined loop of unmasked BLOCK loads as kernels/topk_filter.py's
filter, but with nothing appended: COUNT=0 keeps only a running max (the loads' floor), COUNT=1 also
counts the keys >= a fixed threshold (the compare without the prefix sum and the stores). The filter's
time over these floors says whether it waits on memory or on its own instructions.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _stream_floor_kernel(score_ptr, out_ptr, row0, offset, S, stride_s, t_f, BLOCK: tl.constexpr,
                         STAGES: tl.constexpr, COUNT: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    row = score_ptr + r.to(tl.int64) * stride_s
    n_full = (n // BLOCK) * BLOCK
    acc = tl.zeros([BLOCK], tl.float32)
    hits = tl.zeros([BLOCK], tl.int32)
    for start in tl.range(0, n_full, BLOCK, num_stages=STAGES):
        x = tl.load(row + start + tl.arange(0, BLOCK))
        if COUNT:
            hits += (x >= t_f).to(tl.int32)
        else:
            acc = tl.maximum(acc, x)
    tl.store(out_ptr + r, tl.max(acc, axis=0) + tl.sum(hits, axis=0).to(tl.float32))


def stream_floor(scores, row0, rows, offset, S, *, block, warps, stages, count, t_f=3.0):
    """Launch over rows [0, rows) of the chunk; returns the per-row result (kept so the loads stay)."""
    import torch

    out = torch.empty((rows,), device=scores.device, dtype=torch.float32)
    _stream_floor_kernel[(rows,)](scores, out, row0, offset, S, scores.stride(0), t_f, BLOCK=block, STAGES=stages,
                                  COUNT=bool(count), num_warps=warps, num_stages=stages)
    return out
