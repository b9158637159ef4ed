"""DSA indexer: causal scores I[t,s] = sum_h w[t,h] * relu(q[t,h] . k[s]) and per-row top-k.

Never writes the full [T, S] score matrix: rows are processed in chunks of ``chunk_rows``.
For each chunk, (1) a GEMM-shaped kernel writes the causal part of the chunk's scores (fp32),
k tile loaded once per program and reused by all indexer heads; tiles wholly above the diagonal
exit at once; (2) one program per row selects the top-k by radix select (kernels/topk.py).
Each row's scores (<= 512 KB at 128K context) stay in L2 across the select's passes.

Output: int32 [T, topk]; row t holds min(topk, t + offset + 1) selected key indices in ascending
order followed by -1. Ties at the threshold go to the lower index (deterministic).
``impl="fused"`` (kernels/indexer_fused.py) gives the same output without writing the score rows:
per-row sampled thresholds, survivors written by the scoring kernel, one exact select over them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._tuning import Autotuner, KernelConfig
from kernels.indexer_fused import SCORE_CONFIGS, indexer_topk_fused, score_tile
from kernels.topk import EXPERIMENTAL_TOPK_CONFIGS, TOPK_CONFIGS, TOPK_TUNER, _bucket, topk_rows_chunk
from kernels.topk_filter import SelectPipeline

__all__ = ["EXPERIMENTAL_TOPK_CONFIGS", "INDEXER_IMPLS", "TOPK_CONFIGS", "TOPK_TUNER", "indexer_scores_chunk",
           "indexer_topk", "topk_rows_chunk"]

# "scores": write each chunk's fp32 score rows, then the tuned select (the default, timed on the H200);
# "fused": never write them (kernels/indexer_fused.py; not yet timed on the GPU).
INDEXER_IMPLS = ("scores", "fused")

SCORE_TUNER = Autotuner("indexer_score", SCORE_CONFIGS)


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
        kt = tl.load(k_ptr + cols[:, None] * stride_kt + tl.arange(0, D)[None, :], mask=col_ok[:, None], other=0.0)
        acc = score_tile(q_ptr, w_ptr, kt, rows, row_ok, stride_qt, stride_qh, stride_wt, HEADS, D, BLOCK_T, BLOCK_S)
        causal = cols[None, :] <= (rows + offset)[:, None]
        mask = row_ok[:, None] & col_ok[None, :] & causal
        tl.store(out_ptr + local[:, None] * stride_o + cols[None, :], acc, mask=mask)


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

    cfg = SCORE_TUNER.choose((_bucket(rows), _bucket(S), heads, dim, q.dtype), q.device, launch)
    launch(cfg)


def indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int = 2048,
                 offset: int | None = None, chunk_rows: int = 4096, impl: str = "scores") -> torch.Tensor:
    """Indices [T, topk] (int32, -1 padded) of the top-k causal indexer scores per query.

    q [T, heads, dim], k [S, dim] (same dtype, bf16 on GPU), w [T, heads] (scales folded in).
    Query t sits at key position t + offset (default offset = S - T: queries are the last T
    keys). Peak extra memory: chunk_rows * S * 4 bytes (4096 x 64K = 1 GiB), plus the filter top-k's
    candidate lists of two chunks (topk_filter.SelectPipeline, for the selects on a stream of their
    own: chunk_rows * 4096 * 8 bytes each, 128 MiB at 4096 rows); with impl="fused"
    chunk_rows * (CAP * 8 + SAMPLES * 4) bytes (4096 rows: 288 MiB), the same output.
    """
    if impl not in INDEXER_IMPLS:
        raise ValueError(f"impl must be one of {INDEXER_IMPLS}, got {impl!r}")
    _check(q, k, w, topk)
    T, S = q.shape[0], k.shape[0]
    offset = S - T if offset is None else int(offset)
    if offset < 0:
        raise ValueError(f"offset must be >= 0 (queries cannot precede the keys), got {offset}")
    q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
    if impl == "fused":
        return indexer_topk_fused(q, k, w, topk, offset, chunk_rows)
    out = torch.empty((T, topk), device=q.device, dtype=torch.int32)
    chunk_rows = max(1, min(chunk_rows, T))
    scores = torch.empty((chunk_rows, S), device=q.device, dtype=torch.float32)
    pipeline = select_pipeline(q.device)
    # Last chunk first: its rows are the longest, so that is what the autotuner times.
    for row0 in reversed(range(0, T, chunk_rows)):
        rows = min(chunk_rows, T - row0)
        indexer_scores_chunk(q, k, w, row0, rows, offset, scores)
        topk_rows_chunk(scores, row0, rows, offset, S, topk, out, pipeline=pipeline)
    if pipeline is not None:
        pipeline.join(q.device)
    return out


_SELECT_STREAMS: dict = {}


def select_pipeline(device: torch.device):
    """A topk_filter.SelectPipeline for one run of chunks: the top-k's selects on a stream of their own
    (one per CUDA device, made once) beside the next chunk's scoring and filtering; None off CUDA."""
    if device.type != "cuda":
        return None
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SELECT_STREAMS:
        _SELECT_STREAMS[key] = torch.cuda.Stream(device=key)
    return SelectPipeline(_SELECT_STREAMS[key])
