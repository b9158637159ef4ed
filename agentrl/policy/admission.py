"""Admission: how many GRPO groups may start now, so that none is stale by the time it trains.

Shaped like AReaL's staleness manager. With B groups per optimizer step, a group started while the
trainer is at version v is trained at the earliest by the step that produces version v + 1, and
must be trained by version v + max_staleness. So by version v at most

    (max_staleness + v + 1) * B

groups may ever have started (the capacity formula), minus the ones that left untrained (stale,
infra error, lost worker), whose slots are given back. An episode budget caps concurrency on its own.

With partial rollout the bound holds per token, not per group: an in-flight episode is continued on
each new version, and the loss masks (or TIS-corrects) only its tokens older than the bound. A group
started early is then no longer lost whole, so admission may run `lead_steps` further ahead,

    (max_staleness + lead_steps + v + 1) * B,

more episodes in flight for an engine whose decode rate grows with its batch, at the price of more
tokens past the bound (counted: stale_tokens). lead_steps = 0 is the formula above; the config
allows lead_steps > 0 only with rollout.partial (without it those groups would be retired stale).

Invariants (tests/test_policy_admission.py): the count never goes negative; capacity is never
negative; after `on_resume(version, trained, buffered)` the formula holds exactly as if the run
had never stopped (AReaL's on_version_recovered): without it a run resumed at step N would see
N x B free slots and start that many extra groups, all of which end up stale.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdmissionPolicy:
    groups_per_step: int
    group_size: int
    max_staleness: int
    max_episodes_in_flight: int
    lead_steps: int = 0  # rollout.partial_lead_steps: steps of groups admitted beyond the staleness capacity
    started_groups: int = 0  # ever started (or recovered), minus those retired untrained
    running_episodes: int = 0

    def __post_init__(self) -> None:
        if self.max_episodes_in_flight < self.group_size:
            raise ValueError(f"buffer.max_episodes_in_flight={self.max_episodes_in_flight} is below "
                             f"algorithm.group_size={self.group_size}: no group could ever start; raise it to at "
                             f"least {self.group_size}")
        if self.lead_steps < 0:
            raise ValueError(f"rollout.partial_lead_steps={self.lead_steps} is negative; use 0 or more")

    def capacity(self, version: int) -> int:
        """Groups that may start now at trainer version `version`."""
        by_staleness = (self.max_staleness + self.lead_steps + version + 1) * self.groups_per_step - self.started_groups
        by_episodes = (self.max_episodes_in_flight - self.running_episodes) // self.group_size
        return max(min(by_staleness, by_episodes), 0)

    def on_start(self) -> None:
        """A group of `group_size` episodes started."""
        self.started_groups += 1
        self.running_episodes += self.group_size

    def on_episodes_end(self, n: int) -> None:
        """`n` episodes of a started group ended (finished, failed or cancelled)."""
        if n > self.running_episodes:
            raise ValueError(f"{n} episodes ended but only {self.running_episodes} were running")
        self.running_episodes -= n

    def on_group_retired(self) -> None:
        """A started group left without being trained (stale, infra error, lost): its slot frees up."""
        if self.started_groups == 0:
            raise ValueError("a group was retired but none had started")
        self.started_groups -= 1

    def on_resume(self, version: int, buffered_groups: int) -> None:
        """After a restart at trainer `version`: version x B groups were trained before the stop and
        `buffered_groups` complete or partial groups came back from the replay log; all count as started."""
        self.started_groups = version * self.groups_per_step + buffered_groups
        self.running_episodes = 0
