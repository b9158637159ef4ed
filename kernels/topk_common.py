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
def key_to_float(t):
    """The inverse of ordered_key: the fp32 whose ordered key is t."""
    sign_bit = tl.full([], 0x80000000, tl.uint32)
    bits = tl.where((t & sign_bit) != 0, t ^ sign_bit, t ^ tl.full([], 0xFFFFFFFF, tl.uint32))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def threshold_at_count(keys, ok, need):
    """Largest uint32 t with at least `need` of the valid `keys` >= t (0 when fewer than `need` keys
    are valid, i.e. everything survives; 0xFFFFFFFF when need <= 0)."""
    return search_count(keys, ok, need, -1)


@triton.jit
def search_count(keys, ok, need, slack):
    """slack < 0: threshold_at_count, exact. slack >= 0: a t with `need` +- `slack` of the valid keys
    >= t, found in fewer passes (the search stops as soon as one of its two bounds is that close;
    for a sampled threshold, which only has to leave about 1.5 k keys, not exactly)."""
    lo, hi, n_lo, n_hi = search_bracket(keys, ok, need, slack, 0)
    use_hi = (slack >= 0) & (n_lo - need > slack) & (need - n_hi <= slack)
    return tl.where(use_hi, hi, lo).to(tl.uint32)


# The cut points of search_bracket (constants picked on the indexer's own score rows with a host
# model of the search, bench/gpu/topk_search_model.py: passes to the k-th key of ~3 k filtered
# candidates 15.5 -> 5.7, + a rank of the last few keys; the sampled threshold 7.2 -> 5.2).
FIRST_CUT_FRAC: tl.constexpr = tl.constexpr(0.2)  # first pass: cut at need x (1 +- 0.2) by the tail model
CUT_Z: tl.constexpr = tl.constexpr(1.5)  # later passes: +- 1.5 binomial sd of the window's keys around need
MODEL_MISSES: tl.constexpr = tl.constexpr(2)  # after two model cuts that missed, thirds only
LAST_KEYS: tl.constexpr = tl.constexpr(32)  # kth_key finishes a window of <= 32 keys by ranking them


@triton.jit
def _tail_cut(lo, hi, n_lo, n_hi, c):
    """The key where about c keys are >= it, with log(count) taken as linear in the score between
    (lo, n_lo) and (hi, n_hi) (or (max key, 1) while n_hi is 0): an exponential tail, which is what
    the top few percent of a row of indexer scores looks like. Any value is safe: callers clamp."""
    top = tl.where(n_hi > 0, hi, hi - 1)
    f_lo = key_to_float(lo.to(tl.uint32))
    f_hi = key_to_float(top.to(tl.uint32))
    ln_lo = tl.log(n_lo.to(tl.float32))
    span = ln_lo - tl.log(tl.maximum(n_hi, 1).to(tl.float32))
    frac = (ln_lo - tl.log(tl.maximum(c, 1.0))) / span
    return ordered_key(f_lo + frac * (f_hi - f_lo)).to(tl.int64)


@triton.jit
def _count_min_max(n_a, lo_a, hi_a, n_b, lo_b, hi_b):
    return n_a + n_b, tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b)


