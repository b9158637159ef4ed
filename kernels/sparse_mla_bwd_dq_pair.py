"""The split backward's dq pass in Gluon with the two consumer warpgroups on alternate key tiles (sm_90).

Same contract as kernels/sparse_mla_bwd_gluon.py's dq_pass (dq of each token, and the bf16 dS / P rows of
the [tokens, heads, topk] scratch the dkv pass reads), for the same shapes (bf16, 512 + 64 columns).

Why: in sparse_mla_bwd_gluon.py both consumer warpgroups work on every 32-key tile, each computing half of
its key columns of S = q kv^T and dP = dO kv_nope^T: 64 x 16 wgmmas that read 2 KB of q or dO from shared
memory per 16-deep step for 0.5 KB of keys, 68 steps a tile. Here (the forward's kernels/sparse_mla_gluon_
pair.py, without its running max: lse is known) each warpgroup takes every other tile whole (64 x 32
wgmmas, the same steps over twice the keys), computes its P and dS, and both warpgroups add both tiles'
dS kv into the dq columns each owns: warpgroup 0 dq[:, 0:256] and the rope columns 512-543, warpgroup 1
dq[:, 256:512] and 544-575, the own tile's dS from registers, the other's through shared memory. Each
KV slot is stored in four parts (columns 0-255, 256-511, 512-543, 544-575) so that every wgmma operand is
a whole buffer: q 72 KB + dO 64 KB + two 36 KB slots + dS / P of both tiles (16 KB) in 227 KB.
Per pair j, warpgroup w (tile 2j + w, slot w): S and dP; P and dS; dS and P into its shared tiles (once the
other warpgroup has read the previous dS: `ds_free`), signalled (`ds_full`); dq += its dS (registers) while
its dS and P rows go out to the scratch; dq += the other's dS once signalled; then both slots and the
other's dS tile are handed back.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.sparse_mla_bwd_gluon import row_stats, tile_to_global
from kernels.sparse_mla_gluon import BLOCK_H, D_R, D_V, rows_to_shared
from kernels.sparse_mla_gluon_pair import copy_rows, signal

HALF = D_V // 2  # value columns (and half of the rope columns) a warpgroup's dq owns
# 224 / 48 (warpgroup 0, the default partition, gets 504 - 224 - 48 = 232): no spill in any loop (bench/kernel_resources;
# 216 / 56 spills in warpgroup 1's, 232 / 40 in the producer's); what spills (80 bytes) is the set-up's values across setmaxnreg
SCHEDULE = dict(BLOCK_N=32, PRODUCER_WARPS=4, PRODUCER_REGS=48, CONSUMER_REGS=224, ROW_GROUP=32)


@gluon.jit
def _gather_tiles4(kv_ptr, idx_row, n_idx, stride_kv, n_tiles, kv_l, kv_r, kv_ra, kv_rb, full, empty,
                   BLOCK_N: gl.constexpr, HALF: gl.constexpr, ROW_GROUP: gl.constexpr, WARPS: gl.constexpr):
    """The producer: tile i into slot i % 2 in its four column parts once both warpgroups have handed the slot
    back; `full` takes one arrival from every producer thread as its copies land."""
    RH: gl.constexpr = kv_ra.shape[2]
    for i in range(n_tiles):
        s = i % 2
        mbarrier.wait(empty.index(s), ((i // 2) & 1) ^ 1)  # the phase before a fresh barrier's first counts done
        j0 = i * BLOCK_N
        copy_rows(kv_l.index(s), kv_ptr, idx_row, n_idx, stride_kv, j0, 0, ROW_GROUP, WARPS)
        copy_rows(kv_r.index(s), kv_ptr, idx_row, n_idx, stride_kv, j0, HALF, ROW_GROUP, WARPS)
        copy_rows(kv_ra.index(s), kv_ptr, idx_row, n_idx, stride_kv, j0, 2 * HALF, BLOCK_N, WARPS)
        copy_rows(kv_rb.index(s), kv_ptr, idx_row, n_idx, stride_kv, j0, 2 * HALF + RH, BLOCK_N, WARPS)
        cp.mbarrier_arrive(full.index(s), increment_count=False)


@gluon.jit
def _dq_tiles(W: gl.constexpr, idx_row, n_idx, pairs, n_heads, lse_row, delta_row, ds_row, p_row, scale, scale_log2,
              q_l, q_r, q_ra, q_rb, do_l, do_r, kv_l, kv_r, kv_ra, kv_rb, ds_smem, p_smem, full, empty, ds_full,
              ds_free, dq_row, stride_dqh, h0, HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
              HALF: gl.constexpr):
    """Consumer warpgroup W: tiles 2j + W in slot W; dq's columns W * 256 .. + 256 and 512 + W * 32 .. + 32."""
    RH: gl.constexpr = kv_ra.shape[2]
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    dn_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    dr_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, RH, 16])
    dn_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dn_l, k_width=2)
    dr_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dr_l, k_width=2)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    row_ok, lse2, delta = row_stats(lse_row, delta_row, n_heads, BLOCK_H, s_l)
    zero_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    dq_n = gl.zeros([BLOCK_H, HALF], gl.float32, dn_l)
    dq_r = gl.zeros([BLOCK_H, RH], gl.float32, dr_l)
    for j in range(pairs):
        ph = j & 1
        z = (j + n_idx) >> 30  # always 0 (n_idx < 2^30): every wgmma descriptor stays in the loop (see below)
        mine = W + z
        other = 1 - W + z
        mbarrier.wait(full.index(W), ph)
        fence_async_shared()  # the copies landed through the generic proxy; wgmma reads through the async one
        # S and dP of tile 2j + W. Shared operands sit at a loop-variant index: at constant addresses the compiler
        # hoists the 64-bit descriptors of all their k-steps out of the loop (sparse_mla_bwd_gluon.py: 312 bytes
        # of spills)
        s_tok = warpgroup_mma(q_l.index(z), kv_l.index(mine).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s_tok = warpgroup_mma(q_r.index(z), kv_r.index(mine).permute((1, 0)), s_tok, is_async=True)
        s_tok = warpgroup_mma(q_ra.index(z), kv_ra.index(mine).permute((1, 0)), s_tok, is_async=True)
        s_tok = warpgroup_mma(q_rb.index(z), kv_rb.index(mine).permute((1, 0)), s_tok, is_async=True)
        dp_tok = warpgroup_mma(do_l.index(z), kv_l.index(mine).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        dp_tok = warpgroup_mma(do_r.index(z), kv_r.index(mine).permute((1, 0)), dp_tok, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
        k0 = (2 * j + W) * BLOCK_N
        jj = k0 + cols
        ids = gl.load(idx_row + jj, mask=jj < n_idx, other=-1)
        live = row_ok[:, None] & (ids >= 0)[None, :]
        p = gl.where(live, gl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        ds = (p * (dp - delta[:, None]) * scale).to(gl.bfloat16)
        mbarrier.wait(ds_free.index(W), ph ^ 1)  # the other warpgroup has read this tile's previous dS
        ds_smem.index(mine).store(ds)
        p_smem.index(mine).store(p.to(gl.bfloat16))
        fence_async_shared()
        signal(ds_full.index(W))
        n_tok = warpgroup_mma(gl.convert_layout(ds, dn_op), kv_l.index(mine) if W == 0 else kv_r.index(mine), dq_n,
                              is_async=True)
        r_tok = warpgroup_mma(gl.convert_layout(ds, dr_op), kv_ra.index(mine) if W == 0 else kv_rb.index(mine), dq_r,
                              is_async=True)
        tile_to_global(ds_smem.index(mine), ds_row, k0, n_idx, n_heads, 4)  # while the wgmmas run
        tile_to_global(p_smem.index(mine), p_row, k0, n_idx, n_heads, 4)
        mbarrier.wait(ds_full.index(1 - W), ph)  # the other tile's dS
        fence_async_shared()  # its KV slot landed by cp.async (generic proxy), waited for by the other warpgroup
        n_tok = warpgroup_mma(ds_smem.index(other), kv_l.index(other) if W == 0 else kv_r.index(other), n_tok,
                              is_async=True)
        r_tok = warpgroup_mma(ds_smem.index(other), kv_ra.index(other) if W == 0 else kv_rb.index(other), r_tok,
                              is_async=True)
        dq_n, dq_r = warpgroup_mma_wait(0, deps=(n_tok, r_tok))
        gl.thread_barrier()  # every warp is done with both slots and the other's dS (and its own dS / P rows)
        mbarrier.arrive(ds_free.index(1 - W), count=1)
        mbarrier.arrive(empty.index(0), count=1)
        mbarrier.arrive(empty.index(1), count=1)
    hn = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, dn_l))
    hr = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, dr_l))
    gl.store(dq_row + hn[:, None] * stride_dqh + W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, dn_l))[None, :],
             dq_n.to(gl.bfloat16), mask=(hn < HEADS)[:, None])
    gl.store(dq_row + hr[:, None] * stride_dqh + 2 * HALF + W * RH
             + gl.arange(0, RH, layout=gl.SliceLayout(0, dr_l))[None, :], dq_r.to(gl.bfloat16),
             mask=(hr < HEADS)[:, None])


