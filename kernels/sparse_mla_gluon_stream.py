"""Sparse MLA forward in Gluon: the paired kernel (sparse_mla_gluon_pair.py) made persistent, its work split
evenly over the SMs by Stream-K (kernels/sparse_mla_stream_k.py), sm_90.

Same contract as kernels/sparse_mla_gluon.py (q [T, heads, 576], kv [S, 576], idx [T, topk] int32 with -1 for
unused slots; out [T, heads, 512] and the natural-log lse).

Why: the paired kernel runs a program per (token, 64 heads), one an SM, and each program
- loads its q (72 KB) before its producer may gather a row, and stores its output (64 KB) after its last PV: the
  SM's tensor cores wait through both, a few us of a ~95 us program;
- at 4096 tokens on 132 SMs fills 31 waves and a 32nd of 4 programs (3% of the run, 128 SMs idle).
Here G programs (one an SM) each take an equal run of key-tile pairs in (token, head block) order, so an SM's
run covers ~31 items, the first and last maybe cut (written as partials, merged after by
sparse_mla_stream_k.combine_partials). Within a run the producer loads the next item's q (cp.async, freed
by the consumers' `q_empty` once their last QK^T of an item is done) and its first KV tiles while the consumers
finish the item before: its last PVs, the row sums' exchange and the output's stores. The pair schedule itself
(warpgroup 0 on even tiles, 1 on odd ones, each owning half of O's columns, the max handed over in shared memory)
is the paired kernel's; every barrier that completed once a pair or once an item keeps its phase by a count
carried across items.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels import sparse_mla_stream_k as sk
from kernels.sparse_mla_gluon import BLOCK_H, BLOCK_N, D_R, D_V, forward_outputs
from kernels.sparse_mla_gluon_pair import (HALF, M0, M1, N_SYNC, O_LAYOUT, P_OPERAND, S0, S1, S_LAYOUT,
                                           SCHEDULE, _copy_rows, _fresh, _masked, _qk_part, _signal)


@gluon.jit
def _run(units, pairs_per_item):
    """This program's units [start, end) (sparse_mla_stream_k.program_units) and the first item they touch."""
    g = gl.program_id(0).to(gl.int64)
    n_prog = gl.num_programs(0).to(gl.int64)
    start = (g * units // n_prog).to(gl.int32)
    end = ((g + 1) * units // n_prog).to(gl.int32)
    return start, end, start // pairs_per_item


@gluon.jit
def _unit(start, end, u, pairs_per_item, first_item, HB: gl.constexpr, BLOCK_H: gl.constexpr):
    """Unit u of a run: its item's token and first head, the pair's index in the item, the segment's index
    in the run, and whether the unit is its segment's first and last. One loop over units, with the segment's
    start and end as branches inside it, and not a loop over segments around one over pairs: ptxas
    serialises every wgmma of that nest (C7514, "non wgmma instructions reading accumulator registers")."""
    gu = start + u
    item = gu // pairs_per_item
    pair = gu - item * pairs_per_item
    first = (pair == 0) | (u == 0)
    last = (pair == pairs_per_item - 1) | (gu == end - 1)
    return (item // HB).to(gl.int64), (item % HB) * BLOCK_H, pair, item - first_item, first, last


@gluon.jit
def _slot(start, end, item_start, s, pairs_per_item):
    """The partial's workspace slot of segment s (its item's units from item_start), -1 for a whole item."""
    cut = (start > item_start) | (end < item_start + pairs_per_item)
    return gl.where(cut, 2 * gl.program_id(0) + gl.minimum(s, 1), -1)


@gluon.jit
def _copy_q(dst, q_tok, h0, HEADS: gl.constexpr, col0: gl.constexpr, ROW: gl.constexpr, ROWS: gl.constexpr,
            WARPS: gl.constexpr):
    """cp.async dst [BLOCK_H, C] <- q[t, h0 + r, col0 : col0 + C] (q contiguous, ROW elements a head: q_tok is
    token t's first head);
    heads past HEADS are filled with zeros. The row stride is a compile-time constant, so each thread's
    offsets fold into its copies' immediates: with a runtime stride the producer held ~40 registers of them
    through its loop and spilled (its whole register file is 56)."""
    C: gl.constexpr = dst.shape[1]
    TPC: gl.constexpr = C // 8 if C // 8 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [WARPS, 1], [1, 0])
    c = col0 + gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    for g in gl.static_range(dst.shape[0] // ROWS):
        r = g * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cp.async_copy_global_to_shared(dst.slice(g * ROWS, ROWS, dim=0), q_tok + (h0 + r)[:, None] * ROW + c[None, :],
                                       mask=(h0 + r < HEADS)[:, None])


@gluon.jit
def _produce(q_ptr, kv_ptr, idx_ptr, n_idx, units, pairs_per_item, stride_kv, stride_it, q_l, q_r, q_rope, kv_l,
             kv_r, kv_rope, q_full, q_empty, full_l, full_r, empty_l, empty_r, HEADS: gl.constexpr, HB: gl.constexpr,
             BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, D_R: gl.constexpr,
             ROW_GROUP: gl.constexpr, WARPS: gl.constexpr):
    """The producer: at a segment's first pair its q, once the consumers are done with the last one's; every
    pair's KV tiles in the paired kernel's order (slot 0's left, slot 1's right, slot 0's right, slot 1's left),
    each half's `full` barrier taking one arrival from every producer thread as its copies land."""
    start, end, first_item = _run(units, pairs_per_item)
    for u in range(end - start):
        t, h0, pair, s, first, last = _unit(start, end, u, pairs_per_item, first_item, HB, BLOCK_H)
        if first:
            mbarrier.wait(q_empty, (s & 1) ^ 1)  # a fresh barrier counts as having completed the phase before
            q_tok = q_ptr + t * (HEADS * (2 * HALF + D_R))
            _copy_q(q_l.index(0), q_tok, h0, HEADS, 0, 2 * HALF + D_R, ROW_GROUP, WARPS)
            _copy_q(q_r.index(0), q_tok, h0, HEADS, HALF, 2 * HALF + D_R, ROW_GROUP, WARPS)
            _copy_q(q_rope.index(0), q_tok, h0, HEADS, 2 * HALF, 2 * HALF + D_R, BLOCK_H, WARPS)
            cp.mbarrier_arrive(q_full, increment_count=False)
        idx_row = idx_ptr + t * stride_it
        ph = (u & 1) ^ 1
        j0 = 2 * pair * BLOCK_N
        j1 = j0 + BLOCK_N
        mbarrier.wait(empty_l.index(0), ph)
        _copy_rows(kv_l.index(0), kv_ptr, idx_row, n_idx, stride_kv, j0, 0, ROW_GROUP, WARPS)
        cp.mbarrier_arrive(full_l.index(0), increment_count=False)
        mbarrier.wait(empty_r.index(1), ph)
        _copy_rows(kv_r.index(1), kv_ptr, idx_row, n_idx, stride_kv, j1, HALF, ROW_GROUP, WARPS)
        _copy_rows(kv_rope.index(1), kv_ptr, idx_row, n_idx, stride_kv, j1, 2 * HALF, BLOCK_N, WARPS)
        cp.mbarrier_arrive(full_r.index(1), increment_count=False)
        mbarrier.wait(empty_r.index(0), ph)
        _copy_rows(kv_r.index(0), kv_ptr, idx_row, n_idx, stride_kv, j0, HALF, ROW_GROUP, WARPS)
        _copy_rows(kv_rope.index(0), kv_ptr, idx_row, n_idx, stride_kv, j0, 2 * HALF, BLOCK_N, WARPS)
        cp.mbarrier_arrive(full_r.index(0), increment_count=False)
        mbarrier.wait(empty_l.index(1), ph)
        _copy_rows(kv_l.index(1), kv_ptr, idx_row, n_idx, stride_kv, j1, 0, ROW_GROUP, WARPS)
        cp.mbarrier_arrive(full_l.index(1), increment_count=False)


@gluon.jit
def _finish(o, m, den, slot, out_row, stride_oh, col0, h0, HEADS: gl.constexpr, lse_row, ws_ptr, ml_ptr,
            WRITE_LSE: gl.constexpr, D_V: gl.constexpr, o_l: gl.constexpr):
    """This warpgroup's half of out (and the lse) from its O and both warpgroups' row sums (den); or, for a cut
    item, of the partial: O unnormalised in fp32, the max (base 2) and the row sum. No barrier: each
    warpgroup has the other's row sum from the pair's max handover (sparse_mla_gluon_pair.py's _finish
    exchanges them at the end; here, at every item's end, that wait took the two warpgroups out of step)."""
    r = gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, o_l))
    co = col0 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, o_l))
    rl = gl.arange(0, o.shape[0], layout=den.type.layout)
    if slot >= 0:
        ws_row = ws_ptr + slot.to(gl.int64) * o.shape[0] * D_V
        gl.store(ws_row + r[:, None] * D_V + co[None, :], o, mask=(h0 + r < HEADS)[:, None])
        if WRITE_LSE:
            ml_row = ml_ptr + slot.to(gl.int64) * 2 * o.shape[0]
            gl.store(ml_row + rl, m)
            gl.store(ml_row + o.shape[0] + rl, den)
    else:
        den_safe = gl.where(den > 0, den, 1.0)
        # by the reciprocal: 128 precise divisions a thread were ~380 instructions of the loop's body
        out = o * gl.convert_layout(1.0 / den_safe, gl.SliceLayout(1, o_l))[:, None]
        gl.store(out_row + (h0 + r)[:, None] * stride_oh + co[None, :], out.to(gl.bfloat16),
                 mask=(h0 + r < HEADS)[:, None])
        if WRITE_LSE:
            lse = gl.where(den > 0, (m + gl.log2(den_safe)) / 1.4426950408889634, float("-inf"))
            gl.store(lse_row + h0 + rl, lse, mask=h0 + rl < HEADS)


