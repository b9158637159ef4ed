"""Route Megatron 0.19.2's DSA core attention through agentrl's kernels (train.dsa_kernels).

Megatron's `DSAttention.forward` (no fused backend configured, no indexer loss) computes the top-k
with `dsa.fused_qk_topk_naive` (a dense [b, sq, sk] fp32 score matrix, then `torch.topk`) and the
attention with `dsa._run_sparse_attention` -> `_unfused_absorbed_dsa_fn` (a dense [b, heads, sq, sk]
fp32 score matrix masked down to the top-k). `apply_dsa_kernels(model)` keeps Megatron's forward
(layouts, index sharing between layers, CP/SP handling) and swaps only those two computations for
kernels/indexer.py's chunked scoring + radix top-k and kernels/sparse_mla_bwd.py's sparse MLA
(Triton forward and backward on CUDA; their torch references elsewhere).

How: each switched DSAttention gets a forward that runs Megatron's own forward inside a context
naming that layer's `DsaKernelState`; the two dsa-module functions are replaced, once per
process, by dispatchers that use the kernels only inside such a context and only for inputs they
support (absorbed MLA; packed THD causal segments or no mask; identity key positions; relu
scoring; power-of-two top-k), and call Megatron's originals otherwise. Unswitched models are
unaffected. Each state counts kernel calls and fallbacks, so a run can see what ran.

Context parallelism and TP sequence parallelism: the local query rows are chunks of their
sequences (CP's zigzag chunks, a TP rank's row shard) against keys gathered over the group; each
chunk is a run of consecutive positions at an offset into its sequence's keys, and the indexer
kernel takes that offset (kernels/indexer.py), instead of the fallback to Megatron's dense scorer
(its per-head fp32 scores [sq, heads, sk]: 8K local queries x 32 heads x 32K keys at CP4 = 34 GB
per computing layer).
The sparse attention needs nothing more: its indices already point into the gathered keys.
"""

from __future__ import annotations

import contextvars
import itertools
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

_ACTIVE: contextvars.ContextVar[DsaKernelState | None] = contextvars.ContextVar("agentrl_dsa_kernels", default=None)
_ORIGINALS: dict[str, Any] = {}


@dataclass
class DsaKernelState:
    """Per switched layer: which implementation to use and what ran."""

    use_triton: bool | None = None  # None: Triton on CUDA tensors, the torch references elsewhere
    bwd_impl: str | None = None  # the sparse MLA backward (kernels.sparse_mla_bwd.BWD_IMPLS); None: its default
    # offset_runs: top-k calls whose query rows sit at an offset into the keys (CP / SP chunks)
    calls: dict[str, int] = field(default_factory=lambda: {"topk": 0, "attention": 0, "fallback": 0,
                                                           "offset_runs": 0})
    fallback_reasons: set[str] = field(default_factory=set)

    def triton_for(self, t: torch.Tensor) -> bool:
        return t.is_cuda if self.use_triton is None else self.use_triton

    def fallback(self, reason: str) -> None:
        self.calls["fallback"] += 1
        self.fallback_reasons.add(reason)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _query_runs(sq: int, sk: int, mask, starts, ends, key_positions) -> list[tuple[int, int, int, int]] | str:
    """[(row_start, row_end, key_start, offset)] covering the sq query rows, or why they do not exist.

    A run is a stretch of rows at consecutive positions of one sequence: row r of it attends keys
    key_start .. key_start + offset + (r - row_start), i.e. the run's queries sit `offset` keys into
    their sequence's keys. Without CP or sequence parallelism every packed sequence is one run with
    offset 0; under CP (zigzag chunks against the all-gathered keys) or TP sequence parallelism
    (a row shard against the TP-gathered keys) the local rows are chunks at offsets."""
    if key_positions is not None:
        return "explicit key positions"
    if starts is None:
        if mask is not None:
            return "additive mask"
        return [(0, sq, 0, 0)] if sq == sk else f"sq={sq} != sk={sk} without varlen bounds"
    if ends is None or starts.numel() != sq or ends.numel() != sq:
        return "varlen bounds do not cover the rows"
    if sq == 0:
        return []
    starts, pos = starts.to(torch.int64), ends.to(torch.int64) - 1
    if bool((pos < starts).any()) or int(pos.max()) >= sk:
        return "varlen bounds are not causal within the keys"
    cut = torch.nonzero((starts[1:] != starts[:-1]) | (pos[1:] != pos[:-1] + 1)).flatten().add(1).tolist()
    bounds = [0, *cut, sq]
    s_list, p_list = starts.tolist(), pos.tolist()
    return [(a, b, s_list[a], p_list[a] - s_list[a]) for a, b in itertools.pairwise(bounds)]


