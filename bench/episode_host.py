#!/usr/bin/env python3
"""The host side of the episode loop, without an engine: N episodes of a run config's training
tasks through the real EpisodeRunner (its env, sandboxes and the tasks' own tests), with every
generation answered at once by a fixed command. What is left is what an episode costs the machine
besides inference: sandbox create and set-up (env_s), the tests (score_s), delete (close_s), and the
episode worker's own Python.

Why: on the H200 machine (session 11, bench/results/engine_agent_h200.json) a gpu_smollm2 episode
took 13.4 s, of which generation was 1.6 s; the engine there serves ~40 requests/s, the loop ran
~4.7 episodes/s. This says whether the sandboxes of that machine are slow on their own (run it
there) or only inside the loop.

    python3 bench/episode_host.py --config gpu_smollm2 --set model.name=tiny --episodes 256 \\
        --concurrency 64 --out "$OUT/episode_host.json"

Reports episodes/s, this process's and its children's CPU seconds per episode, and each phase's
median and p90 (EpisodeRunner's timings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class InstantGenerator:
    """Answers every turn at once with `command` in a bash block and the tokenizer's EOS."""

    def __init__(self, tokenizer, command: str) -> None:
        self.ids = tokenizer.encode(f"```bash\n{command}\n```", add_special_tokens=False)
        eos = tokenizer.eos_token_id
        if eos is not None:
            self.ids.append(eos)

    async def generate(self, input_ids, sampling, *, session_id, rid=None):
        from agentrl.rollout.types import GenerateResult

        await asyncio.sleep(0)
        n = len(self.ids)
        return GenerateResult(list(self.ids), [-0.1] * n, [0] * n, "stop", len(input_ids), 0, rid)


def _quantiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {"median": round(statistics.median(values), 4), "p90": round(values[int(0.9 * (len(values) - 1))], 4),
            "mean": round(statistics.fmean(values), 4)}


async def run(args) -> dict:
    from agentrl.agent.runner import EpisodeRunner
    from agentrl.config.loader import load_config
    from agentrl.sandbox.factory import make_provider

    cfg = load_config(args.config, args.set)
    runner = EpisodeRunner(cfg, None, make_provider(cfg.sandbox, "episode-host-bench"))
    runner.generator = InstantGenerator(runner.tokenizer, args.command)
    ids, suggested = runner.tasks()
    train = suggested.get("train") or ids
    rng = random.Random(args.seed)
    plan = [rng.choice(train) for _ in range(args.episodes)]
    gate = asyncio.Semaphore(args.concurrency)
    timings, outcomes = [], {}

    async def one(i: int, task: str) -> None:
        async with gate:
            traj, summary = await runner.run(task, f"host-{i}", f"host-g{i}")
            timings.append(traj.timings)
            outcomes[summary.outcome] = outcomes.get(summary.outcome, 0) + 1

    t0, cpu0, ch0 = time.perf_counter(), time.process_time(), os.times()
    await asyncio.gather(*(one(i, t) for i, t in enumerate(plan)))
    wall, cpu, ch1 = time.perf_counter() - t0, time.process_time() - cpu0, os.times()
    children = (ch1.children_user - ch0.children_user) + (ch1.children_system - ch0.children_system)
    phases = sorted({k for t in timings for k, v in t.items() if isinstance(v, int | float)})
    return {
        "episodes": args.episodes, "concurrency": args.concurrency, "tasks": len(train), "outcomes": outcomes,
        "wall_s": round(wall, 2), "episodes_per_s": round(args.episodes / wall, 2),
        "process_cpu_ms_per_episode": round(1000 * cpu / args.episodes, 1),
        "children_cpu_ms_per_episode": round(1000 * children / args.episodes, 1),
        "phase_s": {k: _quantiles([t[k] for t in timings if isinstance(t.get(k), int | float)]) for k in phases},
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="gpu_smollm2", help="recipe name or YAML path (its env, tasks, sandbox)")
    ap.add_argument("--set", action="append", default=[], help="override a config field (repeatable), e.g. "
                    "model.name=tiny: its tokenizer ships with agentrl, so no model weights are needed")
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--command", default="ls /app > /tmp/listing.txt", help="the reply of every turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.episodes < 1 or args.concurrency < 1:
        ap.error("--episodes and --concurrency must be >= 1")
    from bench.machine import machine

    report = {"benchmark": "episode_host", "machine": machine(), "config": args.config, "overrides": args.set,
              "command": args.command, **asyncio.run(run(args))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("episodes_per_s", "process_cpu_ms_per_episode",
                                              "children_cpu_ms_per_episode", "phase_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
