"""Dynamic sampling (DAPO, Yu et al. 2025): groups whose rewards are all equal are left out of the
batch and replaced by new groups.

Such a group has advantage 0 for every sample (GRPO and Dr. GRPO alike): it adds no gradient but
still counts in the step's token mean, so with sparse rewards (SmolLM2 passes ~4% of easy tasks,
REFERENCE.md section 8: most groups of 8 are all-fail) it dilutes the few groups that do carry
signal. One reported ablation gained 2.4 points from this filter (REFERENCE.md section 7).

The run loop calls `select` on the complete groups it drains: `kept` go to training, `dropped`
are retired untrained and as many new groups are admitted in their place. After `max_skips`
dropped groups in a row, the next zero-variance group is let through (counted), so a run whose
tasks are all failed, or all solved, keeps stepping and evaluating instead of generating forever.
Pure bookkeeping: no Ray, no I/O; counters are part of the checkpoint via state_dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Rewards closer than this are equal (TB2 rewards are 0/1; reward.json may give fractions).
REWARD_TOLERANCE = 1e-9
DEFAULT_MAX_SKIPS = 32


@dataclass(frozen=True)
class GroupRewards:
    group_id: str
    task_id: str
    rewards: tuple[float, ...]  # one per trajectory; a missing reward counts as 0, as in training


def is_zero_variance(rewards: Sequence[float | None], tolerance: float = REWARD_TOLERANCE) -> bool:
    values = [0.0 if r is None else float(r) for r in rewards]
    return not values or max(values) - min(values) <= tolerance


def groups_of(trajectories: Iterable) -> list[GroupRewards]:
    """Trajectories (objects with group_id, task_id, reward) grouped by group_id, in first-seen order."""
    by_id: dict[str, tuple[str, list[float]]] = {}
    for t in trajectories:
        by_id.setdefault(t.group_id, (t.task_id, []))[1].append(0.0 if t.reward is None else float(t.reward))
    return [GroupRewards(g, task, tuple(r)) for g, (task, r) in by_id.items()]


@dataclass
class Selection:
    kept: list[GroupRewards] = field(default_factory=list)
    dropped: list[GroupRewards] = field(default_factory=list)

    @property
    def kept_ids(self) -> list[str]:
        return [g.group_id for g in self.kept]

    @property
    def dropped_ids(self) -> list[str]:
        return [g.group_id for g in self.dropped]


class DynamicSampler:
    """Keeps groups with reward variance; drops (when enabled) the others, counting them."""

    def __init__(self, enabled: bool = True, max_skips: int = DEFAULT_MAX_SKIPS):
        if max_skips < 0:
            raise ValueError(f"algorithm.dynamic_sampling_max_skips must be >= 0, got {max_skips}")
        self.enabled, self.max_skips = enabled, max_skips
        self.counters = {"groups_seen": 0, "groups_kept": 0, "zero_variance": 0, "dropped_unsolved": 0,
                         "dropped_solved": 0, "let_through": 0}
        self.streak = 0  # zero-variance groups dropped in a row

    @classmethod
    def from_config(cls, algo) -> DynamicSampler:
        """From AlgorithmConfig (dynamic_sampling, dynamic_sampling_max_skips)."""
        return cls(algo.dynamic_sampling, algo.dynamic_sampling_max_skips)

    def select(self, groups: Sequence[GroupRewards]) -> Selection:
        out = Selection()
        for g in groups:
            self.counters["groups_seen"] += 1
            if not is_zero_variance(g.rewards):
                self.streak = 0
                out.kept.append(g)
                continue
            self.counters["zero_variance"] += 1
            if not self.enabled:
                out.kept.append(g)
            elif self.streak >= self.max_skips:
                self.streak = 0
                self.counters["let_through"] += 1
                out.kept.append(g)
            else:
                self.streak += 1
                solved = bool(g.rewards) and g.rewards[0] > 0
                self.counters["dropped_solved" if solved else "dropped_unsolved"] += 1
                out.dropped.append(g)
        self.counters["groups_kept"] += len(out.kept)
        return out

    def metrics(self) -> dict[str, float]:
        """Counters since the run began, and the share of drained groups that were dropped."""
        seen = self.counters["groups_seen"]
        dropped = self.counters["dropped_unsolved"] + self.counters["dropped_solved"]
        return {**{f"dynamic_sampling_{k}": float(v) for k, v in self.counters.items()},
                "dynamic_sampling_drop_rate": dropped / seen if seen else 0.0}

    def state_dict(self) -> dict:
        return {"kind": "dynamic_sampling", "counters": dict(self.counters), "streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "dynamic_sampling":
            raise ValueError(f"not a DynamicSampler state: kind {state.get('kind')!r}")
        self.counters.update({k: int(v) for k, v in state["counters"].items() if k in self.counters})
        self.streak = int(state["streak"])
