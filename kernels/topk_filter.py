"""Filter-then-select exact top-k of causal score rows (the FILTER variant of kernels/topk.py).

Why two kernels. The sampled variant (topk_sample.py) already reads each row once, but it does the
compaction and the select in one program, so the select's footprint (a 2048-wide sort, radix
histograms: 80-122 registers a thread) sets the occupancy of the streaming part, and each 512-key
block is loaded, scanned and stored before the next load is issued: about 2 KB in flight per
program, a latency-bound 0.5 TB/s on the H200 (11% of the copy rate). Here:
  1. filter, one lean program per row: a threshold t from SAMPLES sampled keys (runs of RUN
     neighbouring keys, so that a sample costs a 32-byte sector and not one per key; SPLIT_T: by a
     kernel of their own), then one pipelined pass over the row (num_stages > 1: the next blocks'
     loads are in flight while one block is scanned) that appends every score >= t (a float
     compare: the threshold is turned back into its float once) to the row's candidate lists, the
     raw fp32 score and its int32 index in two arrays, in index order, and stores the count (it
     keeps counting past CAP). The appends go through topk_common.scatter_b32 on CUDA: through
     tl.store, the prefix sum that places them ran in a one-key-per-thread layout and the filter
     took 0.83 ms against 0.59 (H200, 4096 x 64K rows; the loads alone 0.26 ms).
  2. select, one program per row, everything in registers: the CAP-slot candidate lists (or the row
     itself when it has <= CAP keys), the k-th largest key by threshold_at_count (a ternary search),
     ties at it to the lowest indices (the candidates are in index order: a prefix count), and
     the k indices written ascending through a prefix sum: no sort, no scratch reread.
Exact whatever the sample: if >= k keys of a row are >= t, its k-th key is >= t, so every key the
full select would take (ties included) is a candidate. A row with fewer than k candidates (t too
high) or more than CAP (t too low, heavy ties) is finished by the full radix select over the row
(topk_common.emit_full) inside the select kernel.
The float compare keeps a superset of the keys >= t (-0.0 and +0.0 compare equal; NaN scores are
kept by `x != x`), which is all exactness needs: the select orders the candidates by ordered_key.
Row reads: one, plus SAMPLES / RUN sectors for the threshold; candidates: ~1.5 k x 8 bytes written
and read back.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.topk_common import (emit_full, emit_in_order, emit_short_row, ordered_key, sampled_threshold,
                                 scatter_b32, select_in_registers, threshold_at_count)


class Candidates(NamedTuple):
    """What the filter leaves for the select: per row, up to CAP scores and their indices in index
    order, and how many keys passed the threshold (past CAP when they overflowed)."""
    scores: torch.Tensor
    indices: torch.Tensor
    counts: torch.Tensor  # [rows, SEGS]: SEGS lists of CAP / SEGS slots a row (kernels' SEGS)


@triton.jit
def _threshold_kernel(score_ptr, t_ptr, row0, offset, S, stride_s, K: tl.constexpr, SAMPLES: tl.constexpr,
                      RUN: tl.constexpr, CAP: tl.constexpr):
    """SPLIT_T: each filtered row's threshold, by a kernel of its own (the samples' registers then do
    not bound the streaming kernel's occupancy: 95 registers with 4096 samples in it, 56 without)."""
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    if n > CAP:
        tl.store(t_ptr + r, sampled_threshold(score_ptr + r.to(tl.int64) * stride_s, n, K, SAMPLES, RUN))


@triton.jit
def key_to_float(t):
    # the inverse of ordered_key: the fp32 whose ordered key is t
    sign_bit = tl.full([], 0x80000000, tl.uint32)
    bits = tl.where((t & sign_bit) != 0, t ^ sign_bit, t ^ tl.full([], 0xFFFFFFFF, tl.uint32))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_threshold(score_ptr, t_ptr, r, n, stride_s, K: tl.constexpr, SAMPLES: tl.constexpr, RUN: tl.constexpr,
                   SPLIT_T: tl.constexpr):
    """Row r's scores and its threshold as a float (from SPLIT_T's kernel, or sampled here)."""
    row = score_ptr + r.to(tl.int64) * stride_s
    if SPLIT_T:
        t = tl.load(t_ptr + r)
    else:
        t = sampled_threshold(row, n, K, SAMPLES, RUN)
    return row, key_to_float(t)


