"""Check task folders end to end: validate, run the oracle, score it, score an empty attempt.

What `agentrl tasks check` runs. A task passes when it loads, its oracle (`bash /solution/solve.sh`
in a fresh sandbox, under the task's agent timeout) ends with the expected status and reward
(`scored` / 1.0 unless its [metadata] says otherwise), and an empty attempt in another fresh
sandbox ends with the expected empty status (`scored` with reward 0.0 unless an adversarial
verifier makes it an infra error). A folder with `expected_error.txt` passes when validation
fails with a message containing that text.

With `hack`, each known forgery (forgeries.py) runs as a whole episode through TB2Env, the way
training runs one, instead of the empty attempt; the task fails if any of them scores above 0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentrl.envs.base import Action
from agentrl.sandbox.base import SandboxError, SandboxProvider
from envs.tbench2.env import TB2Env
from envs.tbench2.forgeries import Forgery
from envs.tbench2.loader import TaskFormatError, TaskSpec, expected_error, load_task
from envs.tbench2.scorer import SCORED, ScoreResult, score_task, upload_tree

_ORACLE_OUTPUT_BYTES = 64 * 1024


@dataclass
class TaskCheck:
    task: str
    status: str  # the oracle's status: "scored", "infra_error:<kind>", or "invalid"
    reward: float | None  # the oracle's reward; None unless status == "scored"
    empty_reward: float | None
    unsupported: list[str] = field(default_factory=list)
    error: str | None = None  # why the task failed the check (or the expected validation error)
    ok: bool = False
    empty_status: str | None = None
    expected_status: str = "scored"
    solve_timed_out: bool = False
    elapsed_s: float = 0.0
    forgeries: list[ForgeryCheck] | None = None  # with hack: one per forgery, instead of the empty attempt

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def forged(self) -> list[ForgeryCheck]:
        return [f for f in self.forgeries or [] if f.forged]


@dataclass
class ForgeryCheck:
    forgery: str
    armed: bool  # its probe saw the trick in place before scoring
    status: str
    reward: float | None
    detail: str

    @property
    def forged(self) -> bool:
        return self.reward is not None and self.reward > 0


def task_dirs_of(path: Path, names: list[str] | None = None) -> list[Path]:
    """`path` itself if it is a task folder, else its sub-folders holding a task.toml (or the
    named ones)."""
    if (path / "task.toml").is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a task folder nor a folder of tasks")
    dirs = sorted(p for p in path.iterdir() if p.is_dir() and (p / "task.toml").is_file())
    if names:
        known = {d.name: d for d in dirs}
        missing = [n for n in names if n not in known]
        if missing:
            raise FileNotFoundError(f"no task folder named {missing} in {path} (known: {sorted(known)})")
        dirs = [known[n] for n in names]
    return dirs


async def run_oracle(provider: SandboxProvider, task: TaskSpec) -> tuple[ScoreResult, bool]:
    """Solve with solution/solve.sh in a fresh sandbox, then score. Returns (verdict, timed out)."""
    sandbox = await provider.create(task.sandbox_spec(labels={"purpose": "oracle"}))
    try:
        await upload_tree(sandbox, task.path / "solution", "/solution")
        run = await sandbox.exec(
            "bash /solution/solve.sh",
            cwd=task.workdir,
            timeout_s=task.agent_timeout_s,
            max_output_bytes=_ORACLE_OUTPUT_BYTES,
        )
        return await score_task(sandbox, task, provider=provider), run.timed_out
    finally:
        await sandbox.close()


async def run_empty(provider: SandboxProvider, task: TaskSpec) -> ScoreResult:
    sandbox = await provider.create(task.sandbox_spec(labels={"purpose": "empty"}))
    try:
        return await score_task(sandbox, task, provider=provider)
    finally:
        await sandbox.close()


async def run_forgery(
    provider: SandboxProvider, task: TaskSpec, forgery: Forgery, *, verifier_sandbox: str | None = None
) -> ForgeryCheck:
    """One forgery as an episode: TB2Env reset (sandbox + tmux terminal), its commands and
    keystrokes as steps, its probe, then the env's own score() (`verifier_sandbox` overrides the
    task's, as TB2Env's option does)."""
    env = TB2Env(task.path.parent, provider, verifier_timeout_s=None, verifier_sandbox=verifier_sandbox)
    armed = False
    try:
        first = await env.reset(task.name, episode_id=f"hack-{forgery.name}")
        for command in forgery.commands:
            await env.step(Action(command=command, duration_s=30.0))
        if first.metadata.get("terminal_error") is None:  # the episode has its tmux terminal
            for keys in forgery.keystrokes:
                await env.step(Action(keystrokes=keys, duration_s=0.3))
        probe = await env.step(Action(command=forgery.probe, duration_s=30.0))
        armed = "ARMED" in probe.text
        verdict = await env.score()
        return ForgeryCheck(forgery.name, armed, verdict.status or "", verdict.reward, verdict.metadata["detail"])
    except SandboxError as err:
        return ForgeryCheck(forgery.name, armed, f"infra_error:{err.kind}", None, str(err))
    finally:
        await env.close()


async def check_task(
    provider: SandboxProvider, task_dir: Path, *, hack: tuple[Forgery, ...] | None = None
) -> TaskCheck:
    start = time.monotonic()
    want_error = expected_error(task_dir)
    try:
        task = load_task(task_dir)
    except TaskFormatError as err:
        ok = want_error is not None and want_error in str(err)
        why = str(err) if ok or want_error is None else f"{err} (expected an error containing {want_error!r})"
        return TaskCheck(
            task_dir.name,
            "invalid",
            None,
            None,
            error=why,
            ok=ok,
            expected_status="invalid",
            elapsed_s=time.monotonic() - start,
        )
    check = TaskCheck(
        task.name,
        "",
        None,
        None,
        unsupported=list(task.unsupported_locally),
        expected_status=task.expected_status,
    )
    if want_error is not None:
        check.status, check.error = (
            "scored",
            f"expected validation to fail with {want_error!r}, but the task loads",
        )
    elif task.solution_path is None:
        check.status, check.error = (
            "invalid",
            "solution/solve.sh is missing: nothing to check the tests against",
        )
    else:
        try:
            oracle, check.solve_timed_out = await run_oracle(provider, task)
            empty = None if hack else await run_empty(provider, task)
            if hack:
                check.forgeries = [await run_forgery(provider, task, f) for f in hack]
        except SandboxError as err:
            check.status, check.error = f"infra_error:{err.kind}", f"sandbox: {err}"
        else:
            check.status, check.reward = oracle.status, oracle.reward
            if empty is not None:
                check.empty_status, check.empty_reward = empty.status, empty.reward
            check.error = _judge(task, oracle, empty, check.forged)
            check.ok = check.error is None
    check.elapsed_s = time.monotonic() - start
    return check


def _judge(
    task: TaskSpec, oracle: ScoreResult, empty: ScoreResult | None, forged: list[ForgeryCheck]
) -> str | None:
    problems = [f"forgery {f.forgery} scored {f.reward:g} ({f.detail})" for f in forged]
    if oracle.status != task.expected_status:
        problems.append(f"oracle ended {oracle.status} ({oracle.detail}), expected {task.expected_status}")
    elif (
        oracle.status == SCORED and task.expected_reward is not None and oracle.reward != task.expected_reward
    ):
        problems.append(f"oracle scored {oracle.reward}, expected {task.expected_reward} ({oracle.detail})")
    if empty is not None and empty.status != task.expected_empty_status:
        problems.append(
            f"empty attempt ended {empty.status} ({empty.detail}), expected {task.expected_empty_status}"
        )
    elif empty is not None and empty.status == SCORED and empty.reward != 0.0:
        problems.append(f"empty attempt scored {empty.reward}, expected 0.0 ({empty.detail})")
    return "; ".join(problems) or None


async def check_tasks(
    provider: SandboxProvider,
    task_dirs: list[Path],
    *,
    jobs: int = 1,
    progress: Callable[[int, int, TaskCheck], None] | None = None,
    hack: tuple[Forgery, ...] | None = None,
) -> list[TaskCheck]:
    slots = asyncio.Semaphore(max(1, jobs))
    results: list[TaskCheck | None] = [None] * len(task_dirs)
    finished = 0

    async def one(i: int, d: Path) -> None:
        nonlocal finished
        async with slots:
            results[i] = await check_task(provider, d, hack=hack)
        finished += 1
        if progress is not None:
            progress(finished, len(task_dirs), results[i])

    await asyncio.gather(*(one(i, d) for i, d in enumerate(task_dirs)))
    return [r for r in results if r is not None]
