"""How fast the filter's access pattern alone can stream a chunk of causal score rows (bench only).

One program per row, the same pipelined loop of unmasked BLOCK loads as kernels/topk_filter.py's
filter, but with nothing appended: COUNT=0 keeps only a running max (the loads' floor), COUNT=1 also
counts the keys >= a fixed threshold (the compare without the prefix sum and the stores). The filter's
time over these floors says whether it waits on memory or on its own instructions. The same for the
select: its tile loaded (SEARCH=0), then the k-th key searched (SEARCH=1), against the whole select.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.topk_common import LAST_KEYS, kth_key, ordered_key, sample_positions, search_bracket


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


SELECT_STAGES = ("load", "search", "kth", "search_to_one")  # what select_floor runs of the select


@triton.jit
def _select_floor_kernel(ckey_ptr, cidx_ptr, count_ptr, out_ptr, scratch_ptr, stride_c, K: tl.constexpr,
                         CAP: tl.constexpr, STAGE: tl.constexpr):
    """The select's tile without its emission: load the CAP-slot candidate lists of a row (STAGE 0);
    also narrow to the k-th key's window as kth_key does (1: search_bracket down to LAST_KEYS keys);
    also rank that window (2: topk_common.kth_key, as the select runs it); or, instead of the rank, search
    on until the bracket is one key wide (3: what kth_key's rank replaces); store one word a row."""
    r = tl.program_id(0)
    j = tl.arange(0, CAP)
    count = tl.load(count_ptr + r)
    ok = j < count
    key = ordered_key(tl.load(ckey_ptr + r.to(tl.int64) * stride_c + j, mask=ok, other=0.0))
    idx = tl.load(cidx_ptr + r.to(tl.int64) * stride_c + j, mask=ok, other=0)
    if STAGE == 0:
        res = tl.max(key, axis=0)
    elif STAGE == 1:
        res = search_bracket(key, ok, K, -1, LAST_KEYS)[0].to(tl.uint32)
    elif STAGE == 2:
        res = kth_key(key, ok, K, scratch_ptr + r.to(tl.int64) * K, K, False)[0]
    else:
        res = search_bracket(key, ok, K, -1, 0)[0].to(tl.uint32)
    tl.store(out_ptr + r, res + tl.max(idx, axis=0).to(tl.uint32))


def select_floor(cand, rows, topk, *, warps, stage):
    """Launch over the rows of a topk_filter.Candidates (rows with k..CAP candidates); returns the
    per-row word. ``stage``: one of SELECT_STAGES."""
    import torch

    out = torch.empty((rows,), device=cand.scores.device, dtype=torch.uint32)
    scratch = torch.empty((rows, topk), device=cand.scores.device, dtype=torch.int32)
    _select_floor_kernel[(rows,)](cand.scores, cand.indices, cand.counts, out, scratch, cand.scores.stride(0),
                                  K=topk, CAP=cand.scores.shape[1], STAGE=SELECT_STAGES.index(stage),
                                  num_warps=warps, num_stages=1)
    return out


@triton.jit
def _threshold_floor_kernel(score_ptr, out_ptr, row0, offset, S, stride_s, SAMPLES: tl.constexpr, RUN: tl.constexpr,
                            CAP: tl.constexpr):
    """The sampled threshold's loads without its search: the same SAMPLES keys in runs of RUN
    (topk_common.sampled_threshold's addresses), one max a row."""
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    if n > CAP:
        pos, _ = sample_positions(n, SAMPLES, RUN)
        ok = pos < n
        keys = ordered_key(tl.load(score_ptr + r.to(tl.int64) * stride_s + pos, mask=ok, other=0.0))
        tl.store(out_ptr + r, tl.max(keys, axis=0))


def threshold_floor(scores, row0, rows, offset, S, *, samples, run, cap):
    """Launch over rows [0, rows) of the chunk; returns the per-row word."""
    import torch

    out = torch.empty((rows,), device=scores.device, dtype=torch.uint32)
    _threshold_floor_kernel[(rows,)](scores, out, row0, offset, S, scores.stride(0), SAMPLES=samples, RUN=run,
                                     CAP=cap, num_warps=4, num_stages=1)
    return out