@gluon.jit
def _even_tiles(idx_ptr, n_idx, units, pairs_per_item, stride_it, scale_log2, q_l, q_r, q_rope, kv_l, kv_r, kv_rope,
                p1_smem, m_smem, den_smem, q_full, q_empty, full_l, full_r, empty_l, empty_r, sync, out_ptr, stride_ot,
                stride_oh, lse_ptr, stride_lt, ws_ptr, ml_ptr, HEADS: gl.constexpr, HB: gl.constexpr,
                BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, D_V: gl.constexpr):
    """Warpgroup 0 (the default partition): tiles 2j, O's columns 0-255. A segment starts from the max -inf,
    which zeroes the row sums and O through the first rescale (alpha = 0)."""
    start, end, first_item = _run(units, pairs_per_item)
    zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)
    mbarrier.wait(q_full, 0)
    s_tok = _qk_part(q_l.index(0), kv_l.index(0), full_l.index(0), 0, zero_s, False)
    s_tok = _qk_part(q_r.index(0), kv_r.index(0), full_r.index(0), 0, s_tok, True)
    s_tok = warpgroup_mma(q_rope.index(0), kv_rope.index(0).permute((1, 0)), s_tok, is_async=True)
    sc = warpgroup_mma_wait(0, deps=(s_tok, ))
    for u in range(end - start):
        t, h0, pair, s, first, last = _unit(start, end, u, pairs_per_item, first_item, HB, BLOCK_H)
        ph = u & 1
        z = (u + n_idx) >> 30  # always 0 (n_idx < 2^30): see _qk_part
        if last:
            _signal(q_empty)  # this segment's QK^Ts are done: q may be refilled
        x = _masked(sc, idx_ptr + t * stride_it, n_idx, 2 * pair * BLOCK_N, scale_log2, S_LAYOUT)
        m0 = gl.maximum(m, gl.max(x, axis=1))
        m0_safe = gl.where(m0 == float("-inf"), 0.0, m0)  # rows with no valid key yet
        alpha = gl.exp2(m - m0_safe)
        p = gl.exp2(x - m0_safe[:, None])
        den = den * alpha + gl.sum(p, axis=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        m_smem.store(m0)
        den_smem.slice(0, BLOCK_H).store(den)  # with m0: warpgroup 1 rescales it to m1 for its own total
        _signal(sync.index(M0))
        o_tok = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_OPERAND), kv_l.index(z), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o_tok, ))
        _signal(empty_l.index(0))  # slot 0's left half: its QK^T and this PV are done
        mbarrier.wait(sync.index(M1), ph)
        m1 = m_smem.load(gl.SliceLayout(1, S_LAYOUT))  # max(m0, tile 2j + 1's): where the pair ends
        den_odd = den_smem.slice(BLOCK_H, BLOCK_H).load(gl.SliceLayout(1, S_LAYOUT))  # warpgroup 1's, at m1
        beta = gl.where(m0 == float("-inf"), 1.0, gl.exp2(m0_safe - gl.where(m1 == float("-inf"), 0.0, m1)))
        kv_rope.index(z).store((p * beta[:, None]).to(gl.bfloat16))  # slot 0's rope columns: read by S0 only
        fence_async_shared()
        _signal(sync.index(S0))
        o = o * gl.convert_layout(beta, gl.SliceLayout(1, O_LAYOUT))[:, None]
        den = den * beta
        m = m1
        mbarrier.wait(sync.index(S1), ph)
        fence_async_shared()  # slot 1 landed by cp.async (generic proxy), waited for by warpgroup 1 only
        o_tok = warpgroup_mma(p1_smem.index(z), kv_l.index(1 + z), o, is_async=True)
        if u + 1 < end - start:  # the next pair's first QK^T (the next segment's: on its q) while this PV runs
            if last:
                mbarrier.wait(q_full, (s + 1) & 1)
            s_tok = _qk_part(q_l.index(z), kv_l.index(z), full_l.index(0), ph ^ 1, zero_s, False)
            o = warpgroup_mma_wait(1, deps=(o_tok, ))
            _signal(empty_l.index(1))
            s_tok = _qk_part(q_r.index(z), kv_r.index(z), full_r.index(0), ph ^ 1, s_tok, True)
            s_tok = warpgroup_mma(q_rope.index(z), kv_rope.index(z).permute((1, 0)), s_tok, is_async=True)
            sc = warpgroup_mma_wait(0, deps=(s_tok, ))
        else:
            o = warpgroup_mma_wait(0, deps=(o_tok, ))
            _signal(empty_l.index(1))
        if last:
            item_start = (first_item + s) * pairs_per_item
            _finish(o, m, den + den_odd, _slot(start, end, item_start, s, pairs_per_item), out_ptr + t * stride_ot,
                    stride_oh, 0, h0, HEADS, lse_ptr + t * stride_lt, ws_ptr, ml_ptr, False, D_V, O_LAYOUT)
            zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)  # the next segment's start (o is free)


