"""Capacity model: what a plan needs per GPU, how long a step takes, and how stale samples get.

Memory per GPU by role, from the model's shapes and the plan's layout:
- trainer (Megatron, bf16 weights): non-expert weights / (TP * PP), expert weights / (EP * ETP * PP)
  on the busiest pipeline stage (most layers, plus embedding or LM head); fp32 main gradients of
  the same shard; activations with full recompute = one bf16 hidden state per layer of the stage
  for every micro-batch in flight in 1F1B (PP of them on stage 0) + the working set of the one
  layer being recomputed + one log-prob chunk; optimizer state (fp32 master + 2 moments, 12 B per
  param) on node-local disk when train.optimizer.offload = disk, else in HBM.
- engine (SGLang, FP8 weights, dp-attention): experts split over the engine's GPUs (EP = engine
  size), everything else replicated per GPU; the KV pool is what mem_fraction_static leaves.
Step time: training FLOPs (8 x active params per token with full recompute, plus sparse attention)
at an assumed MFU, the optimizer's disk stream at the measured 88% of disk bandwidth, the
weight broadcast, and the loop simulation (loop_sim.py) for sync vs async with an assumed episode
duration distribution. Every hardware number and assumption is named in HARDWARE / Assumptions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from agentrl.bench.loop_sim import LoopShape, lognormal_draw, simulate, summarize

GB = 1e9

# Spec-sheet numbers per GPU (dense bf16, no sparsity). H200's measured GEMM rate on this
# project's machine was 799 TFLOP/s (REFERENCE section 7); the model applies MFU to the spec.
HARDWARE: dict[str, dict[str, float]] = {
    "H200": {"hbm_gb": 141.0, "bf16_tflops": 989.0, "hbm_tbps": 4.8, "nic_gbps": 50.0},
    "B200": {"hbm_gb": 180.0, "bf16_tflops": 2250.0, "hbm_tbps": 8.0, "nic_gbps": 50.0},
    "GB300": {"hbm_gb": 288.0, "bf16_tflops": 2500.0, "hbm_tbps": 8.0, "nic_gbps": 100.0},
}
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


def param_counts(model: str) -> dict[str, float]:
    """Parameters of a named model (MTP layer excluded): `expert` (routed experts), `dense`
    (everything else, embeddings included), `embedding` (input + output), `active`, `total`."""
    from agentrl.models.arch import get_arch
    from agentrl.models.hf_config import _GLM_DIMS

    arch = get_arch(model)
    h, v = arch.hidden_size, arch.vocab_size
    if not arch.has_dsa:  # a dense causal LM: no expert split
        total = (arch.total_params_b or 0.0) * 1e9
        emb = h * v
        return {"expert": 0.0, "dense": total, "embedding": emb, "active": total, "total": total}
    d = _GLM_DIMS[model]
    heads, ql, kvl = arch.num_attention_heads, d["q_lora_rank"], d["kv_lora_rank"]
    qk, rope, vd = d["qk_nope_head_dim"] + d["qk_rope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    attn = h * ql + ql * heads * qk + h * (kvl + rope) + kvl * heads * (d["qk_nope_head_dim"] + vd) + heads * vd * h
    indexer = ql * d["index_n_heads"] * d["index_head_dim"] + h * d["index_head_dim"] + h * d["index_n_heads"]
    expert_one = 3 * h * arch.moe_intermediate_size
    moe_layers = arch.num_layers - arch.num_dense_layers
    dense_mlp = 3 * h * arch.dense_intermediate_size
    shared = d.get("n_shared_experts", 1) * expert_one
    router = arch.n_routed_experts * h
    emb = 2 * h * v
    expert = moe_layers * arch.n_routed_experts * expert_one
    # Indexer weights exist only in the layers that compute their own top-k (21 of GLM-5.2's 78).
    dense = (arch.num_layers * attn + len(arch.computing_layers()) * indexer + arch.num_dense_layers * dense_mlp
             + moe_layers * (shared + router) + emb)
    active = dense + moe_layers * arch.experts_per_token * expert_one
    return {"expert": float(expert), "dense": float(dense), "embedding": float(emb), "active": float(active),
            "total": float(expert + dense)}


def trainer_memory(cfg: Any, plan: Any) -> dict[str, float]:
    """GB per training GPU on the busiest pipeline stage."""
    from agentrl.models.arch import get_arch

    arch = get_arch(plan.model)
    pc = param_counts(plan.model)
    p = plan.parallel
    stage_layers = max(plan.pp_layer_split) if plan.pp_layer_split else arch.num_layers
    frac = stage_layers / arch.num_layers
    dense_shard = (pc["dense"] - pc["embedding"]) * frac / p.tp + pc["embedding"] / 2 / p.tp
    expert_shard = pc["expert"] * frac / (p.ep * p.etp)
    params = dense_shard + expert_shard
    tokens = plan.max_tokens_per_gpu
    hidden_bytes = tokens * arch.hidden_size * 2 / p.tp  # sequence parallel splits it by TP
    checkpoints = hidden_bytes * stage_layers * p.pp  # 1F1B: stage 0 holds PP micro-batches
    working = hidden_bytes * 24 + tokens * arch.experts_per_token * arch.moe_intermediate_size * 2 * 3 / max(p.etp, 1)
    chunk = min(cfg.train.logprob_chunk_tokens, tokens)
    logits = chunk * arch.vocab_size / p.tp * 4 * 2  # fp32 logits and their gradient
    on_disk = cfg.train.optimizer.offload == "disk"
    out = {"weights_gb": params * 2 / GB, "grads_gb": params * 4 / GB,
           "activations_gb": (checkpoints + working + logits) / GB,
           "optimizer_gb": 0.0 if on_disk else params * 12 / GB,
           "optimizer_on_disk_gb_per_gpu": params * 12 / GB if on_disk else 0.0, "params_per_gpu_b": params / 1e9}
    out["total_gb"] = out["weights_gb"] + out["grads_gb"] + out["activations_gb"] + out["optimizer_gb"]
    return out


def engine_memory(cfg: Any, plan: Any) -> dict[str, float]:
    """GB per inference GPU of one engine: FP8 (or bf16) weights and the KV pool left over."""
    from agentrl.models.arch import get_arch
    from agentrl.models.hf_config import _GLM_DIMS

    arch = get_arch(plan.model)
    pc = param_counts(plan.model)
    gpus = max(plan.engines[0].gpus, 1) if plan.engines else 1
    sg = cfg.rollout.sglang
    wbytes = 1 if sg.quantization == "fp8" else 2
    weights = (pc["expert"] / gpus + (pc["dense"] - pc["embedding"])) * wbytes + pc["embedding"] * 2
    hbm = HARDWARE.get(plan.hardware, {}).get("hbm_gb", 0.0) * GB
    pool = max(hbm * sg.mem_fraction_static - weights, 0.0)
    d = _GLM_DIMS.get(plan.model)
    kv_dtype = 1 if "fp8" in (sg.kv_cache_dtype or "") else 2
    per_token = arch.num_layers * ((d["kv_lora_rank"] + d["qk_rope_head_dim"] + d["index_head_dim"]) * kv_dtype
                                   if d else 2 * arch.hidden_size * 2)
    return {"weights_gb": weights / GB, "kv_pool_gb": pool / GB, "kv_bytes_per_token": per_token,
            "kv_tokens_per_gpu": pool / per_token if per_token else 0.0,
            "total_gb": (weights + pool) / GB, "hbm_gb": hbm / GB}


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
                     "train_gpus": plan.train_gpus, "engines": len(plan.engines), "parallel": asdict(plan.parallel),
                     "pp_layer_split": plan.pp_layer_split, "max_tokens_per_gpu": plan.max_tokens_per_gpu},
            "assumptions": asdict(a), "params_b": {k: v / 1e9 for k, v in param_counts(plan.model).items()},
            "memory_gb_per_gpu": mem, "step": step, "loop": loop,
            "generation": {"generated_tokens_per_step": gen_tokens, "engine_tokens_per_s": gen_capacity,
                           "generation_bound_step_s": gen_tokens / gen_capacity if gen_capacity else None},
            "reference_step_s": REFERENCE_STEP_S,
            "episode_median_matching_reference_s": median_matching(cfg, step["trainer_step_s"], a, REFERENCE_STEP_S)}


def memory_rows(cfg: Any, plan: Any) -> list[tuple[str, str, str, str, str, str, str]]:
    """(role, weights, grads, activations, optimizer, KV pool, total) in GB per GPU, for --dry-run."""
    def gb(x: float) -> str:
        return f"{x:.1f}" if x >= 1 else f"{x:.4f}"

    rows = []
    t = trainer_memory(cfg, plan)
    opt = gb(t["optimizer_gb"]) if t["optimizer_gb"] else f"on disk: {gb(t['optimizer_on_disk_gb_per_gpu'])}"
    rows.append(("trainer", gb(t["weights_gb"]), gb(t["grads_gb"]), gb(t["activations_gb"]), opt, "-", gb(t["total_gb"])))
    if plan.engine_kind == "sglang" and plan.engines:
        e = engine_memory(cfg, plan)
        rows.append(("engine", gb(e["weights_gb"]), "-", "-", "-", gb(e["kv_pool_gb"]), gb(e["total_gb"])))
    return rows