@triton.jit
def search_bracket(keys, ok, need, slack, stop_keys):
    """[lo, hi) with n_lo = count(>= lo) >= need > count(>= hi) = n_hi, narrowed until it is one key
    wide (slack < 0), or one bound within `slack` of need (slack >= 0), or it holds <= stop_keys keys.

    Each pass counts the keys at or above two cut points in one reduction (the two counts packed in
    the halves of an int32, so the tile must hold < 65536 keys). The cuts come from a tail model
    (_tail_cut) around need, +- a margin that covers the model's error in the first pass and the
    binomial spread of the window's keys after it: a hit leaves the few keys between the cuts. A pass
    whose window did not halve makes the next one cut in thirds (and after MODEL_MISSES such passes,
    all), so a score distribution the model fits badly (heavy ties, two clusters) costs at most twice
    the ternary search over [min, max]. A pass costs ~5 us a chunk of 4096 rows (H200, 4096 keys a
    row: ten fewer passes took the select from 0.248 to 0.200 ms, topk_filter_gpu.json run 10)."""
    tl.static_assert(keys.numel < 65536, "search_bracket packs two counts in an int32")
    need = tl.zeros([], tl.int32) + need  # a constexpr K or a runtime count
    slack = tl.zeros([], tl.int32) + slack
    # the valid keys' count, min and max by one reduction (three took three rounds of barriers)
    n_valid, lo, hi = tl.reduce((ok.to(tl.int32), tl.where(ok, keys, 0xFFFFFFFF), tl.where(ok, keys, 0)), 0,
                                _count_min_max)
    lo = lo.to(tl.int64)  # count(>= lo) = n_valid
    hi = hi.to(tl.int64) + 1  # count(>= hi) = 0
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
    model = tl.full([], 1, tl.int32)
    misses = tl.zeros([], tl.int32)
    while ((hi - lo > 1) & (n_lo - n_hi > stop_keys)
           & ((slack < 0) | ((n_lo - need > slack) & (need - n_hi > slack)))):
        span = hi - lo
        w = (n_lo - n_hi).to(tl.float32)
        p = ((n_lo - need).to(tl.float32) + 0.5) / w
        margin = tl.where(n_hi == 0, need.to(tl.float32) * FIRST_CUT_FRAC, CUT_Z * tl.sqrt(w * p * (1.0 - p)) + 1.0)
        margin = tl.maximum(margin, slack.to(tl.float32))
        use_model = (model != 0) & (misses < MODEL_MISSES)
        third = tl.maximum(span // 3, 1)
        c1 = tl.where(use_model, _tail_cut(lo, hi, n_lo, n_hi, need.to(tl.float32) + margin), lo + third)
        c2 = tl.where(use_model, _tail_cut(lo, hi, n_lo, n_hi, need.to(tl.float32) - margin), hi - third)
        c1 = tl.minimum(tl.maximum(c1, lo + 1), hi - 1)
        c2 = tl.minimum(tl.maximum(c2, c1), hi - 1)  # lo < c1 <= c2 < hi
        above = (ok & (keys >= c1.to(tl.uint32))).to(tl.int32) + ((ok & (keys >= c2.to(tl.uint32))).to(tl.int32) << 16)
        both = tl.sum(above, axis=0)
        n1 = both & 0xFFFF
        n2 = both >> 16
        at2 = n2 >= need
        at1 = n1 >= need
        lo, n_lo, hi, n_hi = (tl.where(at2, c2, tl.where(at1, c1, lo)), tl.where(at2, n2, tl.where(at1, n1, n_lo)),
                              tl.where(at2, hi, tl.where(at1, c2, c1)), tl.where(at2, n_hi, tl.where(at1, n2, n1)))
        halved = (hi - lo) * 2 <= span
        misses += (use_model & ~halved).to(tl.int32)
        model = (~use_model | halved).to(tl.int32)
    return lo, hi, n_lo, n_hi


@triton.jit
def kth_key(keys, ok, need, scratch, SCRATCH: tl.constexpr, ASM_STORE: tl.constexpr):
    """(threshold_at_count(keys, ok, need), how many valid keys are above it) for 1 <= need <= the
    valid keys, with the search's last passes replaced by a rank: once the bracket holds <= LAST_KEYS
    keys (at most SCRATCH: `scratch` holds SCRATCH int32 this program may overwrite), they are
    compacted there and the need-th largest is the largest window key with >= need - n_hi window
    keys at or above it. (Searching on to a one-key bracket instead of the rank made the filter
    top-k's select 19% slower: the whole 64K top-k 8.60 ms against 7.21, H200, topk_filter_gpu.json
    run 16.)"""
    E: tl.constexpr = LAST_KEYS if SCRATCH >= LAST_KEYS else SCRATCH
    lo, hi, n_lo, n_hi = search_bracket(keys, ok, need, -1, E)
    kth = lo.to(tl.uint32)
    n_above = n_hi  # a one-key bracket: lo is the k-th key and count(> lo) = count(>= hi)
    if hi - lo > 1:
        inw = ok & (keys >= lo.to(tl.uint32)) & (keys <= (hi - 1).to(tl.uint32))
        pos = tl.cumsum(inw.to(tl.int32), axis=0) - 1
        if ASM_STORE:
            scatter_b32(scratch + pos, keys.to(tl.int32, bitcast=True), inw)
        else:
            tl.store(scratch + pos, keys.to(tl.int32, bitcast=True), mask=inw)
        tl.debug_barrier()
        j = tl.arange(0, E)
        valid = j < n_lo - n_hi
        wk = tl.load(scratch + j, mask=valid, other=0).to(tl.uint32, bitcast=True)
        ge = tl.sum(((wk[None, :] >= wk[:, None]) & valid[None, :]).to(tl.int32), axis=1)
        kth = tl.max(tl.where(valid & (ge >= need - n_hi), wk, 0), axis=0)
        n_above = n_hi + tl.sum((valid & (wk > kth)).to(tl.int32), axis=0)
        tl.debug_barrier()  # the caller's stores may overwrite scratch
    return kth, n_above


SLACK_DIV: tl.constexpr = tl.constexpr(32)  # sampled_threshold stops its search within need / SLACK_DIV


@triton.jit
def sample_positions(n, SAMPLES: tl.constexpr, RUN: tl.constexpr):
    """(positions [SAMPLES], run_stride): sampled_threshold's samples of a row of n keys, runs of RUN
    neighbours whose starts are run_stride keys apart (positions >= n are not in the row)."""
    N_RUNS: tl.constexpr = SAMPLES // RUN
    run_stride = tl.maximum((n + N_RUNS - 1) // N_RUNS, RUN)
    i = tl.arange(0, SAMPLES)
    return (i // RUN) * run_stride + (i % RUN), run_stride


@triton.jit
def sampled_threshold(row, n, K: tl.constexpr, SAMPLES: tl.constexpr, RUN: tl.constexpr, scale):
    """t such that about 1.5 k x scale of the row's n keys are >= t, from SAMPLES keys taken in runs
    of RUN neighbours at a fixed stride (RUN 8: a run is one 32-byte sector; RUN 1: single strided keys).

    scale: the filter's aim over 1.5 (1.0 by default: topk_filter's AIM), times, in a refilter, the
    miss of the threshold these samples gave before (scaling the samples' count by the miss corrects
    the sample by what the row showed)."""
    pos, run_stride = sample_positions(n, SAMPLES, RUN)
    ok = pos < n
    keys = ordered_key(tl.load(row + pos, mask=ok, other=0.0))
    # each sample stands for run_stride / RUN keys: ask for ~1.5 k of them plus 4 samples of margin,
    # give or take 1/32 of that (the sample's own error is ~10 times larger: survivors 2404-3924 of a
    # 3072 target on 4096 x 64K rows)
    need = (3 * K * RUN) // (2 * run_stride) + 4
    if scale != 1.0:
        need = (need.to(tl.float32) * scale).to(tl.int32) + 1
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

    The k-th key by kth_key (out_row is its scratch); of the keys equal to it, the lowest indices: by position
    when the tile is in index order (ORDERED), else by a bitwise search over the index
    (idx_bits passes, only when more keys tie than are needed), then the K indices are sorted.
    ASM_STORE (ORDERED only): the indices go out through scatter_b32 (CUDA)."""
    kth, n_above = kth_key(key, ok, K, out_row, K, ASM_STORE)
    above = ok & (key > kth)
    tied = ok & (key == kth)
    need = K - n_above
    if ORDERED:
        # one prefix sum, the two running counts packed (the tile holds < 65536 keys): the first
        # `need` tied keys are taken, so a key's slot is the above keys and the taken tied keys up to it
        run = tl.cumsum(above.to(tl.int32) + (tied.to(tl.int32) << 16), axis=0)
        tied_upto = run >> 16
        take = above | (tied & (tied_upto <= need))
        pos = (run & 0xFFFF) + tl.minimum(tied_upto, need) - 1
        if ASM_STORE:
            scatter_b32(out_row + pos, idx, take)
        else:
            tl.store(out_row + pos, idx, mask=take)
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