@triton.jit
def _filter_kernel(score_ptr, ckey_ptr, cidx_ptr, count_ptr, t_ptr, row0, offset, S, stride_s, stride_c,
                   K: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr, RUN: tl.constexpr,
                   CAP: tl.constexpr, STAGES: tl.constexpr, SPLIT_T: tl.constexpr, ASM_STORE: tl.constexpr,
                   SEGS: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    if SEGS > 1:
        if n > CAP:
            _filter_row_in_segments(score_ptr, ckey_ptr, cidx_ptr, count_ptr, t_ptr, r, n, stride_s, stride_c, K,
                                    BLOCK, SAMPLES, RUN, CAP, STAGES, SPLIT_T, ASM_STORE, SEGS)
    elif n > CAP:  # shorter rows are selected straight from the scores
        row, t_f = _row_threshold(score_ptr, t_ptr, r, n, stride_s, K, SAMPLES, RUN, SPLIT_T)
        ckey_row = ckey_ptr + r.to(tl.int64) * stride_c
        cidx_row = cidx_ptr + r.to(tl.int64) * stride_c
        n_full = (n // BLOCK) * BLOCK
        n_cand = tl.zeros([], tl.int32)
        # whole blocks unmasked (16-byte loads), pipelined; then the row's tail, masked
        for start in tl.range(0, n_full, BLOCK, num_stages=STAGES):
            idx = start + tl.arange(0, BLOCK)
            x = tl.load(row + idx)
            n_cand = _append_hits(ckey_row, cidx_row, n_cand, x, idx, (x >= t_f) | (x != x), CAP, ASM_STORE)
        idx = n_full + tl.arange(0, BLOCK)
        ok = idx < n
        x = tl.load(row + idx, mask=ok, other=0.0)
        n_cand = _append_hits(ckey_row, cidx_row, n_cand, x, idx, ok & ((x >= t_f) | (x != x)), CAP, ASM_STORE)
        tl.store(count_ptr + r, n_cand)


@triton.jit
def _filter_row_in_segments(score_ptr, ckey_ptr, cidx_ptr, count_ptr, t_ptr, r, n, stride_s, stride_c,
                            K: tl.constexpr, BLOCK: tl.constexpr, SAMPLES: tl.constexpr, RUN: tl.constexpr,
                            CAP: tl.constexpr, STAGES: tl.constexpr, SPLIT_T: tl.constexpr,
                            ASM_STORE: tl.constexpr, SEGS: tl.constexpr):
    """SEGS > 1: the row's whole blocks cut into SEGS contiguous ranges, scanned side by side as the
    rows of a [SEGS, BLOCK / SEGS] tile (one warp a row when BLOCK / SEGS = 128 and SEGS = warps), each
    appending to its own CAP / SEGS slots, so that the prefix sums and counts never cross warps (no
    barrier per block); the tail goes after the last range's. The segments, read in order, are in
    index order."""
    W: tl.constexpr = BLOCK // SEGS
    SEG_CAP: tl.constexpr = CAP // SEGS
    row, t_f = _row_threshold(score_ptr, t_ptr, r, n, stride_s, K, SAMPLES, RUN, SPLIT_T)
    ckey_row = ckey_ptr + r.to(tl.int64) * stride_c
    cidx_row = cidx_ptr + r.to(tl.int64) * stride_c
    q = (n // BLOCK) * W  # keys per range: whole blocks only
    seg = tl.arange(0, SEGS)
    lane = seg[:, None] * q + tl.arange(0, W)[None, :]
    slot = seg[:, None] * SEG_CAP
    cnt = tl.zeros([SEGS], tl.int32)
    for start in tl.range(0, q, W, num_stages=STAGES):
        idx = lane + start
        x = tl.load(row + idx)
        hit = ((x >= t_f) | (x != x)).to(tl.int32)
        pos = cnt[:, None] + tl.cumsum(hit, axis=1) - 1
        keep = (hit != 0) & (pos < SEG_CAP)
        if ASM_STORE:
            scatter_b32(ckey_row + slot + pos, x.to(tl.int32, bitcast=True), keep)
            scatter_b32(cidx_row + slot + pos, idx, keep)
        else:
            tl.store(ckey_row + slot + pos, x, mask=keep)
            tl.store(cidx_row + slot + pos, idx, mask=keep)
        cnt += tl.sum(hit, axis=1)
    last = tl.sum(tl.where(seg == SEGS - 1, cnt, 0), axis=0)
    idx = q * SEGS + tl.arange(0, BLOCK)
    ok = idx < n
    x = tl.load(row + idx, mask=ok, other=0.0)
    last = _append_hits(ckey_row + (SEGS - 1) * SEG_CAP, cidx_row + (SEGS - 1) * SEG_CAP, last, x, idx,
                        ok & ((x >= t_f) | (x != x)), SEG_CAP, ASM_STORE)
    tl.store(count_ptr + r * SEGS + seg, tl.where(seg == SEGS - 1, last, cnt))


@triton.jit
def _append_hits(ckey_row, cidx_row, n_cand, x, idx, hit, CAP: tl.constexpr, ASM_STORE: tl.constexpr):
    """Append the hits' scores and indices after the row's n_cand candidates; the new count."""
    hit_i = hit.to(tl.int32)
    pos = n_cand + tl.cumsum(hit_i, axis=0) - 1
    keep = hit & (pos < CAP)
    if ASM_STORE:
        scatter_b32(ckey_row + pos, x.to(tl.int32, bitcast=True), keep)
        scatter_b32(cidx_row + pos, idx, keep)
    else:
        tl.store(ckey_row + pos, x, mask=keep)
        tl.store(cidx_row + pos, idx, mask=keep)
    return n_cand + tl.sum(hit_i, axis=0)




@triton.jit
def _select_kernel(score_ptr, ckey_ptr, cidx_ptr, count_ptr, out_ptr, shift_ptr, dmask_ptr, row0, offset, S,
                   stride_s, stride_c, stride_o, K: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
                   RADIX_BITS: tl.constexpr, N_PASSES: tl.constexpr, ASM_STORE: tl.constexpr,
                   SEGS: tl.constexpr, EMIT_CHUNK: tl.constexpr):
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
            fits = count <= CAP
        elif SEGS == 1:
            count = tl.load(count_ptr + r)
            fits = count <= CAP
            ok = j < count
            key = ordered_key(tl.load(ckey_ptr + r.to(tl.int64) * stride_c + j, mask=ok, other=0.0))
            idx = tl.load(cidx_ptr + r.to(tl.int64) * stride_c + j, mask=ok, other=0)
        else:  # SEGS lists of CAP / SEGS slots, read in order: index order, with gaps masked
            SEG_CAP: tl.constexpr = CAP // SEGS
            cnts = tl.load(count_ptr + r * SEGS + tl.arange(0, SEGS))
            count = tl.sum(cnts, axis=0)
            fits = tl.max(cnts, axis=0) <= SEG_CAP
            jj = tl.arange(0, SEG_CAP)[None, :]
            ok2 = jj < cnts[:, None]
            off = r.to(tl.int64) * stride_c + tl.arange(0, SEGS)[:, None] * SEG_CAP + jj
            ok = tl.reshape(ok2, [CAP])
            key = tl.reshape(ordered_key(tl.load(ckey_ptr + off, mask=ok2, other=0.0)), [CAP])
            idx = tl.reshape(tl.load(cidx_ptr + off, mask=ok2, other=0), [CAP])
        in_tile = (count >= K) & fits
        if EMIT_CHUNK == 0:
            if in_tile:
                select_in_registers(key, idx, ok, out_row, 0, K, True, ASM_STORE)
        else:
            if in_tile:  # the k-th key from the keys alone, then the indices streamed back (one warp a row)
                kth = threshold_at_count(key, ok, K)
                need = K - tl.sum((ok & (key > kth)).to(tl.int32), axis=0)
                if n <= CAP:
                    emit_in_order(row, row, n, kth, need, out_row, True, EMIT_CHUNK, ASM_STORE)
                else:
                    emit_in_order(ckey_ptr + r.to(tl.int64) * stride_c, cidx_ptr + r.to(tl.int64) * stride_c,
                                  count, kth, need, out_row, False, EMIT_CHUNK, ASM_STORE)
        if not in_tile:  # the sampled threshold missed (or heavy ties): full radix select over the row
            zero = tl.zeros([], tl.uint32)
            emit_full(row, out_row, n, zero, zero, tl.full([], K, tl.int32), shift_ptr, dmask_ptr,
                      0, N_PASSES, RADIX_BITS, BLOCK)


def asm_stores(t: torch.Tensor) -> bool:
    """Whether the kernels' scattered stores go through inline PTX (topk_common.scatter_b32): on a CUDA
    tensor, not under TRITON_INTERPRET=1 (the interpreter runs no PTX)."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


def row_thresholds(scores, row0, rows, offset, S, topk, *, samples, run, cap, warps=4):
    """SPLIT_T's first kernel: each row's sampled threshold (uint32 ordered key; unset for rows of <= CAP keys).
    ``warps``: fewer warps a row make the search's reductions cheaper (one warp: shuffles only, no
    barrier) and hold more samples a thread."""
    thresh = torch.empty((rows,), device=scores.device, dtype=torch.uint32)
    _threshold_kernel[(rows,)](scores, thresh, row0, offset, S, scores.stride(0), K=topk, SAMPLES=samples,
                               RUN=run, CAP=cap, num_warps=warps, num_stages=1)
    return thresh


def filter_rows(scores, row0, rows, offset, S, topk, *, samples, run, block, cap, warps, stages, split_t=False,
                asm_store=None, thresh=None, segs=1, t_warps=4):
    """Phase 1: the rows' candidates, Candidates(scores [rows, CAP] fp32, indices [rows, CAP] int32,
    counts [rows, segs] int32: per row the keys >= t of each of its segs lists of CAP / segs slots;
    0 for rows with <= CAP keys, which the select reads from the scores).
    ``split_t``: the thresholds by a kernel of their own first (row_thresholds; or ``thresh``, given). ``asm_store`` (default: asm_stores(scores))
    picks the candidates' store path (benchmarks compare both)."""
    if cap < topk or cap & (cap - 1):
        raise ValueError(f"CAP ({cap}) must be a power of two >= topk ({topk})")
    if samples % run or samples & (samples - 1):
        raise ValueError(f"SAMPLES ({samples}) must be a power of two and a multiple of RUN ({run})")
    if segs < 1 or segs & (segs - 1) or block % segs or cap % segs:
        raise ValueError(f"SEGS ({segs}) must be a power of two dividing BLOCK ({block}) and CAP ({cap})")
    ckey = torch.empty((rows, cap), device=scores.device, dtype=torch.float32)
    cidx = torch.empty((rows, cap), device=scores.device, dtype=torch.int32)
    count = torch.zeros((rows, segs), device=scores.device, dtype=torch.int32)
    if split_t and thresh is None:
        thresh = row_thresholds(scores, row0, rows, offset, S, topk, samples=samples, run=run, cap=cap,
                                warps=t_warps)
    if not split_t:
        thresh = count  # unread
    _filter_kernel[(rows,)](scores, ckey, cidx, count, thresh, row0, offset, S, scores.stride(0), ckey.stride(0),
                            K=topk, BLOCK=block, SAMPLES=samples, RUN=run, CAP=cap, STAGES=stages,
                            SPLIT_T=bool(split_t), SEGS=segs,
                            ASM_STORE=asm_stores(scores) if asm_store is None else asm_store, num_warps=warps, num_stages=stages)
    return Candidates(ckey, cidx, count)


def select_rows(scores, cand, row0, rows, offset, S, topk, out, shifts, masks, *, radix_bits, warps, asm_store=None,
                emit_chunk=0):
    """Phase 2: the exact top-k of each row from its Candidates (or its scores) into out[row0 + r].
    ``emit_chunk`` > 0: only the keys stay in registers for the k-th key's search, and the indices are
    emitted reading the lists back that many at a time (for a select of one warp a row)."""
    if emit_chunk and cand.counts.shape[1] > 1:
        raise ValueError("emit_chunk reads one candidate list a row: filter with segs=1")
    _select_kernel[(rows,)](scores, cand.scores, cand.indices, cand.counts, out, shifts, masks, row0, offset, S,
                            scores.stride(0), cand.scores.stride(0), out.stride(0), K=topk,
                            CAP=cand.scores.shape[1], BLOCK=1024,
                            RADIX_BITS=radix_bits, N_PASSES=shifts.numel(), SEGS=cand.counts.shape[1],
                            EMIT_CHUNK=emit_chunk,
                            ASM_STORE=asm_stores(scores) if asm_store is None else asm_store,
                            num_warps=warps, num_stages=1)


def topk_rows_filtered(scores, row0, rows, offset, S, topk, out, shifts, masks, *, samples, run, block, cap,
                       radix_bits, filter_warps, filter_stages, select_warps, split_t=False, segs=1, t_warps=4,
                       emit_chunk=0):
    """Same contract as topk.topk_rows_chunk: filter_rows, then select_rows."""
    cand = filter_rows(scores, row0, rows, offset, S, topk, samples=samples, run=run, block=block,
                       cap=cap, warps=filter_warps, stages=filter_stages, split_t=split_t, segs=segs,
                       t_warps=t_warps)
    select_rows(scores, cand, row0, rows, offset, S, topk, out, shifts, masks, radix_bits=radix_bits,
                warps=select_warps, emit_chunk=emit_chunk)
