"""Sparse MLA attention backward (absorbed MQA form) and the autograd wrapper of forward + backward.

Given dO [T, heads, D_V], the forward's out and natural-log lse, per (token, key j in top-k):
  P = exp(scale * q.kv_j - lse), dP = dO . kv_j[:D_V], dS = scale * P * (dP - Delta),
  Delta[t, h] = sum(dO * out) over D_V,
  dq[t, h]  = sum_j dS kv_j                                  (all D = D_V + D_R columns)
  dkv[idx[t, j]] += sum_h dS q[t, h]  +  [sum_h P dO[t, h], 0] (value grad on the first D_V)
impl="atomic" (this file's kernel): one program per (token, block of heads) recomputes S and P from
lse (no [T, heads, topk] tensor is kept), accumulates dq in registers and scatter-adds each key
block's dkv with fp32 atomics: a key picked by many tokens, or twice in one row, simply receives
several adds; -1 slots add nothing.
FLOPs (the benchmark's formula): 2 * T * heads * n_valid * (3 * (D_V + D_R) + 2 * D_V).
impl="keymajor" runs kernels/sparse_mla_bwd_keymajor.py instead (a dq kernel and a key-major dkv
kernel that owns its rows: no atomics, same results); impl="split" runs
kernels/sparse_mla_bwd_split.py (a 64-head dq kernel that also writes dS and P, then a
token-major dkv kernel of two GEMMs per key tile and v4 atomics), the default (DEFAULT_BWD_IMPL).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tuning import Autotuner, KernelConfig
from kernels.sparse_mla import LOG2E, _bucket, reference_sparse_mla, sparse_mla_forward
from kernels.sparse_mla_bwd_keymajor import keymajor_backward
from kernels.sparse_mla_bwd_rows import sparse_mla_bwd_rows_kernel
from kernels.sparse_mla_bwd_split import split_backward

# H200, 4096 tokens, 64 heads, top-2048: every tile with 64 heads or 64 keys needs 311-418 KB of
# shared memory (limit 227 KB: the transposed dS / P operands of the dkv dots are staged there).
# Measured: 32 heads x 32 keys, 8 warps, 1 stage 37.3 ms; 4 warps 2 stages 44.3; 32 x 16 48.5;
# 4 warps 1 stage 50.8; 16 x 32 54.3.
BWD_CONFIGS = [
    KernelConfig.make(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=1),
    KernelConfig.make(BLOCK_H=32, BLOCK_N=32, num_warps=4, num_stages=2),
    KernelConfig.make(BLOCK_H=32, BLOCK_N=16, num_warps=4, num_stages=2),
]
BWD_TUNER = Autotuner("sparse_mla_bwd", BWD_CONFIGS)
# atomic: this file's kernel; keymajor: sparse_mla_bwd_keymajor.py; split: sparse_mla_bwd_split.py
BWD_IMPLS = ("atomic", "keymajor", "split")
# What sparse_mla, sparse_mla_backward and the Megatron DSA switch use when not told. H200, 4096
# tokens x top-2048 of 64K, same run (bench/results/kernels.json): split 18.7 ms, atomic 37.2,
# keymajor 320; the 5-layer GLM-5.2 through the switch at 2K tokens 159.6 vs 199.6 ms.
DEFAULT_BWD_IMPL = "split"


@triton.jit
def _delta_kernel(do_ptr, out_ptr, delta_ptr, stride_dot, stride_doh, stride_ot, stride_oh, stride_lt,
                  HEADS: tl.constexpr, D_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """Delta[t, h] = sum over D_V of dO * out in fp32: one read of each (torch's fp32 product of the
    two [T, heads, 512] tensors writes and reads 3 GB more at 4096 tokens x 64 heads)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = heads < HEADS
    dv = tl.arange(0, D_V)
    do = tl.load(do_ptr + t * stride_dot + heads[:, None] * stride_doh + dv[None, :], mask=ok[:, None], other=0.0)
    o = tl.load(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dv[None, :], mask=ok[:, None], other=0.0)
    tl.store(delta_ptr + t * stride_lt + heads, tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1), mask=ok)