@gluon.jit
def _odd_tiles(idx_ptr, n_idx, units, pairs_per_item, stride_it, scale_log2, q_l, q_r, q_rope, kv_l, kv_r, kv_rope,
               p1_smem, m_smem, den_smem, q_full, q_empty, full_l, full_r, empty_l, empty_r, sync, out_ptr, stride_ot,
               stride_oh, lse_ptr, stride_lt, ws_ptr, ml_ptr, HEADS: gl.constexpr, HB: gl.constexpr,
               BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, D_V: gl.constexpr):
    """Warpgroup 1 (a worker partition): tiles 2j + 1, O's columns 256-511, and the lse."""
    start, end, first_item = _run(units, pairs_per_item)
    zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)
    for u in range(end - start):
        t, h0, pair, s, first, last = _unit(start, end, u, pairs_per_item, first_item, HB, BLOCK_H)
        ph = u & 1
        z = (u + n_idx) >> 30  # always 0: see _qk_part
        if first:
            mbarrier.wait(q_full, s & 1)
        # the right half first: the producer fills slot 1's right half before its left
        s_tok = _qk_part(q_r.index(z), kv_r.index(1 + z), full_r.index(1), ph, zero_s, False)
        s_tok = warpgroup_mma(q_rope.index(z), kv_rope.index(1 + z).permute((1, 0)), s_tok, is_async=True)
        s_tok = _qk_part(q_l.index(z), kv_l.index(1 + z), full_l.index(1), ph, s_tok, True)
        sc = warpgroup_mma_wait(0, deps=(s_tok, ))
        if last:
            _signal(q_empty)  # this segment's QK^Ts are done: q may be refilled
        x = _masked(sc, idx_ptr + t * stride_it, n_idx, (2 * pair + 1) * BLOCK_N, scale_log2, S_LAYOUT)
        mbarrier.wait(sync.index(M0), ph)
        m0 = m_smem.load(gl.SliceLayout(1, S_LAYOUT))
        den_even = den_smem.slice(0, BLOCK_H).load(gl.SliceLayout(1, S_LAYOUT))  # warpgroup 0's, at m0
        m1 = gl.maximum(m0, gl.max(x, axis=1))
        gl.thread_barrier()  # every thread has read m0 before any writes m1 over it
        m1_safe = gl.where(m1 == float("-inf"), 0.0, m1)
        alpha = gl.exp2(m - m1_safe)
        p = gl.exp2(x - m1_safe[:, None])
        den = den * alpha + gl.sum(p, axis=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        m = m1
        den_even = den_even * gl.exp2(m0 - m1_safe)  # warpgroup 0's rescale (its beta); 0 while m0 is -inf
        m_smem.store(m1)
        den_smem.slice(BLOCK_H, BLOCK_H).store(den)
        _signal(sync.index(M1))
        p_bf = p.to(gl.bfloat16)
        o_tok = warpgroup_mma(gl.convert_layout(p_bf, P_OPERAND), kv_r.index(1 + z), o, is_async=True)
        p1_smem.index(z).store(p_bf)
        fence_async_shared()
        _signal(sync.index(S1))
        mbarrier.wait(sync.index(S0), ph)
        fence_async_shared()  # slot 0's right half landed by cp.async, waited for by warpgroup 0 only
        o_tok = warpgroup_mma(kv_rope.index(z), kv_r.index(z), o_tok, is_async=True)  # P0, in slot 0's rope
        warpgroup_mma_wait(1, deps=(o_tok, ))  # the first PV done (its value is read below, after both)
        _signal(empty_r.index(1))  # slot 1's right half: this QK^T and the first PV are done
        o = warpgroup_mma_wait(0, deps=(o_tok, ))
        _signal(empty_r.index(0))  # slot 0's right half and P0
        if last:
            item_start = (first_item + s) * pairs_per_item
            _finish(o, m, den + den_even, _slot(start, end, item_start, s, pairs_per_item), out_ptr + t * stride_ot,
                    stride_oh, HALF, h0, HEADS, lse_ptr + t * stride_lt, ws_ptr, ml_ptr, True, D_V, O_LAYOUT)
            zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)  # the next segment's start (o is free)


