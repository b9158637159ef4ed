"""Memory per GPU by role for a resolved plan: the planner's accounting, shown by `train --dry-run`
(agentrl/config/show.py) and used by the capacity benchmark (bench/capacity.py).

From the model's shapes and the plan's layout:
- trainer (Megatron, bf16 weights): non-expert weights / (TP * PP), expert weights / (EP * ETP * PP)
  on the busiest pipeline stage (most layers, plus embedding or LM head); fp32 main gradients of
  the same shard; activations with full recompute = one bf16 hidden state per layer of the stage
  for every micro-batch in flight in 1F1B (PP of them on stage 0) + the working set of the one
  layer being recomputed + one log-prob chunk; optimizer state (fp32 master + 2 moments, 12 B per
  param) on node-local disk when train.optimizer.offload = disk, else in HBM.
- engine (SGLang, FP8 weights, dp-attention): experts split over the engine's GPUs (EP = engine
  size), everything else replicated per GPU; the KV pool is what mem_fraction_static leaves.
Every hardware number is named in HARDWARE.
"""

from __future__ import annotations

from typing import Any

GB = 1e9

# Spec-sheet numbers per GPU (dense bf16, no sparsity). H200's measured GEMM rate on this
# project's machine was 799 TFLOP/s (REFERENCE section 7); the model applies MFU to the spec.
HARDWARE: dict[str, dict[str, float]] = {
    "H200": {"hbm_gb": 141.0, "bf16_tflops": 989.0, "hbm_tbps": 4.8, "nic_gbps": 50.0},
    "B200": {"hbm_gb": 180.0, "bf16_tflops": 2250.0, "hbm_tbps": 8.0, "nic_gbps": 50.0},
    "GB300": {"hbm_gb": 288.0, "bf16_tflops": 2500.0, "hbm_tbps": 8.0, "nic_gbps": 100.0},
}


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
    p = plan.layout
    stage_layers = max(p.pp_split)
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
    gpus = max(int(plan.engines[0].gpus), 1) if plan.engines else 1
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
