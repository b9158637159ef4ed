"""Evaluate a policy on tasks without training: `agentrl eval`.

Starts one engine from the run config (the embedded engine locally), optionally loads a trainer
checkpoint's weights into it (the same weight-sync path the run loop uses), then plays N episodes
of every task in real sandboxes and scores them with each task's own tests. The report gives the
pass rate per task and overall with sample counts and a 95% Wilson interval, so two reports (e.g.
the base model and a trained checkpoint on the same held-out tasks) can be compared honestly.

Infrastructure failures are counted apart and never as failed attempts.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.config.schema import RunConfig


def wilson_interval(passed: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a pass rate (sensible at small n and at 0 or n passes)."""
    if n == 0:
        return 0.0, 1.0
    p = passed / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def summarise(episodes: list[dict]) -> dict[str, Any]:
    """Pass rates per task and overall from episode summaries ({task_id, outcome, reward})."""
    per_task: dict[str, dict[str, Any]] = {}
    for e in episodes:
        t = per_task.setdefault(e["task_id"], {"samples": 0, "passed": 0, "infra_errors": 0})
        if e["outcome"].startswith("infra_error"):
            t["infra_errors"] += 1
            continue
        t["samples"] += 1
        t["passed"] += int((e["reward"] or 0.0) >= 1.0)
    for t in per_task.values():
        t["pass_rate"] = t["passed"] / t["samples"] if t["samples"] else None
    n = sum(t["samples"] for t in per_task.values())
    passed = sum(t["passed"] for t in per_task.values())
    low, high = wilson_interval(passed, n)
    return {"pass_rate": passed / n if n else None, "passed": passed, "samples": n,
            "infra_errors": sum(t["infra_errors"] for t in per_task.values()),
            "ci95": [round(low, 4), round(high, 4)],
            "outcomes": dict(Counter(e["outcome"] for e in episodes)),
            "per_task": dict(sorted(per_task.items()))}


def checkpoint_weights(directory: Path) -> tuple[dict, int]:
    """(state dict, weight version) of a torch-backend checkpoint folder (its state.pt)."""
    import torch

    path = Path(directory) / "state.pt"
    if not path.is_file():
        raise FileNotFoundError(f"--checkpoint {directory}: no state.pt there; pass a run's "
                                "checkpoints/latest folder (written every train.checkpoint_every steps)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    return state["model"], int(state["version"])


async def evaluate(cfg: RunConfig, tasks: list[str], samples: int, *, checkpoint: Path | None = None,
                   concurrency: int = 8, work_dir: Path, on_episode: Callable[[dict], None] | None = None) -> dict:
    """Play `samples` episodes of each task against one engine; returns the report dict."""
    from agentrl.agent.episode import run_episode
    from agentrl.cluster.engine_process import EngineProcess, local_engine_argv
    from agentrl.config.plan import resolve_plan
    from agentrl.envs.registry import available_envs
    from agentrl.models.tokenizer import load_tokenizer, stop_token_ids
    from agentrl.rollout.client import EngineClient
    from agentrl.rollout.types import SamplingParams
    from agentrl.sandbox.factory import make_provider

    plan = resolve_plan(cfg)
    spec = plan.engines[0]
    argv, url = local_engine_argv(spec.command, cfg.cluster.host, 0)
    engine = EngineProcess(argv, url, work_dir / "logs" / "eval_engine.log", env=spec.env)
    envs = available_envs()
    if cfg.env.name not in envs:
        raise ValueError(f"env.name={cfg.env.name!r} is not installed; known: {', '.join(envs)}")
    env_cls = envs[cfg.env.name].load()
    tokenizer = load_tokenizer(cfg.model.path or cfg.model.name)
    r = cfg.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              stop_token_ids=stop_token_ids(tokenizer))
    weights, version = checkpoint_weights(checkpoint) if checkpoint is not None else (None, 0)
    run_id = f"eval-{uuid.uuid4().hex[:8]}"
    provider = make_provider(cfg.sandbox, run_id)
    started = time.perf_counter()
    await engine.start()
    try:
        if weights is not None:
            from agentrl.sync.weights import push_weights

            sync = await push_weights([url], weights.items(), version, pause_mode=r.pause_mode)
            if sync["failed_engines"]:
                raise RuntimeError(f"the engine refused the checkpoint's weights: {sync['failed_engines']}")
        client = EngineClient(url, timeout_s=r.request_timeout_s)
        gate = asyncio.Semaphore(concurrency)

        async def one(task_id: str, k: int) -> dict:
            async with gate:
                env = env_cls.from_config(cfg, provider=provider) if hasattr(env_cls, "from_config") \
                    else env_cls(**cfg.env.kwargs)
                gid = f"{run_id}-{task_id}"
                traj = await run_episode(env, client, tokenizer, task_id, cfg.agent, sampling, f"{gid}-{k}", gid)
                summary = {"task_id": task_id, "sample": k, "outcome": traj.outcome, "reward": traj.reward,
                           "turns": traj.num_turns, "generated": traj.num_generated,
                           "text": tokenizer.decode(traj.token_ids[traj.prompt_len:])}
                if on_episode:
                    on_episode(summary)
                return summary

        try:
            episodes = await asyncio.gather(*(one(t, k) for k in range(samples) for t in tasks))
        finally:
            await client.aclose()
    finally:
        engine.stop()
        await provider.aclose()
    report = summarise(list(episodes))
    report.update({"model": cfg.model.name, "checkpoint": str(checkpoint) if checkpoint else None,
                   "weight_version": version, "tasks": list(tasks), "samples_per_task": samples,
                   "temperature": r.temperature, "max_new_tokens": r.max_new_tokens,
                   "max_turns": cfg.agent.max_turns, "wall_s": round(time.perf_counter() - started, 1)})
    with open(work_dir / "eval_episodes.jsonl", "w") as f:
        for e in episodes:
            f.write(json.dumps(e) + "\n")
    return report
