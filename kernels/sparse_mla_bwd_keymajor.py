"""Sparse MLA backward without atomics: a per-token dq kernel and a key-major dkv kernel.

Same math as kernels/sparse_mla_bwd.py (P = exp(scale q.kv - lse), dS = scale P (dO.kv[:D_V] - Delta)),
split by who owns the output rows:
- dq: one program per (token, block of heads) walks the token's top-k slots: the atomic kernel
  (kernels/sparse_mla_bwd_rows.py) with its dkv half compiled out, so its tiles are not held to
  that kernel's 32 x 32 shared-memory limit.
- dkv: the top-k index is inverted on the device (``invert_topk``: for each block of BLOCK_K
  consecutive keys, the tokens that selected any of them, and per token how many times each key).
  One program per key block owns those BLOCK_K dkv rows in registers and loops over its tokens:
  it recomputes the [heads, BLOCK_K] tile of P and dS from q, dO, lse and Delta, weights each
  column by the key's multiplicity in that token's row, and adds dS^T q + P^T dO. Every dkv row
  is written once by its owner: no atomics, and a key no token selected is stored as exact 0.
Semantics equal the atomic kernel's: a key listed c times in a row contributes c times (to dq
through c slots, to dkv through the weight c), -1 slots contribute nothing.

Cost of the key-major order (estimates, not measured): every (key block, token) pair loads the
token's q and dO rows (heads x (D + D_V) bf16: 137 KB at 64 heads) and computes a full
[heads, BLOCK_K] tile, of which only the selected columns count. With the benchmark's uniform-random
top-2048 of 64K keys a 16-key block is touched by ~40% of the tokens for ~1.25 selected keys each
(a ~13x tile overhead); DSA's selections cluster (neighbouring tokens pick neighbouring keys),
which is where this order pays. The inversion is a torch.unique over T * topk int64 codes
(67 MB at 4096 x 2048) plus a run-length pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tuning import Autotuner, KernelConfig
from kernels.sparse_mla import LOG2E, _bucket
from kernels.sparse_mla_bwd_rows import sparse_mla_bwd_rows_kernel

# Not measured yet (the H200 has not run these kernels). The dq kernel keeps no dkv tiles, so the
# forward's best shape (64 heads x 64 keys, 8 warps: 4.66 ms there) is tried first on CUDA;
# the dkv kernel holds [BLOCK_K, 576] fp32 in registers and stages q / dO [BLOCK_H, 576] tiles.
DQ_CONFIGS = [
    KernelConfig.make(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2),
    KernelConfig.make(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2),
    KernelConfig.make(BLOCK_H=32, BLOCK_N=64, num_warps=4, num_stages=2),
    KernelConfig.make(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=1),
]
DKV_CONFIGS = [
    KernelConfig.make(BLOCK_K=16, BLOCK_H=64, num_warps=4, num_stages=2),
    KernelConfig.make(BLOCK_K=16, BLOCK_H=64, num_warps=8, num_stages=2),
    KernelConfig.make(BLOCK_K=32, BLOCK_H=64, num_warps=8, num_stages=1),
    KernelConfig.make(BLOCK_K=32, BLOCK_H=32, num_warps=4, num_stages=2),
    KernelConfig.make(BLOCK_K=16, BLOCK_H=32, num_warps=4, num_stages=1),  # the smallest footprint
]
DQ_TUNER = Autotuner("sparse_mla_bwd_dq", DQ_CONFIGS)
DKV_TUNER = Autotuner("sparse_mla_bwd_dkv_keymajor", DKV_CONFIGS)


@triton.jit
def _dkv_keymajor_kernel(q_ptr, kv_ptr, do_ptr, lse_ptr, delta_ptr, dkv_ptr,
                         block_off_ptr, pair_tok_ptr, pair_start_ptr, pair_len_ptr, ent_key_ptr, ent_count_ptr,
                         n_keys, scale, scale_log2,
                         stride_qt, stride_qh, stride_kv, stride_dot, stride_doh, stride_lt, stride_dkv,
                         HEADS: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    keys = b * BLOCK_K + kk
    key_ok = keys < n_keys
    dv = tl.arange(0, D_V)
    dr = tl.arange(0, D_R)
    kv_rows = kv_ptr + keys.to(tl.int64)[:, None] * stride_kv
    kv_nope = tl.load(kv_rows + dv[None, :], mask=key_ok[:, None], other=0.0)
    kv_rope = tl.load(kv_rows + D_V + dr[None, :], mask=key_ok[:, None], other=0.0)
    acc_nope = tl.zeros([BLOCK_K, D_V], tl.float32)
    acc_rope = tl.zeros([BLOCK_K, D_R], tl.float32)
    for pi in range(tl.load(block_off_ptr + b), tl.load(block_off_ptr + b + 1)):
        t = tl.load(pair_tok_ptr + pi).to(tl.int64)
        e = tl.load(pair_start_ptr + pi) + kk
        e_ok = kk < tl.load(pair_len_ptr + pi)  # at most BLOCK_K distinct keys per (block, token)
        local = tl.load(ent_key_ptr + e, mask=e_ok, other=-1)
        count = tl.load(ent_count_ptr + e, mask=e_ok, other=0)
        mult = tl.sum(tl.where(local[:, None] == kk[None, :], count[:, None], 0), axis=0).to(tl.float32)
        for h0 in tl.static_range(0, HEADS, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            head_ok = heads < HEADS
            q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
            q_nope = tl.load(q_row + dv[None, :], mask=head_ok[:, None], other=0.0)
            q_rope = tl.load(q_row + D_V + dr[None, :], mask=head_ok[:, None], other=0.0)
            do = tl.load(do_ptr + t * stride_dot + heads[:, None] * stride_doh + dv[None, :],
                         mask=head_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + t * stride_lt + heads, mask=head_ok, other=float("-inf"))
            row_ok = head_ok & (lse > float("-inf"))
            lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
            delta = tl.load(delta_ptr + t * stride_lt + heads, mask=head_ok, other=0.0)
            s = tl.dot(q_nope, tl.trans(kv_nope))
            s = tl.dot(q_rope, tl.trans(kv_rope), s)
            live = row_ok[:, None] & (mult > 0)[None, :]
            p = tl.where(live, tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(kv_nope))
            ds = (p * (dp - delta[:, None]) * scale * mult[None, :]).to(q_nope.dtype)
            acc_nope = tl.dot(tl.trans(ds), q_nope, acc_nope)
            acc_nope = tl.dot(tl.trans((p * mult[None, :]).to(do.dtype)), do, acc_nope)
            acc_rope = tl.dot(tl.trans(ds), q_rope, acc_rope)
    out_rows = dkv_ptr + keys.to(tl.int64)[:, None] * stride_dkv
    tl.store(out_rows + dv[None, :], acc_nope, mask=key_ok[:, None])
    tl.store(out_rows + D_V + dr[None, :], acc_rope, mask=key_ok[:, None])


class TopkInverse:
    """The top-k index grouped by key block (CSR), all int tensors on idx's device.

    block_off [n_blocks + 1]: pairs of block b are block_off[b]:block_off[b+1]; pair p is one token
    pair_tok[p] that selected some key of the block; its distinct keys are the entries
    pair_start[p] : pair_start[p] + pair_len[p] (ent_key: key - block start, ent_count: how many
    of the token's slots hold that key). Ordered by (block, token, key)."""

    def __init__(self, block_off, pair_tok, pair_start, pair_len, ent_key, ent_count, block_k):
        self.block_off, self.pair_tok, self.pair_start, self.pair_len = block_off, pair_tok, pair_start, pair_len
        self.ent_key, self.ent_count, self.block_k = ent_key, ent_count, block_k


def invert_topk(idx: torch.Tensor, n_keys: int, block_k: int) -> TopkInverse:
    """Invert idx [T, topk] (-1 = unused slot) into per-key-block token lists, with torch ops."""
    T, K = idx.shape
    flat = idx.reshape(-1)
    pos = (flat >= 0).nonzero().squeeze(1)
    keys = flat[pos].long()
    if keys.numel() and int(keys.max()) >= n_keys:
        raise ValueError(f"idx holds key index {int(keys.max())} but kv has only {n_keys} rows")
    toks = pos // K
    block = keys // block_k
    code = (block * T + toks) * block_k + keys % block_k  # sorts as (block, token, key)
    uniq, ent_count = torch.unique(code, sorted=True, return_counts=True)
    pair_code, pair_len = torch.unique_consecutive(uniq // block_k, return_counts=True)
    pair_start = torch.cumsum(pair_len, 0) - pair_len
    n_blocks = triton.cdiv(n_keys, block_k)
    block_off = torch.zeros(n_blocks + 1, device=idx.device, dtype=torch.int64)
    block_off[1:] = torch.cumsum(torch.bincount(pair_code // T, minlength=n_blocks), 0)
    return TopkInverse(block_off, (pair_code % T).to(torch.int32), pair_start, pair_len.to(torch.int32),
                       (uniq % block_k).to(torch.int32), ent_count.to(torch.int32), block_k)


def tuning_keys(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> tuple[tuple, tuple]:
    """(DQ_TUNER key, DKV_TUNER key) of a call: power-of-two buckets of the token and key counts."""
    key = (min(_bucket(q.shape[0]), 4096), q.shape[1], q.shape[2], idx.shape[1], q.dtype)
    return key, (_bucket(kv.shape[0]),) + key


def keymajor_backward(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, grad_out: torch.Tensor,
                      lse: torch.Tensor, delta: torch.Tensor, sm_scale: float,
                      d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq in q's dtype, dkv fp32) from contiguous q, kv, int32 idx, grad_out (q's dtype), fp32 lse
    and Delta = rowsum(dO * out) [T, heads]; the checks and preparation are sparse_mla_backward's."""
    T, heads, dim = q.shape
    S = kv.shape[0]
    dq = torch.empty_like(q)
    dkv = torch.empty((S, dim), device=kv.device, dtype=torch.float32)  # the owners write every row
    if T == 0:
        return dq, dkv.zero_()
    dq_key, dkv_key = tuning_keys(q, kv, idx)

    def launch_dq(cfg: KernelConfig) -> None:
        bh = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(heads)))
        sparse_mla_bwd_rows_kernel[(T, triton.cdiv(heads, bh))](  # dkv/ds/p unused here
            q, kv, idx, grad_out, lse, delta, dq, dq, dq, dq, sm_scale, sm_scale * LOG2E, idx.shape[1],
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), grad_out.stride(0), grad_out.stride(1),
            lse.stride(0), dq.stride(0), dq.stride(1), 0, 0,
            HEADS=heads, D_V=d_v, D_R=dim - d_v, BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"], WITH_DKV=False,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def launch_dkv(cfg: KernelConfig) -> None:
        inv = invert_topk(idx, S, cfg["BLOCK_K"])  # inside the launch: tuning times it too
        bh = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(heads)))
        _dkv_keymajor_kernel[(inv.block_off.numel() - 1,)](
            q, kv, grad_out, lse, delta, dkv, inv.block_off, inv.pair_tok, inv.pair_start, inv.pair_len,
            inv.ent_key, inv.ent_count, S, sm_scale, sm_scale * LOG2E,
            q.stride(0), q.stride(1), kv.stride(0), grad_out.stride(0), grad_out.stride(1), lse.stride(0),
            dkv.stride(0),
            HEADS=heads, D_V=d_v, D_R=dim - d_v, BLOCK_H=bh, BLOCK_K=inv.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    launch_dq(DQ_TUNER.choose(dq_key, q.device, launch_dq))
    if S:
        launch_dkv(DKV_TUNER.choose(dkv_key, q.device, launch_dkv))
    return dq, dkv
