"""How long one full weight update takes at scale: the capacity model `--dry-run` prints.

What happens (agentrl.sync.update): stages go one after another (an engine takes one update request
at a time); within a stage the sender gathers its tensors (TP shards over NVLink, routed experts
from its EP peers, FP8-quantised by them, over NVLink or its NIC) while it broadcasts earlier
buckets to every engine GPU, so a stage lasts as long as its slowest pipe:
  stage_s = max(broadcast, gather over the NIC, gather over NVLink, FP8 launches) + buckets x overhead
  total_s = sum(stage_s) + PAUSE_S
Every engine GPU receives the whole model (SGLang's update_weights_from_distributed broadcasts
whole tensors to the group; each rank keeps its shard), so the broadcast moves the full model
through one NIC per GPU, at the slowest link of the ring.

Rates (measured, bench/results/megatron.json, two H200s with NVLink): raw NCCL broadcast 360 GB/s,
the exporter's 336.6 GB/s (93.5% of raw); an H200's NVLink is 450 GB/s each way, so a broadcast
gets 80% of a link's nominal rate. Inter-node links get the same 80% x 93.5% of the NIC's rate
(agentrl.config.memory.HARDWARE nic_gbps). FP8 quantisation: 391 GB/s of input, host-bound at
~70 us per tensor launch (the same file). Anchors (REFERENCE.md section 7): GLM-5 744B over NCCL
58 s on 16 H100 nodes (~13 GB/s per receiver for ~0.76 TB of FP8), 8.5 s with RDMA.

Tensor shapes come from agentrl.config.model_shapes (pure arithmetic; `hf_specs` lists the
engines' tensors, checked against the meta model's list in tests), so the dry run stays fast.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from agentrl.sync.buckets import TensorSpec, wire_entries
from agentrl.sync.fp8 import fp8_rule

RAW_BROADCAST_GBPS = 360.1  # measured, two H200s of one host, 256 MiB buckets
EXPORT_GBPS = 336.6  # measured, the BucketStream exporter over the same link (93.5%)
NVLINK_NOMINAL_GBPS = 450.0  # H200 NVLink 4: 900 GB/s both ways
LINK_EFFICIENCY = RAW_BROADCAST_GBPS / NVLINK_NOMINAL_GBPS  # 0.80 of nominal for a raw broadcast
EXPORT_EFFICIENCY = EXPORT_GBPS / RAW_BROADCAST_GBPS  # 0.935
FP8_QUANT_GBPS = 391.0  # measured input rate of kernels/fp8_quant on an H200
FP8_LAUNCH_S = 70e-6  # measured host time per quantised tensor (400 tensors of ~27 MB)
BUCKET_OVERHEAD_S = 2e-3  # assumed: posting a bucket's request and the engines' answers (not measured)
PAUSE_S = 0.5  # assumed: pause (retract), begin, end, continue on every engine (not measured)
GOAL_S = 10.0  # issue 18's target for one full GLM-5.2 update
GB = 1e9


@lru_cache(maxsize=4)
def hf_specs(s: Any) -> tuple[TensorSpec, ...]:
    """The engines' HF tensors of a GLM-MoE-DSA model (agentrl.config.model_shapes.ModelShapes), in
    mapping-rule order, routed experts per expert, MTP layers included, MTP aliases left out."""
    h = s.hidden

    def w(name: str, *shape: int) -> TensorSpec:
        return TensorSpec(name, "bfloat16", tuple(shape))

    def layer(p: str, moe: bool, indexer: bool) -> list[TensorSpec]:
        out = [w(p + "input_layernorm.weight", h), w(p + "self_attn.q_a_proj.weight", s.q_lora, h),
               w(p + "self_attn.q_a_layernorm.weight", s.q_lora),
               w(p + "self_attn.q_b_proj.weight", s.heads * (s.qk_nope + s.qk_rope), s.q_lora),
               w(p + "self_attn.kv_a_proj_with_mqa.weight", s.kv_lora + s.qk_rope, h),
               w(p + "self_attn.kv_a_layernorm.weight", s.kv_lora),
               w(p + "self_attn.kv_b_proj.weight", s.heads * (s.qk_nope + s.v_head), s.kv_lora),
               w(p + "self_attn.o_proj.weight", h, s.heads * s.v_head)]
        if indexer:
            i = p + "self_attn.indexer."
            out += [w(i + "wq_b.weight", s.index_heads * s.index_dim, s.q_lora), w(i + "wk.weight", s.index_dim, h),
                    w(i + "k_norm.weight", s.index_dim), w(i + "k_norm.bias", s.index_dim),
                    w(i + "weights_proj.weight", s.index_heads, h)]
        out.append(w(p + "post_attention_layernorm.weight", h))
        if not moe:
            return out + [w(p + "mlp.gate_proj.weight", s.dense_inter, h), w(p + "mlp.up_proj.weight", s.dense_inter, h),
                          w(p + "mlp.down_proj.weight", h, s.dense_inter)]
        sh = s.n_shared * s.moe_inter
        out += [w(p + "mlp.gate.weight", s.n_experts, h),
                TensorSpec(p + "mlp.gate.e_score_correction_bias", "float32", (s.n_experts,)),
                w(p + "mlp.shared_experts.gate_proj.weight", sh, h), w(p + "mlp.shared_experts.up_proj.weight", sh, h),
                w(p + "mlp.shared_experts.down_proj.weight", h, sh)]
        for e in range(s.n_experts):
            x = f"{p}mlp.experts.{e}."
            out += [w(x + "gate_proj.weight", s.moe_inter, h), w(x + "up_proj.weight", s.moe_inter, h),
                    w(x + "down_proj.weight", h, s.moe_inter)]
        return out

    out = [w("model.embed_tokens.weight", s.vocab, h)]
    for i in range(s.layers):
        out += layer(f"model.layers.{i}.", i >= s.dense_layers, s.computes_index(i + 1))
    out.append(w("model.norm.weight", h))
    if not s.tied:
        out.append(w("lm_head.weight", s.vocab, h))
    for k in range(s.mtp_layers):
        p = f"model.layers.{s.layers + k}."
        out += [w(p + "enorm.weight", h), w(p + "hnorm.weight", h), w(p + "eh_proj.weight", h, 2 * h),
                w(p + "shared_head.norm.weight", h)]
        out += layer(p, s.layers - 1 >= s.dense_layers, s.computes_index(k + 1))
    return tuple(out)


_TP_SHARDED = ("q_b_proj", "kv_b_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "shared_experts",
               "embed_tokens", "lm_head", "eh_proj")


def _stage_of(name: str, stage_starts: list[int], layers: int) -> int:
    if name == "model.embed_tokens.weight":
        return 0
    if not name.startswith("model.layers."):
        return len(stage_starts) - 1
    layer = int(name.split(".")[2])
    if layer >= layers:
        return len(stage_starts) - 1
    return max(i for i, start in enumerate(stage_starts) if start <= layer)


def stage_traffic(specs: tuple[TensorSpec, ...], plan: Any, fp8: bool) -> list[dict[str, float]]:
    """Per stage: bytes on the wire, expert bytes from EP peers (on the sender's node and over its
    NIC), TP-shard bytes gathered, quantised tensors (expert and other)."""
    lay = plan.layout
    starts = [r.start for r in lay.stages()]
    gpn = max(plan.ranks_per_train_node, 1)
    ep_local = min(lay.ep, gpn) if lay.ep > 1 else 1  # EP peers of the sender on its node, itself included
    out = [{"wire_bytes": 0.0, "tensors": 0, "expert_nic_bytes": 0.0, "expert_nvlink_bytes": 0.0,
            "tp_gather_bytes": 0.0, "fp8_expert_tensors": 0, "fp8_other_tensors": 0} for _ in starts]
    for spec in specs:
        st = out[_stage_of(spec.name, starts, lay.num_layers)]
        q = fp8 and fp8_rule(spec)
        wire = sum(e.nbytes for e in wire_entries(spec, q))
        st["wire_bytes"] += wire
        st["tensors"] += 1
        if ".mlp.experts." in spec.name:
            st["expert_nvlink_bytes"] += wire * (ep_local - 1) / lay.ep
            st["expert_nic_bytes"] += wire * (lay.ep - ep_local) / lay.ep
            st["fp8_expert_tensors"] += int(q)
        else:
            if lay.tp > 1 and any(k in spec.name for k in _TP_SHARDED):
                st["tp_gather_bytes"] += spec.nbytes * (lay.tp - 1) / lay.tp
            st["fp8_other_tensors"] += int(q)
    return out


def predict_update(plan: Any, *, fp8: bool, bucket_bytes: int = 256 << 20) -> dict[str, Any]:
    """Predicted seconds of one full update of `plan`'s model to its engines (module docstring)."""
    from agentrl.config.memory import HARDWARE
    from agentrl.config.model_shapes import shapes_of

    hw = HARDWARE.get(plan.hardware)
    if not hw:
        raise ValueError(f"cluster.hardware={plan.hardware}: no link rates for it")
    nic = hw["nic_gbps"] * LINK_EFFICIENCY * EXPORT_EFFICIENCY * GB
    nvlink = EXPORT_GBPS * GB
    across_nodes = plan.engine_kind == "sglang" and not plan.colocated and plan.num_nodes > 1
    bcast = nic if across_nodes else nvlink
    stages = []
    for i, t in enumerate(stage_traffic(hf_specs(shapes_of(plan.model)), plan, fp8)):
        quant = (t["fp8_expert_tensors"] / max(plan.layout.ep, 1) + t["fp8_other_tensors"]) * FP8_LAUNCH_S
        parts = {"broadcast_s": t["wire_bytes"] / bcast, "gather_nic_s": t["expert_nic_bytes"] / nic,
                 "gather_nvlink_s": (t["expert_nvlink_bytes"] + t["tp_gather_bytes"]) / nvlink, "fp8_launch_s": quant}
        buckets = -(-int(t["wire_bytes"]) // bucket_bytes)
        total = max(parts.values()) + buckets * BUCKET_OVERHEAD_S + bucket_bytes / bcast  # + the pipeline's fill
        stages.append({"stage": i, "layers": len(plan.layout.stages()[i]), "tensors": t["tensors"],
                       "gb": t["wire_bytes"] / GB, "buckets": buckets, **parts, "seconds": total,
                       "dominant": max(parts, key=parts.get).removesuffix("_s")})
    total = sum(s["seconds"] for s in stages) + PAUSE_S
    return {"fp8": fp8, "seconds": total, "goal_s": GOAL_S, "meets_goal": total <= GOAL_S,
            "gb_per_engine_gpu": sum(s["gb"] for s in stages), "broadcast_gbps": bcast / GB,
            "link": "inter-node NIC" if across_nodes else "NVLink", "stages": stages}


def update_estimate(cfg: Any, plan: Any) -> dict[str, Any]:
    """The dry run's view: the configured precision and the other one; {"unavailable": why} when the
    model has no GLM shapes or the plan no hardware rates."""
    try:
        mine = bool(cfg.rollout.weight_sync_fp8)
        bucket = cfg.rollout.weight_bucket_mb << 20
        return {"configured": predict_update(plan, fp8=mine, bucket_bytes=bucket),
                "other": predict_update(plan, fp8=not mine, bucket_bytes=bucket)}
    except (KeyError, ValueError) as err:
        return {"unavailable": str(err)}
