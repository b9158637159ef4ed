"""Turns: multi-turn episodes of heavy-tailed length, where generation is the work (for partial rollout).

Agentic episodes spend their time generating turn after turn, and their length is heavy-tailed: a
few run many times longer than the median, across several weight updates. Each episode here plays
T turns, T drawn from a lognormal with median `median_turns` and shape `sigma`, capped at
`max_turns`; T depends only on (seed, the reset seed), or without a reset seed on (seed, episode id):
the run loop gives the k-th group of every run of one seed the same reset seeds
(agentrl/policy/seeding.py), so two runs play the same lengths, and a replayed episode keeps its length. Every
turn the model replies (agent.action_format=text: the whole reply is the action) and the env
answers with a short fixed observation; with `sandbox` it first runs one command in the
episode's real sandbox (`printf %s WORD | wc -c`, WORD the reply's first word), so a resumed episode
replays real commands. Reward: the share of replies whose first non-space character is one of
`target_chars` (a vowel by default), a rule a policy can learn.
A benchmark's env: runs name it by import path, env.name = ENV_NAME (no entry point).
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from agentrl.envs.base import Action, Observation, State
from agentrl.sandbox.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec
from bench.episode_draw import episode_rng

ENV_NAME = "bench.turns_env:TurnsEnv"
PROMPT = "Answer every turn with one word."


class TurnsEnv:
    def __init__(self, provider: SandboxProvider | None = None, median_turns: float = 3.0, sigma: float = 0.8,
                 max_turns: int = 12, num_tasks: int = 8, seed: int = 0, target_chars: str = "aeiou",
                 sandbox: bool = False):
        if not isinstance(median_turns, (int, float)) or not median_turns >= 1:
            raise ValueError(f"TurnsEnv: median_turns must be a number >= 1, got {median_turns!r}")
        if not isinstance(sigma, (int, float)) or sigma < 0:
            raise ValueError(f"TurnsEnv: sigma must be a number >= 0, got {sigma!r}")
        for name, value in (("max_turns", max_turns), ("num_tasks", num_tasks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TurnsEnv: {name} must be an integer >= 1, got {value!r}")
        if not target_chars:
            raise ValueError("TurnsEnv: target_chars must name at least one character")
        self.provider, self.use_sandbox = provider, sandbox
        self.median_turns, self.sigma, self.max_turns = float(median_turns), float(sigma), max_turns
        self.num_tasks, self.seed, self.target_chars = num_tasks, seed, target_chars.lower()
        self._state = State()
        self._sandbox: Sandbox | None = None
        self.turns = 0
        self.replies: list[str] = []

    @classmethod
    def from_config(cls, cfg: Any, provider: SandboxProvider | None = None, **overrides: Any) -> TurnsEnv:
        return cls(provider=provider, **{**cfg.env.kwargs, **overrides})

    def task_ids(self) -> list[str]:
        return [f"turns-{i}" for i in range(self.num_tasks)]

    def draw_turns(self, episode_id: str, reset_seed: int | None = None) -> int:
        """Turns of the episode: round(lognormal(log(median_turns), sigma)), in [1, max_turns]; drawn
        from the reset seed when there is one, else from the episode id."""
        rng = episode_rng(self.seed, episode_id, reset_seed)
        return max(1, min(self.max_turns, round(rng.lognormvariate(math.log(self.median_turns), self.sigma))))

    def _ask(self, k: int) -> str:
        return f"Turn {k} of {self.turns}: one word."

    async def reset(self, task_id: str, *, episode_id: str | None = None, seed: int | None = None) -> Observation:
        if task_id not in self.task_ids():
            raise ValueError(f"TurnsEnv: unknown task {task_id!r}; ids are turns-<i>, i < {self.num_tasks}")
        await self.close()
        self._state = State(episode_id=episode_id, step_count=0, task_id=task_id)
        self.turns, self.replies = self.draw_turns(episode_id or task_id, seed), []
        if self.use_sandbox:
            if self.provider is None:  # a run builds it with one; only a check of the tasks goes without
                raise ValueError("TurnsEnv(sandbox=True) needs a sandbox provider: build it with TurnsEnv.from_config")
            self._sandbox = await self.provider.create(SandboxSpec(labels={"env": "turns", "task": task_id}))
        return Observation(text=f"{PROMPT} ({task_id})\n{self._ask(1)}")

    async def step(self, action: Action) -> Observation:
        reply = action.text if action.text is not None else (action.command or action.keystrokes or "")
        self.replies.append(reply)
        self._state.step_count += 1
        k = self._state.step_count
        text = "ok"
        if self._sandbox is not None:
            # The tiny model's random tokens can decode to NUL, which a command cannot hold (the
            # sandbox answers exit 126): the word is counted without them.
            word = (reply.split() or [""])[0][:32].replace("\x00", "")
            result = await self._sandbox.exec(f"printf %s {shlex.quote(word)} | wc -c", timeout_s=60.0)
            if result.exit_code != 0:
                raise SandboxError("exec", f"wc in the sandbox exited {result.exit_code}: {result.output[:200]}")
            text = f"ok {result.output.strip()}"
        if k >= self.turns:
            return Observation(text=text, done=True)
        return Observation(text=f"{text}\n{self._ask(k + 1)}")

    def reward_for(self, reply: str) -> float:
        first = reply.lstrip()[:1].lower()
        return 1.0 if first and first in self.target_chars else 0.0

    async def score(self) -> Observation:
        reward = sum(map(self.reward_for, self.replies)) / len(self.replies) if self.replies else 0.0
        return Observation(text=f"reward {reward}", done=True, reward=reward, status="scored")

    @property
    def state(self) -> State:
        return self._state

    async def close(self) -> None:
        box, self._sandbox = self._sandbox, None
        if box is not None:
            await box.close()
