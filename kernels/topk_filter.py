"""Filter-then-select exact top-k of causal score rows (the FILTER variant of kernels/topk.py).

Why two kernels. The sampled variant (topk_sample.py) already reads each row once, but it does the
compaction and the select in one program, so the select's footprint (a 2048-wide sort, radix
histograms: 80-122 registers a thread) sets the occupancy of the streaming part, and each 512-key
block is loaded, scanned and stored before the next load is issued: about 2 KB in flight per
program, a latency-bound 0.5 TB/s on the H200 (11% of the copy rate). Here:
  1. filter, one lean program per row: a threshold t from SAMPLES sampled keys (runs of RUN
     neighbouring keys, so that a sample costs a 32-byte sector and not one per key), then one
     pipelined pass over the row (num_stages > 1: the next blocks' loads are in flight while one
     block is scanned) that appends every key >= t to the row's candidate list as one 64-bit word
     (ordered key << 32 | index), in index order, and stores the count (it keeps counting past CAP).
  2. select, one program per row, everything in registers: the CAP-slot candidate list (or the row
     itself when it has <= CAP keys), the k-th largest key by a bitwise search (32 count passes),
     ties at it to the lowest indices (the candidates are in index order: a prefix count), and
     the k indices written ascending through a prefix sum: no sort, no scratch reread.
Exact whatever the sample: if >= k keys of a row are >= t, its k-th key is >= t, so every key the
full select would take (ties included) is a candidate. A row with fewer than k candidates (t too
high) or more than CAP (t too low, heavy ties) is finished by the full radix select over the row
(topk_common.emit_full) inside the select kernel.
Row reads: one, plus SAMPLES / RUN sectors for the threshold; candidates: ~1.5 k x 8 bytes written
and read back.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.topk_common import emit_full, emit_short_row, ordered_key, sampled_threshold, select_in_registers


@triton.jit
def _threshold_kernel(score_ptr, t_ptr, row0, offset, S, stride_s, K: tl.constexpr, SAMPLES: tl.constexpr,
                      RUN: tl.constexpr, CAP: tl.constexpr):
    """SPLIT_T: each filtered row's threshold, by a kernel of its own (the samples' registers then do
    not bound the streaming kernel's occupancy: 127 registers with 4096 samples in it, 80 with 2048)."""
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    if n > CAP:
        tl.store(t_ptr + r, sampled_threshold(score_ptr + r.to(tl.int64) * stride_s, n, K, SAMPLES, RUN))


