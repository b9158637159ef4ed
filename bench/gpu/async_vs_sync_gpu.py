#!/usr/bin/env python3
"""Async vs sync where trainer and rollouts do not share two cores: the async-vs-sync benchmark
(bench/async_sync.py: the real run loop, lognormal episodes in real bubblewrap sandboxes, the same
steps and batch in both modes) on the GPU machine, the Megatron trainer (tiny GLM, bf16) and the
embedded engine on the H200 (the gpu_smoke recipe: cluster.colocate), the sandboxes and episode
workers on the host's cores. Writes bench/results/async_vs_sync_gpu.json: speedup, trainer and
engine (rollout) idle ratios, the bottleneck stage's idle ratio, staleness p50/p95, episodes in
flight, machine and versions. The issue's goal: speedup >= 2.5 and the bottleneck idle <= 0.10.

The integrator's command on the H200, from the repository root (Ray, pydantic and their small
wheels importable as REFERENCE.md section 8 describes, e.g. PYTHONPATH=/tmp/site; bubblewrap on
PATH, e.g. its .deb unpacked with `dpkg -x bubblewrap_*.deb /tmp/bw` and PATH=/tmp/bw/usr/bin:$PATH;
the lognormal env needs no tmux):

    python bench/gpu/async_vs_sync_gpu.py --out "$OUT/async_vs_sync_gpu.json"

About 2 x (start-up + steps x step time): the defaults (16 steps of 8 x 4 episodes, median episode
1 s, prompts of about 2K tokens) took 8.3 minutes on the H200 (bench/results/async_vs_sync_gpu.json:
sync 270 s, async 100 s, 50-60 s of start-up each); bench/gpu/pending.sh runs it. `--check` resolves the plan,
lists what the machine lacks and runs nothing (the CPU test runs it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECIPE = "gpu_smoke"  # one H200: a Megatron rank and one embedded engine sharing it
# Host placement: 16 cores for the sandboxes and episode workers; the engine batches every episode
# in flight. More episode workers spread the sandboxes' exec overhead over processes.
# The context limit holds the long prompts (--context-words 500 is 2,049 tiny-tokenizer tokens; the
# recipe's 2,048 had left 1,500 words, 6,166 tokens, no room: every episode was a prompt nobody answered).
GPU_SETS = ("cluster.num_cpus=16", "cluster.episode_workers=4", "rollout.embedded.max_batch_size=128",
            "sandbox.backend=local", "agent.max_context_tokens=4096")
WHAT = ("async vs sync on one H200: Megatron trainer rank + embedded engine sharing the GPU (gpu_smoke), "
        "lognormal episodes in local bubblewrap sandboxes on the host's cores")


def workload(args: argparse.Namespace):
    from bench.async_sync import Workload

    # Long prompts (context_words) make the trainer's step the larger cost, so that rollouts keep
    # ahead and the trainer is the stage whose idle ratio the goal reads; tune with --context-words.
    return Workload(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                    median_s=args.median_s, sigma=args.sigma, max_s=args.max_s, in_flight=args.in_flight,
                    max_staleness=args.max_staleness, context_words=args.context_words, lr=args.lr)


def missing() -> list[str]:
    """What this machine lacks for the run, one line each (empty: ready)."""
    import importlib.util

    out = []
    for mod in ("torch", "ray", "pydantic", "megatron.core"):
        if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None:
            out.append(f"{mod} is not importable: carry its wheel (REFERENCE.md section 8) and set PYTHONPATH")
    if not out:
        import torch

        if not torch.cuda.is_available():
            out.append("no CUDA device: run this on the GPU machine")
    if shutil.which("bwrap") is None:
        out.append("bwrap is not on PATH: unpack the bubblewrap .deb (dpkg -x) and add its usr/bin to PATH")
    elif not out:
        out += sandbox_probe()
    return out


def sandbox_probe() -> list[str]:
    """One real local sandbox: created, one command run, closed (the last GPU attempt lost every
    episode to infra_error:create without a message; this names the cause before anything starts)."""
    import asyncio

    from agentrl.sandbox.base import SandboxSpec
    from agentrl.sandbox.local import LocalSandboxProvider

    async def probe() -> str:
        box = await LocalSandboxProvider(run_id="gpu-probe").create(SandboxSpec(image="local"))
        try:
            r = await box.exec("echo sandbox-ok", timeout_s=30)
            return r.output.strip()
        finally:
            await box.close()

    try:
        got = asyncio.run(probe())
    except Exception as e:  # noqa: BLE001 - reported, the run is refused
        return [f"a local sandbox does not work here: {type(e).__name__}: {e}"]
    return [] if got == "sandbox-ok" else [f"a local sandbox ran `echo` and printed {got!r}"]


def check(args: argparse.Namespace) -> dict:
    """The resolved plan of both modes and what is missing; runs nothing."""
    from agentrl.config.loader import load_config
    from agentrl.config.plan import resolve_plan
    from bench.async_sync import overrides

    w = workload(args)
    w.check()
    plans = {}
    for mode in ("sync", "async"):
        cfg = load_config(RECIPE, overrides(w, mode, Path("/tmp/agentrl-async-vs-sync-gpu") / mode) + list(GPU_SETS))
        plan = resolve_plan(cfg)
        plans[mode] = {"backend": plan.backend, "engine": plan.engine_kind, "transport": plan.weight_transport,
                       "colocated": plan.colocated, "hardware": cfg.cluster.hardware, "env": cfg.env.name,
                       "layout": plan.layout.describe(), "episodes_in_flight": cfg.buffer.max_episodes_in_flight}
    return {"plans": plans, "missing": missing()}


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "async_vs_sync_gpu.json")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--median-s", type=float, default=1.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-s", type=float, default=15.0)
    ap.add_argument("--in-flight", type=int, default=128)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--context-words", type=int, default=500)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--check", action="store_true", help="resolve the plan, list what is missing, run nothing")
    return ap.parse_args(argv)


def stop_code(report: dict, check_only: bool) -> int | None:
    """With --check: print the report and return its exit code (1 when something is missing).
    Otherwise return 1 (after saying what) when something is missing, None to go on."""
    if check_only:
        print(json.dumps(report, indent=2))
        return 1 if report["missing"] else 0
    if report["missing"]:
        print("cannot run:\n  " + "\n  ".join(report["missing"]), file=sys.stderr)
        return 1
    return None


def main(argv: list[str]) -> int:
    args = parse(argv)
    stop = stop_code(check(args), args.check)
    if stop is not None:
        return stop
    from bench.async_sync import run_async_vs_sync

    r = run_async_vs_sync(args.out, workload(args), recipe=RECIPE, extra=GPU_SETS, what=WHAT)
    keys = ("speedup", "trainer_idle_ratio_async", "engine_idle_ratio_async", "bottleneck_idle_ratio_async",
            "staleness_p50", "staleness_p95", "episodes_in_flight_mean_async", "goal_met_bottleneck")
    print(json.dumps({k: r.get(k) for k in keys}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
