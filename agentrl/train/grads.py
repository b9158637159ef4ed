"""Gradients of the Megatron backend: fp32 accumulation, the reductions Megatron's DDP and
finalize_model_grads would do, and the global norm.

The backend does not wrap the model in Megatron's DDP (its buffers assume CUDA and a fused
optimizer), so this module does the same work on plain tensors:
- `attach_main_grads`: every trainable param gets `main_grad`, an fp32 accumulator, and a hook
  that adds the param's grad into it as soon as autograd has produced it (then frees it), so a bf16
  model holds 2 B (param) + 4 B (main_grad) per param on the GPU between micro-batches.
- `reduce_gradients`, in the order finalize_model_grads uses (sums commute, the order is for the
  reader): TP (sequence-parallel tagged params and the q/k latent norms summed, params tagged
  `average_gradients_across_tp_domain` averaged), the embedding group (the word embedding's copy
  on the last stage, for MTP or tied weights, summed with the first stage's so both stay equal),
  and data parallel (dense params over DP x CP, routed experts over expert-DP: EP ranks own other
  experts and never mix). The loss is already normalised by the step's global token count, so
  every reduction is a sum, except the TP average that Megatron defines.
- `clip_grad_norm`: the L2 norm over the whole model (each shard counted once) and the scaling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SHARED_EMBEDDING = "shared_embedding"  # Megatron's tag on the last stage's embedding copy


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def attach_main_grads(named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """fp32 `main_grad` for every param, accumulated by a post-accumulate-grad hook."""
    for _, p in named_params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

        def accumulate(param: torch.Tensor) -> None:
            param.main_grad.add_(param.grad)
            param.grad = None

        p.register_post_accumulate_grad_hook(accumulate)


def zero_main_grads(named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
    for _, p in named_params:
        p.main_grad.zero_()


def _all_reduce_flat(grads: list[torch.Tensor], group, scale: float = 1.0) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # gloo has no AVG: sum, then scale
    if scale != 1.0:
        flat.mul_(scale)
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()


def _tp_sums_and_averages(named_params, sequence_parallel: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """finalize_model_grads._allreduce_non_tensor_model_parallel_grads' selection."""
    sums, avgs = [], []
    for name, p in named_params:
        if getattr(p, "average_gradients_across_tp_domain", False):
            avgs.append(p.main_grad)
        elif (sequence_parallel and getattr(p, "sequence_parallel", False)) or "q_layernorm" in name \
                or "k_layernorm" in name:
            sums.append(p.main_grad)
    return sums, avgs


def reduce_gradients(named_params: list[tuple[str, torch.nn.Parameter]], *, sequence_parallel: bool,
                     shared_embedding: torch.nn.Parameter | None) -> None:
    """All-reduce `main_grad`s over TP, the embedding group and DP (see the module docstring).
    `shared_embedding`: this stage's word-embedding weight when it is in the embedding group
    (first and last stage with MTP or tied weights, PP > 1), else None."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        sums, avgs = _tp_sums_and_averages(named_params, sequence_parallel)
        group = ps.get_tensor_model_parallel_group()
        _all_reduce_flat(sums, group)
        _all_reduce_flat(avgs, group, 1.0 / tp)
    if shared_embedding is not None:
        _all_reduce_flat([shared_embedding.main_grad], ps.get_embedding_group())
    dense = [p.main_grad for n, p in named_params if not is_expert_param(n)]
    experts = [p.main_grad for n, p in named_params if is_expert_param(n)]
    _all_reduce_flat(dense, ps.get_data_parallel_group(with_context_parallel=True))
    _all_reduce_flat(experts, ps.get_expert_data_parallel_group(with_gtp_remat=False))


def clip_grad_norm(named_params: list[tuple[str, torch.nn.Parameter]], max_norm: float) -> float:
    """Global L2 norm over every shard of the model, then scale grads to `max_norm` (as torch's
    clip_grad_norm_ does: coefficient min(1, max_norm / (norm + 1e-6))). TP-split params are summed
    over TP, experts over expert TP x EP, replicated params count once, the last stage's embedding
    copy not at all; stages are summed over PP."""
    from megatron.core import parallel_state as ps

    device = named_params[0][1].device
    dense_rep = torch.zeros((), dtype=torch.float64, device=device)
    dense_tp = torch.zeros((), dtype=torch.float64, device=device)
    expert = torch.zeros((), dtype=torch.float64, device=device)
    for name, p in named_params:
        if getattr(p, SHARED_EMBEDDING, False) and not ps.is_pipeline_first_stage():
            continue
        sq = p.main_grad.double().pow(2).sum()
        if is_expert_param(name):
            expert += sq
        elif getattr(p, "tensor_model_parallel", False):
            dense_tp += sq
        else:
            dense_rep += sq
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(dense_tp, group=ps.get_tensor_model_parallel_group())
    if ps.get_expert_tensor_and_model_parallel_world_size() > 1:
        dist.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
    total = dense_rep + dense_tp + expert
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for _, p in named_params:
            p.main_grad.mul_(coef)
    return norm
