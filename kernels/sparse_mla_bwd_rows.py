"""The per-token sparse MLA backward kernel, shared by both backward impls.

One program per (token, block of heads) walks the token's top-k slots, recomputes S and P from
lse and accumulates dq in registers (the math is in kernels/sparse_mla_bwd.py's docstring). With
WITH_DKV it also scatter-adds each key block's dkv with fp32 atomics (impl="atomic"); without it,
the dkv half is compiled out and the launch is the dq kernel of impl="keymajor", whose dkv kernel
owns its rows instead. With STORE_DSP (impl="split") that dq launch also writes the bf16 dS and P
tiles it computed to a [T, heads, topk] scratch, from which kernels/sparse_mla_bwd_split.py's dkv
kernel builds dkv without recomputing them. Kept apart so that no impl's module imports another's.
"""
from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def sparse_mla_bwd_rows_kernel(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
                               ds_ptr, p_ptr, scale, scale_log2, n_idx,
                               stride_qt, stride_qh, stride_kv, stride_it, stride_dot, stride_doh, stride_lt,
                               stride_dqt, stride_dqh, stride_dkv, stride_st,
                               HEADS: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, WITH_DKV: tl.constexpr,
                               STORE_DSP: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < HEADS
    dv = tl.arange(0, D_V)
    dr = tl.arange(0, D_R)
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + dv[None, :], mask=head_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + D_V + dr[None, :], mask=head_ok[:, None], other=0.0)
    do = tl.load(do_ptr + t * stride_dot + heads[:, None] * stride_doh + dv[None, :], mask=head_ok[:, None],
                 other=0.0)
    lse = tl.load(lse_ptr + t * stride_lt + heads, mask=head_ok, other=float("-inf"))
    row_ok = head_ok & (lse > float("-inf"))  # a row with no valid key has P = 0 everywhere
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    delta = tl.load(delta_ptr + t * stride_lt + heads, mask=head_ok, other=0.0)
    dq_nope = tl.zeros([BLOCK_H, D_V], tl.float32)
    dq_rope = tl.zeros([BLOCK_H, D_R], tl.float32)
    for start in range(0, n_idx, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        ids = tl.load(idx_ptr + t * stride_it + j, mask=j < n_idx, other=-1)
        valid = ids >= 0
        safe = tl.where(valid, ids, 0).to(tl.int64)
        rows = kv_ptr + safe[:, None] * stride_kv
        kv_nope = tl.load(rows + dv[None, :], mask=valid[:, None], other=0.0)
        kv_rope = tl.load(rows + D_V + dr[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q_nope, tl.trans(kv_nope))
        s = tl.dot(q_rope, tl.trans(kv_rope), s)
        live = row_ok[:, None] & valid[None, :]
        p = tl.where(live, tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(kv_nope))
        ds = (p * (dp - delta[:, None]) * scale).to(kv_nope.dtype)
        if STORE_DSP:  # [heads, keys] tiles into the [T, heads, topk] scratch (keys contiguous)
            slot = t * stride_st + heads[:, None] * n_idx + j[None, :]
            keep = head_ok[:, None] & (j < n_idx)[None, :]
            tl.store(ds_ptr + slot, ds, mask=keep)
            tl.store(p_ptr + slot, p.to(ds.dtype), mask=keep)
        dq_nope = tl.dot(ds, kv_nope, dq_nope)
        dq_rope = tl.dot(ds, kv_rope, dq_rope)
        if WITH_DKV:  # compiled out for the dq-only launch: its tiles then need no dkv staging
            dk_nope = tl.dot(tl.trans(ds), q_nope)
            dk_nope = tl.dot(tl.trans(p.to(do.dtype)), do, dk_nope)
            dk_rope = tl.dot(tl.trans(ds), q_rope)
            out_rows = dkv_ptr + safe[:, None] * stride_dkv
            tl.atomic_add(out_rows + dv[None, :], dk_nope, mask=valid[:, None], sem="relaxed")
            tl.atomic_add(out_rows + D_V + dr[None, :], dk_rope, mask=valid[:, None], sem="relaxed")
    dq_row = dq_ptr + t * stride_dqt + heads[:, None] * stride_dqh
    tl.store(dq_row + dv[None, :], dq_nope.to(dq_ptr.dtype.element_ty), mask=head_ok[:, None])
    tl.store(dq_row + D_V + dr[None, :], dq_rope.to(dq_ptr.dtype.element_ty), mask=head_ok[:, None])
