"""`agentrl eval --harness harbor`: the same checkpoint, tasks and sampling settings played by two
harnesses, side by side.

1. agentrl's own eval (agentrl/evaluate.py), exactly as `agentrl eval` runs it;
2. Harbor's Terminus-2 agent through Harbor's trial runner and verifier (`harbor run`), in
   agentrl's local sandbox, against an embedded engine started from the same run config and
   loaded with the same checkpoint, reached through SGLang's OpenAI-compatible API
   (agentrl/rollout/embedded/openai_api.py) by LiteLLM.

What is held equal: the model and its weights (base, or the checkpoint pushed through the same
weight-sync path), the tasks, the samples per task (Harbor's attempts), temperature, top_p, the
per-turn token limit (rollout.max_new_tokens -> max_tokens), the turn limit (agent.max_turns) and
the context (agent.max_context_tokens, told to Terminus-2 as the model's input limit), the wall
clock (agent.episode_timeout_s caps each task's agent timeout in both). What
differs, and is the comparison: each harness's own prompt, action protocol and terminal loop.
Terminus-2's context summarisation is turned off (for RL an episode is truncated instead), and so
is its asciinema recording (no asciinema in the local sandbox). A Harbor trial whose verifier gave
no verdict is judged by the control agentrl's own scorer runs (agentrl/harbor/control.py), so that
an agent breaking its sandbox fails in both harnesses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.config.schema import RunConfig

HARNESSES = ("agentrl", "harbor")
HARBOR_AGENT = "terminus-2"
# LiteLLM's OpenAI client insists on a key; the embedded engine checks none. Not a secret.
PLACEHOLDER_API_KEY = "agentrl-embedded-engine"


def terminus_kwargs(cfg: RunConfig, api_base: str) -> dict[str, Any]:
    """Terminus-2's --ak options that hold the run's sampling settings (see the module docstring)."""
    r, a = cfg.rollout, cfg.agent
    return {
        "api_base": api_base, "temperature": r.temperature, "max_turns": a.max_turns,
        "llm_call_kwargs": {"max_tokens": r.max_new_tokens, "top_p": r.top_p},
        "model_info": {"max_input_tokens": a.max_context_tokens, "max_output_tokens": r.max_new_tokens},
        "enable_summarize": False, "proactive_summarization_threshold": 0, "record_terminal_session": False,
        "suppress_max_turns_warning": True,
    }


def tasks_dir_of(cfg: RunConfig) -> Path:
    """The folder of TB2 tasks the run's env plays (env.tasks_dir, or its generated set)."""
    from agentrl.envs.registry import make_run_env

    env = make_run_env(cfg)
    tasks_dir = getattr(env, "tasks_dir", None)
    if cfg.env.name != "tbench2" or tasks_dir is None:
        raise ValueError(f"--harness harbor plays terminal-bench tasks: env.name = {cfg.env.name!r} must be tbench2")
    return Path(tasks_dir)


async def harbor_report(cfg: RunConfig, tasks: list[str], samples: int, *, checkpoint: Path | None,
                        concurrency: int, work_dir: Path) -> dict[str, Any]:
    """Terminus-2 through `harbor run` against the run's engine: agentrl.evaluate's report shape."""
    import asyncio

    from agentrl.evaluate import serving_engine, summarise
    from agentrl.harbor.control import judged_rows
    from agentrl.harbor.jobs import read_job, run_job

    tasks_dir = tasks_dir_of(cfg)
    started = time.perf_counter()
    async with serving_engine(cfg, checkpoint, work_dir, "harbor_engine.log") as (url, version):
        job = await asyncio.to_thread(
            run_job, tasks_dir, HARBOR_AGENT, work_dir / "harbor_jobs", f"eval-{int(time.time())}", tasks=tasks,
            model=f"openai/{cfg.model.name}", agent_kwargs=terminus_kwargs(cfg, f"{url}/v1"),
            n_concurrent=concurrency, n_attempts=samples, agent_max_timeout_s=cfg.agent.episode_timeout_s,
            env={"OPENAI_API_KEY": PLACEHOLDER_API_KEY})
    rows = await judged_rows(read_job(job), tasks_dir, cfg.sandbox)  # agentrl's "who broke it" control
    report = summarise(rows)
    report.update({"harness": "harbor", "agent": HARBOR_AGENT, "job_dir": str(job), "weight_version": version,
                   "wall_s": round(time.perf_counter() - started, 1), "trials": rows})
    return report


async def compare_harnesses(cfg: RunConfig, tasks: list[str], samples: int, *, checkpoint: Path | None,
                            concurrency: int, work_dir: Path,
                            on_episode: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """agentrl's eval, then Harbor's, of the same checkpoint on the same tasks (one after the
    other: each gets the machine's CPUs to itself)."""
    from agentrl.evaluate import evaluate

    tasks_dir_of(cfg)  # refuse a non-TB2 env before any engine starts
    ours = await evaluate(cfg, tasks, samples, checkpoint=checkpoint, concurrency=concurrency,
                          work_dir=work_dir / "agentrl", on_episode=on_episode)
    (work_dir / "harbor").mkdir(parents=True, exist_ok=True)
    theirs = await harbor_report(cfg, tasks, samples, checkpoint=checkpoint, concurrency=concurrency,
                                 work_dir=work_dir / "harbor")
    settings = {"model": cfg.model.name, "checkpoint": str(checkpoint) if checkpoint else None, "tasks": list(tasks),
                "samples_per_task": samples, "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                "max_new_tokens": cfg.rollout.max_new_tokens, "max_turns": cfg.agent.max_turns,
                "max_context_tokens": cfg.agent.max_context_tokens, "episode_timeout_s": cfg.agent.episode_timeout_s}
    return {"settings": settings, "agentrl": ours, "harbor": theirs,
            "pass_rate": {"agentrl": ours["pass_rate"], "harbor": theirs["pass_rate"]}}


def comparison_line(report: dict[str, Any]) -> str:
    parts = []
    for name in HARNESSES:
        r = report[name]
        parts.append(f"{name} {r['pass_rate']} ({r['passed']}/{r['samples']}, 95% CI {r['ci95']}, "
                     f"{r['infra_errors']} infra error(s))")
    return "pass rate: " + "; ".join(parts)
