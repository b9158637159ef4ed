"""Staleness: how many weight versions behind the trainer a group's oldest token is.

A group is trainable at trainer version v iff v - oldest_token_version <= max_staleness
(lag == max is admitted, max + 1 is not). The bound is on the OLDEST token because a
multi-turn episode spans versions; its first turn is the stalest part.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessBound:
    max_staleness: int

    def lag(self, oldest_version: int, current_version: int) -> int:
        return current_version - oldest_version

    def admits(self, oldest_version: int, current_version: int) -> bool:
        return self.lag(oldest_version, current_version) <= self.max_staleness


@dataclass
class AdmissionControl:
    """How many more groups may start now, so that none is stale by the time it is trained.

    With B groups per step, groups started at version v are consumed at the earliest by step v;
    at most (max_staleness + v + 1) * B groups may ever have been started by version v
    (the capacity formula of AReaL's staleness manager), minus those still running or waiting.
    Episode and token budgets cap concurrency independently."""

    groups_per_step: int
    group_size: int
    max_staleness: int
    max_episodes_in_flight: int
    max_tokens_in_flight: int | None = None
    started_groups: int = 0  # ever started, minus groups retired without training (drop/retry)
    running_episodes: int = 0
    tokens_in_flight: int = 0

    def capacity(self, version: int) -> int:
        """Groups that may start now."""
        by_staleness = (self.max_staleness + version + 1) * self.groups_per_step - self.started_groups
        by_episodes = (self.max_episodes_in_flight - self.running_episodes) // self.group_size
        cap = min(by_staleness, by_episodes)
        if self.max_tokens_in_flight is not None and self.tokens_in_flight >= self.max_tokens_in_flight:
            cap = 0
        return max(cap, 0)

    def on_start(self, episodes: int) -> None:
        self.started_groups += 1
        self.running_episodes += episodes

    def on_episode_end(self, tokens: int = 0) -> None:
        self.running_episodes -= 1
        self.tokens_in_flight = max(0, self.tokens_in_flight - tokens)

    def on_group_retired(self) -> None:
        """A group left without being trained (stale drop, infra retry): its slot frees up."""
        self.started_groups -= 1

    def gauges(self) -> dict[str, int]:
        return {"started_groups": self.started_groups, "running_episodes": self.running_episodes,
                "tokens_in_flight": self.tokens_in_flight}