@gluon.jit
def _sparse_mla_fwd_stream(q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, ws_ptr, ml_ptr, scale_log2, n_idx, units,
                           pairs_per_item, stride_kv, stride_it, stride_ot, stride_oh, stride_lt,
                           HEADS: gl.constexpr, HB: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                           HALF: gl.constexpr, D_R: gl.constexpr, D_V: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, ROW_GROUP: gl.constexpr):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    half_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], gl.bfloat16)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_R], gl.bfloat16)
    kvh_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
    kvr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], gl.bfloat16)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_l = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], half_sl)  # [1, ...]: see _qk_part
    q_r = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], half_sl)
    q_rope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_R], rope_sl)
    kv_l = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], kvh_sl)
    kv_r = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], kvh_sl)
    kv_rope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_R], kvr_sl)  # [BLOCK_H, BLOCK_N] P0 fits slot 0's
    p1_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, BLOCK_N], kvr_sl)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)
    den_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_sl)
    q_full = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    q_empty = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    full_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    full_r = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    empty_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    empty_r = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    sync = gl.allocate_shared_memory(gl.int64, [N_SYNC, 1], bar_l)
    mbarrier.init(q_full, count=PRODUCER_WARPS * 32)
    mbarrier.init(q_empty, count=2)  # one arrival from each consumer warpgroup
    for s in gl.static_range(2):
        mbarrier.init(full_l.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(full_r.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty_l.index(s), count=1)
        mbarrier.init(empty_r.index(s), count=1)
    for b in gl.static_range(N_SYNC):
        mbarrier.init(sync.index(b), count=1)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize(  # the constexprs inline: a tuple held in a variable turns them into tensors
        [(_even_tiles, (idx_ptr, n_idx, units, pairs_per_item, stride_it, scale_log2, q_l, q_r, q_rope, kv_l, kv_r,
                        kv_rope, p1_smem, m_smem, den_smem, q_full, q_empty, full_l, full_r, empty_l, empty_r, sync,
                        out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, ws_ptr, ml_ptr, HEADS, HB, BLOCK_H,
                        BLOCK_N, HALF, D_V)),
         (_odd_tiles, (idx_ptr, n_idx, units, pairs_per_item, stride_it, scale_log2, q_l, q_r, q_rope, kv_l, kv_r,
                       kv_rope, p1_smem, m_smem, den_smem, q_full, q_empty, full_l, full_r, empty_l, empty_r, sync,
                       out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, ws_ptr, ml_ptr, HEADS, HB, BLOCK_H,
                       BLOCK_N, HALF, D_V)),
         (_produce, (q_ptr, kv_ptr, idx_ptr, n_idx, units, pairs_per_item, stride_kv, stride_it,
                     q_l, q_r, q_rope, kv_l, kv_r, kv_rope, q_full, q_empty, full_l, full_r, empty_l, empty_r, HEADS,
                     HB, BLOCK_H, BLOCK_N, HALF, D_R, ROW_GROUP, PRODUCER_WARPS))],
        [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def constexprs(**change) -> dict:
    """The kernel's compile-time constants besides HEADS and HB (what a launch and bench/kernel_resources pass)."""
    base = dict(BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, HALF=HALF, D_R=D_R, D_V=D_V, **SCHEDULE)
    unknown = set(change) - set(base)
    if unknown:
        raise ValueError(f"unknown Gluon Stream-K sparse MLA constants {sorted(unknown)}; known: {sorted(base)}")
    return base | change


def sparse_mla_forward_stream(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float,
                              d_v: int = 512, programs: int | None = None,
                              **schedule) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla.sparse_mla_forward's outputs from this kernel (inputs as checked there). programs: how many
    to launch (default: one an SM)."""
    q, kv, idx, out, lse, trivial = forward_outputs(q, kv, idx, d_v, "Gluon Stream-K sparse MLA forward")
    if trivial:
        return out, lse
    T, heads, _ = q.shape
    n_idx = idx.shape[1]
    hb = triton.cdiv(heads, BLOCK_H)
    items, pairs = T * hb, triton.cdiv(triton.cdiv(n_idx, BLOCK_N), 2)
    units = items * pairs
    programs = min(programs or sk.sm_count(q.device), units)
    ws, ml = sk.workspace(2 * programs, BLOCK_H, d_v, q.device)
    _sparse_mla_fwd_stream[(programs, )](
        q, kv, idx, out, lse, ws, ml, sm_scale * 1.4426950408889634, n_idx, units, pairs, kv.stride(0), idx.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), HEADS=heads, HB=hb, **constexprs(**schedule), num_warps=4)
    sk.combine_partials(ws, ml, out, lse, sk.cut_items(items, pairs, programs), BLOCK_H)
    return out, lse
