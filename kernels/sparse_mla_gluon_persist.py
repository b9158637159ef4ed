"""Sparse MLA forward in Gluon: sparse_mla_gluon_pair.py's schedule in persistent programs (sm_90).

Same contract and shapes as kernels/sparse_mla_gluon_pair.py. Why: there a program is one token, so each
token's start and end run with nothing beside them on its SM: q's 72 KB are loaded before the producer starts,
the first tile's gathers are waited for with idle tensor cores, and the last PVs and the stores of out run
with no gathers in flight (at 4096 tokens of a 64K context about 96 us a program on the H200). Here a
program takes tokens pid, pid + grid, ... (grid: one program an SM), and the producer warpgroup runs across
the tokens' boundaries: it gathers the next token's first tile as soon as its slot is free and loads the
next token's q (by cp.async, into the one q buffer) as soon as both consumer warpgroups have issued their
last QK^T of the token (the `q_empty` barrier; `q_full` tells the consumers it landed). The consumers' math
is the paired kernel's, with every barrier phase counted over the program's tokens.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.sparse_mla_gluon import BLOCK_H, BLOCK_N, D_R, launch_forward
from kernels.sparse_mla_gluon_pair import (HALF, M0, M1, N_SYNC, O_LAYOUT, P_OPERAND, S0, S1, S_LAYOUT, SCHEDULE,
                                           _copy_rows, _finish, _fresh, _masked, _qk_part, _signal)

# the token loop's state takes registers: with the paired kernel's split (warpgroup 1: 216, producer: 56,
# warpgroup 0: 232) warpgroup 0 spills in its loop and the producer 10 values a pair (bench/kernel_resources'
# SASS); with 200 / 64 / 240 neither consumer spills and the producer 3 a pair. Q_ROWS: q's rows a cp.async call.
PERSIST_SCHEDULE = dict(PRODUCER_REGS=64, CONSUMER_REGS=200, Q_ROWS=16)


@gluon.jit
def _copy_q(dst, q_row, stride_qh, h0, HEADS: gl.constexpr, col0, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """cp.async dst [BLOCK_H, C] <- q_row's heads h0 .. h0 + BLOCK_H, columns col0 .. col0 + C (heads past HEADS
    are not read: cp.async fills them with zeros)."""
    C: gl.constexpr = dst.shape[1]
    TPC: gl.constexpr = C // 8 if C // 8 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [WARPS, 1], [1, 0])
    c = col0 + gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    for g in gl.static_range(dst.shape[0] // ROWS):
        h = h0 + g * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cp.async_copy_global_to_shared(dst.slice(g * ROWS, ROWS, dim=0), q_row + h[:, None] * stride_qh + c[None, :],
                                       mask=(h < HEADS)[:, None])


@gluon.jit
def _gather_pair(j, g, kv_ptr, idx_row, n_idx, stride_kv, kv_l, kv_r, kv_rope, full_l, full_r, empty_l, empty_r,
                 q_row, stride_qh, h0, q_l, q_r, q_rope, q_full, q_empty, n, HEADS: gl.constexpr,
                 BLOCK_N: gl.constexpr, HALF: gl.constexpr, ROW_GROUP: gl.constexpr, WARPS: gl.constexpr,
                 Q_ROWS: gl.constexpr, WITH_Q: gl.constexpr):
    """Pair j of a token (the program's g-th): the paired kernel's four half-slot gathers; with WITH_Q (the token's
    first pair) the token's q right after the first left half (that slot frees before q does)."""
    ph = (g & 1) ^ 1  # a fresh barrier counts as having completed the phase before its first
    j0 = 2 * j * BLOCK_N
    j1 = j0 + BLOCK_N
    mbarrier.wait(empty_l.index(0), ph)
    _copy_rows(kv_l.index(0), kv_ptr, idx_row, n_idx, stride_kv, j0, 0, ROW_GROUP, WARPS)
    cp.mbarrier_arrive(full_l.index(0), increment_count=False)
    if WITH_Q:
        mbarrier.wait(q_empty, (n & 1) ^ 1)  # both warpgroups past their last QK^T of the token before
        _copy_q(q_l.index(0), q_row, stride_qh, h0, HEADS, 0, Q_ROWS, WARPS)
        _copy_q(q_r.index(0), q_row, stride_qh, h0, HEADS, HALF, Q_ROWS, WARPS)
        _copy_q(q_rope.index(0), q_row, stride_qh, h0, HEADS, 2 * HALF, Q_ROWS, WARPS)
        cp.mbarrier_arrive(q_full, increment_count=False)
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
def _producer(q_ptr, kv_ptr, idx_ptr, n_tokens, n_idx, stride_qt, stride_qh, stride_kv, stride_it, pairs, h0, q_l,
              q_r, q_rope, q_full, q_empty, kv_l, kv_r, kv_rope, full_l, full_r, empty_l, empty_r, HEADS: gl.constexpr,
              BLOCK_N: gl.constexpr, HALF: gl.constexpr, ROW_GROUP: gl.constexpr, WARPS: gl.constexpr,
              Q_ROWS: gl.constexpr):
    """Each token's pairs in order, the first with the token's q (outside the loop over the others, whose
    registers it would otherwise take)."""
    for n in range(gl.cdiv(n_tokens - gl.program_id(0), gl.num_programs(0))):  # this program's n-th token: t
        t = gl.program_id(0) + n * gl.num_programs(0)
        idx_row = idx_ptr + t.to(gl.int64) * stride_it
        q_row = q_ptr + t.to(gl.int64) * stride_qt
        g0 = n * pairs
        _gather_pair(0, g0, kv_ptr, idx_row, n_idx, stride_kv, kv_l, kv_r, kv_rope, full_l, full_r, empty_l, empty_r,
                     q_row, stride_qh, h0, q_l, q_r, q_rope, q_full, q_empty, n, HEADS, BLOCK_N, HALF, ROW_GROUP,
                     WARPS, Q_ROWS, True)
        for j in range(1, pairs):
            _gather_pair(j, g0 + j, kv_ptr, idx_row, n_idx, stride_kv, kv_l, kv_r, kv_rope, full_l, full_r, empty_l,
                         empty_r, q_row, stride_qh, h0, q_l, q_r, q_rope, q_full, q_empty, n, HEADS, BLOCK_N, HALF,
                         ROW_GROUP, WARPS, Q_ROWS, False)


@gluon.jit
def _even_tiles(idx_ptr, n_tokens, n_idx, stride_it, pairs, scale_log2, q_l, q_r, q_rope, q_full, q_empty, kv_l, kv_r,
                kv_rope, p1_smem, m_smem, den_smem, full_l, full_r, empty_l, empty_r, sync, out_ptr, stride_ot,
                stride_oh, h0, lse_ptr, stride_lt, HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                HALF: gl.constexpr, IO_EVICT: gl.constexpr):
    """Warpgroup 0 (the default partition): each token's tiles 2j, O's columns 0-255."""
    for n in range(gl.cdiv(n_tokens - gl.program_id(0), gl.num_programs(0))):  # this program's n-th token: t
        t = gl.program_id(0) + n * gl.num_programs(0)
        idx_row = idx_ptr + t.to(gl.int64) * stride_it
        g0 = n * pairs  # pairs done by this program before this token: the barriers' phases count them
        zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)
        mbarrier.wait(q_full, n & 1)
        s_tok = _qk_part(q_l.index(0), kv_l.index(0), full_l.index(0), g0 & 1, zero_s, False)
        s_tok = _qk_part(q_r.index(0), kv_r.index(0), full_r.index(0), g0 & 1, s_tok, True)
        s_tok = warpgroup_mma(q_rope.index(0), kv_rope.index(0).permute((1, 0)), s_tok, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        for j in range(pairs):
            ph = (g0 + j) & 1
            z = (j + n_idx) >> 30  # always 0 (n_idx < 2^30): see sparse_mla_gluon_pair._qk_part
            if j + 1 == pairs:
                _signal(q_empty)  # this token's last QK^T of warpgroup 0 is done
            x = _masked(s, idx_row, n_idx, 2 * j * BLOCK_N, scale_log2, S_LAYOUT)
            m0 = gl.maximum(m, gl.max(x, axis=1))
            m0_safe = gl.where(m0 == float("-inf"), 0.0, m0)  # rows with no valid key yet
            alpha = gl.exp2(m - m0_safe)
            p = gl.exp2(x - m0_safe[:, None])
            den = den * alpha + gl.sum(p, axis=1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
            m_smem.store(m0)
            _signal(sync.index(M0))
            o_tok = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_OPERAND), kv_l.index(z), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o_tok, ))
            _signal(empty_l.index(0))
            mbarrier.wait(sync.index(M1), ph)
            m1 = m_smem.load(gl.SliceLayout(1, S_LAYOUT))
            beta = gl.where(m0 == float("-inf"), 1.0, gl.exp2(m0_safe - gl.where(m1 == float("-inf"), 0.0, m1)))
            kv_rope.index(z).store((p * beta[:, None]).to(gl.bfloat16))  # slot 0's rope columns: read by S0 only
            fence_async_shared()
            _signal(sync.index(S0))
            o = o * gl.convert_layout(beta, gl.SliceLayout(1, O_LAYOUT))[:, None]
            den = den * beta
            m = m1
            mbarrier.wait(sync.index(S1), ph)
            fence_async_shared()
            o_tok = warpgroup_mma(p1_smem.index(z), kv_l.index(1 + z), o, is_async=True)
            if j + 1 < pairs:  # tile 2j + 2's QK^T on slot 0's left half while this PV runs
                s_tok = _qk_part(q_l.index(z), kv_l.index(z), full_l.index(0), ph ^ 1, zero_s, False)
                o = warpgroup_mma_wait(1, deps=(o_tok, ))
                _signal(empty_l.index(1))
                s_tok = _qk_part(q_r.index(z), kv_r.index(z), full_r.index(0), ph ^ 1, s_tok, True)
                s_tok = warpgroup_mma(q_rope.index(z), kv_rope.index(z).permute((1, 0)), s_tok, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s_tok, ))
            else:
                o = warpgroup_mma_wait(0, deps=(o_tok, ))
                _signal(empty_l.index(1))
        _finish(o, m, den, m_smem, den_smem, sync, 0, out_ptr + t.to(gl.int64) * stride_ot, stride_oh, 0, h0, HEADS,
                lse_ptr + t.to(gl.int64) * stride_lt, False, O_LAYOUT, IO_EVICT, n & 1)


