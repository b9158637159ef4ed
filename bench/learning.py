"""`agentrl bench learning RUN_DIR`: the learning report of a finished run.

The in-run evals are small (a few samples per task, to keep the run short). This report measures
the held-out pass rate again with many samples, for the model as it started (its own weights) and
for the run's last checkpoint, under the run's own sampling and agent settings, and says whether
the difference is more than noise (one-sided two-proportion z-test). The train reward curve comes
from the run's metrics.jsonl.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.machine import machine


def two_proportion_p_value(passed_a: int, n_a: int, passed_b: int, n_b: int) -> float | None:
    """One-sided p-value that rate b exceeds rate a only by chance (pooled z-test)."""
    if n_a == 0 or n_b == 0:
        return None
    pooled = (passed_a + passed_b) / (n_a + n_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    if se == 0:
        return 1.0 if passed_b / n_b <= passed_a / n_a else 0.0
    z = (passed_b / n_b - passed_a / n_a) / se
    return 0.5 * math.erfc(z / math.sqrt(2))


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: RUN_DIR must be a finished run's directory")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_learning_report(run_dir: Path, out: Path, samples: int, concurrency: int = 8) -> dict[str, Any]:
    from agentrl.config.schema import RunConfig
    from agentrl.eval_cli import split_tasks
    from agentrl.evaluate import evaluate

    run_dir = Path(run_dir)
    cfg = RunConfig.model_validate_json((run_dir / "config.json").read_text())
    rows = read_rows(run_dir)
    checkpoint = run_dir / "checkpoints" / "latest"
    if not (checkpoint / "state.pt").is_file():
        raise FileNotFoundError(f"{checkpoint}/state.pt not found: the run saved no checkpoint yet")
    eval_tasks = split_tasks(cfg, "eval")
    train_tasks = split_tasks(cfg, "train")
    work = out.parent / f"{out.stem}_eval"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    before = asyncio.run(evaluate(cfg, eval_tasks, samples, concurrency=concurrency, work_dir=work / "before"))
    after = asyncio.run(evaluate(cfg, eval_tasks, samples, checkpoint=checkpoint, concurrency=concurrency,
                                 work_dir=work / "after"))
    p = two_proportion_p_value(before["passed"], before["samples"], after["passed"], after["samples"])
    report = {
        "model": cfg.model.name,
        "recipe": cfg.recipe,
        "mode": cfg.mode,
        "tasks": {"train": train_tasks, "eval": eval_tasks},
        "steps": rows[-1]["step"] if rows else 0,
        "checkpoint_version": after["weight_version"],
        "train_wall_clock_s": round(rows[-1]["wall_s"], 1) if rows else None,
        "eval_before": before["pass_rate"],
        "eval_after": after["pass_rate"],
        "eval_samples": after["samples"],
        "eval_samples_before": before["samples"],
        "eval_before_ci95": before["ci95"],
        "eval_after_ci95": after["ci95"],
        "eval_gain": (after["pass_rate"] or 0.0) - (before["pass_rate"] or 0.0),
        "p_value_one_sided": p,
        "how_judged": "held-out tasks, the same sampling settings before and after; one-sided two-proportion "
                      "z-test on pass counts (infra errors excluded), plus 95% Wilson intervals",
        "eval_per_task_before": before["per_task"],
        "eval_per_task_after": after["per_task"],
        "train_reward_curve": [{"step": r["step"], "reward_mean": r["reward_mean"]} for r in rows],
        "in_run_evals": [{"version": r["eval_version"], "pass_rate": r["eval_pass_rate"],
                          "samples": r["eval_samples"]} for r in _distinct_evals(rows)],
        "staleness_max": [r["staleness_max"] for r in rows],
        "settings": {"group_size": cfg.algorithm.group_size, "prompts_per_step": cfg.algorithm.prompts_per_step,
                     "lr": cfg.train.optimizer.lr, "trainable_layers": cfg.train.trainable_layers,
                     "temperature": cfg.rollout.temperature, "max_new_tokens": cfg.rollout.max_new_tokens,
                     "max_turns": cfg.agent.max_turns, "max_staleness": cfg.buffer.max_staleness},
        "eval_wall_clock_s": round(time.perf_counter() - started, 1),
        "machine": machine(),
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _distinct_evals(rows: list[dict]) -> list[dict]:
    seen: dict[int, dict] = {}
    for r in rows:
        if r.get("eval_version") is not None and r.get("eval_pass_rate") is not None:
            seen[r["eval_version"]] = r
    return [seen[v] for v in sorted(seen)]
