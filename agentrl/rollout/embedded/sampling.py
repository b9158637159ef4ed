"""Per-row sampling of one token with the exact logprob RL needs.

The reported logprob is log_softmax(logits / T) over the full vocabulary, the quantity SGLang
returns and the trainer recomputes; top-k / top-p only restrict which token may be drawn.
Temperature 0 means greedy (argmax) and reports log_softmax(logits), as SGLang does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class RowParams:
    temperature: float
    top_p: float
    top_k: int  # <= 0: whole vocabulary


def effective_temperature(t: float) -> float:
    return 1.0 if t < GREEDY_EPS else t


def scaled_logprobs(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """log_softmax(logits / T) per row, fp32. logits: [B, V] or [B, S, V] with one T per row."""
    t = torch.tensor([effective_temperature(x) for x in temperatures], dtype=torch.float32)
    t = t.view(-1, *([1] * (logits.dim() - 1)))
    return torch.log_softmax(logits.float() / t, dim=-1)


def sample_rows(
    logits: torch.Tensor, params: list[RowParams], generator: torch.Generator | None = None
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V]; returns (token ids, their full-vocabulary logprobs)."""
    logp = scaled_logprobs(logits, [p.temperature for p in params])
    greedy = torch.tensor([p.temperature < GREEDY_EPS for p in params])
    vocab = logp.shape[-1]
    if all(p.top_k <= 0 and p.top_p >= 1.0 for p in params):
        probs = logp.exp()
    else:
        probs = _filtered_probs(logp, params, vocab)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    tokens = torch.where(greedy, logp.argmax(dim=-1), sampled)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()


def _filtered_probs(logp: torch.Tensor, params: list[RowParams], vocab: int) -> torch.Tensor:
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_lp.exp()
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    ps = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    rank = torch.arange(vocab)[None, :]
    # Keep a token if it is within top-k and the mass strictly before it is < top_p (the first
    # token is always kept).
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = (rank < ks[:, None]) & (mass_before < ps[:, None])
    keep[:, 0] = True
    filtered = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    return torch.zeros_like(filtered).scatter(-1, order, filtered)
