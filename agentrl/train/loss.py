"""GRPO with PPO-style asymmetric clipping and truncated importance sampling (TIS).

- Advantages: group-normalised rewards, A_i = (r_i - mean_g) / (std_g + eps) (GRPO, Shao et al.
  2024), or with `advantage_norm="none"` A_i = r_i - mean_g (Dr. GRPO, Liu et al. 2025: dividing
  by the std up-weights groups whose rewards barely differ, e.g. 1 success in 8 gets A = 2.65 where
  the centred reward is 0.875). A group whose rewards are all equal carries no signal: its
  advantages are 0, counted. (Dr. GRPO's other change, no per-sequence length normalisation, is
  already how this loss normalises: one token mean over the whole step.)
- Policy loss per sampled token: max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)) with
  r = exp(logp_new - logp_old) (PPO; the asymmetric "clip-higher" of DAPO, Yu et al. 2025).
- TIS (Yao et al. 2025): w = clamp(exp(logp_old - logp_rollout), tis_low, tis_high), detached,
  multiplies each token's loss. It corrects both the engine/trainer numeric mismatch and, in the
  fully-async loop, the version lag of stale samples.
- Optional k3 KL to a reference policy (Schulman's unbiased estimator), coefficient 0 by default.
- Stale tokens under partial rollout (algorithm.stale_tokens): a trajectory continued across weight
  updates holds tokens of several versions. `mask` leaves the ones older than the staleness bound
  out of the loss (the bound then holds per trained token); `tis` keeps them, each weighted by its
  own truncated importance weight above (the correction for their version lag); stale_tokens.py.
Token-level mean over every loss token of the step (not per sequence), so long episodes are
not down-weighted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrl.train.stale_tokens import STALE_TOKEN_POLICIES, apply_stale_tokens, stale_token_positions  # noqa: F401

ADV_EPS = 1e-6
ADVANTAGE_NORMS = ("std", "none")


@dataclass
class GroupAdvantages:
    advantages: list[float]  # one per trajectory, in input order
    zero_variance_groups: int
    groups: int


def step_advantages(trajectories, group_ids: list[str],
                    advantage_norm: str = "std") -> tuple[GroupAdvantages, list[float], float]:
    """A training step's group advantages (a missing reward counts as 0), the per-trajectory
    advantages and the mean reward. `advantage_norm` is algorithm.advantage_norm. Both backends
    start their step with it."""
    if not trajectories:
        raise ValueError("train_step needs at least one trajectory")
    if advantage_norm not in ADVANTAGE_NORMS:
        raise ValueError(f"algorithm.advantage_norm {advantage_norm!r} is unknown; use one of {ADVANTAGE_NORMS}")
    rewards = [t.reward if t.reward is not None else 0.0 for t in trajectories]
    adv = group_advantages(rewards, group_ids, normalize_std=advantage_norm == "std")
    return adv, list(adv.advantages), sum(rewards) / len(rewards)


def group_advantages(rewards: list[float], group_ids: list[str], normalize_std: bool = True) -> GroupAdvantages:
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        by_group.setdefault(g, []).append(i)
    adv = [0.0] * len(rewards)
    zero = 0
    for idx in by_group.values():
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        centred = r - r.mean()
        if torch.all(centred.abs() < 1e-12):
            zero += 1
            continue
        scale = (r.std(unbiased=False) + ADV_EPS) if normalize_std else 1.0
        for i, a in zip(idx, (centred / scale).tolist()):
            adv[i] = a
    return GroupAdvantages(adv, zero, len(by_group))


@dataclass
class LossInputs:
    """Per-token tensors, all [N] over the step's loss tokens (or [B, T] with mask)."""

    logp: torch.Tensor  # current policy, requires grad
    old_logp: torch.Tensor  # policy at the start of the step (detached)
    rollout_logp: torch.Tensor  # what the engine reported when sampling
    advantages: torch.Tensor  # per token (the trajectory's advantage broadcast)
    mask: torch.Tensor  # 1.0 on loss tokens
    ref_logp: torch.Tensor | None = None


@dataclass
class LossConfig:
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    use_tis: bool = True
    tis_clip_low: float = 0.5
    tis_clip: float = 2.0
    kl_coef: float = 0.0


def grpo_tis_loss(x: LossInputs, cfg: LossConfig, num_loss_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum of per-token losses divided by `num_loss_tokens` (the step's total), plus metrics.

    Returning a sum-normalised value lets micro-batches accumulate gradients to exactly the
    step's token mean."""
    mask = x.mask.to(x.logp.dtype)
    log_ratio = x.logp - x.old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics: dict[str, float] = {}
    if cfg.use_tis:
        raw_w = torch.exp((x.old_logp - x.rollout_logp).detach())
        w = torch.clamp(raw_w, cfg.tis_clip_low, cfg.tis_clip)
        per_token = per_token * w
        clipped_tis = ((raw_w < cfg.tis_clip_low) | (raw_w > cfg.tis_clip)).to(mask.dtype)
        metrics["tis_clip_frac_sum"] = float((clipped_tis * mask).sum())
        metrics["tis_weight_sum"] = float((w * mask).sum())
    if cfg.kl_coef > 0:
        if x.ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        d = x.ref_logp - x.logp
        per_token = per_token + cfg.kl_coef * (torch.exp(d) - d - 1.0)
    loss = (per_token * mask).sum() / max(num_loss_tokens, 1)
    with torch.no_grad():
        pg_clipped = ((unclipped < clipped).to(mask.dtype) * mask).sum()
        metrics["pg_clip_frac_sum"] = float(pg_clipped)
        metrics["mismatch_kl_sum"] = float(((x.rollout_logp - x.old_logp) * mask).sum())
        metrics["loss_tokens"] = float(mask.sum())
    return loss, metrics
