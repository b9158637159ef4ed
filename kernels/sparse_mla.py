"""Sparse MLA attention forward over DSA top-k indices, absorbed (MQA) form.

q [T, heads, D_V + D_R] (GLM-5.2: 64 heads, 512 latent + 64 rope = 576), kv [S, D_V + D_R] one
shared latent per token (its first D_V columns are also the value), idx [T, topk] int32 with -1
for unused slots. out[t, h] = softmax_j(scale * q[t,h] . kv[idx[t,j]]) @ kv[idx[t,j], :D_V].

One program per (token, block of heads): all heads of a token share one gathered KV tile, so
a [BLOCK_N, 576] gather feeds BLOCK_H x BLOCK_N x 1088 MACs; online softmax in base 2.
Also returns the natural-log logsumexp [T, heads] (what a backward pass would need).
FLOPs (the benchmark's formula): 2 * T * heads * n_valid * (D_V + D_R + D_V).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import sparse_mla_gluon, sparse_mla_gluon_pair
from kernels._tuning import Autotuner, KernelConfig

# H200, 4096 tokens, 64 heads, top-2048 (ms at 64K / 8K context), three rounds of configs:
# 64 heads x 64 keys, 8 warps, 2 stages 4.66 / 4.27; the same warp-specialised 4.68 / 4.22;
# 32 heads x 64 keys, 4 warps 4.87 / 4.69; 3 stages 4.98 / 4.82; 1 stage 6.09 / 5.62; 32-key tiles
# 6.6-7.9; 16 warps 10.3-16.4; 4 warps with 64 heads 13.8 (the [64, 512] fp32 accumulator spills).
# Only the competitive ones stay: every config costs a compile and a timing per tuning key.
CONFIGS = [
    KernelConfig.make(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2),
    KernelConfig.make(BLOCK_H=64, BLOCK_N=64, WS=1, num_warps=8, num_stages=2),
    KernelConfig.make(BLOCK_H=32, BLOCK_N=64, num_warps=4, num_stages=2),
    KernelConfig.make(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=3),
]
TUNER = Autotuner("sparse_mla_fwd", CONFIGS)
LOG2E = 1.4426950408889634


@triton.jit
def _sparse_mla_fwd_kernel(q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, scale_log2, n_idx,
                           stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_lt,
                           HEADS: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < HEADS
    dv = tl.arange(0, D_V)
    dr = tl.arange(0, D_R)
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + dv[None, :], mask=head_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + D_V + dr[None, :], mask=head_ok[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    for start in tl.range(0, n_idx, BLOCK_N, warp_specialize=WS):
        j = start + tl.arange(0, BLOCK_N)
        ids = tl.load(idx_ptr + t * stride_it + j, mask=j < n_idx, other=-1)
        valid = ids >= 0
        rows = kv_ptr + tl.where(valid, ids, 0).to(tl.int64)[:, None] * stride_kv
        kv_nope = tl.load(rows + dv[None, :], mask=valid[:, None], other=0.0)
        kv_rope = tl.load(rows + D_V + dr[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q_nope, tl.trans(kv_nope))
        s = tl.dot(q_rope, tl.trans(kv_rope), s)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid key yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv_nope.dtype), kv_nope)
        m = m_new
    l_safe = tl.where(denom > 0, denom, 1.0)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    lse = tl.where(denom > 0, (m + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + t * stride_lt + heads, lse, mask=head_ok)


def _bucket(n: int) -> int:
    """Tuning key of a size: its power-of-two ceiling (varying packed lengths reuse one tuning)."""
    return 1 << max(int(n) - 1, 0).bit_length()


# "gluon": kernels/sparse_mla_gluon.py (bf16, 512 + 64 columns, sm_90 only; 1.51x the Triton kernel on an
# H100); "pair": kernels/sparse_mla_gluon_pair.py (the same shapes and machines, the two consumer warpgroups on
# alternate tiles); "triton": the kernel above (any power-of-two split, any CUDA GPU, the interpreter on CPU).
FWD_IMPLS = ("gluon", "pair", "triton")
GLUON_FWD_IMPLS = ("gluon", "pair")  # what gluon_runs gates
# The Gluon kernel a default launch takes where gluon_runs: the paired one, at every context. 4096 tokens x top-2048:
# on the H200 (bench/results/kernels.json and sparse_mla_gluon_gpu.json run 6, session 25) with 8K keys (latents in
# L2) 2.69-2.76 ms against 2.90-2.96 for the in-order kernel, with 64K keys 2.96-3.01 against 3.01-3.06; on an H100
# 8K 1.05-1.12x, 64K 0.97-1.03x over four runs (runs 4-5, kernels_fwd_h100.json).
DEFAULT_GLUON_FWD = "pair"


def gluon_runs(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """Whether the Gluon kernels are the ones to take: where they run (sparse_mla_gluon.supports) and no head
    rows are padded (they compute 64 heads a program, one wgmma M, so 16 heads a rank, GLM-5.2 at TP4, would
    cost them 4x, where the Triton kernel takes 16-head blocks)."""
    return q.shape[1] % sparse_mla_gluon.BLOCK_H == 0 and sparse_mla_gluon.supports(q, kv, d_v)


def default_forward_impl(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> str:
    """The FWD_IMPLS entry sparse_mla_forward takes when none is named: DEFAULT_GLUON_FWD where gluon_runs, else
    "triton"."""
    return DEFAULT_GLUON_FWD if gluon_runs(q, kv, d_v) else "triton"


def sparse_mla_forward(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float,
                       d_v: int = 512, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [T, heads, d_v] in q's dtype, lse [T, heads] fp32, natural log).

    Rows whose indices are all -1 give out = 0 and lse = -inf. impl: one of FWD_IMPLS; None:
    default_forward_impl's choice.
    """
    if impl not in (None, *FWD_IMPLS):
        raise ValueError(f"impl must be one of {FWD_IMPLS} or None, got {impl!r}")
    if q.dim() != 3 or kv.dim() != 2 or q.shape[2] != kv.shape[1]:
        raise ValueError(f"q must be [T, heads, D] and kv [S, D] with equal D; got q "
                         f"{tuple(q.shape)}, kv {tuple(kv.shape)}")
    T, heads, dim = q.shape
    d_r = dim - d_v
    if d_v <= 0 or d_r <= 0 or d_v & (d_v - 1) or d_r & (d_r - 1) or min(d_v, d_r) < 16:
        raise ValueError(f"need D = d_v + d_rope with both powers of two >= 16; got D={dim}, d_v={d_v}")
    if idx.dim() != 2 or idx.shape[0] != T:
        raise ValueError(f"idx must be [T={T}, topk], got shape {tuple(idx.shape)}")
    if q.dtype != kv.dtype:
        raise ValueError(f"q ({q.dtype}) and kv ({kv.dtype}) must share a dtype")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    impl = impl or default_forward_impl(q, kv, d_v)
    if impl == "gluon":
        return sparse_mla_gluon.sparse_mla_forward_gluon(q, kv, idx, sm_scale, d_v)
    if impl == "pair":
        return sparse_mla_gluon_pair.sparse_mla_forward_pair(q, kv, idx, sm_scale, d_v)
    q, kv, idx = q.contiguous(), kv.contiguous(), idx.to(torch.int32).contiguous()
    out = torch.empty((T, heads, d_v), device=q.device, dtype=q.dtype)
    lse = torch.empty((T, heads), device=q.device, dtype=torch.float32)
    if T == 0:
        return out, lse

    def launch(cfg: KernelConfig) -> None:
        bh = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(heads)))
        grid = (T, triton.cdiv(heads, bh))
        _sparse_mla_fwd_kernel[grid](
            q, kv, idx, out, lse, sm_scale * LOG2E, idx.shape[1], q.stride(0), q.stride(1),
            kv.stride(0), idx.stride(0), out.stride(0), out.stride(1), lse.stride(0),
            HEADS=heads, D_V=d_v, D_R=d_r, BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"],
            WS=bool(dict(cfg.params).get("WS", 0)) and q.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    cfg = TUNER.choose((min(_bucket(T), 4096), heads, dim, idx.shape[1], q.dtype), q.device, launch)
    launch(cfg)
    return out, lse


def reference_sparse_mla(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sm_scale: float,
                         d_v: int = 512, chunk_tokens: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch definition (fp32 math, gathered per chunk of tokens); same outputs as the kernel."""
    outs, lses = [], []
    for start in range(0, q.shape[0], chunk_tokens):
        ids = idx[start:start + chunk_tokens].long()
        valid = ids >= 0
        kvg = kv[ids.clamp(min=0)].float()  # [t, k, D]
        s = torch.einsum("thd,tkd->thk", q[start:start + chunk_tokens].float(), kvg) * sm_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append(torch.einsum("thk,tkd->thd", p, kvg[..., :d_v]).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def sparse_mla_flops(tokens: int, heads: int, n_valid: int, d_v: int = 512, d_r: int = 64) -> float:
    """QK^T (2 * d_qk) plus PV (2 * d_v) multiply-adds per (token, head, key)."""
    return 2.0 * tokens * heads * n_valid * (d_v + d_r + d_v)


def default_sm_scale(d_qk_head: int = 256) -> float:
    """GLM-5.2 scales by the un-absorbed q/k head width (qk_nope 192 + rope 64 = 256)."""
    return 1.0 / math.sqrt(d_qk_head)
