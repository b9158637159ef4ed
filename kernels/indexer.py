"""DSA indexer: causal scores I[t,s] = sum_h w[t,h] * relu(q[t,h] . k[s]) and per-row top-k.

Never writes the full [T, S] score matrix: rows are processed in chunks of ``chunk_rows``.
For each chunk, (1) a GEMM-shaped kernel writes the causal part of the chunk's scores (fp32),
k tile loaded once per program and reused by all indexer heads; tiles wholly above the diagonal
exit at once; (2) one program per row selects the top-k with a radix select on the scores'
order-preserving uint32 keys (ceil(32 / RADIX_BITS) histogram passes find the exact k-th key,
then one pass emits indices in ascending order). Each row's scores (<= 512 KB at 128K context)
stay in L2 across the four passes, so HBM sees them about once.

Output: int32 [T, topk]; row t holds min(topk, t + offset + 1) selected key indices in ascending
order followed by -1. Ties at the threshold go to the lower index (deterministic).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tuning import Autotuner, KernelConfig

SCORE_CONFIGS = [
    KernelConfig.make(BLOCK_T=64, BLOCK_S=128, num_warps=4, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_S=128, num_warps=8, num_stages=3),
    KernelConfig.make(BLOCK_T=128, BLOCK_S=64, num_warps=4, num_stages=4),
    KernelConfig.make(BLOCK_T=64, BLOCK_S=256, num_warps=8, num_stages=3),
]
# RADIX_BITS trades passes (ceil(32 / bits) + 1 over the row) against histogram cost per element.
# H200 run 2, 4096 rows of a 64K context: 6 bits / 1024 / 4 warps 5.36 ms, 8 bits 6.2 ms,
# 8 bits / 512 5.4 ms, 4 bits 6.4 ms, 11 bits 33.7 ms (tl.histogram cost grows with the bins).
TOPK_CONFIGS = [
    KernelConfig.make(BLOCK=1024, RADIX_BITS=8, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=1024, RADIX_BITS=6, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=512, RADIX_BITS=6, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=512, RADIX_BITS=6, num_warps=2, num_stages=1),
    KernelConfig.make(BLOCK=1024, RADIX_BITS=5, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=512, RADIX_BITS=7, num_warps=4, num_stages=1),
    KernelConfig.make(BLOCK=2048, RADIX_BITS=6, num_warps=8, num_stages=1),
]
SCORE_TUNER = Autotuner("indexer_score", SCORE_CONFIGS)
TOPK_TUNER = Autotuner("indexer_topk", TOPK_CONFIGS)


@triton.jit
def _indexer_score_kernel(q_ptr, k_ptr, w_ptr, out_ptr, S, rows_in_chunk, row0, offset,
                          stride_qt, stride_qh, stride_kt, stride_wt, stride_o,
                          HEADS: tl.constexpr, D: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_t = tl.program_id(1)
    local = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = row0 + local
    row_ok = local < rows_in_chunk
    last_pos = row0 + offset + tl.minimum((pid_t + 1) * BLOCK_T, rows_in_chunk) - 1
    if pid_s * BLOCK_S <= last_pos:  # else the whole tile is in the causal future
        cols = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        col_ok = cols < S
        d = tl.arange(0, D)
        kt = tl.load(k_ptr + cols[:, None] * stride_kt + d[None, :], mask=col_ok[:, None], other=0.0)
        acc = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
        for h in range(HEADS):
            q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                        mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr + rows * stride_wt + h, mask=row_ok, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(kt))
            acc += tl.maximum(s, 0.0) * w[:, None]
        causal = cols[None, :] <= (rows + offset)[:, None]
        mask = row_ok[:, None] & col_ok[None, :] & causal
        tl.store(out_ptr + local[:, None] * stride_o + cols[None, :], acc, mask=mask)


@triton.jit
def _ordered_key(x):
    # fp32 -> uint32 whose unsigned order is the float order (negatives flipped).
    bits = x.to(tl.uint32, bitcast=True)
    sign_bit = tl.full([], 0x80000000, tl.uint32)
    all_ones = tl.full([], 0xFFFFFFFF, tl.uint32)
    return tl.where((bits & sign_bit) != 0, bits ^ all_ones, bits | sign_bit)


@triton.jit
def _radix_pass(row_ptr, n, prefix, prefix_mask, remaining, shift, digit_mask,
                RADIX_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram one digit of the keys that match ``prefix``; pick the digit holding the k-th."""
    NB: tl.constexpr = 1 << RADIX_BITS
    hist = tl.zeros([NB], tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < n
        key = _ordered_key(tl.load(row_ptr + idx, mask=ok, other=0.0))
        match = ok & ((key & prefix_mask) == prefix)
        digit = ((key >> shift) & digit_mask).to(tl.int32)
        hist += tl.histogram(digit, NB, mask=match)
    bins = tl.arange(0, NB)
    at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= bin
    chosen = tl.max(tl.where(at_or_above >= remaining, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
    prefix = prefix | (chosen.to(tl.uint32) << shift)
    prefix_mask = prefix_mask | (digit_mask << shift)
    return prefix, prefix_mask, remaining - above


@triton.jit
def _topk_rows_kernel(score_ptr, out_ptr, shift_ptr, dmask_ptr, row0, offset, S, stride_s, stride_o,
                      K: tl.constexpr, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, N_PASSES: tl.constexpr):
    r = tl.program_id(0)
    n = tl.minimum(row0 + r + offset + 1, S)  # valid (causal) keys of this row
    row_ptr = score_ptr + r.to(tl.int64) * stride_s
    out_row = out_ptr + (row0 + r).to(tl.int64) * stride_o
    if n <= K:
        for start in range(0, K, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            tl.store(out_row + idx, tl.where(idx < n, idx, -1), mask=idx < K)
    else:
        prefix = tl.zeros([], tl.uint32)
        pmask = tl.zeros([], tl.uint32)
        remaining = tl.full([], K, tl.int32)
        for p in tl.static_range(N_PASSES):  # most significant digit first
            shift = tl.load(shift_ptr + p)
            dmask = tl.load(dmask_ptr + p)
            prefix, pmask, remaining = _radix_pass(row_ptr, n, prefix, pmask, remaining, shift, dmask,
                                                   RADIX_BITS, BLOCK)
        # prefix is now the k-th largest key; take every key above it and the first
        # `remaining` keys equal to it, in index order.
        written = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        for start in range(0, n, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            ok = idx < n
            key = _ordered_key(tl.load(row_ptr + idx, mask=ok, other=0.0))
            eq = ok & (key == prefix)
            tie_rank = ties + tl.cumsum(eq.to(tl.int32), axis=0)
            take = (ok & (key > prefix)) | (eq & (tie_rank <= remaining))
            take_i = take.to(tl.int32)
            pos = written + tl.cumsum(take_i, axis=0) - 1
            tl.store(out_row + pos, idx, mask=take)
            written += tl.sum(take_i, axis=0)
            ties += tl.sum(eq.to(tl.int32), axis=0)


def _radix_schedule(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pass shift and digit mask over the 32-bit key, most significant digit first."""
    shifts, masks = [], []
    hi = 32
    while hi > 0:
        lo = max(hi - bits, 0)
        shifts.append(lo)
        masks.append((1 << (hi - lo)) - 1)
        hi = lo
    return (torch.tensor(shifts, dtype=torch.int32, device=device),
            torch.tensor(masks, dtype=torch.int64, device=device).to(torch.uint32))


def _check(q, k, w, topk):
    if q.dim() != 3:
        raise ValueError(f"q must be [T, heads, dim], got shape {tuple(q.shape)}")
    T, heads, dim = q.shape
    if k.dim() != 2 or k.shape[1] != dim:
        raise ValueError(f"k must be [S, dim={dim}], got shape {tuple(k.shape)}")
    if w.shape != (T, heads):
        raise ValueError(f"w must be [T={T}, heads={heads}], got shape {tuple(w.shape)}")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"head dim must be a power of two >= 16 (tl.dot), got {dim}")
    if topk < 1 or topk & (topk - 1):
        raise ValueError(f"topk must be a power of two >= 1, got {topk}")
    if q.dtype != k.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a dtype")


def indexer_scores_chunk(q, k, w, row0, rows, offset, out):
    """Write causal scores of query rows [row0, row0+rows) into out[:rows, :] (fp32)."""
    _, heads, dim = q.shape
    S = k.shape[0]

    def launch(cfg: KernelConfig) -> None:
        bt, bs = cfg["BLOCK_T"], cfg["BLOCK_S"]
        grid = (triton.cdiv(S, bs), triton.cdiv(rows, bt))
        _indexer_score_kernel[grid](
            q, k, w, out, S, rows, row0, offset, q.stride(0), q.stride(1), k.stride(0), w.stride(0),
            out.stride(0), HEADS=heads, D=dim, BLOCK_T=bt, BLOCK_S=bs,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    cfg = SCORE_TUNER.choose((rows, S, heads, dim, q.dtype), q.device, launch)
    launch(cfg)


def topk_rows_chunk(scores, row0, rows, offset, S, topk, out, config: KernelConfig | None = None):
    """Top-k of each causal row of ``scores`` (chunk rows [row0, row0+rows)) into out[row0:...].

    ``config`` forces one variant (tests); by default the autotuner picks it."""
    def launch(cfg: KernelConfig) -> None:
        shifts, masks = _radix_schedule(cfg["RADIX_BITS"], scores.device)
        _topk_rows_kernel[(rows,)](scores, out, shifts, masks, row0, offset, S, scores.stride(0), out.stride(0),
                                   K=topk, BLOCK=cfg["BLOCK"], RADIX_BITS=cfg["RADIX_BITS"],
                                   N_PASSES=shifts.numel(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    cfg = config or TOPK_TUNER.choose((rows, S, topk), scores.device, launch)
    launch(cfg)


def indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int = 2048,
                 offset: int | None = None, chunk_rows: int = 4096) -> torch.Tensor:
    """Indices [T, topk] (int32, -1 padded) of the top-k causal indexer scores per query.

    q [T, heads, dim], k [S, dim] (same dtype, bf16 on GPU), w [T, heads] (scales folded in).
    Query t sits at key position t + offset (default offset = S - T: queries are the last T
    keys). Peak extra memory: chunk_rows * S * 4 bytes (4096 x 64K = 1 GiB).
    """
    _check(q, k, w, topk)
    T, S = q.shape[0], k.shape[0]
    offset = S - T if offset is None else int(offset)
    if offset < 0:
        raise ValueError(f"offset must be >= 0 (queries cannot precede the keys), got {offset}")
    q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
    out = torch.empty((T, topk), device=q.device, dtype=torch.int32)
    chunk_rows = max(1, min(chunk_rows, T))
    scores = torch.empty((chunk_rows, S), device=q.device, dtype=torch.float32)
    # Last chunk first: its rows are the longest, so that is what the autotuner times.
    for row0 in reversed(range(0, T, chunk_rows)):
        rows = min(chunk_rows, T - row0)
        indexer_scores_chunk(q, k, w, row0, rows, offset, scores)
        topk_rows_chunk(scores, row0, rows, offset, S, topk, out)
    return out
