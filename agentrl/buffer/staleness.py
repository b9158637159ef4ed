"""Staleness: how many weight versions behind the trainer a group's tokens are.

A group is trainable at trainer version v iff its lag <= max_staleness (lag == max is admitted,
max + 1 is not). Which tokens the lag is taken from depends on how episodes meet weight updates:
- whole-group rule (default): the group's OLDEST sampled token, because a multi-turn episode spans
  versions and its first turn is the stalest part; every trained token is then within the bound.
- per-token rule (rollout.partial): episodes are continued across updates, so a long one holds
  tokens of many versions, and a group's first finishers age while its last one still runs. The
  group trains while its NEWEST sampled token is within the bound (it has something fresh to
  train); every older token is the loss's business (algorithm.stale_tokens, agentrl/train/loss.py:
  masked out, so the bound still holds for every trained token, or kept with its TIS weight).
  Under `mask` a trajectory that is stale throughout still gives its reward to the group's
  baseline but no gradient: the gradient then leans to the group's later, longer episodes.
How many groups may start so that the bound holds is admission's business (agentrl/policy/admission.py);
stopping a running group the whole-group rule already condemns is agentrl/policy/stale_cancel.py's.
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
        """The lag this rule judges a group of trajectories by (its oldest sampled token's, or with
        per_token its newest one's); None when no token was sampled."""
        sampled = [v for t in trajectories for v, m in zip(t.weight_versions, t.loss_mask) if m]
        if not sampled:
            return None
        return self.lag(max(sampled) if self.per_token else min(sampled), current_version)