@gluon.jit
def _odd_tiles(idx_ptr, n_tokens, n_idx, stride_it, pairs, scale_log2, q_l, q_r, q_rope, q_full, q_empty, kv_l, kv_r,
               kv_rope, p1_smem, m_smem, den_smem, full_l, full_r, empty_l, empty_r, sync, out_ptr, stride_ot,
               stride_oh, h0, lse_ptr, stride_lt, HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
               HALF: gl.constexpr, IO_EVICT: gl.constexpr):
    """Warpgroup 1 (a worker partition): each token's tiles 2j + 1, O's columns 256-511, and the lse."""
    for n in range(gl.cdiv(n_tokens - gl.program_id(0), gl.num_programs(0))):  # this program's n-th token: t
        t = gl.program_id(0) + n * gl.num_programs(0)
        idx_row = idx_ptr + t.to(gl.int64) * stride_it
        g0 = n * pairs
        zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)
        mbarrier.wait(q_full, n & 1)
        for j in range(pairs):
            ph = (g0 + j) & 1
            z = (j + n_idx) >> 30
            s_tok = _qk_part(q_r.index(z), kv_r.index(1 + z), full_r.index(1), ph, zero_s, False)
            s_tok = warpgroup_mma(q_rope.index(z), kv_rope.index(1 + z).permute((1, 0)), s_tok, is_async=True)
            s_tok = _qk_part(q_l.index(z), kv_l.index(1 + z), full_l.index(1), ph, s_tok, True)
            s = warpgroup_mma_wait(0, deps=(s_tok, ))
            if j + 1 == pairs:
                _signal(q_empty)  # this token's last QK^T of warpgroup 1 is done
            x = _masked(s, idx_row, n_idx, (2 * j + 1) * BLOCK_N, scale_log2, S_LAYOUT)
            mbarrier.wait(sync.index(M0), ph)
            m1 = gl.maximum(m_smem.load(gl.SliceLayout(1, S_LAYOUT)), gl.max(x, axis=1))
            gl.thread_barrier()  # every thread has read m0 before any writes m1 over it
            m1_safe = gl.where(m1 == float("-inf"), 0.0, m1)
            alpha = gl.exp2(m - m1_safe)
            p = gl.exp2(x - m1_safe[:, None])
            den = den * alpha + gl.sum(p, axis=1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
            m = m1
            m_smem.store(m1)
            _signal(sync.index(M1))
            p_bf = p.to(gl.bfloat16)
            o_tok = warpgroup_mma(gl.convert_layout(p_bf, P_OPERAND), kv_r.index(1 + z), o, is_async=True)
            p1_smem.index(z).store(p_bf)
            fence_async_shared()
            _signal(sync.index(S1))
            mbarrier.wait(sync.index(S0), ph)
            fence_async_shared()
            o_tok = warpgroup_mma(kv_rope.index(z), kv_r.index(z), o_tok, is_async=True)  # P0, in slot 0's rope
            warpgroup_mma_wait(1, deps=(o_tok, ))
            _signal(empty_r.index(1))
            o = warpgroup_mma_wait(0, deps=(o_tok, ))
            _signal(empty_r.index(0))
        _finish(o, m, den, m_smem, den_smem, sync, 1, out_ptr + t.to(gl.int64) * stride_ot, stride_oh, HALF, h0, HEADS,
                lse_ptr + t.to(gl.int64) * stride_lt, True, O_LAYOUT, IO_EVICT, n & 1)


@gluon.jit
def _sparse_mla_fwd_persist(q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, scale_log2, n_idx, stride_qt, stride_qh,
                            stride_kv, stride_it, stride_ot, stride_oh, stride_lt, n_tokens, HEADS: gl.constexpr,
                            BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, D_R: gl.constexpr,
                            PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            ROW_GROUP: gl.constexpr, IO_EVICT: gl.constexpr, Q_ROWS: gl.constexpr):
    h0 = gl.program_id(1) * BLOCK_H
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    half_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], gl.bfloat16)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_R], gl.bfloat16)
    kvh_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
    kvr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], gl.bfloat16)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_l = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], half_sl)
    q_r = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], half_sl)
    q_rope = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_R], rope_sl)
    kv_l = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], kvh_sl)
    kv_r = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], kvh_sl)
    kv_rope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_R], kvr_sl)
    p1_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, BLOCK_N], kvr_sl)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)
    den_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_sl)
    full_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    full_r = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    empty_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    empty_r = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    sync = gl.allocate_shared_memory(gl.int64, [N_SYNC, 1], bar_l)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)  # q_full, q_empty
    for s in gl.static_range(2):
        mbarrier.init(full_l.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(full_r.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty_l.index(s), count=1)
        mbarrier.init(empty_r.index(s), count=1)
    for b in gl.static_range(N_SYNC):
        mbarrier.init(sync.index(b), count=1)
    mbarrier.init(q_bars.index(0), count=PRODUCER_WARPS * 32)
    mbarrier.init(q_bars.index(1), count=2)  # one arrival from each consumer warpgroup
    fence_async_shared()
    gl.thread_barrier()
    pairs = gl.cdiv(gl.cdiv(n_idx, BLOCK_N), 2)  # an odd last tile is paired with one of -1 slots
    gl.warp_specialize(
        [(_even_tiles, (idx_ptr, n_tokens, n_idx, stride_it, pairs, scale_log2, q_l, q_r, q_rope, q_bars.index(0),
                        q_bars.index(1), kv_l, kv_r, kv_rope, p1_smem, m_smem, den_smem, full_l, full_r, empty_l,
                        empty_r, sync, out_ptr, stride_ot, stride_oh, h0, lse_ptr, stride_lt, HEADS, BLOCK_H,
                        BLOCK_N, HALF, IO_EVICT)),
         (_odd_tiles, (idx_ptr, n_tokens, n_idx, stride_it, pairs, scale_log2, q_l, q_r, q_rope, q_bars.index(0),
                       q_bars.index(1), kv_l, kv_r, kv_rope, p1_smem, m_smem, den_smem, full_l, full_r, empty_l,
                       empty_r, sync, out_ptr, stride_ot, stride_oh, h0, lse_ptr, stride_lt, HEADS, BLOCK_H,
                       BLOCK_N, HALF, IO_EVICT)),
         (_producer, (q_ptr, kv_ptr, idx_ptr, n_tokens, n_idx, stride_qt, stride_qh, stride_kv, stride_it, pairs, h0,
                      q_l, q_r, q_rope, q_bars.index(0), q_bars.index(1), kv_l, kv_r, kv_rope, full_l, full_r,
                      empty_l, empty_r, HEADS, BLOCK_N, HALF, ROW_GROUP, PRODUCER_WARPS, Q_ROWS))],
        [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def constexprs(**change) -> dict:
    """The kernel's compile-time constants besides HEADS (the paired kernel's)."""
    base = dict(BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, HALF=HALF, D_R=D_R, **(SCHEDULE | PERSIST_SCHEDULE))
    unknown = set(change) - set(base)
    if unknown:
        raise ValueError(f"unknown Gluon persistent sparse MLA constants {sorted(unknown)}; known: {sorted(base)}")
    return base | change


def sparse_mla_forward_persist(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float,
                               d_v: int = 512, **schedule) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla.sparse_mla_forward's outputs from this kernel (inputs as checked there)."""
    return launch_forward(_sparse_mla_fwd_persist, constexprs(**schedule), 4, q, kv, idx, sm_scale, d_v,
                          "persistent Gluon sparse MLA forward", persistent=True)
