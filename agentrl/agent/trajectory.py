"""What an episode produces: the exact tokens, who produced them, and how it ended.

Invariants (DESIGN.md): every sampled token carries the weight version that produced it; an
infrastructure failure is an outcome, never a reward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Outcomes. Only the first three are trainable; `infra_error:<kind>` never is.
SCORED = "scored"
AGENT_TIMEOUT = "agent_timeout"
TRUNCATED = "truncated"
INFRA_ERROR_PREFIX = "infra_error:"
TRAINABLE_OUTCOMES = frozenset({SCORED, AGENT_TIMEOUT, TRUNCATED})


def infra_error(kind: str) -> str:
    """Outcome string for an infrastructure failure of the given kind (sandbox, engine, verifier, ...)."""
    return f"{INFRA_ERROR_PREFIX}{kind}"


def is_trainable(outcome: str) -> bool:
    return outcome in TRAINABLE_OUTCOMES


@dataclass
class Trajectory:
    """One episode, token-in-token-out.

    `token_ids` is the full conversation exactly as the engine saw and produced it. For every
    position: `loss_mask` is 1 where the policy sampled the token, 0 for prompt and observation
    tokens; `rollout_logprobs` and `weight_versions` are meaningful only where loss_mask is 1
    (0.0 and -1 elsewhere).
    """

    episode_id: str
    task_id: str
    group_id: str
    prompt_len: int
    token_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    weight_versions: list[int]
    outcome: str
    reward: float | None = None
    num_turns: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory.{name} has {len(getattr(self, name))} entries, token_ids has {n}"
                )
        if self.outcome == SCORED and self.reward is None:
            raise ValueError("a scored trajectory needs a reward")
        if not is_trainable(self.outcome) and not self.outcome.startswith(INFRA_ERROR_PREFIX):
            raise ValueError(f"unknown outcome {self.outcome!r}")

    @property
    def trainable(self) -> bool:
        return is_trainable(self.outcome)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int | None:
        """Weight version of the oldest sampled token (what the staleness bound looks at)."""
        versions = [v for v, m in zip(self.weight_versions, self.loss_mask) if m]
        return min(versions) if versions else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls(**data)
