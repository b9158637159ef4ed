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
import contextlib
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
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
    from agentrl.agent.runner import passed

    per_task: dict[str, dict[str, Any]] = {}
    for e in episodes:
        t = per_task.setdefault(e["task_id"], {"samples": 0, "passed": 0, "infra_errors": 0})
        if e["outcome"].startswith("infra_error"):
            t["infra_errors"] += 1
            continue
        t["samples"] += 1
        t["passed"] += int(passed(e["outcome"], e["reward"]))
    for t in per_task.values():
        t["pass_rate"] = t["passed"] / t["samples"] if t["samples"] else None
    n = sum(t["samples"] for t in per_task.values())
    n_pass = sum(t["passed"] for t in per_task.values())
    low, high = wilson_interval(n_pass, n)
    return {"pass_rate": n_pass / n if n else None, "passed": n_pass, "samples": n,
            "infra_errors": sum(t["infra_errors"] for t in per_task.values()),
            "ci95": [round(low, 4), round(high, 4)],
            "outcomes": dict(Counter(e["outcome"] for e in episodes)),
            "per_task": dict(sorted(per_task.items()))}


def checkpoint_weights(cfg: RunConfig, directory: Path, work_dir: Path) -> tuple[list, int]:
    """(HF-named weights, weight version) of a run's checkpoint folder, loaded through the run's
    own trainer backend (torch or Megatron) on one rank, so every backend's checkpoint works."""
    from agentrl.config.plan import resolve_plan
    from agentrl.train.factory import make_backend
    from agentrl.train.megatron_parallel import DistInit

    directory = Path(directory)
    if not directory.is_dir() or not any(directory.iterdir()):
        raise FileNotFoundError(f"--checkpoint {directory}: not a checkpoint folder; pass a run's "
                                "checkpoints/latest (written every train.checkpoint_every steps)")
    one = cfg.model_copy(deep=True)
    one.cluster.cpu_trainer_ranks = 1
    backend = make_backend(one, resolve_plan(one), DistInit.single(), work_dir)
    backend.load_checkpoint(directory)
    return [(n, t.detach().cpu().clone()) for n, t in backend.named_weights()], backend.version


@contextlib.asynccontextmanager
async def serving_engine(cfg: RunConfig, checkpoint: Path | None, work_dir: Path,
                         log_name: str = "eval_engine.log") -> AsyncIterator[tuple[str, int]]:
    """(URL, weight version) of one engine of the run config, serving the checkpoint's weights when
    one is given; stopped on exit. What `agentrl eval` and `agentrl eval --harness harbor` play against."""
    from agentrl.cluster.engine_process import EngineProcess, free_port
    from agentrl.config.plan import resolve_plan
    from agentrl.rollout.engine_cmd import engine_argv

    spec = resolve_plan(cfg, check_runnable=False).engines[0]
    host = cfg.cluster.host if cfg.cluster.host != "node_ip" else "127.0.0.1"
    port = free_port(host)
    url = f"http://{host}:{port}"
    weights, version = checkpoint_weights(cfg, checkpoint, work_dir) if checkpoint is not None else (None, 0)
    engine = EngineProcess(engine_argv(cfg, spec, node_rank=0, host=host, port=port, dist_init_addr=None), url,
                           work_dir / "logs" / log_name, env=spec.env)
    await engine.start()
    try:
        if weights is not None:
            from agentrl.sync.weights import push_weights

            sync = await push_weights([url], weights, version, pause_mode=cfg.rollout.pause_mode)
            if sync["failed_engines"]:
                raise RuntimeError(f"the engine refused the checkpoint's weights: {sync['failed_engines']}")
        yield url, version
    finally:
        engine.stop()


async def evaluate(cfg: RunConfig, tasks: list[str], samples: int, *, checkpoint: Path | None = None,
                   concurrency: int = 8, work_dir: Path, on_episode: Callable[[dict], None] | None = None) -> dict:
    """Play `samples` episodes of each task against one engine; returns the report dict."""
    from agentrl.agent.runner import EpisodeRunner
    from agentrl.rollout.client import EngineClient
    from agentrl.sandbox.factory import make_provider

    r = cfg.rollout
    run_id = f"eval-{uuid.uuid4().hex[:8]}"
    provider = make_provider(cfg.sandbox, run_id)
    started = time.perf_counter()
    try:
        async with serving_engine(cfg, checkpoint, work_dir) as (url, version):
            client = EngineClient(url, timeout_s=r.request_timeout_s)
            runner = EpisodeRunner(cfg, client, provider)
            gate = asyncio.Semaphore(concurrency)

            async def one(task_id: str, k: int) -> dict:
                async with gate:
                    gid = f"{run_id}-{task_id}"
                    traj, s = await runner.run(task_id, f"{gid}-{k}", gid, evaluate=True)
                    summary = {**s.to_dict(), "sample": k, "text": runner.decode_reply(traj)}
                    if on_episode:
                        on_episode(summary)
                    return summary

            try:
                episodes = await asyncio.gather(*(one(t, k) for k in range(samples) for t in tasks))
            finally:
                await client.aclose()
    finally:
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
