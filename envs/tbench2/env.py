"""TB2Env: terminal-bench-2 tasks as an agentrl Env (entry point `tbench2` in `agentrl.envs`).

One episode at a time: `reset(task_id)` brings a sandbox up from the task (its Dockerfile locally,
its image on Daytona) with a tmux terminal in the working directory, and returns the instruction
and the first screen. `step` runs either `Action.command` (one shell command through exec, with
`Action.duration_s` as its timeout) or `Action.keystrokes` (typed into tmux, then waits
`duration_s`). `score` runs the task's tests (envs/tbench2/scorer.py). `close` always deletes the
sandbox. The task's `[agent] timeout_sec` is enforced: once it has passed, `step` runs nothing and
returns done=True with metadata `agent_timeout: true`.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from agentrl.config.schema import AgentConfig, RunConfig, SandboxConfig
from agentrl.envs.base import Action, Observation, State
from agentrl.sandbox.base import Sandbox, SandboxError, SandboxProvider
from agentrl.sandbox.factory import make_provider
from envs.tbench2.loader import (
    DEFAULT_TASKS_DIR,
    TaskFormatError,
    TaskSpec,
    list_task_dirs,
    load_splits,
    load_task,
)
from envs.tbench2.scorer import SCORED, score_task
from envs.tbench2.terminal import TmuxTerminal, cap_text


class TB2Env:
    def __init__(
        self,
        tasks_dir: str | Path | None = None,
        provider: SandboxProvider | None = None,
        *,
        sandbox: SandboxConfig | dict[str, Any] | None = None,
        run_id: str | None = None,
        observation_max_chars: int = 4000,
        command_timeout_s: float = 60.0,
        terminal_max_bytes: int = 10_000,
        max_keystroke_wait_s: float = 60.0,
        verifier_timeout_s: float | None = None,
        use_terminal: bool = True,
        verifier_sandbox: str | None = None,
    ):
        """`provider` is shared and not closed by this env; without one, the env makes its own
        from `sandbox` (a SandboxConfig or its dict) and closes it in close(). `verifier_sandbox`
        ("same" or "fresh") overrides every task's `[verifier] sandbox` (scorer.py)."""
        self.tasks_dir = Path(tasks_dir) if tasks_dir is not None else DEFAULT_TASKS_DIR
        self.sandbox_config = (
            sandbox if isinstance(sandbox, SandboxConfig) else SandboxConfig(**(sandbox or {}))
        )
        self.run_id = run_id or f"tb2-{uuid.uuid4().hex[:8]}"
        self.observation_max_chars = observation_max_chars
        self.command_timeout_s = command_timeout_s
        self.terminal_max_bytes = terminal_max_bytes
        self.max_keystroke_wait_s = max_keystroke_wait_s
        self.verifier_timeout_s = verifier_timeout_s
        self.use_terminal = use_terminal
        self.verifier_sandbox = verifier_sandbox
        self._provider = provider
        self._owns_provider = provider is None
        self._tasks: dict[str, TaskSpec] = {}
        self.invalid_tasks: dict[str, str] = {}  # name -> validation error, filled by task_ids()
        self._sandbox: Sandbox | None = None
        self._terminal: TmuxTerminal | None = None
        self._task: TaskSpec | None = None
        self._state = State()
        self._deadline = 0.0
        self._scored = False

    @classmethod
    def from_config(cls, cfg: RunConfig, provider: SandboxProvider | None = None, **overrides: Any) -> TB2Env:
        """Build from the run's config tree (env.tasks_dir, env.kwargs, agent, sandbox)."""
        agent: AgentConfig = cfg.agent
        kwargs: dict[str, Any] = {
            "tasks_dir": cfg.env.tasks_dir,
            "provider": provider,
            "sandbox": cfg.sandbox,
            "observation_max_chars": agent.observation_max_chars,
            "command_timeout_s": agent.command_timeout_s,
        }
        if cfg.env.generate is not None:  # a generated set (envs/tbench2/generate), built once into a cache
            from envs.tbench2.generate.cache import ensure_generated

            kwargs["tasks_dir"] = ensure_generated(**cfg.env.generate.model_dump())
        kwargs.update(cfg.env.kwargs)
        kwargs.update(overrides)
        return cls(**kwargs)

    # --- tasks -----------------------------------------------------------------------------------

    def task_ids(self) -> list[str]:
        """Tasks of tasks_dir that load; the others are in `invalid_tasks` with their error."""
        ids = []
        for d in list_task_dirs(self.tasks_dir):
            try:
                self.task(d.name)
                ids.append(d.name)
            except TaskFormatError as err:
                self.invalid_tasks[d.name] = str(err)
        return ids

    def splits(self) -> dict[str, list[str]]:
        """The tasks dir's SPLITS.json ({"train": [...], "eval": [...], ...}); {} without one."""
        return load_splits(self.tasks_dir)

    def task(self, task_id: str) -> TaskSpec:
        if task_id not in self._tasks:
            d = self.tasks_dir / task_id
            if "/" in task_id or task_id.startswith(".") or not (d / "task.toml").is_file():
                raise KeyError(f"unknown task {task_id!r}: no {d}/task.toml")
            self._tasks[task_id] = load_task(d)
        return self._tasks[task_id]

    # --- episode ---------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    async def reset(
        self, task_id: str, *, episode_id: str | None = None, seed: int | None = None
    ) -> Observation:
        await self._drop_sandbox()
        task = self.task(task_id)
        episode_id = episode_id or uuid.uuid4().hex[:12]
        if self._provider is None:
            self._provider = make_provider(self.sandbox_config, self.run_id)
        self._task, self._scored = task, False
        self._sandbox = await self._provider.create(task.sandbox_spec(labels={"episode": episode_id}))
        screen, terminal_error = "", None
        if self.use_terminal:
            terminal = TmuxTerminal(
                self._sandbox,
                cwd=task.workdir,
                max_output_bytes=self.terminal_max_bytes,
                max_duration_s=self.max_keystroke_wait_s,
            )
            try:
                screen = await terminal.start()
                self._terminal = terminal
            except SandboxError as err:  # e.g. an image without tmux: commands still work
                if err.kind != "terminal":
                    raise
                terminal_error = str(err)
        self._deadline = time.monotonic() + task.agent_timeout_s
        self._state = State(
            episode_id=episode_id,
            task_id=task_id,
            step_count=0,
            sandbox_id=self._sandbox.id,
            agent_timeout_s=task.agent_timeout_s,
        )
        text = (
            task.instruction
            if not screen.strip()
            else f"{task.instruction}\n\nCurrent terminal screen:\n{screen}"
        )
        return Observation(
            text=text,
            metadata={
                "instruction": task.instruction,
                "screen": screen,
                "workdir": task.workdir,
                "agent_timeout_s": task.agent_timeout_s,
                "unsupported_locally": task.unsupported_locally,
                "terminal_error": terminal_error,
            },
        )

    async def step(self, action: Action) -> Observation:
        if self._sandbox is None or self._task is None:
            raise RuntimeError("step() before reset(): call reset(task_id) first")
        self._state.step_count += 1
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            return Observation(
                text=f"[agent time limit of {self._task.agent_timeout_s:g} s reached]",
                done=True,
                metadata={"agent_timeout": True},
            )
        if action.command is not None:
            timeout = min(action.duration_s or self.command_timeout_s, remaining)
            res = await self._sandbox.exec(
                action.command, timeout_s=timeout, max_output_bytes=4 * self.observation_max_chars
            )
            text = res.output
            if res.timed_out:
                text += f"\n[command timed out after {timeout:g} s and was killed]"
            elif res.exit_code != 0:
                text += f"\n[exit code {res.exit_code}]"
            return Observation(
                text=_cap_chars(text, self.observation_max_chars),
                metadata={
                    "exit_code": res.exit_code,
                    "timed_out": res.timed_out,
                    "truncated": res.truncated,
                },
            )
        if action.keystrokes is not None:
            if self._terminal is None:
                raise SandboxError(
                    "terminal",
                    "no terminal in this episode (use_terminal=False or tmux failed to "
                    "start; see reset's metadata.terminal_error); send commands instead",
                )
            wait = min(action.duration_s if action.duration_s is not None else 1.0, remaining)
            text = await self._terminal.send(action.keystrokes, wait)
            return Observation(text=_cap_chars(text, self.observation_max_chars))
        raise ValueError("a TB2 action needs `command` or `keystrokes`")

    async def score(self) -> Observation:
        if self._sandbox is None or self._task is None:
            raise RuntimeError("score() before reset(): call reset(task_id) first")
        if self._scored:
            raise RuntimeError("score() called twice in one episode")
        self._scored = True
        result = await score_task(
            self._sandbox,
            self._task,
            timeout_s=self.verifier_timeout_s,
            provider=self._provider,
            verifier_sandbox=self.verifier_sandbox,
        )
        text = f"{result.status}: {result.detail}"
        return Observation(
            text=text,
            done=True,
            reward=result.reward if result.status == SCORED else None,
            status=result.status,
            metadata={
                "detail": result.detail,
                "elapsed_s": result.elapsed_s,
                "verifier_output": cap_text(result.output, 8192),
            },
        )

    async def close(self) -> None:
        """Delete the sandbox (always) and the provider this env made itself."""
        try:
            await self._drop_sandbox()
        finally:
            if self._owns_provider and self._provider is not None:
                provider, self._provider = self._provider, None
                await provider.aclose()

    async def _drop_sandbox(self) -> None:
        sandbox, self._sandbox, self._terminal = self._sandbox, None, None
        if sandbox is not None:
            await sandbox.close()


def _cap_chars(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    return f"{text[:head]}\n[... {len(text) - max_chars} characters omitted ...]\n{text[len(text) - (max_chars - head) :]}"
