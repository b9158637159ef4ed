"""Memory per GPU by role for a resolved plan: the one byte accounting used by `train --dry-run`
(agentrl/config/show.py), the capacity benchmark (bench/capacity.py) and the Megatron backend's
own report (MegatronBackend.memory_report, checked against its real tensors by the tests).

Trainer (Megatron backend, per GPU of the busiest pipeline stage; parameter counts from
agentrl/config/model_shapes.py, TP / EP / duplicated / frozen parameters as the backend holds them):
- persistent state, bytes per parameter (`STATE_BYTES`): weights in train.dtype (frozen ones too);
  an fp32 gradient accumulator (main_grad) per trainable param; fp32 masters when the weights are
  not fp32; Adam's two fp32 moments. Masters and moments sit in HBM, or on node-local disk with
  train.optimizer.offload=disk (the disk Adam keeps an fp32 master for every trainable param):
  bf16 + disk = 2 + 4 = 6 B per param in HBM.
- activations with full recompute (`activation_bytes`): one bf16 hidden state per layer of the
  stage for every micro-batch in flight in 1F1B (PP of them on stage 0); the DSA top-k of every
  computing layer of the stage, int64, kept per micro-batch in flight (the index sharing carries
  it to later layers and to the recomputed backward); the working set of the one layer being
  recomputed and differentiated (its saved activations, per token, from the shapes, times
  BACKWARD_WORKING_FACTOR); one log-prob chunk's fp32 logits and their gradient; and, when
  train.dsa_kernels is off, Megatron's unfused DSA attention of the recomputed layer: dense fp32
  scores of [heads / TP, local queries, keys] (and the indexer's dense scorer), DENSE_SCORE_COPIES
  such tensors at once (the kernel switch never builds them). The switch's own backward (the split
  sparse MLA backward's dS / P scratch, at most 1 GiB, and the fp32 key gradient) gets no term: on
  the H200 slice below the peak with it was 19.43 GiB, as before it (19.4; parallel_gpu.json part
  memory_slice_dsa_kernels, session 13), within what layer_working already counts.
Engine (SGLang, FP8 weights, dp-attention): experts split over the engine's GPUs (EP = engine
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


WEIGHT_BYTES = {"bfloat16": 2, "float32": 4}
MAIN_GRAD_BYTES = 4  # fp32 gradient accumulator per trainable param (agentrl.train.grads)
MASTER_BYTES = 4  # fp32 master copy of a trainable param
MOMENT_BYTES = 8  # Adam's exp_avg and exp_avg_sq, fp32
INDEX_BYTES = 8  # the DSA top-k indices are int64
# The peak of a recomputed layer's backward holds its saved activations and, for about as long,
# their gradients: x2 (an assumption; bench/gpu/parallel_gpu.py measures a slice against it).
BACKWARD_WORKING_FACTOR = 2.0


def state_bytes(params: Any, dtype: str, offload: str) -> dict[str, dict[str, float]]:
    """Bytes of the trainer's persistent state for `params` (model_shapes.GpuParams), by place
    ("device", "host", "disk") and kind ("weights", "grads", "masters", "moments")."""
    if dtype not in WEIGHT_BYTES:
        raise ValueError(f"train.dtype={dtype!r}: no byte size known (use one of {', '.join(WEIGHT_BYTES)})")
    out: dict[str, dict[str, float]] = {place: {"weights": 0.0, "grads": 0.0, "masters": 0.0, "moments": 0.0}
                                        for place in ("device", "host", "disk")}
    out["device"]["weights"] = float(params.total * WEIGHT_BYTES[dtype])
    out["device"]["grads"] = float(params.trainable * MAIN_GRAD_BYTES)
    place = {"none": "device", "cpu": "host", "disk": "disk"}[offload]
    if dtype != "float32" or offload == "disk":
        out[place]["masters"] = float(params.trainable * MASTER_BYTES)
    out[place]["moments"] = float(params.trainable * MOMENT_BYTES)
    return out


def layer_activation_bytes_per_token(s: Any, moe: bool, tp: int, etp: int = 1) -> float:
    """Saved activations of one decoder layer per token (bf16), from the shapes: the MLA absorbed
    path (latent projections, per-head absorbed queries and latent outputs), the indexer's queries,
    and the MLP (for MoE: the top-k permuted copies of the hidden state around the expert GEMMs)."""
    h, heads = s.hidden, s.heads
    attn = (2 * h + 2 * s.q_lora + s.kv_lora + (s.kv_lora + s.qk_rope)  # norms, latents, key
            + heads * ((s.qk_nope + s.qk_rope) + (s.kv_lora + s.qk_rope) + s.kv_lora + s.v_head) / tp  # q, absorbed q, out
            + s.index_heads * s.index_dim + s.index_dim)
    if moe:
        k = s.experts_per_token
        mlp = h + k * (2 * h + 4 * s.moe_inter) / etp + s.n_shared * 4 * s.moe_inter / tp
    else:
        mlp = h + 4 * s.dense_inter / tp
    return 2.0 * (attn + mlp)


# Megatron 0.19.2's unfused DSA (train.dsa_kernels off) at peak holds this many fp32 tensors of one
# layer's [heads, queries, keys] scores, the indexer's dense scorer counted in the same unit.
# Measured on an H200 (bench/results/parallel_gpu.json, memory_slice: 2 layers, 64 heads, 7,680
# tokens): peak 119.8 GiB against 21.1 GiB of the other terms, 98.7 GiB = 7.0 x 14.1 GiB.
DENSE_SCORE_COPIES = 7.0


def activation_bytes(s: Any, layers: range, *, tokens: int, tp: int, in_flight: int, chunk: int,
                     last: bool, index_topk: int, fused_logprobs: bool = False, dense_dsa: bool = False,
                     cp: int = 1) -> dict[str, float]:
    """Activation bytes of one GPU of the stage holding `layers` (see the module docstring).
    `fused_logprobs`: the head runs the fused Triton kernel (one GPU with TP 1), which never
    writes logits; otherwise a chunk of fp32 logits and their gradient exist at once.
    `dense_dsa`: Megatron's unfused DSA attention runs (train.dsa_kernels off): the rank's `tokens`
    queries against `tokens * cp` keys."""
    local = tokens / tp  # sequence parallelism splits the hidden states over TP
    computing = sum(1 for i in layers if s.computes_index(i + 1))
    moe_layers = [i >= s.dense_layers for i in layers]
    working = max(layer_activation_bytes_per_token(s, moe, tp) for moe in moe_layers) * tokens
    return {"checkpoints": local * s.hidden * 2 * len(layers) * in_flight,
            "dsa_topk": tokens * min(index_topk, tokens) * INDEX_BYTES * computing * in_flight,
            "layer_working": working * BACKWARD_WORKING_FACTOR,
            "logits": (min(chunk, tokens) * s.vocab / tp * 4 * 2) if last and not fused_logprobs else 0.0,
            # queries: the rank's tokens; keys: gathered over CP (Megatron's all-gather CP path)
            "dense_dsa_scores": (s.heads / tp * tokens * tokens * cp * 4 * DENSE_SCORE_COPIES
                                 if dense_dsa and s.index_heads else 0.0)}


def trainer_memory(cfg: Any, plan: Any) -> dict[str, float]:
    """GB per training GPU on the busiest pipeline stage (the one with the largest total)."""
    from agentrl.config.model_shapes import shapes_of, stage_gpu_params
    from agentrl.models.arch import get_arch

    arch = get_arch(plan.model)
    p = plan.layout
    train = cfg.train
    s = shapes_of(plan.model)
    stages = p.stages()
    best: dict[str, float] = {}
    for i, params in enumerate(stage_gpu_params(s, stages, p.tp, p.ep)):
        state = state_bytes(params, train.dtype, train.optimizer.offload)
        act = activation_bytes(s, stages[i], tokens=plan.max_tokens_per_gpu, tp=p.tp, in_flight=p.pp - i,
                               chunk=train.logprob_chunk_tokens, last=i == len(stages) - 1, index_topk=arch.index_topk,
                               fused_logprobs=p.tp == 1 and bool(plan.gpus_per_rank),
                               dense_dsa=not train.dsa_kernels, cp=p.cp)
        dev = state["device"]
        out = {"weights_gb": dev["weights"] / GB, "grads_gb": dev["grads"] / GB,
               "activations_gb": sum(act.values()) / GB, "optimizer_gb": (dev["masters"] + dev["moments"]) / GB,
               "optimizer_on_disk_gb_per_gpu": (state["disk"]["masters"] + state["disk"]["moments"]) / GB,
               "params_per_gpu_b": params.total / 1e9, "stage": float(i),
               **{f"activations_{k}_gb": v / GB for k, v in act.items()}}
        out["total_gb"] = out["weights_gb"] + out["grads_gb"] + out["activations_gb"] + out["optimizer_gb"]
        if not best or out["total_gb"] > best["total_gb"]:
            best = out
    return best


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
