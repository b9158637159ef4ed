"""`agentrl bench learning RUN_DIR`: the learning report of a finished run.

The in-run evals are small (a few samples per task, to keep the run short). This report measures
the held-out pass rates again with many samples, for the model as it started (its own weights) and
for the run's last checkpoint, under the run's own sampling and agent settings, and says whether
each difference is more than noise (one-sided two-proportion z-test, 95% Wilson intervals). Two
held-out splits when the env has them (a generated set's SPLITS.json):
- `eval`: the held-out families (kinds of task never trained on): `eval_before` / `eval_after`;
- `eval_instances`: unseen instances of the trained families: `heldout_instances_before` / `_after`.
Each side of each split plays at least MIN_EPISODES episodes (samples per task raised to reach it).
The train reward curve comes from the run's metrics.jsonl.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import tempfile
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


# Episodes per side of a held-out comparison: at 80 a 15-point gain from ~5% is p < 0.01.
MIN_EPISODES = 80
# The report's name for each split the env may offer (SPLITS.json keys), in report order.
SPLIT_FIELDS = {"eval": "eval", "eval_instances": "heldout_instances"}


def samples_for(tasks: int, samples: int, min_episodes: int = MIN_EPISODES) -> int:
    """Samples per task: at least `samples`, and enough for `min_episodes` episodes in all."""
    return max(samples, -(-min_episodes // max(tasks, 1)))


def compare(before: dict, after: dict, field: str) -> dict[str, Any]:
    """The before/after fields of one split, named `<field>_before`, `<field>_after`, ..."""
    p = two_proportion_p_value(before["passed"], before["samples"], after["passed"], after["samples"])
    return {
        f"{field}_before": before["pass_rate"], f"{field}_after": after["pass_rate"],
        f"{field}_samples": after["samples"], f"{field}_samples_before": before["samples"],
        f"{field}_passed_before": before["passed"], f"{field}_passed_after": after["passed"],
        f"{field}_before_ci95": before["ci95"], f"{field}_after_ci95": after["ci95"],
        f"{field}_gain": (after["pass_rate"] or 0.0) - (before["pass_rate"] or 0.0),
        f"{field}_p_value_one_sided": p,
        f"{field}_infra_errors": [before["infra_errors"], after["infra_errors"]],
    }


def per_family(per_task: dict[str, dict]) -> dict[str, str]:
    """'passed/samples' per task family of a generated set (task ids `<family>-s<seed>-<i>`)."""
    out: dict[str, list[int]] = {}
    for task, r in per_task.items():
        family = task.rsplit("-s", 1)[0]
        counts = out.setdefault(family, [0, 0])
        counts[0] += r["passed"]
        counts[1] += r["samples"]
    return {f: f"{p}/{n}" for f, (p, n) in sorted(out.items())}


def held_out_splits(cfg) -> dict[str, list[str]]:
    """The run's held-out splits by SPLITS.json key: `eval` always, `eval_instances` when offered."""
    from agentrl.envs.base import SplitEnv
    from agentrl.envs.registry import make_run_env
    from agentrl.eval_cli import split_tasks

    env = make_run_env(cfg)
    suggested = dict(env.splits()) if isinstance(env, SplitEnv) else {}
    splits = {"eval": split_tasks(cfg, "eval")}
    if suggested.get("eval_instances"):
        splits["eval_instances"] = list(suggested["eval_instances"])
    return splits