@gluon.jit
def dq_pair_kernel(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, ds_ptr, p_ptr, scale, scale_log2,
                   n_idx, stride_qt, stride_qh, stride_kv, stride_it, stride_dot, stride_doh, stride_lt, stride_dqt,
                   stride_dqh, stride_st, HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                   HALF: gl.constexpr, D_R: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, ROW_GROUP: gl.constexpr):
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    RH: gl.constexpr = D_R // 2
    qh_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], gl.bfloat16)
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, RH], gl.bfloat16)
    kh_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
    kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RH], gl.bfloat16)
    t_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    # q and dO as [1, ...]: indexed by a loop-variant 0 in the consumers (see _dq_tiles)
    q_l = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], qh_sl)
    q_r = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], qh_sl)
    q_ra = gl.allocate_shared_memory(dtype, [1, BLOCK_H, RH], qr_sl)
    q_rb = gl.allocate_shared_memory(dtype, [1, BLOCK_H, RH], qr_sl)
    do_l = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], qh_sl)
    do_r = gl.allocate_shared_memory(dtype, [1, BLOCK_H, HALF], qh_sl)
    kv_l = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], kh_sl)
    kv_r = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], kh_sl)
    kv_ra = gl.allocate_shared_memory(dtype, [2, BLOCK_N, RH], kr_sl)
    kv_rb = gl.allocate_shared_memory(dtype, [2, BLOCK_N, RH], kr_sl)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N], t_sl)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N], t_sl)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    for s in gl.static_range(2):
        mbarrier.init(full.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty.index(s), count=2)  # both warpgroups read both slots
        mbarrier.init(ds_full.index(s), count=1)
        mbarrier.init(ds_free.index(s), count=1)
    q_row = q_ptr + t * stride_qt
    do_row = do_ptr + t * stride_dot
    rows_to_shared(q_l.index(0), q_row, stride_qh, h0, HEADS, 0, 4)  # heads past HEADS as zeros
    rows_to_shared(q_r.index(0), q_row, stride_qh, h0, HEADS, HALF, 4)
    rows_to_shared(q_ra.index(0), q_row, stride_qh, h0, HEADS, 2 * HALF, 4)
    rows_to_shared(q_rb.index(0), q_row, stride_qh, h0, HEADS, 2 * HALF + RH, 4)
    rows_to_shared(do_l.index(0), do_row, stride_doh, h0, HEADS, 0, 4)
    rows_to_shared(do_r.index(0), do_row, stride_doh, h0, HEADS, HALF, 4)
    fence_async_shared()
    gl.thread_barrier()
    idx_row = idx_ptr + t * stride_it
    n_tiles = gl.cdiv(n_idx, BLOCK_N)
    pairs = gl.cdiv(n_tiles, 2)  # an odd last tile is paired with one of -1 slots (P = dS = 0, nothing written)
    lse_row = lse_ptr + t * stride_lt + h0
    delta_row = delta_ptr + t * stride_lt + h0
    ds_row = ds_ptr + t * stride_st + h0 * n_idx
    p_row = p_ptr + t * stride_st + h0 * n_idx
    dq_row = dq_ptr + t * stride_dqt
    gl.warp_specialize(  # the constexprs inline: a tuple held in a variable turns them into tensors
        [(_dq_tiles, (0, idx_row, n_idx, pairs, HEADS - h0, lse_row, delta_row, ds_row, p_row, scale, scale_log2, q_l,
                        q_r, q_ra, q_rb, do_l, do_r, kv_l, kv_r, kv_ra, kv_rb, ds_smem, p_smem, full, empty, ds_full,
                        ds_free, dq_row, stride_dqh, h0, HEADS, BLOCK_H, BLOCK_N, HALF)),
         (_dq_tiles, (1, idx_row, n_idx, pairs, HEADS - h0, lse_row, delta_row, ds_row, p_row, scale, scale_log2, q_l,
                        q_r, q_ra, q_rb, do_l, do_r, kv_l, kv_r, kv_ra, kv_rb, ds_smem, p_smem, full, empty, ds_full,
                        ds_free, dq_row, stride_dqh, h0, HEADS, BLOCK_H, BLOCK_N, HALF)),
         (_gather_tiles4, (kv_ptr, idx_row, n_idx, stride_kv, 2 * pairs, kv_l, kv_r, kv_ra, kv_rb, full, empty,
                           BLOCK_N, HALF, ROW_GROUP, PRODUCER_WARPS))],
        [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def constexprs(heads: int, **change) -> dict:
    """The kernel's compile-time constants (what a launch and bench/kernel_resources pass)."""
    base = dict(HEADS=heads, BLOCK_H=BLOCK_H, HALF=HALF, D_R=D_R, **SCHEDULE)
    unknown = set(change) - set(base)
    if unknown:
        raise ValueError(f"unknown Gluon paired dq pass constants {sorted(unknown)}; known: {sorted(base)}")
    base |= change
    base["ROW_GROUP"] = min(base["ROW_GROUP"], base["BLOCK_N"])
    return base


def dq_pass(q, kv, idx, grad_out, lse, delta, dq, ds, p, sm_scale: float, **schedule) -> None:
    """sparse_mla_bwd_gluon.dq_pass's outputs from this kernel (contiguous inputs, as split_backward passes
    them; n_idx >= 1)."""
    n, heads, _ = q.shape
    dq_pair_kernel[(n, -(-heads // BLOCK_H))](
        q, kv, idx, grad_out, lse, delta, dq, ds, p, sm_scale, sm_scale * 1.4426950408889634, idx.shape[1],
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), grad_out.stride(0), grad_out.stride(1),
        lse.stride(0), dq.stride(0), dq.stride(1), ds.stride(0), **constexprs(heads, **schedule), num_warps=4)