def _topk_run(state: DsaKernelState, q, k, w, topk: int, offset: int) -> torch.Tensor:
    """[n, topk] int64 causal top-k of one run (indices into `k`, -1 padded)."""
    if state.triton_for(q):
        from kernels.indexer import indexer_topk
        kd = k.to(q.dtype)
        return indexer_topk(q.contiguous(), kd.contiguous(), w.float().contiguous(), topk, offset=offset).long()
    from kernels.indexer_torch import reference_indexer_topk
    return reference_indexer_topk(q, k, w, topk, offset=offset, chunk_rows=256, stable=True).long()


def _kernel_qk_topk(q, k, weights, index_topk, mask=None, varlen_starts=None, varlen_ends=None,
                    key_positions=None, use_relu=True):
    """Drop-in for dsa.fused_qk_topk_naive: (None, topk [b, sq, topk] int64, -1 padded)."""
    state = _ACTIVE.get()
    original = _ORIGINALS["fused_qk_topk_naive"]
    args = (q, k, weights, index_topk)
    kwargs = {"mask": mask, "varlen_starts": varlen_starts, "varlen_ends": varlen_ends,
              "key_positions": key_positions, "use_relu": use_relu}
    if state is None:
        return original(*args, **kwargs)
    sq, b = q.shape[0], q.shape[1]
    runs = _query_runs(sq, k.shape[0], mask, varlen_starts, varlen_ends, key_positions)
    reason = ("relu scoring off" if not use_relu else f"index_topk {index_topk} not a power of two"
              if not _pow2(index_topk) else f"indexer head dim {q.shape[-1]} not a power of two >= 16"
              if not (_pow2(q.shape[-1]) and q.shape[-1] >= 16) else None)
    if isinstance(runs, str) or reason:
        state.fallback(reason or runs)
        return original(*args, **kwargs)
    state.calls["topk"] += 1
    if any(offset for *_, offset in runs):
        state.calls["offset_runs"] += 1
    out = torch.full((b, sq, index_topk), -1, dtype=torch.int64, device=q.device)
    for bi in range(b):
        for r0, r1, k0, offset in runs:
            local = _topk_run(state, q[r0:r1, bi], k[k0:k0 + offset + (r1 - r0), bi], weights[r0:r1, bi],
                              index_topk, offset)
            out[bi, r0:r1] = torch.where(local >= 0, local + k0, local)
    return None, out


def _padded_rope(x: torch.Tensor, d_v: int) -> torch.Tensor:
    """Zero-pad the rope part of [..., d_v + d_r] to a power of two >= 16 (tl.dot needs K >= 16).
    Zero columns add nothing to q.k, and their gradients are cut off again by the slice."""
    d_r = x.shape[-1] - d_v
    want = max(16, 1 << (d_r - 1).bit_length())
    return x if want == d_r else F.pad(x, (0, want - d_r))


