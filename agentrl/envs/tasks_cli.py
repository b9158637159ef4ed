"""`agentrl tasks`: check terminal-bench-2 task folders end to end.

Only typer and the standard library are imported here; the sandbox backends and the task code are
imported inside the command.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Annotated

import typer

from agentrl.envs.tasks_generate import generate as generate_tasks_command

app = typer.Typer(no_args_is_help=True, add_completion=False)
app.command("generate")(generate_tasks_command)  # agentrl/envs/tasks_generate.py


@app.command("check")
def check(
    tasks_dir: Annotated[Path, typer.Argument(help="A folder of task folders, or one task folder.")],
    backend: Annotated[str, typer.Option(help="Sandbox backend: local or daytona.")] = "local",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the results as a JSON list on stdout.")
    ] = False,
    task: Annotated[
        list[str] | None, typer.Option("--task", help="Check only this task (repeatable).")
    ] = None,
    jobs: Annotated[int, typer.Option(min=1, help="Tasks checked at once.")] = 1,
    hack: Annotated[
        bool,
        typer.Option(
            "--hack", help="Run the built-in forgeries (envs/tbench2/forgeries.py) instead of the empty attempt."
        ),
    ] = False,
    forgery: Annotated[
        list[str] | None, typer.Option("--forgery", help="With --hack: only this forgery (repeatable).")
    ] = None,
) -> None:
    """Validate each task, score its oracle (solution/solve.sh) and an empty attempt, each in a
    fresh sandbox. Exits 1 if a task fails validation, its oracle does not score 1.0 or its empty
    attempt does not score 0.0, unless it is an adversarial fixture whose expected status is met.
    With --hack, each known forgery runs as an episode instead of the empty attempt, and any that
    scores above 0 is reported (task, forgery, reward) and fails the check."""
    from agentrl.config.schema import SandboxConfig
    from agentrl.sandbox.base import SandboxError
    from agentrl.sandbox.factory import make_provider
    from envs.tbench2.check import check_tasks, task_dirs_of
    from envs.tbench2.forgeries import by_name

    if backend not in ("local", "daytona"):
        raise typer.BadParameter(f"{backend!r}: use local or daytona", param_hint="--backend")
    if forgery and not hack:
        raise typer.BadParameter("--forgery needs --hack", param_hint="--forgery")
    try:
        forgeries = by_name(forgery) if hack else None
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--forgery") from None
    try:
        dirs = task_dirs_of(tasks_dir, task)
    except FileNotFoundError as err:
        raise typer.BadParameter(str(err), param_hint="TASKS_DIR / --task") from None
    if not dirs:
        typer.echo(f"no task folders (with a task.toml) in {tasks_dir}", err=True)
        raise typer.Exit(1)

    def progress(done: int, total: int, result) -> None:
        mark = "ok  " if result.ok else "FAIL"
        attempt = (
            f"{len(result.forgeries)} forgeries, {len(result.forged)} scored"
            if result.forgeries is not None
            else f"empty {result.empty_status or '-'} {_num(result.empty_reward)}"
        )
        detail = (
            f"oracle {result.status} {_num(result.reward)}, {attempt}"
            if result.status != "invalid"
            else "invalid task.toml / layout"
        )
        line = f"[{done}/{total}] {mark} {result.task}: {detail} ({result.elapsed_s:.1f} s)"
        if result.error:
            line += f"\n        {result.error}"
        print(line, file=sys.stderr, flush=True)

    async def run():
        provider = make_provider(SandboxConfig(backend=backend), f"tasks-check-{uuid.uuid4().hex[:8]}")
        try:
            return await check_tasks(provider, dirs, jobs=jobs, progress=progress, hack=forgeries)
        finally:
            await provider.aclose()

    try:
        results = asyncio.run(run())
    except SandboxError as err:  # the backend itself is unusable (no key, no bubblewrap, ...)
        typer.echo(f"cannot check tasks on the {backend} backend: {err}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        keys = (
            "task",
            "status",
            "reward",
            "empty_reward",
            "unsupported",
            "error",
            "ok",
            "empty_status",
            "expected_status",
            "solve_timed_out",
            "elapsed_s",
            *(("forgeries",) if hack else ()),
        )
        print(json.dumps([{k: r.to_json()[k] for k in keys} for r in results], indent=2))
    for r in results:  # every forged pass, one line each: what an optimiser would find
        for f in r.forged:
            print(f"FORGED {r.task}: {f.forgery} scored {f.reward:g} ({f.detail})", file=sys.stderr)
    failed = [r.task for r in results if not r.ok]
    print(
        f"{len(results) - len(failed)}/{len(results)} tasks passed"
        + (f"; failed: {', '.join(failed)}" if failed else ""),
        file=sys.stderr,
    )
    raise typer.Exit(1 if failed else 0)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"
