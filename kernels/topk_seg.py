"""Segment-parallel exact top-k of causal score rows (the SEG variant of kernels/topk.py).

The one-program-per-row select keeps one small program busy for a whole 256 KB row three times
over (6% of HBM bandwidth on the H200). Here every pass over the rows runs on a (row, segment)
grid, so a 4096-row chunk of 64K-key rows is 4096 x 16 programs of 4K keys each:
  1. FULL_PASSES x: histogram of the next RADIX_BITS digit of the keys matching the prefix,
     per segment, added into a per-row global histogram with atomics; then a per-row program
     picks the digit holding the k-th key (same arithmetic as topk_common.radix_pass).
  2. compaction: each segment writes its keys above the prefix straight to the row's output, and
     the keys on the prefix (candidates) to a scratch buffer, at positions from atomic counters.
  3. per row: the remaining digits on the candidates only, ties at the k-th key resolved to the
     lowest indices (a bisection over the index), the output sorted ascending. A row whose
     candidates overflow the scratch (CAP) redoes the remaining digits over the whole row.
Row reads: FULL_PASSES + 1, all of them at full grid parallelism. Output identical to topk.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.topk_common import emit_full, emit_short_row, ordered_key, radix_pass


@triton.jit
def _seg_hist_kernel(score_ptr, state_ptr, hist_ptr, shift_ptr, dmask_ptr, row0, offset, S, p,
                     stride_s, K: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr,
                     RADIX_BITS: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    seg0 = tl.program_id(1) * SEG
    if (n > K) & (seg0 < n):
        NB: tl.constexpr = 1 << RADIX_BITS
        st = state_ptr + r * 8
        prefix = tl.load(st).to(tl.uint32)
        pmask = tl.load(st + 1).to(tl.uint32)
        shift = tl.load(shift_ptr + p)
        dmask = tl.load(dmask_ptr + p)
        row = score_ptr + r.to(tl.int64) * stride_s
        hist = tl.zeros([NB], tl.int32)
        for start in range(seg0, tl.minimum(seg0 + SEG, n), BLOCK):
            idx = start + tl.arange(0, BLOCK)
            ok = (idx < n) & (idx < seg0 + SEG)
            key = ordered_key(tl.load(row + idx, mask=ok, other=0.0))
            match = ok & ((key & pmask) == prefix)
            hist += tl.histogram(((key >> shift) & dmask).to(tl.int32), NB, mask=match)
        tl.atomic_add(hist_ptr + r * NB + tl.arange(0, NB), hist, sem="relaxed")


@triton.jit
def _seg_select_kernel(state_ptr, hist_ptr, shift_ptr, dmask_ptr, row0, offset, S, p,
                       K: tl.constexpr, RADIX_BITS: tl.constexpr):
    """Pick the digit of the k-th key from the row's histogram; extend the prefix; clear the histogram."""
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    if n > K:
        NB: tl.constexpr = 1 << RADIX_BITS
        st = state_ptr + r * 8
        bins = tl.arange(0, NB)
        hist = tl.load(hist_ptr + r * NB + bins)
        remaining = tl.where(p == 0, K, tl.load(st + 2))
        at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist
        chosen = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
        above = tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
        shift = tl.load(shift_ptr + p)
        dmask = tl.load(dmask_ptr + p)
        prefix = tl.load(st).to(tl.uint32) | (chosen.to(tl.uint32) << shift)
        pmask = tl.load(st + 1).to(tl.uint32) | (dmask << shift)
        tl.store(st, prefix.to(tl.int64))
        tl.store(st + 1, pmask.to(tl.int64))
        tl.store(st + 2, (remaining - above).to(tl.int64))
        tl.store(hist_ptr + r * NB + bins, tl.zeros([NB], tl.int32))


