"""Torch reference for the DSA indexer (kernels/indexer.py): scores and top-k selection.

``reference_indexer_topk`` is the plain torch path chunked over query rows (the [chunk, heads, S]
product is the memory hog, so chunks are small). ``stable=True`` selects with a stable sort,
which makes ties go to the lower index exactly like the kernel (tests); ``stable=False`` uses
``torch.topk`` and ``fast=True`` forms scores with bf16 GEMMs (cuBLAS, fp32 accumulate): the
fastest plain-torch path, which the benchmark times as the baseline (its tie order and bf16
rounding make it unfit for exact comparisons). Output format as the kernel: ascending
indices, -1 padded.
"""
from __future__ import annotations

import torch


def reference_indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                             offset: int | None = None) -> torch.Tensor:
    """[T, S] fp32 scores with -inf in the causal future (test sizes only)."""
    T, S = q.shape[0], k.shape[0]
    offset = S - T if offset is None else offset
    return _chunk_scores(q, k, w, 0, T, offset)


def _chunk_scores(q, k, w, row0, rows, offset, fast=False):
    if fast:  # [rows*heads, S] GEMM, relu, then a batched [1, heads] @ [heads, S] per row
        qc = q[row0:row0 + rows]
        dots = (qc.reshape(-1, qc.shape[-1]) @ k.t()).view(rows, qc.shape[1], -1).relu_()
        wc = w[row0:row0 + rows].to(dots.dtype)[:, None, :]
        scores = torch.bmm(wc, dots).squeeze(1).float()
    else:
        dots = torch.einsum("thd,sd->ths", q[row0:row0 + rows].float(), k.float()).relu_()
        scores = torch.einsum("ths,th->ts", dots, w[row0:row0 + rows].float())
    pos = torch.arange(row0, row0 + rows, device=q.device)[:, None] + offset
    future = torch.arange(k.shape[0], device=q.device)[None, :] > pos
    return scores.masked_fill_(future, float("-inf"))


def select_topk(scores: torch.Tensor, n_valid: torch.Tensor, topk: int, stable: bool) -> torch.Tensor:
    """Top-k columns of each row (first n_valid columns valid), ascending, -1 padded, int32."""
    kk = min(topk, scores.shape[1])
    if stable:
        idx = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :kk]
    else:
        idx = torch.topk(scores, kk, dim=1).indices
    keep = torch.arange(kk, device=scores.device)[None, :] < n_valid[:, None].clamp(max=kk)
    idx = torch.where(keep, idx, torch.full_like(idx, scores.shape[1]))
    idx = torch.sort(idx, dim=1).values
    idx = torch.where(idx == scores.shape[1], -1, idx).to(torch.int32)
    if kk < topk:
        idx = torch.cat([idx, idx.new_full((idx.shape[0], topk - kk), -1)], dim=1)
    return idx


def reference_indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int = 2048,
                           offset: int | None = None, chunk_rows: int = 256,
                           stable: bool = True, fast: bool = False) -> torch.Tensor:
    T, S = q.shape[0], k.shape[0]
    offset = S - T if offset is None else offset
    out = []
    for row0 in range(0, T, chunk_rows):
        rows = min(chunk_rows, T - row0)
        scores = _chunk_scores(q, k, w, row0, rows, offset, fast=fast)
        n_valid = (torch.arange(row0, row0 + rows, device=q.device) + offset + 1).clamp(max=S)
        out.append(select_topk(scores, n_valid, topk, stable))
    return torch.cat(out, dim=0)
