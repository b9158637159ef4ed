"""What a taken batch trains on, and the facts about its tokens that the run's metrics report.

Under partial rollout (per-token staleness rule) the trajectories go through the loss's stale-token
policy first (agentrl/train/stale_tokens.py: `mask` leaves tokens older than the bound out of the loss
mask, `tis` keeps them for their TIS weight). The facts, in both modes:
  trajectories_interrupted   trajectories whose generation a weight update interrupted (and that went on)
  tokens_carried_over        sampled tokens produced before such an interruption and kept
  version_spans_mean / _max  runs of equal weight version over a trajectory's sampled tokens
  stale_tokens               sampled tokens older than the bound (masked under `mask`)
  trained_tokens             sampled tokens the loss trains on
  token_lag_mean / _max      version lag of the trained tokens at take time
"""

from __future__ import annotations

from agentrl.train.stale_tokens import apply_stale_tokens


def version_spans(loss_mask: list[int], versions: list[int]) -> int:
    """Runs of equal version over the sampled tokens (1: one version; 0: nothing sampled)."""
    spans, last = 0, None
    for m, v in zip(loss_mask, versions):
        if m and v != last:
            spans, last = spans + 1, v
    return spans


def batch_view(trajectories: list, current_version: int, max_staleness: int, stale_policy: str | None):
    """(trajectories for the trainer, metrics). `stale_policy` None: the whole-group rule, trained as
    sampled (the stale count is then 0 unless the bound changed between take and sampling)."""
    out, spans, stale, lags = [], [], 0, []
    interrupted = carried = 0
    for sampled in trajectories:
        spans.append(version_spans(sampled.loss_mask, sampled.weight_versions))
        interrupted += int(sampled.info.get("interruptions", 0) > 0)
        carried += int(sampled.info.get("carried_tokens", 0))
        t, n = apply_stale_tokens(sampled, current_version, max_staleness, stale_policy or "tis")
        stale += n
        out.append(t)
        lags += [current_version - v for m, v in zip(t.loss_mask, t.weight_versions) if m]
    metrics = {
        "trajectories_interrupted": interrupted, "tokens_carried_over": carried,
        "version_spans_mean": sum(spans) / len(spans) if spans else 0.0, "version_spans_max": max(spans, default=0),
        "stale_tokens": stale, "trained_tokens": len(lags),
        "token_lag_mean": sum(lags) / len(lags) if lags else 0.0, "token_lag_max": max(lags, default=0),
    }
    return out, metrics
