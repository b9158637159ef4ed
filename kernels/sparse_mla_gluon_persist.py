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
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier)

from kernels.sparse_mla_gluon import launch_forward
from kernels.sparse_mla_gluon_pair import (O_LAYOUT, SCHEDULE, _buffers, _even_pair, _finish, _first_scores,
                                           _fresh, _gather_left0, _gather_rest, _odd_pair, _odd_scores, _signal)
from kernels.sparse_mla_gluon_pair import constexprs as pair_constexprs

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
def _token_count(n_tokens):
    """How many tokens this program takes: pid, pid + grid, ... below n_tokens."""
    return gl.cdiv(n_tokens - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _token(n):
    """This program's n-th token (int64: it scales row strides)."""
    return (gl.program_id(0) + n * gl.num_programs(0)).to(gl.int64)


@gluon.jit
def _producer(q_ptr, kv_ptr, idx_ptr, n_tokens, n_idx, stride_qt, stride_qh, stride_kv, stride_it, pairs, h0, q_l,
              q_r, q_rope, q_full, q_empty, kv_l, kv_r, kv_rope, full_l, full_r, empty_l, empty_r, HEADS: gl.constexpr,
              BLOCK_N: gl.constexpr, HALF: gl.constexpr, ROW_GROUP: gl.constexpr, WARPS: gl.constexpr,
              Q_ROWS: gl.constexpr):
    """Each token's pairs as the paired kernel's producer gathers them, with the token's q right after its first
    tile's left half (that slot frees before q does), outside the loop over the other pairs (whose registers it
    would otherwise take)."""
    for n in range(_token_count(n_tokens)):
        t = _token(n)
        idx_row = idx_ptr + t * stride_it
        ph = ((n * pairs) & 1) ^ 1  # a fresh barrier counts as having completed the phase before its first
        _gather_left0(0, ph, kv_ptr, idx_row, n_idx, stride_kv, kv_l, full_l, empty_l, ROW_GROUP, WARPS)
        mbarrier.wait(q_empty, (n & 1) ^ 1)  # both warpgroups past their last QK^T of the token before
        q_row = q_ptr + t * stride_qt
        _copy_q(q_l.index(0), q_row, stride_qh, h0, HEADS, 0, Q_ROWS, WARPS)
        _copy_q(q_r.index(0), q_row, stride_qh, h0, HEADS, HALF, Q_ROWS, WARPS)
        _copy_q(q_rope.index(0), q_row, stride_qh, h0, HEADS, 2 * HALF, Q_ROWS, WARPS)
        cp.mbarrier_arrive(q_full, increment_count=False)
        _gather_rest(0, ph, kv_ptr, idx_row, n_idx, stride_kv, kv_l, kv_r, kv_rope, full_l, full_r, empty_l, empty_r,
                     BLOCK_N, HALF, ROW_GROUP, WARPS)
        for j in range(1, pairs):
            ph = ((n * pairs + j) & 1) ^ 1
            _gather_left0(2 * j * BLOCK_N, ph, kv_ptr, idx_row, n_idx, stride_kv, kv_l, full_l, empty_l, ROW_GROUP,
                          WARPS)
            _gather_rest(2 * j * BLOCK_N, ph, kv_ptr, idx_row, n_idx, stride_kv, kv_l, kv_r, kv_rope, full_l, full_r,
                         empty_l, empty_r, BLOCK_N, HALF, ROW_GROUP, WARPS)


@gluon.jit
def _even_tiles(idx_ptr, n_tokens, n_idx, stride_it, pairs, scale_log2, q_l, q_r, q_rope, q_full, q_empty, kv_l, kv_r,
                kv_rope, p1_smem, m_smem, den_smem, full_l, full_r, empty_l, empty_r, sync, out_ptr, stride_ot,
                stride_oh, h0, lse_ptr, stride_lt, HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                HALF: gl.constexpr, IO_EVICT: gl.constexpr):
    """Warpgroup 0 (the default partition): each token's tiles 2j, O's columns 0-255."""
    for n in range(_token_count(n_tokens)):
        t = _token(n)
        idx_row = idx_ptr + t * stride_it
        g0 = n * pairs  # pairs done by this program before this token: the barriers' phases count them
        zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)
        mbarrier.wait(q_full, n & 1)
        s = _first_scores(q_l, q_r, q_rope, kv_l, kv_r, kv_rope, full_l, full_r, g0 & 1, zero_s)
        for j in range(pairs):
            if j + 1 == pairs:
                _signal(q_empty)  # this token's last QK^T of warpgroup 0 is done
            s, m, den, o = _even_pair(j, pairs, (g0 + j) & 1, s, m, den, o, zero_s, idx_row, n_idx, scale_log2,
                                      q_l, q_r, q_rope, kv_l, kv_r, kv_rope, p1_smem, m_smem, full_l,
                                      full_r, empty_l, sync, BLOCK_N)
        _finish(o, m, den, m_smem, den_smem, sync, 0, out_ptr + t * stride_ot, stride_oh, 0, h0, HEADS,
                lse_ptr + t * stride_lt, False, O_LAYOUT, IO_EVICT, n & 1)