def _delta(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    T, heads, d_v = grad_out.shape
    out = out.contiguous()
    delta = torch.empty((T, heads), device=out.device, dtype=torch.float32)
    if T:
        bh = min(16, triton.next_power_of_2(heads))
        _delta_kernel[(T, triton.cdiv(heads, bh))](grad_out, out, delta, grad_out.stride(0), grad_out.stride(1),
                                                   out.stride(0), out.stride(1), delta.stride(0),
                                                   HEADS=heads, D_V=d_v, BLOCK_H=bh)
    return delta


def _check_impl(impl: str, name: str = "impl") -> None:
    if impl not in BWD_IMPLS:
        raise ValueError(f"{name} must be one of {BWD_IMPLS}, got {impl!r}")


def sparse_mla_backward(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, grad_out: torch.Tensor, sm_scale: float,
                        d_v: int = 512, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [T, heads, D] in q's dtype, dkv [S, D] fp32) for the forward's (out, lse); impl one of
    BWD_IMPLS (None: DEFAULT_BWD_IMPL)."""
    impl = DEFAULT_BWD_IMPL if impl is None else impl
    _check_impl(impl)
    T, heads, dim = q.shape
    if grad_out.shape != (T, heads, d_v) or out.shape != (T, heads, d_v) or lse.shape != (T, heads):
        raise ValueError(f"grad_out/out must be [T={T}, heads={heads}, d_v={d_v}] and lse [T, heads]; got "
                         f"{tuple(grad_out.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}")
    q, kv, idx = q.contiguous(), kv.contiguous(), idx.to(torch.int32).contiguous()
    grad_out, lse = grad_out.to(q.dtype).contiguous(), lse.float().contiguous()
    delta = _delta(grad_out, out)  # [T, heads]
    if impl == "keymajor":
        return keymajor_backward(q, kv, idx, grad_out, lse, delta, sm_scale, d_v)
    if impl == "split":
        return split_backward(q, kv, idx, grad_out, lse, delta, sm_scale, d_v)
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
    if T == 0:
        return dq, dkv

    def launch(cfg: KernelConfig) -> None:
        bh = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(heads)))
        dkv.zero_()  # the autotuner runs launch several times; atomics accumulate
        sparse_mla_bwd_rows_kernel[(T, triton.cdiv(heads, bh))](
            q, kv, idx, grad_out, lse, delta, dq, dkv, dq, dq, sm_scale, sm_scale * LOG2E, idx.shape[1],
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), grad_out.stride(0), grad_out.stride(1),
            lse.stride(0), dq.stride(0), dq.stride(1), dkv.stride(0), 0,
            HEADS=heads, D_V=d_v, D_R=dim - d_v, BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"], WITH_DKV=True,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    cfg = BWD_TUNER.choose((min(_bucket(T), 4096), heads, dim, idx.shape[1], q.dtype), q.device, launch)
    launch(cfg)
    return dq, dkv


def sparse_mla_bwd_flops(tokens: int, heads: int, n_valid: int, d_v: int = 512, d_r: int = 64) -> float:
    """Recompute QK^T, dP = dO V^T, dq = dS K, dK = dS^T Q (2 * d_qk each or d_v), dV = P^T dO."""
    d_qk = d_v + d_r
    return 2.0 * tokens * heads * n_valid * (3 * d_qk + 2 * d_v)


class SparseMLAFunction(torch.autograd.Function):
    """out = sparse MLA(q, kv, idx) with Triton forward and backward; idx gets no gradient."""

    @staticmethod
    def forward(ctx, q, kv, idx, sm_scale: float, d_v: int, bwd_impl: str = DEFAULT_BWD_IMPL):
        _check_impl(bwd_impl, "bwd_impl")
        out, lse = sparse_mla_forward(q, kv, idx, sm_scale, d_v)
        ctx.save_for_backward(q, kv, idx, out, lse)
        ctx.sm_scale, ctx.d_v, ctx.bwd_impl = sm_scale, d_v, bwd_impl
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, kv, idx, out, lse = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None, None
        dq, dkv = sparse_mla_backward(q, kv, idx, out, lse, grad_out, ctx.sm_scale, ctx.d_v, ctx.bwd_impl)
        return dq, dkv.to(kv.dtype), None, None, None, None


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float, d_v: int = 512,
               use_triton: bool | None = None, bwd_impl: str | None = None) -> torch.Tensor:
    """Differentiable sparse MLA: out [T, heads, d_v] (q's dtype). Gradients flow to q and kv.

    use_triton None: the Triton kernels on CUDA, the torch reference elsewhere (its autograd
    defines the gradient the kernels are tested against). True also runs Triton under
    TRITON_INTERPRET=1 on CPU (tests). bwd_impl picks the Triton backward (BWD_IMPLS; None:
    DEFAULT_BWD_IMPL)."""
    bwd_impl = DEFAULT_BWD_IMPL if bwd_impl is None else bwd_impl
    _check_impl(bwd_impl, "bwd_impl")
    if use_triton is None:
        use_triton = q.is_cuda
    if use_triton:
        return SparseMLAFunction.apply(q, kv, idx, sm_scale, d_v, bwd_impl)[0]
    return reference_sparse_mla(q, kv, idx, sm_scale, d_v)[0]