def _kernel_sparse_attention(*, absorbed_mla, query, key, value, up_v_weight, topk_indices, softmax_scale,
                             config, mask, varlen_starts, varlen_ends, key_positions, topk_length=None):
    """Drop-in for dsa._run_sparse_attention (absorbed path): [sq, b, heads * v_head_dim]."""
    state = _ACTIVE.get()
    original = _ORIGINALS["_run_sparse_attention"]
    kwargs = {"absorbed_mla": absorbed_mla, "query": query, "key": key, "value": value,
              "up_v_weight": up_v_weight, "topk_indices": topk_indices, "softmax_scale": softmax_scale,
              "config": config, "mask": mask, "varlen_starts": varlen_starts, "varlen_ends": varlen_ends,
              "key_positions": key_positions, "topk_length": topk_length}
    if state is None:
        return original(**kwargs)
    d_v = int(getattr(config, "kv_lora_rank", 0) or 0)
    reason = ("not the absorbed layout" if not absorbed_mla or up_v_weight is None or value is not None
              else "top-k given as lengths" if topk_length is not None
              else f"kv_lora_rank {d_v} not a power of two >= 16" if not (_pow2(d_v) and d_v >= 16) else None)
    if reason:
        state.fallback(reason)
        return original(**kwargs)
    # Validity: every index comes from a causal top-k of the same mask (-1 where none), so the
    # kernels need no mask; Megatron's path re-applies it to a dense matrix.
    from kernels.sparse_mla_bwd import sparse_mla

    state.calls["attention"] += 1
    triton = state.triton_for(query)
    outs = []
    for bi in range(query.shape[1]):
        q, kv = query[:, bi], key[:, bi, 0]
        if triton:
            q, kv = _padded_rope(q, d_v), _padded_rope(kv, d_v)
        outs.append(sparse_mla(q, kv, topk_indices[bi].to(torch.int32), softmax_scale, d_v, use_triton=triton,
                               bwd_impl=state.bwd_impl))
    output = torch.stack(outs, dim=1)  # [sq, b, heads, d_v]
    output = torch.einsum("sbhc,hdc->sbhd", output, up_v_weight).contiguous()
    return output.view(output.size(0), output.size(1), -1)


def _install_dispatchers() -> None:
    """Replace the two dsa functions by the dispatchers, once per process (idempotent)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    if _ORIGINALS:
        return
    _ORIGINALS["fused_qk_topk_naive"] = dsa.fused_qk_topk_naive
    _ORIGINALS["_run_sparse_attention"] = dsa._run_sparse_attention
    dsa.fused_qk_topk_naive = _kernel_qk_topk
    dsa._run_sparse_attention = _kernel_sparse_attention


def _switched_forward(self, *args, **kwargs):
    token = _ACTIVE.set(self._agentrl_dsa_kernels)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _ACTIVE.reset(token)


def apply_dsa_kernels(model: torch.nn.Module, use_triton: bool | None = None, bwd_impl: str | None = None) -> int:
    """Switch every DSAttention of `model` to the kernels; returns how many layers were switched.

    Idempotent (a layer already switched is counted, not wrapped twice). use_triton None: Triton
    on CUDA tensors, torch references on CPU; True forces Triton (TRITON_INTERPRET=1 on CPU).
    bwd_impl picks the sparse MLA backward (None: kernels.sparse_mla_bwd.DEFAULT_BWD_IMPL); calling
    again with another one switches the layers already switched to it."""
    from kernels.sparse_mla_bwd import BWD_IMPLS

    if bwd_impl is not None and bwd_impl not in BWD_IMPLS:
        raise ValueError(f"bwd_impl must be one of {BWD_IMPLS} or None, got {bwd_impl!r}")
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    _install_dispatchers()
    switched = 0
    for module in model.modules():
        if not isinstance(module, DSAttention):
            continue
        if getattr(module, "_agentrl_dsa_kernels", None) is None:
            module._agentrl_dsa_kernels = DsaKernelState(use_triton=use_triton)
            module.forward = types.MethodType(_switched_forward, module)
        module._agentrl_dsa_kernels.bwd_impl = bwd_impl
        switched += 1
    return switched


def dsa_kernel_stats(model: torch.nn.Module) -> dict[str, Any]:
    """Summed kernel / fallback call counts and the fallback reasons over the switched layers."""
    calls = {"topk": 0, "attention": 0, "fallback": 0, "offset_runs": 0}
    reasons: set[str] = set()
    for module in model.modules():
        state = getattr(module, "_agentrl_dsa_kernels", None)
        if isinstance(state, DsaKernelState):
            for key, n in state.calls.items():
                calls[key] += n
            reasons |= state.fallback_reasons
    return {**calls, "fallback_reasons": sorted(reasons)}