def run_learning_report(run_dir: Path, out: Path, samples: int, concurrency: int = 8,
                        min_episodes: int = MIN_EPISODES, plot: Path | None = None) -> dict[str, Any]:
    from agentrl.config.schema import RunConfig
    from agentrl.eval_cli import split_tasks
    from agentrl.evaluate import evaluate

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} holds no config.json: not a run dir (pass the folder given as "
                                "logging.run_dir)")
    cfg = RunConfig.model_validate_json((run_dir / "config.json").read_text())
    rows = read_rows(run_dir)
    checkpoint = run_dir / "checkpoints" / "latest"
    if not (checkpoint / "state.pt").is_file():
        raise FileNotFoundError(f"{checkpoint}/state.pt not found: the run saved no checkpoint yet")
    splits = held_out_splits(cfg)
    train_tasks = split_tasks(cfg, "train")
    work = out.parent / f"{out.stem}_eval"
    started = time.perf_counter()
    report: dict[str, Any] = {
        "model": cfg.model.name, "recipe": cfg.recipe, "mode": cfg.mode,
        "tasks": {"train": train_tasks, **splits},
        "steps": rows[-1]["step"] if rows else 0,
        "train_wall_clock_s": round(rows[-1]["wall_s"], 1) if rows else None,
    }
    for key, tasks in splits.items():
        field, n = SPLIT_FIELDS[key], samples_for(len(tasks), samples, min_episodes)
        sides = {}
        for side, ckpt in (("before", None), ("after", checkpoint)):
            # The engine's logs and the backend's model cache (~0.5 GB) stay in a scratch folder; only
            # the episodes are kept beside the report.
            with tempfile.TemporaryDirectory(prefix="agentrl-learning-") as scratch:
                sides[side] = asyncio.run(evaluate(cfg, tasks, n, checkpoint=ckpt, concurrency=concurrency,
                                                   work_dir=Path(scratch)))
                (work / key / side).mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(scratch) / "eval_episodes.jsonl", work / key / side / "eval_episodes.jsonl")
        report.update(compare(sides["before"], sides["after"], field))
        report[f"{field}_samples_per_task"] = n
        report["checkpoint_version"] = sides["after"]["weight_version"]
        report[f"{field}_per_family"] = {s: per_family(r["per_task"]) for s, r in sides.items()}
        report[f"{field}_per_task"] = {s: r["per_task"] for s, r in sides.items()}
    report.update({
        "how_judged": "each held-out split under the run's own sampling settings, before (the model's own "
                      "weights) and after (checkpoints/latest); one-sided two-proportion z-test on pass counts "
                      "(infra errors excluded), plus 95% Wilson intervals",
        "train_reward_curve": [{"step": r["step"], "reward_mean": r["reward_mean"]} for r in rows],
        "train_pass_rate_by_version": training_pass_rates(run_dir),
        "in_run_evals": [{"version": r["eval_version"], "pass_rate": r["eval_pass_rate"],
                          "samples": r["eval_samples"]} for r in _distinct_evals(rows)],
        "staleness_max": [r["staleness_max"] for r in rows],
        "settings": {"group_size": cfg.algorithm.group_size, "prompts_per_step": cfg.algorithm.prompts_per_step,
                     "lr": cfg.train.optimizer.lr, "trainable_layers": cfg.train.trainable_layers,
                     "temperature": cfg.rollout.temperature, "max_new_tokens": cfg.rollout.max_new_tokens,
                     "max_turns": cfg.agent.max_turns, "max_staleness": cfg.buffer.max_staleness,
                     "advantage_norm": cfg.algorithm.advantage_norm,
                     "dynamic_sampling": cfg.algorithm.dynamic_sampling,
                     "curriculum": cfg.env.curriculum.sampler},
        "eval_wall_clock_s": round(time.perf_counter() - started, 1),
        "machine": machine(),
    })
    out.write_text(json.dumps(report, indent=2) + "\n")
    if plot is not None:
        plot_learning(report, plot)
    return report


def training_pass_rates(run_dir: Path, bucket: int = 2) -> list[dict]:
    """Pass rate of every training episode the run played (transcripts/*.jsonl), by the weight
    version that wrote it, in buckets of `bucket` versions. Unlike the step's reward_mean, which
    dynamic sampling computes over the kept groups only (those with a success and a failure), this
    counts the dropped all-fail and all-pass groups too: it is the policy's own pass rate."""
    counts: dict[int, list[int]] = {}
    for path in sorted((Path(run_dir) / "transcripts").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            e = json.loads(line) if line.strip() else None
            if not e or e.get("evaluate") or e["outcome"].startswith("infra_error"):
                continue
            version = max(e.get("versions") or [0])
            c = counts.setdefault(version // bucket * bucket, [0, 0])
            c[0] += int(e["passed"])
            c[1] += 1
    return [{"versions": [v, v + bucket - 1], "passed": p, "episodes": n, "pass_rate": round(p / n, 4)}
            for v, (p, n) in sorted(counts.items())]


def plot_learning(report: dict, path: Path) -> None:
    """Training pass rate by weight version, and each held-out split before vs after (95% CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    curve = report.get("train_pass_rate_by_version", [])
    left.plot([sum(c["versions"]) / 2 for c in curve], [c["pass_rate"] for c in curve], "o-",
              label="training episodes (all groups)")
    evals = report.get("in_run_evals", [])
    left.plot([e["version"] for e in evals], [e["pass_rate"] for e in evals], "s-",
              label="in-run eval, held-out families")
    left.set(xlabel="weight version", ylabel="pass rate", ylim=(0, 1), title=report.get("recipe", ""))
    left.legend(loc="upper left")
    names = [f for f in SPLIT_FIELDS.values() if f"{f}_before" in report]
    for i, f in enumerate(names):
        for j, side in enumerate(("before", "after")):
            rate, (low, high) = report[f"{f}_{side}"] or 0.0, report[f"{f}_{side}_ci95"]
            right.bar(i * 3 + j, rate, color=("tab:gray", "tab:green")[j], label=side if i == 0 else None,
                      yerr=[[rate - low], [high - rate]], capsize=4)
    right.set_xticks([i * 3 + 0.5 for i in range(len(names))],
                     [{"eval": "held-out\nfamilies", "heldout_instances": "held-out\ninstances"}[f] for f in names])
    right.set(ylim=(0, 1), title="before vs after (95% CI)")
    right.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _distinct_evals(rows: list[dict]) -> list[dict]:
    seen: dict[int, dict] = {}
    for r in rows:
        if r.get("eval_version") is not None and r.get("eval_pass_rate") is not None:
            seen[r["eval_version"]] = r
    return [seen[v] for v in sorted(seen)]
