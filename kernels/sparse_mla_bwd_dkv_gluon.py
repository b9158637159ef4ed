"""The split backward's dkv pass in Gluon (sm_90): dS / P tiles copied ahead, each tile's GEMMs overlapping
the previous tile's scatter-adds.

Same contract as sparse_mla_bwd_split.py's `_dkv_from_dsp_kernel`: dkv[idx[t, j]] += dS[t, :, j]^T q[t] +
P[t, :, j]^T dO[t] (value columns) and dS^T q_rope (rope columns) over every token t and slot j, from the
bf16 dS / P scratch [tokens, heads, topk] the dq pass wrote, with fp32 atomics (a key picked twice or by
many tokens is added once per pick; -1 slots add nothing). For bf16, 512 + 64 columns, heads a multiple
of 64 up to 128.

Why: the Triton pass is bound per SM (bench/results/split_overlap_gpu.json: on 32 SMs it takes 4.3x as
long as on 132), each tile's loads, transposes, two small-K GEMMs and the reductions' epilogue one after
another in the same warps. Here one program per (token, block of COLS value columns), 8 warps:
- the tile's dS and P rows ([heads, 64 keys], keys contiguous) are cp.async copies STAGES - 1 tiles ahead;
- the GEMMs take dS^T and P^T straight from shared memory as the transposed A operand (no register
  transpose): acc [64 keys, COLS] = dS^T q[:, cols] + P^T dO[:, cols], asynchronously;
- while they run, the previous tile's accumulator goes out as fp32 reductions into its keys' dkv rows.
The rope columns are a second, smaller launch of the same kernel (dS^T q_rope only: WITH_P off).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kernels import sparse_mla_gluon

BLOCK_N = 64  # keys a tile: one wgmma M
D_V, D_R = 512, 64
SCHEDULE = dict(COLS=128, STAGES=3, V4=False)


@gluon.jit
def _copy_tile(ds_ring, p_ring, slot, ds_row, p_row, k0, n_idx, WITH_P: gl.constexpr, HEADS: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """Tile [HEADS, BLOCK_N] at key k0 of the token's dS (and P) rows into ring slot `slot` (cp.async, one
    commit group; keys past n_idx are not copied: their rows add nothing)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_N // 8), BLOCK_N // 8], [8, 1], [1, 0])
    h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, layout))
    k = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    off = h[:, None] * n_idx + k[None, :]
    ok = (k < n_idx)[None, :]
    cp.async_copy_global_to_shared(ds_ring.index(slot), ds_row + off, mask=ok)
    if WITH_P:
        cp.async_copy_global_to_shared(p_ring.index(slot), p_row + off, mask=ok)
    cp.commit_group()


@gluon.jit
def _scatter_add(dkv_ptr, stride_dkv, acc, ids, cols, V4: gl.constexpr):
    """dkv[ids[r], cols] += acc[r, :] for the rows with ids >= 0 (relaxed fp32 reductions)."""
    if V4:  # through shared memory into 4 consecutive columns a thread: 16-byte reductions
        v4_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [8, 1], [1, 0])
        acc = gl.convert_layout(acc, v4_l)
        ids = gl.convert_layout(ids, gl.SliceLayout(1, v4_l))
        cols = gl.convert_layout(cols, gl.SliceLayout(0, v4_l))
    rows = dkv_ptr + gl.where(ids >= 0, ids, 0).to(gl.int64) * stride_dkv
    gl.atomic_add(rows[:, None] + cols[None, :], acc, mask=(ids >= 0)[:, None], sem="relaxed")


