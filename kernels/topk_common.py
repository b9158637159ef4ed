"""Radix-select building blocks shared by the exact top-k variants (kernels/topk.py, topk_sample.py,
topk_seg.py): the fp32 -> ordered uint32 key map, one digit pass, and the two ways to emit a row's
k indices (over the whole row, or over a compacted candidate buffer), and, at the end, the helpers
for candidate buffers in any order (kernels/indexer_fused.py). Public so that each variant
imports them from here, so topk_sample.py and topk_seg.py import nothing from topk.py (which
dispatches to them).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ordered_key(x):
    # fp32 -> uint32 whose unsigned order is the float order (negatives flipped).
    bits = x.to(tl.uint32, bitcast=True)
    sign_bit = tl.full([], 0x80000000, tl.uint32)
    all_ones = tl.full([], 0xFFFFFFFF, tl.uint32)
    return tl.where((bits & sign_bit) != 0, bits ^ all_ones, bits | sign_bit)


@triton.jit
def emit_short_row(out_row, n, K: tl.constexpr, BLOCK: tl.constexpr):
    """A row with n <= K valid keys selects them all: 0..n-1, then -1 up to K."""
    for start in range(0, K, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        tl.store(out_row + idx, tl.where(idx < n, idx, -1), mask=idx < K)


@triton.jit
def radix_pass(ptr, n, prefix, prefix_mask, remaining, shift, digit_mask,
                RADIX_BITS: tl.constexpr, BLOCK: tl.constexpr, KEYS: tl.constexpr):
    """Histogram one digit of the keys that match ``prefix``; pick the digit holding the k-th.

    ``ptr`` holds fp32 scores, or uint32 keys when KEYS. Returns the extended prefix and mask,
    how many keys are still needed from the new prefix, and how many keys share it."""
    NB: tl.constexpr = 1 << RADIX_BITS
    hist = tl.zeros([NB], tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < n
        if KEYS:
            key = tl.load(ptr + idx, mask=ok, other=0)
        else:
            key = ordered_key(tl.load(ptr + idx, mask=ok, other=0.0))
        match = ok & ((key & prefix_mask) == prefix)
        digit = ((key >> shift) & digit_mask).to(tl.int32)
        hist += tl.histogram(digit, NB, mask=match)
    bins = tl.arange(0, NB)
    at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= bin
    chosen = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
    in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
    prefix = prefix | (chosen.to(tl.uint32) << shift)
    prefix_mask = prefix_mask | (digit_mask << shift)
    return prefix, prefix_mask, remaining - above, in_bin


@triton.jit
def emit_full(row_ptr, out_row, n, prefix, pmask, remaining, shift_ptr, dmask_ptr,
               FIRST_PASS: tl.constexpr, N_PASSES: tl.constexpr, RADIX_BITS: tl.constexpr,
               BLOCK: tl.constexpr):
    """Finish the digits from FIRST_PASS on over the whole row, then emit in index order."""
    for p in tl.static_range(FIRST_PASS, N_PASSES):
        prefix, pmask, remaining, _ = radix_pass(row_ptr, n, prefix, pmask, remaining, tl.load(shift_ptr + p),
                                                  tl.load(dmask_ptr + p), RADIX_BITS, BLOCK, False)
    # prefix is now the k-th largest key: take every key above it and the first `remaining`
    # keys equal to it, in index order.
    written = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < n
        key = ordered_key(tl.load(row_ptr + idx, mask=ok, other=0.0))
        eq = ok & (key == prefix)
        tie_rank = ties + tl.cumsum(eq.to(tl.int32), axis=0)
        take = (ok & (key > prefix)) | (eq & (tie_rank <= remaining))
        take_i = take.to(tl.int32)
        tl.store(out_row + written + tl.cumsum(take_i, axis=0) - 1, idx, mask=take)
        written += tl.sum(take_i, axis=0)
        ties += tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def finish_candidates(out_row, ckey_row, cidx_row, n_cand, prefix, pmask, remaining, written, shift_ptr,
                       dmask_ptr, K: tl.constexpr, FIRST_PASS: tl.constexpr, N_PASSES: tl.constexpr,
                       RADIX_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Candidates (keys + indices, in index order) hold the k-th key; `written` keys are already out."""
    # 2. remaining digits on the candidates only
    for p in tl.static_range(FIRST_PASS, N_PASSES):
        prefix, pmask, remaining, _ = radix_pass(ckey_row, n_cand, prefix, pmask, remaining,
                                                  tl.load(shift_ptr + p), tl.load(dmask_ptr + p),
                                                  RADIX_BITS, BLOCK, True)
    # 3. emit candidates above the k-th key and the first `remaining` equal to it (index order)
    ties = tl.zeros([], tl.int32)
    for start in range(0, n_cand, BLOCK):
        j = start + tl.arange(0, BLOCK)
        ok = j < n_cand
        key = tl.load(ckey_row + j, mask=ok, other=0)
        idx = tl.load(cidx_row + j, mask=ok, other=0)
        eq = ok & (key == prefix)
        tie_rank = ties + tl.cumsum(eq.to(tl.int32), axis=0)
        take = (ok & (key > prefix)) | (eq & (tie_rank <= remaining))
        take_i = take.to(tl.int32)
        tl.store(out_row + written + tl.cumsum(take_i, axis=0) - 1, idx, mask=take)
        written += tl.sum(take_i, axis=0)
        ties += tl.sum(eq.to(tl.int32), axis=0)
    tl.debug_barrier()
    # 4. the K written indices, ascending (the full variant emits them in order already)
    kk = tl.arange(0, K)
    tl.store(out_row + kk, tl.sort(tl.load(out_row + kk), dim=0))


