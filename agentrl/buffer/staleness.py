"""Staleness: how many weight versions behind the trainer a group's tokens are.

A group is trainable at trainer version v iff its lag <= max_staleness (lag == max is admitted,
max + 1 is not). Which tokens the lag is taken from depends on how episodes meet weight updates:
- whole-group rule (default): the group's OLDEST sampled token, because a multi-turn episode spans
  versions and its first turn is the stalest part; every trained token is then within the bound.
- per-token rule (rollout.partial): episodes are continued across updates, so a long one holds
  tokens of many versions. The group trains while EACH trajectory's NEWEST sampled token is within
  the bound (every trajectory still has a fresh part); its older tokens are the loss's business
  (algorithm.stale_tokens: masked out, or kept with their TIS weight; agentrl/train/loss.py).
How many groups may start so that the bound holds is admission's business (agentrl/policy/admission.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessBound:
    max_staleness: int
    per_token: bool = False

    def lag(self, oldest_version: int, current_version: int) -> int:
        return current_version - oldest_version

    def admits(self, oldest_version: int, current_version: int) -> bool:
        return self.lag(oldest_version, current_version) <= self.max_staleness

    def group_lag(self, trajectories: Iterable, current_version: int) -> int | None:
        """The lag this rule judges a group of trajectories by; None when no token was sampled."""
        ends = []
        for t in trajectories:
            sampled = [v for v, m in zip(t.weight_versions, t.loss_mask) if m]
            if sampled:
                ends.append(max(sampled) if self.per_token else min(sampled))
        if not ends:
            return None
        return self.lag(min(ends), current_version)
