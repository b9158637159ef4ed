"""Pure-torch log-probabilities of target tokens from hidden states and the LM head.

``reference_logprobs`` is the plain definition (materialises [T, V] in fp32; tests only).
``chunked_logprobs`` is what the trainer uses where Triton cannot run (CPU): tokens are
processed in chunks whose logits are recomputed in backward (activation checkpointing), so
peak extra memory is O(chunk_tokens * V) instead of O(T * V).
Both share the signature of ``kernels.logprobs.fused_logprobs``.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

LogprobsOut = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def check_logprobs_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          temperature: float) -> None:
    """Raise a ValueError naming the bad argument; shared by every implementation."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden_size], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be [vocab, hidden_size={hidden.shape[1]}], got shape {tuple(weight.shape)}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [tokens={hidden.shape[0]}], got shape {tuple(targets.shape)}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be int32/int64 token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    temperature: float, with_entropy: bool) -> torch.Tensor:
    logits = (hidden @ weight.t()).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return token_logp.unsqueeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.stack([token_logp, entropy], dim=-1)


def reference_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       temperature: float = 1.0, return_entropy: bool = False) -> LogprobsOut:
    """The definition, in fp32 over the full [T, V] matrix. Use only at test sizes."""
    check_logprobs_inputs(hidden, weight, targets, temperature)
    out = _chunk_logprobs(hidden.float(), weight.float(), targets, temperature, return_entropy)
    return (out[:, 0], out[:, 1]) if return_entropy else out[:, 0]


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     temperature: float = 1.0, return_entropy: bool = False,
                     chunk_tokens: int = 1024) -> LogprobsOut:
    """Token log-probs (and entropies) with O(chunk_tokens * V) extra memory, differentiable.

    Logits come out of the GEMM in the inputs' dtype and are upcast to fp32 for the softmax: with
    bf16 inputs they carry bf16 rounding (~0.4% of |logit|, measured 0.015 max abs on log-probs at
    V=154880), which the fused kernel avoids by keeping logits in fp32; pass fp32 inputs when that
    matters (the CPU trainer does). Each chunk is checkpointed, so backward recomputes its logits.
    """
    check_logprobs_inputs(hidden, weight, targets, temperature)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    pieces = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        args = (hidden[start:start + chunk_tokens], weight, targets[start:start + chunk_tokens],
                temperature, return_entropy)
        if needs_grad:
            pieces.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*args))
    if pieces:
        out = torch.cat(pieces, dim=0)
    else:
        out = hidden.new_zeros((0, 2 if return_entropy else 1), dtype=torch.float32)
    return (out[:, 0], out[:, 1]) if return_entropy else out[:, 0]