@triton.jit
def _seg_compact_kernel(score_ptr, out_ptr, state_ptr, ckey_ptr, cidx_ptr, row0, offset, S,
                        stride_s, stride_o, stride_c, K: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr,
                        CAP: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    seg0 = tl.program_id(1) * SEG
    if (n > K) & (seg0 < n):
        st = state_ptr + r * 8
        prefix = tl.load(st).to(tl.uint32)
        pmask = tl.load(st + 1).to(tl.uint32)
        row = score_ptr + r.to(tl.int64) * stride_s
        out_row = out_ptr + (row0 + r).to(tl.int64) * stride_o
        for start in range(seg0, tl.minimum(seg0 + SEG, n), BLOCK):
            idx = start + tl.arange(0, BLOCK)
            ok = (idx < n) & (idx < seg0 + SEG)
            key = ordered_key(tl.load(row + idx, mask=ok, other=0.0))
            masked = key & pmask
            top = ok & (masked > prefix)
            cand = ok & (masked == prefix)
            n_top = tl.sum(top.to(tl.int32), axis=0)
            n_cand = tl.sum(cand.to(tl.int32), axis=0)
            if n_top > 0:
                base = tl.atomic_add(st + 3, n_top.to(tl.int64), sem="relaxed").to(tl.int32)
                tl.store(out_row + base + tl.cumsum(top.to(tl.int32), axis=0) - 1, idx, mask=top)
            if n_cand > 0:
                base = tl.atomic_add(st + 4, n_cand.to(tl.int64), sem="relaxed").to(tl.int32)
                pos = base + tl.cumsum(cand.to(tl.int32), axis=0) - 1
                keep = cand & (pos < CAP)
                tl.store(ckey_ptr + r.to(tl.int64) * stride_c + pos, key, mask=keep)
                tl.store(cidx_ptr + r.to(tl.int64) * stride_c + pos, idx, mask=keep)


@triton.jit
def _count_ties_below(ckey_row, cidx_row, n_cand, kth, bound, BLOCK: tl.constexpr):
    c = tl.zeros([], tl.int32)
    for start in range(0, n_cand, BLOCK):
        j = start + tl.arange(0, BLOCK)
        ok = j < n_cand
        key = tl.load(ckey_row + j, mask=ok, other=0)
        idx = tl.load(cidx_row + j, mask=ok, other=0)
        c += tl.sum((ok & (key == kth) & (idx < bound)).to(tl.int32), axis=0)
    return c


@triton.jit
def _seg_resolve_kernel(score_ptr, out_ptr, state_ptr, ckey_ptr, cidx_ptr, shift_ptr, dmask_ptr, row0, offset, S,
                        stride_s, stride_o, stride_c, K: tl.constexpr, BLOCK: tl.constexpr,
                        RADIX_BITS: tl.constexpr, N_PASSES: tl.constexpr, FULL_PASSES: tl.constexpr,
                        CAP: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)
    out_row = out_ptr + (row0 + r).to(tl.int64) * stride_o
    if n <= K:
        emit_short_row(out_row, n, K, BLOCK)
    else:
        st = state_ptr + r * 8
        prefix = tl.load(st).to(tl.uint32)
        pmask = tl.load(st + 1).to(tl.uint32)
        remaining = tl.load(st + 2).to(tl.int32)
        written = tl.load(st + 3).to(tl.int32)
        n_cand = tl.load(st + 4).to(tl.int32)
        row = score_ptr + r.to(tl.int64) * stride_s
        if n_cand > CAP:  # the scratch overflowed: finish over the whole row, in index order
            emit_full(row, out_row, n, prefix, pmask, remaining, shift_ptr, dmask_ptr,
                       FULL_PASSES, N_PASSES, RADIX_BITS, BLOCK)
        else:
            ckey_row = ckey_ptr + r.to(tl.int64) * stride_c
            cidx_row = cidx_ptr + r.to(tl.int64) * stride_c
            for p in tl.static_range(FULL_PASSES, N_PASSES):
                prefix, pmask, remaining, _ = radix_pass(ckey_row, n_cand, prefix, pmask, remaining,
                                                          tl.load(shift_ptr + p), tl.load(dmask_ptr + p),
                                                          RADIX_BITS, BLOCK, True)
            # prefix is the k-th key: the `remaining` lowest indices among candidates equal to it
            ties = _count_ties_below(ckey_row, cidx_row, n_cand, prefix, n, BLOCK)
            bound = n
            if ties > remaining:  # rare: bisect the index bound that admits exactly `remaining`
                lo = tl.zeros([], tl.int32)
                hi = n
                while lo < hi:
                    mid = (lo + hi) // 2
                    if _count_ties_below(ckey_row, cidx_row, n_cand, prefix, mid, BLOCK) >= remaining:
                        hi = mid
                    else:
                        lo = mid + 1
                bound = lo
            for start in range(0, n_cand, BLOCK):
                j = start + tl.arange(0, BLOCK)
                ok = j < n_cand
                key = tl.load(ckey_row + j, mask=ok, other=0)
                idx = tl.load(cidx_row + j, mask=ok, other=0)
                take = ok & ((key > prefix) | ((key == prefix) & (idx < bound)))
                take_i = take.to(tl.int32)
                tl.store(out_row + written + tl.cumsum(take_i, axis=0) - 1, idx, mask=take)
                written += tl.sum(take_i, axis=0)
            tl.debug_barrier()
            kk = tl.arange(0, K)
            tl.store(out_row + kk, tl.sort(tl.load(out_row + kk), dim=0))


def topk_rows_segmented(scores, row0, rows, offset, S, topk, out, shifts, masks, *, seg, block, radix_bits,
                        full_passes, cap, num_warps):
    """Same contract as topk.topk_rows_chunk; launches the four segment-parallel stages."""
    dev = scores.device
    nb = 1 << radix_bits
    state = torch.zeros((rows, 8), device=dev, dtype=torch.int64)  # prefix, pmask, remaining, written, n_cand
    hist = torch.zeros((rows, nb), device=dev, dtype=torch.int32)
    ckey = torch.empty((rows, cap), device=dev, dtype=torch.uint32)
    cidx = torch.empty((rows, cap), device=dev, dtype=torch.int32)
    grid2 = (rows, triton.cdiv(S, seg))
    common = {"K": topk, "num_warps": num_warps, "num_stages": 1}
    for p in range(full_passes):
        _seg_hist_kernel[grid2](scores, state, hist, shifts, masks, row0, offset, S, p, scores.stride(0),
                                SEG=seg, BLOCK=block, RADIX_BITS=radix_bits, **common)
        _seg_select_kernel[(rows,)](state, hist, shifts, masks, row0, offset, S, p, RADIX_BITS=radix_bits,
                                    **common)
    _seg_compact_kernel[grid2](scores, out, state, ckey, cidx, row0, offset, S, scores.stride(0), out.stride(0),
                               ckey.stride(0), SEG=seg, BLOCK=block, CAP=cap, **common)
    _seg_resolve_kernel[(rows,)](scores, out, state, ckey, cidx, shifts, masks, row0, offset, S, scores.stride(0),
                                 out.stride(0), ckey.stride(0), BLOCK=block, RADIX_BITS=radix_bits,
                                 N_PASSES=shifts.numel(), FULL_PASSES=full_passes, CAP=cap, **common)
