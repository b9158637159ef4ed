"""RMSNorm / LayerNorm for megatron-core's layer spec without TransformerEngine, usable with
sequence parallelism.

Why: megatron-core 0.19.2's torch norms (`WrappedTorchNorm`) assert "sequence parallel not supported
by torch LayerNorm", and AbsorbedMLA (the DSA attention) requires sequence parallelism at TP > 1,
so without TE no TP > 1 model builds. A norm needs nothing to run on a sequence shard: it is per
token. What sequence parallelism needs is the bookkeeping: each TP rank sees a different slice of
the tokens, so the norm's weight gradient is partial on every rank and must be summed over TP. The
norms here tag their params `sequence_parallel=config.sequence_parallel` (as Megatron's fused
norms do); `megatron_parallel.reduce_gradients` sums tagged grads over TP, as Megatron's
finalize_model_grads does when its DDP is used (the backend does not use it).

Measured (REFERENCE section 9): a TP2 + SP gloo probe with such a norm gave log-probs within
9.5e-7 of TP1, and the tagged norm grads summed over TP equal TP1's within 1e-7.

Which norm and which eps: `config.normalization` picks RMSNorm or LayerNorm (Megatron hands the
DSA indexer's k_norm a config copy with "LayerNorm", so it gets a bias); eps is the caller's
(layernorm_epsilon, or dsa_indexer_k_norm_epsilon for k_norm), except the MLA q/kv latent norms,
whose eps `qk_norm_eps` may override (transformers' GlmMoeDsa uses 1e-6 there, Megatron passes
layernorm_epsilon). The indexer marks its own params `average_gradients_across_tp_domain` after
building k_norm; that tag wins in reduce_gradients (the indexer runs on TP-gathered tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

KINDS = ("RMSNorm", "LayerNorm")


class SequenceParallelNorm(torch.nn.Module):
    """Per-token RMSNorm (weight) or LayerNorm (weight and bias) over the last dimension, fp32 params
    like Megatron's torch norms; the same arithmetic as torch.nn.RMSNorm / torch.nn.LayerNorm."""

    def __init__(self, hidden_size: int, eps: float, kind: str, sequence_parallel: bool):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"normalization {kind!r} is not supported without TransformerEngine; use one of {KINDS}")
        self.hidden_size, self.eps, self.kind = hidden_size, float(eps), kind
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size)) if kind == "LayerNorm" else None
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel  # read by reduce_gradients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.hidden_size,)
        if self.bias is None:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return F.layer_norm(x, shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}({self.hidden_size}, eps={self.eps})"


def norm_class(eps_override: float | None = None) -> type:
    """A class for megatron's spec (build_module calls classes, returns plain functions unbuilt)
    whose instances are SequenceParallelNorm of the caller's config; `eps_override` replaces
    the caller's eps (the q/kv latent norms)."""

    class SpecNorm:
        def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> SequenceParallelNorm:
            if getattr(config, "layernorm_zero_centered_gamma", False):
                raise ValueError("layernorm_zero_centered_gamma is not supported by agentrl's norms")
            return SequenceParallelNorm(hidden_size, eps if eps_override is None else eps_override,
                                        config.normalization, bool(config.sequence_parallel))

    SpecNorm.__name__ = SpecNorm.__qualname__ = "SequenceParallelNorm" if eps_override is None else "FixedEpsNorm"
    return SpecNorm