@gluon.jit
def dkv_pass_kernel(q_ptr, do_ptr, idx_ptr, ds_ptr, p_ptr, dkv_ptr, n_idx, stride_qt, stride_qh, stride_dot,
                    stride_doh, stride_it, stride_st, stride_dkv, col0, HEADS: gl.constexpr, BLOCK_N: gl.constexpr,
                    COLS: gl.constexpr, STAGES: gl.constexpr, WITH_P: gl.constexpr, V4: gl.constexpr):
    t = gl.program_id(0).to(gl.int64)
    c0 = col0 + gl.program_id(1) * COLS
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    tile_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_N], gl.bfloat16)
    col_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, COLS], gl.bfloat16)
    ds_ring = gl.allocate_shared_memory(dtype, [STAGES, HEADS, BLOCK_N], tile_sl)
    p_ring = gl.allocate_shared_memory(dtype, [STAGES if WITH_P else 1, HEADS, BLOCK_N], tile_sl)
    q_c = gl.allocate_shared_memory(dtype, [HEADS, COLS], col_sl)
    do_c = gl.allocate_shared_memory(dtype, [HEADS if WITH_P else 16, COLS], col_sl)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, COLS // 2, 16])
    idx_row = idx_ptr + t * stride_it
    ds_row = ds_ptr + t * stride_st
    p_row = p_ptr + t * stride_st
    n_tiles = gl.cdiv(n_idx, BLOCK_N)
    for s in gl.static_range(STAGES - 1):  # the first tiles' copies, then q's and dO's columns beside them
        _copy_tile(ds_ring, p_ring, s, ds_row, p_row, s * BLOCK_N, n_idx, WITH_P, HEADS, BLOCK_N)
    sparse_mla_gluon.rows_to_shared(q_c, q_ptr + t * stride_qt, stride_qh, 0, HEADS, c0)
    if WITH_P:
        sparse_mla_gluon.rows_to_shared(do_c, do_ptr + t * stride_dot, stride_doh, 0, HEADS, c0)
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
    cols = c0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, acc_l))
    zero = gl.zeros([BLOCK_N, COLS], gl.float32, acc_l)
    prev = zero
    prev_ids = gl.full([BLOCK_N], -1, gl.int32, gl.SliceLayout(1, acc_l))
    for i in range(n_tiles):
        gl.thread_barrier()  # every warpgroup's GEMMs of tile i - 1 are done: its slot may be refilled
        _copy_tile(ds_ring, p_ring, (i + STAGES - 1) % STAGES, ds_row, p_row, (i + STAGES - 1) * BLOCK_N, n_idx,
                   WITH_P, HEADS, BLOCK_N)
        cp.wait_group(STAGES - 1)  # this thread's copies of tile i have landed ...
        gl.thread_barrier()  # ... and every thread's
        fence_async_shared()
        slot = i % STAGES
        j = i * BLOCK_N + keys
        ids = gl.load(idx_row + j, mask=j < n_idx, other=-1)
        tok = warpgroup_mma(ds_ring.index(slot).permute((1, 0)), q_c, zero, use_acc=False, is_async=True)
        if WITH_P:
            tok = warpgroup_mma(p_ring.index(slot).permute((1, 0)), do_c, tok, is_async=True)
        _scatter_add(dkv_ptr, stride_dkv, prev, prev_ids, cols, V4)  # tile i - 1's, while tile i's GEMMs run
        prev = warpgroup_mma_wait(0, deps=(tok, ))
        prev_ids = ids
    _scatter_add(dkv_ptr, stride_dkv, prev, prev_ids, cols, V4)
    cp.wait_group(0)


def supports(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """bf16 on sm_90 with 512 + 64 columns (the Gluon forward's rule) and 64 or 128 heads."""
    return q.shape[1] in (64, 128) and sparse_mla_gluon.supports(q, kv, d_v)


def dkv_pass(q, grad_out, idx, ds, p, dkv, **schedule) -> None:
    """dkv += the dkv pass over q's tokens from their dS / P scratch rows [tokens, heads, topk]
    (contiguous inputs as split_backward passes them; n_idx >= 1)."""
    sch = SCHEDULE | schedule
    n, heads, _ = q.shape
    common = (q, grad_out, idx, ds, p, dkv, idx.shape[1], q.stride(0), q.stride(1), grad_out.stride(0),
              grad_out.stride(1), idx.stride(0), ds.stride(0), dkv.stride(0))
    dkv_pass_kernel[(n, D_V // sch["COLS"])](*common, 0, HEADS=heads, BLOCK_N=BLOCK_N, COLS=sch["COLS"],
                                             STAGES=sch["STAGES"], WITH_P=True, V4=sch["V4"], num_warps=8)
    dkv_pass_kernel[(n, 1)](*common, D_V, HEADS=heads, BLOCK_N=BLOCK_N, COLS=D_R, STAGES=sch["STAGES"],
                            WITH_P=False, V4=sch["V4"], num_warps=8)