@gluon.jit
def _odd_tiles(idx_ptr, n_tokens, n_idx, stride_it, pairs, scale_log2, q_l, q_r, q_rope, q_full, q_empty, kv_l, kv_r,
               kv_rope, p1_smem, m_smem, den_smem, full_l, full_r, empty_l, empty_r, sync, out_ptr, stride_ot,
               stride_oh, h0, lse_ptr, stride_lt, HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
               HALF: gl.constexpr, IO_EVICT: gl.constexpr):
    """Warpgroup 1 (a worker partition): each token's tiles 2j + 1, O's columns 256-511, and the lse."""
    for n in range(_token_count(n_tokens)):
        t = _token(n)
        idx_row = idx_ptr + t * stride_it
        g0 = n * pairs
        zero_s, m, den, o = _fresh(BLOCK_H, BLOCK_N, HALF)
        mbarrier.wait(q_full, n & 1)
        for j in range(pairs):
            s = _odd_scores(j, (g0 + j) & 1, n_idx, zero_s, q_l, q_r, q_rope, kv_l, kv_r, kv_rope, full_l, full_r)
            if j + 1 == pairs:
                _signal(q_empty)  # this token's last QK^T of warpgroup 1 is done
            m, den, o = _odd_pair(j, (g0 + j) & 1, s, m, den, o, idx_row, n_idx, scale_log2, kv_r, kv_rope,
                                  p1_smem, m_smem, empty_r, sync, BLOCK_N)
        _finish(o, m, den, m_smem, den_smem, sync, 1, out_ptr + t * stride_ot, stride_oh, HALF, h0, HEADS,
                lse_ptr + t * stride_lt, True, O_LAYOUT, IO_EVICT, n & 1)


@gluon.jit
def _sparse_mla_fwd_persist(q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, scale_log2, n_idx, stride_qt, stride_qh,
                            stride_kv, stride_it, stride_ot, stride_oh, stride_lt, n_tokens, HEADS: gl.constexpr,
                            BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, D_R: gl.constexpr,
                            PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            ROW_GROUP: gl.constexpr, IO_EVICT: gl.constexpr, Q_ROWS: gl.constexpr):
    h0 = gl.program_id(1) * BLOCK_H
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    (q_l, q_r, q_rope, kv_l, kv_r, kv_rope, p1_smem, m_smem, den_smem, full_l, full_r, empty_l, empty_r,
     sync) = _buffers(dtype, BLOCK_H, BLOCK_N, HALF, D_R, PRODUCER_WARPS)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # q_full, q_empty
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
    """The kernel's compile-time constants besides HEADS: the paired kernel's, PERSIST_SCHEDULE's over them."""
    return pair_constexprs(SCHEDULE | PERSIST_SCHEDULE, "persistent", **change)


def sparse_mla_forward_persist(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float,
                               d_v: int = 512, **schedule) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla.sparse_mla_forward's outputs from this kernel (inputs as checked there)."""
    return launch_forward(_sparse_mla_fwd_persist, constexprs(**schedule), 4, q, kv, idx, sm_scale, d_v,
                          "persistent Gluon sparse MLA forward", persistent=True)