@triton.jit
def _filter_kernel(score_ptr, cand_ptr, count_ptr, t_ptr, row0, offset, S, stride_s, stride_c,
                   K: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr, RUN: tl.constexpr,
                   CAP: tl.constexpr, STAGES: tl.constexpr, SPLIT_T: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    if n > CAP:  # shorter rows are selected straight from the scores
        row = score_ptr + r.to(tl.int64) * stride_s
        if SPLIT_T:
            t = tl.load(t_ptr + r)
        else:
            t = sampled_threshold(row, n, K, SAMPLES, RUN)
        cand_row = cand_ptr + r.to(tl.int64) * stride_c
        n_full = (n // BLOCK) * BLOCK
        n_cand = tl.zeros([], tl.int32)
        # whole blocks unmasked (16-byte loads), pipelined; then the row's tail, masked
        for start in tl.range(0, n_full, BLOCK, num_stages=STAGES):
            idx = start + tl.arange(0, BLOCK)
            key = ordered_key(tl.load(row + idx))
            n_cand = _append_hits(cand_row, n_cand, key, idx, key >= t, CAP)
        idx = n_full + tl.arange(0, BLOCK)
        ok = idx < n
        key = ordered_key(tl.load(row + idx, mask=ok, other=0.0))
        n_cand = _append_hits(cand_row, n_cand, key, idx, ok & (key >= t), CAP)
        tl.store(count_ptr + r, n_cand)


@triton.jit
def _append_hits(cand_row, n_cand, key, idx, hit, CAP: tl.constexpr):
    """Append (key << 32 | index) of the hits after the row's n_cand candidates; the new count."""
    hit_i = hit.to(tl.int32)
    pos = n_cand + tl.cumsum(hit_i, axis=0) - 1
    word = (key.to(tl.uint64) << 32) | idx.to(tl.uint64)
    tl.store(cand_row + pos, word, mask=hit & (pos < CAP))
    return n_cand + tl.sum(hit_i, axis=0)


@triton.jit
def _select_kernel(score_ptr, cand_ptr, count_ptr, out_ptr, shift_ptr, dmask_ptr, row0, offset, S,
                   stride_s, stride_c, stride_o, K: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                   RADIX_BITS: tl.constexpr, N_PASSES: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    row = score_ptr + r.to(tl.int64) * stride_s
    out_row = out_ptr + (row0 + r).to(tl.int64) * stride_o
    if n <= K:
        emit_short_row(out_row, n, K, BLOCK)
    else:
        j = tl.arange(0, CAP)
        if n <= CAP:  # every key of the row is a candidate, in index order
            count = n
            ok = j < n
            key = ordered_key(tl.load(row + j, mask=ok, other=0.0))
            idx = j
        else:
            count = tl.load(count_ptr + r)
            ok = j < count
            word = tl.load(cand_ptr + r.to(tl.int64) * stride_c + j, mask=ok, other=0)
            key = (word >> 32).to(tl.uint32)
            idx = (word & 0xFFFFFFFF).to(tl.int32)
        if (count >= K) & (count <= CAP):
            select_in_registers(key, idx, ok, out_row, 0, K, True)
        else:  # the sampled threshold missed (or heavy ties): full radix select over the row
            zero = tl.zeros([], tl.uint32)
            emit_full(row, out_row, n, zero, zero, tl.full([], K, tl.int32), shift_ptr, dmask_ptr,
                      0, N_PASSES, RADIX_BITS, BLOCK)


def filter_rows(scores, row0, rows, offset, S, topk, *, samples, run, block, cap, warps, stages, split_t=False):
    """Phase 1: the rows' candidate lists [rows, CAP] (uint64 words) and counts [rows] (int32; 0 for rows
    with <= CAP keys, which the select reads from the scores). ``split_t``: the thresholds by a kernel
    of their own first."""
    if cap < topk or cap & (cap - 1):
        raise ValueError(f"CAP ({cap}) must be a power of two >= topk ({topk})")
    if samples % run or samples & (samples - 1):
        raise ValueError(f"SAMPLES ({samples}) must be a power of two and a multiple of RUN ({run})")
    cand = torch.empty((rows, cap), device=scores.device, dtype=torch.uint64)
    count = torch.zeros((rows,), device=scores.device, dtype=torch.int32)
    thresh = count  # unread unless split_t
    if split_t:
        thresh = torch.empty((rows,), device=scores.device, dtype=torch.uint32)
        _threshold_kernel[(rows,)](scores, thresh, row0, offset, S, scores.stride(0), K=topk, SAMPLES=samples,
                                   RUN=run, CAP=cap, num_warps=4, num_stages=1)
    _filter_kernel[(rows,)](scores, cand, count, thresh, row0, offset, S, scores.stride(0), cand.stride(0),
                            K=topk, BLOCK=block, SAMPLES=samples, RUN=run, CAP=cap, STAGES=stages,
                            SPLIT_T=bool(split_t), num_warps=warps, num_stages=stages)
    return cand, count


def select_rows(scores, cand, count, row0, rows, offset, S, topk, out, shifts, masks, *, radix_bits, warps):
    """Phase 2: the exact top-k of each row from its candidates (or its scores) into out[row0 + r]."""
    _select_kernel[(rows,)](scores, cand, count, out, shifts, masks, row0, offset, S, scores.stride(0),
                            cand.stride(0), out.stride(0), K=topk, CAP=cand.shape[1], BLOCK=1024,
                            RADIX_BITS=radix_bits, N_PASSES=shifts.numel(), num_warps=warps, num_stages=1)


def topk_rows_filtered(scores, row0, rows, offset, S, topk, out, shifts, masks, *, samples, run, block, cap,
                       radix_bits, filter_warps, filter_stages, select_warps, split_t=False):
    """Same contract as topk.topk_rows_chunk: filter_rows, then select_rows."""
    cand, count = filter_rows(scores, row0, rows, offset, S, topk, samples=samples, run=run, block=block,
                              cap=cap, warps=filter_warps, stages=filter_stages, split_t=split_t)
    select_rows(scores, cand, count, row0, rows, offset, S, topk, out, shifts, masks, radix_bits=radix_bits,
                warps=select_warps)
