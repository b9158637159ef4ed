"""`agentrl eval`: pass rates of a model (or a trained checkpoint) on tasks, no training."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Annotated

import typer


def eval_command(
    config: Annotated[str, typer.Option("--config", help="Recipe name or YAML path.")] = "local",
    overrides: Annotated[list[str], typer.Option("--set", help="Override a config field, e.g. "
                                                  "model.name=smollm2-135m (repeatable).")] = [],  # noqa: B006
    tasks: Annotated[list[str], typer.Option("--task", help="Task id (repeatable); default: the --split.")] = [],  # noqa: B006
    split: Annotated[str, typer.Option(help="Which of the env's splits to use when no --task is given: "
                                            "eval (env.eval_tasks or SPLITS.json) or train.")] = "eval",
    samples: Annotated[int, typer.Option(min=1, help="Episodes per task.")] = 8,
    checkpoint: Annotated[Path | None, typer.Option(help="A run's checkpoints/latest folder; default: the "
                                                         "model's own weights.")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Episodes run at once.")] = 8,
    out: Annotated[Path | None, typer.Option(help="Write the JSON report here (episodes go beside it).")] = None,
    harness: Annotated[str, typer.Option(help="agentrl (its own agent), or harbor: also Harbor's Terminus-2 on the "
                                              "same engine, checkpoint, tasks and sampling, reported beside it "
                                              "(needs the harbor extra; agentrl/harbor/eval.py).")] = "agentrl",
) -> None:
    """Play SAMPLES episodes of each task in real sandboxes and report pass rates with 95% intervals."""
    import asyncio

    from agentrl.config.front import FrontDoorError, error_line, resolve_run, unwritable_folder
    from agentrl.evaluate import evaluate

    if harness not in ("agentrl", "harbor"):
        typer.echo(f"error: --harness {harness!r}: use agentrl or harbor", err=True)
        raise typer.Exit(2)
    try:
        cfg, _ = resolve_run(config=config, overrides=overrides, check_runnable=False)
        task_ids = chosen_tasks(cfg, [t for item in tasks for t in item.split(",") if t], split)
    except (FrontDoorError, ValueError) as e:
        typer.echo(error_line(e), err=True)
        raise typer.Exit(2) from None
    work_dir = (out.parent if out else Path(cfg.logging.run_dir)) / "eval"
    if why := unwritable_folder(work_dir):  # before any episode plays: else the report would lose them all
        field = f"--out {out}" if out else f"logging.run_dir={cfg.logging.run_dir}"
        typer.echo(f"error: {field}: {why}; pass a writable folder", err=True)
        raise typer.Exit(2)
    total = len(task_ids) * samples
    done = {"n": 0, "passed": 0}

    def progress(e: dict) -> None:
        done["n"] += 1
        done["passed"] += int(e["passed"])  # the report's own rule (runner.passed), not reward alone
        typer.echo(f"[{done['n']}/{total}] {e['task_id']}#{e['sample']}: {e['outcome']} reward={e['reward']} "
                   f"(passed so far {done['passed']})", err=True)

    typer.echo(f"evaluating {cfg.model.name} on {len(task_ids)} task(s) x {samples} sample(s)", err=True)
    run = evaluate
    if harness == "harbor":
        from agentrl.harbor.eval import compare_harnesses as run
    try:
        report = asyncio.run(run(cfg, task_ids, samples, checkpoint=checkpoint, concurrency=concurrency,
                                 work_dir=work_dir, on_episode=progress))
    except (FileNotFoundError, ValueError) as e:
        typer.echo(error_line(e), err=True)
        raise typer.Exit(2) from None
    text = json.dumps(report, indent=2)
    if out:
        out.write_text(text + "\n")
        typer.echo(f"wrote {out}", err=True)
    if harness == "harbor":
        from agentrl.harbor.eval import comparison_line

        typer.echo(comparison_line(report))
        return
    typer.echo(f"pass rate {report['pass_rate']} ({report['passed']}/{report['samples']}, 95% CI {report['ci95']})")


def chosen_tasks(cfg, asked: list[str], split: str) -> list[str]:
    """The --task ids, each one a task of the run's env (a typo is refused before anything plays,
    rather than becoming an episode's infra error), else the ids of `split`."""
    if not asked:
        return split_tasks(cfg, split)
    from agentrl.envs.registry import make_run_env

    env = make_run_env(cfg)
    known = list(env.task_ids())
    invalid = getattr(env, "invalid_tasks", {})  # envs whose task folders can fail to load say why
    for task in asked:
        if task in invalid:
            raise typer.BadParameter(f"--task {task!r}: not a valid task of env {cfg.env.name}: {invalid[task]}")
        if task not in known:
            near = difflib.get_close_matches(task, known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise typer.BadParameter(f"--task {task!r}: env {cfg.env.name} has no such task; {hint}"
                                     f"{len(known)} known, e.g. {', '.join(known[:3])}")
    return asked


def split_tasks(cfg, split: str) -> list[str]:
    """The task ids of `split` ("eval" or "train") of the run's env, as the run loop splits them."""
    from agentrl.agent.runner import split_tasks as run_split
    from agentrl.envs.base import SplitEnv
    from agentrl.envs.registry import make_run_env

    if split not in ("eval", "train"):
        raise typer.BadParameter(f"--split {split!r}: use eval or train")
    env = make_run_env(cfg)
    suggested = dict(env.splits()) if isinstance(env, SplitEnv) else {}
    train, held_out = run_split(cfg, list(env.task_ids()), suggested)
    chosen = held_out if split == "eval" else train
    if not chosen:
        raise typer.BadParameter(f"the env has no {split!r} split; pass --task ids or set env.{split}_tasks")
    return list(chosen)
