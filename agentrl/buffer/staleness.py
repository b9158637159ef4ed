"""Staleness: how many weight versions behind the trainer a group's oldest token is.

A group is trainable at trainer version v iff v - oldest_token_version <= max_staleness
(lag == max is admitted, max + 1 is not). The bound is on the OLDEST token because a
multi-turn episode spans versions; its first turn is the stalest part. How many groups may start
so that the bound holds is admission's business (agentrl/policy/admission.py).
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
