"""Fused log-probabilities (and entropies) of target tokens: Triton, forward and backward.

logits = hidden @ weight.T / temperature, with hidden [T, H], weight [V, H]; per token we need
log_softmax(logits)[target] and optionally the entropy. [T, V] is never materialised in fp32.

Forward: one program owns BLOCK_T tokens and one vocabulary split; it walks its split in BLOCK_V
tiles, each tile a bf16 GEMM over H (tl.dot, fp32 accumulate), and keeps an online max m, sum
s = sum exp(z - m), e = sum exp(z - m) * z (for entropy) and the target logit. The splits are
merged in torch ([n_splits, T] floats). Splits exist for parallelism and for L2: consecutive
programs share a token block (kept hot in L2) and stream different weight tiles, so with ~16
programs per multiprocessor the weight is read from HBM only T / (8 * BLOCK_T) times instead of
the hidden block being re-read for every vocabulary tile.

Backward (per chunk of tokens): a GEMM-shaped kernel recomputes each logits tile, turns it into
dL/dlogits in registers (softmax from the saved logsumexp), and writes it in the operand dtype;
then grad_hidden = G @ W and grad_weight += G^T @ h are two cuBLAS GEMMs. Extra memory is
O(chunk_tokens * V) in bf16, never [T, V] in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tuning import Autotuner, KernelConfig
from kernels.logprobs_torch import LogprobsOut, check_logprobs_inputs

# Hopper-friendly tiles; the first entry is also the CPU (interpreter) choice.
# H200, T=16K, V=154880, H=6144. Run 1 (plain loads): 128x256x64, 8 warps, 3 stages won both
# (fwd 56 ms = 548 TFLOP/s; bwd tile kernel 690 TFLOP/s); 128x128 tiles were 25-40% slower.
# Run 2 (TMA=1: Hopper bulk tensor copies): fwd 256x128 TMA 49.5 ms (630 TFLOP/s, entropy too),
# bwd 128x256 TMA 21.7 ms per 8192 tokens (720 TFLOP/s). Run 3: 256x256 (16 warps) crashes the
# compiler; 128x128-H tiles 50% slower. FLAT (loop-nest flattening) and WS (warp specialisation)
# are Triton 3.6 scheduling options, tried as variants. Run 4: fwd 256x128 TMA FLAT 47.9 ms
# (650 TFLOP/s, 81%); with entropy 256x128 TMA 49.3 ms; bwd 128x256 TMA WS 22.6 ms.
FWD_CONFIGS = [
    KernelConfig.make(BLOCK_T=128, BLOCK_V=128, BLOCK_H=64, TMA=0, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, TMA=0, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, TMA=1, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, TMA=1, num_warps=8, num_stages=4),
    KernelConfig.make(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, TMA=1, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, TMA=1, num_warps=8, num_stages=4),
    KernelConfig.make(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, TMA=1, num_warps=16, num_stages=3),
    KernelConfig.make(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, TMA=1, FLAT=1, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, TMA=1, FLAT=1, num_warps=8, num_stages=4),
    KernelConfig.make(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, TMA=1, WS=1, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, TMA=1, FLAT=1, num_warps=8, num_stages=3),
]
BWD_CONFIGS = [
    KernelConfig.make(BLOCK_T=128, BLOCK_V=128, BLOCK_H=64, TMA=0, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, TMA=0, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, TMA=1, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, TMA=1, num_warps=8, num_stages=4),
    KernelConfig.make(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, TMA=1, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=256, BLOCK_V=128, BLOCK_H=64, TMA=1, num_warps=8, num_stages=4),
    KernelConfig.make(BLOCK_T=128, BLOCK_V=256, BLOCK_H=64, TMA=1, WS=1, num_warps=8, num_stages=4),
]
FWD_TUNER = Autotuner("logprobs_fwd", FWD_CONFIGS)
BWD_TUNER = Autotuner("logprobs_bwd", BWD_CONFIGS)
PROGRAMS_PER_SM = 16  # see module docstring: keeps ~8 token blocks (12 MB at H=6144) hot in L2
MIN_TILES_PER_SPLIT = 4


@triton.jit
def _dot_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, offs_h, H, stride_h, stride_w, acc,
              BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr):
    """acc += hidden[rows, :] @ weight[cols, :].T with plain (masked) loads."""
    for k in range(0, H, BLOCK_H):
        hk = k + offs_h
        if EVEN_H:
            a = tl.load(h_ptr + rows[:, None] * stride_h + hk[None, :], mask=row_ok[:, None], other=0.0)
            b = tl.load(w_ptr + cols[:, None] * stride_w + hk[None, :], mask=col_ok[:, None], other=0.0)
        else:
            a = tl.load(h_ptr + rows[:, None] * stride_h + hk[None, :],
                        mask=row_ok[:, None] & (hk[None, :] < H), other=0.0)
            b = tl.load(w_ptr + cols[:, None] * stride_w + hk[None, :],
                        mask=col_ok[:, None] & (hk[None, :] < H), other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _logprobs_fwd_kernel(h_ptr, w_ptr, tgt_ptr, part_ptr, T, V, H, stride_h, stride_w, inv_temp,
                         tiles_per_split, n_splits,
                         BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                         WITH_ENT: tl.constexpr, EVEN_H: tl.constexpr, TMA: tl.constexpr,
                         FLAT: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    split = pid % n_splits
    row_start = (pid // n_splits) * BLOCK_T
    rows = row_start + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_T], tl.float32)
    e = tl.zeros([BLOCK_T], tl.float32)
    zt = tl.zeros([BLOCK_T], tl.float32)
    # Every split walks the same number of tiles (uniform loop); tiles past V are fully masked.
    if TMA:  # Hopper bulk tensor copies; out-of-bounds rows/cols arrive as zeros
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[T, H], strides=[stride_h, 1],
                                           block_shape=[BLOCK_T, BLOCK_H])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[V, H], strides=[stride_w, 1],
                                           block_shape=[BLOCK_V, BLOCK_H])
    # FLAT: let the compiler flatten the tile x K loop nest so the pipeline does not drain per tile
    for i in tl.range(0, tiles_per_split, flatten=FLAT):
        col_start = (split * tiles_per_split + i) * BLOCK_V
        cols = col_start + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        if TMA:
            for k in tl.range(0, H, BLOCK_H, warp_specialize=WS):
                acc = tl.dot(h_desc.load([row_start, k]), tl.trans(w_desc.load([col_start, k])), acc)
        else:
            acc = _dot_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, offs_h, H, stride_h, stride_w, acc,
                            BLOCK_H, EVEN_H)
        z = tl.where(col_ok[None, :], acc * inv_temp, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new[:, None])
        s = s * alpha + tl.sum(p, axis=1)
        if WITH_ENT:
            e = e * alpha + tl.sum(p * tl.where(col_ok[None, :], z, 0.0), axis=1)
        m = m_new
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    base = part_ptr + split * T + rows
    stride_part = n_splits * T
    tl.store(base, m, mask=row_ok)
    tl.store(base + stride_part, s, mask=row_ok)
    tl.store(base + 2 * stride_part, e, mask=row_ok)
    tl.store(base + 3 * stride_part, zt, mask=row_ok)


@triton.jit
def _logprobs_bwd_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, g_ptr,
                         T, V, H, stride_h, stride_w, stride_g, inv_temp,
                         BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                         GROUP_T: tl.constexpr, WITH_ENT: tl.constexpr, EVEN_H: tl.constexpr,
                         TMA: tl.constexpr, WS: tl.constexpr):
    # Grouped ordering: GROUP_T token blocks sweep the vocabulary together (L2 reuse of W tiles).
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BLOCK_T)
    n_v = tl.cdiv(V, BLOCK_V)
    group = pid // (GROUP_T * n_v)
    first_t = group * GROUP_T
    group_size = tl.minimum(n_t - first_t, GROUP_T)
    pid_t = first_t + (pid % (GROUP_T * n_v)) % group_size
    pid_v = (pid % (GROUP_T * n_v)) // group_size
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < T
    col_ok = cols < V
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    if TMA:
        h_desc = tl.make_tensor_descriptor(h_ptr, shape=[T, H], strides=[stride_h, 1],
                                           block_shape=[BLOCK_T, BLOCK_H])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[V, H], strides=[stride_w, 1],
                                           block_shape=[BLOCK_V, BLOCK_H])
        for k in tl.range(0, H, BLOCK_H, warp_specialize=WS):
            acc = tl.dot(h_desc.load([pid_t * BLOCK_T, k]), tl.trans(w_desc.load([pid_v * BLOCK_V, k])), acc)
    else:
        acc = _dot_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, offs_h, H, stride_h, stride_w, acc,
                        BLOCK_H, EVEN_H)
    z = acc * inv_temp
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
    p = tl.exp(z - lse[:, None])
    g = glp[:, None] * (tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0) - p)
    if WITH_ENT:
        # d(-sum p log p)/dz_j = -p_j (log p_j + H)
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        g -= gent[:, None] * p * (z - lse[:, None] + ent[:, None])
    g = g * inv_temp
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(g_ptr + rows[:, None] * stride_g + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=mask)


def _tma_workspace(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _use_tma(cfg: KernelConfig, *tensors: torch.Tensor) -> bool:
    """TMA configs run only on Hopper+ with 16-byte aligned rows; elsewhere they use plain loads."""
    if not dict(cfg.params).get("TMA", 0) or not tensors[0].is_cuda:
        return False
    if torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    if any(t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 for t in tensors):
        return False
    triton.set_allocator(_tma_workspace)  # in-kernel descriptors need a small global workspace
    return True


def _flag(cfg: KernelConfig, name: str, t: torch.Tensor) -> bool:
    """Compiler-scheduling options (loop flattening, warp specialisation): CUDA only."""
    return bool(dict(cfg.params).get(name, 0)) and t.is_cuda


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _forward_partials(hidden, weight, targets, inv_temp, with_ent):
    T, H = hidden.shape
    V = weight.shape[0]
    num_sms = _num_sms(hidden.device)
    holder = {}

    def launch(cfg: KernelConfig) -> None:
        bt, bv = cfg["BLOCK_T"], cfg["BLOCK_V"]
        n_t, n_vt = triton.cdiv(T, bt), triton.cdiv(V, bv)
        n_splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * num_sms, n_t), n_vt // MIN_TILES_PER_SPLIT))
        tiles_per_split = triton.cdiv(n_vt, n_splits)
        n_splits = triton.cdiv(n_vt, tiles_per_split)
        part = torch.empty((4, n_splits, T), device=hidden.device, dtype=torch.float32)
        _logprobs_fwd_kernel[(n_t * n_splits,)](
            hidden, weight, targets, part, T, V, H, hidden.stride(0), weight.stride(0), inv_temp,
            tiles_per_split, n_splits, BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=cfg["BLOCK_H"],
            WITH_ENT=with_ent, EVEN_H=(H % cfg["BLOCK_H"] == 0), TMA=_use_tma(cfg, hidden, weight),
            FLAT=_flag(cfg, "FLAT", hidden), WS=_flag(cfg, "WS", hidden), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        holder["part"] = part

    key = (T, V, H, hidden.dtype, with_ent)
    cfg = FWD_TUNER.choose(key, hidden.device, launch)
    launch(cfg)  # tuning may have left another config's partials (other split count) behind
    return holder["part"]


def _merge_partials(part: torch.Tensor):
    m, s, e, zt = part.unbind(0)
    m_max = m.max(dim=0).values
    scale = torch.exp(m - m_max)  # empty splits have m = -inf -> 0
    s_tot = (s * scale).sum(0)
    lse = m_max + torch.log(s_tot)
    logp = zt.sum(0) - lse
    entropy = lse - (e * scale).sum(0) / s_tot
    return logp, lse, entropy


def _grad_logits_chunk(h, weight, tgt, lse, ent, glp, gent, inv_temp, with_ent):
    T, H = h.shape
    V = weight.shape[0]
    g = torch.empty((T, V), device=h.device, dtype=h.dtype)

    def launch(cfg: KernelConfig) -> None:
        bt, bv = cfg["BLOCK_T"], cfg["BLOCK_V"]
        grid = (triton.cdiv(T, bt) * triton.cdiv(V, bv),)
        _logprobs_bwd_kernel[grid](
            h, weight, tgt, lse, ent, glp, gent, g, T, V, H, h.stride(0), weight.stride(0), g.stride(0),
            inv_temp, BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=cfg["BLOCK_H"], GROUP_T=8, WITH_ENT=with_ent,
            EVEN_H=(H % cfg["BLOCK_H"] == 0), TMA=_use_tma(cfg, h, weight), WS=_flag(cfg, "WS", h),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    cfg = BWD_TUNER.choose((T, V, H, h.dtype, with_ent), h.device, launch)
    launch(cfg)
    return g


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result; on CUDA cuBLAS accumulates bf16 operands in fp32 directly."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, return_entropy, bwd_chunk_tokens):
        inv_temp = 1.0 / float(temperature)
        part = _forward_partials(hidden, weight, targets, inv_temp, return_entropy)
        logp, lse, entropy = _merge_partials(part)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_temp, ctx.return_entropy, ctx.chunk = inv_temp, return_entropy, bwd_chunk_tokens
        if return_entropy:
            return logp, entropy
        return logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        with_ent = ctx.return_entropy and grad_entropy is not None
        glp = grad_logp.float().contiguous()
        gent = grad_entropy.float().contiguous() if with_ent else glp
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w32 = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            h = hidden[sl]
            g = _grad_logits_chunk(h, weight, targets[sl], lse[sl], entropy[sl], glp[sl], gent[sl],
                                   ctx.inv_temp, with_ent)
            if need_h:
                torch.mm(g, weight, out=grad_h[sl])
            if need_w:
                grad_w32 += _mm_f32(g.t(), h)
            del g
        grad_w = grad_w32.to(weight.dtype) if need_w else None
        return grad_h, grad_w, None, None, None, None


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0, return_entropy: bool = False,
                   bwd_chunk_tokens: int = 8192) -> LogprobsOut:
    """Log-probs of ``targets`` under softmax(hidden @ weight.T / temperature), fp32 [T].

    With ``return_entropy`` also returns the per-token entropy [T]. Differentiable w.r.t.
    ``hidden`` and ``weight``. Backward holds one [bwd_chunk_tokens, V] gradient tile in the
    operand dtype (8192 x 154880 bf16 = 2.5 GB) plus an fp32 weight-gradient accumulator.
    """
    check_logprobs_inputs(hidden, weight, targets, temperature)
    if bwd_chunk_tokens < 1:
        raise ValueError(f"bwd_chunk_tokens must be >= 1, got {bwd_chunk_tokens}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return (empty, empty.clone()) if return_entropy else empty
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(f"targets must lie in [0, vocab={weight.shape[0]}); got "
                         f"min {int(targets.min())}, max {int(targets.max())}")
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    return FusedLogprobs.apply(hidden, weight, targets.contiguous(), float(temperature),
                               bool(return_entropy), int(bwd_chunk_tokens))
