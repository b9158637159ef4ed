#!/usr/bin/env python3
"""Partial rollout off vs on where decoding scales with the batch: the partial-rollout benchmark
(bench/partial.py: the real run loop, the multi-turn `turns` env, variants interleaved) on the GPU
machine, the Megatron trainer and the embedded engine sharing the H200 (the gpu_smoke recipe, as
bench/gpu/async_vs_sync_gpu.py places them). Writes bench/results/partial_rollout_gpu.json.

Why the GPU: on the 2-core VM the engine and trainer share the cores, so neither more episodes in
flight (300 -> 247 generated tokens/s at 34 instead of 15) nor longer episodes (off wastes 4%)
leave partial rollout anything to gain (README, "Partial rollout and in-flight resume"). With
partial rollout the staleness bound holds per token, so admission may run `--lead-steps` further
ahead (rollout.partial_lead_steps): more episodes in flight, which only pays where a bigger batch
decodes faster. The default variants are off, tis, and tis with the lead; the issue's goal is +20%
trained tokens per second at the same max_staleness.

On the H200, from the repository root (Ray, pydantic and their wheels importable, as for
async_vs_sync_gpu.py; no sandboxes, so no bubblewrap):

    python bench/gpu/partial_gpu.py --out "$OUT/partial_rollout_gpu.json"

`--check` resolves each variant's plan, lists what the machine lacks and runs nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.async_vs_sync_gpu import GPU_SETS, RECIPE, stop_code  # noqa: E402 -- after the path fix above
from bench.partial import VARIANTS  # noqa: E402

WHAT = ("partial rollout on one H200: one trainer rank + embedded engine sharing the GPU (gpu_smoke), "
        "the multi-turn turns env (no sandbox)")
DEFAULT_VARIANTS = ("off", "tis", "tis_lead")
# What each --model changes in the gpu_smoke recipe. tiny: its Megatron GLM (MLA + DSA), which the
# engine decodes eagerly (static decode refuses DSA caches); in session 7 its 48-token turns at 24
# decode steps/s left `off` at step 6 of 16 after 510 s. smollm2-135m: full attention, so the
# engine can decode on CUDA graphs (--static-decode-len); the torch trainer, fp32 as gpu_smollm2.
MODEL_SETS = {
    "tiny": (),
    "smollm2-135m": ("model.name=smollm2-135m", "train.backend=torch", "train.dtype=float32",
                     "rollout.embedded.dtype=float32"),
}


def extra_sets(args: argparse.Namespace) -> list[str]:
    """The overrides on top of the workload's: host placement, the model, the engine's decode."""
    sets = [*GPU_SETS, *MODEL_SETS[args.model]]
    if args.static_decode_len:
        sets.append(f"rollout.embedded.static_decode_len={args.static_decode_len}")
    return sets + list(args.set)


def missing() -> list[str]:
    """What this machine lacks, one line each (empty: ready)."""
    out = [f"{m} is not importable: carry its wheel (REFERENCE.md section 8) and set PYTHONPATH"
           for m in ("torch", "ray", "pydantic", "megatron") if importlib.util.find_spec(m) is None]
    if not out:
        import torch

        if not torch.cuda.is_available():
            out.append("no CUDA device: run this on the GPU machine")
    return out


def workload(args: argparse.Namespace):
    from bench.partial import PartialWorkload

    return PartialWorkload(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                           median_turns=args.median_turns, sigma=args.sigma, max_turns=args.max_turns,
                           tokens_per_turn=args.tokens_per_turn, max_staleness=args.max_staleness,
                           in_flight=args.in_flight, partial_lead_steps=args.lead_steps)


def check(args: argparse.Namespace) -> dict:
    from agentrl.config.loader import load_config
    from agentrl.config.plan import resolve_plan
    from bench.partial import overrides

    w = workload(args)
    w.check()
    plans = {}
    for name in args.variant:
        cfg = load_config(RECIPE, overrides(w, name, Path("/tmp/agentrl-partial-gpu") / name) + extra_sets(args))
        plan = resolve_plan(cfg)
        plans[name] = {"model": cfg.model.name, "backend": plan.backend, "engine": plan.engine_kind,
                       "colocated": plan.colocated, "static_decode_len": cfg.rollout.embedded.static_decode_len,
                       "hardware": cfg.cluster.hardware, "partial": cfg.rollout.partial,
                       "stale_tokens": cfg.algorithm.stale_tokens, "lead_steps": cfg.rollout.partial_lead_steps}
    return {"plans": plans, "missing": missing()}


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "partial_rollout_gpu.json")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS),
                    help=f"repeatable (default: {', '.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--median-turns", type=float, default=6.0)
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--max-turns", type=int, default=32)
    ap.add_argument("--tokens-per-turn", type=int, default=48)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--lead-steps", type=int, default=4, help="the *_lead variants' rollout.partial_lead_steps")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", choices=sorted(MODEL_SETS), default="tiny", help="what trainer and engine run")
    ap.add_argument("--static-decode-len", type=int, default=0,
                    help="rollout.embedded.static_decode_len (full-attention models; 0: eager decode)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    ap.add_argument("--check", action="store_true", help="resolve the plans, list what is missing, run nothing")
    args = ap.parse_args(argv)
    args.variant = args.variant or list(DEFAULT_VARIANTS)
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    stop = stop_code(check(args), args.check)
    if stop is not None:
        return stop
    from bench.partial import run_partial_bench

    r = run_partial_bench(args.out, workload(args), variants=tuple(args.variant), repeats=args.repeats,
                          recipe=RECIPE, extra=tuple(extra_sets(args)), what=WHAT)
    print(json.dumps({k: r.get(k) for k in r if k.startswith(("throughput_gain_", "efficiency_gain_", "goal_met"))},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
