"""Sampled-threshold exact top-k of causal score rows (the SAMPLES variant of kernels/topk.py).

Measured on the H200: the radix variants are bound by per-key instructions (a histogram per
digit pass), not by HBM, and splitting rows over more programs did not help. This variant
touches each key once with cheap work:
  1. threshold: SAMPLES keys at a fixed stride; t = the r-th largest sample key, with r chosen so
     that about 1.5 k keys of the row are >= t (topk_common.threshold_at_count: a search over the
     samples in registers, no histogram);
  2. one read of the row: keys >= t are compacted (key, index; index order) into scratch;
  3. exact select on the candidates only (radix passes + ties to the lowest index, as topk.py).
Exact whatever the sample: a row whose candidate count is < k (threshold too high) or > CAP
(heavy ties) is finished by the full radix select over the row instead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.topk_common import emit_full, emit_short_row, finish_candidates, ordered_key, sampled_threshold


@triton.jit
def _topk_sample_kernel(score_ptr, out_ptr, ckey_ptr, cidx_ptr, shift_ptr, dmask_ptr, row0, offset, S,
                        stride_s, stride_o, stride_c, K: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr,
                        RADIX_BITS: tl.constexpr, N_PASSES: tl.constexpr, CAP: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    row = score_ptr + r.to(tl.int64) * stride_s
    out_row = out_ptr + (row0 + r).to(tl.int64) * stride_o
    if n <= K:
        emit_short_row(out_row, n, K, BLOCK)
    else:
        t = tl.zeros([], tl.uint32)
        if n > CAP:
            t = sampled_threshold(row, n, K, SAMPLES, 1, 1.0)
        ckey_row = ckey_ptr + r.to(tl.int64) * stride_c
        cidx_row = cidx_ptr + r.to(tl.int64) * stride_c
        n_cand = tl.zeros([], tl.int32)
        for start in range(0, n, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            ok = idx < n
            key = ordered_key(tl.load(row + idx, mask=ok, other=0.0))
            cand = ok & (key >= t)
            cand_i = cand.to(tl.int32)
            pos = n_cand + tl.cumsum(cand_i, axis=0) - 1
            keep = cand & (pos < CAP)
            tl.store(ckey_row + pos, key, mask=keep)
            tl.store(cidx_row + pos, idx, mask=keep)
            n_cand += tl.sum(cand_i, axis=0)
        tl.debug_barrier()  # candidates written by all threads before any thread reads them
        zero = tl.zeros([], tl.uint32)
        if (n_cand >= K) & (n_cand <= CAP):
            finish_candidates(out_row, ckey_row, cidx_row, n_cand, zero, zero, tl.full([], K, tl.int32),
                               tl.zeros([], tl.int32), shift_ptr, dmask_ptr, K, 0, N_PASSES, RADIX_BITS, BLOCK)
        else:
            emit_full(row, out_row, n, zero, zero, tl.full([], K, tl.int32), shift_ptr, dmask_ptr,
                       0, N_PASSES, RADIX_BITS, BLOCK)


def topk_rows_sampled(scores, row0, rows, offset, S, topk, out, shifts, masks, *, samples, block, radix_bits, cap,
                      num_warps):
    """Same contract as topk.topk_rows_chunk (one program per row)."""
    if cap < topk:
        raise ValueError(f"CAP ({cap}) must be >= topk ({topk})")
    ckey = torch.empty((rows, cap), device=scores.device, dtype=torch.uint32)
    cidx = torch.empty((rows, cap), device=scores.device, dtype=torch.int32)
    _topk_sample_kernel[(rows,)](scores, out, ckey, cidx, shifts, masks, row0, offset, S, scores.stride(0),
                                 out.stride(0), ckey.stride(0), K=topk, BLOCK=block, SAMPLES=samples,
                                 RADIX_BITS=radix_bits, N_PASSES=shifts.numel(), CAP=cap, num_warps=num_warps,
                                 num_stages=1)
