"""Replay buffer: ingest and serve rates, with durability (fsync before ack) on and off.

Ingest: `add` of complete groups of trajectories of `tokens` tokens each (token ids, loss mask,
rollout logprobs, weight versions: the size a real episode writes). Serve: `take_batch` of a
step's groups, their trajectories (as the trainer fetches them) + `mark_trained`, until the buffer
is empty. Recovery: reopening the log of the whole run. The cost of durability is the ingest time
with fsync over the time without, and the fsync's share of one add; the log lives on the disk of
`directory` (default: the temp dir).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.machine import machine


def _trajectory(gid: str, k: int, tokens: int, rng: random.Random) -> Any:
    from agentrl.agent.trajectory import SCORED, Trajectory

    prompt = tokens // 4
    return Trajectory(episode_id=f"{gid}-{k}", task_id="t", group_id=gid, prompt_len=prompt,
                      token_ids=[rng.randrange(150_000) for _ in range(tokens)],
                      loss_mask=[0] * prompt + [1] * (tokens - prompt),
                      rollout_logprobs=[0.0] * prompt + [-rng.random() * 5 for _ in range(tokens - prompt)],
                      weight_versions=[-1] * prompt + [3] * (tokens - prompt), outcome=SCORED, reward=rng.random())


def _one(directory: Path, fsync: bool, groups: int, group_size: int, groups_per_step: int, tokens: int) -> dict:
    from agentrl.buffer.replay import LOG_NAME, ReplayBuffer

    rng = random.Random(0)
    trajs = [_trajectory(f"g{g}", k, tokens, rng) for g in range(groups) for k in range(group_size)]
    buf = ReplayBuffer(directory, group_size, max_staleness=4, fsync=fsync)
    t0 = time.perf_counter()
    for t in trajs:
        buf.add(t)
    ingest = time.perf_counter() - t0
    log_bytes = (directory / LOG_NAME).stat().st_size
    t0 = time.perf_counter()
    step = 0
    served = 0
    while (batch := buf.take_batch(groups_per_step, current_version=3)) is not None:
        step += 1
        served += len(buf.batch_trajectories(batch.batch_id))  # what the trainer ranks fetch
        buf.mark_trained(step, batch.batch_id)
    serve = time.perf_counter() - t0
    buf.close()
    t0 = time.perf_counter()
    again = ReplayBuffer(directory, group_size, max_staleness=4, fsync=fsync, resume_step=step)
    recover = time.perf_counter() - t0
    left = again.ready_groups()  # every group was trained: a resume at the last step has none
    again.close()
    n = len(trajs)
    return {"fsync": fsync, "trajectories": n, "log_mb": log_bytes / 1e6, "ingest_s": ingest,
            "ingest_traj_per_s": n / ingest, "ingest_mb_per_s": log_bytes / ingest / 1e6, "ms_per_add": ingest / n * 1e3,
            "serve_steps": step, "served_trajectories": served, "serve_s": serve, "serve_traj_per_s": n / serve if serve else None,
            "recover_s": recover, "recover_traj_per_s": n / recover if recover else None,
            "groups_ready_after_recovery": left}


def run_buffer_bench(out_path: str | Path, groups: int = 64, group_size: int = 8, groups_per_step: int = 8,
                     tokens: int = 2048, directory: str | Path | None = None) -> dict:
    if min(groups, group_size, groups_per_step, tokens) < 1:
        raise ValueError("groups, group_size, groups_per_step and tokens must be >= 1")
    report: dict[str, Any] = {"benchmark": "buffer", "machine": machine(),
                              "settings": {"groups": groups, "group_size": group_size,
                                           "groups_per_step": groups_per_step, "tokens_per_trajectory": tokens}}
    with tempfile.TemporaryDirectory(prefix="agentrl-buffer-bench-", dir=directory) as tmp:
        report["directory"] = tmp
        for fsync in (False, True):  # alternate order would not help: each gets a fresh log
            report["fsync_on" if fsync else "fsync_off"] = _one(Path(tmp) / str(fsync), fsync, groups, group_size,
                                                                groups_per_step, tokens)
    on, off = report["fsync_on"], report["fsync_off"]
    report["durability_cost_x"] = on["ingest_s"] / off["ingest_s"]
    report["fsync_ms_per_add"] = on["ms_per_add"] - off["ms_per_add"]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