# Helpers for candidate buffers in arbitrary order (kernels/indexer_fused.py writes survivors with
# one atomic counter per row, so their order is not index order and finish_candidates' tie rule,
# "the first `remaining` equal keys in buffer order", would depend on the scheduling).

@triton.jit
def threshold_at_count(keys, ok, need):
    """Largest uint32 t with at least `need` of the valid `keys` >= t (0 when fewer than `need` keys
    are valid, i.e. everything survives; 0xFFFFFFFF when need <= 0)."""
    return search_count(keys, ok, need, -1)


@triton.jit
def search_count(keys, ok, need, slack):
    """slack < 0: threshold_at_count, exact. slack >= 0: a t with `need` +- `slack` of the valid keys
    >= t, found in fewer passes (the search stops as soon as one of its two bounds is that close;
    for a sampled threshold, which only has to leave about 1.5 k keys, not exactly).

    A search in registers over [min, max] of the valid keys rather than over all 32 bits, and
    ternary: each pass counts the keys at or above two cut points in one reduction (the two counts
    packed in the halves of an int32, so the tile must hold < 65536 keys): ~16 passes for the ~1.5 k
    candidates of a filtered row, against 32 bit by bit. Its cost grows with the keys, not with the
    barriers: over 4096 rows (H100) the sampled thresholds took 0.14 / 0.26 / 0.59 ms for 2048 /
    4096 / 8192 samples a row, and one or two warps a row were slower than four."""
    tl.static_assert(keys.numel < 65536, "search_count packs two counts in an int32")
    n_valid = tl.sum(ok.to(tl.int32), axis=0)
    lo = tl.min(tl.where(ok, keys, 0xFFFFFFFF), axis=0).to(tl.int64)  # count(>= lo) = n_valid
    hi = tl.max(tl.where(ok, keys, 0), axis=0).to(tl.int64) + 1  # count(>= hi) = 0
    n_lo = n_valid
    n_hi = tl.zeros([], tl.int32)
    if n_valid < need:
        lo = tl.zeros([], tl.int64)
        hi = lo + 1
        n_lo = need
    if need <= 0:
        lo = tl.full([], 0xFFFFFFFF, tl.int64)
        hi = lo + 1
        n_lo = need
    # invariant: n_lo = count(>= lo) >= need > count(>= hi) = n_hi
    while (hi - lo > 1) & ((slack < 0) | ((n_lo - need > slack) & (need - n_hi > slack))):
        third = tl.maximum((hi - lo) // 3, 1)
        c1 = lo + third
        c2 = tl.maximum(hi - third, c1)  # lo < c1 <= c2 < hi
        above = (ok & (keys >= c1.to(tl.uint32))).to(tl.int32) + ((ok & (keys >= c2.to(tl.uint32))).to(tl.int32) << 16)
        both = tl.sum(above, axis=0)
        n1 = both & 0xFFFF
        n2 = both >> 16
        at2 = n2 >= need
        at1 = n1 >= need
        lo, n_lo, hi, n_hi = (tl.where(at2, c2, tl.where(at1, c1, lo)), tl.where(at2, n2, tl.where(at1, n1, n_lo)),
                              tl.where(at2, hi, tl.where(at1, c2, c1)), tl.where(at2, n_hi, tl.where(at1, n2, n1)))
    use_hi = (slack >= 0) & (n_lo - need > slack) & (need - n_hi <= slack)
    return tl.where(use_hi, hi, lo).to(tl.uint32)


SLACK_DIV: tl.constexpr = tl.constexpr(32)  # sampled_threshold stops its search within need / SLACK_DIV


@triton.jit
def sampled_threshold(row, n, K: tl.constexpr, SAMPLES: tl.constexpr, RUN: tl.constexpr):
    """t such that about 1.5 k of the row's n keys are >= t, from SAMPLES keys taken in runs of RUN
    neighbours at a fixed stride (RUN 8: a run is one 32-byte sector; RUN 1: single strided keys)."""
    N_RUNS: tl.constexpr = SAMPLES // RUN
    run_stride = tl.maximum((n + N_RUNS - 1) // N_RUNS, RUN)  # keys between the starts of two runs
    i = tl.arange(0, SAMPLES)
    pos = (i // RUN) * run_stride + (i % RUN)
    ok = pos < n
    keys = ordered_key(tl.load(row + pos, mask=ok, other=0.0))
    # each sample stands for run_stride / RUN keys: ask for ~1.5 k of them plus 4 samples of margin,
    # give or take 1/32 of that (the sample's own error is ~10 times larger: survivors 2404-3924 of a
    # 3072 target on 4096 x 64K rows)
    need = (3 * K * RUN) // (2 * run_stride) + 4
    return search_count(keys, ok, need, need // SLACK_DIV)


@triton.jit
def lowest_tie_cutoff(ckey_row, cidx_row, n_cand, tie_key, need, idx_bits, BLOCK: tl.constexpr):
    """The need-th smallest index among the candidates whose key == tie_key (need >= 1 of them).

    Bitwise: the largest z with fewer than `need` such indices < z is that index (indices are
    distinct); one pass over the candidates per index bit, order-independent."""
    z = tl.zeros([], tl.int32)
    for i in range(idx_bits):
        c = z | (tl.full([], 1, tl.int32) << (idx_bits - 1 - i))
        below = tl.zeros([], tl.int32)
        for start in range(0, n_cand, BLOCK):
            j = start + tl.arange(0, BLOCK)
            ok = j < n_cand
            key = tl.load(ckey_row + j, mask=ok, other=0)
            idx = tl.load(cidx_row + j, mask=ok, other=0)
            below += tl.sum((ok & (key == tie_key) & (idx < c)).to(tl.int32), axis=0)
        z = tl.where(below < need, c, z)
    return z


@triton.jit
def finish_unordered_candidates(out_row, ckey_row, cidx_row, n_cand, shift_ptr, dmask_ptr, idx_bits,
                                K: tl.constexpr, N_PASSES: tl.constexpr, RADIX_BITS: tl.constexpr,
                                BLOCK: tl.constexpr):
    """Exact top-K of n_cand >= K candidates (keys + indices, any order): the K indices, ascending.

    Same selection as finish_candidates on index-ordered candidates: every key above the k-th, and
    of the keys equal to it the `remaining` lowest indices (found by lowest_tie_cutoff, only when
    more keys tie than are needed)."""
    prefix = tl.zeros([], tl.uint32)
    pmask = tl.zeros([], tl.uint32)
    remaining = tl.full([], K, tl.int32)
    in_bin = n_cand
    for p in tl.static_range(N_PASSES):
        prefix, pmask, remaining, in_bin = radix_pass(ckey_row, n_cand, prefix, pmask, remaining,
                                                       tl.load(shift_ptr + p), tl.load(dmask_ptr + p),
                                                       RADIX_BITS, BLOCK, True)
    # after the last digit `prefix` is the k-th key and `in_bin` counts the candidates equal to it
    cutoff = tl.full([], 0x7FFFFFFF, tl.int32)
    if in_bin > remaining:
        cutoff = lowest_tie_cutoff(ckey_row, cidx_row, n_cand, prefix, remaining, idx_bits, BLOCK)
    written = tl.zeros([], tl.int32)
    for start in range(0, n_cand, BLOCK):
        j = start + tl.arange(0, BLOCK)
        ok = j < n_cand
        key = tl.load(ckey_row + j, mask=ok, other=0)
        idx = tl.load(cidx_row + j, mask=ok, other=0)
        take = ok & ((key > prefix) | ((key == prefix) & (idx <= cutoff)))
        take_i = take.to(tl.int32)
        tl.store(out_row + written + tl.cumsum(take_i, axis=0) - 1, idx, mask=take)
        written += tl.sum(take_i, axis=0)
    tl.debug_barrier()
    kk = tl.arange(0, K)
    tl.store(out_row + kk, tl.sort(tl.load(out_row + kk), dim=0))


@triton.jit
def scatter_b32(ptr, val, mask):
    """tl.store(ptr, val, mask) for 32-bit values, as a predicated st.global the layout passes cannot see.

    Why: a store through scattered pointers (a compaction: base + prefix sum - 1) makes Triton's
    coalescing pass give it a one-element-per-thread layout, and the prefix sum feeding it is then
    recomputed in that layout: a warp scan per element instead of per thread. In topk_filter's filter
    (sm_90 PTX, BLOCK 1024, 4 warps) that was 112 shuffles and 23 barriers against 28 and 11 here;
    the select (CAP 4096, 4 warps) went from 168 registers and a 48-byte spill to 158 and none.
    CUDA only: the interpreter runs no PTX (callers pass tl.store's path there)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptr.to(tl.uint64, bitcast=True), val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1)


@triton.jit
def select_in_registers(key, idx, ok, out_row, idx_bits, K: tl.constexpr, ORDERED: tl.constexpr,
                        ASM_STORE: tl.constexpr):
    """Exact top-K of the valid (key, index) pairs of a register tile (>= K valid, indices distinct):
    writes the K indices ascending to out_row.

    The k-th key by threshold_at_count; of the keys equal to it, the lowest indices: by position
    when the tile is in index order (ORDERED), else by a bitwise search over the index
    (idx_bits passes, only when more keys tie than are needed), then the K indices are sorted.
    ASM_STORE (ORDERED only): the indices go out through scatter_b32 (CUDA)."""
    kth = threshold_at_count(key, ok, K)
    above = ok & (key > kth)
    tied = ok & (key == kth)
    need = K - tl.sum(above.to(tl.int32), axis=0)
    if ORDERED:
        take = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))
        if ASM_STORE:
            scatter_b32(out_row + tl.cumsum(take.to(tl.int32), axis=0) - 1, idx, take)
        else:
            tl.store(out_row + tl.cumsum(take.to(tl.int32), axis=0) - 1, idx, mask=take)
    else:
        cutoff = tl.full([], 0x7FFFFFFF, tl.int32)
        if tl.sum(tied.to(tl.int32), axis=0) > need:
            z = tl.zeros([], tl.int32)
            for i in range(idx_bits):
                c = z | (tl.full([], 1, tl.int32) << (idx_bits - 1 - i))
                below = tl.sum((tied & (idx < c)).to(tl.int32), axis=0)
                z = tl.where(below < need, c, z)
            cutoff = z
        take = above | (tied & (idx <= cutoff))
        tl.store(out_row + tl.cumsum(take.to(tl.int32), axis=0) - 1, idx, mask=take)
        tl.debug_barrier()
        kk = tl.arange(0, K)
        tl.store(out_row + kk, tl.sort(tl.load(out_row + kk), dim=0))
