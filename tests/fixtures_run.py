"""A realistic fake run dir, for tests of anything that reads one (the report, the curves).

`write_fake_run(path)` simulates an async run: every step trains on groups whose episodes were
generated up to `max_staleness` versions earlier, multi-turn episodes that span weight updates,
rewards that improve, evals every few versions, a few timeouts, truncations and infra errors.
It writes exactly the files and fields the orchestrator and EpisodeWorker write: config.json
(a validated RunConfig), metrics.jsonl, summary.json, transcripts/worker_N.jsonl and
logs/engine_0.log. With `hostile=True` one episode carries markup in its task id, outcome, error
and text, as untrusted model output and task folders may.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS = ["hello-file", "count-lines", "fix-permissions", "json-extract", "git-init-commit", "sort-csv"]
HOSTILE_TEXT = '<script>alert("pwned")</script><img src=x onerror=alert(1)> & "quotes" </pre></details>'
HOSTILE_TASK = "<img src=x onerror=alert(2)>"


def _config(steps: int, group_size: int, prompts: int, max_staleness: int, eval_every: int) -> dict:
    from agentrl.config.schema import RunConfig

    d = RunConfig().model_dump(mode="json")
    d["recipe"] = "local-smollm2"
    d["model"]["name"] = "smollm2-135m"
    d["train"]["max_steps"] = steps
    d["algorithm"].update(group_size=group_size, prompts_per_step=prompts)
    d["buffer"]["max_staleness"] = max_staleness
    d["env"].update(eval_every=eval_every, eval_tasks=TASKS[:2])
    return RunConfig.model_validate(d).model_dump(mode="json")


def _text(rng: random.Random, task: str, turns: int, passed: bool) -> str:
    parts = []
    for t in range(turns):
        last = t == turns - 1
        cmd = rng.choice(
            [
                "ls -la /app",
                "cat /app/input.txt",
                "echo hello > /app/hello.txt",
                "wc -l data.csv",
                "chmod 644 /app/secret.txt",
                "git init && git add -A && git commit -m init",
            ]
        )
        reply = (
            f"Let me work on {task}.\n```bash\n{cmd}\n```"
            if not last
            else ("The task is done.\nTASK_COMPLETE" if passed else f"```bash\n{cmd} # retry\n```")
        )
        parts.append(f"<|im_start|>assistant\n{reply}<|im_end|>\n")
        if not last:
            parts.append(
                f"<|im_start|>user\n{rng.choice(['(no output)', 'total 8', '3 data.csv', 'Permission denied'])}"
                "<|im_end|>\n"
            )
    return "".join(parts)


def _episode(rng, ep_id, task, group, version, max_staleness, step, evaluate, with_turns) -> dict:
    turns = rng.randint(1, 6)
    start = max(0, version - (0 if evaluate else rng.randint(0, max_staleness)))
    per_turn, v = [], start
    for _ in range(turns):
        if not evaluate and v < version and rng.random() < 0.35:
            v += 1  # a weight update landed between turns
        per_turn.append([v] if rng.random() > 0.1 or v >= version else [v, v + 1])
    roll = rng.random()
    if roll < 0.04:
        outcome, reward = rng.choice(["infra_error:create", "infra_error:engine", "infra_error:lost"]), None
    elif roll < 0.08:
        outcome, reward = "agent_timeout", 0.0
    elif roll < 0.11:
        outcome, reward = "truncated", 0.0
    else:
        outcome, reward = "scored", 1.0 if rng.random() < 0.15 + 0.05 * step else 0.0
    generated = sum(rng.randint(20, 300) for _ in range(turns))
    versions = sorted({x for t in per_turn for x in t})
    row = {
        "episode_id": ep_id,
        "task_id": task,
        "group_id": group,
        "outcome": outcome,
        "reward": reward,
        "tokens": generated + 180 + 40 * turns,
        "generated": generated,
        "turns": turns,
        "oldest_version": versions[0],
        "evaluate": evaluate,
        "duration_s": round(rng.uniform(2, 40), 2),
        "timings": {
            "generate_s": round(rng.uniform(1, 20), 2),
            "env_s": round(rng.uniform(0.5, 8), 2),
            "score_s": round(rng.uniform(0.1, 2), 2),
            "close_s": 0.05,
            "total_s": 30.0,
        },
        "info": {
            "parse_errors": rng.randint(0, 1),
            "actions": turns,
            "stop": "task_complete" if reward else "max_turns",
            "finish_reasons": ["stop"] * turns,
        },
        "text": _text(rng, task, turns, reward == 1.0),
        "versions": versions,
    }
    if outcome.startswith("infra_error"):
        row["info"]["error"] = f"reset: SandboxError: {outcome.split(':')[1]} failed after 3 attempts"
    if with_turns:
        row["turn_versions"] = per_turn
    return row


def write_fake_run(
    run_dir: str | Path,
    *,
    steps: int = 12,
    group_size: int = 4,
    prompts_per_step: int = 2,
    max_staleness: int = 2,
    eval_every: int = 5,
    workers: int = 2,
    seed: int = 0,
    hostile: bool = True,
    finished: bool = True,
) -> Path:
    """Write a fake run into run_dir (created) and return it. Deterministic for a seed."""
    rng = random.Random(seed)
    run = Path(run_dir)
    (run / "transcripts").mkdir(parents=True, exist_ok=True)
    (run / "logs").mkdir(exist_ok=True)
    (run / "config.json").write_text(
        json.dumps(_config(steps, group_size, prompts_per_step, max_staleness, eval_every), indent=2)
    )
    transcripts: list[list[dict]] = [[] for _ in range(workers)]  # rows per worker file, in write order
    outcomes: dict[str, int] = {}
    rows, evals, t0, wall, n_ep = [], [], 1_790_000_000.0, 0.0, 0
    for step in range(1, steps + 1):
        version = step - 1
        staleness = []
        rewards = []
        for g in range(prompts_per_step):
            task, group = rng.choice(TASKS), f"g{step:03d}{g:02d}{rng.getrandbits(24):06x}"
            eps = [
                _episode(
                    rng,
                    f"{group}-{k}",
                    task,
                    group,
                    version,
                    max_staleness,
                    step,
                    False,
                    with_turns=n_ep % 3 != 0,
                )
                for k in range(group_size)
            ]
            for e in eps:
                n_ep += 1
                outcomes[e["outcome"]] = outcomes.get(e["outcome"], 0) + 1
                rewards.append(e["reward"] or 0.0)
                transcripts[n_ep % workers].append(e)
            staleness.append(version - min(e["oldest_version"] for e in eps))
        if hostile and step == 2:
            e = _episode(
                rng, "gHOSTILE-0", HOSTILE_TASK, "gHOSTILE", version, max_staleness, step, False, True
            )
            e.update(text=HOSTILE_TEXT, outcome="infra_error:<script>kind</script>", reward=None)
            e["info"]["error"] = "</pre><script>alert(3)</script>"
            transcripts[0].append(e)
        if (step - 1) % eval_every == 0:
            evs = [
                _episode(rng, f"eval{version}-{t}-{k}", t, f"eval{version}-{t}", version, 0, step, True, True)
                for t in TASKS[:2]
                for k in range(2)
            ]
            for e in evs:
                transcripts[0].append(e)
            scored = [e for e in evs if not e["outcome"].startswith("infra_error")]
            evals.append(
                {
                    "eval_version": version,
                    "eval_samples": len(scored),
                    "eval_pass_rate": sum(1 for e in scored if e["reward"] == 1.0) / max(len(scored), 1),
                    "eval_infra_errors": len(evs) - len(scored),
                }
            )
        step_time = rng.uniform(1.5, 3.0)
        wall += step_time + rng.uniform(2, 6)
        finished_eps = sum(outcomes.values())
        row = {
            "step": step,
            "weight_version": step,
            "reward_mean": sum(rewards) / len(rewards),
            "staleness_max": max(staleness),
            "staleness_mean": sum(staleness) / len(staleness),
            "episodes_infra_error": sum(v for k, v in outcomes.items() if k.startswith("infra_error")),
            "episodes_finished": finished_eps,
            "outcomes": dict(outcomes),
            "episodes_per_s": finished_eps / wall,
            "gen_tokens_per_s": rng.uniform(400, 900),
            "trainer_idle_ratio": rng.uniform(0.1, 0.5),
            "wall_s": wall,
            "time": t0 + wall,
            "loss": rng.uniform(-0.05, 0.05),
            "grad_norm": rng.uniform(0.2, 1.5),
            "advantage_abs_mean": rng.uniform(0.3, 0.9),
            "zero_variance_groups": rng.randint(0, 1),
            "groups": prompts_per_step,
            "loss_tokens": rng.randint(2000, 6000),
            "micro_batches": 2,
            "tis_clip_frac": rng.uniform(0, 0.02),
            "tis_weight_mean": rng.uniform(0.97, 1.0),
            "pg_clip_frac": rng.uniform(0, 0.1),
            "rollout_train_mismatch": rng.uniform(0, 1e-3),
            "oldest_token_version": version - max(staleness),
            "step_time_s": step_time,
            "sync_s": rng.uniform(0.2, 0.8),
            "sync_paused_s": 0.1,
            "sync_bytes": 270_000_000,
            "sync_buckets": 3,
            "staleness": staleness,
        }
        if evals:
            row.update(evals[-1])
        rows.append(row)
    for w, rows_w in enumerate(transcripts):
        with open(run / "transcripts" / f"worker_{w}.jsonl", "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in rows_w)
    with open(run / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if finished:
        (run / "summary.json").write_text(
            json.dumps(
                {
                    "steps": steps,
                    "wall_s": wall,
                    "last": rows[-1],
                    "evals": evals,
                    "buffer": {
                        "groups": 0,
                        "accepted": n_ep // group_size,
                        "trained": steps * prompts_per_step,
                    },
                },
                indent=2,
            )
        )
    (run / "logs" / "engine_0.log").write_text("engine: listening on http://127.0.0.1:31000\n")
    return run
