"""Lognormal: an environment whose episodes take a heavy-tailed time, for measuring async vs sync.

Agentic episodes have heavy-tailed durations (most end in minutes, a few run to the hour-long
timeout); a synchronous trainer waits for the slowest episode of every batch. This env reproduces
that shape with real sandboxes: each episode creates one sandbox in `reset`, and its one action
runs `sleep D` inside that sandbox, D drawn from a lognormal with median `median_s` and shape
`sigma`, capped at `max_s` (the episode time limit). D depends only on (seed, the reset seed), or
without a reset seed on (seed, episode id): two runs of one seed play the same durations
(agentrl/policy/seeding.py), and a rerun of the same episode takes the same time.

Reward is a checkable rule on the model's reply, so a policy can learn it: 1.0 when the reply's
first non-space character is one of `target_chars` (default: a vowel; ~23% of the tiny
tokenizer's tokens start with one), else 0.0. Use agent.action_format=text so the whole reply is
the action. `context_words` adds a fixed per-task description to the prompt: agentic trajectories
are long, so training costs scale with their tokens while engines reuse the shared prefix.
A benchmark's env, not a product one: runs name it by import path, env.name="bench.lognormal_env:LognormalEnv"
(ENV_NAME), which agentrl/envs/registry.py resolves; it is registered as no entry point.
"""

from __future__ import annotations

import math
import random
from typing import Any

from agentrl.envs.base import Action, Observation, State
from agentrl.sandbox.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec
from bench.episode_draw import episode_rng

PROMPT = "Answer with one word."
ENV_NAME = "bench.lognormal_env:LognormalEnv"  # what a run config sets env.name to


class LognormalEnv:
    def __init__(self, provider: SandboxProvider | None = None, median_s: float = 1.0, sigma: float = 1.0,
                 max_s: float = 60.0, num_tasks: int = 8, seed: int = 0, target_chars: str = "aeiou",
                 context_words: int = 0):
        for name, value in (("median_s", median_s), ("max_s", max_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LognormalEnv: {name} must be a number > 0, got {value!r}")
        if not isinstance(sigma, (int, float)) or sigma < 0:
            raise ValueError(f"LognormalEnv: sigma must be a number >= 0, got {sigma!r}")
        if not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"LognormalEnv: num_tasks must be an integer >= 1, got {num_tasks!r}")
        if not isinstance(context_words, int) or context_words < 0:
            raise ValueError(f"LognormalEnv: context_words must be an integer >= 0, got {context_words!r}")
        if not target_chars:
            raise ValueError("LognormalEnv: target_chars must name at least one character")
        if provider is None:
            raise ValueError("LognormalEnv needs a sandbox provider: build it with LognormalEnv.from_config(cfg, provider)")
        self.provider = provider
        self.median_s, self.sigma, self.max_s = float(median_s), float(sigma), float(max_s)
        self.num_tasks, self.seed, self.target_chars = num_tasks, seed, target_chars.lower()
        self.context_words = context_words
        self._state = State()
        self._sandbox: Sandbox | None = None
        self._reply: str | None = None
        self.duration_s = 0.0

    @classmethod
    def from_config(cls, cfg: Any, provider: SandboxProvider | None = None, **overrides: Any) -> LognormalEnv:
        """Build from the run's config tree: the run's sandbox provider plus env.kwargs."""
        return cls(provider=provider, **{**cfg.env.kwargs, **overrides})

    def task_ids(self) -> list[str]:
        return [f"lognormal-{i}" for i in range(self.num_tasks)]

    def draw_duration(self, episode_id: str, reset_seed: int | None = None) -> float:
        """Seconds the episode's action takes: lognormal(log(median_s), sigma), capped at max_s; drawn
        from the reset seed when there is one, else from the episode id (bench/episode_draw.py)."""
        rng = episode_rng(self.seed, episode_id, reset_seed)
        return min(self.max_s, rng.lognormvariate(math.log(self.median_s), self.sigma))

    async def reset(self, task_id: str, *, episode_id: str | None = None, seed: int | None = None) -> Observation:
        if task_id not in self.task_ids():
            raise ValueError(f"LognormalEnv: unknown task {task_id!r}; ids are lognormal-<i>, i < {self.num_tasks}")
        await self.close()
        self._state = State(episode_id=episode_id, step_count=0, task_id=task_id)
        self._reply = None
        self.duration_s = self.draw_duration(episode_id or task_id, seed)
        self._sandbox = await self.provider.create(SandboxSpec(labels={"env": "lognormal", "task": task_id}))
        return Observation(text=f"{PROMPT} ({task_id})" + self.context(task_id))

    def context(self, task_id: str) -> str:
        """The task's fixed description: `context_words` pseudo-words, the same on every call."""
        if not self.context_words:
            return ""
        rng = random.Random(f"{self.seed}:{task_id}:context")
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = ("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(self.context_words))
        return "\nContext: " + " ".join(words)

    async def step(self, action: Action) -> Observation:
        if self._sandbox is None:
            raise RuntimeError("LognormalEnv.step before reset")
        self._state.step_count += 1
        self._reply = action.text if action.text is not None else (action.command or action.keystrokes or "")
        # The episode's work happens in the sandbox, so its cost includes real exec overhead.
        result = await self._sandbox.exec(f"sleep {self.duration_s:.3f}", timeout_s=self.duration_s + 60.0)
        if result.exit_code != 0:
            raise SandboxError("exec", f"sleep in the sandbox exited {result.exit_code}: {result.output[:200]}")
        return Observation(text="done", done=True)

    def reward_for(self, reply: str) -> float:
        first = reply.lstrip()[:1].lower()
        return 1.0 if first and first in self.target_chars else 0.0

    async def score(self) -> Observation:
        reward = self.reward_for(self._reply or "")
        return Observation(text=f"reward {reward}", done=True, reward=reward, status="scored")

    @property
    def state(self) -> State:
        return self._state

    async def close(self) -> None:
        box, self._sandbox = self._sandbox, None
        if box is not None:
            await box.close()
