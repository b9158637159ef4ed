"""The environment contract, shaped like OpenEnv's: async reset / step / state / close.

A new environment is one class implementing `Env` plus one entry point in the `agentrl.envs`
group of its own package.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


class Action(BaseModel):
    """What the agent does in one step. Terminal envs use `command` (a shell command) or
    `keystrokes`; other envs put their payload in `text`."""

    model_config = ConfigDict(extra="forbid")
    command: str | None = None
    keystrokes: str | None = None
    duration_s: float | None = None
    text: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class Observation(BaseModel):
    """What the agent sees. `reward` is set only when the env scored the episode; `status`
    says how scoring went (`scored`, or `infra_error:<kind>` which is never a reward)."""

    model_config = ConfigDict(extra="forbid")
    text: str = ""
    done: bool = False
    reward: float | None = None
    status: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class State(BaseModel):
    model_config = ConfigDict(extra="allow")
    episode_id: str | None = None
    step_count: int = 0
    task_id: str | None = None


@runtime_checkable
class Env(Protocol):
    """One episode at a time. `reset` takes the task id; `score` ends the episode with a verdict."""

    async def reset(self, task_id: str, *, episode_id: str | None = None, seed: int | None = None) -> Observation: ...

    async def step(self, action: Action) -> Observation: ...

    async def score(self) -> Observation: ...

    @property
    def state(self) -> State: ...

    async def close(self) -> None: ...

    def task_ids(self) -> list[str]: ...


@runtime_checkable
class ConfigurableEnvFactory(Protocol):
    """Optional: an env class that builds itself from the run's config tree (and the run's sandbox
    provider) instead of from `env.kwargs` alone. `registry.make_run_env` uses it when present."""

    def from_config(self, cfg: Any, provider: Any = None) -> Env: ...


@runtime_checkable
class SplitEnv(Protocol):
    """Optional: an env that suggests train / eval splits of its tasks ({"train": [...], "eval": [...]})."""

    def splits(self) -> dict[str, list[str]]: ...
