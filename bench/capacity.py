"""Capacity model: what a plan needs per GPU, how long a step takes, and how stale samples get.

Memory per GPU by role comes from the planner's accounting (agentrl/config/memory.py).
Step time: training FLOPs (8 x active params per token with full recompute, plus sparse attention)
at an assumed MFU, the optimizer's disk stream at the measured 88% of disk bandwidth, the
weight broadcast, and the loop simulation (loop_sim.py) for sync vs async with an assumed episode
duration distribution. Every hardware number and assumption is named in HARDWARE / Assumptions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from agentrl.config.memory import GB, HARDWARE, engine_memory, param_counts, trainer_memory
from bench.loop_sim import LoopShape, lognormal_draw, simulate, summarize

REFERENCE_STEP_S = 6.5 * 60  # REFERENCE section 1: 100 steps in ~21 h, with an eval every 10 steps
OFFLOAD_STREAM_EFFICIENCY = 0.88  # bench/results/offload_h200.json: 88% of the disk's bandwidth


@dataclass(frozen=True)
class Assumptions:
    """What the model cannot read from the plan. Defaults describe terminal-bench-2 with GLM-5.2."""

    tokens_per_trajectory: int = 24_000  # prompt + 30 turns of command/observation, mean
    mfu: float = 0.25  # Megatron MoE training with EP all-to-all, PP bubbles and recompute
    disk_gbps_per_node: float = 20.0  # node-local NVMe array, read and write
    episode_median_s: float = 300.0  # an agentic episode: sandbox, up to 30 turns, tests (not measured)
    episode_sigma: float = 0.8
    engine_decode_tps: float = 1500.0  # tokens/s one engine generates at the recipe's concurrency
    steps_simulated: int = 50


def train_step_time(cfg: Any, plan: Any, a: Assumptions) -> dict[str, float]:
    """Seconds of one optimizer step on the trainer side: compute, optimizer disk stream, weight sync."""
    from agentrl.models.arch import get_arch
    from agentrl.models.hf_config import _GLM_DIMS

    arch = get_arch(plan.model)
    pc = param_counts(plan.model)
    hw = HARDWARE.get(plan.hardware)
    if hw is None:
        raise ValueError(f"capacity: no hardware numbers for {plan.hardware!r}; known: {', '.join(HARDWARE)}")
    tokens = cfg.algorithm.prompts_per_step * cfg.algorithm.group_size * a.tokens_per_trajectory
    d = _GLM_DIMS.get(plan.model)
    attn = 0.0
    if d:  # sparse MLA in absorbed form: q.k over kv_lora + rope dims, p.v over kv_lora, top-k keys
        keys = min(arch.index_topk, a.tokens_per_trajectory // 2)
        attn = 2 * arch.num_attention_heads * keys * (2 * d["kv_lora_rank"] + d["qk_rope_head_dim"]) * arch.num_layers
    flops = tokens * (8 * (pc["active"] - pc["embedding"] / 2) + 4 * attn)  # fwd 1 + recompute 1 + bwd 2
    compute = flops / (plan.train_gpus * hw["bf16_tflops"] * 1e12 * a.mfu)
    opt_bytes_per_node = 12 * 2 * pc["total"] / max(plan.train_nodes, 1)  # read + write fp32 master, m, v
    optimizer = (opt_bytes_per_node / (a.disk_gbps_per_node * GB * OFFLOAD_STREAM_EFFICIENCY)
                 if cfg.train.optimizer.offload == "disk" else 0.0)
    wbytes = 1 if cfg.rollout.sglang.quantization == "fp8" else 2
    # Anchor (REFERENCE section 7): GLM-5 744B bf16 over NCCL on 16 H100 nodes took 58 s, i.e.
    # 25.7 GB/s aggregate with 50 GB/s NICs; scaled by this hardware's NIC bandwidth.
    sync_gbps = 1.49e12 / 58.0 / GB * hw["nic_gbps"] / 50.0
    sync = pc["total"] * wbytes / (sync_gbps * GB)
    return {"tokens_per_step": tokens, "train_tflop": flops / 1e12, "compute_s": compute, "optimizer_disk_s": optimizer,
            "weight_sync_s": sync, "weight_sync_gbps": sync_gbps, "trainer_step_s": compute + optimizer + sync}


def loop_prediction(cfg: Any, trainer_step_s: float, a: Assumptions, median_s: float | None = None) -> dict:
    """Simulated sync and async step time, idle ratio and staleness with lognormal episodes."""
    alg, buf = cfg.algorithm, cfg.buffer
    shape = LoopShape(alg.prompts_per_step, alg.group_size, buf.max_staleness, buf.max_episodes_in_flight,
                      trainer_step_s, a.steps_simulated)
    med = median_s or a.episode_median_s
    out = {}
    for mode in ("sync", "async"):
        draw = lognormal_draw(med, a.episode_sigma, cfg.agent.episode_timeout_s)
        out[mode] = summarize(simulate(mode, shape, draw), a.steps_simulated)
    out["speedup"] = out["sync"]["wall_s"] / out["async"]["wall_s"]
    return out


def median_matching(cfg: Any, trainer_step_s: float, a: Assumptions, target_step_s: float) -> float | None:
    """The episode median (s) at which the simulated async step equals `target_step_s`, by bisection
    (None when even instant episodes are slower: the trainer alone exceeds the target)."""
    lo, hi = 1.0, cfg.agent.episode_timeout_s
    if loop_prediction(cfg, trainer_step_s, a, lo)["async"]["step_s"] > target_step_s:
        return None
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if loop_prediction(cfg, trainer_step_s, a, mid)["async"]["step_s"] > target_step_s:
            hi = mid
        else:
            lo = mid
    return lo


def plan_capacity(cfg: Any, plan: Any, a: Assumptions = Assumptions()) -> dict:
    """The whole estimate for one plan: memory by role, step time, generation, staleness."""
    mem = {"trainer": trainer_memory(cfg, plan)}
    if plan.engine_kind == "sglang" and plan.engines:
        mem["engine"] = engine_memory(cfg, plan)
    hw = HARDWARE.get(plan.hardware, {})
    for role in mem.values():
        role["fits"] = bool(hw) and role["total_gb"] <= hw["hbm_gb"]
    step = train_step_time(cfg, plan, a)
    loop = loop_prediction(cfg, step["trainer_step_s"], a)
    gen_tokens = cfg.algorithm.prompts_per_step * cfg.algorithm.group_size * a.tokens_per_trajectory * 0.3
    gen_capacity = len(plan.engines) * a.engine_decode_tps
    return {"plan": {"model": plan.model, "hardware": plan.hardware, "nodes": plan.num_nodes,
                     "train_gpus": plan.train_gpus, "engines": len(plan.engines), "layout": plan.layout.to_json(),
                     "max_tokens_per_gpu": plan.max_tokens_per_gpu},
            "assumptions": asdict(a), "params_b": {k: v / 1e9 for k, v in param_counts(plan.model).items()},
            "memory_gb_per_gpu": mem, "step": step, "loop": loop,
            "generation": {"generated_tokens_per_step": gen_tokens, "engine_tokens_per_s": gen_capacity,
                           "generation_bound_step_s": gen_tokens / gen_capacity if gen_capacity else None},
            "reference_step_s": REFERENCE_STEP_S,
            "episode_median_matching_reference_s": median_matching(cfg, step["trainer_step_s"], a, REFERENCE_STEP_S)}
